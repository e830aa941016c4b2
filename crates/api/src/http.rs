//! Bounds of the HTTP surface that are not the server's (see `server` for those): the
//! per-principal request rate, how long a request body may take to arrive, how long a
//! request may run, and the metrics token.

use std::num::NonZeroU32;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use domain::{ErrorCode, Secret};
use engine::credentials::TokenDigest;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};

use crate::AppState;
use crate::problem::ApiError;

/// What `stockd serve` configures; the defaults suit one shop's traffic on one node.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Requests one principal may send per second, sustained (a fraction for fewer
    /// than one a second); 0 turns the limit off.
    pub rate_limit_requests_per_second: f64,
    /// Requests one principal may send in a burst above the sustained rate.
    pub rate_limit_burst: u32,
    /// Longest wait for a request's body, from its headers on.
    pub body_read_timeout_milliseconds: u64,
    /// Longest a request may run before it is answered 503 (its outcome then unknown:
    /// retry with the same key). Longer than the gateway's timeout, so a payment's
    /// answer is never cut off by it.
    pub request_timeout_milliseconds: u64,
    /// A token that may read `/metrics` and nothing else (`STOCKD_METRICS_TOKEN`).
    pub metrics_token: Option<Secret>,
}

impl Default for HttpConfig {
    fn default() -> HttpConfig {
        HttpConfig {
            rate_limit_requests_per_second: 20_000.0,
            rate_limit_burst: 40_000,
            body_read_timeout_milliseconds: 10_000,
            request_timeout_milliseconds: 30_000,
            metrics_token: None,
        }
    }
}

/// The bounds in force, shared by every request.
pub struct HttpLimits {
    rate: Option<DefaultKeyedRateLimiter<TokenDigest>>,
    pub body_read_timeout: Duration,
    pub request_timeout: Duration,
    pub metrics_token_hash: Option<Vec<u8>>,
}

impl HttpLimits {
    pub fn new(config: &HttpConfig) -> HttpLimits {
        let per_second = config.rate_limit_requests_per_second;
        let rate = (per_second.is_finite() && per_second > 0.0)
            .then(|| Duration::from_secs_f64((1.0 / per_second).min(86_400.0)))
            .and_then(|interval| Quota::with_period(interval.max(Duration::from_nanos(1))))
            .map(|quota| {
                let burst = NonZeroU32::new(config.rate_limit_burst).unwrap_or(NonZeroU32::MIN);
                RateLimiter::keyed(quota.allow_burst(burst))
            });
        HttpLimits {
            rate,
            body_read_timeout: Duration::from_millis(config.body_read_timeout_milliseconds.max(1)),
            request_timeout: Duration::from_millis(config.request_timeout_milliseconds.max(1)),
            metrics_token_hash: config
                .metrics_token
                .as_ref()
                .filter(|token| !token.is_empty())
                .map(|token| Sha256::digest(token.expose().as_bytes()).to_vec()),
        }
    }

    /// Counts one request of the credential with this digest against its rate: 429
    /// `rate_limited` with the seconds until it may send again, when over.
    pub fn admit(&self, credential: &TokenDigest) -> Result<(), ApiError> {
        let Some(rate) = &self.rate else {
            return Ok(());
        };
        rate.check_key(credential).map_err(|not_until| {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            ApiError::new(
                ErrorCode::RateLimited,
                "this credential sent more requests than its rate allows; retry after the pause",
            )
            .retry_after(wait.as_secs() + u64::from(wait.subsec_nanos() > 0))
        })
    }

    /// Forgets principals that have not sent anything lately (their buckets are full
    /// again), so the limiter's memory follows the credentials in use.
    pub fn forget_idle(&self) {
        if let Some(rate) = &self.rate {
            rate.retain_recent();
            rate.shrink_to_fit();
        }
    }
}

/// Answers 503 `unavailable` when a request runs past its bound. The work it started
/// may still complete (a reservation in a batch, a payment at the gateway), so the
/// answer says to retry with the same key, which then finds the stored outcome.
pub async fn bound_request_duration(
    state: &AppState,
    running: impl Future<Output = Response>,
) -> Response {
    let bound = state.http.request_timeout;
    match tokio::time::timeout(bound, running).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "the request did not finish within {} ms; its outcome is not known: retry with the same Idempotency-Key",
                bound.as_millis()
            ),
        )
        .into_response(),
    }
}

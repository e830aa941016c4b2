//! Prometheus metrics: request latency histograms per route (with buckets, so p95 and
//! p99 can be computed), outcomes by error code, and gauges read at scrape time.

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};
use std::time::{Duration, Instant};

use ::metrics::{Counter, Gauge, Histogram};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::AppState;
use crate::problem::OutcomeCode;

/// Latency buckets in seconds: fine below 10 ms where a healthy hot path lives, coarse
/// up to the 30 s statement timeout.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// Reservations per combiner batch: one (a quiet moment) up to the default bound of 256.
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// How often the recorder's histograms are drained when nobody scrapes them.
const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Counters of rare events an alert reads with `increase()`, shown at 0 from the
/// start: Prometheus sees no increase in a series whose first sample is already 1, so
/// the first event in a process, often the only one, would never alert. (Labelled
/// ones cannot be listed here; their alerts also count a series new in the window,
/// deploy/prometheus/alerts.yml.)
pub const ALERTED_EVENT_COUNTERS: &[&str] = &[
    "stockd_reservations_expiry_failed_total",
    "stockd_outbox_events_skipped_total",
];

/// Installs the process-wide recorder once; later calls return the same handle.
pub fn install_recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".to_owned()),
                    LATENCY_BUCKETS_SECONDS,
                )
                .expect("bucket list is non-empty")
                .set_buckets_for_metric(
                    Matcher::Full("stockd_combiner_batch_size".to_owned()),
                    BATCH_SIZE_BUCKETS,
                )
                .expect("bucket list is non-empty")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (a test binary that built one
            // itself); then this handle renders nothing, which tests would notice.
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            for name in ALERTED_EVENT_COUNTERS {
                ::metrics::counter!(*name).increment(0);
            }
            // `build_recorder` starts no upkeep: a histogram's samples pile up until a
            // scrape drains them, so with nobody scraping (no Prometheus yet, a wrong
            // metrics token) every request's samples stayed in memory for good.
            let upkept = handle.clone();
            let upkeep = std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(METRICS_UPKEEP_INTERVAL);
                        upkept.run_upkeep();
                    }
                });
            if let Err(error) = upkeep {
                tracing::warn!(%error, "no metrics upkeep thread: histograms drain only when scraped");
            }
            handle
        })
        .clone()
}

/// The handles of the per-request series, registered once each.
///
/// `metrics`' macros look a series up in the registry by its labels on every call,
/// building the labels' strings first: four lookups and five allocations per request,
/// about 3 % of a sold-out answer's CPU (docs/BENCHMARKS.md, twenty-third session).
/// Each handle is registered at its first use, by a request, so it is the recorder's
/// installed by then (an `AppState` built before `install_recorder` still counts).
pub struct RequestMetrics {
    in_progress: OnceLock<Gauge>,
    /// By route template, then by (method, status, code). Bounded: the routes are the
    /// router's templates and `unmatched`, the methods [`method_label`]'s, the statuses
    /// and codes the handlers' own.
    series: RwLock<HashMap<Box<str>, HashMap<SeriesKey, Series>>>,
}

type SeriesKey = (&'static str, u16, &'static str);

#[derive(Clone)]
struct Series {
    duration: Histogram,
    responses: Counter,
}

impl Series {
    fn record(&self, elapsed_seconds: f64) {
        self.duration.record(elapsed_seconds);
        self.responses.increment(1);
    }
}

impl RequestMetrics {
    pub fn new() -> RequestMetrics {
        RequestMetrics {
            in_progress: OnceLock::new(),
            series: RwLock::new(HashMap::new()),
        }
    }

    fn in_progress(&self) -> &Gauge {
        self.in_progress
            .get_or_init(|| ::metrics::gauge!("stockd_requests_in_progress"))
    }

    /// Records one answer in its series, registering the series the first time.
    fn record(&self, route: &str, key: SeriesKey, elapsed_seconds: f64) {
        {
            let known = self
                .series
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(series) = known.get(route).and_then(|by_outcome| by_outcome.get(&key)) {
                return series.record(elapsed_seconds);
            }
        }
        self.register(route, key).record(elapsed_seconds);
    }

    /// Two requests may register the same series at once: the recorder hands both the
    /// same storage, so either handle counts.
    #[cold]
    fn register(&self, route: &str, key: SeriesKey) -> Series {
        let (method, status, code) = key;
        let series = Series {
            duration: ::metrics::histogram!(
                "stockd_http_request_duration_seconds",
                "route" => route.to_owned(),
                "method" => method
            ),
            responses: ::metrics::counter!(
                "stockd_http_responses_total",
                "route" => route.to_owned(),
                "method" => method,
                "status" => status.to_string(),
                "code" => code
            ),
        };
        self.series
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(route.into())
            .or_default()
            .insert(key, series.clone());
        series
    }
}

impl Default for RequestMetrics {
    fn default() -> RequestMetrics {
        RequestMetrics::new()
    }
}

/// The `method` label: the methods of RFC 9110 and `PATCH` by name, any other `other`,
/// so a client inventing methods cannot add series without bound.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => "other",
    }
}

/// Records every request's latency and outcome, labelled by route template (never the
/// raw path, so SKU codes do not explode label cardinality), and logs it at `debug`.
///
/// The outermost part of `crate::each_request`. tower-http's `TraceLayer` did the same
/// logging with a span per request and cost 3–6 % of the hot path's throughput even
/// with `debug` off (docs/BENCHMARKS.md); a disabled `debug!` costs a branch.
pub async fn track<Run, Ran>(metrics: &RequestMetrics, request: Request, run: Run) -> Response
where
    Run: FnOnce(Request) -> Ran,
    Ran: Future<Output = Response>,
{
    let route = request.extensions().get::<MatchedPath>().cloned();
    let route = route.as_ref().map_or("unmatched", MatchedPath::as_str);
    let method = method_label(request.method());
    let started = Instant::now();
    let in_progress = InProgress::start(metrics.in_progress());
    // A handler that panics is answered 500 here, inside the recording, so it is
    // counted like any 500 (the router's own panic layer, outside, answered it too,
    // but after this had unwound without recording anything).
    let response =
        futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(run(request)))
            .await
            .unwrap_or_else(crate::panic_response);
    drop(in_progress);
    let elapsed = started.elapsed().as_secs_f64();
    let status = response.status().as_u16();
    let code = response
        .extensions()
        .get::<OutcomeCode>()
        .map_or("none", |outcome| outcome.0.as_str());
    tracing::debug!(
        method = %method,
        route = %route,
        status = %status,
        code,
        elapsed_milliseconds = elapsed * 1_000.0,
        "request"
    );
    metrics.record(route, (method, status, code), elapsed);
    response
}

/// Counts a request in `stockd_requests_in_progress` until dropped (also when the
/// request is cancelled: a client that went away).
struct InProgress<'a>(&'a Gauge);

impl InProgress<'_> {
    fn start(gauge: &Gauge) -> InProgress<'_> {
        gauge.increment(1.0);
        InProgress(gauge)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// Longest a scrape waits for each gauge that reads the database.
const GAUGE_QUERY_TIMEOUT_MILLISECONDS: u64 = 1_000;

/// Prometheus metrics
///
/// docs/OPERATIONS.md lists them with their alerts.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    operation_id = "metrics",
    responses((status = 200, description = "The metrics in Prometheus's text format", body = String, content_type = "text/plain"))
)]
pub async fn render(
    State(state): State<AppState>,
    crate::extract::MetricsReader(shop): crate::extract::MetricsReader,
) -> Response {
    // First, before the gauges that need a connection: a scrape that waits for one
    // would report the pool after the wait.
    state.engine.pool_gauges();
    // The gauges that need a database connection wait at most this long for it, so a
    // scrape still answers (with the last values of those) while the pool is exhausted.
    let bounded = Duration::from_millis(GAUGE_QUERY_TIMEOUT_MILLISECONDS);
    if let Ok(Ok(gauges)) = tokio::time::timeout(bounded, state.engine.gauges()).await {
        metrics::gauge!("stockd_reservations", "status" => "RESERVED").set(gauges.reserved as f64);
        metrics::gauge!("stockd_expiry_backlog").set(gauges.expired_backlog as f64);
    }
    if state.engine.payments_attached()
        && let Ok(Ok(payments)) = tokio::time::timeout(bounded, state.engine.payment_gauges()).await
    {
        metrics::gauge!("stockd_payment_attempts_unresolved")
            .set(payments.attempts_unresolved as f64);
        metrics::gauge!("stockd_payment_oldest_unresolved_age_seconds")
            .set(payments.oldest_unresolved_age_seconds as f64);
        metrics::gauge!("stockd_refunds_pending").set(payments.refunds_pending as f64);
        metrics::gauge!("stockd_refunds_failed").set(payments.refunds_failed as f64);
    }
    metrics::gauge!("stockd_requests_in_flight").set(state.engine.requests_in_flight() as f64);
    let mut body = state
        .metrics
        .as_ref()
        .map_or_else(String::new, PrometheusHandle::render);
    // Rendered here rather than registered: only the current top SKUs are labels, so
    // a SKU that cools down leaves the page instead of staying forever.
    body.push_str(&engine::duplicates::render_hot_skus(
        &state
            .engine
            .hot_duplicate_skus_of(shop.as_ref(), engine::duplicates::HOT_SKUS_EXPORTED)
            .await,
    ));
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn a_handler_with_a_bug(_request: Request) -> Response {
        panic!("a handler's bug")
    }

    /// Found in review: a handler that panicked was answered 500 by the router's panic
    /// layer, outside the recording, which had unwound first: the 500 never reached
    /// `stockd_http_responses_total`, and an alert on 5xx missed it.
    #[test]
    fn a_handler_that_panics_is_answered_500_and_counted() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let page = recorder.handle();
        let metrics = RequestMetrics::new();

        let response = ::metrics::with_local_recorder(&recorder, || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(track(
                    &metrics,
                    Request::new(axum::body::Body::empty()),
                    a_handler_with_a_bug,
                ))
        });

        assert_eq!(
            response.status(),
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        );
        let page = page.render();
        assert!(
            page.lines()
                .any(|line| line.starts_with("stockd_http_responses_total")
                    && line.contains("status=\"500\"")
                    && line.ends_with(" 1")),
            "{page}"
        );
    }
}

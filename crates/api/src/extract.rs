//! Extractors that turn a raw request into validated values, answering every failure
//! with a problem document instead of axum's plain-text rejections.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use domain::IdempotencyKey;
use domain::limits::REQUEST_BODY_BYTES_MAX;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use store::IdempotencyClaim;

use crate::AppState;
use crate::problem::ApiError;

/// The `Idempotency-Key` header every mutating call must carry.
pub struct RequiredIdempotencyKey(pub IdempotencyKey);

impl<S: Send + Sync> FromRequestParts<S> for RequiredIdempotencyKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let mut values = parts.headers.get_all("idempotency-key").iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return Err(ApiError::invalid(
                "exactly one Idempotency-Key header is required on this call",
            ));
        };
        let text = value
            .to_str()
            .map_err(|_| ApiError::invalid("Idempotency-Key must be visible ASCII"))?;
        IdempotencyKey::parse(text)
            .map(RequiredIdempotencyKey)
            .map_err(|error| ApiError::invalid(error.0))
    }
}

/// A JSON body parsed into `T`, with the request's fingerprint for idempotency.
///
/// The body must be `application/json`, at most [`REQUEST_BODY_BYTES_MAX`] bytes, and
/// match `T` exactly (unknown fields are refused). The fingerprint hashes the method,
/// the path and the canonical form of the JSON (keys sorted, whitespace dropped), so a
/// retry that re-serializes the same document still matches.
pub struct JsonBody<T> {
    pub value: T,
    fingerprint: String,
}

impl<T> JsonBody<T> {
    pub fn claim(&self, key: RequiredIdempotencyKey) -> IdempotencyClaim {
        IdempotencyClaim {
            key: key.0,
            fingerprint: self.fingerprint.clone(),
        }
    }
}

impl<T: DeserializeOwned + Default> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request<Body>, _state: &AppState) -> Result<Self, ApiError> {
        let (value, fingerprint) = parse_json_body(request).await?;
        Ok(JsonBody {
            value: value.unwrap_or_default(),
            fingerprint,
        })
    }
}

/// Like [`JsonBody`] but the body may not be empty.
pub struct RequiredJsonBody<T>(pub JsonBody<T>);

impl<T: DeserializeOwned> FromRequest<AppState> for RequiredJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request<Body>, _state: &AppState) -> Result<Self, ApiError> {
        let (value, fingerprint) = parse_json_body(request).await?;
        let value = value.ok_or_else(|| ApiError::invalid("a JSON request body is required"))?;
        Ok(RequiredJsonBody(JsonBody { value, fingerprint }))
    }
}

/// Parses the body; `None` when it is empty. Returns the request's fingerprint too.
/// A request body, read no further than [`REQUEST_BODY_BYTES_MAX`]: a longer one is
/// refused with 413 as soon as the limit is passed, never buffered whole.
pub async fn read_body(body: Body) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, REQUEST_BODY_BYTES_MAX)
        .await
        .map_err(|_| {
            ApiError::invalid(format!(
                "request body is larger than {REQUEST_BODY_BYTES_MAX} bytes"
            ))
            .with_status(StatusCode::PAYLOAD_TOO_LARGE)
        })
}

async fn parse_json_body<T: DeserializeOwned>(
    request: Request<Body>,
) -> Result<(Option<T>, String), ApiError> {
    let method = request.method().as_str().to_owned();
    let path = request.uri().path().to_owned();
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(|value| {
            value
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        });
    let bytes = read_body(request.into_body()).await?;
    if bytes.is_empty() {
        return Ok((None, fingerprint(&method, &path, "")));
    }
    if content_type.as_deref() != Some("application/json") {
        return Err(ApiError::invalid("Content-Type must be application/json")
            .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE));
    }
    let canonical: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|error| ApiError::invalid(format!("request body is not valid JSON: {error}")))?;
    let value: T = serde_path_to_error::deserialize(&canonical).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if path == "." {
            ApiError::invalid(inner.to_string())
        } else {
            ApiError::invalid(format!("{path}: {inner}"))
        }
    })?;
    // serde_json's map is ordered by key, so this is a canonical form of the document.
    let canonical_text = serde_json::to_string(&canonical).unwrap_or_default();
    Ok((Some(value), fingerprint(&method, &path, &canonical_text)))
}

fn fingerprint(method: &str, path: &str, canonical_body: &str) -> String {
    let mut hasher = Sha256::new();
    for part in [method, "\n", path, "\n", canonical_body] {
        hasher.update(part.as_bytes());
    }
    domain::lower_hex(&hasher.finalize())
}

/// The bearer token of admin calls.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let presented = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .unwrap_or("");
        if constant_time_equal(presented.as_bytes(), state.admin_token.as_bytes()) {
            Ok(Admin)
        } else {
            Err(ApiError::new(
                domain::ErrorCode::Unauthorized,
                "this call needs 'Authorization: Bearer <admin token>'",
            ))
        }
    }
}

/// Compares without an early exit, so response time does not reveal how much of a
/// guessed token was right.
pub fn constant_time_equal(left: &[u8], right: &[u8]) -> bool {
    if left.len() != right.len() || right.is_empty() {
        return false;
    }
    left.iter()
        .zip(right)
        .fold(0_u8, |difference, (a, b)| difference | (a ^ b))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_differ_by_method_path_and_body() {
        let base = fingerprint("POST", "/v1/reservations", "{\"a\":1}");
        assert_eq!(base.len(), 64);
        assert_ne!(base, fingerprint("PUT", "/v1/reservations", "{\"a\":1}"));
        assert_ne!(base, fingerprint("POST", "/v1/reservation", "{\"a\":1}"));
        assert_ne!(base, fingerprint("POST", "/v1/reservations", "{\"a\":2}"));
    }

    #[test]
    fn token_comparison_needs_an_exact_non_empty_match() {
        assert!(constant_time_equal(b"secret", b"secret"));
        assert!(!constant_time_equal(b"secreT", b"secret"));
        assert!(!constant_time_equal(b"secret-longer", b"secret"));
        assert!(!constant_time_equal(b"", b""));
    }
}

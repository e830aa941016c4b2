//! Extractors that turn a raw request into validated values, answering every failure
//! with a problem document instead of axum's plain-text rejections.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use domain::limits::REQUEST_BODY_BYTES_MAX;
use domain::{Action, ErrorCode, IdempotencyKey, Principal, authorize};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use store::{IdempotencyClaim, ScopedKey};

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
    /// The request's claim on its key, in the caller's own key space.
    pub fn claim(&self, caller: &Principal, key: RequiredIdempotencyKey) -> IdempotencyClaim {
        IdempotencyClaim {
            key: ScopedKey::new(caller, &key.0),
            fingerprint: self.fingerprint.clone(),
        }
    }
}

impl<T: DeserializeOwned + Default> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request<Body>, state: &AppState) -> Result<Self, ApiError> {
        let (value, fingerprint) = parse_json_body(request, state).await?;
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

    async fn from_request(request: Request<Body>, state: &AppState) -> Result<Self, ApiError> {
        let (value, fingerprint) = parse_json_body(request, state).await?;
        let value = value.ok_or_else(|| ApiError::invalid("a JSON request body is required"))?;
        Ok(RequiredJsonBody(JsonBody { value, fingerprint }))
    }
}

/// A request body, read no further than [`REQUEST_BODY_BYTES_MAX`] and for no longer
/// than the state's body-read bound: a longer one is refused with 413 as soon as the
/// limit is passed, never buffered whole; a slow one with 408, and its connection
/// closed.
pub async fn read_body(body: Body, state: &AppState) -> Result<axum::body::Bytes, ApiError> {
    let bound = state.http.body_read_timeout;
    match tokio::time::timeout(bound, axum::body::to_bytes(body, REQUEST_BODY_BYTES_MAX)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        // Only the limit's own error is a body too large: a body the client broke off
        // or sent malformed (a bad chunk) is a bad request, counted as one.
        Ok(Err(error)) if is_length_limit(&error) => Err(ApiError::invalid(format!(
            "request body is larger than {REQUEST_BODY_BYTES_MAX} bytes"
        ))
        .with_status(StatusCode::PAYLOAD_TOO_LARGE)),
        Ok(Err(error)) => Err(ApiError::invalid(format!(
            "the request body could not be read: {error}"
        ))
        .closing_the_connection()),
        Err(_) => Err(ApiError::invalid(format!(
            "the request body did not arrive within {} ms",
            bound.as_millis()
        ))
        .with_status(StatusCode::REQUEST_TIMEOUT)
        .closing_the_connection()),
    }
}

/// Whether reading a body stopped at its length limit (anywhere in the error's chain).
fn is_length_limit(error: &axum::Error) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = current {
        if cause.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        current = cause.source();
    }
    false
}

/// Parses the body; `None` when it is empty. Returns the request's fingerprint too.
async fn parse_json_body<T: DeserializeOwned>(
    request: Request<Body>,
    state: &AppState,
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
    let bytes = read_body(request.into_body(), state).await?;
    if bytes.is_empty() {
        return Ok((None, fingerprint(&method, &path, "")));
    }
    if content_type.as_deref() != Some("application/json") {
        return Err(ApiError::invalid("Content-Type must be application/json")
            .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE));
    }
    let canonical = json_with_unique_keys(&bytes)
        .map_err(|error| ApiError::invalid(format!("request body is not valid JSON: {error}")))?;
    // Every body the API takes is an object; serde would also read a struct from an
    // array of its fields in order (`[]` as an empty request), which the document
    // does not allow.
    if !canonical.is_object() {
        return Err(ApiError::invalid("request body must be a JSON object"));
    }
    // Without path tracking first: `serde_path_to_error` wraps every field's
    // deserializer, more than half of deserializing's instructions (docs/BENCHMARKS.md,
    // twenty-third session). Only a body that fails is read again with it, to say where;
    // the same deserializer over the same document fails the same way.
    let value: T = match T::deserialize(&canonical) {
        Ok(value) => value,
        Err(_) => serde_path_to_error::deserialize(&canonical).map_err(|error| {
            let path = error.path().to_string();
            let inner = error.into_inner();
            if path == "." {
                ApiError::invalid(inner.to_string())
            } else {
                ApiError::invalid(format!("{path}: {inner}"))
            }
        })?,
    };
    // serde_json's map is ordered by key, so this is a canonical form of the document.
    // `{}` is the empty body's fingerprint: an optional body may be left out or sent
    // as `{}`, and a retry that sends the other must replay, not be refused.
    let canonical_text = if canonical.as_object().is_some_and(serde_json::Map::is_empty) {
        String::new()
    } else {
        serde_json::to_string(&canonical).unwrap_or_default()
    };
    Ok((Some(value), fingerprint(&method, &path, &canonical_text)))
}

/// A JSON document as a `serde_json::Value`, refused when an object names a key twice.
/// serde_json keeps the last one silently: `{"quantity":1,"quantity":1000000}` would be
/// read as a million while a proxy, a firewall or a log that reads the first saw 1.
pub(crate) fn json_with_unique_keys(bytes: &[u8]) -> Result<serde_json::Value, serde_json::Error> {
    serde_json::from_slice::<UniqueKeys>(bytes).map(|document| document.0)
}

struct UniqueKeys(serde_json::Value);

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(UniqueKeysVisitor)
            .map(UniqueKeys)
    }
}

/// Builds the `Value` serde_json's own visitor would, checking each object's keys.
struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::from(value))
    }

    fn visit_u64<E>(self, value: u64) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::from(value))
    }

    fn visit_f64<E>(self, value: f64) -> Result<serde_json::Value, E> {
        Ok(serde_json::Number::from_f64(value)
            .map_or(serde_json::Value::Null, serde_json::Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E>(self) -> Result<serde_json::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<serde_json::Value, D::Error> {
        serde::Deserialize::deserialize(deserializer).map(|UniqueKeys(value)| value)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut sequence: A,
    ) -> Result<serde_json::Value, A::Error> {
        let mut elements = Vec::new();
        while let Some(UniqueKeys(element)) = sequence.next_element()? {
            elements.push(element);
        }
        Ok(serde_json::Value::Array(elements))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> Result<serde_json::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "the key '{key}' appears twice in one object"
                )));
            }
            let UniqueKeys(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(serde_json::Value::Object(object))
    }
}

pub(crate) fn fingerprint(method: &str, path: &str, canonical_body: &str) -> String {
    let mut hasher = Sha256::new();
    for part in [method, "\n", path, "\n", canonical_body] {
        hasher.update(part.as_bytes());
    }
    domain::lower_hex(&hasher.finalize())
}

/// A route's path parameters, as axum's `Path` takes them, with a malformed one (a
/// percent-encoding that is not UTF-8, say) answered with a problem document rather
/// than axum's plain text.
pub struct Path<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(rejection) if rejection.status().is_client_error() => {
                Err(ApiError::invalid(rejection.body_text()))
            }
            // A route whose parameters do not match its handler: stockd's own mistake.
            Err(rejection) => Err(ApiError::new(ErrorCode::Internal, rejection.body_text())),
        }
    }
}

/// A route's query parameters, each taken once by name; [`QueryParameters::finish`]
/// refuses any the route does not know (a typo must not silently widen a list).
pub struct QueryParameters(std::collections::HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for QueryParameters {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Query(pairs) =
            axum::extract::Query::<Vec<(String, String)>>::from_request_parts(parts, state)
                .await
                .map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
        Ok(QueryParameters(unique_parameters(pairs)?))
    }
}

/// A query's parameters by name, each given once: a parameter given twice is refused
/// (400), as a body's duplicate key is, rather than the last one taken (a proxy or a
/// log reading the first would see another request than stockd answered).
pub fn unique_parameters(
    pairs: Vec<(String, String)>,
) -> Result<std::collections::HashMap<String, String>, ApiError> {
    let mut parameters = std::collections::HashMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        if parameters.contains_key(&name) {
            return Err(ApiError::invalid(format!(
                "query parameter '{}' is given more than once",
                name.chars().take(64).collect::<String>()
            )));
        }
        parameters.insert(name, value);
    }
    Ok(parameters)
}

impl QueryParameters {
    /// The parameter `name` parsed, or `None` when absent.
    pub fn take<T, E: std::fmt::Display>(
        &mut self,
        name: &str,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Option<T>, ApiError> {
        self.0
            .remove(name)
            .map(|value| {
                parse(&value).map_err(|error| ApiError::invalid(format!("{name}: {error}")))
            })
            .transpose()
    }

    /// `limit`: 1..=`maximum`, `default` when absent.
    pub fn limit(&mut self, default: i64, maximum: i64) -> Result<i64, ApiError> {
        Ok(self
            .take("limit", |value| {
                value
                    .parse::<i64>()
                    .ok()
                    .filter(|limit| (1..=maximum).contains(limit))
                    .ok_or_else(|| format!("must be 1 to {maximum}"))
            })?
            .unwrap_or(default))
    }

    /// Refuses the parameters nobody took.
    pub fn finish(self) -> Result<(), ApiError> {
        match self.0.keys().min() {
            Some(unknown) => Err(ApiError::invalid(format!(
                "unknown query parameter '{unknown}'"
            ))),
            None => Ok(()),
        }
    }
}

/// The bearer token of a request, if it carries one. The scheme's name is matched in
/// any case (RFC 9110 §11.1): some clients and proxies send `bearer`.
pub fn bearer_token(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|token| !token.is_empty())
}

/// The authenticated caller of a route: a credential that stockd knows and has not
/// revoked, within its request rate. Without one: 401, before anything else is read.
pub struct Caller(pub std::sync::Arc<Principal>);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let Some(token) = bearer_token(parts) else {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "this call needs 'Authorization: Bearer <admin token, operator token or service key>'",
            ));
        };
        let digest = engine::credentials::digest(token);
        let principal = state
            .engine
            .authenticate_digest(&digest, token.len())
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::Unauthorized,
                    "the credential is unknown or was revoked",
                )
            })?;
        // Counted per credential, by the digest it was looked up with.
        state.http.admit(&digest)?;
        Ok(Caller(principal))
    }
}

/// A reader of `/metrics`: the metrics token, or a credential that may audit. An
/// operator's reading is of its shop: `Some(shop)`.
pub struct MetricsReader(pub Option<domain::ShopCode>);

impl FromRequestParts<AppState> for MetricsReader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let (Some(token), Some(expected)) = (bearer_token(parts), &state.http.metrics_token_hash)
            && domain::constant_time_equal(&Sha256::digest(token.as_bytes()), expected)
        {
            return Ok(MetricsReader(None));
        }
        let Caller(principal) = Caller::from_request_parts(parts, state).await?;
        authorize(&principal, Action::Audit, None)
            .map_err(|denied| ApiError::new(ErrorCode::Forbidden, denied.0))?;
        Ok(MetricsReader(principal.shop().cloned()))
    }
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

    fn authorization(value: &str) -> Parts {
        axum::http::Request::builder()
            .header(header::AUTHORIZATION, value)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn the_bearer_scheme_is_recognised_in_any_case_and_nothing_else_is() {
        for value in [
            "Bearer tok-1",
            "bearer tok-1",
            "BEARER tok-1",
            "Bearer  tok-1 ",
        ] {
            assert_eq!(
                bearer_token(&authorization(value)),
                Some("tok-1"),
                "{value}"
            );
        }
        for value in ["Basic tok-1", "Bearertok-1", "Bearer ", "Bearer", "tok-1"] {
            assert_eq!(bearer_token(&authorization(value)), None, "{value}");
        }
    }
}

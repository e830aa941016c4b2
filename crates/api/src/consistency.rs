//! Read-your-writes across replicas (seed 002 §六.2): answers to writes carry the
//! writer's position as `Stockd-Consistency-Token`; a display read that sends it back
//! is served by a replica only when that replica has replayed past it. Display answers
//! say who served them (`Stockd-Served-By`) and how fresh they are (`as_of`).

use axum::Json;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use domain::ConsistencyToken;
use serde::Serialize;
use store::{Displayed, ReadHandle};

use crate::AppState;
use crate::problem::{AnsweredWithoutAWrite, ApiError};

pub const CONSISTENCY_TOKEN_HEADER: &str = "stockd-consistency-token";
pub const SERVED_BY_HEADER: &str = "stockd-served-by";

/// A display read's handle: from the request's `Stockd-Consistency-Token`, if any.
pub struct DisplayRead(pub ReadHandle);

impl<S: Send + Sync> FromRequestParts<S> for DisplayRead {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let mut values = parts.headers.get_all(CONSISTENCY_TOKEN_HEADER).iter();
        let token = match (values.next(), values.next()) {
            (None, _) => None,
            (Some(value), None) => {
                let text = value.to_str().map_err(|_| {
                    ApiError::invalid("Stockd-Consistency-Token must be visible ASCII")
                })?;
                Some(ConsistencyToken::parse(text).map_err(|error| ApiError::invalid(error.0))?)
            }
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "at most one Stockd-Consistency-Token header may be sent",
                ));
            }
        };
        Ok(DisplayRead(ReadHandle::display(token)))
    }
}

/// A display answer: `body` with `as_of` added, and `Stockd-Served-By`.
pub fn displayed_response<T, B: Serialize>(displayed: &Displayed<T>, body: B) -> Response {
    served_response(
        Json(displayed_json(displayed, body)).into_response(),
        displayed.served_by.as_str(),
    )
}

/// A display answer's body: `body` with `as_of` added.
pub fn displayed_json<T, B: Serialize>(displayed: &Displayed<T>, body: B) -> serde_json::Value {
    let mut value = serde_json::to_value(body).unwrap_or(serde_json::Value::Null);
    if let serde_json::Value::Object(fields) = &mut value {
        fields.insert(
            "as_of".into(),
            serde_json::Value::String(displayed.as_of.to_string()),
        );
    }
    value
}

/// `response` with `Stockd-Served-By: served_by` (`primary`, `replica` or `cache`).
pub fn served_response(mut response: Response, served_by: &'static str) -> Response {
    response
        .headers_mut()
        .insert(SERVED_BY_HEADER, HeaderValue::from_static(served_by));
    response
}

/// Whether an answer to `method` is the result of a unit of work (a change, or a
/// refusal stored under the key), whose writes a later read may need to see.
pub(crate) fn reports_a_write(method: &Method, status: StatusCode) -> bool {
    let mutating = matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    // 422 (`idempotency_key_reused`) never comes from a unit of work: the key holds
    // another request's answer.
    let from_a_unit_of_work = status.is_success() || status == StatusCode::CONFLICT;
    mutating && from_a_unit_of_work
}

/// Stamps the writer's position on every answer a write's unit of work gave (the
/// innermost part of `crate::each_request`; `method` is the request's). The position
/// is read after the answer was made, so it is at or past the write's commit (and
/// after a replay, past the original's). A refusal made before any unit of work
/// ([`AnsweredWithoutAWrite`]) gets none: there is nothing to wait for, and a
/// campaign's sold-out answers must not cost a round trip each.
pub async fn stamp_writes(
    state: &AppState,
    method: &Method,
    running: impl Future<Output = Response>,
) -> Response {
    let mut response = running.await;
    // The combiner read the position once for its whole batch: nothing more to read.
    let stamped = response.headers().contains_key(CONSISTENCY_TOKEN_HEADER);
    let wrote_nothing = response
        .extensions()
        .get::<AnsweredWithoutAWrite>()
        .is_some();
    if !stamped
        && !wrote_nothing
        && reports_a_write(method, response.status())
        && let Some(token) = state.engine.consistency_token().await
    {
        stamp(&mut response, token);
    }
    response
}

/// Puts `token` on `response` as `Stockd-Consistency-Token`.
pub fn stamp(response: &mut Response, token: ConsistencyToken) {
    if let Ok(value) = HeaderValue::from_str(&token.to_string()) {
        response
            .headers_mut()
            .insert(CONSISTENCY_TOKEN_HEADER, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answers_of_units_of_work_carry_a_token() {
        assert!(reports_a_write(&Method::POST, StatusCode::CREATED));
        assert!(reports_a_write(&Method::PUT, StatusCode::OK));
        assert!(reports_a_write(&Method::DELETE, StatusCode::OK));
        assert!(reports_a_write(&Method::POST, StatusCode::CONFLICT));
        // A key used for another request: the key's answer is not this request's.
        assert!(!reports_a_write(
            &Method::PATCH,
            StatusCode::UNPROCESSABLE_ENTITY
        ));
        // Refused before any unit of work ran: nothing to wait for, and no database
        // round trip for an unauthenticated or rate-limited caller.
        assert!(!reports_a_write(&Method::POST, StatusCode::UNAUTHORIZED));
        assert!(!reports_a_write(
            &Method::POST,
            StatusCode::TOO_MANY_REQUESTS
        ));
        assert!(!reports_a_write(&Method::POST, StatusCode::BAD_REQUEST));
        assert!(!reports_a_write(
            &Method::POST,
            StatusCode::SERVICE_UNAVAILABLE
        ));
        assert!(!reports_a_write(&Method::GET, StatusCode::OK));
    }
}

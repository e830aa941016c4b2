//! Errors as RFC 9457 `application/problem+json`, and the one place that maps error
//! codes to HTTP statuses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use domain::ErrorCode;
use engine::EngineError;

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// The HTTP status of each stable error code.
pub fn status_for(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::InvalidArgument => StatusCode::BAD_REQUEST,
        ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorCode::Forbidden => StatusCode::FORBIDDEN,
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::InsufficientStock
        | ErrorCode::OffShelf
        | ErrorCode::IllegalTransition
        | ErrorCode::VersionConflict
        | ErrorCode::AlreadyExists
        | ErrorCode::PurchaseLimitExceeded
        | ErrorCode::OrderRefReused
        | ErrorCode::FailedPrecondition
        | ErrorCode::CampaignNotStarted
        | ErrorCode::RequestInProgress => StatusCode::CONFLICT,
        ErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::IdempotencyKeyReused => StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::LockTimeout | ErrorCode::RetryExhausted | ErrorCode::Unavailable => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        ErrorCode::PaymentUnknown => StatusCode::ACCEPTED,
        ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn title_for(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::InvalidArgument => "The request is malformed or out of range",
        ErrorCode::Unauthorized => "Missing or wrong credentials",
        ErrorCode::Forbidden => "Not allowed for these credentials",
        ErrorCode::NotFound => "No such resource",
        ErrorCode::InsufficientStock => "Not enough stock available",
        ErrorCode::OffShelf => "The SKU is not on sale",
        ErrorCode::IllegalTransition => "That status change is not allowed",
        ErrorCode::VersionConflict => "Changed concurrently by someone else",
        ErrorCode::IdempotencyKeyReused => "Idempotency-Key already used for a different request",
        ErrorCode::RequestInProgress => "A request with this Idempotency-Key is still running",
        ErrorCode::LockTimeout => "Timed out waiting for a lock; retry with the same key",
        ErrorCode::RetryExhausted => "Too much contention; retry with the same key",
        ErrorCode::Unavailable => "Temporarily unavailable; retry later",
        ErrorCode::PaymentUnknown => "Payment outcome not known yet",
        ErrorCode::AlreadyExists => "Something with this name already exists",
        ErrorCode::RateLimited => "Too many requests from this credential; slow down",
        ErrorCode::PurchaseLimitExceeded => "This user already holds or bought the SKU's limit",
        ErrorCode::OrderRefReused => "This order number was used by another request",
        ErrorCode::FailedPrecondition => "What the request names does not allow it",
        ErrorCode::CampaignNotStarted => "The campaign has not started yet",
        ErrorCode::Internal => "Internal error",
    }
}

/// The problem document for `code` with `status`. Deterministic, so a stored problem
/// replays byte for byte.
///
/// Written piece by piece rather than through a derived `Serialize`: most answers of a
/// flash sale are refusals, and `format!` plus serde's struct machinery were about
/// three quarters of rendering one (docs/BENCHMARKS.md, twenty-fourth session). Only the
/// title and the detail can hold characters JSON must escape; serde_json escapes them.
pub fn problem_body_with_status(code: ErrorCode, status: StatusCode, detail: &str) -> String {
    let code_text = code.as_str();
    let title = title_for(code);
    debug_assert!(
        code_text
            .bytes()
            .all(|byte| byte.is_ascii_lowercase() || byte == b'_'),
        "a code needs no escaping"
    );
    let mut body = Vec::with_capacity(96 + 2 * code_text.len() + title.len() + detail.len());
    body.extend_from_slice(b"{\"type\":\"urn:stockd:problem:");
    body.extend_from_slice(code_text.as_bytes());
    body.extend_from_slice(b"\",\"title\":");
    push_json_string(&mut body, title);
    body.extend_from_slice(b",\"status\":");
    body.extend_from_slice(status.as_str().as_bytes());
    body.extend_from_slice(b",\"code\":\"");
    body.extend_from_slice(code_text.as_bytes());
    body.extend_from_slice(b"\",\"detail\":");
    push_json_string(&mut body, detail);
    body.push(b'}');
    // Every piece is UTF-8: the static parts, and serde_json's output for a `&str`.
    String::from_utf8(body).unwrap_or_else(|_| String::from("{}"))
}

/// Appends `text` as a JSON string, quoted and escaped.
fn push_json_string(body: &mut Vec<u8>, text: &str) {
    // Writing a string into a `Vec` cannot fail.
    let _ = serde_json::to_writer(body, text);
}

pub fn problem_body(code: ErrorCode, detail: &str) -> String {
    problem_body_with_status(code, status_for(code), detail)
}

/// An error answered directly (not stored): validation failures, auth failures and
/// transient engine errors.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    pub status: StatusCode,
    pub detail: String,
    /// `Retry-After` for a 429 or 503 (1 second when not set).
    pub retry_after_seconds: Option<u64>,
    /// Answer with `Connection: close` (a client too slow to trust with another request).
    pub close_connection: bool,
    /// Refused before any unit of work ran (`EngineError::Refused`, a reused key, a key
    /// still in progress): nothing was written, so the answer carries no writer
    /// position (see [`AnsweredWithoutAWrite`]).
    pub without_a_write: bool,
}

/// The response extension that tells `consistency::stamp_writes` an answer wrote
/// nothing: a refusal decided before any unit of work (a campaign's sold-out answer
/// from memory, a limit checked at the door) has no position a later read must wait
/// for, and reading one would cost the database round trip the answer was made to
/// avoid.
#[derive(Debug, Clone, Copy)]
pub struct AnsweredWithoutAWrite;

impl ApiError {
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> ApiError {
        ApiError {
            code,
            status: status_for(code),
            detail: detail.into(),
            retry_after_seconds: None,
            close_connection: false,
            without_a_write: false,
        }
    }

    pub fn retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after_seconds = Some(seconds.max(1));
        self
    }

    pub fn closing_the_connection(mut self) -> ApiError {
        self.close_connection = true;
        self
    }

    pub fn invalid(detail: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidArgument, detail)
    }

    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = status;
        self
    }
}

/// The response extension the metrics layer reads to count outcomes by code.
#[derive(Debug, Clone, Copy)]
pub struct OutcomeCode(pub ErrorCode);

pub fn problem_response(status: StatusCode, code: ErrorCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
    );
    if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response.extensions_mut().insert(OutcomeCode(code));
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = problem_body_with_status(self.code, self.status, &self.detail);
        let mut response = problem_response(self.status, self.code, body);
        if let Some(seconds) = self.retry_after_seconds
            && let Ok(value) = HeaderValue::from_str(&seconds.to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        if self.close_connection {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.without_a_write {
            response.extensions_mut().insert(AnsweredWithoutAWrite);
        }
        response
    }
}

/// What a client is told when the database is out of reach: the driver's own message
/// stays in the log.
pub const DATABASE_UNAVAILABLE_DETAIL: &str =
    "the database is unavailable; retry later (a write with the same Idempotency-Key)";

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> ApiError {
        let code = error.code();
        if let EngineError::Overloaded(message) = error {
            return ApiError::new(code, message).with_status(StatusCode::TOO_MANY_REQUESTS);
        }
        // Answers that stored nothing under the key: a refusal decided before any unit
        // of work, a key used for another request, a key whose first request still runs.
        let without_a_write = matches!(
            error,
            EngineError::Refused { .. }
                | EngineError::IdempotencyKeyReused
                | EngineError::RequestInProgress
        );
        let detail = match error {
            EngineError::InvalidArgument(message)
            | EngineError::NotFound(message)
            | EngineError::Forbidden(message)
            | EngineError::Unauthorized(message)
            | EngineError::PaymentUnknown(message)
            | EngineError::Refused {
                detail: message, ..
            }
            | EngineError::Unavailable(message)
            | EngineError::Overloaded(message) => message,
            EngineError::Internal(_) => String::from("see the server log"),
            EngineError::DatabaseUnavailable(message) => {
                tracing::warn!(
                    error = %domain::redact_urls_in(&message),
                    "answered 503: the database is unavailable"
                );
                String::from(DATABASE_UNAVAILABLE_DETAIL)
            }
            EngineError::IdempotencyKeyReused => {
                String::from("this Idempotency-Key was first used with a different request")
            }
            EngineError::RequestInProgress => String::from(
                "the first request with this Idempotency-Key has not finished; retry later with the same key",
            ),
            EngineError::LockTimeout | EngineError::RetryExhausted => {
                String::from("nothing was changed; retry with the same Idempotency-Key")
            }
        };
        ApiError {
            without_a_write,
            ..ApiError::new(code, detail)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_a_client_or_server_error_status_except_payment_unknown() {
        for code in ErrorCode::ALL {
            let status = status_for(code);
            if code == ErrorCode::PaymentUnknown {
                assert_eq!(status, StatusCode::ACCEPTED);
            } else {
                assert!(
                    status.is_client_error() || status.is_server_error(),
                    "{code}"
                );
            }
        }
    }

    /// The document as the derived serializer wrote it before it was written by hand:
    /// stored problems replay byte for byte, so a new one must read the same.
    fn problem_body_through_serde(code: ErrorCode, status: StatusCode, detail: &str) -> String {
        #[derive(serde::Serialize)]
        struct ProblemBody<'a> {
            #[serde(rename = "type")]
            problem_type: String,
            title: &'a str,
            status: u16,
            code: &'static str,
            detail: &'a str,
        }
        serde_json::to_string(&ProblemBody {
            problem_type: format!("urn:stockd:problem:{}", code.as_str()),
            title: title_for(code),
            status: status.as_u16(),
            code: code.as_str(),
            detail,
        })
        .unwrap()
    }

    #[test]
    fn a_problem_document_reads_byte_for_byte_as_the_derived_serializer_wrote_it() {
        let details = [
            "",
            "campaign 'flash' is sold out",
            "quote \" backslash \\ newline \n tab \t bell \u{7} delete \u{7f}",
            "不是 JSON 的 </script> \u{2028} \u{1F600}",
        ];
        for code in ErrorCode::ALL {
            for detail in details {
                for status in [status_for(code), StatusCode::TOO_MANY_REQUESTS] {
                    let written = problem_body_with_status(code, status, detail);
                    assert_eq!(
                        written,
                        problem_body_through_serde(code, status, detail),
                        "{code} {status} {detail:?}"
                    );
                    let parsed: serde_json::Value = serde_json::from_str(&written).unwrap();
                    assert_eq!(parsed["detail"], detail);
                }
            }
        }
    }

    #[test]
    fn only_answers_that_stored_nothing_are_marked_as_writing_nothing() {
        let marked = |error: EngineError| {
            ApiError::from(error)
                .into_response()
                .extensions()
                .get::<AnsweredWithoutAWrite>()
                .is_some()
        };
        assert!(marked(EngineError::Refused {
            code: ErrorCode::InsufficientStock,
            detail: "sold out".into(),
        }));
        assert!(marked(EngineError::IdempotencyKeyReused));
        assert!(marked(EngineError::RequestInProgress));
        // An unknown payment recorded its attempt: a later read may wait for it.
        assert!(!marked(EngineError::PaymentUnknown(
            "asked again later".into()
        )));
        assert!(!marked(EngineError::Internal("a bug".into())));
    }

    #[test]
    fn problem_bodies_name_the_code_and_status() {
        let body: serde_json::Value =
            serde_json::from_str(&problem_body(ErrorCode::InsufficientStock, "only 1 left"))
                .unwrap();
        assert_eq!(body["code"], "insufficient_stock");
        assert_eq!(body["status"], 409);
        assert_eq!(body["detail"], "only 1 left");
        assert_eq!(body["type"], "urn:stockd:problem:insufficient_stock");
    }
}

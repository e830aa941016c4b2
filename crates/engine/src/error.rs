//! The engine's one error enum. The HTTP layer maps each variant to a status and a
//! stable code in one place.

use std::fmt;

use domain::ErrorCode;
use store::StoreError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    InvalidArgument(String),
    NotFound(String),
    /// The caller may not do this (an operator outside its shop, or a non-admin delete).
    Forbidden(String),
    /// Missing or wrong credentials (a webhook's signature).
    Unauthorized(String),
    /// The gateway has not said whether the money moved; nothing was guessed. Asked
    /// again later (same key), or resolved by webhook or reconciliation.
    PaymentUnknown(String),
    /// A business refusal reached outside a unit of work: its code says why
    /// (`off_shelf`, `insufficient_stock`, …). Stored under the key where the use case
    /// passes it to `Engine::refusal_under_key`; an answer from memory (sold out, a
    /// limit reached) is not stored.
    Refused {
        code: ErrorCode,
        detail: String,
    },
    IdempotencyKeyReused,
    RequestInProgress,
    LockTimeout,
    RetryExhausted,
    Unavailable(String),
    /// The database could not be reached, or refused for want of resources. The
    /// driver's words are logged, never shown: they can name hosts, users and paths.
    DatabaseUnavailable(String),
    /// Too much queued already; shed at once rather than waited out (HTTP 429).
    Overloaded(String),
    /// A bug or a broken invariant; logged in full, shown to clients without detail.
    Internal(String),
}

impl EngineError {
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            EngineError::NotFound(_) => ErrorCode::NotFound,
            EngineError::Forbidden(_) => ErrorCode::Forbidden,
            EngineError::Unauthorized(_) => ErrorCode::Unauthorized,
            EngineError::PaymentUnknown(_) => ErrorCode::PaymentUnknown,
            EngineError::Refused { code, .. } => *code,
            EngineError::IdempotencyKeyReused => ErrorCode::IdempotencyKeyReused,
            EngineError::RequestInProgress => ErrorCode::RequestInProgress,
            EngineError::LockTimeout => ErrorCode::LockTimeout,
            EngineError::RetryExhausted => ErrorCode::RetryExhausted,
            EngineError::Unavailable(_)
            | EngineError::DatabaseUnavailable(_)
            | EngineError::Overloaded(_) => ErrorCode::Unavailable,
            EngineError::Internal(_) => ErrorCode::Internal,
        }
    }
}

impl fmt::Display for EngineError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::InvalidArgument(message)
            | EngineError::NotFound(message)
            | EngineError::Forbidden(message)
            | EngineError::Unauthorized(message)
            | EngineError::PaymentUnknown(message)
            | EngineError::Refused {
                detail: message, ..
            }
            | EngineError::Unavailable(message)
            | EngineError::DatabaseUnavailable(message)
            | EngineError::Overloaded(message)
            | EngineError::Internal(message) => write!(formatter, "{}: {message}", self.code()),
            _ => formatter.write_str(self.code().as_str()),
        }
    }
}

impl std::error::Error for EngineError {}

/// Store errors that reach a caller after retrying (if retrying applies).
impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> EngineError {
        match error {
            StoreError::Retryable(_) | StoreError::Deadlock(_) => EngineError::RetryExhausted,
            StoreError::LockTimeout(_) => EngineError::LockTimeout,
            StoreError::KeyInFlight => EngineError::RequestInProgress,
            StoreError::Unavailable(message) => EngineError::DatabaseUnavailable(message),
            StoreError::Invariant(message) | StoreError::Database(message) => {
                EngineError::Internal(message)
            }
            StoreError::TokenAhead(token) => EngineError::InvalidArgument(format!(
                "Stockd-Consistency-Token '{token}' names a log position this database has not reached: send back the token a write's answer carried"
            )),
        }
    }
}

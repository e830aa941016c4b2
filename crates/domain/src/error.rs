//! The stable error codes of the external contract, and the parse error every newtype
//! returns.

use std::fmt;

/// Stable, documented error codes. Clients match on these strings; never rename one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidArgument,
    Unauthorized,
    Forbidden,
    NotFound,
    InsufficientStock,
    OffShelf,
    IllegalTransition,
    VersionConflict,
    IdempotencyKeyReused,
    RequestInProgress,
    LockTimeout,
    RetryExhausted,
    Unavailable,
    PaymentUnknown,
    AlreadyExists,
    /// This principal sent more requests than its rate allows (429).
    RateLimited,
    /// The user already holds or bought the SKU's per-user limit (409).
    PurchaseLimitExceeded,
    /// The shop's order number was used by a request with another Idempotency-Key
    /// (409).
    OrderRefReused,
    /// The request is well formed, but what it names does not allow it: SKUs of
    /// several shops, a SKU with a per-user limit and no `user_id`, a SKU without a
    /// price in an order, a full cart (409). `invalid_argument` is for a request that
    /// is wrong by itself.
    FailedPrecondition,
    /// The request names a campaign that has not started yet (409).
    CampaignNotStarted,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::InvalidArgument,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::InsufficientStock,
        ErrorCode::OffShelf,
        ErrorCode::IllegalTransition,
        ErrorCode::VersionConflict,
        ErrorCode::IdempotencyKeyReused,
        ErrorCode::RequestInProgress,
        ErrorCode::LockTimeout,
        ErrorCode::RetryExhausted,
        ErrorCode::Unavailable,
        ErrorCode::PaymentUnknown,
        ErrorCode::AlreadyExists,
        ErrorCode::RateLimited,
        ErrorCode::PurchaseLimitExceeded,
        ErrorCode::OrderRefReused,
        ErrorCode::FailedPrecondition,
        ErrorCode::CampaignNotStarted,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::InsufficientStock => "insufficient_stock",
            ErrorCode::OffShelf => "off_shelf",
            ErrorCode::IllegalTransition => "illegal_transition",
            ErrorCode::VersionConflict => "version_conflict",
            ErrorCode::IdempotencyKeyReused => "idempotency_key_reused",
            ErrorCode::RequestInProgress => "request_in_progress",
            ErrorCode::LockTimeout => "lock_timeout",
            ErrorCode::RetryExhausted => "retry_exhausted",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::PaymentUnknown => "payment_unknown",
            ErrorCode::AlreadyExists => "already_exists",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::PurchaseLimitExceeded => "purchase_limit_exceeded",
            ErrorCode::OrderRefReused => "order_ref_reused",
            ErrorCode::FailedPrecondition => "failed_precondition",
            ErrorCode::CampaignNotStarted => "campaign_not_started",
            ErrorCode::Internal => "internal",
        }
    }

    pub fn parse(text: &str) -> Option<ErrorCode> {
        ErrorCode::ALL
            .into_iter()
            .find(|code| code.as_str() == text)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// Why a value was refused by a parsing constructor. The message is written for the
/// client: it names the rule, not the Rust type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl ParseError {
    pub fn new(message: impl Into<String>) -> ParseError {
        ParseError(message.into())
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

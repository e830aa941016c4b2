//! The reservation batch's decision lives in `domain::plan` (pure, tested without a
//! database); what the backends report about writing a decided batch lives here.

pub use domain::plan::*;

use domain::ConsistencyToken;

/// What the whole-batch fast path did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WholeBatch {
    /// Every request was accepted, written and committed; the writer's position read
    /// after that commit, in the same round trip.
    Applied(ConsistencyToken),
    /// Nothing was written: the batch needs deciding request by request.
    NotApplied,
    /// Nothing was written: a stock row or a key stayed locked for the whole lock
    /// bound. The batch transaction that tells which waits only briefly
    /// ([`crate::backend::Dialect::SHORT_LOCK_WAIT`]), so a request waits about one
    /// bound in all, not two.
    WaitedOutTheLock,
}

/// What writing a decided batch changed, for the caller to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchWritten {
    /// Stock rows whose conditional update matched.
    pub rows_taken: u64,
    /// Idempotency records inserted (a key committed meanwhile by another process is
    /// skipped, and the caller retries the batch).
    pub records_stored: u64,
}

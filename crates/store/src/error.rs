//! The store's one error enum, and the classification of database errors by kind.

use std::fmt;

/// What went wrong in a unit of work. Business refusals (insufficient stock, illegal
/// transitions) are not errors: they are stored responses. These are the failures that
/// leave the database unchanged and may be worth retrying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Deadlock or serialization failure: the transaction was rolled back and the whole
    /// unit of work may run again.
    Retryable(String),
    /// A row lock was not granted within the configured bound.
    LockTimeout(String),
    /// Another transaction holds this idempotency key and has not committed yet.
    KeyInFlight,
    /// The database could not be reached, or a pool had no connection to give in time.
    Unavailable(String),
    /// Something the store relies on did not hold (a conditional update under a row
    /// lock matched no row). Never expected; the transaction was rolled back.
    Invariant(String),
    /// Any other database error.
    Database(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Retryable(message) => write!(formatter, "retryable conflict: {message}"),
            StoreError::LockTimeout(message) => write!(formatter, "lock timeout: {message}"),
            StoreError::KeyInFlight => formatter.write_str("idempotency key is in flight"),
            StoreError::Unavailable(message) => {
                write!(formatter, "database unavailable: {message}")
            }
            StoreError::Invariant(message) => write!(formatter, "invariant violated: {message}"),
            StoreError::Database(message) => write!(formatter, "database error: {message}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// PostgreSQL SQLSTATEs that mean "run the transaction again".
const POSTGRES_SERIALIZATION_FAILURE: &str = "40001";
const POSTGRES_DEADLOCK_DETECTED: &str = "40P01";
const POSTGRES_LOCK_NOT_AVAILABLE: &str = "55P03";
const POSTGRES_QUERY_CANCELED: &str = "57014";
/// SQLite result codes. A plain `SQLITE_BUSY` (or `SQLITE_BUSY_TIMEOUT`) arrives only
/// after the busy handler waited the whole `busy_timeout` for another process's write
/// lock: that is a lock timeout, reported like PostgreSQL's `55P03`. The other busy
/// and locked variants (recovery, snapshot, shared-cache locks) are transient
/// conflicts worth another attempt.
const SQLITE_BUSY: i64 = 5;
const SQLITE_BUSY_TIMEOUT: i64 = 773;
const SQLITE_LOCKED: i64 = 6;

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> StoreError {
        classify(&error)
    }
}

/// Sorts a database error into the kinds callers act on. Classification is by error
/// code, never by message text or constraint name.
pub fn classify(error: &sqlx::Error) -> StoreError {
    match error {
        sqlx::Error::Database(database_error) => {
            let message = database_error.message().to_owned();
            let code = database_error
                .code()
                .map(|code| code.into_owned())
                .unwrap_or_default();
            match code.as_str() {
                POSTGRES_SERIALIZATION_FAILURE | POSTGRES_DEADLOCK_DETECTED => {
                    return StoreError::Retryable(message);
                }
                POSTGRES_LOCK_NOT_AVAILABLE => return StoreError::LockTimeout(message),
                POSTGRES_QUERY_CANCELED => return StoreError::Unavailable(message),
                _ => {}
            }
            if let Ok(extended_code) = code.parse::<i64>() {
                if extended_code == SQLITE_BUSY || extended_code == SQLITE_BUSY_TIMEOUT {
                    return StoreError::LockTimeout(message);
                }
                let primary_code = extended_code & 0xFF;
                if primary_code == SQLITE_BUSY || primary_code == SQLITE_LOCKED {
                    return StoreError::Retryable(message);
                }
            }
            StoreError::Database(format!("{message} (code {code})"))
        }
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(error.to_string()),
        other => StoreError::Database(other.to_string()),
    }
}

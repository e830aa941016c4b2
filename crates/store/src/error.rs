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
    /// The database broke a deadlock by rolling this transaction back; retried like
    /// [`StoreError::Retryable`] and counted on its own (`stockd_db_deadlocks_total`).
    /// The message names the statement that was waiting.
    Deadlock(String),
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
    /// A display read's consistency token names a log position the writer has not
    /// reached: no write's answer carried it (made up, or another database's).
    TokenAhead(domain::ConsistencyToken),
}

impl fmt::Display for StoreError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Retryable(message) => write!(formatter, "retryable conflict: {message}"),
            StoreError::Deadlock(message) => write!(formatter, "deadlock: {message}"),
            StoreError::LockTimeout(message) => write!(formatter, "lock timeout: {message}"),
            StoreError::KeyInFlight => formatter.write_str("idempotency key is in flight"),
            StoreError::Unavailable(message) => {
                write!(formatter, "database unavailable: {message}")
            }
            StoreError::Invariant(message) => write!(formatter, "invariant violated: {message}"),
            StoreError::Database(message) => write!(formatter, "database error: {message}"),
            StoreError::TokenAhead(token) => write!(
                formatter,
                "consistency token {token} is past the writer's position"
            ),
        }
    }
}

impl std::error::Error for StoreError {}

impl StoreError {
    /// Whether the whole unit of work may run again: nothing of it was applied.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Retryable(_) | StoreError::Deadlock(_))
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> StoreError {
        classify(&error)
    }
}

/// Sorts a database error into the kinds callers act on. Classification is by error
/// code, never by message text or constraint name; each backend's codes are read in
/// its own module (`classify_database` there).
pub fn classify(error: &sqlx::Error) -> StoreError {
    use crate::backends::{mysql, postgres, sqlite};
    match error {
        sqlx::Error::Database(database_error) => {
            if let Some(error) =
                database_error.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            {
                postgres::classify_database(error)
            } else if let Some(error) =
                database_error.try_downcast_ref::<sqlx::sqlite::SqliteError>()
            {
                sqlite::classify_database(error)
            } else if let Some(error) =
                database_error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            {
                mysql::classify_database(error)
            } else {
                StoreError::Database(database_error.message().to_owned())
            }
        }
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(error.to_string()),
        other => StoreError::Database(other.to_string()),
    }
}

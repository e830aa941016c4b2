//! The embedded default: one SQLite file in WAL mode with `synchronous=FULL`.
//!
//! SQLite allows one writer at a time. Rather than let connections race for the write
//! lock (and spin in SQLite's busy handler), all writes go through a pool of exactly one
//! connection, so writers queue fairly inside the process, and every write transaction
//! starts with `BEGIN IMMEDIATE` so it holds the lock from its first statement. Reads
//! use a separate pool and see WAL snapshots without blocking the writer.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};

use crate::StoreConfig;

type Db = Sqlite;
type BackendStore = SqliteStore;

#[derive(Debug, Clone)]
pub struct SqliteStore {
    write: SqlitePool,
    read: SqlitePool,
}

mod dialect {
    /// SQLite has no row locks: the `BEGIN IMMEDIATE` write lock already serializes
    /// every writer, so plain reads inside a write transaction are current.
    pub const SELECT_AVAILABLE_FOR_UPDATE: &str =
        "SELECT available FROM stock WHERE sku = $1 AND warehouse = $2";
    pub const SELECT_RESERVATION_STATUS_FOR_UPDATE: &str =
        "SELECT status FROM reservation WHERE id = $1";
    pub const CLAIM_EXPIRED_RESERVATIONS: &str = "SELECT id FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 ORDER BY expires_at, id LIMIT $2";
    pub const VERSION_QUERY: &str = "SELECT 'SQLite ' || sqlite_version()";
    /// The write lock taken by `BEGIN IMMEDIATE` serializes migrations too.
    pub const MIGRATION_LOCK: Option<&str> = None;
    pub const MIGRATIONS: &[(i64, &str, &str)] = &[(
        1,
        "reservation_core",
        include_str!("../migrations/sqlite/0001_reservation_core.sql"),
    )];
}

impl SqliteStore {
    pub async fn connect(config: &StoreConfig) -> Result<SqliteStore, crate::StoreError> {
        let options = SqliteConnectOptions::from_str(&config.database_url)
            .map_err(|error| crate::StoreError::Unavailable(error.to_string()))?;
        if let Some(parent) = Path::new(options.get_filename()).parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|error| {
                crate::StoreError::Unavailable(format!(
                    "cannot create directory {}: {error}",
                    parent.display()
                ))
            })?;
        }
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_millis(config.lock_timeout_milliseconds));
        let acquire_timeout = Duration::from_millis(config.acquire_timeout_milliseconds);
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(acquire_timeout)
            .connect_with(options.clone())
            .await?;
        let read = SqlitePoolOptions::new()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(acquire_timeout)
            .connect_with(options.read_only(true))
            .await?;
        Ok(SqliteStore { write, read })
    }

    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, Sqlite>, crate::StoreError> {
        Ok(self.write.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn begin_read(&self) -> Result<sqlx::Transaction<'static, Sqlite>, crate::StoreError> {
        Ok(self.read.begin().await?)
    }

    /// A deferred read transaction sees one WAL snapshot from its first read on.
    async fn begin_snapshot(
        &self,
    ) -> Result<sqlx::Transaction<'static, Sqlite>, crate::StoreError> {
        self.begin_read().await
    }

    fn read_pool(&self) -> &SqlitePool {
        &self.read
    }

    fn write_pool(&self) -> &SqlitePool {
        &self.write
    }

    pub async fn close(&self) {
        self.write.close().await;
        self.read.close().await;
    }
}

include!("shared.rs");

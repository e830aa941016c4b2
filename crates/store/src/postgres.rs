//! PostgreSQL, for production: several stockd processes may share one database.
//!
//! Row locks (`FOR UPDATE`) order concurrent writers, `SKIP LOCKED` lets several
//! workers claim distinct rows, and every connection carries a `lock_timeout` so a lock
//! wait is bounded. Commits are durable (`synchronous_commit` is left at `on`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::StoreConfig;

type Db = Postgres;
type BackendStore = PostgresStore;

#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

mod dialect {
    pub const SELECT_AVAILABLE_FOR_UPDATE: &str =
        "SELECT available FROM stock WHERE sku = $1 AND warehouse = $2 FOR UPDATE";
    pub const SELECT_RESERVATION_STATUS_FOR_UPDATE: &str =
        "SELECT status FROM reservation WHERE id = $1 FOR UPDATE";
    /// `SKIP LOCKED`: a reservation another worker is releasing is left to it.
    pub const CLAIM_EXPIRED_RESERVATIONS: &str = "SELECT id FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 ORDER BY expires_at, id LIMIT $2 \
         FOR UPDATE SKIP LOCKED";
    pub const VERSION_QUERY: &str = "SELECT version()";
    /// Serializes migrations of one schema across processes; released at commit.
    pub const MIGRATION_LOCK: Option<&str> =
        Some("SELECT pg_advisory_xact_lock(hashtext('stockd_migrate:' || current_schema()))");
    pub const MIGRATIONS: &[(i64, &str, &str)] = &[(
        1,
        "reservation_core",
        include_str!("../migrations/postgres/0001_reservation_core.sql"),
    )];
}

impl PostgresStore {
    pub async fn connect(config: &StoreConfig) -> Result<PostgresStore, crate::StoreError> {
        let mut options = PgConnectOptions::from_str(&config.database_url)
            .map_err(|error| crate::StoreError::Unavailable(error.to_string()))?;
        let lock_timeout = format!("{}ms", config.lock_timeout_milliseconds);
        let statement_timeout = format!("{}ms", config.statement_timeout_milliseconds);
        options = options.options([
            ("lock_timeout", lock_timeout.as_str()),
            ("statement_timeout", statement_timeout.as_str()),
            ("synchronous_commit", "on"),
        ]);
        if let Some(schema) = &config.postgres_schema {
            options = options.options([("search_path", schema.as_str())]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(Duration::from_millis(config.acquire_timeout_milliseconds))
            .connect_with(options)
            .await?;
        Ok(PostgresStore { pool })
    }

    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, Postgres>, crate::StoreError> {
        Ok(self.pool.begin().await?)
    }

    async fn begin_read(&self) -> Result<sqlx::Transaction<'static, Postgres>, crate::StoreError> {
        Ok(self.pool.begin().await?)
    }

    /// The audit compares several tables, so it reads them from one snapshot.
    async fn begin_snapshot(
        &self,
    ) -> Result<sqlx::Transaction<'static, Postgres>, crate::StoreError> {
        Ok(self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?)
    }

    fn read_pool(&self) -> &PgPool {
        &self.pool
    }

    fn write_pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

include!("shared.rs");

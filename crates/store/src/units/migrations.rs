//! Migrations (the backend's list, each in its own transaction, serialized across
//! processes where the backend can: `Dialect::MIGRATION_LOCK`), the engine's version
//! and the readiness ping.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{invariant, wall_clock_milliseconds};
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::sql::{Connection, statement};

impl<B: Backend> Units<B> {
    /// Applies every migration this binary knows and the database lacks, each in its
    /// own transaction, serialized across processes.
    pub async fn migrate(&self) -> Result<Vec<i64>, StoreError> {
        let mut applied_now = Vec::new();
        self.write_connection()
            .await?
            .execute_script(
                "CREATE TABLE IF NOT EXISTS schema_migration (\
                 version BIGINT NOT NULL PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)",
            )
            .await?;
        for (version, name, sql) in <B::Connection as Dialect>::MIGRATIONS {
            let mut transaction = self.begin_write().await?;
            if let Some(lock) = <B::Connection as Dialect>::MIGRATION_LOCK {
                transaction.execute_script(lock).await?;
            }
            let applied: Option<String> =
                statement("SELECT name FROM schema_migration WHERE version = $1")
                    .bind(version)
                    .fetch_optional_scalar(&mut *transaction)
                    .await?;
            match applied {
                Some(applied_name) if applied_name == *name => continue,
                Some(applied_name) => {
                    return Err(invariant(format!(
                        "migration {version} is '{applied_name}' in the database but '{name}' in this binary"
                    )));
                }
                None => {}
            }
            transaction.execute_script(sql).await?;
            statement(
                "INSERT INTO schema_migration (version, name, applied_at) VALUES ($1, $2, $3)",
            )
            .bind(version)
            .bind(*name)
            .bind(wall_clock_milliseconds())
            .execute(&mut *transaction)
            .await?;
            transaction.commit().await?;
            applied_now.push(*version);
        }
        let newest_known = <B::Connection as Dialect>::MIGRATIONS
            .last()
            .map(|(version, _, _)| *version)
            .unwrap_or(0);
        let newest_applied: Option<i64> = statement("SELECT MAX(version) FROM schema_migration")
            .fetch_one_scalar(&mut *self.write_connection().await?)
            .await?;
        if newest_applied.unwrap_or(0) > newest_known {
            return Err(invariant(format!(
                "the database has migration {} but this stockd knows only up to {newest_known}; run a newer stockd",
                newest_applied.unwrap_or(0)
            )));
        }
        Ok(applied_now)
    }

    /// The database engine and its version, for release evidence.
    pub async fn database_version(&self) -> Result<String, StoreError> {
        let version: String = statement(<B::Connection as Dialect>::VERSION_QUERY)
            .fetch_one_scalar(&mut *self.writer_read_connection().await?)
            .await?;
        Ok(version)
    }

    /// One round trip to the database: readiness.
    pub async fn ping(&self) -> Result<(), StoreError> {
        statement("SELECT 1")
            .execute(&mut *self.writer_read_connection().await?)
            .await?;
        Ok(())
    }
}

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

/// The newest migration this binary knows for the backend.
fn newest_known_migration<B: Backend>() -> i64 {
    <B::Connection as Dialect>::MIGRATIONS
        .last()
        .map(|(version, _, _)| *version)
        .unwrap_or(0)
}

/// Refuses a database migrated by a newer stockd: this one would misread it.
fn refuse_a_newer_schema<B: Backend>(newest_applied: i64) -> Result<(), StoreError> {
    let newest_known = newest_known_migration::<B>();
    if newest_applied > newest_known {
        return Err(invariant(format!(
            "the database has migration {newest_applied} but this stockd knows only up to {newest_known}; run a newer stockd"
        )));
    }
    Ok(())
}

/// Longest a start waits for another process's migrations (PostgreSQL's advisory lock
/// waits as long).
const MIGRATION_LOCK_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(15 * 60);

impl<B: Backend> Units<B> {
    /// Applies every migration this binary knows and the database lacks, each in its
    /// own transaction, serialized across processes.
    pub async fn migrate(&self) -> Result<Vec<i64>, StoreError> {
        let applied_now = match <B::Connection as Dialect>::MIGRATION_SESSION_LOCK {
            Some((take, give_back)) => {
                let mut holder = self.backend.migration_connection().await?;
                // Each wait is short (a second) and asked again: another process's
                // migration may take minutes, and this start waits up to
                // `MIGRATION_LOCK_WAIT_MAX` for it.
                let waiting_since = std::time::Instant::now();
                loop {
                    let taken: Option<i64> = statement(take).fetch_one_scalar(&mut *holder).await?;
                    if taken == Some(1) {
                        break;
                    }
                    if waiting_since.elapsed() >= MIGRATION_LOCK_WAIT_MAX {
                        return Err(StoreError::LockTimeout(format!(
                            "another process held the migration lock for {MIGRATION_LOCK_WAIT_MAX:?}"
                        )));
                    }
                }
                let applied = self.apply_migrations_on(&mut holder).await;
                let given_back = statement(give_back)
                    .fetch_one_scalar::<Option<i64>>(&mut *holder)
                    .await;
                let applied = applied?;
                given_back?;
                applied
            }
            None => self.apply_migrations_in_transactions().await?,
        };
        let newest_applied = self.newest_applied_migration().await?;
        refuse_a_newer_schema::<B>(newest_applied)?;
        Ok(applied_now)
    }

    /// Whether the database holds exactly the migrations this binary knows: refused
    /// when it is not migrated, lacks some or has others (a newer stockd's).
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        self.ping().await?;
        let applied: Vec<i64> = statement("SELECT version FROM schema_migration ORDER BY version")
            .fetch_all_scalar(&mut *self.writer_read_connection().await?)
            .await
            .map_err(|error| {
                invariant(format!(
                    "the database's migrations could not be read ({error}): is it migrated? `stockd migrate` migrates it"
                ))
            })?;
        refuse_a_newer_schema::<B>(applied.last().copied().unwrap_or(0))?;
        let known: Vec<i64> = <B::Connection as Dialect>::MIGRATIONS
            .iter()
            .map(|(version, _, _)| *version)
            .collect();
        if let Some(unknown) = applied.iter().find(|version| !known.contains(version)) {
            return Err(invariant(format!(
                "the database has migration {unknown}, which this stockd does not know"
            )));
        }
        let missing: Vec<String> = known
            .iter()
            .filter(|version| !applied.contains(version))
            .map(i64::to_string)
            .collect();
        if !missing.is_empty() {
            return Err(invariant(format!(
                "the database lacks migrations {} of this stockd; run `stockd migrate` first",
                missing.join(", ")
            )));
        }
        Ok(())
    }

    async fn newest_applied_migration(&self) -> Result<i64, StoreError> {
        let newest: Option<i64> = statement("SELECT MAX(version) FROM schema_migration")
            .fetch_one_scalar(&mut *self.writer_read_connection().await?)
            .await?;
        Ok(newest.unwrap_or(0))
    }

    /// Each migration in a transaction of its own that starts with the backend's
    /// migration lock, if it has one.
    async fn apply_migrations_in_transactions(&self) -> Result<Vec<i64>, StoreError> {
        let mut applied_now = Vec::new();
        let mut transaction = self.begin_write().await?;
        if let Some(lock) = <B::Connection as Dialect>::MIGRATION_LOCK {
            transaction.execute_script(lock).await?;
        }
        create_migration_table(&mut *transaction).await?;
        transaction.commit().await?;
        for (version, name, sql) in <B::Connection as Dialect>::MIGRATIONS {
            let mut transaction = self.begin_write().await?;
            if let Some(lock) = <B::Connection as Dialect>::MIGRATION_LOCK {
                transaction.execute_script(lock).await?;
            }
            if apply_migration(&mut *transaction, *version, name, sql).await? {
                transaction.commit().await?;
                applied_now.push(*version);
            } else {
                transaction.rollback().await?;
            }
        }
        Ok(applied_now)
    }

    /// Every migration on the session that holds the migration lock (each commits by
    /// itself, as the backend's DDL does).
    async fn apply_migrations_on(&self, holder: &mut B::Pooled) -> Result<Vec<i64>, StoreError> {
        let mut applied_now = Vec::new();
        create_migration_table(&mut **holder).await?;
        for (version, name, sql) in <B::Connection as Dialect>::MIGRATIONS {
            if apply_migration(&mut **holder, *version, name, sql).await? {
                applied_now.push(*version);
            }
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

async fn create_migration_table<C: Dialect>(connection: &mut C) -> Result<(), StoreError> {
    connection
        .execute_script(
            "CREATE TABLE IF NOT EXISTS schema_migration (\
             version BIGINT NOT NULL PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)",
        )
        .await
}

/// Applies one migration unless the database has it; answers whether it applied it.
/// The database naming another migration at its version is refused.
async fn apply_migration<C: Dialect>(
    connection: &mut C,
    version: i64,
    name: &str,
    sql: &'static str,
) -> Result<bool, StoreError> {
    let applied: Option<String> = statement("SELECT name FROM schema_migration WHERE version = $1")
        .bind(version)
        .fetch_optional_scalar(&mut *connection)
        .await?;
    match applied {
        Some(applied_name) if applied_name == name => return Ok(false),
        Some(applied_name) => {
            return Err(invariant(format!(
                "migration {version} is '{applied_name}' in the database but '{name}' in this binary"
            )));
        }
        None => {}
    }
    connection.execute_script(sql).await?;
    statement("INSERT INTO schema_migration (version, name, applied_at) VALUES ($1, $2, $3)")
        .bind(version)
        .bind(name.to_owned())
        .bind(wall_clock_milliseconds())
        .execute(&mut *connection)
        .await?;
    Ok(true)
}

//! The strategy lab (seed 002 七.2, "对比三种实现结果"): the ways to deduct stock the
//! seeds compare, run straight against the database under the `last-unit` and
//! `limited` cases. One of them is wrong on purpose — read, check in the application,
//! write the computed value — and must visibly oversell; that is the point of the lab.
//! It lives here and nowhere near the server.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::report::Latency;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// SELECT, check in the application, then UPDATE to the computed value. Unsafe.
    ReadCheckWrite,
    /// A short transaction: SELECT … FOR UPDATE (SQLite: BEGIN IMMEDIATE), check, UPDATE.
    SelectForUpdate,
    /// One conditional UPDATE … WHERE available >= q, affected rows checked.
    ConditionalUpdate,
    /// Read the version, UPDATE … WHERE version = v, retry a bounded number of times.
    OptimisticVersion,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::ReadCheckWrite,
        Strategy::SelectForUpdate,
        Strategy::ConditionalUpdate,
        Strategy::OptimisticVersion,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::ReadCheckWrite => "read-check-write",
            Strategy::SelectForUpdate => "select-for-update",
            Strategy::ConditionalUpdate => "conditional-update",
            Strategy::OptimisticVersion => "optimistic-version",
        }
    }

    pub fn is_safe(self) -> bool {
        self != Strategy::ReadCheckWrite
    }
}

/// One of the seeds' contention cases.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Case {
    pub name: &'static str,
    pub stock: i64,
    pub requests: u64,
}

pub const LAST_UNIT: Case = Case {
    name: "last-unit",
    stock: 1,
    requests: 100,
};
pub const LIMITED: Case = Case {
    name: "limited",
    stock: 10,
    requests: 1000,
};

/// Attempts of the optimistic strategy before it gives up on a request.
pub const OPTIMISTIC_ATTEMPTS_MAX: u32 = 5;
/// Concurrent requests, each on its own connection from the pool.
pub const CONNECTIONS: u32 = 20;

#[derive(Debug, Clone, Serialize)]
pub struct StrategyResult {
    pub case: &'static str,
    pub strategy: Strategy,
    pub stock: i64,
    pub requests: u64,
    /// Requests the application believed succeeded.
    pub successes: u64,
    /// Successes beyond the stock: units sold that did not exist.
    pub oversold: u64,
    /// Deduction records the database holds.
    pub deduction_records: i64,
    pub final_available: i64,
    pub latency: Latency,
    pub retries: u64,
    /// Lock waits that timed out, deadlocks, SQLite busy: the cost of locking.
    pub lock_errors: u64,
    pub other_errors: u64,
}

impl StrategyResult {
    /// Whether more was sold than there was, by the clients' successes or by what the
    /// database holds: a deduction whose commit went through while its client heard
    /// an error counts in the records, not in the successes.
    pub fn oversold_visibly(&self) -> bool {
        self.oversold > 0 || self.deduction_records > self.stock || self.final_available < 0
    }
}

#[cfg(test)]
mod result_tests {
    use super::*;

    fn result(successes: u64, deduction_records: i64, final_available: i64) -> StrategyResult {
        StrategyResult {
            case: "last unit",
            strategy: Strategy::ConditionalUpdate,
            stock: 10,
            requests: 100,
            successes,
            oversold: successes.saturating_sub(10),
            deduction_records,
            final_available,
            latency: Latency::of_microseconds(Vec::new()),
            retries: 0,
            lock_errors: 0,
            other_errors: 0,
        }
    }

    #[test]
    fn an_oversell_shows_in_the_successes_or_in_the_database() {
        assert!(!result(10, 10, 0).oversold_visibly());
        assert!(result(11, 11, 0).oversold_visibly(), "by the successes");
        assert!(
            result(10, 11, 0).oversold_visibly(),
            "a record whose client heard an error"
        );
        assert!(result(10, 10, -1).oversold_visibly(), "a negative counter");
    }
}

/// What one attempted deduction ended in.
enum Outcome {
    Success,
    Insufficient,
}

#[derive(Default)]
struct Counters {
    retries: AtomicU64,
    lock_errors: AtomicU64,
    other_errors: AtomicU64,
}

fn is_lock_error(error: &sqlx::Error) -> bool {
    matches!(
        store::error::classify(error),
        store::StoreError::Retryable(_)
            | store::StoreError::Deadlock(_)
            | store::StoreError::LockTimeout(_)
    )
}

/// Generates the four strategies for one backend. Each takes a pooled connection for
/// one request and returns what happened.
macro_rules! strategies_for {
    ($module:ident, $database:ty, $begin_write:literal, $for_update:literal, $placeholder:literal) => {
        mod $module {
            use super::*;

            type Pool = sqlx::Pool<$database>;

            pub async fn prepare(pool: &Pool, stock: i64) -> Result<(), sqlx::Error> {
                sqlx::raw_sql(
                    "DROP TABLE IF EXISTS lab_deduction; DROP TABLE IF EXISTS lab_inventory; \
                     CREATE TABLE lab_inventory (sku_id BIGINT PRIMARY KEY, available BIGINT NOT NULL \
                     CHECK (available >= 0), version BIGINT NOT NULL); \
                     CREATE TABLE lab_deduction (request_id VARCHAR(64) PRIMARY KEY, sku_id BIGINT NOT NULL, \
                     quantity BIGINT NOT NULL, status VARCHAR(16) NOT NULL);",
                )
                .execute(pool)
                .await?;
                sqlx::query(concat!("INSERT INTO lab_inventory (sku_id, available, version) VALUES (1, ", $placeholder, ", 0)"))
                    .bind(stock)
                    .execute(pool)
                    .await?;
                Ok(())
            }

            pub async fn totals(pool: &Pool) -> Result<(i64, i64), sqlx::Error> {
                let available: i64 = sqlx::query_scalar("SELECT available FROM lab_inventory WHERE sku_id = 1")
                    .fetch_one(pool)
                    .await?;
                let records: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM lab_deduction WHERE status = 'SUCCESS'")
                    .fetch_one(pool)
                    .await?;
                Ok((available, records))
            }

            async fn record_success(
                executor: impl sqlx::Executor<'_, Database = $database>,
                request_id: &str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(concat!(
                    "INSERT INTO lab_deduction (request_id, sku_id, quantity, status) VALUES (",
                    $placeholder,
                    ", 1, 1, 'SUCCESS')"
                ))
                .bind(request_id)
                .execute(executor)
                .await?;
                Ok(())
            }

            pub async fn deduct(
                strategy: Strategy,
                pool: &Pool,
                request_id: &str,
                think_time: Duration,
                counters: &Counters,
            ) -> Result<Outcome, sqlx::Error> {
                match strategy {
                    Strategy::ReadCheckWrite => {
                        let mut connection = pool.acquire().await?;
                        let available: i64 =
                            sqlx::query_scalar("SELECT available FROM lab_inventory WHERE sku_id = 1")
                                .fetch_one(&mut *connection)
                                .await?;
                        tokio::time::sleep(think_time).await;
                        if available < 1 {
                            return Ok(Outcome::Insufficient);
                        }
                        // The bug: write the value computed from a stale read.
                        sqlx::query(concat!("UPDATE lab_inventory SET available = ", $placeholder, " WHERE sku_id = 1"))
                            .bind(available - 1)
                            .execute(&mut *connection)
                            .await?;
                        record_success(&mut *connection, request_id).await?;
                        Ok(Outcome::Success)
                    }
                    Strategy::SelectForUpdate => {
                        let mut transaction = pool.begin_with($begin_write).await?;
                        let available: i64 = sqlx::query_scalar(concat!(
                            "SELECT available FROM lab_inventory WHERE sku_id = 1",
                            $for_update
                        ))
                        .fetch_one(&mut *transaction)
                        .await?;
                        tokio::time::sleep(think_time).await;
                        if available < 1 {
                            transaction.rollback().await?;
                            return Ok(Outcome::Insufficient);
                        }
                        sqlx::query("UPDATE lab_inventory SET available = available - 1 WHERE sku_id = 1")
                            .execute(&mut *transaction)
                            .await?;
                        record_success(&mut *transaction, request_id).await?;
                        transaction.commit().await?;
                        Ok(Outcome::Success)
                    }
                    Strategy::ConditionalUpdate => {
                        let mut transaction = pool.begin_with($begin_write).await?;
                        let updated = sqlx::query(
                            "UPDATE lab_inventory SET available = available - 1, version = version + 1 \
                             WHERE sku_id = 1 AND available >= 1",
                        )
                        .execute(&mut *transaction)
                        .await?;
                        if updated.rows_affected() != 1 {
                            transaction.rollback().await?;
                            return Ok(Outcome::Insufficient);
                        }
                        record_success(&mut *transaction, request_id).await?;
                        transaction.commit().await?;
                        Ok(Outcome::Success)
                    }
                    Strategy::OptimisticVersion => {
                        for attempt in 0..OPTIMISTIC_ATTEMPTS_MAX {
                            if attempt > 0 {
                                counters.retries.fetch_add(1, Ordering::Relaxed);
                            }
                            let (available, version): (i64, i64) = sqlx::query_as(
                                "SELECT available, version FROM lab_inventory WHERE sku_id = 1",
                            )
                            .fetch_one(pool)
                            .await?;
                            tokio::time::sleep(think_time).await;
                            if available < 1 {
                                return Ok(Outcome::Insufficient);
                            }
                            let mut transaction = pool.begin_with($begin_write).await?;
                            let updated = sqlx::query(concat!(
                                "UPDATE lab_inventory SET available = available - 1, version = version + 1 \
                                 WHERE sku_id = 1 AND version = ",
                                $placeholder,
                                " AND available >= 1"
                            ))
                            .bind(version)
                            .execute(&mut *transaction)
                            .await?;
                            if updated.rows_affected() == 1 {
                                record_success(&mut *transaction, request_id).await?;
                                transaction.commit().await?;
                                return Ok(Outcome::Success);
                            }
                            transaction.rollback().await?;
                        }
                        // Out of attempts: a contention failure, reported as such.
                        Ok(Outcome::Insufficient)
                    }
                }
            }
        }
    };
}

strategies_for!(sqlite_strategies, sqlx::Sqlite, "BEGIN IMMEDIATE", "", "$1");
strategies_for!(
    postgres_strategies,
    sqlx::Postgres,
    "BEGIN",
    " FOR UPDATE",
    "$1"
);
strategies_for!(mysql_strategies, sqlx::MySql, "BEGIN", " FOR UPDATE", "?");

/// The database the lab runs against: its own tables in a scratch file or schema.
pub enum LabDatabase {
    Sqlite {
        pool: sqlx::SqlitePool,
        directory: std::path::PathBuf,
    },
    Postgres {
        pool: sqlx::PgPool,
        url: String,
        schema: String,
    },
    Mysql {
        pool: sqlx::MySqlPool,
        url: String,
        database: String,
    },
}

impl LabDatabase {
    /// `postgres://…` gets a fresh schema on that server, `mysql://…` a fresh database
    /// (its sessions at the server's default isolation, `REPEATABLE READ`); anything
    /// else a scratch SQLite file in WAL mode.
    pub async fn open(database_url: &str) -> Result<LabDatabase, String> {
        if database_url.starts_with("mysql://") || database_url.starts_with("postgres") {
            crate::target::database_on_this_machine(database_url)?;
        }
        let suffix = format!("{:016x}", rand::random::<u64>());
        if database_url.starts_with("mysql://") {
            let database = format!("stockd_lab_{suffix}");
            let url = crate::target::create_mysql_database(database_url, &database).await?;
            let options = <sqlx::mysql::MySqlConnectOptions as std::str::FromStr>::from_str(&url)
                .map_err(|error| error.to_string())?;
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(CONNECTIONS)
                .acquire_timeout(Duration::from_secs(60))
                .after_connect(|connection, _| {
                    Box::pin(async move {
                        sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 5")
                            .execute(connection)
                            .await?;
                        Ok(())
                    })
                })
                .connect_with(options)
                .await
                .map_err(|error| error.to_string())?;
            return Ok(LabDatabase::Mysql {
                pool,
                url: database_url.to_owned(),
                database,
            });
        }
        if database_url.starts_with("postgres://") || database_url.starts_with("postgresql://") {
            let schema = format!("stockd_lab_{suffix}");
            let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(database_url)
                .await
                .map_err(|error| format!("cannot reach PostgreSQL: {error}"))?;
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .execute(&mut connection)
                .await
                .map_err(|error| error.to_string())?;
            let options =
                <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(database_url)
                    .map_err(|error| error.to_string())?
                    .options([("search_path", schema.as_str()), ("lock_timeout", "5000ms")]);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(CONNECTIONS)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(options)
                .await
                .map_err(|error| error.to_string())?;
            Ok(LabDatabase::Postgres {
                pool,
                url: database_url.to_owned(),
                schema,
            })
        } else {
            let directory = std::env::temp_dir().join(format!("stockd-lab-{suffix}"));
            std::fs::create_dir_all(&directory).map_err(|error| error.to_string())?;
            let options = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(directory.join("lab.db"))
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(5));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(CONNECTIONS)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(options)
                .await
                .map_err(|error| error.to_string())?;
            Ok(LabDatabase::Sqlite { pool, directory })
        }
    }

    pub fn backend(&self) -> &'static str {
        match self {
            LabDatabase::Sqlite { .. } => "sqlite",
            LabDatabase::Postgres { .. } => "postgres",
            LabDatabase::Mysql { .. } => "mysql",
        }
    }

    pub async fn close(self) {
        match self {
            LabDatabase::Sqlite { pool, directory } => {
                pool.close().await;
                let _ = std::fs::remove_dir_all(directory);
            }
            LabDatabase::Mysql {
                pool,
                url,
                database,
            } => {
                pool.close().await;
                crate::target::drop_mysql_database(&url, &database).await;
            }
            LabDatabase::Postgres { pool, url, schema } => {
                pool.close().await;
                if let Ok(mut connection) =
                    <sqlx::PgConnection as sqlx::Connection>::connect(&url).await
                {
                    let statement = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
                    let _ = sqlx::query(sqlx::AssertSqlSafe(statement))
                        .execute(&mut connection)
                        .await;
                }
            }
        }
    }

    async fn prepare(&self, stock: i64) -> Result<(), String> {
        match self {
            LabDatabase::Sqlite { pool, .. } => sqlite_strategies::prepare(pool, stock).await,
            LabDatabase::Postgres { pool, .. } => postgres_strategies::prepare(pool, stock).await,
            LabDatabase::Mysql { pool, .. } => mysql_strategies::prepare(pool, stock).await,
        }
        .map_err(|error| error.to_string())
    }

    async fn totals(&self) -> Result<(i64, i64), String> {
        match self {
            LabDatabase::Sqlite { pool, .. } => sqlite_strategies::totals(pool).await,
            LabDatabase::Postgres { pool, .. } => postgres_strategies::totals(pool).await,
            LabDatabase::Mysql { pool, .. } => mysql_strategies::totals(pool).await,
        }
        .map_err(|error| error.to_string())
    }

    async fn deduct(
        &self,
        strategy: Strategy,
        request_id: &str,
        think_time: Duration,
        counters: &Counters,
    ) -> Result<Outcome, sqlx::Error> {
        match self {
            LabDatabase::Sqlite { pool, .. } => {
                sqlite_strategies::deduct(strategy, pool, request_id, think_time, counters).await
            }
            LabDatabase::Postgres { pool, .. } => {
                postgres_strategies::deduct(strategy, pool, request_id, think_time, counters).await
            }
            LabDatabase::Mysql { pool, .. } => {
                mysql_strategies::deduct(strategy, pool, request_id, think_time, counters).await
            }
        }
    }
}

/// Runs one strategy under one case: all requests at once, each on a pooled connection.
pub async fn run(
    database: &Arc<LabDatabase>,
    strategy: Strategy,
    case: Case,
    think_time: Duration,
) -> Result<StrategyResult, String> {
    database.prepare(case.stock).await?;
    let counters = Arc::new(Counters::default());
    let barrier = Arc::new(tokio::sync::Barrier::new(case.requests as usize));
    let mut tasks = Vec::with_capacity(case.requests as usize);
    for index in 0..case.requests {
        let database = Arc::clone(database);
        let counters = Arc::clone(&counters);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let started = Instant::now();
            let outcome = database
                .deduct(strategy, &format!("request-{index}"), think_time, &counters)
                .await;
            (outcome, started.elapsed())
        }));
    }
    let mut successes = 0;
    let mut latencies = Vec::with_capacity(tasks.len());
    for task in tasks {
        let (outcome, elapsed) = task.await.map_err(|error| error.to_string())?;
        latencies.push(elapsed.as_micros().min(u128::from(u64::MAX)) as u64);
        match outcome {
            Ok(Outcome::Success) => successes += 1,
            Ok(Outcome::Insufficient) => {}
            Err(error) if is_lock_error(&error) => {
                counters.lock_errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                counters.other_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let (final_available, deduction_records) = database.totals().await?;
    Ok(StrategyResult {
        case: case.name,
        strategy,
        stock: case.stock,
        requests: case.requests,
        successes,
        oversold: successes.saturating_sub(case.stock as u64),
        deduction_records,
        final_available,
        latency: Latency::of_microseconds(latencies),
        retries: counters.retries.load(Ordering::Relaxed),
        lock_errors: counters.lock_errors.load(Ordering::Relaxed),
        other_errors: counters.other_errors.load(Ordering::Relaxed),
    })
}

/// Every strategy under both cases.
pub async fn run_all(
    database_url: &str,
    think_time: Duration,
) -> Result<(String, Vec<StrategyResult>), String> {
    let database = Arc::new(LabDatabase::open(database_url).await?);
    let backend = database.backend().to_owned();
    let mut results = Vec::new();
    for case in [LAST_UNIT, LIMITED] {
        for strategy in Strategy::ALL {
            results.push(run(&database, strategy, case, think_time).await?);
        }
    }
    if let Ok(database) = Arc::try_unwrap(database) {
        database.close().await;
    }
    Ok((backend, results))
}

pub fn render_table(backend: &str, results: &[StrategyResult]) -> String {
    let mut text = format!(
        "strategy lab on {backend}: {CONNECTIONS} connections, all requests released at once\n\
         {:<10} {:<19} {:>5} {:>9} {:>8} {:>9} {:>8} {:>8} {:>8} {:>7} {:>11}\n",
        "case",
        "strategy",
        "stock",
        "successes",
        "oversold",
        "available",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "retries",
        "lock errors"
    );
    for result in results {
        text.push_str(&format!(
            "{:<10} {:<19} {:>5} {:>9} {:>8} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>7} {:>11}{}\n",
            result.case,
            result.strategy.name(),
            result.stock,
            result.successes,
            result.oversold,
            result.final_available,
            result.latency.p50_milliseconds,
            result.latency.p95_milliseconds,
            result.latency.p99_milliseconds,
            result.retries,
            result.lock_errors,
            if result.oversold_visibly() {
                "  <- OVERSOLD"
            } else {
                ""
            }
        ));
    }
    text
}

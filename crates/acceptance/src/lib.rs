//! The test harness: a fresh database per test (a temporary SQLite file, or a fresh
//! schema on the PostgreSQL server), the real router, engine and store on top of it, a
//! manual clock, and typed request helpers.
//!
//! PostgreSQL tests read `STOCKD_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`), MySQL/MariaDB tests
//! `STOCKD_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306`; each test gets a
//! database of its own there). When no server answers they print a loud notice and pass
//! as skipped — except under `CI=true`, where that is a failure.

pub mod http;
pub mod nats;
pub mod payments;
pub mod redis_server;

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request};
use domain::Timestamp;
use engine::{Engine, EngineConfig, ManualClock};
use http_body_util::BodyExt;
use serde_json::Value;
use sqlx::Connection;
use store::{Store, StoreConfig};
use tower::ServiceExt;

pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306";
pub const ADMIN_TOKEN: &str = "test-admin-token";
/// 2026-01-01T00:00:00Z: every test starts its manual clock here.
pub const START: Timestamp = Timestamp::from_unix_milliseconds(1_767_225_600_000);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    Mysql,
}

pub fn postgres_url() -> String {
    std::env::var("STOCKD_TEST_POSTGRES_URL").unwrap_or_else(|_| DEFAULT_POSTGRES_URL.to_owned())
}

/// The MySQL server's URL, without a database.
pub fn mysql_url() -> String {
    std::env::var("STOCKD_TEST_MYSQL_URL").unwrap_or_else(|_| DEFAULT_MYSQL_URL.to_owned())
}

fn running_in_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| value == "true" || value == "1")
}

impl Backend {
    /// Whether this backend can run here. SQLite always can. For PostgreSQL, a missing
    /// server skips the test with a notice, or fails it under `CI=true`.
    pub async fn available(self) -> bool {
        let (name, url, variable, reached) = match self {
            Backend::Sqlite => return true,
            Backend::Postgres => {
                let url = postgres_url();
                let reached = match sqlx::PgConnection::connect(&url).await {
                    Ok(connection) => connection.close().await.map_err(|error| error.to_string()),
                    Err(error) => Err(error.to_string()),
                };
                ("PostgreSQL", url, "STOCKD_TEST_POSTGRES_URL", reached)
            }
            Backend::Mysql => {
                let url = mysql_url();
                let reached = match sqlx::MySqlConnection::connect(&url).await {
                    Ok(connection) => connection.close().await.map_err(|error| error.to_string()),
                    Err(error) => Err(error.to_string()),
                };
                ("MySQL", url, "STOCKD_TEST_MYSQL_URL", reached)
            }
        };
        let Err(error) = reached else {
            return true;
        };
        let notice = format!(
            "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
             !! SKIPPED: {name} test, no server at {url}: {error}\n\
             !! Start {name} or set {variable}.\n\
             !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
        );
        if running_in_ci() {
            panic!("{notice}CI=true: a skipped {name} test is a failure");
        }
        eprintln!("{notice}");
        false
    }
}

/// Declares each listed `async fn name(backend: Backend)` as a test on SQLite, on
/// PostgreSQL and on MySQL, with the same test names in `sqlite::`, `postgres::` and
/// `mysql::`.
#[macro_export]
macro_rules! mirrored_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::Backend::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if $crate::Backend::Postgres.available().await {
                        super::$name($crate::Backend::Postgres).await
                    }
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if $crate::Backend::Mysql.available().await {
                        super::$name($crate::Backend::Mysql).await
                    }
                }
            )*
        }
    };
}

/// [`mirrored_tests`] for tests that read counters of the process-wide metrics
/// recorder: each runs in a process of its own (`sqlite_alone::`, `postgres_alone::`
/// and `mysql_alone::`), so what tests running beside it count cannot leak into its
/// figures, under `cargo test` as under cargo-nextest.
#[macro_export]
macro_rules! mirrored_tests_alone {
    ($($name:ident),* $(,)?) => {
        mod sqlite_alone {
            $(
                #[test]
                fn $name() {
                    $crate::run_alone(module_path!(), stringify!($name), || {
                        $crate::block_on(super::$name($crate::Backend::Sqlite))
                    });
                }
            )*
        }
        mod postgres_alone {
            $(
                #[test]
                fn $name() {
                    $crate::run_alone(module_path!(), stringify!($name), || {
                        $crate::block_on(async {
                            if $crate::Backend::Postgres.available().await {
                                super::$name($crate::Backend::Postgres).await
                            }
                        })
                    });
                }
            )*
        }
        mod mysql_alone {
            $(
                #[test]
                fn $name() {
                    $crate::run_alone(module_path!(), stringify!($name), || {
                        $crate::block_on(async {
                            if $crate::Backend::Mysql.available().await {
                                super::$name($crate::Backend::Mysql).await
                            }
                        })
                    });
                }
            )*
        }
    };
}

/// Set in a test binary re-run for one test by [`run_alone`].
const ALONE_VARIABLE: &str = "STOCKD_TEST_ALONE";

/// Runs `test` when this process runs no other test (cargo-nextest's process per test,
/// or a re-run by this function); otherwise runs this binary again for this one test
/// and fails when that run does not pass exactly one test.
pub fn run_alone(module: &str, name: &str, test: impl FnOnce()) {
    let own_process = std::env::var("NEXTEST_EXECUTION_MODE").as_deref() == Ok("process-per-test")
        || std::env::var_os(ALONE_VARIABLE).is_some();
    if own_process {
        test();
        return;
    }
    // libtest names tests by their path inside the crate, without the crate's name.
    let inside_crate = module.split_once("::").map_or(module, |(_, rest)| rest);
    let filter = format!("{inside_crate}::{name}");
    let binary = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(binary)
        .args([
            filter.as_str(),
            "--exact",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(ALONE_VARIABLE, "1")
        .output()
        .expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{filter} in a process of its own:\n{stdout}\n{stderr}"
    );
}

/// Runs a test's future on a runtime like `#[tokio::test(flavor = "multi_thread")]`'s.
pub fn block_on<Test: std::future::Future<Output = ()>>(test: Test) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a test runtime")
        .block_on(test);
}

/// A database that exists for one test and is removed when the last handle drops.
#[derive(Debug)]
pub struct TestDatabase {
    pub backend: Backend,
    /// The lock wait bound every instance on this database uses.
    pub lock_timeout_milliseconds: u64,
    /// The statement bound every instance on this database uses.
    pub statement_timeout_milliseconds: u64,
    pub url: String,
    pub schema: Option<String>,
    sqlite_directory: Option<PathBuf>,
    /// The default service key's secret, created by the first instance.
    pub service_token: tokio::sync::OnceCell<String>,
    /// The bounds every instance's store enforces.
    pub limits: store::StoreLimits,
}

fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

impl RawConnection {
    /// The database's plan for `statement`, as text: SQLite's `EXPLAIN QUERY PLAN`
    /// details, PostgreSQL's `EXPLAIN` lines, MySQL's `EXPLAIN` access type and key.
    pub async fn plan_of(&mut self, statement: &str) -> String {
        use sqlx::Row;
        match self {
            RawConnection::Sqlite(connection) => {
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "EXPLAIN QUERY PLAN {statement}"
                )))
                .fetch_all(connection)
                .await
                .expect("explain");
                rows.iter()
                    .map(|row| row.get::<String, _>("detail"))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
            RawConnection::Postgres(connection) => {
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {statement}")))
                    .fetch_all(connection)
                    .await
                    .expect("explain");
                rows.iter()
                    .map(|row| row.get::<String, _>(0))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
            RawConnection::Mysql(connection) => {
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {statement}")))
                    .fetch_all(connection)
                    .await
                    .expect("explain");
                rows.iter()
                    .map(|row| {
                        let access: Option<String> = row.try_get("type").ok().flatten();
                        let key: Option<String> = row.try_get("key").ok().flatten();
                        let possible: Option<String> = row.try_get("possible_keys").ok().flatten();
                        let extra: Option<String> = row.try_get("Extra").ok().flatten();
                        format!(
                            "type={} key={} possible_keys={} extra={}",
                            access.unwrap_or_default(),
                            key.unwrap_or_default(),
                            possible.unwrap_or_default(),
                            extra.unwrap_or_default()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        }
    }
}

impl TestDatabase {
    pub async fn create(backend: Backend) -> TestDatabase {
        match backend {
            Backend::Sqlite => {
                let directory =
                    std::env::temp_dir().join(format!("stockd-test-{}", random_suffix()));
                std::fs::create_dir_all(&directory).expect("temporary directory");
                let url = format!("sqlite://{}", directory.join("stockd.db").display());
                TestDatabase {
                    backend,
                    lock_timeout_milliseconds: 2_000,
                    statement_timeout_milliseconds: StoreConfig::new("")
                        .statement_timeout_milliseconds,
                    url,
                    schema: None,
                    sqlite_directory: Some(directory),
                    service_token: tokio::sync::OnceCell::new(),
                    limits: store::StoreLimits::default(),
                }
            }
            Backend::Postgres => {
                let url = postgres_url();
                let schema = format!("stockd_test_{}", random_suffix());
                let mut connection = sqlx::PgConnection::connect(&url)
                    .await
                    .expect("PostgreSQL reachable");
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                    .execute(&mut connection)
                    .await
                    .expect("create test schema");
                let _ = connection.close().await;
                TestDatabase {
                    backend,
                    lock_timeout_milliseconds: 2_000,
                    statement_timeout_milliseconds: StoreConfig::new("")
                        .statement_timeout_milliseconds,
                    url,
                    schema: Some(schema),
                    sqlite_directory: None,
                    service_token: tokio::sync::OnceCell::new(),
                    limits: store::StoreLimits::default(),
                }
            }
            Backend::Mysql => {
                let server = mysql_url();
                let database = format!("stockd_test_{}", random_suffix());
                let mut connection = sqlx::MySqlConnection::connect(&server)
                    .await
                    .expect("MySQL reachable");
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "CREATE DATABASE {database} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
                )))
                .execute(&mut connection)
                .await
                .expect("create test database");
                let _ = connection.close().await;
                TestDatabase {
                    backend,
                    lock_timeout_milliseconds: 2_000,
                    statement_timeout_milliseconds: StoreConfig::new("")
                        .statement_timeout_milliseconds,
                    url: format!("{}/{database}", server.trim_end_matches('/')),
                    schema: Some(database),
                    sqlite_directory: None,
                    service_token: tokio::sync::OnceCell::new(),
                    limits: store::StoreLimits::default(),
                }
            }
        }
    }

    pub fn store_config(&self) -> StoreConfig {
        let mut config = StoreConfig::new(&self.url);
        if self.backend == Backend::Postgres {
            config.postgres_schema = self.schema.clone();
        }
        config.pool_size = 8;
        config.lock_timeout_milliseconds = self.lock_timeout_milliseconds;
        config.statement_timeout_milliseconds = self.statement_timeout_milliseconds;
        config.limits = self.limits;
        // Tests send bursts of a thousand requests at once; let them queue for a
        // connection rather than fail with `unavailable`.
        config.acquire_timeout_milliseconds = 120_000;
        config
    }

    pub async fn connect(&self) -> Store {
        let store = Store::connect(&self.store_config())
            .await
            .expect("connect test database");
        store.migrate().await.expect("migrate test database");
        store
    }
}

/// A raw connection to a test database, for arranging what the API cannot (tampering
/// with a counter, holding a lock) and for reading rows directly.
pub enum RawConnection {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
    Mysql(sqlx::MySqlConnection),
}

impl RawConnection {
    /// Runs one statement; returns the affected-row count or the database's error text.
    pub async fn execute(&mut self, statement: &str) -> Result<u64, String> {
        let statement = sqlx::AssertSqlSafe(statement.to_owned());
        match self {
            RawConnection::Sqlite(connection) => sqlx::query(statement)
                .execute(connection)
                .await
                .map(|result| result.rows_affected())
                .map_err(|error| error.to_string()),
            RawConnection::Postgres(connection) => sqlx::query(statement)
                .execute(connection)
                .await
                .map(|result| result.rows_affected())
                .map_err(|error| error.to_string()),
            // The text protocol: `BEGIN` and other statements MySQL cannot prepare.
            RawConnection::Mysql(connection) => sqlx::raw_sql(statement)
                .execute(connection)
                .await
                .map(|result| result.rows_affected())
                .map_err(|error| error.to_string()),
        }
    }

    /// The text column of every row `query` answers, in its order (NULL as `None`).
    pub async fn texts(&mut self, query: &str) -> Vec<Option<String>> {
        let query = sqlx::AssertSqlSafe(query.to_owned());
        match self {
            RawConnection::Sqlite(connection) => sqlx::query_scalar(query)
                .fetch_all(connection)
                .await
                .expect("a text query"),
            RawConnection::Postgres(connection) => sqlx::query_scalar(query)
                .fetch_all(connection)
                .await
                .expect("a text query"),
            RawConnection::Mysql(connection) => sqlx::query_scalar(query)
                .fetch_all(connection)
                .await
                .expect("a text query"),
        }
    }
}

impl TestDatabase {
    /// A connection of its own to this PostgreSQL test database, in the test's schema,
    /// for the PostgreSQL-only tests (plans, functions, the WAL).
    pub async fn postgres_connection(&self) -> sqlx::PgConnection {
        assert_eq!(
            self.backend,
            Backend::Postgres,
            "a PostgreSQL test database"
        );
        let mut connection = sqlx::PgConnection::connect(&self.url)
            .await
            .expect("raw PostgreSQL connection");
        let schema = self
            .schema
            .as_deref()
            .expect("PostgreSQL tests use a schema");
        sqlx::query(sqlx::AssertSqlSafe(format!("SET search_path TO {schema}")))
            .execute(&mut connection)
            .await
            .expect("set search_path");
        connection
    }

    pub async fn raw_connection(&self) -> RawConnection {
        match self.backend {
            Backend::Sqlite => RawConnection::Sqlite(
                sqlx::SqliteConnection::connect(&self.url)
                    .await
                    .expect("raw SQLite connection"),
            ),
            Backend::Postgres => RawConnection::Postgres(self.postgres_connection().await),
            Backend::Mysql => RawConnection::Mysql(
                sqlx::MySqlConnection::connect(&self.url)
                    .await
                    .expect("raw MySQL connection"),
            ),
        }
    }

    /// A connection to read plans on: PostgreSQL is told to avoid a sequential scan,
    /// so a plan shows whether an index can answer at all (a near-empty table is
    /// otherwise scanned whatever its indexes).
    pub async fn plan_connection(&self) -> RawConnection {
        let mut connection = self.raw_connection().await;
        if self.backend == Backend::Postgres {
            connection
                .execute("SET enable_seqscan = off")
                .await
                .expect("turn sequential scans off");
        }
        connection
    }

    /// Waits until another backend waits for a lock `holder` holds (PostgreSQL). On
    /// SQLite writers queue inside the process, where there is nothing to observe:
    /// returns at once.
    pub async fn wait_until_blocked_by(&self, holder: &mut RawConnection) {
        self.wait_until_blocked_for(holder, std::time::Duration::ZERO)
            .await
    }

    /// [`TestDatabase::wait_until_blocked_by`], until the waiting statement has waited
    /// at least `minimum` by the database's own clock (PostgreSQL and MySQL).
    pub async fn wait_until_blocked_for(
        &self,
        holder: &mut RawConnection,
        minimum: std::time::Duration,
    ) {
        self.wait_until_waiting(holder, minimum, 1).await
    }

    /// [`TestDatabase::wait_until_blocked_by`], until `waiters` statements wait.
    pub async fn wait_until_blocking(&self, holder: &mut RawConnection, waiters: i64) {
        self.wait_until_waiting(holder, std::time::Duration::ZERO, waiters)
            .await
    }

    async fn wait_until_waiting(
        &self,
        holder: &mut RawConnection,
        minimum: std::time::Duration,
        waiters: i64,
    ) {
        let minimum_milliseconds = i64::try_from(minimum.as_millis()).unwrap_or(i64::MAX);
        if let RawConnection::Mysql(holder) = holder {
            return self
                .wait_until_blocked_by_mysql(holder, minimum_milliseconds, waiters)
                .await;
        }
        let RawConnection::Postgres(holder) = holder else {
            return;
        };
        let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *holder)
            .await
            .expect("the holder's backend pid");
        let observer = sqlx::PgPool::connect(&self.url)
            .await
            .expect("observer connection");
        let observer = &observer;
        wait_until_async("another backend waits for the held lock", || async move {
            sqlx::query_scalar(
                // Waiters queue behind one another on a row: the second waits for the
                // first (its tuple lock), not for the holder, so waiters are counted
                // through the chain.
                "WITH RECURSIVE blocked(pid) AS ( \
                 SELECT pid FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)) \
                 AND clock_timestamp() - query_start >= $2 * INTERVAL '1 millisecond' \
                 UNION SELECT activity.pid FROM pg_stat_activity activity, blocked \
                 WHERE blocked.pid = ANY (pg_blocking_pids(activity.pid))) \
                 SELECT COUNT(*) >= $3 FROM blocked",
            )
            .bind(holder_pid)
            .bind(minimum_milliseconds)
            .bind(waiters)
            .fetch_one(observer)
            .await
            .expect("observe lock waits")
        })
        .await;
        observer.close().await;
    }

    /// [`TestDatabase::wait_until_blocked_by`] on MySQL/MariaDB: a session of this test's
    /// database other than the holder and the observer is running a statement (the
    /// only statement that can run long in a test is one waiting for a lock). InnoDB's
    /// lock tables (`INNODB_TRX`, `INNODB_LOCK_WAITS`) missed waits here; the session
    /// list does not.
    async fn wait_until_blocked_by_mysql(
        &self,
        holder: &mut sqlx::MySqlConnection,
        minimum_milliseconds: i64,
        waiters: i64,
    ) {
        let holder_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *holder)
            .await
            .expect("the holder's connection id");
        let database = self.schema.clone().expect("MySQL tests use a database");
        let mut observer = sqlx::MySqlConnection::connect(&self.url)
            .await
            .expect("observer connection");
        let observer = &mut observer;
        let database = &database;
        for _ in 0..12_000 {
            let running: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                 WHERE DB = ? AND ID NOT IN (?, CONNECTION_ID()) AND COMMAND IN ('Query', 'Execute') \
                 AND TIME_MS > ?",
            )
            .bind(database.as_str())
            .bind(holder_id)
            .bind(minimum_milliseconds.max(50))
            .fetch_one(&mut *observer)
            .await
            .expect("observe running statements");
            if running >= waiters {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("gave up waiting until another session waits for the held lock");
    }

    /// Holds the write lock on `sku`'s stock row in the default warehouse (SQLite: the
    /// whole database's write lock) until the returned connection runs `ROLLBACK`.
    pub async fn hold_stock_row_lock(&self, sku: &str) -> RawConnection {
        let mut connection = self.raw_connection().await;
        match self.backend {
            Backend::Sqlite => {
                connection
                    .execute("BEGIN IMMEDIATE")
                    .await
                    .expect("take the write lock");
            }
            Backend::Postgres | Backend::Mysql => {
                connection.execute("BEGIN").await.expect("begin");
                let statement = format!(
                    "SELECT available FROM stock WHERE sku = '{sku}' AND warehouse = 'default' FOR UPDATE"
                );
                connection
                    .execute(&statement)
                    .await
                    .expect("lock the stock row");
            }
        }
        connection
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if let Some(directory) = &self.sqlite_directory {
            let _ = std::fs::remove_dir_all(directory);
        }
        if let Some(schema) = self.schema.take() {
            let url = match self.backend {
                Backend::Mysql => mysql_url(),
                _ => self.url.clone(),
            };
            let backend = self.backend;
            // Drop runs inside the test's runtime, which cannot block on itself: clean
            // up from a thread with its own small runtime.
            let cleanup = std::thread::spawn(move || {
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                runtime.block_on(async move {
                    if backend == Backend::Mysql {
                        if let Ok(mut connection) = sqlx::MySqlConnection::connect(&url).await {
                            let statement = format!("DROP DATABASE IF EXISTS {schema}");
                            let _ = sqlx::query(sqlx::AssertSqlSafe(statement))
                                .execute(&mut connection)
                                .await;
                            let _ = connection.close().await;
                        }
                        return;
                    }
                    if let Ok(mut connection) = sqlx::PgConnection::connect(&url).await {
                        let statement = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
                        let _ = sqlx::query(sqlx::AssertSqlSafe(statement))
                            .execute(&mut connection)
                            .await;
                        let _ = connection.close().await;
                    }
                });
            });
            let _ = cleanup.join();
        }
    }
}

/// The HTTP settings of a test whose requests are cut after `milliseconds` (answered
/// 503 while their work goes on).
pub fn http_with_request_bound(milliseconds: u64) -> api::http::HttpConfig {
    api::http::HttpConfig {
        request_timeout_milliseconds: milliseconds,
        ..api::http::HttpConfig::default()
    }
}

/// The engine settings tests run with: waits long enough that a burst of a thousand
/// requests on one row never turns into `request_in_progress` by timing alone.
pub fn test_engine_config() -> EngineConfig {
    EngineConfig {
        idempotency_wait_milliseconds: 120_000,
        ..EngineConfig::default()
    }
}

/// One stockd instance (router, engine, store) on a test database.
#[derive(Clone)]
pub struct TestApp {
    pub router: Router,
    pub engine: Engine,
    pub store: Store,
    pub clock: ManualClock,
    pub database: Arc<TestDatabase>,
    /// The secret of the service key (shop `default`) calls present by default.
    pub service_token: Arc<str>,
}

/// A response as a client sees it.
#[derive(Debug, Clone)]
pub struct TestResponse {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
}

impl TestResponse {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|error| panic!("response is not JSON ({error}): {}", self.body))
    }

    /// The problem document's `code`, or `None` for a success.
    pub fn code(&self) -> Option<String> {
        serde_json::from_str::<Value>(&self.body)
            .ok()
            .and_then(|body| body.get("code").and_then(Value::as_str).map(str::to_owned))
    }

    /// A header's value, when present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|value| value == "true")
    }

    pub fn content_type(&self) -> String {
        self.headers
            .get("content-type")
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    }
}

/// Which credential a call presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// The instance's service key of shop `default` (a checkout backend): what most
    /// calls of the reservation, order and cart suites are made with.
    ServiceKey,
    /// This bearer token (the admin's, an operator's, another service key's).
    Bearer(String),
    /// No `Authorization` header at all.
    Anonymous,
}

/// What to send. Built with the helpers below; `send` does the rest.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: Method,
    pub path: String,
    pub idempotency_key: Option<String>,
    pub credential: Credential,
    pub body: Option<String>,
    pub content_type: Option<String>,
    /// The payment gateway's webhook signature header (`Stripe-Signature`), if any.
    pub signature: Option<String>,
    /// `Stockd-Consistency-Token`, for display reads.
    pub consistency_token: Option<String>,
    /// Any other headers (`Prefer`, …), in order.
    pub headers: Vec<(String, String)>,
}

impl Call {
    pub fn new(method: Method, path: impl Into<String>) -> Call {
        Call {
            method,
            path: path.into(),
            idempotency_key: None,
            credential: Credential::ServiceKey,
            body: None,
            content_type: None,
            signature: None,
            consistency_token: None,
            headers: Vec::new(),
        }
    }

    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Call {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn consistency_token(mut self, token: impl Into<String>) -> Call {
        self.consistency_token = Some(token.into());
        self
    }

    pub fn get(path: impl Into<String>) -> Call {
        Call::new(Method::GET, path)
    }

    pub fn post(path: impl Into<String>) -> Call {
        Call::new(Method::POST, path)
    }

    pub fn put(path: impl Into<String>) -> Call {
        Call::new(Method::PUT, path)
    }

    pub fn patch(path: impl Into<String>) -> Call {
        Call::new(Method::PATCH, path)
    }

    pub fn key(mut self, key: impl Into<String>) -> Call {
        self.idempotency_key = Some(key.into());
        self
    }

    pub fn admin(self) -> Call {
        self.bearer(ADMIN_TOKEN)
    }

    pub fn bearer(mut self, token: &str) -> Call {
        self.credential = Credential::Bearer(token.to_owned());
        self
    }

    /// No credential at all.
    pub fn anonymous(mut self) -> Call {
        self.credential = Credential::Anonymous;
        self
    }

    pub fn json(mut self, body: &Value) -> Call {
        self.body = Some(body.to_string());
        self.content_type = Some("application/json".to_owned());
        self
    }

    /// A body sent verbatim, for malformed-input tests.
    pub fn raw(mut self, body: impl Into<String>, content_type: Option<&str>) -> Call {
        self.body = Some(body.into());
        self.content_type = content_type.map(str::to_owned);
        self
    }
}

fn unique_key(prefix: &str) -> String {
    format!("{prefix}-{}", random_suffix())
}

impl TestApp {
    pub async fn spawn(backend: Backend) -> TestApp {
        TestApp::spawn_with(backend, test_engine_config()).await
    }

    pub async fn spawn_with(backend: Backend, config: EngineConfig) -> TestApp {
        TestApp::spawn_with_lock_timeout(backend, config, 2_000).await
    }

    /// An instance whose store enforces `limits` (open holds per shopper).
    pub async fn spawn_with_limits(backend: Backend, limits: store::StoreLimits) -> TestApp {
        let mut database = TestDatabase::create(backend).await;
        database.limits = limits;
        TestApp::on(
            Arc::new(database),
            ManualClock::new(START),
            test_engine_config(),
        )
        .await
    }

    /// An instance whose HTTP layer has these bounds (request rate, body and request
    /// timeouts).
    pub async fn spawn_with_http(backend: Backend, http: &api::http::HttpConfig) -> TestApp {
        let database = Arc::new(TestDatabase::create(backend).await);
        TestApp::on_with_http(
            database,
            ManualClock::new(START),
            test_engine_config(),
            http,
        )
        .await
    }

    /// An instance whose lock waits (PostgreSQL `lock_timeout`, SQLite `busy_timeout`)
    /// end after `lock_timeout_milliseconds`.
    pub async fn spawn_with_lock_timeout(
        backend: Backend,
        config: EngineConfig,
        lock_timeout_milliseconds: u64,
    ) -> TestApp {
        let mut database = TestDatabase::create(backend).await;
        database.lock_timeout_milliseconds = lock_timeout_milliseconds;
        let database = Arc::new(database);
        let clock = ManualClock::new(START);
        TestApp::on(database, clock, config).await
    }

    /// An instance on an existing database, as a second process would be; creates
    /// the default service key the first time.
    pub async fn on(
        database: Arc<TestDatabase>,
        clock: ManualClock,
        config: EngineConfig,
    ) -> TestApp {
        TestApp::on_with_http(database, clock, config, &api::http::HttpConfig::default()).await
    }

    /// [`TestApp::on`] with the HTTP layer's bounds given.
    pub async fn on_with_http(
        database: Arc<TestDatabase>,
        clock: ManualClock,
        config: EngineConfig,
        http: &api::http::HttpConfig,
    ) -> TestApp {
        let store = database.connect().await;
        let engine = Engine::new(
            store.clone(),
            Arc::new(clock.clone()),
            api::renderer(),
            config,
        );
        engine
            .configure_admin_token(&domain::Secret::new(ADMIN_TOKEN))
            .expect("the test admin token is a valid bearer token");
        let router = api::app(api::AppState::new(
            engine.clone(),
            Some(api::metrics::install_recorder()),
            http,
        ));
        let mut app = TestApp {
            router,
            engine,
            store,
            clock,
            database: Arc::clone(&database),
            service_token: Arc::from(""),
        };
        let token = database
            .service_token
            .get_or_init(|| async { app.create_service_key("default", "test-checkout").await })
            .await;
        app.service_token = Arc::from(token.as_str());
        app
    }

    /// Another stockd instance on the same database and clock.
    pub async fn another_instance(&self) -> TestApp {
        TestApp::on(
            Arc::clone(&self.database),
            self.clock.clone(),
            test_engine_config(),
        )
        .await
    }

    /// This instance, with calls made by default as a new service key of `shop` (the
    /// checkout backend of another shop).
    pub async fn as_service_of(&self, shop: &str) -> TestApp {
        let token = self
            .create_service_key(shop, &format!("{shop}-checkout"))
            .await;
        TestApp {
            service_token: Arc::from(token.as_str()),
            ..self.clone()
        }
    }

    /// The principal calls are made as by default (this instance's service key).
    pub async fn service_principal(&self) -> domain::Principal {
        self.engine
            .authenticate(&self.service_token)
            .await
            .expect("authenticate")
            .expect("the test's service key is known")
    }

    /// `key` as stored for calls made with the default credential: records are kept
    /// per (principal, key).
    pub async fn stored_key(&self, key: &str) -> String {
        format!("{} {key}", self.service_principal().await.scope())
    }

    /// Creates a service key of `shop` as the admin; returns its secret.
    pub async fn create_service_key(&self, shop: &str, name: &str) -> String {
        let response = self
            .send(
                Call::post("/v1/admin/service-keys")
                    .admin()
                    .key(unique_key("service-key"))
                    .json(&serde_json::json!({"shop": shop, "name": name})),
            )
            .await;
        assert_eq!(response.status, 201, "create service key: {response:?}");
        response.json()["secret"]
            .as_str()
            .expect("secret")
            .to_owned()
    }

    /// Stops this instance (closing its connections) and starts a new one on the same
    /// database, as a process restart would.
    pub async fn restart(self) -> TestApp {
        let TestApp {
            store,
            clock,
            database,
            ..
        } = self;
        store.close().await;
        TestApp::on(database, clock, test_engine_config()).await
    }

    /// The instance's (manual) time.
    pub fn clock_now(&self) -> Timestamp {
        engine::Clock::now(&self.clock)
    }

    /// Sets the test clock to this machine's, the database server's: a later
    /// [`TestApp::clock_runs_ahead_of_the_database`] then puts it ahead of the
    /// database's. (Tests' clocks start at [`START`], far behind it.)
    pub fn clock_at_the_databases(&self) {
        self.clock.set(engine::Clock::now(&engine::SystemClock));
    }

    /// Moves the test clock (shared by every instance of this app) `seconds` on while
    /// the database server's moves on by the test's milliseconds only, and has this
    /// instance sample how far its clock runs ahead, as its database activity worker
    /// does (`Engine::held_back_now`).
    pub async fn clock_runs_ahead_of_the_database(&self, seconds: i64) {
        self.clock.advance_seconds(seconds);
        self.engine
            .database_activity_step()
            .await
            .expect("database activity sample");
    }

    pub fn backend(&self) -> Backend {
        self.database.backend
    }

    pub async fn send(&self, call: Call) -> TestResponse {
        let mut request = Request::builder().method(call.method).uri(&call.path);
        if let Some(key) = &call.idempotency_key {
            request = request.header("idempotency-key", key);
        }
        match &call.credential {
            Credential::ServiceKey => {
                request = request.header("authorization", format!("Bearer {}", self.service_token));
            }
            Credential::Bearer(token) => {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            Credential::Anonymous => {}
        }
        if let Some(content_type) = &call.content_type {
            request = request.header("content-type", content_type);
        }
        if let Some(signature) = &call.signature {
            request = request.header("stripe-signature", signature);
        }
        if let Some(token) = &call.consistency_token {
            request = request.header("stockd-consistency-token", token);
        }
        for (name, value) in &call.headers {
            request = request.header(name, value);
        }
        let request = request
            .body(call.body.map_or_else(Body::empty, Body::from))
            .expect("a well-formed test request");
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("the router is infallible");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("response body")
            .to_bytes();
        TestResponse {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    /// Creates (or updates) a SKU with a title and a price.
    pub async fn create_sku(&self, sku: &str) -> TestResponse {
        let response = self
            .send(
                Call::put(format!("/v1/skus/{sku}"))
                    .admin()
                    .key(unique_key("sku"))
                    .json(&serde_json::json!({"title": format!("Test {sku}"), "price": 100, "currency": "CNY"})),
            )
            .await;
        assert!(
            response.status == 201 || response.status == 200,
            "create sku: {response:?}"
        );
        response
    }

    /// Receives `quantity` units into the default warehouse (or `warehouse`).
    pub async fn receive(&self, sku: &str, quantity: i64) -> TestResponse {
        self.receive_in(sku, quantity, None).await
    }

    pub async fn receive_in(
        &self,
        sku: &str,
        quantity: i64,
        warehouse: Option<&str>,
    ) -> TestResponse {
        let mut body = serde_json::json!({"kind": "receive", "quantity": quantity});
        if let Some(warehouse) = warehouse {
            body["warehouse"] = Value::from(warehouse);
        }
        let response = self
            .send(
                Call::post(format!("/v1/skus/{sku}/stock-movements"))
                    .admin()
                    .key(unique_key("receive"))
                    .json(&body),
            )
            .await;
        assert_eq!(response.status, 201, "receive: {response:?}");
        response
    }

    /// A SKU with `quantity` units in the default warehouse.
    pub async fn stocked_sku(&self, sku: &str, quantity: i64) {
        self.create_sku(sku).await;
        if quantity > 0 {
            self.receive(sku, quantity).await;
        }
    }

    /// `POST /v1/reservations` with one line per `(sku, quantity)`.
    pub async fn reserve(&self, key: &str, lines: &[(&str, i64)]) -> TestResponse {
        let lines: Vec<Value> = lines
            .iter()
            .map(|(sku, quantity)| serde_json::json!({"sku": sku, "quantity": quantity}))
            .collect();
        self.send(
            Call::post("/v1/reservations")
                .key(key)
                .json(&serde_json::json!({"lines": lines})),
        )
        .await
    }

    pub async fn confirm(&self, reservation_id: &str, key: &str) -> TestResponse {
        self.send(Call::post(format!("/v1/reservations/{reservation_id}/confirm")).key(key))
            .await
    }

    pub async fn release(&self, reservation_id: &str, key: &str) -> TestResponse {
        self.send(Call::post(format!("/v1/reservations/{reservation_id}/release")).key(key))
            .await
    }

    pub async fn sku(&self, sku: &str) -> Value {
        let response = self.send(Call::get(format!("/v1/skus/{sku}"))).await;
        assert_eq!(response.status, 200, "get sku: {response:?}");
        response.json()
    }

    /// `(available, reserved)` of a SKU over all warehouses.
    pub async fn counters(&self, sku: &str) -> (i64, i64) {
        let body = self.sku(sku).await;
        (
            body["available"].as_i64().expect("available"),
            body["reserved"].as_i64().expect("reserved"),
        )
    }

    pub async fn audit(&self) -> Value {
        let response = self.send(Call::get("/v1/audit").admin()).await;
        assert_eq!(response.status, 200, "audit: {response:?}");
        response.json()
    }

    pub async fn assert_audit_clean(&self) {
        let audit = self.audit().await;
        assert_eq!(audit["ok"], true, "audit found differences: {audit:#}");
    }

    /// Every row of every table, for proving a refused request changed nothing.
    pub async fn contents(&self) -> String {
        self.store.contents().await.expect("read database contents")
    }

    /// Every row of every table but the idempotency records: a stored refusal adds its
    /// record and nothing else.
    pub async fn contents_except_idempotency_records(&self) -> String {
        let contents = self.contents().await;
        contents
            .split("idempotency_record\n")
            .next()
            .unwrap_or_default()
            .to_owned()
    }

    /// Numbers every outbox event committed so far, as the outbox worker does on its
    /// own (tests run no workers).
    pub async fn sequence_all_events(&self) {
        for _ in 0..1_000 {
            if self.engine.sequence_step().await.expect("sequencer step") == 0 {
                return;
            }
        }
        panic!("the sequencer kept finding events");
    }

    /// Every event the admin's feed shows, after numbering what committed.
    pub async fn all_events(&self) -> Vec<Value> {
        self.sequence_all_events().await;
        let mut events = Vec::new();
        let mut cursor = "0".to_owned();
        for _ in 0..1_000 {
            let page = self
                .send(Call::get(format!("/v1/events?after={cursor}&limit=1000")).admin())
                .await;
            assert_eq!(page.status, 200, "{page:?}");
            let page = page.json();
            let found = page["events"].as_array().expect("events").clone();
            cursor = page["next_cursor"].as_str().expect("cursor").to_owned();
            if found.is_empty() {
                return events;
            }
            events.extend(found);
        }
        panic!("the feed never ended");
    }

    /// Counts ledger rows of `kind` for `sku`, straight from the database.
    pub async fn ledger_rows(&self, sku: &str, kind: &str) -> i64 {
        let contents = self.contents().await;
        let ledger = contents
            .split("stock_ledger\n")
            .nth(1)
            .and_then(|rest| rest.split("idempotency_record\n").next())
            .unwrap_or_default();
        i64::try_from(
            ledger
                .lines()
                .filter(|row| {
                    let cells: Vec<&str> = row.split('|').collect();
                    cells.get(1) == Some(&sku) && cells.get(3) == Some(&kind)
                })
                .count(),
        )
        .unwrap_or(i64::MAX)
    }
}

/// Waits until `condition` holds. The bound only keeps a broken test from hanging; a
/// healthy run meets the condition in milliseconds.
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    wait_until_async(what, || std::future::ready(condition())).await;
}

/// Waits until `condition` holds, polling it every 5 ms for up to a minute: for states
/// that nothing notifies, seen only through the database, over HTTP or in another
/// process. The bound only turns a hang into a failure; no test passes by timing.
pub async fn wait_until_async<Condition, Check>(what: &str, mut condition: Condition)
where
    Condition: FnMut() -> Check,
    Check: std::future::Future<Output = bool>,
{
    for _ in 0..12_000 {
        if condition().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("gave up waiting until {what}");
}

/// A loopback port nothing listens on now (for a server a test starts itself).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// Waits until something accepts connections on this loopback port.
pub async fn wait_until_listening(what: &str, port: u16) {
    wait_until_async(what, || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
}

/// A product to create in tests.
pub struct ProductSpec<'a> {
    pub shop: &'a str,
    pub title: &'a str,
    pub image: Option<&'a str>,
    pub category: &'a str,
    pub supplier: &'a str,
    pub skus: &'a [&'a str],
}

impl<'a> ProductSpec<'a> {
    /// A complete product (title, image, price) of `shop` in category `dairy`.
    pub fn complete(shop: &'a str, skus: &'a [&'a str]) -> ProductSpec<'a> {
        ProductSpec {
            shop,
            title: "Test product",
            image: Some("https://images.example.com/test.jpg"),
            category: "dairy",
            supplier: "test-supplier",
            skus,
        }
    }
}

impl TestApp {
    /// Creates a product as the admin; returns its id.
    pub async fn create_product(&self, spec: ProductSpec<'_>) -> String {
        let skus: Vec<Value> = spec
            .skus
            .iter()
            .map(|sku| serde_json::json!({"sku": sku, "price": 250, "currency": "CNY", "spec": "1 unit"}))
            .collect();
        let mut body = serde_json::json!({
            "title": spec.title,
            "category": spec.category,
            "supplier": spec.supplier,
            "shop": spec.shop,
            "skus": skus,
        });
        if let Some(image) = spec.image {
            body["image_url"] = Value::from(image);
        }
        let response = self
            .send(
                Call::post("/v1/products")
                    .admin()
                    .key(unique_key("product"))
                    .json(&body),
            )
            .await;
        assert_eq!(response.status, 201, "create product: {response:?}");
        response.json()["product_id"]
            .as_str()
            .expect("product id")
            .to_owned()
    }

    /// `POST /v1/admin/shelf` with `token` (the admin's when `None`).
    pub async fn shelf(&self, token: Option<&str>, body: Value) -> TestResponse {
        let call = Call::post("/v1/admin/shelf")
            .key(unique_key("shelf"))
            .json(&body);
        let call = match token {
            Some(token) => call.bearer(token),
            None => call.admin(),
        };
        self.send(call).await
    }

    /// Creates an operator of `shop`; returns its token.
    pub async fn create_operator(&self, operator: &str, shop: &str) -> String {
        let response = self
            .send(
                Call::post("/v1/admin/operators")
                    .admin()
                    .key(unique_key("operator"))
                    .json(&serde_json::json!({"operator_id": operator, "shop": shop})),
            )
            .await;
        assert_eq!(response.status, 201, "create operator: {response:?}");
        response.json()["token"].as_str().expect("token").to_owned()
    }

    /// The staff view of a product.
    pub async fn staff_product(&self, product_id: &str) -> Value {
        let response = self
            .send(Call::get(format!("/v1/admin/products/{product_id}")).admin())
            .await;
        assert_eq!(response.status, 200, "staff product: {response:?}");
        response.json()
    }

    /// Sale status and version of one SKU of a product, from the staff view.
    pub async fn sale_status(&self, product_id: &str, sku: &str) -> (String, i64) {
        let product = self.staff_product(product_id).await;
        let entry = product["skus"]
            .as_array()
            .expect("skus")
            .iter()
            .find(|entry| entry["sku"] == sku)
            .unwrap_or_else(|| panic!("{sku} not in {product}"))
            .clone();
        (
            entry["sale_status"].as_str().expect("status").to_owned(),
            entry["version"].as_i64().expect("version"),
        )
    }

    /// The whole shelf log (admin view), oldest first.
    pub async fn shelf_log(&self, query: &str) -> Vec<Value> {
        let response = self
            .send(Call::get(format!("/v1/admin/shelf-log?limit=500{query}")).admin())
            .await;
        assert_eq!(response.status, 200, "shelf log: {response:?}");
        response.json()["entries"]
            .as_array()
            .expect("entries")
            .clone()
    }
}

/// Runs `calls` all at once against `app` and returns the responses in call order.
pub async fn send_concurrently(app: &TestApp, calls: Vec<Call>) -> Vec<TestResponse> {
    let barrier = Arc::new(tokio::sync::Barrier::new(calls.len()));
    let tasks: Vec<_> = calls
        .into_iter()
        .map(|call| {
            let app = app.clone();
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                app.send(call).await
            })
        })
        .collect();
    let mut responses = Vec::with_capacity(tasks.len());
    for task in tasks {
        responses.push(task.await.expect("request task"));
    }
    responses
}

/// The rows `contents` lists under `table` whose column `column` is `value`.
pub fn rows_where(contents: &str, table: &str, column: usize, value: &str) -> Vec<Vec<String>> {
    let mut in_table = false;
    let mut rows = Vec::new();
    for line in contents.lines() {
        if !line.contains('|') {
            in_table = line == table;
            continue;
        }
        let cells: Vec<String> = line.split('|').map(str::to_owned).collect();
        if in_table && cells.get(column).map(String::as_str) == Some(value) {
            rows.push(cells);
        }
    }
    rows
}

/// What a path wrote for one reservation (its row, lines and ledger rows, from
/// `TestApp::contents`), without what differs by design: the ids, the order that holds
/// it and its expiry (inputs of the writer, not its doing).
pub fn reservation_rows(contents: &str, reservation: &str) -> Vec<Vec<String>> {
    let mut written = Vec::new();
    for mut row in rows_where(contents, "reservation", 0, reservation) {
        // id, status, release_reason, expires_at, shop, user_id, order_id
        row[0] = "<reservation>".into();
        row[3] = "<expiry>".into();
        row[6] = if row[6].is_empty() { "" } else { "<order>" }.into();
        written.push(row);
    }
    for mut row in rows_where(contents, "reservation_line", 0, reservation) {
        row[0] = "<reservation>".into();
        written.push(row);
    }
    for mut row in rows_where(contents, "stock_ledger", 6, reservation) {
        // id, sku, warehouse, kind, available_delta, reserved_delta, reference
        row[0] = "<ledger id>".into();
        row[6] = "<reservation>".into();
        written.push(row);
    }
    written
}

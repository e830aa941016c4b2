//! Where the load goes: a stockd already running (`--url`), or one started inside this
//! process on a fresh temporary database.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use engine::{Engine, EngineConfig, SystemClock};
use store::{Store, StoreConfig};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How the lab starts a server in its own process.
#[derive(Debug, Clone)]
pub struct InProcessOptions {
    pub pool_size: u32,
    pub engine_config: EngineConfig,
    /// Replicas for display reads (`STOCKD_REPLICA_URLS`).
    pub replica_urls: Vec<String>,
    pub replica_lag_seconds_max: Option<f64>,
    /// Longest wait for a pooled connection. A benchmark queues far more requests than
    /// connections and lets them wait their turn; a drill wants `unavailable` soon.
    pub acquire_timeout_milliseconds: u64,
    /// Run the background workers (expiry, payments, the replica monitor, …).
    pub workers: bool,
    /// Longest wait for a row lock before `lock_timeout`.
    pub lock_timeout_milliseconds: u64,
}

impl Default for InProcessOptions {
    fn default() -> InProcessOptions {
        InProcessOptions {
            pool_size: 16,
            engine_config: EngineConfig::default(),
            replica_urls: Vec::new(),
            replica_lag_seconds_max: None,
            acquire_timeout_milliseconds: 60_000,
            workers: false,
            lock_timeout_milliseconds: 2_000,
        }
    }
}

/// A running stockd the lab can reach.
pub struct Target {
    pub address: SocketAddr,
    pub admin_token: domain::Secret,
    /// `sqlite` or `postgres` when the lab started the server itself.
    pub backend: Option<&'static str>,
    /// The database engine and version, when the lab started the server itself.
    pub database_version: Option<String>,
    in_process: Option<InProcess>,
    /// The in-process server's database, for a drill's own connection to it.
    database: Option<ScratchDatabase>,
}

/// Where an in-process server keeps its data.
#[derive(Debug, Clone)]
struct ScratchDatabase {
    url: String,
    postgres_schema: Option<String>,
}

/// A connection of the lab's own to an in-process server's database: a drill holds
/// locks and takes rows in the wrong order with it, as another program would.
pub enum RawDatabase {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
    Mysql(sqlx::MySqlConnection),
}

impl RawDatabase {
    /// Runs one statement (MySQL: through the text protocol, so `BEGIN` works);
    /// answers the affected rows or the database's error text.
    pub async fn execute(&mut self, statement: &str) -> Result<u64, String> {
        let text = sqlx::AssertSqlSafe(statement.to_owned());
        match self {
            RawDatabase::Sqlite(connection) => sqlx::query(text)
                .execute(connection)
                .await
                .map(|done| done.rows_affected()),
            RawDatabase::Postgres(connection) => sqlx::query(text)
                .execute(connection)
                .await
                .map(|done| done.rows_affected()),
            RawDatabase::Mysql(connection) => sqlx::raw_sql(text)
                .execute(connection)
                .await
                .map(|done| done.rows_affected()),
        }
        .map_err(|error| error.to_string())
    }

    /// Whether `query` answers at least one row.
    pub async fn fetch_exists(&mut self, query: &str) -> Result<bool, String> {
        let text = sqlx::AssertSqlSafe(query.to_owned());
        match self {
            RawDatabase::Sqlite(connection) => sqlx::query(text)
                .fetch_optional(connection)
                .await
                .map(|row| row.is_some()),
            RawDatabase::Postgres(connection) => sqlx::query(text)
                .fetch_optional(connection)
                .await
                .map(|row| row.is_some()),
            RawDatabase::Mysql(connection) => sqlx::query(text)
                .fetch_optional(connection)
                .await
                .map(|row| row.is_some()),
        }
        .map_err(|error| error.to_string())
    }

    pub fn backend(&self) -> &'static str {
        match self {
            RawDatabase::Sqlite(_) => "sqlite",
            RawDatabase::Postgres(_) => "postgres",
            RawDatabase::Mysql(_) => "mysql",
        }
    }
}

/// A server the lab started. It runs on a runtime and threads of its own, as a
/// separate process would, so the load generator's tasks never starve the server's
/// (sharing one scheduler made throughput swing by half from run to run).
struct InProcess {
    shutdown: CancellationToken,
    thread: std::thread::JoinHandle<()>,
    scratch: Scratch,
}

/// What to remove when the in-process server stops.
enum Scratch {
    SqliteDirectory(PathBuf),
    PostgresSchema { url: String, schema: String },
    MysqlDatabase { url: String, database: String },
}

/// Creates a scratch database on the MySQL server at `url`; answers the URL of it.
pub(crate) async fn create_mysql_database(url: &str, database: &str) -> Result<String, String> {
    let mut connection = <sqlx::MySqlConnection as sqlx::Connection>::connect(url)
        .await
        .map_err(|error| format!("cannot reach MySQL: {error}"))?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {database} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    )))
    .execute(&mut connection)
    .await
    .map_err(|error| format!("cannot create database {database}: {error}"))?;
    let _ = sqlx::Connection::close(connection).await;
    Ok(url_of_database(url, database))
}

/// `url` naming `database` instead of the one it named, if any; its options (`?socket=`,
/// `?statement-cache-capacity=`, …) kept, so the in-process server connects the way
/// the run asked.
fn url_of_database(url: &str, database: &str) -> String {
    let (server, options) = match url.find('?') {
        Some(start) => url.split_at(start),
        None => (url, ""),
    };
    let server = match server.find("://").map(|start| start + 3) {
        Some(host_start) => match server[host_start..].find('/') {
            Some(path_start) => &server[..host_start + path_start],
            None => server,
        },
        None => server,
    };
    format!("{server}/{database}{options}")
}

/// Drops a scratch database on the MySQL server at `url`.
pub(crate) async fn drop_mysql_database(url: &str, database: &str) {
    if let Ok(mut connection) = <sqlx::MySqlConnection as sqlx::Connection>::connect(url).await {
        let statement = format!("DROP DATABASE IF EXISTS {database}");
        let _ = sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut connection)
            .await;
    }
}

fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Worker threads of the in-process server's runtime.
const SERVER_WORKER_THREADS: usize = 2;

/// What the server thread reports once it listens.
struct Started {
    address: SocketAddr,
    backend: &'static str,
    database_version: String,
}

async fn serve_in_process(
    config: StoreConfig,
    engine_config: EngineConfig,
    workers: bool,
    admin_token: domain::Secret,
    shutdown: CancellationToken,
    started: tokio::sync::oneshot::Sender<Result<Started, String>>,
) {
    let setup = async {
        let store = Store::connect(&config)
            .await
            .map_err(|error| format!("cannot open the database: {error}"))?;
        store
            .migrate()
            .await
            .map_err(|error| format!("migration failed: {error}"))?;
        let database_version = store
            .database_version()
            .await
            .unwrap_or_else(|error| format!("unknown ({error})"));
        let engine = Engine::new(
            store.clone(),
            Arc::new(SystemClock),
            api::renderer(),
            engine_config,
        );
        engine
            .configure_admin_token(&admin_token)
            .map_err(|error| format!("the lab's admin token: {error}"))?;
        if workers {
            engine::workers::spawn_workers(&engine, &TaskTracker::new(), &shutdown);
        }
        // The run's one service key carries every simulated shopper (a shop's whole
        // checkout backend): its per-credential rate is not what a bench measures, so
        // the in-process server has none. A remote server keeps its own.
        let http = api::http::HttpConfig {
            rate_limit_requests_per_second: 0.0,
            ..api::http::HttpConfig::default()
        };
        let router = api::app(api::AppState::new(
            engine,
            Some(api::metrics::install_recorder()),
            &http,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|error| format!("cannot listen: {error}"))?;
        let address = listener.local_addr().map_err(|error| error.to_string())?;
        Ok::<_, String>((
            store,
            router,
            listener,
            Started {
                address,
                backend: "",
                database_version,
            },
        ))
    };
    match setup.await {
        Ok((store, router, listener, mut report)) => {
            report.backend = store.backend_name();
            let _ = started.send(Ok(report));
            let _ = api::server::serve_until(
                listener,
                router,
                shutdown,
                Duration::from_secs(30),
                api::server::ServerConfig {
                    // One connection per simulated client, up to the lab's bound.
                    connections_max: crate::scenario::CLIENTS_MAX + 64,
                    ..api::server::ServerConfig::default()
                },
            )
            .await;
            store.close().await;
        }
        Err(error) => {
            let _ = started.send(Err(error));
        }
    }
}

/// Load runs and drills reach only a database on this machine (a loopback host, or a
/// Unix socket: no host), as they reach only a stockd on it: they create schemas there
/// and send it thousands of writes a second.
pub fn database_on_this_machine(url: &str) -> Result<(), String> {
    database_on_this_machine_in(url, &|name| std::env::var(name).ok())
}

/// [`database_on_this_machine`], `environment` answering the process's variables:
/// PostgreSQL's client also reads its server from `PGHOSTADDR` (which wins over the
/// URL's host) and `PGHOST` (for a URL without one), so an operator's shell could
/// otherwise send the load elsewhere whatever the URL says.
fn database_on_this_machine_in(
    url: &str,
    environment: &dyn Fn(&str) -> Option<String>,
) -> Result<(), String> {
    let authority = crate::fault_drills::upstream_text(url)?;
    let host = match authority.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or(""),
        None => authority
            .rsplit_once(':')
            .map_or(authority.as_str(), |(host, _)| host),
    };
    if url.starts_with("postgres") {
        // `PGHOST` only stands in for a host the URL does not name.
        let names_a_host = !host.is_empty()
            || url.split_once('?').is_some_and(|(_, query)| {
                query
                    .split('&')
                    .any(|pair| pair.split('=').next() == Some("host"))
            });
        let variables: &[&str] = if names_a_host {
            &["PGHOSTADDR"]
        } else {
            &["PGHOSTADDR", "PGHOST"]
        };
        for name in variables {
            let Some(value) = environment(name) else {
                continue;
            };
            // PGHOST may list several hosts, and name a socket's directory.
            for host in value.split(',').filter(|host| !host.starts_with('/')) {
                loopback_or_socket(host).map_err(|error| format!("{name}: {error}"))?;
            }
        }
    }
    // No host: a Unix socket.
    loopback_or_socket(host)?;
    // PostgreSQL's URL names its server again in the query (`?host=`, `?hostaddr=`,
    // which win over the authority): `postgres://u@127.0.0.1/db?host=db.example.com`
    // reaches db.example.com.
    if let Some((_, query)) = url.split_once('?') {
        for pair in query.split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if matches!(name, "host" | "hostaddr") {
                let value = percent_decoded(value);
                if !value.starts_with('/') {
                    loopback_or_socket(&value)?;
                }
            }
        }
    }
    Ok(())
}

fn loopback_or_socket(host: &str) -> Result<(), String> {
    if host.is_empty() || domain::is_loopback_host(host) {
        Ok(())
    } else {
        Err(format!(
            "load tests and drills only reach a database on this machine; '{host}' is not a loopback address"
        ))
    }
}

/// A query value with its `%XX` escapes decoded (`+` stays: libpq and sqlx read it
/// as itself); an escape that is not one stays as it is.
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = (bytes[index] == b'%')
            .then(|| value.get(index + 1..index + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                decoded.push(byte);
                index += 3;
            }
            None => {
                decoded.push(bytes[index]);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

impl Target {
    /// A stockd at `url` (`http://host:port`), reached with `admin_token`.
    pub async fn remote(url: &str, admin_token: domain::Secret) -> Result<Target, String> {
        let authority = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("--url must start with http:// (got '{url}')"))?
            .trim_end_matches('/');
        let address = tokio::net::lookup_host(authority)
            .await
            .map_err(|error| format!("cannot resolve {authority}: {error}"))?
            .next()
            .ok_or_else(|| format!("{authority} resolves to no address"))?;
        if !address.ip().is_loopback() {
            return Err(format!(
                "load tests only target loopback addresses; {address} is not one"
            ));
        }
        Ok(Target {
            address,
            admin_token,
            backend: None,
            database_version: None,
            in_process: None,
            database: None,
        })
    }

    /// Starts stockd in this process on a fresh database: a temporary SQLite file, a
    /// new schema on the PostgreSQL server at `server_url` (`postgres://…`), or a new
    /// database on the MySQL server there (`mysql://…`).
    pub async fn in_process(
        server_url: Option<&str>,
        pool_size: u32,
        engine_config: EngineConfig,
    ) -> Result<Target, String> {
        Target::in_process_with(
            server_url,
            InProcessOptions {
                pool_size,
                engine_config,
                ..InProcessOptions::default()
            },
        )
        .await
    }

    /// [`Target::in_process`] with every option: replicas, the pool's acquire bound and
    /// the background workers (a drill needs the replica monitor).
    pub async fn in_process_with(
        server_url: Option<&str>,
        options: InProcessOptions,
    ) -> Result<Target, String> {
        if let Some(url) = server_url {
            database_on_this_machine(url)?;
        }
        for url in &options.replica_urls {
            database_on_this_machine(url)?;
        }
        let InProcessOptions {
            pool_size,
            engine_config,
            replica_urls,
            replica_lag_seconds_max,
            acquire_timeout_milliseconds,
            workers,
            lock_timeout_milliseconds,
        } = options;
        let (config, scratch) = match server_url {
            Some(url) if url.starts_with("mysql://") => {
                let database = format!("stockd_bench_{}", random_suffix());
                let database_url = create_mysql_database(url, &database).await?;
                (
                    StoreConfig::new(database_url),
                    Scratch::MysqlDatabase {
                        url: url.to_owned(),
                        database,
                    },
                )
            }
            Some(url) => {
                let schema = format!("stockd_bench_{}", random_suffix());
                let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(url)
                    .await
                    .map_err(|error| format!("cannot reach PostgreSQL: {error}"))?;
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                    .execute(&mut connection)
                    .await
                    .map_err(|error| format!("cannot create schema {schema}: {error}"))?;
                let mut config = StoreConfig::new(url);
                config.postgres_schema = Some(schema.clone());
                (
                    config,
                    Scratch::PostgresSchema {
                        url: url.to_owned(),
                        schema,
                    },
                )
            }
            None => {
                let directory =
                    std::env::temp_dir().join(format!("stockd-bench-{}", random_suffix()));
                std::fs::create_dir_all(&directory)
                    .map_err(|error| format!("cannot create {}: {error}", directory.display()))?;
                let config = StoreConfig::new(format!(
                    "sqlite://{}",
                    directory.join("stockd.db").display()
                ));
                (config, Scratch::SqliteDirectory(directory))
            }
        };
        let mut config = config;
        config.pool_size = pool_size;
        config.acquire_timeout_milliseconds = acquire_timeout_milliseconds;
        config.lock_timeout_milliseconds = lock_timeout_milliseconds;
        config.replicas.urls = replica_urls;
        if let Some(seconds) = replica_lag_seconds_max {
            config.replicas.lag_seconds_max = seconds;
        }
        let database = ScratchDatabase {
            url: config.database_url.clone(),
            postgres_schema: config.postgres_schema.clone(),
        };
        let admin_token = domain::Secret::new(random_suffix());
        let shutdown = CancellationToken::new();
        let (started_sender, started) = tokio::sync::oneshot::channel();
        let thread = {
            let shutdown = shutdown.clone();
            let admin_token = admin_token.clone();
            std::thread::Builder::new()
                .name("stockd-server".into())
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(SERVER_WORKER_THREADS)
                        .thread_name("stockd-server-worker")
                        .enable_all()
                        .build();
                    match runtime {
                        Ok(runtime) => runtime.block_on(serve_in_process(
                            config,
                            engine_config,
                            workers,
                            admin_token,
                            shutdown,
                            started_sender,
                        )),
                        Err(error) => {
                            let _ = started_sender
                                .send(Err(format!("cannot start a runtime: {error}")));
                        }
                    }
                })
                .map_err(|error| format!("cannot start the server thread: {error}"))?
        };
        let in_process = InProcess {
            shutdown,
            thread,
            scratch,
        };
        let report = match started.await {
            Ok(Ok(report)) => report,
            Ok(Err(error)) => {
                stop_in_process(in_process).await;
                return Err(error);
            }
            Err(_) => {
                stop_in_process(in_process).await;
                return Err("the server thread ended before it started listening".into());
            }
        };
        Ok(Target {
            address: report.address,
            admin_token,
            backend: Some(report.backend),
            database_version: Some(report.database_version),
            in_process: Some(in_process),
            database: Some(database),
        })
    }

    /// A new connection to the in-process server's database (its schema on
    /// PostgreSQL); `None` for a remote server.
    pub async fn raw_database(&self) -> Result<RawDatabase, String> {
        use sqlx::Connection;
        let database = self
            .database
            .as_ref()
            .ok_or("a remote server's database is not the lab's to touch")?;
        let url = database.url.as_str();
        if url.starts_with("mysql://") {
            return sqlx::MySqlConnection::connect(url)
                .await
                .map(RawDatabase::Mysql)
                .map_err(|error| error.to_string());
        }
        if url.starts_with("postgres") {
            let mut connection = sqlx::PgConnection::connect(url)
                .await
                .map_err(|error| error.to_string())?;
            if let Some(schema) = &database.postgres_schema {
                sqlx::query(sqlx::AssertSqlSafe(format!("SET search_path TO {schema}")))
                    .execute(&mut connection)
                    .await
                    .map_err(|error| error.to_string())?;
            }
            return Ok(RawDatabase::Postgres(connection));
        }
        sqlx::SqliteConnection::connect(url)
            .await
            .map(RawDatabase::Sqlite)
            .map_err(|error| error.to_string())
    }

    /// Stops an in-process server and removes its scratch database.
    pub async fn stop(self) {
        if let Some(in_process) = self.in_process {
            stop_in_process(in_process).await;
        }
    }
}

async fn stop_in_process(in_process: InProcess) {
    in_process.shutdown.cancel();
    let thread = in_process.thread;
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    match in_process.scratch {
        Scratch::SqliteDirectory(directory) => {
            let _ = std::fs::remove_dir_all(directory);
        }
        Scratch::MysqlDatabase { url, database } => drop_mysql_database(&url, &database).await,
        Scratch::PostgresSchema { url, schema } => {
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

#[cfg(test)]
mod database_tests {
    use super::{database_on_this_machine_in, url_of_database};

    /// A process without PostgreSQL's variables.
    fn no_variables(_: &str) -> Option<String> {
        None
    }

    fn database_on_this_machine(url: &str) -> Result<(), String> {
        database_on_this_machine_in(url, &no_variables)
    }

    #[test]
    fn a_scratch_database_url_keeps_the_servers_options() {
        assert_eq!(
            url_of_database("mysql://root@127.0.0.1:3306", "scratch"),
            "mysql://root@127.0.0.1:3306/scratch"
        );
        assert_eq!(
            url_of_database("mysql://root@127.0.0.1:3306/shop", "scratch"),
            "mysql://root@127.0.0.1:3306/scratch"
        );
        assert_eq!(
            url_of_database(
                "mysql://root@localhost/shop?socket=/run/mysqld/mysqld.sock&statement-cache-capacity=500",
                "scratch"
            ),
            "mysql://root@localhost/scratch?socket=/run/mysqld/mysqld.sock&statement-cache-capacity=500"
        );
        assert_eq!(
            url_of_database("mysql://root@127.0.0.1:3306?ssl-mode=disabled", "scratch"),
            "mysql://root@127.0.0.1:3306/scratch?ssl-mode=disabled"
        );
    }

    #[test]
    fn only_a_database_on_this_machine_is_a_target() {
        for url in [
            "postgres://postgres@127.0.0.1:5432/postgres",
            "postgres://postgres:secret@localhost/postgres",
            "mysql://root@127.0.0.1:3306",
            "postgres://postgres@[::1]:5432/postgres",
            "postgres:///postgres?host=/var/run/postgresql",
            "postgres:///postgres?host=%2Fvar%2Frun%2Fpostgresql",
            "postgres://postgres@127.0.0.1/postgres?sslmode=disable&hostaddr=127.0.0.1",
        ] {
            assert!(database_on_this_machine(url).is_ok(), "{url}");
        }
        for url in [
            "postgres://postgres@db.example.com:5432/shop",
            "mysql://root@10.0.0.7:3306",
            "postgres://postgres@[2001:db8::1]:5432/shop",
            "postgres://postgres@127.0.0.1/shop?host=db.example.com",
            "postgres://postgres@127.0.0.1/shop?sslmode=disable&hostaddr=10.0.0.7",
            "postgres://postgres@localhost/shop?host=db%2Eexample%2Ecom",
        ] {
            assert!(database_on_this_machine(url).is_err(), "{url}");
        }
    }

    /// Found in review: PostgreSQL's client reads `PGHOSTADDR` (which wins over the
    /// URL's host) and `PGHOST` from the environment, so a shell that exported a
    /// remote one sent a load run there whatever the URL said.
    #[test]
    fn a_remote_server_in_postgresqls_variables_is_no_target() {
        let url = "postgres://postgres@127.0.0.1:5432/postgres";
        let hostless = "postgres:///postgres";
        for (url, name, value) in [
            (url, "PGHOSTADDR", "10.0.0.7"),
            (hostless, "PGHOST", "db.example.com"),
            (hostless, "PGHOST", "/var/run/postgresql,db.example.com"),
        ] {
            let environment = |asked: &str| (asked == name).then(|| value.to_owned());
            assert!(
                database_on_this_machine_in(url, &environment).is_err(),
                "{name}={value}"
            );
        }
        for (url, name, value) in [
            (url, "PGHOSTADDR", "127.0.0.1"),
            (hostless, "PGHOST", "/var/run/postgresql"),
            (hostless, "PGHOST", "localhost"),
            // The URL names its host: PGHOST is not read.
            (url, "PGHOST", "db.example.com"),
        ] {
            let environment = |asked: &str| (asked == name).then(|| value.to_owned());
            assert!(
                database_on_this_machine_in(url, &environment).is_ok(),
                "{name}={value}"
            );
        }
        let mysql = |asked: &str| (asked == "PGHOST").then(|| "db.example.com".to_owned());
        assert!(database_on_this_machine_in("mysql://root@127.0.0.1:3306", &mysql).is_ok());
    }
}

//! Where the load goes: a stockd already running (`--url`), or one started inside this
//! process on a fresh temporary database.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use engine::{Engine, EngineConfig, SystemClock};
use store::{Store, StoreConfig};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A running stockd the lab can reach.
pub struct Target {
    pub address: SocketAddr,
    pub admin_token: String,
    /// `sqlite` or `postgres` when the lab started the server itself.
    pub backend: Option<&'static str>,
    /// The database URL when the lab started the server itself (for evidence).
    pub database_url: Option<String>,
    in_process: Option<InProcess>,
}

struct InProcess {
    shutdown: CancellationToken,
    server: JoinHandle<std::io::Result<bool>>,
    store: Store,
    scratch: Scratch,
}

/// What to remove when the in-process server stops.
enum Scratch {
    SqliteDirectory(PathBuf),
    PostgresSchema { url: String, schema: String },
}

fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

impl Target {
    /// A stockd at `url` (`http://host:port`), reached with `admin_token`.
    pub async fn remote(url: &str, admin_token: String) -> Result<Target, String> {
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
            database_url: None,
            in_process: None,
        })
    }

    /// Starts stockd in this process on a fresh database: a temporary SQLite file, or a
    /// new schema on the PostgreSQL server at `postgres_url`.
    pub async fn in_process(postgres_url: Option<&str>, pool_size: u32) -> Result<Target, String> {
        let (config, scratch) = match postgres_url {
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
        // A benchmark queues far more requests than connections; let them wait their
        // turn instead of failing on the default acquire bound.
        config.acquire_timeout_milliseconds = 60_000;
        let database_url = config.database_url.clone();
        let store = Store::connect(&config)
            .await
            .map_err(|error| format!("cannot open the database: {error}"))?;
        store
            .migrate()
            .await
            .map_err(|error| format!("migration failed: {error}"))?;
        let backend = store.backend_name();
        let admin_token = random_suffix();
        let engine = Engine::new(
            store.clone(),
            Arc::new(SystemClock),
            api::renderer(),
            EngineConfig::default(),
        );
        let router = api::app(api::AppState {
            engine,
            admin_token: Arc::from(admin_token.as_str()),
            metrics: Some(api::metrics::install_recorder()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|error| format!("cannot listen: {error}"))?;
        let address = listener.local_addr().map_err(|error| error.to_string())?;
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(api::server::serve_until(
            listener,
            router,
            shutdown.clone(),
            Duration::from_secs(30),
        ));
        Ok(Target {
            address,
            admin_token,
            backend: Some(backend),
            database_url: Some(database_url),
            in_process: Some(InProcess {
                shutdown,
                server,
                store,
                scratch,
            }),
        })
    }

    /// The in-process server's store, for reading the database version.
    pub fn store(&self) -> Option<&Store> {
        self.in_process.as_ref().map(|in_process| &in_process.store)
    }

    /// Stops an in-process server and removes its scratch database.
    pub async fn stop(self) {
        let Some(in_process) = self.in_process else {
            return;
        };
        in_process.shutdown.cancel();
        let _ = in_process.server.await;
        in_process.store.close().await;
        match in_process.scratch {
            Scratch::SqliteDirectory(directory) => {
                let _ = std::fs::remove_dir_all(directory);
            }
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
}

//! The `stockd` binary: parses the command line and wires the crates together.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use engine::{Engine, EngineConfig, SystemClock};
use store::{Store, StoreConfig};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

// glibc's allocator was a sixth of the server's CPU on the hot path (malloc, free and
// their chunk bookkeeping, docs/BENCHMARKS.md); mimalloc's per-thread free lists cost
// less for the many small, short-lived allocations of a request.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// stockd: inventory reservations that never oversell.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the HTTP API and run the background workers.
    Serve(Box<ServeArguments>),
    /// Apply database migrations and exit.
    Migrate(DatabaseArguments),
    /// Replay the ledger against counters and reservations; exit 0 only when clean.
    Audit(DatabaseArguments),
    /// Load a small supermarket catalog with stock (safe to run twice).
    Seed(DatabaseArguments),
    /// Replace the admin token stored in the database with a new one and print it
    /// (instances without STOCKD_ADMIN_TOKEN accept it within the credential cache's
    /// bound, the old one no longer).
    RotateAdminToken(DatabaseArguments),
    /// Serve the payment gateway sandbox: the gateway protocol subset stockd speaks,
    /// with state and fault injection, sending signed webhooks.
    GatewaySandbox(SandboxArguments),
    /// Drive a load scenario against stockd and judge the result; exit 0 only when
    /// nothing was oversold, duplicated or left unexplained.
    Bench(Box<BenchArguments>),
    /// Inject a real fault, check what must hold, print a verdict; exit 0 only when
    /// it held (failover, replica-lag: on deploy/local-cluster, started if down).
    Drill(DrillArguments),
    /// The release gate of seed 002: the acceptance scenarios, the order-number rule,
    /// every drill this machine can run and the three-way reconciliation, with the
    /// release evidence written as Markdown; exit 0 only when every item held.
    Gate(GateArguments),
    /// Experiments straight against a database.
    Lab {
        #[command(subcommand)]
        experiment: LabCommand,
    },
}

#[derive(Args)]
struct DrillArguments {
    /// failover, replica-lag, duplicate-delivery, lock-timeout, deadlock,
    /// lost-response, compensation-failure or drop-before-commit.
    name: String,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// failover: clients sending reservations at once.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// failover: seconds of load before the leader is killed, and after the first
    /// write the new leader acknowledged (1 to 300: a drill stops by itself).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=300))]
    seconds: u64,
    /// duplicate-delivery: a NATS with JetStream to use (default: the drill starts
    /// `nats-server -js` of its own).
    #[arg(long)]
    nats_url: Option<String>,
    /// lock-timeout, deadlock, lost-response, compensation-failure,
    /// drop-before-commit: `postgres://…` (a scratch schema there)
    /// or `mysql://…` (a scratch database there); default a temporary SQLite file
    /// (deadlock needs one of the two).
    #[arg(long)]
    database_url: Option<String>,
}

#[derive(Args)]
struct GateArguments {
    /// `postgres://…` (a scratch schema there per item) or `mysql://…` (a scratch
    /// database); default temporary SQLite files (then `deadlock` and
    /// `drop-before-commit` are listed as not run).
    #[arg(long)]
    database_url: Option<String>,
    /// Where to write the evidence page (Markdown).
    #[arg(long)]
    evidence: std::path::PathBuf,
    /// Write the items as JSON to this file too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Also run `failover` and `replica-lag` on deploy/local-cluster.
    #[arg(long)]
    cluster: bool,
}

#[derive(Subcommand)]
enum LabCommand {
    /// Compare read-check-write, SELECT FOR UPDATE, conditional UPDATE and optimistic
    /// versioning under the last-unit and limited cases.
    Strategies(StrategiesArguments),
}

#[derive(Args)]
struct BenchArguments {
    /// last-unit, limited, ample, hot, spread, multi-sku, bad-input or flash-sale.
    scenario: String,
    /// A running stockd (http://127.0.0.1:8080); without it, one is started in this
    /// process on a fresh temporary database.
    #[arg(long)]
    url: Option<String>,
    /// The running stockd's admin token (with --url).
    #[arg(long, env = "STOCKD_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Without --url: postgres://… runs the in-process stockd on a fresh schema there;
    /// the default is a temporary SQLite file.
    #[arg(long)]
    database_url: Option<String>,
    /// Database connections of the in-process stockd.
    #[arg(long, default_value_t = 16)]
    pool_size: u32,
    /// Concurrent clients, one connection each.
    #[arg(long)]
    clients: Option<usize>,
    /// How long the throughput scenarios run: 10s, 2m, 500ms.
    #[arg(long, value_parser = parse_duration)]
    duration: Option<std::time::Duration>,
    /// Send this many requests instead of running for a duration.
    #[arg(long)]
    requests: Option<u64>,
    /// SKUs in spread and multi-sku.
    #[arg(long)]
    skus: Option<usize>,
    /// Lines per order as MIN-MAX (multi-sku default 2-5).
    #[arg(long, value_parser = parse_range)]
    lines_per_order: Option<(usize, usize)>,
    /// Share of requests that repeat an earlier request's key and body (0 to 0.9).
    #[arg(long)]
    duplicate_ratio: Option<f64>,
    /// flash-sale: the campaign's units (1000).
    #[arg(long)]
    stock: Option<i64>,
    /// flash-sale: shoppers the requests come from (50000).
    #[arg(long)]
    users: Option<u64>,
    /// flash-sale: most units one shopper may buy (1).
    #[arg(long)]
    per_user_limit: Option<i64>,
    /// flash-sale: the campaign's stock rows (the server's default, 4).
    #[arg(long)]
    buckets: Option<u32>,
    /// Write at least this many ledger rows of history (pairs of +1/-1 adjustments
    /// over the run's SKUs, counters unchanged) before the clients start: a ledger that
    /// has grown, as a shop's does. In-process server only.
    #[arg(long)]
    ledger_rows: Option<u64>,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Also write release evidence (Markdown) here.
    #[arg(long)]
    evidence: Option<std::path::PathBuf>,
    /// Batching of the in-process stockd (same flags as `serve`).
    #[command(flatten)]
    combiner: CombinerArguments,
    /// The in-process stockd's campaign waiting rooms (same flags as `serve`).
    #[command(flatten)]
    campaigns: CampaignArguments,
}

#[derive(Args)]
struct StrategiesArguments {
    /// postgres://… (a fresh schema is created and dropped) or sqlite (a scratch file).
    #[arg(long, default_value = "sqlite")]
    database_url: String,
    /// Application work between reading and writing, as in a real service.
    #[arg(long, default_value_t = 1)]
    think_time_milliseconds: u64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let (number, unit) = match text.find(|character: char| !character.is_ascii_digit()) {
        Some(position) => text.split_at(position),
        None => (text, "s"),
    };
    let value: u64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a duration like 10s"))?;
    match unit {
        "ms" => Ok(std::time::Duration::from_millis(value)),
        "s" => Ok(std::time::Duration::from_secs(value)),
        "m" => Ok(std::time::Duration::from_secs(value * 60)),
        _ => Err(format!("'{text}': use ms, s or m")),
    }
}

fn parse_range(text: &str) -> Result<(usize, usize), String> {
    let parse = |part: &str| {
        part.trim()
            .parse::<usize>()
            .map_err(|_| format!("'{text}' is not MIN-MAX"))
    };
    match text.split_once('-') {
        Some((low, high)) => Ok((parse(low)?, parse(high)?)),
        None => parse(text).map(|value| (value, value)),
    }
}

#[derive(Args, Clone)]
struct DatabaseArguments {
    /// sqlite://path/file.db (created on first start) or postgres://user@host/db.
    // The URLs may hold passwords: `--help` never prints their values.
    #[arg(
        long,
        env = "STOCKD_DATABASE_URL",
        default_value = "sqlite://stockd-data/stockd.db",
        hide_env_values = true
    )]
    database_url: String,
    /// PostgreSQL schema to use (default: the server's search_path).
    #[arg(long, env = "STOCKD_DATABASE_SCHEMA")]
    database_schema: Option<String>,
    /// Connections in the database pool.
    #[arg(long, env = "STOCKD_DATABASE_POOL_SIZE", default_value_t = 16)]
    database_pool_size: u32,
    /// PostgreSQL replicas for display reads only, comma-separated (the product view,
    /// SKU and order views, carts, the shelf log); everything that decides reads the
    /// writer. A cluster's read port (HAProxy) works as one URL.
    #[arg(
        long,
        env = "STOCKD_REPLICA_URLS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    replica_urls: Vec<String>,
    /// A replica further behind than this leaves the read rotation (and returns once
    /// it stays below half of it).
    #[arg(long, env = "STOCKD_REPLICA_LAG_SECONDS_MAX", default_value_t = store::replicas::REPLICA_LAG_SECONDS_MAX_DEFAULT, value_parser = parse_lag_seconds)]
    replica_lag_seconds_max: f64,
    /// Longest wait for a row lock before answering lock_timeout.
    #[arg(
        long,
        env = "STOCKD_LOCK_TIMEOUT_MILLISECONDS",
        default_value_t = 2_000
    )]
    lock_timeout_milliseconds: u64,
    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long, env = "STOCKD_LOG", default_value = "info")]
    log: String,
    /// Log format: text or json.
    #[arg(long, env = "STOCKD_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

#[derive(Args)]
struct ServeArguments {
    #[command(flatten)]
    database: DatabaseArguments,
    /// Address to listen on.
    #[arg(long, env = "STOCKD_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// NATS with JetStream (`nats://host:port`): the outbox relay publishes every
    /// event to stream STOCKD_EVENTS, and reservation commands are taken from
    /// stockd.commands.reserve. Without it events are served by GET /v1/events only.
    /// NATS being down delays events, never a sale.
    #[arg(long, env = "STOCKD_NATS_URL", hide_env_values = true)]
    nats_url: Option<String>,
    /// Redis (`redis://host:port`) for the display cache: the shopper's product view
    /// is served from it, filled on a miss and dropped by the outbox's events; nothing
    /// that decides a sale reads it. Redis down means database reads.
    #[arg(long, env = "STOCKD_REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// Bearer token for admin calls; generated and printed when unset.
    #[arg(long, env = "STOCKD_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Hold applied when a reservation names no ttl_seconds.
    #[arg(
        long,
        env = "STOCKD_RESERVATION_TTL_SECONDS_DEFAULT",
        default_value_t = 900
    )]
    reservation_ttl_seconds_default: i64,
    /// Pause between expiry worker steps.
    #[arg(
        long,
        env = "STOCKD_EXPIRY_INTERVAL_MILLISECONDS",
        default_value_t = 1_000
    )]
    expiry_interval_milliseconds: u64,
    /// Pause before a refund the gateway did not confirm is sent again (same key).
    #[arg(
        long,
        env = "STOCKD_REFUND_RETRY_MILLISECONDS",
        default_value_t = 30_000,
        value_parser = clap::value_parser!(i64).range(100..=86_400_000)
    )]
    refund_retry_milliseconds: i64,
    /// A transaction of the database open longer than this counts in
    /// stockd_db_long_transactions.
    #[arg(
        long,
        env = "STOCKD_LONG_TRANSACTION_SECONDS",
        default_value_t = 10,
        value_parser = clap::value_parser!(i64).range(1..=86_400)
    )]
    long_transaction_seconds: i64,
    /// How long idempotency records are kept.
    #[arg(
        long,
        env = "STOCKD_IDEMPOTENCY_RETENTION_SECONDS",
        default_value_t = 86_400
    )]
    idempotency_retention_seconds: i64,
    /// How long in-flight requests may run after a shutdown signal.
    #[arg(long, env = "STOCKD_SHUTDOWN_GRACE_SECONDS", default_value_t = 30)]
    shutdown_grace_seconds: u64,
    /// A token that may read /metrics and nothing else.
    #[arg(long, env = "STOCKD_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    #[command(flatten)]
    limits: LimitArguments,
    #[command(flatten)]
    campaigns: CampaignArguments,
    #[command(flatten)]
    combiner: CombinerArguments,
    /// Load the demo supermarket catalog before serving (as `stockd seed` does).
    #[arg(long)]
    demo: bool,
    #[command(flatten)]
    payments: PaymentArguments,
}

impl ServeArguments {
    fn check(&self) -> Result<(), String> {
        self.database.check()?;
        self.limits.check()?;
        self.campaigns.check()?;
        self.combiner.check()?;
        self.payments.check()?;
        // A lock wait ends as `lock_timeout`, and a gateway call as `payment_unknown`
        // (202), only within the request's own bound: past it the request is cut
        // short with a 503 that says neither. Necessary, not sufficient: a reservation
        // may wait twice (its batch's wait, then its own in the one-by-one pass), so a
        // bound near the request's still ends some waits as 503 (README).
        let request = self.limits.request_timeout_milliseconds;
        for (variable, milliseconds) in [
            (
                "STOCKD_LOCK_TIMEOUT_MILLISECONDS",
                self.database.lock_timeout_milliseconds,
            ),
            (
                "STOCKD_GATEWAY_TIMEOUT_MILLISECONDS",
                self.payments.gateway_timeout_milliseconds,
            ),
        ] {
            if milliseconds >= request {
                return Err(format!(
                    "{variable} ({milliseconds}) must be below STOCKD_REQUEST_TIMEOUT_MILLISECONDS ({request})"
                ));
            }
        }
        // Set, even empty (a secret that failed to reach the environment), a token is
        // checked: an empty one would otherwise be taken as unset, and a token
        // generated in its place.
        for (variable, token) in [
            ("STOCKD_ADMIN_TOKEN", self.admin_token.as_deref()),
            ("STOCKD_METRICS_TOKEN", self.metrics_token.as_deref()),
        ] {
            if let Some(token) = token {
                engine::credentials::check_admin_token(&domain::Secret::new(token.to_owned()))
                    .map_err(|error| format!("{variable}: {error}"))?;
            }
        }
        // A name to resolve is resolved at the bind; anything else must be host:port.
        if self.listen.parse::<std::net::SocketAddr>().is_err()
            && !self
                .listen
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
        {
            return Err(format!(
                "STOCKD_LISTEN must be host:port, such as 127.0.0.1:8080 (got '{}')",
                self.listen
            ));
        }
        // An address given as one (not a name to resolve) is known now: the in-process
        // sandbox on a public one is refused before the database is opened.
        if let Ok(address) = self.listen.parse::<std::net::SocketAddr>() {
            choose_gateway(&self.payments, address)?;
        }
        if let Some(url) = self.redis_url.as_deref().filter(|url| !url.is_empty()) {
            cache::DisplayCache::new(cache::CacheConfig::new(url))
                .map_err(|error| error.to_string())?;
        }
        if let Some(url) = self.nats_url.as_deref().filter(|url| !url.is_empty()) {
            bus::check_url(url).map_err(|error| format!("STOCKD_NATS_URL: {error}"))?;
        }
        if domain::TtlSeconds::new(self.reservation_ttl_seconds_default).is_err() {
            return Err(
                "STOCKD_RESERVATION_TTL_SECONDS_DEFAULT must be between 1 and 86400".into(),
            );
        }
        bounded(
            "STOCKD_EXPIRY_INTERVAL_MILLISECONDS",
            self.expiry_interval_milliseconds,
            10,
            3_600_000,
        )?;
        // A client's retries must find their key while what they made still holds:
        // below the longest hold a request may ask for, a retry of a reservation or an
        // order still open would make a second one (and a retried confirm would run
        // again); at or below zero every key would go at once.
        bounded(
            "STOCKD_IDEMPOTENCY_RETENTION_SECONDS",
            u64::try_from(self.idempotency_retention_seconds).unwrap_or(0),
            domain::limits::RESERVATION_TTL_SECONDS_MAX.unsigned_abs(),
            31_536_000,
        )?;
        bounded(
            "STOCKD_SHUTDOWN_GRACE_SECONDS",
            self.shutdown_grace_seconds,
            0,
            3_600,
        )
    }
}

/// Bounds on what callers may do and how long the server waits for them.
#[derive(Args, Clone)]
struct LimitArguments {
    /// Requests one credential may send per second, sustained (0: no limit).
    #[arg(
        long,
        env = "STOCKD_RATE_LIMIT_REQUESTS_PER_SECOND",
        default_value_t = 20_000.0
    )]
    rate_limit_requests_per_second: f64,
    /// Requests one credential may send at once above its rate.
    #[arg(long, env = "STOCKD_RATE_LIMIT_BURST", default_value_t = 40_000)]
    rate_limit_burst: u32,
    /// Open holds (unpaid orders included) one shopper of a shop may have at once.
    #[arg(long, env = "STOCKD_USER_OPEN_HOLDS_MAX", default_value_t = 20)]
    user_open_holds_max: i64,
    /// How long a credential looked up is trusted before the database is asked
    /// again: the bound within which a key revoked elsewhere stops working here.
    #[arg(
        long,
        env = "STOCKD_CREDENTIAL_CACHE_MILLISECONDS",
        default_value_t = 2_000
    )]
    credential_cache_milliseconds: i64,
    /// Longest wait for a request's headers (and between two requests of a connection).
    #[arg(
        long,
        env = "STOCKD_HEADER_READ_TIMEOUT_MILLISECONDS",
        default_value_t = 10_000
    )]
    header_read_timeout_milliseconds: u64,
    /// Longest wait for a request's body.
    #[arg(
        long,
        env = "STOCKD_BODY_READ_TIMEOUT_MILLISECONDS",
        default_value_t = 10_000
    )]
    body_read_timeout_milliseconds: u64,
    /// Longest a request may run before it is answered 503 (retry with the same key).
    #[arg(
        long,
        env = "STOCKD_REQUEST_TIMEOUT_MILLISECONDS",
        default_value_t = 30_000
    )]
    request_timeout_milliseconds: u64,
    /// Connections served at once; more are answered 503 and closed.
    #[arg(long, env = "STOCKD_CONNECTIONS_MAX", default_value_t = 1024)]
    connections_max: usize,
}

impl LimitArguments {
    fn check(&self) -> Result<(), String> {
        let rate = self.rate_limit_requests_per_second;
        if !(rate.is_finite() && (0.0..=1_000_000_000.0).contains(&rate)) {
            return Err(format!(
                "STOCKD_RATE_LIMIT_REQUESTS_PER_SECOND must be between 0 (no limit) and 1000000000, not {rate}"
            ));
        }
        bounded(
            "STOCKD_RATE_LIMIT_BURST",
            u64::from(self.rate_limit_burst),
            1,
            1_000_000_000,
        )?;
        bounded(
            "STOCKD_HEADER_READ_TIMEOUT_MILLISECONDS",
            self.header_read_timeout_milliseconds,
            100,
            600_000,
        )?;
        bounded(
            "STOCKD_BODY_READ_TIMEOUT_MILLISECONDS",
            self.body_read_timeout_milliseconds,
            100,
            600_000,
        )?;
        bounded(
            "STOCKD_REQUEST_TIMEOUT_MILLISECONDS",
            self.request_timeout_milliseconds,
            1_000,
            600_000,
        )?;
        bounded(
            "STOCKD_CONNECTIONS_MAX",
            self.connections_max as u64,
            1,
            1_000_000,
        )?;
        bounded(
            "STOCKD_USER_OPEN_HOLDS_MAX",
            u64::try_from(self.user_open_holds_max).unwrap_or(0),
            1,
            1_000_000,
        )?;
        bounded(
            "STOCKD_CREDENTIAL_CACHE_MILLISECONDS",
            u64::try_from(self.credential_cache_milliseconds).unwrap_or(u64::MAX),
            0,
            10_000,
        )?;
        Ok(())
    }

    fn http(&self, metrics_token: Option<&str>) -> api::http::HttpConfig {
        api::http::HttpConfig {
            rate_limit_requests_per_second: self.rate_limit_requests_per_second,
            rate_limit_burst: self.rate_limit_burst,
            body_read_timeout_milliseconds: self.body_read_timeout_milliseconds,
            request_timeout_milliseconds: self.request_timeout_milliseconds,
            metrics_token: metrics_token.map(domain::Secret::new),
        }
    }

    fn server(&self) -> api::server::ServerConfig {
        api::server::ServerConfig {
            header_read_timeout: Duration::from_millis(self.header_read_timeout_milliseconds),
            connections_max: self.connections_max,
        }
    }
}

/// The payment gateway. Without a URL, an in-process sandbox plays the gateway.
#[derive(Args, Clone)]
struct PaymentArguments {
    /// The gateway's base URL (`https://api.stripe.com`); unset: an in-process sandbox.
    #[arg(long, env = "STOCKD_GATEWAY_URL")]
    gateway_url: Option<String>,
    /// The gateway's secret API key.
    #[arg(
        long,
        env = "STOCKD_GATEWAY_API_KEY",
        hide_env_values = true,
        default_value = gateway::SANDBOX_API_KEY
    )]
    gateway_api_key: String,
    /// The secret webhooks are signed with (required with --gateway-url).
    #[arg(long, env = "STOCKD_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: Option<String>,
    /// Longest wait for the gateway's answer; past it a payment is "unknown", not failed.
    #[arg(
        long,
        env = "STOCKD_GATEWAY_TIMEOUT_MILLISECONDS",
        default_value_t = 5_000
    )]
    gateway_timeout_milliseconds: u64,
    /// `sandbox`: without a gateway URL, take payments through the in-process sandbox
    /// (which charges every card) even on a non-loopback address; with one, the URL is
    /// a `stockd gateway-sandbox` and its fault payment methods are allowed.
    #[arg(long, env = "STOCKD_GATEWAY")]
    gateway: Option<String>,
}

/// Shortest webhook secret taken: a gateway's are far longer (Stripe's `whsec_` and 32
/// characters); an empty one would let anyone sign a "payment succeeded".
const WEBHOOK_SECRET_CHARACTERS_MIN: usize = 16;

fn check_webhook_secret(secret: &str) -> Result<(), String> {
    if secret.trim() != secret || secret.chars().count() < WEBHOOK_SECRET_CHARACTERS_MIN {
        return Err(format!(
            "STOCKD_WEBHOOK_SECRET must be at least {WEBHOOK_SECRET_CHARACTERS_MIN} characters without surrounding spaces: anyone could sign webhooks with a short or empty one"
        ));
    }
    Ok(())
}

impl PaymentArguments {
    /// The gateway's URL as given: an empty `STOCKD_GATEWAY_URL=` counts as unset, as
    /// the other URLs' do.
    fn gateway_url(&self) -> Option<&str> {
        self.gateway_url
            .as_deref()
            .map(str::trim)
            .filter(|url| !url.is_empty())
    }

    /// How to reach the gateway at `url` with this key and bound.
    fn gateway_config(&self, url: impl Into<String>) -> gateway::GatewayConfig {
        gateway::GatewayConfig {
            base_url: url.into(),
            api_key: self.gateway_api_key.clone(),
            timeout_milliseconds: self.gateway_timeout_milliseconds,
        }
    }

    /// Whether `STOCKD_GATEWAY=sandbox` says so; any other value is refused.
    fn explicit_sandbox(&self) -> Result<bool, String> {
        match self.gateway.as_deref() {
            None | Some("") => Ok(false),
            Some("sandbox") => Ok(true),
            Some(other) => Err(format!(
                "STOCKD_GATEWAY must be 'sandbox' (or unset), not '{other}'"
            )),
        }
    }

    fn check(&self) -> Result<(), String> {
        self.explicit_sandbox()?;
        if let Some(secret) = &self.webhook_secret {
            check_webhook_secret(secret)?;
        }
        bounded(
            "STOCKD_GATEWAY_TIMEOUT_MILLISECONDS",
            self.gateway_timeout_milliseconds,
            100,
            120_000,
        )?;
        if let Some(url) = self.gateway_url() {
            if self.webhook_secret.is_none() {
                return Err("STOCKD_GATEWAY_URL needs STOCKD_WEBHOOK_SECRET".into());
            }
            // `STOCKD_GATEWAY=sandbox` says the URL is a `stockd gateway-sandbox`, which
            // serves plain HTTP with the sandbox's key, wherever it runs (staging).
            if self.gateway.as_deref() == Some("sandbox") {
                return Ok(());
            }
            self.gateway_config(url).check()?;
        }
        Ok(())
    }
}

#[derive(Args)]
struct SandboxArguments {
    #[arg(long, env = "STOCKD_SANDBOX_LISTEN", default_value = "127.0.0.1:8090")]
    listen: String,
    /// stockd's webhook endpoint (`http://127.0.0.1:8080/v1/payments/webhook`).
    #[arg(long, env = "STOCKD_SANDBOX_WEBHOOK_URL")]
    webhook_url: Option<String>,
    #[arg(long, env = "STOCKD_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: String,
    /// When set, requests must present it as `Authorization: Bearer …`.
    #[arg(long, env = "STOCKD_GATEWAY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Apply this fault to every payment: succeed, decline, slow, charge_then_timeout,
    /// lost_response, no_webhook, webhook_3x, webhooks_out_of_order, requires_action.
    #[arg(long, env = "STOCKD_SANDBOX_FAULT")]
    fault: Option<String>,
    #[arg(long, default_value_t = 2_000)]
    slow_milliseconds: u64,
    #[arg(long, default_value_t = 30_000)]
    hang_milliseconds: u64,
}

/// `value` of the setting `name` within `low..=high`, or why not.
fn bounded(name: &str, value: u64, low: u64, high: u64) -> Result<(), String> {
    if (low..=high).contains(&value) {
        Ok(())
    } else {
        Err(format!("{name} must be between {low} and {high}"))
    }
}

/// A running campaign's waiting room and tickets (the flash-sale admission).
#[derive(Args, Clone, Copy)]
struct CampaignArguments {
    /// A running campaign's requests that reach the database at once (per process);
    /// the next ones wait in the campaign's line.
    #[arg(long, env = "STOCKD_CAMPAIGN_IN_FLIGHT_MAX", default_value_t = 256)]
    campaign_in_flight_max: usize,
    /// Places in a campaign's line (per process); beyond them, 429 `rate_limited`.
    #[arg(
        long,
        env = "STOCKD_CAMPAIGN_WAITING_ROOM_MAX",
        default_value_t = 10_000
    )]
    campaign_waiting_room_max: usize,
    /// How long a campaign ticket keeps its request's answer once it ran.
    #[arg(
        long,
        env = "STOCKD_CAMPAIGN_TICKET_RETENTION_SECONDS",
        default_value_t = 600
    )]
    campaign_ticket_retention_seconds: i64,
}

impl CampaignArguments {
    fn check(&self) -> Result<(), String> {
        bounded(
            "STOCKD_CAMPAIGN_IN_FLIGHT_MAX",
            self.campaign_in_flight_max as u64,
            1,
            100_000,
        )?;
        bounded(
            "STOCKD_CAMPAIGN_WAITING_ROOM_MAX",
            self.campaign_waiting_room_max as u64,
            0,
            1_000_000,
        )?;
        bounded(
            "STOCKD_CAMPAIGN_TICKET_RETENTION_SECONDS",
            u64::try_from(self.campaign_ticket_retention_seconds).unwrap_or(0),
            1,
            86_400,
        )
    }

    fn apply(self, config: EngineConfig) -> EngineConfig {
        EngineConfig {
            campaign_in_flight_max: self.campaign_in_flight_max,
            campaign_waiting_room_max: self.campaign_waiting_room_max,
            campaign_ticket_retention_seconds: self.campaign_ticket_retention_seconds,
            ..config
        }
    }
}

/// How reservations are batched (the hot-SKU combiner).
#[derive(Args, Clone, Copy)]
struct CombinerArguments {
    /// Reservation queues, each batched on its own (a request goes to its first SKU's); 0 = one.
    #[arg(long, env = "STOCKD_COMBINER_SHARDS", default_value_t = 0)]
    combiner_shards: usize,
    /// Batches of one queue in flight at once; 0 = one.
    #[arg(long, env = "STOCKD_COMBINER_BATCHES_IN_FLIGHT", default_value_t = 0)]
    combiner_batches_in_flight: usize,
    /// Most reservations in one batch (one transaction).
    #[arg(long, env = "STOCKD_COMBINER_BATCH_SIZE_MAX", default_value_t = 256)]
    combiner_batch_size_max: usize,
    /// Most reservations waiting in one queue; more are answered 429 at once.
    #[arg(long, env = "STOCKD_COMBINER_QUEUE_DEPTH_MAX", default_value_t = 4096)]
    combiner_queue_depth_max: usize,
}

impl CombinerArguments {
    fn check(&self) -> Result<(), String> {
        // On PostgreSQL each batch in flight of each shard holds a connection.
        bounded("STOCKD_COMBINER_SHARDS", self.combiner_shards as u64, 0, 64)?;
        bounded(
            "STOCKD_COMBINER_BATCHES_IN_FLIGHT",
            self.combiner_batches_in_flight as u64,
            0,
            64,
        )?;
        bounded(
            "STOCKD_COMBINER_BATCH_SIZE_MAX",
            self.combiner_batch_size_max as u64,
            1,
            10_000,
        )?;
        bounded(
            "STOCKD_COMBINER_QUEUE_DEPTH_MAX",
            self.combiner_queue_depth_max as u64,
            1,
            1_000_000,
        )
    }

    fn apply(self, config: EngineConfig) -> EngineConfig {
        EngineConfig {
            combiner_shards: self.combiner_shards,
            combiner_batches_in_flight: self.combiner_batches_in_flight,
            combiner_batch_size_max: self.combiner_batch_size_max,
            combiner_queue_depth_max: self.combiner_queue_depth_max,
            ..config
        }
    }
}

fn store_config(arguments: &DatabaseArguments) -> StoreConfig {
    let mut config = StoreConfig::new(&arguments.database_url);
    config.pool_size = arguments.database_pool_size;
    config.lock_timeout_milliseconds = arguments.lock_timeout_milliseconds;
    config.postgres_schema = arguments.database_schema.clone();
    config.replicas.urls = arguments
        .replica_urls
        .iter()
        .map(|url| url.trim().to_owned())
        .filter(|url| !url.is_empty())
        .collect();
    config.replicas.lag_seconds_max = arguments.replica_lag_seconds_max;
    config
}

/// A lag bound: a positive number of seconds, at most a day.
fn parse_lag_seconds(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|seconds| seconds.is_finite() && *seconds > 0.0 && *seconds <= 86_400.0)
        .ok_or_else(|| format!("expected seconds above 0 and at most 86400, got '{text}'"))
}

/// Logging as `STOCKD_LOG` and `STOCKD_LOG_FORMAT` ask; a typo in either is refused
/// (before, it silently meant `info` and text, hiding the debug lines asked for).
fn init_logging(arguments: &DatabaseArguments) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(&arguments.log).map_err(|error| {
        format!(
            "STOCKD_LOG is not a log filter ({error}): '{}'",
            arguments.log
        )
    })?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match arguments.log_format.as_str() {
        "json" => builder.json().init(),
        "text" => builder.init(),
        other => {
            return Err(format!(
                "STOCKD_LOG_FORMAT must be text or json, not '{other}'"
            ));
        }
    }
    Ok(())
}

impl DatabaseArguments {
    fn check(&self) -> Result<(), String> {
        bounded(
            "STOCKD_DATABASE_POOL_SIZE",
            u64::from(self.database_pool_size),
            1,
            10_000,
        )?;
        // PostgreSQL reads 0 as "wait forever", SQLite as "fail at once".
        bounded(
            "STOCKD_LOCK_TIMEOUT_MILLISECONDS",
            self.lock_timeout_milliseconds,
            10,
            600_000,
        )?;
        // A server's statement bound would cancel a longer wait first (503
        // `unavailable`, never `lock_timeout`); SQLite has none. MySQL counts the
        // lock bound in whole seconds, rounded up.
        let config = store_config(self);
        let statement = config.statement_timeout_milliseconds;
        let waited = if config.is_mysql() {
            self.lock_timeout_milliseconds.div_ceil(1_000) * 1_000
        } else {
            self.lock_timeout_milliseconds
        };
        if !self.database_url.starts_with("sqlite:") && waited >= statement {
            return Err(format!(
                "STOCKD_LOCK_TIMEOUT_MILLISECONDS ({}) must be below the statement bound ({statement} ms) on PostgreSQL and MySQL",
                self.lock_timeout_milliseconds
            ));
        }
        // A schema is PostgreSQL's: elsewhere it would be dropped without a word, and
        // the data written into the URL's database instead of the one meant.
        if self.database_schema.is_some() && !config.is_postgres() {
            return Err(
                "STOCKD_DATABASE_SCHEMA is supported with PostgreSQL only (on MySQL, name the database in STOCKD_DATABASE_URL)"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

async fn connect_and_migrate(arguments: &DatabaseArguments) -> Result<Store, String> {
    arguments.check()?;
    connect_and_migrate_with(store_config(arguments)).await
}

async fn connect_and_migrate_with(config: StoreConfig) -> Result<Store, String> {
    // Error texts can quote the URL, password included: never print that.
    let store = Store::connect(&config).await.map_err(|error| {
        format!(
            "cannot open the database: {}",
            domain::redact_urls_in(&error.to_string())
        )
    })?;
    let applied = store.migrate().await.map_err(|error| {
        format!(
            "migration failed: {}",
            domain::redact_urls_in(&error.to_string())
        )
    })?;
    if !applied.is_empty() {
        tracing::info!(
            ?applied,
            backend = store.backend_name(),
            "applied migrations"
        );
    }
    Ok(store)
}

async fn serve(arguments: ServeArguments) -> Result<(), String> {
    // Every setting is checked before the database is opened: a binary refusing its
    // configuration must not have migrated the schema first.
    arguments.check()?;
    // Signals are heard from here on: one during the migrations lets the one under way
    // finish (on MySQL a migration's DDL commits statement by statement: one cut short
    // is half applied and unrecorded, and the next start fails on it), then stops.
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let mut store_config = store_config(&arguments.database);
    store_config.limits.open_holds_max = arguments.limits.user_open_holds_max;
    let store = connect_and_migrate_with(store_config).await?;
    if shutdown.is_cancelled() {
        store.close().await;
        println!("stockd: stopped by a signal during start-up, after the migrations");
        return Ok(());
    }
    let config = arguments.combiner.apply(EngineConfig {
        reservation_ttl_seconds_default: arguments.reservation_ttl_seconds_default,
        expiry_interval_milliseconds: arguments.expiry_interval_milliseconds,
        idempotency_retention_seconds: arguments.idempotency_retention_seconds,
        credential_cache_milliseconds: arguments.limits.credential_cache_milliseconds,
        long_transaction_milliseconds: arguments.long_transaction_seconds * 1_000,
        refund_retry_milliseconds: arguments.refund_retry_milliseconds,
        ..arguments.campaigns.apply(EngineConfig::default())
    });
    let listener = tokio::net::TcpListener::bind(&arguments.listen)
        .await
        .map_err(|error| {
            format!(
                "STOCKD_LISTEN: cannot listen on {}: {error}",
                arguments.listen
            )
        })?;
    let address = listener.local_addr().map_err(|error| error.to_string())?;
    let gateway = choose_gateway(&arguments.payments, address)?;
    let engine = Engine::new(
        store.clone(),
        Arc::new(SystemClock),
        api::renderer(),
        config,
    );
    match &arguments.admin_token {
        Some(token) if !token.is_empty() => {
            engine
                .configure_admin_token(&domain::Secret::new(token.clone()))
                .map_err(|error| format!("STOCKD_ADMIN_TOKEN: {error}"))?;
            let retired = engine
                .retire_stored_admin_token()
                .await
                .map_err(|error| format!("cannot retire the stored admin token: {error}"))?;
            println!(
                "stockd: admin token: STOCKD_ADMIN_TOKEN{}",
                if retired {
                    " (the generated one stored before is deleted: it no longer works, also without the variable)"
                } else {
                    ""
                }
            );
        }
        _ => match engine
            .ensure_admin_token()
            .await
            .map_err(|error| format!("cannot store the admin token: {error}"))?
        {
            Some(token) => println!(
                "stockd: generated admin token (set STOCKD_ADMIN_TOKEN to choose one; kept across restarts, replaced by `stockd rotate-admin-token`): {}",
                token.expose()
            ),
            None => println!(
                "stockd: admin token: the one generated on first start (stored as a hash; `stockd rotate-admin-token` prints a new one)"
            ),
        },
    }
    let state = api::AppState::new(
        engine.clone(),
        Some(api::metrics::install_recorder()),
        &arguments.limits.http(arguments.metrics_token.as_deref()),
    );
    let sandbox = attach_payments(&engine, &arguments.payments, gateway).await?;
    if arguments.demo {
        let summary = engine::demo::load_demo_catalog(&engine)
            .await
            .map_err(|error| format!("loading the demo catalog failed: {error}"))?;
        print_demo_summary(&summary);
    }
    let payments = match &sandbox {
        Some((sandbox, sandbox_address)) => {
            sandbox.set_webhook_url(format!("http://{address}/v1/payments/webhook"));
            format!("payments through the in-process gateway sandbox at http://{sandbox_address}")
        }
        None => "payments through the configured gateway".to_owned(),
    };
    // One sample of this instance's clock against the database server's before
    // anything is judged by it (`Engine::held_back_now`: hold ends, schedules,
    // campaigns, the relay's lease): a restart with a clock ahead must not release
    // holds or start a sale early before the sampling worker's first round.
    if let Err(error) = engine.database_activity_step().await {
        tracing::warn!(%error, "no first sample of the clock against the database's: hold ends and schedules are judged by this instance's clock until one succeeds");
    }
    let campaigns = engine
        .load_open_campaigns()
        .await
        .map_err(|error| format!("cannot read the open campaigns: {error}"))?;
    if campaigns > 0 {
        println!("stockd: routing {campaigns} open flash-sale campaign(s)");
    }
    // When the signal came: the grace is counted from it, for the connections, the
    // tickets' requests and the workers alike.
    let signalled_at = Arc::new(std::sync::OnceLock::new());
    tokio::spawn({
        let shutdown = shutdown.clone();
        let signalled_at = Arc::clone(&signalled_at);
        async move {
            shutdown.cancelled().await;
            let _ = signalled_at.set(tokio::time::Instant::now());
        }
    });
    // The last line printed at start-up: scripts wait for it.
    println!(
        "stockd: listening on http://{address} ({} database; {payments}); console at \
         http://{address}/console, API reference at http://{address}/docs",
        store.backend_name()
    );

    let workers = TaskTracker::new();
    let intake_state = state.clone();
    let nats_url = arguments.nats_url.as_deref().filter(|url| !url.is_empty());
    if nats_url.is_some() {
        // Before the workers start: their first prune must already wait for the
        // relay's acknowledgements, not only the sequencer's numbering.
        engine.attach_event_relay();
    }
    engine::workers::spawn_workers(&engine, &workers, &shutdown);
    if let Some(url) = arguments.redis_url.as_deref().filter(|url| !url.is_empty()) {
        let cache = cache::DisplayCache::new(cache::CacheConfig::new(url))
            .map_err(|error| error.to_string())?;
        tracing::info!(redis = %domain::redact_url(url), "display cache in Redis");
        engine::workers::spawn_cache_invalidator(&engine, Arc::new(cache), &workers, &shutdown);
    }
    if let Some(url) = nats_url {
        let bus = bus::Bus::connect(bus::BusConfig::new(url))
            .await
            .map_err(|error| format!("STOCKD_NATS_URL: {error}"))?;
        let relay = Arc::new(engine::relay::EventRelay::for_this_process(bus));
        tracing::info!(
            nats = %domain::redact_url(url),
            holder = relay.holder(),
            "relaying events to NATS JetStream"
        );
        workers.spawn(api::intake::attach_and_run(
            intake_state.clone(),
            relay.bus().clone(),
            api::intake::IntakeSettings::default(),
            shutdown.clone(),
        ));
        engine::workers::spawn_relay(&engine, relay, &workers, &shutdown);
    }
    spawn_rate_limit_sweeper(state.clone(), &workers, &shutdown);
    let grace = Duration::from_secs(arguments.shutdown_grace_seconds);
    let finished = api::server::serve_until(
        listener,
        api::app(state),
        shutdown.clone(),
        grace,
        arguments.limits.server(),
    )
    .await
    .map_err(|error| format!("server failed: {error}"))?;
    // The tickets' requests and the workers' last steps end within the same grace as
    // the connections, counted from the signal: an orchestrator's kill timeout set to
    // the grace (plus a margin) is then enough.
    let deadline = signalled_at
        .get()
        .copied()
        .unwrap_or_else(tokio::time::Instant::now)
        + grace;
    let after_connections = deadline;
    if !engine
        .finish_tickets(deadline.saturating_duration_since(tokio::time::Instant::now()))
        .await
    {
        tracing::warn!("requests of tickets handed out did not run within the grace period");
    }
    workers.close();
    if tokio::time::timeout_at(after_connections, workers.wait())
        .await
        .is_err()
    {
        tracing::warn!("workers did not stop within the grace period");
    }
    store.close().await;
    tracing::info!(all_requests_finished = finished, "stopped");
    Ok(())
}

/// Forgets, once a minute, the rate of credentials that sent nothing lately.
fn spawn_rate_limit_sweeper(
    state: api::AppState,
    workers: &TaskTracker,
    shutdown: &CancellationToken,
) {
    let shutdown = shutdown.clone();
    workers.spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(60)) => state.http.forget_idle(),
            }
        }
    });
}

/// Where payments go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GatewayChoice {
    /// `STOCKD_GATEWAY_URL`: the gateway there. A real one refuses the sandbox's fault
    /// methods; with `STOCKD_GATEWAY=sandbox` the URL is a `stockd gateway-sandbox`.
    Configured { sandbox: bool },
    /// The in-process sandbox: on a loopback listener, or chosen with
    /// `STOCKD_GATEWAY=sandbox`.
    InProcessSandbox,
}

/// The sandbox "charges" every card: it may take payments only where nobody else can
/// reach the server, unless chosen explicitly.
fn choose_gateway(
    arguments: &PaymentArguments,
    address: std::net::SocketAddr,
) -> Result<GatewayChoice, String> {
    match (arguments.gateway_url(), arguments.explicit_sandbox()?) {
        // A gateway on this machine with the sandbox's key is a `stockd
        // gateway-sandbox`, which accepts every card, as the in-process one does.
        (Some(url), false)
            if !address.ip().is_loopback()
                && arguments.gateway_config(url).is_a_sandbox_on_this_machine() =>
        {
            Err(format!(
                "refusing to serve on {address} with the payment sandbox at {url}, which accepts every card: \
                 set STOCKD_GATEWAY_API_KEY to the gateway's own key if it is a real one, \
                 or STOCKD_GATEWAY=sandbox to use the sandbox on purpose"
            ))
        }
        (Some(_), sandbox) => Ok(GatewayChoice::Configured { sandbox }),
        (None, true) => Ok(GatewayChoice::InProcessSandbox),
        (None, false) if address.ip().is_loopback() => Ok(GatewayChoice::InProcessSandbox),
        (None, false) => Err(format!(
            "refusing to serve on {address} with the in-process payment sandbox, which accepts every card: \
             set STOCKD_GATEWAY_URL (and STOCKD_WEBHOOK_SECRET) for a real gateway, \
             or STOCKD_GATEWAY=sandbox to use the sandbox on purpose"
        )),
    }
}

/// The exit status of a stop forced by a second signal during the grace period.
const FORCED_STOP_EXIT_CODE: i32 = 1;

/// Cancels `shutdown` on SIGINT or SIGTERM, and exits at once on a second one (an
/// operator who cannot wait out the grace period). The handlers are registered before
/// this returns, so a signal sent as soon as the start-up lines are printed is not lost
/// (with the default disposition it would kill the process mid-start).
fn cancel_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut interrupt), Ok(mut terminate)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot listen for SIGINT and SIGTERM");
            return;
        };
        tokio::spawn(async move {
            let mut next_signal = async || {
                tokio::select! {
                    _ = interrupt.recv() => {},
                    _ = terminate.recv() => {},
                }
            };
            next_signal().await;
            tracing::info!(
                "shutdown signal received; finishing in-flight requests (a second signal stops at once)"
            );
            shutdown.cancel();
            next_signal().await;
            // As safe as a crash, which the kill -9 drill checks: an answer is sent
            // only after its transaction committed, and the database rolls back the
            // rest; clients retry what got no answer under the same key.
            tracing::warn!(
                "second shutdown signal: stopping without waiting for in-flight requests"
            );
            std::process::exit(FORCED_STOP_EXIT_CODE);
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        shutdown.cancel();
    });
}

/// Connects the engine to the configured gateway, or starts the in-process sandbox
/// (reached over HTTP like any gateway) and returns it.
async fn attach_payments(
    engine: &Engine,
    arguments: &PaymentArguments,
    choice: GatewayChoice,
) -> Result<Option<(sandbox::Sandbox, std::net::SocketAddr)>, String> {
    if let (GatewayChoice::Configured { sandbox }, Some(url)) = (choice, arguments.gateway_url()) {
        let secret = arguments
            .webhook_secret
            .clone()
            .ok_or("--gateway-url needs --webhook-secret (STOCKD_WEBHOOK_SECRET)")?;
        let gateway = gateway::GatewayClient::new(arguments.gateway_config(url))?;
        engine.attach_payments(engine::payments::Payments {
            gateway,
            webhook_secret: domain::Secret::new(secret),
            sandbox_methods_allowed: sandbox,
            own_sandbox_payments: None,
        });
        return Ok(None);
    }
    let secret = arguments
        .webhook_secret
        .clone()
        .unwrap_or_else(|| format!("whsec_{}", domain::lower_hex(&rand::random::<[u8; 16]>())));
    let mut config = sandbox::SandboxConfig::new(secret.clone());
    config.api_key = Some(arguments.gateway_api_key.clone());
    let sandbox = sandbox::Sandbox::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|error| format!("cannot start the gateway sandbox: {error}"))?;
    let address = listener.local_addr().map_err(|error| error.to_string())?;
    let serving = sandbox.clone();
    tokio::spawn(async move { serving.serve(listener, CancellationToken::new()).await });
    let gateway =
        gateway::GatewayClient::new(arguments.gateway_config(format!("http://{address}")))?;
    engine.attach_payments(engine::payments::Payments {
        gateway,
        webhook_secret: domain::Secret::new(secret),
        sandbox_methods_allowed: true,
        own_sandbox_payments: Some(sandbox.id_prefix("pi")),
    });
    Ok(Some((sandbox, address)))
}

async fn gateway_sandbox(arguments: SandboxArguments) -> Result<bool, String> {
    check_webhook_secret(&arguments.webhook_secret)?;
    let mut config = sandbox::SandboxConfig::new(arguments.webhook_secret);
    config.webhook_url = arguments.webhook_url;
    config.api_key = arguments.api_key;
    config.slow_milliseconds = arguments.slow_milliseconds;
    config.hang_milliseconds = arguments.hang_milliseconds;
    config.fault = arguments
        .fault
        .as_deref()
        .map(sandbox::Fault::parse)
        .transpose()?;
    let sandbox = sandbox::Sandbox::new(config);
    let listener = tokio::net::TcpListener::bind(&arguments.listen)
        .await
        .map_err(|error| format!("cannot listen on {}: {error}", arguments.listen))?;
    let address = listener.local_addr().map_err(|error| error.to_string())?;
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    println!("stockd: gateway sandbox listening on http://{address}");
    sandbox
        .serve(listener, shutdown)
        .await
        .map_err(|error| error.to_string())?;
    Ok(true)
}

fn print_demo_summary(summary: &engine::demo::DemoSummary) {
    println!(
        "stockd: demo catalog loaded: {} products in shop demo-market, SKUs {}",
        summary.product_ids.len(),
        summary.skus.join(", ")
    );
    println!(
        "stockd: try GET /v1/products/{}",
        summary.product_ids.first().map_or("", String::as_str)
    );
    if let Some(token) = &summary.operator_token {
        println!("stockd: operator demo-operator (shop demo-market) token: {token}");
    }
    if let Some(secret) = &summary.service_secret {
        println!("stockd: service key demo-checkout (shop demo-market) secret: {secret}");
    }
}

async fn seed(arguments: DatabaseArguments) -> Result<bool, String> {
    let store = connect_and_migrate(&arguments).await?;
    let engine = Engine::new(
        store.clone(),
        Arc::new(SystemClock),
        api::renderer(),
        EngineConfig::default(),
    );
    let summary = engine::demo::load_demo_catalog(&engine)
        .await
        .map_err(|error| format!("loading the demo catalog failed: {error}"))?;
    print_demo_summary(&summary);
    store.close().await;
    Ok(true)
}

async fn rotate_admin_token(arguments: DatabaseArguments) -> Result<bool, String> {
    let store = connect_and_migrate(&arguments).await?;
    let engine = Engine::new(
        store.clone(),
        Arc::new(SystemClock),
        api::renderer(),
        EngineConfig::default(),
    );
    let token = engine
        .rotate_admin_token()
        .await
        .map_err(|error| format!("cannot store the admin token: {error}"))?;
    println!(
        "stockd: new admin token (the old one stops working): {}",
        token.expose()
    );
    store.close().await;
    Ok(true)
}

/// Longest one statement of `stockd audit` may run. Its statements read the whole
/// ledger, which only grows: the service's 30 s bound would fail the audit of a large
/// one (about 10 s at 10 million rows, docs/BENCHMARKS.md), and an operator running the
/// command waits for its answer.
const AUDIT_STATEMENT_TIMEOUT_MILLISECONDS: u64 = 3_600_000;

/// The store `stockd audit` opens: the service's, with the audit's statement bound.
fn audit_store_config(arguments: &DatabaseArguments) -> StoreConfig {
    let mut config = store_config(arguments);
    config.statement_timeout_milliseconds = AUDIT_STATEMENT_TIMEOUT_MILLISECONDS;
    config
}

async fn audit(arguments: DatabaseArguments) -> Result<bool, String> {
    let store = Store::connect(&audit_store_config(&arguments))
        .await
        .map_err(|error| {
            format!(
                "cannot open the database: {}",
                domain::redact_urls_in(&error.to_string())
            )
        })?;
    // Read only: it migrates nothing, but a schema older or newer than this binary's
    // would make its verdict worthless.
    store
        .check_schema()
        .await
        .map_err(|error| domain::redact_urls_in(&error.to_string()))?;
    let engine = Engine::new(
        store.clone(),
        Arc::new(SystemClock),
        api::renderer(),
        EngineConfig::default(),
    );
    let report = engine
        .audit(&domain::Principal::Admin)
        .await
        .map_err(|error| format!("audit failed: {error}"))?;
    let body = serde_json::to_string_pretty(&api::wire::AuditBody::new(&report))
        .map_err(|error| error.to_string())?;
    println!("{body}");
    store.close().await;
    Ok(report.ok())
}

/// Runs one drill; true when everything it checks held.
async fn drill(arguments: DrillArguments) -> Result<bool, String> {
    let seconds = Duration::from_secs(arguments.seconds.max(1));
    let report = match arguments.name.as_str() {
        "failover" => {
            lab::drill::failover(lab::drill::FailoverOptions {
                clients: arguments.clients.clamp(1, 256),
                before_kill: seconds,
                after_recovery: seconds,
            })
            .await?
        }
        "replica-lag" => lab::drill::replica_lag(lab::drill::ReplicaLagOptions::default()).await?,
        "duplicate-delivery" => {
            lab::duplicate_drill::duplicate_delivery(
                lab::duplicate_drill::DuplicateDeliveryOptions {
                    nats_url: arguments.nats_url.clone(),
                },
            )
            .await?
        }
        "lock-timeout"
        | "deadlock"
        | "lost-response"
        | "compensation-failure"
        | "drop-before-commit" => {
            let options = lab::fault_drills::FaultDrillOptions {
                database_url: arguments.database_url.clone(),
            };
            match arguments.name.as_str() {
                "lock-timeout" => lab::fault_drills::lock_timeout(options).await?,
                "deadlock" => lab::fault_drills::deadlock(options).await?,
                "compensation-failure" => lab::fault_drills::compensation_failure(options).await?,
                "drop-before-commit" => lab::fault_drills::drop_before_commit(options).await?,
                _ => lab::fault_drills::lost_response(options).await?,
            }
        }
        other => {
            return Err(format!(
                "unknown drill '{other}' (this build has: {})",
                lab::drill::DRILLS.join(", ")
            ));
        }
    };
    print!("{}", report.render());
    if let Some(path) = &arguments.json {
        let text = serde_json::to_string_pretty(&report).map_err(|error| error.to_string())?;
        std::fs::write(path, text)
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    Ok(report.held)
}

async fn bench(arguments: BenchArguments) -> Result<bool, String> {
    arguments.campaigns.check()?;
    let command = lab::BenchCommand {
        scenario: lab::Scenario::parse(&arguments.scenario)?,
        options: lab::BenchOptions {
            clients: arguments.clients,
            duration: arguments.duration,
            requests: arguments.requests,
            skus: arguments.skus,
            lines_per_order: arguments.lines_per_order,
            duplicate_ratio: arguments.duplicate_ratio,
            stock: arguments.stock,
            users: arguments.users,
            per_user_limit: arguments.per_user_limit,
            buckets: arguments.buckets,
            ledger_rows: arguments.ledger_rows,
            seed: arguments.seed,
        },
        url: arguments.url,
        admin_token: arguments.admin_token.map(domain::Secret::new),
        database_url: arguments.database_url,
        pool_size: arguments.pool_size,
        engine_config: arguments
            .combiner
            .apply(arguments.campaigns.apply(EngineConfig::default())),
        json: arguments.json,
        evidence: arguments.evidence,
        command_line: lab::evidence::redacted_command(&std::env::args().collect::<Vec<_>>()),
    };
    let report = lab::bench(command).await?;
    Ok(report.passed())
}

async fn gate(arguments: GateArguments) -> Result<bool, String> {
    let report = lab::gate::gate(lab::gate::GateOptions {
        database_url: arguments.database_url,
        evidence: arguments.evidence.clone(),
        cluster: arguments.cluster,
        command_line: lab::evidence::redacted_command(&std::env::args().collect::<Vec<_>>()),
    })
    .await?;
    for item in &report.items {
        let verdict = match item.held {
            Some(true) => "pass   ",
            Some(false) => "FAIL   ",
            None => "not run",
        };
        println!("{verdict} {}: {}", item.name, item.detail);
    }
    println!(
        "gate: {} (evidence in {})",
        report.verdict.name(),
        arguments.evidence.display()
    );
    if let Some(path) = &arguments.json {
        let text = serde_json::to_string_pretty(&report).map_err(|error| error.to_string())?;
        std::fs::write(path, text)
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    Ok(report.passed)
}

async fn strategies(arguments: StrategiesArguments) -> Result<bool, String> {
    let think_time = Duration::from_millis(arguments.think_time_milliseconds);
    let (backend, results) = lab::strategies::run_all(&arguments.database_url, think_time).await?;
    println!("{}", lab::strategies::render_table(&backend, &results));
    if let Some(path) = &arguments.json {
        let json = serde_json::to_string_pretty(&results).map_err(|error| error.to_string())?;
        std::fs::write(path, json)
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    // The safe strategies must never oversell; the unsafe one is expected to.
    Ok(results
        .iter()
        .all(|result| !result.strategy.is_safe() || !result.oversold_visibly()))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            // The parser names the flag a bad value was given to; most settings come
            // from the environment, so the variable is named too.
            if let Some(variable) = variable_of_invalid_argument(&error) {
                eprintln!("stockd: {variable} (or its flag) has a value stockd refuses:");
            }
            error.exit()
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("stockd: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let outcome = runtime.block_on(async move {
        match cli.command {
            Command::Serve(arguments) => {
                init_logging(&arguments.database)?;
                serve(*arguments).await.map(|()| true)
            }
            Command::Migrate(arguments) => {
                init_logging(&arguments)?;
                // A signal lets the migration under way finish (on MySQL a migration's
                // DDL commits statement by statement: one cut short is half applied
                // and unrecorded); a second one stops at once.
                cancel_on_signal(CancellationToken::new());
                let store = connect_and_migrate(&arguments).await?;
                println!("stockd: database is migrated ({})", store.backend_name());
                store.close().await;
                Ok(true)
            }
            Command::Audit(arguments) => {
                init_logging(&arguments)?;
                audit(arguments).await
            }
            Command::Seed(arguments) => {
                init_logging(&arguments)?;
                seed(arguments).await
            }
            Command::RotateAdminToken(arguments) => {
                init_logging(&arguments)?;
                rotate_admin_token(arguments).await
            }
            Command::GatewaySandbox(arguments) => gateway_sandbox(arguments).await,
            Command::Bench(arguments) => bench(*arguments).await,
            Command::Drill(arguments) => drill(arguments).await,
            Command::Gate(arguments) => gate(arguments).await,
            Command::Lab {
                experiment: LabCommand::Strategies(arguments),
            } => strategies(arguments).await,
        }
    });
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(message) => {
            eprintln!("stockd: {message}");
            ExitCode::from(2)
        }
    }
}

/// The environment variable of the flag a parse error is about, if it has one.
fn variable_of_invalid_argument(error: &clap::Error) -> Option<String> {
    use clap::CommandFactory;
    use clap::error::ErrorKind;
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return None;
    }
    let clap::error::ContextValue::String(argument) =
        error.get(clap::error::ContextKind::InvalidArg)?
    else {
        return None;
    };
    let long = argument
        .strip_prefix("--")?
        .split([' ', '='])
        .next()?
        .to_owned();
    let command = Cli::command();
    command
        .get_subcommands()
        .chain(std::iter::once(&command))
        .flat_map(clap::Command::get_arguments)
        .find(|candidate| candidate.get_long() == Some(long.as_str()))
        .and_then(|candidate| candidate.get_env())
        .map(|variable| variable.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stockd audit` reads the whole ledger in one snapshot: the service's 30 s
    /// statement bound would fail it on a large ledger, so the command has its own.
    #[test]
    fn the_audit_command_runs_under_its_own_statement_bound_not_the_services() {
        let cli = Cli::parse_from(["stockd", "audit", "--database-url", "sqlite://audit.db"]);
        let Command::Audit(arguments) = cli.command else {
            panic!("parsed as another command");
        };
        assert_eq!(
            audit_store_config(&arguments).statement_timeout_milliseconds,
            AUDIT_STATEMENT_TIMEOUT_MILLISECONDS
        );
        assert_eq!(
            store_config(&arguments).statement_timeout_milliseconds,
            30_000
        );
    }
}

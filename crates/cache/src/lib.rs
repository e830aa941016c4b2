//! The display cache (DESIGN.md principle 12, "Events and caches"; seed 003 §4.4): the
//! shopper's product view kept in Redis. It only ever shows: nothing that decides a
//! sale reads it.
//!
//! - **Filled on a miss**, by whoever missed: [`DisplayCache::lookup`] answers the
//!   value or a [`Fill`] ticket holding the key's generation; the reader reads the
//!   database and hands the ticket back with the value ([`DisplayCache::fill`]).
//! - **Dropped by the events**: the engine follows the outbox and, for every event
//!   about a product or its SKUs, [`DisplayCache::invalidate`]s the key — the
//!   generation goes up and the value goes away, in one script.
//! - **No stale refill**: a fill writes only if the generation is still the one its
//!   ticket read (a compare-and-set in Lua), so a reader that read the database before
//!   a change cannot put the old state back after the change's invalidation.
//! - **Bounded**: every value expires after `value_ttl`, every call gives up after
//!   `timeout`; Redis down means the caller reads the database (and counts an error).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::OnceCell;

/// Why the cache could not answer (the caller reads the database instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheError(pub String);

impl std::fmt::Display for CacheError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "display cache: {}", self.0)
    }
}

impl std::error::Error for CacheError {}

/// How to reach Redis and how long values live.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub url: String,
    /// Longest a value is shown without a refill, whatever the events did.
    pub value_ttl: Duration,
    /// Longest wait for Redis on any call, connecting included.
    pub timeout: Duration,
    /// How long a key's generation is remembered after its last change (it must
    /// outlive any fill in progress).
    pub generation_ttl: Duration,
}

impl CacheConfig {
    pub fn new(url: impl Into<String>) -> CacheConfig {
        CacheConfig {
            url: url.into(),
            value_ttl: Duration::from_secs(60),
            timeout: Duration::from_millis(250),
            generation_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// What is cached, one key each.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CacheKey {
    /// The shopper's view of a product (`GET /v1/products/{id}`).
    ProductView(String),
}

impl CacheKey {
    fn value_key(&self) -> String {
        match self {
            CacheKey::ProductView(id) => format!("stockd:v1:product-view:{id}"),
        }
    }

    fn generation_key(&self) -> String {
        format!("{}:generation", self.value_key())
    }
}

/// A miss's permission to fill: the key's generation when it missed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fill {
    key: CacheKey,
    generation: String,
}

/// A lookup's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Hit(String),
    Miss(Fill),
}

/// The cache of one process (the connection is shared by every request).
pub struct DisplayCache {
    client: redis::Client,
    connection: OnceCell<ConnectionManager>,
    config: CacheConfig,
}

impl std::fmt::Debug for DisplayCache {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("DisplayCache")
            .field("value_ttl", &self.config.value_ttl)
            .finish_non_exhaustive()
    }
}

/// Sets the value only while the generation is the ticket's (a missing generation
/// counts as "0").
const FILL_SCRIPT: &str = r"
local current = redis.call('GET', KEYS[2]) or '0'
if current == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
return 0
";

/// Moves the generation on and drops the value, together.
const INVALIDATE_SCRIPT: &str = r"
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[1])
return 1
";

impl DisplayCache {
    /// Checks the URL; connects on first use (Redis may be down at start).
    pub fn new(config: CacheConfig) -> Result<DisplayCache, CacheError> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|error| CacheError(format!("STOCKD_REDIS_URL: {error}")))?;
        Ok(DisplayCache {
            client,
            connection: OnceCell::new(),
            config,
        })
    }

    async fn connection(&self) -> Result<ConnectionManager, CacheError> {
        let timeout = self.config.timeout;
        let connection = self
            .connection
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_secs(1));
                tokio::time::timeout(
                    timeout,
                    self.client.get_connection_manager_with_config(config),
                )
                .await
                .map_err(|_| CacheError("connecting timed out".into()))?
                .map_err(|error| CacheError(error.to_string()))
            })
            .await?;
        Ok(connection.clone())
    }

    /// The value, or a ticket to fill it.
    pub async fn lookup(&self, key: &CacheKey) -> Result<Lookup, CacheError> {
        let mut connection = self.connection().await?;
        let (value, generation): (Option<String>, Option<String>) = self
            .bounded(
                redis::cmd("MGET")
                    .arg(key.value_key())
                    .arg(key.generation_key())
                    .query_async(&mut connection),
            )
            .await?;
        Ok(match value {
            Some(value) => Lookup::Hit(value),
            None => Lookup::Miss(Fill {
                key: key.clone(),
                generation: generation.unwrap_or_else(|| "0".to_owned()),
            }),
        })
    }

    /// Stores `value` for the ticket's key unless the key changed since the ticket
    /// was taken. Answers whether it was stored.
    pub async fn fill(&self, ticket: &Fill, value: &str) -> Result<bool, CacheError> {
        let mut connection = self.connection().await?;
        let stored: i64 = self
            .bounded(
                redis::Script::new(FILL_SCRIPT)
                    .key(ticket.key.value_key())
                    .key(ticket.key.generation_key())
                    .arg(&ticket.generation)
                    .arg(value)
                    .arg(milliseconds(self.config.value_ttl))
                    .invoke_async(&mut connection),
            )
            .await?;
        Ok(stored == 1)
    }

    /// Drops these keys: their values go, their generations move on (so a fill that
    /// read before now cannot store).
    pub async fn invalidate(&self, keys: &[CacheKey]) -> Result<(), CacheError> {
        if keys.is_empty() {
            return Ok(());
        }
        let mut connection = self.connection().await?;
        let script = redis::Script::new(INVALIDATE_SCRIPT);
        for key in keys {
            let _: i64 = self
                .bounded(
                    script
                        .key(key.value_key())
                        .key(key.generation_key())
                        .arg(milliseconds(self.config.generation_ttl))
                        .invoke_async(&mut connection),
                )
                .await?;
        }
        Ok(())
    }

    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, CacheError> {
        tokio::time::timeout(self.config.timeout, call)
            .await
            .map_err(|_| CacheError(format!("no answer within {:?}", self.config.timeout)))?
            .map_err(|error| CacheError(error.to_string()))
    }
}

fn milliseconds(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

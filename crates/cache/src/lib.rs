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
//!   Generations are tokens never used twice, not counters: Redis restarted without
//!   persistence, or a generation evicted, forgets them, and a counter would start
//!   over and hand an old ticket its number again. A missing generation matches no
//!   ticket; a miss sets one.
//! - **Bounded**: every value expires after `value_ttl`, and so does a generation set
//!   by a miss; every call gives up after `timeout`; Redis down means the caller reads
//!   the database (and counts an error). One request at a time connects, and no other
//!   waits for it. A call that gets no answer in time drops the connection, so a Redis
//!   that connected and then went silent costs one request the timeout, not every one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;

/// After a connection attempt failed, requests go to the database without trying
/// again for this long (then the next request tries).
pub const CONNECT_RETRY_PAUSE: Duration = Duration::from_secs(1);

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
    /// How long a key's generation is remembered after its last change (a fill that
    /// takes longer stores nothing). A generation set by a miss lives only as long as
    /// a value: a miss on a key that never changes, a made-up product id say, leaves
    /// nothing behind for longer, whoever sends them.
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

/// A miss's permission to fill: the key's generation when it missed (set by the miss
/// when the key had none).
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
    link: Mutex<Link>,
    config: CacheConfig,
    generations: GenerationTokens,
}

/// Generation tokens no process hands out twice: a random start of the process's own
/// and a count.
struct GenerationTokens {
    process: u64,
    count: AtomicU64,
}

impl GenerationTokens {
    fn new() -> GenerationTokens {
        GenerationTokens {
            process: rand::random(),
            count: AtomicU64::new(0),
        }
    }

    fn next(&self) -> String {
        let count = self.count.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}-{count}", self.process)
    }
}

/// Where the shared connection stands. One request at a time connects; the others
/// never wait for it (they read the database), so Redis unreachable at start costs
/// each request nothing, instead of each waiting its turn to try.
#[derive(Default)]
enum Link {
    /// Not connected: the next request may try, from `retry_at` on when an attempt
    /// failed.
    #[default]
    Down,
    Failed {
        retry_at: Instant,
    },
    Connecting,
    Up(ConnectionManager),
}

/// The attempt of the request that connects: a request that goes away mid-attempt
/// (its caller gone) leaves the link for the next request to try at once.
struct ConnectAttempt<'a> {
    link: &'a Mutex<Link>,
    settled: bool,
}

impl ConnectAttempt<'_> {
    fn settle(mut self, outcome: Link) {
        *lock(self.link) = outcome;
        self.settled = true;
    }
}

impl Drop for ConnectAttempt<'_> {
    fn drop(&mut self) {
        if !self.settled {
            *lock(self.link) = Link::Down;
        }
    }
}

fn lock(link: &Mutex<Link>) -> MutexGuard<'_, Link> {
    link.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl std::fmt::Debug for DisplayCache {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("DisplayCache")
            .field("value_ttl", &self.config.value_ttl)
            .finish_non_exhaustive()
    }
}

/// The value; or, on a miss, the key's generation, set to the new token `ARGV[1]` when
/// the key has none (Redis restarted, the key never dropped or its generation evicted).
const LOOKUP_SCRIPT: &str = r"
local value = redis.call('GET', KEYS[1])
if value then
    return {value, false}
end
local generation = redis.call('GET', KEYS[2])
if not generation then
    generation = ARGV[1]
    redis.call('SET', KEYS[2], generation, 'PX', ARGV[2])
end
return {false, generation}
";

/// Sets the value only while the generation is the ticket's (a missing generation is
/// no ticket's).
const FILL_SCRIPT: &str = r"
local current = redis.call('GET', KEYS[2])
if current == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
return 0
";

/// For each (value, generation) pair of keys: moves the generation on to the new
/// token `ARGV[1]` and drops the value, together.
const INVALIDATE_SCRIPT: &str = r"
for index = 1, #KEYS, 2 do
    redis.call('SET', KEYS[index + 1], ARGV[1], 'PX', ARGV[2])
    redis.call('DEL', KEYS[index])
end
return #KEYS / 2
";

/// Keys dropped by one script call: a step's drops go in a few calls, not one call
/// per key (each bounded by the timeout, where one slow answer failed the step), and
/// no single call keeps Redis busy long.
pub const KEYS_PER_INVALIDATION_MAX: usize = 500;

impl DisplayCache {
    /// Longest a value is shown without a refill.
    pub fn value_ttl(&self) -> Duration {
        self.config.value_ttl
    }

    /// Checks the URL; connects on first use (Redis may be down at start).
    pub fn new(config: CacheConfig) -> Result<DisplayCache, CacheError> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|error| CacheError(format!("STOCKD_REDIS_URL: {error}")))?;
        Ok(DisplayCache {
            client,
            link: Mutex::new(Link::Down),
            config,
            generations: GenerationTokens::new(),
        })
    }

    /// The shared connection; or, while another request is connecting or within
    /// [`CONNECT_RETRY_PAUSE`] of a failed attempt, an error at once.
    async fn connection(&self) -> Result<ConnectionManager, CacheError> {
        let attempt = {
            let mut link = lock(&self.link);
            match &*link {
                Link::Up(connection) => return Ok(connection.clone()),
                Link::Connecting => {
                    return Err(CacheError(
                        "not connected yet (another request is connecting)".into(),
                    ));
                }
                Link::Failed { retry_at } if Instant::now() < *retry_at => {
                    return Err(CacheError(format!(
                        "not connected (the last attempt failed; the next within {CONNECT_RETRY_PAUSE:?})"
                    )));
                }
                Link::Failed { .. } | Link::Down => {
                    *link = Link::Connecting;
                    ConnectAttempt {
                        link: &self.link,
                        settled: false,
                    }
                }
            }
        };
        let timeout = self.config.timeout;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let connected = tokio::time::timeout(
            timeout,
            self.client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| CacheError("connecting timed out".into()))
        .and_then(|connected| connected.map_err(|error| CacheError(error.to_string())));
        match connected {
            Ok(connection) => {
                attempt.settle(Link::Up(connection.clone()));
                Ok(connection)
            }
            Err(error) => {
                attempt.settle(Link::Failed {
                    retry_at: Instant::now() + CONNECT_RETRY_PAUSE,
                });
                Err(error)
            }
        }
    }

    /// The value, or a ticket to fill it.
    pub async fn lookup(&self, key: &CacheKey) -> Result<Lookup, CacheError> {
        let mut connection = self.connection().await?;
        let (value, generation): (Option<String>, Option<String>) = self
            .bounded(
                redis::Script::new(LOOKUP_SCRIPT)
                    .key(key.value_key())
                    .key(key.generation_key())
                    .arg(self.generations.next())
                    .arg(milliseconds(self.miss_generation_ttl()))
                    .invoke_async(&mut connection),
            )
            .await?;
        match (value, generation) {
            (Some(value), _) => Ok(Lookup::Hit(value)),
            (None, Some(generation)) => Ok(Lookup::Miss(Fill {
                key: key.clone(),
                generation,
            })),
            (None, None) => Err(CacheError(
                "a miss answered no generation to fill with".into(),
            )),
        }
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
        for chunk in keys.chunks(KEYS_PER_INVALIDATION_MAX) {
            let mut invocation = script.prepare_invoke();
            for key in chunk {
                invocation.key(key.value_key()).key(key.generation_key());
            }
            invocation
                .arg(self.generations.next())
                .arg(milliseconds(self.config.generation_ttl));
            let _: i64 = self
                .bounded(invocation.invoke_async(&mut connection))
                .await?;
        }
        Ok(())
    }

    /// How long a generation set by a miss lives: no longer than the value it lets a
    /// reader fill (the generation only has to outlive the fill in progress; one that
    /// is gone matches no ticket, so the next miss sets a new one).
    fn miss_generation_ttl(&self) -> Duration {
        self.config.value_ttl.min(self.config.generation_ttl)
    }

    /// The call, given up after the timeout. A call given up drops the shared
    /// connection: a Redis that took the connection and went silent (a partition, a
    /// stalled server) would otherwise cost every request the whole timeout; now the
    /// requests within [`CONNECT_RETRY_PAUSE`] go to the database at once, and the next
    /// one connects afresh.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, CacheError> {
        // The connection's own response bound is the same as this one: whichever
        // ends the wait first, the call got no answer.
        let error = match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(error)) if !error.is_timeout() => return Err(CacheError(error.to_string())),
            Ok(Err(_)) | Err(_) => {
                CacheError(format!("no answer within {:?}", self.config.timeout))
            }
        };
        let mut link = lock(&self.link);
        if matches!(*link, Link::Up(_)) {
            *link = Link::Failed {
                retry_at: Instant::now() + CONNECT_RETRY_PAUSE,
            };
        }
        Err(error)
    }
}

fn milliseconds(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::net::TcpListener;

    /// A "Redis" that takes connections and never answers, and the cache pointed at
    /// it, with a bound long enough that an attempt cannot end during the test.
    async fn silent_redis() -> (TcpListener, Arc<DisplayCache>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let address = listener.local_addr().expect("its address");
        let config = CacheConfig {
            timeout: Duration::from_secs(600),
            ..CacheConfig::new(format!("redis://{address}"))
        };
        (
            listener,
            Arc::new(DisplayCache::new(config).expect("a cache")),
        )
    }

    fn key() -> CacheKey {
        CacheKey::ProductView("product-1".into())
    }

    #[tokio::test]
    async fn while_one_request_connects_the_others_go_to_the_database_without_waiting() {
        let (listener, cache) = silent_redis().await;
        let connecting = tokio::spawn({
            let cache = Arc::clone(&cache);
            async move { cache.lookup(&key()).await }
        });
        let (_unanswered, _) = listener.accept().await.expect("the first connection");

        // Answered at once; the bound only turns a wait for the first request's
        // attempt (600 s) into a failure.
        let other = tokio::time::timeout(Duration::from_secs(60), cache.lookup(&key()))
            .await
            .expect("answered without waiting for the other request's attempt");

        assert!(other.is_err(), "{other:?}");
        assert!(
            !connecting.is_finished(),
            "answered while the first request was still connecting"
        );
        connecting.abort();
    }

    #[tokio::test]
    async fn a_request_that_goes_away_while_connecting_lets_the_next_one_connect() {
        let (listener, cache) = silent_redis().await;
        let connecting = tokio::spawn({
            let cache = Arc::clone(&cache);
            async move { cache.lookup(&key()).await }
        });
        let (_first, _) = listener.accept().await.expect("the first connection");
        connecting.abort();
        assert!(connecting.await.is_err_and(|error| error.is_cancelled()));

        let mut next = tokio::spawn({
            let cache = Arc::clone(&cache);
            async move { cache.lookup(&key()).await }
        });
        tokio::select! {
            accepted = listener.accept() => {
                accepted.expect("a second attempt");
            }
            answered = &mut next => {
                panic!("answered without trying to connect: {answered:?}");
            }
        }
        next.abort();
    }
}

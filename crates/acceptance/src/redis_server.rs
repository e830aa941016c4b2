//! A Redis server of a test's own: the machine's `redis-server` on a free loopback
//! port without persistence, so a test can stop it (Redis down) and start it again.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use cache::{CacheConfig, DisplayCache};

const REDIS_SERVER_DEFAULT: &str = "/usr/bin/redis-server";

pub struct TestRedis {
    port: u16,
    child: Option<Child>,
}

impl TestRedis {
    pub async fn start() -> TestRedis {
        let port = crate::free_port();
        let mut redis = TestRedis { port, child: None };
        redis.start_again().await;
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A display cache on this server, with the engine's default bounds.
    pub fn cache(&self) -> Arc<DisplayCache> {
        let mut config = CacheConfig::new(self.url());
        config.timeout = Duration::from_millis(500);
        Arc::new(DisplayCache::new(config).expect("a display cache"))
    }

    /// Stops the server (SIGKILL); its values are gone (no persistence).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        let binary = std::env::var("STOCKD_TEST_REDIS_SERVER")
            .unwrap_or_else(|_| REDIS_SERVER_DEFAULT.to_owned());
        let child = Command::new(&binary)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {binary}: {error}"));
        self.child = Some(child);
        crate::wait_until_listening("the Redis server accepts connections", self.port).await;
    }

    /// The keys Redis holds and how long each has left (`None`: kept for good).
    pub async fn keys_with_their_time_left(&self) -> Vec<(String, Option<Duration>)> {
        let client = redis::Client::open(self.url()).expect("a Redis client");
        let mut connection = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut connection)
            .await
            .expect("KEYS");
        let mut listed = Vec::with_capacity(keys.len());
        for key in keys {
            let milliseconds: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut connection)
                .await
                .expect("PTTL");
            let left = u64::try_from(milliseconds).ok().map(Duration::from_millis);
            listed.push((key, left));
        }
        listed
    }

    /// Sets a key directly (a test tampering with the cache).
    pub async fn set(&self, key: &str, value: &str) {
        let client = redis::Client::open(self.url()).expect("a Redis client");
        let mut connection = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis");
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query_async(&mut connection)
            .await
            .expect("SET");
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

//! A NATS server with JetStream of a test's own: the machine's `nats-server` binary on
//! a free loopback port, its store in a temporary directory, so a test can stop and
//! start it (NATS down, NATS back) without disturbing any other test.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use bus::{Bus, BusConfig};
use serde_json::Value;

/// Where Debian installs the server; `STOCKD_TEST_NATS_SERVER` names another.
const NATS_SERVER_DEFAULT: &str = "/usr/sbin/nats-server";

pub struct TestNats {
    port: u16,
    directory: PathBuf,
    child: Option<Child>,
}

impl TestNats {
    /// Starts a server and waits until it accepts connections.
    pub async fn start() -> TestNats {
        let port = crate::free_port();
        let directory = std::env::temp_dir().join(format!(
            "stockd-test-nats-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&directory).expect("a directory for the NATS store");
        let mut nats = TestNats {
            port,
            directory,
            child: None,
        };
        nats.start_again().await;
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGKILL: as abrupt as a crash); its store stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        let binary = std::env::var("STOCKD_TEST_NATS_SERVER")
            .unwrap_or_else(|_| NATS_SERVER_DEFAULT.to_owned());
        let child = Command::new(&binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.directory)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {binary}: {error}"));
        self.child = Some(child);
        crate::wait_until_listening("the NATS server accepts connections", self.port).await;
    }

    /// A connection as stockd makes it, with short timeouts for tests.
    pub async fn bus(&self) -> Bus {
        let mut config = BusConfig::new(self.url());
        config.request_timeout = Duration::from_secs(2);
        let bus = Bus::connect(config).await.expect("connect to NATS");
        crate::wait_until("the bus is connected", || bus.is_connected()).await;
        bus
    }

    /// Publishes a reservation command (JetStream acknowledges it).
    pub async fn publish_command(&self, body: &[u8], key: Option<&str>, message_id: &str) {
        self.try_publish_command(body, key, message_id)
            .await
            .expect("JetStream took the command");
    }

    /// [`TestNats::publish_command`], answering JetStream's refusal instead of failing.
    pub async fn try_publish_command(
        &self,
        body: &[u8],
        key: Option<&str>,
        message_id: &str,
    ) -> Result<(), String> {
        self.try_publish_command_with_key_under(
            body,
            key.map(|key| ("Idempotency-Key", key)),
            message_id,
        )
        .await
    }

    /// [`TestNats::publish_command`] with its key under the header `name` (as a
    /// client that spells it otherwise sends it).
    pub async fn publish_command_with_key_under(
        &self,
        body: &[u8],
        (name, key): (&str, &str),
        message_id: &str,
    ) {
        self.try_publish_command_with_key_under(body, Some((name, key)), message_id)
            .await
            .expect("JetStream took the command");
    }

    async fn try_publish_command_with_key_under(
        &self,
        body: &[u8],
        key: Option<(&str, &str)>,
        message_id: &str,
    ) -> Result<(), String> {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to publish");
        let context = jetstream::new(client);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", message_id);
        if let Some((name, key)) = key {
            headers.insert(name, key);
        }
        context
            .publish_with_headers(
                bus::intake::RESERVE_COMMAND_SUBJECT,
                headers,
                body.to_vec().into(),
            )
            .await
            .map_err(|error| error.to_string())?
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    }

    /// Creates the command stream as an operator might, with no limit but NATS's own
    /// (the intake keeps a stream's existing configuration).
    pub async fn create_command_stream_without_limits(&self) {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to create the stream");
        jetstream::new(client)
            .create_stream(jetstream::stream::Config {
                name: bus::intake::COMMAND_STREAM.to_owned(),
                subjects: vec![bus::intake::COMMAND_SUBJECTS.to_owned()],
                ..jetstream::stream::Config::default()
            })
            .await
            .expect("create the stream");
    }

    /// Creates the event stream as an operator might, refusing messages larger than
    /// `bytes` (the relay keeps a stream's existing configuration).
    pub async fn create_event_stream_with_message_size_max(&self, bytes: i32) {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to create the stream");
        jetstream::new(client)
            .create_stream(jetstream::stream::Config {
                name: bus::EVENT_STREAM.to_owned(),
                subjects: vec![bus::EVENT_SUBJECTS.to_owned()],
                max_message_size: bytes,
                ..jetstream::stream::Config::default()
            })
            .await
            .expect("create the stream");
    }

    /// Deletes stream `stream`, as an operator (or a server that lost its store) would.
    pub async fn delete_stream(&self, stream: &str) {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to delete the stream");
        jetstream::new(client)
            .delete_stream(stream)
            .await
            .expect("delete the stream");
    }

    /// Deletes the intake's consumer only, as an operator (`nats consumer rm`) would.
    pub async fn delete_intake_consumer(&self) {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to delete the consumer");
        jetstream::new(client)
            .get_stream(bus::intake::COMMAND_STREAM)
            .await
            .expect("the command stream")
            .delete_consumer(bus::intake::RESERVE_CONSUMER)
            .await
            .expect("delete the consumer");
    }

    /// Every message in stream `stream` with its headers, in stream order.
    pub async fn stream_messages_with_headers(&self, stream: &str) -> Vec<StreamMessage> {
        let client = async_nats::connect(self.url())
            .await
            .expect("connect to read the stream");
        let context = jetstream::new(client);
        let Ok(mut stream) = context.get_stream(stream).await else {
            return Vec::new();
        };
        let last = stream
            .info()
            .await
            .expect("stream info")
            .state
            .last_sequence;
        let mut messages = Vec::new();
        for sequence in 1..=last {
            let Ok(message) = stream.get_raw_message(sequence).await else {
                continue;
            };
            let headers = message
                .headers
                .iter()
                .map(|(name, values)| {
                    (
                        name.to_string(),
                        values
                            .first()
                            .map(|value| value.as_str().to_owned())
                            .unwrap_or_default(),
                    )
                })
                .collect();
            let body = serde_json::from_slice(&message.payload).unwrap_or(Value::Null);
            messages.push(StreamMessage {
                subject: message.subject.to_string(),
                headers,
                body,
            });
        }
        messages
    }

    /// Every message in stream `stream`, in stream order: (subject, `Nats-Msg-Id`,
    /// body).
    pub async fn stream_messages(&self, stream: &str) -> Vec<(String, String, Value)> {
        self.stream_messages_with_headers(stream)
            .await
            .into_iter()
            .map(|message| {
                let id = message
                    .headers
                    .get("Nats-Msg-Id")
                    .cloned()
                    .unwrap_or_default();
                (message.subject, id, message.body)
            })
            .collect()
    }
}

impl Drop for TestNats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// A message read back from a stream.
#[derive(Debug, Clone)]
pub struct StreamMessage {
    pub subject: String,
    pub headers: std::collections::BTreeMap<String, String>,
    pub body: Value,
}

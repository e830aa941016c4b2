//! stockd's NATS JetStream side (DESIGN.md, "Events and caches"): the stream the
//! outbox relay publishes events to, and the subjects of the queue intake. It knows
//! NATS and the contract's names, nothing of the database: the engine decides what to
//! publish and records what was acknowledged.
//!
//! Every call is bounded: a publish waits `publish_timeout` for its acknowledgement,
//! and a connection that is down makes calls fail fast (the client reconnects in the
//! background) instead of blocking the caller.

use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage, stream};
use bytes::Bytes;

pub mod intake;

pub use domain::event::{EVENT_STREAM, EVENT_SUBJECTS};

/// Why a call to NATS did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BusError {
    /// NATS could not be reached or did not answer in time: try again later.
    Unavailable(String),
    /// NATS answered with a refusal (a stream misconfigured, a message too large).
    Refused(String),
}

impl std::fmt::Display for BusError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BusError::Unavailable(reason) => write!(formatter, "NATS unavailable: {reason}"),
            BusError::Refused(reason) => write!(formatter, "NATS refused: {reason}"),
        }
    }
}

impl std::error::Error for BusError {}

/// How to reach NATS.
#[derive(Debug, Clone)]
pub struct BusConfig {
    /// `nats://host:port`.
    pub url: String,
    /// The client's name in the server's connection list.
    pub client_name: String,
    /// Longest wait for one publish's acknowledgement, or for a JetStream API call.
    pub request_timeout: Duration,
    /// How long JetStream remembers a message id to drop a second publish of it.
    pub duplicate_window: Duration,
    /// How long the event stream keeps events.
    pub event_retention: Duration,
}

impl BusConfig {
    pub fn new(url: impl Into<String>) -> BusConfig {
        BusConfig {
            url: url.into(),
            client_name: "stockd".to_owned(),
            request_timeout: Duration::from_secs(5),
            duplicate_window: Duration::from_secs(120),
            event_retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// A message to publish with its id (`Nats-Msg-Id`).
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub subject: String,
    pub message_id: String,
    pub body: Bytes,
    /// Messages with the same key (an aggregate's events) must be stored in their
    /// order: one is sent only once the previous one with its key was acknowledged.
    pub ordering_key: String,
    /// The shop the message is about, sent as header `Stockd-Shop`: every shop's
    /// events share the subjects, and a consumer keeps its shop's by it.
    pub shop: Option<String>,
}

/// What one ordered publish achieved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    /// Leading messages JetStream acknowledged, in order: everything before the
    /// first that failed.
    pub acknowledged: usize,
    /// Of those, how many JetStream had already stored under the same id (dropped).
    pub duplicates: usize,
    /// Why the rest were not acknowledged, when some were not and something failed.
    pub failure: Option<BusError>,
    /// The time to send ran out before the last message: the rest were not sent (not
    /// a failure; they go out at the next step).
    pub ran_out_of_time: bool,
}

/// A connection to NATS and its JetStream context.
#[derive(Clone)]
pub struct Bus {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    config: BusConfig,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Bus")
            .field("url", &domain::redact_url(&self.config.url))
            .finish_non_exhaustive()
    }
}

/// Whether `url` (one server, or several separated by commas) names NATS servers: a
/// malformed one is refused before the process opens its database.
pub fn check_url(url: &str) -> Result<(), BusError> {
    for (index, server) in url.split(',').enumerate() {
        // The server is not quoted: a URL that does not parse cannot be redacted
        // either, and its password may be what broke it.
        server
            .trim()
            .parse::<async_nats::ServerAddr>()
            .map_err(|error| {
                BusError::Unavailable(format!(
                    "server {} of the list is not a NATS URL: {error}",
                    index + 1
                ))
            })?;
    }
    Ok(())
}

/// What a stream this bus creates may hold besides its age limit (JetStream's `-1`:
/// no limit). A stream that exists keeps its own configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamLimits {
    pub messages_max: i64,
    pub bytes_max: i64,
    pub message_bytes_max: i32,
    /// Which messages give way when the stream is full: `New` refuses the publish
    /// (its sender hears it), `Old` drops the oldest.
    pub discard: stream::DiscardPolicy,
    /// `WorkQueue` forgets a message once it is acknowledged; `Limits` keeps it to
    /// the limits.
    pub retention: stream::RetentionPolicy,
}

impl StreamLimits {
    /// Bounded by age only: the event stream, whose consumers must not lose an event
    /// to a burst of others (the relay's backlog waits in the outbox instead).
    pub(crate) const AGE_ONLY: StreamLimits = StreamLimits {
        messages_max: -1,
        bytes_max: -1,
        message_bytes_max: -1,
        discard: stream::DiscardPolicy::Old,
        retention: stream::RetentionPolicy::Limits,
    };
}

impl Bus {
    /// Connects, or starts connecting: a server that is down at start is retried in
    /// the background (and after any disconnection), and calls fail until it answers.
    pub async fn connect(config: BusConfig) -> Result<Bus, BusError> {
        let client = async_nats::ConnectOptions::new()
            .name(&config.client_name)
            .connection_timeout(config.request_timeout)
            .request_timeout(Some(config.request_timeout))
            .retry_on_initial_connect()
            .connect(config.url.as_str())
            .await
            .map_err(|error| BusError::Unavailable(error.to_string()))?;
        let mut jetstream = jetstream::new(client.clone());
        jetstream.set_timeout(config.request_timeout);
        Ok(Bus {
            client,
            jetstream,
            config,
        })
    }

    /// Whether the connection is up now.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Creates the event stream `STOCKD_EVENTS` (subjects `stockd.events.>`) when it
    /// is missing; an existing one is left as its operator configured it.
    pub async fn ensure_event_stream(&self) -> Result<(), BusError> {
        self.ensure_stream(
            EVENT_STREAM,
            EVENT_SUBJECTS,
            self.config.event_retention,
            StreamLimits::AGE_ONLY,
        )
        .await
    }

    pub(crate) async fn ensure_stream(
        &self,
        name: &str,
        subjects: &str,
        max_age: Duration,
        limits: StreamLimits,
    ) -> Result<(), BusError> {
        self.unless_disconnected()?;
        let created = self
            .jetstream
            .get_or_create_stream(stream::Config {
                name: name.to_owned(),
                subjects: vec![subjects.to_owned()],
                storage: stream::StorageType::File,
                duplicate_window: self.config.duplicate_window,
                max_age,
                max_messages: limits.messages_max,
                max_bytes: limits.bytes_max,
                max_message_size: limits.message_bytes_max,
                discard: limits.discard,
                retention: limits.retention,
                ..stream::Config::default()
            })
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(error) => Err(classify(error.to_string())),
        }
    }

    /// Publishes `messages` in order, each with its id, pipelined on the one
    /// connection, and waits for the acknowledgements. Counts the leading ones
    /// acknowledged: the caller records those and sends the rest again later
    /// (JetStream drops a repeat of an id it has seen).
    ///
    /// JetStream stores each message on its own: a message sent after one that fails
    /// (refused, or lost with the connection while the next ones were still in the
    /// client's buffer) can be stored before the failed one is sent again. So no two
    /// messages of one ordering key are in flight at once: before sending a second
    /// one, the acknowledgements up to the first are awaited (in order), and a failure
    /// among them stops the publish. An aggregate's events are stored in their order;
    /// different aggregates' may interleave, as the contract allows.
    ///
    /// Nothing is sent from `send_until` on (the acknowledgements of what was sent are
    /// still awaited): the relay's lease may end soon after, and a successor then
    /// publishes these events and newer ones; one of these sent after those would be
    /// stored after them (past the duplicate window, a second time).
    pub async fn publish_in_order(
        &self,
        messages: &[Outgoing],
        send_until: tokio::time::Instant,
    ) -> Published {
        if let Err(error) = self.unless_disconnected() {
            return Published {
                failure: Some(error),
                ..Published::default()
            };
        }
        let mut published = Published::default();
        // Sent and not yet acknowledged, in order, each with its ordering key.
        let mut pending: std::collections::VecDeque<(&str, jetstream::context::PublishAckFuture)> =
            std::collections::VecDeque::with_capacity(messages.len());
        let mut failure = None;
        for message in messages {
            let key = message.ordering_key.as_str();
            // The acknowledgements up to this key's previous message, not all of them:
            // a backlog of one aggregate's chain costs a round trip per event, the
            // others' stay pipelined.
            if let Some(previous) = pending
                .iter()
                .rposition(|(pending_key, _)| *pending_key == key)
                && let Err(error) = self
                    .acknowledged(&mut pending, previous + 1, &mut published)
                    .await
            {
                failure = Some(error);
                break;
            }
            // Checked after the wait above, right before the send: that wait may take
            // up to the request timeout per acknowledgement.
            if tokio::time::Instant::now() >= send_until {
                published.ran_out_of_time = true;
                break;
            }
            let sent = self
                .jetstream
                .send_publish(
                    message.subject.clone(),
                    match &message.shop {
                        Some(shop) => PublishMessage::build().header("Stockd-Shop", shop.as_str()),
                        None => PublishMessage::build(),
                    }
                    .payload(message.body.clone())
                    .message_id(message.message_id.as_str()),
                )
                .await;
            match sent {
                Ok(acknowledgement) => pending.push_back((key, acknowledgement)),
                Err(error) => {
                    failure = Some(classify(error.to_string()));
                    break;
                }
            }
        }
        // What was sent before a failure to send is still counted when acknowledged
        // (after a failed acknowledgement nothing is left here).
        let all = pending.len();
        if let Err(error) = self.acknowledged(&mut pending, all, &mut published).await {
            failure.get_or_insert(error);
        }
        published.failure = if published.acknowledged == messages.len()
            || (published.ran_out_of_time && failure.is_none())
        {
            None
        } else {
            failure.or_else(|| Some(BusError::Unavailable("not acknowledged".to_owned())))
        };
        published
    }

    /// Awaits the first `count` acknowledgements in `pending`, in order, counting them
    /// into `published`, up to the first that fails; then every other one is dropped
    /// (not counted: the caller sends them again).
    async fn acknowledged(
        &self,
        pending: &mut std::collections::VecDeque<(&str, jetstream::context::PublishAckFuture)>,
        count: usize,
        published: &mut Published,
    ) -> Result<(), BusError> {
        for _ in 0..count.min(pending.len()) {
            let Some((_, acknowledgement)) = pending.pop_front() else {
                break;
            };
            let answer =
                match tokio::time::timeout(self.config.request_timeout, acknowledgement).await {
                    Ok(Ok(acknowledged)) => Ok(acknowledged),
                    Ok(Err(error)) => Err(classify(error.to_string())),
                    Err(_) => Err(BusError::Unavailable(format!(
                        "no acknowledgement within {:?}",
                        self.config.request_timeout
                    ))),
                };
            match answer {
                Ok(acknowledged) => {
                    published.acknowledged += 1;
                    if acknowledged.duplicate {
                        published.duplicates += 1;
                    }
                }
                Err(error) => {
                    pending.clear();
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    /// Fails at once while the connection is down, rather than queue a message in the
    /// client's buffer and wait out the timeout.
    fn unless_disconnected(&self) -> Result<(), BusError> {
        if self.is_connected() {
            Ok(())
        } else {
            Err(BusError::Unavailable("not connected".to_owned()))
        }
    }
}

/// A NATS error's text to a kind: JetStream's API refusals name an error code (`err_code`
/// in the raw answer, "error code" in the client's rendering of a refused publish, such
/// as a message larger than the stream takes); everything else (timeouts, no
/// responders, a broken connection) is transient.
fn classify(text: String) -> BusError {
    if text.contains("err_code") || text.contains("error code") || text.contains("maximum payload")
    {
        BusError::Refused(text)
    } else {
        BusError::Unavailable(text)
    }
}

//! The queue intake's subjects (DESIGN.md, "Events and caches"): reservation commands
//! on `stockd.commands.reserve` (stream `STOCKD_COMMANDS`, one durable pull consumer
//! shared by every instance, explicit acks), answers on `stockd.results.reserve`
//! (stream `STOCKD_RESULTS`), each with the command's `Idempotency-Key`.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull};
use bytes::Bytes;
use futures_util::StreamExt;

use crate::{Bus, BusError, StreamLimits, classify};

pub const COMMAND_STREAM: &str = "STOCKD_COMMANDS";
pub const COMMAND_SUBJECTS: &str = "stockd.commands.>";
pub const RESERVE_COMMAND_SUBJECT: &str = "stockd.commands.reserve";
pub const RESULT_STREAM: &str = "STOCKD_RESULTS";
pub const RESULT_SUBJECTS: &str = "stockd.results.>";
pub const RESERVE_RESULT_SUBJECT: &str = "stockd.results.reserve";
/// The durable consumer every instance pulls reservation commands from.
pub const RESERVE_CONSUMER: &str = "stockd-reserve";

/// Room for a command's headers (its `Idempotency-Key`, `Nats-Msg-Id`, a sender's
/// own) beside the body, in the stream's bound on one message.
const COMMAND_HEADERS_BYTES_MAX: usize = 4 * 1024;

/// How the intake consumes.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    /// Commands handed out and not yet acknowledged, over every instance: JetStream
    /// stops delivering beyond it (backpressure).
    pub in_flight_max: i64,
    /// A command not acknowledged within this is delivered again (a crashed instance).
    pub ack_wait: Duration,
    /// Deliveries of one command at most, when this instance creates the consumer: a
    /// command that keeps failing transiently (the database down for longer than
    /// `max_deliver` × the retry pause) is answered with that failure at the last one
    /// (JetStream would drop it after it).
    pub deliveries_max: i64,
    /// How long commands (unanswered ones: an answered command is forgotten) and
    /// answers are kept in their streams.
    pub retention: Duration,
    /// Commands the command stream holds at most, when this instance creates it; a
    /// publish beyond it is refused (its sender hears it) rather than an older command
    /// dropped unanswered.
    pub stored_commands_max: i64,
    /// The command stream's size bound, refused beyond as `stored_commands_max`.
    pub stored_commands_bytes_max: i64,
    /// One command's size bound: the HTTP request body's
    /// (`domain::limits::REQUEST_BODY_BYTES_MAX`) and its headers' (JetStream counts
    /// both).
    pub command_bytes_max: i32,
    /// The answer stream's size bound: the oldest answers give way (a sender reads its
    /// answer soon after it is published, or asks again under its key).
    pub stored_answers_bytes_max: i64,
}

impl Default for IntakeConfig {
    fn default() -> IntakeConfig {
        IntakeConfig {
            in_flight_max: 256,
            ack_wait: Duration::from_secs(30),
            deliveries_max: 1_000,
            retention: Duration::from_secs(24 * 3600),
            stored_commands_max: 1_000_000,
            // JetStream sets a stream's byte limit aside from its storage when the
            // stream is created: both together stay well inside a small server's.
            stored_commands_bytes_max: 256 << 20,
            command_bytes_max: i32::try_from(
                domain::limits::REQUEST_BODY_BYTES_MAX + COMMAND_HEADERS_BYTES_MAX,
            )
            .unwrap_or(i32::MAX),
            stored_answers_bytes_max: 256 << 20,
        }
    }
}

/// One delivered command.
pub struct Command {
    message: jetstream::Message,
}

impl Command {
    pub fn body(&self) -> &[u8] {
        &self.message.payload
    }

    /// A header's value, when present, its name matched in any case: the HTTP side
    /// takes `idempotency-key` as `Idempotency-Key`, and NATS clients pass a name on
    /// as the sender spelled it, while async-nats compares names byte for byte.
    pub fn header(&self, name: &str) -> Option<&str> {
        let headers = self.message.headers.as_ref()?;
        headers
            .get(name)
            .or_else(|| {
                headers
                    .iter()
                    .find(|(found, _)| AsRef::<str>::as_ref(*found).eq_ignore_ascii_case(name))
                    .and_then(|(_, values)| values.first())
            })
            .map(|value| value.as_str())
    }

    /// How many times JetStream delivered this command (1 the first time).
    pub fn delivered(&self) -> i64 {
        self.message.info().map(|info| info.delivered).unwrap_or(1)
    }

    /// The command's position in its stream.
    pub fn stream_sequence(&self) -> u64 {
        self.message
            .info()
            .map(|info| info.stream_sequence)
            .unwrap_or(0)
    }

    /// Done with: JetStream forgets it.
    pub async fn acknowledge(&self) -> Result<(), BusError> {
        self.message
            .ack_with(AckKind::Ack)
            .await
            .map_err(|error| BusError::Unavailable(error.to_string()))
    }

    /// Still being worked on: JetStream starts the command's acknowledgement wait
    /// again instead of delivering it to another instance.
    pub async fn still_working(&self) -> Result<(), BusError> {
        self.message
            .ack_with(AckKind::Progress)
            .await
            .map_err(|error| BusError::Unavailable(error.to_string()))
    }

    /// Not done: deliver it again after `delay`.
    pub async fn retry_after(&self, delay: Duration) -> Result<(), BusError> {
        self.message
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(|error| BusError::Unavailable(error.to_string()))
    }
}

/// An answer to publish on the result subject.
#[derive(Debug, Clone)]
pub struct Answer<'a> {
    pub idempotency_key: Option<&'a str>,
    /// The shop the command named (`None` for one that could not be read): shops share
    /// the answers' subject, and two of them may use the same key.
    pub shop: Option<&'a str>,
    /// The HTTP status the same request would have had.
    pub status: u16,
    pub replayed: bool,
    /// The command's stream sequence, so a sender without a key can match it.
    pub command_sequence: u64,
    /// The writer's position after the command's unit of work, as HTTP's
    /// `Stockd-Consistency-Token`: a read sent with it sees the command's effect.
    pub consistency_token: Option<String>,
    /// Seconds before sending the command again is worth it (a 429 or 503).
    pub retry_after_seconds: Option<u64>,
    pub body: Bytes,
}

impl Bus {
    /// Creates the command and result streams and the shared consumer when missing;
    /// answers the consumer.
    pub async fn reserve_consumer(
        &self,
        config: &IntakeConfig,
    ) -> Result<ReserveConsumer, BusError> {
        let command_limits = StreamLimits {
            messages_max: config.stored_commands_max,
            bytes_max: config.stored_commands_bytes_max,
            message_bytes_max: config.command_bytes_max,
            discard: jetstream::stream::DiscardPolicy::New,
            // An answered command is forgotten: a consumer created again (deleted by
            // hand, or its state lost) delivers only what is still unanswered, not a
            // day of commands whose keys may be purged by then and would act again.
            retention: jetstream::stream::RetentionPolicy::WorkQueue,
        };
        self.ensure_stream(
            COMMAND_STREAM,
            COMMAND_SUBJECTS,
            config.retention,
            command_limits,
        )
        .await?;
        let answer_limits = StreamLimits {
            bytes_max: config.stored_answers_bytes_max,
            ..StreamLimits::AGE_ONLY
        };
        self.ensure_stream(
            RESULT_STREAM,
            RESULT_SUBJECTS,
            config.retention,
            answer_limits,
        )
        .await?;
        let stream = self
            .jetstream
            .get_stream(COMMAND_STREAM)
            .await
            .map_err(|error| classify(error.to_string()))?;
        let consumer = stream
            .get_or_create_consumer(
                RESERVE_CONSUMER,
                pull::Config {
                    durable_name: Some(RESERVE_CONSUMER.to_owned()),
                    filter_subject: RESERVE_COMMAND_SUBJECT.to_owned(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    max_deliver: config.deliveries_max,
                    max_ack_pending: config.in_flight_max,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(|error| classify(error.to_string()))?;
        Ok(ReserveConsumer { consumer })
    }

    /// Publishes an answer and waits for JetStream's acknowledgement.
    pub async fn publish_answer(&self, answer: &Answer<'_>) -> Result<(), BusError> {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(key) = answer.idempotency_key {
            headers.insert("Idempotency-Key", key);
        }
        if let Some(shop) = answer.shop {
            headers.insert("Stockd-Shop", shop);
        }
        headers.insert("Stockd-Status", answer.status.to_string().as_str());
        headers.insert(
            "Idempotent-Replayed",
            if answer.replayed { "true" } else { "false" },
        );
        headers.insert(
            "Stockd-Command-Sequence",
            answer.command_sequence.to_string().as_str(),
        );
        if let Some(token) = &answer.consistency_token {
            headers.insert("Stockd-Consistency-Token", token.as_str());
        }
        if let Some(seconds) = answer.retry_after_seconds {
            headers.insert("Retry-After", seconds.to_string().as_str());
        }
        let acknowledgement = self
            .jetstream
            .publish_with_headers(RESERVE_RESULT_SUBJECT, headers, answer.body.clone())
            .await
            .map_err(|error| classify(error.to_string()))?;
        match tokio::time::timeout(self.config.request_timeout, acknowledgement).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(classify(error.to_string())),
            Err(_) => Err(BusError::Unavailable(
                "no acknowledgement of the answer".into(),
            )),
        }
    }
}

/// The shared durable consumer of reservation commands.
pub struct ReserveConsumer {
    consumer: jetstream::consumer::Consumer<pull::Config>,
}

impl ReserveConsumer {
    /// Up to `count` commands, waiting at most `wait` for the first.
    pub async fn fetch(&self, count: usize, wait: Duration) -> Result<Vec<Command>, BusError> {
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(count.max(1))
            .expires(wait)
            .messages()
            .await
            .map_err(|error| BusError::Unavailable(error.to_string()))?;
        let mut commands = Vec::new();
        while let Some(message) = batch.next().await {
            match message {
                Ok(message) => commands.push(Command { message }),
                Err(error) => {
                    if commands.is_empty() {
                        return Err(BusError::Unavailable(error.to_string()));
                    }
                    break;
                }
            }
        }
        Ok(commands)
    }

    /// How many times JetStream delivers one command at most, as the consumer on the
    /// server was created (an existing consumer keeps its own, whatever this
    /// instance's configuration says): `i64::MAX` for one without a bound (NATS stores
    /// -1). Read when the consumer was attached; an edit on the server is seen when
    /// the intake attaches again.
    pub fn deliveries_max(&self) -> i64 {
        match self.consumer.cached_info().config.max_deliver {
            bound if bound > 0 => bound,
            _ => i64::MAX,
        }
    }

    /// Commands handed out and not acknowledged yet, over every instance, as the
    /// server counts them now.
    pub async fn unacknowledged(&self) -> Result<usize, BusError> {
        self.consumer
            .get_info()
            .await
            .map(|info| info.num_ack_pending)
            .map_err(|error| classify(error.to_string()))
    }

    /// What waits at the consumer, over every instance, as the server counts it now.
    /// An error also says the consumer is gone: a fetch from one deleted (with its
    /// stream, say) waits out its time and finds nothing, as an idle one does.
    pub async fn backlog(&self) -> Result<Backlog, BusError> {
        self.consumer
            .get_info()
            .await
            .map(|info| Backlog {
                waiting: info.num_pending,
                in_flight: u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX),
            })
            .map_err(|error| classify(error.to_string()))
    }
}

/// The shared consumer's backlog: what every instance's intake has still to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Commands in the stream not handed out yet.
    pub waiting: u64,
    /// Commands handed out and not acknowledged yet.
    pub in_flight: u64,
}

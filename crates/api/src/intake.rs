//! The queue intake (seed 002 §十二.4): reservation commands from JetStream subject
//! `stockd.commands.reserve`, each processed exactly as `POST /v1/reservations` — the
//! same parsing, the same combiner, the same idempotency records — and answered on
//! `stockd.results.reserve` with the command's `Idempotency-Key`.
//!
//! A command's body is the HTTP request's plus `shop`; its principal is the shop's
//! queue intake (a service principal with the reserved key id
//! `ServiceKeyId::queue_intake`, which no credential has: who may publish commands
//! is NATS's permissions' business). Delivered twice — a redelivery after a crash or
//! a lost acknowledgement, or a sender that published again — it finds its first
//! answer under its key and has no second effect. A command that cannot be parsed is
//! answered `invalid_argument` and acknowledged, never retried; one that met a
//! transient failure (`lock_timeout`, `retry_exhausted`, `unavailable`, the original
//! still running, or a campaign's waiting room with no place for it: `rate_limited`)
//! is not answered but delivered again after a pause, except at its last delivery
//! (the consumer's `max_deliver`), when it is answered with that failure (not final:
//! it says to retry under the same key); an `internal` error is answered. At most `in_flight_max` commands
//! are handed out at once over every instance, and one step takes at most
//! `batch_size_max` of them. A command being worked on is reported in progress every
//! half acknowledgement wait, for at most [`COMMAND_DURATION_MAX`].

use std::sync::Arc;
use std::time::Duration;

use bus::intake::{Answer, Backlog, Command, IntakeConfig, ReserveConsumer};
use bus::{Bus, BusError};
use domain::{ErrorCode, IdempotencyKey, Principal, ServiceKeyId, ShopCode};
use store::{IdempotencyClaim, ScopedKey};

use crate::AppState;
use crate::extract::fingerprint;
use crate::problem::{ApiError, problem_body_with_status};
use crate::wire::CreateReservationRequest;

/// The intake of one instance.
pub struct ReserveIntake {
    bus: Bus,
    /// The consumer steps fetch from: built again after a step fails, in case the
    /// streams or the consumer were deleted (NATS back with an empty store, an
    /// operator's clean-up), which no fetch would ever recover from.
    consumer: std::sync::Mutex<Arc<ReserveConsumer>>,
    config: IntakeSettings,
    /// When the backlog was last sampled: a busy intake, whose fetches are never
    /// empty, samples it at most once per [`BACKLOG_SAMPLE_INTERVAL`].
    backlog_sampled_at: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// Longest a command is worked on (a campaign's line it waits in, a lock its
/// reservation waits for): past it, it is handled as a transient failure and
/// delivered again later, where its key finds what became of it.
pub const COMMAND_DURATION_MAX: Duration = Duration::from_secs(300);

/// How often a busy intake reads the consumer's backlog for its gauges (an idle one
/// reads it after each empty fetch, which also tells it the consumer still exists).
pub const BACKLOG_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

/// How one instance takes commands.
#[derive(Debug, Clone)]
pub struct IntakeSettings {
    pub consumer: IntakeConfig,
    /// Commands one step fetches and processes together (concurrently, so their
    /// reservations share the combiner's batches).
    pub batch_size_max: usize,
    /// How long a step waits for the first command.
    pub fetch_wait: Duration,
    /// Pause before a command that met a transient failure is delivered again.
    pub retry_delay: Duration,
}

impl Default for IntakeSettings {
    fn default() -> IntakeSettings {
        IntakeSettings {
            consumer: IntakeConfig::default(),
            batch_size_max: 64,
            fetch_wait: Duration::from_millis(500),
            retry_delay: Duration::from_secs(1),
        }
    }
}

/// What became of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    /// Answered (with this status) and acknowledged.
    Answered { status: u16, replayed: bool },
    /// Could not be parsed: answered `invalid_argument` and acknowledged.
    Poison,
    /// A transient failure: not answered, delivered again later.
    Retried,
    /// A transient failure at the last delivery JetStream makes (the consumer's
    /// `max_deliver`): answered with it (this status) and acknowledged, so the sender
    /// hears why rather than nothing for good. Each such answer says to retry under
    /// the same key: `request_in_progress` may be followed by the running delivery's
    /// own answer.
    GivenUp { status: u16 },
}

impl ReserveIntake {
    /// Creates the streams and the shared consumer when missing.
    pub async fn attach(bus: Bus, config: IntakeSettings) -> Result<ReserveIntake, BusError> {
        let consumer = bus.reserve_consumer(&config.consumer).await?;
        Ok(ReserveIntake {
            bus,
            consumer: std::sync::Mutex::new(Arc::new(consumer)),
            config,
            backlog_sampled_at: std::sync::Mutex::new(None),
        })
    }

    fn consumer(&self) -> Arc<ReserveConsumer> {
        Arc::clone(
            &self
                .consumer
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    /// Creates the streams and the consumer again where missing (an existing one is
    /// found as it is), for the steps after a failed one.
    async fn attach_again(&self) {
        match self.bus.reserve_consumer(&self.config.consumer).await {
            Ok(consumer) => {
                *self
                    .consumer
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(consumer);
                metrics::gauge!("stockd_intake_attached").set(1.0);
            }
            Err(error) => {
                metrics::gauge!("stockd_intake_attached").set(0.0);
                tracing::debug!(%error, "the intake's streams and consumer could not be checked yet");
            }
        }
    }

    /// Reads the shared consumer's backlog and shows it as `stockd_intake_commands_waiting`
    /// and `stockd_intake_commands_in_flight` (each instance shows the same figures:
    /// the consumer is every instance's).
    pub async fn backlog(&self) -> Result<Backlog, BusError> {
        *self
            .backlog_sampled_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(tokio::time::Instant::now());
        let backlog = self.consumer().backlog().await?;
        metrics::gauge!("stockd_intake_commands_waiting").set(backlog.waiting as f64);
        metrics::gauge!("stockd_intake_commands_in_flight").set(backlog.in_flight as f64);
        Ok(backlog)
    }

    fn backlog_sample_due(&self) -> bool {
        self.backlog_sampled_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_none_or(|at| at.elapsed() >= BACKLOG_SAMPLE_INTERVAL)
    }

    pub fn settings(&self) -> &IntakeSettings {
        &self.config
    }

    /// Commands handed out and not acknowledged yet, over every instance.
    pub async fn unacknowledged(&self) -> Result<usize, BusError> {
        self.consumer().unacknowledged().await
    }

    /// One intake step: fetches up to a batch of commands and handles them together.
    /// Answers what became of each, in delivery order.
    /// A step that fails (the fetch, an answer that could not be published, or a
    /// consumer found gone after an empty fetch) creates the streams and the consumer
    /// again where missing before it answers its error: the next step fetches from
    /// them as they are then.
    pub async fn step(&self, state: &AppState) -> Result<Vec<Handled>, BusError> {
        let stepped = self.fetch_and_handle(state).await;
        match &stepped {
            Ok(_) => metrics::gauge!("stockd_intake_attached").set(1.0),
            Err(_) => self.attach_again().await,
        }
        stepped
    }

    async fn fetch_and_handle(&self, state: &AppState) -> Result<Vec<Handled>, BusError> {
        let consumer = self.consumer();
        let commands = consumer
            .fetch(self.config.batch_size_max, self.config.fetch_wait)
            .await?;
        if commands.is_empty() {
            // Nothing came: an idle queue, or a consumer that is gone. One request
            // per idle wait tells them apart, and samples the backlog.
            self.backlog().await?;
        } else if self.backlog_sample_due()
            && let Err(error) = self.backlog().await
        {
            // The commands in hand are handled all the same; the gauges wait.
            tracing::debug!(%error, "the intake's backlog could not be read");
        }
        let deliveries_max = consumer.deliveries_max();
        let handled = futures_util::future::join_all(
            commands
                .iter()
                .map(|command| self.handle(state, command, deliveries_max)),
        )
        .await;
        handled.into_iter().collect()
    }

    async fn handle(
        &self,
        state: &AppState,
        command: &Command,
        deliveries_max: i64,
    ) -> Result<Handled, BusError> {
        let key = command.header("Idempotency-Key").map(str::to_owned);
        let parsed = parse_command(command.body(), key.as_deref());
        let shop = parsed
            .as_ref()
            .ok()
            .and_then(|parsed| parsed.principal.shop().cloned());
        let shop = shop.as_ref().map(ShopCode::as_str);
        let outcome = match parsed {
            Ok(parsed) => {
                // Queued commands never take a ticket: they wait their turn.
                let reserving = async {
                    crate::routes::reserve(
                        state,
                        &parsed.principal,
                        &parsed.claim,
                        parsed.request,
                        false,
                    )
                    .await
                    .and_then(|held| held.answered().map_err(crate::problem::ApiError::from))
                };
                self.while_saying_it_is_worked_on(command, reserving)
                    .await
                    .unwrap_or_else(|| {
                        Err(ApiError::new(
                            ErrorCode::Unavailable,
                            "the command ran past its bound; it is delivered again",
                        ))
                    })
            }
            Err(refused) => Err(refused),
        };
        let (status, body, replayed, token) = match outcome {
            Ok(reply) => {
                let token = match reply.consistency_token {
                    Some(token) => Some(token.to_string()),
                    None => self.position_after(state, reply.response.status).await,
                };
                (
                    reply.response.status,
                    reply.response.body,
                    reply.replayed,
                    token,
                )
            }
            Err(error) if is_transient(&error) && command.delivered() < deliveries_max => {
                metrics::counter!("stockd_intake_commands_total", "outcome" => "retried")
                    .increment(1);
                command.retry_after(self.config.retry_delay).await?;
                return Ok(Handled::Retried);
            }
            Err(error) if is_transient(&error) => {
                // JetStream would drop it silently after this delivery. Every such
                // answer says to retry under the same key, so one that another
                // delivery then answers for good is not contradicted (409
                // `request_in_progress`, 429 `rate_limited` are not final).
                let status = error.status.as_u16();
                let body = problem_body_with_status(error.code, error.status, &error.detail);
                let answered = Answered {
                    status,
                    body,
                    replayed: false,
                    token: None,
                    retry_after_seconds: Some(error.retry_after_seconds.unwrap_or(1)),
                };
                self.answer(command, (key.as_deref(), shop), answered)
                    .await?;
                metrics::counter!("stockd_intake_commands_total", "outcome" => "given_up")
                    .increment(1);
                tracing::warn!(
                    key = key.as_deref(),
                    shop,
                    deliveries = command.delivered(),
                    code = error.code.as_str(),
                    "a command failed transiently at its last delivery: answered with that failure"
                );
                return Ok(Handled::GivenUp { status });
            }
            Err(error) => {
                let poison = error.code == ErrorCode::InvalidArgument;
                let body = problem_body_with_status(error.code, error.status, &error.detail);
                if poison {
                    let answered = Answered {
                        status: error.status.as_u16(),
                        body,
                        replayed: false,
                        token: None,
                        retry_after_seconds: None,
                    };
                    self.answer(command, (key.as_deref(), shop), answered)
                        .await?;
                    metrics::counter!("stockd_intake_commands_total", "outcome" => "poison")
                        .increment(1);
                    return Ok(Handled::Poison);
                }
                // A refusal a unit of work gave (not one decided before any) carries
                // the writer's position, as over HTTP.
                let token = if error.without_a_write {
                    None
                } else {
                    self.position_after(state, error.status.as_u16()).await
                };
                (error.status.as_u16(), body, false, token)
            }
        };
        let answered = Answered {
            status,
            body,
            replayed,
            token,
            retry_after_seconds: None,
        };
        self.answer(command, (key.as_deref(), shop), answered)
            .await?;
        let outcome = if replayed { "replayed" } else { "answered" };
        metrics::counter!("stockd_intake_commands_total", "outcome" => outcome).increment(1);
        Ok(Handled::Answered { status, replayed })
    }

    /// Runs `work` on `command`, telling JetStream every half acknowledgement wait
    /// that the command is still being worked on: one waiting in a campaign's line,
    /// or for a lock, past the wait would otherwise go to another instance as well and
    /// use up a delivery. `None` when it ran past [`COMMAND_DURATION_MAX`].
    async fn while_saying_it_is_worked_on<T>(
        &self,
        command: &Command,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        let every = (self.config.consumer.ack_wait / 2).max(Duration::from_millis(100));
        let bounded = tokio::time::timeout(COMMAND_DURATION_MAX, work);
        tokio::pin!(bounded);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                done = &mut bounded => return done.ok(),
                _ = ticks.tick() => {
                    if let Err(error) = command.still_working().await {
                        tracing::debug!(%error, "could not tell JetStream a command is still worked on");
                    }
                }
            }
        }
    }

    /// The writer's position for an answer of `status` to the command, when a unit of
    /// work gave it (as `consistency::stamp_writes` decides over HTTP).
    async fn position_after(&self, state: &AppState, status: u16) -> Option<String> {
        let status = axum::http::StatusCode::from_u16(status).ok()?;
        if !crate::consistency::reports_a_write(&axum::http::Method::POST, status) {
            return None;
        }
        let token = state.engine.consistency_token().await?;
        Some(token.to_string())
    }

    /// Publishes the answer, then acknowledges the command: a crash in between
    /// delivers the command again, which finds its stored answer and sends it again.
    async fn answer(
        &self,
        command: &Command,
        (key, shop): (Option<&str>, Option<&str>),
        answered: Answered,
    ) -> Result<(), BusError> {
        self.bus
            .publish_answer(&Answer {
                idempotency_key: key,
                shop,
                status: answered.status,
                replayed: answered.replayed,
                command_sequence: command.stream_sequence(),
                consistency_token: answered.token,
                retry_after_seconds: answered.retry_after_seconds,
                body: answered.body.into_bytes().into(),
            })
            .await?;
        command.acknowledge().await
    }
}

/// What a command is answered, before it is published.
struct Answered {
    status: u16,
    body: String,
    replayed: bool,
    /// `Stockd-Consistency-Token`, when a unit of work gave the answer.
    token: Option<String>,
    /// `Retry-After`, for an answer that says to send the command again.
    retry_after_seconds: Option<u64>,
}

/// A command, parsed as its HTTP request would be.
struct ParsedCommand {
    principal: Principal,
    claim: IdempotencyClaim,
    request: CreateReservationRequest,
}

fn parse_command(body: &[u8], key: Option<&str>) -> Result<ParsedCommand, ApiError> {
    // The HTTP request's bound, before anything is parsed (a stream created by an
    // operator may take commands as large as NATS's own payload limit).
    if body.len() > domain::limits::REQUEST_BODY_BYTES_MAX {
        return Err(ApiError::invalid(format!(
            "command body is larger than {} bytes",
            domain::limits::REQUEST_BODY_BYTES_MAX
        ))
        .with_status(axum::http::StatusCode::PAYLOAD_TOO_LARGE));
    }
    let key = key.ok_or_else(|| ApiError::invalid("a command needs an Idempotency-Key header"))?;
    let key = IdempotencyKey::parse(key).map_err(|error| ApiError::invalid(error.0))?;
    let mut document = crate::extract::json_with_unique_keys(body)
        .map_err(|error| ApiError::invalid(format!("command body is not valid JSON: {error}")))?;
    let shop = document
        .as_object_mut()
        .and_then(|fields| fields.remove("shop"))
        .ok_or_else(|| ApiError::invalid("a command names its shop"))?;
    let shop = shop
        .as_str()
        .ok_or_else(|| ApiError::invalid("shop must be a string"))
        .and_then(|shop| ShopCode::parse(shop).map_err(|error| ApiError::invalid(error.0)))?;
    let request: CreateReservationRequest =
        serde_path_to_error::deserialize(&document).map_err(|error| {
            let path = error.path().to_string();
            ApiError::invalid(format!("{path}: {}", error.into_inner()))
        })?;
    let principal = Principal::Service {
        key: ServiceKeyId::queue_intake(),
        shop,
    };
    // The same fingerprint as the HTTP request with this body.
    let canonical = serde_json::to_string(&document).unwrap_or_default();
    let claim = IdempotencyClaim {
        key: ScopedKey::new(&principal, &key),
        fingerprint: fingerprint("POST", "/v1/reservations", &canonical),
    };
    Ok(ParsedCommand {
        principal,
        claim,
        request,
    })
}

/// Failures after which the same command may well succeed: delivered again, not
/// answered (a retry of a request with the same key over HTTP would run again too).
/// A campaign's waiting room that has no place (it is full, or the shopper's one place
/// is taken — by this very command delivered twice at once) answers HTTP 429 with
/// `Retry-After`; a queued command waits for its turn instead, and a second delivery
/// then hears the first one's stored answer. An internal error is answered: the same
/// command would meet it again at each of the thousand deliveries.
fn is_transient(error: &ApiError) -> bool {
    matches!(
        error.code,
        ErrorCode::LockTimeout
            | ErrorCode::RetryExhausted
            | ErrorCode::Unavailable
            | ErrorCode::RequestInProgress
            | ErrorCode::RateLimited
    )
}

/// Attaches the intake once NATS answers (it may be down at start), then runs it
/// until `shutdown`.
pub async fn attach_and_run(
    state: AppState,
    bus: Bus,
    settings: IntakeSettings,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let retry = settings.retry_delay;
    metrics::gauge!("stockd_intake_attached").set(0.0);
    let intake = loop {
        let attached = ReserveIntake::attach(bus.clone(), settings.clone()).await;
        if attached.is_err() {
            // Counted as a failed step: an intake that never attaches takes no
            // command, and commands wait in their stream while it tries.
            metrics::counter!("stockd_worker_errors_total", "worker" => "intake").increment(1);
        }
        match attached {
            Ok(intake) => break intake,
            // NATS not up yet is expected at start; a refusal (a stream's configuration
            // the server will not take, too little storage for its limits) is for a
            // person to see.
            Err(error @ BusError::Refused(_)) => {
                tracing::warn!(%error, "the intake cannot attach: NATS refused its streams or consumer");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(retry) => {}
                }
            }
            Err(error) => {
                tracing::debug!(%error, "intake not attached yet");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(retry) => {}
                }
            }
        }
    };
    metrics::gauge!("stockd_intake_attached").set(1.0);
    tracing::info!("taking reservation commands from stockd.commands.reserve");
    run(state, Arc::new(intake), shutdown).await;
}

/// Runs the intake until `shutdown`: a step after another, pausing after a failure.
pub async fn run(
    state: AppState,
    intake: Arc<ReserveIntake>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    loop {
        let pause = match intake.step(&state).await {
            Ok(_) => Duration::ZERO,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "intake").increment(1);
                tracing::warn!(%error, "intake step failed");
                intake.config.retry_delay
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_that_found_no_place_waits_and_one_that_failed_inside_is_answered() {
        let delivered_again = [
            ErrorCode::LockTimeout,
            ErrorCode::RetryExhausted,
            ErrorCode::Unavailable,
            ErrorCode::RequestInProgress,
            ErrorCode::RateLimited,
        ];
        for code in delivered_again {
            assert!(is_transient(&ApiError::new(code, "")), "{code:?}");
        }
        let answered = [
            ErrorCode::Internal,
            ErrorCode::InvalidArgument,
            ErrorCode::InsufficientStock,
            ErrorCode::PurchaseLimitExceeded,
            ErrorCode::Forbidden,
        ];
        for code in answered {
            assert!(!is_transient(&ApiError::new(code, "")), "{code:?}");
        }
    }
}

//! The outbox relay: publishes the numbered events to NATS JetStream in position
//! order, at least once, and records what JetStream acknowledged.
//!
//! One instance relays at a time: a step first takes or renews the relay's lease in
//! the database (`outbox_relay`), and renews it again before it publishes what it
//! read, so two instances never publish from the same claim; a relay that stops (crash, lost lease) is replaced when its lease runs
//! out, and its successor starts again after the last acknowledged position. Events
//! it had published but not recorded go out again with the same `Nats-Msg-Id` (the
//! event id), which JetStream drops inside its duplicate window. NATS being down only
//! makes steps fail: the events wait in the outbox, and the gauges show them. A relay
//! whose step could not publish gives the lease up and stands aside for a while, so an
//! instance that reaches NATS takes over rather than waiting behind it for ever.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use bus::{Bus, BusError, Outgoing};
use domain::FeedCursor;

use crate::{Engine, EngineError, log_store_error};

/// This instance's side of the relay: its connection and its name in the lease.
#[derive(Debug)]
pub struct EventRelay {
    bus: Bus,
    holder: String,
    stream_ready: AtomicBool,
    /// Unix milliseconds (the engine's clock) before which this instance does not
    /// claim the lease: it failed to publish lately.
    standing_aside_until: AtomicI64,
}

impl EventRelay {
    pub fn new(bus: Bus, holder: impl Into<String>) -> EventRelay {
        EventRelay {
            bus,
            holder: holder.into(),
            stream_ready: AtomicBool::new(false),
            standing_aside_until: AtomicI64::new(i64::MIN),
        }
    }

    /// A relay named after this process and a random suffix (two instances on one
    /// host hold different leases).
    pub fn for_this_process(bus: Bus) -> EventRelay {
        let holder = format!(
            "stockd-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        EventRelay::new(bus, holder)
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn bus(&self) -> &Bus {
        &self.bus
    }
}

/// What one relay step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayStep {
    /// Events JetStream acknowledged (and the relay recorded).
    pub published: usize,
    /// Of those, how many JetStream already had (a republish after a lost record).
    pub duplicates: usize,
    /// Another instance holds the lease: this one published nothing.
    pub waiting_for_lease: bool,
    /// This instance failed to publish lately and leaves the lease to the others for
    /// `relay_stand_aside_milliseconds`: it published nothing.
    pub standing_aside: bool,
    /// A full batch was taken: more may be waiting.
    pub more_waiting: bool,
    /// Why some events were not published (they wait for the next step).
    pub failure: Option<BusError>,
    /// The event JetStream refused, when the failure was a refusal (the first event
    /// not acknowledged): the relay never skips one, so every later event waits
    /// behind it until the stream takes it.
    pub refused_event: Option<String>,
}

/// Positions are numbered without holes: a batch recorded past a gap after the
/// acknowledged position went on past events pruned before any relay published them
/// (no instance held the lease within the retention: NATS configured again after a
/// long pause). They are in no stream; said once, when the batch after them is
/// recorded. A relay that never recorded anything (`through` 0: NATS configured for
/// the first time on an outbox already pruned) starts from the oldest kept event, as
/// meant, and only says so.
fn note_skipped_events(through: i64, first: i64) {
    let skipped = first.saturating_sub(through.saturating_add(1));
    if skipped <= 0 {
        return;
    }
    if through == 0 {
        tracing::info!(
            first,
            "the relay's first publish starts from the oldest event kept; older ones were pruned before NATS was configured"
        );
        return;
    }
    metrics::counter!("stockd_outbox_events_skipped_total")
        .increment(u64::try_from(skipped).unwrap_or(0));
    tracing::error!(
        after = through,
        next = first,
        skipped,
        "events were pruned before the relay published them: the stream lacks them"
    );
}

/// The first half of a relay step: a batch read under the lease, or why there is none.
#[derive(Debug)]
pub enum RelayRead {
    /// Nothing to publish (no lease, standing aside, no events, a failure).
    Nothing(RelayStep),
    /// The events after `through`, the acknowledged position the lease's claim read.
    Batch {
        through: i64,
        events: Vec<store::PublishedEvent>,
    },
}

impl Engine {
    /// One relay step: takes or renews the lease, publishes up to one batch of the
    /// events after the last acknowledged position, and records how far JetStream
    /// acknowledged them.
    pub async fn relay_step(&self, relay: &EventRelay) -> Result<RelayStep, EngineError> {
        match self.relay_read(relay).await? {
            RelayRead::Nothing(step) => Ok(step),
            RelayRead::Batch { through, events } => {
                self.relay_publish(relay, through, &events).await
            }
        }
    }

    /// A step's first half: takes or renews the lease and reads the batch to publish.
    /// Public so that tests can pause a relay between its halves.
    pub async fn relay_read(&self, relay: &EventRelay) -> Result<RelayRead, EngineError> {
        let config = &self.inner.config;
        let now = self.now();
        if now.unix_milliseconds() < relay.standing_aside_until.load(Ordering::Relaxed) {
            return Ok(RelayRead::Nothing(RelayStep {
                standing_aside: true,
                ..RelayStep::default()
            }));
        }
        // The lease is told by the clock held back by how far this instance runs ahead
        // of the database's: one ahead would otherwise take it over from a holder
        // whose lease has not ended.
        let lease_now = self.held_back_now();
        // A read first: a step with nothing to do writes nothing (SQLite's one writer
        // is the hot path's, and every write on PostgreSQL is a synchronous commit).
        // The lease is renewed once half of it has passed, or when events wait.
        let peek = self
            .inner
            .store
            .peek_relay(store::NATS_RELAY)
            .await
            .map_err(|error| log_store_error("peek_relay", error))?;
        let ours = peek.holder.as_deref() == Some(relay.holder.as_str());
        if peek.lease_until > lease_now {
            if !ours && peek.holder.is_some() {
                return Ok(RelayRead::Nothing(RelayStep {
                    waiting_for_lease: true,
                    ..RelayStep::default()
                }));
            }
            let left_milliseconds =
                peek.lease_until.unix_milliseconds() - lease_now.unix_milliseconds();
            if ours
                && !peek.events_waiting
                && left_milliseconds > config.relay_lease_milliseconds / 2
            {
                return Ok(RelayRead::Nothing(RelayStep::default()));
            }
        }
        let lease_until = lease_now.plus_milliseconds(config.relay_lease_milliseconds);
        let claimed = self
            .inner
            .store
            .claim_relay(store::NATS_RELAY, &relay.holder, lease_now, lease_until)
            .await
            .map_err(|error| log_store_error("claim_relay", error))?;
        let Some(through) = claimed else {
            return Ok(RelayRead::Nothing(RelayStep {
                waiting_for_lease: true,
                ..RelayStep::default()
            }));
        };
        if !relay.stream_ready.load(Ordering::Relaxed) {
            if let Err(error) = relay.bus.ensure_event_stream().await {
                self.stand_aside(relay, &error).await?;
                return Ok(RelayRead::Nothing(RelayStep {
                    failure: Some(error),
                    ..RelayStep::default()
                }));
            }
            relay.stream_ready.store(true, Ordering::Relaxed);
        }
        let events = match self
            .inner
            .store
            .events_after(
                FeedCursor::of_position(through),
                None,
                config.relay_batch_size,
            )
            .await
        {
            Ok(events) => events,
            Err(error) => {
                // This instance cannot read what it is to publish (its database
                // connection, or an event of a kind a newer version wrote during a
                // rolling upgrade): the lease goes to an instance that can, rather
                // than renewed here at every step while no event moves. The read's
                // error is the step's, whether or not the lease could be given up.
                if let Err(release) = self.stand_aside(relay, &error).await {
                    tracing::warn!(%release, "relay lease not given up after a failed read; another instance takes over when it ends");
                }
                return Err(log_store_error("relay_events", error));
            }
        };
        if events.is_empty() {
            return Ok(RelayRead::Nothing(RelayStep::default()));
        }
        Ok(RelayRead::Batch { through, events })
    }

    /// A step's second half: publishes `events` (read after `through`) and records how
    /// far JetStream acknowledged them. The lease is renewed first: the read (and a
    /// check of the stream) may have outlasted it, and a successor may have claimed
    /// it and published the same events since; publishing them again past JetStream's
    /// duplicate window would repeat them after newer ones. Published only while the
    /// lease is still this instance's and nothing was recorded past `through`.
    pub async fn relay_publish(
        &self,
        relay: &EventRelay,
        through: i64,
        events: &[store::PublishedEvent],
    ) -> Result<RelayStep, EngineError> {
        let config = &self.inner.config;
        // Taken before the renewal, as `now` is: the lease runs from `now`, and a
        // renewal that waited (for a pooled connection, a synchronous standby's
        // commit) must not move the end of the sends past it.
        let renewing_from = tokio::time::Instant::now();
        let now = self.held_back_now();
        let renewed = self
            .inner
            .store
            .claim_relay(
                store::NATS_RELAY,
                &relay.holder,
                now,
                now.plus_milliseconds(config.relay_lease_milliseconds),
            )
            .await
            .map_err(|error| log_store_error("claim_relay", error))?;
        if renewed != Some(through) {
            tracing::warn!(
                holder = relay.holder,
                "relay lease lost, or events recorded by another holder, while reading: nothing published"
            );
            return Ok(RelayStep {
                waiting_for_lease: true,
                ..RelayStep::default()
            });
        }
        let messages: Vec<Outgoing> = events
            .iter()
            .map(|event| Outgoing {
                subject: event.event_type.subject(),
                message_id: event.id.clone(),
                body: serde_json::to_vec(&event.body()).unwrap_or_default().into(),
                ordering_key: format!("{}/{}", event.aggregate.as_str(), event.aggregate_id),
                shop: Some(event.shop.clone()).filter(|shop| !shop.is_empty()),
            })
            .collect();
        // Sent within half the lease from its renewal: waits for acknowledgements
        // (a slow NATS, a long chain of one aggregate's events) must not carry sends
        // past the lease, and half leaves room for instances' clocks that disagree.
        let send_until = renewing_from
            + std::time::Duration::from_millis(
                u64::try_from(config.relay_lease_milliseconds / 2).unwrap_or(0),
            );
        let published = relay.bus.publish_in_order(&messages, send_until).await;
        if published.failure.is_some() {
            // The stream may be what failed (deleted, or NATS back with an empty
            // store): the next step makes sure of it again before publishing.
            relay.stream_ready.store(false, Ordering::Relaxed);
        }
        let refused_event = match &published.failure {
            Some(BusError::Refused(reason)) => events.get(published.acknowledged).map(|event| {
                metrics::counter!("stockd_outbox_publish_refused_total").increment(1);
                tracing::error!(
                    event = event.id,
                    position = event.position,
                    event_type = event.event_type.as_str(),
                    %reason,
                    "JetStream refused an event: it and every later one wait in the outbox until the stream takes it"
                );
                event.id.clone()
            }),
            _ => None,
        };
        let mut step = RelayStep {
            published: published.acknowledged,
            duplicates: published.duplicates,
            refused_event,
            more_waiting: published.ran_out_of_time
                || i64::try_from(events.len()).unwrap_or(i64::MAX) >= config.relay_batch_size,
            failure: published.failure.clone(),
            ..RelayStep::default()
        };
        if published.acknowledged > 0 {
            let acknowledged = &events[..published.acknowledged];
            let last = acknowledged[acknowledged.len() - 1].position;
            let recorded = self
                .inner
                .store
                .mark_relayed(store::NATS_RELAY, &relay.holder, last)
                .await
                .map_err(|error| log_store_error("mark_relayed", error))?;
            if !recorded {
                // The lease went to another instance meanwhile: it publishes these
                // again (JetStream drops the repeats) and records them itself.
                tracing::warn!(holder = relay.holder, "relay lease lost during a publish");
                step.published = 0;
                step.more_waiting = false;
            } else {
                note_skipped_events(through, events[0].position);
            }
            let now = self.now().unix_milliseconds();
            for event in acknowledged {
                metrics::histogram!("stockd_outbox_publish_delay_seconds")
                    .record((now - event.occurred_at.unix_milliseconds()).max(0) as f64 / 1000.0);
            }
            metrics::counter!("stockd_outbox_events_published_total")
                .increment(published.acknowledged as u64);
            metrics::counter!("stockd_outbox_events_duplicate_total")
                .increment(published.duplicates as u64);
        }
        if let Some(failure) = &step.failure {
            step.more_waiting = false;
            metrics::counter!("stockd_outbox_publish_failures_total").increment(1);
            self.stand_aside(relay, failure).await?;
        }
        Ok(step)
    }

    /// After a step that could not publish (or read what to publish): the lease goes back (an instance that
    /// reaches NATS takes it at its next step) and this one does not claim it again
    /// for `relay_stand_aside_milliseconds`. Renewing it at every failed step would
    /// keep the others waiting for as long as this instance cannot reach NATS.
    async fn stand_aside(
        &self,
        relay: &EventRelay,
        failure: &(dyn std::fmt::Display + Sync),
    ) -> Result<(), EngineError> {
        let until = self
            .now()
            .plus_milliseconds(self.inner.config.relay_stand_aside_milliseconds);
        relay
            .standing_aside_until
            .store(until.unix_milliseconds(), Ordering::Relaxed);
        tracing::warn!(
            %failure,
            holder = relay.holder,
            "relay could not publish or read its events: lease given up, events wait for this or another instance"
        );
        self.release_relay(relay).await
    }

    /// Gives the relay's lease up (a clean stop), so another instance takes over at
    /// once instead of after the lease.
    pub async fn release_relay(&self, relay: &EventRelay) -> Result<(), EngineError> {
        self.inner
            .store
            .release_relay(store::NATS_RELAY, &relay.holder, self.now())
            .await
            .map_err(|error| log_store_error("release_relay", error))
    }
}

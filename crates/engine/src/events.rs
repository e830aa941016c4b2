//! The outbox's readers: the sequencer step (numbers committed events in the order it
//! finds them), its pruning, its gauges, and the pull feed. The NATS relay reads the
//! same numbered events (`relay`).

use domain::{Action, FeedCursor, Principal, ShopCode, authorize};
use store::{OutboxBacklog, PublishedEvent};

use crate::{Engine, EngineError, forbidden, log_store_error};

/// One page of the pull feed.
#[derive(Debug, Clone, PartialEq)]
pub struct EventsPage {
    pub events: Vec<PublishedEvent>,
    /// Where the next page starts: the last event's position for a full page; for
    /// one that is not full, the newest numbered event's (past other shops' events),
    /// or the cursor asked for when nothing newer was numbered.
    pub next_cursor: FeedCursor,
}

impl Engine {
    /// Up to `limit` events after `cursor`, in commit order: the principal's shop's,
    /// or for the admin every shop's (or the one it names).
    pub async fn events_page(
        &self,
        principal: &Principal,
        shop: Option<&ShopCode>,
        cursor: FeedCursor,
        limit: i64,
    ) -> Result<EventsPage, EngineError> {
        authorize(principal, Action::ReadEvents, shop).map_err(forbidden)?;
        let shop = shop.or(principal.shop());
        // Read before the page: every event up to this position is numbered and
        // visible, so a page that is not full has shown every one of them the reader
        // may see, and its cursor can move past the others (other shops' events).
        let latest = self
            .inner
            .store
            .latest_event_position()
            .await
            .map_err(|error| log_store_error("events", error))?;
        // A cursor past every position ever numbered was not given by this database:
        // another one's, or this one's before a restore from an older backup. Paging
        // on would skip, silently, every event numbered up to it.
        let after = cursor.position();
        if after > latest {
            return Err(EngineError::NotFound(format!(
                "cursor {after} is past the newest event ({latest}): it was not given by this database (another one's, or one restored from before it); read again from after=0 and reconcile"
            )));
        }
        let events = self
            .inner
            .store
            .events_after(cursor, shop, limit)
            .await
            .map_err(|error| log_store_error("events", error))?;
        // A page that does not start right after the cursor may have a gap: the
        // shop's events are a part of every shop's, or events were pruned. A reader
        // whose cursor is older than what is kept hears so instead of skipping on.
        if after > 0 && events.first().map(|first| first.position) != Some(after + 1) {
            let first_kept = self
                .inner
                .store
                .first_kept_event_position()
                .await
                .map_err(|error| log_store_error("events", error))?;
            if first_kept > after + 1 {
                return Err(EngineError::NotFound(format!(
                    "the events after cursor {after} are no longer kept (events are kept {} days once relayed; the oldest kept is {first_kept}): read again from after=0 and reconcile what was missed",
                    self.inner.config.outbox_retention_seconds / 86_400
                )));
            }
        }
        let last_shown = events.last().map_or(after, |last| last.position);
        let page_full = i64::try_from(events.len()).unwrap_or(i64::MAX)
            >= limit.clamp(1, store::EVENTS_PER_STEP_MAX);
        let next_cursor = if page_full {
            FeedCursor::of_position(last_shown)
        } else {
            FeedCursor::of_position(last_shown.max(latest))
        };
        Ok(EventsPage {
            events,
            next_cursor,
        })
    }

    /// One sequencer step: numbers up to one batch of committed events. Answers how
    /// many it numbered (a full batch means more may be waiting).
    pub async fn sequence_step(&self) -> Result<u64, EngineError> {
        let numbered = self
            .retried("sequence_events", || {
                self.inner
                    .store
                    .sequence_events(self.inner.config.outbox_sequence_batch_size)
            })
            .await?;
        metrics::counter!("stockd_outbox_events_sequenced_total").increment(numbered);
        if numbered > 0 {
            self.inner.events_numbered.notify_one();
        }
        Ok(numbered)
    }

    /// The reader whose acknowledgement lets an event go: the NATS relay when this
    /// instance relays, otherwise the sequencer (the pull feed serves what it numbered).
    pub(crate) fn outbox_reader(&self) -> Option<&'static str> {
        self.inner
            .event_relay
            .load(std::sync::atomic::Ordering::Relaxed)
            .then_some(store::NATS_RELAY)
    }

    /// Declares that this instance relays events to NATS: pruning then waits for the
    /// relay's acknowledgements, and the backlog gauges count what it has not sent.
    pub fn attach_event_relay(&self) {
        self.inner
            .event_relay
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Resolves when this process's sequencer has numbered events since the last call.
    pub async fn events_numbered(&self) {
        self.inner.events_numbered.notified().await;
    }

    /// Deletes one batch of events older than the retention that every reader took.
    pub async fn outbox_prune_step(&self) -> Result<u64, EngineError> {
        let config = &self.inner.config;
        let before = self.now().plus_seconds(-config.outbox_retention_seconds);
        let pruned = self
            .retried("prune_events", || {
                self.inner.store.prune_events(
                    before,
                    self.outbox_reader(),
                    config.outbox_prune_batch_size,
                )
            })
            .await?;
        metrics::counter!("stockd_outbox_events_pruned_total").increment(pruned);
        Ok(pruned)
    }

    /// Exports what waits in the outbox: `stockd_outbox_pending` and
    /// `stockd_outbox_oldest_pending_age_seconds`, the relay's backlog included when
    /// it is a reader, here or on any instance within the retention.
    pub async fn outbox_gauges_step(&self) -> Result<OutboxBacklog, EngineError> {
        let backlog = self
            .inner
            .store
            .outbox_backlog(
                self.outbox_reader(),
                self.now()
                    .plus_seconds(-self.inner.config.outbox_retention_seconds),
            )
            .await
            .map_err(|error| log_store_error("outbox_backlog", error))?;
        metrics::gauge!("stockd_outbox_pending").set(backlog.pending as f64);
        let age_seconds = backlog.oldest_occurred_at.map_or(0.0, |oldest| {
            (self.now().unix_milliseconds() - oldest.unix_milliseconds()).max(0) as f64 / 1000.0
        });
        metrics::gauge!("stockd_outbox_oldest_pending_age_seconds").set(age_seconds);
        Ok(backlog)
    }
}

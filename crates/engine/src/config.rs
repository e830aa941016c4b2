//! The engine's bounds, with the defaults `stockd serve` uses.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Attempts of one unit of work that hits deadlocks or serialization failures,
    /// the first included; then `retry_exhausted`.
    pub retry_attempts_max: u32,
    /// First backoff between attempts; doubles each time, capped, with full jitter.
    pub retry_backoff_base_milliseconds: u64,
    pub retry_backoff_cap_milliseconds: u64,
    /// How long a retry waits for its original, still running in this process, before
    /// answering `request_in_progress`.
    pub idempotency_wait_milliseconds: u64,
    /// How long idempotency records are kept; a key reused after that runs again.
    pub idempotency_retention_seconds: i64,
    /// Records deleted per purge step.
    pub idempotency_purge_batch_size: i64,
    pub idempotency_purge_interval_milliseconds: u64,
    /// Reservations released per expiry step.
    pub expiry_batch_size: i64,
    /// Pause between expiry steps when the previous step found less than a full batch.
    pub expiry_interval_milliseconds: u64,
    /// TTL applied when a reservation names none.
    pub reservation_ttl_seconds_default: i64,
    /// Audits allowed to run at once (each one scans the ledger).
    pub audits_concurrent_max: usize,
    /// Orders expired per step of the order worker.
    pub order_expiry_batch_size: i64,
    /// A payment attempt still unresolved this long after it started is asked about.
    pub reconcile_after_milliseconds: i64,
    /// How long one process holds an attempt it is asking about.
    pub reconcile_lease_milliseconds: i64,
    pub reconcile_batch_size: i64,
    pub refund_batch_size: i64,
    /// Pause before a refund the gateway did not confirm is tried again.
    pub refund_retry_milliseconds: i64,
    /// Pause between steps of the payment workers (order expiry, reconciliation,
    /// refunds).
    pub payment_worker_interval_milliseconds: u64,
    /// Schedules applied per schedule-worker step.
    pub schedule_batch_size: i64,
    /// Longest pause of the schedule worker: it wakes at the next due schedule or
    /// after this, whichever comes first, and sweeps for anything missed.
    pub schedule_sweep_interval_milliseconds: u64,
    /// How long a campaign bucket, or a SKU in a warehouse, found short stays short in
    /// this process's memory: within it, requests skip the bucket, and a campaign whose
    /// every bucket is short (or a request with a line found short) is answered sold
    /// out from memory, without the database. A unit that comes back (a release, an
    /// expiry, a cancel) is seen here after at most this long.
    pub sold_out_recheck_milliseconds: i64,
    /// A running campaign's requests that run against the database at once, per
    /// process; the next ones wait in its line.
    pub campaign_in_flight_max: usize,
    /// Places in a campaign's line (per process); a request beyond them is refused
    /// with `rate_limited`.
    pub campaign_waiting_room_max: usize,
    /// How long a ticket keeps its request's answer after the request ran.
    pub campaign_ticket_retention_seconds: i64,
    /// Answered tickets kept at most (oldest dropped first, even within retention).
    pub campaign_tickets_answered_max: usize,
    /// Campaigns one shop may have open at once; one more is refused with
    /// `failed_precondition`.
    pub campaigns_open_per_shop_max: i64,
    /// Reservation queues, each drained into batches by its own task; a request goes
    /// to the queue of its first SKU. 0 picks one.
    pub combiner_shards: usize,
    /// Most reservations one batch (one transaction) holds.
    pub combiner_batch_size_max: usize,
    /// Most reservations waiting in one shard's queue; more are refused at once.
    pub combiner_queue_depth_max: usize,
    /// Batches of one shard in flight at once (their row locks are still taken in
    /// order); 0 picks one (measured fastest on every backend, see `Engine::new`).
    pub combiner_batches_in_flight: usize,
    /// How long this process trusts what it read about a bearer token (found, unknown
    /// or revoked) before asking the database again: the bound within which a key
    /// revoked on another instance stops working here.
    pub credential_cache_milliseconds: i64,
    /// Pause between samples of the replicas' lag (each sample can move a replica
    /// into or out of the read rotation).
    pub replica_sample_interval_milliseconds: u64,
    /// Outbox events the sequencer numbers per step.
    pub outbox_sequence_batch_size: i64,
    /// Pause of the outbox worker when a step found less than a full batch: the
    /// longest an event waits before the feed (and the relay) can see it.
    pub outbox_interval_milliseconds: u64,
    /// How long events stay in the outbox after every reader took them: the pull
    /// feed's history.
    pub outbox_retention_seconds: i64,
    /// Events deleted per prune step, and the pause between prune steps that found
    /// less than a full batch (after a full one the next step follows at once).
    pub outbox_prune_batch_size: i64,
    pub outbox_prune_interval_milliseconds: u64,
    /// Pause between refreshes of the outbox gauges.
    pub outbox_gauge_interval_milliseconds: u64,
    /// Events the NATS relay publishes per step.
    pub relay_batch_size: i64,
    /// How long a relay's claim lasts unless renewed: the longest a stopped relay
    /// keeps another instance from taking over. Longer than a step can take (a
    /// batch's acknowledgements are each bounded by the NATS request timeout).
    pub relay_lease_milliseconds: i64,
    /// Pause of the relay when a step found less than a full batch (it also wakes
    /// when this instance's sequencer numbers events).
    pub relay_interval_milliseconds: u64,
    /// Pause after a step that failed (NATS down): how often the relay tries again.
    pub relay_retry_milliseconds: u64,
    /// After a step that could not publish, this instance gives the relay's lease up
    /// and claims it again only this much later, so an instance that reaches NATS
    /// takes over (its steps come every interval) instead of waiting behind one that
    /// cannot. Longer than `relay_retry_milliseconds`; alone, the cost is this delay
    /// once NATS is back.
    pub relay_stand_aside_milliseconds: i64,
    /// Pause between checks for stock rows with a negative counter (a table scan).
    pub negative_stock_interval_milliseconds: u64,
    /// Pause between samples of the database's sessions (lock waiters, long
    /// transactions, stock scans).
    pub database_activity_interval_milliseconds: u64,
    /// A transaction open longer than this counts in `stockd_db_long_transactions`:
    /// stockd's own last milliseconds, so anything near this is someone else's.
    pub long_transaction_milliseconds: i64,
    /// Campaigns past their end the campaign worker looks at per step (the next step
    /// goes on after the last of a full one).
    pub campaigns_ended_per_step_max: i64,
    /// Pause between rounds of the live auditor.
    pub live_audit_interval_milliseconds: u64,
    /// Ledger rows older than this join the live auditor's running sums: longer than
    /// any stockd transaction lasts, so no row with a lower id can still commit.
    pub live_audit_settle_milliseconds: i64,
    /// Shortest time between two recounts of the live auditor's running sums from the
    /// whole ledger, done when a round finds a stock row differing from its sums.
    pub live_audit_recount_interval_milliseconds: i64,
    /// Orders a live-audit round reads in its page of changed orders: the next round
    /// goes on after the last of a full page, so a first round over a long history (or
    /// the changes of a long outage) is spread over rounds instead of outgrowing the
    /// statement bound.
    pub live_audit_orders_per_round_max: i64,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            retry_attempts_max: 5,
            retry_backoff_base_milliseconds: 5,
            retry_backoff_cap_milliseconds: 200,
            idempotency_wait_milliseconds: 5_000,
            idempotency_retention_seconds: 24 * 3600,
            idempotency_purge_batch_size: 1_000,
            idempotency_purge_interval_milliseconds: 60_000,
            expiry_batch_size: 200,
            campaigns_ended_per_step_max: crate::campaigns::CAMPAIGNS_ENDED_PER_STEP_MAX,
            expiry_interval_milliseconds: 1_000,
            reservation_ttl_seconds_default: domain::limits::RESERVATION_TTL_SECONDS_DEFAULT,
            audits_concurrent_max: 1,
            order_expiry_batch_size: 100,
            reconcile_after_milliseconds: 10_000,
            reconcile_lease_milliseconds: 30_000,
            reconcile_batch_size: 50,
            refund_batch_size: 50,
            refund_retry_milliseconds: 30_000,
            payment_worker_interval_milliseconds: 1_000,
            schedule_batch_size: 100,
            schedule_sweep_interval_milliseconds: 60_000,
            sold_out_recheck_milliseconds: 1_000,
            campaign_in_flight_max: 256,
            campaign_waiting_room_max: 10_000,
            campaign_ticket_retention_seconds: 600,
            campaign_tickets_answered_max: 100_000,
            campaigns_open_per_shop_max: domain::limits::CAMPAIGNS_OPEN_PER_SHOP_MAX,
            combiner_shards: 0,
            combiner_batch_size_max: 256,
            combiner_queue_depth_max: 4096,
            combiner_batches_in_flight: 0,
            credential_cache_milliseconds: 2_000,
            replica_sample_interval_milliseconds: 500,
            outbox_sequence_batch_size: 500,
            outbox_interval_milliseconds: 20,
            outbox_retention_seconds: 3 * 24 * 3600,
            outbox_prune_batch_size: 1_000,
            outbox_prune_interval_milliseconds: 60_000,
            outbox_gauge_interval_milliseconds: 1_000,
            relay_batch_size: 500,
            relay_lease_milliseconds: 15_000,
            relay_interval_milliseconds: 100,
            relay_retry_milliseconds: 1_000,
            relay_stand_aside_milliseconds: 3_000,
            negative_stock_interval_milliseconds: 60_000,
            database_activity_interval_milliseconds: 5_000,
            long_transaction_milliseconds: 10_000,
            live_audit_interval_milliseconds: 30_000,
            live_audit_settle_milliseconds: 60_000,
            live_audit_recount_interval_milliseconds: 600_000,
            live_audit_orders_per_round_max: 10_000,
        }
    }
}

impl EngineConfig {
    /// The pause before attempt `attempt + 1` (0-based): exponential, capped, jittered.
    pub fn backoff(&self, attempt: u32, random_fraction: f64) -> Duration {
        let exponential = self
            .retry_backoff_base_milliseconds
            .saturating_mul(1_u64 << attempt.min(16))
            .min(self.retry_backoff_cap_milliseconds);
        let jittered = (exponential as f64 * random_fraction.clamp(0.0, 1.0)) as u64;
        Duration::from_millis(jittered.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_then_stays_at_the_cap() {
        let config = EngineConfig::default();
        assert_eq!(config.backoff(0, 1.0), Duration::from_millis(5));
        assert_eq!(config.backoff(2, 1.0), Duration::from_millis(20));
        assert_eq!(config.backoff(30, 1.0), Duration::from_millis(200));
    }

    #[test]
    fn backoff_jitter_never_reaches_zero_or_exceeds_the_step() {
        let config = EngineConfig::default();
        assert_eq!(config.backoff(3, 0.0), Duration::from_millis(1));
        assert!(config.backoff(3, 0.5) <= Duration::from_millis(40));
    }
}

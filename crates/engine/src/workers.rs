//! The background workers. Each one is a loop around an engine step function; the
//! loop only sleeps, repeats and stops when told. The database decides which instance
//! does which piece of work, so any number of processes may run these loops.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Engine;

/// Starts every worker on `tracker`; they stop when `shutdown` is cancelled.
pub fn spawn_workers(engine: &Engine, tracker: &TaskTracker, shutdown: &CancellationToken) {
    tracker.spawn(expiry_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(purge_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(schedule_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(order_expiry_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(payment_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(replica_monitor_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(outbox_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(negative_stock_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(database_activity_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(live_audit_loop(engine.clone(), shutdown.clone()));
    tracker.spawn(campaign_loop(engine.clone(), shutdown.clone()));
}

/// Campaigns: ends the due ones (what is left goes back) and reads the open ones again,
/// so a campaign another instance created is routed here within the interval.
async fn campaign_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(crate::campaigns::REGISTRY_REFRESH_MILLISECONDS);
    every(interval, &shutdown, "campaigns", || engine.campaign_step()).await;
}

/// The live auditor: the three-way check from its checkpoint, every interval.
async fn live_audit_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().live_audit_interval_milliseconds);
    // Until a round succeeds, the auditor's last success counts from its start: a
    // fleet whose every round fails (a broken migration, a missing privilege, a bound
    // too short for the ledger) then shows a time going stale, which
    // `StockdAuditStale` fires on, instead of no series at all, which it cannot.
    metrics::gauge!("stockd_audit_last_success_timestamp_seconds")
        .set(engine.now().unix_milliseconds() as f64 / 1_000.0);
    every(interval, &shutdown, "live_audit", || {
        engine.live_audit_step()
    })
    .await;
}

/// Samples the database's sessions: lock waiters, long transactions, stock scans.
async fn database_activity_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().database_activity_interval_milliseconds);
    every(interval, &shutdown, "database_activity", || {
        engine.database_activity_step()
    })
    .await;
}

/// Checks that no stock row went below zero (`stockd_stock_rows_negative`).
async fn negative_stock_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().negative_stock_interval_milliseconds);
    every(interval, &shutdown, "negative_stock", || {
        engine.negative_stock_step()
    })
    .await;
}

/// Runs `step` every `interval` until shut down; a failed step is counted in
/// `stockd_worker_errors_total{worker}` and logged, and the next one runs on time.
async fn every<Output, Step>(
    interval: Duration,
    shutdown: &CancellationToken,
    worker: &'static str,
    step: impl Fn() -> Step,
) where
    Step: std::future::Future<Output = Result<Output, crate::EngineError>>,
{
    loop {
        if let Err(error) = step().await {
            metrics::counter!("stockd_worker_errors_total", "worker" => worker).increment(1);
            tracing::warn!(worker, %error, "worker step failed");
        }
        if !pause_unless_shut_down(shutdown, interval).await {
            break;
        }
    }
}

/// Numbers committed outbox events (so the feed and the relay can see them), prunes
/// the old ones and exports the backlog. Sequencers of several instances take turns
/// on one database row; pruning and gauges run on their own slower clocks.
async fn outbox_loop(engine: Engine, shutdown: CancellationToken) {
    let config = engine.config();
    let interval = Duration::from_millis(config.outbox_interval_milliseconds);
    let prune_every = Duration::from_millis(config.outbox_prune_interval_milliseconds);
    let gauges_every = Duration::from_millis(config.outbox_gauge_interval_milliseconds);
    let batch_size = u64::try_from(config.outbox_sequence_batch_size).unwrap_or(0);
    let prune_batch_size = u64::try_from(config.outbox_prune_batch_size).unwrap_or(0);
    // A process that starts prunes at once: a backlog left by a stopped one goes first.
    let mut next_prune = tokio::time::Instant::now();
    let mut next_gauges = tokio::time::Instant::now();
    loop {
        let pause = match engine.sequence_step().await {
            Ok(numbered) if numbered >= batch_size => Duration::ZERO,
            Ok(_) => interval,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "outbox").increment(1);
                tracing::warn!(%error, "outbox sequencer step failed");
                interval.max(Duration::from_millis(500))
            }
        };
        let now = tokio::time::Instant::now();
        if now >= next_prune {
            // A full batch means more is due: the next one at the loop's next turn, so
            // pruning keeps up with any rate of events, not one batch an interval.
            next_prune = match engine.outbox_prune_step().await {
                Ok(pruned) if pruned >= prune_batch_size => now,
                Ok(_) => now + prune_every,
                Err(error) => {
                    metrics::counter!("stockd_worker_errors_total", "worker" => "outbox_prune")
                        .increment(1);
                    tracing::warn!(%error, "outbox prune step failed");
                    now + prune_every
                }
            };
        }
        if now >= next_gauges {
            if let Err(error) = engine.outbox_gauges_step().await {
                tracing::debug!(%error, "outbox gauges not read");
            }
            // From when the read ended: a slow read must not make every turn of the
            // sequencer's loop read the gauges again.
            next_gauges = tokio::time::Instant::now() + gauges_every;
        }
        if !pause_unless_shut_down(&shutdown, pause).await {
            break;
        }
    }
}

/// Samples the replicas' lag; a store without replicas makes each step a no-op.
async fn replica_monitor_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().replica_sample_interval_milliseconds);
    // Replicas are configured at start only: without any there is nothing to watch.
    if !engine.store().has_replicas() {
        return;
    }
    loop {
        engine.replica_monitor_step().await;
        if !pause_unless_shut_down(&shutdown, interval).await {
            break;
        }
    }
}

/// Expires unpaid orders past their hold, giving their stock back. A loop of its own:
/// the payment loop waits on the gateway (up to its timeout per call), and a slow or
/// unreachable gateway must not keep stock held past the holds. After a full claim the
/// next step runs at once: after a sale, thousands of unpaid orders fall due together,
/// and their stock is what the next shoppers wait for.
async fn order_expiry_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().payment_worker_interval_milliseconds);
    loop {
        let pause = match engine.order_expiry_step().await {
            Ok(_) if engine.order_expiry_has_more_due() => Duration::ZERO,
            Ok(_) => interval,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "order_expiry")
                    .increment(1);
                tracing::warn!(%error, "order expiry step failed");
                interval
            }
        };
        if !pause_unless_shut_down(&shutdown, pause).await {
            break;
        }
    }
}

/// Asks the gateway about unresolved payments and issues pending refunds — each step
/// bounded, each safe with several processes.
async fn payment_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().payment_worker_interval_milliseconds);
    loop {
        if engine.payments_attached() {
            if let Err(error) = engine.reconcile_step().await {
                metrics::counter!("stockd_worker_errors_total", "worker" => "reconciliation")
                    .increment(1);
                tracing::warn!(%error, "reconciliation step failed");
            }
            if let Err(error) = engine.refund_step().await {
                metrics::counter!("stockd_worker_errors_total", "worker" => "refunds").increment(1);
                tracing::warn!(%error, "refund step failed");
            }
        }
        if !pause_unless_shut_down(&shutdown, interval).await {
            break;
        }
    }
}

/// Applies scheduled shelf changes with minute precision: sleeps until the next due
/// schedule (woken early when a new one is recorded here), and never longer than the
/// sweep interval, which catches schedules recorded by other processes or missed while
/// this one was down or its clock jumped.
async fn schedule_loop(engine: Engine, shutdown: CancellationToken) {
    let sweep = Duration::from_millis(engine.config().schedule_sweep_interval_milliseconds);
    let batch_size = usize::try_from(engine.config().schedule_batch_size).unwrap_or(0);
    loop {
        let applied_full_batch = match engine.schedule_step().await {
            Ok(applied) => applied.len() >= batch_size,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "schedules")
                    .increment(1);
                tracing::warn!(%error, "schedule step failed");
                false
            }
        };
        let pause = if applied_full_batch {
            Duration::ZERO
        } else {
            let next_due = engine.next_schedule_due().await.ok().flatten();
            pause_before_next_schedule(next_due, engine.now(), sweep)
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
            () = engine.schedules_changed() => {}
        }
    }
}

/// The shortest pause of the schedule worker after a step that did not fill its batch.
/// A schedule still due then is held by another instance's step (or the step failed):
/// without a floor the worker would ask again at once, in a loop, until that step
/// commits. Schedules have minute precision, so a second costs nothing.
const SCHEDULE_PAUSE_MIN: Duration = Duration::from_secs(1);

/// Until the next schedule is due, at least [`SCHEDULE_PAUSE_MIN`] and at most the
/// sweep interval (which also catches schedules recorded elsewhere).
fn pause_before_next_schedule(
    next_due: Option<domain::Timestamp>,
    now: domain::Timestamp,
    sweep: Duration,
) -> Duration {
    let Some(due) = next_due else {
        return sweep;
    };
    let wait = due
        .unix_milliseconds()
        .saturating_sub(now.unix_milliseconds());
    Duration::from_millis(u64::try_from(wait).unwrap_or(0))
        .max(SCHEDULE_PAUSE_MIN)
        .min(sweep)
}

async fn expiry_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().expiry_interval_milliseconds);
    loop {
        let pause = match engine.expire_step().await {
            Ok(step) if step.more_waiting => Duration::ZERO,
            Ok(_) => interval,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "expiry").increment(1);
                tracing::warn!(%error, "expiry step failed");
                interval
            }
        };
        if let Ok(backlog) = engine.expiry_backlog().await {
            metrics::gauge!("stockd_expiry_backlog").set(backlog as f64);
        }
        if !pause_unless_shut_down(&shutdown, pause).await {
            break;
        }
    }
}

async fn purge_loop(engine: Engine, shutdown: CancellationToken) {
    let interval = Duration::from_millis(engine.config().idempotency_purge_interval_milliseconds);
    let batch_size = u64::try_from(engine.config().idempotency_purge_batch_size).unwrap_or(0);
    loop {
        let pause = match engine.purge_step().await {
            Ok(purged) if purged >= batch_size => Duration::ZERO,
            Ok(_) => interval,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "idempotency_purge")
                    .increment(1);
                tracing::warn!(%error, "idempotency purge step failed");
                interval
            }
        };
        if !pause_unless_shut_down(&shutdown, pause).await {
            break;
        }
    }
}

/// Starts the NATS relay of this instance on `tracker`: publishes numbered events
/// whenever this instance holds the relay's lease, and gives the lease up on a clean
/// stop.
pub fn spawn_relay(
    engine: &Engine,
    relay: std::sync::Arc<crate::relay::EventRelay>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) {
    engine.attach_event_relay();
    tracker.spawn(relay_loop(engine.clone(), relay, shutdown.clone()));
}

async fn relay_loop(
    engine: Engine,
    relay: std::sync::Arc<crate::relay::EventRelay>,
    shutdown: CancellationToken,
) {
    let config = engine.config();
    let interval = Duration::from_millis(config.relay_interval_milliseconds);
    let retry = Duration::from_millis(config.relay_retry_milliseconds);
    loop {
        let pause = match engine.relay_step(&relay).await {
            Ok(step) if step.failure.is_some() || step.standing_aside => retry,
            Ok(step) if step.more_waiting => Duration::ZERO,
            Ok(_) => interval,
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "relay").increment(1);
                tracing::warn!(%error, "relay step failed");
                retry
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
            () = engine.events_numbered(), if pause < retry => {}
        }
    }
    if let Err(error) = engine.release_relay(&relay).await {
        tracing::warn!(%error, "relay lease not given up; another instance takes over when it ends");
    }
}

/// Starts the display cache's invalidator on `tracker`: it follows the outbox from
/// the events numbered when it starts and drops what they make stale.
pub fn spawn_cache_invalidator(
    engine: &Engine,
    cache: std::sync::Arc<cache::DisplayCache>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) {
    tracker.spawn(cache_invalidation_loop(
        engine.clone(),
        cache,
        shutdown.clone(),
    ));
}

async fn cache_invalidation_loop(
    engine: Engine,
    cache: std::sync::Arc<cache::DisplayCache>,
    shutdown: CancellationToken,
) {
    let interval = Duration::from_millis(engine.config().outbox_interval_milliseconds);
    let retry = Duration::from_millis(engine.config().relay_retry_milliseconds);
    let mut cursor = loop {
        match engine.latest_event_cursor().await {
            Ok(cursor) => break cursor,
            Err(_) => {
                if !pause_unless_shut_down(&shutdown, retry).await {
                    return;
                }
            }
        }
    };
    // Reads use the cache only from here: a value filled before the start cursor was
    // read could hold a change whose event lies before the cursor, which no step would
    // drop. Until then reads go to the database.
    engine.attach_display_cache(cache);
    loop {
        let pause = match engine.cache_invalidation_step(cursor).await {
            Ok(step) => {
                cursor = step.cursor;
                if step.events > 0 {
                    Duration::ZERO
                } else {
                    interval
                }
            }
            Err(error) => {
                metrics::counter!("stockd_worker_errors_total", "worker" => "cache_invalidation")
                    .increment(1);
                tracing::debug!(%error, "cache invalidation step failed");
                retry
            }
        };
        if !pause_unless_shut_down(&shutdown, pause).await {
            break;
        }
    }
}

/// Sleeps for `pause`; false when `shutdown` came first and the loop should end.
async fn pause_unless_shut_down(shutdown: &CancellationToken, pause: Duration) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(pause) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use domain::Timestamp;

    #[test]
    fn the_schedule_worker_waits_for_the_next_due_schedule_within_a_floor_and_the_sweep() {
        let now = Timestamp::from_unix_milliseconds(1_000_000);
        let sweep = Duration::from_secs(60);
        let due_in = |milliseconds: i64| Some(now.plus_milliseconds(milliseconds));

        assert_eq!(pause_before_next_schedule(None, now, sweep), sweep);
        assert_eq!(
            pause_before_next_schedule(due_in(5_000), now, sweep),
            Duration::from_secs(5)
        );
        assert_eq!(
            pause_before_next_schedule(due_in(600_000), now, sweep),
            sweep,
            "never longer than the sweep"
        );
        for overdue in [0, -1, -60_000] {
            assert_eq!(
                pause_before_next_schedule(due_in(overdue), now, sweep),
                SCHEDULE_PAUSE_MIN,
                "a schedule still due (held by another instance's step) is not asked for again at once"
            );
        }
    }
}

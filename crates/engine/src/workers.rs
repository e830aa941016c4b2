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
        if let Ok(backlog) = engine.store().expiry_backlog(engine.now()).await {
            metrics::gauge!("stockd_expiry_backlog").set(backlog as f64);
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
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
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

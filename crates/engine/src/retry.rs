//! Bounded retries of a unit of work that hit a deadlock or serialization failure.

use std::future::Future;

use store::StoreError;

use crate::config::EngineConfig;

/// Runs `work` until it succeeds, fails with anything but [`StoreError::Retryable`],
/// or has run `retry_attempts_max` times; pauses with capped, jittered exponential
/// backoff in between. The last `Retryable` is returned when attempts run out. The
/// whole unit of work, retries included, is timed as
/// `stockd_store_operation_duration_seconds{operation}`.
pub async fn with_retries<Output, Work, Attempt>(
    config: &EngineConfig,
    operation: &'static str,
    work: Work,
) -> Result<Output, StoreError>
where
    Work: Fn() -> Attempt,
    Attempt: Future<Output = Result<Output, StoreError>>,
{
    let started = std::time::Instant::now();
    let outcome = run_with_retries(config, operation, work).await;
    metrics::histogram!("stockd_store_operation_duration_seconds", "operation" => operation)
        .record(started.elapsed().as_secs_f64());
    outcome
}

async fn run_with_retries<Output, Work, Attempt>(
    config: &EngineConfig,
    operation: &'static str,
    work: Work,
) -> Result<Output, StoreError>
where
    Work: Fn() -> Attempt,
    Attempt: Future<Output = Result<Output, StoreError>>,
{
    let mut attempt = 0;
    loop {
        match work().await {
            Err(StoreError::Retryable(message)) if attempt + 1 < config.retry_attempts_max => {
                metrics::counter!("stockd_store_retries_total", "operation" => operation)
                    .increment(1);
                tracing::debug!(operation, attempt, %message, "retrying after a conflict");
                tokio::time::sleep(config.backoff(attempt, rand::random::<f64>())).await;
                attempt += 1;
            }
            Err(StoreError::Retryable(message)) => {
                metrics::counter!("stockd_store_retries_exhausted_total", "operation" => operation)
                    .increment(1);
                tracing::warn!(operation, attempts = attempt + 1, %message, "retries exhausted");
                return Err(StoreError::Retryable(message));
            }
            outcome => return outcome,
        }
    }
}

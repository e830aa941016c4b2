//! Bounded retries of a unit of work that hit a deadlock or serialization failure.

use std::future::Future;

use store::StoreError;

use crate::config::EngineConfig;

/// Runs `work` until it succeeds, fails with anything but a retryable error
/// ([`StoreError::is_retryable`]), or has run `retry_attempts_max` times; pauses with
/// capped, jittered exponential backoff in between. The last retryable error is
/// returned when attempts run out. The whole unit of work, retries included, is timed
/// as `stockd_store_operation_duration_seconds{operation}`, and its statements' lock
/// waits and deadlocks are labelled `operation` too.
pub async fn with_retries<Output, Work, Attempt>(
    config: &EngineConfig,
    operation: &'static str,
    work: Work,
) -> Result<Output, StoreError>
where
    Work: Fn() -> Attempt,
    Attempt: Future<Output = Result<Output, StoreError>>,
{
    with_retries_on(config, operation, &[], work).await
}

/// [`with_retries`] for a unit of work on these SKUs, which a deadlock's log line names
/// (seed 002 §九: "死锁涉及的 SQL 和 SKU").
pub async fn with_retries_on<Output, Work, Attempt>(
    config: &EngineConfig,
    operation: &'static str,
    skus: &[&str],
    work: Work,
) -> Result<Output, StoreError>
where
    Work: Fn() -> Attempt,
    Attempt: Future<Output = Result<Output, StoreError>>,
{
    let started = std::time::Instant::now();
    let outcome =
        store::observe::in_operation(operation, run_with_retries(config, operation, skus, work))
            .await;
    metrics::histogram!("stockd_store_operation_duration_seconds", "operation" => operation)
        .record(started.elapsed().as_secs_f64());
    outcome
}

async fn run_with_retries<Output, Work, Attempt>(
    config: &EngineConfig,
    operation: &'static str,
    skus: &[&str],
    work: Work,
) -> Result<Output, StoreError>
where
    Work: Fn() -> Attempt,
    Attempt: Future<Output = Result<Output, StoreError>>,
{
    let mut attempt = 0;
    loop {
        match work().await {
            Err(error) if error.is_retryable() => {
                if let StoreError::Deadlock(message) = &error {
                    record_deadlock(operation, skus, message);
                }
                if attempt + 1 >= config.retry_attempts_max {
                    metrics::counter!("stockd_store_retries_exhausted_total", "operation" => operation)
                        .increment(1);
                    tracing::warn!(operation, attempts = attempt + 1, %error, "retries exhausted");
                    return Err(error);
                }
                metrics::counter!("stockd_store_retries_total", "operation" => operation)
                    .increment(1);
                tracing::debug!(operation, attempt, %error, "retrying after a conflict");
                tokio::time::sleep(config.backoff(attempt, rand::random::<f64>())).await;
                attempt += 1;
            }
            outcome => return outcome,
        }
    }
}

/// The distinct SKUs of `lines`, in order: what a deadlock's log line names.
pub fn skus_of(lines: &[domain::ReservationLine]) -> Vec<&str> {
    let mut skus: Vec<&str> = lines.iter().map(|line| line.sku.as_str()).collect();
    skus.sort_unstable();
    skus.dedup();
    skus
}

/// Counts a deadlock the database broke by rolling `operation` back, and logs the
/// statement that was waiting (in `message`) and the SKUs the unit of work was on.
fn record_deadlock(operation: &'static str, skus: &[&str], message: &str) {
    metrics::counter!("stockd_db_deadlocks_total", "operation" => operation).increment(1);
    tracing::warn!(
        operation,
        skus = %skus.join(","),
        detail = %message,
        "deadlock: the database rolled this unit of work back; it runs again"
    );
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Log output collected in memory.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_deadlock_is_retried_and_its_log_line_names_the_statement_and_the_skus() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let config = EngineConfig::default();
        let attempts = AtomicU32::new(0);

        let outcome = with_retries_on(&config, "create_order", &["AAA", "BBB"], || async {
            if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                Err(StoreError::Deadlock(
                    "deadlock detected; statement: UPDATE stock SET reserved = reserved + $1"
                        .into(),
                ))
            } else {
                Ok("reserved")
            }
        })
        .await;

        assert_eq!(outcome, Ok("reserved"));
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(logged.contains("WARN"), "{logged}");
        assert!(logged.contains("operation=\"create_order\""), "{logged}");
        assert!(logged.contains("skus=AAA,BBB"), "{logged}");
        assert!(
            logged.contains("statement: UPDATE stock SET reserved = reserved + $1"),
            "{logged}"
        );
    }

    #[test]
    fn the_skus_of_lines_are_named_once_each_in_order() {
        let line = |sku: &str| domain::ReservationLine {
            sku: domain::SkuCode::parse(sku).unwrap(),
            warehouse: domain::WarehouseCode::default_warehouse(),
            quantity: domain::Quantity::new(1).unwrap(),
        };
        let lines = [line("BBB"), line("AAA"), line("BBB")];

        assert_eq!(skus_of(&lines), vec!["AAA", "BBB"]);
    }
}

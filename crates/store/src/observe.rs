//! What the store tells operations about its statements (seed 002 §九): lock waits
//! and deadlocks, labelled by the unit of work that met them.
//!
//! The engine names the unit of work it runs ([`in_operation`]); the statement layer
//! reads that name from the task, so no unit of work has to pass it along.

use std::future::Future;
use std::time::Duration;

tokio::task_local! {
    static OPERATION: &'static str;
}

/// A row-locking statement that took at least this long waited for a lock: an
/// uncontended one answers in well under a millisecond on a local database, and a
/// statement that writes one row has nothing else to spend ten milliseconds on.
pub const LOCK_WAIT_FLOOR: Duration = Duration::from_millis(10);

/// Runs `work` with its statements' metrics labelled `operation`.
pub async fn in_operation<Work: Future>(operation: &'static str, work: Work) -> Work::Output {
    OPERATION.scope(operation, work).await
}

/// The unit of work running on this task, `other` outside one (migrations, tests).
pub fn current_operation() -> &'static str {
    OPERATION
        .try_with(|operation| *operation)
        .unwrap_or("other")
}

/// Whether a statement takes row locks, so that its time is spent mostly waiting for
/// them when it is long: every write, `SELECT … FOR UPDATE`, and PostgreSQL's
/// reservation writer functions and procedures (`SELECT stockd_…`, `CALL stockd_…`,
/// migrations 0006 and on).
pub fn takes_row_locks(text: &str) -> bool {
    let text = text.trim_start();
    let head = text.get(..6).unwrap_or("");
    head.eq_ignore_ascii_case("UPDATE")
        || head.eq_ignore_ascii_case("INSERT")
        || head.eq_ignore_ascii_case("DELETE")
        || text.starts_with("SELECT stockd_")
        || text.starts_with("CALL stockd_")
        || text.contains("FOR UPDATE")
}

/// Records a lock wait of `waited` for the current operation when it reached the
/// floor: `stockd_db_lock_waits_total{operation}` and
/// `stockd_db_lock_wait_seconds{operation}`.
pub fn record_lock_wait(waited: Duration) {
    if waited < LOCK_WAIT_FLOOR {
        return;
    }
    let operation = current_operation();
    metrics::counter!("stockd_db_lock_waits_total", "operation" => operation).increment(1);
    metrics::histogram!("stockd_db_lock_wait_seconds", "operation" => operation)
        .record(waited.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_locking_reads_take_row_locks_and_plain_reads_do_not() {
        assert!(takes_row_locks(
            "UPDATE stock SET available = available - $1 WHERE sku = $2"
        ));
        assert!(takes_row_locks("  insert into ledger (sku) values ($1)"));
        assert!(takes_row_locks("DELETE FROM cart_item WHERE user_id = $1"));
        assert!(takes_row_locks(
            "SELECT status FROM reservation WHERE id = $1 FOR UPDATE"
        ));
        assert!(takes_row_locks("SELECT stockd_reserve_whole_batch($1, $2)"));
        assert!(takes_row_locks(
            "CALL stockd_reserve_whole_batch_committed($1, NULL)"
        ));
        assert!(!takes_row_locks(
            "SELECT available FROM stock WHERE sku = $1"
        ));
        assert!(!takes_row_locks("BEGIN"));
    }

    #[tokio::test]
    async fn an_operation_names_the_statements_run_inside_it_and_only_those() {
        assert_eq!(current_operation(), "other");
        let inside = in_operation("reserve", async { current_operation() }).await;
        assert_eq!(inside, "reserve");
        assert_eq!(current_operation(), "other");
    }
}

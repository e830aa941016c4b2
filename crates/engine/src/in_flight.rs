//! Idempotency keys being executed by this process right now.
//!
//! A retry that arrives while its original is still running waits (bounded) for the
//! original to finish and then replays its stored response, instead of racing it into
//! the database. Across processes the database's unique key does the same job.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::EngineError;

/// A running request's signal: a semaphore without permits, closed when the request
/// finishes. A closed semaphore answers every `acquire`, one that starts after the close
/// included, so a waiter cannot miss the finish. It is one small allocation where a
/// `watch` channel was several (docs/BENCHMARKS.md, twenty-fourth session): every
/// mutating request enters here. Wrapped so a waiter can only wait: a permit added
/// through a bare semaphore would read as the owner's finish.
#[derive(Debug, Clone)]
pub struct Finished(Arc<Signal>);

#[derive(Debug)]
struct Signal {
    closed: Semaphore,
    /// An answer the owner gave from memory, stored under no key, with the request's
    /// fingerprint: copies of the same request waiting for it hear it too, instead of
    /// each running again in turn (each a key probe and a read of the key).
    shared: OnceLock<(String, EngineError)>,
}

impl Finished {
    /// The owner's answer from memory, for a request with the same fingerprint.
    pub fn shared_answer(&self, fingerprint: &str) -> Option<EngineError> {
        self.0
            .shared
            .get()
            .filter(|(shared, _)| shared == fingerprint)
            .map(|(_, answer)| answer.clone())
    }
}

type Running = Arc<Mutex<HashMap<Arc<str>, Finished>>>;

#[derive(Debug, Default, Clone)]
pub struct InFlight {
    running: Running,
}

/// Held while a key's request runs; dropping it (on success, error or cancellation)
/// wakes everyone waiting for the key.
#[derive(Debug)]
pub struct InFlightGuard {
    running: Running,
    key: Arc<str>,
    finished: Finished,
}

impl InFlightGuard {
    /// Shares an answer given from memory (stored under no key) with the copies of
    /// this request (same fingerprint) waiting for it.
    pub fn share_answer(&self, fingerprint: &str, answer: &EngineError) {
        let _ = self
            .finished
            .0
            .shared
            .set((fingerprint.to_owned(), answer.clone()));
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        running.remove(&self.key);
        // After the removal, so a waiter woken here that enters again owns the key.
        self.finished.0.closed.close();
    }
}

pub enum Entry {
    /// This request owns the key until the guard is dropped.
    Owner(InFlightGuard),
    /// Another request with this key is running; wait for it.
    Busy(Finished),
}

impl InFlight {
    pub fn enter(&self, key: &str) -> Entry {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(finished) = running.get(key) {
            return Entry::Busy(finished.clone());
        }
        let key: Arc<str> = Arc::from(key);
        let finished = Finished(Arc::new(Signal {
            closed: Semaphore::new(0),
            shared: OnceLock::new(),
        }));
        running.insert(Arc::clone(&key), finished.clone());
        Entry::Owner(InFlightGuard {
            running: Arc::clone(&self.running),
            key,
            finished,
        })
    }

    pub fn len(&self) -> usize {
        self.running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Waits until the owner of the key drops its guard, or `limit` passes. Returns whether
/// the owner finished.
pub async fn wait_for_owner(finished: Finished, limit: Duration) -> bool {
    // The semaphore never has a permit: `acquire` returns only once it is closed.
    tokio::time::timeout(limit, finished.0.closed.acquire())
        .await
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_entry_for_a_running_key_waits_until_the_owner_finishes() {
        let in_flight = InFlight::default();
        let Entry::Owner(guard) = in_flight.enter("k") else {
            panic!("first entry owns the key")
        };
        let Entry::Busy(finished) = in_flight.enter("k") else {
            panic!("second entry is busy")
        };
        let waiter = tokio::spawn(wait_for_owner(finished, Duration::from_secs(60)));
        drop(guard);
        assert!(waiter.await.unwrap());
        assert!(in_flight.is_empty());
        assert!(matches!(in_flight.enter("k"), Entry::Owner(_)));
    }

    #[tokio::test]
    async fn a_copy_waiting_for_an_answer_from_memory_hears_it_and_another_request_does_not() {
        let in_flight = InFlight::default();
        let Entry::Owner(guard) = in_flight.enter("k") else {
            panic!("first entry owns the key")
        };
        let Entry::Busy(finished) = in_flight.enter("k") else {
            panic!("second entry is busy")
        };
        let sold_out = EngineError::Refused {
            code: domain::ErrorCode::InsufficientStock,
            detail: "sold out".into(),
        };
        guard.share_answer("fingerprint", &sold_out);
        drop(guard);
        assert!(wait_for_owner(finished.clone(), Duration::from_secs(60)).await);
        assert_eq!(finished.shared_answer("fingerprint"), Some(sold_out));
        assert_eq!(finished.shared_answer("another body"), None);
        let Entry::Owner(next) = in_flight.enter("k") else {
            panic!("the key is free again")
        };
        let Entry::Busy(fresh) = in_flight.enter("k") else {
            panic!("busy")
        };
        drop(next);
        assert_eq!(
            fresh.shared_answer("fingerprint"),
            None,
            "a new owner shares nothing"
        );
    }

    #[tokio::test]
    async fn a_waiter_that_starts_after_the_owner_finished_does_not_wait() {
        let in_flight = InFlight::default();
        let Entry::Owner(guard) = in_flight.enter("k") else {
            panic!("first entry owns the key")
        };
        let Entry::Busy(finished) = in_flight.enter("k") else {
            panic!("second entry is busy")
        };
        drop(guard);
        assert!(finished.0.closed.is_closed());
        assert!(wait_for_owner(finished, Duration::from_secs(60)).await);
    }

    #[tokio::test]
    async fn waiting_gives_up_after_the_limit_while_the_owner_still_runs() {
        let in_flight = InFlight::default();
        let Entry::Owner(_guard) = in_flight.enter("k") else {
            panic!("first entry owns the key")
        };
        let Entry::Busy(finished) = in_flight.enter("k") else {
            panic!("second entry is busy")
        };
        assert!(!wait_for_owner(finished, Duration::from_millis(1)).await);
    }

    #[test]
    fn different_keys_do_not_wait_for_each_other() {
        let in_flight = InFlight::default();
        let _first = in_flight.enter("a");
        assert!(matches!(in_flight.enter("b"), Entry::Owner(_)));
    }
}

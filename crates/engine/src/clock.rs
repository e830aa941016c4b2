//! Time, injected. Every rule that reads the time (expiry, retention) reads it here, so
//! tests move a manual clock instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use domain::Timestamp;

pub trait Clock: Send + Sync {
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let milliseconds = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Timestamp::from_unix_milliseconds(milliseconds)
    }
}

/// A clock that only moves when told to. Clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    milliseconds: Arc<AtomicI64>,
}

impl ManualClock {
    pub fn new(start: Timestamp) -> ManualClock {
        ManualClock {
            milliseconds: Arc::new(AtomicI64::new(start.unix_milliseconds())),
        }
    }

    pub fn advance_seconds(&self, seconds: i64) {
        self.advance_milliseconds(seconds * 1000);
    }

    pub fn advance_milliseconds(&self, milliseconds: i64) {
        self.milliseconds.fetch_add(milliseconds, Ordering::SeqCst);
    }

    pub fn set(&self, instant: Timestamp) {
        self.milliseconds
            .store(instant.unix_milliseconds(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_unix_milliseconds(self.milliseconds.load(Ordering::SeqCst))
    }
}

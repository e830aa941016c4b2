//! Where a display read goes, and what it says about its freshness.
//!
//! A display read takes a [`ReadHandle`]; it is the only way a unit of work reaches a
//! replica (`Backend::begin_display`). Units of work that decide — idempotency lookups,
//! locks, statuses a transition reads, the audit, the workers — take no handle and so
//! read the writer. Which methods are display reads is the contract's list: the
//! shopper's product view, `GET /v1/skus/{sku}`, carts, the shelf log, order views.

use domain::{ConsistencyToken, Fallback, ServedBy, Timestamp};

/// A display read's request: may be served by a replica, and when it carries a token,
/// only by one that has replayed past it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadHandle {
    token: Option<ConsistencyToken>,
}

impl ReadHandle {
    pub fn display(token: Option<ConsistencyToken>) -> ReadHandle {
        ReadHandle { token }
    }

    pub fn token(&self) -> Option<ConsistencyToken> {
        self.token
    }
}

/// Where a display read was served from, as the backend chose it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Served {
    pub by: ServedBy,
    /// Why a read that could have gone to a replica went to the primary.
    pub fallback: Option<Fallback>,
    /// The replica's position in the configured list.
    pub replica: Option<usize>,
    /// The replica's lag at its last sample (0 on the primary).
    pub lag_seconds: f64,
}

impl Served {
    pub fn primary(fallback: Option<Fallback>) -> Served {
        Served {
            by: ServedBy::Primary,
            fallback,
            replica: None,
            lag_seconds: 0.0,
        }
    }

    pub fn replica(index: usize, lag_seconds: f64) -> Served {
        Served {
            by: ServedBy::Replica,
            fallback: None,
            replica: Some(index),
            lag_seconds,
        }
    }

    /// The data's time for a read made at `now`: on a replica, `now` less its lag.
    pub fn as_of(&self, now: Timestamp) -> Timestamp {
        let lag_milliseconds = (self.lag_seconds * 1000.0).round() as i64;
        now.plus_milliseconds(-lag_milliseconds.max(0))
    }
}

/// A display read's answer, with who served it and how fresh it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Displayed<T> {
    pub value: T,
    pub served_by: ServedBy,
    pub fallback: Option<Fallback>,
    pub as_of: Timestamp,
}

impl<T> Displayed<T> {
    pub fn map<U>(self, change: impl FnOnce(T) -> U) -> Displayed<U> {
        Displayed {
            value: change(self.value),
            served_by: self.served_by,
            fallback: self.fallback,
            as_of: self.as_of,
        }
    }
}

impl<T> Displayed<Option<T>> {
    /// The value when there is one, with the same provenance.
    pub fn found(self) -> Option<Displayed<T>> {
        let Displayed {
            value,
            served_by,
            fallback,
            as_of,
        } = self;
        value.map(|value| Displayed {
            value,
            served_by,
            fallback,
            as_of,
        })
    }
}

/// A replica as its last sample saw it, for metrics and `/readyz`-style reports.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaHealth {
    /// The replica's URL without its password.
    pub name: String,
    pub lag_seconds: Option<f64>,
    pub lag_bytes: Option<u64>,
    /// The largest lag in seconds sampled since this process started.
    pub lag_seconds_peak: f64,
    pub in_rotation: bool,
    /// Moves into or out of the rotation since the previous sample: this sample's own,
    /// and a failed read's that took it out in between.
    pub rotation_changes: u64,
}

/// The replicas a store reads from, and when one leaves the rotation.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaConfig {
    /// `STOCKD_REPLICA_URLS`: display reads only.
    pub urls: Vec<String>,
    /// `STOCKD_REPLICA_LAG_SECONDS_MAX`: above it a replica leaves the read rotation.
    pub lag_seconds_max: f64,
    /// Longest wait for a replica's connection before the read goes to the primary.
    pub acquire_timeout_milliseconds: u64,
    /// Longest wait for a replica's answer to a lag sample or to the position check
    /// before a read. A replica that does not answer (a frozen host, a network that
    /// drops packets without resetting the connection) counts as failed: it leaves
    /// the rotation, and neither the monitor nor a read waits on it longer.
    pub answer_timeout_milliseconds: u64,
}

/// Default of `STOCKD_REPLICA_LAG_SECONDS_MAX`.
pub const REPLICA_LAG_SECONDS_MAX_DEFAULT: f64 = 5.0;

impl Default for ReplicaConfig {
    fn default() -> ReplicaConfig {
        ReplicaConfig {
            urls: Vec::new(),
            lag_seconds_max: REPLICA_LAG_SECONDS_MAX_DEFAULT,
            acquire_timeout_milliseconds: 1_000,
            answer_timeout_milliseconds: 1_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_answer_is_as_old_as_the_replica_lag() {
        let now = Timestamp::from_unix_milliseconds(10_000);
        assert_eq!(
            Served::replica(0, 1.5).as_of(now).unix_milliseconds(),
            8_500
        );
        assert_eq!(Served::primary(None).as_of(now), now);
    }
}

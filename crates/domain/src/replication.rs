//! Replication's vocabulary: the consistency token a write answer carries, who served a
//! display read, and when a replica is in the read rotation.
//!
//! Seed 002 §六.2: a read that must see a write is served by a replica only when the
//! replica has replayed past the write ("基于复制位点或版本号判断副本是否已经追上主库"),
//! otherwise by the primary; never by waiting a fixed time.

use std::fmt;
use std::str::FromStr;

use crate::error::ParseError;

/// How far the writer had got when an answer was made: on PostgreSQL a WAL position
/// (`pg_current_wal_lsn()` read after the commit), written as PostgreSQL writes an LSN
/// (`16/B374D848`: the high and low 32 bits in hexadecimal). A replica whose replay
/// position is at or past the token has every write the answer reported.
///
/// Backends stockd does not replicate (SQLite, MySQL) answer [`ConsistencyToken::ORIGIN`]:
/// every display read there is served by the writer, which is past every token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsistencyToken(u64);

/// Longest token text accepted: two 8-digit halves and the slash.
const TOKEN_LENGTH_MAX: usize = 17;

impl ConsistencyToken {
    /// The start of the log: every reader has replayed past it.
    pub const ORIGIN: ConsistencyToken = ConsistencyToken(0);

    pub const fn from_position(position: u64) -> ConsistencyToken {
        ConsistencyToken(position)
    }

    pub const fn position(self) -> u64 {
        self.0
    }

    /// Parses PostgreSQL's `HIGH/LOW` notation.
    pub fn parse(text: &str) -> Result<ConsistencyToken, ParseError> {
        let invalid = || {
            ParseError::new(format!(
                "a consistency token is a log position like '16/B374D848' (got '{}')",
                text.chars().take(TOKEN_LENGTH_MAX + 3).collect::<String>()
            ))
        };
        if text.len() > TOKEN_LENGTH_MAX {
            return Err(invalid());
        }
        let (high, low) = text.split_once('/').ok_or_else(invalid)?;
        let half = |part: &str| {
            if part.is_empty() || part.len() > 8 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid());
            }
            u32::from_str_radix(part, 16).map_err(|_| invalid())
        };
        Ok(ConsistencyToken(
            (u64::from(half(high)?) << 32) | u64::from(half(low)?),
        ))
    }

    /// Whether a reader that has replayed up to `replayed` has everything this token
    /// names.
    pub fn is_reached_by(self, replayed: ConsistencyToken) -> bool {
        replayed >= self
    }
}

impl fmt::Display for ConsistencyToken {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl FromStr for ConsistencyToken {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<ConsistencyToken, ParseError> {
        ConsistencyToken::parse(text)
    }
}

/// Who answered a display read (`Stockd-Served-By`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedBy {
    Primary,
    Replica,
}

impl ServedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            ServedBy::Primary => "primary",
            ServedBy::Replica => "replica",
        }
    }
}

/// Why a display read that could have gone to a replica went to the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No replica is configured, or none is in the rotation.
    NoReplicaInRotation,
    /// The replica had not replayed past the request's token.
    BehindToken,
    /// The replica could not be reached, or its read failed (a conflict with
    /// recovery, say).
    ReplicaFailed,
    /// The connection the read port gave is not a replica (mid-failover).
    NotInRecovery,
}

impl Fallback {
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoReplicaInRotation => "no_replica_in_rotation",
            Fallback::BehindToken => "behind_token",
            Fallback::ReplicaFailed => "replica_failed",
            Fallback::NotInRecovery => "not_in_recovery",
        }
    }
}

/// One sample of a replica's lag, or why none could be taken.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LagSample {
    Measured {
        seconds: f64,
        bytes: u64,
    },
    /// The replica did not answer, or is not replaying (promoted, say).
    Unhealthy,
}

/// Samples in a row below half the bound before a replica that left the rotation
/// returns to it: a replica hovering at the bound does not flap in and out.
pub const ROTATION_RETURN_SAMPLES: u32 = 3;

/// Whether a replica serves display reads, with hysteresis: it leaves the rotation as
/// soon as one sample is above `lag_seconds_max` (or unhealthy), and returns only
/// after [`ROTATION_RETURN_SAMPLES`] samples in a row at or below half the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    In,
    /// Out, with the count of good samples seen since.
    Out {
        good_samples: u32,
    },
}

impl Rotation {
    /// A new replica waits for its first good samples before it serves.
    pub const fn new() -> Rotation {
        Rotation::Out { good_samples: 0 }
    }

    pub fn is_in(self) -> bool {
        self == Rotation::In
    }

    /// The rotation after one more sample.
    pub fn after(self, sample: LagSample, lag_seconds_max: f64) -> Rotation {
        let seconds = match sample {
            LagSample::Measured { seconds, .. } => seconds,
            LagSample::Unhealthy => return Rotation::Out { good_samples: 0 },
        };
        match self {
            Rotation::In if seconds > lag_seconds_max => Rotation::Out { good_samples: 0 },
            Rotation::In => Rotation::In,
            Rotation::Out { good_samples } if seconds <= lag_seconds_max / 2.0 => {
                if good_samples + 1 >= ROTATION_RETURN_SAMPLES {
                    Rotation::In
                } else {
                    Rotation::Out {
                        good_samples: good_samples + 1,
                    }
                }
            }
            Rotation::Out { .. } => Rotation::Out { good_samples: 0 },
        }
    }

    /// A read on the replica failed: out until it samples well again.
    pub fn after_failure(self) -> Rotation {
        Rotation::Out { good_samples: 0 }
    }
}

impl Default for Rotation {
    fn default() -> Rotation {
        Rotation::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_reads_and_writes_postgres_log_positions() {
        let token = ConsistencyToken::parse("16/B374D848").unwrap();
        assert_eq!(token.position(), (0x16 << 32) | 0xB374_D848);
        assert_eq!(token.to_string(), "16/B374D848");
        assert_eq!(
            ConsistencyToken::parse("0/0").unwrap(),
            ConsistencyToken::ORIGIN
        );
        assert_eq!(ConsistencyToken::ORIGIN.to_string(), "0/0");
        assert_eq!(
            ConsistencyToken::parse("ffffffff/FFFFFFFF")
                .unwrap()
                .position(),
            u64::MAX
        );
    }

    #[test]
    fn a_malformed_token_is_refused() {
        for text in [
            "",
            "/",
            "1/",
            "/1",
            "1",
            "1/2/3",
            "g/1",
            "1/-1",
            "+1/1",
            " 1/1",
            "1/1 ",
            "123456789/1",
            "1/123456789",
            "0x1/1",
        ] {
            assert!(ConsistencyToken::parse(text).is_err(), "{text:?} accepted");
        }
    }

    #[test]
    fn tokens_compare_as_log_positions_not_as_text() {
        let earlier = ConsistencyToken::parse("0/FFFFFFFF").unwrap();
        let later = ConsistencyToken::parse("1/0").unwrap();
        assert!(earlier < later);
        assert!(earlier.is_reached_by(later));
        assert!(!later.is_reached_by(earlier));
        assert!(later.is_reached_by(later), "replayed exactly to the token");
        assert!(ConsistencyToken::ORIGIN.is_reached_by(ConsistencyToken::ORIGIN));
    }

    fn measured(seconds: f64) -> LagSample {
        LagSample::Measured { seconds, bytes: 0 }
    }

    #[test]
    fn a_new_replica_serves_only_after_enough_good_samples() {
        let mut rotation = Rotation::new();
        for _ in 1..ROTATION_RETURN_SAMPLES {
            rotation = rotation.after(measured(0.0), 5.0);
            assert!(!rotation.is_in());
        }
        assert!(rotation.after(measured(0.0), 5.0).is_in());
    }

    #[test]
    fn a_replica_above_the_bound_leaves_at_once_and_returns_with_hysteresis() {
        let rotation = Rotation::In.after(measured(5.1), 5.0);
        assert_eq!(rotation, Rotation::Out { good_samples: 0 });
        // At the bound but above half of it: not good enough to come back.
        assert_eq!(
            rotation.after(measured(4.0), 5.0),
            Rotation::Out { good_samples: 0 }
        );
        // A bad sample in between starts the count again.
        let almost = rotation.after(measured(1.0), 5.0).after(measured(1.0), 5.0);
        assert_eq!(
            almost.after(measured(3.0), 5.0),
            Rotation::Out { good_samples: 0 }
        );
        assert!(almost.after(measured(2.5), 5.0).is_in());
        // In rotation, a lag up to the bound keeps it there.
        assert!(Rotation::In.after(measured(5.0), 5.0).is_in());
    }

    #[test]
    fn an_unhealthy_sample_or_a_failed_read_takes_a_replica_out() {
        assert_eq!(
            Rotation::In.after(LagSample::Unhealthy, 5.0),
            Rotation::Out { good_samples: 0 }
        );
        assert_eq!(
            Rotation::Out { good_samples: 2 }.after(LagSample::Unhealthy, 5.0),
            Rotation::Out { good_samples: 0 }
        );
        assert_eq!(
            Rotation::In.after_failure(),
            Rotation::Out { good_samples: 0 }
        );
    }
}

//! PostgreSQL's replicas: which one serves a display read, how far behind each one is,
//! and the writer's log position that answers to writes carry as consistency tokens.
//!
//! A replica is reached only through [`ReplicaSet::begin_on`], which the backend's
//! `begin_display` calls with a display read's handle. The writer's health never
//! depends on a replica: replica pools connect lazily, and a replica that fails is
//! taken out of the rotation while reads go to the primary.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use domain::{ConsistencyToken, Fallback, LagSample, Rotation};
use sqlx::postgres::PgConnectOptions;
use sqlx::{PgPool, Postgres};
use tokio::sync::watch;

use crate::error::StoreError;
use crate::replicas::{ReplicaConfig, ReplicaHealth, Served};

/// Parses a PostgreSQL LSN as `pg_current_wal_lsn()::text` writes it.
pub(crate) fn position(text: &str) -> Result<ConsistencyToken, StoreError> {
    ConsistencyToken::parse(text)
        .map_err(|error| StoreError::Database(format!("an unreadable log position: {error}")))
}

#[derive(Debug)]
struct Member {
    /// The URL without its password.
    name: String,
    pool: PgPool,
    state: Mutex<MemberState>,
}

#[derive(Debug, Default, Clone, Copy)]
struct MemberState {
    rotation: Rotation,
    lag_seconds: Option<f64>,
    lag_bytes: Option<u64>,
    lag_seconds_peak: f64,
    /// When the writer's position was read for the last sample that found the replica
    /// caught up: whatever it lacks now was committed after that.
    caught_up_at: Option<std::time::Instant>,
    /// Times a failed read took the replica out of the rotation since the last sample
    /// (counted with that sample's own moves).
    left_after_failure: u64,
}

impl Member {
    fn state(&self) -> MemberState {
        *self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn update(&self, change: impl FnOnce(&mut MemberState)) -> MemberState {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        change(&mut state);
        *state
    }
}

/// The configured replicas, each with its own pool and rotation.
#[derive(Debug)]
pub(crate) struct ReplicaSet {
    members: Vec<Member>,
    next: AtomicUsize,
    lag_seconds_max: f64,
    /// Longest wait for a replica's answer ([`ReplicaConfig::answer_timeout_milliseconds`]).
    answer_timeout: Duration,
    /// Longest wait for a replica's connection (the pool's own bound).
    acquire_timeout: Duration,
}

impl ReplicaSet {
    /// Pools for every replica URL, connected lazily: a replica that is down when stockd
    /// starts delays nothing.
    pub fn connect(
        config: &ReplicaConfig,
        pool_size: u32,
        options_of: impl Fn(&str) -> Result<PgConnectOptions, StoreError>,
    ) -> Result<ReplicaSet, StoreError> {
        let mut members = Vec::with_capacity(config.urls.len());
        for url in &config.urls {
            let options = options_of(url)?
                .application_name("stockd-replica")
                .options([("default_transaction_read_only", "on")]);
            let pool = crate::backend::pool_options()
                .max_connections(pool_size.max(1))
                .acquire_timeout(Duration::from_millis(config.acquire_timeout_milliseconds))
                .connect_lazy_with(options);
            members.push(Member {
                name: domain::redact_url(url),
                pool,
                state: Mutex::new(MemberState::default()),
            });
        }
        Ok(ReplicaSet {
            members,
            next: AtomicUsize::new(0),
            lag_seconds_max: config.lag_seconds_max,
            answer_timeout: Duration::from_millis(config.answer_timeout_milliseconds.max(1)),
            acquire_timeout: Duration::from_millis(config.acquire_timeout_milliseconds),
        })
    }

    /// No replicas.
    pub fn none() -> ReplicaSet {
        ReplicaSet {
            members: Vec::new(),
            next: AtomicUsize::new(0),
            lag_seconds_max: 0.0,
            answer_timeout: Duration::from_millis(1),
            acquire_timeout: Duration::from_millis(1),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The next replica in the rotation, round robin.
    pub fn pick(&self) -> Option<usize> {
        let count = self.members.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..count)
            .map(|offset| (start + offset) % count.max(1))
            .find(|&index| self.members[index].state().rotation.is_in())
    }

    /// A read-only transaction on replica `index`, when it can serve a read carrying
    /// `token`; otherwise why not, and nothing is held.
    pub async fn begin_on(
        &self,
        index: usize,
        token: Option<ConsistencyToken>,
    ) -> Result<(sqlx::Transaction<'static, Postgres>, Served), Fallback> {
        // Bounded: a replica that stopped answering must not hold the read (it would
        // answer only when the request's own bound cut it, with the replica still in
        // the rotation for every read after it). The bound leaves a new connection
        // the pool's own time to open (a distant replica needs several round trips).
        let bound = self.acquire_timeout + self.answer_timeout;
        match tokio::time::timeout(bound, self.checked_begin(index, token)).await {
            Ok(outcome) => outcome,
            Err(_) => {
                let error = StoreError::Unavailable(format!("no answer within {bound:?}"));
                self.failed(index, &error);
                Err(Fallback::ReplicaFailed)
            }
        }
    }

    async fn checked_begin(
        &self,
        index: usize,
        token: Option<ConsistencyToken>,
    ) -> Result<(sqlx::Transaction<'static, Postgres>, Served), Fallback> {
        let member = &self.members[index];
        let mut transaction = match member.pool.begin().await {
            Ok(transaction) => transaction,
            Err(error) => {
                self.failed(index, &StoreError::from(error));
                return Err(Fallback::ReplicaFailed);
            }
        };
        if let Some(token) = token {
            // On the connection the read will use: behind a read port, each connection
            // may reach another replica.
            let replayed: Result<Option<String>, sqlx::Error> =
                sqlx::query_scalar("SELECT pg_last_wal_replay_lsn()::text")
                    .fetch_one(&mut *transaction)
                    .await;
            let verdict = match replayed {
                Err(error) => {
                    self.failed(index, &StoreError::from(error));
                    Err(Fallback::ReplicaFailed)
                }
                Ok(None) => Err(Fallback::NotInRecovery),
                Ok(Some(replayed)) => match position(&replayed) {
                    Ok(replayed) if token.is_reached_by(replayed) => Ok(()),
                    Ok(_) => Err(Fallback::BehindToken),
                    Err(_) => Err(Fallback::ReplicaFailed),
                },
            };
            if let Err(fallback) = verdict {
                let _ = transaction.rollback().await;
                return Err(fallback);
            }
        }
        let lag_seconds = member.state().lag_seconds.unwrap_or(0.0);
        Ok((transaction, Served::replica(index, lag_seconds)))
    }

    /// A read on replica `index` failed: it leaves the rotation until it samples well.
    pub fn failed(&self, index: usize, error: &StoreError) {
        let member = &self.members[index];
        let mut was_in = false;
        member.update(|state| {
            was_in = state.rotation.is_in();
            state.rotation = state.rotation.after_failure();
            if was_in {
                state.left_after_failure += 1;
            }
        });
        if was_in {
            tracing::warn!(replica = %member.name, %error, "replica left the read rotation after a failed read");
        }
    }

    /// Samples every replica's lag against the writer's position and moves each into
    /// or out of the rotation. One step of the replica monitor.
    pub async fn sample(&self, writer: &PgPool) -> Vec<ReplicaHealth> {
        let asked_writer_at = std::time::Instant::now();
        let writer_position: Option<ConsistencyToken> = tokio::time::timeout(
            self.answer_timeout,
            sqlx::query_scalar::<_, String>("SELECT pg_current_wal_lsn()::text").fetch_one(writer),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .and_then(|text| position(&text).ok());
        // All at once, each bounded: one replica that does not answer must neither
        // stay in the rotation nor hold up the others' samples.
        let samples = futures_util::future::join_all(
            self.members
                .iter()
                .map(|member| sample_member(member, writer_position, self.answer_timeout)),
        )
        .await;
        let answered_at = std::time::Instant::now();
        let mut health = Vec::with_capacity(self.members.len());
        for (member, sample) in self.members.iter().zip(samples) {
            let mut was_in = false;
            let mut left_after_failure = 0;
            let after = member.update(|state| {
                left_after_failure = std::mem::take(&mut state.left_after_failure);
                was_in = state.rotation.is_in();
                let sample = bounded_by_last_caught_up(
                    sample,
                    &mut state.caught_up_at,
                    writer_position.is_some().then_some(asked_writer_at),
                    answered_at,
                );
                state.rotation = state.rotation.after(sample, self.lag_seconds_max);
                (state.lag_seconds, state.lag_bytes) = match sample {
                    LagSample::Measured { seconds, bytes } => (Some(seconds), Some(bytes)),
                    LagSample::Unhealthy => (None, None),
                };
                state.lag_seconds_peak =
                    state.lag_seconds_peak.max(state.lag_seconds.unwrap_or(0.0));
            });
            let rotation_changed = was_in != after.rotation.is_in();
            if rotation_changed {
                tracing::warn!(
                    replica = %member.name,
                    in_rotation = after.rotation.is_in(),
                    lag_seconds = ?after.lag_seconds,
                    lag_seconds_max = self.lag_seconds_max,
                    "replica rotation changed"
                );
            }
            health.push(ReplicaHealth {
                name: member.name.clone(),
                lag_seconds: after.lag_seconds,
                lag_bytes: after.lag_bytes,
                lag_seconds_peak: after.lag_seconds_peak,
                in_rotation: after.rotation.is_in(),
                rotation_changes: left_after_failure + u64::from(rotation_changed),
            });
        }
        health
    }

    pub async fn close(&self) {
        for member in &self.members {
            member.pool.close().await;
        }
    }
}

/// One replica's lag: bytes behind the writer's position, and seconds since the last
/// transaction it replayed unless it has replayed everything the writer had. A
/// connection is waited for within the pool's bound, its answer within
/// `answer_timeout`; no answer counts as unhealthy.
async fn sample_member(
    member: &Member,
    writer_position: Option<ConsistencyToken>,
    answer_timeout: Duration,
) -> LagSample {
    let Ok(mut connection) = member.pool.acquire().await else {
        return LagSample::Unhealthy;
    };
    let asked = tokio::time::timeout(
        answer_timeout,
        sqlx::query_as::<_, (bool, Option<String>, Option<i64>)>(
            "SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text, \
             (EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp()) * 1000)::bigint",
        )
        .fetch_one(&mut *connection),
    )
    .await;
    let row = match asked {
        Ok(row) => row,
        Err(_) => {
            // Its state is unknown mid-query: closed, not handed to the next caller.
            connection.close_on_drop();
            return LagSample::Unhealthy;
        }
    };
    let Ok((true, Some(replayed), replay_age_milliseconds)) = row else {
        return LagSample::Unhealthy;
    };
    let Ok(replayed) = position(&replayed) else {
        return LagSample::Unhealthy;
    };
    lag_of(writer_position, replayed, replay_age_milliseconds)
}

/// A replica's lag from what it answered: caught up with the writer, none; behind it,
/// the age of the last transaction it replayed. Behind with no such transaction (a
/// standby restarted that has replayed nothing since, and may not be streaming at
/// all: `pg_last_xact_replay_timestamp()` is NULL) its lag is unknown: unhealthy, not
/// 0 s behind.
fn lag_of(
    writer_position: Option<ConsistencyToken>,
    replayed: ConsistencyToken,
    replay_age_milliseconds: Option<i64>,
) -> LagSample {
    let bytes = writer_position
        .map(|writer| writer.position().saturating_sub(replayed.position()))
        .unwrap_or(0);
    let caught_up = writer_position.is_some_and(|writer| writer.is_reached_by(replayed));
    let seconds = match (caught_up, replay_age_milliseconds) {
        (true, _) => 0.0,
        (false, Some(age)) => age.max(0) as f64 / 1000.0,
        (false, None) => return LagSample::Unhealthy,
    };
    LagSample::Measured { seconds, bytes }
}

/// A replica behind the writer lacks only what was committed since the last sample
/// that found it caught up (`caught_up_at`, when that sample read the writer's
/// position), so its lag is at most the time since then. The age of the last
/// transaction it replayed alone overstates it after a quiet spell: one commit after
/// ten idle minutes, sampled before the replica replays it, read as ten minutes behind
/// and took the replica out of the rotation. A caught-up sample (with the writer's
/// position known, `writer_asked_at`) sets the mark; an unhealthy one leaves it.
fn bounded_by_last_caught_up(
    sample: LagSample,
    caught_up_at: &mut Option<std::time::Instant>,
    writer_asked_at: Option<std::time::Instant>,
    now: std::time::Instant,
) -> LagSample {
    match sample {
        LagSample::Measured { bytes: 0, .. } => {
            if writer_asked_at.is_some() {
                *caught_up_at = writer_asked_at;
            }
            sample
        }
        LagSample::Measured { seconds, bytes } => LagSample::Measured {
            seconds: caught_up_at.map_or(seconds, |since| {
                seconds.min(now.saturating_duration_since(since).as_secs_f64())
            }),
            bytes,
        },
        LagSample::Unhealthy => sample,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found in review: a failed read took a replica out of the rotation (and said so
    /// at WARN), but `stockd_replica_rotation_changes_total` counted only the monitor's
    /// own moves, so the next sample found it out already and the leaving went
    /// uncounted. Nothing listens on port 1: every read and sample fails at once.
    #[tokio::test]
    async fn a_replica_a_failed_read_took_out_counts_one_move_at_the_next_sample() {
        let nowhere = "postgres://stockd@127.0.0.1:1/stockd";
        let config = crate::replicas::ReplicaConfig {
            urls: vec![nowhere.to_owned()],
            acquire_timeout_milliseconds: 500,
            answer_timeout_milliseconds: 500,
            ..crate::replicas::ReplicaConfig::default()
        };
        let set = ReplicaSet::connect(&config, 1, |url| {
            url.parse::<PgConnectOptions>()
                .map_err(|error| StoreError::Database(error.to_string()))
        })
        .unwrap();
        set.members[0].update(|state| state.rotation = Rotation::In);
        let writer = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(500))
            .connect_lazy(nowhere)
            .unwrap();

        set.failed(0, &StoreError::Unavailable("the read failed".to_owned()));
        let first = set.sample(&writer).await;
        let second = set.sample(&writer).await;

        assert!(!first[0].in_rotation);
        assert_eq!(first[0].rotation_changes, 1, "the failed read's move");
        assert_eq!(second[0].rotation_changes, 0, "counted once");
    }

    #[test]
    fn a_replica_behind_after_a_quiet_spell_lags_no_longer_than_since_it_was_caught_up() {
        let start = std::time::Instant::now();
        let half_a_second_later = start + Duration::from_millis(500);
        let mut caught_up_at = None;
        let caught_up = LagSample::Measured {
            seconds: 0.0,
            bytes: 0,
        };
        // The last transaction it replayed is ten minutes old: the writer was idle.
        let behind = LagSample::Measured {
            seconds: 600.0,
            bytes: 120,
        };

        let never_caught_up =
            bounded_by_last_caught_up(behind, &mut caught_up_at, Some(start), start);
        bounded_by_last_caught_up(caught_up, &mut caught_up_at, Some(start), start);
        let after = bounded_by_last_caught_up(behind, &mut caught_up_at, None, half_a_second_later);

        assert_eq!(never_caught_up, behind, "no mark yet: the replay's age");
        assert_eq!(
            after,
            LagSample::Measured {
                seconds: 0.5,
                bytes: 120
            }
        );
        let stuck = bounded_by_last_caught_up(
            LagSample::Measured {
                seconds: 2.0,
                bytes: 120,
            },
            &mut caught_up_at,
            None,
            start + Duration::from_secs(60),
        );
        assert_eq!(
            stuck,
            LagSample::Measured {
                seconds: 2.0,
                bytes: 120
            },
            "a replica replaying recent transactions keeps their age"
        );
    }

    fn at(position: u64) -> ConsistencyToken {
        ConsistencyToken::from_position(position)
    }

    #[test]
    fn a_replica_behind_the_writer_that_replayed_nothing_since_it_started_is_unhealthy() {
        assert_eq!(lag_of(Some(at(200)), at(100), None), LagSample::Unhealthy);
        assert_eq!(
            lag_of(Some(at(200)), at(100), Some(1_500)),
            LagSample::Measured {
                seconds: 1.5,
                bytes: 100
            }
        );
    }

    #[test]
    fn a_replica_caught_up_with_the_writer_has_no_lag_whatever_it_last_replayed() {
        for age in [None, Some(3_600_000)] {
            assert_eq!(
                lag_of(Some(at(200)), at(200), age),
                LagSample::Measured {
                    seconds: 0.0,
                    bytes: 0
                }
            );
        }
    }
}

/// The writer's log position after a commit, read once for every caller waiting at
/// the same time: a caller needs a read that *starts* after its commit finished, so it
/// waits for the next read to start (or starts it) rather than take one in flight.
/// Under load this is one round trip per round trip, not one per answer.
#[derive(Debug, Clone)]
pub(crate) struct WriterPosition {
    inner: Arc<PositionInner>,
}

#[derive(Debug)]
struct PositionInner {
    state: Mutex<PositionState>,
    published: watch::Sender<Published>,
}

#[derive(Debug, Default)]
struct PositionState {
    /// The number of the last read started.
    started: u64,
    /// A read is running; `wanted` asks it to start another when it ends.
    running: bool,
    wanted: bool,
}

#[derive(Debug, Clone)]
struct Published {
    read: u64,
    position: Result<ConsistencyToken, StoreError>,
}

impl WriterPosition {
    pub fn new() -> WriterPosition {
        let (published, _) = watch::channel(Published {
            read: 0,
            position: Ok(ConsistencyToken::ORIGIN),
        });
        WriterPosition {
            inner: Arc::new(PositionInner {
                state: Mutex::new(PositionState::default()),
                published,
            }),
        }
    }

    /// A position at or past every commit that finished before this call.
    pub async fn after_commit(&self, writer: &PgPool) -> Result<ConsistencyToken, StoreError> {
        let mut receiver = self.inner.published.subscribe();
        let (needed, start) = {
            let mut state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
            let needed = state.started + 1;
            let start = !state.running;
            if start {
                state.running = true;
                state.started = needed;
            } else {
                state.wanted = true;
            }
            (needed, start)
        };
        if start {
            // A task of its own, so a caller that goes away never strands the others.
            tokio::spawn(read_positions(self.inner.clone(), writer.clone(), needed));
        }
        let published = receiver
            .wait_for(|published| published.read >= needed)
            .await
            .map_err(|_| StoreError::Unavailable("the writer position reader stopped".into()))?;
        published.position.clone()
    }
}

/// Reads the writer's position, then again while callers arrived during the read.
async fn read_positions(inner: Arc<PositionInner>, writer: PgPool, mut read: u64) {
    loop {
        let position = sqlx::query_scalar::<_, String>("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&writer)
            .await
            .map_err(StoreError::from)
            .and_then(|text| position(&text));
        inner.published.send_replace(Published { read, position });
        let mut state = inner.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.wanted {
            state.wanted = false;
            state.started += 1;
            read = state.started;
        } else {
            state.running = false;
            return;
        }
    }
}

//! The hot-SKU combiner: concurrent reservations queue up per shard, and one task per
//! shard drains the queue into batches that the store applies in one transaction and
//! one durable commit (group commit).
//!
//! A request lands in the shard of its first SKU (in lock order), so every request for
//! a hot SKU meets the others in one queue. Batching is adaptive without any timer:
//! while a batch is in the database, new requests wait in the queue, and the next batch
//! takes all of them (up to the bound). Under light load a request finds the shard idle
//! and goes alone, with no added latency. Queues are bounded: a full queue answers at
//! once (backpressure) instead of letting waits grow without limit.
//!
//! Each request in a batch still succeeds or fails on its own, in arrival order, with
//! its own idempotency record, reservation and ledger rows; the database row stays the
//! oversell boundary, so several stockd processes on one database stay correct.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use domain::{ConsistencyToken, WarehouseCode};
use futures_util::FutureExt;
use store::{Idempotent, LockTurn, ReserveRequest, ResponseRenderer, Store, StoreError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::retry::{skus_of, with_retries_on};

/// Why the combiner did not take a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The shard's queue is full.
    QueueFull,
    /// The combiner is shutting down.
    Stopped,
}

struct Job {
    request: ReserveRequest,
    enqueued: Instant,
    reply: oneshot::Sender<Answer>,
}

/// One queue, and its depth gauge's handle, shared with the shard's task.
struct Shard {
    sender: mpsc::Sender<Job>,
    queue_depth: Arc<QueueDepth>,
}

/// A shard's `stockd_combiner_queue_depth` handle, set by the submitting side and the
/// shard's task alike: registered at first use rather than looked up by label at each
/// (a registry lookup and a label string per reservation), and not at start, so a
/// combiner started before the recorder still reports.
struct QueueDepth {
    shard: usize,
    gauge: OnceLock<metrics::Gauge>,
}

impl QueueDepth {
    fn set(&self, depth: usize) {
        self.gauge
            .get_or_init(|| {
                metrics::gauge!("stockd_combiner_queue_depth", "shard" => self.shard.to_string())
            })
            .set(depth as f64);
    }
}

/// A request's outcome, with the writer's position after its batch committed (the
/// answer's consistency token: read once per batch, not once per request).
pub(crate) struct Answer {
    pub outcome: Result<Idempotent, StoreError>,
    pub position: Option<ConsistencyToken>,
}

#[derive(Clone)]
pub struct Combiner {
    shards: Arc<Vec<Shard>>,
    /// The pool of the combiner's own (PostgreSQL), kept here for the pool gauges.
    own_pool: Option<Store>,
}

/// What a shard needs to run batches.
struct ShardContext {
    shard: usize,
    queue_depth: Arc<QueueDepth>,
    store: Store,
    clock: Arc<dyn Clock>,
    renderer: Arc<dyn ResponseRenderer>,
    config: EngineConfig,
}

impl Combiner {
    /// Starts one task per shard. On PostgreSQL they run on a thread and runtime of
    /// the combiner's own, with connections of its own (one per batch that may be in
    /// flight, and one for the position read after a batch of the transaction path,
    /// so the next batch does not wait for it): a batch then hears the database's answer as soon as it comes, where
    /// the server's runtime notices a socket's readiness only between its ready tasks,
    /// of which a loaded server has hundreds (docs/BENCHMARKS.md). Elsewhere they run
    /// on the caller's runtime and share its pool: a socket belongs to the runtime that
    /// opened it, so a shared pool's connections stay with the server's. The tasks
    /// stop, and the thread with them, when every `Combiner` clone is dropped.
    pub fn start(
        store: Store,
        clock: Arc<dyn Clock>,
        renderer: Arc<dyn ResponseRenderer>,
        config: &EngineConfig,
    ) -> Combiner {
        let shard_count = config.combiner_shards.max(1);
        let connections = shard_count * config.combiner_batches_in_flight.max(1) + 1;
        let own_pool = store.with_own_pool(u32::try_from(connections).unwrap_or(u32::MAX));
        let own_thread = own_pool.is_some();
        let gauged_pool = own_pool.clone();
        let mut shards = Vec::with_capacity(shard_count);
        let mut tasks = Vec::with_capacity(shard_count);
        for shard in 0..shard_count {
            let (sender, receiver) = mpsc::channel(config.combiner_queue_depth_max.max(1));
            let queue_depth = Arc::new(QueueDepth {
                shard,
                gauge: OnceLock::new(),
            });
            let context = ShardContext {
                shard,
                queue_depth: Arc::clone(&queue_depth),
                store: own_pool.clone().unwrap_or_else(|| store.clone()),
                clock: Arc::clone(&clock),
                renderer: Arc::clone(&renderer),
                config: config.clone(),
            };
            tasks.push(run_shard(receiver, context));
            shards.push(Shard {
                sender,
                queue_depth,
            });
        }
        let all_shards = async move {
            if let Some(own_pool) = &own_pool {
                // Open a connection now, on this runtime, so the first batch (a flash
                // sale's first, say) does not wait for it. A database that is down
                // now is met again, and answered, by that batch.
                if let Err(error) = own_pool.ping().await {
                    tracing::warn!(%error, "the combiner's connection could not be opened yet");
                }
            }
            let mut running = tokio::task::JoinSet::new();
            for task in tasks {
                running.spawn(task);
            }
            while running.join_next().await.is_some() {}
            if let Some(own_pool) = own_pool {
                own_pool.close().await;
            }
        };
        let own_runtime = if own_thread {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|error| {
                    tracing::warn!(%error, "the combiner runs on the server's runtime: it cannot have its own");
                })
                .ok()
        } else {
            None
        };
        match own_runtime {
            Some(runtime) => {
                let spawned = std::thread::Builder::new()
                    .name("stockd-combiner".into())
                    .spawn(move || runtime.block_on(all_shards));
                if let Err(error) = spawned {
                    // Its queues are closed with it: reservations answer that the
                    // combiner stopped, and the failure is in the log.
                    tracing::error!(%error, "cannot start the combiner's thread");
                }
            }
            None => {
                tokio::spawn(all_shards);
            }
        }
        Combiner {
            shards: Arc::new(shards),
            own_pool: gauged_pool,
        }
    }

    /// The connections of the combiner's own pool, when it has one (PostgreSQL). Its
    /// waits and acquire timeouts are counted with the store's: the two pools share
    /// one watch.
    pub fn own_pool_usage(&self) -> Option<store::backend::PoolUsage> {
        self.own_pool.as_ref().map(Store::pool_usage)
    }

    fn shard_of(&self, request: &ReserveRequest) -> usize {
        let first = request
            .lines
            .iter()
            .map(|line| (&line.sku, &line.warehouse))
            .min();
        let mut hasher = DefaultHasher::new();
        first.hash(&mut hasher);
        (hasher.finish() % self.shards.len() as u64) as usize
    }

    /// Reservations waiting in the queues (not yet taken into a batch).
    pub fn queued(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.sender.max_capacity() - shard.sender.capacity())
            .sum()
    }

    /// Queues `request` and waits for its batch to commit.
    pub(crate) async fn submit(&self, request: ReserveRequest) -> Result<Answer, Refusal> {
        let shard = self.shard_of(&request);
        let (reply, answer) = oneshot::channel();
        let job = Job {
            request,
            enqueued: Instant::now(),
            reply,
        };
        let Shard {
            sender,
            queue_depth,
        } = &self.shards[shard];
        match sender.try_send(job) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                metrics::counter!("stockd_combiner_rejected_total", "reason" => "queue_full")
                    .increment(1);
                return Err(Refusal::QueueFull);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(Refusal::Stopped),
        }
        queue_depth.set(sender.max_capacity() - sender.capacity());
        answer.await.map_err(|_| Refusal::Stopped)
    }
}

/// Drains the shard's queue into batches. Up to `combiner_batches_in_flight` batches
/// run at once, and a batch takes its row locks only after the one before it holds
/// its own ([`LockTurn`]), so requests are still decided in arrival order while the
/// next batch's preparation overlaps the current batch's commit.
async fn run_shard(mut receiver: mpsc::Receiver<Job>, context: ShardContext) {
    let context = Arc::new(context);
    let batch_size_max = context.config.combiner_batch_size_max.max(1);
    let batches_in_flight_max = context.config.combiner_batches_in_flight.max(1);
    let in_flight = Arc::new(Semaphore::new(batches_in_flight_max));
    let mut previous_locked: Option<oneshot::Receiver<()>> = None;
    loop {
        // Wait for a free slot before taking requests, so requests that arrive while
        // the slots are busy gather into the next batch.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            break;
        };
        let mut jobs: Vec<Job> = Vec::with_capacity(batch_size_max);
        if receiver.recv_many(&mut jobs, batch_size_max).await == 0 {
            break;
        }
        let started = Instant::now();
        metrics::histogram!("stockd_combiner_batch_size").record(jobs.len() as f64);
        // One registry lookup per batch, not one per request.
        let wait_seconds = metrics::histogram!("stockd_combiner_wait_seconds");
        for job in &jobs {
            wait_seconds.record(started.duration_since(job.enqueued).as_secs_f64());
        }
        context.queue_depth.set(receiver.len());
        let (locked, next_after) = oneshot::channel();
        let turn = LockTurn {
            after: previous_locked.replace(next_after),
            locked: Some(locked),
        };
        let batch = run_batch(Arc::clone(&context), jobs, turn, permit);
        if batches_in_flight_max == 1 {
            // Nothing could overlap this batch: the loop would only wait for its
            // permit. Running it here saves a hand-off to a spawned task (often to the
            // other worker thread), which a lone request's latency pays in full. A
            // panic ends only this batch, as it would in a task of its own: its
            // callers hear that the combiner stopped, and the shard goes on.
            if AssertUnwindSafe(batch).catch_unwind().await.is_err() {
                tracing::error!(shard = context.shard, "a reservation batch panicked");
            }
        } else {
            tokio::spawn(batch);
        }
    }
}

/// Runs one batch and answers its requests; the permit is its slot among the batches
/// in flight.
async fn run_batch(
    context: Arc<ShardContext>,
    jobs: Vec<Job>,
    turn: LockTurn,
    permit: OwnedSemaphorePermit,
) {
    let (requests, replies): (Vec<ReserveRequest>, Vec<_>) =
        jobs.into_iter().map(|job| (job.request, job.reply)).unzip();
    let (outcomes, committed_at) = execute(&context, &requests, turn).await;
    drop(permit);
    let wrote = outcomes.iter().any(Result::is_ok);
    let answer = move |position: Option<ConsistencyToken>| {
        for (reply, outcome) in replies.into_iter().zip(outcomes) {
            // A caller that went away still had its effect stored; its retry replays it.
            let _ = reply.send(Answer { outcome, position });
        }
    };
    // At or past the commit: read with it (PostgreSQL's one round trip), or else read
    // after it, in a task of its own so the queue's next batch need not wait for that
    // read (PostgreSQL's transaction path); a batch that wrote nothing needs none.
    match committed_at {
        Some(position) => answer(Some(position)),
        None if wrote => {
            let store = context.store.clone();
            tokio::spawn(async move { answer(store.consistency_token().await.ok()) });
        }
        None => answer(None),
    }
}

/// Runs a batch (with retries); one outcome per request, and the writer's position
/// after the commit when the store read it with the commit.
async fn execute(
    context: &ShardContext,
    requests: &[ReserveRequest],
    turn: LockTurn,
) -> (
    Vec<Result<Idempotent, StoreError>>,
    Option<ConsistencyToken>,
) {
    let renderer = context.renderer.as_ref();
    // The first attempt takes the turn; a retry (rare) locks without waiting.
    let turn = tokio::sync::Mutex::new(turn);
    let lines: Vec<_> = requests
        .iter()
        .flat_map(|request| request.lines.iter().cloned())
        .collect();
    let skus = skus_of(&lines);
    let batch = with_retries_on(&context.config, "reserve", &skus, || async {
        let mut turn = turn.lock().await;
        context
            .store
            .reserve_batch(requests, context.clock.now(), renderer, &mut turn)
            .await
    })
    .await;
    // Whatever happened, the next batch may lock now.
    turn.into_inner().pass();
    match batch {
        Ok(applied) => {
            metrics::counter!("stockd_combiner_batches_total", "path" => applied.path.as_str())
                .increment(1);
            (
                applied.outcomes.into_iter().map(Ok).collect(),
                applied.position,
            )
        }
        // One key of the batch is held by another process's open transaction (only
        // possible across processes), or one of its rows by another transaction past
        // the lock bound (a long shelf or campaign transaction, a console session).
        // Run the requests one by one so only those wait and answer
        // `request_in_progress` or `lock_timeout`; the others are decided. A request
        // naming a stock row found locked answers `lock_timeout` at once, so the batch
        // waits out the bound about once per locked row, not once per request
        // ([`LockedRows`]). So too for an error of one request's rows (a row damaged
        // by hand, a constraint it breaks): it fails that request alone, not every
        // request batched with it, batch after batch. A database out of reach fails
        // them all at once, without a try each.
        Err(
            StoreError::KeyInFlight
            | StoreError::LockTimeout(_)
            | StoreError::Invariant(_)
            | StoreError::Database(_),
        ) if requests.len() > 1 => {
            let mut outcomes = Vec::with_capacity(requests.len());
            let mut locked = LockedRows {
                whole_database: context.store.locks_whole_database(),
                ..LockedRows::default()
            };
            for request in requests {
                if let Some(line) = locked.condemns(request) {
                    outcomes.push(Err(StoreError::LockTimeout(format!(
                        "sku '{}' in warehouse '{}' stayed locked past the bound for a request before this one",
                        line.sku, line.warehouse
                    ))));
                    continue;
                }
                let single = std::slice::from_ref(request);
                let skus = skus_of(&request.lines);
                let outcome = with_retries_on(&context.config, "reserve", &skus, || async {
                    let mut free = LockTurn::free();
                    context
                        .store
                        .reserve_batch(single, context.clock.now(), renderer, &mut free)
                        .await
                })
                .await
                .and_then(|mut applied| {
                    applied.outcomes.pop().ok_or_else(|| {
                        StoreError::Invariant("a batch of one returned nothing".into())
                    })
                });
                locked.learn(request, &outcome);
                outcomes.push(outcome);
            }
            (outcomes, None)
        }
        Err(error) => (requests.iter().map(|_| Err(error.clone())).collect(), None),
    }
}

/// What a batch's one-by-one run learnt of which stock rows stay locked past the bound.
/// A request that locked only its stock rows (one row, no shopper's tallies, no order
/// number) and timed out proves that row locked. One of several rows that timed out
/// may have waited on any of them: a row is taken as locked after two such timeouts
/// naming it, unless a request decided meanwhile took its lock (then it was free). So
/// an innocent row is not condemned for its neighbour, and a locked one costs the
/// batch at most two waits. Where a write lock is the whole database's (SQLite: another
/// process, `stockd migrate` or a shell holding it), one timeout says every row is
/// locked, so it condemns every request after it: the batch waits once, not once per
/// request.
#[derive(Default)]
struct LockedRows<'a> {
    whole_database: bool,
    /// A request timed out on a database locked whole.
    everything: bool,
    condemned: std::collections::HashSet<(&'a domain::SkuCode, &'a WarehouseCode)>,
    suspected: std::collections::HashMap<(&'a domain::SkuCode, &'a WarehouseCode), u32>,
    taken: std::collections::HashSet<(&'a domain::SkuCode, &'a WarehouseCode)>,
}

/// Timeouts of requests of several rows naming a row before it is taken as locked.
const SUSPECTED_TIMEOUTS_TO_CONDEMN: u32 = 2;

impl<'a> LockedRows<'a> {
    /// The first line of `request` on a row taken as locked, if any.
    fn condemns(&self, request: &'a ReserveRequest) -> Option<&'a domain::ReservationLine> {
        request
            .lines
            .iter()
            .find(|line| self.everything || self.condemned.contains(&(&line.sku, &line.warehouse)))
    }

    fn learn(&mut self, request: &'a ReserveRequest, outcome: &Result<Idempotent, StoreError>) {
        let rows = request
            .lines
            .iter()
            .map(|line| (&line.sku, &line.warehouse));
        match outcome {
            // Decided under its locks: every row it names was free then.
            Ok(Idempotent::Executed(_)) => self.taken.extend(rows),
            Err(StoreError::LockTimeout(_)) if self.whole_database => self.everything = true,
            Err(StoreError::LockTimeout(_)) => {
                let only_stock_rows = request.user.is_none() && request.reference.is_empty();
                match request.lines.as_slice() {
                    [line] if only_stock_rows => {
                        self.condemned.insert((&line.sku, &line.warehouse));
                    }
                    _ => {
                        for row in rows {
                            let count = self.suspected.entry(row).or_insert(0);
                            *count += 1;
                            if *count >= SUSPECTED_TIMEOUTS_TO_CONDEMN && !self.taken.contains(&row)
                            {
                                self.condemned.insert(row);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use domain::{
        IdempotencyKey, Principal, Quantity, ReservationId, ReservationLine, SkuCode, Timestamp,
        UserId,
    };
    use store::{IdempotencyClaim, ScopedKey, ShopScope, StoredResponse};

    fn request(rows: &[(&str, &str)], user: Option<&str>) -> ReserveRequest {
        ReserveRequest {
            claim: IdempotencyClaim {
                key: ScopedKey::new(&Principal::Admin, &IdempotencyKey::parse("k").unwrap()),
                fingerprint: String::new(),
            },
            id: ReservationId::generate(Timestamp::from_unix_milliseconds(0), 1),
            lines: rows
                .iter()
                .map(|(sku, warehouse)| ReservationLine {
                    sku: SkuCode::parse(sku).unwrap(),
                    warehouse: WarehouseCode::parse(warehouse).unwrap(),
                    quantity: Quantity::new(1).unwrap(),
                })
                .collect(),
            ttl_seconds: 60,
            shop: ShopScope::Any,
            user: user.map(|user| UserId::parse(user).unwrap()),
            reference: domain::OrderReference::default(),
            undecided_when_short: false,
        }
    }

    fn timed_out() -> Result<Idempotent, StoreError> {
        Err(StoreError::LockTimeout("waited".into()))
    }

    fn decided() -> Result<Idempotent, StoreError> {
        Ok(Idempotent::Executed(StoredResponse {
            status: 201,
            body: String::new(),
        }))
    }

    #[test]
    fn a_request_of_one_stock_row_that_timed_out_condemns_that_row_only() {
        let locked_alone = request(&[("A", "default")], None);
        let same_row = request(&[("B", "default"), ("A", "default")], None);
        let other_warehouse = request(&[("A", "north")], None);
        let mut locked = LockedRows::default();

        locked.learn(&locked_alone, &timed_out());

        assert!(locked.condemns(&same_row).is_some());
        assert!(locked.condemns(&other_warehouse).is_none());
    }

    #[test]
    fn on_a_database_locked_whole_one_timeout_condemns_every_later_request() {
        let first = request(&[("A", "default")], Some("ann"));
        let other_row = request(&[("B", "north")], None);
        let mut locked = LockedRows {
            whole_database: true,
            ..LockedRows::default()
        };

        let before = locked.condemns(&other_row).is_some();
        locked.learn(&first, &timed_out());

        assert!(!before, "nothing is condemned before a timeout");
        assert!(
            locked.condemns(&other_row).is_some(),
            "SQLite's write lock is the database's: every row waits on it"
        );
    }

    #[test]
    fn a_request_that_may_have_waited_on_a_shoppers_tally_condemns_nothing_at_once() {
        let with_a_shopper = request(&[("A", "default")], Some("ann"));
        let mut locked = LockedRows::default();

        locked.learn(&with_a_shopper, &timed_out());

        assert!(
            locked
                .condemns(&request(&[("A", "default")], None))
                .is_none()
        );
    }

    #[test]
    fn two_timeouts_of_several_rows_condemn_a_row_no_decided_request_took() {
        let both = request(&[("A", "default"), ("B", "default")], None);
        let b_alone = request(&[("B", "default")], None);
        let a_alone = request(&[("A", "default")], None);
        let mut locked = LockedRows::default();

        locked.learn(&both, &timed_out());
        let after_one = (
            locked.condemns(&a_alone).is_some(),
            locked.condemns(&b_alone).is_some(),
        );
        locked.learn(&b_alone, &decided());
        locked.learn(&both, &timed_out());

        assert_eq!(
            after_one,
            (false, false),
            "one timeout of two rows proves nothing"
        );
        assert!(locked.condemns(&a_alone).is_some(), "A timed out twice");
        assert!(locked.condemns(&b_alone).is_none(), "B was taken meanwhile");
    }
}

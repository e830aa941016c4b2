//! The sold-out answer from memory: what this process found short, and for how many
//! units, so that the next requests for as many are refused without a database round
//! trip for a bounded time (`sold_out_recheck_milliseconds`).
//!
//! Two users: a campaign's buckets (`campaigns::CampaignRoute`) and lines outside any
//! campaign ([`ShortLines`], a SKU in a warehouse). Memory only ever says no: a
//! finding removes a request from the database's path, it never adds a unit, so the
//! worst it does is a false "sold out" for at most the bound.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

use domain::{ErrorCode, ReservationLine, SkuCode, Timestamp, WarehouseCode};
use store::IdempotencyClaim;

use crate::{Engine, EngineError};

/// What one stock row was last found short for: when, and the units the request asked
/// for that it could not give (so it holds fewer). One word, so that a reader never
/// mixes the time of one finding with the units of another; 0 is no finding.
#[derive(Debug, Default)]
pub(crate) struct ShortFinding(AtomicU64);

/// Low bits of a [`ShortFinding`]'s word: the units. A request for more is not
/// recorded (it proves little about smaller ones, and the memory answer is only a
/// shortcut); the high 44 bits hold milliseconds since the epoch, which fit until
/// the year 2527.
const FINDING_UNITS_BITS: u32 = 20;
const FINDING_UNITS_MASK: u64 = (1 << FINDING_UNITS_BITS) - 1;

impl ShortFinding {
    /// The row held fewer than `units` at `now`. The latest finding replaces the one
    /// before: stock only changed since.
    pub(crate) fn record(&self, now: Timestamp, units: i64) {
        let (Ok(at), Ok(units)) = (
            u64::try_from(now.unix_milliseconds().max(1)),
            u64::try_from(units),
        ) else {
            return;
        };
        if units == 0 || units > FINDING_UNITS_MASK || at >> (64 - FINDING_UNITS_BITS) != 0 {
            return;
        }
        self.0
            .store((at << FINDING_UNITS_BITS) | units, Ordering::SeqCst);
    }

    pub(crate) fn clear(&self) {
        self.0.store(0, Ordering::SeqCst);
    }

    /// Whether a request for `units` would find the row short, by a finding of the
    /// last `recheck_milliseconds`.
    pub(crate) fn refuses(&self, units: i64, now: Timestamp, recheck_milliseconds: i64) -> bool {
        let word = self.0.load(Ordering::SeqCst);
        if word == 0 {
            return false;
        }
        let at = i64::try_from(word >> FINDING_UNITS_BITS).unwrap_or(i64::MAX);
        let fewest = i64::try_from(word & FINDING_UNITS_MASK).unwrap_or(i64::MAX);
        is_fresh(at, now, recheck_milliseconds) && units >= fewest
    }
}

/// Whether a finding made at `at` (milliseconds since the epoch) is still trusted at
/// `now`: younger than `recheck_milliseconds`, and not in the future (a clock that
/// stepped back puts `now` before the finding, and must not stretch the bound).
pub(crate) fn is_fresh(at: i64, now: Timestamp, recheck_milliseconds: i64) -> bool {
    let age = now.unix_milliseconds().saturating_sub(at);
    (0..recheck_milliseconds).contains(&age)
}

/// SKUs (in a warehouse) with a finding, at most; past this the memory starts again
/// (forgetting only costs database answers).
pub const SHORT_LINES_REMEMBERED_MAX: usize = 100_000;

/// Keys this process sent to the database, at most (oldest dropped first, per
/// shard). About 6 MiB; at 30,000 requests a second, the last eight seconds' keys.
pub const KEYS_SENT_REMEMBERED_MAX: usize = 262_144;

/// The remembered keys are split over this many locks, by hash, so that concurrent
/// requests rarely wait for each other to note theirs.
const KEYS_SENT_SHARDS: usize = 16;

/// What this process found short outside campaigns: for a SKU in a warehouse, when and
/// for how many units a request with that line alone was refused `insufficient_stock`.
/// Cleared for a line by a hold taken on it here, and wholly by anything this process
/// does that can give stock back (a release, an expiry, a cancel, a return, a
/// receive); what another instance gives back is seen within the bound.
#[derive(Debug, Default)]
pub(crate) struct ShortLines {
    by_sku: RwLock<HashMap<SkuCode, Vec<(WarehouseCode, ShortFinding)>>>,
    /// Findings held now: at 0 (nearly always, outside a sale) a request takes no lock.
    held: AtomicUsize,
    /// Times this process did something that can give stock back: a refusal decided
    /// before one of them is not recorded after it.
    changes: AtomicU64,
    sent: [Mutex<SentKeys>; KEYS_SENT_SHARDS],
    /// `stockd_sold_out_from_memory_total`, registered at its first answer.
    sold_out_from_memory: OnceLock<metrics::Counter>,
}

type FindingsBySku = HashMap<SkuCode, Vec<(WarehouseCode, ShortFinding)>>;

/// The finding of `line`'s row, if one is held.
fn finding_of<'findings>(
    findings: &'findings FindingsBySku,
    line: &ReservationLine,
) -> Option<&'findings ShortFinding> {
    findings.get(&line.sku).and_then(|rows| {
        rows.iter()
            .find(|(warehouse, _)| warehouse == &line.warehouse)
            .map(|(_, finding)| finding)
    })
}

/// The keys sent to the database from here (one shard's), by a 64-bit hash: a
/// collision only sends a request to the database, which answers it right.
#[derive(Debug, Default)]
struct SentKeys {
    keys: HashSet<u64>,
    order: VecDeque<u64>,
}

fn key_hash(key: &str) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    key.hash(&mut hasher);
    hasher.finish()
}

impl ShortLines {
    fn findings(&self) -> std::sync::RwLockReadGuard<'_, FindingsBySku> {
        self.by_sku
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn findings_mut(&self) -> std::sync::RwLockWriteGuard<'_, FindingsBySku> {
        self.by_sku
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The first of `lines` that this process found short for as many units or fewer
    /// within the last `recheck_milliseconds`.
    pub(crate) fn refusing<'lines>(
        &self,
        lines: &'lines [ReservationLine],
        now: Timestamp,
        recheck_milliseconds: i64,
    ) -> Option<&'lines ReservationLine> {
        if self.held.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let findings = self.findings();
        lines.iter().find(|line| {
            finding_of(&findings, line).is_some_and(|finding| {
                finding.refuses(line.quantity.get(), now, recheck_milliseconds)
            })
        })
    }

    /// The returns seen so far: taken before a request is decided, and handed to
    /// [`ShortLines::record`] with its refusal.
    pub(crate) fn changes_seen(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// `line`'s row held fewer than its units at `now`, by a decision made when
    /// `changes_seen` returns had been seen: not recorded when another came since
    /// (it may have been after the decision, and the finding stale).
    ///
    /// Why no return is missed (every atomic here is sequentially consistent): a
    /// return is counted before `held` is read and the findings cleared under the
    /// write lock. A new finding is counted in `held` before the count of returns is
    /// checked, under the write lock: either the check sees the return, or the clear
    /// sees the finding and waits for the lock. A finding updated in place is checked
    /// and written under the read lock, which the clear waits for.
    ///
    /// A hold taken here does not count: it only lowers stock, so a refusal decided
    /// before it is still true after it, unless another instance gave stock back in
    /// between, which this process learns within the bound in any case. (Counting
    /// holds would drop nearly every finding of a shop selling many SKUs at once.)
    pub(crate) fn record(&self, line: &ReservationLine, now: Timestamp, changes_seen: u64) {
        let units = line.quantity.get();
        {
            let findings = self.findings();
            if let Some(finding) = finding_of(&findings, line) {
                if self.changes_seen() == changes_seen {
                    finding.record(now, units);
                }
                return;
            }
        }
        let mut findings = self.findings_mut();
        if self.held.load(Ordering::SeqCst) >= SHORT_LINES_REMEMBERED_MAX {
            findings.clear();
            self.held.store(0, Ordering::SeqCst);
        }
        self.held.fetch_add(1, Ordering::SeqCst);
        let stale = self.changes_seen() != changes_seen;
        if stale || finding_of(&findings, line).is_some() {
            // Stale, or written by another request since the read above (then this
            // finding only replaces it when fresh).
            self.held.fetch_sub(1, Ordering::SeqCst);
            if !stale && let Some(finding) = finding_of(&findings, line) {
                finding.record(now, units);
            }
            return;
        }
        let finding = ShortFinding::default();
        finding.record(now, units);
        findings
            .entry(line.sku.clone())
            .or_default()
            .push((line.warehouse.clone(), finding));
    }

    /// A hold was taken on `lines` here: there was stock for it, so what was found
    /// short of them may be stale (another instance may have given stock back).
    pub(crate) fn clear_lines(&self, lines: &[ReservationLine]) {
        if self.held.load(Ordering::SeqCst) == 0 {
            return;
        }
        let findings = self.findings();
        for line in lines {
            if let Some(finding) = finding_of(&findings, line) {
                finding.clear();
            }
        }
    }

    /// Stock may have come back to any row (a return here): every finding is stale,
    /// and so is a refusal decided before now and not recorded yet.
    pub(crate) fn forget(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        if self.held.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut findings = self.findings_mut();
        findings.clear();
        self.held.store(0, Ordering::SeqCst);
    }

    fn sent(&self, hash: u64) -> std::sync::MutexGuard<'_, SentKeys> {
        // The hash's top bits choose the shard (its low bits place it in the set).
        let shard = (hash >> 60) as usize % KEYS_SENT_SHARDS;
        self.sent[shard]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `key` is being sent to the database, which may store an answer under it: a
    /// retry of it goes to the database too, which replays that answer byte for byte,
    /// whatever memory found since.
    pub(crate) fn note_sent(&self, key: &str) {
        let hash = key_hash(key);
        let mut sent = self.sent(hash);
        if sent.keys.insert(hash) {
            sent.order.push_back(hash);
            if sent.order.len() > KEYS_SENT_REMEMBERED_MAX / KEYS_SENT_SHARDS
                && let Some(oldest) = sent.order.pop_front()
            {
                sent.keys.remove(&oldest);
            }
        }
    }

    pub(crate) fn sent_from_here(&self, key: &str) -> bool {
        let hash = key_hash(key);
        self.sent(hash).keys.contains(&hash)
    }
}

/// Whether an answer is the database's `insufficient_stock`.
pub(crate) fn is_insufficient_stock(response: &store::StoredResponse) -> bool {
    response.status == 409 && response.body.contains("\"code\":\"insufficient_stock\"")
}

/// Whether memory may refuse a request, or only the database may answer it. Not a
/// queued command: its answer must be stored under its key, where a redelivery finds
/// it. Not a request that names an `order_ref`: the database answers a reused one
/// `order_ref_reused` before anything else, and a caller retrying under a new key
/// after a lost answer needs that, not "sold out". (Other answers the database gives
/// before the stock's, a SKU gone off the shelf or a missing `user_id`, are only
/// another "no", at most the bound late.)
pub(crate) fn memory_may_refuse(claim: &IdempotencyClaim, names_order_ref: bool) -> bool {
    !names_order_ref && !claim.key.is_queue_intake()
}

/// Held by a path that can give stock back: when it ends, answered, failed or dropped
/// with its caller (a commit may have happened whatever the caller heard), this
/// process's findings are forgotten, unless the path said it gave nothing back.
pub(crate) struct StockMayComeBack<'engine> {
    memory: &'engine ShortLines,
    armed: bool,
}

impl StockMayComeBack<'_> {
    /// The path ended having given no stock back (a worker step that found nothing
    /// due, a duplicate webhook): the findings stand.
    pub(crate) fn nothing_given_back(mut self) {
        self.armed = false;
    }
}

impl Drop for StockMayComeBack<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.memory.forget();
        }
    }
}

impl Engine {
    /// Runs `attempt`, the database's decision on a request whose lines are outside
    /// any campaign, unless this process found one of its lines short for as many
    /// units within the re-check bound and memory may answer the request
    /// ([`Engine::memory_may_answer`]): that request is refused `insufficient_stock`
    /// without the database (and not stored under its key, so a retry after the bound
    /// asks again). Learns from the answer: a refusal for stock of a request with one
    /// line is that line's; a hold clears its lines' findings.
    pub(crate) async fn unless_known_short<Attempt, Decided>(
        &self,
        claim: &IdempotencyClaim,
        lines: &[ReservationLine],
        memory_may_refuse: bool,
        attempt: Attempt,
    ) -> Result<store::Idempotent, EngineError>
    where
        Attempt: FnOnce() -> Decided,
        Decided: std::future::Future<Output = Result<store::Idempotent, EngineError>>,
    {
        let memory = &self.inner.short_lines;
        let recheck = self.inner.config.sold_out_recheck_milliseconds;
        if let Some(line) = memory.refusing(lines, self.now(), recheck)
            && self.memory_may_refuse_now(claim, memory_may_refuse).await
        {
            memory
                .sold_out_from_memory
                .get_or_init(|| metrics::counter!("stockd_sold_out_from_memory_total"))
                .increment(1);
            return Err(EngineError::Refused {
                code: ErrorCode::InsufficientStock,
                detail: format!(
                    "sku '{}' has fewer than {} units available in warehouse '{}' (this instance found it so within the last {recheck} ms; not recorded under the key)",
                    line.sku,
                    line.quantity.get(),
                    line.warehouse
                ),
            });
        }
        self.note_sent(claim, memory_may_refuse);
        let changes_seen = memory.changes_seen();
        // A finding is dated when its request went to the database: stock given back
        // while it waited (elsewhere, unseen here) is then not outlived by the
        // answer's latency beyond the re-check bound.
        let sent_at = self.now();
        let decided = attempt().await?;
        if let store::Idempotent::Executed(response) = &decided {
            if response.status == 201 {
                memory.clear_lines(lines);
            } else if lines.len() == 1 && is_insufficient_stock(response) {
                // With other lines the refusal may be theirs; a replayed one may be old.
                memory.record(&lines[0], sent_at, changes_seen);
            }
        }
        Ok(decided)
    }

    /// Whether memory may answer this request now: it is of a kind memory may refuse
    /// ([`memory_may_refuse`]), its key was not sent to the database from here (then
    /// the key may hold an answer, and only the database knows which), and no request
    /// under it waits in a campaign's line (which may yet store one).
    pub(crate) fn memory_may_answer(
        &self,
        claim: &IdempotencyClaim,
        memory_may_refuse: bool,
    ) -> bool {
        memory_may_refuse
            && !self.inner.short_lines.sent_from_here(claim.key.as_str())
            && !self
                .inner
                .campaigns
                .waiting_keys
                .contains(claim.key.as_str())
    }

    /// Whether memory refuses this request now: memory may answer it
    /// ([`Engine::memory_may_answer`]), and its key holds no answer in the database
    /// (sent there from another instance, or from this one before a restart or past
    /// the bound of keys remembered): a retry of a request answered 201 hears its 201.
    /// Asked through the key probe, with the other requests memory refuses meanwhile;
    /// when that cannot be known, memory does not answer.
    pub(crate) async fn memory_may_refuse_now(
        &self,
        claim: &IdempotencyClaim,
        memory_may_refuse: bool,
    ) -> bool {
        self.memory_may_answer(claim, memory_may_refuse)
            && crate::cold(self.inner.key_probe.holds_answer(claim.key.as_str())).await
                == Some(false)
    }

    /// Notes a request's key as it is sent to the database: once it was, the key may
    /// hold an answer (even if this caller goes away or hears an error). A request
    /// memory never refuses needs no note.
    pub(crate) fn note_sent(&self, claim: &IdempotencyClaim, memory_may_refuse: bool) {
        if memory_may_refuse {
            self.inner.short_lines.note_sent(claim.key.as_str());
        }
    }

    /// For a path that can give stock back (a release, a cancel, a return, a movement,
    /// a payment, a webhook, a worker step): keep it until the path ends.
    pub(crate) fn stock_may_come_back(&self) -> StockMayComeBack<'_> {
        StockMayComeBack {
            memory: &self.inner.short_lines,
            armed: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use domain::Quantity;

    fn line(sku: &str, warehouse: &str, units: i64) -> ReservationLine {
        ReservationLine {
            sku: SkuCode::parse(sku).expect("a valid sku"),
            warehouse: WarehouseCode::parse(warehouse).expect("a valid warehouse"),
            quantity: Quantity::new(units).expect("a valid quantity"),
        }
    }

    fn at(milliseconds: i64) -> Timestamp {
        Timestamp::from_unix_milliseconds(milliseconds)
    }

    #[test]
    fn a_line_found_short_refuses_as_many_units_or_more_within_the_bound_only() {
        let memory = ShortLines::default();
        memory.record(&line("TV-55", "main", 3), at(1_000_000), 0);
        let refuses = |units, now| {
            memory
                .refusing(&[line("TV-55", "main", units)], at(now), 1_000)
                .is_some()
        };
        assert!(refuses(3, 1_000_000));
        assert!(refuses(4, 1_000_999));
        assert!(!refuses(2, 1_000_500), "fewer units still ask");
        assert!(
            !refuses(3, 1_001_000),
            "past the bound the database is asked"
        );
        assert!(
            !refuses(3, 999_999),
            "a clock stepped back does not stretch it"
        );
        assert!(
            memory
                .refusing(&[line("TV-55", "east", 3)], at(1_000_000), 1_000)
                .is_none(),
            "another warehouse's row is another row"
        );
    }

    #[test]
    fn a_hold_clears_its_lines_and_a_return_clears_every_finding() {
        let memory = ShortLines::default();
        let seen = memory.changes_seen();
        memory.record(&line("TV-55", "main", 1), at(1_000_000), seen);
        memory.record(&line("PHONE", "main", 1), at(1_000_000), seen);
        memory.clear_lines(&[line("TV-55", "main", 1)]);
        let now = at(1_000_001);
        assert!(
            memory
                .refusing(&[line("TV-55", "main", 1)], now, 1_000)
                .is_none()
        );
        assert!(
            memory
                .refusing(&[line("PHONE", "main", 1)], now, 1_000)
                .is_some()
        );
        memory.forget();
        assert!(
            memory
                .refusing(&[line("PHONE", "main", 1)], now, 1_000)
                .is_none()
        );
        assert_eq!(memory.held.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_refusal_decided_before_a_return_here_is_not_recorded_after_it_but_one_before_a_hold_is() {
        let memory = ShortLines::default();
        let now = at(1_000_000);
        let lamp = line("LAMP", "main", 1);
        let refused = |memory: &ShortLines| {
            memory
                .refusing(std::slice::from_ref(&lamp), now, 1_000)
                .is_some()
        };
        // A new finding, then one that would replace a held finding in place.
        let seen = memory.changes_seen();
        memory.forget();
        memory.record(&lamp, now, seen);
        assert!(!refused(&memory));
        let five = line("LAMP", "main", 5);
        memory.record(&five, now, memory.changes_seen());
        memory.record(&lamp, now, seen);
        assert!(!refused(&memory), "only the finding for 5 units stands");
        assert!(memory.refusing(&[five], now, 1_000).is_some());
        // A hold only lowers stock: the refusal before it is still true.
        let seen = memory.changes_seen();
        memory.clear_lines(&[line("LAMP", "main", 1)]);
        memory.record(&lamp, now, seen);
        assert!(refused(&memory));
    }

    #[test]
    fn keys_sent_are_remembered_up_to_their_bound_oldest_forgotten_first() {
        let memory = ShortLines::default();
        memory.note_sent("key-0");
        assert!(memory.sent_from_here("key-0"));
        assert!(!memory.sent_from_here("key-1"));
        // Twice the bound: key-0's shard receives about twice its share, whatever the
        // hash spread (a shard's count strays by a few hundred from 32,768).
        let noted = 2 * KEYS_SENT_REMEMBERED_MAX;
        for index in 1..=noted {
            memory.note_sent(&format!("key-{index}"));
        }
        assert!(!memory.sent_from_here("key-0"));
        assert!(memory.sent_from_here(&format!("key-{noted}")));
        let kept: usize = memory
            .sent
            .iter()
            .map(|shard| shard.lock().unwrap().order.len())
            .sum();
        assert_eq!(kept, KEYS_SENT_REMEMBERED_MAX);
    }
}

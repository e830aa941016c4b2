//! The reservation batch: the combiner's group commit. Claims every key, locks the
//! stock rows in the global order, decides which requests fit (`domain::plan`) and
//! writes the accepted ones through the backend's batch writer.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::invariant;
use super::idempotency::resolve_existing;
use super::reservations::new_reservation;
use super::tallies::{add_to_tallies, lock_tallies};
use crate::backend::{Backend, Dialect, Finish, FoundRecords, LockedStock, NewReservation};
use crate::error::StoreError;
use crate::model::{
    BatchApplied, BatchPath, IdempotencyClaim, Idempotent, LockTurn, Rejection, ReserveRequest,
    ResponseRenderer, ShopScope, StoredResponse,
};
use crate::plan::{
    BatchWritten, PlanRequest, SkuFacts, StockKey, Tallies, WholeBatch, plan_batch,
    totals_if_all_accepted,
};
use crate::sql::statement;
use domain::{ErrorCode, ShopCode, SkuCode, Timestamp};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Where a request of a reservation batch stands.
pub(crate) enum BatchSlot {
    /// Answered without deciding: a replayed or reused key.
    Decided(Idempotent),
    /// The same key and body as the earlier request at this index: its answer.
    SameAs(usize),
    /// The first request of its key: decided by this batch.
    Claimed,
}

/// One outcome per request, in order, from the slots and the claimed requests' responses.
/// A repeated key gets its first request's outcome: the same replay or refusal, or, when
/// the first one ran now, a replay of its response.
pub(crate) fn batch_outcomes(
    slots: Vec<BatchSlot>,
    responses: &[Option<StoredResponse>],
) -> Result<Vec<Idempotent>, StoreError> {
    let mut outcomes: Vec<Idempotent> = Vec::with_capacity(slots.len());
    for (index, slot) in slots.into_iter().enumerate() {
        let outcome = match slot {
            BatchSlot::Decided(outcome) => outcome,
            BatchSlot::Claimed => responses[index]
                .clone()
                .map(Idempotent::Executed)
                .ok_or_else(|| invariant("a claimed request has no response"))?,
            BatchSlot::SameAs(first) => match outcomes.get(first) {
                Some(Idempotent::Executed(response)) => Idempotent::Replayed(response.clone()),
                Some(earlier) => earlier.clone(),
                None => return Err(invariant("a repeated key before its first request")),
            },
        };
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// `skus` completed with the SKUs of `wanted` that have no stock row yet (or none in
/// that warehouse): they still need their facts, to tell `not_found` from
/// `insufficient_stock`.
pub(crate) async fn with_unlisted_skus<C: Dialect>(
    transaction: &mut C,
    wanted: &[StockKey],
    mut skus: HashMap<SkuCode, SkuFacts>,
) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
    let mut unlisted: Vec<&SkuCode> = wanted
        .iter()
        .map(|(sku, _)| sku)
        .filter(|sku| !skus.contains_key(*sku))
        .collect();
    unlisted.dedup();
    if !unlisted.is_empty() {
        skus.extend(transaction.sku_facts(&unlisted).await?);
    }
    Ok(skus)
}

/// Most campaigns whose per-user limit one process keeps (a shop runs a handful at a
/// time; past the bound the whole memory is dropped and read again as needed).
const CAMPAIGN_LIMITS_KNOWN_MAX: usize = 4_096;

/// The per-user limits of the campaigns this process has read, by campaign code. A
/// campaign's limit never changes once it exists (an early end moves only its times),
/// so a limit read once stays true, and
/// a flash sale's batches save the statement (a round trip under the bucket's lock).
#[derive(Debug, Default)]
pub(crate) struct CampaignLimits {
    known: std::sync::Mutex<HashMap<domain::campaign::CampaignCode, Option<i64>>>,
}

impl CampaignLimits {
    fn known(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<domain::campaign::CampaignCode, Option<i64>>> {
        self.known
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn get(&self, code: &domain::campaign::CampaignCode) -> Option<Option<i64>> {
        self.known().get(code).copied()
    }

    fn insert(&self, code: domain::campaign::CampaignCode, per_user_limit: Option<i64>) {
        let mut known = self.known();
        if known.len() >= CAMPAIGN_LIMITS_KNOWN_MAX {
            known.clear();
        }
        known.insert(code, per_user_limit);
    }
}

/// `skus` completed with the facts of the campaigns whose buckets `wanted` names, each
/// under its campaign's tally code: the SKU's sale status and shop, and the campaign's
/// per-user limit, which a bucket's line counts against instead of the SKU's
/// ([`domain::plan::limit_of`]). The limit is read once per process (`limits`): a
/// campaign's limit never changes once it exists.
pub(crate) async fn with_campaign_facts<C: Dialect>(
    transaction: &mut C,
    wanted: &[StockKey],
    mut skus: HashMap<SkuCode, SkuFacts>,
    limits: &CampaignLimits,
) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
    for (sku, warehouse) in wanted {
        let Some((code, _)) = domain::campaign::bucket_of(warehouse) else {
            continue;
        };
        let tally = code.tally_sku();
        if skus.contains_key(&tally) {
            continue;
        }
        let Some(facts) = skus.get(sku).cloned() else {
            continue;
        };
        let per_user_limit = match limits.get(&code) {
            Some(known) => known,
            None => {
                let limit: Option<Option<i64>> =
                    statement("SELECT per_user_limit FROM campaign WHERE code = $1")
                        .bind(code.as_str())
                        .fetch_optional_scalar(&mut *transaction)
                        .await?;
                let Some(per_user_limit) = limit else {
                    return Err(invariant(format!(
                        "stock row ({sku}, {warehouse}) names a campaign that does not exist"
                    )));
                };
                limits.insert(code, per_user_limit);
                per_user_limit
            }
        };
        skus.insert(
            tally,
            SkuFacts {
                per_user_limit,
                ..facts
            },
        );
    }
    Ok(skus)
}

/// Step 1 of a batch: the first request of each key, and each request's slot.
pub(crate) fn slots_by_key(requests: &[ReserveRequest]) -> (HashMap<&str, usize>, Vec<BatchSlot>) {
    let mut first_of_key: HashMap<&str, usize> = HashMap::with_capacity(requests.len());
    let mut slots = Vec::with_capacity(requests.len());
    for (index, request) in requests.iter().enumerate() {
        let key = request.claim.key.as_str();
        match first_of_key.get(key) {
            Some(first) if requests[*first].claim.fingerprint == request.claim.fingerprint => {
                slots.push(BatchSlot::SameAs(*first));
            }
            Some(_) => slots.push(BatchSlot::Decided(Idempotent::KeyReused)),
            None => {
                first_of_key.insert(key, index);
                slots.push(BatchSlot::Claimed);
            }
        }
    }
    (first_of_key, slots)
}

/// Decides the claimed requests whose keys already have a committed record: replayed,
/// or refused as reused when the fingerprint differs.
pub(crate) async fn replay_committed_keys<C: Dialect>(
    transaction: &mut C,
    requests: &[ReserveRequest],
    first_of_key: &HashMap<&str, usize>,
    slots: &mut [BatchSlot],
) -> Result<(), StoreError> {
    let existing = transaction.existing_records(&keys_of(first_of_key)).await?;
    replay_existing(requests, &existing, slots)
}

/// The batch's distinct idempotency keys.
fn keys_of<'a>(first_of_key: &HashMap<&'a str, usize>) -> Vec<&'a str> {
    first_of_key.keys().copied().collect()
}

/// Decides the claimed requests whose keys have one of these committed records.
fn replay_existing(
    requests: &[ReserveRequest],
    existing: &FoundRecords,
    slots: &mut [BatchSlot],
) -> Result<(), StoreError> {
    for (index, request) in requests.iter().enumerate() {
        if let (BatchSlot::Claimed, Some((fingerprint, response))) =
            (&slots[index], existing.get(request.claim.key.as_str()))
        {
            slots[index] = BatchSlot::Decided(resolve_existing(
                &request.claim,
                fingerprint,
                response.clone(),
            )?);
        }
    }
    Ok(())
}

/// The stock rows these requests' lines name, in the global (sku, warehouse) order.
fn stock_rows_of<'a>(requests: impl Iterator<Item = &'a ReserveRequest>) -> Vec<StockKey> {
    let mut wanted: Vec<StockKey> = requests
        .flat_map(|request| request.lines.iter())
        .map(|line| (line.sku.clone(), line.warehouse.clone()))
        .collect();
    wanted.sort();
    wanted.dedup();
    wanted
}

/// Renders each claimed request's answer from its decision (a success whose shop was
/// verified only now is rendered again with it); answers the accepted requests with
/// their shops.
pub(crate) fn answer_decided<'a>(
    requests: &'a [ReserveRequest],
    claimed: &[usize],
    decisions: &'a [Result<ShopCode, Rejection>],
    responses: &mut [Option<StoredResponse>],
    renderer: &dyn ResponseRenderer,
    now: Timestamp,
) -> Vec<(&'a ReserveRequest, &'a ShopCode)> {
    let mut accepted = Vec::new();
    for (index, decided) in claimed.iter().zip(decisions) {
        match decided {
            Ok(shop) => {
                let request = &requests[*index];
                if !matches!(request.shop, ShopScope::Verified(_)) {
                    responses[*index] = Some(renderer.reservation_created(&new_reservation(
                        request,
                        Some(shop),
                        now,
                    )));
                }
                accepted.push((request, shop));
            }
            Err(rejection) => responses[*index] = Some(renderer.rejected(rejection)),
        }
    }
    accepted
}

/// The claimed requests whose order number is taken by a committed request (with
/// another key: a request with the same key was replayed before this point); within
/// the batch, `plan_batch` gives a number to the first request accepted with it. A
/// request's shop is its first SKU's (a request across shops is refused anyway).
pub(crate) async fn order_refs_taken<C: Dialect>(
    connection: &mut C,
    requests: &[ReserveRequest],
    claimed: &[usize],
    skus: &HashMap<SkuCode, SkuFacts>,
) -> Result<HashSet<usize>, StoreError> {
    let mut taken = HashSet::new();
    for index in claimed {
        let request = &requests[*index];
        let (Some(order_ref), Some(facts)) = (
            request.reference.order_ref.as_ref(),
            request.lines.first().and_then(|line| skus.get(&line.sku)),
        ) else {
            continue;
        };
        // Two requests of this batch with one number: `plan_batch` gives it to the
        // first that is accepted, not merely the first.
        if order_ref_exists(connection, facts.shop.as_str(), order_ref).await? {
            taken.insert(*index);
        }
    }
    Ok(taken)
}

/// Whether a committed reservation or order of `shop` carries `order_ref`.
pub(crate) async fn order_ref_exists<C: Dialect>(
    connection: &mut C,
    shop: &str,
    order_ref: &domain::OrderRef,
) -> Result<bool, StoreError> {
    Ok(
        statement("SELECT reservation_id FROM order_reference WHERE shop = $1 AND order_ref = $2")
            .bind(shop)
            .bind(order_ref.as_str())
            .fetch_optional_row(&mut *connection)
            .await?
            .is_some(),
    )
}

/// Records an accepted reservation's order number and channel (nothing without
/// either). The number was checked free under this transaction; a request with another
/// key that committed it since makes the insert write nothing, and the whole unit of
/// work runs again (then it refuses this request as `order_ref_reused`).
pub(crate) async fn record_order_reference<C: Dialect>(
    connection: &mut C,
    reservation: &domain::ReservationId,
    shop: &ShopCode,
    reference: &domain::OrderReference,
    now: Timestamp,
) -> Result<(), StoreError> {
    if reference.is_empty() {
        return Ok(());
    }
    let written = statement(
        "INSERT INTO order_reference (reservation_id, shop, order_ref, source, created_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (shop, order_ref) DO NOTHING",
    )
    .bind(reservation.as_str())
    .bind(shop.as_str())
    .bind(reference.order_ref.as_ref().map(domain::OrderRef::as_str))
    .bind(reference.source.as_ref().map(domain::RequestSource::as_str))
    .bind(now.unix_milliseconds())
    .execute(&mut *connection)
    .await?;
    if written != 1 {
        return Err(StoreError::Retryable(format!(
            "order_ref {:?} was committed by another request meanwhile",
            reference.order_ref.as_ref().map(domain::OrderRef::as_str)
        )));
    }
    Ok(())
}

/// A written batch changed every locked row it planned to, and stored every record:
/// fewer rows is an invariant broken under the locks; fewer records, a key another
/// process committed since the lookup (the batch runs again and replays it).
pub(crate) fn check_written(
    written: &BatchWritten,
    rows_planned: usize,
    records_planned: usize,
) -> Result<(), StoreError> {
    if written.rows_taken != rows_planned as u64 {
        return Err(invariant(format!(
            "reserving batch totals changed {} of {rows_planned} locked rows",
            written.rows_taken
        )));
    }
    if written.records_stored != records_planned as u64 {
        return Err(StoreError::Retryable(format!(
            "stored {} of {records_planned} idempotency records: a key was committed concurrently",
            written.records_stored
        )));
    }
    Ok(())
}

impl<B: Backend> Units<B> {
    /// Reserves stock for a batch of independent requests in one transaction. Each
    /// request succeeds or is refused on its own, in order; the returned outcomes line
    /// up with `requests`. A database error fails the whole batch, which then changed
    /// nothing and may be retried.
    ///
    /// The batch costs a fixed number of statements whatever its size: each step is one
    /// bulk statement (the backend's `Dialect` batch methods), which is what lets the
    /// engine's combiner fold hundreds of requests into one transaction and one commit.
    /// `turn` orders the row-lock step after the previous batch of the same queue (see
    /// [`LockTurn`]).
    ///
    /// Longer than 70 lines on purpose: each step is a function of its own, and what
    /// stays here, with a comment per step, is their order — rendering before any lock,
    /// the fast path before the turn, the turn around the row locks, one transaction
    /// from the key lookup to the commit — which is the protocol, and reads (and is
    /// reviewed) as one sequence.
    pub async fn reserve_batch(
        &self,
        requests: &[ReserveRequest],
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
        turn: &mut LockTurn,
    ) -> Result<BatchApplied, StoreError> {
        // 1. A key repeated inside the batch is answered with its first request's
        //    response (or refused as reused when its fingerprint differs); only the
        //    first request of each key is decided.
        let (first_of_key, mut slots) = slots_by_key(requests);

        // Render the success answers before taking any lock: almost every request gets
        // one, and rendering under a row lock would lengthen every batch's hold.
        let mut responses: Vec<Option<StoredResponse>> = requests
            .iter()
            .zip(&slots)
            .map(|(request, slot)| {
                matches!(slot, BatchSlot::Claimed)
                    .then(|| renderer.reservation_created(&new_reservation(request, None, now)))
            })
            .collect();

        // 2. The fast path (PostgreSQL), when the backend has one.
        let fast = self
            .try_whole_batch(requests, &slots, &responses, now)
            .await?;
        if let WholeBatch::Applied(position) = fast {
            turn.pass();
            return Ok(BatchApplied {
                outcomes: batch_outcomes(slots, &responses)?,
                path: BatchPath::OneRoundTrip,
                position: Some(position),
            });
        }

        // 3. The batch transaction. A key with a committed record is replayed (or
        //    refused as reused when its fingerprint differs). The new keys' records
        //    are inserted with their responses below, in this transaction; a key
        //    another process commits meanwhile makes that insert come up short
        //    (SQLite, MySQL) or fail with a unique violation (PostgreSQL), and the
        //    batch is rolled back and retried (then it replays).
        //
        //    The turn is taken before the transaction begins: on SQLite the one write
        //    connection is the lock, and a batch that took it while waiting for the
        //    previous batch's turn would deadlock with that batch.
        //
        //    Where the two reads go together (and begin the transaction), the stock
        //    rows are those of every request, and a failed read passes the turn as a
        //    failed row lock does.
        turn.wait().await;
        let (mut transaction, read_stock) =
            if <B::Connection as Dialect>::READS_RECORDS_WITH_STOCK_ROWS {
                let begun = self
                    .backend
                    .begin_write_reading(&keys_of(&first_of_key), &stock_rows_of(requests.iter()))
                    .await;
                let (transaction, existing, stock) = begun.inspect_err(|_| turn.pass())?;
                replay_existing(requests, &existing, &mut slots)?;
                (transaction, Some(stock))
            } else {
                let mut transaction = self.begin_write().await?;
                if fast == WholeBatch::WaitedOutTheLock
                    && let Some(short) = <B::Connection as Dialect>::SHORT_LOCK_WAIT
                {
                    statement(short).execute(&mut *transaction).await?;
                }
                replay_committed_keys(&mut *transaction, requests, &first_of_key, &mut slots)
                    .await?;
                (transaction, None)
            };
        let claimed: Vec<usize> = slots
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| matches!(slot, BatchSlot::Claimed).then_some(index))
            .collect();

        // 4. Lock the rows, 5. decide every claimed request in memory, in arrival order.
        let (available, skus, tallies) = self
            .lock_batch_rows(&mut *transaction, requests, &claimed, read_stock, turn)
            .await?;
        let taken = order_refs_taken(&mut *transaction, requests, &claimed, &skus).await?;
        let plan = plan_batch(
            claimed.iter().map(|index| {
                let request = &requests[*index];
                PlanRequest {
                    lines: &request.lines,
                    shop: &request.shop,
                    user: request.user.as_ref(),
                    order_ref_taken: taken.contains(index),
                    order_ref: request.reference.order_ref.as_ref(),
                    undecided_when_short: request.undecided_when_short,
                }
            }),
            &skus,
            &available,
            &tallies,
        );

        // 6. Write the whole batch: each row's total taken with one conditional update
        //    (the rows are locked, so every condition holds; it stays as the oversell
        //    boundary anyway), the accepted reservations with their lines and ledger
        //    rows, the shoppers' tallies, and the idempotency records with their
        //    responses.
        let accepted = answer_decided(
            requests,
            &claimed,
            &plan.decisions,
            &mut responses,
            renderer,
            now,
        );
        // A request refused for naming another shop's SKUs (found so only under the
        // lock: a SKU created meanwhile) stores nothing, as every 403: the key stays
        // free, and a retry is decided again.
        for (index, decided) in claimed.iter().zip(&plan.decisions) {
            if let Err(rejection) = decided
                && rejection.code == ErrorCode::Forbidden
            {
                responses[*index] = None;
                slots[*index] = BatchSlot::Decided(Idempotent::Forbidden(rejection.detail.clone()));
            }
        }
        // An undecided request stores nothing: no record, no answer.
        for position in &plan.undecided {
            let index = claimed[*position];
            responses[index] = None;
            slots[index] = BatchSlot::Decided(Idempotent::Undecided);
        }
        let records: Vec<(&IdempotencyClaim, &StoredResponse)> = claimed
            .iter()
            .filter_map(|index| {
                responses[*index]
                    .as_ref()
                    .map(|response| (&requests[*index].claim, response))
            })
            .collect();
        let reservations = NewReservation::of_batch(&accepted, now);
        let nothing_follows = plan.holds_added.is_empty()
            && plan.purchases_added.is_empty()
            && accepted
                .iter()
                .all(|(request, _)| request.reference.is_empty());
        if nothing_follows {
            // No order numbers and no tallies: the writes, their check and the commit
            // go together (on SQLite, as one command).
            self.backend
                .write_batch_and_commit(transaction, &plan.totals, &reservations, &records, now)
                .await?;
            return Ok(BatchApplied {
                outcomes: batch_outcomes(slots, &responses)?,
                path: BatchPath::Transaction,
                position: None,
            });
        }
        let written = transaction
            .write_batch(&plan.totals, &reservations, &records, now)
            .await?;
        check_written(&written, plan.totals.len(), records.len())?;
        for (request, shop) in &accepted {
            record_order_reference(
                &mut *transaction,
                &request.id,
                shop,
                &request.reference,
                now,
            )
            .await?;
        }
        add_to_tallies(
            &mut *transaction,
            &plan.holds_added,
            &plan.purchases_added,
            self.limits().open_holds_max,
        )
        .await?;
        transaction.commit().await?;
        Ok(BatchApplied {
            outcomes: batch_outcomes(slots, &responses)?,
            path: BatchPath::Transaction,
            position: None,
        })
    }

    /// The fast path: one round trip that writes and commits the whole batch when
    /// every request fits, which is nearly always on a hot SKU with stock left. It
    /// writes nothing otherwise, and the batch is decided in a transaction (which
    /// waits only briefly for a lock when the fast path waited out the whole bound).
    /// It does not wait for the turn: it takes the row last and holds it only for the
    /// update and the commit. (With more than one batch in flight, a later batch may so
    /// take the last units before an earlier one: both batches' requests are in flight
    /// at once, and each gets an answer consistent with the row.) A request that names
    /// a shopper (limits to check), an order number or a channel, a campaign's bucket, or
    /// whose SKUs' shop is not verified yet is decided in the transaction.
    async fn try_whole_batch(
        &self,
        requests: &[ReserveRequest],
        slots: &[BatchSlot],
        responses: &[Option<StoredResponse>],
        now: Timestamp,
    ) -> Result<WholeBatch, StoreError> {
        // A campaign's bucket: its limit is the campaign's, which only the transaction
        // reads; and a short bucket may have to leave its requests undecided.
        let fast_path_fits = requests.iter().zip(slots).all(|(request, slot)| {
            !matches!(slot, BatchSlot::Claimed)
                || (request.user.is_none()
                    && request.reference.is_empty()
                    && !request.undecided_when_short
                    && matches!(request.shop, ShopScope::Verified(_))
                    && !request
                        .lines
                        .iter()
                        .any(|line| domain::campaign::is_bucket_warehouse(&line.warehouse)))
        });
        if !<B::Connection as Dialect>::WHOLE_BATCH_FAST_PATH || !fast_path_fits {
            return Ok(WholeBatch::NotApplied);
        }
        let claimed: Vec<&ReserveRequest> = requests
            .iter()
            .zip(slots)
            .filter_map(|(request, slot)| matches!(slot, BatchSlot::Claimed).then_some(request))
            .collect();
        let accepted: Vec<(&ReserveRequest, &ShopCode)> = claimed
            .iter()
            .filter_map(|request| match &request.shop {
                ShopScope::Verified(shop) => Some((*request, shop)),
                _ => None,
            })
            .collect();
        let records: Vec<(&IdempotencyClaim, &StoredResponse)> = requests
            .iter()
            .zip(responses)
            .filter_map(|(request, response)| {
                response.as_ref().map(|response| (&request.claim, response))
            })
            .collect();
        let totals = totals_if_all_accepted(claimed.iter().map(|request| request.lines.as_slice()));
        self.backend
            .reserve_whole_batch(
                &totals,
                &NewReservation::of_batch(&accepted, now),
                &records,
                now,
            )
            .await
    }

    /// Locks the stock rows the claimed requests touch, in (sku, warehouse) order,
    /// reading their SKUs' sale status, shop and per-user limit once they are locked
    /// (in the same statement, or on MySQL in a second one), and passes the turn. `read_stock`, when the rows were read with the keys' records, holds
    /// them already, and other requests' rows besides (only the claimed requests'
    /// lines are ever looked up in them). A shelf change (or a new limit) locks the
    /// same rows first, so it cannot slip between this read and the commit. Then the
    /// shoppers' tallies, in key order.
    async fn lock_batch_rows(
        &self,
        transaction: &mut B::Connection,
        requests: &[ReserveRequest],
        claimed: &[usize],
        read_stock: Option<LockedStock>,
        turn: &mut LockTurn,
    ) -> Result<(BTreeMap<StockKey, i64>, HashMap<SkuCode, SkuFacts>, Tallies), StoreError> {
        let wanted_rows = stock_rows_of(claimed.iter().map(|index| &requests[*index]));
        let locked = match read_stock {
            Some(stock) => Ok(stock),
            None => transaction.lock_stock_rows(&wanted_rows).await,
        };
        turn.pass();
        let (available, skus) = locked?;
        let skus = with_unlisted_skus(&mut *transaction, &wanted_rows, skus).await?;
        let skus =
            with_campaign_facts(&mut *transaction, &wanted_rows, skus, &self.campaign_limits)
                .await?;
        let tallies = lock_tallies(
            &mut *transaction,
            claimed.iter().map(|index| &requests[*index]),
            &skus,
            self.limits().open_holds_max,
        )
        .await?;
        Ok((available, skus, tallies))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(number: usize) -> domain::campaign::CampaignCode {
        let warehouse = domain::WarehouseCode::parse(&format!("campaign-{number:012x}-1")).unwrap();
        domain::campaign::bucket_of(&warehouse).unwrap().0
    }

    #[test]
    fn a_campaigns_limit_is_remembered_once_read_and_the_memory_stays_bounded() {
        let limits = CampaignLimits::default();
        assert_eq!(limits.get(&code(1)), None);
        limits.insert(code(1), Some(2));
        limits.insert(code(2), None);
        assert_eq!(limits.get(&code(1)), Some(Some(2)));
        assert_eq!(limits.get(&code(2)), Some(None));
        for number in 3..=CAMPAIGN_LIMITS_KNOWN_MAX + 1 {
            limits.insert(code(number), Some(1));
        }
        assert!(limits.known().len() <= CAMPAIGN_LIMITS_KNOWN_MAX);
        assert_eq!(
            limits.get(&code(CAMPAIGN_LIMITS_KNOWN_MAX + 1)),
            Some(Some(1))
        );
        assert_eq!(limits.get(&code(1)), None, "a full memory starts over");
    }
}

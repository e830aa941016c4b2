//! Scheduled shelf changes: storing a schedule and the worker's step that applies
//! the due ones.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{expect_one_row, invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::shelf::{
    LogLine, apply_shelf_change, insert_shelf_log, load_shelf_state, lock_shops_of, lock_sku_rows,
    shelf_target,
};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{
    Actor, AppliedSchedule, ScheduleRecord, ShelfChange, ShelfOutcome, ShelfResult,
    ShelfScheduling, ShelfTarget,
};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, ResponseRenderer};
use crate::sql::{Row, statement};
use domain::limits::SCHEDULES_PENDING_PER_SHOP_MAX;
use domain::{
    ErrorCode, ProductId, Recurrence, Rejection, SaleStatus, ScheduleId, ScheduleStatus,
    ShelfOperation, ShopCode, SkuCode, Timestamp, next_occurrence_id, operation_label,
};
use std::collections::{BTreeMap, BTreeSet};

fn decode_schedule(row: &Row) -> Result<ScheduleRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let sku: String = row.try_get("sku")?;
    let product_id: Option<String> = row.try_get("product_id")?;
    let shop: Option<String> = row.try_get("shop")?;
    let applied_at: Option<i64> = row.try_get("applied_at")?;
    let series_id: String = row.try_get("series_id")?;
    Ok(ScheduleRecord {
        id: parse_stored("schedule id", &id, ScheduleId::parse)?,
        sku: parse_stored("sku code", &sku, SkuCode::parse)?,
        product_id: product_id
            .as_deref()
            .map(|id| parse_stored("product id", id, ProductId::parse))
            .transpose()?,
        operation: row.try_get("operation")?,
        due_at: Timestamp::from_unix_milliseconds(row.try_get("due_at")?),
        status: row.try_get("status")?,
        operator_id: row.try_get("operator_id")?,
        shop: shop
            .as_deref()
            .map(|shop| parse_stored("shop", shop, ShopCode::parse))
            .transpose()?,
        remark: row.try_get("remark")?,
        outcome: row.try_get("outcome")?,
        created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        applied_at: applied_at.map(Timestamp::from_unix_milliseconds),
        series_id: parse_stored("schedule id", &series_id, ScheduleId::parse)?,
        recurrence: row.try_get("recurrence")?,
    })
}

/// Selects the columns [`decode_schedule`] reads, with the SKU's product: a macro, as
/// `concat!` (statements are `'static` text) takes only literals.
macro_rules! select_schedules {
    () => {
        "SELECT shelf_schedule.id, shelf_schedule.sku, sku.product_id, shelf_schedule.operation, \
         shelf_schedule.due_at, shelf_schedule.status, shelf_schedule.operator_id, \
         shelf_schedule.shop, shelf_schedule.remark, shelf_schedule.outcome, \
         shelf_schedule.created_at, shelf_schedule.applied_at, shelf_schedule.series_id, \
         shelf_schedule.recurrence \
         FROM shelf_schedule LEFT JOIN sku ON sku.code = shelf_schedule.sku"
    };
}

/// One schedule, whatever its status, on `connection`.
async fn load_schedule<C: Dialect>(
    connection: &mut C,
    id: &ScheduleId,
) -> Result<Option<ScheduleRecord>, StoreError> {
    let row = statement(concat!(
        select_schedules!(),
        " WHERE shelf_schedule.id = $1"
    ))
    .bind(id.as_str())
    .fetch_optional_row(connection)
    .await?;
    row.as_ref().map(decode_schedule).transpose()
}

/// A claimed schedule and the target it changes.
pub(crate) struct DueSchedule {
    id: ScheduleId,
    sku: SkuCode,
    operation: ShelfOperation,
    remark: String,
    due_at: Timestamp,
    recurrence: Option<Recurrence>,
    series: ScheduleId,
    target: ShelfTarget,
}

/// Claims up to `limit` due schedules (and their SKUs' other due ones, past the limit)
/// and locks what they will change — every shop,
/// then every stock row, in the order a shelf change takes them — before the first
/// change: applied one by one, the batch would take a shop's lock after another SKU's
/// stock rows and could deadlock against a shelf batch or a reservation.
pub(crate) async fn claim_due_schedules<C: Dialect>(
    transaction: &mut C,
    now: Timestamp,
    limit: i64,
) -> Result<Vec<DueSchedule>, StoreError> {
    let claimed = statement(C::CLAIM_DUE_SCHEDULES)
        .bind(now.unix_milliseconds())
        .bind(limit)
        .fetch_all_as::<ClaimedRow>(&mut *transaction)
        .await?;
    lock_claimed(transaction, claimed, now).await
}

/// The due schedules of one SKU, claimed and locked as [`claim_due_schedules`] does.
async fn claim_due_schedules_of_sku<C: Dialect>(
    transaction: &mut C,
    now: Timestamp,
    sku: &SkuCode,
) -> Result<Vec<DueSchedule>, StoreError> {
    let claimed = statement(C::CLAIM_DUE_SCHEDULES_OF_SKU)
        .bind(now.unix_milliseconds())
        .bind(sku.as_str())
        .fetch_all_as::<ClaimedRow>(&mut *transaction)
        .await?;
    lock_claimed(transaction, claimed, now).await
}

/// Locks what the claimed schedules change and adds their SKUs' other due schedules.
async fn lock_claimed<C: Dialect>(
    transaction: &mut C,
    claimed: Vec<ClaimedRow>,
    now: Timestamp,
) -> Result<Vec<DueSchedule>, StoreError> {
    let mut due = due_schedules(transaction, claimed).await?;
    let targets: Vec<&ShelfTarget> = due.iter().map(|schedule| &schedule.target).collect();
    lock_shops_of(&mut *transaction, &targets).await?;
    let mut skus: Vec<SkuCode> = due.iter().map(|schedule| schedule.sku.clone()).collect();
    skus.sort();
    skus.dedup();
    transaction
        .lock_stock_of_skus(&skus.iter().collect::<Vec<_>>())
        .await?;
    // Then every SKU's own row, in code order, before the first change: applied one by
    // one, the batch would lock a later-due SKU's row (and its product's) before an
    // earlier code's, and a product edit, which locks its SKUs' rows in code order,
    // could hold the earlier one waiting for the later: a deadlock.
    lock_sku_rows(&mut *transaction, &skus).await?;
    // Then the SKUs' other due schedules, which the batch's limit left out: a SKU's
    // schedules apply together, in the order of their slots (see
    // `apply_due_schedules`), or a late "on" left to the next batch would apply after
    // a later-slotted "off" of this one. The locks above make another worker's claim of
    // the same SKUs wait for this transaction; one that claimed first holds its rows,
    // which `SKIP LOCKED` leaves to it, and the SKU is then held back below.
    let claimed_ids: BTreeSet<String> =
        due.iter().map(|schedule| schedule.id.to_string()).collect();
    for sku in &skus {
        let rest: Vec<ClaimedRow> = statement(C::CLAIM_DUE_SCHEDULES_OF_SKU)
            .bind(now.unix_milliseconds())
            .bind(sku.as_str())
            .fetch_all_as::<ClaimedRow>(&mut *transaction)
            .await?
            .into_iter()
            .filter(|row| !claimed_ids.contains(&row.0))
            .collect();
        due.extend(due_schedules(transaction, rest).await?);
    }
    held_back_behind_other_claims(transaction, due, now).await
}

/// A claimed schedule's row: id, sku, operation, remark, due_at, recurrence, series.
type ClaimedRow = (String, String, String, String, i64, Option<String>, String);

/// The claimed rows with the targets they change.
async fn due_schedules<C: Dialect>(
    transaction: &mut C,
    claimed: Vec<ClaimedRow>,
) -> Result<Vec<DueSchedule>, StoreError> {
    let mut due = Vec::with_capacity(claimed.len());
    for (id, sku, operation, remark, due_at, recurrence, series) in claimed {
        let series = parse_stored("schedule id", &series, ScheduleId::parse)?;
        let id = parse_stored("schedule id", &id, ScheduleId::parse)?;
        let sku = parse_stored("sku code", &sku, SkuCode::parse)?;
        let operation = parse_stored("operation", &operation, ShelfOperation::parse)?;
        let recurrence = recurrence
            .map(|text| {
                Recurrence::parse(&text)
                    .ok_or_else(|| invariant(format!("schedule {id} repeats '{text}'")))
            })
            .transpose()?;
        // The SKU's shop: a standalone SKU has no product, and its schedule takes its
        // shop's lock like a manual operation does.
        let target = statement("SELECT product_id, shop FROM sku WHERE code = $1")
            .bind(sku.as_str())
            .fetch_optional_as::<(Option<String>, Option<String>)>(&mut *transaction)
            .await?;
        let Some((product_id, shop)) = target else {
            return Err(invariant(format!(
                "schedule {id} names a sku that does not exist"
            )));
        };
        let target = shelf_target(sku.clone(), product_id.as_deref(), shop.as_deref())?;
        due.push(DueSchedule {
            id,
            sku,
            operation,
            remark,
            due_at: Timestamp::from_unix_milliseconds(due_at),
            recurrence,
            series,
            target,
        });
    }
    Ok(due)
}

/// `due` without the schedules of a SKU that has another due schedule outside this
/// claim: one another instance claimed (its row skipped by this claim) and has not
/// committed yet. Those stay pending, for a later step that claims them all, so one
/// SKU's changes apply in the order of their slots whichever instance applies them
/// ("off at 20:00" then "on at 20:01", never the other way round). Read after the
/// locks: a schedule settled meanwhile is no longer pending.
async fn held_back_behind_other_claims<C: Dialect>(
    transaction: &mut C,
    due: Vec<DueSchedule>,
    now: Timestamp,
) -> Result<Vec<DueSchedule>, StoreError> {
    let claimed: BTreeSet<String> = due.iter().map(|schedule| schedule.id.to_string()).collect();
    let mut checked: BTreeSet<SkuCode> = BTreeSet::new();
    let mut held_back: BTreeSet<SkuCode> = BTreeSet::new();
    for schedule in &due {
        if !checked.insert(schedule.sku.clone()) {
            continue;
        }
        let pending: Vec<String> = statement(
            "SELECT id FROM shelf_schedule WHERE status = 'PENDING' AND sku = $1 AND due_at <= $2",
        )
        .bind(schedule.sku.as_str())
        .bind(now.unix_milliseconds())
        .fetch_all_scalar(&mut *transaction)
        .await?;
        if pending.iter().any(|id| !claimed.contains(id)) {
            held_back.insert(schedule.sku.clone());
        }
    }
    Ok(due
        .into_iter()
        .filter(|schedule| !held_back.contains(&schedule.sku))
        .collect())
}

/// Settles a pending schedule as `to` (applied, skipped, refused or cancelled)
/// through [`ScheduleStatus::may_become`]: the one writer of a schedule's status.
/// Answers how many rows changed: 0 when it was no longer pending.
async fn settle_schedule<C: Dialect>(
    transaction: &mut C,
    id: &ScheduleId,
    to: ScheduleStatus,
    outcome: &str,
    now: Timestamp,
) -> Result<u64, StoreError> {
    let from = ScheduleStatus::Pending;
    if !from.may_become(to) {
        return Err(invariant(format!(
            "schedule {id} cannot go from {} to {}",
            from.as_str(),
            to.as_str()
        )));
    }
    statement(
        "UPDATE shelf_schedule SET status = $2, outcome = $3, applied_at = $4 WHERE id = $1 AND status = $5",
    )
    .bind(id.as_str())
    .bind(to.as_str())
    .bind(outcome)
    .bind(now.unix_milliseconds())
    .bind(from.as_str())
    .execute(&mut *transaction)
    .await
}

/// Cancels the pending schedules of `sku`, deleted in `transaction`: a deleted SKU is
/// never changed again, so they could only ever be skipped, and left pending they
/// would count against the shop's cap and show among what is still to come. A daily
/// series ends with its pending occurrence. A schedule the worker holds is skipped
/// here: the worker waits for this delete's locks, then finds the SKU deleted and
/// settles it as skipped.
pub(crate) async fn cancel_schedules_of_deleted_sku<C: Dialect>(
    transaction: &mut C,
    sku: &SkuCode,
    now: Timestamp,
) -> Result<(), StoreError> {
    let pending: Vec<String> = statement(C::CLAIM_PENDING_SCHEDULES_OF_SKU)
        .bind(sku.as_str())
        .fetch_all_scalar(&mut *transaction)
        .await?;
    for id in pending {
        let id = parse_stored("schedule id", &id, ScheduleId::parse)?;
        let updated = settle_schedule(
            &mut *transaction,
            &id,
            ScheduleStatus::Cancelled,
            "cancelled: the SKU was deleted",
            now,
        )
        .await?;
        expect_one_row(updated, "cancelling a deleted SKU's schedule")?;
    }
    Ok(())
}

/// Inserts the occurrence after `settled` (due at `due_at`) of its daily `series`: the
/// same SKU, operation, operator, shop, remark and series, due at the first slot
/// after `due_by` (the time due schedules are judged by), written at `now`.
async fn leave_next_occurrence<C: Dialect>(
    transaction: &mut C,
    settled: &ScheduleId,
    series: &ScheduleId,
    recurrence: Recurrence,
    due_at: Timestamp,
    (now, due_by): (Timestamp, Timestamp),
) -> Result<ScheduleId, StoreError> {
    let next_due = recurrence.next_due(due_at, due_by);
    let next = next_occurrence_id(series, next_due);
    let inserted = statement(
        "INSERT INTO shelf_schedule (id, sku, operation, due_at, status, operator_id, shop, remark, created_at, series_id, recurrence) \
         SELECT $1, sku, operation, $2, 'PENDING', operator_id, shop, remark, $3, series_id, recurrence \
         FROM shelf_schedule WHERE id = $4",
    )
    .bind(next.as_str())
    .bind(next_due.unix_milliseconds())
    .bind(now.unix_milliseconds())
    .bind(settled.as_str())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(inserted, "leaving a daily schedule's next occurrence")?;
    Ok(next)
}

/// A refusal when these schedules would take a shop past
/// [`SCHEDULES_PENDING_PER_SHOP_MAX`] pending ones. The caller holds each shop's lock
/// ([`lock_shops_of`]), so two requests cannot both count the room that only one of
/// them fits in. Standalone SKUs (no shop, the admin's) are counted together, without
/// a lock: only the admin schedules them.
async fn pending_cap_refusal<C: Dialect>(
    transaction: &mut C,
    targets: &[&ShelfTarget],
) -> Result<Option<Rejection>, StoreError> {
    let mut per_shop: BTreeMap<Option<&ShopCode>, i64> = BTreeMap::new();
    for target in targets {
        *per_shop.entry(target.shop.as_ref()).or_default() += 1;
    }
    for (shop, adding) in per_shop {
        let pending: i64 = statement(
            "SELECT COUNT(*) FROM shelf_schedule WHERE status = 'PENDING' \
             AND (shop = $1 OR ($1 IS NULL AND shop IS NULL))",
        )
        .bind(shop.map(ShopCode::as_str))
        .fetch_one_scalar(&mut *transaction)
        .await?;
        if pending + adding > SCHEDULES_PENDING_PER_SHOP_MAX {
            let whose = shop.map_or_else(
                || "standalone SKUs".to_owned(),
                |shop| format!("shop '{shop}'"),
            );
            return Ok(Some(Rejection::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "{whose} has {pending} pending schedules; at most {SCHEDULES_PENDING_PER_SHOP_MAX} may be pending, so {adding} more do not fit (cancel some, or wait for them to apply)"
                ),
            )));
        }
    }
    Ok(None)
}

/// Takes the locks a schedule request holds while it decides: each shop's (in code
/// order, as a shelf change takes them), then each SKU's own row (in code order). A
/// delete takes both before it changes the SKU and cancels its schedules, so a
/// schedule is stored either before a delete (and cancelled by it) or after it (and
/// refused here), never left pending on a deleted SKU.
async fn lock_schedule_targets<C: Dialect>(
    transaction: &mut C,
    targets: &[(ScheduleId, ShelfTarget)],
) -> Result<(), StoreError> {
    let targets: Vec<&ShelfTarget> = targets.iter().map(|(_, target)| target).collect();
    lock_shops_of(&mut *transaction, &targets).await?;
    let skus: BTreeSet<&SkuCode> = targets.iter().map(|target| &target.sku).collect();
    let skus: Vec<&SkuCode> = skus.into_iter().collect();
    lock_sku_rows(transaction, &skus).await
}

impl<B: Backend> Units<B> {
    /// Schedules with `status` (`PENDING`: what is still to come), by due time: of one
    /// shop when given, after the schedule `after` when given, at most `limit`.
    pub async fn schedules(
        &self,
        shop: Option<&ShopCode>,
        status: &str,
        after: Option<&ScheduleId>,
        limit: i64,
    ) -> Result<Vec<ScheduleRecord>, StoreError> {
        // A page goes on from the (due time, id) of the last schedule of the one
        // before; a schedule's due time never changes, so the cursor stays put. The
        // cursor is read within the shop too: another shop's schedule names nothing
        // here (an empty page), rather than cutting this shop's list at its due time.
        let rows = statement(concat!(
            select_schedules!(),
            " WHERE shelf_schedule.status = $1 AND ($2 IS NULL OR shelf_schedule.shop = $2) \
             AND ($3 IS NULL OR shelf_schedule.due_at > (SELECT last_shown.due_at FROM shelf_schedule last_shown \
                      WHERE last_shown.id = $3 AND ($2 IS NULL OR last_shown.shop = $2)) \
                  OR (shelf_schedule.due_at = (SELECT last_shown.due_at FROM shelf_schedule last_shown \
                      WHERE last_shown.id = $3 AND ($2 IS NULL OR last_shown.shop = $2)) \
                      AND shelf_schedule.id > $3)) \
             ORDER BY shelf_schedule.due_at, shelf_schedule.id LIMIT $4"
        ))
            .bind(status)
            .bind(shop.map(ShopCode::as_str))
            .bind(after.map(ScheduleId::as_str))
            .bind(limit)
            .fetch_all_rows(&mut *self.writer_read_connection().await?)
            .await?;
        rows.iter().map(decode_schedule).collect()
    }

    /// One schedule, whatever its status.
    pub async fn schedule(&self, id: &ScheduleId) -> Result<Option<ScheduleRecord>, StoreError> {
        load_schedule(&mut *self.writer_read_connection().await?, id).await
    }

    /// Records shelf operations to apply at `due_at`.
    pub async fn schedule_shelf(
        &self,
        claim: &IdempotencyClaim,
        scheduling: &ShelfScheduling,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        lock_schedule_targets(&mut *transaction, &scheduling.targets).await?;
        // A deleted SKU never changes again: a schedule of it could only be skipped.
        let mut deleted = BTreeSet::new();
        for (_, target) in &scheduling.targets {
            let state = load_shelf_state(&mut *transaction, &target.sku).await?;
            if state.is_some_and(|state| state.status == SaleStatus::Deleted) {
                deleted.insert(&target.sku);
            }
        }
        let live: Vec<&ShelfTarget> = scheduling
            .targets
            .iter()
            .map(|(_, target)| target)
            .filter(|target| !deleted.contains(&target.sku))
            .collect();
        if let Some(refusal) = pending_cap_refusal(&mut *transaction, &live).await? {
            let response = renderer.rejected(&refusal);
            return commit_with_answer(transaction, claim, response).await;
        }
        let mut results = Vec::with_capacity(scheduling.targets.len());
        for (id, target) in &scheduling.targets {
            if deleted.contains(&target.sku) {
                results.push(ShelfResult {
                    sku: target.sku.clone(),
                    product_id: target.product_id.clone(),
                    outcome: ShelfOutcome::Refused {
                        code: ErrorCode::IllegalTransition,
                        reason: format!(
                            "sku '{}' is deleted: a deleted SKU is never scheduled",
                            target.sku
                        ),
                        missing: Vec::new(),
                    },
                    availability: None,
                });
                continue;
            }
            statement(
                "INSERT INTO shelf_schedule (id, sku, operation, due_at, status, operator_id, shop, remark, created_at, series_id, recurrence) \
                 VALUES ($1, $2, $3, $4, 'PENDING', $5, $6, $7, $8, $1, $9)",
            )
            .bind(id.as_str())
            .bind(target.sku.as_str())
            .bind(scheduling.operation.as_str())
            .bind(scheduling.due_at.unix_milliseconds())
            .bind(scheduling.actor.operator.as_str())
            .bind(target.shop.as_ref().map(ShopCode::as_str))
            .bind(&scheduling.remark)
            .bind(now.unix_milliseconds())
            .bind(scheduling.recurrence.map(Recurrence::as_str))
            .execute(&mut *transaction)
            .await?;
            results.push(ShelfResult {
                sku: target.sku.clone(),
                product_id: target.product_id.clone(),
                outcome: ShelfOutcome::Scheduled {
                    schedule_id: id.clone(),
                    due_at: scheduling.due_at,
                },
                availability: None,
            });
        }
        let response = renderer.shelf_results(&results);
        commit_with_answer(transaction, claim, response).await
    }

    /// The earliest pending schedule, for the worker's timer.
    pub async fn next_schedule_due(&self) -> Result<Option<Timestamp>, StoreError> {
        let due: Option<i64> =
            statement("SELECT MIN(due_at) FROM shelf_schedule WHERE status = 'PENDING'")
                .fetch_one_scalar(&mut *self.writer_read_connection().await?)
                .await?;
        Ok(due.map(Timestamp::from_unix_milliseconds))
    }

    /// Applies up to `limit` schedules due at or before `now` (more when a SKU's due
    /// schedules go past the limit: they apply together), each exactly once even
    /// with several processes (claimed with `SKIP LOCKED` on PostgreSQL). A schedule of
    /// a deleted SKU is skipped and logged.
    ///
    /// Due schedules are judged by `due_by` (the caller's clock held back by how far it
    /// runs ahead of the database's, `Engine::held_back_now`: a clock ahead must not
    /// put a product on sale before its launch); what is written carries `now`.
    ///
    /// A batch that waits past the lock bound for a row it must change (a stock or
    /// SKU row another session holds open) is rolled back and the due schedules are
    /// applied one SKU at a time instead, each in its own transaction waiting only
    /// briefly: the held SKU's are left pending for a later step, and a held row no
    /// longer stops every shop's schedules.
    pub async fn apply_due_schedules(
        &self,
        clocks: (Timestamp, Timestamp),
        limit: i64,
    ) -> Result<Vec<AppliedSchedule>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let claimed = claim_due_schedules(&mut *transaction, clocks.1, limit).await;
        match claimed {
            Ok(due) => {
                let applied = apply_claimed(&mut *transaction, due, clocks).await?;
                transaction.commit().await?;
                Ok(applied)
            }
            Err(StoreError::LockTimeout(failure)) => {
                transaction.rollback().await?;
                tracing::warn!(%failure, "a schedule batch waited past the lock bound for a row: one SKU at a time");
                self.apply_due_schedules_one_sku_at_a_time(clocks, limit)
                    .await
            }
            Err(error) => Err(error),
        }
    }

    /// [`Units::apply_due_schedules`] one SKU at a time, the SKUs due first first: a
    /// SKU whose rows are held is left for a later step.
    async fn apply_due_schedules_one_sku_at_a_time(
        &self,
        clocks: (Timestamp, Timestamp),
        limit: i64,
    ) -> Result<Vec<AppliedSchedule>, StoreError> {
        let skus: Vec<String> = statement(
            "SELECT sku FROM shelf_schedule WHERE status = 'PENDING' AND due_at <= $1 \
             GROUP BY sku ORDER BY MIN(due_at), sku LIMIT $2",
        )
        .bind(clocks.1.unix_milliseconds())
        .bind(limit)
        .fetch_all_scalar(&mut *self.writer_read_connection().await?)
        .await?;
        let mut applied = Vec::new();
        for sku in skus {
            let sku = parse_stored("sku code", &sku, SkuCode::parse)?;
            let mut transaction = self.begin_write().await?;
            if let Some(short) = <B::Connection as Dialect>::SHORT_LOCK_WAIT {
                statement(short).execute(&mut *transaction).await?;
            }
            match claim_due_schedules_of_sku(&mut *transaction, clocks.1, &sku).await {
                Ok(due) => {
                    applied.extend(apply_claimed(&mut *transaction, due, clocks).await?);
                    transaction.commit().await?;
                }
                Err(StoreError::LockTimeout(failure)) => {
                    transaction.rollback().await?;
                    tracing::warn!(%sku, %failure, "a SKU's schedules wait: a row of theirs is held");
                }
                Err(error) => return Err(error),
            }
        }
        Ok(applied)
    }
}

/// Applies claimed, locked schedules in their slots' order, and settles each.
async fn apply_claimed<C: Dialect>(
    transaction: &mut C,
    mut due: Vec<DueSchedule>,
    (now, due_by): (Timestamp, Timestamp),
) -> Result<Vec<AppliedSchedule>, StoreError> {
    // A daily occurrence late by more than a day stands for the last slot it
    // missed, and applies at that slot's place among its SKU's other schedules:
    // "off daily at 20:00" from yesterday and "on daily at 06:00" from today,
    // both missed, leave the SKU off, as 20:00 today left it. By their stale due
    // times the off applied first and the SKU stayed on sale all night.
    due.sort_by_key(|schedule| {
        let slot = schedule.recurrence.map_or(schedule.due_at, |recurrence| {
            recurrence.latest_slot(schedule.due_at, due_by)
        });
        (slot, schedule.due_at, schedule.id.clone())
    });
    let mut applied = Vec::with_capacity(due.len());
    // Every schedule's log lines, written once after the last one: the log's lock
    // is held from there to the commit, not across the batch, where every manual
    // shelf change of every shop would wait for it.
    let mut log = Vec::new();
    for DueSchedule {
        id,
        sku,
        operation,
        remark,
        due_at,
        recurrence,
        series,
        target,
    } in due
    {
        let actor = Actor::scheduler();
        let current = load_shelf_state(&mut *transaction, &sku).await?;
        let (status, outcome) = if current
            .as_ref()
            .is_some_and(|state| state.status == SaleStatus::Deleted)
        {
            log.push(LogLine {
                target: target.clone(),
                actor: actor.clone(),
                from: SaleStatus::Deleted,
                to: SaleStatus::Deleted,
                operation: operation_label(operation, true),
                repeated: false,
                remark: "schedule skipped: the SKU was deleted".to_owned(),
            });
            (ScheduleStatus::Skipped, "the SKU was deleted".to_owned())
        } else {
            let change = ShelfChange {
                operation,
                targets: vec![target.clone()],
                expected_versions: Default::default(),
                actor,
                remark,
                scheduled: true,
            };
            let results =
                apply_shelf_change(&mut *transaction, &change, (now, due_by), &mut log).await?;
            match results.first().map(|result| &result.outcome) {
                Some(ShelfOutcome::Refused { reason, .. }) => {
                    (ScheduleStatus::Refused, reason.clone())
                }
                Some(ShelfOutcome::Repeated { status }) => (
                    ScheduleStatus::Applied,
                    format!("already {}", status.as_str()),
                ),
                Some(ShelfOutcome::Changed { from, to, .. }) => (
                    ScheduleStatus::Applied,
                    format!("{} to {}", from.as_str(), to.as_str()),
                ),
                _ => (ScheduleStatus::Refused, "nothing to apply".to_owned()),
            }
        };
        // Claimed `PENDING` under its lock: it settles through the table, once.
        let updated = settle_schedule(&mut *transaction, &id, status, &outcome, now).await?;
        expect_one_row(updated, "settling a claimed schedule")?;
        // A daily series goes on in the same transaction, so an occurrence is
        // never settled without its successor or left twice. A deleted SKU ends
        // it; a refused change does not (the product may be complete tomorrow).
        let next = match recurrence {
            Some(recurrence) if status != ScheduleStatus::Skipped => Some(
                leave_next_occurrence(
                    &mut *transaction,
                    &id,
                    &series,
                    recurrence,
                    due_at,
                    (now, due_by),
                )
                .await?,
            ),
            _ => None,
        };
        applied.push(AppliedSchedule {
            id,
            sku,
            status: status.as_str(),
            outcome,
            next,
        });
    }
    insert_shelf_log(&mut *transaction, log, now).await?;
    Ok(applied)
}

impl<B: Backend> Units<B> {
    /// Withdraws the pending occurrence of the series `id` belongs to: the schedule
    /// itself while it is pending, or the next occurrence a daily one left. The
    /// caller has checked that `actor` may change the schedule's shop.
    pub async fn cancel_schedule(
        &self,
        claim: &IdempotencyClaim,
        id: &ScheduleId,
        actor: &Actor,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let series: Option<String> =
            statement("SELECT series_id FROM shelf_schedule WHERE id = $1")
                .bind(id.as_str())
                .fetch_optional_scalar(&mut *transaction)
                .await?;
        let Some(series) = series else {
            let refusal = Rejection::new(
                ErrorCode::NotFound,
                format!("schedule '{id}' does not exist"),
            );
            let response = renderer.rejected(&refusal);
            return commit_with_answer(transaction, claim, response).await;
        };
        let outcome = format!("cancelled by {}", actor.operator);
        let mut cancelled = None;
        // Twice at most: a schedule worker settling the pending occurrence while the
        // first look waited for its row leaves the next one, committed after that
        // statement began and so unseen by it; the second look sees it.
        for _ in 0..2 {
            let pending: Vec<(String,)> = statement(
                "SELECT id FROM shelf_schedule WHERE series_id = $1 AND status = $2 ORDER BY due_at, id",
            )
            .bind(&series)
            .bind(ScheduleStatus::Pending.as_str())
            .fetch_all_as(&mut *transaction)
            .await?;
            for (pending_id,) in pending {
                let pending_id = parse_stored("schedule id", &pending_id, ScheduleId::parse)?;
                let updated = settle_schedule(
                    &mut *transaction,
                    &pending_id,
                    ScheduleStatus::Cancelled,
                    &outcome,
                    now,
                )
                .await?;
                if updated == 1 {
                    cancelled = Some(pending_id);
                }
            }
            if cancelled.is_some() {
                break;
            }
        }
        let response = match cancelled {
            Some(cancelled) => {
                let record = load_schedule(&mut *transaction, &cancelled)
                    .await?
                    .ok_or_else(|| invariant("a cancelled schedule vanished inside its own transaction"))?;
                renderer.schedule_cancelled(&record)
            }
            None => renderer.rejected(&Rejection::new(
                ErrorCode::IllegalTransition,
                format!(
                    "schedule '{id}' has nothing pending to cancel: it has settled and no later occurrence of it is to come"
                ),
            )),
        };
        commit_with_answer(transaction, claim, response).await
    }
}

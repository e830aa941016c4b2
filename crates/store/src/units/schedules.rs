//! Scheduled shelf changes: storing a schedule and the worker's step that applies
//! the due ones.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{expect_one_row, invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::shelf::{LogLine, apply_shelf_change, insert_shelf_log, load_shelf_state, shelf_target};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{
    Actor, AppliedSchedule, ScheduleRecord, ShelfChange, ShelfOutcome, ShelfResult,
    ShelfScheduling, ShelfTarget,
};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, ResponseRenderer};
use crate::sql::{Row, statement};
use domain::{
    ProductId, SaleStatus, ScheduleId, ScheduleStatus, ShelfOperation, ShopCode, SkuCode,
    Timestamp, operation_label,
};
use std::collections::BTreeSet;

fn decode_schedule(row: &Row) -> Result<ScheduleRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let sku: String = row.try_get("sku")?;
    let product_id: Option<String> = row.try_get("product_id")?;
    let shop: Option<String> = row.try_get("shop")?;
    let applied_at: Option<i64> = row.try_get("applied_at")?;
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
    })
}

/// A claimed schedule: its id, SKU, operation, remark and the target it changes.
pub(crate) type DueSchedule = (ScheduleId, SkuCode, ShelfOperation, String, ShelfTarget);

/// Claims up to `limit` due schedules and locks what they will change — every shop,
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
        .fetch_all_as::<(String, String, String, String)>(&mut *transaction)
        .await?;
    let mut due = Vec::with_capacity(claimed.len());
    for (id, sku, operation, remark) in claimed {
        let id = parse_stored("schedule id", &id, ScheduleId::parse)?;
        let sku = parse_stored("sku code", &sku, SkuCode::parse)?;
        let operation = parse_stored("operation", &operation, ShelfOperation::parse)?;
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
        due.push((id, sku, operation, remark, target));
    }
    let shops: BTreeSet<&ShopCode> = due
        .iter()
        .filter_map(|(_, _, _, _, target)| target.shop.as_ref())
        .collect();
    for shop in shops {
        transaction.lock_shop(shop).await?;
    }
    let mut skus: Vec<&SkuCode> = due.iter().map(|(_, sku, _, _, _)| sku).collect();
    skus.sort();
    skus.dedup();
    transaction.lock_stock_of_skus(&skus).await?;
    Ok(due)
}

impl<B: Backend> Units<B> {
    /// Schedules with `status` (`PENDING`: what is still to come), by due time: of one
    /// shop when given, at most `limit`.
    pub async fn schedules(
        &self,
        shop: Option<&ShopCode>,
        status: &str,
        limit: i64,
    ) -> Result<Vec<ScheduleRecord>, StoreError> {
        let rows = statement(
            "SELECT shelf_schedule.id, shelf_schedule.sku, sku.product_id, shelf_schedule.operation, \
             shelf_schedule.due_at, shelf_schedule.status, shelf_schedule.operator_id, \
             shelf_schedule.shop, shelf_schedule.remark, shelf_schedule.outcome, \
             shelf_schedule.created_at, shelf_schedule.applied_at \
             FROM shelf_schedule LEFT JOIN sku ON sku.code = shelf_schedule.sku \
             WHERE shelf_schedule.status = $1 AND ($2 IS NULL OR shelf_schedule.shop = $2) \
             ORDER BY shelf_schedule.due_at, shelf_schedule.id LIMIT $3",
        )
        .bind(status)
        .bind(shop.map(ShopCode::as_str))
        .bind(limit)
        .fetch_all_rows(&mut *self.writer_read_connection().await?)
        .await?;
        rows.iter().map(decode_schedule).collect()
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
        let mut results = Vec::with_capacity(scheduling.targets.len());
        for (id, target) in &scheduling.targets {
            statement(
                "INSERT INTO shelf_schedule (id, sku, operation, due_at, status, operator_id, shop, remark, created_at) \
                 VALUES ($1, $2, $3, $4, 'PENDING', $5, $6, $7, $8)",
            )
            .bind(id.as_str())
            .bind(target.sku.as_str())
            .bind(scheduling.operation.as_str())
            .bind(scheduling.due_at.unix_milliseconds())
            .bind(scheduling.actor.operator.as_str())
            .bind(target.shop.as_ref().map(ShopCode::as_str))
            .bind(&scheduling.remark)
            .bind(now.unix_milliseconds())
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

    /// Applies up to `limit` schedules due at or before `now`, each exactly once even
    /// with several processes (claimed with `SKIP LOCKED` on PostgreSQL). A schedule of
    /// a deleted SKU is skipped and logged.
    pub async fn apply_due_schedules(
        &self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<AppliedSchedule>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let due = claim_due_schedules(&mut *transaction, now, limit).await?;
        let mut applied = Vec::with_capacity(due.len());
        for (id, sku, operation, remark, target) in due {
            let actor = Actor::scheduler();
            let current = load_shelf_state(&mut *transaction, &sku).await?;
            let (status, outcome) = if current
                .as_ref()
                .is_some_and(|state| state.status == SaleStatus::Deleted)
            {
                let line = LogLine {
                    target: &target,
                    actor: &actor,
                    from: SaleStatus::Deleted,
                    to: SaleStatus::Deleted,
                    operation: operation_label(operation, true),
                    repeated: false,
                    remark: "schedule skipped: the SKU was deleted",
                };
                insert_shelf_log(&mut *transaction, line, now).await?;
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
                let results = apply_shelf_change(&mut *transaction, &change, now).await?;
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
            let from = ScheduleStatus::Pending;
            if !from.may_become(status) {
                return Err(invariant(format!(
                    "schedule {id} cannot go from {} to {}",
                    from.as_str(),
                    status.as_str()
                )));
            }
            let updated = statement(
                "UPDATE shelf_schedule SET status = $2, outcome = $3, applied_at = $4 WHERE id = $1 AND status = $5",
            )
            .bind(id.as_str())
            .bind(status.as_str())
            .bind(&outcome)
            .bind(now.unix_milliseconds())
            .bind(from.as_str())
            .execute(&mut *transaction)
            .await?;
            expect_one_row(updated, "settling a claimed schedule")?;
            applied.push(AppliedSchedule {
                id,
                sku,
                status: status.as_str(),
                outcome,
            });
        }
        transaction.commit().await?;
        Ok(applied)
    }
}

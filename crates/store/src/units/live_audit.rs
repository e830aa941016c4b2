//! The live auditor's round: the three-way check of seed 002, incrementally.
//!
//! Each round compares every stock row's counters with what its ledger rows add up to
//! and its `reserved` counter with its open reservations, and the orders changed since
//! the previous round with their reservation and payments (a page of them at most:
//! [`OrdersWindow`]) — without replaying the ledger. `audit_running_sum` keeps each stock row's ledger sums through a checkpoint
//! (`audit_progress.through_ledger_id`, migration 0016 / 0012 / 0003); a round reads
//! only the ledger rows after it. Ledger ids are handed out before commit, so a row
//! can commit after a higher one: the checkpoint advances only over rows older than
//! the settle age, and the younger rows are summed afresh each round until they are
//! older. The stock table and the open reservations are read whole each round: both
//! are as large as the catalog and the live holds, not as the history (a closed
//! campaign's emptied bucket rows stay, though: up to 64 rows a campaign).
//!
//! A running sum that missed a row (a transaction that committed later than the settle
//! age allows: a clock behind, a commit stalled on a synchronous standby) would raise
//! the same difference in every round for ever. So a round that finds a stock row's
//! counters differ from its ledger sums may recount the running sums from the whole
//! ledger through the checkpoint, in the same snapshot, and compare again: a running
//! sum that was wrong is corrected with the checkpoint's move; a counter that is wrong
//! stays a difference. The engine allows one recount per ten minutes
//! (`EngineConfig::live_audit_recount_interval_milliseconds`): it reads the whole ledger.
//!
//! What the round does not repeat (reservation lines against their ledger rows,
//! orphaned ledger rows, returns) is the full audit's (`stockd audit`,
//! `GET /v1/audit`).

use futures_util::{StreamExt, TryStreamExt};

use super::Units;
use super::audit::{Findings, audit_orders_by_id, audit_orders_changed_from};
use crate::backend::{Backend, Finish};
use crate::error::StoreError;
use crate::model::AuditDifference;
use crate::sql::statement;
use domain::Timestamp;

/// Every stock row with its ledger sums (the running sums plus the rows after the
/// checkpoint `$1`) and what its open reservations hold.
const LIVE_STOCK_ROWS: &str = "SELECT stock.sku, stock.warehouse, stock.available, stock.reserved, \
     COALESCE(sums.available_sum, 0) + COALESCE(recent.available, 0), \
     COALESCE(sums.reserved_sum, 0) + COALESCE(recent.reserved, 0), \
     COALESCE(held.quantity, 0) \
     FROM stock \
     LEFT JOIN audit_running_sum sums ON sums.sku = stock.sku AND sums.warehouse = stock.warehouse \
     LEFT JOIN (SELECT sku, warehouse, CAST(SUM(available_delta) AS BIGINT) AS available, \
         CAST(SUM(reserved_delta) AS BIGINT) AS reserved \
         FROM stock_ledger WHERE id > $1 GROUP BY sku, warehouse) AS recent \
     ON recent.sku = stock.sku AND recent.warehouse = stock.warehouse \
     LEFT JOIN (SELECT line.sku, line.warehouse, CAST(SUM(line.quantity) AS BIGINT) AS quantity \
         FROM reservation_line line JOIN reservation ON reservation.id = line.reservation_id \
         WHERE reservation.status = 'RESERVED' GROUP BY line.sku, line.warehouse) AS held \
     ON held.sku = stock.sku AND held.warehouse = stock.warehouse \
     ORDER BY stock.sku, stock.warehouse";

/// The running sums' recount: for each stock row whose running sums differ from what
/// the ledger through the checkpoint `$1` adds up to, that sum, and the difference. A
/// running sum without ledger rows through the checkpoint is not looked for: no round
/// writes one.
const RUNNING_SUM_RECOUNT: &str = "SELECT counted.sku, counted.warehouse, \
     counted.available, counted.reserved, \
     counted.available - COALESCE(sums.available_sum, 0), \
     counted.reserved - COALESCE(sums.reserved_sum, 0) \
     FROM (SELECT sku, warehouse, CAST(SUM(available_delta) AS BIGINT) AS available, \
         CAST(SUM(reserved_delta) AS BIGINT) AS reserved \
         FROM stock_ledger WHERE id <= $1 GROUP BY sku, warehouse) AS counted \
     LEFT JOIN audit_running_sum sums ON sums.sku = counted.sku AND sums.warehouse = counted.warehouse \
     WHERE counted.available <> COALESCE(sums.available_sum, 0) \
        OR counted.reserved <> COALESCE(sums.reserved_sum, 0) \
     ORDER BY counted.sku, counted.warehouse";

/// Running sums corrected in one recount, at most; the rest wait for the next one.
const RUNNING_SUM_CORRECTIONS_MAX: usize = 10_000;

/// One stock row's sums, or their change: (sku, warehouse, available, reserved).
type SumsOfRow = (String, String, i64, i64);

/// One recounted running sum: (sku, warehouse, available, reserved as the ledger adds
/// them up, and how far the running sums were from that).
type Recounted = (String, String, i64, i64, i64, i64);

/// Which orders a live round checks: the recent changes whole (a commit may still come
/// in under an `updated_at` of the settle age before), a page of the older ones from a
/// position on, and by id those an earlier round found differing. Every round's cost
/// is bounded, however long the history, the outage or a difference lasts, and the
/// recent changes are checked every round even while the history is walked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrdersWindow {
    /// The page of older changes starts at the orders changed at `since` with an id
    /// after `after` (empty: all of them), then those changed later, up to
    /// `recent_from`.
    pub since: Timestamp,
    pub after: String,
    /// At most this many orders in the page.
    pub limit: i64,
    /// Changes at or after this instant are recent, read whole (up to
    /// `recent_limit`) every round.
    pub recent_from: Timestamp,
    pub recent_limit: i64,
    /// Orders found differing before: checked again, in or out of the page, so a
    /// difference stays counted until it is gone while the window moves on.
    pub recheck: Vec<String>,
}

/// What one round found and how far it got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveAuditRound {
    /// The checkpoint after the round (the last ledger id in the running sums).
    pub through_ledger_id: i64,
    /// Ledger rows after the previous checkpoint that this round read.
    pub ledger_rows_read: i64,
    pub stock_rows_checked: i64,
    pub orders_checked: i64,
    /// The last order of a full page of older changes, as (`updated_at`, id): more
    /// follow it, and the next round's page starts after it. `None`: the page held all
    /// there were up to the recent ones.
    pub orders_page_ended_at: Option<(Timestamp, String)>,
    /// The orders found differing (the rechecked ones still differing among them).
    pub differing_orders: Vec<String>,
    /// The first differences (bounded like the full audit's).
    pub differences: Vec<AuditDifference>,
    pub differences_total: i64,
    /// Whether this round moved the checkpoint (another instance's round may have
    /// moved it first; then the next round reads from there).
    pub advanced: bool,
    /// Whether this round recounted the running sums from the whole ledger.
    pub recounted: bool,
    /// Running sums the recount found wrong and corrected (with the checkpoint's move;
    /// none when another round moved it first).
    pub running_sums_corrected: i64,
}

/// Compares every stock row's counters with its ledger sums (the running sums, plus
/// `corrections`, plus the rows after `through`) and its open holds. Returns the rows
/// checked and how many of them differ from their ledger sums.
async fn compare_stock_rows<C: crate::backend::Dialect>(
    connection: &mut C,
    through: i64,
    corrections: &std::collections::HashMap<(String, String), (i64, i64)>,
    findings: &mut Findings,
) -> Result<(i64, i64), StoreError> {
    let mut checked = 0_i64;
    let mut differing = 0_i64;
    let mut rows =
        statement(LIVE_STOCK_ROWS)
            .bind(through)
            .fetch_as::<(String, String, i64, i64, i64, i64, i64)>(connection);
    while let Some((sku, warehouse, available, reserved, ledger_available, ledger_reserved, open)) =
        rows.try_next().await?
    {
        checked += 1;
        let (available_correction, reserved_correction) = corrections
            .get(&(sku.clone(), warehouse.clone()))
            .copied()
            .unwrap_or((0, 0));
        let ledger = (
            ledger_available + available_correction,
            ledger_reserved + reserved_correction,
        );
        if ledger != (available, reserved) {
            differing += 1;
        }
        findings.compare_stock_row(&sku, &warehouse, (available, reserved), ledger, open);
    }
    Ok((checked, differing))
}

impl<B: Backend> Units<B> {
    /// One round of the live audit. Ledger rows created before `settle_before` join
    /// the running sums; the orders `orders` names are checked.
    pub async fn live_audit_round(
        &self,
        now: Timestamp,
        settle_before: Timestamp,
        orders: &OrdersWindow,
        recount: bool,
    ) -> Result<LiveAuditRound, StoreError> {
        // The comparisons, on one snapshot: counters and ledger rows of the same
        // commits.
        let mut transaction = self.begin_snapshot().await?;
        let through: i64 =
            statement("SELECT through_ledger_id FROM audit_progress WHERE name = 'live'")
                .fetch_one_scalar(&mut *transaction)
                .await?;
        let ledger_rows_read: i64 = statement("SELECT COUNT(*) FROM stock_ledger WHERE id > $1")
            .bind(through)
            .fetch_one_scalar(&mut *transaction)
            .await?;
        let settled_through: i64 = statement(
            "SELECT COALESCE(MAX(id), $1) FROM stock_ledger WHERE id > $1 AND created_at < $2",
        )
        .bind(through)
        .bind(settle_before.unix_milliseconds())
        .fetch_one_scalar(&mut *transaction)
        .await?;
        let no_corrections = std::collections::HashMap::new();
        let mut stock_findings = Findings::default();
        let (stock_rows_checked, differing) = compare_stock_rows(
            &mut *transaction,
            through,
            &no_corrections,
            &mut stock_findings,
        )
        .await?;
        let mut order_findings = Findings::default();
        let rechecked =
            audit_orders_by_id(&mut *transaction, &orders.recheck, &mut order_findings).await?;
        let skip = orders.recheck.iter().cloned().collect();
        let page = audit_orders_changed_from(
            &mut *transaction,
            (orders.since, orders.after.as_str()),
            Some(orders.recent_from),
            orders.limit,
            &skip,
            &mut order_findings,
        )
        .await?;
        let recent = audit_orders_changed_from(
            &mut *transaction,
            (orders.recent_from, ""),
            None,
            orders.recent_limit,
            &skip,
            &mut order_findings,
        )
        .await?;
        if recent.read >= orders.recent_limit {
            tracing::warn!(
                limit = orders.recent_limit,
                "the live audit read only the first orders of the recent changes; the rest are checked once they are older"
            );
        }
        let orders_checked = rechecked.checked + page.checked + recent.checked;
        let orders_page_ended_at = if page.read >= orders.limit {
            page.last
        } else {
            None
        };
        let mut differing_orders = rechecked.differing;
        differing_orders.extend(page.differing);
        differing_orders.extend(recent.differing);
        let settled: Vec<SumsOfRow> = statement(
            "SELECT sku, warehouse, CAST(SUM(available_delta) AS BIGINT), CAST(SUM(reserved_delta) AS BIGINT) \
             FROM stock_ledger WHERE id > $1 AND id <= $2 GROUP BY sku, warehouse ORDER BY sku, warehouse",
        )
        .bind(through)
        .bind(settled_through)
        .fetch_as(&mut *transaction)
        .try_collect()
        .await?;
        // The recount comes last: when it fails (a statement timeout on a very large
        // ledger), the round still reports what it found without it.
        let recounted = recount && differing > 0 && through > 0;
        // The recounted sums, written as they are (not as a change): two instances'
        // rounds that both recount write the same values.
        let mut corrected_sums: Vec<SumsOfRow> = Vec::new();
        if recounted {
            let recount: Result<Vec<Recounted>, StoreError> = statement(RUNNING_SUM_RECOUNT)
                .bind(through)
                .fetch_as::<Recounted>(&mut *transaction)
                .take(RUNNING_SUM_CORRECTIONS_MAX)
                .try_collect()
                .await;
            let compared_again = match recount {
                Ok(found) if !found.is_empty() => {
                    let changes = found
                        .iter()
                        .map(|(sku, warehouse, _, _, available, reserved)| {
                            ((sku.clone(), warehouse.clone()), (*available, *reserved))
                        })
                        .collect();
                    let mut recompared = Findings::default();
                    compare_stock_rows(&mut *transaction, through, &changes, &mut recompared)
                        .await
                        .map(|_| Some((found, recompared)))
                }
                Ok(_) => Ok(None),
                Err(error) => Err(error),
            };
            match compared_again {
                Ok(Some((found, recompared))) => {
                    stock_findings = recompared;
                    corrected_sums = found
                        .into_iter()
                        .map(|(sku, warehouse, available, reserved, _, _)| {
                            (sku, warehouse, available, reserved)
                        })
                        .collect();
                }
                Ok(None) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "the live audit could not recount its running sums; its differences stand"
                ),
            }
        }
        let mut findings = stock_findings;
        findings.absorb(order_findings);
        transaction.rollback().await?;

        // The checkpoint moves in a write transaction of its own, from the value the
        // snapshot read: of two instances' rounds, the second changes nothing. A
        // recount is of the running sums through `through`: written only together with
        // the move from `through`, before the settled rows are added.
        let moved = if settled_through > through || !corrected_sums.is_empty() {
            self.advance_live_audit(through, settled_through, &corrected_sums, &settled, now)
                .await?
        } else {
            false
        };
        let advanced = moved && settled_through > through;
        let running_sums_corrected = if moved {
            i64::try_from(corrected_sums.len()).unwrap_or(i64::MAX)
        } else {
            0
        };
        Ok(LiveAuditRound {
            through_ledger_id: if advanced { settled_through } else { through },
            ledger_rows_read,
            stock_rows_checked,
            orders_checked,
            orders_page_ended_at,
            differing_orders,
            differences: findings.differences,
            differences_total: findings.total,
            advanced,
            recounted,
            running_sums_corrected,
        })
    }

    /// Sets the recounted running sums, adds the settled rows' sums, and moves the
    /// checkpoint from `through` to `settled_through`, unless another round moved it
    /// meanwhile.
    async fn advance_live_audit(
        &self,
        through: i64,
        settled_through: i64,
        recounted: &[SumsOfRow],
        settled: &[SumsOfRow],
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mut transaction = self.begin_write().await?;
        // Locks the checkpoint row until the commit: rounds of several instances
        // take turns here, so the update-then-insert below cannot race.
        let moved = statement(
            "UPDATE audit_progress SET through_ledger_id = $2, checked_at = $3 \
             WHERE name = 'live' AND through_ledger_id = $1",
        )
        .bind(through)
        .bind(settled_through)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        if moved != 1 {
            transaction.rollback().await?;
            return Ok(false);
        }
        // The recounted values first, then the settled rows' sums on top.
        let set = "UPDATE audit_running_sum SET available_sum = $3, reserved_sum = $4 \
                   WHERE sku = $1 AND warehouse = $2";
        let add = "UPDATE audit_running_sum SET available_sum = available_sum + $3, \
                   reserved_sum = reserved_sum + $4 WHERE sku = $1 AND warehouse = $2";
        for (update, rows) in [(set, recounted), (add, settled)] {
            for (sku, warehouse, available, reserved) in rows {
                let updated = statement(update)
                    .bind(sku.as_str())
                    .bind(warehouse.as_str())
                    .bind(*available)
                    .bind(*reserved)
                    .execute(&mut *transaction)
                    .await?;
                if updated == 0 {
                    // No sums yet for this row: both start from zero.
                    statement(
                        "INSERT INTO audit_running_sum (sku, warehouse, available_sum, reserved_sum) \
                         VALUES ($1, $2, $3, $4)",
                    )
                    .bind(sku.as_str())
                    .bind(warehouse.as_str())
                    .bind(*available)
                    .bind(*reserved)
                    .execute(&mut *transaction)
                    .await?;
                }
            }
        }
        transaction.commit().await?;
        Ok(true)
    }
}

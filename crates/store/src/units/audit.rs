//! The audit: replays the ledger and compares it with the counters, the reservations
//! and the orders, on one snapshot; and the full dump tests compare databases with.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{AUDIT_DIFFERENCES_REPORTED_MAX, AuditDifference, AuditReport};
use crate::sql::{Cell, statement};
use domain::{AttemptStatus, OrderStatus, RefundStatus, ReservationStatus, ShopCode, Timestamp};
use futures_util::TryStreamExt;

/// Every stock row with what its ledger rows add up to and what its open reservations
/// hold, for the audit.
pub(crate) const AUDIT_STOCK_ROWS: &str = "SELECT stock.sku, stock.warehouse, stock.available, stock.reserved, \
     COALESCE(ledger.available, 0), COALESCE(ledger.reserved, 0), COALESCE(held.quantity, 0) \
     FROM stock \
     LEFT JOIN (SELECT sku, warehouse, CAST(SUM(available_delta) AS BIGINT) AS available, \
         CAST(SUM(reserved_delta) AS BIGINT) AS reserved \
         FROM stock_ledger GROUP BY sku, warehouse) AS ledger \
     ON ledger.sku = stock.sku AND ledger.warehouse = stock.warehouse \
     LEFT JOIN (SELECT line.sku, line.warehouse, CAST(SUM(line.quantity) AS BIGINT) AS quantity \
         FROM reservation_line line JOIN reservation ON reservation.id = line.reservation_id \
         WHERE reservation.status = 'RESERVED' GROUP BY line.sku, line.warehouse) AS held \
     ON held.sku = stock.sku AND held.warehouse = stock.warehouse \
     ORDER BY stock.sku, stock.warehouse";

/// Stock rows that ledger rows or open reservations name but that do not exist.
pub(crate) const AUDIT_MISSING_STOCK_ROWS: &str = "SELECT named.sku, named.warehouse FROM \
     (SELECT sku, warehouse FROM stock_ledger \
      UNION SELECT line.sku, line.warehouse \
         FROM reservation_line line JOIN reservation ON reservation.id = line.reservation_id \
         WHERE reservation.status = 'RESERVED') AS named \
     WHERE NOT EXISTS (SELECT 1 FROM stock \
         WHERE stock.sku = named.sku AND stock.warehouse = named.warehouse) \
     ORDER BY named.sku, named.warehouse";

/// Every (order, SKU, warehouse) with returned goods: the units returned and the units
/// the order sold there (its reservation's lines, when that reservation is confirmed).
pub(crate) const AUDIT_RETURNS: &str = "SELECT ledger.reference, ledger.sku, ledger.warehouse, \
     CAST(SUM(ledger.available_delta) AS BIGINT), CAST(MIN(ledger.available_delta) AS BIGINT), \
     CAST(COALESCE((SELECT SUM(line.quantity) FROM customer_order \
         JOIN reservation ON reservation.id = customer_order.reservation_id \
             AND reservation.status = 'CONFIRMED' \
         JOIN reservation_line line ON line.reservation_id = reservation.id \
             AND line.sku = ledger.sku AND line.warehouse = ledger.warehouse \
         WHERE customer_order.id = ledger.reference), 0) AS BIGINT) \
     FROM stock_ledger ledger WHERE ledger.kind = 'return' \
     GROUP BY ledger.reference, ledger.sku, ledger.warehouse \
     ORDER BY ledger.reference, ledger.sku, ledger.warehouse";

/// An order's lines against the lines its reservation holds, (sku, warehouse) by
/// (sku, warehouse): what the shopper is charged for and can return (its lines) must be
/// what left or is held in stock for it (its reservation's lines, which the ledger
/// checks). Portable without FULL JOIN: both sides in one UNION, compared by group.
pub(crate) const AUDIT_ORDER_LINES: &str = "SELECT sides.order_id, sides.sku, sides.warehouse, \
     CAST(SUM(sides.ordered) AS BIGINT), CAST(SUM(sides.held) AS BIGINT) FROM ( \
         SELECT order_id, sku, warehouse, quantity AS ordered, 0 AS held FROM order_line \
         UNION ALL \
         SELECT customer_order.id, line.sku, line.warehouse, 0, line.quantity FROM customer_order \
         JOIN reservation_line line ON line.reservation_id = customer_order.reservation_id \
     ) sides GROUP BY sides.order_id, sides.sku, sides.warehouse \
     HAVING SUM(sides.ordered) <> SUM(sides.held) \
     ORDER BY sides.order_id, sides.sku, sides.warehouse";

/// Every payment attempt with its order and its refund, if any: what the money side of
/// the audit compares (who was charged, what is owed back, what went back).
pub(crate) const AUDIT_PAYMENTS_AND_REFUNDS: &str = "SELECT attempt.id, customer_order.id, customer_order.shop, \
     customer_order.status, customer_order.amount_minor, attempt.status, attempt.amount_minor, \
     COALESCE(attempt.failure_reason, ''), refund.status, COALESCE(refund.amount_minor, 0) \
     FROM payment_attempt attempt JOIN customer_order ON customer_order.id = attempt.order_id \
     LEFT JOIN refund ON refund.attempt_id = attempt.id \
     ORDER BY attempt.id";

/// An order's amount against its lines' prices times their quantities.
pub(crate) const AUDIT_ORDER_AMOUNTS: &str = "SELECT customer_order.id, customer_order.shop, customer_order.amount_minor, \
     CAST(COALESCE(SUM(line.quantity * line.unit_price_minor), 0) AS BIGINT) FROM customer_order \
     LEFT JOIN order_line line ON line.order_id = customer_order.id \
     GROUP BY customer_order.id, customer_order.shop, customer_order.amount_minor \
     HAVING customer_order.amount_minor <> COALESCE(SUM(line.quantity * line.unit_price_minor), 0) \
     ORDER BY customer_order.id";

/// What an audit found: every difference counted, the first
/// [`AUDIT_DIFFERENCES_REPORTED_MAX`] kept.
#[derive(Default)]
pub(crate) struct Findings {
    pub(crate) differences: Vec<AuditDifference>,
    pub(crate) total: i64,
    /// An operator's audit: only differences of this shop are counted and kept (its
    /// SKUs tell the shop of a difference that names only a SKU). Kept before the first
    /// [`AUDIT_DIFFERENCES_REPORTED_MAX`] are cut, so other shops' differences cannot
    /// crowd the shop's own out.
    scope: Option<ShopScope>,
}

struct ShopScope {
    shop: String,
    /// The shop's own SKUs: as large as its catalog, not the database's.
    skus: std::collections::HashSet<String>,
}

impl Findings {
    /// One stock row's counters (`available`, `reserved`) against what its ledger rows
    /// add up to and against what its open reservations hold.
    pub(crate) fn compare_stock_row(
        &mut self,
        sku: &str,
        warehouse: &str,
        (available, reserved): (i64, i64),
        (ledger_available, ledger_reserved): (i64, i64),
        open: i64,
    ) {
        let at = |check: &'static str, expected: i64, actual: i64| AuditDifference {
            check,
            sku: Some(sku.to_owned()),
            warehouse: Some(warehouse.to_owned()),
            reference: None,
            shop: None,
            expected,
            actual,
        };
        if ledger_available != available {
            self.note(at("ledger_vs_available", ledger_available, available));
        }
        if ledger_reserved != reserved {
            self.note(at("ledger_vs_reserved", ledger_reserved, reserved));
        }
        if open != reserved {
            self.note(at("open_reservations_vs_reserved", open, reserved));
        }
    }

    /// Adds another check's findings after these (same scope).
    pub(crate) fn absorb(&mut self, other: Findings) {
        let unkept = other.total - other.differences.len() as i64;
        for difference in other.differences {
            self.note(difference);
        }
        self.total += unkept;
    }

    pub(crate) fn note(&mut self, difference: AuditDifference) {
        if let Some(scope) = &self.scope {
            let ours = match (&difference.shop, &difference.sku) {
                (Some(shop), _) => *shop == scope.shop,
                (None, Some(sku)) => scope.skus.contains(sku),
                (None, None) => false,
            };
            if !ours {
                return;
            }
        }
        self.total += 1;
        if self.differences.len() < AUDIT_DIFFERENCES_REPORTED_MAX {
            self.differences.push(difference);
        }
    }
}

/// Every stock row's counters against its ledger and its open reservations; returns
/// the rows checked.
pub(crate) async fn audit_stock_rows<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<i64, StoreError> {
    // Counters against the ledger, and `reserved` against open reservations: the
    // database sums both per stock row and the rows are streamed, so the audit's
    // memory does not grow with the catalog either.
    let mut stock_rows_checked = 0_i64;
    let mut stock_rows = statement(AUDIT_STOCK_ROWS)
        .fetch_as::<(String, String, i64, i64, i64, i64, i64)>(&mut *transaction);
    while let Some((sku, warehouse, available, reserved, ledger_available, ledger_reserved, open)) =
        stock_rows.try_next().await?
    {
        stock_rows_checked += 1;
        findings.compare_stock_row(
            &sku,
            &warehouse,
            (available, reserved),
            (ledger_available, ledger_reserved),
            open,
        );
    }
    drop(stock_rows);
    Ok(stock_rows_checked)
}

/// Stock rows that ledger rows or open reservations name but that do not exist.
pub(crate) async fn audit_missing_stock_rows<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    let mut missing_rows =
        statement(AUDIT_MISSING_STOCK_ROWS).fetch_as::<(String, String)>(&mut *transaction);
    while let Some((sku, warehouse)) = missing_rows.try_next().await? {
        findings.note(AuditDifference {
            check: "stock_row_missing",
            sku: Some(sku),
            warehouse: Some(warehouse),
            reference: None,
            shop: None,
            expected: 1,
            actual: 0,
        });
    }
    drop(missing_rows);

    Ok(())
}

/// Every reservation line against its ledger rows; returns the lines checked.
pub(crate) async fn audit_reservation_lines<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<i64, StoreError> {
    // Every reservation line against the ledger rows that reference it: a hold
    // takes `quantity` from available into reserved; a confirm consumes it from
    // reserved; a release gives it back. Anything else (a double release, a
    // missing reserve row) shows up as a net difference.
    //
    // The lines, ledger orphans and orders grow with every request served, so they
    // are streamed row by row: the audit's memory stays flat however large the
    // tables get (collected, they took a SQLite server's peak from 83 to 171 MB after
    // 250,000 reservations).
    let mut reservation_lines_checked = 0_i64;
    let mut lines =
        statement(C::AUDIT_RESERVATION_LINES)
            .fetch_as::<(String, String, String, String, i64, i64, i64)>(&mut *transaction);
    while let Some((id, status, sku, warehouse, quantity, net_available, net_reserved)) =
        lines.try_next().await?
    {
        reservation_lines_checked += 1;
        let (expected_available, expected_reserved) = match status.as_str() {
            "RESERVED" => (-quantity, quantity),
            "CONFIRMED" => (-quantity, 0),
            _ => (0, 0),
        };
        for (check, expected, actual) in [
            (
                "reservation_ledger_available",
                expected_available,
                net_available,
            ),
            (
                "reservation_ledger_reserved",
                expected_reserved,
                net_reserved,
            ),
        ] {
            if expected != actual {
                findings.note(AuditDifference {
                    check,
                    sku: Some(sku.clone()),
                    warehouse: Some(warehouse.clone()),
                    reference: Some(id.clone()),
                    shop: None,
                    expected,
                    actual,
                });
            }
        }
    }
    drop(lines);

    Ok(reservation_lines_checked)
}

/// Ledger rows of reservation kinds that reference no reservation line.
pub(crate) async fn audit_orphan_ledger_rows<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    // Ledger rows of reservation kinds must reference a reservation line.
    let mut orphans = statement(
        "SELECT ledger.id, ledger.sku, ledger.warehouse, ledger.reference FROM stock_ledger ledger \
         LEFT JOIN reservation_line line ON line.reservation_id = ledger.reference \
         AND line.sku = ledger.sku AND line.warehouse = ledger.warehouse \
         WHERE ledger.kind IN ('reserve', 'confirm', 'release') AND line.reservation_id IS NULL \
         ORDER BY ledger.id",
    )
    .fetch_as::<(i64, String, String, String)>(&mut *transaction);
    while let Some((_, sku, warehouse, reference)) = orphans.try_next().await? {
        findings.note(AuditDifference {
            check: "orphan_ledger_row",
            sku: Some(sku),
            warehouse: Some(warehouse),
            reference: Some(reference),
            shop: None,
            expected: 0,
            actual: 1,
        });
    }
    drop(orphans);
    Ok(())
}

/// Every order with its reservation's status and what its payment attempts add up to:
/// succeeded if one did, else running if one runs, else failed if any was made. For the
/// full audit, which reads them all: the attempts are grouped once.
const ALL_ORDERS_WITH_THEIR_HOLDS: &str = "SELECT customer_order.id, customer_order.shop, \
     customer_order.status, reservation.status, COALESCE(reservation.order_id, ''), \
     CASE attempts.outcome WHEN 3 THEN 'SUCCEEDED' WHEN 2 THEN 'PROCESSING' WHEN 1 THEN 'FAILED' END, \
     customer_order.updated_at \
     FROM customer_order JOIN reservation ON reservation.id = customer_order.reservation_id \
     LEFT JOIN (SELECT order_id, MAX(CASE status WHEN 'SUCCEEDED' THEN 3 WHEN 'PROCESSING' THEN 2 ELSE 1 END) AS outcome \
         FROM payment_attempt GROUP BY order_id) AS attempts ON attempts.order_id = customer_order.id \
     ORDER BY customer_order.id";

/// The same for some orders: each order's attempts read through their index, so the
/// cost is of the orders chosen, not of every attempt ever made (a grouped subquery
/// joined to them is aggregated whole by PostgreSQL and SQLite).
macro_rules! some_orders_with_their_holds {
    ($filter:literal) => {
        concat!(
            "SELECT customer_order.id, customer_order.shop, customer_order.status, reservation.status, \
             COALESCE(reservation.order_id, ''), \
             CASE (SELECT MAX(CASE attempt.status WHEN 'SUCCEEDED' THEN 3 WHEN 'PROCESSING' THEN 2 ELSE 1 END) \
                 FROM payment_attempt attempt WHERE attempt.order_id = customer_order.id) \
             WHEN 3 THEN 'SUCCEEDED' WHEN 2 THEN 'PROCESSING' WHEN 1 THEN 'FAILED' END, \
             customer_order.updated_at \
             FROM customer_order JOIN reservation ON reservation.id = customer_order.reservation_id ",
            $filter
        )
    };
}

/// The orders changed at or after a position (`updated_at` `$1`, then ids after `$2`
/// at that instant) and before `$4`, in that order, at most `$3`: a page of the live
/// auditor's window.
pub const ORDERS_CHANGED_FROM: &str = some_orders_with_their_holds!(
    "WHERE customer_order.updated_at >= $1 \
     AND (customer_order.updated_at > $1 OR customer_order.id > $2) \
     AND customer_order.updated_at < $4 \
     ORDER BY customer_order.updated_at, customer_order.id LIMIT $3"
);

/// One order, by its id.
const ORDER_BY_ID: &str = some_orders_with_their_holds!("WHERE customer_order.id = $1");

/// What checking a set of orders found besides its findings.
#[derive(Debug, Default)]
pub(crate) struct OrdersChecked {
    pub(crate) checked: i64,
    /// The orders read, those skipped included.
    pub(crate) read: i64,
    /// The last order read, as (`updated_at`, id).
    pub(crate) last: Option<(Timestamp, String)>,
    /// The orders that differ, in the order read.
    pub(crate) differing: Vec<String>,
}

/// Every order against its reservation and its payments; returns the orders checked.
pub(crate) async fn audit_orders<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<i64, StoreError> {
    let checked = check_orders(
        transaction,
        statement(ALL_ORDERS_WITH_THEIR_HOLDS),
        &std::collections::HashSet::new(),
        findings,
    )
    .await?;
    Ok(checked.checked)
}

/// A page of the orders changed from `(since, after)` on and before `until` (see
/// [`ORDERS_CHANGED_FROM`]), at most `limit`, leaving out those in `skip` (checked
/// already).
pub(crate) async fn audit_orders_changed_from<C: Dialect>(
    transaction: &mut C,
    (since, after): (Timestamp, &str),
    until: Option<Timestamp>,
    limit: i64,
    skip: &std::collections::HashSet<String>,
    findings: &mut Findings,
) -> Result<OrdersChecked, StoreError> {
    let query = statement(ORDERS_CHANGED_FROM)
        .bind(since.unix_milliseconds())
        .bind(after)
        .bind(limit)
        .bind(until.map_or(i64::MAX, Timestamp::unix_milliseconds));
    check_orders(transaction, query, skip, findings).await
}

/// These orders, one by one (an order since deleted is skipped).
pub(crate) async fn audit_orders_by_id<C: Dialect>(
    transaction: &mut C,
    ids: &[String],
    findings: &mut Findings,
) -> Result<OrdersChecked, StoreError> {
    let mut all = OrdersChecked::default();
    for id in ids {
        let query = statement(ORDER_BY_ID).bind(id.as_str());
        let one = check_orders(
            &mut *transaction,
            query,
            &std::collections::HashSet::new(),
            findings,
        )
        .await?;
        all.checked += one.checked;
        all.read += one.read;
        all.differing.extend(one.differing);
    }
    Ok(all)
}

/// The three-way check of seed 002 for the orders `query` reads: a paid order holds
/// sold stock and a succeeded payment; an order that gave its stock back holds a
/// released reservation; and so on.
async fn check_orders<C: Dialect>(
    transaction: &mut C,
    query: crate::sql::Statement<'_>,
    skip: &std::collections::HashSet<String>,
    findings: &mut Findings,
) -> Result<OrdersChecked, StoreError> {
    let mut result = OrdersChecked::default();
    let mut orders = query
        .fetch_as::<(String, String, String, String, String, Option<String>, i64)>(
            &mut *transaction,
        );
    while let Some((
        id,
        shop,
        order_status,
        reservation_status,
        holder,
        attempt_status,
        updated_at,
    )) = orders.try_next().await?
    {
        result.read += 1;
        if skip.contains(&id) {
            result.last = Some((Timestamp::from_unix_milliseconds(updated_at), id));
            continue;
        }
        result.checked += 1;
        let difference = if holder != id {
            // Its reservation is held for another order (or for none): two orders on
            // one hold would each agree with it, and sell its stock twice.
            Some(format!("{id}: its reservation is held by order '{holder}'"))
        } else {
            let agrees = match (
                OrderStatus::parse(&order_status),
                ReservationStatus::parse(&reservation_status),
                attempt_status
                    .as_deref()
                    .map(AttemptStatus::parse)
                    .transpose(),
            ) {
                (Ok(order), Ok(reservation), Ok(payment)) => {
                    order.agrees_with(reservation, payment)
                }
                // A status no table knows is a hand edit: a difference.
                _ => false,
            };
            (!agrees).then(|| {
                format!(
                    "{id}: order {order_status}, reservation {reservation_status}, payment {}",
                    attempt_status.as_deref().unwrap_or("none")
                )
            })
        };
        if let Some(reference) = difference {
            findings.note(AuditDifference {
                check: "order_vs_reservation_and_payment",
                sku: None,
                warehouse: None,
                reference: Some(reference),
                shop: Some(shop),
                expected: 1,
                actual: 0,
            });
            result.differing.push(id.clone());
        }
        result.last = Some((Timestamp::from_unix_milliseconds(updated_at), id));
    }
    drop(orders);
    Ok(result)
}

/// Every campaign's units against its ledger: what its movements put into its buckets
/// is its quantity less what went back, and its SKU's row gave exactly that (seed 000:
/// a campaign's stock is carved out, never created).
pub(crate) async fn audit_campaigns<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    let mut campaigns = statement(
        "SELECT campaign.id, campaign.sku, campaign.quantity - campaign.returned, \
         CAST(COALESCE(SUM(CASE WHEN ledger.warehouse = campaign.warehouse THEN ledger.available_delta ELSE 0 END), 0) AS BIGINT), \
         CAST(COALESCE(SUM(CASE WHEN ledger.warehouse <> campaign.warehouse THEN ledger.available_delta ELSE 0 END), 0) AS BIGINT) \
         FROM campaign LEFT JOIN stock_ledger ledger ON ledger.reference = campaign.id \
         GROUP BY campaign.id, campaign.sku, campaign.quantity, campaign.returned ORDER BY campaign.id",
    )
    .fetch_as::<(String, String, i64, i64, i64)>(&mut *transaction);
    while let Some((id, sku, kept, from_source, into_buckets)) = campaigns.try_next().await? {
        for (check, actual, expected) in [
            ("campaign_bucket_units", into_buckets, kept),
            ("campaign_source_units", from_source, -kept),
        ] {
            if actual != expected {
                findings.note(AuditDifference {
                    check,
                    sku: Some(sku.clone()),
                    warehouse: None,
                    reference: Some(id.clone()),
                    shop: None,
                    expected,
                    actual,
                });
            }
        }
    }
    drop(campaigns);
    // A closed campaign is done with its buckets: a unit left in one (or held from
    // one) could never be sold or moved again.
    let mut stranded = statement(
        "SELECT campaign.id, campaign.sku, campaign.code, stock.warehouse, \
         stock.available + stock.reserved \
         FROM campaign JOIN stock ON stock.sku = campaign.sku AND stock.warehouse LIKE $1 \
         WHERE campaign.closed_at IS NOT NULL \
         AND (stock.available <> 0 OR stock.reserved <> 0) \
         ORDER BY campaign.id, stock.warehouse",
    )
    .bind(format!("{}%", domain::campaign::BUCKET_WAREHOUSE_PREFIX))
    .fetch_as::<(String, String, String, String, i64)>(&mut *transaction);
    let mut found = Vec::new();
    while let Some((id, sku, code, warehouse, units)) = stranded.try_next().await? {
        // The SKU's other campaigns' buckets match the pattern too: only this one's count.
        let bucket = domain::WarehouseCode::parse(&warehouse)
            .ok()
            .and_then(|warehouse| domain::campaign::bucket_of(&warehouse));
        if bucket.is_some_and(|(of, _)| of.as_str() == code) {
            found.push(AuditDifference {
                check: "campaign_closed_bucket_units",
                sku: Some(sku),
                warehouse: Some(warehouse),
                reference: Some(id),
                shop: None,
                expected: 0,
                actual: units,
            });
        }
    }
    drop(stranded);
    for difference in found {
        findings.note(difference);
    }
    Ok(())
}

/// Every payment attempt against its order and its refund: the attempt that paid is
/// refunded exactly when its order says so, a second charge always, nothing else ever
/// ([`domain::refund_agrees`]); a charge is for the order's amount, a refund for the
/// charge's.
pub(crate) async fn audit_payments_and_refunds<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    type Row = (
        String,
        String,
        String,
        String,
        i64,
        String,
        i64,
        String,
        Option<String>,
        i64,
    );
    let mut attempts = statement(AUDIT_PAYMENTS_AND_REFUNDS).fetch_as::<Row>(&mut *transaction);
    while let Some((
        attempt,
        order,
        shop,
        order_status,
        order_amount,
        attempt_status,
        attempt_amount,
        failure_reason,
        refund_status,
        refund_amount,
    )) = attempts.try_next().await?
    {
        let mut differ = |check: &'static str, reference: String, expected: i64, actual: i64| {
            findings.note(AuditDifference {
                check,
                sku: None,
                warehouse: None,
                reference: Some(reference),
                shop: Some(shop.clone()),
                expected,
                actual,
            });
        };
        let charged_twice = failure_reason.starts_with(domain::SECOND_CHARGE_REASON_PREFIX);
        let agrees = match (
            OrderStatus::parse(&order_status),
            AttemptStatus::parse(&attempt_status),
            refund_status
                .as_deref()
                .map(RefundStatus::parse)
                .transpose(),
        ) {
            (Ok(order), Ok(status), Ok(refund)) => {
                domain::refund_agrees(order, status, charged_twice, refund)
            }
            // A status no table knows is a hand edit: a difference.
            _ => false,
        };
        if !agrees {
            differ(
                "payment_vs_refund",
                format!(
                    "{order}: order {order_status}, attempt {attempt} {attempt_status}{}, refund {}",
                    if charged_twice {
                        " (a second charge)"
                    } else {
                        ""
                    },
                    refund_status.as_deref().unwrap_or("none")
                ),
                1,
                0,
            );
        }
        if attempt_amount != order_amount {
            differ(
                "payment_amount_vs_order",
                format!("{order}: attempt {attempt}"),
                order_amount,
                attempt_amount,
            );
        }
        if refund_status.is_some() && refund_amount != attempt_amount {
            differ(
                "refund_amount_vs_payment",
                format!("{order}: attempt {attempt}"),
                attempt_amount,
                refund_amount,
            );
        }
    }
    drop(attempts);
    Ok(())
}

/// Every return against what its order sold.
pub(crate) async fn audit_returns<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    // Returned goods against what their order sold: a return puts back only units
    // that left stock (a confirmed reservation), at most as many as were sold. A
    // `return` row for anything else would make counters and ledger agree on stock
    // created from nothing.
    let mut returns = statement(AUDIT_RETURNS)
        .fetch_as::<(String, String, String, i64, i64, i64)>(&mut *transaction);
    while let Some((order, sku, warehouse, returned, smallest, sold)) = returns.try_next().await? {
        // A return only ever puts units back: a row taking them away would lose stock
        // with counters and ledger agreeing, and hide inside a sum that still fits.
        if smallest <= 0 {
            findings.note(AuditDifference {
                check: "return_not_an_increase",
                sku: Some(sku.clone()),
                warehouse: Some(warehouse.clone()),
                reference: Some(order.clone()),
                shop: None,
                expected: 1,
                actual: smallest,
            });
        }
        if returned > sold {
            findings.note(AuditDifference {
                check: "returned_more_than_sold",
                sku: Some(sku),
                warehouse: Some(warehouse),
                reference: Some(order),
                shop: None,
                expected: sold,
                actual: returned,
            });
        }
    }
    drop(returns);
    Ok(())
}

pub(crate) async fn audit_order_lines<C: Dialect>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    let mut lines = statement(AUDIT_ORDER_LINES)
        .fetch_as::<(String, String, String, i64, i64)>(&mut *transaction);
    while let Some((order, sku, warehouse, ordered, held)) = lines.try_next().await? {
        findings.note(AuditDifference {
            check: "order_line_vs_reservation_line",
            sku: Some(sku),
            warehouse: Some(warehouse),
            reference: Some(order),
            shop: None,
            expected: held,
            actual: ordered,
        });
    }
    drop(lines);
    let mut amounts =
        statement(AUDIT_ORDER_AMOUNTS).fetch_as::<(String, String, i64, i64)>(&mut *transaction);
    while let Some((order, shop, amount, priced)) = amounts.try_next().await? {
        findings.note(AuditDifference {
            check: "order_amount_vs_lines",
            sku: None,
            warehouse: None,
            reference: Some(order),
            shop: Some(shop),
            expected: priced,
            actual: amount,
        });
    }
    drop(amounts);
    Ok(())
}

/// The tables `contents` dumps, each with the query that lists its rows in a fixed
/// order (NULLs spelled as values, so every cell is text or an integer).
const CONTENTS_QUERIES: &[(&str, &str)] = &[
    (
        "sku",
        "SELECT code, shop, title, COALESCE(price_minor, -1), COALESCE(currency, ''), low_stock_threshold, \
         COALESCE(per_user_limit, -1), sale_status, version FROM sku ORDER BY code",
    ),
    (
        "stock",
        "SELECT sku, warehouse, available, reserved, version FROM stock ORDER BY sku, warehouse",
    ),
    (
        "reservation",
        "SELECT id, status, COALESCE(release_reason, ''), expires_at, COALESCE(shop, ''), \
         COALESCE(user_id, ''), COALESCE(order_id, '') FROM reservation ORDER BY id",
    ),
    (
        "reservation_line",
        "SELECT reservation_id, line_number, sku, warehouse, quantity FROM reservation_line ORDER BY reservation_id, line_number",
    ),
    (
        "campaign",
        "SELECT id, sku, warehouse, quantity, buckets, COALESCE(per_user_limit, -1), returned, \
         COALESCE(ended_at, -1), COALESCE(closed_at, -1) FROM campaign ORDER BY id",
    ),
    (
        "customer_order",
        "SELECT id, shop, user_id, status, amount_minor, currency, reservation_id, expires_at, version FROM customer_order ORDER BY id",
    ),
    (
        "order_line",
        "SELECT order_id, line_number, sku, warehouse, quantity, unit_price_minor FROM order_line ORDER BY order_id, line_number",
    ),
    (
        "order_history",
        "SELECT order_id, COALESCE(from_status, ''), to_status, reason FROM order_history ORDER BY id",
    ),
    (
        "payment_attempt",
        "SELECT id, order_id, gateway_key, status, COALESCE(gateway_payment_id, ''), amount_minor FROM payment_attempt ORDER BY id",
    ),
    (
        "webhook_event",
        "SELECT event_id, event_type, COALESCE(gateway_payment_id, ''), outcome FROM webhook_event ORDER BY event_id",
    ),
    (
        "refund",
        "SELECT id, order_id, status, amount_minor, COALESCE(gateway_refund_id, '') FROM refund ORDER BY id",
    ),
    (
        "order_reference",
        "SELECT reservation_id, shop, COALESCE(order_ref, ''), COALESCE(source, ''), created_at \
         FROM order_reference ORDER BY reservation_id",
    ),
    (
        "order_return",
        "SELECT order_id FROM order_return ORDER BY order_id",
    ),
    (
        "product",
        "SELECT id, title, COALESCE(image_url, ''), category, supplier, shop, version, COALESCE(deleted_at, -1) FROM product ORDER BY id",
    ),
    (
        "shelf_log",
        "SELECT id, COALESCE(product_id, ''), sku, operator_id, operator_type, from_status, to_status, operation, repeated, remark FROM shelf_log ORDER BY id",
    ),
    (
        "shelf_schedule",
        "SELECT id, sku, operation, due_at, status, operator_id, COALESCE(shop, ''), remark, outcome FROM shelf_schedule ORDER BY id",
    ),
    (
        "credential",
        "SELECT kind, id, name, COALESCE(shop, ''), secret_hash, COALESCE(revoked_at, -1) FROM credential ORDER BY kind, id",
    ),
    (
        "cart_item",
        "SELECT shop, user_id, sku, quantity FROM cart_item ORDER BY user_id, sku",
    ),
    (
        "shopper_hold",
        "SELECT shop, user_id, open_holds FROM shopper_hold ORDER BY shop, user_id",
    ),
    (
        "shopper_purchase",
        "SELECT shop, user_id, sku, quantity FROM shopper_purchase ORDER BY shop, user_id, sku",
    ),
    (
        "outbox",
        "SELECT aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at FROM outbox \
         ORDER BY aggregate, aggregate_id, sequence",
    ),
    (
        "outbox_sequence",
        "SELECT aggregate, aggregate_id, last_sequence FROM outbox_sequence ORDER BY aggregate, aggregate_id",
    ),
    (
        "stock_ledger",
        "SELECT id, sku, warehouse, kind, available_delta, reserved_delta, reference FROM stock_ledger ORDER BY id",
    ),
    (
        "idempotency_record",
        "SELECT key, fingerprint, status_code, body FROM idempotency_record ORDER BY key",
    ),
];

impl<B: Backend> Units<B> {
    /// Replays the ledger and compares it with the counters and the reservations, on
    /// one consistent snapshot.
    pub async fn audit(
        &self,
        now: Timestamp,
        shop: Option<&ShopCode>,
    ) -> Result<AuditReport, StoreError> {
        let mut transaction = self.begin_snapshot().await?;
        let mut findings = Findings::default();
        if let Some(shop) = shop {
            let skus: std::collections::HashSet<String> =
                statement("SELECT code FROM sku WHERE shop = $1")
                    .bind(shop.as_str())
                    .fetch_all_as::<(String,)>(&mut *transaction)
                    .await?
                    .into_iter()
                    .map(|(code,)| code)
                    .collect();
            findings.scope = Some(ShopScope {
                shop: shop.as_str().to_owned(),
                skus,
            });
        }
        let stock_rows_checked = audit_stock_rows(&mut *transaction, &mut findings).await?;
        audit_missing_stock_rows(&mut *transaction, &mut findings).await?;
        let reservation_lines_checked =
            audit_reservation_lines(&mut *transaction, &mut findings).await?;
        audit_orphan_ledger_rows(&mut *transaction, &mut findings).await?;
        let orders_checked = audit_orders(&mut *transaction, &mut findings).await?;
        audit_returns(&mut *transaction, &mut findings).await?;
        audit_payments_and_refunds(&mut *transaction, &mut findings).await?;
        audit_order_lines(&mut *transaction, &mut findings).await?;
        audit_campaigns(&mut *transaction, &mut findings).await?;
        let ledger_rows_checked: i64 = statement("SELECT COUNT(*) FROM stock_ledger")
            .fetch_one_scalar(&mut *transaction)
            .await?;
        transaction.rollback().await?;
        Ok(AuditReport {
            checked_at: now,
            stock_rows_checked,
            reservation_lines_checked,
            orders_checked,
            ledger_rows_checked,
            differences: findings.differences,
            differences_total: findings.total,
        })
    }

    /// Every row of every table, in a fixed order, as text. Tests compare it before and
    /// after a refused request to prove nothing changed; operators can diff two dumps.
    pub async fn contents(&self) -> Result<String, StoreError> {
        let mut text = String::new();
        for (table, query) in CONTENTS_QUERIES.iter().copied() {
            text.push_str(table);
            text.push('\n');
            let rows = statement(query)
                .fetch_all_rows(&mut *self.writer_read_connection().await?)
                .await?;
            for row in &rows {
                let mut cells = Vec::new();
                for cell in &row.cells {
                    cells.push(match cell {
                        Cell::Integer(number) => number.to_string(),
                        Cell::Text(text) => text.clone(),
                        Cell::Null => "NULL".to_owned(),
                    });
                }
                text.push_str(&cells.join("|"));
                text.push('\n');
            }
        }
        Ok(text)
    }
}

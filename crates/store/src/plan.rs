//! Deciding a reservation batch in memory, after its stock rows are locked and before
//! anything is written. Pure, so the all-or-nothing and arrival-order rules are tested
//! without a database.

use std::collections::{BTreeMap, HashMap};

use domain::{ErrorCode, ReservationLine, SaleStatus, SkuCode, WarehouseCode};

use crate::model::Rejection;

pub type StockKey = (SkuCode, WarehouseCode);

/// The batch's decisions: one per request, in arrival order, and the total each stock
/// row must give up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    pub decisions: Vec<Result<(), Rejection>>,
    /// Units taken from each row by the accepted requests; rows with nothing taken are
    /// absent. Ordered by (sku, warehouse): the order rows are written in.
    pub totals: BTreeMap<StockKey, i64>,
}

/// Accepts each request, in order, when every one of its lines fits in what the
/// requests before it left; otherwise refuses it whole, taking nothing.
///
/// `sale_statuses` holds the SKUs that exist; `available` the locked rows' counters (a
/// missing row has nothing available).
pub fn plan_batch<'a>(
    requests: impl IntoIterator<Item = &'a [ReservationLine]>,
    sale_statuses: &HashMap<SkuCode, SaleStatus>,
    available: &BTreeMap<StockKey, i64>,
) -> BatchPlan {
    let mut remaining = available.clone();
    let mut totals: BTreeMap<StockKey, i64> = BTreeMap::new();
    let mut decisions = Vec::new();
    for lines in requests {
        let decision = check_request(lines, sale_statuses, &remaining);
        if decision.is_ok() {
            for line in lines {
                let key = (line.sku.clone(), line.warehouse.clone());
                let quantity = line.quantity.get();
                *remaining.entry(key.clone()).or_insert(0) -= quantity;
                *totals.entry(key).or_insert(0) += quantity;
            }
        }
        decisions.push(decision);
    }
    BatchPlan { decisions, totals }
}

/// What the batch would take from each row if every request were accepted: the sum of
/// its lines per (sku, warehouse).
///
/// When every row holds at least its total and every SKU is on sale, [`plan_batch`]
/// accepts every request with exactly these totals (each request fits in what the ones
/// before it left, since what is left covers all the requests still to come). That is
/// what lets the whole-batch fast path check totals instead of deciding per request.
pub fn totals_if_all_accepted<'a>(
    requests: impl IntoIterator<Item = &'a [ReservationLine]>,
) -> BTreeMap<StockKey, i64> {
    let mut totals: BTreeMap<StockKey, i64> = BTreeMap::new();
    for line in requests.into_iter().flatten() {
        *totals
            .entry((line.sku.clone(), line.warehouse.clone()))
            .or_insert(0) += line.quantity.get();
    }
    totals
}

fn check_request(
    lines: &[ReservationLine],
    sale_statuses: &HashMap<SkuCode, SaleStatus>,
    remaining: &BTreeMap<StockKey, i64>,
) -> Result<(), Rejection> {
    for line in lines {
        match sale_statuses.get(&line.sku) {
            None => {
                return Err(Rejection::new(
                    ErrorCode::NotFound,
                    format!("sku '{}' does not exist", line.sku),
                ));
            }
            Some(status) if !status.is_sellable() => {
                return Err(Rejection::new(
                    ErrorCode::OffShelf,
                    format!(
                        "sku '{}' is not on sale (status {})",
                        line.sku,
                        status.as_str()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    for line in lines {
        let key = (line.sku.clone(), line.warehouse.clone());
        let left = remaining.get(&key).copied().unwrap_or(0);
        if left < line.quantity.get() {
            return Err(Rejection::new(
                ErrorCode::InsufficientStock,
                format!(
                    "sku '{}' in warehouse '{}': requested {}, available {}",
                    line.sku,
                    line.warehouse,
                    line.quantity.get(),
                    left.max(0)
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use domain::Quantity;

    fn line(sku: &str, quantity: i64) -> ReservationLine {
        ReservationLine {
            sku: SkuCode::parse(sku).unwrap(),
            warehouse: WarehouseCode::default_warehouse(),
            quantity: Quantity::new(quantity).unwrap(),
        }
    }

    fn key(sku: &str) -> StockKey {
        (
            SkuCode::parse(sku).unwrap(),
            WarehouseCode::default_warehouse(),
        )
    }

    fn on_shelf(skus: &[&str]) -> HashMap<SkuCode, SaleStatus> {
        skus.iter()
            .map(|sku| (SkuCode::parse(sku).unwrap(), SaleStatus::OnShelf))
            .collect()
    }

    #[test]
    fn requests_are_served_in_arrival_order_until_stock_runs_out() {
        let requests = [vec![line("A", 2)], vec![line("A", 2)], vec![line("A", 1)]];
        let available = BTreeMap::from([(key("A"), 3)]);
        let plan = plan_batch(
            requests.iter().map(Vec::as_slice),
            &on_shelf(&["A"]),
            &available,
        );
        assert!(plan.decisions[0].is_ok());
        assert_eq!(
            plan.decisions[1].as_ref().unwrap_err().code,
            ErrorCode::InsufficientStock
        );
        assert!(plan.decisions[2].is_ok());
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 3)]));
    }

    #[test]
    fn a_refused_multi_line_request_takes_nothing_from_any_line() {
        let requests = [vec![line("A", 1), line("B", 5)], vec![line("A", 1)]];
        let available = BTreeMap::from([(key("A"), 1), (key("B"), 4)]);
        let plan = plan_batch(
            requests.iter().map(Vec::as_slice),
            &on_shelf(&["A", "B"]),
            &available,
        );
        assert!(plan.decisions[0].is_err());
        assert!(plan.decisions[1].is_ok());
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 1)]));
    }

    #[test]
    fn unknown_and_off_shelf_skus_are_refused_with_their_own_codes() {
        let mut statuses = on_shelf(&["A"]);
        statuses.insert(SkuCode::parse("OFF").unwrap(), SaleStatus::OffShelf);
        let requests = [vec![line("MISSING", 1)], vec![line("OFF", 1)]];
        let available = BTreeMap::from([(key("OFF"), 10)]);
        let plan = plan_batch(requests.iter().map(Vec::as_slice), &statuses, &available);
        assert_eq!(
            plan.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::NotFound
        );
        assert_eq!(
            plan.decisions[1].as_ref().unwrap_err().code,
            ErrorCode::OffShelf
        );
        assert!(plan.totals.is_empty());
    }

    #[test]
    fn a_batch_whose_rows_hold_its_totals_is_accepted_whole_with_those_totals() {
        let requests = [
            vec![line("A", 2), line("B", 1)],
            vec![line("A", 3)],
            vec![line("B", 4), line("C", 1)],
            vec![line("A", 1)],
        ];
        let totals = totals_if_all_accepted(requests.iter().map(Vec::as_slice));
        assert_eq!(
            totals,
            BTreeMap::from([(key("A"), 6), (key("B"), 5), (key("C"), 1)])
        );
        // Exactly the totals available: every request fits, in any order.
        let plan = plan_batch(
            requests.iter().map(Vec::as_slice),
            &on_shelf(&["A", "B", "C"]),
            &totals,
        );
        assert!(plan.decisions.iter().all(Result::is_ok));
        assert_eq!(plan.totals, totals);
        // One unit short on one row: not every request fits any more.
        let mut short = totals.clone();
        short.insert(key("B"), 4);
        let plan = plan_batch(
            requests.iter().map(Vec::as_slice),
            &on_shelf(&["A", "B", "C"]),
            &short,
        );
        assert!(plan.decisions.iter().any(Result::is_err));
    }

    #[test]
    fn a_row_that_does_not_exist_has_nothing_available() {
        let requests = [vec![line("A", 1)]];
        let plan = plan_batch(
            requests.iter().map(Vec::as_slice),
            &on_shelf(&["A"]),
            &BTreeMap::new(),
        );
        assert_eq!(
            plan.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::InsufficientStock
        );
    }
}

/// What the whole-batch fast path did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WholeBatch {
    /// Every request was accepted, written and committed.
    Applied,
    /// Nothing was written: the batch needs deciding request by request.
    NotApplied,
}

/// What writing a decided batch changed, for the caller to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchWritten {
    /// Stock rows whose conditional update matched.
    pub rows_taken: u64,
    /// Idempotency records inserted (a key committed meanwhile by another process is
    /// skipped, and the caller retries the batch).
    pub records_stored: u64,
}

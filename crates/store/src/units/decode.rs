//! Reading stored values back: parsing what a row holds into domain types, and the
//! errors that say a stored value or an expected row was not what the store wrote.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use std::collections::{BTreeMap, HashMap};

use crate::backend::LockedStock;
use crate::error::StoreError;
use crate::model::StoredResponse;
use crate::plan::{PurchaseKey, ShopperKey, SkuFacts};
use crate::sql::{Cell, Row};
use domain::{Currency, PriceMinor, SaleStatus, ShopCode, SkuCode, WarehouseCode};

pub(crate) fn invariant(message: impl Into<String>) -> StoreError {
    StoreError::Invariant(message.into())
}

pub(crate) fn corrupt(what: &str, error: impl std::fmt::Display) -> StoreError {
    StoreError::Invariant(format!("stored {what} does not parse: {error}"))
}

pub(crate) fn expect_one_row(rows_affected: u64, what: &str) -> Result<(), StoreError> {
    if rows_affected == 1 {
        Ok(())
    } else {
        Err(invariant(format!(
            "{what}: expected 1 row, changed {rows_affected}"
        )))
    }
}

/// A shopper's tally key (`shopper_hold`'s or `shopper_purchase`'s), as the text of its
/// key columns in the table's order.
pub(crate) trait TallyKey: Clone + Eq + std::hash::Hash {
    fn columns(&self) -> Vec<&str>;
}

impl TallyKey for ShopperKey {
    fn columns(&self) -> Vec<&str> {
        vec![self.0.as_str(), self.1.as_str()]
    }
}

impl TallyKey for PurchaseKey {
    fn columns(&self) -> Vec<&str> {
        vec![self.0.as_str(), self.1.as_str(), self.2.as_str()]
    }
}

/// Tally rows read back (their key columns as text, then the count), matched to the
/// keys asked for. A row of a key nobody asked for means the statement is wrong.
pub(crate) fn tallies_of<K: TallyKey>(
    asked: &[K],
    found: &[Row],
) -> Result<HashMap<K, i64>, StoreError> {
    let wanted: HashMap<Vec<&str>, &K> = asked.iter().map(|key| (key.columns(), key)).collect();
    let mut tallies = HashMap::with_capacity(found.len());
    for row in found {
        let width = row.cells.len().saturating_sub(1);
        let columns = (0..width)
            .map(|column| row.try_get::<String, _>(column))
            .collect::<Result<Vec<String>, StoreError>>()?;
        let count: i64 = row.try_get(width)?;
        let text: Vec<&str> = columns.iter().map(String::as_str).collect();
        let key = wanted.get(&text).ok_or_else(|| {
            invariant(format!("a tally of ({}) nobody asked for", text.join(", ")))
        })?;
        tallies.insert((*key).clone(), count);
    }
    Ok(tallies)
}

/// The rows of a statement that reads both kinds of tally (shop, user, SKU, count),
/// split by kind: a row without a SKU is an open-hold tally (shop, user, count), the
/// others purchases, as [`tallies_of`] reads each.
pub(crate) fn split_tally_rows(rows: Vec<Row>) -> (Vec<Row>, Vec<Row>) {
    let (holds, purchases): (Vec<Row>, Vec<Row>) = rows
        .into_iter()
        .partition(|row| matches!(row.cells.get(2), Some(Cell::Null)));
    // An open-hold row loses its SKU column, in its names as in its cells, so it
    // reads like a row of the open-hold statement.
    let names: std::sync::Arc<[String]> = holds
        .first()
        .map(|row| {
            row.names
                .iter()
                .enumerate()
                .filter(|(position, _)| *position != 2)
                .map(|(_, name)| name.clone())
                .collect()
        })
        .unwrap_or_else(|| std::sync::Arc::from([]));
    let holds = holds
        .into_iter()
        .map(|mut row| {
            row.cells.remove(2);
            row.names = std::sync::Arc::clone(&names);
            row
        })
        .collect();
    (holds, purchases)
}

/// A SKU's facts as the reserving transaction reads them with its stock rows.
pub(crate) fn decode_sku_facts(
    status: &str,
    shop: &str,
    per_user_limit: Option<i64>,
) -> Result<SkuFacts, StoreError> {
    Ok(SkuFacts {
        sale_status: SaleStatus::parse(status).map_err(|error| corrupt("sale status", error))?,
        shop: ShopCode::parse(shop).map_err(|error| corrupt("shop", error))?,
        per_user_limit,
    })
}

/// The wall clock, only for bookkeeping columns no rule reads (`applied_at`).
pub(crate) fn wall_clock_milliseconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[allow(unused_imports)]
/// 64 bits for an id minted inside a unit of work, derived from what the id is for
/// (FNV-1a): an order has at most one late-success reservation and one refund, so
/// the (time, order) pair never repeats.
pub(crate) fn derived_random(seed: &str, purpose: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in seed.bytes().chain(purpose.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

pub(crate) fn parse_stored<T>(
    what: &str,
    text: &str,
    parse: impl Fn(&str) -> Result<T, domain::ParseError>,
) -> Result<T, StoreError> {
    parse(text).map_err(|error| corrupt(what, error))
}

/// A stored idempotency record's response: none while its unit of work has not
/// committed (status 0), else the status and body it answered.
pub(crate) fn stored_response(
    status_code: i64,
    body: String,
) -> Result<Option<StoredResponse>, StoreError> {
    if status_code == 0 {
        return Ok(None);
    }
    let status = u16::try_from(status_code).map_err(|error| corrupt("status code", error))?;
    Ok(Some(StoredResponse { status, body }))
}

/// A locked stock row as the backends read it: sku, warehouse, available, and its SKU's
/// sale status, shop and per-user limit.
pub(crate) type LockedStockRow = (String, String, i64, String, String, Option<i64>);

/// A SKU's facts as the backends read them: code, sale status, shop, per-user limit.
pub(crate) type SkuFactsRow = (String, String, String, Option<i64>);

/// The locked rows' available counts and their SKUs' facts.
pub(crate) fn locked_stock_of(found: Vec<LockedStockRow>) -> Result<LockedStock, StoreError> {
    let mut available = BTreeMap::new();
    let mut facts = HashMap::new();
    for (sku, warehouse, count, status, shop, per_user_limit) in found {
        let (sku, warehouse) = stock_key_of(&sku, &warehouse)?;
        facts.insert(
            sku.clone(),
            decode_sku_facts(&status, &shop, per_user_limit)?,
        );
        available.insert((sku, warehouse), count);
    }
    Ok((available, facts))
}

/// A stock row's (sku, warehouse) as stored.
pub(crate) fn stock_key_of(
    sku: &str,
    warehouse: &str,
) -> Result<crate::plan::StockKey, StoreError> {
    Ok((
        SkuCode::parse(sku).map_err(|error| corrupt("sku code", error))?,
        WarehouseCode::parse(warehouse).map_err(|error| corrupt("warehouse", error))?,
    ))
}

/// The SKUs' facts, by code.
pub(crate) fn sku_facts_of(
    found: Vec<SkuFactsRow>,
) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
    let mut facts = HashMap::with_capacity(found.len());
    for (code, status, shop, per_user_limit) in found {
        facts.insert(
            SkuCode::parse(&code).map_err(|error| corrupt("sku code", error))?,
            decode_sku_facts(&status, &shop, per_user_limit)?,
        );
    }
    Ok(facts)
}

/// A SKU's stored price and currency (`price_minor`, `currency`; either may be unset).
pub(crate) fn price_of(row: &Row) -> Result<(Option<PriceMinor>, Option<Currency>), StoreError> {
    let price: Option<i64> = row.try_get("price_minor")?;
    let currency: Option<String> = row.try_get("currency")?;
    Ok((
        price
            .map(PriceMinor::new)
            .transpose()
            .map_err(|error| corrupt("price", error))?,
        currency
            .as_deref()
            .map(|text| parse_stored("currency", text, Currency::parse))
            .transpose()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn row(cells: Vec<Cell>) -> Row {
        let names: Arc<[String]> = ["shop", "user_id", "sku", "count"]
            .iter()
            .map(|name| (*name).to_owned())
            .collect();
        Row { names, cells }
    }

    fn text(value: &str) -> Cell {
        Cell::Text(value.to_owned())
    }

    #[test]
    fn both_kinds_of_tally_read_together_come_apart_by_whether_a_row_names_a_sku() {
        let shopper: ShopperKey = (
            ShopCode::parse("default").unwrap(),
            domain::UserId::parse("u-1").unwrap(),
        );
        let purchase: PurchaseKey = (
            shopper.0.clone(),
            shopper.1.clone(),
            SkuCode::parse("tea").unwrap(),
        );
        let (holds, purchases) = split_tally_rows(vec![
            row(vec![
                text("default"),
                text("u-1"),
                Cell::Null,
                Cell::Integer(2),
            ]),
            row(vec![
                text("default"),
                text("u-1"),
                text("tea"),
                Cell::Integer(1),
            ]),
        ]);
        assert_eq!(holds[0].names.len(), holds[0].cells.len());
        let holds = tallies_of(std::slice::from_ref(&shopper), &holds).unwrap();
        let purchases = tallies_of(std::slice::from_ref(&purchase), &purchases).unwrap();
        assert_eq!(holds.get(&shopper), Some(&2));
        assert_eq!(purchases.get(&purchase), Some(&1));
        assert_eq!((holds.len(), purchases.len()), (1, 1));
    }
}

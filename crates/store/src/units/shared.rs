//! Idempotency, stock, reservations, the audit and migrations: the units of work of
//! the first wave, written once for every backend (see `crate::backend`).
//!
//! Placeholders are `$1`, `$2`, …; a backend whose driver spells them otherwise
//! rewrites them. Every statement that changes stock checks its affected-row count.

use std::collections::HashMap;

use domain::{
    AttemptStatus, Currency, ErrorCode, OrderId, OrderStatus, PriceMinor, ProductId, Quantity,
    ReleaseReason, Reservation, ReservationId, ReservationLine, ReservationStatus, SaleStatus,
    ShopCode, Sku, SkuCode, StockLevel, Timestamp, UserId, WarehouseCode,
};
use futures_util::TryStreamExt;

use super::Units;
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{
    AUDIT_DIFFERENCES_REPORTED_MAX, AuditDifference, AuditReport, BatchApplied, BatchPath,
    ExpiryOutcome, IdempotencyClaim, Idempotent, LockTurn, MovementRecord, Rejection,
    ReservationAction, ReservationGauges, ReserveRequest, ResponseRenderer, ScopedKey, ShopScope,
    SkuChanges, StockMovement, StoredResponse,
};
use crate::plan::{
    PlanRequest, PurchaseKey, ShopperKey, SkuFacts, StockKey, Tallies, WholeBatch, plan_batch,
    totals_if_all_accepted,
};
use crate::sql::{Cell, Connection, Row, statement};

/// The largest `available + reserved` a row may reach; see `domain::limits`.
pub(crate) const STOCK_ON_HAND_MAX: i64 = domain::limits::STOCK_ON_HAND_MAX;

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
     CAST(SUM(ledger.available_delta) AS BIGINT), \
     CAST(COALESCE((SELECT SUM(line.quantity) FROM customer_order \
         JOIN reservation ON reservation.id = customer_order.reservation_id \
             AND reservation.status = 'CONFIRMED' \
         JOIN reservation_line line ON line.reservation_id = reservation.id \
             AND line.sku = ledger.sku AND line.warehouse = ledger.warehouse \
         WHERE customer_order.id = ledger.reference), 0) AS BIGINT) \
     FROM stock_ledger ledger WHERE ledger.kind = 'return' \
     GROUP BY ledger.reference, ledger.sku, ledger.warehouse \
     ORDER BY ledger.reference, ledger.sku, ledger.warehouse";

/// What a key's claim found.
pub(crate) enum Claim {
    /// This transaction now holds the key.
    Taken,
    /// The key has a committed record (or, within one batch, an earlier request's claim).
    Existing {
        fingerprint: String,
        response: Option<StoredResponse>,
    },
}

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

/// Claims an idempotency key inside `transaction`. On PostgreSQL a concurrent
/// uncommitted claim of the same key makes this wait (bounded by `lock_timeout`), which
/// is reported as [`StoreError::KeyInFlight`].
pub(crate) async fn claim_key<C: Connection>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    now: Timestamp,
) -> Result<Claim, StoreError> {
    let inserted = statement(
        "INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
         VALUES ($1, $2, 0, '', $3) ON CONFLICT (key) DO NOTHING",
    )
    .bind(claim.key.as_str())
    .bind(&claim.fingerprint)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await
    .map_err(|error| match error {
        StoreError::LockTimeout(_) => StoreError::KeyInFlight,
        other => other,
    })?;
    if inserted == 1 {
        return Ok(Claim::Taken);
    }
    let row =
        statement("SELECT fingerprint, status_code, body FROM idempotency_record WHERE key = $1")
            .bind(claim.key.as_str())
            .fetch_one_row(&mut *transaction)
            .await?;
    let status_code: i64 = row.try_get("status_code")?;
    let response = if status_code == 0 {
        None
    } else {
        let status = u16::try_from(status_code).map_err(|error| corrupt("status code", error))?;
        Some(StoredResponse {
            status,
            body: row.try_get("body")?,
        })
    };
    Ok(Claim::Existing {
        fingerprint: row.try_get("fingerprint")?,
        response,
    })
}

/// The answer for a key that already has a committed record.
pub(crate) fn resolve_existing(
    claim: &IdempotencyClaim,
    fingerprint: &str,
    response: Option<StoredResponse>,
) -> Result<Idempotent, StoreError> {
    if fingerprint != claim.fingerprint {
        return Ok(Idempotent::KeyReused);
    }
    response
        .map(Idempotent::Replayed)
        .ok_or_else(|| invariant("an idempotency claim without a response was visible"))
}

/// Claims `claim`'s key in this transaction, the opening of every keyed unit of work.
/// `Some` is the answer a retry gets (the stored response, or "key reused"): the
/// caller rolls back and returns it, having changed nothing.
pub(crate) async fn claim_or_answer<C: Connection>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    now: Timestamp,
) -> Result<Option<Idempotent>, StoreError> {
    match claim_key(transaction, claim, now).await? {
        Claim::Taken => Ok(None),
        Claim::Existing {
            fingerprint,
            response,
        } => resolve_existing(claim, &fingerprint, response).map(Some),
    }
}

/// Stores the response for a key claimed by this transaction.
pub(crate) async fn complete_claim<C: Connection>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let updated = statement(
        "UPDATE idempotency_record SET status_code = $2, body = $3 \
         WHERE key = $1 AND status_code = 0",
    )
    .bind(claim.key.as_str())
    .bind(i64::from(response.status))
    .bind(&response.body)
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "completing an idempotency claim")
}

/// One append-only ledger row: a change of a (sku, warehouse) row's counters and what
/// caused it.
pub(crate) struct LedgerEntry<'a> {
    pub(crate) sku: &'a SkuCode,
    pub(crate) warehouse: &'a WarehouseCode,
    pub(crate) kind: &'static str,
    pub(crate) available_delta: i64,
    pub(crate) reserved_delta: i64,
    /// The reservation or movement id that caused the change.
    pub(crate) reference: &'a str,
    pub(crate) idempotency_key: Option<&'a str>,
}

pub(crate) async fn insert_ledger_row<C: Connection>(
    transaction: &mut C,
    entry: LedgerEntry<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    statement(
        "INSERT INTO stock_ledger \
         (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(entry.sku.as_str())
    .bind(entry.warehouse.as_str())
    .bind(entry.kind)
    .bind(entry.available_delta)
    .bind(entry.reserved_delta)
    .bind(entry.reference)
    .bind(entry.idempotency_key)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

pub(crate) fn decode_sku_row(row: &Row, stock: Vec<StockLevel>) -> Result<Sku, StoreError> {
    let code: String = row.try_get("code")?;
    let shop: String = row.try_get("shop")?;
    let product_id: Option<String> = row.try_get("product_id")?;
    let price: Option<i64> = row.try_get("price_minor")?;
    let currency: Option<String> = row.try_get("currency")?;
    let sale_status: String = row.try_get("sale_status")?;
    Ok(Sku {
        code: SkuCode::parse(&code).map_err(|error| corrupt("sku code", error))?,
        product_id: product_id
            .as_deref()
            .map(ProductId::parse)
            .transpose()
            .map_err(|error| corrupt("product id", error))?,
        shop: ShopCode::parse(&shop).map_err(|error| corrupt("shop", error))?,
        title: row.try_get("title")?,
        spec: row.try_get("spec")?,
        price: price
            .map(PriceMinor::new)
            .transpose()
            .map_err(|error| corrupt("price", error))?,
        currency: currency
            .as_deref()
            .map(Currency::parse)
            .transpose()
            .map_err(|error| corrupt("currency", error))?,
        low_stock_threshold: row.try_get("low_stock_threshold")?,
        per_user_limit: row.try_get("per_user_limit")?,
        sale_status: SaleStatus::parse(&sale_status)
            .map_err(|error| corrupt("sale status", error))?,
        version: row.try_get("version")?,
        created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        updated_at: Timestamp::from_unix_milliseconds(row.try_get("updated_at")?),
        stock,
    })
}

pub(crate) async fn load_sku<C: Connection>(
    connection: &mut C,
    code: &SkuCode,
) -> Result<Option<Sku>, StoreError> {
    let Some(row) = statement(
        "SELECT code, product_id, shop, title, spec, price_minor, currency, low_stock_threshold, \
         per_user_limit, sale_status, version, created_at, updated_at FROM sku WHERE code = $1",
    )
    .bind(code.as_str())
    .fetch_optional_row(&mut *connection)
    .await?
    else {
        return Ok(None);
    };
    let stock_rows = statement(
        "SELECT warehouse, available, reserved FROM stock WHERE sku = $1 ORDER BY warehouse",
    )
    .bind(code.as_str())
    .fetch_all_rows(&mut *connection)
    .await?;
    let mut stock = Vec::with_capacity(stock_rows.len());
    for stock_row in &stock_rows {
        let warehouse: String = stock_row.try_get("warehouse")?;
        stock.push(StockLevel {
            warehouse: WarehouseCode::parse(&warehouse)
                .map_err(|error| corrupt("warehouse", error))?,
            available: stock_row.try_get("available")?,
            reserved: stock_row.try_get("reserved")?,
        });
    }
    decode_sku_row(&row, stock).map(Some)
}

pub(crate) async fn load_reservation<C: Connection>(
    connection: &mut C,
    id: &ReservationId,
) -> Result<Option<Reservation>, StoreError> {
    let Some(row) = statement(
        "SELECT status, release_reason, expires_at, created_at, updated_at, shop, user_id, order_id \
         FROM reservation WHERE id = $1",
    )
    .bind(id.as_str())
    .fetch_optional_row(&mut *connection)
    .await?
    else {
        return Ok(None);
    };
    let line_rows = statement(
        "SELECT sku, warehouse, quantity FROM reservation_line \
         WHERE reservation_id = $1 ORDER BY line_number",
    )
    .bind(id.as_str())
    .fetch_all_rows(&mut *connection)
    .await?;
    let mut lines = Vec::with_capacity(line_rows.len());
    for line_row in &line_rows {
        lines.push(decode_line(line_row)?);
    }
    let status: String = row.try_get("status")?;
    let release_reason: Option<String> = row.try_get("release_reason")?;
    let shop: Option<String> = row.try_get("shop")?;
    let user: Option<String> = row.try_get("user_id")?;
    let order_id: Option<String> = row.try_get("order_id")?;
    Ok(Some(Reservation {
        id: id.clone(),
        shop: shop
            .as_deref()
            .map(ShopCode::parse)
            .transpose()
            .map_err(|error| corrupt("shop", error))?,
        user: user
            .as_deref()
            .map(UserId::parse)
            .transpose()
            .map_err(|error| corrupt("user id", error))?,
        order_id: order_id
            .as_deref()
            .map(OrderId::parse)
            .transpose()
            .map_err(|error| corrupt("order id", error))?,
        status: ReservationStatus::parse(&status).map_err(|error| corrupt("status", error))?,
        release_reason: release_reason
            .as_deref()
            .map(ReleaseReason::parse)
            .transpose()
            .map_err(|error| corrupt("release reason", error))?,
        expires_at: Timestamp::from_unix_milliseconds(row.try_get("expires_at")?),
        created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        updated_at: Timestamp::from_unix_milliseconds(row.try_get("updated_at")?),
        lines,
    }))
}

pub(crate) fn decode_line(row: &Row) -> Result<ReservationLine, StoreError> {
    let sku: String = row.try_get("sku")?;
    let warehouse: String = row.try_get("warehouse")?;
    Ok(ReservationLine {
        sku: SkuCode::parse(&sku).map_err(|error| corrupt("sku code", error))?,
        warehouse: WarehouseCode::parse(&warehouse).map_err(|error| corrupt("warehouse", error))?,
        quantity: Quantity::new(row.try_get("quantity")?)
            .map_err(|error| corrupt("quantity", error))?,
    })
}

/// Moves `quantity` units of a line between `available` and `reserved` (release) or out
/// of `reserved` (confirm), guarded so a counter can never go below zero.
pub(crate) async fn settle_line<C: Connection>(
    transaction: &mut C,
    line: &ReservationLine,
    action: ReservationAction,
    reservation: &ReservationId,
    now: Timestamp,
) -> Result<(), StoreError> {
    let quantity = line.quantity.get();
    let (text, kind, available_delta) = match action {
        ReservationAction::Confirm => (
            "UPDATE stock SET reserved = reserved - $3, version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2 AND reserved >= $3",
            "confirm",
            0,
        ),
        ReservationAction::Release => (
            "UPDATE stock SET available = available + $3, reserved = reserved - $3, \
             version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2 AND reserved >= $3",
            "release",
            quantity,
        ),
    };
    let updated = statement(text)
        .bind(line.sku.as_str())
        .bind(line.warehouse.as_str())
        .bind(quantity)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
    expect_one_row(updated, "settling a reservation line")?;
    insert_ledger_row(
        transaction,
        LedgerEntry {
            sku: &line.sku,
            warehouse: &line.warehouse,
            kind,
            available_delta,
            reserved_delta: -quantity,
            reference: reservation.as_str(),
            idempotency_key: None,
        },
        now,
    )
    .await
}

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

/// The reservation a request creates, as its answer shows it.
pub(crate) fn new_reservation(
    request: &ReserveRequest,
    shop: Option<&ShopCode>,
    now: Timestamp,
) -> Reservation {
    let shop = shop.or(match &request.shop {
        ShopScope::Verified(shop) | ShopScope::Required(shop) => Some(shop),
        ShopScope::Any => None,
    });
    Reservation {
        id: request.id.clone(),
        shop: shop.cloned(),
        user: request.user.clone(),
        order_id: None,
        status: ReservationStatus::Reserved,
        release_reason: None,
        expires_at: request.expires_at,
        created_at: now,
        updated_at: now,
        lines: request.lines.clone(),
    }
}

/// `skus` completed with the SKUs of `wanted` that have no stock row yet (or none in
/// that warehouse): they still need their facts, to tell `not_found` from
/// `insufficient_stock`.
pub(crate) async fn with_unlisted_skus<C: Connection>(
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

/// Locks and reads the tallies of the shoppers that `requests` name (open holds, and
/// units of SKUs with a per-user limit), in key order. Reservations without a user
/// read nothing.
pub(crate) async fn lock_tallies<'a, C: Connection>(
    transaction: &mut C,
    requests: impl Iterator<Item = &'a ReserveRequest>,
    skus: &HashMap<SkuCode, SkuFacts>,
    open_holds_max: i64,
) -> Result<Tallies, StoreError> {
    let mut shoppers: Vec<ShopperKey> = Vec::new();
    let mut purchases: Vec<PurchaseKey> = Vec::new();
    for request in requests {
        let Some(user) = &request.user else { continue };
        // The shop the request will be decided in: its first SKU's (a request of
        // several shops is refused anyway).
        let Some(shop) = request
            .lines
            .first()
            .and_then(|line| skus.get(&line.sku))
            .map(|facts| facts.shop.clone())
        else {
            continue;
        };
        for line in &request.lines {
            if skus
                .get(&line.sku)
                .is_some_and(|facts| facts.per_user_limit.is_some())
            {
                purchases.push((shop.clone(), user.clone(), line.sku.clone()));
            }
        }
        shoppers.push((shop, user.clone()));
    }
    read_tallies(transaction, shoppers, purchases, open_holds_max).await
}

/// The tallies of these shoppers, locked (PostgreSQL) in key order.
pub(crate) async fn read_tallies<C: Connection>(
    transaction: &mut C,
    mut shoppers: Vec<ShopperKey>,
    mut purchases: Vec<PurchaseKey>,
    open_holds_max: i64,
) -> Result<Tallies, StoreError> {
    shoppers.sort();
    shoppers.dedup();
    purchases.sort();
    purchases.dedup();
    let mut tallies = Tallies {
        open_holds_max,
        ..Tallies::default()
    };
    for (shop, user) in shoppers {
        let holds: Option<i64> = statement(C::SELECT_SHOPPER_HOLD_FOR_UPDATE)
            .bind(shop.as_str())
            .bind(user.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
        tallies.open_holds.insert((shop, user), holds.unwrap_or(0));
    }
    for (shop, user, sku) in purchases {
        let quantity: Option<i64> = statement(C::SELECT_SHOPPER_PURCHASE_FOR_UPDATE)
            .bind(shop.as_str())
            .bind(user.as_str())
            .bind(sku.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
        tallies
            .purchased
            .insert((shop, user, sku), quantity.unwrap_or(0));
    }
    Ok(tallies)
}

/// Adds a decided batch's holds and units to the shoppers' tallies. Each write is
/// conditional on the bound (the open-hold bound, the SKU's per-user limit), so the
/// database refuses what the decision should never have allowed: a tally another
/// process moved since it was read makes the batch retry, and then decide again.
pub(crate) async fn add_to_tallies<C: Connection>(
    transaction: &mut C,
    holds_added: &std::collections::BTreeMap<ShopperKey, i64>,
    purchases_added: &std::collections::BTreeMap<PurchaseKey, i64>,
    open_holds_max: i64,
) -> Result<(), StoreError> {
    for ((shop, user), added) in holds_added {
        let written = statement(
            "INSERT INTO shopper_hold (shop, user_id, open_holds) VALUES ($1, $2, $3) \
             ON CONFLICT (shop, user_id) DO UPDATE SET open_holds = shopper_hold.open_holds + excluded.open_holds \
             WHERE shopper_hold.open_holds + excluded.open_holds <= $4",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(added)
        .bind(open_holds_max)
        .execute(&mut *transaction)
        .await?;
        if written != 1 {
            return Err(StoreError::Retryable(format!(
                "the open holds of user '{user}' changed since they were read"
            )));
        }
    }
    for ((shop, user, sku), added) in purchases_added {
        let written = statement(
            "INSERT INTO shopper_purchase (shop, user_id, sku, quantity) \
             SELECT $1, $2, $3, $4 FROM sku WHERE sku.code = $3 \
             AND (sku.per_user_limit IS NULL OR $4 <= sku.per_user_limit) \
             ON CONFLICT (shop, user_id, sku) DO UPDATE SET quantity = shopper_purchase.quantity + excluded.quantity \
             WHERE shopper_purchase.quantity + excluded.quantity <= \
             COALESCE((SELECT per_user_limit FROM sku WHERE sku.code = excluded.sku), $5)",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(sku.as_str())
        .bind(added)
        .bind(STOCK_ON_HAND_MAX)
        .execute(&mut *transaction)
        .await?;
        if written != 1 {
            return Err(StoreError::Retryable(format!(
                "what user '{user}' holds of sku '{sku}' changed since it was read"
            )));
        }
    }
    Ok(())
}

/// Who moves a reservation out of `RESERVED`. A reservation held by an order is moved
/// only by that order's flow (DESIGN.md, trust model).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mover<'a> {
    /// The reservation endpoints (`confirm`, `release`) and the sweep of plain holds.
    Client,
    /// The flow of this order: pay, cancel, expiry, refund.
    Order(&'a OrderId),
    /// The flows of the orders holding the reservations, whose rows the caller locked
    /// (the order-expiry batch).
    HoldingOrders,
}

/// One reservation to move out of `RESERVED`.
pub(crate) struct Move<'a> {
    pub(crate) id: &'a ReservationId,
    pub(crate) action: ReservationAction,
    /// Why, when it is released.
    pub(crate) reason: ReleaseReason,
}

/// A reservation moved, with what must be settled for it.
pub(crate) struct Moved<'a> {
    pub(crate) id: &'a ReservationId,
    pub(crate) action: ReservationAction,
    pub(crate) shopper: Option<ShopperKey>,
    pub(crate) lines: Vec<ReservationLine>,
}

/// Moves each reservation out of `RESERVED` through the transition table (locking the
/// reservation rows in id order), then settles all their lines in the one global
/// (sku, warehouse) order, then gives the shoppers' tallies back: an open hold per
/// reservation, and on release the units. Only the caller that moves a reservation out
/// of `RESERVED` touches its stock, so a release that runs twice returns it once.
///
/// One outcome per move, in order; `Err` is a business refusal, and nothing was
/// written for that reservation.
pub(crate) async fn settle_reservations<C: Connection>(
    transaction: &mut C,
    moves: &[Move<'_>],
    mover: Mover<'_>,
    now: Timestamp,
) -> Result<Vec<Result<(), Rejection>>, StoreError> {
    let mut in_lock_order: Vec<usize> = (0..moves.len()).collect();
    in_lock_order.sort_by(|left, right| moves[*left].id.cmp(moves[*right].id));
    let mut outcomes: Vec<Result<(), Rejection>> = vec![Ok(()); moves.len()];
    let mut moved: Vec<Moved<'_>> = Vec::with_capacity(moves.len());
    for index in in_lock_order {
        let step = &moves[index];
        match move_reservation(transaction, step, mover, now).await? {
            Ok(done) => moved.push(done),
            Err(rejection) => outcomes[index] = Err(rejection),
        }
    }
    let mut settlements: Vec<(&ReservationLine, ReservationAction, &ReservationId)> = moved
        .iter()
        .flat_map(|done| {
            done.lines
                .iter()
                .map(move |line| (line, done.action, done.id))
        })
        .collect();
    settlements.sort_by(|(left, _, _), (right, _, _)| {
        (&left.sku, &left.warehouse).cmp(&(&right.sku, &right.warehouse))
    });
    for (line, action, id) in settlements {
        settle_line(transaction, line, action, id, now).await?;
    }
    give_back_tallies(transaction, &moved).await?;
    Ok(outcomes)
}

/// Whether `mover` may move reservation `id`, held by `order_id`: a client never moves
/// an order's reservation; an order flow moves only its own.
pub(crate) fn mover_may_move(
    mover: Mover<'_>,
    id: &ReservationId,
    order_id: Option<&str>,
) -> Result<Result<(), Rejection>, StoreError> {
    match (mover, order_id) {
        (Mover::Client, Some(order)) => Ok(Err(Rejection::new(
            ErrorCode::IllegalTransition,
            format!(
                "reservation '{id}' is held by order '{order}': only that order's payment, cancel or expiry moves it"
            ),
        ))),
        (Mover::Order(order), held_by) if held_by != Some(order.as_str()) => Err(invariant(
            format!("order {order} tried to move reservation {id}, held by {held_by:?}"),
        )),
        (Mover::HoldingOrders, None) => Err(invariant(format!(
            "an order flow tried to move reservation {id}, held by no order"
        ))),
        _ => Ok(Ok(())),
    }
}

/// The status a locked reservation moves from and to, through the transition table;
/// refused when the table has no such step, or when a client confirms a hold past its
/// end.
pub(crate) fn decide_move(
    step: &Move<'_>,
    mover: Mover<'_>,
    status: &str,
    expires_at: i64,
    now: Timestamp,
) -> Result<Result<(ReservationStatus, ReservationStatus), Rejection>, StoreError> {
    let id = step.id;
    let current = ReservationStatus::parse(status).map_err(|error| corrupt("status", error))?;
    let target = match step.action {
        ReservationAction::Confirm => ReservationStatus::Confirmed,
        ReservationAction::Release => ReservationStatus::Released,
    };
    if let Err(illegal) = current.transition(target) {
        return Ok(Err(Rejection::new(
            ErrorCode::IllegalTransition,
            format!("reservation '{id}': {illegal}"),
        )));
    }
    // The clock in this transaction decides, not the sweep: a plain hold past its end
    // is never sold, even while the sweep has not released it yet. (An order's hold
    // is the order's business: a payment in flight settles it either way.)
    let expires_at = Timestamp::from_unix_milliseconds(expires_at);
    if matches!(mover, Mover::Client)
        && step.action == ReservationAction::Confirm
        && expires_at <= now
    {
        return Ok(Err(Rejection::new(
            ErrorCode::IllegalTransition,
            format!("reservation '{id}' expired at {expires_at}: it can no longer be confirmed"),
        )));
    }
    Ok(Ok((current, target)))
}

/// A reservation's lines.
pub(crate) async fn reservation_lines_of<C: Connection>(
    transaction: &mut C,
    id: &ReservationId,
) -> Result<Vec<ReservationLine>, StoreError> {
    let line_rows = statement(
        "SELECT sku, warehouse, quantity FROM reservation_line WHERE reservation_id = $1",
    )
    .bind(id.as_str())
    .fetch_all_rows(&mut *transaction)
    .await?;
    let mut lines = Vec::with_capacity(line_rows.len());
    for row in &line_rows {
        lines.push(decode_line(row)?);
    }
    Ok(lines)
}

/// The status half of [`settle_reservations`] for one reservation.
pub(crate) async fn move_reservation<'a, C: Connection>(
    transaction: &mut C,
    step: &Move<'a>,
    mover: Mover<'_>,
    now: Timestamp,
) -> Result<Result<Moved<'a>, Rejection>, StoreError> {
    let id = step.id;
    /// A locked reservation's status, holder order, shop, shopper and hold end.
    type LockedReservation = (String, Option<String>, Option<String>, Option<String>, i64);
    let row: Option<LockedReservation> = statement(C::SELECT_RESERVATION_FOR_UPDATE)
        .bind(id.as_str())
        .fetch_optional_as(&mut *transaction)
        .await?;
    let Some((status, order_id, shop, user, expires_at)) = row else {
        return Ok(Err(Rejection::new(
            ErrorCode::NotFound,
            format!("reservation '{id}' does not exist"),
        )));
    };
    if let Err(refused) = mover_may_move(mover, id, order_id.as_deref())? {
        return Ok(Err(refused));
    }
    let (current, target) = match decide_move(step, mover, &status, expires_at, now)? {
        Ok(decided) => decided,
        Err(refused) => return Ok(Err(refused)),
    };
    let reason = (target == ReservationStatus::Released).then_some(step.reason.as_str());
    let updated = statement(
        "UPDATE reservation SET status = $2, release_reason = $3, updated_at = $4 \
         WHERE id = $1 AND status = $5",
    )
    .bind(id.as_str())
    .bind(target.as_str())
    .bind(reason)
    .bind(now.unix_milliseconds())
    .bind(current.as_str())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "changing a locked reservation's status")?;
    let lines = reservation_lines_of(transaction, id).await?;
    let shopper = match (shop, user) {
        (Some(shop), Some(user)) => Some((
            ShopCode::parse(&shop).map_err(|error| corrupt("shop", error))?,
            UserId::parse(&user).map_err(|error| corrupt("user id", error))?,
        )),
        _ => None,
    };
    Ok(Ok(Moved {
        id,
        action: step.action,
        shopper,
        lines,
    }))
}

/// Gives back what the moved reservations counted against their shoppers, in key
/// order: one open hold each, and on release their units.
pub(crate) async fn give_back_tallies<C: Connection>(
    transaction: &mut C,
    moved: &[Moved<'_>],
) -> Result<(), StoreError> {
    let mut holds: std::collections::BTreeMap<&ShopperKey, i64> = Default::default();
    let mut units: std::collections::BTreeMap<(&ShopCode, &UserId, &SkuCode), i64> =
        Default::default();
    for done in moved {
        let Some(shopper) = &done.shopper else {
            continue;
        };
        *holds.entry(shopper).or_insert(0) += 1;
        if done.action == ReservationAction::Release {
            for line in &done.lines {
                *units
                    .entry((&shopper.0, &shopper.1, &line.sku))
                    .or_insert(0) += line.quantity.get();
            }
        }
    }
    for ((shop, user), count) in holds {
        let updated = statement(
            "UPDATE shopper_hold SET open_holds = open_holds - $3 \
             WHERE shop = $1 AND user_id = $2 AND open_holds >= $3",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(count)
        .execute(&mut *transaction)
        .await?;
        expect_one_row(updated, "giving back a shopper's open hold")?;
    }
    for ((shop, user, sku), quantity) in units {
        let updated = statement(
            "UPDATE shopper_purchase SET quantity = quantity - $4 \
             WHERE shop = $1 AND user_id = $2 AND sku = $3 AND quantity >= $4",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(sku.as_str())
        .bind(quantity)
        .execute(&mut *transaction)
        .await?;
        expect_one_row(updated, "giving back a shopper's units")?;
    }
    Ok(())
}

/// What an audit found: every difference counted, the first
/// [`AUDIT_DIFFERENCES_REPORTED_MAX`] kept.
#[derive(Default)]
pub(crate) struct Findings {
    pub(crate) differences: Vec<AuditDifference>,
    pub(crate) total: i64,
}

impl Findings {
    pub(crate) fn note(&mut self, difference: AuditDifference) {
        self.total += 1;
        if self.differences.len() < AUDIT_DIFFERENCES_REPORTED_MAX {
            self.differences.push(difference);
        }
    }
}

/// Every stock row's counters against its ledger and its open reservations; returns
/// the rows checked.
pub(crate) async fn audit_stock_rows<C: Connection>(
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
        let at = |check: &'static str, expected: i64, actual: i64| AuditDifference {
            check,
            sku: Some(sku.clone()),
            warehouse: Some(warehouse.clone()),
            reference: None,
            shop: None,
            expected,
            actual,
        };
        if ledger_available != available {
            findings.note(at("ledger_vs_available", ledger_available, available));
        }
        if ledger_reserved != reserved {
            findings.note(at("ledger_vs_reserved", ledger_reserved, reserved));
        }
        if open != reserved {
            findings.note(at("open_reservations_vs_reserved", open, reserved));
        }
    }
    drop(stock_rows);
    Ok(stock_rows_checked)
}

/// Stock rows that ledger rows or open reservations name but that do not exist.
pub(crate) async fn audit_missing_stock_rows<C: Connection>(
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
pub(crate) async fn audit_reservation_lines<C: Connection>(
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
pub(crate) async fn audit_orphan_ledger_rows<C: Connection>(
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

/// Every order against its reservation and its payments; returns the orders checked.
pub(crate) async fn audit_orders<C: Connection>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<i64, StoreError> {
    // Every order against its reservation and its payment: the third leg of the
    // three-way check. A paid order holds sold stock and a succeeded payment; an
    // order that gave its stock back holds a released reservation; and so on.
    let mut orders_checked = 0_i64;
    let mut orders = statement(
        // An order's payment is what its attempts add up to: succeeded if one did,
        // else running if one runs, else failed if any was made.
        "SELECT customer_order.id, customer_order.shop, customer_order.status, reservation.status, \
         CASE attempts.outcome WHEN 3 THEN 'SUCCEEDED' WHEN 2 THEN 'PROCESSING' WHEN 1 THEN 'FAILED' END \
         FROM customer_order JOIN reservation ON reservation.id = customer_order.reservation_id \
         LEFT JOIN (SELECT order_id, MAX(CASE status WHEN 'SUCCEEDED' THEN 3 WHEN 'PROCESSING' THEN 2 ELSE 1 END) AS outcome \
             FROM payment_attempt GROUP BY order_id) AS attempts ON attempts.order_id = customer_order.id \
         ORDER BY customer_order.id",
    )
    .fetch_as::<(String, String, String, String, Option<String>)>(&mut *transaction);
    while let Some((id, shop, order_status, reservation_status, attempt_status)) =
        orders.try_next().await?
    {
        orders_checked += 1;
        let agrees = match (
            OrderStatus::parse(&order_status),
            ReservationStatus::parse(&reservation_status),
            attempt_status
                .as_deref()
                .map(AttemptStatus::parse)
                .transpose(),
        ) {
            (Ok(order), Ok(reservation), Ok(payment)) => order.agrees_with(reservation, payment),
            // A status no table knows is a hand edit: a difference.
            _ => false,
        };
        if !agrees {
            findings.note(AuditDifference {
                check: "order_vs_reservation_and_payment",
                sku: None,
                warehouse: None,
                reference: Some(format!(
                    "{id}: order {order_status}, reservation {reservation_status}, payment {}",
                    attempt_status.as_deref().unwrap_or("none")
                )),
                shop: Some(shop),
                expected: 1,
                actual: 0,
            });
        }
    }
    drop(orders);
    Ok(orders_checked)
}

/// Every return against what its order sold.
pub(crate) async fn audit_returns<C: Connection>(
    transaction: &mut C,
    findings: &mut Findings,
) -> Result<(), StoreError> {
    // Returned goods against what their order sold: a return puts back only units
    // that left stock (a confirmed reservation), at most as many as were sold. A
    // `return` row for anything else would make counters and ledger agree on stock
    // created from nothing.
    let mut returns =
        statement(AUDIT_RETURNS).fetch_as::<(String, String, String, i64, i64)>(&mut *transaction);
    while let Some((order, sku, warehouse, returned, sold)) = returns.try_next().await? {
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

impl<B: Backend> Units<B> {
    /// Applies every migration this binary knows and the database lacks, each in its
    /// own transaction, serialized across processes.
    pub async fn migrate(&self) -> Result<Vec<i64>, StoreError> {
        let mut applied_now = Vec::new();
        self.write_connection()
            .await?
            .execute_script(
                "CREATE TABLE IF NOT EXISTS schema_migration (\
                 version BIGINT NOT NULL PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)",
            )
            .await?;
        for (version, name, sql) in <B::Connection as Dialect>::MIGRATIONS {
            let mut transaction = self.begin_write().await?;
            if let Some(lock) = <B::Connection as Dialect>::MIGRATION_LOCK {
                statement(lock).execute(&mut *transaction).await?;
            }
            let applied: Option<String> =
                statement("SELECT name FROM schema_migration WHERE version = $1")
                    .bind(version)
                    .fetch_optional_scalar(&mut *transaction)
                    .await?;
            match applied {
                Some(applied_name) if applied_name == *name => continue,
                Some(applied_name) => {
                    return Err(invariant(format!(
                        "migration {version} is '{applied_name}' in the database but '{name}' in this binary"
                    )));
                }
                None => {}
            }
            transaction.execute_script(sql).await?;
            statement(
                "INSERT INTO schema_migration (version, name, applied_at) VALUES ($1, $2, $3)",
            )
            .bind(version)
            .bind(*name)
            .bind(wall_clock_milliseconds())
            .execute(&mut *transaction)
            .await?;
            transaction.commit().await?;
            applied_now.push(*version);
        }
        let newest_known = <B::Connection as Dialect>::MIGRATIONS
            .last()
            .map(|(version, _, _)| *version)
            .unwrap_or(0);
        let newest_applied: Option<i64> = statement("SELECT MAX(version) FROM schema_migration")
            .fetch_one_scalar(&mut *self.write_connection().await?)
            .await?;
        if newest_applied.unwrap_or(0) > newest_known {
            return Err(invariant(format!(
                "the database has migration {} but this stockd knows only up to {newest_known}; run a newer stockd",
                newest_applied.unwrap_or(0)
            )));
        }
        Ok(applied_now)
    }

    /// The database engine and its version, for release evidence.
    pub async fn database_version(&self) -> Result<String, StoreError> {
        let version: String = statement(<B::Connection as Dialect>::VERSION_QUERY)
            .fetch_one_scalar(&mut *self.read_connection().await?)
            .await?;
        Ok(version)
    }

    /// One round trip to the database: readiness.
    pub async fn ping(&self) -> Result<(), StoreError> {
        statement("SELECT 1")
            .execute(&mut *self.read_connection().await?)
            .await?;
        Ok(())
    }

    pub async fn sku(&self, code: &SkuCode) -> Result<Option<Sku>, StoreError> {
        let mut transaction = self.begin_read().await?;
        let sku = load_sku(&mut *transaction, code).await;
        transaction.rollback().await?;
        sku
    }

    pub async fn reservation(&self, id: &ReservationId) -> Result<Option<Reservation>, StoreError> {
        let mut transaction = self.begin_read().await?;
        let reservation = load_reservation(&mut *transaction, id).await;
        transaction.rollback().await?;
        reservation
    }

    /// Stores `response` under `claim`'s key on its own (for answers reached across
    /// several transactions, like a payment's). A key that already has a record keeps
    /// it, and that one is the answer.
    pub async fn store_response(
        &self,
        claim: &IdempotencyClaim,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        complete_claim(&mut *transaction, claim, response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response.clone()))
    }

    /// The shops of these SKUs (the ones that exist), read on the writer: the engine
    /// caches them for good, so a stale replica must not answer.
    pub async fn sku_shops(
        &self,
        codes: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, ShopCode>, StoreError> {
        let mut shops = HashMap::with_capacity(codes.len());
        for code in codes {
            let shop: Option<String> = statement("SELECT shop FROM sku WHERE code = $1")
                .bind(code.as_str())
                .fetch_optional_scalar(&mut *self.write_connection().await?)
                .await?;
            if let Some(shop) = shop {
                shops.insert(
                    (*code).clone(),
                    ShopCode::parse(&shop).map_err(|error| corrupt("shop", error))?,
                );
            }
        }
        Ok(shops)
    }

    /// The committed record of `key`, if any: `(fingerprint, response)`.
    pub async fn idempotency_record(
        &self,
        key: &ScopedKey,
    ) -> Result<Option<(String, StoredResponse)>, StoreError> {
        let row = statement(
            "SELECT fingerprint, status_code, body FROM idempotency_record WHERE key = $1",
        )
        .bind(key.as_str())
        .fetch_optional_row(&mut *self.read_connection().await?)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let status_code: i64 = row.try_get("status_code")?;
        let status = u16::try_from(status_code).map_err(|error| corrupt("status code", error))?;
        Ok(Some((
            row.try_get("fingerprint")?,
            StoredResponse {
                status,
                body: row.try_get("body")?,
            },
        )))
    }

    /// Creates a SKU or updates the given fields of an existing one.
    pub async fn upsert_sku(
        &self,
        claim: &IdempotencyClaim,
        code: &SkuCode,
        changes: &SkuChanges,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let shop = changes.shop.clone().unwrap_or_else(ShopCode::default_shop);
        let inserted = statement(
            "INSERT INTO sku (code, shop, title, price_minor, currency, low_stock_threshold, \
             per_user_limit, sale_status, version, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'ON_SHELF', 1, $8, $8) ON CONFLICT (code) DO NOTHING",
        )
        .bind(code.as_str())
        .bind(shop.as_str())
        .bind(changes.title.as_deref().unwrap_or(""))
        .bind(changes.price.map(PriceMinor::get))
        .bind(changes.currency.as_ref().map(Currency::as_str))
        .bind(changes.low_stock_threshold.unwrap_or(0))
        .bind(changes.per_user_limit.flatten())
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        let created = inserted == 1;
        if !created {
            let existing_shop: String = statement("SELECT shop FROM sku WHERE code = $1")
                .bind(code.as_str())
                .fetch_one_scalar(&mut *transaction)
                .await?;
            if let Some(wanted) = &changes.shop
                && wanted.as_str() != existing_shop
            {
                let response = renderer.rejected(&Rejection::new(
                    ErrorCode::AlreadyExists,
                    format!(
                        "sku '{code}' already exists in shop '{existing_shop}'; a SKU's shop never changes"
                    ),
                ));
                complete_claim(&mut *transaction, claim, &response).await?;
                transaction.commit().await?;
                return Ok(Idempotent::Executed(response));
            }
            if changes.per_user_limit.is_some() {
                // A reservation reads the limit after locking these rows (like the sale
                // status), so a new limit cannot slip past one that commits after it.
                transaction.lock_stock_of_skus(&[code]).await?;
            }
            let updated = statement(
                "UPDATE sku SET title = COALESCE($2, title), price_minor = COALESCE($3, price_minor), \
                 currency = COALESCE($4, currency), \
                 low_stock_threshold = COALESCE($5, low_stock_threshold), \
                 per_user_limit = CASE WHEN $6 = 1 THEN $7 ELSE per_user_limit END, \
                 version = version + 1, updated_at = $8 WHERE code = $1",
            )
            .bind(code.as_str())
            .bind(changes.title.as_deref())
            .bind(changes.price.map(PriceMinor::get))
            .bind(changes.currency.as_ref().map(Currency::as_str))
            .bind(changes.low_stock_threshold)
            .bind(i64::from(changes.per_user_limit.is_some()))
            .bind(changes.per_user_limit.flatten())
            .bind(now.unix_milliseconds())
            .execute(&mut *transaction)
            .await?;
            expect_one_row(updated, "updating a sku")?;
        }
        let sku = load_sku(&mut *transaction, code)
            .await?
            .ok_or_else(|| invariant("a sku vanished inside its own transaction"))?;
        let response = renderer.sku_saved(&sku, created);
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Receives or adjusts stock in one warehouse, with its ledger row.
    pub async fn record_movement(
        &self,
        claim: &IdempotencyClaim,
        movement: &StockMovement,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let outcome = apply_movement(&mut *transaction, movement, now).await?;
        let response = match outcome {
            Ok(record) => {
                insert_ledger_row(
                    &mut *transaction,
                    LedgerEntry {
                        sku: &movement.sku,
                        warehouse: &movement.warehouse,
                        kind: movement.quantity.kind().as_str(),
                        available_delta: record.available_delta,
                        reserved_delta: 0,
                        reference: movement.id.as_str(),
                        idempotency_key: Some(claim.key.as_str()),
                    },
                    now,
                )
                .await?;
                renderer.movement_recorded(&record)
            }
            Err(rejection) => renderer.rejected(&rejection),
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Reserves stock for a batch of independent requests in one transaction. Each
    /// request succeeds or is refused on its own, in order; the returned outcomes line
    /// up with `requests`. A database error fails the whole batch, which then changed
    /// nothing and may be retried.
    ///
    /// The batch costs a fixed number of statements whatever its size: each step is one
    /// bulk statement (`bulk` in each dialect), which is what lets the engine's combiner
    /// fold hundreds of requests into one transaction and one commit. `turn` orders the
    /// row-lock step after the previous batch of the same queue (see [`LockTurn`]).
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

        // 2. The fast path (PostgreSQL): one round trip that writes and commits the
        //    whole batch when every request fits, which is nearly always on a hot SKU
        //    with stock left. It writes nothing otherwise, and the batch is decided
        //    below. It does not wait for the turn: it takes the row last and holds it
        //    only for the update and the commit. (With more than one batch in flight,
        //    a later batch may so take the last units before an earlier one: both
        //    batches' requests are in flight at once, and each gets an answer
        //    consistent with the row.) A request that names a shopper (limits to
        //    check) or whose SKUs' shop is not verified yet is decided below.
        let fast_path_fits = requests.iter().zip(&slots).all(|(request, slot)| {
            !matches!(slot, BatchSlot::Claimed)
                || (request.user.is_none() && matches!(request.shop, ShopScope::Verified(_)))
        });
        if <B::Connection as Dialect>::WHOLE_BATCH_FAST_PATH && fast_path_fits {
            let claimed: Vec<&ReserveRequest> = requests
                .iter()
                .zip(&slots)
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
                .zip(&responses)
                .filter_map(|(request, response)| {
                    response.as_ref().map(|response| (&request.claim, response))
                })
                .collect();
            let totals =
                totals_if_all_accepted(claimed.iter().map(|request| request.lines.as_slice()));
            let whole = self
                .backend
                .reserve_whole_batch(&totals, &accepted, &records, now)
                .await?;
            if whole == WholeBatch::Applied {
                turn.pass();
                return Ok(BatchApplied {
                    outcomes: batch_outcomes(slots, &responses)?,
                    path: BatchPath::OneRoundTrip,
                });
            }
        }

        // 3. The batch transaction. A key with a committed record is replayed (or
        //    refused as reused when its fingerprint differs). The new keys' records
        //    are inserted with their responses below, in this transaction; a key
        //    another process commits meanwhile makes that insert come up short
        //    (SQLite) or fail with a unique violation (PostgreSQL), and the batch is
        //    rolled back and retried (then it replays).
        //
        //    The turn is taken before the transaction begins: on SQLite the one write
        //    connection is the lock, and a batch that took it while waiting for the
        //    previous batch's turn would deadlock with that batch.
        turn.wait().await;
        let mut transaction = self.begin_write().await?;
        let keys: Vec<&str> = first_of_key.keys().copied().collect();
        let existing = transaction.existing_records(&keys).await?;
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
        let claimed: Vec<usize> = slots
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| matches!(slot, BatchSlot::Claimed).then_some(index))
            .collect();

        // 4. Lock the stock rows the claimed requests touch, in (sku, warehouse) order,
        //    reading their SKUs' sale status, shop and per-user limit with them. A shelf
        //    change (or a new limit) locks the same rows first, so it cannot slip
        //    between this read and the commit. Then the shoppers' tallies, in key order.
        let mut wanted_rows: Vec<StockKey> = claimed
            .iter()
            .flat_map(|index| requests[*index].lines.iter())
            .map(|line| (line.sku.clone(), line.warehouse.clone()))
            .collect();
        wanted_rows.sort();
        wanted_rows.dedup();
        let locked = transaction.lock_stock_rows(&wanted_rows).await;
        turn.pass();
        let (available, skus) = locked?;
        let skus = with_unlisted_skus(&mut *transaction, &wanted_rows, skus).await?;
        let tallies = lock_tallies(
            &mut *transaction,
            claimed.iter().map(|index| &requests[*index]),
            &skus,
            self.limits().open_holds_max,
        )
        .await?;

        // 5. Decide every claimed request in memory, in arrival order.
        let plan = plan_batch(
            claimed.iter().map(|index| {
                let request = &requests[*index];
                PlanRequest {
                    lines: &request.lines,
                    shop: &request.shop,
                    user: request.user.as_ref(),
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
        let mut accepted = Vec::new();
        for (index, decided) in claimed.iter().zip(&plan.decisions) {
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
        let records: Vec<(&IdempotencyClaim, &StoredResponse)> = claimed
            .iter()
            .filter_map(|index| {
                responses[*index]
                    .as_ref()
                    .map(|response| (&requests[*index].claim, response))
            })
            .collect();
        let written = transaction
            .write_batch(&plan.totals, &accepted, &records, now)
            .await?;
        if written.rows_taken != plan.totals.len() as u64 {
            return Err(invariant(format!(
                "reserving batch totals changed {} of {} locked rows",
                written.rows_taken,
                plan.totals.len()
            )));
        }
        if written.records_stored != records.len() as u64 {
            // Another process committed one of these keys since step 3.
            return Err(StoreError::Retryable(format!(
                "stored {} of {} idempotency records: a key was committed concurrently",
                written.records_stored,
                records.len()
            )));
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
        })
    }

    /// Confirms (consumes) or releases (returns) a reservation's stock. Only the
    /// transaction that moves the reservation out of `RESERVED` touches stock.
    pub async fn change_reservation(
        &self,
        claim: &IdempotencyClaim,
        id: &ReservationId,
        action: ReservationAction,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let reason = ReleaseReason::Requested;
        let outcome = settle_reservations(
            &mut *transaction,
            &[Move { id, action, reason }],
            Mover::Client,
            now,
        )
        .await?
        .remove(0);
        let response = match outcome {
            Ok(()) => {
                let reservation =
                    load_reservation(&mut *transaction, id)
                        .await?
                        .ok_or_else(|| {
                            invariant("a reservation vanished inside its own transaction")
                        })?;
                renderer.reservation_changed(&reservation)
            }
            Err(rejection) => renderer.rejected(&rejection),
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Releases up to `limit` reservations whose hold ended at or before `now`. Several
    /// processes may run this at once: each reservation is claimed by exactly one.
    pub async fn expire_batch(
        &self,
        now: Timestamp,
        limit: i64,
    ) -> Result<ExpiryOutcome, StoreError> {
        let mut transaction = self.begin_write().await?;
        let ids: Vec<String> = statement(<B::Connection as Dialect>::CLAIM_EXPIRED_RESERVATIONS)
            .bind(now.unix_milliseconds())
            .bind(limit)
            .fetch_all_scalar(&mut *transaction)
            .await?;
        let ids = ids
            .iter()
            .map(|id| ReservationId::parse(id).map_err(|error| corrupt("reservation id", error)))
            .collect::<Result<Vec<_>, _>>()?;
        let moves: Vec<Move<'_>> = ids
            .iter()
            .map(|id| Move {
                id,
                action: ReservationAction::Release,
                reason: ReleaseReason::Expired,
            })
            .collect();
        // Claimed rows are locked and `RESERVED` and held by no order: each moves.
        let outcomes = settle_reservations(&mut *transaction, &moves, Mover::Client, now).await?;
        if let Some(refused) = outcomes.iter().find_map(|outcome| outcome.as_ref().err()) {
            return Err(invariant(format!(
                "a claimed expired reservation could not be released: {}",
                refused.detail
            )));
        }
        let released = ids;
        transaction.commit().await?;
        Ok(ExpiryOutcome { released })
    }

    /// Deletes up to `limit` idempotency records created before `created_before`.
    pub async fn purge_idempotency_records(
        &self,
        created_before: Timestamp,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let mut transaction = self.begin_write().await?;
        let deleted = statement(
            "DELETE FROM idempotency_record WHERE key IN (\
             SELECT key FROM idempotency_record WHERE created_at < $1 ORDER BY created_at LIMIT $2)",
        )
        .bind(created_before.unix_milliseconds())
        .bind(limit)
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(deleted)
    }

    /// Open holds and the expiry backlog, for the metrics endpoint (once per scrape).
    /// Both are counted through the partial index on `RESERVED` rows, so a scrape
    /// costs as much as there are open holds. Confirmed and released reservations are
    /// never deleted: counting them would scan a table that only grows, at every scrape.
    pub async fn reservation_gauges(
        &self,
        now: Timestamp,
    ) -> Result<ReservationGauges, StoreError> {
        let reserved: i64 = statement("SELECT COUNT(*) FROM reservation WHERE status = 'RESERVED'")
            .fetch_one_scalar(&mut *self.read_connection().await?)
            .await?;
        Ok(ReservationGauges {
            reserved,
            expired_backlog: self.expiry_backlog(now).await?,
        })
    }

    /// `RESERVED` reservations already past their expiry: read from the partial index
    /// the expiry worker uses, so it stays cheap however many reservations exist.
    pub async fn expiry_backlog(&self, now: Timestamp) -> Result<i64, StoreError> {
        statement(
            "SELECT COUNT(*) FROM reservation \
             WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL",
        )
        .bind(now.unix_milliseconds())
        .fetch_one_scalar(&mut *self.read_connection().await?)
        .await
    }

    /// Replays the ledger and compares it with the counters and the reservations, on
    /// one consistent snapshot.
    pub async fn audit(&self, now: Timestamp) -> Result<AuditReport, StoreError> {
        let mut transaction = self.begin_snapshot().await?;
        let mut findings = Findings::default();
        let stock_rows_checked = audit_stock_rows(&mut *transaction, &mut findings).await?;
        audit_missing_stock_rows(&mut *transaction, &mut findings).await?;
        let reservation_lines_checked =
            audit_reservation_lines(&mut *transaction, &mut findings).await?;
        audit_orphan_ledger_rows(&mut *transaction, &mut findings).await?;
        let orders_checked = audit_orders(&mut *transaction, &mut findings).await?;
        audit_returns(&mut *transaction, &mut findings).await?;
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
        for (table, query) in [
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
                "stock_ledger",
                "SELECT id, sku, warehouse, kind, available_delta, reserved_delta, reference FROM stock_ledger ORDER BY id",
            ),
            (
                "idempotency_record",
                "SELECT key, fingerprint, status_code, body FROM idempotency_record ORDER BY key",
            ),
        ] {
            text.push_str(table);
            text.push('\n');
            let rows = statement(query)
                .fetch_all_rows(&mut *self.read_connection().await?)
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

/// Applies one movement's counter change. `Err` is a business refusal, stored as the
/// response; nothing has been written when it is returned.
pub(crate) async fn apply_movement<C: Connection>(
    transaction: &mut C,
    movement: &StockMovement,
    now: Timestamp,
) -> Result<Result<MovementRecord, Rejection>, StoreError> {
    let sku_exists: Option<String> = statement("SELECT code FROM sku WHERE code = $1")
        .bind(movement.sku.as_str())
        .fetch_optional_scalar(&mut *transaction)
        .await?;
    if sku_exists.is_none() {
        return Ok(Err(Rejection::new(
            ErrorCode::NotFound,
            format!("sku '{}' does not exist", movement.sku),
        )));
    }
    let delta = movement.quantity.available_delta();
    let counters: Option<(i64, i64)> = if delta > 0 {
        statement(
            "INSERT INTO stock (sku, warehouse, available, reserved, version, updated_at) \
             VALUES ($1, $2, $3, 0, 1, $4) \
             ON CONFLICT (sku, warehouse) DO UPDATE SET available = stock.available + excluded.available, \
             version = stock.version + 1, updated_at = excluded.updated_at \
             WHERE stock.available + stock.reserved + excluded.available <= $5 \
             RETURNING available, reserved",
        )
        .bind(movement.sku.as_str())
        .bind(movement.warehouse.as_str())
        .bind(delta)
        .bind(now.unix_milliseconds())
        .bind(STOCK_ON_HAND_MAX)
        .fetch_optional_as(&mut *transaction)
        .await?
    } else {
        statement(
            "UPDATE stock SET available = available + $3, version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2 AND available + $3 >= 0 \
             RETURNING available, reserved",
        )
        .bind(movement.sku.as_str())
        .bind(movement.warehouse.as_str())
        .bind(delta)
        .bind(now.unix_milliseconds())
        .fetch_optional_as(&mut *transaction)
        .await?
    };
    let Some((available, reserved)) = counters else {
        let rejection = if delta > 0 {
            Rejection::new(
                ErrorCode::InvalidArgument,
                format!(
                    "receiving {delta} would put more than {STOCK_ON_HAND_MAX} units on hand for sku '{}' in warehouse '{}'",
                    movement.sku, movement.warehouse
                ),
            )
        } else {
            Rejection::new(
                ErrorCode::InsufficientStock,
                format!(
                    "cannot remove {} units of sku '{}' from warehouse '{}': not that many available",
                    -delta, movement.sku, movement.warehouse
                ),
            )
        };
        return Ok(Err(rejection));
    };
    Ok(Ok(MovementRecord {
        id: movement.id.clone(),
        kind: movement.quantity.kind(),
        sku: movement.sku.clone(),
        warehouse: movement.warehouse.clone(),
        available_delta: delta,
        available,
        reserved,
        created_at: now,
    }))
}

/// Moves the reservation an order holds out of `RESERVED` and settles it (see
/// [`settle_reservations`]). `Err` is a business refusal; nothing was written.
pub(crate) async fn settle_order_reservation<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    reservation: &ReservationId,
    action: ReservationAction,
    reason: ReleaseReason,
    now: Timestamp,
) -> Result<Result<(), Rejection>, StoreError> {
    let step = Move {
        id: reservation,
        action,
        reason,
    };
    Ok(
        settle_reservations(transaction, &[step], Mover::Order(order), now)
            .await?
            .remove(0),
    )
}

/// The wall clock, only for bookkeeping columns no rule reads (`applied_at`).
pub(crate) fn wall_clock_milliseconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

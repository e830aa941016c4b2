//! Orders (seed 000): creating one with its hold, reading it, cancelling, expiring and
//! returning it. Locks are taken order first, then its reservation, then stock rows
//! in (sku, warehouse) order.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::batch::with_unlisted_skus;
use super::carts::{cart_lines_as_read, remove_checked_out_lines};
use super::decode::{expect_one_row, invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::outbox::{NewEvent, Sequence, append_event};
use super::payments::paying_attempt;
use super::refunds::insert_refund;
use super::reservations::{
    Move, Mover, OneByOne, begin_whole_batch, claim_past_cursor, kept_whole, load_reservation,
    settle_order_reservation, settle_reservations,
};
use super::stock::{LedgerEntry, available_in, insert_ledger_row};
use super::tallies::{add_to_tallies, give_back_refunded_units, read_tallies};
use super::{Units, displayed};
use crate::backend::{Backend, Dialect, Finish, NewReservation};
use crate::error::StoreError;
use crate::model::{
    ExpiryCursor, IdempotencyClaim, Idempotent, Rejection, ReservationAction, ResponseRenderer,
    StoredResponse,
};
use crate::orders::{
    CancelRights, NewOrder, Order, OrderExpiry, OrderHistoryEntry, OrderLine, OrderSummary,
    PaymentAttempt, RefundRecord,
};
use crate::plan::{BatchPlan, PlanRequest, PurchaseKey, StockKey, plan_batch};
use crate::replicas::{Displayed, ReadHandle};
use crate::sql::statement;
use domain::{
    AttemptStatus, Currency, ErrorCode, EventType, OrderId, OrderStatus, PaymentAttemptId,
    RefundId, ReleaseReason, ReservationId, ReservationLine, ReservationStatus, ShopCode, SkuCode,
    Timestamp, UserId as OrderUserId, WarehouseCode,
};
use serde_json::json;

/// Moves an order through the transition table with a conditional update on its
/// current status, and records the change in its history and the outbox.
pub(crate) async fn move_order<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    from: OrderStatus,
    to: OrderStatus,
    reason: &str,
    now: Timestamp,
) -> Result<(), StoreError> {
    from.transition(to)
        .map_err(|illegal| invariant(illegal.to_string()))?;
    let updated = statement(
        "UPDATE customer_order SET status = $2, version = version + 1, updated_at = $3 WHERE id = $1 AND status = $4",
    )
    .bind(order.as_str())
    .bind(to.as_str())
    .bind(now.unix_milliseconds())
    .bind(from.as_str())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "changing a locked order's status")?;
    insert_history(transaction, order, Some(from), to, reason, now).await
}

/// Records an order's status change (its creation: `from` is `None`) in its history
/// and announces it (`order.status_changed`).
pub(crate) async fn insert_history<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    from: Option<OrderStatus>,
    to: OrderStatus,
    reason: &str,
    now: Timestamp,
) -> Result<(), StoreError> {
    statement(
        "INSERT INTO order_history (order_id, from_status, to_status, reason, created_at) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(order.as_str())
    .bind(from.map(OrderStatus::as_str))
    .bind(to.as_str())
    .bind(domain::limits::bounded_reason(reason).into_owned())
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    // The order's row is locked (or new): its version counts its status changes, 1
    // at creation, so it is the event's number in the order's sequence.
    let (shop, user, version): (String, String, i64) =
        statement("SELECT shop, user_id, version FROM customer_order WHERE id = $1")
            .bind(order.as_str())
            .fetch_one_as(&mut *transaction)
            .await?;
    append_event(
        transaction,
        NewEvent {
            event_type: EventType::OrderStatusChanged,
            aggregate_id: order.as_str(),
            shop: &shop,
            sequence: Sequence::Known(version),
            data: json!({
                "order_id": order.as_str(),
                "shop": shop,
                "user_id": user,
                "from": from.map(OrderStatus::as_str),
                "to": to.as_str(),
                "reason": domain::limits::bounded_reason(reason),
            }),
        },
        now,
    )
    .await
}

/// Releases the reservation a locked order holds and moves the order out (to `EXPIRED`
/// or `CANCELLED`): one step of the order's own flow, so no one else can be moving it.
pub(crate) async fn release_order<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    reservation: &ReservationId,
    (from, to): (OrderStatus, OrderStatus),
    (why, key): (&str, Option<&str>),
    now: Timestamp,
) -> Result<(), StoreError> {
    let reason = match to {
        OrderStatus::Expired => ReleaseReason::Expired,
        _ => ReleaseReason::Requested,
    };
    let Ok(()) = settle_order_reservation(
        transaction,
        order,
        reservation,
        (ReservationAction::Release, reason),
        key,
        now,
    )
    .await?
    else {
        return Err(invariant(format!(
            "order {order}: its reservation could not be released"
        )));
    };
    move_order(transaction, order, from, to, why, now).await
}

/// A locked order: its status, reservation and hold end ([`lock_order`]).
pub(crate) type LockedOrder = (OrderStatus, ReservationId, Timestamp);

/// The locked order's status, reservation and hold end.
pub(crate) async fn lock_order<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
) -> Result<Option<LockedOrder>, StoreError> {
    let row = statement(C::SELECT_ORDER_FOR_UPDATE)
        .bind(order.as_str())
        .fetch_optional_as::<(String, String, i64)>(&mut *transaction)
        .await?;
    row.map(|(status, reservation, expires_at)| {
        Ok((
            parse_stored("order status", &status, OrderStatus::parse)?,
            parse_stored("reservation id", &reservation, ReservationId::parse)?,
            Timestamp::from_unix_milliseconds(expires_at),
        ))
    })
    .transpose()
}

/// A unit of work on one order under an idempotency key, as
/// [`Units::open_on_order`] opened it.
pub(crate) enum OnOrder<T> {
    /// The key had its answer already (a replay, a key in flight or reused): the
    /// transaction is rolled back, nothing is held.
    Answered(Idempotent),
    /// The order's row locked (`None`: no such order) and the key claimed, both held
    /// to the transaction's end.
    Open(T, Option<LockedOrder>),
}

/// The status of a reservation its locked order holds (the order's lock guards it).
pub(crate) async fn reservation_status<C: Dialect>(
    transaction: &mut C,
    reservation: &ReservationId,
) -> Result<ReservationStatus, StoreError> {
    let status: String = statement("SELECT status FROM reservation WHERE id = $1")
        .bind(reservation.as_str())
        .fetch_one_scalar(&mut *transaction)
        .await?;
    parse_stored("reservation status", &status, ReservationStatus::parse)
}

pub(crate) async fn order_lines<C: Dialect>(
    connection: &mut C,
    order: &OrderId,
) -> Result<Vec<OrderLine>, StoreError> {
    let rows = statement(
        "SELECT sku, warehouse, quantity, unit_price_minor FROM order_line WHERE order_id = $1 ORDER BY line_number",
    )
    .bind(order.as_str())
    .fetch_all_as::<(String, String, i64, i64)>(&mut *connection)
    .await?;
    let mut lines = Vec::with_capacity(rows.len());
    for (sku, warehouse, quantity, unit_price_minor) in rows {
        lines.push(OrderLine {
            sku: parse_stored("sku code", &sku, SkuCode::parse)?,
            warehouse: parse_stored("warehouse", &warehouse, WarehouseCode::parse)?,
            quantity,
            unit_price_minor,
        });
    }
    Ok(lines)
}

/// An after-sale return's effect: every line of the order back to available stock, in
/// (sku, warehouse) order, each with its `return` ledger row and its `stock.moved`
/// event (kind `return`, naming the order and the movement id the answer lists).
pub(crate) async fn put_goods_back<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    claim: &IdempotencyClaim,
    now: Timestamp,
) -> Result<(), StoreError> {
    let shop: String = statement("SELECT shop FROM customer_order WHERE id = $1")
        .bind(order.as_str())
        .fetch_one_scalar(&mut *transaction)
        .await?;
    // Movement ids number the order's lines as the order lists them; the rows are
    // written in lock order.
    let mut lines: Vec<(u32, OrderLine)> =
        (0..).zip(order_lines(transaction, order).await?).collect();
    lines.sort_by(|(_, left), (_, right)| {
        (&left.sku, &left.warehouse).cmp(&(&right.sku, &right.warehouse))
    });
    // A line into a campaign's bucket passes its units on to the campaign's source
    // row once the campaign has closed. That row is locked now, with the lines' rows
    // in the global order: taken after the events below, it waited while holding the
    // SKU's event counter, which a receive into the source row takes after the row (a
    // deadlock).
    let mut sources = Vec::new();
    for (_, line) in &lines {
        if let Some(source) =
            super::campaigns::source_of_bucket(transaction, &line.sku, &line.warehouse).await?
        {
            sources.push((line.sku.clone(), source));
        }
    }
    if !sources.is_empty() {
        let mut rows: Vec<StockKey> = lines
            .iter()
            .map(|(_, line)| (line.sku.clone(), line.warehouse.clone()))
            .chain(sources)
            .collect();
        rows.sort();
        rows.dedup();
        transaction.lock_stock_rows(&rows).await?;
    }
    // Every line's stock row first (in lock order), then the events: appending one
    // locks the SKU's event counter, which a receive takes after its stock row.
    let mut moved = Vec::with_capacity(lines.len());
    for (line_number, line) in &lines {
        let (available, reserved) = transaction
            .adjust_stock(
                line.sku.as_str(),
                line.warehouse.as_str(),
                line.quantity,
                now,
            )
            .await?
            .ok_or_else(|| invariant("returning an order's goods found no stock row"))?;
        insert_ledger_row(
            transaction,
            LedgerEntry {
                sku: &line.sku,
                warehouse: &line.warehouse,
                kind: "return",
                available_delta: line.quantity,
                reserved_delta: 0,
                reference: order.as_str(),
                idempotency_key: Some(claim.key.as_str()),
            },
            now,
        )
        .await?;
        moved.push((*line_number, line, available, reserved));
    }
    for (line_number, line, available, reserved) in moved {
        let movement = domain::LedgerMovementId::Return {
            order: order.clone(),
            line: line_number,
        };
        append_event(
            transaction,
            NewEvent {
                event_type: EventType::StockMoved,
                aggregate_id: line.sku.as_str(),
                shop: &shop,
                sequence: Sequence::Counted,
                data: json!({
                    "movement_id": movement.to_string(),
                    "order_id": order.as_str(),
                    "sku": line.sku.as_str(),
                    "shop": shop,
                    "warehouse": line.warehouse.as_str(),
                    "kind": "return",
                    "available_delta": line.quantity,
                    "available": available,
                    "reserved": reserved,
                }),
            },
            now,
        )
        .await?;
        super::campaigns::pass_on_to_a_closed_campaigns_source(
            transaction,
            &line.sku,
            &line.warehouse,
            line.quantity,
            now,
        )
        .await?;
    }
    Ok(())
}

/// An order's prices: each line's unit price, in line order, their one currency and
/// the total.
pub(crate) struct Prices {
    pub(crate) unit_prices: Vec<i64>,
    pub(crate) currency: String,
    pub(crate) amount_minor: i64,
}

/// Prices an order's lines from their SKUs; refused when a SKU has no price, the
/// currencies differ, the total does not fit in 64 bits or is 0.
pub(crate) async fn price_order<C: Dialect>(
    transaction: &mut C,
    order: &NewOrder,
) -> Result<Result<Prices, Rejection>, StoreError> {
    let mut prices = Vec::with_capacity(order.lines.len());
    for line in &order.lines {
        let price = statement("SELECT price_minor, currency FROM sku WHERE code = $1")
            .bind(line.sku.as_str())
            .fetch_one_as::<(Option<i64>, Option<String>)>(&mut *transaction)
            .await?;
        // A price of 0 is no price: the line would go out free inside a paid order.
        match price {
            (Some(price), Some(currency)) if price > 0 => prices.push((price, currency)),
            _ => {
                return Ok(Err(Rejection::new(
                    ErrorCode::FailedPrecondition,
                    format!("sku '{}' has no price and cannot be ordered", line.sku),
                )));
            }
        }
    }
    if prices.windows(2).any(|pair| pair[0].1 != pair[1].1) {
        return Ok(Err(Rejection::new(
            ErrorCode::FailedPrecondition,
            "an order's SKUs must share one currency",
        )));
    }
    let amount = order
        .lines
        .iter()
        .zip(&prices)
        .try_fold(0_i64, |sum, (line, (price, _))| {
            line.quantity.get().checked_mul(*price)?.checked_add(sum)
        });
    let Some(amount_minor) = amount else {
        return Ok(Err(Rejection::new(
            ErrorCode::FailedPrecondition,
            "the order's total does not fit in a 64-bit amount of minor units",
        )));
    };
    if amount_minor == 0 {
        // Nothing to charge: the gateway would refuse it, and the stock would wait for
        // a payment that cannot happen.
        return Ok(Err(Rejection::new(
            ErrorCode::FailedPrecondition,
            "the order's total is 0: there is nothing to pay",
        )));
    }
    let currency = prices[0].1.clone();
    Ok(Ok(Prices {
        unit_prices: prices.into_iter().map(|(price, _)| price).collect(),
        currency,
        amount_minor,
    }))
}

/// Writes a decided order: the stock taken, the order-held reservation with its lines
/// and ledger rows, the order with its lines and first history entry.
pub(crate) async fn write_order<C: Dialect>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    order: &NewOrder,
    shop: &ShopCode,
    plan: &crate::plan::BatchPlan,
    prices: &Prices,
    now: Timestamp,
) -> Result<(), StoreError> {
    let hold = OrderHold {
        id: &order.reservation_id,
        order: &order.id,
        shopper: (shop, &order.user),
        expires_at: order.expires_at,
        request_key: Some(claim.key.as_str()),
        ledger_key: claim.key.as_str(),
        lines: &order.lines,
        totals: &plan.totals,
    };
    write_order_hold(transaction, &hold, now).await?;
    statement(
        "INSERT INTO customer_order (id, shop, user_id, status, amount_minor, currency, reservation_id, expires_at, \
         version, idempotency_key, created_at, updated_at) \
         VALUES ($1, $2, $3, 'PENDING_PAYMENT', $4, $5, $6, $7, 1, $8, $9, $9)",
    )
    .bind(order.id.as_str())
    .bind(shop.as_str())
    .bind(order.user.as_str())
    .bind(prices.amount_minor)
    .bind(&prices.currency)
    .bind(order.reservation_id.as_str())
    .bind(order.expires_at.unix_milliseconds())
    .bind(claim.key.as_str())
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    for (line_number, (line, price)) in order.lines.iter().zip(&prices.unit_prices).enumerate() {
        statement(
            "INSERT INTO order_line (order_id, line_number, sku, warehouse, quantity, unit_price_minor) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(order.id.as_str())
        .bind(i64::try_from(line_number).unwrap_or(i64::MAX))
        .bind(line.sku.as_str())
        .bind(line.warehouse.as_str())
        .bind(line.quantity.get())
        .bind(price)
        .execute(&mut *transaction)
        .await?;
    }
    insert_history(
        transaction,
        &order.id,
        None,
        OrderStatus::PendingPayment,
        "created",
        now,
    )
    .await
}

/// An order-held reservation to write.
pub(crate) struct OrderHold<'a> {
    pub(crate) id: &'a ReservationId,
    pub(crate) order: &'a OrderId,
    pub(crate) shopper: (&'a ShopCode, &'a OrderUserId),
    pub(crate) expires_at: Timestamp,
    /// The key stored on the reservation: the order's request (none for a late success).
    pub(crate) request_key: Option<&'a str>,
    /// The key its ledger rows name: the request's, or the late payment's id.
    pub(crate) ledger_key: &'a str,
    pub(crate) lines: &'a [ReservationLine],
    /// Units each stock row gives up, in (sku, warehouse) order.
    pub(crate) totals: &'a std::collections::BTreeMap<StockKey, i64>,
}

/// An order-held reservation (a new order, a cart's checkout, a late success), written
/// by the backend's one reservation writer; every locked row's conditional update must
/// have taken its units.
pub(crate) async fn write_order_hold<C: Dialect>(
    transaction: &mut C,
    hold: &OrderHold<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    let reservation = NewReservation {
        id: hold.id,
        expires_at: hold.expires_at,
        request_key: hold.request_key,
        ledger_key: hold.ledger_key,
        shop: hold.shopper.0,
        user: Some(hold.shopper.1.as_str()),
        order: Some(hold.order),
        lines: hold.lines,
    };
    let taken = transaction
        .write_reservations(hold.totals, &[reservation], now)
        .await?;
    if taken != hold.totals.len() as u64 {
        return Err(invariant(format!(
            "taking an order's stock changed {taken} of {} locked rows",
            hold.totals.len()
        )));
    }
    Ok(())
}

/// An order's payment attempts, oldest first.
pub(crate) async fn order_attempts<C: Dialect>(
    connection: &mut C,
    id: &OrderId,
) -> Result<Vec<PaymentAttempt>, StoreError> {
    let attempt_rows = statement(
        "SELECT id, status, gateway_key, gateway_payment_id, payment_method, failure_reason, amount_minor, currency, \
         created_at, updated_at FROM payment_attempt WHERE order_id = $1 ORDER BY attempt_number",
    )
    .bind(id.as_str())
    .fetch_all_as::<(String, String, String, Option<String>, String, Option<String>, i64, String, i64, i64)>(&mut *connection)
    .await?;
    let mut attempts = Vec::with_capacity(attempt_rows.len());
    for (
        attempt,
        status,
        gateway_key,
        gateway_payment_id,
        payment_method,
        failure_reason,
        amount,
        currency,
        created,
        updated,
    ) in attempt_rows
    {
        attempts.push(PaymentAttempt {
            id: parse_stored("attempt id", &attempt, PaymentAttemptId::parse)?,
            status: parse_stored("attempt status", &status, AttemptStatus::parse)?,
            gateway_key,
            gateway_payment_id,
            payment_method,
            failure_reason,
            amount_minor: amount,
            currency,
            created_at: Timestamp::from_unix_milliseconds(created),
            updated_at: Timestamp::from_unix_milliseconds(updated),
        });
    }
    Ok(attempts)
}

/// An order's refunds, oldest first.
pub(crate) async fn order_refunds<C: Dialect>(
    connection: &mut C,
    id: &OrderId,
) -> Result<Vec<RefundRecord>, StoreError> {
    let refund_rows = statement(
        "SELECT id, attempt_id, status, amount_minor, currency, gateway_refund_id, reason, failure_reason, \
         resolution, resolved_by, resolution_remark, resolved_at \
         FROM refund WHERE order_id = $1 ORDER BY created_at, id",
    )
    .bind(id.as_str())
    .fetch_all_rows(&mut *connection)
    .await?;
    let mut refunds = Vec::with_capacity(refund_rows.len());
    for row in &refund_rows {
        let refund: String = row.try_get("id")?;
        let attempt: String = row.try_get("attempt_id")?;
        let resolution: Option<String> = row.try_get("resolution")?;
        let resolution = match resolution {
            Some(resolution) => Some(crate::orders::RefundResolutionRecord {
                resolution: parse_stored(
                    "refund resolution",
                    &resolution,
                    domain::RefundResolution::parse,
                )?,
                by: row
                    .try_get::<Option<String>, _>("resolved_by")?
                    .unwrap_or_default(),
                remark: row
                    .try_get::<Option<String>, _>("resolution_remark")?
                    .unwrap_or_default(),
                at: Timestamp::from_unix_milliseconds(
                    row.try_get::<Option<i64>, _>("resolved_at")?
                        .unwrap_or_default(),
                ),
            }),
            None => None,
        };
        refunds.push(RefundRecord {
            id: parse_stored("refund id", &refund, RefundId::parse)?,
            attempt_id: parse_stored("attempt id", &attempt, PaymentAttemptId::parse)?,
            status: row.try_get("status")?,
            amount_minor: row.try_get("amount_minor")?,
            currency: row.try_get("currency")?,
            gateway_refund_id: row.try_get("gateway_refund_id")?,
            reason: row.try_get("reason")?,
            failure_reason: row.try_get("failure_reason")?,
            resolution,
        });
    }
    Ok(refunds)
}

/// The statuses an order went through, oldest first.
pub(crate) async fn order_history<C: Dialect>(
    connection: &mut C,
    id: &OrderId,
) -> Result<Vec<OrderHistoryEntry>, StoreError> {
    let history_rows = statement(
        "SELECT from_status, to_status, reason, created_at FROM order_history WHERE order_id = $1 ORDER BY id",
    )
    .bind(id.as_str())
    .fetch_all_as::<(Option<String>, String, String, i64)>(&mut *connection)
    .await?;
    let mut history = Vec::with_capacity(history_rows.len());
    for (from, to, reason, at) in history_rows {
        history.push(OrderHistoryEntry {
            from: from
                .as_deref()
                .map(|from| parse_stored("order status", from, OrderStatus::parse))
                .transpose()?,
            to: parse_stored("order status", &to, OrderStatus::parse)?,
            reason,
            at: Timestamp::from_unix_milliseconds(at),
        });
    }
    Ok(history)
}

pub(crate) async fn load_order<C: Dialect>(
    connection: &mut C,
    id: &OrderId,
) -> Result<Option<Order>, StoreError> {
    let row = statement(
        "SELECT shop, user_id, status, amount_minor, currency, reservation_id, expires_at, version, created_at, updated_at \
         FROM customer_order WHERE id = $1",
    )
    .bind(id.as_str())
    .fetch_optional_as::<(String, String, String, i64, String, String, i64, i64, i64, i64)>(&mut *connection)
    .await?;
    let Some((
        shop,
        user,
        status,
        amount_minor,
        currency,
        reservation,
        expires_at,
        version,
        created_at,
        updated_at,
    )) = row
    else {
        return Ok(None);
    };
    let reservation = parse_stored("reservation id", &reservation, ReservationId::parse)?;
    let reservation = load_reservation(&mut *connection, &reservation)
        .await?
        .ok_or_else(|| invariant(format!("order {id} has no reservation")))?;
    let lines = order_lines(&mut *connection, id).await?;
    let attempts = order_attempts(&mut *connection, id).await?;
    let refunds = order_refunds(&mut *connection, id).await?;
    let returned: Option<String> =
        statement("SELECT order_id FROM order_return WHERE order_id = $1")
            .bind(id.as_str())
            .fetch_optional_scalar(&mut *connection)
            .await?;
    let history = order_history(&mut *connection, id).await?;
    Ok(Some(Order {
        id: id.clone(),
        shop: parse_stored("shop", &shop, ShopCode::parse)?,
        user: parse_stored("user id", &user, OrderUserId::parse)?,
        status: parse_stored("order status", &status, OrderStatus::parse)?,
        amount_minor,
        currency: parse_stored("currency", &currency, Currency::parse)?,
        expires_at: Timestamp::from_unix_milliseconds(expires_at),
        version,
        created_at: Timestamp::from_unix_milliseconds(created_at),
        updated_at: Timestamp::from_unix_milliseconds(updated_at),
        lines,
        reservation,
        attempts,
        refunds,
        returned: returned.is_some(),
        history,
    }))
}

/// A paid order cancelled by staff: `REFUND_PENDING`, with a refund of the attempt that
/// paid it for the refund worker to issue, and its units no longer counted against
/// the shopper's per-user limits.
pub(crate) async fn cancel_paid_order<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    reservation: &ReservationId,
    now: Timestamp,
) -> Result<(), StoreError> {
    move_order(
        &mut *transaction,
        order,
        OrderStatus::Paid,
        OrderStatus::RefundPending,
        "cancelled after payment: refund",
        now,
    )
    .await?;
    let Some(paid_by) = paying_attempt(&mut *transaction, order).await? else {
        return Err(invariant(format!(
            "paid order {order} has no succeeded attempt"
        )));
    };
    insert_refund(&mut *transaction, &paid_by, now, "cancelled after payment").await?;
    give_back_refunded_units(&mut *transaction, reservation).await
}

/// A change's answer about an order: its refusal, or the order as the change left it.
pub(crate) async fn order_answer<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    refusal: Option<Rejection>,
    renderer: &dyn ResponseRenderer,
) -> Result<StoredResponse, StoreError> {
    Ok(match refusal {
        Some(rejection) => renderer.rejected(&rejection),
        None => {
            let loaded = load_order(&mut *transaction, order)
                .await?
                .ok_or_else(|| invariant("an order vanished inside its own transaction"))?;
            renderer.order(&loaded, false)
        }
    })
}

/// Expires `orders` (locked, unpaid, holding stock): their reservations go back, in
/// the one global lock order, then each order moves to `EXPIRED`. A refused move comes
/// back as the refusal ([`super::reservations::failure_on_the_data`] reads it).
async fn expire_these<C: Dialect>(
    transaction: &mut C,
    orders: &[(OrderId, OrderStatus, ReservationId)],
    now: Timestamp,
) -> Result<Vec<Result<(), Rejection>>, StoreError> {
    let moves: Vec<Move<'_>> = orders
        .iter()
        .map(|(_, _, reservation)| Move {
            id: reservation,
            action: ReservationAction::Release,
            reason: ReleaseReason::Expired,
            key: None,
        })
        .collect();
    let outcomes =
        settle_reservations(&mut *transaction, &moves, Mover::HoldingOrders, now).await?;
    if outcomes.iter().any(Result::is_err) {
        return Ok(outcomes);
    }
    for (order, status, _) in orders {
        move_order(
            &mut *transaction,
            order,
            *status,
            OrderStatus::Expired,
            "hold ended unpaid",
            now,
        )
        .await?;
    }
    Ok(outcomes)
}

impl<B: Backend> Units<B> {
    /// Begins a unit of work on `order` under `claim`: the order's row lock before
    /// the key, as every unit of work on an order takes them (two orders' units under
    /// one key would otherwise lock in opposite orders), then the key claimed.
    pub(crate) async fn open_on_order(
        &self,
        order: &OrderId,
        claim: &IdempotencyClaim,
        now: Timestamp,
    ) -> Result<OnOrder<B::Transaction>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let locked = lock_order(&mut *transaction, order).await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(OnOrder::Answered(answer));
        }
        Ok(OnOrder::Open(transaction, locked))
    }

    /// An order and its reservation, in one transaction: all lines reserved or none,
    /// the amount from the SKUs' prices, the shopper's open holds and per-user limits
    /// counted. The reservation is held by the order: only its flow moves it.
    pub async fn create_order(
        &self,
        claim: &IdempotencyClaim,
        order: &NewOrder,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let mut plan = self.plan_order(&mut *transaction, order).await?;
        if !plan.undecided.is_empty() {
            // A campaign's bucket was short: nothing stored, the key not claimed, and
            // the next bucket tried. Before a checkout leaves a line out below: its
            // line is short only once the last bucket says so.
            transaction.rollback().await?;
            return Ok(Idempotent::Undecided);
        }
        // A checkout leaves out the lines that cannot be sold (seed 003 §5.1): one that
        // went short or off the shelf, or past the shopper's limit through another of
        // their orders, after the cart was read is found so only here,
        // under the locks, and is left out with its problem instead of refusing the
        // lines that can still be ordered.
        let narrowed = match &plan.decisions[0] {
            Err(rejection)
                if order.skipped.is_some()
                    && order.lines.len() > 1
                    && matches!(
                        rejection.code,
                        ErrorCode::InsufficientStock
                            | ErrorCode::OffShelf
                            | ErrorCode::PurchaseLimitExceeded
                    ) =>
            {
                self.without_lines_gone_bad(&mut *transaction, order)
                    .await?
            }
            _ => None,
        };
        if let Some(narrowed) = &narrowed {
            plan = self.plan_order(&mut *transaction, narrowed).await?;
        }
        let order = narrowed.as_ref().unwrap_or(order);
        let decided = plan.decisions[0].clone();
        let checkout = order.skipped.is_some();
        let priced = match decided {
            Ok(shop) if checkout => {
                match cart_lines_as_read(&mut *transaction, &shop, &order.user, &order.lines)
                    .await?
                {
                    Ok(()) => price_order(&mut *transaction, order)
                        .await?
                        .map(|prices| (shop, prices)),
                    Err(rejection) => Err(rejection),
                }
            }
            Ok(shop) => price_order(&mut *transaction, order)
                .await?
                .map(|prices| (shop, prices)),
            Err(rejection) => Err(rejection),
        };
        // Another shop's SKUs (found so only under the lock: a SKU created meanwhile)
        // store nothing, as every 403: the key stays free, and a retry is decided again.
        if let Err(rejection) = &priced
            && rejection.code == ErrorCode::Forbidden
        {
            transaction.rollback().await?;
            return Ok(Idempotent::Forbidden(rejection.detail.clone()));
        }
        let response = match priced {
            Err(rejection) => renderer.rejected(&rejection),
            Ok((shop, prices)) => {
                write_order(&mut *transaction, claim, order, &shop, &plan, &prices, now).await?;
                if checkout {
                    // The ordered lines leave the cart with the order, or neither
                    // happens: a checkout interrupted after its commit leaves no line
                    // behind to be ordered twice.
                    remove_checked_out_lines(&mut *transaction, &shop, &order.user, &order.lines)
                        .await?;
                }
                super::batch::record_order_reference(
                    &mut *transaction,
                    &order.reservation_id,
                    &shop,
                    &order.reference,
                    now,
                )
                .await?;
                add_to_tallies(
                    &mut *transaction,
                    &plan.holds_added,
                    &plan.purchases_added,
                    self.limits().open_holds_max,
                )
                .await?;
                let created = load_order(&mut *transaction, &order.id)
                    .await?
                    .ok_or_else(|| invariant("an order vanished inside its own transaction"))?;
                match &order.skipped {
                    Some(skipped) => renderer.checked_out(&created, skipped),
                    None => renderer.order(&created, true),
                }
            }
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// A checkout's order without the lines that cannot be sold now, as each decided
    /// alone under the order's locks finds (short: `out_of_stock`, or
    /// `quantity_above_available` while some is left; `off_shelf`), those added to its
    /// skipped lines; `None` when no line is refused alone or none would be left (the
    /// whole order's refusal stands).
    async fn without_lines_gone_bad(
        &self,
        transaction: &mut B::Connection,
        order: &NewOrder,
    ) -> Result<Option<NewOrder>, StoreError> {
        let mut kept = Vec::with_capacity(order.lines.len());
        let mut skipped = order.skipped.clone().unwrap_or_default();
        let skipped_before = skipped.len();
        for line in &order.lines {
            let alone = NewOrder {
                lines: vec![line.clone()],
                ..order.clone()
            };
            let plan = self.plan_order(&mut *transaction, &alone).await?;
            let problem = match &plan.decisions[0] {
                Err(rejection) if rejection.code == ErrorCode::OffShelf => {
                    Some(domain::cart::CartProblem::OffShelf)
                }
                // The line alone is over the limit: the shopper's other orders took it.
                // (At the bound of open holds every line is, and nothing is kept.)
                Err(rejection) if rejection.code == ErrorCode::PurchaseLimitExceeded => {
                    Some(domain::cart::CartProblem::AbovePurchaseLimit)
                }
                Err(rejection) if rejection.code == ErrorCode::InsufficientStock => {
                    let available =
                        available_in(&mut *transaction, &line.sku, &line.warehouse).await?;
                    Some(if available > 0 {
                        domain::cart::CartProblem::QuantityAboveAvailable
                    } else {
                        domain::cart::CartProblem::OutOfStock
                    })
                }
                _ => None,
            };
            match problem {
                Some(problem) => skipped.push(crate::catalog::SkippedLine {
                    sku: line.sku.clone(),
                    quantity: line.quantity.get(),
                    problem,
                }),
                None => kept.push(line.clone()),
            }
        }
        if kept.is_empty() || skipped.len() == skipped_before {
            return Ok(None);
        }
        Ok(Some(NewOrder {
            lines: kept,
            skipped: Some(skipped),
            ..order.clone()
        }))
    }

    /// Locks an order's stock rows (in the global order) and its shopper's tallies, and
    /// decides it like a reservation batch of one.
    async fn plan_order(
        &self,
        transaction: &mut B::Connection,
        order: &NewOrder,
    ) -> Result<BatchPlan, StoreError> {
        let mut wanted: Vec<StockKey> = order
            .lines
            .iter()
            .map(|line| (line.sku.clone(), line.warehouse.clone()))
            .collect();
        wanted.sort();
        let (available, skus) = transaction.lock_stock_rows(&wanted).await?;
        let skus = with_unlisted_skus(&mut *transaction, &wanted, skus).await?;
        let skus = super::batch::with_campaign_facts(
            &mut *transaction,
            &wanted,
            skus,
            &self.campaign_limits,
        )
        .await?;
        let shopper = order
            .lines
            .first()
            .and_then(|line| skus.get(&line.sku))
            .map(|facts| (facts.shop.clone(), order.user.clone()));
        let limited: Vec<PurchaseKey> = match &shopper {
            Some((shop, user)) => order
                .lines
                .iter()
                .filter(|line| domain::plan::limit_of(line, &skus).is_some())
                .map(|line| {
                    (
                        shop.clone(),
                        user.clone(),
                        domain::campaign::tally_sku(&line.sku, &line.warehouse),
                    )
                })
                .collect(),
            None => Vec::new(),
        };
        let order_ref_taken = match (&order.reference.order_ref, &shopper) {
            (Some(order_ref), Some((shop, _))) => {
                super::batch::order_ref_exists(&mut *transaction, shop.as_str(), order_ref).await?
            }
            _ => false,
        };
        let tallies = read_tallies(
            &mut *transaction,
            shopper.into_iter().collect(),
            limited,
            self.limits().open_holds_max,
        )
        .await?;
        Ok(plan_batch(
            [PlanRequest {
                lines: &order.lines,
                shop: &order.shop,
                user: Some(&order.user),
                order_ref_taken,
                order_ref: None,
                undecided_when_short: order.undecided_when_short,
            }],
            &skus,
            &available,
            &tallies,
        ))
    }

    /// Orders newest first (the staff's and a checkout's search): of one shop and one
    /// shopper when given, older than the order `before`, at most `limit`.
    pub async fn order_summaries(
        &self,
        shop: Option<&ShopCode>,
        user: Option<&OrderUserId>,
        before: Option<&OrderId>,
        limit: i64,
    ) -> Result<Vec<OrderSummary>, StoreError> {
        let rows = statement(
            "SELECT id, shop, user_id, status, amount_minor, currency, created_at, updated_at \
             FROM customer_order WHERE ($1 IS NULL OR shop = $1) AND ($2 IS NULL OR user_id = $2) \
             AND ($3 IS NULL OR id < $3) ORDER BY id DESC LIMIT $4",
        )
        .bind(shop.map(ShopCode::as_str))
        .bind(user.map(OrderUserId::as_str))
        .bind(before.map(OrderId::as_str))
        .bind(limit)
        .fetch_all_rows(&mut *self.writer_read_connection().await?)
        .await?;
        rows.iter()
            .map(|row| {
                let id: String = row.try_get("id")?;
                let shop: String = row.try_get("shop")?;
                let user: String = row.try_get("user_id")?;
                let status: String = row.try_get("status")?;
                let currency: String = row.try_get("currency")?;
                Ok(OrderSummary {
                    id: parse_stored("order id", &id, OrderId::parse)?,
                    shop: parse_stored("shop", &shop, ShopCode::parse)?,
                    user: parse_stored("user id", &user, OrderUserId::parse)?,
                    status: parse_stored("order status", &status, OrderStatus::parse)?,
                    amount_minor: row.try_get("amount_minor")?,
                    currency: parse_stored("currency", &currency, Currency::parse)?,
                    created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
                    updated_at: Timestamp::from_unix_milliseconds(row.try_get("updated_at")?),
                })
            })
            .collect()
    }

    /// The shop an order belongs to (fixed at creation).
    pub async fn order_shop(&self, id: &OrderId) -> Result<Option<ShopCode>, StoreError> {
        let shop: Option<String> = statement("SELECT shop FROM customer_order WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional_scalar(&mut *self.write_connection().await?)
            .await?;
        shop.map(|shop| parse_stored("shop", &shop, ShopCode::parse))
            .transpose()
    }

    pub async fn order(&self, id: &OrderId) -> Result<Option<Order>, StoreError> {
        let mut transaction = self.begin_writer_read().await?;
        let order = load_order(&mut *transaction, id).await;
        transaction.rollback().await?;
        order
    }

    /// `GET /v1/orders/{id}`, a display read (payments and cancels read the writer's).
    pub async fn display_order(
        &self,
        reader: &ReadHandle,
        id: &OrderId,
        now: Timestamp,
    ) -> Result<Displayed<Option<Order>>, StoreError> {
        displayed!(self, reader, now, |transaction| load_order(
            &mut *transaction,
            id
        )
        .await)
    }

    /// Expires up to `limit` orders still waiting for payment past their hold (unpaid,
    /// or declined and not paid again): their stock goes back. Orders with a payment in
    /// flight are left to reconciliation. The claim starts after `cursor` (the previous
    /// step's [`OrderExpiry::resume_after`], see [`ExpiryCursor`]).
    pub async fn expire_orders(
        &self,
        now: Timestamp,
        hold_ends_by: Timestamp,
        limit: i64,
        cursor: Option<&ExpiryCursor>,
    ) -> Result<OrderExpiry, StoreError> {
        let mut transaction = self.begin_write().await?;
        let (ids, resume_after) = claim_past_cursor(
            &mut *transaction,
            <B::Connection as Dialect>::CLAIM_EXPIRED_ORDERS,
            (hold_ends_by, limit),
            cursor,
        )
        .await?;
        // The claim locked the orders; their reservations and stock rows are then
        // settled together, in the one global lock order (reservation ids, then
        // (sku, warehouse)), never order by order.
        let mut expiring: Vec<(OrderId, OrderStatus, ReservationId)> =
            Vec::with_capacity(ids.len());
        for id in ids {
            let order = parse_stored("order id", &id, OrderId::parse)?;
            let Some((status, reservation, _)) = lock_order(&mut *transaction, &order).await?
            else {
                continue;
            };
            if status.accepts_a_payment_attempt() {
                expiring.push((order, status, reservation));
            }
        }
        // As the reservation expiry does: the whole claim under a savepoint, and when
        // the data around one order is broken (its stock row holding fewer units
        // reserved than its hold, by a hand edit or a defect), one order at a time,
        // each under a savepoint. The broken one stays as it is, reported for a
        // person; before, it rolled the whole step back, and, claimed first again by
        // every later step, stopped every unpaid order of every shop expiring.
        begin_whole_batch(&mut *transaction).await?;
        let whole = expire_these(&mut *transaction, &expiring, now).await;
        if kept_whole(&mut *transaction, "an order expiry batch", whole).await? {
            transaction.commit().await?;
            return Ok(OrderExpiry {
                expired: expiring.into_iter().map(|(order, _, _)| order).collect(),
                stuck: Vec::new(),
                deferred: Vec::new(),
                resume_after,
            });
        }
        let mut one_by_one = OneByOne::start(&mut *transaction, expiring.len()).await?;
        for single in expiring {
            let reservation = single.2.clone();
            let Some(single) = one_by_one
                .next(&mut *transaction, single, &reservation)
                .await?
            else {
                continue;
            };
            let settled = expire_these(&mut *transaction, std::slice::from_ref(&single), now).await;
            one_by_one
                .record(&mut *transaction, single, settled)
                .await?;
        }
        transaction.commit().await?;
        let orders_of = |expiring: Vec<(OrderId, OrderStatus, ReservationId)>| {
            expiring.into_iter().map(|(order, _, _)| order).collect()
        };
        Ok(OrderExpiry {
            expired: orders_of(one_by_one.settled),
            stuck: one_by_one
                .stuck
                .into_iter()
                .map(|((order, _, _), failure)| (order, failure))
                .collect(),
            deferred: orders_of(one_by_one.deferred),
            resume_after,
        })
    }

    /// `POST /v1/orders/{id}/cancel`: an unpaid order gives its stock back; a paid one
    /// goes to `REFUND_PENDING` with a refund to issue. A payment in flight must be
    /// resolved first.
    pub async fn cancel_order(
        &self,
        claim: &IdempotencyClaim,
        order: &OrderId,
        rights: CancelRights,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let (mut transaction, locked) = match self.open_on_order(order, claim, now).await? {
            OnOrder::Answered(answer) => return Ok(answer),
            OnOrder::Open(transaction, locked) => (transaction, locked),
        };
        let holds_stock = match &locked {
            Some((_, reservation, _)) => {
                reservation_status(&mut *transaction, reservation).await?
                    == ReservationStatus::Reserved
            }
            None => false,
        };
        // Which cancel this is depends on the status found under the lock, and so
        // does whether the caller's role may make it.
        let forbidden = match &locked {
            Some((status, _, _)) if status.accepts_a_payment_attempt() && holds_stock => {
                (!rights.unpaid).then_some(
                    "the order is not paid: the shop's checkout (its service key) or an admin cancels it",
                )
            }
            Some((OrderStatus::Paid, _, _)) => (!rights.paid)
                .then_some("the order is paid: cancelling it (and refunding) is a staff decision"),
            _ => None,
        };
        if let Some(detail) = forbidden {
            transaction.rollback().await?;
            return Ok(Idempotent::Forbidden(detail.to_owned()));
        }
        let refusal = match locked {
            None => Some(Rejection::new(
                ErrorCode::NotFound,
                format!("order '{order}' does not exist"),
            )),
            // Unpaid, or declined with its hold kept.
            Some((status, reservation, _)) if status.accepts_a_payment_attempt() && holds_stock => {
                release_order(
                    &mut *transaction,
                    order,
                    &reservation,
                    (status, OrderStatus::Cancelled),
                    ("cancelled", Some(claim.key.as_str())),
                    now,
                )
                .await?;
                None
            }
            Some((OrderStatus::Paid, reservation, _)) => {
                cancel_paid_order(&mut *transaction, order, &reservation, now).await?;
                None
            }
            // Not a transition the table allows: the payment's outcome decides first.
            Some((OrderStatus::PaymentProcessing, _, _)) => Some(Rejection::new(
                ErrorCode::IllegalTransition,
                "a payment is in flight; the order can be cancelled once its outcome is known",
            )),
            Some((status, _, _)) => Some(Rejection::new(
                ErrorCode::IllegalTransition,
                format!("an order cannot be cancelled from {}", status.as_str()),
            )),
        };
        let response = order_answer(&mut *transaction, order, refusal, renderer).await?;
        commit_with_answer(transaction, claim, response).await
    }

    /// After-sale return: the order's goods go back to available stock, with `return`
    /// ledger rows, once (`order_return` guards it), and only when they left stock: the
    /// order's reservation is confirmed. The SKUs' sale status is not
    /// touched: a returned unit of an off-shelf SKU stays off the shelf.
    pub async fn return_order(
        &self,
        claim: &IdempotencyClaim,
        order: &OrderId,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let (mut transaction, locked) = match self.open_on_order(order, claim, now).await? {
            OnOrder::Answered(answer) => return Ok(answer),
            OnOrder::Open(transaction, locked) => (transaction, locked),
        };
        let refusal = match locked {
            None => Some(Rejection::new(
                ErrorCode::NotFound,
                format!("order '{order}' does not exist"),
            )),
            Some((status, _, _))
                if !matches!(
                    status,
                    OrderStatus::Paid | OrderStatus::RefundPending | OrderStatus::Refunded
                ) =>
            {
                Some(Rejection::new(
                    ErrorCode::IllegalTransition,
                    format!(
                        "only a paid order's goods can come back (order is {})",
                        status.as_str()
                    ),
                ))
            }
            Some((_, reservation, _))
                if reservation_status(&mut *transaction, &reservation).await?
                    != ReservationStatus::Confirmed =>
            {
                // A late success that found no stock (or no sale) refunds an order whose
                // reservation was released: those goods never left stock.
                Some(Rejection::new(
                    ErrorCode::IllegalTransition,
                    format!(
                        "order '{order}' never took its goods out of stock (its payment came after they were given back): nothing to return"
                    ),
                ))
            }
            Some(_) => {
                let guarded = statement("INSERT INTO order_return (order_id, created_at) VALUES ($1, $2) ON CONFLICT (order_id) DO NOTHING")
                    .bind(order.as_str())
                    .bind(now.unix_milliseconds())
                    .execute(&mut *transaction)
                    .await?;
                if guarded == 0 {
                    Some(Rejection::new(
                        ErrorCode::IllegalTransition,
                        format!("order '{order}' was returned already"),
                    ))
                } else {
                    put_goods_back(&mut *transaction, order, claim, now).await?;
                    None
                }
            }
        };
        let response = order_answer(&mut *transaction, order, refusal, renderer).await?;
        commit_with_answer(transaction, claim, response).await
    }
}

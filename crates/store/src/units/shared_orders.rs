//! Orders and payments (seed 000), written once for every backend.
//!
//! No unit of work here calls the gateway: a payment attempt is committed before the
//! call and settled by a later transaction. Locks are taken order first, then its
//! reservation, then stock rows in (sku, warehouse) order.

use super::shared::*;
use super::shared_catalog::*;
#[allow(unused_imports)]
use std::collections::HashMap;

use domain::{
    Currency, ErrorCode, OrderId, Quantity, ReleaseReason, ReservationId, ReservationLine,
    ReservationStatus, ShopCode, SkuCode, Timestamp, WarehouseCode,
};

use super::Units;
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{
    IdempotencyClaim, Idempotent, Rejection, ReservationAction, ResponseRenderer, ShopScope,
    StoredResponse,
};
use crate::plan::{PlanRequest, PurchaseKey, ShopperKey, StockKey, plan_batch};
use crate::sql::{Connection, statement};
use domain::{AttemptStatus, OrderStatus, PaymentAttemptId, RefundId, UserId as OrderUserId};

use crate::orders::{
    AttemptToCall, BeginPayment, GatewayOutcome, NewOrder, Order, OrderHistoryEntry, OrderLine,
    PaymentAttempt, PaymentGauges, RefundRecord, RefundToIssue,
};

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

/// Moves an order through the transition table with a conditional update on its
/// current status, and records the change in its history.
pub(crate) async fn move_order<C: Connection>(
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

pub(crate) async fn insert_history<C: Connection>(
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
    .bind(reason)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

/// Releases the reservation a locked order holds and moves the order out (to `EXPIRED`
/// or `CANCELLED`): one step of the order's own flow, so no one else can be moving it.
pub(crate) async fn release_order<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    reservation: &ReservationId,
    from: OrderStatus,
    to: OrderStatus,
    why: &str,
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
        ReservationAction::Release,
        reason,
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

/// The locked order's status, reservation and hold end.
pub(crate) async fn lock_order<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
) -> Result<Option<(OrderStatus, ReservationId, Timestamp)>, StoreError> {
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

/// The status of a reservation its locked order holds (the order's lock guards it).
pub(crate) async fn reservation_status<C: Connection>(
    transaction: &mut C,
    reservation: &ReservationId,
) -> Result<ReservationStatus, StoreError> {
    let status: String = statement("SELECT status FROM reservation WHERE id = $1")
        .bind(reservation.as_str())
        .fetch_one_scalar(&mut *transaction)
        .await?;
    parse_stored("reservation status", &status, ReservationStatus::parse)
}

pub(crate) async fn order_lines<C: Connection>(
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

/// A success arrived for an order that gave its stock back: take the stock again
/// (reserved and confirmed at once) when every line still fits, and the order is
/// `PAID`; otherwise it goes `REFUND_PENDING` with a refund to issue.
pub(crate) async fn settle_late_success<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    attempt: &PaymentAttemptId,
    from: OrderStatus,
    payment_id: &str,
    now: Timestamp,
) -> Result<OrderStatus, StoreError> {
    let sale = plan_late_sale(transaction, order).await?;
    if let Err(refused) = &sale.plan.decisions[0] {
        let reason = format!(
            "paid after its stock was given back; cannot be sold again ({}): refund",
            refused.detail
        );
        move_order(
            transaction,
            order,
            from,
            OrderStatus::RefundPending,
            &reason,
            now,
        )
        .await?;
        insert_refund(
            transaction,
            attempt,
            now,
            "the payment arrived after the stock was given back, and it could not be sold again",
        )
        .await?;
        return Ok(OrderStatus::RefundPending);
    }
    take_stock_again(transaction, order, from, &sale, payment_id, now).await
}

/// What taking an order's stock again would do, decided like a new sale under the
/// locks of its stock rows and its shopper's tallies.
pub(crate) struct LateSale {
    pub(crate) reservation_lines: Vec<ReservationLine>,
    pub(crate) shopper: ShopperKey,
    pub(crate) plan: crate::plan::BatchPlan,
}

pub(crate) async fn plan_late_sale<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
) -> Result<LateSale, StoreError> {
    let lines = order_lines(transaction, order).await?;
    let mut wanted: Vec<StockKey> = lines
        .iter()
        .map(|line| (line.sku.clone(), line.warehouse.clone()))
        .collect();
    wanted.sort();
    wanted.dedup();
    let (available, skus) = transaction.lock_stock_rows(&wanted).await?;
    let (shop, user): (String, String) =
        statement("SELECT shop, user_id FROM customer_order WHERE id = $1")
            .bind(order.as_str())
            .fetch_one_as(&mut *transaction)
            .await?;
    let shopper = (
        parse_stored("shop", &shop, ShopCode::parse)?,
        parse_stored("user id", &user, OrderUserId::parse)?,
    );
    // Taken again like a new sale: on sale, in stock, within the shopper's per-user
    // limits (the sold units count; a hold does not, since none stays open).
    let limited: Vec<PurchaseKey> = lines
        .iter()
        .filter(|line| {
            skus.get(&line.sku)
                .is_some_and(|facts| facts.per_user_limit.is_some())
        })
        .map(|line| (shopper.0.clone(), shopper.1.clone(), line.sku.clone()))
        .collect();
    let tallies = read_tallies(transaction, vec![shopper.clone()], limited, i64::MAX).await?;
    let reservation_lines = lines
        .iter()
        .map(|line| {
            Ok(ReservationLine {
                sku: line.sku.clone(),
                warehouse: line.warehouse.clone(),
                quantity: Quantity::new(line.quantity)
                    .map_err(|error| corrupt("order line quantity", error))?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let scope = ShopScope::Verified(shopper.0.clone());
    let plan = plan_batch(
        [PlanRequest {
            lines: &reservation_lines,
            shop: &scope,
            user: Some(&shopper.1),
        }],
        &skus,
        &available,
        &tallies,
    );
    Ok(LateSale {
        reservation_lines,
        shopper,
        plan,
    })
}

/// Takes a paid order's stock again (its late success fitted): a new reservation,
/// reserved and confirmed through the transition table, and the order `PAID`.
pub(crate) async fn take_stock_again<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    from: OrderStatus,
    sale: &LateSale,
    payment_id: &str,
    now: Timestamp,
) -> Result<OrderStatus, StoreError> {
    let LateSale {
        reservation_lines,
        shopper,
        plan,
    } = sale;
    // Taken as any sale is: a hold (counted against the shopper until it is confirmed
    // below, so the open-hold tally ends where it started) reserved like a new order's,
    // then confirmed through the reservation's transition table.
    add_to_tallies(
        transaction,
        &plan.holds_added,
        &plan.purchases_added,
        i64::MAX,
    )
    .await?;
    let reservation = ReservationId::generate(now, derived_random(order.as_str(), "late-success"));
    let hold = OrderHold {
        id: &reservation,
        order,
        shopper: (&shopper.0, &shopper.1),
        expires_at: now,
        request_key: None,
        ledger_key: payment_id,
        lines: reservation_lines,
        totals: &plan.totals,
    };
    write_order_hold(transaction, &hold, now).await?;
    statement("UPDATE customer_order SET reservation_id = $2 WHERE id = $1")
        .bind(order.as_str())
        .bind(reservation.as_str())
        .execute(&mut *transaction)
        .await?;
    let Ok(()) = settle_order_reservation(
        transaction,
        order,
        &reservation,
        ReservationAction::Confirm,
        ReleaseReason::Requested,
        now,
    )
    .await?
    else {
        return Err(invariant(format!(
            "order {order}: the stock taken again could not be confirmed"
        )));
    };
    move_order(
        transaction,
        order,
        from,
        OrderStatus::Paid,
        "paid after its stock was given back; stock taken again",
        now,
    )
    .await?;
    Ok(OrderStatus::Paid)
}

/// A refund of what `attempt` charged, to be issued by the refund worker with its own
/// gateway key. One per attempt.
pub(crate) async fn insert_refund<C: Connection>(
    transaction: &mut C,
    attempt: &PaymentAttemptId,
    now: Timestamp,
    reason: &str,
) -> Result<(), StoreError> {
    let id = RefundId::generate(now, derived_random(attempt.as_str(), "refund"));
    statement(
        "INSERT INTO refund (id, order_id, attempt_id, gateway_key, status, amount_minor, currency, reason, \
         next_try_at, created_at, updated_at) \
         SELECT $1, order_id, id, $2, 'PENDING', amount_minor, currency, $3, $4, $4, $4 FROM payment_attempt WHERE id = $5 \
         ON CONFLICT (attempt_id) DO NOTHING",
    )
    .bind(id.as_str())
    .bind(format!("stockd-refund-{attempt}"))
    .bind(reason)
    .bind(now.unix_milliseconds())
    .bind(attempt.as_str())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

/// An after-sale return's effect: every line of the order back to available stock, in
/// (sku, warehouse) order, each with its `return` ledger row.
pub(crate) async fn put_goods_back<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    claim: &IdempotencyClaim,
    now: Timestamp,
) -> Result<(), StoreError> {
    let mut lines = order_lines(transaction, order).await?;
    lines.sort_by(|left, right| (&left.sku, &left.warehouse).cmp(&(&right.sku, &right.warehouse)));
    for line in &lines {
        let updated = statement(
            "UPDATE stock SET available = available + $3, version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2",
        )
        .bind(line.sku.as_str())
        .bind(line.warehouse.as_str())
        .bind(line.quantity)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        expect_one_row(updated, "returning an order's goods")?;
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
    }
    Ok(())
}

/// The attempt that paid an order, if one did.
pub(crate) async fn paying_attempt<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
) -> Result<Option<PaymentAttemptId>, StoreError> {
    let id: Option<String> =
        statement("SELECT id FROM payment_attempt WHERE order_id = $1 AND status = 'SUCCEEDED'")
            .bind(order.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
    id.map(|id| parse_stored("attempt id", &id, PaymentAttemptId::parse))
        .transpose()
}

/// Applies what the gateway said to a locked attempt and its order. Idempotent: an
/// attempt already settled the same way changes nothing, and a failure reported
/// after a success changes nothing either.
pub(crate) async fn settle_attempt<C: Connection>(
    transaction: &mut C,
    attempt: &PaymentAttemptId,
    outcome: &GatewayOutcome,
    source: &str,
    now: Timestamp,
) -> Result<Option<OrderStatus>, StoreError> {
    // Order first, then the attempt: the lock order every order transaction keeps.
    let order: Option<String> = statement("SELECT order_id FROM payment_attempt WHERE id = $1")
        .bind(attempt.as_str())
        .fetch_optional_scalar(&mut *transaction)
        .await?;
    let Some(order) = order else { return Ok(None) };
    let order = parse_stored("order id", &order, OrderId::parse)?;
    let Some((order_status, reservation, _)) = lock_order(transaction, &order).await? else {
        return Err(invariant(format!("attempt {attempt} has no order")));
    };
    let status: String = statement(C::SELECT_ATTEMPT_STATUS_FOR_UPDATE)
        .bind(attempt.as_str())
        .fetch_one_scalar(&mut *transaction)
        .await?;
    let status = parse_stored("attempt status", &status, AttemptStatus::parse)?;
    match (status, outcome) {
        (AttemptStatus::Succeeded, _) => Ok(Some(order_status)),
        (
            AttemptStatus::Failed,
            GatewayOutcome::Failed { .. } | GatewayOutcome::Abandoned { .. },
        ) => Ok(Some(order_status)),
        (_, GatewayOutcome::Succeeded { payment_id }) => {
            let settling = Settling {
                attempt,
                order: &order,
                order_status,
                reservation: &reservation,
                source,
                now,
            };
            apply_success(transaction, &settling, payment_id).await
        }
        (
            AttemptStatus::Processing,
            GatewayOutcome::Failed { payment_id, reason }
            | GatewayOutcome::Abandoned { payment_id, reason },
        ) => {
            let settling = Settling {
                attempt,
                order: &order,
                order_status,
                reservation: &reservation,
                source,
                now,
            };
            apply_failure(
                transaction,
                &settling,
                outcome,
                payment_id.as_deref(),
                reason,
            )
            .await
        }
    }
}

/// A locked attempt and its locked order, being settled.
#[derive(Clone, Copy)]
pub(crate) struct Settling<'a> {
    pub(crate) attempt: &'a PaymentAttemptId,
    pub(crate) order: &'a OrderId,
    pub(crate) order_status: OrderStatus,
    pub(crate) reservation: &'a ReservationId,
    pub(crate) source: &'a str,
    pub(crate) now: Timestamp,
}

pub(crate) async fn set_attempt_status<C: Connection>(
    transaction: &mut C,
    attempt: &PaymentAttemptId,
    status: AttemptStatus,
    payment_id: Option<&str>,
    reason: Option<&str>,
    now: Timestamp,
) -> Result<(), StoreError> {
    let updated = statement(
        "UPDATE payment_attempt SET status = $2, gateway_payment_id = COALESCE($3, gateway_payment_id), \
         failure_reason = $4, updated_at = $5 WHERE id = $1",
    )
    .bind(attempt.as_str())
    .bind(status.as_str())
    .bind(payment_id)
    .bind(reason)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "settling a locked payment attempt")
}

/// The gateway says the attempt succeeded: the order is paid (or, when its stock was
/// given back, takes it again or is refunded); a second charge is refunded.
pub(crate) async fn apply_success<C: Connection>(
    transaction: &mut C,
    settling: &Settling<'_>,
    payment_id: &str,
) -> Result<Option<OrderStatus>, StoreError> {
    let Settling {
        attempt,
        order,
        order_status,
        reservation,
        source,
        now,
    } = *settling;
    // At most one attempt pays an order (a unique index says so too). Another
    // one charged as well is a second charge: recorded, not applied, and
    // refunded, so the order keeps one charge.
    let paid_by: Option<String> = statement(
        "SELECT id FROM payment_attempt WHERE order_id = $1 AND status = 'SUCCEEDED' AND id <> $2",
    )
    .bind(order.as_str())
    .bind(attempt.as_str())
    .fetch_optional_scalar(&mut *transaction)
    .await?;
    if let Some(paid_by) = paid_by {
        let reason =
            format!("charged ({payment_id}) after attempt {paid_by} had paid the order: refunded");
        tracing::warn!(order = %order, %attempt, %payment_id, "a second payment succeeded for an order paid already; refunding it");
        set_attempt_status(
            transaction,
            attempt,
            AttemptStatus::Failed,
            Some(payment_id),
            Some(&reason),
            now,
        )
        .await?;
        insert_refund(
            transaction,
            attempt,
            now,
            "a second payment for an order paid already",
        )
        .await?;
        return Ok(Some(order_status));
    }
    set_attempt_status(
        transaction,
        attempt,
        AttemptStatus::Succeeded,
        Some(payment_id),
        None,
        now,
    )
    .await?;
    let reason = format!("payment {payment_id} succeeded ({source})");
    let held = reservation_status(transaction, reservation).await?;
    match (order_status, held) {
        (
            OrderStatus::PaymentProcessing
            | OrderStatus::PendingPayment
            | OrderStatus::PaymentFailed,
            ReservationStatus::Reserved,
        ) => {
            let Ok(()) = settle_order_reservation(
                transaction,
                order,
                reservation,
                ReservationAction::Confirm,
                ReleaseReason::Requested,
                now,
            )
            .await?
            else {
                return Err(invariant(format!(
                    "order {order}: its reservation could not be confirmed"
                )));
            };
            move_order(
                transaction,
                order,
                order_status,
                OrderStatus::Paid,
                &reason,
                now,
            )
            .await?;
            Ok(Some(OrderStatus::Paid))
        }
        (
            status @ (OrderStatus::Expired | OrderStatus::Cancelled | OrderStatus::PaymentFailed),
            ReservationStatus::Released,
        ) => settle_late_success(transaction, order, attempt, status, payment_id, now)
            .await
            .map(Some),
        (status, _) => Ok(Some(status)),
    }
}

/// The gateway says the attempt failed (declined, refused) or was abandoned when the
/// hold ended: a decline keeps the hold for another card, an abandonment gives the
/// stock back.
pub(crate) async fn apply_failure<C: Connection>(
    transaction: &mut C,
    settling: &Settling<'_>,
    outcome: &GatewayOutcome,
    payment_id: Option<&str>,
    reason: &str,
) -> Result<Option<OrderStatus>, StoreError> {
    let Settling {
        attempt,
        order,
        order_status,
        reservation,
        source,
        now,
    } = *settling;
    set_attempt_status(
        transaction,
        attempt,
        AttemptStatus::Failed,
        payment_id,
        Some(reason),
        now,
    )
    .await?;
    match (outcome, order_status) {
        // Declined: the order keeps its hold, and another card may pay it until
        // the hold ends (then the order-expiry worker gives the stock back).
        (GatewayOutcome::Failed { .. }, OrderStatus::PaymentProcessing) => {
            move_order(
                transaction,
                order,
                order_status,
                OrderStatus::PaymentFailed,
                &format!(
                    "payment declined: {reason} ({source}); another payment may be tried while the hold lasts"
                ),
                now,
            )
            .await?;
            Ok(Some(OrderStatus::PaymentFailed))
        }
        // Not completed before the hold ended, and the gateway says it will not be.
        (GatewayOutcome::Abandoned { .. }, OrderStatus::PaymentProcessing) => {
            release_order(
                transaction,
                order,
                reservation,
                order_status,
                OrderStatus::Expired,
                &format!("payment abandoned: {reason} ({source})"),
                now,
            )
            .await?;
            Ok(Some(OrderStatus::Expired))
        }
        (_, status) => Ok(Some(status)),
    }
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
pub(crate) async fn price_order<C: Connection>(
    transaction: &mut C,
    order: &NewOrder,
) -> Result<Result<Prices, Rejection>, StoreError> {
    let mut prices = Vec::with_capacity(order.lines.len());
    for line in &order.lines {
        let price = statement("SELECT price_minor, currency FROM sku WHERE code = $1")
            .bind(line.sku.as_str())
            .fetch_one_as::<(Option<i64>, Option<String>)>(&mut *transaction)
            .await?;
        match price {
            (Some(price), Some(currency)) => prices.push((price, currency)),
            _ => {
                return Ok(Err(Rejection::new(
                    ErrorCode::InvalidArgument,
                    format!("sku '{}' has no price and cannot be ordered", line.sku),
                )));
            }
        }
    }
    if prices.windows(2).any(|pair| pair[0].1 != pair[1].1) {
        return Ok(Err(Rejection::new(
            ErrorCode::InvalidArgument,
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
            ErrorCode::InvalidArgument,
            "the order's total does not fit in a 64-bit amount of minor units",
        )));
    };
    if amount_minor == 0 {
        // Nothing to charge: the gateway would refuse it, and the stock would wait for
        // a payment that cannot happen.
        return Ok(Err(Rejection::new(
            ErrorCode::InvalidArgument,
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
pub(crate) async fn write_order<C: Connection>(
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

/// The one writer of an order-held reservation (a new order, a cart's checkout, a late
/// success): the stock taken row by row in (sku, warehouse) order, each conditional
/// update's row count checked; the reservation `RESERVED`; its lines with their
/// `reserve` ledger rows.
pub(crate) async fn write_order_hold<C: Connection>(
    transaction: &mut C,
    hold: &OrderHold<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    for ((sku, warehouse), total) in hold.totals {
        let updated = statement(
            "UPDATE stock SET available = available - $3, reserved = reserved + $3, \
             version = version + 1, updated_at = $4 WHERE sku = $1 AND warehouse = $2 AND available >= $3",
        )
        .bind(sku.as_str())
        .bind(warehouse.as_str())
        .bind(total)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        expect_one_row(updated, "taking an order's stock")?;
    }
    statement(
        "INSERT INTO reservation (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at, \
         order_id, shop, user_id) VALUES ($1, 'RESERVED', NULL, $2, $3, $4, $4, $5, $6, $7)",
    )
    .bind(hold.id.as_str())
    .bind(hold.expires_at.unix_milliseconds())
    .bind(hold.request_key)
    .bind(now.unix_milliseconds())
    .bind(hold.order.as_str())
    .bind(hold.shopper.0.as_str())
    .bind(hold.shopper.1.as_str())
    .execute(&mut *transaction)
    .await?;
    for (line_number, line) in hold.lines.iter().enumerate() {
        statement(
            "INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(hold.id.as_str())
        .bind(i64::try_from(line_number).unwrap_or(i64::MAX))
        .bind(line.sku.as_str())
        .bind(line.warehouse.as_str())
        .bind(line.quantity.get())
        .execute(&mut *transaction)
        .await?;
        insert_ledger_row(
            transaction,
            LedgerEntry {
                sku: &line.sku,
                warehouse: &line.warehouse,
                kind: "reserve",
                available_delta: -line.quantity.get(),
                reserved_delta: line.quantity.get(),
                reference: hold.id.as_str(),
                idempotency_key: Some(hold.ledger_key),
            },
            now,
        )
        .await?;
    }
    Ok(())
}

impl<B: Backend> Units<B> {
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
        let mut wanted: Vec<StockKey> = order
            .lines
            .iter()
            .map(|line| (line.sku.clone(), line.warehouse.clone()))
            .collect();
        wanted.sort();
        let (available, skus) = transaction.lock_stock_rows(&wanted).await?;
        let skus = with_unlisted_skus(&mut *transaction, &wanted, skus).await?;
        let shopper = order
            .lines
            .first()
            .and_then(|line| skus.get(&line.sku))
            .map(|facts| (facts.shop.clone(), order.user.clone()));
        let limited: Vec<PurchaseKey> = match &shopper {
            Some((shop, user)) => order
                .lines
                .iter()
                .filter(|line| {
                    skus.get(&line.sku)
                        .is_some_and(|facts| facts.per_user_limit.is_some())
                })
                .map(|line| (shop.clone(), user.clone(), line.sku.clone()))
                .collect(),
            None => Vec::new(),
        };
        let tallies = read_tallies(
            &mut *transaction,
            shopper.into_iter().collect(),
            limited,
            self.limits().open_holds_max,
        )
        .await?;
        let plan = plan_batch(
            [PlanRequest {
                lines: &order.lines,
                shop: &order.shop,
                user: Some(&order.user),
            }],
            &skus,
            &available,
            &tallies,
        );
        let decided = plan.decisions[0].clone();
        let priced = match decided {
            Ok(shop) => price_order(&mut *transaction, order)
                .await?
                .map(|prices| (shop, prices)),
            Err(rejection) => Err(rejection),
        };
        let response = match priced {
            Err(rejection) => renderer.rejected(&rejection),
            Ok((shop, prices)) => {
                write_order(&mut *transaction, claim, order, &shop, &plan, &prices, now).await?;
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
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
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
        let mut transaction = self.begin_read().await?;
        let order = load_order(&mut *transaction, id).await;
        transaction.rollback().await?;
        order
    }

    /// Starts paying an order: `PENDING_PAYMENT → PAYMENT_PROCESSING` with a new
    /// attempt, committed before the gateway is called. An order already processing
    /// hands back its running attempt, to be asked about again. Anything else is
    /// answered here, the answer stored under `claim` with what it changed.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin_payment(
        &self,
        claim: &IdempotencyClaim,
        order: &OrderId,
        attempt: &PaymentAttemptId,
        payment_method: &str,
        reconcile_after: Timestamp,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<BeginPayment, StoreError> {
        let mut transaction = self.begin_write().await?;
        let locked = lock_order(&mut *transaction, order).await?;
        // A declined order keeps its hold and may be paid again with another card; an
        // order declined before that was possible gave its stock back.
        let holds_stock = match &locked {
            Some((_, reservation, _)) => {
                reservation_status(&mut *transaction, reservation).await?
                    == ReservationStatus::Reserved
            }
            None => false,
        };
        // A retry of the request that started an attempt learns that attempt's
        // outcome; it never starts another.
        let started_by_this_request = match &locked {
            Some(_) => {
                let started: Option<i64> = statement(
                    "SELECT attempt_number FROM payment_attempt WHERE order_id = $1 AND request_key = $2 LIMIT 1",
                )
                .bind(order.as_str())
                .bind(claim.key.as_str())
                .fetch_optional_scalar(&mut *transaction)
                .await?;
                started.is_some()
            }
            None => false,
        };
        if let Some((status, _, expires_at)) = &locked
            && status.accepts_a_payment_attempt()
            && holds_stock
            && !started_by_this_request
            && *expires_at > now
        {
            let new = NewAttempt {
                id: attempt,
                request_key: claim.key.as_str(),
                payment_method,
                reconcile_after,
            };
            start_attempt(&mut *transaction, order, *status, &new, now).await?;
            let started = BeginPayment::Started(attempt_to_call(&mut *transaction, attempt).await?);
            transaction.commit().await?;
            return Ok(started);
        }
        if let Some((OrderStatus::PaymentProcessing, _, _)) = &locked {
            let running: String = statement(
                "SELECT id FROM payment_attempt WHERE order_id = $1 AND status = 'PROCESSING'",
            )
            .bind(order.as_str())
            .fetch_one_scalar(&mut *transaction)
            .await?;
            let running = parse_stored("attempt id", &running, PaymentAttemptId::parse)?;
            let running =
                BeginPayment::InProgress(attempt_to_call(&mut *transaction, &running).await?);
            transaction.commit().await?;
            return Ok(running);
        }
        // Answered here: the key is claimed in this transaction, so the answer commits
        // with what it reports (an order expired just now) or not at all.
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(BeginPayment::Answered(answer));
        }
        let response =
            answer_without_paying(&mut *transaction, order, locked, holds_stock, now, renderer)
                .await?;
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(BeginPayment::Answered(Idempotent::Executed(response)))
    }

    /// Settles an attempt with the gateway's answer (from the reconciliation or a
    /// webhook's check). Returns the order's status afterwards.
    pub async fn settle_payment(
        &self,
        attempt: &PaymentAttemptId,
        outcome: &GatewayOutcome,
        source: &str,
        now: Timestamp,
    ) -> Result<Option<OrderStatus>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let settled = settle_attempt(&mut *transaction, attempt, outcome, source, now).await?;
        transaction.commit().await?;
        Ok(settled)
    }

    /// Settles an attempt with the answer to the pay call that made it, and stores
    /// that call's answer (the order as it now is) under its key in the same
    /// transaction: a crash between the two cannot leave the effect without it.
    pub async fn settle_payment_with_answer(
        &self,
        claim: &IdempotencyClaim,
        attempt: &PaymentAttemptId,
        outcome: &GatewayOutcome,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        let order: Option<String> = statement("SELECT order_id FROM payment_attempt WHERE id = $1")
            .bind(attempt.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
        let order = order
            .map(|order| parse_stored("order id", &order, OrderId::parse))
            .transpose()?
            .ok_or_else(|| invariant(format!("attempt {attempt} vanished")))?;
        // What the gateway said is true whoever asks: applied (idempotently) even when
        // another process already answered this request's key.
        settle_attempt(&mut *transaction, attempt, outcome, "pay", now).await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.commit().await?;
            return Ok(answer);
        }
        let settled = load_order(&mut *transaction, &order)
            .await?
            .ok_or_else(|| invariant("an order vanished inside its own transaction"))?;
        let response = renderer.order(&settled, false);
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Applies a verified webhook event exactly once (by event id) in one transaction.
    /// Returns `None` for an event seen before.
    pub async fn apply_payment_event(
        &self,
        event_id: &str,
        event_type: &str,
        payment_id: &str,
        attempt: Option<&PaymentAttemptId>,
        outcome: Option<&GatewayOutcome>,
        now: Timestamp,
    ) -> Result<Option<String>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let attempt = match attempt {
            Some(attempt) => Some(attempt.clone()),
            None => {
                let found: Option<String> =
                    statement("SELECT id FROM payment_attempt WHERE gateway_payment_id = $1")
                        .bind(payment_id)
                        .fetch_optional_scalar(&mut *transaction)
                        .await?;
                found
                    .map(|id| parse_stored("attempt id", &id, PaymentAttemptId::parse))
                    .transpose()?
            }
        };
        let outcome_text = match (&attempt, outcome) {
            (Some(attempt), Some(outcome)) => {
                match settle_attempt(&mut *transaction, attempt, outcome, "webhook", now).await? {
                    Some(status) => format!("order {}", status.as_str()),
                    None => "unknown attempt".to_owned(),
                }
            }
            (None, _) => "unknown payment".to_owned(),
            (Some(_), None) => "ignored".to_owned(),
        };
        let inserted = statement(
            "INSERT INTO webhook_event (event_id, event_type, gateway_payment_id, outcome, received_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(event_id)
        .bind(event_type)
        .bind(payment_id)
        .bind(&outcome_text)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        if inserted == 0 {
            // Delivered before: undo whatever this delivery did.
            transaction.rollback().await?;
            return Ok(None);
        }
        transaction.commit().await?;
        Ok(Some(outcome_text))
    }

    /// The attempt `attempt` names, or else the one the gateway's `payment_id` belongs to.
    pub async fn payment_attempt(
        &self,
        attempt: Option<&PaymentAttemptId>,
        payment_id: &str,
    ) -> Result<Option<AttemptToCall>, StoreError> {
        let mut connection = self.write_connection().await?;
        let found: Option<String> = statement(
            "SELECT id FROM payment_attempt WHERE id = $1 OR (gateway_payment_id = $2 AND $3 = 0) \
             ORDER BY id LIMIT 1",
        )
        .bind(attempt.map_or("", PaymentAttemptId::as_str))
        .bind(payment_id)
        .bind(i64::from(attempt.is_some()))
        .fetch_optional_scalar(&mut *connection)
        .await?;
        let Some(found) = found else {
            return Ok(None);
        };
        let found = parse_stored("attempt id", &found, PaymentAttemptId::parse)?;
        attempt_to_call(&mut *connection, &found).await.map(Some)
    }

    /// Unresolved attempts due for a look, leased for `lease_milliseconds` so several
    /// processes do not ask the gateway about the same attempt at once.
    pub async fn claim_attempts_to_reconcile(
        &self,
        now: Timestamp,
        limit: i64,
        lease_milliseconds: i64,
    ) -> Result<Vec<AttemptToCall>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let ids: Vec<String> = statement(<B::Connection as Dialect>::CLAIM_ATTEMPTS_TO_RECONCILE)
            .bind(now.unix_milliseconds())
            .bind(limit)
            .fetch_all_scalar(&mut *transaction)
            .await?;
        let mut attempts = Vec::with_capacity(ids.len());
        for id in ids {
            // Leased, and asked about less and less often while the gateway keeps not
            // knowing (5xx, 409, 429, no answer): the lease at first, doubling per look.
            let tries: i64 = statement("SELECT reconcile_tries FROM payment_attempt WHERE id = $1")
                .bind(&id)
                .fetch_one_scalar(&mut *transaction)
                .await?;
            statement(
                "UPDATE payment_attempt SET reconcile_after = $2, reconcile_tries = reconcile_tries + 1 WHERE id = $1",
            )
            .bind(&id)
            .bind(
                now.unix_milliseconds()
                    .saturating_add(retry_delay(lease_milliseconds, tries)),
            )
            .execute(&mut *transaction)
            .await?;
            let id = parse_stored("attempt id", &id, PaymentAttemptId::parse)?;
            attempts.push(attempt_to_call(&mut *transaction, &id).await?);
        }
        transaction.commit().await?;
        Ok(attempts)
    }

    /// Expires up to `limit` orders still waiting for payment past their hold (unpaid,
    /// or declined and not paid again): their stock goes back. Orders with a payment in
    /// flight are left to reconciliation.
    pub async fn expire_orders(
        &self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<OrderId>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let ids: Vec<String> = statement(<B::Connection as Dialect>::CLAIM_EXPIRED_ORDERS)
            .bind(now.unix_milliseconds())
            .bind(limit)
            .fetch_all_scalar(&mut *transaction)
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
        let moves: Vec<Move<'_>> = expiring
            .iter()
            .map(|(_, _, reservation)| Move {
                id: reservation,
                action: ReservationAction::Release,
                reason: ReleaseReason::Expired,
            })
            .collect();
        let outcomes =
            settle_reservations(&mut *transaction, &moves, Mover::HoldingOrders, now).await?;
        if let Some(refused) = outcomes.iter().find_map(|outcome| outcome.as_ref().err()) {
            return Err(invariant(format!(
                "an expired order's reservation could not be released: {}",
                refused.detail
            )));
        }
        let mut expired = Vec::with_capacity(expiring.len());
        for (order, status, _) in expiring {
            move_order(
                &mut *transaction,
                &order,
                status,
                OrderStatus::Expired,
                "hold ended unpaid",
                now,
            )
            .await?;
            expired.push(order);
        }
        transaction.commit().await?;
        Ok(expired)
    }

    /// `POST /v1/orders/{id}/cancel`: an unpaid order gives its stock back; a paid one
    /// goes to `REFUND_PENDING` with a refund to issue. A payment in flight must be
    /// resolved first.
    pub async fn cancel_order(
        &self,
        claim: &IdempotencyClaim,
        order: &OrderId,
        may_cancel_paid: bool,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        // The order before the key, as every unit of work on an order takes them.
        let locked = lock_order(&mut *transaction, order).await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let holds_stock = match &locked {
            Some((_, reservation, _)) => {
                reservation_status(&mut *transaction, reservation).await?
                    == ReservationStatus::Reserved
            }
            None => false,
        };
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
                    status,
                    OrderStatus::Cancelled,
                    "cancelled",
                    now,
                )
                .await?;
                None
            }
            Some((OrderStatus::Paid, _, _)) if !may_cancel_paid => Some(Rejection::new(
                ErrorCode::Forbidden,
                "the order is paid: cancelling it (and refunding) is a staff decision",
            )),
            Some((OrderStatus::Paid, _, _)) => {
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
        let response = match refusal {
            Some(rejection) => renderer.rejected(&rejection),
            None => {
                let loaded = load_order(&mut *transaction, order)
                    .await?
                    .ok_or_else(|| invariant("an order vanished inside its own transaction"))?;
                renderer.order(&loaded, false)
            }
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Pending refunds due for a try, leased like attempts.
    pub async fn claim_refunds(
        &self,
        now: Timestamp,
        limit: i64,
        lease_milliseconds: i64,
    ) -> Result<Vec<RefundToIssue>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let rows = statement(<B::Connection as Dialect>::CLAIM_REFUNDS)
            .bind(now.unix_milliseconds())
            .bind(limit)
            .fetch_all_as::<(String, String, String, String, i64, String, i64)>(&mut *transaction)
            .await?;
        let mut refunds = Vec::with_capacity(rows.len());
        for (id, order, attempt, gateway_key, amount_minor, currency, tries) in rows {
            statement("UPDATE refund SET next_try_at = $2, tries = tries + 1 WHERE id = $1")
                .bind(&id)
                .bind(
                    now.unix_milliseconds()
                        .saturating_add(retry_delay(lease_milliseconds, tries)),
                )
                .execute(&mut *transaction)
                .await?;
            let payment: Option<String> =
                statement("SELECT gateway_payment_id FROM payment_attempt WHERE id = $1")
                    .bind(&attempt)
                    .fetch_optional_scalar(&mut *transaction)
                    .await?
                    .flatten();
            let Some(gateway_payment_id) = payment else {
                continue;
            };
            refunds.push(RefundToIssue {
                refund_id: parse_stored("refund id", &id, RefundId::parse)?,
                order_id: parse_stored("order id", &order, OrderId::parse)?,
                gateway_key,
                gateway_payment_id,
                amount_minor,
                currency,
            });
        }
        transaction.commit().await?;
        Ok(refunds)
    }

    /// Records a refund the gateway confirmed. The refund of the attempt that paid the
    /// order makes it `REFUNDED`; the refund of a second charge leaves the order as it
    /// is. Idempotent.
    pub async fn settle_refund(
        &self,
        refund: &RefundId,
        gateway_refund_id: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        let found: Option<(String, String)> = statement(
            "SELECT refund.order_id, payment_attempt.status FROM refund \
             JOIN payment_attempt ON payment_attempt.id = refund.attempt_id WHERE refund.id = $1",
        )
        .bind(refund.as_str())
        .fetch_optional_as(&mut *transaction)
        .await?;
        let Some((order, attempt_status)) = found else {
            return Err(invariant(format!("refund {refund} vanished")));
        };
        let order = parse_stored("order id", &order, OrderId::parse)?;
        // The order first: the lock order of every order transaction.
        let locked = lock_order(&mut *transaction, &order).await?;
        let updated = statement(
            "UPDATE refund SET status = 'SUCCEEDED', gateway_refund_id = $2, updated_at = $3 WHERE id = $1 AND status = 'PENDING'",
        )
        .bind(refund.as_str())
        .bind(gateway_refund_id)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        if updated == 1
            && attempt_status == AttemptStatus::Succeeded.as_str()
            && let Some((OrderStatus::RefundPending, _, _)) = locked
        {
            move_order(
                &mut *transaction,
                &order,
                OrderStatus::RefundPending,
                OrderStatus::Refunded,
                "refund confirmed",
                now,
            )
            .await?;
        }
        transaction.commit().await?;
        Ok(())
    }

    /// Records a refund the gateway refused outright: `FAILED` with its reason, never
    /// claimed again. The order stays `REFUND_PENDING` for a person to resolve.
    pub async fn fail_refund(
        &self,
        refund: &RefundId,
        reason: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        statement(
            "UPDATE refund SET status = 'FAILED', failure_reason = $2, updated_at = $3 WHERE id = $1 AND status = 'PENDING'",
        )
        .bind(refund.as_str())
        .bind(reason)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(())
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
        let mut transaction = self.begin_write().await?;
        // The order before the key, as every unit of work on an order takes them.
        let locked = lock_order(&mut *transaction, order).await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
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
        let response = match refusal {
            Some(rejection) => renderer.rejected(&rejection),
            None => {
                let loaded = load_order(&mut *transaction, order)
                    .await?
                    .ok_or_else(|| invariant("an order vanished inside its own transaction"))?;
                renderer.order(&loaded, false)
            }
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Orders past their hold that still wait for payment (exported as a gauge).
    pub async fn payment_gauges(&self, now: Timestamp) -> Result<PaymentGauges, StoreError> {
        let (unresolved, oldest): (i64, Option<i64>) = statement(
            "SELECT COUNT(*), MIN(created_at) FROM payment_attempt WHERE status = 'PROCESSING'",
        )
        .fetch_one_as(&mut *self.read_connection().await?)
        .await?;
        let (refunds, refunds_failed): (i64, i64) = statement(
            "SELECT COUNT(*) FILTER (WHERE status = 'PENDING'), COUNT(*) FILTER (WHERE status = 'FAILED') FROM refund",
        )
        .fetch_one_as(&mut *self.read_connection().await?)
        .await?;
        Ok(PaymentGauges {
            attempts_unresolved: unresolved,
            oldest_unresolved_age_seconds: oldest.map_or(0, |created_at| {
                now.unix_milliseconds().saturating_sub(created_at).max(0) / 1000
            }),
            refunds_pending: refunds,
            refunds_failed,
        })
    }
}

/// A payment attempt to start.
pub(crate) struct NewAttempt<'a> {
    pub(crate) id: &'a PaymentAttemptId,
    /// The pay request's idempotency key (scoped by its principal).
    pub(crate) request_key: &'a str,
    pub(crate) payment_method: &'a str,
    pub(crate) reconcile_after: Timestamp,
}

/// Starts attempt n+1 of a locked order that may be paid: its own number and gateway
/// key, `PROCESSING`, and the order `PAYMENT_PROCESSING`.
pub(crate) async fn start_attempt<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    from: OrderStatus,
    new: &NewAttempt<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    let number: i64 = statement(
        "SELECT COALESCE(MAX(attempt_number), 0) + 1 FROM payment_attempt WHERE order_id = $1",
    )
    .bind(order.as_str())
    .fetch_one_scalar(&mut *transaction)
    .await?;
    // Each attempt its own gateway key: a retry of this attempt is the same call,
    // another card is another call.
    let gateway_key = format!("stockd-{order}-{number}");
    statement(
        "INSERT INTO payment_attempt (id, order_id, attempt_number, gateway_key, payment_method, status, \
         amount_minor, currency, reconcile_after, created_at, updated_at, request_key) \
         SELECT $1, id, $7, $2, $3, 'PROCESSING', amount_minor, currency, $4, $5, $5, $8 FROM customer_order WHERE id = $6",
    )
    .bind(new.id.as_str())
    .bind(&gateway_key)
    .bind(new.payment_method)
    .bind(new.reconcile_after.unix_milliseconds())
    .bind(now.unix_milliseconds())
    .bind(order.as_str())
    .bind(number)
    .bind(new.request_key)
    .execute(&mut *transaction)
    .await?;
    let reason = if number == 1 {
        "payment started".to_owned()
    } else {
        format!("payment attempt {number} started")
    };
    move_order(
        transaction,
        order,
        from,
        OrderStatus::PaymentProcessing,
        &reason,
        now,
    )
    .await?;
    Ok(())
}

/// The answer to `pay` for a locked order no attempt can start on: missing, its hold
/// ended (expired now, its stock given back), its payment settled, or not payable.
pub(crate) async fn answer_without_paying<C: Connection>(
    transaction: &mut C,
    order: &OrderId,
    locked: Option<(OrderStatus, ReservationId, Timestamp)>,
    holds_stock: bool,
    now: Timestamp,
    renderer: &dyn ResponseRenderer,
) -> Result<StoredResponse, StoreError> {
    let response = match locked {
        None => renderer.rejected(&Rejection::new(
            ErrorCode::NotFound,
            format!("order '{order}' does not exist"),
        )),
        Some((status, reservation, expires_at))
            if status.accepts_a_payment_attempt() && holds_stock && expires_at <= now =>
        {
            release_order(
                transaction,
                order,
                &reservation,
                status,
                OrderStatus::Expired,
                "hold ended before payment",
                now,
            )
            .await?;
            renderer.rejected(&Rejection::new(
                ErrorCode::IllegalTransition,
                format!("order '{order}' expired before payment"),
            ))
        }
        // The payment already has its outcome: a retry of an interrupted `pay`,
        // or a second caller, learns it.
        Some((
            OrderStatus::Paid
            | OrderStatus::PaymentFailed
            | OrderStatus::RefundPending
            | OrderStatus::Refunded,
            _,
            _,
        )) => {
            let settled = load_order(transaction, order)
                .await?
                .ok_or_else(|| invariant("an order vanished inside its own transaction"))?;
            renderer.order(&settled, false)
        }
        Some((status, _, _)) => renderer.rejected(&Rejection::new(
            ErrorCode::IllegalTransition,
            format!("order '{order}' is {} and cannot be paid", status.as_str()),
        )),
    };
    Ok(response)
}

pub(crate) async fn attempt_to_call<C: Connection>(
    connection: &mut C,
    attempt: &PaymentAttemptId,
) -> Result<AttemptToCall, StoreError> {
    let row = statement(
        "SELECT payment_attempt.order_id, gateway_key, gateway_payment_id, payment_method, payment_attempt.amount_minor, \
         payment_attempt.currency, customer_order.expires_at FROM payment_attempt \
         JOIN customer_order ON customer_order.id = payment_attempt.order_id WHERE payment_attempt.id = $1",
    )
    .bind(attempt.as_str())
    .fetch_one_as::<(String, String, Option<String>, String, i64, String, i64)>(&mut *connection)
    .await?;
    let (
        order,
        gateway_key,
        gateway_payment_id,
        payment_method,
        amount_minor,
        currency,
        expires_at,
    ) = row;
    Ok(AttemptToCall {
        attempt_id: attempt.clone(),
        order_id: parse_stored("order id", &order, OrderId::parse)?,
        gateway_key,
        gateway_payment_id,
        payment_method,
        amount_minor,
        currency,
        order_expires_at: Timestamp::from_unix_milliseconds(expires_at),
    })
}

/// An order's payment attempts, oldest first.
pub(crate) async fn order_attempts<C: Connection>(
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
pub(crate) async fn order_refunds<C: Connection>(
    connection: &mut C,
    id: &OrderId,
) -> Result<Vec<RefundRecord>, StoreError> {
    let refund_rows = statement(
        "SELECT id, attempt_id, status, amount_minor, currency, gateway_refund_id, reason, failure_reason \
         FROM refund WHERE order_id = $1 ORDER BY created_at, id",
    )
    .bind(id.as_str())
    .fetch_all_as::<(String, String, String, i64, String, Option<String>, String, Option<String>)>(&mut *connection)
    .await?;
    let mut refunds = Vec::with_capacity(refund_rows.len());
    for (
        refund,
        attempt,
        status,
        amount_minor,
        currency,
        gateway_refund_id,
        reason,
        failure_reason,
    ) in refund_rows
    {
        refunds.push(RefundRecord {
            id: parse_stored("refund id", &refund, RefundId::parse)?,
            attempt_id: parse_stored("attempt id", &attempt, PaymentAttemptId::parse)?,
            status,
            amount_minor,
            currency,
            gateway_refund_id,
            reason,
            failure_reason,
        });
    }
    Ok(refunds)
}

/// The statuses an order went through, oldest first.
pub(crate) async fn order_history<C: Connection>(
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

pub(crate) async fn load_order<C: Connection>(
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

/// How long a claimed refund or unresolved attempt waits before it may be claimed
/// again: the lease at first, doubling with every try up to [`RETRY_MILLISECONDS_MAX`].
/// A gateway that is down (or keeps not knowing) is asked less and less often instead
/// of every lease for ever; `stockd_refunds_pending` and
/// `stockd_payment_attempts_unresolved` show the backlog meanwhile.
pub(crate) fn retry_delay(lease_milliseconds: i64, tries_before: i64) -> i64 {
    let doublings = u32::try_from(tries_before.clamp(0, 32)).unwrap_or(32);
    lease_milliseconds
        .saturating_mul(2_i64.saturating_pow(doublings))
        .min(RETRY_MILLISECONDS_MAX.max(lease_milliseconds))
}

/// The longest wait between two tries of one refund or one attempt: an hour.
pub(crate) const RETRY_MILLISECONDS_MAX: i64 = 3_600_000;

//! Payment attempts: beginning one (committed before the gateway is called),
//! settling it from the gateway's answer, a webhook or reconciliation, and the late
//! success that arrives after the hold ended. No unit of work calls the gateway.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{corrupt, derived_random, expect_one_row, invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer, complete_claim, withdraw_claim};
use super::orders::{
    OnOrder, OrderHold, load_order, lock_order, move_order, order_lines, release_order,
    reservation_status, write_order_hold,
};
use super::outbox::{NewEvent, Sequence, append_event};
use super::refunds::insert_refund;
use super::reservations::settle_order_reservation;
use super::stock::available_in;
use super::tallies::{add_to_tallies, read_tallies};
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{
    IdempotencyClaim, Idempotent, Rejection, ReservationAction, ResponseRenderer, ShopScope,
    StoredResponse,
};
use crate::orders::{AttemptToCall, BeginPayment, GatewayOutcome, OrderLine, PaymentGauges};
use crate::plan::{PlanRequest, PurchaseKey, ShopperKey, StockKey, plan_batch};
use crate::sql::statement;
use domain::{
    AttemptStatus, ErrorCode, EventType, OrderId, OrderStatus, PaymentAttemptId, Quantity,
    ReleaseReason, ReservationId, ReservationLine, ReservationStatus, ShopCode, SkuCode, Timestamp,
    UserId as OrderUserId, WarehouseCode,
};
use serde_json::json;

/// A success arrived for an order that gave its stock back: take the stock again
/// (reserved and confirmed at once) when every line still fits, and the order is
/// `PAID`; otherwise it goes `REFUND_PENDING` with a refund to issue.
pub(crate) async fn settle_late_success<C: Dialect>(
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
    /// Campaign lines taken from another row than the order's: (sku, from, to).
    pub(crate) moved: Vec<(SkuCode, WarehouseCode, WarehouseCode)>,
}

/// Where a late sale takes each campaign line of an order (`lines`, changed in place)
/// from, as a new request for the SKU would be served: the bucket the order held,
/// while it still holds enough; else, while the campaign has not ended (its units are
/// still in its buckets), its fullest bucket; once it ended and gave its units back,
/// the campaign's regular row, where they went. Read without locks: the rows chosen
/// are locked and decided on after, and a row drained meanwhile refunds the order, as
/// any short row does. Answers the lines moved.
async fn where_a_late_sale_takes<C: Dialect>(
    transaction: &mut C,
    lines: &mut [OrderLine],
) -> Result<Vec<(SkuCode, WarehouseCode, WarehouseCode)>, StoreError> {
    let mut moved: Vec<(SkuCode, WarehouseCode, WarehouseCode)> = Vec::new();
    for index in 0..lines.len() {
        let (sku, held_in) = (lines[index].sku.clone(), lines[index].warehouse.clone());
        let Some((code, _)) = domain::campaign::bucket_of(&held_in) else {
            continue;
        };
        if moved
            .iter()
            .any(|(of, from, _)| *of == sku && *from == held_in)
        {
            continue;
        }
        // Every line of the SKU held in that bucket goes to one row.
        let wanted: i64 = lines
            .iter()
            .filter(|line| line.sku == sku && line.warehouse == held_in)
            .map(|line| line.quantity)
            .sum();
        if available_in(transaction, &sku, &held_in).await? >= wanted {
            continue;
        }
        let campaign: Option<(String, i64, Option<i64>)> =
            statement("SELECT warehouse, buckets, ended_at FROM campaign WHERE code = $1")
                .bind(code.as_str())
                .fetch_optional_as(&mut *transaction)
                .await?;
        let Some((source, buckets, ended_at)) = campaign else {
            continue;
        };
        let to = if ended_at.is_some() {
            parse_stored("warehouse", &source, WarehouseCode::parse)?
        } else {
            let mut fullest = (held_in.clone(), 0);
            for bucket in 0..u32::try_from(buckets).unwrap_or(0) {
                let warehouse = code.bucket_warehouse(bucket);
                let units = available_in(transaction, &sku, &warehouse).await?;
                if units > fullest.1 {
                    fullest = (warehouse, units);
                }
            }
            fullest.0
        };
        if to != held_in {
            moved.push((sku, held_in, to));
        }
    }
    for line in lines.iter_mut() {
        if let Some((_, _, to)) = moved
            .iter()
            .find(|(sku, from, _)| *sku == line.sku && *from == line.warehouse)
        {
            line.warehouse = to.clone();
        }
    }
    Ok(moved)
}

pub(crate) async fn plan_late_sale<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
) -> Result<LateSale, StoreError> {
    let mut lines = order_lines(transaction, order).await?;
    let moved = where_a_late_sale_takes(transaction, &mut lines).await?;
    let mut wanted: Vec<StockKey> = lines
        .iter()
        .map(|line| (line.sku.clone(), line.warehouse.clone()))
        .collect();
    wanted.sort();
    wanted.dedup();
    let (available, skus) = transaction.lock_stock_rows(&wanted).await?;
    // A campaign's line counts against the campaign's limit, as when it was sold
    // (read afresh: a late success is rare, no cache is worth keeping for it).
    let skus = super::batch::with_campaign_facts(
        &mut *transaction,
        &wanted,
        skus,
        &super::batch::CampaignLimits::default(),
    )
    .await?;
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
            skus.get(&domain::campaign::tally_sku(&line.sku, &line.warehouse))
                .is_some_and(|facts| facts.per_user_limit.is_some())
        })
        .map(|line| {
            (
                shopper.0.clone(),
                shopper.1.clone(),
                domain::campaign::tally_sku(&line.sku, &line.warehouse),
            )
        })
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
            // The order's number was claimed with it at creation.
            order_ref_taken: false,
            order_ref: None,
            undecided_when_short: false,
        }],
        &skus,
        &available,
        &tallies,
    );
    Ok(LateSale {
        reservation_lines,
        shopper,
        plan,
        moved,
    })
}

/// Takes a paid order's stock again (its late success fitted): a new reservation,
/// reserved and confirmed through the transition table, and the order `PAID`.
pub(crate) async fn take_stock_again<C: Dialect>(
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
        moved,
    } = sale;
    // The order's lines say where its goods are (a return puts them back there; the
    // audit holds them to the reservation's lines): a campaign line taken elsewhere
    // says so.
    for (sku, from, to) in moved {
        statement("UPDATE order_line SET warehouse = $4 WHERE order_id = $1 AND sku = $2 AND warehouse = $3")
            .bind(order.as_str())
            .bind(sku.as_str())
            .bind(from.as_str())
            .bind(to.as_str())
            .execute(&mut *transaction)
            .await?;
    }
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
    let updated = statement("UPDATE customer_order SET reservation_id = $2 WHERE id = $1")
        .bind(order.as_str())
        .bind(reservation.as_str())
        .execute(&mut *transaction)
        .await?;
    expect_one_row(updated, "giving a locked order its new reservation")?;
    // A gateway's answer settles it, from whichever path heard it first (the pay
    // call, a webhook, reconciliation): no request key of its own.
    let Ok(()) = settle_order_reservation(
        transaction,
        order,
        &reservation,
        (ReservationAction::Confirm, ReleaseReason::Requested),
        None,
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

/// The attempt that paid an order, if one did.
pub(crate) async fn paying_attempt<C: Dialect>(
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
pub(crate) async fn settle_attempt<C: Dialect>(
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
    // A success recorded already as a second charge (its attempt `FAILED` with a
    // refund: no other failed attempt has one) heard again — a webhook redelivered, the
    // same payment under another event id, the pay call's answer after the webhook's —
    // changes nothing: it is being refunded.
    let refunded_as_second_charge = status == AttemptStatus::Failed
        && matches!(outcome, GatewayOutcome::Succeeded { .. })
        && statement("SELECT COUNT(*) FROM refund WHERE attempt_id = $1")
            .bind(attempt.as_str())
            .fetch_one_scalar::<i64>(&mut *transaction)
            .await?
            > 0;
    match (status, outcome) {
        (AttemptStatus::Succeeded, _) => Ok(Some(order_status)),
        (AttemptStatus::Failed, GatewayOutcome::Succeeded { .. }) if refunded_as_second_charge => {
            Ok(Some(order_status))
        }
        (
            AttemptStatus::Failed,
            GatewayOutcome::Failed { .. } | GatewayOutcome::Abandoned { .. },
        ) => Ok(Some(order_status)),
        (_, GatewayOutcome::Succeeded { payment_id }) => {
            let settling = Settling {
                attempt,
                attempt_status: status,
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
                attempt_status: status,
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
    /// The attempt's status as locked: where its transition starts.
    pub(crate) attempt_status: AttemptStatus,
    pub(crate) order: &'a OrderId,
    pub(crate) order_status: OrderStatus,
    pub(crate) reservation: &'a ReservationId,
    pub(crate) source: &'a str,
    pub(crate) now: Timestamp,
}

/// Moves a locked attempt from `from` to `status` through [`ATTEMPT_TRANSITIONS`],
/// with the gateway's payment id and the reason; the update is conditional on `from`
/// and its row count checked.
pub(crate) async fn set_attempt_status<C: Dialect>(
    transaction: &mut C,
    attempt: &PaymentAttemptId,
    (from, status): (AttemptStatus, AttemptStatus),
    payment_id: Option<&str>,
    reason: Option<&str>,
    now: Timestamp,
) -> Result<(), StoreError> {
    if !from.may_become(status) {
        return Err(invariant(format!(
            "payment attempt {attempt} cannot go from {} to {}",
            from.as_str(),
            status.as_str()
        )));
    }
    let updated = statement(
        "UPDATE payment_attempt SET status = $2, gateway_payment_id = COALESCE($3, gateway_payment_id), \
         failure_reason = $4, updated_at = $5 WHERE id = $1 AND status = $6",
    )
    .bind(attempt.as_str())
    .bind(status.as_str())
    .bind(payment_id)
    .bind(reason.map(|reason| domain::limits::bounded_reason(reason).into_owned()))
    .bind(now.unix_milliseconds())
    .bind(from.as_str())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "settling a locked payment attempt")?;
    let (order, shop, amount_minor, currency): (String, String, i64, String) = statement(
        "SELECT payment_attempt.order_id, customer_order.shop, payment_attempt.amount_minor, payment_attempt.currency \
         FROM payment_attempt JOIN customer_order ON customer_order.id = payment_attempt.order_id \
         WHERE payment_attempt.id = $1",
    )
    .bind(attempt.as_str())
    .fetch_one_as(&mut *transaction)
    .await?;
    append_event(
        transaction,
        NewEvent {
            event_type: EventType::PaymentSettled,
            aggregate_id: attempt.as_str(),
            shop: &shop,
            sequence: Sequence::Counted,
            data: json!({
                "attempt_id": attempt.as_str(),
                "order_id": order,
                "shop": shop,
                "status": status.as_str(),
                "amount_minor": amount_minor,
                "currency": currency,
                "failure_reason": reason.map(domain::limits::bounded_reason),
            }),
        },
        now,
    )
    .await
}

/// A success for an order another attempt paid already: a second charge, recorded as
/// a failed attempt and refunded, so the order keeps one charge.
pub(crate) async fn refund_second_charge<C: Dialect>(
    transaction: &mut C,
    settling: &Settling<'_>,
    paid_by: &str,
    payment_id: &str,
) -> Result<(), StoreError> {
    let Settling {
        attempt,
        order,
        now,
        ..
    } = *settling;
    let reason = format!(
        "{}{payment_id}) after attempt {paid_by} had paid the order: refunded",
        domain::SECOND_CHARGE_REASON_PREFIX
    );
    tracing::warn!(order = %order, %attempt, %payment_id, "a second payment succeeded for an order paid already; refunding it");
    set_attempt_status(
        transaction,
        attempt,
        (settling.attempt_status, AttemptStatus::Failed),
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
    .await
}

/// A success for an order that still holds its stock: the reservation confirmed, the
/// order `PAID`.
pub(crate) async fn pay_holding_order<C: Dialect>(
    transaction: &mut C,
    settling: &Settling<'_>,
    reason: &str,
) -> Result<(), StoreError> {
    let Settling {
        order,
        order_status,
        reservation,
        now,
        ..
    } = *settling;
    // A gateway's answer settles it, from whichever path heard it first: no request
    // key of its own.
    let Ok(()) = settle_order_reservation(
        transaction,
        order,
        reservation,
        (ReservationAction::Confirm, ReleaseReason::Requested),
        None,
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
        reason,
        now,
    )
    .await
}

/// The gateway says the attempt succeeded: the order is paid (or, when its stock was
/// given back, takes it again or is refunded); a second charge is refunded.
pub(crate) async fn apply_success<C: Dialect>(
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
        ..
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
        refund_second_charge(transaction, settling, &paid_by, payment_id).await?;
        return Ok(Some(order_status));
    }
    set_attempt_status(
        transaction,
        attempt,
        (settling.attempt_status, AttemptStatus::Succeeded),
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
            pay_holding_order(transaction, settling, &reason).await?;
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
pub(crate) async fn apply_failure<C: Dialect>(
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
        ..
    } = *settling;
    set_attempt_status(
        transaction,
        attempt,
        (settling.attempt_status, AttemptStatus::Failed),
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
                (order_status, OrderStatus::Expired),
                (&format!("payment abandoned: {reason} ({source})"), None),
                now,
            )
            .await?;
            Ok(Some(OrderStatus::Expired))
        }
        (_, status) => Ok(Some(status)),
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
pub(crate) async fn start_attempt<C: Dialect>(
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

/// The attempt this request's key started on the order: its id, status and failure
/// reason.
async fn own_attempt_status<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    claim: &IdempotencyClaim,
) -> Result<(String, String, Option<String>), StoreError> {
    statement(
        "SELECT id, status, failure_reason FROM payment_attempt \
         WHERE order_id = $1 AND request_key = $2 ORDER BY attempt_number LIMIT 1",
    )
    .bind(order.as_str())
    .bind(claim.key.as_str())
    .fetch_one_as::<(String, String, Option<String>)>(&mut *transaction)
    .await
}

/// The first of an order's SKUs (in line order) that is not on sale now, with its sale
/// status.
async fn first_line_not_on_sale<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
) -> Result<Option<(String, String)>, StoreError> {
    statement(
        "SELECT sku.code, sku.sale_status FROM order_line JOIN sku ON sku.code = order_line.sku \
         WHERE order_line.order_id = $1 AND sku.sale_status <> 'ON_SHELF' \
         ORDER BY order_line.line_number LIMIT 1",
    )
    .bind(order.as_str())
    .fetch_optional_as::<(String, String)>(&mut *transaction)
    .await
}

/// The answer to `pay` for a locked order no attempt can start on: missing, its hold
/// ended (expired now, its stock given back), its payment settled, or not payable.
pub(crate) async fn answer_without_paying<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    (locked, holds_stock): (Option<(OrderStatus, ReservationId, Timestamp)>, bool),
    (now, hold_ends_by): (Timestamp, Timestamp),
    renderer: &dyn ResponseRenderer,
) -> Result<StoredResponse, StoreError> {
    let response = match locked {
        None => renderer.rejected(&Rejection::new(
            ErrorCode::NotFound,
            format!("order '{order}' does not exist"),
        )),
        Some((status, reservation, expires_at))
            if status.accepts_a_payment_attempt() && holds_stock && expires_at <= hold_ends_by =>
        {
            release_order(
                transaction,
                order,
                &reservation,
                (status, OrderStatus::Expired),
                ("hold ended before payment", None),
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

pub(crate) async fn attempt_to_call<C: Dialect>(
    connection: &mut C,
    attempt: &PaymentAttemptId,
) -> Result<AttemptToCall, StoreError> {
    let row = statement(
        "SELECT payment_attempt.order_id, gateway_key, gateway_payment_id, payment_method, payment_attempt.amount_minor, \
         payment_attempt.currency, customer_order.expires_at, payment_attempt.created_at FROM payment_attempt \
         JOIN customer_order ON customer_order.id = payment_attempt.order_id WHERE payment_attempt.id = $1",
    )
    .bind(attempt.as_str())
    .fetch_one_as::<(String, String, Option<String>, String, i64, String, i64, i64)>(
        &mut *connection,
    )
    .await?;
    let (
        order,
        gateway_key,
        gateway_payment_id,
        payment_method,
        amount_minor,
        currency,
        expires_at,
        created_at,
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
        created_at: Timestamp::from_unix_milliseconds(created_at),
    })
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

/// What decides whether a pay request may start an attempt: whether the order still
/// holds its stock (a declined order keeps its hold and may be paid again with another
/// card; one declined before that was possible gave its stock back), and whether this
/// request started an attempt already (its retry learns that attempt's outcome; it
/// never starts another).
pub(crate) async fn payment_facts<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    reservation: &ReservationId,
    claim: &IdempotencyClaim,
) -> Result<(bool, bool), StoreError> {
    let holds_stock =
        reservation_status(&mut *transaction, reservation).await? == ReservationStatus::Reserved;
    let started: Option<i64> = statement(
        "SELECT attempt_number FROM payment_attempt WHERE order_id = $1 AND request_key = $2 LIMIT 1",
    )
    .bind(order.as_str())
    .bind(claim.key.as_str())
    .fetch_optional_scalar(&mut *transaction)
    .await?;
    Ok((holds_stock, started.is_some()))
}

/// Whether the request's key started an attempt of another order, or with another
/// payment method, since `keys_since` (as long as keys are remembered): the key's
/// first request, whose answer may not be stored yet (its gateway call timed out),
/// and this one are different requests.
async fn key_started_another_payment<C: Dialect>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    (order, payment_method): (&OrderId, &str),
    keys_since: Timestamp,
) -> Result<bool, StoreError> {
    let started: Option<(String, String)> = statement(
        "SELECT order_id, payment_method FROM payment_attempt \
         WHERE request_key = $1 AND created_at >= $2 LIMIT 1",
    )
    .bind(claim.key.as_str())
    .bind(keys_since.unix_milliseconds())
    .fetch_optional_as(&mut *transaction)
    .await?;
    Ok(started.is_some_and(|(started_order, started_method)| {
        started_order != order.as_str() || started_method != payment_method
    }))
}

impl<B: Backend> Units<B> {
    /// Starts paying an order: `PENDING_PAYMENT → PAYMENT_PROCESSING` with a new
    /// attempt, committed before the gateway is called. An order already processing
    /// hands back its running attempt, to be asked about again, when this request
    /// started it; another request's running attempt is answered
    /// [`BeginPayment::AnotherRequestRunning`]. Anything else is answered here, the
    /// answer stored under `claim` with what it changed.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin_payment(
        &self,
        claim: &IdempotencyClaim,
        order: &OrderId,
        attempt: &PaymentAttemptId,
        payment_method: &str,
        reconcile_after: Timestamp,
        keys_since: Timestamp,
        (now, hold_ends_by): (Timestamp, Timestamp),
        renderer: &dyn ResponseRenderer,
    ) -> Result<BeginPayment, StoreError> {
        // The key is claimed before anything is decided, and held to the commit: two
        // requests under one key for two orders (two instances, each locking its own
        // order) would otherwise both see no attempt of the other's and both charge a
        // card. The second now waits here for the first's commit, then finds its
        // attempt below. A payment that goes on to the gateway withdraws the claim
        // before committing: its answer is stored once the gateway has given it.
        let (mut transaction, locked) = match self.open_on_order(order, claim, now).await? {
            OnOrder::Answered(answer) => return Ok(BeginPayment::Answered(answer)),
            OnOrder::Open(transaction, locked) => (transaction, locked),
        };
        if key_started_another_payment(
            &mut *transaction,
            claim,
            (order, payment_method),
            keys_since,
        )
        .await?
        {
            transaction.rollback().await?;
            return Ok(BeginPayment::Answered(Idempotent::KeyReused));
        }
        let (holds_stock, started_by_this_request) = match &locked {
            Some((_, reservation, _)) => {
                payment_facts(&mut *transaction, order, reservation, claim).await?
            }
            None => (false, false),
        };
        let payable = matches!(
            &locked,
            Some((status, _, expires_at))
                if status.accepts_a_payment_attempt()
                    && holds_stock
                    && !started_by_this_request
                    && *expires_at > hold_ends_by
        );
        // Seed 003 §1.3: "taken off the shelf, yet the customer could still pay" is an
        // accident. An order holding a SKU that went off sale since it was placed is
        // not charged; it keeps its hold until it expires or is cancelled.
        let not_on_sale = if payable {
            first_line_not_on_sale(&mut *transaction, order).await?
        } else {
            None
        };
        let attempts_exhausted = if payable && not_on_sale.is_none() {
            let attempts: i64 =
                statement("SELECT COUNT(*) FROM payment_attempt WHERE order_id = $1")
                    .bind(order.as_str())
                    .fetch_one_scalar(&mut *transaction)
                    .await?;
            (attempts >= domain::limits::PAYMENT_ATTEMPTS_PER_ORDER_MAX).then_some(attempts)
        } else {
            None
        };
        if let Some((status, _, _)) = &locked
            && payable
            && not_on_sale.is_none()
            && attempts_exhausted.is_none()
        {
            let new = NewAttempt {
                id: attempt,
                request_key: claim.key.as_str(),
                payment_method,
                reconcile_after,
            };
            start_attempt(&mut *transaction, order, *status, &new, now).await?;
            let started = BeginPayment::Started(attempt_to_call(&mut *transaction, attempt).await?);
            withdraw_claim(&mut *transaction, claim).await?;
            transaction.commit().await?;
            return Ok(started);
        }
        let mut ended_meanwhile = None;
        if let Some((OrderStatus::PaymentProcessing, _, _)) = &locked {
            // Attempts from before request keys were recorded have none.
            let (running, running_key): (String, Option<String>) = statement(
                "SELECT id, request_key FROM payment_attempt WHERE order_id = $1 AND status = 'PROCESSING'",
            )
            .bind(order.as_str())
            .fetch_one_as(&mut *transaction)
            .await?;
            let running = parse_stored("attempt id", &running, PaymentAttemptId::parse)?;
            // A retry learns its own attempt's outcome, never another request's: when
            // this key's attempt ended and another request's runs now, the retry is
            // told so (and that is stored under its key), instead of calling the
            // gateway with the other attempt's key and storing its outcome here.
            // A request that started no attempt of this order, while another request's
            // runs: asking about that payment for it would store the other card's
            // outcome under this key (a decline it never met), and it tried no card.
            if !started_by_this_request && running_key.is_some() {
                transaction.rollback().await?;
                return Ok(BeginPayment::AnotherRequestRunning);
            }
            if started_by_this_request && running_key.as_deref() != Some(claim.key.as_str()) {
                let (attempt, status, reason) =
                    own_attempt_status(&mut *transaction, order, claim).await?;
                ended_meanwhile = Some((
                    attempt,
                    status,
                    reason,
                    format!("another payment of order '{order}' is in progress"),
                ));
            } else {
                let running =
                    BeginPayment::InProgress(attempt_to_call(&mut *transaction, &running).await?);
                withdraw_claim(&mut *transaction, claim).await?;
                transaction.commit().await?;
                return Ok(running);
            }
        }
        // The same when another request's payment has settled the order since: a
        // retry of a declined request must not hear "PAID" (the other card's success)
        // and believe its own card paid. Its own success is the order's to show.
        if let Some((
            status @ (OrderStatus::Paid | OrderStatus::RefundPending | OrderStatus::Refunded),
            _,
            _,
        )) = &locked
            && started_by_this_request
        {
            let (attempt, own_status, reason) =
                own_attempt_status(&mut *transaction, order, claim).await?;
            if own_status != AttemptStatus::Succeeded.as_str() {
                ended_meanwhile = Some((
                    attempt,
                    own_status,
                    reason,
                    format!(
                        "order '{order}' is {} through another payment",
                        status.as_str()
                    ),
                ));
            }
        }
        // Answered here: the key is claimed in this transaction, so the answer commits
        // with what it reports (an order expired just now) or not at all.
        let response = match (not_on_sale, ended_meanwhile) {
            (None, None) if let Some(attempts) = attempts_exhausted => {
                renderer.rejected(&Rejection::new(
                    ErrorCode::FailedPrecondition,
                    format!(
                        "order '{order}' has had {attempts} payment attempts, the most one order takes: it is not charged again; it keeps its hold until it expires or is cancelled"
                    ),
                ))
            }
            (_, Some((attempt, status, reason, meanwhile))) => {
                renderer.rejected(&Rejection::new(
                    ErrorCode::IllegalTransition,
                    format!(
                        "this request's payment attempt {attempt} ended {status}{}; {meanwhile}",
                        reason.map(|reason| format!(" ({reason})")).unwrap_or_default()
                    ),
                ))
            }
            (Some((sku, status)), None) => renderer.rejected(&Rejection::new(
                ErrorCode::OffShelf,
                format!(
                    "sku '{sku}' of order '{order}' is not on sale ({status}) since the order was placed: it cannot be paid; the order keeps its hold until it expires or is cancelled"
                ),
            )),
            (None, None) => {
                answer_without_paying(
                    &mut *transaction,
                    order,
                    (locked, holds_stock),
                    (now, hold_ends_by),
                    renderer,
                )
                    .await?
            }
        };
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
        commit_with_answer(transaction, claim, response).await
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

    /// Whether a webhook event with this id was recorded (applied or ignored) before:
    /// read on the writer, where [`Units::apply_payment_event`] records it.
    pub async fn webhook_event_seen(&self, event_id: &str) -> Result<bool, StoreError> {
        let seen: Option<i64> = statement("SELECT 1 FROM webhook_event WHERE event_id = $1")
            .bind(event_id)
            .fetch_optional_scalar(&mut *self.write_connection().await?)
            .await?;
        Ok(seen.is_some())
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

    /// Records the id the gateway gave an attempt's payment, when an answer named it
    /// before the payment was complete (a customer action pending, still processing):
    /// later looks read the payment by its id instead of sending the create again
    /// under a key the gateway may have forgotten by then. An id recorded before
    /// stays.
    pub async fn note_gateway_payment_id(
        &self,
        attempt: &PaymentAttemptId,
        payment_id: &str,
    ) -> Result<(), StoreError> {
        statement(
            "UPDATE payment_attempt SET gateway_payment_id = $2 \
             WHERE id = $1 AND gateway_payment_id IS NULL",
        )
        .bind(attempt.as_str())
        .bind(payment_id)
        .execute(&mut *self.write_connection().await?)
        .await?;
        Ok(())
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
            let (tries, hold_ends): (i64, i64) = statement(
                "SELECT payment_attempt.reconcile_tries, customer_order.expires_at FROM payment_attempt \
                 JOIN customer_order ON customer_order.id = payment_attempt.order_id \
                 WHERE payment_attempt.id = $1",
            )
            .bind(&id)
            .fetch_one_as(&mut *transaction)
            .await?;
            // Never past the order's hold end while that is ahead: the first look
            // after it cancels a payment left waiting for the shopper (a 3-D Secure
            // step abandoned) and gives the stock back, which the doubling would
            // otherwise put off by up to an hour. Never before the lease ends either:
            // a hold ending a second from now would free the row for another process
            // while this one still asks the gateway about it.
            let backed_off = now
                .unix_milliseconds()
                .saturating_add(retry_delay(lease_milliseconds, tries));
            let leased_until = now.unix_milliseconds().saturating_add(lease_milliseconds);
            let next = if hold_ends > now.unix_milliseconds() {
                backed_off.min(hold_ends.max(leased_until))
            } else {
                backed_off
            };
            statement(
                "UPDATE payment_attempt SET reconcile_after = $2, reconcile_tries = reconcile_tries + 1 WHERE id = $1",
            )
            .bind(&id)
            .bind(next)
            .execute(&mut *transaction)
            .await?;
            let id = parse_stored("attempt id", &id, PaymentAttemptId::parse)?;
            attempts.push(attempt_to_call(&mut *transaction, &id).await?);
        }
        transaction.commit().await?;
        Ok(attempts)
    }

    /// Gives back attempts a reconciliation step claimed but did not ask about (its
    /// lease had no room left for them): due again at once, their tries as before the
    /// claim. Only while the claim's lease lasts: past it, another instance may hold
    /// one.
    pub async fn give_back_attempts(
        &self,
        attempts: &[PaymentAttemptId],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.give_back_claimed(
            "UPDATE payment_attempt SET reconcile_after = $2, reconcile_tries = reconcile_tries - 1 \
             WHERE id = $1 AND reconcile_after > $2 AND reconcile_tries > 0",
            attempts.iter().map(PaymentAttemptId::as_str),
            now,
        )
        .await
    }

    /// Runs `give_back` (`$1` a claimed row's id, `$2` now) for each of `ids`, in one
    /// transaction: the shared half of [`Units::give_back_attempts`] and
    /// [`Units::give_back_refunds`].
    pub(crate) async fn give_back_claimed(
        &self,
        give_back: &'static str,
        ids: impl Iterator<Item = &str>,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        for id in ids {
            statement(give_back)
                .bind(id)
                .bind(now.unix_milliseconds())
                .execute(&mut *transaction)
                .await?;
        }
        transaction.commit().await?;
        Ok(())
    }

    /// Orders past their hold that still wait for payment (exported as a gauge).
    pub async fn payment_gauges(&self, now: Timestamp) -> Result<PaymentGauges, StoreError> {
        let (unresolved, oldest): (i64, Option<i64>) = statement(
            "SELECT COUNT(*), MIN(created_at) FROM payment_attempt WHERE status = 'PROCESSING'",
        )
        .fetch_one_as(&mut *self.writer_read_connection().await?)
        .await?;
        let (refunds, refunds_failed): (i64, i64) = statement(
            "SELECT COALESCE(SUM(CASE WHEN status = 'PENDING' THEN 1 ELSE 0 END), 0), \
             COALESCE(SUM(CASE WHEN status = 'FAILED' THEN 1 ELSE 0 END), 0) FROM refund",
        )
        .fetch_one_as(&mut *self.writer_read_connection().await?)
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

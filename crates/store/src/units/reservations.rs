//! Reservations: reading one, moving it out of `RESERVED` through the transition
//! table (confirm, release, expiry), and the expiry worker's step.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{corrupt, expect_one_row, invariant};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::outbox::{NewEvent, Sequence, append_event, lines_json};
use super::stock::settle_line;
use super::tallies::give_back_tallies;
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{
    ExpiryCursor, ExpiryOutcome, IdempotencyClaim, Idempotent, Rejection, ReservationAction,
    ReservationGauges, ReserveRequest, ResponseRenderer, ShopScope,
};
use crate::plan::ShopperKey;
use crate::sql::{Row, statement};
use domain::{
    ErrorCode, EventType, OrderId, Quantity, ReleaseReason, Reservation, ReservationId,
    ReservationLine, ReservationStatus, ShopCode, SkuCode, Timestamp, UserId, WarehouseCode,
};
use serde_json::json;

/// The expiry backlog gauge counts due holds up to this many: beyond it the worker is
/// far behind, and the exact figure is not worth reading them all at every scrape.
pub const EXPIRY_BACKLOG_COUNTED_MAX: i64 = 100_000;

pub(crate) async fn load_reservation<C: Dialect>(
    connection: &mut C,
    id: &ReservationId,
) -> Result<Option<Reservation>, StoreError> {
    let Some(row) = statement(
        "SELECT reservation.status, reservation.release_reason, reservation.expires_at, \
         reservation.created_at, reservation.updated_at, reservation.shop, reservation.user_id, \
         reservation.order_id, reference.order_ref, reference.source \
         FROM reservation LEFT JOIN order_reference reference ON reference.reservation_id = reservation.id \
         WHERE reservation.id = $1",
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
    let order_ref: Option<String> = row.try_get("order_ref")?;
    let source: Option<String> = row.try_get("source")?;
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
        reference: domain::OrderReference {
            order_ref: order_ref
                .as_deref()
                .map(domain::OrderRef::parse)
                .transpose()
                .map_err(|error| corrupt("order_ref", error))?,
            source: source
                .as_deref()
                .map(domain::RequestSource::parse)
                .transpose()
                .map_err(|error| corrupt("source", error))?,
        },
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
        expires_at: now.plus_seconds(request.ttl_seconds),
        created_at: now,
        updated_at: now,
        lines: request.lines.clone(),
        reference: request.reference.clone(),
    }
}

/// Who moves a reservation out of `RESERVED`. A reservation held by an order is moved
/// only by that order's flow (DESIGN.md, trust model).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mover<'a> {
    /// The reservation endpoints (`confirm`, `release`) and the sweep of plain holds,
    /// judging a hold's end by the time given (`hold_ends_by`: the caller's clock held
    /// back by how far it runs ahead of the database's, `Engine::held_back_now`).
    Client { hold_ends_by: Timestamp },
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
    /// The idempotency key of the request that moves it, which its ledger rows carry
    /// (DESIGN principle 6); `None` for a worker's move (expiry, a gateway's answer),
    /// whose rows name the reservation and, through it, the order.
    pub(crate) key: Option<&'a str>,
}

/// A reservation moved, with what must be settled for it.
pub(crate) struct Moved<'a> {
    pub(crate) id: &'a ReservationId,
    pub(crate) action: ReservationAction,
    pub(crate) key: Option<&'a str>,
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
pub(crate) async fn settle_reservations<C: Dialect>(
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
    let mut settlements: Vec<(&ReservationLine, &Moved<'_>)> = moved
        .iter()
        .flat_map(|done| done.lines.iter().map(move |line| (line, done)))
        .collect();
    settlements.sort_by(|(left, _), (right, _)| {
        (&left.sku, &left.warehouse).cmp(&(&right.sku, &right.warehouse))
    });
    for (line, done) in settlements {
        settle_line(transaction, line, done.action, done.id, done.key, now).await?;
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
        (Mover::Client { .. }, Some(order)) => Ok(Err(Rejection::new(
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
    if let Mover::Client { hold_ends_by } = mover
        && step.action == ReservationAction::Confirm
        && expires_at <= hold_ends_by
    {
        return Ok(Err(Rejection::new(
            ErrorCode::IllegalTransition,
            format!("reservation '{id}' expired at {expires_at}: it can no longer be confirmed"),
        )));
    }
    Ok(Ok((current, target)))
}

/// The first of a reservation's SKUs that is not on sale now, with its status.
async fn first_held_sku_not_on_sale<C: Dialect>(
    transaction: &mut C,
    id: &ReservationId,
) -> Result<Option<(String, String)>, StoreError> {
    statement(
        "SELECT sku.code, sku.sale_status FROM reservation_line JOIN sku ON sku.code = reservation_line.sku \
         WHERE reservation_line.reservation_id = $1 AND sku.sale_status <> 'ON_SHELF' \
         ORDER BY sku.code LIMIT 1",
    )
    .bind(id.as_str())
    .fetch_optional_as::<(String, String)>(&mut *transaction)
    .await
}

/// A reservation's lines.
pub(crate) async fn reservation_lines_of<C: Dialect>(
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
pub(crate) async fn move_reservation<'a, C: Dialect>(
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
    let (current, target) = match decide_move(step, mover, &status, expires_at)? {
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
    let event_type = match (target, step.reason) {
        (ReservationStatus::Confirmed, _) => EventType::ReservationConfirmed,
        (_, ReleaseReason::Expired) => EventType::ReservationExpired,
        _ => EventType::ReservationReleased,
    };
    let event_shop = shop.as_deref().unwrap_or(ShopCode::DEFAULT);
    append_event(
        transaction,
        NewEvent {
            event_type,
            aggregate_id: id.as_str(),
            shop: event_shop,
            // A reservation leaves `RESERVED` once (the transition table has no way
            // back), so this is its second and last event.
            sequence: Sequence::Known(2),
            data: json!({
                "reservation_id": id.as_str(),
                "shop": event_shop,
                "order_id": order_id.as_deref(),
                "reason": reason,
                "lines": lines_json(&lines),
            }),
        },
        now,
    )
    .await?;
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
        key: step.key,
        shopper,
        lines,
    }))
}

/// Moves the reservation an order holds out of `RESERVED` and settles it (see
/// [`settle_reservations`]). `Err` is a business refusal; nothing was written.
pub(crate) async fn settle_order_reservation<C: Dialect>(
    transaction: &mut C,
    order: &OrderId,
    reservation: &ReservationId,
    (action, reason): (ReservationAction, ReleaseReason),
    key: Option<&str>,
    now: Timestamp,
) -> Result<Result<(), Rejection>, StoreError> {
    let step = Move {
        id: reservation,
        action,
        reason,
        key,
    };
    Ok(
        settle_reservations(transaction, &[step], Mover::Order(order), now)
            .await?
            .remove(0),
    )
}

/// Whether an error says something about the rows a unit of work touched (a broken
/// invariant, a constraint the database refused), not about the database's state
/// (a deadlock, a lock wait, a lost connection: those retry the whole unit).
fn is_about_the_data(error: &StoreError) -> bool {
    matches!(error, StoreError::Invariant(_) | StoreError::Database(_))
}

/// What a worker's claimed batch met when settled whole.
pub(crate) enum WholeBatch {
    /// Every move went through.
    Settled,
    /// One failed on its data (a refused move, a broken row): why.
    FailedOnTheData(String),
    /// A row it needed was held by another transaction past the lock bound (an
    /// operator's session left open, a long transaction): which one is not known.
    RowHeld(String),
}

/// Sorts a claimed batch's settlement: [`WholeBatch`], or the error that fails the step
/// (the connection, a deadlock: those retry the whole unit).
pub(crate) fn whole_batch(
    settled: Result<Vec<Result<(), Rejection>>, StoreError>,
) -> Result<WholeBatch, StoreError> {
    match settled {
        Ok(outcomes) => Ok(match outcomes.into_iter().find_map(Result::err) {
            None => WholeBatch::Settled,
            Some(refused) => WholeBatch::FailedOnTheData(refused.detail),
        }),
        Err(StoreError::LockTimeout(message)) => Ok(WholeBatch::RowHeld(message)),
        Err(error) if is_about_the_data(&error) => {
            Ok(WholeBatch::FailedOnTheData(error.to_string()))
        }
        Err(error) => Err(error),
    }
}

/// Begins settling a worker's claimed batch whole: the savepoint [`kept_whole`] keeps
/// or goes back to.
pub(crate) async fn begin_whole_batch<C: Dialect>(transaction: &mut C) -> Result<(), StoreError> {
    statement("SAVEPOINT whole_batch")
        .execute(&mut *transaction)
        .await?;
    Ok(())
}

/// Keeps a claimed batch settled whole since [`begin_whole_batch`] (`true`). When one
/// of its moves failed on its data or waited past the lock bound for a held row, says
/// so in the log (naming the batch as `batch` does) and undoes the batch, for the
/// caller to settle it [`OneByOne`] (`false`). Any other error fails the step.
pub(crate) async fn kept_whole<C: Dialect>(
    transaction: &mut C,
    batch: &str,
    settled: Result<Vec<Result<(), Rejection>>, StoreError>,
) -> Result<bool, StoreError> {
    let kept = match whole_batch(settled)? {
        WholeBatch::Settled => true,
        WholeBatch::FailedOnTheData(failure) => {
            tracing::warn!(%failure, "{batch} could not be settled whole: one by one");
            false
        }
        WholeBatch::RowHeld(failure) => {
            tracing::warn!(%failure, "{batch} waited past the lock bound for a stock row: one by one");
            false
        }
    };
    let end = if kept {
        "RELEASE SAVEPOINT whole_batch"
    } else {
        "ROLLBACK TO SAVEPOINT whole_batch"
    };
    statement(end).execute(&mut *transaction).await?;
    Ok(kept)
}

/// How a claimed batch went, settled one item at a time.
pub(crate) struct OneByOne<T> {
    pub settled: Vec<T>,
    /// Failed on their data, with why: left for a person.
    pub stuck: Vec<(T, String)>,
    /// Not settled because a stock row of theirs was held by another transaction:
    /// left as they are for a later step.
    pub deferred: Vec<T>,
    /// The stock rows found held.
    held: std::collections::BTreeSet<(SkuCode, WarehouseCode)>,
    /// The stock rows of the item being settled.
    rows_of_next: Vec<(SkuCode, WarehouseCode)>,
}

/// Settles a claimed batch one item at a time, each under a savepoint, after the whole
/// batch could not be settled: an item whose data is broken is reported stuck, and one
/// whose stock row another transaction holds is deferred, as is every later one needing
/// a row of the same: one row held open (an operator's session left in a transaction)
/// would otherwise fail every step on the same claim, and no hold of any SKU would
/// expire while it stays held. The first item on a held row waits the short lock bound
/// where the database has one, the rest do not wait at all.
///
/// For each item: [`OneByOne::next`], and when it answers the item back, settle it
/// and hand the result to [`OneByOne::record`].
impl<T> OneByOne<T> {
    pub(crate) async fn start<C: Dialect>(
        transaction: &mut C,
        capacity: usize,
    ) -> Result<OneByOne<T>, StoreError> {
        if let Some(short) = C::SHORT_LOCK_WAIT {
            statement(short).execute(&mut *transaction).await?;
        }
        Ok(OneByOne {
            settled: Vec::with_capacity(capacity),
            stuck: Vec::new(),
            deferred: Vec::new(),
            held: Default::default(),
            rows_of_next: Vec::new(),
        })
    }

    /// `item` back, under a savepoint, when it is to be settled now; `None` when it
    /// was deferred (a stock row of its hold `reservation` was found held).
    pub(crate) async fn next<C: Dialect>(
        &mut self,
        transaction: &mut C,
        item: T,
        reservation: &ReservationId,
    ) -> Result<Option<T>, StoreError> {
        self.rows_of_next = reservation_lines_of(&mut *transaction, reservation)
            .await?
            .into_iter()
            .map(|line| (line.sku, line.warehouse))
            .collect();
        if self.rows_of_next.iter().any(|row| self.held.contains(row)) {
            self.deferred.push(item);
            return Ok(None);
        }
        statement("SAVEPOINT settle_one")
            .execute(&mut *transaction)
            .await?;
        Ok(Some(item))
    }

    /// Keeps or undoes what settling `item` (the last [`OneByOne::next`] answered)
    /// did, and files it by how it went.
    pub(crate) async fn record<C: Dialect>(
        &mut self,
        transaction: &mut C,
        item: T,
        settled: Result<Vec<Result<(), Rejection>>, StoreError>,
    ) -> Result<(), StoreError> {
        let settled = whole_batch(settled)?;
        let end = if matches!(settled, WholeBatch::Settled) {
            "RELEASE SAVEPOINT settle_one"
        } else {
            "ROLLBACK TO SAVEPOINT settle_one"
        };
        statement(end).execute(&mut *transaction).await?;
        match settled {
            WholeBatch::Settled => self.settled.push(item),
            WholeBatch::FailedOnTheData(failure) => self.stuck.push((item, failure)),
            WholeBatch::RowHeld(_) => {
                self.held.extend(std::mem::take(&mut self.rows_of_next));
                self.deferred.push(item);
            }
        }
        Ok(())
    }
}

/// Claims due rows with `query` (one of the expiry claims: `$1` now, `$2` the limit,
/// `$3` and `$4` the cursor) after `cursor`, or from the beginning: their ids, in the
/// claim's order, and where the next claim resumes ([`ExpiryCursor`]: after the last
/// of them when the claim was full, from the beginning when it came back short).
pub(crate) async fn claim_past_cursor<C: Dialect>(
    transaction: &mut C,
    queries: &[&'static str],
    (now, limit): (Timestamp, i64),
    cursor: Option<&ExpiryCursor>,
) -> Result<(Vec<String>, Option<ExpiryCursor>), StoreError> {
    // From the beginning: every hold ends after `i64::MIN`, every id sorts after "".
    let (after_expiry, after_id) = cursor.map_or((i64::MIN, ""), |cursor| {
        (cursor.expires_at_milliseconds, cursor.id.as_str())
    });
    let mut claimed: Vec<(String, i64)> = Vec::new();
    for query in queries {
        let rows: Vec<(String, i64)> = statement(query)
            .bind(now.unix_milliseconds())
            .bind(limit)
            .bind(after_expiry)
            .bind(after_id)
            .fetch_all_as(&mut *transaction)
            .await?;
        claimed.extend(rows);
    }
    // Several statements' claims, in the one order, cut to the limit (the rows past
    // it stay locked until the commit, and the next step takes them from the cursor).
    if queries.len() > 1 {
        claimed.sort_by(|(left_id, left_at), (right_id, right_at)| {
            (left_at, left_id).cmp(&(right_at, right_id))
        });
        claimed.truncate(usize::try_from(limit).unwrap_or(0));
    }
    let full = i64::try_from(claimed.len()).is_ok_and(|claimed| claimed >= limit);
    let resume_after = claimed
        .last()
        .filter(|_| full)
        .map(|(id, expires_at_milliseconds)| ExpiryCursor {
            expires_at_milliseconds: *expires_at_milliseconds,
            id: id.clone(),
        });
    Ok((
        claimed.into_iter().map(|(id, _)| id).collect(),
        resume_after,
    ))
}

impl<B: Backend> Units<B> {
    pub async fn reservation(&self, id: &ReservationId) -> Result<Option<Reservation>, StoreError> {
        let mut transaction = self.begin_writer_read().await?;
        let reservation = load_reservation(&mut *transaction, id).await;
        transaction.rollback().await?;
        reservation
    }

    /// Confirms (consumes) or releases (returns) a reservation's stock. Only the
    /// transaction that moves the reservation out of `RESERVED` touches stock.
    pub async fn change_reservation(
        &self,
        claim: &IdempotencyClaim,
        id: &ReservationId,
        action: ReservationAction,
        (now, hold_ends_by): (Timestamp, Timestamp),
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let reason = ReleaseReason::Requested;
        let confirming = action == ReservationAction::Confirm;
        if confirming {
            statement("SAVEPOINT confirm_hold")
                .execute(&mut *transaction)
                .await?;
        }
        let mut outcome = settle_reservations(
            &mut *transaction,
            &[Move {
                id,
                action,
                reason,
                key: Some(claim.key.as_str()),
            }],
            Mover::Client { hold_ends_by },
            now,
        )
        .await?
        .remove(0);
        // A SKU taken off the shelf (or deleted) is not sold, also from a hold taken
        // before (seed 003: the deduction must see the shelf change at once). Read with
        // the hold's stock rows locked by the settlement, and a shelf change locks them
        // first: it either committed before this read or waits for this commit.
        if confirming
            && outcome.is_ok()
            && let Some((sku, status)) = first_held_sku_not_on_sale(&mut *transaction, id).await?
        {
            statement("ROLLBACK TO SAVEPOINT confirm_hold")
                .execute(&mut *transaction)
                .await?;
            outcome = Err(Rejection::new(
                ErrorCode::OffShelf,
                format!(
                    "sku '{sku}' is not on sale ({status}): the hold cannot be confirmed; release it"
                ),
            ));
        }
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
        commit_with_answer(transaction, claim, response).await
    }

    /// Releases up to `limit` reservations whose hold ended at or before `now`, after
    /// `cursor` (the previous step's [`ExpiryOutcome::resume_after`]). Several
    /// processes may run this at once: each reservation is claimed by exactly one.
    pub async fn expire_batch(
        &self,
        now: Timestamp,
        hold_ends_by: Timestamp,
        limit: i64,
        cursor: Option<&ExpiryCursor>,
    ) -> Result<ExpiryOutcome, StoreError> {
        let mut transaction = self.begin_write().await?;
        let (claimed, resume_after) = claim_past_cursor(
            &mut *transaction,
            &[<B::Connection as Dialect>::CLAIM_EXPIRED_RESERVATIONS],
            (hold_ends_by, limit),
            cursor,
        )
        .await?;
        let ids = claimed
            .iter()
            .map(|id| ReservationId::parse(id).map_err(|error| corrupt("reservation id", error)))
            .collect::<Result<Vec<_>, _>>()?;
        let moves: Vec<Move<'_>> = ids
            .iter()
            .map(|id| Move {
                id,
                action: ReservationAction::Release,
                reason: ReleaseReason::Expired,
                key: None,
            })
            .collect();
        // Claimed rows are locked and `RESERVED` and held by no order: each moves,
        // unless the data around one is broken (a stock row holding fewer units
        // reserved than the hold, by a hand edit or a defect). Then the batch is
        // moved again one reservation at a time, each under a savepoint, and the ones
        // that cannot move are reported and left `RESERVED` for a person, rather than
        // stopping every expiry behind the first of them, for good.
        begin_whole_batch(&mut *transaction).await?;
        let mover = Mover::Client { hold_ends_by };
        let whole = settle_reservations(&mut *transaction, &moves, mover, now).await;
        if kept_whole(&mut *transaction, "an expiry batch", whole).await? {
            transaction.commit().await?;
            return Ok(ExpiryOutcome {
                released: ids,
                stuck: Vec::new(),
                deferred: Vec::new(),
                resume_after,
            });
        }
        let mut one_by_one = OneByOne::start(&mut *transaction, moves.len()).await?;
        for single in moves {
            let id = single.id;
            let Some(single) = one_by_one.next(&mut *transaction, single, id).await? else {
                continue;
            };
            let settled =
                settle_reservations(&mut *transaction, std::slice::from_ref(&single), mover, now)
                    .await;
            one_by_one
                .record(&mut *transaction, single, settled)
                .await?;
        }
        transaction.commit().await?;
        let ids_of =
            |moves: Vec<Move<'_>>| moves.into_iter().map(|single| single.id.clone()).collect();
        Ok(ExpiryOutcome {
            released: ids_of(one_by_one.settled),
            stuck: one_by_one
                .stuck
                .into_iter()
                .map(|(single, failure)| (single.id.clone(), failure))
                .collect(),
            deferred: ids_of(one_by_one.deferred),
            resume_after,
        })
    }

    /// Open holds and the expiry backlog, for the metrics endpoint (once per scrape).
    /// The open holds are counted whole: a scrape costs as much as there are open holds
    /// (PostgreSQL reads the table when they are a large share of it). Confirmed and released reservations are
    /// never deleted: counting them would scan a table that only grows, at every scrape.
    pub async fn reservation_gauges(
        &self,
        now: Timestamp,
    ) -> Result<ReservationGauges, StoreError> {
        let reserved: i64 = statement("SELECT COUNT(*) FROM reservation WHERE status = 'RESERVED'")
            .fetch_one_scalar(&mut *self.writer_read_connection().await?)
            .await?;
        Ok(ReservationGauges {
            reserved,
            expired_backlog: self.expiry_backlog(now).await?,
        })
    }

    /// `RESERVED` reservations already past their expiry, counted up to
    /// [`EXPIRY_BACKLOG_COUNTED_MAX`]: read in the order of the partial index the expiry
    /// worker uses, so it costs the due holds, never the open or settled ones. Without
    /// the order and the bound, PostgreSQL estimates the status and the time
    /// independently and scans the whole table once settled reservations (never
    /// deleted) outnumber the due ones: 143 ms against 0.5 ms at 2,000,000 rows
    /// (docs/BENCHMARKS.md, issue 19).
    pub async fn expiry_backlog(&self, now: Timestamp) -> Result<i64, StoreError> {
        statement(
            "SELECT COUNT(*) FROM (SELECT 1 AS due FROM reservation \
             WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL \
             ORDER BY expires_at LIMIT $2) AS backlog",
        )
        .bind(now.unix_milliseconds())
        .bind(EXPIRY_BACKLOG_COUNTED_MAX)
        .fetch_one_scalar(&mut *self.writer_read_connection().await?)
        .await
    }
}

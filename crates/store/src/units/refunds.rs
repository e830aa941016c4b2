//! Refunds: written with the change that owes them, claimed by the refund worker,
//! settled or failed from the gateway's answer.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{derived_random, expect_one_row, invariant, parse_stored};
use super::idempotency::commit_with_answer;
use super::orders::{OnOrder, lock_order, move_order, order_answer};
use super::payments::retry_delay;
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, Rejection, ResponseRenderer};
use crate::orders::{RefundDecision, RefundToIssue};
use crate::sql::statement;
use domain::{
    AttemptStatus, ErrorCode, OrderId, OrderStatus, PaymentAttemptId, RefundId, RefundStatus,
    Timestamp,
};

/// A refund of what `attempt` charged, to be issued by the refund worker with its own
/// gateway key. One per attempt.
pub(crate) async fn insert_refund<C: Dialect>(
    transaction: &mut C,
    attempt: &PaymentAttemptId,
    now: Timestamp,
    reason: &str,
) -> Result<(), StoreError> {
    let id = RefundId::generate(now, derived_random(attempt.as_str(), "refund"));
    let inserted = statement(
        "INSERT INTO refund (id, order_id, attempt_id, gateway_key, status, amount_minor, currency, reason, \
         next_try_at, created_at, updated_at) \
         SELECT $1, order_id, id, $2, 'PENDING', amount_minor, currency, $3, $4, $4, $4 FROM payment_attempt WHERE id = $5 \
         ON CONFLICT (attempt_id) DO NOTHING",
    )
    .bind(id.as_str())
    .bind(format!("stockd-refund-{attempt}"))
    .bind(domain::limits::bounded_reason(reason).into_owned())
    .bind(now.unix_milliseconds())
    .bind(attempt.as_str())
    .execute(&mut *transaction)
    .await?;
    // Every caller moved the attempt or its order under the order's lock first, so no
    // refund of it can exist yet: none written (a refund already there, an attempt
    // missing) is broken data, and an order must not wait as `REFUND_PENDING` for a
    // refund nobody will issue.
    expect_one_row(inserted, &format!("a refund of attempt {attempt}"))
}

/// Who moves a refund, and so which table allows the move.
enum RefundChange<'a> {
    /// The gateway's answer, as the refund worker read it
    /// ([`domain::REFUND_TRANSITIONS`]).
    Answered {
        to: RefundStatus,
        gateway_refund_id: Option<&'a str>,
        failure_reason: Option<&'a str>,
    },
    /// A person's decision on a refused refund ([`domain::REFUND_RESOLUTIONS`]),
    /// recorded with it.
    Resolved(&'a RefundDecision),
}

/// Moves a refund as `change` says, from its status as read under its order's lock
/// (every status change of a refund holds it), through the change's transition table,
/// with the update conditional on that status and its row count checked. Answers
/// whether it moved: a refund the gateway's answer leaves where it is stays (the same
/// answer, applied twice).
///
/// A refund sent again gets a key of its own (the refused refund's id and the time of
/// the decision: the gateway must see a new refund, and a refund is refused again at
/// the earliest after a round trip, so no two decisions share a millisecond), loses
/// the refused refund's id (the worker would read that one back instead of sending),
/// and is due at once, not counted as tried.
async fn move_refund<C: Dialect>(
    transaction: &mut C,
    refund: &RefundId,
    change: RefundChange<'_>,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let status: String = statement("SELECT status FROM refund WHERE id = $1")
        .bind(refund.as_str())
        .fetch_one_scalar(&mut *transaction)
        .await?;
    let from = parse_stored("refund status", &status, RefundStatus::parse)?;
    let (to, gateway_refund_id, failure_reason, decision) = match change {
        RefundChange::Answered {
            to,
            gateway_refund_id,
            failure_reason,
        } => {
            if from == to {
                return Ok(false);
            }
            if !from.may_become(to) {
                return Err(invariant(format!(
                    "refund {refund} cannot go from {} to {}",
                    from.as_str(),
                    to.as_str()
                )));
            }
            (to, gateway_refund_id, failure_reason, None)
        }
        RefundChange::Resolved(decision) => {
            let Some(to) = decision.resolution.applied_to(from) else {
                return Err(invariant(format!(
                    "refund {refund} is {}: {} does not apply",
                    from.as_str(),
                    decision.resolution.as_str()
                )));
            };
            (to, None, None, Some(decision))
        }
    };
    let sent_again = decision.is_some() && to == RefundStatus::Pending;
    let updated = statement(
        "UPDATE refund SET status = $2, \
         gateway_refund_id = CASE WHEN $7 = 1 THEN NULL ELSE COALESCE($3, gateway_refund_id) END, \
         failure_reason = COALESCE($4, failure_reason), updated_at = $5, \
         gateway_key = CASE WHEN $7 = 1 THEN $8 ELSE gateway_key END, \
         tries = CASE WHEN $7 = 1 THEN 0 ELSE tries END, \
         next_try_at = CASE WHEN $7 = 1 THEN $5 ELSE next_try_at END, \
         resolution = COALESCE($9, resolution), resolved_by = COALESCE($10, resolved_by), \
         resolution_remark = COALESCE($11, resolution_remark), \
         resolved_at = CASE WHEN $12 = 1 THEN $5 ELSE resolved_at END \
         WHERE id = $1 AND status = $6",
    )
    .bind(refund.as_str())
    .bind(to.as_str())
    .bind(gateway_refund_id)
    .bind(failure_reason.map(|reason| domain::limits::bounded_reason(reason).into_owned()))
    .bind(now.unix_milliseconds())
    .bind(from.as_str())
    .bind(i64::from(sent_again))
    .bind(format!(
        "stockd-refund-{refund}-again-{}",
        now.unix_milliseconds()
    ))
    .bind(decision.map(|decision| decision.resolution.as_str()))
    .bind(decision.map(|decision| decision.by.as_str()))
    .bind(decision.map(|decision| domain::limits::bounded_reason(&decision.remark).into_owned()))
    .bind(i64::from(decision.is_some()))
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "moving a refund under its order's lock")?;
    Ok(true)
}

impl<B: Backend> Units<B> {
    /// Gives back refunds a step claimed but did not send (its lease had no room left
    /// for them): due again at once, their tries as before the claim. Only while the
    /// claim's lease lasts: past it, another instance may hold one.
    pub async fn give_back_refunds(
        &self,
        refunds: &[RefundId],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.give_back_claimed(
            "UPDATE refund SET next_try_at = $2, tries = tries - 1 \
             WHERE id = $1 AND status = 'PENDING' AND next_try_at > $2 AND tries > 0",
            refunds.iter().map(RefundId::as_str),
            now,
        )
        .await
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
            .fetch_all_as::<(
                String,
                String,
                String,
                String,
                i64,
                String,
                i64,
                Option<String>,
            )>(&mut *transaction)
            .await?;
        let mut refunds = Vec::with_capacity(rows.len());
        for (id, order, attempt, gateway_key, amount_minor, currency, tries, gateway_refund_id) in
            rows
        {
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
                gateway_refund_id,
            });
        }
        transaction.commit().await?;
        Ok(refunds)
    }

    /// Records the gateway's refund of a refund it answered `pending`: later tries
    /// read that refund instead of sending a new one. The refund stays `PENDING`.
    pub async fn note_refund_at_gateway(
        &self,
        refund: &RefundId,
        gateway_refund_id: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        statement(
            "UPDATE refund SET gateway_refund_id = $2, updated_at = $3 WHERE id = $1 AND status = 'PENDING'",
        )
        .bind(refund.as_str())
        .bind(gateway_refund_id)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(())
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
        let moved = move_refund(
            &mut *transaction,
            refund,
            RefundChange::Answered {
                to: RefundStatus::Succeeded,
                gateway_refund_id: Some(gateway_refund_id),
                failure_reason: None,
            },
            now,
        )
        .await?;
        if moved
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

    /// A person's decision on refund `refund` of `order`, which the gateway refused
    /// (`FAILED`), through [`domain::REFUND_RESOLUTIONS`]: sent again (`PENDING`, due at
    /// once, with a new gateway key: the refused one's would replay the refusal, and
    /// without the refused refund's id, which the worker would read back instead of
    /// sending), or refunded elsewhere (`SUCCEEDED`; the refund of the attempt that
    /// paid moves its order from `REFUND_PENDING` to `REFUNDED`). Who decided, what and
    /// why are kept with the refund. Any other status is refused
    /// (`illegal_transition`), and nothing changes.
    pub async fn resolve_refund(
        &self,
        claim: &IdempotencyClaim,
        order: &OrderId,
        refund: &RefundId,
        decision: &RefundDecision,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        // The order's lock is the one every status change of its refunds holds.
        let (mut transaction, locked) = match self.open_on_order(order, claim, now).await? {
            OnOrder::Answered(answer) => return Ok(answer),
            OnOrder::Open(transaction, locked) => (transaction, locked),
        };
        let found: Option<(String, String)> = statement(
            "SELECT refund.status, payment_attempt.status FROM refund \
             JOIN payment_attempt ON payment_attempt.id = refund.attempt_id \
             WHERE refund.id = $1 AND refund.order_id = $2",
        )
        .bind(refund.as_str())
        .bind(order.as_str())
        .fetch_optional_as(&mut *transaction)
        .await?;
        let refusal = match (locked, found) {
            (None, _) => Some(Rejection::new(
                ErrorCode::NotFound,
                format!("order '{order}' does not exist"),
            )),
            (Some(_), None) => Some(Rejection::new(
                ErrorCode::NotFound,
                format!("order '{order}' has no refund '{refund}'"),
            )),
            (Some((order_status, _, _)), Some((status, attempt_status))) => {
                let from = parse_stored("refund status", &status, RefundStatus::parse)?;
                match decision.resolution.applied_to(from) {
                    None => Some(Rejection::new(
                        ErrorCode::IllegalTransition,
                        format!(
                            "refund '{refund}' is {}: only a refund the gateway refused (FAILED) is resolved",
                            from.as_str()
                        ),
                    )),
                    Some(to) => {
                        move_refund(
                            &mut *transaction,
                            refund,
                            RefundChange::Resolved(decision),
                            now,
                        )
                        .await?;
                        if to == RefundStatus::Succeeded
                            && attempt_status == AttemptStatus::Succeeded.as_str()
                            && order_status == OrderStatus::RefundPending
                        {
                            move_order(
                                &mut *transaction,
                                order,
                                OrderStatus::RefundPending,
                                OrderStatus::Refunded,
                                &format!(
                                    "refund {refund} settled outside stockd ({})",
                                    decision.by
                                ),
                                now,
                            )
                            .await?;
                        }
                        None
                    }
                }
            }
        };
        let response = order_answer(&mut *transaction, order, refusal, renderer).await?;
        commit_with_answer(transaction, claim, response).await
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
        let order: Option<String> = statement("SELECT order_id FROM refund WHERE id = $1")
            .bind(refund.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
        let Some(order) = order else {
            return Err(invariant(format!("refund {refund} vanished")));
        };
        let order = parse_stored("order id", &order, OrderId::parse)?;
        // The order first: the lock order of every order transaction, and the lock
        // every status change of its refunds holds.
        lock_order(&mut *transaction, &order).await?;
        move_refund(
            &mut *transaction,
            refund,
            RefundChange::Answered {
                to: RefundStatus::Failed,
                gateway_refund_id: None,
                failure_reason: Some(reason),
            },
            now,
        )
        .await?;
        transaction.commit().await?;
        Ok(())
    }
}

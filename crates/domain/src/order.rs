//! Orders and payments: the checkout state machine (seed 000), with the rule that a
//! payment timeout means "unknown", never "failed".

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::ParseError;
use crate::reservation::ReservationStatus;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OrderStatus {
    PendingPayment,
    /// A payment attempt was sent; its outcome is not known yet.
    PaymentProcessing,
    Paid,
    PaymentFailed,
    Cancelled,
    Expired,
    RefundPending,
    Refunded,
}

/// Every change an order's status may make. A declined payment leaves the order
/// `PAYMENT_FAILED` with its hold: another attempt (another card) may pay it while the
/// hold lasts, the shopper may cancel it, and at the hold's end it expires. A success
/// that arrives after the order gave its stock back (expired or cancelled) leads to
/// `PAID` when the stock can be reserved again, and to `REFUND_PENDING` when it cannot.
pub const ORDER_TRANSITIONS: &[(OrderStatus, OrderStatus)] = &[
    (OrderStatus::PendingPayment, OrderStatus::PaymentProcessing),
    (OrderStatus::PendingPayment, OrderStatus::Paid),
    (OrderStatus::PendingPayment, OrderStatus::PaymentFailed),
    (OrderStatus::PendingPayment, OrderStatus::Cancelled),
    (OrderStatus::PendingPayment, OrderStatus::Expired),
    (OrderStatus::PaymentProcessing, OrderStatus::Paid),
    (OrderStatus::PaymentProcessing, OrderStatus::PaymentFailed),
    (OrderStatus::PaymentProcessing, OrderStatus::Expired),
    (OrderStatus::Paid, OrderStatus::RefundPending),
    (OrderStatus::RefundPending, OrderStatus::Refunded),
    (OrderStatus::Expired, OrderStatus::Paid),
    (OrderStatus::Expired, OrderStatus::RefundPending),
    (OrderStatus::Cancelled, OrderStatus::Paid),
    (OrderStatus::Cancelled, OrderStatus::RefundPending),
    (OrderStatus::PaymentFailed, OrderStatus::PaymentProcessing),
    (OrderStatus::PaymentFailed, OrderStatus::Cancelled),
    (OrderStatus::PaymentFailed, OrderStatus::Expired),
    (OrderStatus::PaymentFailed, OrderStatus::Paid),
    // Orders declined before attempts could be retried gave their stock back at once.
    (OrderStatus::PaymentFailed, OrderStatus::RefundPending),
];

/// A status change that [`ORDER_TRANSITIONS`] does not contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IllegalOrderTransition {
    pub from: OrderStatus,
    pub to: OrderStatus,
}

impl fmt::Display for IllegalOrderTransition {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "an order cannot go from {} to {}",
            self.from.as_str(),
            self.to.as_str()
        )
    }
}

impl OrderStatus {
    pub const ALL: [OrderStatus; 8] = [
        OrderStatus::PendingPayment,
        OrderStatus::PaymentProcessing,
        OrderStatus::Paid,
        OrderStatus::PaymentFailed,
        OrderStatus::Cancelled,
        OrderStatus::Expired,
        OrderStatus::RefundPending,
        OrderStatus::Refunded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::PendingPayment => "PENDING_PAYMENT",
            OrderStatus::PaymentProcessing => "PAYMENT_PROCESSING",
            OrderStatus::Paid => "PAID",
            OrderStatus::PaymentFailed => "PAYMENT_FAILED",
            OrderStatus::Cancelled => "CANCELLED",
            OrderStatus::Expired => "EXPIRED",
            OrderStatus::RefundPending => "REFUND_PENDING",
            OrderStatus::Refunded => "REFUNDED",
        }
    }

    pub fn parse(text: &str) -> Result<OrderStatus, ParseError> {
        OrderStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
            .ok_or_else(|| ParseError::new(format!("unknown order status '{text}'")))
    }

    pub fn transition(self, to: OrderStatus) -> Result<OrderStatus, IllegalOrderTransition> {
        if ORDER_TRANSITIONS.contains(&(self, to)) {
            Ok(to)
        } else {
            Err(IllegalOrderTransition { from: self, to })
        }
    }

    /// Whether an order in this status may hold a reservation in `reservation` and have
    /// payments adding up to `payment` (`SUCCEEDED` if an attempt succeeded, else
    /// `PROCESSING` if one runs, else `FAILED` if any was made): the combinations the
    /// state machine can produce. Anything else is a lost update or a hand edit; the
    /// audit reports it.
    pub fn agrees_with(
        self,
        reservation: ReservationStatus,
        payment: Option<AttemptStatus>,
    ) -> bool {
        use AttemptStatus::{Failed, Processing, Succeeded};
        use ReservationStatus::{Confirmed, Released, Reserved};
        matches!(
            (self, reservation, payment),
            (OrderStatus::PendingPayment, Reserved, None)
                | (OrderStatus::PaymentProcessing, Reserved, Some(Processing))
                | (OrderStatus::Paid, Confirmed, Some(Succeeded))
                // Declined, its hold kept for another card (or, declined before attempts
                // could be retried, its stock given back).
                | (OrderStatus::PaymentFailed, Reserved | Released, Some(Failed))
                | (OrderStatus::Cancelled | OrderStatus::Expired, Released, None | Some(Failed))
                | (
                    OrderStatus::RefundPending | OrderStatus::Refunded,
                    Confirmed | Released,
                    Some(Succeeded)
                )
        )
    }

    /// Whether a new payment attempt may start from this status (while the hold lasts):
    /// not paid yet, or the last attempt was declined.
    pub fn accepts_a_payment_attempt(self) -> bool {
        matches!(
            self,
            OrderStatus::PendingPayment | OrderStatus::PaymentFailed
        )
    }
}

/// The client's payment method token, passed through to the gateway (`pm_card_visa`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PaymentMethod(String);

impl PaymentMethod {
    pub fn parse(text: &str) -> Result<PaymentMethod, ParseError> {
        let ok = (1..=255).contains(&text.len())
            && text
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_');
        if ok {
            Ok(PaymentMethod(text.to_owned()))
        } else {
            Err(ParseError::new(
                "payment_method must be 1 to 255 letters, digits or '_'",
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The project's sandbox fault methods (`pm_sandbox_…`): meaningless to a real
    /// gateway, so refused when one is configured.
    pub fn is_sandbox_only(&self) -> bool {
        self.0.starts_with(PaymentMethod::SANDBOX_PREFIX)
    }

    pub const SANDBOX_PREFIX: &'static str = "pm_sandbox_";
}

impl TryFrom<String> for PaymentMethod {
    type Error = ParseError;
    fn try_from(text: String) -> Result<PaymentMethod, ParseError> {
        PaymentMethod::parse(&text)
    }
}

impl From<PaymentMethod> for String {
    fn from(value: PaymentMethod) -> String {
        value.0
    }
}

/// What stockd knows about one payment attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AttemptStatus {
    /// Sent, or about to be; the gateway's answer is not known.
    Processing,
    Succeeded,
    Failed,
}

/// Every status change of a payment attempt: the gateway's answer settles a running
/// attempt; a success may still come for one that failed (the gateway completed an
/// intent it had declined, or one abandoned when its hold ended); and a second charge
/// on an attempt that failed is recorded on it, failed again, with its refund.
pub const ATTEMPT_TRANSITIONS: &[(AttemptStatus, AttemptStatus)] = &[
    (AttemptStatus::Processing, AttemptStatus::Succeeded),
    (AttemptStatus::Processing, AttemptStatus::Failed),
    (AttemptStatus::Failed, AttemptStatus::Succeeded),
    (AttemptStatus::Failed, AttemptStatus::Failed),
];

impl AttemptStatus {
    /// Whether [`ATTEMPT_TRANSITIONS`] allows this change.
    pub fn may_become(self, to: AttemptStatus) -> bool {
        ATTEMPT_TRANSITIONS.contains(&(self, to))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AttemptStatus::Processing => "PROCESSING",
            AttemptStatus::Succeeded => "SUCCEEDED",
            AttemptStatus::Failed => "FAILED",
        }
    }

    pub fn parse(text: &str) -> Result<AttemptStatus, ParseError> {
        match text {
            "PROCESSING" => Ok(AttemptStatus::Processing),
            "SUCCEEDED" => Ok(AttemptStatus::Succeeded),
            "FAILED" => Ok(AttemptStatus::Failed),
            _ => Err(ParseError::new(format!("unknown attempt status '{text}'"))),
        }
    }
}

/// Where a refund stands: written `PENDING` with the change that owes it, then
/// settled by the gateway's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RefundStatus {
    /// Owed: the refund worker issues it, or reads back the gateway's pending refund.
    Pending,
    /// The gateway says the money went back.
    Succeeded,
    /// The gateway refused it, or it cannot be read: left to a person, never retried
    /// by the worker ([`REFUND_RESOLUTIONS`]: a person sends it again or records it
    /// settled elsewhere).
    Failed,
}

/// What a person decides for a refund the gateway refused (`FAILED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefundResolution {
    /// Owed again: the refund worker sends it as a new refund, with a new gateway key
    /// (the refused one's key would replay the refusal).
    SendAgain,
    /// The money went back outside stockd (the gateway's dashboard, a bank transfer):
    /// recorded `SUCCEEDED`, the order `REFUNDED`; nothing is sent.
    RefundedElsewhere,
}

/// What a person may decide for a refund, by its status: only a refused one is theirs.
pub const REFUND_RESOLUTIONS: &[(RefundStatus, RefundResolution, RefundStatus)] = &[
    (
        RefundStatus::Failed,
        RefundResolution::SendAgain,
        RefundStatus::Pending,
    ),
    (
        RefundStatus::Failed,
        RefundResolution::RefundedElsewhere,
        RefundStatus::Succeeded,
    ),
];

impl RefundResolution {
    /// The status a refund at `from` takes by this resolution, when
    /// [`REFUND_RESOLUTIONS`] allows it.
    pub fn applied_to(self, from: RefundStatus) -> Option<RefundStatus> {
        REFUND_RESOLUTIONS
            .iter()
            .find(|(status, resolution, _)| *status == from && *resolution == self)
            .map(|(_, _, to)| *to)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RefundResolution::SendAgain => "send_again",
            RefundResolution::RefundedElsewhere => "refunded_elsewhere",
        }
    }

    pub fn parse(text: &str) -> Result<RefundResolution, ParseError> {
        [
            RefundResolution::SendAgain,
            RefundResolution::RefundedElsewhere,
        ]
        .into_iter()
        .find(|resolution| resolution.as_str() == text)
        .ok_or_else(|| ParseError::new(format!("unknown refund resolution '{text}'")))
    }
}

/// Every status change of a refund: only a pending one is settled, once.
pub const REFUND_TRANSITIONS: &[(RefundStatus, RefundStatus)] = &[
    (RefundStatus::Pending, RefundStatus::Succeeded),
    (RefundStatus::Pending, RefundStatus::Failed),
];

impl RefundStatus {
    /// Whether [`REFUND_TRANSITIONS`] allows this change.
    pub fn may_become(self, to: RefundStatus) -> bool {
        REFUND_TRANSITIONS.contains(&(self, to))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RefundStatus::Pending => "PENDING",
            RefundStatus::Succeeded => "SUCCEEDED",
            RefundStatus::Failed => "FAILED",
        }
    }

    pub fn parse(text: &str) -> Result<RefundStatus, ParseError> {
        match text {
            "PENDING" => Ok(RefundStatus::Pending),
            "SUCCEEDED" => Ok(RefundStatus::Succeeded),
            "FAILED" => Ok(RefundStatus::Failed),
            _ => Err(ParseError::new(format!("unknown refund status '{text}'"))),
        }
    }
}

/// Whether a payment attempt's refund (its status, or none) agrees with the attempt
/// and its order: the attempt that paid is refunded exactly when its order was
/// cancelled after payment or paid too late (`REFUND_PENDING`: the refund owed or
/// refused; `REFUNDED`: it went back); a second charge (an attempt recorded `FAILED`
/// with the money taken, `charged_twice`) is always refunded; an attempt that took no
/// money never is. Anything else is money kept that is owed, or given back that was
/// not owed: the audit reports it.
pub fn refund_agrees(
    order: OrderStatus,
    attempt: AttemptStatus,
    charged_twice: bool,
    refund: Option<RefundStatus>,
) -> bool {
    match (attempt, charged_twice) {
        (AttemptStatus::Failed, true) => refund.is_some(),
        (AttemptStatus::Succeeded, _) => match order {
            OrderStatus::RefundPending => {
                matches!(refund, Some(RefundStatus::Pending | RefundStatus::Failed))
            }
            OrderStatus::Refunded => refund == Some(RefundStatus::Succeeded),
            _ => refund.is_none(),
        },
        _ => refund.is_none(),
    }
}

/// How a second charge's attempt is recorded: `FAILED`, its reason beginning so (the
/// money was taken after another attempt had paid the order; refunded).
pub const SECOND_CHARGE_REASON_PREFIX: &str = "charged (";

#[cfg(test)]
mod tests {
    use super::*;
    use OrderStatus::*;

    #[test]
    fn only_a_refused_refund_is_resolved_by_a_person() {
        use RefundResolution::{RefundedElsewhere, SendAgain};
        assert_eq!(
            SendAgain.applied_to(RefundStatus::Failed),
            Some(RefundStatus::Pending)
        );
        assert_eq!(
            RefundedElsewhere.applied_to(RefundStatus::Failed),
            Some(RefundStatus::Succeeded)
        );
        for settled_or_owed in [RefundStatus::Pending, RefundStatus::Succeeded] {
            assert_eq!(SendAgain.applied_to(settled_or_owed), None);
            assert_eq!(RefundedElsewhere.applied_to(settled_or_owed), None);
        }
        // The worker's own table still never moves a refused refund.
        assert!(!RefundStatus::Failed.may_become(RefundStatus::Pending));
        assert!(!RefundStatus::Failed.may_become(RefundStatus::Succeeded));
    }

    #[test]
    fn only_money_taken_and_not_kept_is_refunded() {
        use RefundStatus::{Failed as Refused, Pending as Owed, Succeeded as Back};
        let succeeded = AttemptStatus::Succeeded;
        assert!(refund_agrees(Paid, succeeded, false, None));
        assert!(!refund_agrees(Paid, succeeded, false, Some(Owed)));
        assert!(refund_agrees(RefundPending, succeeded, false, Some(Owed)));
        assert!(refund_agrees(
            RefundPending,
            succeeded,
            false,
            Some(Refused)
        ));
        assert!(!refund_agrees(RefundPending, succeeded, false, None));
        assert!(!refund_agrees(RefundPending, succeeded, false, Some(Back)));
        assert!(refund_agrees(Refunded, succeeded, false, Some(Back)));
        assert!(!refund_agrees(Refunded, succeeded, false, Some(Owed)));
        assert!(!refund_agrees(Refunded, succeeded, false, None));
        assert!(refund_agrees(Paid, AttemptStatus::Failed, true, Some(Owed)));
        assert!(refund_agrees(Paid, AttemptStatus::Failed, true, Some(Back)));
        assert!(!refund_agrees(Paid, AttemptStatus::Failed, true, None));
        assert!(refund_agrees(
            PaymentFailed,
            AttemptStatus::Failed,
            false,
            None
        ));
        assert!(!refund_agrees(
            PaymentFailed,
            AttemptStatus::Failed,
            false,
            Some(Owed)
        ));
        assert!(!refund_agrees(
            PaymentProcessing,
            AttemptStatus::Processing,
            false,
            Some(Owed)
        ));
    }

    #[test]
    fn a_refund_is_settled_once_from_pending_and_never_changes_after() {
        let all = [
            RefundStatus::Pending,
            RefundStatus::Succeeded,
            RefundStatus::Failed,
        ];
        for from in all {
            for to in all {
                assert_eq!(
                    from.may_become(to),
                    from == RefundStatus::Pending && to != RefundStatus::Pending,
                    "{from:?} to {to:?}"
                );
            }
            assert_eq!(RefundStatus::parse(from.as_str()), Ok(from));
        }
        assert!(RefundStatus::parse("REFUNDED").is_err());
    }

    #[test]
    fn a_succeeded_attempt_never_changes_and_nothing_becomes_processing() {
        for from in [
            AttemptStatus::Processing,
            AttemptStatus::Succeeded,
            AttemptStatus::Failed,
        ] {
            assert!(!from.may_become(AttemptStatus::Processing), "{from:?}");
            assert!(!AttemptStatus::Succeeded.may_become(from), "{from:?}");
        }
        assert!(AttemptStatus::Processing.may_become(AttemptStatus::Succeeded));
        assert!(AttemptStatus::Failed.may_become(AttemptStatus::Succeeded));
    }

    #[test]
    fn every_pair_outside_the_table_is_refused() {
        for from in OrderStatus::ALL {
            for to in OrderStatus::ALL {
                assert_eq!(
                    from.transition(to).is_ok(),
                    ORDER_TRANSITIONS.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn a_timeout_keeps_the_order_processing_and_never_releases_it_by_itself() {
        // There is no edge from PAYMENT_PROCESSING back to PENDING_PAYMENT or to
        // CANCELLED: an unknown payment is resolved, not guessed.
        assert!(PaymentProcessing.transition(PendingPayment).is_err());
        assert!(PaymentProcessing.transition(Cancelled).is_err());
    }

    #[test]
    fn a_declined_order_may_be_paid_again_cancelled_or_expire() {
        assert!(PaymentFailed.accepts_a_payment_attempt());
        assert!(PendingPayment.accepts_a_payment_attempt());
        for to in [PaymentProcessing, Cancelled, Expired, Paid] {
            assert_eq!(PaymentFailed.transition(to), Ok(to));
        }
        assert!(!Paid.accepts_a_payment_attempt());
    }

    #[test]
    fn a_late_success_leads_to_paid_or_to_a_refund() {
        for from in [Expired, Cancelled, PaymentFailed] {
            assert_eq!(from.transition(Paid), Ok(Paid));
            assert_eq!(from.transition(RefundPending), Ok(RefundPending));
        }
        assert!(Refunded.transition(Paid).is_err(), "refunded is final");
    }

    #[test]
    fn an_order_agrees_only_with_the_reservations_and_payments_its_machine_produces() {
        use AttemptStatus::{Failed, Processing, Succeeded};
        use ReservationStatus::{Confirmed, Released, Reserved};
        assert!(Paid.agrees_with(Confirmed, Some(Succeeded)));
        assert!(
            PaymentFailed.agrees_with(Reserved, Some(Failed)),
            "hold kept"
        );
        assert!(Expired.agrees_with(Released, None));
        assert!(
            !Paid.agrees_with(Released, Some(Succeeded)),
            "sold but given back"
        );
        assert!(
            !Expired.agrees_with(Confirmed, Some(Succeeded)),
            "a lost update"
        );
        assert!(!PaymentProcessing.agrees_with(Reserved, None), "no attempt");
        assert!(!PendingPayment.agrees_with(Reserved, Some(Processing)));
        assert!(
            !Cancelled.agrees_with(Reserved, None),
            "cancelled but still held"
        );
        let agreeing = OrderStatus::ALL
            .into_iter()
            .flat_map(|order| {
                [Reserved, Confirmed, Released]
                    .into_iter()
                    .flat_map(move |reservation| {
                        [None, Some(Processing), Some(Succeeded), Some(Failed)]
                            .into_iter()
                            .filter(move |payment| order.agrees_with(reservation, *payment))
                    })
            })
            .count();
        assert_eq!(agreeing, 13, "the table's rows");
    }

    #[test]
    fn payment_methods_are_plain_tokens() {
        assert!(PaymentMethod::parse("pm_card_visa").is_ok());
        assert!(PaymentMethod::parse("pm card").is_err());
        assert!(PaymentMethod::parse("").is_err());
    }
}

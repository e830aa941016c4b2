//! What goes into and comes out of the order and payment units of work.

use domain::{
    AttemptStatus, Currency, OrderId, OrderStatus, PaymentAttemptId, RefundId, Reservation,
    ReservationId, ReservationLine, ShopCode, SkuCode, Timestamp, UserId, WarehouseCode,
};

use crate::catalog::SkippedLine;
use crate::model::ShopScope;

/// What the caller of a cancel may cancel: its role decides, the order's status
/// (read under the order's lock) says which applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CancelRights {
    /// An order not paid yet (its hold released): the shop's checkout and the admin.
    pub unpaid: bool,
    /// A paid order (refunded): a staff decision, the shop's operators and the admin.
    pub paid: bool,
}

/// An order to create, with the reservation that holds its stock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewOrder {
    pub id: OrderId,
    pub shop: ShopScope,
    pub user: UserId,
    pub reservation_id: ReservationId,
    pub lines: Vec<ReservationLine>,
    pub expires_at: Timestamp,
    /// Set when a checkout creates the order: the cart lines it left out.
    pub skipped: Option<Vec<SkippedLine>>,
    /// The shop's order number and the channel, when given (its reservation's).
    pub reference: domain::OrderReference,
    /// See [`crate::ReserveRequest::undecided_when_short`].
    pub undecided_when_short: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderLine {
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub quantity: i64,
    pub unit_price_minor: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentAttempt {
    pub id: PaymentAttemptId,
    pub status: AttemptStatus,
    pub gateway_key: String,
    pub gateway_payment_id: Option<String>,
    pub payment_method: String,
    pub failure_reason: Option<String>,
    pub amount_minor: i64,
    pub currency: String,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderHistoryEntry {
    pub from: Option<OrderStatus>,
    pub to: OrderStatus,
    pub reason: String,
    pub at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundRecord {
    pub id: RefundId,
    /// The attempt whose charge it returns.
    pub attempt_id: PaymentAttemptId,
    /// `PENDING`, `SUCCEEDED` or `FAILED` (the gateway refused it: a person decides).
    pub status: String,
    pub amount_minor: i64,
    pub currency: String,
    pub gateway_refund_id: Option<String>,
    pub reason: String,
    /// Why the gateway refused it, when it did (the last refusal, once sent again).
    pub failure_reason: Option<String>,
    /// What a person decided after a refusal, the last time.
    pub resolution: Option<RefundResolutionRecord>,
}

/// A person's decision on a refund the gateway refused, to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundDecision {
    pub resolution: domain::RefundResolution,
    /// Who decided: the principal's scope (`admin`, `operator:<id>`).
    pub by: String,
    /// Why, or what was done instead (a bank transfer's reference).
    pub remark: String,
}

/// A person's decision on a refused refund, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundResolutionRecord {
    pub resolution: domain::RefundResolution,
    /// The operator id, or `admin`.
    pub by: String,
    pub remark: String,
    pub at: Timestamp,
}

/// An order as a search lists it; `GET /v1/orders/{id}` has the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderSummary {
    pub id: OrderId,
    pub shop: ShopCode,
    pub user: UserId,
    pub status: OrderStatus,
    pub amount_minor: i64,
    pub currency: Currency,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

/// An order with everything that happened to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    pub id: OrderId,
    pub shop: ShopCode,
    pub user: UserId,
    pub status: OrderStatus,
    pub amount_minor: i64,
    pub currency: Currency,
    pub expires_at: Timestamp,
    pub version: i64,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub lines: Vec<OrderLine>,
    pub reservation: Reservation,
    /// Every payment attempt, oldest first: after a decline another card may be tried
    /// while the hold lasts. At most one succeeds.
    pub attempts: Vec<PaymentAttempt>,
    /// Every refund, oldest first: the order's own (cancelled after payment, or paid
    /// too late), and any of a second charge.
    pub refunds: Vec<RefundRecord>,
    /// Whether an after-sale return put the goods back in stock.
    pub returned: bool,
    pub history: Vec<OrderHistoryEntry>,
}

impl Order {
    /// The latest payment attempt, if any was made.
    pub fn attempt(&self) -> Option<&PaymentAttempt> {
        self.attempts.last()
    }

    /// The refund of the attempt that paid the order, if it has one.
    pub fn refund(&self) -> Option<&RefundRecord> {
        let paid_by = self
            .attempts
            .iter()
            .find(|attempt| attempt.status == AttemptStatus::Succeeded)?;
        self.refunds
            .iter()
            .find(|refund| refund.attempt_id == paid_by.id)
    }
}

/// A payment attempt to send to (or ask) the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptToCall {
    pub attempt_id: PaymentAttemptId,
    pub order_id: OrderId,
    pub gateway_key: String,
    pub gateway_payment_id: Option<String>,
    pub payment_method: String,
    pub amount_minor: i64,
    pub currency: String,
    /// The order's hold ends here; past it, an attempt the gateway has not completed
    /// is abandoned and the stock goes back.
    pub order_expires_at: Timestamp,
    /// When the attempt began: its gateway key was first sent then, and a gateway
    /// forgets keys after a while (Stripe: 24 hours).
    pub created_at: Timestamp,
}

/// What starting a payment found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeginPayment {
    /// The order went `PAYMENT_PROCESSING` with this new attempt, committed.
    Started(AttemptToCall),
    /// This request's attempt was already running: call about it again (same gateway
    /// key).
    InProgress(AttemptToCall),
    /// Another request's attempt is running: this one tried no card, and nothing was
    /// changed or stored. Its outcome is that other request's to learn.
    AnotherRequestRunning,
    /// Nothing to ask the gateway: the answer, stored under the request's key in the
    /// transaction that found it (and made whatever change it reports). The order's
    /// payment already had its outcome (a retry of an interrupted `pay`, or a second
    /// caller, learns it); or the order cannot be paid from its status; or its hold had
    /// ended and it is now `EXPIRED` with its stock back; or it does not exist.
    Answered(crate::model::Idempotent),
}

/// What the gateway said about an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayOutcome {
    Succeeded {
        payment_id: String,
    },
    Failed {
        payment_id: Option<String>,
        reason: String,
    },
    /// Not completed, and the order's hold ran out: give the stock back. A success
    /// arriving later is handled as a late success.
    Abandoned {
        payment_id: Option<String>,
        reason: String,
    },
}

/// A refund to send to the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundToIssue {
    pub refund_id: RefundId,
    pub order_id: OrderId,
    pub gateway_key: String,
    pub gateway_payment_id: String,
    pub amount_minor: i64,
    pub currency: String,
    /// The gateway's refund, once it answered one still `pending`: asked about, not
    /// sent again.
    pub gateway_refund_id: Option<String>,
}

/// What the metrics page shows about payments, read at scrape time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PaymentGauges {
    /// Attempts whose outcome is not known yet (`PROCESSING`).
    pub attempts_unresolved: i64,
    /// Age of the oldest unresolved attempt; 0 when there is none.
    pub oldest_unresolved_age_seconds: i64,
    /// Refunds the gateway has not confirmed yet.
    pub refunds_pending: i64,
    /// Refunds the gateway refused outright: each needs a person.
    pub refunds_failed: i64,
}

/// One step of the order expiry.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OrderExpiry {
    pub expired: Vec<OrderId>,
    /// Claimed, due, and left as they were because giving their stock back failed on
    /// its data (with why): a person's to look at; the others expired.
    pub stuck: Vec<(OrderId, String)>,
    /// Claimed, due, and left as they were because another transaction held a stock
    /// row of theirs past the lock bound: a later step expires them.
    pub deferred: Vec<OrderId>,
    /// Where the next step's claim resumes (see [`crate::ExpiryCursor`]).
    pub resume_after: Option<crate::ExpiryCursor>,
}

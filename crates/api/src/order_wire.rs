//! Wire types of orders and payments.

use domain::{PaymentMethod, Timestamp, TtlSeconds, UserId};
use serde::{Deserialize, Serialize};
use store::Order;
use utoipa::ToSchema;

use crate::wire::{ReservationBody, ReservationLineRequest};

/// `POST /v1/orders`. Each (sku, warehouse) once in `lines`, every SKU of one shop.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOrderRequest {
    #[schema(value_type = crate::openapi::schemas::UserId)]
    pub user_id: UserId,
    /// 1–50 lines, each (sku, warehouse) once, all of one shop.
    #[schema(min_items = 1, max_items = 50)]
    pub lines: Vec<ReservationLineRequest>,
    #[schema(value_type = Option<crate::openapi::schemas::TtlSeconds>)]
    pub ttl_seconds: Option<TtlSeconds>,
    /// The shop's order number: used once per shop (`order_ref_reused` otherwise).
    #[schema(value_type = Option<crate::openapi::schemas::OrderRef>)]
    pub order_ref: Option<domain::OrderRef>,
    /// The calling channel, recorded with the order.
    #[schema(value_type = Option<crate::openapi::schemas::RequestSource>)]
    pub source: Option<domain::RequestSource>,
    /// The campaign the order means to buy from (see `POST /v1/reservations`).
    #[schema(value_type = Option<crate::openapi::schemas::CampaignId>)]
    pub campaign_id: Option<domain::CampaignId>,
}

/// The answer to a checkout: the order it created and the cart lines it left out.
#[derive(Debug, Serialize, ToSchema)]
pub struct CheckedOutBody<'a> {
    #[serde(flatten)]
    pub order: OrderBody<'a>,
    pub skipped: Vec<crate::catalog_wire::SkippedLineBody<'a>>,
}

/// `POST /v1/orders/{id}/pay`: the payment method token the client got from the
/// gateway (with the sandbox, a test method such as `pm_card_visa`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PayRequest {
    #[schema(value_type = crate::openapi::schemas::PaymentMethod)]
    pub payment_method: PaymentMethod,
}

/// `POST /v1/orders/{id}/refunds/{refund_id}/resolve`: what becomes of a refund the
/// gateway refused (`FAILED`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveRefundRequest {
    pub resolution: RefundResolutionWire,
    /// Why, or what was done instead (a bank transfer's reference): 1–500 characters,
    /// not blank.
    #[schema(value_type = crate::openapi::schemas::RefundRemark)]
    pub remark: String,
}

/// A person's decision on a refund the gateway refused.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RefundResolutionWire {
    /// Owed again: the refund worker sends it as a new refund (a new gateway key; the
    /// refused one's would replay the refusal). The refund is `PENDING`, the order stays
    /// `REFUND_PENDING`.
    SendAgain,
    /// The money went back outside stockd (the gateway's dashboard, a bank transfer):
    /// the refund is `SUCCEEDED` and nothing is sent; the refund of the payment that
    /// paid makes its order `REFUNDED`.
    RefundedElsewhere,
}

impl From<RefundResolutionWire> for domain::RefundResolution {
    fn from(wire: RefundResolutionWire) -> domain::RefundResolution {
        match wire {
            RefundResolutionWire::SendAgain => domain::RefundResolution::SendAgain,
            RefundResolutionWire::RefundedElsewhere => domain::RefundResolution::RefundedElsewhere,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OrderLineBody<'a> {
    pub sku: &'a str,
    pub warehouse: &'a str,
    pub quantity: i64,
    pub unit_price: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PaymentBody<'a> {
    #[schema(value_type = crate::openapi::schemas::PaymentAttemptId)]
    pub attempt_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::AttemptStatus)]
    pub status: &'static str,
    pub payment_method: &'a str,
    pub gateway_payment_id: Option<&'a str>,
    pub failure_reason: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub updated_at: Timestamp,
}

impl<'a> PaymentBody<'a> {
    fn new(attempt: &'a store::PaymentAttempt) -> PaymentBody<'a> {
        PaymentBody {
            attempt_id: attempt.id.as_str(),
            status: attempt.status.as_str(),
            payment_method: &attempt.payment_method,
            gateway_payment_id: attempt.gateway_payment_id.as_deref(),
            failure_reason: attempt.failure_reason.as_deref(),
            created_at: attempt.created_at,
            updated_at: attempt.updated_at,
        }
    }
}

impl<'a> RefundBody<'a> {
    fn new(refund: &'a store::RefundRecord) -> RefundBody<'a> {
        RefundBody {
            refund_id: refund.id.as_str(),
            attempt_id: refund.attempt_id.as_str(),
            status: &refund.status,
            amount: refund.amount_minor,
            currency: &refund.currency,
            gateway_refund_id: refund.gateway_refund_id.as_deref(),
            reason: &refund.reason,
            failure_reason: refund.failure_reason.as_deref(),
            resolution: refund
                .resolution
                .as_ref()
                .map(|resolution| RefundResolutionBody {
                    resolution: resolution.resolution.as_str(),
                    by: &resolution.by,
                    remark: &resolution.remark,
                    at: resolution.at,
                }),
        }
    }
}

/// A person's decision on a refund the gateway had refused.
#[derive(Debug, Serialize, ToSchema)]
pub struct RefundResolutionBody<'a> {
    /// `send_again` or `refunded_elsewhere`.
    pub resolution: &'static str,
    /// Who decided: `admin` or `operator:<id>`.
    pub by: &'a str,
    pub remark: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub at: Timestamp,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RefundBody<'a> {
    #[schema(value_type = crate::openapi::schemas::RefundId)]
    pub refund_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::PaymentAttemptId)]
    pub attempt_id: &'a str,
    pub status: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    pub gateway_refund_id: Option<&'a str>,
    pub reason: &'a str,
    /// Why the gateway refused the refund (status `FAILED`; kept once it was sent
    /// again: the last refusal).
    pub failure_reason: Option<&'a str>,
    /// What a person decided after a refusal (`POST
    /// /v1/orders/{id}/refunds/{refund_id}/resolve`), the last time.
    pub resolution: Option<RefundResolutionBody<'a>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryBody<'a> {
    #[schema(value_type = Option<crate::openapi::schemas::OrderStatus>)]
    pub from: Option<&'static str>,
    #[schema(value_type = crate::openapi::schemas::OrderStatus)]
    pub to: &'static str,
    pub reason: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub at: Timestamp,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OrderBody<'a> {
    #[schema(value_type = crate::openapi::schemas::OrderId)]
    pub order_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    #[schema(value_type = crate::openapi::schemas::UserId)]
    pub user_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::OrderStatus)]
    pub status: &'static str,
    pub amount: i64,
    pub currency: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub expires_at: Timestamp,
    pub version: i64,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub updated_at: Timestamp,
    pub lines: Vec<OrderLineBody<'a>>,
    /// The shop's order number and the channel, when the request gave them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order_ref: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'a str>,
    pub reservation: ReservationBody<'a>,
    /// The latest payment attempt.
    pub payment: Option<PaymentBody<'a>>,
    /// Every payment attempt, oldest first (a declined card, then another).
    pub payment_attempts: Vec<PaymentBody<'a>>,
    /// The refund of the payment that paid the order.
    pub refund: Option<RefundBody<'a>>,
    /// Every refund, oldest first (a second charge's too).
    pub refunds: Vec<RefundBody<'a>>,
    pub returned: bool,
    /// The ledger rows the return wrote, one per line (`<order_id>.return.<line>`);
    /// empty until the order is returned.
    #[schema(value_type = Vec<crate::openapi::schemas::LedgerMovementId>)]
    pub return_movement_ids: Vec<String>,
    pub history: Vec<HistoryBody<'a>>,
}

impl<'a> OrderBody<'a> {
    pub fn new(order: &'a Order) -> OrderBody<'a> {
        OrderBody {
            order_id: order.id.as_str(),
            shop: order.shop.as_str(),
            user_id: order.user.as_str(),
            status: order.status.as_str(),
            amount: order.amount_minor,
            currency: order.currency.as_str(),
            expires_at: order.expires_at,
            version: order.version,
            created_at: order.created_at,
            updated_at: order.updated_at,
            lines: order
                .lines
                .iter()
                .map(|line| OrderLineBody {
                    sku: line.sku.as_str(),
                    warehouse: line.warehouse.as_str(),
                    quantity: line.quantity,
                    unit_price: line.unit_price_minor,
                })
                .collect(),
            order_ref: order
                .reservation
                .reference
                .order_ref
                .as_ref()
                .map(domain::OrderRef::as_str),
            source: order
                .reservation
                .reference
                .source
                .as_ref()
                .map(domain::RequestSource::as_str),
            reservation: ReservationBody::new(&order.reservation),
            payment: order.attempt().map(PaymentBody::new),
            payment_attempts: order.attempts.iter().map(PaymentBody::new).collect(),
            refund: order.refund().map(RefundBody::new),
            refunds: order.refunds.iter().map(RefundBody::new).collect(),
            returned: order.returned,
            return_movement_ids: if order.returned {
                domain::LedgerMovementId::of_return(&order.id, order.lines.len())
                    .iter()
                    .map(ToString::to_string)
                    .collect()
            } else {
                Vec::new()
            },
            history: order
                .history
                .iter()
                .map(|entry| HistoryBody {
                    from: entry.from.map(|status| status.as_str()),
                    to: entry.to.as_str(),
                    reason: &entry.reason,
                    at: entry.at,
                })
                .collect(),
        }
    }
}

/// `POST /v1/payments/webhook`: what became of the event.
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookReceiptBody {
    pub received: bool,
    /// The event id was seen before: nothing was applied again.
    pub duplicate: bool,
    /// What the event did.
    pub outcome: String,
}

/// An order as `GET /v1/orders` lists it; `GET /v1/orders/{id}` has the rest.
#[derive(Debug, Serialize, ToSchema)]
pub struct OrderSummaryBody<'a> {
    #[schema(value_type = crate::openapi::schemas::OrderId)]
    pub order_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    #[schema(value_type = crate::openapi::schemas::UserId)]
    pub user_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::OrderStatus)]
    pub status: &'static str,
    pub amount: i64,
    pub currency: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub updated_at: Timestamp,
}

impl<'a> OrderSummaryBody<'a> {
    pub fn new(order: &'a store::OrderSummary) -> OrderSummaryBody<'a> {
        OrderSummaryBody {
            order_id: order.id.as_str(),
            shop: order.shop.as_str(),
            user_id: order.user.as_str(),
            status: order.status.as_str(),
            amount: order.amount_minor,
            currency: order.currency.as_str(),
            created_at: order.created_at,
            updated_at: order.updated_at,
        }
    }
}

/// `GET /v1/orders`: a page, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct OrdersPageBody<'a> {
    pub orders: Vec<OrderSummaryBody<'a>>,
    /// The `before` of the next page (`null` when this page is the last).
    #[schema(value_type = Option<crate::openapi::schemas::OrderId>)]
    pub next_before: Option<&'a str>,
}

//! Handlers of orders, payments and the gateway's webhooks.

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use domain::OrderId;

use crate::AppState;
use crate::consistency::{DisplayRead, displayed_response};
use crate::extract::{Caller, JsonBody, Path, RequiredIdempotencyKey, RequiredJsonBody};
use crate::order_wire::{CreateOrderRequest, OrderBody, PayRequest};
use crate::problem::ApiError;
use crate::routes::reply_response;
use crate::wire::{EmptyRequest, ReservationLineRequest};

fn parse_order_id(text: &str) -> Result<OrderId, ApiError> {
    OrderId::parse(text).map_err(|error| ApiError::invalid(error.0))
}

/// Create an order and its reservation
///
/// Priced from the SKUs, `PENDING_PAYMENT`, its stock held until `expires_at`. A line of a running campaign's SKU draws from the campaign; with `Prefer: respond-async` a busy campaign answers 202 with a ticket to poll.
#[utoipa::path(
    post,
    path = "/v1/orders",
    tag = "orders",
    params(
        ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again."),
        ("Prefer" = Option<String>, Header, description = "`respond-async`: while a running campaign's waiting room is busy, answer 202 with a ticket instead of waiting with the connection open."),
    ),
    request_body = crate::order_wire::CreateOrderRequest,
    responses(
        (status = 201, description = "Created", body = crate::order_wire::OrderBody),
        (status = 202, description = "Waiting in a campaign's line: poll the ticket (Location)", body = crate::wire::TicketBody, headers(("Location" = String, description = "The ticket's URL."), ("Preference-Applied" = String, description = "`respond-async`."))),
    )
)]
pub async fn create_order(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    prefer: crate::routes::PreferRespondAsync,
    RequiredJsonBody(body): RequiredJsonBody<CreateOrderRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let lines = request
        .lines
        .into_iter()
        .map(ReservationLineRequest::into_line)
        .collect();
    Ok(crate::routes::held_response(
        state
            .engine
            .create_order(
                &caller,
                &claim,
                request.user_id,
                engine::HoldRequest {
                    lines,
                    ttl: request.ttl_seconds,
                    reference: domain::OrderReference {
                        order_ref: request.order_ref,
                        source: request.source,
                    },
                    campaign: request.campaign_id,
                    respond_async: prefer.0,
                },
            )
            .await?,
    ))
}

/// An order: status, lines, reservation, payment attempts, refunds, history
#[utoipa::path(
    get,
    path = "/v1/orders/{id}",
    tag = "orders",
    params(("id" = crate::openapi::schemas::OrderId, Path, description = "The order."), ("Stockd-Consistency-Token" = Option<crate::openapi::schemas::ConsistencyToken>, Header, description = "A write's Stockd-Consistency-Token: the read is served only from data that includes that write.")),
    responses((status = 200, description = "The order", body = crate::order_wire::OrderBody))
)]
pub async fn get_order(
    State(state): State<AppState>,
    Caller(caller): Caller,
    DisplayRead(reader): DisplayRead,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_order_id(&id)?;
    let order = state.engine.order_for(&caller, &id, &reader).await?;
    Ok(displayed_response(&order, OrderBody::new(&order.value)))
}

/// Pay an order
///
/// `PAID` (stock confirmed) or `PAYMENT_FAILED` (declined: the hold is kept; another card may be tried with a new key). 202 `payment_unknown` when the gateway did not answer in time: nothing is released until the outcome is known.
#[utoipa::path(
    post,
    path = "/v1/orders/{id}/pay",
    tag = "orders",
    params(("id" = crate::openapi::schemas::OrderId, Path, description = "The order."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::order_wire::PayRequest,
    responses((status = 200, description = "Paid or declined", body = crate::order_wire::OrderBody))
)]
pub async fn pay(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<PayRequest>,
) -> Result<Response, ApiError> {
    let id = parse_order_id(&id)?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .pay(&caller, &claim, &id, &body.value.payment_method)
            .await?,
    ))
}

/// Cancel an order
///
/// Unpaid (the shop's checkout or the admin; an operator is refused 403 and nothing is stored): `CANCELLED`, stock released. Paid (a staff decision: admin or operator; a service key is refused 403): `REFUND_PENDING`, refunded by the refund worker.
#[utoipa::path(
    post,
    path = "/v1/orders/{id}/cancel",
    tag = "orders",
    params(("id" = crate::openapi::schemas::OrderId, Path, description = "The order."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Cancelled", body = crate::order_wire::OrderBody))
)]
pub async fn cancel(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    let id = parse_order_id(&id)?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state.engine.cancel_order(&caller, &claim, &id).await?,
    ))
}

/// Take an after-sale return back into available stock, once
#[utoipa::path(
    post,
    path = "/v1/orders/{id}/return",
    tag = "orders",
    params(("id" = crate::openapi::schemas::OrderId, Path, description = "The order."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Returned", body = crate::order_wire::OrderBody))
)]
pub async fn return_goods(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    let id = parse_order_id(&id)?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state.engine.return_order(&caller, &claim, &id).await?,
    ))
}

/// Resolve a refund the gateway refused
///
/// A staff decision (admin or operator; a service key is refused 403) on a refund marked `FAILED`: `send_again` makes it owed again, sent by the refund worker as a new refund; `refunded_elsewhere` records the money as gone back outside stockd, and the refund of the payment that paid makes the order `REFUNDED`. Who decided, what and the remark are kept with the refund. A refund that is not `FAILED` is refused (409 `illegal_transition`) and nothing changes.
#[utoipa::path(
    post,
    path = "/v1/orders/{id}/refunds/{refund_id}/resolve",
    tag = "orders",
    params(("id" = crate::openapi::schemas::OrderId, Path, description = "The order."), ("refund_id" = crate::openapi::schemas::RefundId, Path, description = "One of the order's refunds."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::order_wire::ResolveRefundRequest,
    responses((status = 200, description = "Resolved", body = crate::order_wire::OrderBody))
)]
pub async fn resolve_refund(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path((id, refund)): Path<(String, String)>,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<crate::order_wire::ResolveRefundRequest>,
) -> Result<Response, ApiError> {
    let id = parse_order_id(&id)?;
    let refund = domain::RefundId::parse(&refund).map_err(|error| ApiError::invalid(error.0))?;
    let claim = body.claim(&caller, key);
    let request = body.value;
    let remark = refund_remark(request.remark)?;
    Ok(reply_response(
        state
            .engine
            .resolve_refund(
                &caller,
                &claim,
                &id,
                &refund,
                request.resolution.into(),
                &remark,
            )
            .await?,
    ))
}

/// A resolution's remark (`RefundRemark` in the OpenAPI document): at most 500
/// characters without control characters or line separators, and not blank.
pub(crate) fn refund_remark(remark: String) -> Result<String, ApiError> {
    let remark = crate::catalog_routes::bounded_text(
        "remark",
        Some(remark),
        domain::limits::REMARK_LENGTH_MAX,
    )?;
    if remark.trim().is_empty() {
        return Err(ApiError::invalid(
            "remark must say why, or what was done instead",
        ));
    }
    Ok(remark)
}

// Webhooks carry no Idempotency-Key: the gateway's event id is the key, and the
// signature (with its timestamp) is the credential.
/// The payment gateway's signed events
///
/// Applied only for intents stockd created; the event id is the idempotency key.
#[utoipa::path(
    post,
    path = "/v1/payments/webhook",
    tag = "orders",
    params(("Stripe-Signature" = String, Header, description = "t=<unix seconds>,v1=<HMAC-SHA256 of t.body with the webhook secret>")),
    request_body(content = Object, description = "The gateway's event.", content_type = "application/json"),
    responses((status = 200, description = "Received", body = crate::order_wire::WebhookReceiptBody))
)]
pub async fn webhook(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    // Not the `Bytes` extractor: it would buffer up to its own, larger default first.
    let body = crate::extract::read_body(body, &state).await?;
    let signature = headers
        .get(gateway_signature_header())
        .and_then(|value| value.to_str().ok());
    let receipt = state.engine.handle_webhook(&body, signature).await?;
    Ok(Json(crate::order_wire::WebhookReceiptBody {
        received: true,
        duplicate: receipt.duplicate,
        outcome: receipt.outcome,
    })
    .into_response())
}

fn gateway_signature_header() -> &'static str {
    "stripe-signature"
}

/// Orders, newest first
///
/// The caller's shop's (the admin's: every shop's, or `shop`'s), of one shopper when `user_id` is given. Each order in full is `GET /v1/orders/{id}`.
#[utoipa::path(
    get,
    path = "/v1/orders",
    tag = "orders",
    params(
        ("user_id" = Option<crate::openapi::schemas::UserId>, Query, description = "Only this shopper's."),
        ("shop" = Option<crate::openapi::schemas::ShopCode>, Query, description = "Only this shop's (a shop's credential: its own anyway)."),
        ("before" = Option<crate::openapi::schemas::OrderId>, Query, description = "The previous page's next_before."),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 200, description = "Orders per page (50 when absent).")
    ),
    responses((status = 200, description = "A page of orders", body = crate::order_wire::OrdersPageBody))
)]
pub async fn list_orders(
    State(state): State<AppState>,
    Caller(caller): Caller,
    mut query: crate::extract::QueryParameters,
) -> Result<Response, ApiError> {
    let user = query.take("user_id", domain::UserId::parse)?;
    let shop = query.take("shop", domain::ShopCode::parse)?;
    let before = query.take("before", domain::OrderId::parse)?;
    let limit = query.limit(
        domain::limits::LIST_PAGE_SIZE_DEFAULT,
        domain::limits::LIST_PAGE_SIZE_MAX,
    )?;
    query.finish()?;
    let orders = state
        .engine
        .order_summaries(
            &caller,
            shop.as_ref(),
            user.as_ref(),
            before.as_ref(),
            limit,
        )
        .await?;
    let full = i64::try_from(orders.len()).unwrap_or(i64::MAX) == limit;
    let body = crate::order_wire::OrdersPageBody {
        orders: orders
            .iter()
            .map(crate::order_wire::OrderSummaryBody::new)
            .collect(),
        next_before: orders
            .last()
            .filter(|_| full)
            .map(|order| order.id.as_str()),
    };
    Ok(Json(body).into_response())
}

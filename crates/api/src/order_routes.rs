//! Handlers of orders, payments and the gateway's webhooks.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use domain::OrderId;

use crate::AppState;
use crate::consistency::{DisplayRead, displayed_response};
use crate::extract::{Caller, JsonBody, RequiredIdempotencyKey, RequiredJsonBody};
use crate::order_wire::{CreateOrderRequest, OrderBody, PayRequest};
use crate::problem::ApiError;
use crate::routes::reply_response;
use crate::wire::{EmptyRequest, ReservationLineRequest};

fn parse_order_id(text: &str) -> Result<OrderId, ApiError> {
    OrderId::parse(text).map_err(|error| ApiError::invalid(error.0))
}

pub async fn create_order(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CreateOrderRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let lines = request
        .lines
        .into_iter()
        .map(ReservationLineRequest::into_line)
        .collect();
    Ok(reply_response(
        state
            .engine
            .create_order(
                &caller,
                &claim,
                request.user_id,
                lines,
                request.ttl_seconds,
                domain::OrderReference {
                    order_ref: request.order_ref,
                    source: request.source,
                },
            )
            .await?,
    ))
}

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

/// After-sale return (staff): the goods go back to stock, once.
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

/// Webhooks carry no Idempotency-Key: the gateway's event id is the key, and the
/// signature (with its timestamp) is the credential.
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
    Ok(Json(serde_json::json!({"received": true, "duplicate": receipt.duplicate, "outcome": receipt.outcome}))
        .into_response())
}

fn gateway_signature_header() -> &'static str {
    "stripe-signature"
}

//! Handlers: parse, call the engine, answer. No business rules live here.

use axum::Json;
use std::collections::HashMap;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use domain::{ErrorCode, FeedCursor, Quantity, ReservationId, ServiceKeyId, ShopCode, SkuCode};
use engine::Reply;
use store::{MovementQuantity, ReservationAction, SkuChanges};

use crate::AppState;
use crate::consistency::{DisplayRead, displayed_response};
use crate::extract::{Caller, JsonBody, RequiredIdempotencyKey, RequiredJsonBody};
use crate::problem::{ApiError, OutcomeCode, PROBLEM_CONTENT_TYPE};
use crate::wire::{
    AuditBody, CreateReservationRequest, CreateServiceKeyRequest, EmptyRequest, LedgerMovementBody,
    MovementKindWire, MovementRequest, ReservationBody, ReservationLineRequest, SaveSkuRequest,
    ServiceKeyBody, SkuBody, code_of_problem,
};

/// Writes a stored (or freshly stored) response exactly as it was first sent.
pub fn reply_response(reply: Reply) -> Response {
    let status =
        StatusCode::from_u16(reply.response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let outcome = (status.is_client_error() || status.is_server_error())
        .then(|| code_of_problem(&reply.response.body))
        .flatten();
    let mut response = (status, reply.response.body).into_response();
    let content_type = if outcome.is_some() {
        PROBLEM_CONTENT_TYPE
    } else {
        "application/json"
    };
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if reply.replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    if let Some(code) = outcome {
        response.extensions_mut().insert(OutcomeCode(code));
    }
    if let Some(token) = reply.consistency_token {
        crate::consistency::stamp(&mut response, token);
    }
    response
}

fn parse_sku(text: &str) -> Result<SkuCode, ApiError> {
    SkuCode::parse(text).map_err(|error| ApiError::invalid(error.0))
}

fn parse_reservation_id(text: &str) -> Result<ReservationId, ApiError> {
    ReservationId::parse(text).map_err(|error| ApiError::invalid(error.0))
}

pub async fn save_sku(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(sku): Path<String>,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<SaveSkuRequest>,
) -> Result<Response, ApiError> {
    let code = parse_sku(&sku)?;
    let claim = body.claim(&caller, key);
    let request = body.value;
    let changes = SkuChanges {
        title: request.title.map(String::from),
        price: request.price,
        currency: request.currency,
        low_stock_threshold: request
            .low_stock_threshold
            .map(domain::LowStockThreshold::get),
        shop: request.shop,
        per_user_limit: request
            .per_user_limit
            .map(|limit| limit.map(domain::PerUserLimit::get)),
    };
    Ok(reply_response(
        state
            .engine
            .save_sku(&caller, &claim, &code, &changes)
            .await?,
    ))
}

pub async fn get_sku(
    State(state): State<AppState>,
    Caller(caller): Caller,
    DisplayRead(reader): DisplayRead,
    Path(sku): Path<String>,
) -> Result<Response, ApiError> {
    let code = parse_sku(&sku)?;
    let sku = state.engine.sku(&caller, &code, &reader).await?;
    Ok(displayed_response(&sku, SkuBody::new(&sku.value)))
}

pub async fn record_movement(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(sku): Path<String>,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<MovementRequest>,
) -> Result<Response, ApiError> {
    let code = parse_sku(&sku)?;
    let claim = body.claim(&caller, key);
    let request = body.value;
    let quantity = match request.kind {
        MovementKindWire::Receive => {
            MovementQuantity::Receive(Quantity::new(request.quantity.get()).map_err(|_| {
                ApiError::invalid("quantity: a receive takes an integer between 1 and 1000000")
            })?)
        }
        MovementKindWire::Adjust => MovementQuantity::Adjust(request.quantity),
    };
    let reply = state
        .engine
        .record_movement(&caller, &claim, code, request.warehouse, quantity)
        .await?;
    Ok(reply_response(reply))
}

pub async fn create_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CreateReservationRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        reserve(&state, &caller, &claim, body.value).await?,
    ))
}

/// A reservation request run by the engine: the HTTP route's, and the queue intake's
/// (`crate::intake`), which must behave alike.
pub(crate) async fn reserve(
    state: &AppState,
    caller: &domain::Principal,
    claim: &store::IdempotencyClaim,
    request: CreateReservationRequest,
) -> Result<Reply, ApiError> {
    let lines = request
        .lines
        .into_iter()
        .map(ReservationLineRequest::into_line)
        .collect();
    Ok(state
        .engine
        .reserve(
            caller,
            claim,
            lines,
            request.ttl_seconds,
            request.user_id,
            domain::OrderReference {
                order_ref: request.order_ref,
                source: request.source,
            },
        )
        .await?)
}

pub async fn get_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_reservation_id(&id)?;
    let reservation = state.engine.reservation(&caller, &id).await?;
    Ok(Json(ReservationBody::new(&reservation)).into_response())
}

pub async fn get_stock_movement(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = domain::LedgerMovementId::parse(&id).map_err(|error| ApiError::invalid(error.0))?;
    let movement = state.engine.ledger_movement(&caller, &id).await?;
    Ok(Json(LedgerMovementBody::new(&movement)).into_response())
}

async fn change_reservation(
    state: AppState,
    caller: std::sync::Arc<domain::Principal>,
    id: String,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
    action: ReservationAction,
) -> Result<Response, ApiError> {
    let id = parse_reservation_id(&id)?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .change_reservation(&caller, &claim, &id, action)
            .await?,
    ))
}

pub async fn confirm_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    change_reservation(state, caller, id, key, body, ReservationAction::Confirm).await
}

pub async fn release_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    change_reservation(state, caller, id, key, body, ReservationAction::Release).await
}

pub async fn audit(
    State(state): State<AppState>,
    Caller(caller): Caller,
) -> Result<Response, ApiError> {
    let report = state.engine.audit(&caller).await?;
    Ok(Json(AuditBody::new(&report)).into_response())
}

/// `POST /v1/admin/service-keys` (admin): the secret is in this answer only.
pub async fn create_service_key(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CreateServiceKeyRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let name = request.name.trim();
    if name.is_empty()
        || name.chars().count() > domain::limits::SERVICE_KEY_NAME_LENGTH_MAX
        || name.chars().any(char::is_control)
    {
        return Err(ApiError::invalid(format!(
            "name must be 1 to {} characters without control characters",
            domain::limits::SERVICE_KEY_NAME_LENGTH_MAX
        )));
    }
    Ok(reply_response(
        state
            .engine
            .create_service_key(&caller, &claim, &request.shop, name)
            .await?,
    ))
}

/// `GET /v1/admin/service-keys` (admin): every key, newest first, never a secret.
pub async fn service_keys(
    State(state): State<AppState>,
    Caller(caller): Caller,
) -> Result<Response, ApiError> {
    let keys = state.engine.service_keys(&caller).await?;
    let bodies: Vec<ServiceKeyBody<'_>> = keys
        .iter()
        .map(|key| ServiceKeyBody::new(key, None))
        .collect();
    Ok(Json(serde_json::json!({"service_keys": bodies})).into_response())
}

/// `DELETE /v1/admin/service-keys/{key_id}` (admin).
pub async fn revoke_service_key(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(key_id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    let key_id = ServiceKeyId::parse(&key_id).map_err(|error| ApiError::invalid(error.0))?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .revoke_service_key(&caller, &claim, &key_id)
            .await?,
    ))
}

pub async fn healthz() -> Response {
    Json(serde_json::json!({"status": "ok"})).into_response()
}

pub async fn readyz(State(state): State<AppState>) -> Response {
    let ping = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        state.engine.store().ping(),
    )
    .await;
    match ping {
        Ok(Ok(())) => Json(
            serde_json::json!({"status": "ready", "database": state.engine.store().backend_name()}),
        )
        .into_response(),
        // The reason goes to the log only: it can name hosts, users and paths.
        Ok(Err(error)) => {
            tracing::warn!(error = %domain::redact_urls_in(&error.to_string()), "readiness check failed");
            ApiError::new(ErrorCode::Unavailable, "the database is unreachable").into_response()
        }
        Err(_) => ApiError::new(
            ErrorCode::Unavailable,
            "database did not answer within 2 seconds",
        )
        .into_response(),
    }
}

pub async fn openapi() -> Response {
    let mut response = crate::OPENAPI_DOCUMENT.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

pub async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint; see /openapi.json")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::invalid("method not allowed on this endpoint")
        .with_status(StatusCode::METHOD_NOT_ALLOWED)
}

/// `GET /v1/events?after=CURSOR&limit=N[&shop=S]`: the outbox's events in commit
/// order, the caller's shop's (the admin's: every shop's, or the one it names). Pass
/// `next_cursor` as `after` for the next page; an empty page keeps the cursor.
pub async fn events(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(parameters) = query.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    let mut cursor = FeedCursor::START;
    let mut limit = EVENTS_PAGE_SIZE_DEFAULT;
    let mut shop = None;
    for (name, value) in &parameters {
        match name.as_str() {
            "after" => {
                cursor = FeedCursor::parse(value).map_err(|error| ApiError::invalid(error.0))?
            }
            "limit" => {
                limit = value
                    .parse::<i64>()
                    .ok()
                    .filter(|limit| (1..=store::EVENTS_PER_STEP_MAX).contains(limit))
                    .ok_or_else(|| {
                        ApiError::invalid(format!(
                            "limit must be 1 to {}",
                            store::EVENTS_PER_STEP_MAX
                        ))
                    })?;
            }
            "shop" => {
                shop = Some(ShopCode::parse(value).map_err(|error| ApiError::invalid(error.0))?);
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter '{other}'"
                )));
            }
        }
    }
    let page = state
        .engine
        .events_page(&caller, shop.as_ref(), cursor, limit)
        .await?;
    let events: Vec<serde_json::Value> = page.events.iter().map(|event| event.body()).collect();
    Ok(Json(serde_json::json!({
        "events": events,
        "next_cursor": page.next_cursor.to_string(),
    }))
    .into_response())
}

/// Events per feed page when the caller names no `limit`.
const EVENTS_PAGE_SIZE_DEFAULT: i64 = 100;

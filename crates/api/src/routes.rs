//! Handlers: parse, call the engine, answer. No business rules live here.

use axum::Json;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use domain::{ErrorCode, FeedCursor, Quantity, ReservationId, ServiceKeyId, ShopCode, SkuCode};
use engine::Reply;
use store::{MovementQuantity, ReservationAction, SkuChanges};

use crate::AppState;
use crate::consistency::{DisplayRead, displayed_response};
use crate::extract::{Caller, JsonBody, Path, RequiredIdempotencyKey, RequiredJsonBody};
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

/// Create a SKU, or change the fields given
///
/// A new SKU belongs to `shop` (the caller's by default); a SKU's shop never changes. `per_user_limit: null` removes the limit.
#[utoipa::path(
    put,
    path = "/v1/skus/{sku}",
    tag = "stock",
    params(("sku" = crate::openapi::schemas::SkuCode, Path, description = "The SKU's code."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::wire::SaveSkuRequest,
    responses((status = 200, description = "Changed", body = crate::wire::SkuBody), (status = 201, description = "Created", body = crate::wire::SkuBody))
)]
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
        expected_version: request.expected_version.map(domain::Version::get),
    };
    Ok(reply_response(
        state
            .engine
            .save_sku(&caller, &claim, &code, &changes)
            .await?,
    ))
}

/// A SKU with its counters
///
/// Totals over warehouses and each warehouse's `available`, `reserved` and `on_hand`. A display read.
#[utoipa::path(
    get,
    path = "/v1/skus/{sku}",
    tag = "stock",
    params(("sku" = crate::openapi::schemas::SkuCode, Path, description = "The SKU's code."), ("Stockd-Consistency-Token" = Option<crate::openapi::schemas::ConsistencyToken>, Header, description = "A write's Stockd-Consistency-Token: the read is served only from data that includes that write.")),
    responses((status = 200, description = "The SKU", body = crate::wire::SkuBody))
)]
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

/// Receive or adjust stock
///
/// `receive` adds 1..1000000 units; `adjust` corrects available stock by a non-zero ±1000000 (never below zero). Each writes one ledger row, named by the answer's `movement_id`.
#[utoipa::path(
    post,
    path = "/v1/skus/{sku}/stock-movements",
    tag = "stock",
    params(("sku" = crate::openapi::schemas::SkuCode, Path, description = "The SKU's code."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::wire::MovementRequest,
    responses((status = 201, description = "Recorded", body = crate::wire::MovementBody))
)]
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

/// Reserve stock
///
/// 1–50 lines of one shop, all or nothing. Held until `expires_at`, then released by the expiry worker unless confirmed. A refusal (`insufficient_stock`, …) is the key's answer from then on. A line of a running campaign's SKU draws from the campaign; when the campaign's waiting room is busy, a caller that sends `Prefer: respond-async` gets a ticket (202) to poll instead of holding its connection.
#[utoipa::path(
    post,
    path = "/v1/reservations",
    tag = "reservations",
    params(
        ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again."),
        ("Prefer" = Option<String>, Header, description = "`respond-async`: while a running campaign's waiting room is busy, answer 202 with a ticket instead of waiting with the connection open."),
    ),
    request_body = crate::wire::CreateReservationRequest,
    responses(
        (status = 201, description = "Reserved", body = crate::wire::ReservationBody),
        (status = 202, description = "Waiting in a campaign's line: poll the ticket (Location)", body = crate::wire::TicketBody, headers(("Location" = String, description = "The ticket's URL."), ("Preference-Applied" = String, description = "`respond-async`."))),
    )
)]
pub async fn create_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    prefer: PreferRespondAsync,
    RequiredJsonBody(body): RequiredJsonBody<CreateReservationRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    Ok(held_response(
        reserve(&state, &caller, &claim, body.value, prefer.0).await?,
    ))
}

/// A reservation request run by the engine: the HTTP route's, and the queue intake's
/// (`crate::intake`), which must behave alike.
pub(crate) async fn reserve(
    state: &AppState,
    caller: &domain::Principal,
    claim: &store::IdempotencyClaim,
    request: CreateReservationRequest,
    respond_async: bool,
) -> Result<engine::Held, ApiError> {
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
            engine::HoldRequest {
                lines,
                ttl: request.ttl_seconds,
                reference: domain::OrderReference {
                    order_ref: request.order_ref,
                    source: request.source,
                },
                campaign: request.campaign_id,
                respond_async,
            },
            request.user_id,
        )
        .await?)
}

/// Whether the caller sent `Prefer: respond-async` (RFC 7240): it would rather poll a
/// ticket than hold its connection while a campaign's line is long.
#[derive(Debug, Clone, Copy)]
pub struct PreferRespondAsync(pub bool);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PreferRespondAsync {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<PreferRespondAsync, Self::Rejection> {
        let asked = parts
            .headers
            .get_all("prefer")
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .filter_map(|preference| preference.split(';').next())
            .any(|token| token.trim().eq_ignore_ascii_case("respond-async"));
        Ok(PreferRespondAsync(asked))
    }
}

/// The answer to a request that may have been given a ticket: the answer itself, or
/// 202 with the ticket and its URL.
pub fn held_response(held: engine::Held) -> Response {
    match held {
        engine::Held::Answered(reply) => reply_response(reply),
        engine::Held::Waiting(ticket) => ticket_response(StatusCode::ACCEPTED, ticket),
    }
}

fn ticket_response(status: StatusCode, ticket: engine::TicketView) -> Response {
    let waiting = matches!(ticket.state, engine::TicketState::Waiting { .. });
    let body = crate::wire::TicketBody::new(ticket);
    let location = HeaderValue::from_str(&body.poll).ok();
    let mut response = (status, Json(body)).into_response();
    if waiting {
        let headers = response.headers_mut();
        if let Some(location) = location {
            headers.insert(header::LOCATION, location);
        }
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        // Nothing was written yet: a position read now would be before the request's
        // commit, and a read waiting for it could miss what the ticket's answer says.
        response
            .extensions_mut()
            .insert(crate::problem::AnsweredWithoutAWrite);
        let headers = response.headers_mut();
        if status == StatusCode::ACCEPTED {
            headers.insert(
                "preference-applied",
                HeaderValue::from_static("respond-async"),
            );
        }
    }
    response
}

/// A ticket of a campaign's waiting room
///
/// Only the caller that was given the ticket sees it, and only on the instance that issued it (a ticket unknown here answers 404: retry the request with its Idempotency-Key). `WAITING` with its position (202, `Retry-After` suggests when to poll again), then `ANSWERED` with the request's answer (200), the same on every poll: the request runs once.
#[utoipa::path(
    get,
    path = "/v1/tickets/{ticket_id}",
    tag = "reservations",
    params(("ticket_id" = crate::openapi::schemas::TicketId, Path, description = "The ticket.")),
    responses(
        (status = 200, description = "Answered: the request's answer is in `answer`", body = crate::wire::TicketBody),
        (status = 202, description = "Still waiting", body = crate::wire::TicketBody, headers(("Retry-After" = u32, description = "Seconds until polling again is worth it."))),
    )
)]
pub async fn get_ticket(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(ticket_id): Path<String>,
) -> Result<Response, ApiError> {
    let id = domain::TicketId::parse(&ticket_id).map_err(|error| ApiError::invalid(error.0))?;
    let ticket = state.engine.ticket(&caller, &id)?;
    let (status, answered_token) = match &ticket.state {
        engine::TicketState::Waiting { .. } => (StatusCode::ACCEPTED, None),
        engine::TicketState::Answered(Ok(reply)) => (StatusCode::OK, Some(reply.consistency_token)),
        engine::TicketState::Answered(Err(_)) => (StatusCode::OK, None),
    };
    let mut response = ticket_response(status, ticket);
    // The request's writes, for a read that must see them (the 202 that handed the
    // ticket out carries none: the request had not run). The position its batch read
    // with the commit, or one read now, after the answer was made.
    let token = match answered_token {
        Some(Some(token)) => Some(token),
        Some(None) => state.engine.consistency_token().await,
        None => None,
    };
    if let Some(token) = token {
        crate::consistency::stamp(&mut response, token);
    }
    Ok(response)
}

/// A reservation
#[utoipa::path(
    get,
    path = "/v1/reservations/{id}",
    tag = "reservations",
    params(("id" = crate::openapi::schemas::ReservationId, Path, description = "The reservation.")),
    responses((status = 200, description = "The reservation", body = crate::wire::ReservationBody))
)]
pub async fn get_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_reservation_id(&id)?;
    let reservation = state.engine.reservation(&caller, &id).await?;
    Ok(Json(ReservationBody::new(&reservation)).into_response())
}

/// One ledger row, by the movement id an answer carried
#[utoipa::path(
    get,
    path = "/v1/stock-movements/{movement_id}",
    tag = "stock",
    params(("movement_id" = crate::openapi::schemas::LedgerMovementId, Path, description = "A movement id from an answer.")),
    responses((status = 200, description = "The ledger row", body = crate::wire::LedgerMovementBody))
)]
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

/// Confirm a reservation: its stock is consumed
///
/// Refused (`illegal_transition`) on a reservation held by an order: only the order's flow moves it.
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/confirm",
    tag = "reservations",
    params(("id" = crate::openapi::schemas::ReservationId, Path, description = "The reservation."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Confirmed (or already confirmed by this key)", body = crate::wire::ReservationBody))
)]
pub async fn confirm_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    change_reservation(state, caller, id, key, body, ReservationAction::Confirm).await
}

/// Release a reservation: its stock goes back
///
/// Refused (`illegal_transition`) on a reservation held by an order.
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/release",
    tag = "reservations",
    params(("id" = crate::openapi::schemas::ReservationId, Path, description = "The reservation."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Released", body = crate::wire::ReservationBody))
)]
pub async fn release_reservation(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    change_reservation(state, caller, id, key, body, ReservationAction::Release).await
}

/// The three-way audit
///
/// Replays the ledger against the counters and the reservations, and checks every order against its reservation and payment. An operator sees its shop's differences.
#[utoipa::path(
    get,
    path = "/v1/audit",
    tag = "operations",
    responses((status = 200, description = "The audit", body = crate::wire::AuditBody))
)]
pub async fn audit(
    State(state): State<AppState>,
    Caller(caller): Caller,
) -> Result<Response, ApiError> {
    let report = state.engine.audit(&caller).await?;
    Ok(Json(AuditBody::new(&report)).into_response())
}

/// Create a service key for one shop's checkout backend
///
/// The secret is in this answer only; stockd keeps its hash.
#[utoipa::path(
    post,
    path = "/v1/admin/service-keys",
    tag = "credentials",
    params(("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::wire::CreateServiceKeyRequest,
    responses((status = 201, description = "Created", body = crate::wire::ServiceKeyBody))
)]
pub async fn create_service_key(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CreateServiceKeyRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let name = crate::wire::service_key_name(&request.name).map_err(ApiError::invalid)?;
    Ok(reply_response(
        state
            .engine
            .create_service_key(&caller, &claim, &request.shop, name)
            .await?,
    ))
}

/// Every service key, newest first (never a secret)
#[utoipa::path(
    get,
    path = "/v1/admin/service-keys",
    tag = "credentials",
    responses((status = 200, description = "The keys", body = crate::wire::ServiceKeysBody))
)]
pub async fn service_keys(
    State(state): State<AppState>,
    Caller(caller): Caller,
) -> Result<Response, ApiError> {
    let keys = state.engine.service_keys(&caller).await?;
    let body = crate::wire::ServiceKeysBody {
        service_keys: keys
            .iter()
            .map(|key| ServiceKeyBody::new(key, None))
            .collect(),
    };
    Ok(Json(body).into_response())
}

/// Revoke a service key
///
/// Refused at once on this instance, within the credential cache bound on the others.
#[utoipa::path(
    delete,
    path = "/v1/admin/service-keys/{key_id}",
    tag = "credentials",
    params(("key_id" = crate::openapi::schemas::ServiceKeyId, Path, description = "The key."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Revoked", body = crate::wire::ServiceKeyBody))
)]
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

/// Liveness
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "Alive", body = crate::wire::HealthBody))
)]
pub async fn healthz() -> Response {
    Json(crate::wire::HealthBody { status: "ok" }).into_response()
}

/// Readiness: the database answers
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses((status = 200, description = "Ready", body = crate::wire::ReadyBody))
)]
pub async fn readyz(State(state): State<AppState>) -> Response {
    let ping = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        state.engine.store().ping(),
    )
    .await;
    match ping {
        Ok(Ok(())) => Json(crate::wire::ReadyBody {
            status: "ready",
            database: state.engine.store().backend_name(),
        })
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

/// This document
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI document", body = Object, content_type = "application/json"))
)]
pub async fn openapi() -> Response {
    let mut response = crate::openapi::DOCUMENT.as_str().into_response();
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

/// The outbox's events in commit order
///
/// The caller's shop's (the admin's: every shop's, or `shop`'s). Start at `after=0` and pass each page's `next_cursor` on; a page that is not full moves the cursor to the newest numbered event (an empty page at the head keeps it). A cursor older than the oldest kept event, or past the newest, is answered 404 `not_found`.
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "operations",
    params(("after" = Option<crate::openapi::schemas::FeedCursor>, Query, description = "An earlier page's next_cursor (0: the start)."), ("limit" = Option<i64>, Query, minimum = 1, maximum = 1000, description = "Events per page (100 when absent)."), ("shop" = Option<crate::openapi::schemas::ShopCode>, Query, description = "The admin's choice of one shop.")),
    responses((status = 200, description = "A page of events", body = crate::wire::EventsPageBody))
)]
pub async fn events(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(pairs) = query.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    let parameters = crate::extract::unique_parameters(pairs)?;
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
    Ok(Json(crate::wire::EventsPageBody {
        events: page.events.iter().map(|event| event.body()).collect(),
        next_cursor: page.next_cursor.to_string(),
    })
    .into_response())
}

/// Events per feed page when the caller names no `limit`.
const EVENTS_PAGE_SIZE_DEFAULT: i64 = 100;

/// Who this credential is: its role and shop
///
/// What the console asks first, to show each person what they may do.
#[utoipa::path(
    get,
    path = "/v1/me",
    tag = "credentials",
    responses((status = 200, description = "The caller", body = crate::wire::WhoAmIBody))
)]
pub async fn who_am_i(Caller(caller): Caller) -> Response {
    Json(crate::wire::WhoAmIBody::new(&caller)).into_response()
}

/// Buckets of a campaign that names none (fewer when it has fewer units): enough for
/// batches to commit side by side on a hot SKU without splitting a small sale thin.
const CAMPAIGN_BUCKETS_DEFAULT: u32 = 4;

/// Start a flash-sale campaign
///
/// Carves `quantity` units out of the SKU's available stock (ledgered) into the campaign's own stock, split over `buckets` rows. While it runs, every reservation and order of the SKU draws from it; regular sales cannot take its units, and it cannot take theirs. At `ends_at` what is left goes back to regular stock (ledgered). One campaign per SKU at a time, and at most 1,000 open (not closed) per shop: one more is refused with `failed_precondition`, nothing carved.
#[utoipa::path(
    post,
    path = "/v1/admin/campaigns",
    tag = "stock",
    params(("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::wire::CreateCampaignRequest,
    responses((status = 201, description = "Created", body = crate::wire::CampaignBody))
)]
pub async fn create_campaign(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<crate::wire::CreateCampaignRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let campaign = engine::campaigns::CampaignRequest {
        sku: request.sku,
        warehouse: request
            .warehouse
            .unwrap_or_else(domain::WarehouseCode::default_warehouse),
        quantity: request.quantity.get(),
        buckets: u32::try_from(request.buckets.map_or_else(
            || request.quantity.get().min(CAMPAIGN_BUCKETS_DEFAULT.into()),
            domain::CampaignBuckets::get,
        ))
        .unwrap_or(1),
        per_user_limit: request.per_user_limit.map(domain::PerUserLimit::get),
        starts_at: request.starts_at,
        ends_at: request.ends_at,
    };
    Ok(reply_response(
        state
            .engine
            .create_campaign(&caller, &claim, campaign)
            .await?,
    ))
}

/// End a campaign now
///
/// For a sale that must stop before its time (a mistyped quantity or date, a problem with the goods): its end moves to now (a campaign not started yet never starts), and what is left in its buckets goes back to regular stock (ledgered) at once; units held then stay held, and come back as they are released. This instance stops routing the SKU's sales to it at once, other instances within a second. Refused with `illegal_transition` when it has ended already.
#[utoipa::path(
    post,
    path = "/v1/admin/campaigns/{id}/end",
    tag = "stock",
    params(("id" = crate::openapi::schemas::CampaignId, Path, description = "The campaign."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Ended", body = crate::wire::CampaignBody))
)]
pub async fn end_campaign(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<EmptyRequest>,
) -> Result<Response, ApiError> {
    let id = domain::CampaignId::parse(&id).map_err(|error| ApiError::invalid(error.0))?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .end_campaign_early(&caller, &claim, &id)
            .await?,
    ))
}

/// A campaign: sold, held, left, returned, per bucket
#[utoipa::path(
    get,
    path = "/v1/admin/campaigns/{id}",
    tag = "stock",
    params(("id" = crate::openapi::schemas::CampaignId, Path, description = "The campaign.")),
    responses((status = 200, description = "The campaign", body = crate::wire::CampaignBody))
)]
pub async fn get_campaign(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = domain::CampaignId::parse(&id).map_err(|error| ApiError::invalid(error.0))?;
    let campaign = state.engine.campaign(&caller, &id).await?;
    // The phase as reservations judge it (`Engine::held_back_now`).
    Ok(Json(crate::wire::CampaignBody::new(
        &campaign,
        state.engine.held_back_now(),
    ))
    .into_response())
}

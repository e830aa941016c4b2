//! Handlers of the catalog: products, shelf operations, the shelf log, operators,
//! carts and checkout.

use std::collections::HashMap;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use cache::{CacheKey, Lookup};
use domain::limits::{REMARK_LENGTH_MAX, SHELF_LOG_PAGE_SIZE_MAX, SPEC_LENGTH_MAX};
use domain::{ErrorCode, ProductId, SaleStatus, ShelfOperation, SkuCode, Timestamp, UserId};
use engine::catalog::{DraftSku, ProductDraft, ShelfRequest};
use store::{ProductChanges, ReadHandle, ShelfLogQuery, TargetSelector};

use crate::AppState;
use crate::catalog_wire::{
    CartBody, CartItemRequest, CheckoutRequest, CreateOperatorRequest, CreateProductRequest,
    ProductBody, ShelfLogEntryBody, ShelfOperationRequest, ShelfOperationWire, ShopperProductBody,
    UpdateProductRequest,
};
use crate::consistency::{DisplayRead, displayed_json, displayed_response, served_response};
use crate::extract::{Caller, JsonBody, RequiredIdempotencyKey, RequiredJsonBody};
use crate::problem::ApiError;
use crate::routes::reply_response;

fn parse_product_id(text: &str) -> Result<ProductId, ApiError> {
    ProductId::parse(text).map_err(|error| ApiError::invalid(error.0))
}

fn parse_user(text: &str) -> Result<UserId, ApiError> {
    UserId::parse(text).map_err(|error| ApiError::invalid(error.0))
}

fn parse_sku(text: &str) -> Result<SkuCode, ApiError> {
    SkuCode::parse(text).map_err(|error| ApiError::invalid(error.0))
}

fn bounded_text(field: &str, text: Option<String>, length_max: usize) -> Result<String, ApiError> {
    let text = text.unwrap_or_default();
    if text.chars().count() > length_max || text.chars().any(char::is_control) {
        return Err(ApiError::invalid(format!(
            "{field} must be at most {length_max} characters without control characters"
        )));
    }
    Ok(text)
}

pub async fn create_product(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CreateProductRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let mut skus = Vec::with_capacity(request.skus.len());
    for sku in request.skus {
        let spec = bounded_text("spec", sku.spec, SPEC_LENGTH_MAX)?;
        skus.push(DraftSku {
            code: sku.sku,
            price: sku.price,
            currency: sku.currency,
            spec,
            per_user_limit: sku.per_user_limit.map(domain::PerUserLimit::get),
        });
    }
    let draft = ProductDraft {
        title: request.title,
        image_url: request.image_url,
        category: request.category,
        supplier: request.supplier,
        shop: request.shop,
        skus,
    };
    Ok(reply_response(
        state.engine.create_product(&caller, &claim, draft).await?,
    ))
}

pub async fn update_product(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<UpdateProductRequest>,
) -> Result<Response, ApiError> {
    let id = parse_product_id(&id)?;
    let claim = body.claim(&caller, key);
    let request = body.value;
    let changes = ProductChanges {
        title: request.title,
        image_url: request.image_url,
        category: request.category,
        supplier: request.supplier,
    };
    Ok(reply_response(
        state
            .engine
            .update_product(&caller, &claim, &id, changes)
            .await?,
    ))
}

pub async fn delete_product(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<crate::wire::EmptyRequest>,
) -> Result<Response, ApiError> {
    let id = parse_product_id(&id)?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state.engine.delete_product(&caller, &claim, &id).await?,
    ))
}

/// What a shopper sees; a deleted product is gone for them.
/// `GET /v1/products/{id}`, the shopper's view. With the display cache it is served
/// from Redis (`Stockd-Served-By: cache`) and filled on a miss from a read at least as
/// new as the writer when the miss was seen; a read that sends a consistency token
/// (it wants its own writes) and any Redis failure read the database.
pub async fn shopper_product(
    State(state): State<AppState>,
    DisplayRead(reader): DisplayRead,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_product_id(&id)?;
    let Some(cache) = state
        .engine
        .display_cache()
        .filter(|_| reader.token().is_none())
    else {
        if state.engine.display_cache().is_some() {
            metrics::counter!("stockd_cache_reads_total", "result" => "bypassed").increment(1);
        }
        return shopper_product_json(&state, &reader, &id).await;
    };
    let key = CacheKey::ProductView(id.as_str().to_owned());
    let ticket = match cache.lookup(&key).await {
        Ok(Lookup::Hit(body)) => {
            metrics::counter!("stockd_cache_reads_total", "result" => "hit").increment(1);
            let response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
            return Ok(served_response(response, "cache"));
        }
        Ok(Lookup::Miss(ticket)) => {
            metrics::counter!("stockd_cache_reads_total", "result" => "miss").increment(1);
            Some(ticket)
        }
        Err(error) => {
            metrics::counter!("stockd_cache_errors_total", "operation" => "lookup").increment(1);
            tracing::debug!(%error, "product view read from the database");
            None
        }
    };
    let Some(ticket) = ticket else {
        return shopper_product_json(&state, &reader, &id).await;
    };
    // Read at least as new as the writer now: a replica behind the change that moved
    // the generation must not fill the cache with what came before it.
    let fresh = ReadHandle::display(state.engine.consistency_token().await);
    let (displayed, value) = shopper_product_value(&state, &fresh, &id).await?;
    let body = value.to_string();
    match cache.fill(&ticket, &body).await {
        Ok(stored) => {
            let stored = if stored { "true" } else { "false" };
            metrics::counter!("stockd_cache_fills_total", "stored" => stored).increment(1);
        }
        Err(error) => {
            metrics::counter!("stockd_cache_errors_total", "operation" => "fill").increment(1);
            tracing::debug!(%error, "product view not cached");
        }
    }
    let response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    Ok(served_response(response, displayed.as_str()))
}

async fn shopper_product_json(
    state: &AppState,
    reader: &ReadHandle,
    id: &ProductId,
) -> Result<Response, ApiError> {
    let (served_by, value) = shopper_product_value(state, reader, id).await?;
    Ok(served_response(
        Json(value).into_response(),
        served_by.as_str(),
    ))
}

/// The shopper's view as the database shows it, and who served the read.
async fn shopper_product_value(
    state: &AppState,
    reader: &ReadHandle,
    id: &ProductId,
) -> Result<(domain::ServedBy, serde_json::Value), ApiError> {
    let displayed = state.engine.display_product(reader, id).await?;
    let product = &displayed.value;
    if product.deleted_at.is_some()
        || product
            .skus
            .iter()
            .all(|sku| sku.sale_status == SaleStatus::Deleted)
    {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("product '{id}' does not exist"),
        ));
    }
    Ok((
        displayed.served_by,
        displayed_json(&displayed, ShopperProductBody::new(product)),
    ))
}

pub async fn staff_product(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_product_id(&id)?;
    let product = state.engine.product_for(&caller, &id).await?;
    Ok(Json(ProductBody::new(&product)).into_response())
}

pub async fn shelf(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<ShelfOperationRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    let (operation, scheduled) = match request.operation {
        ShelfOperationWire::On => (ShelfOperation::On, false),
        ShelfOperationWire::Off => (ShelfOperation::Off, false),
        ShelfOperationWire::OnAt => (ShelfOperation::On, true),
        ShelfOperationWire::OffAt => (ShelfOperation::Off, true),
        ShelfOperationWire::Delete => (ShelfOperation::Delete, false),
    };
    let scheduled_at = match (scheduled, request.scheduled_at) {
        (true, Some(at)) => Some(at),
        (true, None) => return Err(ApiError::invalid("on_at and off_at need scheduled_at")),
        (false, Some(_)) => {
            return Err(ApiError::invalid("scheduled_at goes with on_at or off_at"));
        }
        (false, None) => None,
    };
    let remark = bounded_text("remark", request.remark, REMARK_LENGTH_MAX)?;
    let request = ShelfRequest {
        operation,
        scheduled_at,
        selector: TargetSelector {
            product_ids: request.product_ids,
            skus: request.sku_ids,
            category: request.category,
            supplier: request.supplier,
            shop: None,
        },
        expected_versions: request.expected_versions,
        remark,
    };
    Ok(reply_response(
        state.engine.shelf(&caller, &claim, request).await?,
    ))
}

/// `GET /v1/admin/shelf-log?product=&sku=&since=&after=&limit=`: oldest first; pass
/// the last `id` as `after` for the next page.
pub async fn shelf_log(
    State(state): State<AppState>,
    Caller(caller): Caller,
    DisplayRead(reader): DisplayRead,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(parameters) = query.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    let mut query = ShelfLogQuery {
        limit: 100,
        ..ShelfLogQuery::default()
    };
    for (name, value) in &parameters {
        match name.as_str() {
            "product" => query.product_id = Some(parse_product_id(value)?),
            "sku" => query.sku = Some(parse_sku(value)?),
            "since" => {
                query.since = Some(
                    Timestamp::parse_rfc3339(value).map_err(|error| ApiError::invalid(error.0))?,
                );
            }
            "after" => {
                query.after_id = Some(
                    value
                        .parse::<i64>()
                        .map_err(|_| ApiError::invalid("after must be an entry id"))?,
                );
            }
            "limit" => {
                query.limit = value
                    .parse::<i64>()
                    .ok()
                    .filter(|limit| (1..=SHELF_LOG_PAGE_SIZE_MAX).contains(limit))
                    .ok_or_else(|| {
                        ApiError::invalid(format!("limit must be 1 to {SHELF_LOG_PAGE_SIZE_MAX}"))
                    })?;
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter '{other}'"
                )));
            }
        }
    }
    let entries = state.engine.shelf_log(&caller, query, &reader).await?;
    let next_after = entries.value.last().map(|entry| entry.id);
    let bodies: Vec<ShelfLogEntryBody<'_>> =
        entries.value.iter().map(ShelfLogEntryBody::new).collect();
    Ok(displayed_response(
        &entries,
        serde_json::json!({"entries": bodies, "next_after": next_after}),
    ))
}

pub async fn create_operator(
    State(state): State<AppState>,
    Caller(caller): Caller,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CreateOperatorRequest>,
) -> Result<Response, ApiError> {
    let claim = body.claim(&caller, key);
    let request = body.value;
    Ok(reply_response(
        state
            .engine
            .create_operator(&caller, &claim, &request.operator_id, &request.shop)
            .await?,
    ))
}

pub async fn put_cart_item(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path((user, sku)): Path<(String, String)>,
    key: RequiredIdempotencyKey,
    RequiredJsonBody(body): RequiredJsonBody<CartItemRequest>,
) -> Result<Response, ApiError> {
    let (user, sku) = (parse_user(&user)?, parse_sku(&sku)?);
    let claim = body.claim(&caller, key);
    let quantity = body.value.quantity;
    Ok(reply_response(
        state
            .engine
            .set_cart_item(&caller, &claim, &user, &sku, Some(quantity))
            .await?,
    ))
}

pub async fn delete_cart_item(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path((user, sku)): Path<(String, String)>,
    key: RequiredIdempotencyKey,
    body: JsonBody<crate::wire::EmptyRequest>,
) -> Result<Response, ApiError> {
    let (user, sku) = (parse_user(&user)?, parse_sku(&sku)?);
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .set_cart_item(&caller, &claim, &user, &sku, None)
            .await?,
    ))
}

pub async fn get_cart(
    State(state): State<AppState>,
    Caller(caller): Caller,
    DisplayRead(reader): DisplayRead,
    Path(user): Path<String>,
) -> Result<Response, ApiError> {
    let user = parse_user(&user)?;
    let cart = state.engine.display_cart(&caller, &user, &reader).await?;
    Ok(displayed_response(&cart, CartBody::new(&cart.value)))
}

pub async fn checkout(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(user): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<CheckoutRequest>,
) -> Result<Response, ApiError> {
    let user = parse_user(&user)?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .checkout(&caller, &claim, &user, body.value.ttl_seconds)
            .await?,
    ))
}

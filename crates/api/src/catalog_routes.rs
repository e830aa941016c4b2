//! Handlers of the catalog: products, shelf operations, the shelf log, operators,
//! carts and checkout.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use cache::{CacheKey, Lookup};
use domain::limits::{
    LIST_PAGE_SIZE_DEFAULT, LIST_PAGE_SIZE_MAX, REMARK_LENGTH_MAX, SHELF_LOG_PAGE_SIZE_MAX,
    SPEC_LENGTH_MAX,
};
use domain::{ErrorCode, ProductId, ProductTitle, ShelfOperation, SkuCode, Timestamp, UserId};
use engine::catalog::{DraftSku, ProductDraft, ShelfRequest};
use store::{ProductChanges, ReadHandle, ShelfLogQuery, TargetSelector};

use crate::AppState;
use crate::catalog_wire::{
    CartBody, CartItemRequest, CheckoutRequest, CreateOperatorRequest, CreateProductRequest,
    ProductBody, ShelfLogEntryBody, ShelfOperationRequest, ShelfOperationWire, ShopperProductBody,
    UpdateProductRequest,
};
use crate::consistency::{DisplayRead, displayed_json, displayed_response, served_response};
use crate::extract::{Caller, JsonBody, Path, RequiredIdempotencyKey, RequiredJsonBody};
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

pub(crate) fn bounded_text(
    field: &str,
    text: Option<String>,
    length_max: usize,
) -> Result<String, ApiError> {
    let text = text.unwrap_or_default();
    if text.chars().count() > length_max || text.chars().any(domain::unfit_for_text) {
        return Err(ApiError::invalid(format!(
            "{field} must be at most {length_max} characters without control characters or line separators"
        )));
    }
    Ok(text)
}

/// Create a product with its SKUs
///
/// Every SKU starts `PENDING_REVIEW`.
#[utoipa::path(
    post,
    path = "/v1/products",
    tag = "catalog",
    params(("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::catalog_wire::CreateProductRequest,
    responses((status = 201, description = "Created", body = crate::catalog_wire::ProductBody))
)]
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
        title: request.title.into_title(),
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

/// Change a product's fields
///
/// The shop never changes.
#[utoipa::path(
    patch,
    path = "/v1/products/{id}",
    tag = "catalog",
    params(("id" = crate::openapi::schemas::ProductId, Path, description = "The product."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::catalog_wire::UpdateProductRequest,
    responses((status = 200, description = "Changed", body = crate::catalog_wire::ProductBody))
)]
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
        title: request.title.map(ProductTitle::into_title),
        image_url: request.image_url,
        category: request.category,
        supplier: request.supplier,
        expected_version: request.expected_version.map(domain::Version::get),
    };
    Ok(reply_response(
        state
            .engine
            .update_product(&caller, &claim, &id, changes)
            .await?,
    ))
}

/// Delete a product (admin)
///
/// Soft and terminal: every SKU to `DELETED`, as a shelf operation (each SKU's result, logged). Not the same as taking it off the shelf.
#[utoipa::path(
    delete,
    path = "/v1/products/{id}",
    tag = "catalog",
    params(("id" = crate::openapi::schemas::ProductId, Path, description = "The product."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Deleted", body = crate::catalog_wire::ShelfResultsBody))
)]
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

// With the display cache the view is served from Redis (`Stockd-Served-By: cache`) and
// filled on a miss from a read at least as new as the writer when the miss was seen; a
// read that sends a consistency token (it wants its own writes) and any Redis failure
// read the database.
/// The shopper's view of a product
///
/// Per SKU: `on_sale`, `temporarily_out_of_stock` or `off_shelf`. Open to anyone. A display: the reservation at checkout decides. A product is shown once one of its SKUs was reviewed (put on or off the shelf): before, and once deleted, it is `not_found`; a SKU still in review is left out.
#[utoipa::path(
    get,
    path = "/v1/products/{id}",
    tag = "catalog",
    params(("id" = crate::openapi::schemas::ProductId, Path, description = "The product."), ("Stockd-Consistency-Token" = Option<crate::openapi::schemas::ConsistencyToken>, Header, description = "A write's Stockd-Consistency-Token: the read is served only from data that includes that write.")),
    responses((status = 200, description = "The product", body = crate::catalog_wire::ShopperProductBody))
)]
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
    // the generation must not fill the cache with what came before it. Without the
    // writer's position (it could not be read) any replica in rotation could answer,
    // so the view is served but not cached.
    let Some(position) = state.engine.consistency_token().await else {
        return shopper_product_json(&state, &reader, &id).await;
    };
    let fresh = ReadHandle::display(Some(position));
    let horizon = Some(cache.value_ttl());
    let (displayed, value, changes_soon) =
        shopper_product_value(&state, &fresh, &id, horizon).await?;
    let body = value.to_string();
    // A campaign starting or ending changes the view with no event to drop a copy
    // (nothing is written at that moment): a copy must not outlive it.
    if changes_soon {
        metrics::counter!("stockd_cache_fills_total", "stored" => "false").increment(1);
        let response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
        return Ok(served_response(response, displayed.as_str()));
    }
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
    let (served_by, value, _) = shopper_product_value(state, reader, id, None).await?;
    Ok(served_response(
        Json(value).into_response(),
        served_by.as_str(),
    ))
}

/// The shopper's view as the database shows it, and who served the read.
/// The shopper's view of product `id`, and whether it changes on its own (a campaign
/// on one of its SKUs starting or ending) within `horizon`.
async fn shopper_product_value(
    state: &AppState,
    reader: &ReadHandle,
    id: &ProductId,
    horizon: Option<std::time::Duration>,
) -> Result<(domain::ServedBy, serde_json::Value, bool), ApiError> {
    // Before the read: a campaign's start that lands while the view is being read
    // still counts as one within the horizon.
    let read_from = state.engine.held_back_now();
    let displayed = state.engine.display_product(reader, id).await?;
    let product = &displayed.value;
    // Shoppers see a product once one of its SKUs was reviewed (put on or off the shelf): a
    // product still in review, its title, image and prices not yet checked, is not
    // theirs to see (seed 003 §1.2), nor one deleted whole.
    if product.deleted_at.is_some()
        || product
            .skus
            .iter()
            .all(|sku| !sku.sale_status.is_shown_to_shoppers())
    {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("product '{id}' does not exist"),
        ));
    }
    let changes_soon = horizon.is_some_and(|horizon| {
        let horizon_milliseconds = i64::try_from(horizon.as_millis()).unwrap_or(i64::MAX);
        product.skus.iter().any(|sku| {
            state
                .engine
                .shopper_view_changes_within(&sku.code, read_from, horizon_milliseconds)
        })
    });
    Ok((
        displayed.served_by,
        displayed_json(
            &displayed,
            ShopperProductBody::new(product, |sku| state.engine.shopper_available(sku)),
        ),
        changes_soon,
    ))
}

/// The staff view of a product: sale status, version and stock per SKU
#[utoipa::path(
    get,
    path = "/v1/admin/products/{id}",
    tag = "catalog",
    params(("id" = crate::openapi::schemas::ProductId, Path, description = "The product.")),
    responses((status = 200, description = "The product", body = crate::catalog_wire::ProductBody))
)]
pub async fn staff_product(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_product_id(&id)?;
    let product = state.engine.product_for(&caller, &id).await?;
    Ok(Json(ProductBody::new(&product)).into_response())
}

/// Put SKUs on or off the shelf, now or at a minute
///
/// Targets by `product_ids`, `sku_ids`, `category` or `supplier` (at most 1,000 SKUs). `delete` is the admin's. Each target's result is reported; when every target was refused, the answer is the first refusal's problem with the results in `results`.
#[utoipa::path(
    post,
    path = "/v1/admin/shelf",
    tag = "shelf",
    params(("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::catalog_wire::ShelfOperationRequest,
    responses((status = 200, description = "Each target's result", body = crate::catalog_wire::ShelfResultsBody))
)]
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
    let recurrence = match (scheduled, request.repeat) {
        (true, Some(crate::catalog_wire::RepeatWire::Daily)) => Some(domain::Recurrence::Daily),
        (false, Some(_)) => return Err(ApiError::invalid("repeat goes with on_at or off_at")),
        (_, None) => None,
    };
    if request.expected_versions.len() > domain::limits::SHELF_TARGETS_MAX {
        return Err(ApiError::invalid(format!(
            "at most {} expected_versions",
            domain::limits::SHELF_TARGETS_MAX
        )));
    }
    let remark = bounded_text("remark", request.remark, REMARK_LENGTH_MAX)?;
    let request = ShelfRequest {
        operation,
        scheduled_at,
        recurrence,
        selector: TargetSelector {
            product_ids: request.product_ids,
            skus: request.sku_ids,
            category: request.category,
            supplier: request.supplier,
            shop: request.shop,
        },
        expected_versions: request
            .expected_versions
            .into_iter()
            .map(|(sku, version)| (sku, version.get()))
            .collect(),
        remark,
    };
    Ok(reply_response(
        state.engine.shelf(&caller, &claim, request).await?,
    ))
}

/// Every shelf change: who, when, from, to
///
/// Oldest first; pass the last `id` as `after` for the next page.
#[utoipa::path(
    get,
    path = "/v1/admin/shelf-log",
    tag = "shelf",
    params(("product" = Option<crate::openapi::schemas::ProductId>, Query, description = "Only this product's SKUs."), ("sku" = Option<crate::openapi::schemas::SkuCode>, Query, description = "Only this SKU."), ("since" = Option<crate::openapi::schemas::Timestamp>, Query, description = "Only changes at or after."), ("after" = Option<i64>, Query, description = "The last id of the previous page."), ("limit" = Option<i64>, Query, minimum = 1, maximum = 500, description = "Entries per page (100 when absent)."), ("Stockd-Consistency-Token" = Option<crate::openapi::schemas::ConsistencyToken>, Header, description = "A write's Stockd-Consistency-Token: the read is served only from data that includes that write.")),
    responses((status = 200, description = "A page of the log", body = crate::catalog_wire::ShelfLogPageBody))
)]
pub async fn shelf_log(
    State(state): State<AppState>,
    Caller(caller): Caller,
    DisplayRead(reader): DisplayRead,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(pairs) = query.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    let parameters = crate::extract::unique_parameters(pairs)?;
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
    let after = query.after_id;
    let entries = state.engine.shelf_log(&caller, query, &reader).await?;
    // At the head of the log a page is empty: the cursor stays where it was, so a
    // reader tailing the log asks from there again rather than from the beginning.
    let next_after = entries.value.last().map(|entry| entry.id).or(after);
    let page = crate::catalog_wire::ShelfLogPageBody {
        entries: entries.value.iter().map(ShelfLogEntryBody::new).collect(),
        next_after,
    };
    Ok(displayed_response(&entries, page))
}

/// Create an operator of one shop
///
/// The token is in this answer only.
#[utoipa::path(
    post,
    path = "/v1/admin/operators",
    tag = "credentials",
    params(("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::catalog_wire::CreateOperatorRequest,
    responses((status = 201, description = "Created", body = crate::catalog_wire::OperatorCreatedBody))
)]
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

/// Revoke an operator's token
///
/// At once on this instance, within the credential cache's bound on the others. The id stays taken.
#[utoipa::path(
    delete,
    path = "/v1/admin/operators/{operator_id}",
    tag = "credentials",
    params(("operator_id" = crate::openapi::schemas::OperatorId, Path, description = "The operator."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "Revoked", body = crate::catalog_wire::OperatorRevokedBody))
)]
pub async fn revoke_operator(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(operator_id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<crate::wire::EmptyRequest>,
) -> Result<Response, ApiError> {
    let operator =
        domain::OperatorId::parse(&operator_id).map_err(|error| ApiError::invalid(error.0))?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state
            .engine
            .revoke_operator(&caller, &claim, &operator)
            .await?,
    ))
}

/// Put a SKU in a shopper's cart, or change its quantity
///
/// A cart holds no stock.
#[utoipa::path(
    put,
    path = "/v1/carts/{user}/items/{sku}",
    tag = "carts",
    params(("user" = crate::openapi::schemas::UserId, Path, description = "The shopper."), ("sku" = crate::openapi::schemas::SkuCode, Path, description = "The SKU's code."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body = crate::catalog_wire::CartItemRequest,
    responses((status = 200, description = "The cart", body = crate::catalog_wire::CartBody))
)]
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

/// Take a SKU out of a shopper's cart
#[utoipa::path(
    delete,
    path = "/v1/carts/{user}/items/{sku}",
    tag = "carts",
    params(("user" = crate::openapi::schemas::UserId, Path, description = "The shopper."), ("sku" = crate::openapi::schemas::SkuCode, Path, description = "The SKU's code."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "The cart", body = crate::catalog_wire::CartBody))
)]
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

/// A shopper's cart, each line with what stands in its way
#[utoipa::path(
    get,
    path = "/v1/carts/{user}",
    tag = "carts",
    params(("user" = crate::openapi::schemas::UserId, Path, description = "The shopper."), ("Stockd-Consistency-Token" = Option<crate::openapi::schemas::ConsistencyToken>, Header, description = "A write's Stockd-Consistency-Token: the read is served only from data that includes that write.")),
    responses((status = 200, description = "The cart", body = crate::catalog_wire::CartBody))
)]
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

/// Check a cart out
///
/// An order (`PENDING_PAYMENT`) of the lines that can be ordered now; the others are reported in `skipped` and stay in the cart.
#[utoipa::path(
    post,
    path = "/v1/carts/{user}/checkout",
    tag = "carts",
    params(("user" = crate::openapi::schemas::UserId, Path, description = "The shopper."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::catalog_wire::CheckoutRequest>, description = "Optionally the hold's length.", content_type = "application/json"),
    responses((status = 201, description = "Ordered", body = crate::order_wire::CheckedOutBody))
)]
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

/// Products with their SKUs, oldest first
///
/// An operator sees its own shop's; the admin every shop's, or `shop`'s. Deleted products are listed too (`deleted: true`).
#[utoipa::path(
    get,
    path = "/v1/admin/products",
    tag = "catalog",
    params(
        ("shop" = Option<crate::openapi::schemas::ShopCode>, Query, description = "Only this shop's (an operator's own anyway)."),
        ("category" = Option<crate::openapi::schemas::CategoryCode>, Query, description = "Only this category."),
        ("supplier" = Option<crate::openapi::schemas::SupplierCode>, Query, description = "Only this supplier's."),
        ("after" = Option<crate::openapi::schemas::ProductId>, Query, description = "The previous page's next_after."),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 200, description = "Products per page (50 when absent).")
    ),
    responses((status = 200, description = "A page of products", body = crate::catalog_wire::ProductsPageBody))
)]
pub async fn list_products(
    State(state): State<AppState>,
    Caller(caller): Caller,
    mut query: crate::extract::QueryParameters,
) -> Result<Response, ApiError> {
    let filter = store::ProductFilter {
        shop: query.take("shop", domain::ShopCode::parse)?,
        category: query.take("category", domain::CategoryCode::parse)?,
        supplier: query.take("supplier", domain::SupplierCode::parse)?,
    };
    let after = query.take("after", ProductId::parse)?;
    let limit = query.limit(LIST_PAGE_SIZE_DEFAULT, LIST_PAGE_SIZE_MAX)?;
    query.finish()?;
    let products = state
        .engine
        .products_page(&caller, filter, after.as_ref(), limit)
        .await?;
    let full = i64::try_from(products.len()).unwrap_or(i64::MAX) == limit;
    let body = crate::catalog_wire::ProductsPageBody {
        products: products.iter().map(ProductBody::new).collect(),
        next_after: products
            .last()
            .filter(|_| full)
            .map(|product| product.id.as_str()),
    };
    Ok(Json(body).into_response())
}

/// Scheduled shelf changes, by due time
///
/// `PENDING` ones (what is still to come) unless `status` names another. An operator sees its own shop's. Pass the last `schedule_id` as `after` for the next page.
#[utoipa::path(
    get,
    path = "/v1/admin/schedules",
    tag = "shelf",
    params(
        ("status" = Option<crate::openapi::schemas::ScheduleStatus>, Query, description = "PENDING when absent."),
        ("shop" = Option<crate::openapi::schemas::ShopCode>, Query, description = "Only this shop's (an operator's own anyway)."),
        ("after" = Option<crate::openapi::schemas::ScheduleId>, Query, description = "The last schedule of the previous page."),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 200, description = "Schedules (50 when absent): the first by due time.")
    ),
    responses((status = 200, description = "The schedules", body = crate::catalog_wire::SchedulesBody))
)]
pub async fn list_schedules(
    State(state): State<AppState>,
    Caller(caller): Caller,
    mut query: crate::extract::QueryParameters,
) -> Result<Response, ApiError> {
    let status = query
        .take("status", |text| {
            engine::catalog::ScheduleStatus::parse(text)
                .ok_or("must be PENDING, APPLIED, SKIPPED, REFUSED or CANCELLED")
        })?
        .unwrap_or(engine::catalog::ScheduleStatus::Pending);
    let shop = query.take("shop", domain::ShopCode::parse)?;
    let after = query.take("after", domain::ScheduleId::parse)?;
    let limit = query.limit(LIST_PAGE_SIZE_DEFAULT, LIST_PAGE_SIZE_MAX)?;
    query.finish()?;
    let schedules = state
        .engine
        .schedules(&caller, shop.as_ref(), status, after.as_ref(), limit)
        .await?;
    let body = crate::catalog_wire::SchedulesBody {
        schedules: schedules
            .iter()
            .map(crate::catalog_wire::ScheduleBody::new)
            .collect(),
    };
    Ok(Json(body).into_response())
}

/// Cancel a scheduled shelf change
///
/// Withdraws what the schedule's series has pending: the schedule itself while it is pending, or the next occurrence of a daily one. Nothing on the shelf changes. Answers the cancelled occurrence; `illegal_transition` when nothing is pending.
#[utoipa::path(
    post,
    path = "/v1/admin/schedules/{schedule_id}/cancel",
    tag = "shelf",
    params(("schedule_id" = crate::openapi::schemas::ScheduleId, Path, description = "The schedule, or any occurrence of its daily series."), ("Idempotency-Key" = crate::openapi::schemas::IdempotencyKey, Header, description = "Names this request: a retry with the same key gets the first answer again.")),
    request_body(content = Option<crate::wire::EmptyRequest>, description = "Nothing, or `{}`.", content_type = "application/json"),
    responses((status = 200, description = "The cancelled occurrence", body = crate::catalog_wire::ScheduleBody))
)]
pub async fn cancel_schedule(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(schedule_id): Path<String>,
    key: RequiredIdempotencyKey,
    body: JsonBody<crate::wire::EmptyRequest>,
) -> Result<Response, ApiError> {
    let id = domain::ScheduleId::parse(&schedule_id).map_err(|error| ApiError::invalid(error.0))?;
    let claim = body.claim(&caller, key);
    Ok(reply_response(
        state.engine.cancel_schedule(&caller, &claim, &id).await?,
    ))
}

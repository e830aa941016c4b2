//! stockd's HTTP surface. [`app`] builds the router from an [`AppState`] and is separate
//! from serving it, so tests drive the router directly or bind it to port 0.

pub mod catalog_routes;
pub mod catalog_wire;
pub mod consistency;
pub mod extract;
pub mod http;
pub mod intake;
pub mod metrics;
pub mod order_routes;
pub mod order_wire;
pub mod problem;
pub mod routes;
pub mod server;
pub mod wire;

use std::sync::Arc;

use axum::Router;
use axum::routing::{delete, get, post, put};
use engine::Engine;
use metrics_exporter_prometheus::PrometheusHandle;
use tower_http::catch_panic::CatchPanicLayer;

pub use wire::HttpRenderer;

/// The OpenAPI description of every route, served at `/openapi.json`.
pub const OPENAPI_DOCUMENT: &str = include_str!("../openapi.json");

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    /// Renders `/metrics`; `None` serves an empty page.
    pub metrics: Option<PrometheusHandle>,
    pub http: Arc<http::HttpLimits>,
}

impl AppState {
    pub fn new(
        engine: Engine,
        metrics: Option<PrometheusHandle>,
        config: &http::HttpConfig,
    ) -> AppState {
        AppState {
            engine,
            metrics,
            http: http::HttpLimits::new(config),
        }
    }
}

/// The renderer the engine must be built with, so stored responses are this layer's
/// JSON.
pub fn renderer() -> Arc<dyn store::ResponseRenderer> {
    Arc::new(HttpRenderer)
}

pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(routes::healthz))
        .route("/readyz", get(routes::readyz))
        .route("/metrics", get(metrics::render))
        .route("/openapi.json", get(routes::openapi))
        .route("/v1/skus/{sku}", put(routes::save_sku).get(routes::get_sku))
        .route(
            "/v1/skus/{sku}/stock-movements",
            post(routes::record_movement),
        )
        .route(
            "/v1/stock-movements/{movement_id}",
            get(routes::get_stock_movement),
        )
        .route("/v1/reservations", post(routes::create_reservation))
        .route("/v1/reservations/{id}", get(routes::get_reservation))
        .route(
            "/v1/reservations/{id}/confirm",
            post(routes::confirm_reservation),
        )
        .route(
            "/v1/reservations/{id}/release",
            post(routes::release_reservation),
        )
        .route("/v1/audit", get(routes::audit))
        .route("/v1/events", get(routes::events))
        .route("/v1/orders", post(order_routes::create_order))
        .route("/v1/orders/{id}", get(order_routes::get_order))
        .route("/v1/orders/{id}/pay", post(order_routes::pay))
        .route("/v1/orders/{id}/cancel", post(order_routes::cancel))
        .route("/v1/orders/{id}/return", post(order_routes::return_goods))
        .route("/v1/payments/webhook", post(order_routes::webhook))
        .route("/v1/products", post(catalog_routes::create_product))
        .route(
            "/v1/products/{id}",
            get(catalog_routes::shopper_product)
                .patch(catalog_routes::update_product)
                .delete(catalog_routes::delete_product),
        )
        .route(
            "/v1/admin/products/{id}",
            get(catalog_routes::staff_product),
        )
        .route("/v1/admin/shelf", post(catalog_routes::shelf))
        .route("/v1/admin/shelf-log", get(catalog_routes::shelf_log))
        .route("/v1/admin/operators", post(catalog_routes::create_operator))
        .route(
            "/v1/admin/service-keys",
            post(routes::create_service_key).get(routes::service_keys),
        )
        .route(
            "/v1/admin/service-keys/{key_id}",
            delete(routes::revoke_service_key),
        )
        .route(
            "/v1/carts/{user}/items/{sku}",
            put(catalog_routes::put_cart_item).delete(catalog_routes::delete_cart_item),
        )
        .route("/v1/carts/{user}", get(catalog_routes::get_cart))
        .route("/v1/carts/{user}/checkout", post(catalog_routes::checkout))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            consistency::stamp_writes,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            http::bound_request_duration,
        ))
        .layer(axum::middleware::from_fn(metrics::track))
        .layer(CatchPanicLayer::custom(panic_response))
        .with_state(state)
}

fn panic_response(_panic: Box<dyn std::any::Any + Send + 'static>) -> axum::response::Response {
    tracing::error!("a request handler panicked");
    axum::response::IntoResponse::into_response(problem::ApiError::new(
        domain::ErrorCode::Internal,
        "see the server log",
    ))
}

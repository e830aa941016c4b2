//! stockd's HTTP surface. [`app`] builds the router from an [`AppState`] and is separate
//! from serving it, so tests drive the router directly or bind it to port 0.

// The release build computes the layout of each handler's future, nested through the
// engine's and the store's; once the engine boxed its rare store calls (its `cold`),
// that query went past the default depth of 128 for the deepest handler
// (`create_product`). A compile-time bound only.
#![recursion_limit = "256"]

pub mod catalog_routes;
pub mod catalog_wire;
pub mod consistency;
pub mod extract;
pub mod http;
pub mod intake;
pub mod metrics;
pub mod openapi;
pub mod order_routes;
pub mod order_wire;
pub mod pages;
pub mod problem;
pub mod routes;
pub mod server;
pub mod wire;

use std::sync::Arc;

use axum::Router;
use engine::Engine;
use metrics_exporter_prometheus::PrometheusHandle;
use tower_http::catch_panic::CatchPanicLayer;

pub use wire::HttpRenderer;

/// What every handler and middleware reads. Cloned for each request by each layer that
/// takes it, so it is one shared allocation: one reference count to move per clone, not
/// one per field.
#[derive(Clone)]
pub struct AppState(Arc<SharedState>);

pub struct SharedState {
    pub engine: Engine,
    /// Renders `/metrics`; `None` serves an empty page.
    pub metrics: Option<PrometheusHandle>,
    /// The per-request series' handles, each registered at its first use.
    pub request_metrics: metrics::RequestMetrics,
    pub http: http::HttpLimits,
}

impl AppState {
    pub fn new(
        engine: Engine,
        metrics: Option<PrometheusHandle>,
        config: &http::HttpConfig,
    ) -> AppState {
        AppState(Arc::new(SharedState {
            engine,
            metrics,
            request_metrics: metrics::RequestMetrics::new(),
            http: http::HttpLimits::new(config),
        }))
    }
}

impl std::ops::Deref for AppState {
    type Target = SharedState;

    fn deref(&self) -> &SharedState {
        &self.0
    }
}

/// The renderer the engine must be built with, so stored responses are this layer's
/// JSON.
pub fn renderer() -> Arc<dyn store::ResponseRenderer> {
    Arc::new(HttpRenderer)
}

pub fn app(state: AppState) -> Router {
    // Every route is documented: the handlers reach the router through the document.
    let (router, _) = openapi::routes().split_for_parts();
    router
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            each_request,
        ))
        .layer(CatchPanicLayer::custom(panic_response))
        .with_state(state)
}

/// What every request goes through, outermost first: its latency and outcome recorded
/// (`metrics::track`), its duration bounded (`http::bound_request_duration`), and the
/// writer's position stamped on a write's answer (`consistency::stamp_writes`). One
/// layer, not three: each of axum's `from_fn` layers clones the service inside it and
/// boxes a future for every request (docs/BENCHMARKS.md, twenty-second session).
async fn each_request(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    metrics::track(&state.request_metrics, request, |request| {
        let method = request.method().clone();
        let state = &state;
        async move {
            http::bound_request_duration(
                state,
                consistency::stamp_writes(state, &method, next.run(request)),
            )
            .await
        }
    })
    .await
}

pub(crate) fn panic_response(
    _panic: Box<dyn std::any::Any + Send + 'static>,
) -> axum::response::Response {
    tracing::error!("a request handler panicked");
    axum::response::IntoResponse::into_response(problem::ApiError::new(
        domain::ErrorCode::Internal,
        "see the server log",
    ))
}

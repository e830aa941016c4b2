//! The pages stockd serves to people: `/` (a landing page), `/docs` (the API reference,
//! rendered in the browser from `/openapi.json`) and `/console` (the operations
//! console). Every asset is compiled into the binary: nothing is fetched from another
//! host, so the pages work on a machine without internet.

use crate::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use domain::ErrorCode;

use crate::problem::ApiError;

/// The files under `/assets/`, with their media types.
const ASSETS: [(&str, &str, &str); 3] = [
    (
        "stockd.css",
        "text/css; charset=utf-8",
        include_str!("../assets/stockd.css"),
    ),
    (
        "docs.js",
        "text/javascript; charset=utf-8",
        include_str!("../assets/docs.js"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("../assets/console.js"),
    ),
];

/// The names `/assets/{file}` serves (the document's enum of the parameter).
pub fn asset_names() -> Vec<&'static str> {
    ASSETS.iter().map(|(name, _, _)| *name).collect()
}

/// A page or asset with the headers every one carries: scripts, styles, images and
/// calls only from this origin (no page shows a product's image: a remote image would
/// only be a way out for a token an injected script read), never framed,
/// never sniffed as another type, revalidated on each load (they change with the
/// binary).
fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; style-src 'self'; \
             script-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'self'; \
             frame-ancestors 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // `frame-ancestors` for browsers that predate it.
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

const HTML: &str = "text/html; charset=utf-8";

/// The landing page: links to the console, the reference, health and metrics
#[utoipa::path(
    get,
    path = "/",
    tag = "pages",
    responses((status = 200, description = "The landing page", body = String, content_type = "text/html"))
)]
pub async fn landing() -> Response {
    page(HTML, include_str!("../assets/index.html"))
}

/// The API reference, rendered from /openapi.json
#[utoipa::path(
    get,
    path = "/docs",
    tag = "pages",
    responses((status = 200, description = "The reference page", body = String, content_type = "text/html"))
)]
pub async fn docs() -> Response {
    page(HTML, include_str!("../assets/docs.html"))
}

/// The operations console
///
/// Log in with an admin or operator token; every action is a call of this API.
#[utoipa::path(
    get,
    path = "/console",
    tag = "pages",
    responses((status = 200, description = "The console page", body = String, content_type = "text/html"))
)]
pub async fn console() -> Response {
    page(HTML, include_str!("../assets/console.html"))
}

/// A script or style sheet of the pages
#[utoipa::path(
    get,
    path = "/assets/{file}",
    tag = "pages",
    params(("file" = crate::openapi::schemas::AssetName, Path, description = "The file.")),
    responses(
        (status = 200, description = "The style sheet or script", content(
            (String = "text/css"),
            (String = "text/javascript")
        ))
    )
)]
pub async fn asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    ASSETS
        .iter()
        .find(|(name, _, _)| *name == file)
        .map(|(_, content_type, body)| page(content_type, body))
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no asset '{file}'")))
}

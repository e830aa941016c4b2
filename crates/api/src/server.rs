//! Serving the router with a graceful shutdown: on the signal, stop accepting, let
//! in-flight requests finish (bounded by a grace period), then return.

use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves until `shutdown` is cancelled, then waits up to `grace` for in-flight
/// requests. Returns whether every request finished inside the grace period.
pub async fn serve_until(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    grace: Duration,
) -> std::io::Result<bool> {
    let signal = shutdown.clone();
    let server = axum::serve(listener, router)
        .with_graceful_shutdown(async move { signal.cancelled().await });
    let server = tokio::spawn(async move { server.await });
    shutdown.cancelled().await;
    match tokio::time::timeout(grace, server).await {
        Ok(Ok(result)) => result.map(|()| true),
        Ok(Err(join_error)) => Err(std::io::Error::other(join_error)),
        Err(_) => {
            tracing::warn!(
                grace_seconds = grace.as_secs(),
                "requests still running after the grace period"
            );
            Ok(false)
        }
    }
}

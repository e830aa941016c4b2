//! Serving the router so that no client can hold the server: a bound on the time to
//! send a request's headers (also the idle time between two requests of a kept-alive
//! connection), on the connections held at once, and on the graceful shutdown. The
//! body's and the request's own bounds live in `http` (they are the router's).
//!
//! On the signal the server closes its listening socket, asks every connection to close
//! after its current request, and waits for them up to the grace period.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The server's own bounds.
#[derive(Debug, Clone, Copy)]
pub struct ServerConfig {
    /// Longest wait for a request's headers, from the connection's start or the end of
    /// its previous answer: a client that sends half a header and stops is cut off.
    pub header_read_timeout: Duration,
    /// Connections served at once; one more is answered 503 and closed.
    pub connections_max: usize,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            header_read_timeout: Duration::from_secs(10),
            connections_max: 1024,
        }
    }
}

/// The answer to a connection past the bound: written without reading the request.
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/problem+json\r\nretry-after: 1\r\nconnection: close\r\n\
content-length: 167\r\n\r\n\
{\"type\":\"urn:stockd:problem:unavailable\",\"title\":\"Temporarily unavailable; retry later\",\
\"status\":503,\"code\":\"unavailable\",\"detail\":\"too many connections; retry later\"}";

/// Serves until `shutdown` is cancelled, then waits up to `grace` for the connections'
/// requests to finish. Returns whether every one finished inside the grace period.
pub async fn serve_until(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    grace: Duration,
    config: ServerConfig,
) -> std::io::Result<bool> {
    let connections = Arc::new(Semaphore::new(config.connections_max.max(1)));
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, most likely: pause instead of spinning.
                tracing::warn!(%error, "could not accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        match Arc::clone(&connections).try_acquire_owned() {
            Ok(permit) => {
                let router = router.clone();
                let shutdown = shutdown.clone();
                tracker.spawn(async move {
                    serve_connection(stream, router, shutdown, config).await;
                    drop(permit);
                });
            }
            Err(_) => {
                metrics::counter!("stockd_http_connections_refused_total").increment(1);
                tracker.spawn(refuse(stream));
            }
        }
    }
    // Closed now, not when the grace ends: a client connecting during the grace is
    // refused at once and goes to another instance, instead of waiting in the kernel's
    // backlog for an accept that never comes.
    drop(listener);
    tracker.close();
    if tokio::time::timeout(grace, tracker.wait()).await.is_ok() {
        Ok(true)
    } else {
        tracing::warn!(
            grace_seconds = grace.as_secs(),
            "requests still running after the grace period"
        );
        Ok(false)
    }
}

async fn serve_connection(
    stream: TcpStream,
    router: Router,
    shutdown: CancellationToken,
    config: ServerConfig,
) {
    let service = TowerToHyperService::new(router);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let finished = tokio::select! {
        finished = connection.as_mut() => finished,
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = finished {
        // Timeouts, resets and half-sent requests are the clients' business.
        tracing::debug!(%error, "connection ended with an error");
    }
}

async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(TOO_MANY_CONNECTIONS).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_declares_its_body_length() {
        let text = std::str::from_utf8(TOO_MANY_CONNECTIONS).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let problem: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(problem["code"], "unavailable");
    }
}

//! stockd over a real socket: serving on port 0 and shutting down gracefully, letting
//! the request in flight finish.

use std::time::Duration;

use acceptance::http::request;
use acceptance::{Backend, TestApp, mirrored_tests, wait_until};
use tokio_util::sync::CancellationToken;

mirrored_tests!(a_shutdown_lets_the_request_in_flight_finish_and_then_stops_serving,);

async fn a_shutdown_lets_the_request_in_flight_finish_and_then_stops_serving(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("GRACE", 2).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(api::server::serve_until(
        listener,
        app.router.clone(),
        shutdown.clone(),
        Duration::from_secs(60),
        api::server::ServerConfig::default(),
    ));
    let health = request(address, "GET", "/healthz", &[], None)
        .await
        .unwrap();
    assert_eq!(health.status, 200);

    // A reservation that blocks on a held row lock is in flight when the signal comes.
    let mut lock = app.database.hold_stock_row_lock("GRACE").await;
    let authorization = format!("Bearer {}", app.service_token);
    let in_flight = tokio::spawn(async move {
        request(
            address,
            "POST",
            "/v1/reservations",
            &[
                ("Idempotency-Key", "during-shutdown"),
                ("Authorization", authorization.as_str()),
            ],
            Some(r#"{"lines":[{"sku":"GRACE","quantity":1}]}"#),
        )
        .await
    });
    wait_until("the reservation is in flight", || {
        app.engine.requests_in_flight() == 1
    })
    .await;
    shutdown.cancel();
    lock.execute("ROLLBACK").await.unwrap();

    let response = in_flight.await.unwrap().unwrap();
    assert_eq!(response.status, 201, "{response:?}");
    assert!(
        server.await.unwrap().unwrap(),
        "every request finished in the grace period"
    );
    assert!(
        request(address, "GET", "/healthz", &[], None)
            .await
            .is_err(),
        "no longer serving"
    );
    assert_eq!(app.counters("GRACE").await, (1, 1));
}

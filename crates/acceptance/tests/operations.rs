//! What operators rely on: health, readiness, metrics, the audit catching tampering,
//! the append-only ledger, and the API description.

use acceptance::{Backend, Call, TestApp, mirrored_tests, mirrored_tests_alone};

mirrored_tests_alone!(
    metrics_report_latency_histograms_and_outcomes_by_code,
    counters_of_rare_events_an_alert_watches_are_shown_at_zero_before_the_first_event,
    the_stores_database_connections_send_small_packets_at_once,
);

mirrored_tests!(
    health_and_readiness_answer_when_the_database_is_reachable,
    the_audit_reports_a_counter_changed_behind_the_ledgers_back,
    the_audit_reports_a_reservation_whose_stock_was_returned_twice,
    the_audit_reports_reserved_stock_that_neither_ledger_nor_reservations_account_for,
    the_audit_reports_ledger_rows_of_a_stock_row_that_does_not_exist,
    the_ledger_refuses_updates_and_deletes,
    unknown_routes_and_methods_answer_with_problem_documents,
    the_pages_and_their_assets_carry_the_browser_security_headers,
);

async fn health_and_readiness_answer_when_the_database_is_reachable(backend: Backend) {
    let app = TestApp::spawn(backend).await;

    let health = app.send(Call::get("/healthz")).await;
    let ready = app.send(Call::get("/readyz")).await;

    assert_eq!(health.status, 200);
    assert_eq!(ready.status, 200);
    let expected = match backend {
        Backend::Sqlite => "sqlite",
        Backend::Postgres => "postgres",
        Backend::Mysql => "mysql",
    };
    assert_eq!(ready.json()["database"], expected);

    app.store.close().await;
    let closed = app.send(Call::get("/readyz")).await;
    assert_eq!(closed.status, 503);
    assert_eq!(closed.code().as_deref(), Some("unavailable"));
}

async fn metrics_report_latency_histograms_and_outcomes_by_code(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("METERED", 1).await;
    assert_eq!(app.reserve("first", &[("METERED", 1)]).await.status, 201);
    assert_eq!(app.reserve("second", &[("METERED", 1)]).await.status, 409);
    assert_eq!(app.reserve("third", &[("METERED", 1)]).await.status, 409);
    let invented = axum::http::Method::from_bytes(b"BREW").unwrap();
    let brewed = app.send(Call::new(invented, "/v1/reservations")).await;
    assert_eq!(brewed.status, 405);

    let metrics = app.send(Call::get("/metrics").admin()).await;

    assert_eq!(metrics.status, 200);
    let text = metrics.body;
    assert!(
        text.contains(r#"stockd_http_request_duration_seconds_bucket{route="/v1/reservations",method="POST",le="0.005"}"#),
        "latency is a histogram with buckets per route:\n{text}"
    );
    assert!(
        text.contains(r#"stockd_http_responses_total{route="/v1/reservations",method="POST",status="409",code="insufficient_stock"} 2"#),
        "outcomes are counted by code, each series every time:\n{text}"
    );
    assert!(
        text.contains(r#"stockd_http_responses_total{route="/v1/reservations",method="POST",status="201",code="none"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"stockd_http_responses_total{route="/v1/reservations",method="other",status="405""#
        ),
        "a method the server does not know is counted as other:\n{text}"
    );
    assert!(
        !text.contains("BREW"),
        "an invented method never becomes a label:\n{text}"
    );
    assert!(
        text.contains(r#"stockd_reservations{status="RESERVED"} 1"#),
        "the one open hold:\n{text}"
    );
    assert!(text.contains("stockd_expiry_backlog"), "{text}");
    assert!(
        text.contains(r#"stockd_combiner_batch_size_bucket{le="1"}"#),
        "batch sizes are a histogram with buckets:\n{text}"
    );
    assert!(
        text.contains("stockd_combiner_wait_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains(r#"stockd_combiner_queue_depth{shard="0"} "#),
        "the queue's depth, through its kept handle:\n{text}"
    );
    // The first sold-out answer needed the batch transaction; on PostgreSQL the sale
    // before it fitted whole and took the one-round-trip path (the others have none).
    // The second came from this process's memory, without a batch.
    let (transactions, one_round_trips) = match backend {
        Backend::Sqlite | Backend::Mysql => (2, 0),
        Backend::Postgres => (1, 1),
    };
    assert!(
        text.contains("stockd_sold_out_from_memory_total 1"),
        "the second sold-out answer, from memory:\n{text}"
    );
    assert!(
        text.contains(&format!(
            r#"stockd_combiner_batches_total{{path="transaction"}} {transactions}"#
        )),
        "batches are counted by the path they took:\n{text}"
    );
    assert_eq!(
        text.contains(r#"stockd_combiner_batches_total{path="one_round_trip"}"#),
        one_round_trips > 0,
        "{text}"
    );
    if one_round_trips > 0 {
        assert!(
            text.contains(&format!(
                r#"stockd_combiner_batches_total{{path="one_round_trip"}} {one_round_trips}"#
            )),
            "{text}"
        );
    }
}

async fn counters_of_rare_events_an_alert_watches_are_shown_at_zero_before_the_first_event(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;

    let metrics = app.send(Call::get("/metrics").admin()).await;

    assert_eq!(metrics.status, 200);
    // Prometheus sees no increase in a series born at 1: the first event would not
    // alert. Each test runs in a process of its own, where no such event happened.
    for name in api::metrics::ALERTED_EVENT_COUNTERS {
        assert!(
            metrics.body.lines().any(|line| line == format!("{name} 0")),
            "{name} is shown at 0:\n{}",
            metrics.body
        );
    }
}

async fn the_audit_reports_a_counter_changed_behind_the_ledgers_back(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TAMPERED", 5).await;
    app.assert_audit_clean().await;

    let mut connection = app.database.raw_connection().await;
    let changed = connection
        .execute("UPDATE stock SET available = available + 1 WHERE sku = 'TAMPERED'")
        .await
        .unwrap();
    assert_eq!(changed, 1);

    let audit = app.audit().await;
    assert_eq!(audit["ok"], false);
    assert_eq!(audit["differences_total"], 1);
    let difference = &audit["differences"][0];
    assert_eq!(difference["check"], "ledger_vs_available");
    assert_eq!(difference["sku"], "TAMPERED");
    assert_eq!(difference["expected"], 5);
    assert_eq!(difference["actual"], 6);
}

/// The checks of one audit, in the order it reports them.
fn audit_checks(audit: &serde_json::Value) -> Vec<(String, String, i64, i64)> {
    audit["differences"]
        .as_array()
        .expect("differences")
        .iter()
        .map(|difference| {
            (
                difference["check"].as_str().unwrap_or_default().to_owned(),
                difference["sku"].as_str().unwrap_or_default().to_owned(),
                difference["expected"].as_i64().unwrap_or_default(),
                difference["actual"].as_i64().unwrap_or_default(),
            )
        })
        .collect()
}

async fn the_audit_reports_reserved_stock_that_neither_ledger_nor_reservations_account_for(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CLEAN", 5).await;
    app.stocked_sku("HELD", 5).await;
    assert_eq!(app.reserve("hold", &[("HELD", 2)]).await.status, 201);
    app.assert_audit_clean().await;

    let mut connection = app.database.raw_connection().await;
    connection
        .execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'HELD'")
        .await
        .unwrap();

    let audit = app.audit().await;
    assert_eq!(audit["ok"], false);
    assert_eq!(audit["stock_rows_checked"], 2);
    assert_eq!(
        audit_checks(&audit),
        vec![
            ("ledger_vs_reserved".to_owned(), "HELD".to_owned(), 2, 3),
            (
                "open_reservations_vs_reserved".to_owned(),
                "HELD".to_owned(),
                2,
                3
            ),
        ],
        "{audit:#}"
    );
}

async fn the_audit_reports_ledger_rows_of_a_stock_row_that_does_not_exist(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("REAL", 5).await;
    let mut connection = app.database.raw_connection().await;
    connection
        .execute(
            "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, reference, created_at) \
             VALUES ('GHOST', 'default', 'adjust', 3, 0, 'written-by-hand', 0)",
        )
        .await
        .unwrap();

    let audit = app.audit().await;
    assert_eq!(audit["ok"], false);
    assert_eq!(
        audit_checks(&audit),
        vec![("stock_row_missing".to_owned(), "GHOST".to_owned(), 1, 0)],
        "{audit:#}"
    );
}

async fn the_audit_reports_a_reservation_whose_stock_was_returned_twice(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("DOUBLE", 5).await;
    app.stocked_sku("BESIDE", 5).await;
    let reservation = app.reserve("hold", &[("DOUBLE", 2)]).await.json();
    let id = reservation["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.release(&id, "release").await.status, 200);
    // A sound reservation of two lines beside it: the audit reads every line.
    let beside = app.reserve("beside", &[("DOUBLE", 1), ("BESIDE", 1)]).await;
    assert_eq!(beside.status, 201, "{beside:?}");

    // A buggy second release, written straight into the database: counters and ledger
    // agree with each other, but not with the reservation.
    let mut connection = app.database.raw_connection().await;
    connection
        .execute("UPDATE stock SET available = available + 2 WHERE sku = 'DOUBLE'")
        .await
        .unwrap();
    connection
        .execute(&format!(
            "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, reference, created_at) \
             VALUES ('DOUBLE', 'default', 'release', 2, 0, '{id}', 0)"
        ))
        .await
        .unwrap();

    let audit = app.audit().await;
    assert_eq!(audit["ok"], false);
    let checks: Vec<&str> = audit["differences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|difference| difference["check"].as_str().unwrap())
        .collect();
    assert_eq!(checks, vec!["reservation_ledger_available"], "{audit:#}");
    assert_eq!(audit["differences"][0]["reference"], id.as_str());
    assert_eq!(audit["reservation_lines_checked"], 3);
    assert_eq!(audit["orders_checked"], 0);
}

async fn the_ledger_refuses_updates_and_deletes(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LEDGER", 5).await;
    let mut connection = app.database.raw_connection().await;

    let update = connection
        .execute("UPDATE stock_ledger SET available_delta = 500")
        .await;
    let delete = connection.execute("DELETE FROM stock_ledger").await;

    assert!(update.unwrap_err().contains("append-only"));
    assert!(delete.unwrap_err().contains("append-only"));
    if backend == Backend::Postgres {
        // Found in review: TRUNCATE fires no row trigger. MySQL fires none at all on
        // TRUNCATE (its guard is the role's privileges), and SQLite has no TRUNCATE.
        let truncate = connection.execute("TRUNCATE stock_ledger").await;
        assert!(truncate.unwrap_err().contains("append-only"));
    }
    assert_eq!(app.ledger_rows("LEDGER", "receive").await, 1);
    app.assert_audit_clean().await;
}

async fn unknown_routes_and_methods_answer_with_problem_documents(backend: Backend) {
    let app = TestApp::spawn(backend).await;

    let unknown = app.send(Call::get("/v1/nothing-here")).await;
    let wrong_method = app
        .send(Call::new(axum::http::Method::DELETE, "/v1/reservations"))
        .await;

    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.code().as_deref(), Some("not_found"));
    assert_eq!(wrong_method.status, 405);
    assert_eq!(wrong_method.content_type(), "application/problem+json");
}

#[test]
fn the_openapi_document_describes_every_route() {
    let document: serde_json::Value = serde_json::from_str(&api::openapi::DOCUMENT).unwrap();
    let paths = document["paths"].as_object().unwrap();
    for route in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
        "/v1/skus/{sku}",
        "/v1/skus/{sku}/stock-movements",
        "/v1/reservations",
        "/v1/reservations/{id}",
        "/v1/reservations/{id}/confirm",
        "/v1/reservations/{id}/release",
        "/v1/audit",
        "/v1/products",
        "/v1/products/{id}",
        "/v1/admin/products/{id}",
        "/v1/admin/shelf",
        "/v1/admin/shelf-log",
        "/v1/admin/operators",
        "/v1/carts/{user}/items/{sku}",
        "/v1/carts/{user}",
        "/v1/carts/{user}/checkout",
        "/v1/orders",
        "/v1/orders/{id}",
        "/v1/orders/{id}/pay",
        "/v1/orders/{id}/cancel",
        "/v1/orders/{id}/return",
        "/v1/orders/{id}/refunds/{refund_id}/resolve",
        "/v1/payments/webhook",
    ] {
        assert!(
            paths.contains_key(route),
            "{route} is missing from openapi.json"
        );
    }
    let codes: Vec<&str> = document["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|code| code.as_str().unwrap())
        .collect();
    for code in domain::ErrorCode::ALL {
        assert!(
            codes.contains(&code.as_str()),
            "{code} is missing from openapi.json"
        );
    }
}

/// Every socket of this process connected to `port`, each as a duplicate of its
/// descriptor (`pidfd_getfd`): the store's pooled connections among them. A descriptor
/// closed since the directory was read is passed over; any other failure (a kernel or
/// sandbox without `pidfd_getfd`) is the test's, named.
fn sockets_to(port: u16) -> Vec<std::os::fd::OwnedFd> {
    use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
    let this_process = pidfd_open(getpid(), PidfdFlags::empty())
        .unwrap_or_else(|error| panic!("pidfd_open of this process: {error}"));
    let descriptors = std::fs::read_dir("/proc/self/fd").expect("the process's descriptors");
    descriptors
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|descriptor| {
            match pidfd_getfd(&this_process, descriptor, PidfdGetfdFlags::empty()) {
                Ok(duplicate) => Some(duplicate),
                Err(rustix::io::Errno::BADF) => None,
                Err(error) => panic!("pidfd_getfd of descriptor {descriptor}: {error}"),
            }
        })
        .filter(|socket| {
            let peer = rustix::net::getpeername(socket).ok().flatten();
            peer.and_then(|peer| std::net::SocketAddr::try_from(peer).ok())
                .is_some_and(|peer| peer.port() == port)
        })
        .collect()
}

/// Whether a database URL reaches its server through a Unix socket: no host, a `host`
/// option naming a directory (PostgreSQL), or a `socket` option (MySQL).
fn through_a_unix_socket(url: &reqwest::Url) -> bool {
    url.host_str().is_none_or(str::is_empty)
        || url
            .query_pairs()
            .any(|(name, value)| (name == "host" && value.starts_with('/')) || name == "socket")
}

/// Nagle's algorithm holds a small packet sent while an earlier one is unacknowledged.
/// MySQL's `COM_STMT_CLOSE` (sent when the statement cache evicts) has no reply, so
/// the statement sent right after it waited for the server's delayed ACK, about 40 ms:
/// a flash sale on MariaDB ran at a sixth of its rate (docs/BENCHMARKS.md, thirty-
/// seventh session). Every connection to the database must send at once. In a process
/// of its own, so only this app's connections are seen; a socket is checked until its
/// option is set, as sqlx sets it just after the connect (one opened meanwhile passes
/// through that moment; one without the option never passes).
async fn the_stores_database_connections_send_small_packets_at_once(backend: Backend) {
    if backend == Backend::Sqlite {
        return; // a file, no socket
    }
    let app = TestApp::spawn(backend).await;
    let url = reqwest::Url::parse(&app.database.url).expect("the database URL");
    if through_a_unix_socket(&url) {
        return; // no TCP, no Nagle
    }
    app.stocked_sku("TEA", 5).await;
    assert_eq!(app.reserve("nagle", &[("TEA", 1)]).await.status, 201);
    let port = url.port().unwrap_or(match backend {
        Backend::Mysql => 3306,
        _ => 5432,
    });

    let sockets = sockets_to(port);

    assert!(!sockets.is_empty(), "no socket to port {port} found");
    acceptance::wait_until("every connection to the database has TCP_NODELAY", || {
        sockets
            .iter()
            .all(|socket| rustix::net::sockopt::tcp_nodelay(socket).unwrap_or(false))
    })
    .await;
}

/// The console's pages hold a staff token: they are never framed (the policy's
/// `frame-ancestors`, and X-Frame-Options for browsers that predate it), load scripts
/// only from this origin, load images from nowhere else (a remote image is a way out
/// for a token), are never sniffed as another type and send no referrer.
async fn the_pages_and_their_assets_carry_the_browser_security_headers(backend: Backend) {
    let app = TestApp::spawn(backend).await;

    for path in ["/", "/console", "/assets/console.js", "/docs"] {
        let page = app.send(Call::get(path).anonymous()).await;

        assert_eq!(page.status, 200, "{path}");
        let policy = page.header("content-security-policy").unwrap_or_default();
        assert!(
            policy.contains("frame-ancestors 'none'")
                && policy.contains("script-src 'self'")
                && policy.contains("img-src 'self' data:;"),
            "{path}: {policy}"
        );
        assert_eq!(page.header("x-frame-options"), Some("DENY"), "{path}");
        assert_eq!(
            page.header("x-content-type-options"),
            Some("nosniff"),
            "{path}"
        );
        assert_eq!(
            page.header("referrer-policy"),
            Some("no-referrer"),
            "{path}"
        );
    }
}

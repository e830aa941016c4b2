//! The database metrics of seed 002 §九 that exist so far (issue 17, in part): time in
//! the database per unit of work, duplicate requests, requests in progress, the pools'
//! connections and waiters, and stock rows below zero — each moved by a test that
//! provokes it. Each test runs in a process of its own (the metrics recorder is
//! process-wide).

use acceptance::{Backend, Call, TestApp, mirrored_tests_alone, test_engine_config};

mirrored_tests_alone!(
    a_unit_of_work_is_timed_in_the_store_histogram,
    a_repeated_key_counts_as_a_duplicate_request,
    a_request_waiting_on_a_lock_is_in_progress,
    the_pool_gauges_show_its_connections_and_no_waiter_when_idle,
    requests_that_find_every_connection_taken_are_counted_as_waiting,
    a_stock_row_written_below_zero_around_the_constraints_is_counted,
);

async fn metrics(app: &TestApp) -> String {
    let page = app.send(Call::get("/metrics").admin()).await;
    assert_eq!(page.status, 200);
    page.body
}

/// The sum of a metric's samples whose name and labels start with `prefix`.
fn sample(page: &str, prefix: &str) -> f64 {
    page.lines()
        .filter(|line| line.starts_with(prefix))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn a_unit_of_work_is_timed_in_the_store_histogram(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    assert_eq!(app.reserve("timed", &[("TEA", 1)]).await.status, 201);

    let page = metrics(&app).await;

    assert!(
        sample(
            &page,
            "stockd_store_operation_duration_seconds_count{operation=\"reserve\"}"
        ) >= 1.0,
        "{page}"
    );
    assert!(
        page.contains("stockd_store_operation_duration_seconds_bucket{operation=\"reserve\",le=")
    );
}

async fn a_repeated_key_counts_as_a_duplicate_request(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    assert_eq!(app.reserve("twice", &[("TEA", 1)]).await.status, 201);
    let before = sample(&metrics(&app).await, "stockd_duplicate_requests_total");

    let again = app.reserve("twice", &[("TEA", 1)]).await;

    assert!(again.replayed());
    let after = sample(&metrics(&app).await, "stockd_duplicate_requests_total");
    assert_eq!(after - before, 1.0);
}

async fn a_request_waiting_on_a_lock_is_in_progress(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let idle = sample(&metrics(&app).await, "stockd_requests_in_progress");
    let mut lock = app.database.hold_stock_row_lock("TEA").await;
    let waiting = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("waits", &[("TEA", 1)]).await })
    };
    app.database.wait_until_blocked_by(&mut lock).await;
    if backend == Backend::Sqlite {
        // SQLite's writers queue inside the process: wait until the request is in.
        acceptance::wait_until_async("the request is in progress", || {
            let app = app.clone();
            async move { sample(&metrics(&app).await, "stockd_requests_in_progress") > idle }
        })
        .await;
    }

    let during = sample(&metrics(&app).await, "stockd_requests_in_progress");

    lock.execute("ROLLBACK").await.unwrap();
    let answered = waiting.await.unwrap();
    assert!(
        answered.status == 201 || answered.status == 503,
        "{answered:?}"
    );
    assert!(during >= idle + 1.0, "waiting {during}, idle {idle}");
    assert_eq!(
        sample(&metrics(&app).await, "stockd_requests_in_progress"),
        idle
    );
}

async fn the_pool_gauges_show_its_connections_and_no_waiter_when_idle(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;

    let page = metrics(&app).await;

    let open = sample(&page, "stockd_db_pool_connections{state=\"active\"}")
        + sample(&page, "stockd_db_pool_connections{state=\"idle\"}");
    assert!(open >= 1.0, "{page}");
    assert_eq!(sample(&page, "stockd_db_pool_waiting"), 0.0);
    assert_eq!(sample(&page, "stockd_db_pool_acquire_timeouts_total"), 0.0);
}

async fn a_stock_row_written_below_zero_around_the_constraints_is_counted(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    assert_eq!(app.engine.negative_stock_step().await.unwrap(), 0);
    let mut raw = app.database.raw_connection().await;
    let around = match backend {
        Backend::Sqlite => "PRAGMA ignore_check_constraints = ON",
        Backend::Postgres => "ALTER TABLE stock DROP CONSTRAINT stock_available_check",
        Backend::Mysql => "SET SESSION check_constraint_checks = 0",
    };
    raw.execute(around).await.unwrap();
    raw.execute("UPDATE stock SET available = -1 WHERE sku = 'TEA'")
        .await
        .unwrap();

    let rows = app.engine.negative_stock_step().await.unwrap();

    assert_eq!(rows, 1);
    assert_eq!(
        sample(&metrics(&app).await, "stockd_stock_rows_negative"),
        1.0
    );
}

async fn requests_that_find_every_connection_taken_are_counted_as_waiting(backend: Backend) {
    // A lock bound longer than the test: the waits end when the test releases the row.
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 30_000).await;
    app.stocked_sku("TEA", 5).await;
    let mut lock = app.database.hold_stock_row_lock("TEA").await;
    // Each movement is a unit of work of its own that holds a connection while it
    // waits for the row: more of them than the pool has connections.
    let movements: Vec<_> = (0..40)
        .map(|index| {
            let app = app.clone();
            tokio::spawn(async move {
                app.send(
                    Call::post("/v1/skus/TEA/stock-movements")
                        .admin()
                        .key(format!("waiting-{index}"))
                        .json(&serde_json::json!({"kind": "receive", "quantity": 1})),
                )
                .await
            })
        })
        .collect();

    // Watched in memory: a scrape that started before the waiters queued would wait
    // behind them for the connection its other gauges need.
    acceptance::wait_until("a request waits for a connection", || {
        app.store.pool_usage().waiting >= 1
    })
    .await;
    assert!(sample(&metrics(&app).await, "stockd_db_pool_waiting") >= 1.0);

    lock.execute("ROLLBACK").await.unwrap();
    for movement in movements {
        let answered = movement.await.unwrap();
        assert!(
            answered.status == 201 || answered.status == 503,
            "{answered:?}"
        );
    }
    assert_eq!(sample(&metrics(&app).await, "stockd_db_pool_waiting"), 0.0);
}

//! The database metrics of seed 002 §九: time in the database per unit of work, lock
//! waits, deadlocks, long transactions, stock scans, duplicate requests (and their hot
//! SKUs), requests in progress, the pools' connections and waiters, and stock rows
//! below zero, the instance's clock against the database server's — each moved by a test that provokes it. Each test runs in a process of
//! its own (the metrics recorder is process-wide).

use acceptance::{Backend, Call, TestApp, mirrored_tests_alone, test_engine_config};

mirrored_tests_alone!(
    a_unit_of_work_is_timed_in_the_store_histogram,
    a_repeated_key_counts_as_a_duplicate_request,
    a_request_waiting_on_a_lock_is_in_progress,
    the_pool_gauges_show_its_connections_and_no_waiter_when_idle,
    requests_that_find_every_connection_taken_are_counted_as_waiting,
    a_stock_row_written_below_zero_around_the_constraints_is_counted,
    a_request_that_waits_for_a_held_row_counts_a_lock_wait_and_a_waiting_session,
    a_forced_deadlock_is_counted_and_retried_and_never_reaches_the_caller,
    a_transaction_held_open_past_the_bound_counts_as_long,
    a_sequential_scan_of_the_stock_table_is_counted_or_the_plan_stays_on_the_key,
    duplicates_on_one_sku_are_counted_under_that_sku,
    an_instance_clock_an_hour_off_the_database_server_shows_in_the_skew_gauge,
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

/// Waits until `lock` has blocked the request for well past the lock-wait floor: on
/// PostgreSQL and MySQL by the database's own view of the waiting session. SQLite's
/// writer waits for the file's lock inside stockd's begin, where only the wait itself
/// can be seen (a pool waiter), not its age: there the test holds the lock a few floors
/// longer, which only makes the wait certain, never decides the outcome.
async fn wait_until_the_request_waits(app: &TestApp, lock: &mut acceptance::RawConnection) {
    let well_past_the_floor = store::observe::LOCK_WAIT_FLOOR * 5;
    if app.database.backend == Backend::Sqlite {
        acceptance::wait_until("the request waits for the write lock", || {
            app.store.pool_usage().waiting >= 1
        })
        .await;
        tokio::time::sleep(well_past_the_floor).await;
    } else {
        app.database
            .wait_until_blocked_for(lock, well_past_the_floor)
            .await;
    }
}

async fn a_request_that_waits_for_a_held_row_counts_a_lock_wait_and_a_waiting_session(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let before = sample(
        &metrics(&app).await,
        "stockd_db_lock_waits_total{operation=\"reserve\"}",
    );
    let mut lock = app.database.hold_stock_row_lock("TEA").await;
    let waiting = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("waits", &[("TEA", 1)]).await })
    };
    wait_until_the_request_waits(&app, &mut lock).await;
    let sampled = app.engine.database_activity_step().await.unwrap();

    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(waiting.await.unwrap().status, 201);
    let page = metrics(&app).await;
    // At least the one wait: a statement is counted when it took the floor (10 ms),
    // and on a loaded machine another statement of the same batch can take that long
    // without any lock, so the exact count is the machine's, not stockd's.
    assert!(
        sample(&page, "stockd_db_lock_waits_total{operation=\"reserve\"}") - before >= 1.0,
        "{page}"
    );
    assert!(
        sample(
            &page,
            "stockd_db_lock_wait_seconds_count{operation=\"reserve\"}"
        ) >= 1.0
    );
    match backend {
        // One process writes SQLite: its waiters are the pool's.
        Backend::Sqlite => assert_eq!(sampled.sessions_waiting_on_locks, None),
        Backend::Postgres | Backend::Mysql => {
            assert!(sampled.sessions_waiting_on_locks >= Some(1), "{sampled:?}");
            assert!(sample(&page, "stockd_db_sessions_waiting_on_locks") >= 1.0);
        }
    }
}

async fn a_forced_deadlock_is_counted_and_retried_and_never_reaches_the_caller(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("AAA", 5).await;
    app.stocked_sku("BBB", 5).await;
    if backend == Backend::Sqlite {
        // One writer at a time: opposing orders queue behind each other, no cycle.
        let (forward, backward) = tokio::join!(
            app.create_order("forward", "ann", &[("AAA", 1), ("BBB", 1)]),
            app.create_order("backward", "bob", &[("BBB", 1), ("AAA", 1)]),
        );
        assert_eq!((forward.status, backward.status), (201, 201));
        assert_eq!(
            sample(&metrics(&app).await, "stockd_db_deadlocks_total"),
            0.0
        );
        return;
    }
    let mut raw = app.database.raw_connection().await;
    if backend == Backend::Postgres {
        // The order's session checks for a cycle after the default second; this one
        // much later, so the database rolls the order back, not the test.
        raw.execute("SET deadlock_timeout = '60s'").await.unwrap();
    } else {
        // InnoDB rolls back the lighter transaction: make the test's the heavier.
        raw.execute("CREATE TABLE ballast (id INT PRIMARY KEY)")
            .await
            .unwrap();
    }
    raw.execute("BEGIN").await.unwrap();
    if backend == Backend::Mysql {
        let rows: Vec<String> = (1..=200).map(|id| format!("({id})")).collect();
        raw.execute(&format!(
            "INSERT INTO ballast (id) VALUES {}",
            rows.join(",")
        ))
        .await
        .unwrap();
    }
    raw.execute("UPDATE stock SET available = available WHERE sku = 'BBB'")
        .await
        .unwrap();
    // The order locks AAA, then waits for BBB.
    let order = {
        let app = app.clone();
        tokio::spawn(async move {
            app.create_order("opposed", "ann", &[("AAA", 1), ("BBB", 1)])
                .await
        })
    };
    app.database.wait_until_blocked_by(&mut raw).await;

    // The cycle: the test's transaction now waits for the row the order holds.
    let closing = raw
        .execute("UPDATE stock SET available = available WHERE sku = 'AAA'")
        .await;
    assert!(
        closing.is_ok(),
        "the database rolled the test back: {closing:?}"
    );
    raw.execute("ROLLBACK").await.unwrap();

    let answered = order.await.unwrap();
    assert_eq!(answered.status, 201, "{answered:?}");
    let page = metrics(&app).await;
    assert_eq!(
        sample(
            &page,
            "stockd_db_deadlocks_total{operation=\"create_order\"}"
        ),
        1.0,
        "{page}"
    );
    for sku in ["AAA", "BBB"] {
        let stock = app.sku(sku).await;
        assert_eq!(
            (stock["available"].as_i64(), stock["reserved"].as_i64()),
            (Some(4), Some(1))
        );
    }
}

async fn a_transaction_held_open_past_the_bound_counts_as_long(backend: Backend) {
    let config = engine::EngineConfig {
        long_transaction_milliseconds: 1,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("TEA", 5).await;
    let mut lock = app.database.hold_stock_row_lock("TEA").await;

    if backend == Backend::Sqlite {
        let sampled = app.engine.database_activity_step().await.unwrap();
        assert_eq!(sampled.long_transactions, None, "SQLite shows no sessions");
    } else {
        acceptance::wait_until_async("the held transaction counts as long", || {
            let app = app.clone();
            async move {
                let sampled = app.engine.database_activity_step().await.unwrap();
                sampled.long_transactions >= Some(1)
            }
        })
        .await;
        assert!(sample(&metrics(&app).await, "stockd_db_long_transactions") >= 1.0);
    }
    lock.execute("ROLLBACK").await.unwrap();
}

async fn a_sequential_scan_of_the_stock_table_is_counted_or_the_plan_stays_on_the_key(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let sampled = app.engine.database_activity_step().await.unwrap();
    let deduction = "UPDATE stock SET available = available - 1, reserved = reserved + 1 \
                     WHERE sku = 'TEA' AND warehouse = 'default' AND available >= 1";
    match backend {
        Backend::Postgres => {
            let before = sampled
                .stock_sequential_scans
                .expect("PostgreSQL counts scans");
            // One row: one page, where a scan is the planner's cheapest plan (the
            // alert on scans waits for a table larger than that).
            assert_eq!(sampled.stock_pages, Some(1));
            assert_eq!(sample(&metrics(&app).await, "stockd_db_stock_pages"), 1.0);
            let mut raw = app.database.raw_connection().await;
            // A filter no index can answer; the session's end flushes its statistics.
            raw.execute("SELECT * FROM stock WHERE available + 0 = 5")
                .await
                .unwrap();
            drop(raw);
            acceptance::wait_until_async("the scan is counted", || {
                let app = app.clone();
                async move {
                    let sampled = app.engine.database_activity_step().await.unwrap();
                    sampled.stock_sequential_scans > Some(before)
                }
            })
            .await;
            assert!(
                sample(
                    &metrics(&app).await,
                    "stockd_db_stock_sequential_scans_total"
                ) > before as f64
            );
        }
        Backend::Sqlite | Backend::Mysql => {
            // No per-table scan count here: the deduction's plan is checked instead.
            assert_eq!(sampled.stock_sequential_scans, None);
            assert_eq!(sampled.stock_pages, None);
            let plan = app.database.raw_connection().await.plan_of(deduction).await;
            if backend == Backend::Sqlite {
                assert!(plan.contains("SEARCH stock USING"), "{plan}");
            } else {
                assert!(plan.contains("key=PRIMARY"), "{plan}");
            }
        }
    }
}

async fn duplicates_on_one_sku_are_counted_under_that_sku(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 50).await;
    app.stocked_sku("COLD", 50).await;
    assert_eq!(app.reserve("hot", &[("HOT", 1)]).await.status, 201);
    assert_eq!(app.reserve("cold", &[("COLD", 1)]).await.status, 201);

    for _ in 0..3 {
        assert!(app.reserve("hot", &[("HOT", 1)]).await.replayed());
    }
    assert!(app.reserve("cold", &[("COLD", 1)]).await.replayed());

    let page = metrics(&app).await;
    assert_eq!(
        sample(
            &page,
            "stockd_hot_sku_duplicate_requests_total{sku=\"HOT\"}"
        ),
        3.0,
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            "stockd_hot_sku_duplicate_requests_total{sku=\"COLD\"}"
        ),
        1.0
    );
    assert!(page.contains("# TYPE stockd_hot_sku_duplicate_requests_total counter"));
}

/// The instance's clock an hour ahead, then an hour behind, the database server's: the
/// gauge says so with its sign. The test's clock stands still while the server's runs,
/// so each reading is off by the query's own time, in one known direction; the slack
/// (a minute) only keeps a stalled machine from failing it.
async fn an_instance_clock_an_hour_off_the_database_server_shows_in_the_skew_gauge(
    backend: Backend,
) {
    const HOUR_MILLISECONDS: i64 = 3_600_000;
    const SLACK_MILLISECONDS: i64 = 60_000;
    let app = TestApp::spawn(backend).await;
    let real_now = || {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        i64::try_from(since_epoch.as_millis()).unwrap()
    };
    if backend == Backend::Sqlite {
        // The database is a file of this process, on this machine's clock.
        let sampled = app.engine.database_activity_step().await.unwrap();
        assert_eq!(sampled.clock_ahead_of_database_milliseconds, None);
        assert!(
            !metrics(&app)
                .await
                .contains("stockd_clock_ahead_of_database_seconds")
        );
        return;
    }
    for offset in [HOUR_MILLISECONDS, -HOUR_MILLISECONDS] {
        // A millisecond ahead of the real instant, for the truncation of either clock.
        app.clock.set(domain::Timestamp::from_unix_milliseconds(
            real_now() + offset + 1,
        ));
        let sampled = app.engine.database_activity_step().await.unwrap();
        let ahead = sampled.clock_ahead_of_database_milliseconds.unwrap();
        assert!(
            (offset - SLACK_MILLISECONDS..=offset + 1).contains(&ahead),
            "{offset} ms off, read {ahead} ms"
        );
        let gauge = sample(
            &metrics(&app).await,
            "stockd_clock_ahead_of_database_seconds",
        );
        assert_eq!(gauge, ahead as f64 / 1000.0);
    }
}

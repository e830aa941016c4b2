//! Contention and batches: a lock held too long is reported, not waited out; and the
//! store's batch call decides each request on its own.

use acceptance::{Backend, Call, TestApp, mirrored_tests, test_engine_config, wait_until};
use domain::{
    IdempotencyKey, Principal, Quantity, ReservationId, ReservationLine, ShopCode, SkuCode,
    WarehouseCode,
};
use store::{IdempotencyClaim, Idempotent, ReserveRequest, ScopedKey, ShopScope};

mirrored_tests!(
    a_lock_held_past_the_lock_timeout_answers_lock_timeout_and_changes_nothing,
    each_request_in_a_reservation_batch_succeeds_or_fails_on_its_own,
    a_full_reservation_queue_answers_429_at_once_and_changes_nothing,
    a_batch_that_fits_whole_is_written_in_one_round_trip_on_postgresql,
    a_key_repeated_in_a_batch_after_its_answer_was_stored_replays_that_answer,
    closing_a_pool_of_its_own_leaves_the_store_it_came_from_open,
    the_pool_gauges_count_the_combiners_own_connections_with_the_stores,
    a_sku_locked_past_the_bound_fails_only_its_own_requests_in_a_batch,
    a_request_whose_row_breaks_the_batch_fails_alone,
    a_request_that_timed_out_on_several_rows_condemns_none_of_them_for_the_others,
    a_short_finding_is_dated_when_its_request_was_sent_not_answered,
    a_batch_of_more_shoppers_units_than_one_statement_takes_is_decided_whole,
    a_hold_lasts_its_ttl_from_when_its_batch_is_decided_not_from_its_arrival,
    first_receipts_into_a_new_warehouse_at_once_all_count,
    a_reservation_takes_no_exclusive_lock_on_its_skus_row_nor_on_other_skus_stock,
    a_database_turned_read_only_answers_503_and_the_retry_succeeds_once_it_is_writable,
    an_order_expiry_step_locks_only_the_orders_it_claims,
);

/// Makes the shared MySQL server writable again when dropped, even by a panic: its
/// global `read_only` would hold back every account without `READ_ONLY ADMIN`.
struct WritableAgain;

impl Drop for WritableAgain {
    fn drop(&mut self) {
        let _ = std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                use sqlx::Connection;
                if let Ok(mut root) = sqlx::MySqlConnection::connect(&acceptance::mysql_url()).await
                {
                    let _ = sqlx::query("SET GLOBAL read_only = OFF")
                        .execute(&mut root)
                        .await;
                }
            });
        })
        .join();
    }
}

/// Found in review: MySQL's "the server is read-only" (error 1290: a demoted primary,
/// a switchover) answered 500 `internal`, where PostgreSQL's 25006 answers 503 with
/// `Retry-After`: a client was told to give up while the writer changed. The server
/// is made read-only for an account of the test's own (the global `read_only` spares
/// accounts with `READ_ONLY ADMIN`, such as the root every other test uses).
async fn a_database_turned_read_only_answers_503_and_the_retry_succeeds_once_it_is_writable(
    backend: Backend,
) {
    if backend != Backend::Mysql {
        // PostgreSQL's read-only refusal is mapped the same way (25006, in
        // `postgres.rs`); a read-only role would need the shared test database's
        // roles changed. SQLite has no read-only server.
        return;
    }
    let mut database = acceptance::TestDatabase::create(backend).await;
    let schema = database.schema.clone().expect("a MySQL test database");
    let account = format!("writer_{}", &schema[schema.len() - 8..]);
    // Root's session, opened before the app's URL names the test's account.
    let mut root = database.raw_connection().await;
    root.execute(&format!(
        "CREATE USER '{account}'@'%' IDENTIFIED BY 'writer-password'"
    ))
    .await
    .unwrap();
    root.execute(&format!(
        "GRANT ALL PRIVILEGES ON {schema}.* TO '{account}'@'%'"
    ))
    .await
    .unwrap();
    let server = acceptance::mysql_url();
    let address = server.rsplit('@').next().unwrap().trim_end_matches('/');
    database.url = format!("mysql://{account}:writer-password@{address}/{schema}");
    let app = TestApp::on(
        std::sync::Arc::new(database),
        engine::ManualClock::new(acceptance::START),
        test_engine_config(),
    )
    .await;
    app.stocked_sku("DEMOTED", 3).await;
    let before = app.contents_except_idempotency_records().await;

    let _writable_again = WritableAgain;
    root.execute("SET GLOBAL read_only = ON").await.unwrap();
    let refused = app.reserve("while-read-only", &[("DEMOTED", 1)]).await;
    let unchanged = app.contents_except_idempotency_records().await;
    root.execute("SET GLOBAL read_only = OFF").await.unwrap();
    let retried = app.reserve("while-read-only", &[("DEMOTED", 1)]).await;
    root.execute(&format!("DROP USER '{account}'@'%'"))
        .await
        .unwrap();

    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("unavailable"));
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(
        unchanged, before,
        "nothing changed while the server was read-only"
    );
    assert_eq!(retried.status, 201, "{retried:?}");
    assert_eq!(app.counters("DEMOTED").await, (2, 1));
    app.assert_audit_clean().await;
}

/// The first receipt into a (SKU, warehouse) creates its stock row. Receipts arriving
/// together each find no row; all but one then meet the row another just inserted.
/// On MySQL that meeting read as "the bound is exceeded", and the refusal was stored
/// under the key: goods that arrived never reached the counters, even on retry.
/// There the test makes the meeting certain: a gap lock where the row will go holds
/// every receipt's insert (each has found no row) until two of them wait.
async fn first_receipts_into_a_new_warehouse_at_once_all_count(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.create_sku("ARRIVING").await;
    let mut gap = None;
    if backend == Backend::Mysql {
        let mut holder = app.database.raw_connection().await;
        holder
            .execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .await
            .unwrap();
        holder.execute("BEGIN").await.unwrap();
        holder
            .execute(
                "SELECT * FROM stock WHERE sku = 'ARRIVING' AND warehouse = 'dock-7' FOR UPDATE",
            )
            .await
            .unwrap();
        gap = Some(holder);
    }
    let receipts: u32 = 40;
    let calls: Vec<Call> = (0..receipts)
        .map(|index| {
            Call::post("/v1/skus/ARRIVING/stock-movements")
                .admin()
                .key(format!("receipt-{index}"))
                .json(&serde_json::json!({"kind": "receive", "quantity": 1, "warehouse": "dock-7"}))
        })
        .collect();
    let sending = tokio::spawn({
        let app = app.clone();
        async move { acceptance::send_concurrently(&app, calls).await }
    });
    if let Some(mut holder) = gap {
        wait_until_inserts_wait(&app, 2).await;
        holder.execute("COMMIT").await.unwrap();
    }
    let answers = sending.await.unwrap();
    for answer in &answers {
        assert_eq!(answer.status, 201, "{answer:?}");
    }
    let shown = app
        .send(Call::get("/v1/skus/ARRIVING").admin())
        .await
        .json();
    assert_eq!(shown["available"], i64::from(receipts), "{shown}");
    app.assert_audit_clean().await;
}

/// Until `count` sessions of the test's MySQL database wait in an `INSERT INTO stock`.
async fn wait_until_inserts_wait(app: &TestApp, count: i64) {
    let database = app
        .database
        .schema
        .clone()
        .expect("MySQL tests use a database");
    let observer = sqlx::MySqlPool::connect(&app.database.url)
        .await
        .expect("observer connection");
    let (observer, database) = (&observer, database.as_str());
    acceptance::wait_until_async("the receipts wait on the gap lock", || async move {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE DB = ? AND INFO LIKE 'INSERT INTO stock %' AND TIME_MS > 20",
        )
        .bind(database)
        .fetch_one(observer)
        .await
        .expect("observe the waiting inserts");
        waiting >= count
    })
    .await;
    observer.close().await;
}

async fn a_lock_held_past_the_lock_timeout_answers_lock_timeout_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 100).await;
    app.stocked_sku("HELD", 5).await;
    let before = app.contents().await;
    let mut lock = app.database.hold_stock_row_lock("HELD").await;

    let response = app.reserve("blocked", &[("HELD", 1)]).await;

    assert_eq!(response.status, 503, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("lock_timeout"));
    assert_eq!(response.headers.get("retry-after").unwrap(), "1");
    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(
        app.contents().await,
        before,
        "nothing was stored, not even the key"
    );
    let retry = app.reserve("blocked", &[("HELD", 1)]).await;
    assert_eq!(retry.status, 201, "the same key runs once the lock is gone");
    assert!(!retry.replayed());
}

/// On PostgreSQL the combiner reserves through a pool of its own on a thread of its
/// own; the store it came from, and its replicas, outlive that pool.
async fn closing_a_pool_of_its_own_leaves_the_store_it_came_from_open(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("OWN", 3).await;
    match app.store.with_own_pool(1) {
        None => assert_ne!(
            backend,
            Backend::Postgres,
            "SQLite shares its one writer and MySQL its pool; PostgreSQL has a pool of its own"
        ),
        Some(own) => {
            assert_eq!(own.negative_stock_rows().await.expect("read through it"), 0);
            own.close().await;
            assert!(
                own.negative_stock_rows().await.is_err(),
                "its own pool is closed"
            );
            assert_eq!(
                app.store
                    .negative_stock_rows()
                    .await
                    .expect("the store is open"),
                0
            );
        }
    }

    let response = app.reserve("after-own-pool", &[("OWN", 1)]).await;

    assert_eq!(response.status, 201, "{response:?}");
    assert_eq!(app.counters("OWN").await, (2, 1), "available, reserved");
}

/// `stockd_db_pool_connections` counts every connection the process holds to the
/// database: on PostgreSQL the combiner's own with the store's (an operator sizing
/// `max_connections` reads it).
async fn the_pool_gauges_count_the_combiners_own_connections_with_the_stores(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("GAUGED", 3).await;
    let response = app.reserve("gauged", &[("GAUGED", 1)]).await;
    assert_eq!(response.status, 201, "{response:?}");

    match app.engine.combiner_pool_usage() {
        None => assert_ne!(
            backend,
            Backend::Postgres,
            "PostgreSQL's combiner reserves through a pool of its own"
        ),
        Some(own) => {
            let own_connections = own.active + own.idle;
            assert!(
                own_connections >= 1,
                "the batch's connection stays open: {own:?}"
            );
            // Read before the sum: the store's pool may only grow meanwhile.
            let store = app.store.pool_usage();
            let all = app.engine.pool_usage();
            assert!(
                all.active + all.idle >= store.active + store.idle + own_connections,
                "the store's connections and the combiner's together: {all:?}, the store's {store:?}, the combiner's {own:?}"
            );
        }
    }
}

fn request(key: &str, fingerprint: &str, lines: &[(&str, i64)], random: u64) -> ReserveRequest {
    let now = acceptance::START;
    ReserveRequest {
        claim: IdempotencyClaim {
            key: ScopedKey::new(&Principal::Admin, &IdempotencyKey::parse(key).unwrap()),
            fingerprint: fingerprint.to_owned(),
        },
        id: ReservationId::generate(now, random),
        lines: lines
            .iter()
            .map(|(sku, quantity)| ReservationLine {
                sku: SkuCode::parse(sku).unwrap(),
                warehouse: WarehouseCode::default_warehouse(),
                quantity: Quantity::new(*quantity).unwrap(),
            })
            .collect(),
        ttl_seconds: 60,
        // The SKUs these tests reserve are standalone, of shop `default`.
        shop: ShopScope::Verified(ShopCode::default_shop()),
        user: None,
        reference: domain::OrderReference::default(),
        undecided_when_short: false,
    }
}

fn status_and_code(outcome: &Idempotent) -> (&'static str, u16, Option<String>) {
    let (kind, response) = match outcome {
        Idempotent::Executed(response) => ("executed", response),
        Idempotent::Replayed(response) => ("replayed", response),
        Idempotent::KeyReused => return ("key_reused", 0, None),
        Idempotent::Forbidden(_) => return ("forbidden", 403, None),
        Idempotent::Undecided => return ("undecided", 0, None),
    };
    let body: serde_json::Value = serde_json::from_str(&response.body).unwrap();
    (
        kind,
        response.status,
        body["code"].as_str().map(str::to_owned),
    )
}

async fn each_request_in_a_reservation_batch_succeeds_or_fails_on_its_own(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("A", 3).await;
    app.stocked_sku("B", 1).await;
    // As the admin: the batch below claims its keys in the admin's key space.
    let earlier = app
        .send(
            Call::post("/v1/reservations")
                .admin()
                .key("earlier")
                .json(&serde_json::json!({"lines": [{"sku": "B", "quantity": 1}]})),
        )
        .await;
    assert_eq!(earlier.status, 201, "{earlier:?}");
    let batch = vec![
        request("first", "f1", &[("A", 2)], 1),
        request("too-many", "f2", &[("A", 2)], 2),
        request("unknown", "f3", &[("NOPE", 1)], 3),
        request("one-left", "f4", &[("A", 1)], 4),
        request("first", "f1", &[("A", 2)], 5),
        request("first", "different", &[("A", 1)], 6),
        request("earlier", "not-the-same", &[("B", 1)], 7),
        request("b-sold-out", "f8", &[("A", 1), ("B", 1)], 8),
    ];

    let applied = app
        .store
        .reserve_batch(
            &batch,
            acceptance::START,
            api::renderer().as_ref(),
            &mut store::LockTurn::free(),
        )
        .await
        .unwrap();
    // Not every request fits: the batch is decided request by request.
    assert_eq!(applied.path, store::BatchPath::Transaction);
    let outcomes = applied.outcomes;

    let summary: Vec<_> = outcomes.iter().map(status_and_code).collect();
    assert_eq!(
        summary,
        vec![
            ("executed", 201, None),
            ("executed", 409, Some("insufficient_stock".to_owned())),
            ("executed", 404, Some("not_found".to_owned())),
            ("executed", 201, None),
            ("replayed", 201, None),
            ("key_reused", 0, None),
            ("key_reused", 0, None),
            ("executed", 409, Some("insufficient_stock".to_owned())),
        ]
    );
    let Idempotent::Executed(first) = &outcomes[0] else {
        unreachable!()
    };
    let Idempotent::Replayed(duplicate) = &outcomes[4] else {
        unreachable!()
    };
    assert_eq!(
        first, duplicate,
        "a key repeated inside a batch gets the first answer"
    );
    assert_eq!(app.counters("A").await, (0, 3));
    assert_eq!(app.counters("B").await, (0, 1));
    assert_eq!(app.ledger_rows("A", "reserve").await, 2);
    app.assert_audit_clean().await;
}

async fn reserve_batch(app: &TestApp, batch: &[ReserveRequest]) -> store::BatchApplied {
    app.store
        .reserve_batch(
            batch,
            acceptance::START,
            api::renderer().as_ref(),
            &mut store::LockTurn::free(),
        )
        .await
        .unwrap()
}

async fn a_batch_that_fits_whole_is_written_in_one_round_trip_on_postgresql(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("A", 10).await;
    app.stocked_sku("B", 3).await;
    let batch = vec![
        request("one", "f1", &[("A", 2)], 1),
        request("two", "f2", &[("A", 3), ("B", 3)], 2),
        request("three", "f3", &[("A", 5)], 3),
        request("one", "f1", &[("A", 2)], 4),
    ];

    let applied = reserve_batch(&app, &batch).await;

    let expected_path = match backend {
        Backend::Postgres => store::BatchPath::OneRoundTrip,
        Backend::Sqlite | Backend::Mysql => store::BatchPath::Transaction,
    };
    assert_eq!(applied.path, expected_path);
    let summary: Vec<_> = applied.outcomes.iter().map(status_and_code).collect();
    assert_eq!(
        summary,
        vec![
            ("executed", 201, None),
            ("executed", 201, None),
            ("executed", 201, None),
            ("replayed", 201, None),
        ]
    );
    assert_eq!(app.counters("A").await, (0, 10));
    assert_eq!(app.counters("B").await, (0, 3));
    assert_eq!(app.ledger_rows("A", "reserve").await, 3);
    assert_eq!(app.ledger_rows("B", "reserve").await, 1);
    app.assert_audit_clean().await;

    // The same requests again: every key has its record now, so the batch replays
    // (on PostgreSQL the fast path sees the keys and leaves the batch to the
    // transaction, which replays them).
    let again = reserve_batch(&app, &batch[..3]).await;

    assert_eq!(again.path, store::BatchPath::Transaction);
    for (first, replay) in applied.outcomes.iter().zip(&again.outcomes) {
        let Idempotent::Executed(first) = first else {
            unreachable!()
        };
        assert_eq!(replay, &Idempotent::Replayed(first.clone()));
    }
    assert_eq!(app.counters("A").await, (0, 10));
    assert_eq!(app.ledger_rows("A", "reserve").await, 3);
}

async fn a_key_repeated_in_a_batch_after_its_answer_was_stored_replays_that_answer(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("A", 5).await;
    let stored = reserve_batch(&app, &[request("kept", "f1", &[("A", 1)], 1)]).await;
    let Idempotent::Executed(stored) = &stored.outcomes[0] else {
        panic!("the first request runs: {stored:?}")
    };

    let batch = vec![
        request("kept", "f1", &[("A", 1)], 2),
        request("kept", "f1", &[("A", 1)], 3),
        request("fresh", "f2", &[("A", 1)], 4),
    ];
    let applied = reserve_batch(&app, &batch).await;

    assert_eq!(applied.outcomes[0], Idempotent::Replayed(stored.clone()));
    assert_eq!(applied.outcomes[1], Idempotent::Replayed(stored.clone()));
    assert_eq!(
        status_and_code(&applied.outcomes[2]),
        ("executed", 201, None)
    );
    assert_eq!(app.counters("A").await, (3, 2));
    app.assert_audit_clean().await;
}

async fn a_full_reservation_queue_answers_429_at_once_and_changes_nothing(backend: Backend) {
    let config = engine::EngineConfig {
        combiner_queue_depth_max: 1,
        combiner_batches_in_flight: 1,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("QUEUED", 5).await;
    // The first reservation's batch blocks on a held row lock; the second waits in
    // the queue, which then is full.
    let mut lock = app.database.hold_stock_row_lock("QUEUED").await;
    let first = tokio::spawn({
        let app = app.clone();
        async move { app.reserve("first", &[("QUEUED", 1)]).await }
    });
    wait_until("the first reservation is in its batch", || {
        app.engine.requests_in_flight() == 1 && app.engine.reservations_queued() == 0
    })
    .await;
    let second = tokio::spawn({
        let app = app.clone();
        async move { app.reserve("second", &[("QUEUED", 1)]).await }
    });
    wait_until("the second reservation is queued", || {
        app.engine.reservations_queued() == 1
    })
    .await;

    let shed = app.reserve("third", &[("QUEUED", 1)]).await;

    assert_eq!(shed.status, 429, "{shed:?}");
    assert_eq!(shed.code().as_deref(), Some("unavailable"));
    assert_eq!(shed.headers.get("retry-after").unwrap(), "1");
    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(second.await.unwrap().status, 201);
    let retried = app.reserve("third", &[("QUEUED", 1)]).await;
    assert_eq!(
        retried.status, 201,
        "the shed request left no record: its retry runs"
    );
    assert_eq!(app.counters("QUEUED").await, (2, 3));
    app.assert_audit_clean().await;
}

/// Found in review: on MySQL, where DDL commits by itself and no transaction's lock
/// can serialize migrations, instances started together on a new database ran the
/// same migrations at once (one failing its start on a table the other had just
/// created). A start now takes a named lock for its whole run of migrations: one
/// started while another holds it waits, then finds every migration applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_start_waits_for_another_instances_migrations_to_end() {
    if !Backend::Mysql.available().await {
        return;
    }
    let database = acceptance::TestDatabase::create(Backend::Mysql).await;
    let mut other_instance = database.raw_connection().await;
    other_instance
        .execute("SELECT GET_LOCK(CONCAT('stockd_migrate:', DATABASE()), 0)")
        .await
        .unwrap();
    let store = store::Store::connect(&database.store_config())
        .await
        .expect("connect");
    let migrating = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });

    database.wait_until_blocked_by(&mut other_instance).await;
    let tables_meanwhile = other_instance
        .texts("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()")
        .await;
    other_instance
        .execute("SELECT RELEASE_LOCK(CONCAT('stockd_migrate:', DATABASE()))")
        .await
        .unwrap();
    let applied = migrating.await.unwrap().expect("migrated after the other");

    assert!(
        tables_meanwhile.is_empty(),
        "nothing was created while the other held the lock: {tables_meanwhile:?}"
    );
    assert!(!applied.is_empty(), "then it applied them all");
    assert!(
        store.migrate().await.expect("again").is_empty(),
        "a second run finds nothing to apply"
    );
    store.close().await;
}

/// Found in review: on MariaDB, whose statement bound (`max_statement_time`) applies to
/// DDL too and whose DDL commits by itself, a migration ran under the service's bound:
/// one rewriting a large table was killed at 30 s, half applied, at every start. The
/// migrations' session has no statement bound now. Here every statement of a run of
/// migrations waits on a table lock another session holds, past a 200 ms bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_migration_runs_past_the_statement_bound() {
    if !Backend::Mysql.available().await {
        return;
    }
    let mut database = acceptance::TestDatabase::create(Backend::Mysql).await;
    database.statement_timeout_milliseconds = 200;
    let store = database.connect().await;
    let mut other_session = database.raw_connection().await;
    other_session
        .execute("LOCK TABLES schema_migration WRITE")
        .await
        .unwrap();
    let migrating = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });

    database
        .wait_until_blocked_for(&mut other_session, std::time::Duration::from_millis(600))
        .await;
    other_session.execute("UNLOCK TABLES").await.unwrap();
    let applied = migrating.await.unwrap();

    assert_eq!(
        applied.expect("migrated once the table was free"),
        Vec::<i64>::new(),
        "everything was applied already"
    );
    store.close().await;
}

/// Several stockd processes share one database only on PostgreSQL.
mod postgres_only {
    use super::*;
    use acceptance::{Call, send_concurrently};
    use serde_json::json;

    /// The hot path commits inside its `CALL`, where PostgreSQL would let the
    /// statement's timer cut the commit's wait for a synchronous standby short (and
    /// acknowledge a batch that is local only). The combiner's sessions carry no
    /// statement timer: here a batch waits for a row lock past a 200 ms statement
    /// bound (its lock bound is 5 s) and is then applied.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_hot_paths_call_runs_without_a_statement_timer() {
        if !Backend::Postgres.available().await {
            return;
        }
        let mut database = acceptance::TestDatabase::create(Backend::Postgres).await;
        database.statement_timeout_milliseconds = 200;
        database.lock_timeout_milliseconds = 5_000;
        let app = TestApp::on(
            std::sync::Arc::new(database),
            engine::ManualClock::new(acceptance::START),
            acceptance::test_engine_config(),
        )
        .await;
        app.stocked_sku("TIMED", 3).await;
        let mut other_writer = app.database.hold_stock_row_lock("TIMED").await;
        let reserving = tokio::spawn({
            let app = app.clone();
            async move { app.reserve("past-the-bound", &[("TIMED", 1)]).await }
        });

        app.database
            .wait_until_blocked_for(&mut other_writer, std::time::Duration::from_millis(400))
            .await;
        other_writer.execute("COMMIT").await.unwrap();
        let reserved = reserving.await.unwrap();

        assert_eq!(reserved.status, 201, "{reserved:?}");
        assert_eq!(app.counters("TIMED").await, (2, 1));
        app.assert_audit_clean().await;
    }

    /// Instances started together migrate one after the other: a start that waits for
    /// another's migration longer than the lock bound (a migration may build an index
    /// for minutes) keeps waiting and then finds the schema migrated, instead of
    /// failing its start with `lock_timeout`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_start_waiting_past_the_lock_bound_for_another_migration_migrates_after_it() {
        if !Backend::Postgres.available().await {
            return;
        }
        let mut database = acceptance::TestDatabase::create(Backend::Postgres).await;
        database.lock_timeout_milliseconds = 200;
        let first = database.connect().await;
        let mut other_instance = database.raw_connection().await;
        other_instance.execute("BEGIN").await.unwrap();
        other_instance
            .execute(
                "SELECT pg_advisory_xact_lock(hashtext('stockd_migrate:' || current_schema()))",
            )
            .await
            .unwrap();
        let second = store::Store::connect(&database.store_config())
            .await
            .expect("connect");
        let migrating = tokio::spawn({
            let second = second.clone();
            async move { second.migrate().await }
        });

        database
            .wait_until_blocked_for(&mut other_instance, std::time::Duration::from_millis(600))
            .await;
        other_instance.execute("COMMIT").await.unwrap();

        let applied = migrating.await.unwrap().expect("migrated after the other");
        assert!(
            applied.is_empty(),
            "the first had applied them all: {applied:?}"
        );
        second.close().await;
        first.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn three_instances_hammering_one_sku_never_oversell() {
        if !Backend::Postgres.available().await {
            return;
        }
        let first = TestApp::spawn(Backend::Postgres).await;
        let instances = [
            first.clone(),
            first.another_instance().await,
            first.another_instance().await,
        ];
        first.stocked_sku("CONTESTED", 50).await;

        let mut tasks = Vec::new();
        for (number, instance) in instances.iter().enumerate() {
            let calls: Vec<Call> = (0..120)
                .map(|index| {
                    // Keys 0..10 are sent to every instance: retries that land elsewhere.
                    let key = if index < 10 {
                        format!("shared-{index}")
                    } else {
                        format!("{number}-{index}")
                    };
                    Call::post("/v1/reservations")
                        .key(key)
                        .json(&json!({"lines": [{"sku": "CONTESTED", "quantity": 1}]}))
                })
                .collect();
            let instance = instance.clone();
            tasks.push(tokio::spawn(async move {
                send_concurrently(&instance, calls).await
            }));
        }
        let mut fresh_successes = 0;
        for task in tasks {
            for response in task.await.unwrap() {
                assert!(
                    matches!(response.status, 201 | 409),
                    "only successes, sold-out answers and replays: {response:?}"
                );
                if response.status == 201 && !response.replayed() {
                    fresh_successes += 1;
                }
            }
        }

        assert_eq!(
            fresh_successes, 50,
            "exactly the stock was sold, each unit once"
        );
        assert_eq!(first.counters("CONTESTED").await, (0, 50));
        assert_eq!(first.ledger_rows("CONTESTED", "reserve").await, 50);
        first.assert_audit_clean().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_whose_stock_is_taken_while_it_waits_for_the_row_is_decided_request_by_request()
    {
        if !Backend::Postgres.available().await {
            return;
        }
        let app = TestApp::spawn(Backend::Postgres).await;
        app.stocked_sku("RACED", 3).await;
        // Another writer holds the row; the batch fits the stock it saw, inserts its
        // rows, and waits for the row.
        let mut other_writer = app.database.hold_stock_row_lock("RACED").await;
        let batch = vec![
            request("two", "f1", &[("RACED", 2)], 1),
            request("one", "f2", &[("RACED", 1)], 2),
        ];
        let reserving = tokio::spawn({
            let app = app.clone();
            async move { reserve_batch(&app, &batch).await }
        });
        app.database.wait_until_blocked_by(&mut other_writer).await;
        // The other writer takes two units (with its ledger row) and commits.
        other_writer
            .execute("UPDATE stock SET available = available - 2, version = version + 1 WHERE sku = 'RACED'")
            .await
            .unwrap();
        other_writer
            .execute(
                "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, reference, created_at) \
                 VALUES ('RACED', 'default', 'adjust', -2, 0, 'other-writer', 0)",
            )
            .await
            .unwrap();
        other_writer.execute("COMMIT").await.unwrap();

        let applied = reserving.await.unwrap();

        // The whole batch no longer fits: its rows are rolled back and each request is
        // decided on what is left, in order.
        assert_eq!(applied.path, store::BatchPath::Transaction);
        let summary: Vec<_> = applied.outcomes.iter().map(status_and_code).collect();
        assert_eq!(
            summary,
            vec![
                ("executed", 409, Some("insufficient_stock".to_owned())),
                ("executed", 201, None),
            ]
        );
        assert_eq!(app.counters("RACED").await, (0, 1));
        assert_eq!(app.ledger_rows("RACED", "reserve").await, 1);
        let mut connection = app.database.raw_connection().await;
        assert_eq!(
            connection
                .execute("SELECT id FROM reservation")
                .await
                .unwrap(),
            1,
            "the fast path's rows were rolled back"
        );
        app.assert_audit_clean().await;
    }

    /// Both batch functions (the whole-batch fast path and the batch transaction's
    /// write) keep generic plans (migration 0007), made once per connection from the
    /// statistics of that moment. Made while the catalog is one SKU, such a plan scans
    /// `stock` and `sku`, and kept it would go on scanning them after the shop adds ten
    /// thousand SKUs (measured: 6,000 reservations/s instead of 10,700). Migration 0008
    /// makes every read a key lookup from the first call.
    #[tokio::test]
    async fn the_batch_functions_read_stock_and_skus_by_key_even_while_the_catalog_is_tiny() {
        if !Backend::Postgres.available().await {
            return;
        }
        let app = TestApp::spawn(Backend::Postgres).await;
        app.stocked_sku("TINY", 5).await;
        let mut connection = app.database.postgres_connection().await;
        for statement in ["ANALYZE stock", "ANALYZE sku", "BEGIN"] {
            sqlx::query(statement)
                .execute(&mut connection)
                .await
                .unwrap();
        }

        let answer: String = sqlx::query_scalar(
            "SELECT stockd_reserve_whole_batch(ARRAY['ON_SHELF'], 0, \
             ARRAY['TINY'], ARRAY['default'], ARRAY[1]::BIGINT[], \
             ARRAY['reservation-1'], ARRAY[900000]::BIGINT[], ARRAY['key-1'], \
             ARRAY['default'], ARRAY[NULL]::TEXT[], \
             ARRAY['reservation-1'], ARRAY[0]::BIGINT[], ARRAY['TINY'], ARRAY['default'], \
             ARRAY[1]::BIGINT[], ARRAY['key-1'], \
             ARRAY['key-1'], ARRAY['fingerprint-1'], ARRAY[201]::BIGINT[], ARRAY['{}'])",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap();
        // The batch transaction's write, in the same transaction: another request.
        let written: (i64, i64) = sqlx::query_as(
            "SELECT written.rows_taken, written.records_stored FROM stockd_write_reservation_batch(0, \
             ARRAY['TINY'], ARRAY['default'], ARRAY[1]::BIGINT[], \
             ARRAY['reservation-2'], ARRAY[900000]::BIGINT[], ARRAY['key-2'], \
             ARRAY['default'], ARRAY[NULL]::TEXT[], \
             ARRAY['reservation-2'], ARRAY[0]::BIGINT[], ARRAY['TINY'], ARRAY['default'], \
             ARRAY[1]::BIGINT[], ARRAY['key-2'], \
             ARRAY['key-2'], ARRAY['fingerprint-2'], ARRAY[201]::BIGINT[], ARRAY['{}']) AS written",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap();
        let sequential_scans: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(seq_scan), 0) AS BIGINT) FROM pg_stat_xact_user_tables \
             WHERE schemaname = current_schema() AND relname IN ('stock', 'sku')",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap();
        sqlx::query("ROLLBACK")
            .execute(&mut connection)
            .await
            .unwrap();

        assert_eq!(answer, "applied");
        assert_eq!(written, (1, 1));
        assert_eq!(
            sequential_scans, 0,
            "stock and sku are read through their keys"
        );
    }

    /// Whether `sku`'s stock row is free right now (`FOR UPDATE NOWAIT` from a third
    /// connection, rolled back at once).
    async fn stock_row_is_free(app: &TestApp, sku: &str) -> bool {
        let mut probe = app.database.raw_connection().await;
        probe.execute("BEGIN").await.unwrap();
        let locked = probe
            .execute(&format!(
                "SELECT 1 FROM stock WHERE sku = '{sku}' AND warehouse = 'default' FOR UPDATE NOWAIT"
            ))
            .await;
        probe.execute("ROLLBACK").await.unwrap();
        locked.is_ok()
    }

    /// Issue 13, defect 3: the order-expiry batch settles every order's stock in the
    /// one global (sku, warehouse) order. Order by order, it would lock `LOCK-B` (the
    /// order expiring first) and then wait for `LOCK-A`: the cycle a reservation of
    /// both SKUs, locking `LOCK-A` first, closes into a deadlock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_order_expiry_batch_locks_stock_rows_in_the_global_order() {
        if !Backend::Postgres.available().await {
            return;
        }
        let app = TestApp::spawn(Backend::Postgres).await;
        for sku in ["LOCK-A", "LOCK-B"] {
            app.stocked_sku(sku, 10).await;
        }
        for (sku, ttl_seconds) in [("LOCK-B", 60), ("LOCK-A", 120)] {
            let created = app
                .send(
                    Call::post("/v1/orders")
                        .key(format!("order-{sku}"))
                        .json(&json!({
                            "user_id": "user-1",
                            "lines": [{"sku": sku, "quantity": 1}],
                            "ttl_seconds": ttl_seconds,
                        })),
                )
                .await;
            assert_eq!(created.status, 201, "{created:?}");
        }
        app.clock.advance_seconds(121);
        let mut holder = app.database.hold_stock_row_lock("LOCK-A").await;
        let engine = app.engine.clone();
        let expiry = tokio::spawn(async move { engine.order_expiry_step().await });
        app.database.wait_until_blocked_by(&mut holder).await;
        assert!(
            stock_row_is_free(&app, "LOCK-B").await,
            "waiting for LOCK-A, the batch must not hold LOCK-B"
        );
        holder.execute("ROLLBACK").await.unwrap();
        let expired = expiry.await.unwrap().expect("order expiry step");
        assert_eq!(expired.len(), 2);
        assert_eq!(app.counters("LOCK-A").await, (10, 0));
        assert_eq!(app.counters("LOCK-B").await, (10, 0));
        app.assert_audit_clean().await;
    }

    /// Issue 13, defect 3: the schedule batch takes every shop lock and then every
    /// stock row, in order, before its first change; one schedule at a time it took
    /// `LOCK-B`'s rows and then waited for `LOCK-A`'s.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_schedule_batch_locks_stock_rows_in_the_global_order() {
        if !Backend::Postgres.available().await {
            return;
        }
        let app = TestApp::spawn(Backend::Postgres).await;
        let product = app
            .create_product(acceptance::ProductSpec::complete(
                "north",
                &["LOCK-A", "LOCK-B"],
            ))
            .await;
        assert!(!product.is_empty());
        for sku in ["LOCK-A", "LOCK-B"] {
            app.receive(sku, 5).await;
        }
        for (sku, minutes) in [("LOCK-B", 1), ("LOCK-A", 2)] {
            let scheduled = app
                .shelf(
                    None,
                    json!({"operation": "on_at", "sku_ids": [sku],
                           "scheduled_at": acceptance::START.plus_seconds(minutes * 60).to_rfc3339()}),
                )
                .await;
            assert_eq!(scheduled.status, 200, "{scheduled:?}");
        }
        app.clock.advance_seconds(3 * 60);
        let mut holder = app.database.hold_stock_row_lock("LOCK-A").await;
        let engine = app.engine.clone();
        let step = tokio::spawn(async move { engine.schedule_step().await });
        app.database.wait_until_blocked_by(&mut holder).await;
        assert!(
            stock_row_is_free(&app, "LOCK-B").await,
            "waiting for LOCK-A, the batch must not hold LOCK-B"
        );
        holder.execute("ROLLBACK").await.unwrap();
        let applied = step.await.unwrap().expect("schedule step");
        assert_eq!(applied.len(), 2, "{applied:?}");
        assert!(
            applied.iter().all(|schedule| schedule.status == "APPLIED"),
            "{applied:?}"
        );
    }

    /// sqlx pings a connection when it is released; stockd's pools ping on acquire only
    /// a connection idle for at least their bound (`PING_WHEN_IDLE_FOR_MILLISECONDS` in
    /// production: a round trip less on every request). A connection the server closed
    /// while it sat idle that long is found dead and replaced before a statement uses it.
    /// The bound is zero here, so the test waits for the server, never for a clock.
    #[tokio::test]
    async fn a_pooled_connection_the_server_closed_while_idle_is_replaced_before_use() {
        use sqlx::Connection;
        if !Backend::Postgres.available().await {
            return;
        }
        let pool: sqlx::PgPool =
            store::backend::pool_options_pinging_after(std::time::Duration::ZERO)
                .max_connections(1)
                .connect(&acceptance::postgres_url())
                .await
                .unwrap();
        let first: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
        let other = tokio::sync::Mutex::new(
            sqlx::PgConnection::connect(&acceptance::postgres_url())
                .await
                .unwrap(),
        );
        let signalled: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(first)
            .fetch_one(&mut *other.lock().await)
            .await
            .unwrap();
        assert!(
            signalled,
            "the pool's one connection was closed by the server"
        );
        acceptance::wait_until_async("the terminated session to be gone", || async {
            let alive: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                    .bind(first)
                    .fetch_one(&mut *other.lock().await)
                    .await
                    .unwrap();
            !alive
        })
        .await;

        let second: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .expect("the dead connection was replaced, not used");
        assert_ne!(first, second);
    }
}

/// A batch that meets a row locked past the bound (a long transaction elsewhere) is
/// run again request by request: the requests for other SKUs are decided, and only
/// those for the locked one answer `lock_timeout`.
async fn a_sku_locked_past_the_bound_fails_only_its_own_requests_in_a_batch(backend: Backend) {
    if backend == Backend::Sqlite {
        // One writer: a held lock holds every SKU, there is no other row to decide.
        return;
    }
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 300).await;
    app.stocked_sku("LOCKED", 5).await;
    app.stocked_sku("FREE", 5).await;
    let mut lock = app.database.hold_stock_row_lock("LOCKED").await;
    // The first request waits in the database; the next two queue behind it and go
    // to the database together, as one batch.
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("locked-1", &[("LOCKED", 1)]).await })
    };
    app.database.wait_until_blocked_by(&mut lock).await;

    let (free, locked) = tokio::join!(
        app.reserve("free-1", &[("FREE", 1)]),
        app.reserve("locked-2", &[("LOCKED", 1)])
    );

    assert_eq!(
        free.status, 201,
        "another SKU's request is decided: {free:?}"
    );
    assert_eq!(locked.code().as_deref(), Some("lock_timeout"), "{locked:?}");
    assert_eq!(first.await.unwrap().code().as_deref(), Some("lock_timeout"));
    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(app.counters("FREE").await, (4, 1));
    assert_eq!(app.counters("LOCKED").await, (5, 0));
    app.assert_audit_clean().await;
}

/// A request of several rows that timed out in a batch's one-by-one run may have waited
/// on any of them: the requests after it for its other rows, or for its SKU in another
/// warehouse, are decided, not answered `lock_timeout` on its account.
async fn a_request_that_timed_out_on_several_rows_condemns_none_of_them_for_the_others(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One writer: a held lock holds every SKU, there is no other row to decide.
        return;
    }
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 300).await;
    app.stocked_sku("LOCKED", 5).await;
    assert_eq!(app.receive_in("LOCKED", 5, Some("north")).await.status, 201);
    app.stocked_sku("FREE", 5).await;
    let mut lock = app.database.hold_stock_row_lock("LOCKED").await;
    // The first request waits in the database; the next three queue behind it and go
    // to the database together, as one batch, which times out on the held row.
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("locked-1", &[("LOCKED", 1)]).await })
    };
    app.database.wait_until_blocked_by(&mut lock).await;
    let north = |key: &'static str| {
        Call::post("/v1/reservations")
            .key(key)
            .json(&serde_json::json!({
                "lines": [{"sku": "LOCKED", "warehouse": "north", "quantity": 1}]
            }))
    };

    let (both, free, in_the_north) = tokio::join!(
        app.reserve("both-1", &[("LOCKED", 1), ("FREE", 1)]),
        app.reserve("free-1", &[("FREE", 1)]),
        app.send(north("north-1")),
    );

    assert_eq!(both.code().as_deref(), Some("lock_timeout"), "{both:?}");
    assert_eq!(free.status, 201, "its other row is decided: {free:?}");
    assert_eq!(
        in_the_north.status, 201,
        "its SKU in another warehouse is decided: {in_the_north:?}"
    );
    assert_eq!(first.await.unwrap().code().as_deref(), Some("lock_timeout"));
    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(app.counters("FREE").await, (4, 1));
    app.assert_audit_clean().await;
}

/// A SKU found short is dated when the request went to the database, not when its
/// answer came back: a unit given back elsewhere while the request waited on a lock is
/// not outlived by that wait beyond the re-check bound.
async fn a_short_finding_is_dated_when_its_request_was_sent_not_answered(backend: Backend) {
    if backend == Backend::Sqlite {
        // Its writers queue inside the process: no session outside holds a row.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SCARCE", 1).await;
    assert_eq!(
        app.reserve("take-the-unit", &[("SCARCE", 1)]).await.status,
        201
    );
    let recheck = test_engine_config().sold_out_recheck_milliseconds;
    let mut lock = app.database.hold_stock_row_lock("SCARCE").await;
    let short = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("short-1", &[("SCARCE", 1)]).await })
    };
    app.database.wait_until_blocked_by(&mut lock).await;
    app.clock.advance_milliseconds(recheck - 100);
    lock.execute("ROLLBACK").await.unwrap();
    let short = short.await.unwrap();
    assert_eq!(
        short.code().as_deref(),
        Some("insufficient_stock"),
        "{short:?}"
    );
    // Another instance receives a unit, which this one does not hear of; by then the
    // finding is older than the bound, counted from when its request was sent.
    let other = app.another_instance().await;
    assert_eq!(other.receive_in("SCARCE", 1, None).await.status, 201);
    app.clock.advance_milliseconds(200);

    let reserved = app.reserve("after-the-bound", &[("SCARCE", 1)]).await;

    assert_eq!(reserved.status, 201, "memory did not answer: {reserved:?}");
    app.assert_audit_clean().await;
}

/// MySQL refuses a statement with more than 65,535 placeholders. A batch whose shoppers'
/// units take more (330 shoppers × 50 lines, four placeholders each, within the
/// batch-size bound) goes to the database in chunks and is decided whole, not failed.
async fn a_batch_of_more_shoppers_units_than_one_statement_takes_is_decided_whole(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let skus: Vec<String> = (0..50).map(|index| format!("WIDE-{index:02}")).collect();
    for sku in &skus {
        app.stocked_sku(sku, 400).await;
    }
    let lines: Vec<(&str, i64)> = skus.iter().map(|sku| (sku.as_str(), 1)).collect();
    let batch: Vec<ReserveRequest> = (0..330_u64)
        .map(|index| {
            let key = format!("wide-{index}");
            let mut request = request(&key, &key, &lines, index);
            request.user = Some(domain::UserId::parse(&format!("shopper-{index}")).unwrap());
            request
        })
        .collect();

    let applied = reserve_batch(&app, &batch).await;

    let statuses: Vec<_> = applied.outcomes.iter().map(status_and_code).collect();
    assert!(
        statuses
            .iter()
            .all(|(kind, status, _)| *kind == "executed" && *status == 201),
        "{:?}",
        &statuses[..3]
    );
    assert_eq!(app.counters("WIDE-00").await, (70, 330));
    assert_eq!(app.counters("WIDE-49").await, (70, 330));
    app.assert_audit_clean().await;
}

/// Found in review: a hold's expiry was fixed when its request arrived, so time spent
/// in the combiner's queue (behind a batch waiting for a lock) was taken out of its
/// ttl, and a short hold could commit already expired. It now lasts its ttl from when
/// its batch is decided.
async fn a_hold_lasts_its_ttl_from_when_its_batch_is_decided_not_from_its_arrival(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // Its writers queue inside the process: no session outside holds a row.
        return;
    }
    let config = engine::EngineConfig {
        combiner_shards: 1,
        combiner_batches_in_flight: 1,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("QUEUED", 5).await;
    let mut lock = app.database.hold_stock_row_lock("QUEUED").await;
    let reserve = |key: &'static str| {
        let app = app.clone();
        tokio::spawn(async move {
            app.send(
                Call::post("/v1/reservations")
                    .key(key)
                    .json(&serde_json::json!({
                        "lines": [{"sku": "QUEUED", "quantity": 1}],
                        "ttl_seconds": 60,
                    })),
            )
            .await
        })
    };
    let first = reserve("first");
    app.database.wait_until_blocked_by(&mut lock).await;
    let queued = reserve("queued");
    wait_until(
        "the second request waits in the queue behind the first's batch",
        || app.engine.reservations_queued() == 1,
    )
    .await;
    app.clock.advance_seconds(30);
    lock.execute("ROLLBACK").await.unwrap();

    let first = first.await.unwrap();
    let queued = queued.await.unwrap();

    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(queued.status, 201, "{queued:?}");
    let held = queued.json();
    let at =
        |field: &str| -> domain::Timestamp { serde_json::from_value(held[field].clone()).unwrap() };
    assert_eq!(at("created_at"), acceptance::START.plus_seconds(30));
    assert_eq!(
        at("expires_at"),
        at("created_at").plus_seconds(60),
        "the 30 s in the queue are not taken out of the hold: {held}"
    );
}

/// A reservation locks its own stock rows and nothing else exclusively. Its SKU's row
/// is read, not locked for update: batches on several rows of one SKU (a campaign's
/// buckets) then commit side by side, where an exclusive lock on the SKU's row would
/// line them up. Other SKUs' stock rows are not touched, even on a table so small
/// that MariaDB's optimizer would rather scan it (a scan's `FOR UPDATE` waits for every
/// row it passes). Here another session holds a share lock on the SKU's row, as a
/// concurrent batch may, and an exclusive lock on a neighbour's stock row.
async fn a_reservation_takes_no_exclusive_lock_on_its_skus_row_nor_on_other_skus_stock(
    backend: Backend,
) {
    let share = match backend {
        // One writer: there are no row locks to take.
        Backend::Sqlite => return,
        Backend::Postgres => "SELECT 1 FROM sku WHERE code = 'SHARED' FOR SHARE",
        Backend::Mysql => "SELECT 1 FROM sku WHERE code = 'SHARED' LOCK IN SHARE MODE",
    };
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 300).await;
    for sku in ["A-BEFORE", "SHARED", "Z-AFTER"] {
        app.stocked_sku(sku, 5).await;
    }
    let mut neighbour = app.database.hold_stock_row_lock("Z-AFTER").await;
    let mut reader = app.database.raw_connection().await;
    reader.execute("BEGIN").await.unwrap();
    reader.execute(share).await.unwrap();

    let reserved = app.reserve("shared-1", &[("SHARED", 1)]).await;
    let before = app.reserve("before-1", &[("A-BEFORE", 1)]).await;

    assert_eq!(reserved.status, 201, "{reserved:?}");
    assert_eq!(before.status, 201, "{before:?}");
    reader.execute("ROLLBACK").await.unwrap();
    neighbour.execute("ROLLBACK").await.unwrap();
    assert_eq!(app.counters("SHARED").await, (4, 1));
    app.assert_audit_clean().await;
}

/// Found in review: on MySQL the order-expiry claim read every expired order of both
/// statuses, sorted them and then cut its batch, and InnoDB keeps the lock of every row
/// it read: a step of 5 held every expired order (after a flash sale, tens of
/// thousands), so a late payment's webhook or a cancel on any of them waited for it.
/// A step now locks only about its own batch.
async fn an_order_expiry_step_locks_only_the_orders_it_claims(backend: Backend) {
    if backend == Backend::Sqlite {
        // One writer and no row locks: nothing to wait for but the writer itself.
        return;
    }
    let mut config = test_engine_config();
    config.order_expiry_batch_size = 5;
    let app = TestApp::spawn_with_lock_timeout(backend, config, 60_000).await;
    app.stocked_sku("DUE", 20).await;
    let mut orders = Vec::new();
    for index in 0..12 {
        let created =
            app.send(Call::post("/v1/orders").key(format!("due-{index}")).json(
                &serde_json::json!({
                    "user_id": format!("shopper-{index}"),
                    "lines": [{"sku": "DUE", "quantity": 1}],
                    "ttl_seconds": 60,
                }),
            ))
            .await;
        assert_eq!(created.status, 201, "{created:?}");
        orders.push(created.json()["order_id"].as_str().unwrap().to_owned());
    }
    orders.sort();
    app.clock.advance_seconds(61);
    // The step claims its orders, then waits for the stock row this session holds.
    let mut holder = app.database.hold_stock_row_lock("DUE").await;
    let engine = app.engine.clone();
    let stepping = tokio::spawn(async move { engine.order_expiry_step().await });
    app.database.wait_until_blocked_by(&mut holder).await;

    let mut another = app.database.raw_connection().await;
    let last = orders.last().unwrap();
    let free = another
        .execute(&format!(
            "SELECT id FROM customer_order WHERE id = '{last}' FOR UPDATE NOWAIT"
        ))
        .await;
    holder.execute("ROLLBACK").await.unwrap();
    let expired = stepping.await.unwrap().expect("order expiry step");

    assert!(free.is_ok(), "an order past the batch was locked: {free:?}");
    assert_eq!(expired.len(), 5, "{expired:?}");
    app.assert_audit_clean().await;
}

/// Found in review: only a lock timeout or a key in flight made a batch run again
/// request by request. Any other error of one request's rows (a row damaged by hand, a
/// constraint it breaks) failed every request batched with it, and again in every
/// batch it landed in. Here a trigger stands for the damage: every write to one SKU's
/// stock row fails.
async fn a_request_whose_row_breaks_the_batch_fails_alone(backend: Backend) {
    let damage = match backend {
        // One writer: a held lock holds every SKU, so no batch of two forms behind it.
        Backend::Sqlite => return,
        Backend::Postgres => vec![
            "CREATE FUNCTION refuse_broken() RETURNS trigger AS $$ \
             BEGIN RAISE EXCEPTION 'a row damaged by hand'; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER broken_row BEFORE UPDATE ON stock FOR EACH ROW \
             WHEN (NEW.sku = 'BROKEN') EXECUTE FUNCTION refuse_broken()",
        ],
        Backend::Mysql => vec![
            "CREATE TRIGGER broken_row BEFORE UPDATE ON stock FOR EACH ROW \
             BEGIN IF NEW.sku = 'BROKEN' THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'a row damaged by hand'; \
             END IF; END",
        ],
    };
    let app = TestApp::spawn(backend).await;
    for sku in ["GATE", "BROKEN", "FREE"] {
        app.stocked_sku(sku, 5).await;
    }
    let mut connection = app.database.raw_connection().await;
    for statement in damage {
        connection.execute(statement).await.unwrap();
    }
    let mut gate = app.database.hold_stock_row_lock("GATE").await;
    // The first request waits in the database; the next two queue behind it and go
    // to the database together, as one batch.
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("gate-1", &[("GATE", 1)]).await })
    };
    app.database.wait_until_blocked_by(&mut gate).await;
    let queued = {
        let app = app.clone();
        tokio::spawn(async move {
            tokio::join!(
                app.reserve("broken-1", &[("BROKEN", 1)]),
                app.reserve("free-1", &[("FREE", 1)])
            )
        })
    };
    acceptance::wait_until("both requests queue behind the first", || {
        app.engine.reservations_queued() == 2
    })
    .await;
    gate.execute("ROLLBACK").await.unwrap();

    let (broken, free) = queued.await.unwrap();

    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(free.status, 201, "decided on its own: {free:?}");
    assert_eq!(broken.status, 500, "{broken:?}");
    assert_eq!(app.counters("FREE").await, (4, 1));
    assert_eq!(app.counters("BROKEN").await, (5, 0));
    app.assert_audit_clean().await;
}

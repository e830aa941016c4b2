//! Idempotency: the first result wins, the same key for another request is refused, a
//! key still running answers "in progress", and records expire after the retention.

use acceptance::{Backend, Call, TestApp, mirrored_tests, test_engine_config, wait_until};
use engine::in_flight::Entry;

mirrored_tests!(
    a_retry_returns_the_first_response_byte_for_byte,
    the_same_key_with_a_different_body_is_refused_and_changes_nothing,
    the_same_key_on_another_endpoint_is_refused,
    a_reformatted_body_with_the_same_content_is_a_retry,
    a_body_left_out_and_an_empty_object_are_the_same_request,
    a_key_still_in_flight_answers_request_in_progress_and_changes_nothing,
    a_retry_that_waits_for_its_original_gets_the_original_answer,
    a_second_instance_replays_what_the_first_stored,
    records_past_the_retention_are_purged_in_bounded_batches,
    the_purge_reads_a_batch_of_old_records_without_sorting_every_old_one,
    a_reservation_across_two_shops_hears_its_stored_refusal_though_a_sku_was_created_since,
    a_key_held_by_another_instances_open_transaction_answers_request_in_progress,
    a_key_another_instance_commits_while_the_batch_waits_is_answered_from_its_record,
);

async fn a_retry_returns_the_first_response_byte_for_byte(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;

    let first = app.reserve("same-key", &[("KEYED", 2)]).await;
    app.clock.advance_seconds(5);
    let retry = app.reserve("same-key", &[("KEYED", 2)]).await;

    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert!(retry.replayed());
    assert_eq!(retry.content_type(), "application/json");
    assert_eq!(app.counters("KEYED").await, (3, 2));
}

async fn the_same_key_with_a_different_body_is_refused_and_changes_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    assert_eq!(app.reserve("reused", &[("KEYED", 2)]).await.status, 201);
    let before = app.contents().await;

    let reused = app.reserve("reused", &[("KEYED", 3)]).await;

    assert_eq!(reused.status, 422);
    assert_eq!(reused.code().as_deref(), Some("idempotency_key_reused"));
    assert_eq!(app.contents().await, before);
    assert!(
        !reused.headers.contains_key("stockd-consistency-token"),
        "nothing was written, so there is no position to wait for: {reused:?}"
    );
}

async fn the_same_key_on_another_endpoint_is_refused(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    let reservation = app.reserve("shared-key", &[("KEYED", 1)]).await.json();
    let id = reservation["reservation_id"].as_str().unwrap();

    let confirm = app.confirm(id, "shared-key").await;

    assert_eq!(confirm.code().as_deref(), Some("idempotency_key_reused"));
    assert_eq!(
        app.counters("KEYED").await,
        (4, 1),
        "the confirm did not run"
    );
}

async fn a_reformatted_body_with_the_same_content_is_a_retry(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    let compact = r#"{"lines":[{"sku":"KEYED","quantity":1}],"ttl_seconds":60}"#;
    let spaced =
        "{ \"ttl_seconds\": 60,\n  \"lines\": [ { \"quantity\": 1, \"sku\": \"KEYED\" } ] }";

    let first = app
        .send(
            Call::post("/v1/reservations")
                .key("format")
                .raw(compact, Some("application/json")),
        )
        .await;
    let retry = app
        .send(
            Call::post("/v1/reservations")
                .key("format")
                .raw(spaced, Some("application/json; charset=utf-8")),
        )
        .await;

    assert_eq!(first.status, 201);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
}

async fn a_key_still_in_flight_answers_request_in_progress_and_changes_nothing(backend: Backend) {
    let config = engine::EngineConfig {
        idempotency_wait_milliseconds: 50,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("KEYED", 5).await;
    // Stand in for an original request with this key that has not finished.
    let stored = app.stored_key("in-flight").await;
    let Entry::Owner(original) = app.engine.in_flight().enter(&stored) else {
        panic!("the key is free");
    };
    let before = app.contents().await;

    let retry = app.reserve("in-flight", &[("KEYED", 1)]).await;

    assert_eq!(retry.status, 409);
    assert_eq!(retry.code().as_deref(), Some("request_in_progress"));
    assert_eq!(app.contents().await, before);
    drop(original);
    let after_original = app.reserve("in-flight", &[("KEYED", 1)]).await;
    assert_eq!(
        after_original.status, 201,
        "the original stored nothing, so the retry runs"
    );
}

async fn a_retry_that_waits_for_its_original_gets_the_original_answer(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    // Hold the stock row so the original blocks inside its transaction.
    let mut lock = app.database.hold_stock_row_lock("KEYED").await;
    let original = tokio::spawn({
        let app = app.clone();
        async move { app.reserve("waited", &[("KEYED", 1)]).await }
    });
    wait_until("the original is in flight", || {
        app.engine.requests_in_flight() == 1
    })
    .await;
    let retry = tokio::spawn({
        let app = app.clone();
        async move { app.reserve("waited", &[("KEYED", 1)]).await }
    });
    lock.execute("ROLLBACK").await.unwrap();

    let original = original.await.unwrap();
    let retry = retry.await.unwrap();
    assert_eq!(original.status, 201, "{original:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, original.body);
    assert_eq!(app.counters("KEYED").await, (4, 1));
}

async fn a_second_instance_replays_what_the_first_stored(backend: Backend) {
    let first = TestApp::spawn(backend).await;
    let second = first.another_instance().await;
    first.stocked_sku("KEYED", 5).await;

    let original = first.reserve("across", &[("KEYED", 2)]).await;
    let retry = second.reserve("across", &[("KEYED", 2)]).await;

    assert!(retry.replayed());
    assert_eq!(retry.body, original.body);
    assert_eq!(first.counters("KEYED").await, (3, 2));
}

async fn records_past_the_retention_are_purged_in_bounded_batches(backend: Backend) {
    let config = engine::EngineConfig {
        idempotency_retention_seconds: 86_400,
        idempotency_purge_batch_size: 2,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    // Three keyed admin calls: the test's service key, the SKU and its receipt.
    app.stocked_sku("KEYED", 10).await;
    for index in 0..3 {
        assert_eq!(
            app.reserve(&format!("old-{index}"), &[("KEYED", 1)])
                .await
                .status,
            201
        );
    }
    app.clock.advance_seconds(85_800);
    assert_eq!(app.reserve("recent", &[("KEYED", 1)]).await.status, 201);
    app.clock.advance_seconds(601);

    let mut purged = Vec::new();
    loop {
        let count = app.engine.purge_step().await.unwrap();
        purged.push(count);
        if count < 2 {
            break;
        }
    }

    assert_eq!(purged, vec![2, 2, 2, 0], "six old records, two per step");
    let recent = app.reserve("recent", &[("KEYED", 1)]).await;
    assert!(recent.replayed(), "a record inside the retention is kept");
    let old = app.reserve("old-0", &[("KEYED", 1)]).await;
    assert!(!old.replayed(), "a purged key runs again");
    assert_eq!(old.status, 201);
    app.assert_audit_clean().await;
}

/// Another instance in the middle of a request with `key`: its open transaction has
/// inserted the key's idempotency record (for another request) and not committed.
async fn another_instance_holding_key(app: &TestApp, key: &str) -> acceptance::RawConnection {
    let key = app.stored_key(key).await;
    // MySQL reserves the word.
    let column = match app.backend() {
        Backend::Mysql => "`key`",
        Backend::Sqlite | Backend::Postgres => "key",
    };
    let mut other_instance = app.database.raw_connection().await;
    other_instance.execute("BEGIN").await.unwrap();
    other_instance
        .execute(&format!(
            "INSERT INTO idempotency_record ({column}, fingerprint, status_code, body, created_at) \
             VALUES ('{key}', 'another-request', 201, '{{}}', 0)"
        ))
        .await
        .unwrap();
    other_instance
}

/// On MySQL the batch's key insert waiting out the lock bound on another instance's
/// uncommitted key answered 503 `lock_timeout` (and, in the one-by-one pass, condemned
/// the request's stock row), where PostgreSQL answered 409 `request_in_progress`.
async fn a_key_held_by_another_instances_open_transaction_answers_request_in_progress(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One process writes a SQLite database: no other instance holds a key.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    let mut other_instance = another_instance_holding_key(&app, "contended").await;
    let before = app.contents().await;

    let response = app.reserve("contended", &[("KEYED", 1)]).await;

    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("request_in_progress"));
    assert_eq!(app.contents().await, before);
    other_instance.execute("ROLLBACK").await.unwrap();
    assert_eq!(app.reserve("contended", &[("KEYED", 1)]).await.status, 201);
}

/// The batch looks its keys up before it inserts their records. A key another instance
/// commits in between makes the insert fail (PostgreSQL: a unique violation, migration
/// 0007; MySQL: no row inserted); the batch is rolled back whole and decided again, and
/// this request is answered from the record that is now there — not with a 500, and
/// not by reserving twice.
async fn a_key_another_instance_commits_while_the_batch_waits_is_answered_from_its_record(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One process writes a SQLite database: no other instance commits a key.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    let mut other_instance = another_instance_holding_key(&app, "raced").await;
    let reserving = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("raced", &[("KEYED", 1)]).await })
    };
    // The lookup saw no record; the insert waits for the other instance's row.
    app.database
        .wait_until_blocked_by(&mut other_instance)
        .await;
    other_instance.execute("COMMIT").await.unwrap();

    let response = reserving.await.unwrap();

    assert_eq!(response.status, 422, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("idempotency_key_reused"));
    assert_eq!(app.counters("KEYED").await, (5, 0));
    assert_eq!(app.ledger_rows("KEYED", "reserve").await, 0);
    app.assert_audit_clean().await;
}

/// A SKU's shop is checked before the transaction for the SKUs known then. A
/// reservation naming a SKU of shop `north` and one that did not exist is refused 404
/// by its transaction, stored. Once the second SKU is created in shop `south`, the
/// check before the transaction finds two shops; the retry still hears its stored 404.
/// A new key for the same lines hears "two shops" (409), stored as well.
async fn a_reservation_across_two_shops_hears_its_stored_refusal_though_a_sku_was_created_since(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let put_sku = |sku: &str, shop: &str| {
        Call::put(format!("/v1/skus/{sku}"))
            .admin()
            .key(format!("put-{sku}"))
            .json(&serde_json::json!({"title": sku, "price": 100, "currency": "CNY", "shop": shop}))
    };
    assert_eq!(app.send(put_sku("TWO-N", "north")).await.status, 201);
    app.receive("TWO-N", 5).await;
    let reserve = |key: &str| {
        Call::post("/v1/reservations").admin().key(key).json(
            &serde_json::json!({"lines": [{"sku": "TWO-N", "quantity": 1}, {"sku": "TWO-S", "quantity": 1}]}),
        )
    };

    let unknown = app.send(reserve("two-shops")).await;
    assert_eq!(app.send(put_sku("TWO-S", "south")).await.status, 201);
    app.receive("TWO-S", 5).await;
    let retried = app.send(reserve("two-shops")).await;
    let two_shops = app.send(reserve("two-shops-again")).await;
    let two_shops_retried = app.send(reserve("two-shops-again")).await;

    assert_eq!(unknown.status, 404, "{unknown:?}");
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, unknown.body);
    assert_eq!(two_shops.status, 409, "{two_shops:?}");
    assert_eq!(two_shops.code().as_deref(), Some("failed_precondition"));
    assert!(two_shops_retried.replayed(), "{two_shops_retried:?}");
    assert_eq!(two_shops_retried.body, two_shops.body);
    for sku in ["TWO-N", "TWO-S"] {
        let shown = app.send(Call::get(format!("/v1/skus/{sku}")).admin()).await;
        assert_eq!(shown.json()["reserved"], 0, "{sku}: {shown:?}");
    }
}

/// Found in review: on PostgreSQL the purge asked for the oldest records first, which
/// the records' BRIN index cannot give in order: every step read and sorted every
/// expired record (a sale's million) to delete a thousand. On each backend the plan
/// takes a batch through the index with no sort of all of them; PostgreSQL is told to
/// avoid a sequential scan, so the plan shows whether the index can answer at all.
async fn the_purge_reads_a_batch_of_old_records_without_sorting_every_old_one(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut connection = app.database.plan_connection().await;
    let purge = match backend {
        Backend::Sqlite => {
            <sqlx::SqliteConnection as store::backend::Dialect>::PURGE_IDEMPOTENCY_RECORDS
        }
        Backend::Postgres => {
            <sqlx::PgConnection as store::backend::Dialect>::PURGE_IDEMPOTENCY_RECORDS
        }
        Backend::Mysql => {
            <sqlx::MySqlConnection as store::backend::Dialect>::PURGE_IDEMPOTENCY_RECORDS
        }
    };
    let purge = purge.replace("$1", "1000").replace("$2", "1000");

    let plan = connection.plan_of(&purge).await;

    match backend {
        // The index the statement reads through, and no sort of the old records.
        Backend::Mysql => {
            assert!(plan.contains("key=idempotency_record_created"), "{plan}");
            assert!(!plan.contains("filesort"), "{plan}");
        }
        Backend::Postgres => {
            assert!(plan.contains("idempotency_record_created"), "{plan}");
            assert!(!plan.contains("Sort"), "{plan}");
        }
        Backend::Sqlite => {
            assert!(plan.contains("idempotency_record_created"), "{plan}");
            assert!(!plan.contains("TEMP B-TREE"), "{plan}");
        }
    }
}

/// Found in review: an optional body may be left out or sent as `{}` (README), but the
/// two had different fingerprints, so a retry whose client sent the other form was
/// refused 422 `idempotency_key_reused` instead of hearing its first answer.
async fn a_body_left_out_and_an_empty_object_are_the_same_request(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let reserved = app.reserve("hold-tea", &[("TEA", 2)]).await;
    assert_eq!(reserved.status, 201, "{reserved:?}");
    let id = reserved.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let first = app.release(&id, "release-tea").await;
    let retried = app
        .send(
            Call::post(format!("/v1/reservations/{id}/release"))
                .key("release-tea")
                .json(&serde_json::json!({})),
        )
        .await;

    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(retried.status, 200, "{retried:?}");
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, first.body);
    assert_eq!(app.counters("TEA").await, (5, 0));
}

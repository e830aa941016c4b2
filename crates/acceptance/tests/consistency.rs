//! Read-your-writes on every backend: answers to writes carry `Stockd-Consistency-Token`
//! (on PostgreSQL the writer's WAL position, `0/0` on backends stockd does not
//! replicate), display answers say who served them and how fresh they are, and a
//! malformed token is refused. Replicas themselves are tested on the local cluster
//! (`crates/lab/tests/cluster.rs`).

use acceptance::{Backend, Call, TestApp, mirrored_tests};
use domain::ConsistencyToken;
use serde_json::json;

mirrored_tests!(
    every_write_answer_carries_a_token_that_a_display_read_accepts,
    a_reservation_answer_carries_the_position_its_batch_reached,
    a_malformed_token_is_refused_and_changes_nothing,
    a_token_past_the_writers_position_is_refused_and_a_real_one_is_served,
);

fn key(purpose: &str) -> String {
    format!("consistency-{purpose}-{}", rand::random::<u64>())
}

fn token_of(response: &acceptance::TestResponse) -> ConsistencyToken {
    let text = response
        .headers
        .get("stockd-consistency-token")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_else(|| panic!("no Stockd-Consistency-Token: {response:?}"));
    ConsistencyToken::parse(text).expect("a token stockd wrote parses")
}

async fn every_write_answer_carries_a_token_that_a_display_read_accepts(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let created = app
        .send(
            Call::put("/v1/skus/TOKEN-1")
                .admin()
                .key(key("sku"))
                .json(&json!({"title": "TV"})),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let first = token_of(&created);
    let received = app
        .send(
            Call::post("/v1/skus/TOKEN-1/stock-movements")
                .admin()
                .key(key("receive"))
                .json(&json!({"kind": "receive", "quantity": 3})),
        )
        .await;
    assert_eq!(received.status, 201, "{received:?}");
    let second = token_of(&received);
    assert!(
        second >= first,
        "positions only move forward: {first} then {second}"
    );
    if backend == Backend::Postgres {
        assert!(
            second > ConsistencyToken::ORIGIN,
            "PostgreSQL names a real position"
        );
    }

    let shown = app
        .send(
            Call::get("/v1/skus/TOKEN-1")
                .admin()
                .consistency_token(second.to_string()),
        )
        .await;
    assert_eq!(shown.status, 200, "{shown:?}");
    assert_eq!(shown.json()["available"], 3, "the read sees the write");
    assert_eq!(
        shown
            .headers
            .get("stockd-served-by")
            .map(|v| v.to_str().unwrap()),
        Some("primary"),
        "without replicas the primary serves every display read"
    );
    let as_of = shown.json()["as_of"].as_str().map(str::to_owned);
    assert!(
        as_of.is_some_and(|as_of| domain::Timestamp::parse_rfc3339(&as_of).is_ok()),
        "{}",
        shown.body
    );
    assert!(
        !shown.headers.contains_key("stockd-consistency-token"),
        "a read is not a write"
    );
}

async fn a_reservation_answer_carries_the_position_its_batch_reached(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TOKEN-2", 5).await;
    let before = token_of(
        &app.send(
            Call::post("/v1/skus/TOKEN-2/stock-movements")
                .admin()
                .key(key("more"))
                .json(&json!({"kind": "receive", "quantity": 1})),
        )
        .await,
    );
    let reservation_key = key("reserve");
    let reserved = app.reserve(&reservation_key, &[("TOKEN-2", 2)]).await;
    assert_eq!(reserved.status, 201, "{reserved:?}");
    let after = token_of(&reserved);
    assert!(after >= before, "{before} then {after}");
    // A replay carries a token too (the position now, past the original's commit).
    let replayed = app.reserve(&reservation_key, &[("TOKEN-2", 2)]).await;
    assert_eq!(replayed.headers.get("idempotent-replayed").unwrap(), "true");
    assert!(token_of(&replayed) >= after);
    // A refusal stored under its key is a unit of work's answer as well.
    let refused = app.reserve(&key("too-many"), &[("TOKEN-2", 50)]).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    token_of(&refused);
}

async fn a_malformed_token_is_refused_and_changes_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TOKEN-3", 1).await;
    let before = app.contents().await;
    for token in [
        "",
        "x",
        "1",
        "1/",
        "0x1/2",
        "1/2/3",
        "123456789/0",
        "  0/1",
        "%00",
    ] {
        let shown = app
            .send(
                Call::get("/v1/skus/TOKEN-3")
                    .admin()
                    .consistency_token(token),
            )
            .await;
        assert_eq!(shown.status, 400, "{token:?}: {shown:?}");
        assert_eq!(shown.json()["code"], "invalid_argument", "{token:?}");
    }
    assert_eq!(
        app.contents().await,
        before,
        "a refused read changed nothing"
    );
}

/// Found in review: a token was checked for its shape only, so any caller, the
/// anonymous shopper's product view included, could send one far ahead of the writer
/// and have every read bypass the display cache, find each replica behind and go to
/// the writer. A token past the writer's position names no write: 400.
async fn a_token_past_the_writers_position_is_refused_and_a_real_one_is_served(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(acceptance::ProductSpec::complete("default", &["TOKEN-4"]))
        .await;
    let on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    assert_eq!(on.status, 200, "{on:?}");
    let received = app.receive("TOKEN-4", 2).await;
    let real = token_of(&received);
    // Past the writer on every backend: on those stockd does not replicate, every
    // write answers the origin, so any other position is one.
    let made_up = ConsistencyToken::from_position(real.position() + (1 << 40));
    let before = app.contents().await;

    let reads = [
        Call::get("/v1/skus/TOKEN-4").admin(),
        Call::get(format!("/v1/products/{product}")).anonymous(),
    ];
    for read in reads {
        let refused = app
            .send(read.clone().consistency_token(made_up.to_string()))
            .await;
        assert_eq!(refused.status, 400, "{refused:?}");
        assert_eq!(refused.json()["code"], "invalid_argument", "{refused:?}");
        assert!(
            refused.json()["detail"]
                .as_str()
                .is_some_and(|detail| detail.contains("has not reached")),
            "{refused:?}"
        );
        let served = app.send(read.consistency_token(real.to_string())).await;
        assert_eq!(served.status, 200, "{served:?}");
    }
    assert_eq!(
        app.contents().await,
        before,
        "a refused read changed nothing"
    );
}

/// Calls the hot path's procedure (migration 0019) for one reservation of `quantity`
/// units of `sku`, as the store would; returns its answer and position.
async fn call_whole_batch(
    app: &TestApp,
    connection: &mut sqlx::PgConnection,
    sku: &str,
    quantity: i64,
) -> (String, Option<String>, String) {
    let now = app.clock_now();
    let id = domain::ReservationId::generate(now, rand::random())
        .as_str()
        .to_owned();
    let key = key("procedure");
    let (answer, position) = sqlx::query_as(
        "CALL stockd_reserve_whole_batch_committed(ARRAY['ON_SHELF'], $1, \
         ARRAY[$2], ARRAY['default'], ARRAY[$3], \
         ARRAY[$4], ARRAY[$5], ARRAY[$6], ARRAY['default'], ARRAY[NULL]::TEXT[], \
         ARRAY[$4], ARRAY[0]::BIGINT[], ARRAY[$2], ARRAY['default'], ARRAY[$3], ARRAY[$6], \
         ARRAY[$6], ARRAY['fingerprint'], ARRAY[201]::BIGINT[], ARRAY['{}'], NULL, NULL)",
    )
    .bind(now.unix_milliseconds())
    .bind(sku)
    .bind(quantity)
    .bind(&id)
    .bind(now.plus_seconds(900).unix_milliseconds())
    .bind(&key)
    .fetch_one(connection)
    .await
    .expect("the procedure runs outside a transaction block");
    (answer, position, id)
}

/// The hot path's one round trip (migration 0019) commits the batch inside the call and
/// reads the writer's position after that commit: the commit record of the batch's
/// transaction ends at or before the position the call returns, so a replica that has
/// replayed to it shows the batch. Read from the WAL itself (`pg_walinspect`).
#[tokio::test]
async fn the_one_round_trip_batch_returns_a_position_at_or_past_its_own_commit_record() {
    if !Backend::Postgres.available().await {
        return;
    }
    let app = TestApp::spawn(Backend::Postgres).await;
    app.stocked_sku("TOKEN-4", 5).await;
    let mut connection = app.database.postgres_connection().await;
    // In `public`: the test's own schema is dropped with it, extensions are per database.
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect SCHEMA public")
        .execute(&mut connection)
        .await
        .expect("pg_walinspect ships with PostgreSQL 15");
    let before: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut connection)
        .await
        .unwrap();

    let (answer, position, id) = call_whole_batch(&app, &mut connection, "TOKEN-4", 2).await;
    assert_eq!(answer, "applied");
    let position = position.expect("an applied batch reports its position");
    ConsistencyToken::parse(&position).expect("a position in PostgreSQL's notation");
    let commit_records: Vec<(String, bool)> = sqlx::query_as(
        "SELECT record.end_lsn::text, record.end_lsn <= $2::pg_lsn \
         FROM public.pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) AS record \
         WHERE record.resource_manager = 'Transaction' AND record.record_type = 'COMMIT' \
           AND record.xid::text = (SELECT xmin::text FROM reservation WHERE id = $3)",
    )
    .bind(&before)
    .bind(&position)
    .bind(&id)
    .fetch_all(&mut connection)
    .await
    .unwrap();
    assert_eq!(
        commit_records.len(),
        1,
        "the batch's commit lies between {before} and the returned {position}: {commit_records:?}"
    );
    assert!(
        commit_records[0].1,
        "{commit_records:?} ends after {position}"
    );
    // Committed: another session sees the stock taken.
    assert_eq!(app.counters("TOKEN-4").await, (3, 2));

    // A batch that does not fit writes nothing and reports no position.
    let (answer, position, _) = call_whole_batch(&app, &mut connection, "TOKEN-4", 50).await;
    assert_eq!((answer.as_str(), position), ("does_not_fit", None));
    assert_eq!(app.counters("TOKEN-4").await, (3, 2));
    app.assert_audit_clean().await;
}

/// The whole-batch function looks its keys up with a cached generic plan (migration
/// 0020). Planned while `idempotency_record` holds a page of rows, that plan must still
/// be the primary-key lookup, or a table grown to millions of rows would be read whole
/// for every batch: PostgreSQL's own counters for this transaction show an index scan
/// of the table and no sequential scan.
#[tokio::test]
async fn the_whole_batch_key_lookup_reads_the_primary_key_of_a_table_analyzed_small() {
    if !Backend::Postgres.available().await {
        return;
    }
    let app = TestApp::spawn(Backend::Postgres).await;
    app.stocked_sku("PLAN-1", 5).await;
    let mut connection = app.database.postgres_connection().await;
    sqlx::query("ANALYZE idempotency_record")
        .execute(&mut connection)
        .await
        .unwrap();
    let pages: i32 = sqlx::query_scalar(
        "SELECT relpages FROM pg_class WHERE oid = 'idempotency_record'::regclass",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap();
    assert!(pages <= 1, "the table is analyzed small: {pages} pages");

    // The function itself, in a transaction this test rolls back: the counters of
    // `pg_stat_xact_user_tables` are this transaction's alone, whatever the server's
    // workers read meanwhile.
    let now = app.clock_now();
    let id = domain::ReservationId::generate(now, rand::random())
        .as_str()
        .to_owned();
    let key = key("plan");
    sqlx::query("BEGIN").execute(&mut connection).await.unwrap();
    let answer: String = sqlx::query_scalar(
        "SELECT stockd_reserve_whole_batch(ARRAY['ON_SHELF'], $1, \
         ARRAY['PLAN-1'], ARRAY['default'], ARRAY[1]::BIGINT[], \
         ARRAY[$2], ARRAY[$3], ARRAY[$4], ARRAY['default'], ARRAY[NULL]::TEXT[], \
         ARRAY[$2], ARRAY[0]::BIGINT[], ARRAY['PLAN-1'], ARRAY['default'], ARRAY[1]::BIGINT[], \
         ARRAY[$4], ARRAY[$4], ARRAY['fingerprint'], ARRAY[201]::BIGINT[], ARRAY['{}'])",
    )
    .bind(now.unix_milliseconds())
    .bind(&id)
    .bind(now.plus_seconds(900).unix_milliseconds())
    .bind(&key)
    .fetch_one(&mut connection)
    .await
    .unwrap();
    assert_eq!(answer, "applied");
    let (sequential, indexed): (i64, i64) = sqlx::query_as(
        "SELECT seq_scan, COALESCE(idx_scan, 0) FROM pg_stat_xact_user_tables \
         WHERE relid = 'idempotency_record'::regclass",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap();
    sqlx::query("ROLLBACK")
        .execute(&mut connection)
        .await
        .unwrap();
    assert_eq!(sequential, 0, "no sequential scan of idempotency_record");
    assert!(indexed >= 1, "the key lookup is an index scan");
    assert_eq!(app.counters("PLAN-1").await, (5, 0), "rolled back");
}

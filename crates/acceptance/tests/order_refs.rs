//! The deduction contract of seed 002 §十三.1 (issue 17): reservations and orders take
//! the shop's order number (`order_ref`) and the calling channel (`source`); an order
//! number is used once per shop, so the same number under another Idempotency-Key is
//! refused (`order_ref_reused`, seed 002 §十.1 "不同请求号重复使用同一订单号") and
//! changes nothing, while the same key replays; the answers carry both, and the ids
//! of the ledger rows their effect wrote, each readable at
//! `GET /v1/stock-movements/{movement_id}`.

use acceptance::{Backend, Call, TestApp, TestResponse, mirrored_tests};
use serde_json::{Value, json};

mirrored_tests!(
    a_reservation_carries_its_order_ref_and_source_in_every_answer,
    the_same_order_ref_under_another_key_is_refused_and_changes_nothing,
    the_same_order_ref_under_the_same_key_replays_the_first_answer,
    an_order_number_of_an_order_is_refused_for_a_reservation_too,
    racing_requests_with_one_order_ref_place_exactly_one,
    malformed_order_refs_and_sources_are_refused_with_nothing_changed,
    every_answer_that_moves_stock_names_its_ledger_rows_and_each_can_be_looked_up,
    movement_lookups_outside_the_callers_shop_or_malformed_are_refused,
);

async fn reserve_with(app: &TestApp, key: &str, body: Value) -> TestResponse {
    app.send(Call::post("/v1/reservations").key(key).json(&body))
        .await
}

fn one_tea(order_ref: &str) -> Value {
    json!({"lines": [{"sku": "TEA", "quantity": 1}], "order_ref": order_ref, "source": "web"})
}

async fn a_reservation_carries_its_order_ref_and_source_in_every_answer(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;

    let created = reserve_with(&app, "so-1", one_tea("SO-2026-0001")).await;

    assert_eq!(created.status, 201, "{created:?}");
    let body = created.json();
    assert_eq!(body["order_ref"], "SO-2026-0001");
    assert_eq!(body["source"], "web");
    assert_eq!(body["status"], "RESERVED");
    let id = body["reservation_id"].as_str().unwrap();
    let read = app.send(Call::get(format!("/v1/reservations/{id}"))).await;
    assert_eq!(read.json()["order_ref"], "SO-2026-0001");
    assert_eq!(read.json()["source"], "web");
    let plain = app.reserve("plain", &[("TEA", 1)]).await;
    assert!(
        plain.json().get("order_ref").is_none(),
        "{:?}",
        plain.json()
    );
}

async fn the_same_order_ref_under_another_key_is_refused_and_changes_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    assert_eq!(
        reserve_with(&app, "first", one_tea("SO-7")).await.status,
        201
    );
    let before = app.contents_except_idempotency_records().await;

    let again = reserve_with(&app, "second", one_tea("SO-7")).await;

    assert_eq!(again.status, 409, "{again:?}");
    assert_eq!(again.code().as_deref(), Some("order_ref_reused"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_eq!(app.sku("TEA").await["reserved"], 1);
    // The refusal is the second key's answer from now on.
    let repeated = reserve_with(&app, "second", one_tea("SO-7")).await;
    assert_eq!(repeated.status, 409);
    assert!(repeated.replayed());
}

async fn the_same_order_ref_under_the_same_key_replays_the_first_answer(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let first = reserve_with(&app, "once", one_tea("SO-8")).await;

    let again = reserve_with(&app, "once", one_tea("SO-8")).await;

    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.json(), first.json());
    assert_eq!(app.sku("TEA").await["reserved"], 1);
}

async fn an_order_number_of_an_order_is_refused_for_a_reservation_too(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let ordered = app
        .send(Call::post("/v1/orders").key("order-so-9").json(&json!({
            "user_id": "ann",
            "lines": [{"sku": "TEA", "quantity": 1}],
            "order_ref": "SO-9",
            "source": "app",
        })))
        .await;
    assert_eq!(ordered.status, 201, "{ordered:?}");
    assert_eq!(ordered.json()["order_ref"], "SO-9");
    assert_eq!(ordered.json()["source"], "app");
    let before = app.contents_except_idempotency_records().await;

    let reused = reserve_with(&app, "reservation-so-9", one_tea("SO-9")).await;
    let reordered = app
        .send(
            Call::post("/v1/orders")
                .key("order-so-9-again")
                .json(&json!({
                    "user_id": "bob",
                    "lines": [{"sku": "TEA", "quantity": 1}],
                    "order_ref": "SO-9",
                })),
        )
        .await;

    assert_eq!(reused.code().as_deref(), Some("order_ref_reused"));
    assert_eq!(reordered.status, 409);
    assert_eq!(reordered.code().as_deref(), Some("order_ref_reused"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn racing_requests_with_one_order_ref_place_exactly_one(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 50).await;

    let racers: Vec<_> = (0..10)
        .map(|index| {
            let app = app.clone();
            tokio::spawn(async move {
                reserve_with(&app, &format!("racer-{index}"), one_tea("SO-RACE")).await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for racer in racers {
        let answered = racer.await.unwrap();
        statuses.push((answered.status, answered.code()));
    }

    let placed = statuses.iter().filter(|(status, _)| *status == 201).count();
    let refused = statuses
        .iter()
        .filter(|(status, code)| *status == 409 && code.as_deref() == Some("order_ref_reused"))
        .count();
    assert_eq!((placed, refused), (1, 9), "{statuses:?}");
    assert_eq!(app.sku("TEA").await["reserved"], 1);
}

async fn malformed_order_refs_and_sources_are_refused_with_nothing_changed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let before = app.contents().await;
    let too_long = "S".repeat(65);
    let hostile = [
        json!({"lines": [{"sku": "TEA", "quantity": 1}], "order_ref": ""}),
        json!({"lines": [{"sku": "TEA", "quantity": 1}], "order_ref": too_long}),
        json!({"lines": [{"sku": "TEA", "quantity": 1}], "order_ref": "SO 1; DROP TABLE stock"}),
        json!({"lines": [{"sku": "TEA", "quantity": 1}], "order_ref": 12}),
        json!({"lines": [{"sku": "TEA", "quantity": 1}], "source": "web/../../etc"}),
        json!({"lines": [{"sku": "TEA", "quantity": 1}], "source": "x".repeat(33)}),
    ];

    for (index, body) in hostile.iter().enumerate() {
        let answered = reserve_with(&app, &format!("hostile-{index}"), body.clone()).await;
        assert_eq!(answered.status, 400, "{body}: {answered:?}");
        assert_eq!(answered.code().as_deref(), Some("invalid_argument"));
    }
    assert_eq!(app.contents().await, before);
}

/// The movement ids of an answer, each looked up: the row it names, as a JSON object.
async fn look_up(app: &TestApp, movement_ids: &Value) -> Vec<Value> {
    let mut rows = Vec::new();
    for id in movement_ids.as_array().expect("movement_ids is a list") {
        let id = id.as_str().unwrap();
        let found = app
            .send(Call::get(format!("/v1/stock-movements/{id}")))
            .await;
        assert_eq!(found.status, 200, "{id}: {found:?}");
        assert_eq!(found.json()["movement_id"], id);
        rows.push(found.json());
    }
    rows
}

/// (kind, sku, warehouse, available_delta, reserved_delta) of each row.
fn movements(rows: &[Value]) -> Vec<(String, String, String, i64, i64)> {
    rows.iter()
        .map(|row| {
            (
                row["kind"].as_str().unwrap().to_owned(),
                row["sku"].as_str().unwrap().to_owned(),
                row["warehouse"].as_str().unwrap().to_owned(),
                row["available_delta"].as_i64().unwrap(),
                row["reserved_delta"].as_i64().unwrap(),
            )
        })
        .collect()
}

fn movement(
    kind: &str,
    sku: &str,
    warehouse: &str,
    available: i64,
    reserved: i64,
) -> (String, String, String, i64, i64) {
    (
        kind.into(),
        sku.into(),
        warehouse.into(),
        available,
        reserved,
    )
}

async fn every_answer_that_moves_stock_names_its_ledger_rows_and_each_can_be_looked_up(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.create_sku("TEA").await;
    app.create_sku("COFFEE").await;
    let received = app.receive_in("TEA", 5, None).await;
    app.receive_in("COFFEE", 5, Some("east")).await;
    let receipt = look_up(&app, &json!([received.json()["movement_id"]])).await;
    assert_eq!(
        movements(&receipt),
        [movement("receive", "TEA", "default", 5, 0)]
    );
    assert_eq!(receipt[0]["reference"], received.json()["movement_id"]);

    // The lines in the request's order (not the lock order): line 0 is TEA.
    let reserved = reserve_with(
        &app,
        "two-lines",
        json!({"lines": [
            {"sku": "TEA", "quantity": 2},
            {"sku": "COFFEE", "quantity": 1, "warehouse": "east"},
        ], "order_ref": "SO-LEDGER"}),
    )
    .await;
    assert_eq!(reserved.status, 201, "{reserved:?}");
    let body = reserved.json();
    let id = body["reservation_id"].as_str().unwrap();
    assert_eq!(
        body["movement_ids"],
        json!([format!("{id}.reserve.0"), format!("{id}.reserve.1")])
    );
    let rows = look_up(&app, &body["movement_ids"]).await;
    assert_eq!(
        movements(&rows),
        [
            movement("reserve", "TEA", "default", -2, 2),
            movement("reserve", "COFFEE", "east", -1, 1),
        ]
    );
    assert!(
        rows.iter()
            .all(|row| row["reference"] == id && row["shop"] == "default")
    );
    assert!(rows[0]["ledger_id"].as_i64().unwrap() > receipt[0]["ledger_id"].as_i64().unwrap());

    let confirmed = app.confirm(id, "confirm-two-lines").await;
    assert_eq!(confirmed.status, 200, "{confirmed:?}");
    let confirmed_ids = &confirmed.json()["movement_ids"];
    assert_eq!(confirmed_ids.as_array().unwrap().len(), 4);
    assert_eq!(
        movements(&look_up(&app, confirmed_ids).await)[2..],
        [
            movement("confirm", "TEA", "default", 0, -2),
            movement("confirm", "COFFEE", "east", 0, -1),
        ]
    );
    let read = app.send(Call::get(format!("/v1/reservations/{id}"))).await;
    assert_eq!(
        &read.json()["movement_ids"],
        confirmed_ids,
        "a read shows the same ids"
    );

    let held = app.reserve("to-release", &[("TEA", 1)]).await;
    let held_id = held.json()["reservation_id"].as_str().unwrap().to_owned();
    let released = app.release(&held_id, "release-it").await;
    assert_eq!(
        movements(&look_up(&app, &released.json()["movement_ids"]).await),
        [
            movement("reserve", "TEA", "default", -1, 1),
            movement("release", "TEA", "default", 1, -1),
        ]
    );
    // A refused request moved nothing and names nothing.
    let refused = app.reserve("too-many", &[("TEA", 50)]).await;
    assert_eq!(refused.status, 409);
    assert!(refused.json().get("movement_ids").is_none());
    // A line that was never moved that way, or does not exist, is not found.
    for absent in [
        format!("{held_id}.confirm.0"),
        format!("{id}.reserve.2"),
        format!("{id}.release.0"),
    ] {
        let answer = app
            .send(Call::get(format!("/v1/stock-movements/{absent}")))
            .await;
        assert_eq!(answer.status, 404, "{absent}: {answer:?}");
        assert_eq!(answer.code().as_deref(), Some("not_found"));
    }
    app.assert_audit_clean().await;
}

async fn movement_lookups_outside_the_callers_shop_or_malformed_are_refused(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let reserved = app.reserve("mine", &[("TEA", 1)]).await;
    let id = reserved.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/v1/stock-movements/{id}.reserve.0");
    let south_key = app.create_service_key("south", "south-checkout").await;
    let south_operator = app.create_operator("sam", "south").await;
    let default_operator = app.create_operator("dora", "default").await;
    let before = app.contents().await;

    let anonymous = app.send(Call::get(&path).anonymous()).await;
    let other_key = app.send(Call::get(&path).bearer(&south_key)).await;
    let other_staff = app.send(Call::get(&path).bearer(&south_operator)).await;
    let own_staff = app.send(Call::get(&path).bearer(&default_operator)).await;

    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    assert_eq!(other_key.status, 403, "{other_key:?}");
    assert_eq!(other_key.code().as_deref(), Some("forbidden"));
    assert_eq!(other_staff.status, 403, "{other_staff:?}");
    assert_eq!(own_staff.status, 200, "{own_staff:?}");
    for malformed in [
        "nothing",
        "mov_123",
        &id.clone(),
        &format!("{id}.reserve"),
        &format!("{id}.reserve.x"),
        &format!("{id}.reserve.-1"),
        &format!("{id}.reserve.007"),
        &format!("{id}.reserve.99999999999999999999"),
        &format!("{id}.take.0"),
        &format!("{id}.return.0"),
        "rsv_%27%20OR%201%3D1.reserve.0",
    ] {
        let answer = app
            .send(Call::get(format!("/v1/stock-movements/{malformed}")))
            .await;
        assert_eq!(answer.status, 400, "{malformed}: {answer:?}");
        assert_eq!(answer.code().as_deref(), Some("invalid_argument"));
    }
    assert_eq!(app.contents().await, before, "lookups change nothing");
}

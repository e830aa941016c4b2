//! The deduction contract of seed 002 §十三.1 (issue 17): reservations and orders take
//! the shop's order number (`order_ref`) and the calling channel (`source`); an order
//! number is used once per shop, so the same number under another Idempotency-Key is
//! refused (`order_ref_reused`, seed 002 §十.1 "不同请求号重复使用同一订单号") and
//! changes nothing, while the same key replays; the answers carry both.

use acceptance::{Backend, Call, TestApp, TestResponse, mirrored_tests};
use serde_json::{Value, json};

mirrored_tests!(
    a_reservation_carries_its_order_ref_and_source_in_every_answer,
    the_same_order_ref_under_another_key_is_refused_and_changes_nothing,
    the_same_order_ref_under_the_same_key_replays_the_first_answer,
    an_order_number_of_an_order_is_refused_for_a_reservation_too,
    racing_requests_with_one_order_ref_place_exactly_one,
    malformed_order_refs_and_sources_are_refused_with_nothing_changed,
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

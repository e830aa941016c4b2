//! The seeds' acceptance cases for reserving stock, on SQLite and PostgreSQL.

use std::collections::HashMap;

use acceptance::payments::TestGateway;
use acceptance::{Backend, Call, TestApp, mirrored_tests, send_concurrently, test_engine_config};
use serde_json::json;

mirrored_tests!(
    every_ledger_row_of_a_keyed_request_carries_its_key,
    last_unit_goes_to_exactly_one_of_a_hundred_concurrent_buyers_and_retries_replay,
    ten_units_go_to_exactly_ten_of_a_thousand_concurrent_buyers,
    multi_line_reservations_taking_skus_in_opposite_orders_never_surface_a_deadlock,
    a_multi_line_reservation_is_all_or_nothing,
    releasing_twice_returns_stock_once,
    confirming_twice_consumes_stock_once,
    releasing_after_confirm_is_an_illegal_transition,
    a_restart_between_reserve_and_confirm_keeps_everything,
    reserving_an_unknown_sku_is_not_found_and_reserves_nothing,
    reservations_in_a_named_warehouse_use_that_warehouse_stock,
    a_sold_out_sku_is_answered_from_memory_within_the_recheck_bound_and_its_keys_replay,
    stock_given_back_here_sells_at_once_and_stock_given_back_elsewhere_within_the_bound,
    a_request_naming_an_order_ref_is_decided_by_the_database_while_its_sku_is_sold_out,
    an_expiry_or_a_payment_after_the_hold_here_forgets_what_was_found_sold_out,
    a_key_whose_caller_went_away_before_its_hold_was_answered_is_never_answered_from_memory,
    a_key_answered_before_a_restart_replays_where_memory_finds_the_sku_sold_out,
);

/// The words of a sold-out answer given from this process's memory (not the database).
const FROM_MEMORY: &str = "this instance found it so";

fn reservation_call(key: &str, sku: &str, quantity: i64) -> Call {
    Call::post("/v1/reservations")
        .key(key)
        .json(&json!({"lines": [{"sku": sku, "quantity": quantity}]}))
}

async fn last_unit_goes_to_exactly_one_of_a_hundred_concurrent_buyers_and_retries_replay(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAST-UNIT", 1).await;

    // 100 distinct requests, and the first 10 of them sent 5 more times each.
    let mut calls: Vec<(String, Call)> = (0..100)
        .map(|index| {
            let key = format!("buyer-{index}");
            (key.clone(), reservation_call(&key, "LAST-UNIT", 1))
        })
        .collect();
    for index in 0..10 {
        for _ in 0..5 {
            let key = format!("buyer-{index}");
            calls.push((key.clone(), reservation_call(&key, "LAST-UNIT", 1)));
        }
    }
    let keys: Vec<String> = calls.iter().map(|(key, _)| key.clone()).collect();
    let responses =
        send_concurrently(&app, calls.into_iter().map(|(_, call)| call).collect()).await;

    let mut by_key: HashMap<&str, Vec<&acceptance::TestResponse>> = HashMap::new();
    for (key, response) in keys.iter().zip(&responses) {
        by_key.entry(key).or_default().push(response);
    }
    let winners: Vec<&str> = by_key
        .iter()
        .filter(|(_, answers)| answers.iter().any(|answer| answer.status == 201))
        .map(|(key, _)| *key)
        .collect();
    assert_eq!(
        winners.len(),
        1,
        "exactly one buyer gets the last unit: {winners:?}"
    );
    for (key, answers) in &by_key {
        let first = answers[0];
        if first.status != 201 {
            assert_eq!(first.status, 409, "{key}: {first:?}");
            assert_eq!(first.code().as_deref(), Some("insufficient_stock"), "{key}");
        }
        // Every answer for one key is the first answer, byte for byte; all but one
        // of them are flagged as replays.
        for answer in answers {
            assert_eq!(
                (answer.status, &answer.body),
                (first.status, &first.body),
                "{key}"
            );
        }
        let fresh = answers.iter().filter(|answer| !answer.replayed()).count();
        if first.body.contains(FROM_MEMORY) {
            // Refused from this process's memory once the unit was gone: nothing was
            // stored under the key, so each copy was answered afresh, alike.
            assert_eq!(fresh, answers.len(), "{key}");
        } else {
            assert_eq!(fresh, 1, "{key}: one fresh answer, the rest replays");
        }
    }
    assert_eq!(app.counters("LAST-UNIT").await, (0, 1));
    assert_eq!(
        app.ledger_rows("LAST-UNIT", "reserve").await,
        1,
        "one ledger effect"
    );
    app.assert_audit_clean().await;
}

async fn ten_units_go_to_exactly_ten_of_a_thousand_concurrent_buyers(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LIMITED", 10).await;

    let calls = (0..1000)
        .map(|index| reservation_call(&format!("limited-{index}"), "LIMITED", 1))
        .collect();
    let responses = send_concurrently(&app, calls).await;

    let successes = responses
        .iter()
        .filter(|response| response.status == 201)
        .count();
    let sold_out = responses
        .iter()
        .filter(|response| response.code().as_deref() == Some("insufficient_stock"))
        .count();
    assert_eq!(successes, 10);
    assert_eq!(sold_out, 990, "every other answer is insufficient_stock");
    assert_eq!(app.counters("LIMITED").await, (0, 10));
    assert_eq!(app.ledger_rows("LIMITED", "reserve").await, 10);
    app.assert_audit_clean().await;
}

async fn multi_line_reservations_taking_skus_in_opposite_orders_never_surface_a_deadlock(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    for sku in ["APPLE", "BREAD", "CHEESE"] {
        app.stocked_sku(sku, 40).await;
    }
    let orders = [
        ["APPLE", "BREAD", "CHEESE"],
        ["CHEESE", "BREAD", "APPLE"],
        ["BREAD", "CHEESE", "APPLE"],
    ];
    let calls = (0..150)
        .map(|index| {
            let skus = orders[index % orders.len()];
            let lines: Vec<_> = skus
                .iter()
                .map(|sku| json!({"sku": sku, "quantity": 1}))
                .collect();
            Call::post("/v1/reservations")
                .key(format!("multi-{index}"))
                .json(&json!({"lines": lines}))
        })
        .collect();
    let responses = send_concurrently(&app, calls).await;

    for response in &responses {
        assert!(
            response.status == 201 || response.code().as_deref() == Some("insufficient_stock"),
            "every request ends in success or insufficient_stock: {response:?}"
        );
    }
    let successes = responses
        .iter()
        .filter(|response| response.status == 201)
        .count();
    assert_eq!(
        successes, 40,
        "40 units of each SKU make exactly 40 three-line reservations"
    );
    for sku in ["APPLE", "BREAD", "CHEESE"] {
        assert_eq!(app.counters(sku).await, (0, 40), "{sku}");
    }
    app.assert_audit_clean().await;
}

async fn a_multi_line_reservation_is_all_or_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("PLENTY", 10).await;
    app.stocked_sku("SCARCE", 1).await;

    let refused = app.reserve("both", &[("PLENTY", 3), ("SCARCE", 2)]).await;

    assert_eq!(refused.status, 409);
    assert_eq!(refused.code().as_deref(), Some("insufficient_stock"));
    assert_eq!(
        app.counters("PLENTY").await,
        (10, 0),
        "the line that fit took nothing"
    );
    assert_eq!(app.counters("SCARCE").await, (1, 0));
    let accepted = app.reserve("fits", &[("PLENTY", 3), ("SCARCE", 1)]).await;
    assert_eq!(accepted.status, 201, "{accepted:?}");
    assert_eq!(app.counters("PLENTY").await, (7, 3));
    assert_eq!(app.counters("SCARCE").await, (0, 1));
    app.assert_audit_clean().await;
}

async fn releasing_twice_returns_stock_once(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TWICE", 5).await;
    let reservation = app.reserve("hold", &[("TWICE", 2)]).await.json();
    let id = reservation["reservation_id"].as_str().unwrap();

    let first = app.release(id, "release-1").await;
    let replay = app.release(id, "release-1").await;
    let second = app.release(id, "release-2").await;

    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.json()["status"], "RELEASED");
    assert_eq!(first.json()["release_reason"], "requested");
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(second.status, 409);
    assert_eq!(second.code().as_deref(), Some("illegal_transition"));
    assert_eq!(
        app.counters("TWICE").await,
        (5, 0),
        "stock returned exactly once"
    );
    assert_eq!(app.ledger_rows("TWICE", "release").await, 1);
    app.assert_audit_clean().await;
}

async fn confirming_twice_consumes_stock_once(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CONSUME", 5).await;
    let reservation = app.reserve("hold", &[("CONSUME", 2)]).await.json();
    let id = reservation["reservation_id"].as_str().unwrap();

    let first = app.confirm(id, "confirm-1").await;
    let replay = app.confirm(id, "confirm-1").await;
    let second = app.confirm(id, "confirm-2").await;

    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.json()["status"], "CONFIRMED");
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(second.code().as_deref(), Some("illegal_transition"));
    assert_eq!(
        app.counters("CONSUME").await,
        (3, 0),
        "two units consumed, once"
    );
    assert_eq!(app.ledger_rows("CONSUME", "confirm").await, 1);
    app.assert_audit_clean().await;
}

async fn releasing_after_confirm_is_an_illegal_transition(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SOLD", 5).await;
    let reservation = app.reserve("hold", &[("SOLD", 2)]).await.json();
    let id = reservation["reservation_id"].as_str().unwrap();
    assert_eq!(app.confirm(id, "confirm").await.status, 200);
    let before = app.contents_except_idempotency_records().await;

    let release = app.release(id, "release-after-confirm").await;

    assert_eq!(release.status, 409);
    assert_eq!(release.code().as_deref(), Some("illegal_transition"));
    assert!(
        release.json()["detail"]
            .as_str()
            .unwrap()
            .contains("CONFIRMED to RELEASED")
    );
    assert_eq!(app.counters("SOLD").await, (3, 0));
    assert_eq!(
        app.contents_except_idempotency_records().await,
        before,
        "the refusal changed nothing but its own idempotency record"
    );
    app.assert_audit_clean().await;
}

async fn a_restart_between_reserve_and_confirm_keeps_everything(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("DURABLE", 3).await;
    let reserved = app.reserve("before-restart", &[("DURABLE", 2)]).await;
    assert_eq!(reserved.status, 201);
    let id = reserved.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let app = app.restart().await;

    let replay = app.reserve("before-restart", &[("DURABLE", 2)]).await;
    assert!(
        replay.replayed(),
        "the idempotency record survived the restart"
    );
    assert_eq!(replay.body, reserved.body);
    assert_eq!(app.counters("DURABLE").await, (1, 2));
    let confirmed = app.confirm(&id, "after-restart").await;
    assert_eq!(confirmed.status, 200, "{confirmed:?}");
    assert_eq!(app.counters("DURABLE").await, (1, 0));
    app.assert_audit_clean().await;
}

async fn reserving_an_unknown_sku_is_not_found_and_reserves_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KNOWN", 5).await;

    let response = app
        .reserve("unknown", &[("KNOWN", 1), ("NO-SUCH-SKU", 1)])
        .await;

    assert_eq!(response.status, 404);
    assert_eq!(response.code().as_deref(), Some("not_found"));
    assert_eq!(app.counters("KNOWN").await, (5, 0));
    let replay = app
        .reserve("unknown", &[("KNOWN", 1), ("NO-SUCH-SKU", 1)])
        .await;
    assert!(replay.replayed(), "a refusal is replayed like a success");
    assert_eq!(replay.body, response.body);
}

async fn reservations_in_a_named_warehouse_use_that_warehouse_stock(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.create_sku("SPLIT").await;
    app.receive_in("SPLIT", 2, Some("east")).await;
    app.receive_in("SPLIT", 5, None).await;

    let east = app
        .send(
            Call::post("/v1/reservations")
                .key("east-3")
                .json(&json!({"lines": [{"sku": "SPLIT", "quantity": 3, "warehouse": "east"}]})),
        )
        .await;
    assert_eq!(
        east.code().as_deref(),
        Some("insufficient_stock"),
        "east holds only 2"
    );
    let default = app.reserve("default-3", &[("SPLIT", 3)]).await;
    assert_eq!(default.status, 201);
    assert_eq!(default.json()["lines"][0]["warehouse"], "default");

    let sku = app.sku("SPLIT").await;
    assert_eq!(sku["available"], 4);
    assert_eq!(sku["reserved"], 3);
    assert_eq!(sku["warehouses"][0]["warehouse"], "default");
    assert_eq!(sku["warehouses"][0]["available"], 2);
    assert_eq!(sku["warehouses"][1]["warehouse"], "east");
    assert_eq!(sku["warehouses"][1]["available"], 2);
    app.assert_audit_clean().await;
}

async fn a_sold_out_sku_is_answered_from_memory_within_the_recheck_bound_and_its_keys_replay(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAMP", 2).await;
    app.stocked_sku("BULB", 5).await;
    assert_eq!(app.reserve("lamp-1", &[("LAMP", 2)]).await.status, 201);
    let refused = app.reserve("lamp-2", &[("LAMP", 1)]).await;
    assert_eq!(refused.code().as_deref(), Some("insufficient_stock"));
    assert!(!refused.body.contains(FROM_MEMORY), "{refused:?}");
    assert!(
        refused.headers.contains_key("stockd-consistency-token"),
        "decided by the database: {refused:?}"
    );
    let before = app.contents().await;

    let from_memory = app.reserve("lamp-3", &[("LAMP", 1)]).await;
    let order = app
        .create_order("lamp-order", "user-1", &[("LAMP", 1)])
        .await;
    let with_another_line = app.reserve("lamp-4", &[("BULB", 1), ("LAMP", 1)]).await;

    for answer in [&from_memory, &order, &with_another_line] {
        assert_eq!(answer.status, 409, "{answer:?}");
        assert_eq!(answer.code().as_deref(), Some("insufficient_stock"));
        assert!(answer.body.contains(FROM_MEMORY), "{answer:?}");
        assert!(
            !answer.headers.contains_key("stockd-consistency-token"),
            "no unit of work, no position: {answer:?}"
        );
    }
    assert_eq!(
        app.contents().await,
        before,
        "a memory answer stores nothing, not even its key"
    );
    // A key this instance answered goes to the database, which replays its answer.
    let retried = app.reserve("lamp-2", &[("LAMP", 1)]).await;
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(
        (retried.status, &retried.body),
        (refused.status, &refused.body)
    );
    // Past the bound the database decides again.
    let recheck = app.engine.config().sold_out_recheck_milliseconds;
    app.clock.advance_milliseconds(recheck);
    let asked = app.reserve("lamp-5", &[("LAMP", 1)]).await;
    assert_eq!(asked.code().as_deref(), Some("insufficient_stock"));
    assert!(!asked.body.contains(FROM_MEMORY), "{asked:?}");
    app.assert_audit_clean().await;
}

async fn stock_given_back_here_sells_at_once_and_stock_given_back_elsewhere_within_the_bound(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FAN", 1).await;
    let held = app.reserve("fan-1", &[("FAN", 1)]).await;
    let held = held.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.reserve("fan-2", &[("FAN", 1)]).await.status, 409);
    assert!(
        app.reserve("fan-3", &[("FAN", 1)])
            .await
            .body
            .contains(FROM_MEMORY)
    );

    // A release here forgets what this process found short…
    assert_eq!(app.release(&held, "fan-release").await.status, 200);
    assert_eq!(app.reserve("fan-4", &[("FAN", 1)]).await.status, 201);
    // …and so does a receive.
    assert_eq!(app.reserve("fan-5", &[("FAN", 1)]).await.status, 409);
    assert!(
        app.reserve("fan-6", &[("FAN", 1)])
            .await
            .body
            .contains(FROM_MEMORY)
    );
    assert_eq!(app.receive("FAN", 1).await.status, 201);
    assert_eq!(app.reserve("fan-7", &[("FAN", 1)]).await.status, 201);

    if backend != Backend::Sqlite {
        // Two instances on one SQLite file are not a deployment stockd supports.
        // A unit received on another instance is sold here once the bound has passed.
        let other = app.another_instance().await;
        assert_eq!(app.reserve("fan-8", &[("FAN", 1)]).await.status, 409);
        assert_eq!(other.receive("FAN", 1).await.status, 201);
        let still = app.reserve("fan-9", &[("FAN", 1)]).await;
        assert!(still.body.contains(FROM_MEMORY), "{still:?}");
        let recheck = app.engine.config().sold_out_recheck_milliseconds;
        app.clock.advance_milliseconds(recheck);
        assert_eq!(app.reserve("fan-10", &[("FAN", 1)]).await.status, 201);
    }
    app.assert_audit_clean().await;
}

async fn a_request_naming_an_order_ref_is_decided_by_the_database_while_its_sku_is_sold_out(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KETTLE", 1).await;
    let with_order_ref = |key: &str| {
        Call::post("/v1/reservations")
            .key(key)
            .json(&json!({"lines": [{"sku": "KETTLE", "quantity": 1}], "order_ref": "SO-1"}))
    };
    assert_eq!(app.send(with_order_ref("so-1-first")).await.status, 201);
    assert_eq!(app.reserve("kettle-2", &[("KETTLE", 1)]).await.status, 409);
    assert!(
        app.reserve("kettle-3", &[("KETTLE", 1)])
            .await
            .body
            .contains(FROM_MEMORY)
    );

    // The caller lost its answer and retries under a new key: it hears that its order
    // number holds stock already, not "sold out".
    let retried = app.send(with_order_ref("so-1-second")).await;

    assert_eq!(retried.status, 409, "{retried:?}");
    assert_eq!(
        retried.code().as_deref(),
        Some("order_ref_reused"),
        "{retried:?}"
    );
    app.assert_audit_clean().await;
}

async fn an_expiry_or_a_payment_after_the_hold_here_forgets_what_was_found_sold_out(
    backend: Backend,
) {
    // Findings trusted for an hour, so that only what this process did can end them.
    let config = engine::config::EngineConfig {
        sold_out_recheck_milliseconds: 3_600_000,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    let _gateway = TestGateway::start(&app).await;
    app.stocked_sku("KETTLE", 1).await;
    let sold_out = |key: &'static str| {
        let app = &app;
        async move {
            assert_eq!(
                app.reserve(&format!("{key}-asks"), &[("KETTLE", 1)])
                    .await
                    .status,
                409
            );
            let remembered = app
                .reserve(&format!("{key}-remembered"), &[("KETTLE", 1)])
                .await;
            assert!(remembered.body.contains(FROM_MEMORY), "{remembered:?}");
        }
    };

    // A hold expires through the expiry worker's step…
    let held = app.reserve("kettle-held", &[("KETTLE", 1)]).await;
    assert_eq!(held.status, 201, "{held:?}");
    sold_out("before-expiry").await;
    app.clock.advance_seconds(held_seconds(&app, &held) + 1);
    assert_eq!(app.engine.expire_step().await.unwrap().released.len(), 1);
    assert_eq!(
        app.reserve("after-expiry", &[("KETTLE", 1)]).await.status,
        201
    );

    // …and an order's hold ends, seen by its payment.
    app.clock.advance_seconds(HOUR_SECONDS);
    assert_eq!(app.engine.expire_step().await.unwrap().released.len(), 1);
    let order = app
        .create_order("kettle-order", "user-1", &[("KETTLE", 1)])
        .await;
    assert_eq!(order.status, 201, "{order:?}");
    sold_out("before-payment").await;
    app.clock.advance_seconds(held_seconds(&app, &order) + 1);
    let order_id = order.json()["order_id"].as_str().unwrap().to_owned();
    let late = app.pay(&order_id, "kettle-pay", "pm_card_visa").await;
    assert_eq!(late.status / 100, 4, "the hold ended: {late:?}");

    let after_payment = app.reserve("after-payment", &[("KETTLE", 1)]).await;
    assert_eq!(after_payment.status, 201, "{after_payment:?}");
    app.assert_audit_clean().await;
}

const HOUR_SECONDS: i64 = 3_600;

/// Seconds from the test clock's now until the hold in `answer` ends.
fn held_seconds(app: &TestApp, answer: &acceptance::TestResponse) -> i64 {
    let body = answer.json();
    let expires_at = body["expires_at"]
        .as_str()
        .or_else(|| body["reservation"]["expires_at"].as_str())
        .unwrap_or_else(|| panic!("a hold's end: {body}"));
    let expires_at = domain::Timestamp::parse_rfc3339(expires_at).unwrap();
    (expires_at.unix_milliseconds() - app.clock_now().unix_milliseconds()) / 1_000
}

async fn a_key_whose_caller_went_away_before_its_hold_was_answered_is_never_answered_from_memory(
    backend: Backend,
) {
    let http = acceptance::http_with_request_bound(200);
    let app = TestApp::spawn_with_http(backend, &http).await;
    app.stocked_sku("DESK", 3).await;
    let mut lock = app.database.hold_stock_row_lock("DESK").await;
    // The caller's bound runs out while its batch waits for the lock; the batch goes
    // on and takes every unit once the lock is gone.
    let cut = app.reserve("desk-all", &[("DESK", 3)]).await;
    assert_eq!(cut.status, 503, "{cut:?}");
    lock.execute("ROLLBACK").await.unwrap();
    acceptance::wait_until_async("the cut request's hold committed", || async {
        app.counters("DESK").await == (0, 3)
    })
    .await;
    assert_eq!(app.reserve("desk-1", &[("DESK", 1)]).await.status, 409);
    assert!(
        app.reserve("desk-2", &[("DESK", 1)])
            .await
            .body
            .contains(FROM_MEMORY)
    );

    let retried = app.reserve("desk-all", &[("DESK", 3)]).await;

    assert_eq!(
        retried.status, 201,
        "its hold, not a sold-out from memory: {retried:?}"
    );
    assert!(retried.replayed(), "{retried:?}");
    app.assert_audit_clean().await;
}

/// A key answered 201 before a restart (the answer lost on the way; as for a key
/// another instance answered, this process never sent it) and retried after the
/// restarted instance found the SKU sold out: the retry hears its 201, replayed, and
/// the same key with another body hears `idempotency_key_reused`, not memory's "sold
/// out". A key nobody answered is still refused from memory.
async fn a_key_answered_before_a_restart_replays_where_memory_finds_the_sku_sold_out(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 1).await;
    let held = app.reserve("tv-held", &[("TV", 1)]).await;
    assert_eq!(held.status, 201, "{held:?}");
    let app = app.restart().await;
    let refused = app.reserve("tv-refused", &[("TV", 1)]).await;
    assert_eq!(refused.code().as_deref(), Some("insufficient_stock"));
    assert!(
        !refused.body.contains(FROM_MEMORY),
        "decided by the database"
    );
    let from_memory = app.reserve("tv-fresh", &[("TV", 1)]).await;
    assert!(from_memory.body.contains(FROM_MEMORY), "{from_memory:?}");
    let contents = app.contents().await;

    let retried = app.reserve("tv-held", &[("TV", 1)]).await;
    let reused = app.reserve("tv-held", &[("TV", 2)]).await;

    assert_eq!(retried.status, 201, "{retried:?}");
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, held.body);
    assert_eq!(reused.status, 422, "{reused:?}");
    assert_eq!(reused.code().as_deref(), Some("idempotency_key_reused"));
    assert_eq!(app.contents().await, contents, "nothing held twice");
    let still = app.reserve("tv-fresh-2", &[("TV", 1)]).await;
    assert!(still.body.contains(FROM_MEMORY), "{still:?}");
}

/// DESIGN principle 6: a ledger row names its reference and the idempotency key of the
/// request that moved the stock, a confirm or a release as much as a reservation.
async fn every_ledger_row_of_a_keyed_request_carries_its_key(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KEYED", 5).await;
    let confirmed = app.reserve("hold-to-confirm", &[("KEYED", 1)]).await;
    let released = app.reserve("hold-to-release", &[("KEYED", 1)]).await;
    let confirmed = confirmed.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let released = released.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(app.confirm(&confirmed, "the-confirm").await.status, 200);
    assert_eq!(app.release(&released, "the-release").await.status, 200);

    let mut connection = app.database.raw_connection().await;
    for (reference, kind, key) in [
        (&confirmed, "reserve", "hold-to-confirm"),
        (&confirmed, "confirm", "the-confirm"),
        (&released, "reserve", "hold-to-release"),
        (&released, "release", "the-release"),
    ] {
        let keys = connection
            .texts(&format!(
                "SELECT idempotency_key FROM stock_ledger WHERE reference = '{reference}' AND kind = '{kind}'"
            ))
            .await;
        assert_eq!(keys.len(), 1, "{kind} of {reference}: {keys:?}");
        let stored = keys[0].clone().unwrap_or_default();
        assert!(stored.ends_with(key), "{kind} of {reference}: {stored:?}");
    }
}

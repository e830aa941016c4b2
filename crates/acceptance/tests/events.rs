//! The transactional outbox and its pull feed (issue 16): every state change of the
//! contract's list writes its event in its own transaction, numbered per aggregate;
//! the sequencer numbers committed events in the order it finds them, so a reader of
//! `GET /v1/events` never skips one whose transaction committed late; a refused or
//! rolled-back change announces nothing; a shop sees only its own events.

use std::collections::{BTreeMap, HashSet};

use acceptance::payments::TestGateway;
use acceptance::{Backend, Call, ProductSpec, TestApp, mirrored_tests, test_engine_config};
use engine::EngineConfig;
use serde_json::{Value, json};

mirrored_tests!(
    a_change_to_what_a_shopper_sees_of_a_sku_is_announced,
    every_new_reservation_announces_itself_once_numbered_one,
    confirm_release_and_expiry_are_the_second_and_last_event_of_a_reservation,
    an_order_announces_each_status_it_enters_numbered_by_its_version,
    stock_movements_and_shelf_changes_are_numbered_per_sku,
    a_return_announces_each_line_it_puts_back_as_a_stock_movement,
    a_refused_or_rolled_back_change_announces_nothing,
    the_feed_pages_in_commit_order_and_an_empty_page_keeps_the_cursor,
    an_event_whose_transaction_commits_late_is_not_skipped,
    two_sequencers_number_every_event_exactly_once,
    a_sequencer_step_numbers_at_most_its_batch_in_write_order_with_no_gap,
    the_feed_shows_a_shop_only_its_own_events_and_refuses_bad_input,
    an_event_number_is_taken_once,
    the_outbox_worker_prunes_a_backlog_of_many_batches_without_waiting_between_them,
    a_reader_whose_cursor_is_older_than_the_kept_events_is_told_so,
    a_shops_reader_moves_past_other_shops_events_and_is_not_told_it_missed_them,
    a_cursor_past_the_newest_event_is_refused_not_paged_from,
    pruning_takes_only_a_prefix_of_the_old_events_so_the_feed_never_has_a_hole,
    an_instance_without_nats_prunes_nothing_the_relay_has_not_sent,
);

fn of_type<'a>(events: &'a [Value], event_type: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|event| event["type"] == event_type)
        .collect()
}

fn reservation_id(response: &acceptance::TestResponse) -> String {
    assert_eq!(response.status, 201, "{response:?}");
    response.json()["reservation_id"]
        .as_str()
        .expect("reservation id")
        .to_owned()
}

/// Each aggregate's events, in feed order, are numbered 1, 2, 3… without a gap.
fn assert_gap_free_per_aggregate(events: &[Value]) {
    let mut sequences: BTreeMap<(String, String), Vec<i64>> = BTreeMap::new();
    for event in events {
        let aggregate = event["aggregate"].as_str().unwrap().to_owned();
        let id = event["aggregate_id"].as_str().unwrap().to_owned();
        let sequence = event["sequence"].as_i64().unwrap();
        assert_eq!(
            event["id"],
            format!("{aggregate}/{id}/{sequence}"),
            "an event's id names its aggregate and number"
        );
        sequences.entry((aggregate, id)).or_default().push(sequence);
    }
    for (aggregate, numbers) in sequences {
        let expected: Vec<i64> = (1..=numbers.len() as i64).collect();
        assert_eq!(numbers, expected, "events of {aggregate:?} in feed order");
    }
}

async fn every_new_reservation_announces_itself_once_numbered_one(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    let gateway = TestGateway::start(&app).await;
    let mut created = HashSet::new();
    for index in 0..5 {
        created.insert(reservation_id(
            &app.reserve(&format!("one-{index}"), &[("TEA", 1)]).await,
        ));
    }
    // Concurrent requests travel in combined batches (on PostgreSQL, the one-statement
    // fast path): each still announces itself once.
    let calls: Vec<Call> = (0..20)
        .map(|index| {
            Call::post("/v1/reservations")
                .key(format!("many-{index}"))
                .json(&json!({"lines": [{"sku": "TEA", "quantity": 2}]}))
        })
        .collect();
    for response in acceptance::send_concurrently(&app, calls).await {
        created.insert(reservation_id(&response));
    }
    let order = app.order_of("user-1", &[("TEA", 3)]).await;
    let order_reservation = app.order(&order).await["reservation"]["reservation_id"]
        .as_str()
        .expect("order's reservation")
        .to_owned();
    created.insert(order_reservation.clone());
    drop(gateway);

    let events = app.all_events().await;

    let announced = of_type(&events, "reservation.created");
    assert_eq!(announced.len(), created.len(), "one event per reservation");
    let ids: HashSet<String> = announced
        .iter()
        .map(|event| event["aggregate_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, created, "each reservation exactly once");
    for event in &announced {
        assert_eq!(event["aggregate"], "reservation");
        assert_eq!(event["sequence"], 1);
        assert_eq!(event["data"]["shop"], "default");
        assert_eq!(event["data"]["reservation_id"], event["aggregate_id"]);
        assert!(event["occurred_at"].is_string(), "{event}");
        let lines = event["data"]["lines"].as_array().expect("lines");
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["sku"], "TEA");
        assert_eq!(lines[0]["warehouse"], "default");
    }
    let order_event = announced
        .iter()
        .find(|event| event["aggregate_id"] == order_reservation.as_str())
        .expect("the order's reservation");
    assert_eq!(order_event["data"]["order_id"], order.as_str());
    assert_eq!(order_event["data"]["lines"][0]["quantity"], 3);
    assert_gap_free_per_aggregate(&events);
    app.assert_audit_clean().await;
}

async fn confirm_release_and_expiry_are_the_second_and_last_event_of_a_reservation(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 10).await;
    let confirmed = reservation_id(&app.reserve("confirmed", &[("TEA", 1)]).await);
    let released = reservation_id(&app.reserve("released", &[("TEA", 2)]).await);
    let expiring = app
        .send(
            Call::post("/v1/reservations")
                .key("expiring")
                .json(&json!({"lines": [{"sku": "TEA", "quantity": 3}], "ttl_seconds": 60})),
        )
        .await;
    let expiring = reservation_id(&expiring);
    assert_eq!(app.confirm(&confirmed, "confirm").await.status, 200);
    assert_eq!(app.release(&released, "release").await.status, 200);
    // A second attempt is refused by the transition table: no second event.
    assert_eq!(app.release(&released, "release-again").await.status, 409);
    app.clock.advance_seconds(61);
    app.engine.expire_step().await.expect("expiry step");

    let events = app.all_events().await;

    let second = |id: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|event| event["aggregate_id"] == id && event["sequence"] != 1)
            .collect()
    };
    let confirmed_events = second(&confirmed);
    assert_eq!(confirmed_events.len(), 1);
    assert_eq!(confirmed_events[0]["type"], "reservation.confirmed");
    assert_eq!(confirmed_events[0]["sequence"], 2);
    let released_events = second(&released);
    assert_eq!(released_events.len(), 1);
    assert_eq!(released_events[0]["type"], "reservation.released");
    assert_eq!(released_events[0]["data"]["reason"], "requested");
    assert_eq!(released_events[0]["data"]["lines"][0]["quantity"], 2);
    let expired_events = second(&expiring);
    assert_eq!(expired_events.len(), 1);
    assert_eq!(expired_events[0]["type"], "reservation.expired");
    assert_eq!(expired_events[0]["data"]["reason"], "expired");
    assert_gap_free_per_aggregate(&events);
}

async fn an_order_announces_each_status_it_enters_numbered_by_its_version(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let gateway = TestGateway::start(&app).await;
    app.stocked_sku("TEA", 10).await;
    let order = app.order_of("user-1", &[("TEA", 2)]).await;
    let paid = app.pay(&order, "pay-1", "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    drop(gateway);

    let events = app.all_events().await;

    let order_events: Vec<&Value> = events
        .iter()
        .filter(|event| event["aggregate"] == "order")
        .collect();
    let statuses: Vec<(i64, Value, Value)> = order_events
        .iter()
        .map(|event| {
            assert_eq!(event["type"], "order.status_changed");
            assert_eq!(event["aggregate_id"], order.as_str());
            (
                event["sequence"].as_i64().unwrap(),
                event["data"]["from"].clone(),
                event["data"]["to"].clone(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        vec![
            (1, Value::Null, json!("PENDING_PAYMENT")),
            (2, json!("PENDING_PAYMENT"), json!("PAYMENT_PROCESSING")),
            (3, json!("PAYMENT_PROCESSING"), json!("PAID")),
        ]
    );
    let settled = of_type(&events, "payment.settled");
    assert_eq!(settled.len(), 1, "{settled:?}");
    assert_eq!(settled[0]["sequence"], 1);
    assert_eq!(settled[0]["data"]["order_id"], order.as_str());
    assert_eq!(settled[0]["data"]["status"], "SUCCEEDED");
    assert_eq!(settled[0]["data"]["amount_minor"], 200);
    let confirmed = of_type(&events, "reservation.confirmed");
    assert_eq!(confirmed.len(), 1, "the order's stock was consumed");
    assert_gap_free_per_aggregate(&events);
}

async fn stock_movements_and_shelf_changes_are_numbered_per_sku(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(ProductSpec::complete("default", &["MILK-1L"]))
        .await;
    app.receive("MILK-1L", 5).await;
    let taken = app
        .send(
            Call::post("/v1/skus/MILK-1L/stock-movements")
                .admin()
                .key("adjust")
                .json(&json!({"kind": "adjust", "quantity": -2})),
        )
        .await;
    assert_eq!(taken.status, 201, "{taken:?}");
    for (operation, key) in [("on", "shelf-on"), ("off", "shelf-off")] {
        let response = app
            .shelf(
                None,
                json!({"operation": operation, "product_ids": [product], "remark": key}),
            )
            .await;
        assert_eq!(response.status, 200, "{response:?}");
    }

    let events = app.all_events().await;

    let moved = of_type(&events, "stock.moved");
    let moves: Vec<(i64, Value, Value)> = moved
        .iter()
        .map(|event| {
            assert_eq!(event["aggregate_id"], "MILK-1L");
            (
                event["sequence"].as_i64().unwrap(),
                event["data"]["kind"].clone(),
                event["data"]["available"].clone(),
            )
        })
        .collect();
    assert_eq!(
        moves,
        vec![
            (1, json!("receive"), json!(5)),
            (2, json!("adjust"), json!(3)),
        ]
    );
    let shelf = of_type(&events, "sku.sale_status_changed");
    let changes: Vec<(i64, Value)> = shelf
        .iter()
        .map(|event| {
            assert_eq!(event["data"]["product_id"], product.as_str());
            (
                event["sequence"].as_i64().unwrap(),
                event["data"]["to"].clone(),
            )
        })
        .collect();
    assert_eq!(changes.len(), 2, "{shelf:?}");
    assert_eq!(changes[0].0, 1);
    assert_eq!(changes[1], (2, json!("OFF_SHELF")));
    assert_gap_free_per_aggregate(&events);
}

/// A product's title, image, category or supplier, and a SKU's own title, price or
/// limit, are what a shopper is shown: a change to them announces `sku.changed` for
/// each SKU it shows on (the display cache drops its views by it). A product's SKUs
/// show its title as theirs and follow a new one.
async fn a_change_to_what_a_shopper_sees_of_a_sku_is_announced(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(ProductSpec::complete("default", &["MILK-1L", "MILK-2L"]))
        .await;
    let renamed = app
        .send(
            Call::patch(format!("/v1/products/{product}"))
                .admin()
                .key("rename")
                .json(&json!({"title": "Oat milk", "image_url": "https://images.example.com/oat.jpg"})),
        )
        .await;
    assert_eq!(renamed.status, 200, "{renamed:?}");
    let repriced = app
        .send(
            Call::put("/v1/skus/MILK-1L")
                .admin()
                .key("reprice")
                .json(&json!({"price": 300})),
        )
        .await;
    assert_eq!(repriced.status, 200, "{repriced:?}");

    let events = app.all_events().await;
    let changed: Vec<(Value, i64, Value, Value)> = of_type(&events, "sku.changed")
        .iter()
        .map(|event| {
            (
                event["aggregate_id"].clone(),
                event["sequence"].as_i64().unwrap(),
                event["data"]["product_id"].clone(),
                event["data"]["fields"].clone(),
            )
        })
        .collect();
    let product_id = json!(product);
    assert_eq!(
        changed,
        vec![
            (
                json!("MILK-1L"),
                1,
                product_id.clone(),
                json!(["title", "image_url"])
            ),
            (
                json!("MILK-2L"),
                1,
                product_id.clone(),
                json!(["title", "image_url"])
            ),
            (json!("MILK-1L"), 2, product_id, json!(["price"])),
        ]
    );
    for sku in ["MILK-1L", "MILK-2L"] {
        let shown = app
            .send(Call::get(format!("/v1/skus/{sku}")).admin())
            .await
            .json();
        assert_eq!(shown["title"], "Oat milk", "{shown}");
    }
    assert_gap_free_per_aggregate(&events);
}

async fn a_return_announces_each_line_it_puts_back_as_a_stock_movement(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let gateway = TestGateway::start(&app).await;
    app.stocked_sku("TEA", 10).await;
    app.stocked_sku("COFFEE", 5).await;
    // Listed out of lock order: the movement ids number the lines as the order lists them.
    let order = app.order_of("user-1", &[("TEA", 2), ("COFFEE", 1)]).await;
    let paid = app.pay(&order, "pay-1", "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    drop(gateway);
    let before = app.all_events().await;

    let returned = app
        .send(
            Call::post(format!("/v1/orders/{order}/return"))
                .admin()
                .key("return-1"),
        )
        .await;
    assert_eq!(returned.status, 200, "{returned:?}");

    let events = app.all_events().await;
    let new_events = &events[before.len()..];
    let moves: Vec<(Value, Value, Value, Value, Value, Value)> = of_type(new_events, "stock.moved")
        .iter()
        .map(|event| {
            assert_eq!(event["data"]["kind"], "return");
            assert_eq!(event["data"]["order_id"], order.as_str());
            assert_eq!(event["data"]["shop"], "default");
            (
                event["aggregate_id"].clone(),
                event["sequence"].clone(),
                event["data"]["movement_id"].clone(),
                event["data"]["available_delta"].clone(),
                event["data"]["available"].clone(),
                event["data"]["reserved"].clone(),
            )
        })
        .collect();
    assert_eq!(
        moves,
        vec![
            (
                json!("COFFEE"),
                json!(2),
                json!(format!("{order}.return.1")),
                json!(1),
                json!(5),
                json!(0)
            ),
            (
                json!("TEA"),
                json!(2),
                json!(format!("{order}.return.0")),
                json!(2),
                json!(10),
                json!(0)
            ),
        ],
        "one event per line, after each SKU's receive"
    );
    assert_eq!(
        new_events.len(),
        2,
        "a return announces nothing else: {new_events:?}"
    );
    for (sku, _, movement, ..) in &moves {
        let row = app
            .send(
                Call::get(format!(
                    "/v1/stock-movements/{}",
                    movement.as_str().unwrap()
                ))
                .admin(),
            )
            .await;
        assert_eq!(row.status, 200, "{row:?}");
        assert_eq!(
            &row.json()["sku"],
            sku,
            "the event's movement id names its ledger row"
        );
    }
    assert_gap_free_per_aggregate(&events);
    app.assert_audit_clean().await;
}

async fn a_refused_or_rolled_back_change_announces_nothing(backend: Backend) {
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 100).await;
    app.stocked_sku("TEA", 1).await;
    let before = app.all_events().await;

    let refused = app.reserve("too-many", &[("TEA", 2)]).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    // A unit of work that times out on a held lock rolls back whatever it wrote.
    let mut lock = app.database.hold_stock_row_lock("TEA").await;
    let timed_out = app.reserve("blocked", &[("TEA", 1)]).await;
    assert_eq!(timed_out.code().as_deref(), Some("lock_timeout"));
    lock.execute("ROLLBACK").await.unwrap();

    assert_eq!(app.all_events().await, before, "no event was written");
    let retried = app.reserve("blocked", &[("TEA", 1)]).await;
    assert_eq!(retried.status, 201);
    assert_eq!(
        of_type(&app.all_events().await, "reservation.created").len(),
        1,
        "the retry that committed announced itself"
    );
}

async fn the_feed_pages_in_commit_order_and_an_empty_page_keeps_the_cursor(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 10).await;
    for index in 0..4 {
        reservation_id(&app.reserve(&format!("page-{index}"), &[("TEA", 1)]).await);
    }
    let everything = app.all_events().await;
    assert_eq!(everything.len(), 5, "one receive, four reservations");

    let mut paged = Vec::new();
    let mut cursor = "0".to_owned();
    let mut pages = 0;
    loop {
        let page = app
            .send(Call::get(format!("/v1/events?after={cursor}&limit=2")).admin())
            .await
            .json();
        let events = page["events"].as_array().unwrap().clone();
        let next = page["next_cursor"].as_str().unwrap().to_owned();
        if events.is_empty() {
            assert_eq!(next, cursor, "an empty page keeps the cursor");
            break;
        }
        assert!(events.len() <= 2);
        assert!(next.parse::<i64>().unwrap() > cursor.parse::<i64>().unwrap());
        paged.extend(events);
        cursor = next;
        pages += 1;
    }
    assert_eq!(pages, 3);
    assert_eq!(paged, everything, "the pages are the whole feed, in order");
    // A later event appears after the cursor a reader already holds.
    reservation_id(&app.reserve("later", &[("TEA", 1)]).await);
    app.sequence_all_events().await;
    let next = app
        .send(Call::get(format!("/v1/events?after={cursor}")).admin())
        .await
        .json();
    let events = next["events"].as_array().unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["type"], "reservation.created");
}

async fn an_event_whose_transaction_commits_late_is_not_skipped(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 10).await;
    let mut cursor = feed_cursor_after_everything(&app).await;
    // A unit of work that wrote its event (its id is taken) and has not committed.
    let mut late = app.database.raw_connection().await;
    let begin = if backend == Backend::Sqlite {
        "BEGIN IMMEDIATE"
    } else {
        "BEGIN"
    };
    late.execute(begin).await.unwrap();
    late.execute(
        "INSERT INTO outbox (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at) \
         VALUES ('reservation', 'rsv_late', 1, 'reservation.created', 'default', '{\"lines\": []}', 0)",
    )
    .await
    .unwrap();
    if backend != Backend::Sqlite {
        // Later events commit and are read first (SQLite's one writer makes every
        // other writer wait for the open transaction instead, so nothing can commit
        // after it there).
        reservation_id(&app.reserve("after-the-late-one", &[("TEA", 1)]).await);
        let page = events_after(&app, &cursor).await;
        assert_eq!(page.0.len(), 1);
        assert_eq!(page.0[0]["type"], "reservation.created");
        assert_ne!(page.0[0]["aggregate_id"], "rsv_late");
        cursor = page.1;
    } else {
        app.sequence_all_events().await;
        assert!(events_after(&app, &cursor).await.0.is_empty());
    }

    late.execute("COMMIT").await.unwrap();

    let (events, _) = events_after(&app, &cursor).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["aggregate_id"], "rsv_late");
}

async fn feed_cursor_after_everything(app: &TestApp) -> String {
    let (_, cursor) = events_after(app, "0").await;
    cursor
}

/// The events after `cursor` once everything committed is numbered, and the next
/// cursor.
async fn events_after(app: &TestApp, cursor: &str) -> (Vec<Value>, String) {
    app.sequence_all_events().await;
    let page = app
        .send(Call::get(format!("/v1/events?after={cursor}&limit=1000")).admin())
        .await;
    assert_eq!(page.status, 200, "{page:?}");
    let page = page.json();
    (
        page["events"].as_array().unwrap().clone(),
        page["next_cursor"].as_str().unwrap().to_owned(),
    )
}

async fn a_sequencer_step_numbers_at_most_its_batch_in_write_order_with_no_gap(backend: Backend) {
    let app = TestApp::spawn_with(
        backend,
        EngineConfig {
            outbox_sequence_batch_size: 2,
            ..test_engine_config()
        },
    )
    .await;
    app.stocked_sku("TEA", 10).await;
    let mut made = Vec::new();
    for index in 0..4 {
        made.push(reservation_id(
            &app.reserve(&format!("step-{index}"), &[("TEA", 1)]).await,
        ));
    }

    let mut steps = Vec::new();
    loop {
        let numbered = app.engine.sequence_step().await.expect("sequencer step");
        steps.push(numbered);
        if numbered == 0 {
            break;
        }
    }
    assert_eq!(
        steps,
        [2, 2, 1, 0],
        "one receive and four reservations, two a step"
    );

    let mut cursors = Vec::new();
    let mut announced = Vec::new();
    let mut cursor = "0".to_owned();
    for _ in 0..10 {
        let page = app
            .send(Call::get(format!("/v1/events?after={cursor}&limit=1")).admin())
            .await
            .json();
        let events = page["events"].as_array().unwrap();
        if events.is_empty() {
            break;
        }
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        cursors.push(cursor.parse::<i64>().unwrap());
        if events[0]["type"] == "reservation.created" {
            announced.push(
                events[0]["data"]["reservation_id"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    assert_eq!(cursors, [1, 2, 3, 4, 5], "positions follow each other");
    assert_eq!(
        announced, made,
        "in the order the reservations were written"
    );
}

async fn two_sequencers_number_every_event_exactly_once(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let other = app.another_instance().await;
    app.stocked_sku("TEA", 1_000).await;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sequencers: Vec<_> = [app.clone(), other.clone()]
        .into_iter()
        .map(|instance| {
            let done = std::sync::Arc::clone(&done);
            tokio::spawn(async move {
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    instance
                        .engine
                        .sequence_step()
                        .await
                        .expect("sequencer step");
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let calls: Vec<Call> = (0..60)
        .map(|index| {
            Call::post("/v1/reservations")
                .key(format!("raced-{index}"))
                .json(&json!({"lines": [{"sku": "TEA", "quantity": 1}]}))
        })
        .collect();
    for response in acceptance::send_concurrently(&app, calls).await {
        reservation_id(&response);
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    for sequencer in sequencers {
        sequencer.await.expect("sequencer task");
    }

    let events = other.all_events().await;

    assert_eq!(of_type(&events, "reservation.created").len(), 60);
    let ids: HashSet<&str> = events
        .iter()
        .map(|event| event["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), events.len(), "no event twice");
    assert_gap_free_per_aggregate(&events);
}

async fn the_feed_shows_a_shop_only_its_own_events_and_refuses_bad_input(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 10).await;
    let other_sku = app
        .send(
            Call::put("/v1/skus/OTHER-TEA")
                .admin()
                .key("other-sku")
                .json(&json!({"title": "Other", "price": 100, "currency": "CNY", "shop": "other"})),
        )
        .await;
    assert_eq!(other_sku.status, 201, "{other_sku:?}");
    app.receive("OTHER-TEA", 3).await;
    app.sequence_all_events().await;
    let other_operator = app.create_operator("olga", "other").await;

    let own = app.send(Call::get("/v1/events")).await;
    assert_eq!(own.status, 200, "{own:?}");
    let own_events = own.json()["events"].as_array().unwrap().clone();
    assert!(!own_events.is_empty());
    assert!(
        own_events
            .iter()
            .all(|event| event["data"]["shop"] == "default"),
        "{own_events:?}"
    );
    let theirs = app
        .send(Call::get("/v1/events").bearer(&other_operator))
        .await;
    assert_eq!(theirs.status, 200, "{theirs:?}");
    let their_events = theirs.json()["events"].as_array().unwrap().clone();
    assert_eq!(their_events.len(), 1, "{their_events:?}");
    assert_eq!(their_events[0]["aggregate_id"], "OTHER-TEA");
    let admin_of_other = app
        .send(Call::get("/v1/events?shop=other").admin())
        .await
        .json();
    assert_eq!(admin_of_other["events"].as_array().unwrap().len(), 1);

    let crossing = app.send(Call::get("/v1/events?shop=other")).await;
    assert_eq!(crossing.status, 403, "{crossing:?}");
    assert_eq!(crossing.code().as_deref(), Some("forbidden"));
    let anonymous = app.send(Call::get("/v1/events").anonymous()).await;
    assert_eq!(anonymous.status, 401);
    for bad in [
        "after=-1",
        "after=abc",
        "after=1.5",
        "limit=0",
        "limit=1001",
        "limit=ten",
        "shop=",
        "colour=blue",
    ] {
        let response = app
            .send(Call::get(format!("/v1/events?{bad}")).admin())
            .await;
        assert_eq!(response.status, 400, "{bad}: {response:?}");
        assert_eq!(
            response.code().as_deref(),
            Some("invalid_argument"),
            "{bad}"
        );
        assert!(
            response
                .content_type()
                .starts_with("application/problem+json")
        );
    }
}

/// Every event but a reservation's creation (which its reservation's primary key
/// guards, see below) is refused a second time under its number, by every backend's
/// unique index on (aggregate, aggregate_id, sequence), and the refusal changes nothing.
async fn an_event_number_is_taken_once(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut connection = app.database.raw_connection().await;
    let order_event = "INSERT INTO outbox \
                       (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at) \
                       VALUES ('order', 'ord_numbered_once', 1, 'order.created', 'default', '{}', 0)";
    assert_eq!(connection.execute(order_event).await, Ok(1));
    let before = app.contents().await;
    let twice = connection
        .execute(order_event)
        .await
        .expect_err("an order's event number is taken once");
    assert!(
        twice.to_lowercase().contains("unique") || twice.contains("Duplicate"),
        "{twice}"
    );
    assert_eq!(app.contents().await, before);
}

/// Migration 0021 takes `reservation.created` rows out of PostgreSQL's unique index on
/// (aggregate, aggregate_id, sequence): the reservation writer announces a reservation
/// once because it inserts the reservation under its primary key in the same statement.
#[tokio::test]
async fn the_reservation_writer_announces_a_reservation_once() {
    if !Backend::Postgres.available().await {
        return;
    }
    let app = TestApp::spawn(Backend::Postgres).await;
    app.stocked_sku("TEA", 10).await;
    let reservation = reservation_id(&app.reserve("announced-once", &[("TEA", 1)]).await);
    let mut connection = app.database.postgres_connection().await;
    assert_eq!(announcements(&mut connection, &reservation).await, 1);

    // The writer of reservation rows, asked to write the same reservation again.
    let now = app.clock_now().unix_milliseconds();
    let again = sqlx::query(
        "SELECT stockd_insert_reservation_rows($1, ARRAY[$2], ARRAY[$1 + 60000], \
         ARRAY['again-key'], ARRAY['default'], ARRAY[NULL]::TEXT[], ARRAY[$2], \
         ARRAY[0]::BIGINT[], ARRAY['TEA'], ARRAY['default'], ARRAY[1]::BIGINT[], \
         ARRAY['again-key'], ARRAY[]::TEXT[], ARRAY[]::TEXT[], ARRAY[]::BIGINT[], \
         ARRAY[]::TEXT[])",
    )
    .bind(now)
    .bind(&reservation)
    .execute(&mut connection)
    .await
    .expect_err("a reservation's id is written once");
    let constraint = again
        .as_database_error()
        .and_then(|error| error.constraint().map(str::to_owned));
    assert_eq!(constraint.as_deref(), Some("reservation_pkey"), "{again}");
    assert_eq!(
        announcements(&mut connection, &reservation).await,
        1,
        "still announced once"
    );
}

async fn announcements(connection: &mut sqlx::PgConnection, reservation: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM outbox WHERE aggregate = 'reservation' \
         AND aggregate_id = $1 AND event_type = 'reservation.created'",
    )
    .bind(reservation)
    .fetch_one(connection)
    .await
    .unwrap()
}

async fn the_outbox_worker_prunes_a_backlog_of_many_batches_without_waiting_between_them(
    backend: Backend,
) {
    // Batches of 10 and an hour between steps that find less: within the test only
    // the rule "a full batch is followed at once" can prune 3 batches.
    let app = TestApp::spawn_with(
        backend,
        EngineConfig {
            outbox_prune_batch_size: 10,
            outbox_prune_interval_milliseconds: 3_600_000,
            ..test_engine_config()
        },
    )
    .await;
    app.stocked_sku("TEA", 100).await;
    // Receipts: events that nothing the workers do adds to (a hold would expire).
    for _ in 0..24 {
        app.receive("TEA", 1).await;
    }
    app.sequence_all_events().await;
    assert_eq!(app.all_events().await.len(), 25, "25 receipts' events");
    app.clock.advance_seconds(4 * 24 * 3600);

    let shutdown = tokio_util::sync::CancellationToken::new();
    let workers = tokio_util::task::TaskTracker::new();
    engine::workers::spawn_workers(&app.engine, &workers, &shutdown);
    acceptance::wait_until_async("the backlog is pruned", || async {
        app.all_events().await.is_empty()
    })
    .await;
    shutdown.cancel();
    workers.close();
    workers.wait().await;
}

async fn a_reader_whose_cursor_is_older_than_the_kept_events_is_told_so(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    for _ in 0..3 {
        app.receive("TEA", 1).await;
    }
    app.sequence_all_events().await;
    let page = app
        .send(Call::get("/v1/events?after=0&limit=2").admin())
        .await
        .json();
    let cursor = page["next_cursor"].as_str().unwrap().to_owned();
    // The reader goes away for longer than events are kept.
    app.clock.advance_seconds(4 * 24 * 3600);
    assert_eq!(app.engine.outbox_prune_step().await.unwrap(), 4);
    app.receive("TEA", 1).await;
    app.sequence_all_events().await;

    let stale = app
        .send(Call::get(format!("/v1/events?after={cursor}")).admin())
        .await;
    let from_the_start = app.send(Call::get("/v1/events?after=0").admin()).await;

    assert_eq!(stale.status, 404, "{stale:?}");
    assert_eq!(stale.code().as_deref(), Some("not_found"));
    assert!(stale.body.contains("no longer kept"), "{stale:?}");
    assert_eq!(from_the_start.status, 200);
    assert_eq!(from_the_start.json()["events"].as_array().unwrap().len(), 1);
}

async fn a_shops_reader_moves_past_other_shops_events_and_is_not_told_it_missed_them(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    app.sequence_all_events().await;
    let page = |cursor: String| {
        let app = app.clone();
        async move {
            let page = app
                .send(Call::get(format!("/v1/events?after={cursor}")))
                .await;
            assert_eq!(page.status, 200, "{page:?}");
            page.json()
        }
    };
    // The default shop's reader (its service key) is at the head.
    let first = page("0".to_owned()).await;
    assert_eq!(first["events"].as_array().unwrap().len(), 1);
    let cursor = first["next_cursor"].as_str().unwrap().to_owned();
    // Another shop's events come, and the reader polls while they do.
    let product = app
        .create_product(ProductSpec::complete("north", &["NORTH-TEA"]))
        .await;
    app.receive("NORTH-TEA", 5).await;
    app.sequence_all_events().await;
    let quiet = page(cursor.clone()).await;
    assert!(quiet["events"].as_array().unwrap().is_empty(), "{quiet}");
    let moved = quiet["next_cursor"].as_str().unwrap().to_owned();
    assert_ne!(moved, cursor, "past the north shop's events: {quiet}");
    assert!(!product.is_empty());

    // Days later they are pruned, and the reader's shop has a new event.
    app.clock.advance_seconds(4 * 24 * 3600);
    assert!(app.engine.outbox_prune_step().await.unwrap() >= 2);
    app.receive("TEA", 1).await;
    app.sequence_all_events().await;
    let next = page(moved).await;

    assert_eq!(next["events"].as_array().unwrap().len(), 1, "{next}");
    assert_eq!(next["events"][0]["data"]["sku"], "TEA", "{next}");
}

/// The positions of the events after `cursor`, oldest first, once all are numbered.
async fn positions_after(app: &TestApp, cursor: domain::FeedCursor) -> Vec<i64> {
    app.sequence_all_events().await;
    let page = app
        .engine
        .events_page(&domain::Principal::Admin, None, cursor, 1000)
        .await
        .unwrap();
    page.events.iter().map(|event| event.position).collect()
}

async fn all_positions(app: &TestApp) -> Vec<i64> {
    positions_after(app, domain::FeedCursor::START).await
}

/// A cursor past every position this database numbered (another database's, or one
/// from before a restore) would page on silently past events it never saw.
async fn a_cursor_past_the_newest_event_is_refused_not_paged_from(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    let newest = *all_positions(&app).await.last().unwrap();

    let past = domain::FeedCursor::of_position(newest + 10);
    let refused = app
        .send(Call::get(format!("/v1/events?after={past}")).admin())
        .await;
    let at_the_head = domain::FeedCursor::of_position(newest);
    let head = app
        .send(Call::get(format!("/v1/events?after={at_the_head}")).admin())
        .await;

    assert_eq!(refused.status, 404, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("not_found"));
    assert!(
        refused.body.contains("past the newest event"),
        "{refused:?}"
    );
    assert_eq!(head.status, 200, "{head:?}");
    assert!(head.json()["events"].as_array().unwrap().is_empty());
}

/// An event's time is its request's start and positions follow commits, so a later
/// position can be older. Pruning deletes only the oldest positions, up to the first
/// young one: deleting a later, older event first would leave a hole a reader pages
/// across without being told.
async fn pruning_takes_only_a_prefix_of_the_old_events_so_the_feed_never_has_a_hole(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    for _ in 0..3 {
        app.receive("TEA", 1).await;
    }
    let positions = all_positions(&app).await;
    assert!(positions.len() >= 4, "{positions:?}");
    app.clock.advance_seconds(4 * 24 * 3600);
    // The second event stands for one whose request started late and committed early.
    let young = positions[1];
    let mut connection = app.database.raw_connection().await;
    let updated = connection
        .execute(&format!(
            "UPDATE outbox SET occurred_at = {} WHERE position = {young}",
            app.clock_now().unix_milliseconds()
        ))
        .await
        .unwrap();
    assert_eq!(updated, 1);

    let pruned = app.engine.outbox_prune_step().await.unwrap();

    assert_eq!(pruned, 1, "only the first, the prefix before the young one");
    let shown = positions_after(&app, domain::FeedCursor::of_position(positions[0])).await;
    assert_eq!(shown, positions[1..], "nothing missing after the first");
}

/// Whether pruning waits for the NATS relay is the fleet's, not one instance's: an
/// instance started without `STOCKD_NATS_URL` beside relaying ones prunes nothing the
/// relay has not acknowledged while its lease was held within the retention.
async fn an_instance_without_nats_prunes_nothing_the_relay_has_not_sent(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    for _ in 0..3 {
        app.receive("TEA", 1).await;
    }
    let positions = all_positions(&app).await;
    app.clock.advance_seconds(4 * 24 * 3600);
    // Another instance relays, and has sent the first event only.
    let mut connection = app.database.raw_connection().await;
    let relayed = connection
        .execute(&format!(
            "UPDATE outbox_relay SET holder = 'elsewhere', lease_until = {}, through_position = {} \
             WHERE name = 'nats'",
            app.clock_now().plus_seconds(30).unix_milliseconds(),
            positions[0]
        ))
        .await
        .unwrap();
    assert_eq!(relayed, 1);

    let pruned = app.engine.outbox_prune_step().await.unwrap();

    assert_eq!(pruned, 1, "only what the relay sent");
    assert_eq!(all_positions(&app).await, positions[1..]);
    // A relay that stands aside (or stops cleanly) gives its lease up; it still held it
    // within the retention, so pruning waits for it.
    app.store
        .release_relay("nats", "elsewhere", app.clock_now())
        .await
        .unwrap();
    assert_eq!(app.engine.outbox_prune_step().await.unwrap(), 0);
    // Once nobody held it for longer than the retention, the relay is retired.
    app.clock.advance_seconds(4 * 24 * 3600);
    assert_eq!(
        app.engine.outbox_prune_step().await.unwrap(),
        positions.len() as u64 - 1
    );
}

//! The queue intake (issue 16; seed 002 §十.3, §十二.4), against a real
//! `nats-server -js` of each test's own: a reservation command delivered three times —
//! one after another, at once, after a restart, or again after a crash before its
//! acknowledgement — has one effect and three identical answers; a poison command is
//! answered with an error and never delivered again; a command acts only inside its
//! shop; the consumer hands out no more than its in-flight bound.

use std::time::Duration;

use acceptance::nats::{StreamMessage, TestNats};
use acceptance::{Backend, TestApp, mirrored_tests};
use api::intake::{Handled, IntakeSettings, ReserveIntake};
use serde_json::json;

mirrored_tests!(
    a_command_delivered_three_times_has_one_effect_and_three_identical_answers,
    three_deliveries_handled_at_once_have_one_effect,
    a_command_delivered_again_after_a_restart_is_answered_from_its_first_answer,
    a_command_whose_instance_died_before_the_ack_is_delivered_again_with_no_second_effect,
    a_poison_command_is_answered_with_an_error_and_never_delivered_again,
    a_command_acts_only_inside_its_shop,
    the_consumer_hands_out_no_more_than_its_in_flight_bound,
    two_shops_commands_with_the_same_key_are_two_requests,
    a_command_for_a_sku_this_instance_found_sold_out_is_answered_by_the_database_and_stored,
    a_campaign_command_delivered_twice_at_once_gets_its_one_answer_twice,
    deleted_streams_and_consumer_are_created_again_and_commands_go_on,
    a_command_failing_transiently_at_its_last_delivery_is_answered_with_that_failure,
    a_command_refused_before_its_campaign_starts_hears_that_refusal_again_after_the_start,
    a_command_over_a_campaigns_per_user_limit_hears_that_refusal_again_after_the_end,
    a_commands_answers_carry_the_writers_position,
    a_command_larger_than_a_request_body_is_refused,
    a_full_command_stream_refuses_the_next_command,
    a_consumer_created_again_delivers_no_command_already_answered,
    a_command_naming_a_campaign_this_instance_does_not_route_yet_is_not_refused_for_good,
    a_command_whose_key_header_is_spelled_in_lower_case_is_taken,
    the_commands_waiting_at_the_consumer_are_read_and_shown,
    an_intake_that_cannot_attach_counts_each_try_and_takes_commands_once_nats_is_back,
    a_command_worked_on_past_the_acknowledgement_wait_is_not_delivered_again,
);

fn settings() -> IntakeSettings {
    IntakeSettings {
        fetch_wait: Duration::from_millis(200),
        retry_delay: Duration::from_millis(50),
        ..IntakeSettings::default()
    }
}

async fn intake(nats: &TestNats, settings: IntakeSettings) -> ReserveIntake {
    ReserveIntake::attach(nats.bus().await, settings)
        .await
        .expect("attach the intake")
}

fn state(app: &TestApp) -> api::AppState {
    api::AppState::new(app.engine.clone(), None, &api::http::HttpConfig::default())
}

fn command(sku: &str, quantity: i64) -> Vec<u8> {
    json!({"shop": "default", "lines": [{"sku": sku, "quantity": quantity}]})
        .to_string()
        .into_bytes()
}

/// Steps until `count` commands were answered (retried ones come back).
async fn answer(intake: &ReserveIntake, app: &TestApp, count: usize) -> Vec<Handled> {
    let state = state(app);
    let mut answered = Vec::new();
    for _ in 0..200 {
        for handled in intake.step(&state).await.expect("intake step") {
            if handled != Handled::Retried {
                answered.push(handled);
            }
        }
        if answered.len() >= count {
            return answered;
        }
    }
    panic!("only {} of {count} commands were answered", answered.len());
}

async fn answers(nats: &TestNats) -> Vec<StreamMessage> {
    nats.stream_messages_with_headers("STOCKD_RESULTS").await
}

/// `count` answers, all alike: the same status and body, under `key`.
fn assert_identical_answers(answers: &[StreamMessage], key: &str, count: usize) {
    assert_eq!(answers.len(), count, "{answers:?}");
    for answer in answers {
        assert_eq!(answer.subject, "stockd.results.reserve");
        assert_eq!(
            answer.headers.get("Idempotency-Key").map(String::as_str),
            Some(key)
        );
        assert_eq!(
            answer.headers.get("Stockd-Status"),
            answers[0].headers.get("Stockd-Status")
        );
        assert_eq!(answer.body, answers[0].body, "identical answers");
    }
}

/// Found in review: the key's header was matched byte for byte, so a client that
/// sends `idempotency-key` (as nats.py and nats.js pass a name on unchanged) had its
/// command refused as poison and dropped, while HTTP takes the name in any case.
async fn a_command_whose_key_header_is_spelled_in_lower_case_is_taken(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    let body = command("HOT", 2);

    for delivery in 0..2 {
        nats.publish_command_with_key_under(
            &body,
            ("idempotency-key", "lower-case-key"),
            &format!("message-{delivery}"),
        )
        .await;
        answer(&intake, &app, 1).await;
    }

    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "lower-case-key", 2);
    assert_eq!(answers[0].headers["Stockd-Status"], "201");
    assert_eq!(app.counters("HOT").await, (8, 2), "one effect");
}

async fn a_command_delivered_three_times_has_one_effect_and_three_identical_answers(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    let body = command("HOT", 3);

    for delivery in 0..3 {
        nats.publish_command(&body, Some("order-77"), &format!("message-{delivery}"))
            .await;
        answer(&intake, &app, 1).await;
    }

    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "order-77", 3);
    assert_eq!(answers[0].headers["Stockd-Status"], "201");
    assert_eq!(answers[0].headers["Idempotent-Replayed"], "false");
    assert_eq!(answers[2].headers["Idempotent-Replayed"], "true");
    assert_eq!(answers[0].body["status"], "RESERVED");
    assert_eq!(app.counters("HOT").await, (7, 3), "one effect");
    assert_eq!(app.ledger_rows("HOT", "reserve").await, 1);
    app.assert_audit_clean().await;
}

async fn three_deliveries_handled_at_once_have_one_effect(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    let body = command("HOT", 2);
    for delivery in 0..3 {
        nats.publish_command(&body, Some("at-once"), &format!("message-{delivery}"))
            .await;
    }

    let handled = answer(&intake, &app, 3).await;

    assert_eq!(handled.len(), 3, "{handled:?}");
    assert_identical_answers(&answers(&nats).await, "at-once", 3);
    assert_eq!(app.counters("HOT").await, (8, 2), "one effect");
    app.assert_audit_clean().await;
}

async fn a_command_delivered_again_after_a_restart_is_answered_from_its_first_answer(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let body = command("HOT", 4);
    {
        let intake = intake(&nats, settings()).await;
        nats.publish_command(&body, Some("before-restart"), "message-1")
            .await;
        answer(&intake, &app, 1).await;
    }

    let app = app.restart().await;
    let intake = intake(&nats, settings()).await;
    nats.publish_command(&body, Some("before-restart"), "message-2")
        .await;
    let handled = answer(&intake, &app, 1).await;

    assert_eq!(
        handled,
        vec![Handled::Answered {
            status: 201,
            replayed: true
        }]
    );
    assert_identical_answers(&answers(&nats).await, "before-restart", 2);
    assert_eq!(app.counters("HOT").await, (6, 4));
}

/// Found in review: this test's first delivery was dropped before it reserved, and
/// the reservation it made was another request's, so a redelivery that reserved a
/// second time passed it too. Now the first delivery reserves and its answer is lost
/// (the result stream gone, as with an instance that died after its commit and before
/// its acknowledgement): the redelivery hears the stored answer, with no second effect.
async fn a_command_whose_instance_died_before_the_ack_is_delivered_again_with_no_second_effect(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let mut short = settings();
    short.consumer.ack_wait = Duration::from_secs(1);
    let intake = intake(&nats, short).await;
    let body = command("HOT", 1);
    nats.publish_command(&body, Some("crash"), "message-1")
        .await;
    nats.delete_stream("STOCKD_RESULTS").await;

    // The first delivery reserves, then cannot answer: not acknowledged.
    let lost = intake.step(&state(&app)).await;
    assert!(lost.is_err(), "{lost:?}");
    assert_eq!(
        app.counters("HOT").await,
        (9, 1),
        "the first delivery's effect"
    );
    // Redelivered once the acknowledgement is overdue (the step that failed made the
    // result stream again); handled once.
    let handled = answer(&intake, &app, 1).await;

    assert_eq!(
        handled,
        vec![Handled::Answered {
            status: 201,
            replayed: true
        }]
    );
    assert_eq!(app.counters("HOT").await, (9, 1));
    // And once more from the sender: the first answer again.
    nats.publish_command(&body, Some("crash"), "message-2")
        .await;
    answer(&intake, &app, 1).await;
    assert_identical_answers(&answers(&nats).await, "crash", 2);
    assert_eq!(app.counters("HOT").await, (9, 1));
}

async fn a_poison_command_is_answered_with_an_error_and_never_delivered_again(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    let before = app.contents().await;
    let poison: Vec<(Vec<u8>, Option<&str>)> = vec![
        (b"not json at all".to_vec(), Some("poison-1")),
        (command("HOT", 1), None),
        (
            json!({"lines": [{"sku": "HOT", "quantity": 1}]})
                .to_string()
                .into_bytes(),
            Some("poison-3"),
        ),
        (
            json!({"shop": "default", "lines": [{"sku": "HOT", "quantity": 0}]})
                .to_string()
                .into_bytes(),
            Some("poison-4"),
        ),
        (
            json!({"shop": "default", "lines": [{"sku": "HOT", "quantity": "3"}]})
                .to_string()
                .into_bytes(),
            Some("poison-5"),
        ),
        (
            json!({"shop": "default", "lines": [], "extra": true})
                .to_string()
                .into_bytes(),
            Some("poison-6"),
        ),
        (command("HOT", 1), Some("")),
    ];
    for (index, (body, key)) in poison.iter().enumerate() {
        nats.publish_command(body, *key, &format!("poison-message-{index}"))
            .await;
    }

    let handled = answer(&intake, &app, poison.len()).await;

    assert!(
        handled.iter().all(|handled| *handled == Handled::Poison),
        "{handled:?}"
    );
    let answers = answers(&nats).await;
    assert_eq!(answers.len(), poison.len());
    for answer in &answers {
        assert_eq!(answer.headers["Stockd-Status"], "400");
        assert_eq!(answer.body["code"], "invalid_argument", "{answer:?}");
    }
    assert!(
        intake.step(&state(&app)).await.unwrap().is_empty(),
        "nothing is delivered again"
    );
    assert_eq!(app.contents().await, before, "nothing changed");
}

async fn a_command_acts_only_inside_its_shop(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    let body = json!({"shop": "other", "lines": [{"sku": "HOT", "quantity": 1}]})
        .to_string()
        .into_bytes();
    nats.publish_command(&body, Some("crossing"), "message-1")
        .await;

    let handled = answer(&intake, &app, 1).await;

    assert_eq!(
        handled,
        vec![Handled::Answered {
            status: 403,
            replayed: false
        }]
    );
    assert_eq!(answers(&nats).await[0].body["code"], "forbidden");
    assert_eq!(app.counters("HOT").await, (10, 0));
}

async fn the_consumer_hands_out_no_more_than_its_in_flight_bound(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 100).await;
    let mut bounded = settings();
    bounded.consumer.in_flight_max = 5;
    let intake = intake(&nats, bounded).await;
    for index in 0..12 {
        nats.publish_command(
            &command("HOT", 1),
            Some(&format!("bounded-{index}")),
            &format!("m-{index}"),
        )
        .await;
    }
    let bus = nats.bus().await;
    let consumer = bus
        .reserve_consumer(&intake.settings().consumer)
        .await
        .unwrap();

    let held = consumer
        .fetch(12, Duration::from_millis(500))
        .await
        .unwrap();

    assert_eq!(held.len(), 5, "no more than the bound unacknowledged");
    for command in &held {
        command.retry_after(Duration::ZERO).await.unwrap();
    }
    drop(held);
    let handled = answer(&intake, &app, 12).await;
    assert_eq!(handled.len(), 12);
    assert_eq!(app.counters("HOT").await, (88, 12));
}

async fn two_shops_commands_with_the_same_key_are_two_requests(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let product = app
        .create_product(acceptance::ProductSpec::complete("north", &["NORTH-HOT"]))
        .await;
    let on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    assert_eq!(on.status, 200, "{on:?}");
    app.receive("NORTH-HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    nats.publish_command(&command("HOT", 1), Some("order-1"), "message-1")
        .await;
    let north = json!({"shop": "north", "lines": [{"sku": "NORTH-HOT", "quantity": 1}]})
        .to_string()
        .into_bytes();
    nats.publish_command(&north, Some("order-1"), "message-2")
        .await;

    let handled = answer(&intake, &app, 2).await;

    let created = Handled::Answered {
        status: 201,
        replayed: false,
    };
    assert_eq!(
        handled,
        vec![created.clone(), created],
        "{:?}",
        answers(&nats).await
    );
    // Found in review: the two answers share the subject and the key; each now says
    // its shop, so a sender can tell its own from another shop's.
    let mut shops: Vec<Option<String>> = answers(&nats)
        .await
        .iter()
        .map(|answer| answer.headers.get("Stockd-Shop").cloned())
        .collect();
    shops.sort();
    assert_eq!(
        shops,
        [Some("default".to_owned()), Some("north".to_owned())]
    );
    assert_eq!(app.counters("HOT").await, (9, 1));
    let north = app
        .send(acceptance::Call::get("/v1/skus/NORTH-HOT").admin())
        .await
        .json();
    assert_eq!(
        (&north["available"], &north["reserved"]),
        (&json!(9), &json!(1))
    );
    app.assert_audit_clean().await;
}

async fn a_command_for_a_sku_this_instance_found_sold_out_is_answered_by_the_database_and_stored(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 1).await;
    assert_eq!(app.reserve("http-1", &[("HOT", 1)]).await.status, 201);
    assert_eq!(app.reserve("http-2", &[("HOT", 1)]).await.status, 409);
    let remembered = app.reserve("http-3", &[("HOT", 1)]).await;
    assert!(
        remembered.body.contains("this instance found it so"),
        "{remembered:?}"
    );
    let intake = intake(&nats, settings()).await;

    for delivery in 0..2 {
        nats.publish_command(
            &command("HOT", 1),
            Some("queued-1"),
            &format!("message-{delivery}"),
        )
        .await;
        answer(&intake, &app, 1).await;
    }

    // A memory answer would be stored nowhere, and the redelivery could hear another.
    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "queued-1", 2);
    assert_eq!(answers[0].headers["Stockd-Status"], "409");
    assert_eq!(answers[0].body["code"], "insufficient_stock");
    assert_eq!(
        answers[1].headers["Idempotent-Replayed"], "true",
        "stored under its key"
    );
    app.assert_audit_clean().await;
}

async fn a_campaign_command_delivered_twice_at_once_gets_its_one_answer_twice(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let created = app
        .send(
            acceptance::Call::post("/v1/admin/campaigns")
                .admin()
                .key("campaign-hot")
                .json(&json!({
                    "sku": "HOT",
                    "quantity": 5,
                    "buckets": 1,
                    "per_user_limit": 1,
                    "starts_at": acceptance::START.to_rfc3339(),
                    "ends_at": acceptance::START.plus_seconds(3600).to_rfc3339(),
                })),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let intake = intake(&nats, settings()).await;
    let body = json!({
        "shop": "default",
        "lines": [{"sku": "HOT", "quantity": 1}],
        "user_id": "shopper-1",
    })
    .to_string()
    .into_bytes();
    // Both in one fetch: the second arrives while the first holds the shopper's one
    // place in the campaign's waiting room.
    for delivery in 0..2 {
        nats.publish_command(&body, Some("campaign-1"), &format!("message-{delivery}"))
            .await;
    }

    answer(&intake, &app, 2).await;

    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "campaign-1", 2);
    assert_eq!(answers[0].headers["Stockd-Status"], "201");
    assert_eq!(
        app.ledger_rows("HOT", "reserve").await,
        1,
        "one effect, answered twice"
    );
    app.assert_audit_clean().await;
}

/// Found in review: the intake built its streams and consumer once, when it attached.
/// NATS back with an empty store (or an operator's clean-up) left every later fetch
/// failing until stockd restarted, and commands piled up unanswered. A failed step now
/// creates them again where missing, and the next commands are answered.
async fn deleted_streams_and_consumer_are_created_again_and_commands_go_on(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    nats.delete_stream("STOCKD_COMMANDS").await;
    nats.delete_stream("STOCKD_RESULTS").await;

    let failed = intake.step(&state(&app)).await;
    assert!(
        failed.is_err(),
        "the consumer went with its stream: {failed:?}"
    );
    nats.publish_command(&command("HOT", 2), Some("after-the-clean-up"), "message-1")
        .await;
    let answered = answer(&intake, &app, 1).await;

    assert_eq!(answered.len(), 1, "{answered:?}");
    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "after-the-clean-up", 1);
    assert_eq!(answers[0].headers["Stockd-Status"], "201");
    assert_eq!(app.counters("HOT").await, (8, 2));
}

/// Found in review: a command that failed transiently at every delivery (the database
/// down longer than the deliveries last) was dropped by JetStream after the last one,
/// never answered: its sender waited for good. Its last delivery is now answered with
/// the failure, and acknowledged.
async fn a_command_failing_transiently_at_its_last_delivery_is_answered_with_that_failure(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let mut settings = settings();
    settings.consumer.deliveries_max = 2;
    // Past the wait for the acknowledgement below: JetStream would otherwise give the
    // unacknowledged command up itself.
    settings.consumer.ack_wait = Duration::from_secs(600);
    let intake = intake(&nats, settings).await;
    let state = state(&app);
    // Every delivery waits out the lock bound: `lock_timeout`, a transient failure.
    let holder = app.database.hold_stock_row_lock("HOT").await;
    nats.publish_command(&command("HOT", 1), Some("order-locked"), "message-locked")
        .await;

    let mut handled = Vec::new();
    for _ in 0..200 {
        handled.extend(intake.step(&state).await.expect("intake step"));
        if handled.len() >= 2 {
            break;
        }
    }
    // The acknowledgement is sent without waiting for the server's word.
    acceptance::wait_until_async("the last delivery is acknowledged", || async {
        intake.unacknowledged().await.expect("consumer info") == 0
    })
    .await;
    drop(holder);
    let after = intake.step(&state).await.expect("intake step");

    assert_eq!(
        handled,
        [Handled::Retried, Handled::GivenUp { status: 503 }]
    );
    assert_eq!(after, [], "never delivered again");
    let answers = answers(&nats).await;
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].headers["Idempotency-Key"], "order-locked");
    assert_eq!(answers[0].headers["Stockd-Status"], "503");
    assert_eq!(answers[0].headers["Retry-After"], "1");
    assert_eq!(answers[0].body["code"], "lock_timeout");
    assert_eq!(app.counters("HOT").await, (10, 0), "nothing reserved");
}

/// Creates a campaign of `quantity` units of `sku`, from `starts_in_seconds` after the
/// test clock's start for an hour; returns its id.
async fn campaign(
    app: &TestApp,
    sku: &str,
    quantity: i64,
    per_user_limit: i64,
    starts_in_seconds: i64,
) -> String {
    let starts_at = acceptance::START.plus_seconds(starts_in_seconds);
    let created = app
        .send(
            acceptance::Call::post("/v1/admin/campaigns")
                .admin()
                .key(format!("campaign-{sku}"))
                .json(&json!({
                    "sku": sku,
                    "quantity": quantity,
                    "buckets": 1,
                    "per_user_limit": per_user_limit,
                    "starts_at": starts_at.to_rfc3339(),
                    "ends_at": starts_at.plus_seconds(3600).to_rfc3339(),
                })),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    created.json()["campaign_id"]
        .as_str()
        .expect("campaign id")
        .to_owned()
}

/// A command of shopper-1's for `quantity` TV, naming `campaign` when given.
fn shoppers_command(quantity: i64, campaign: Option<&str>) -> Vec<u8> {
    let mut body = json!({
        "shop": "default",
        "lines": [{"sku": "TV", "quantity": quantity}],
        "user_id": "shopper-1",
    });
    if let Some(campaign) = campaign {
        body["campaign_id"] = json!(campaign);
    }
    body.to_string().into_bytes()
}

/// Delivers `body` under `key`, moves the clock `seconds` on and the campaign worker a
/// step, and delivers it again; answers the answers.
async fn delivered_twice_around(
    (nats, intake, app): (&TestNats, &ReserveIntake, &TestApp),
    body: &[u8],
    key: &str,
    seconds: i64,
) -> Vec<StreamMessage> {
    nats.publish_command(body, Some(key), "message-0").await;
    answer(intake, app, 1).await;
    app.clock.advance_seconds(seconds);
    app.engine.campaign_step().await.expect("campaign step");
    nats.publish_command(body, Some(key), "message-1").await;
    answer(intake, app, 1).await;
    answers(nats).await
}

/// Found in review: a refusal that depends on the moment (a campaign not started yet)
/// was answered but stored nowhere. Delivered again after the campaign started (its
/// acknowledgement lost, or its sender publishing it again), the same command took a
/// hold its sender, told 409, never claims. It is now stored under the command's key,
/// and every delivery hears it.
async fn a_command_refused_before_its_campaign_starts_hears_that_refusal_again_after_the_start(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 10).await;
    let id = campaign(&app, "TV", 4, 1, 3600).await;
    let intake = intake(&nats, settings()).await;
    let body = shoppers_command(1, Some(&id));

    let answers = delivered_twice_around((&nats, &intake, &app), &body, "too-early", 3600).await;

    assert_identical_answers(&answers, "too-early", 2);
    assert_eq!(answers[0].headers["Stockd-Status"], "409");
    assert_eq!(answers[0].body["code"], "campaign_not_started");
    assert_eq!(answers[1].headers["Idempotent-Replayed"], "true");
    assert_eq!(app.ledger_rows("TV", "reserve").await, 0, "no hold taken");
    app.assert_audit_clean().await;
}

/// Found in review, the same for a campaign's per-user limit: a command over the limit
/// was refused from memory and stored nowhere, so delivered again after the campaign
/// ended it reserved the units from regular stock.
async fn a_command_over_a_campaigns_per_user_limit_hears_that_refusal_again_after_the_end(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 10).await;
    campaign(&app, "TV", 4, 1, 0).await;
    app.engine.campaign_step().await.expect("campaign step");
    let intake = intake(&nats, settings()).await;
    let body = shoppers_command(2, None);

    let answers = delivered_twice_around((&nats, &intake, &app), &body, "too-many", 3601).await;

    assert_identical_answers(&answers, "too-many", 2);
    assert_eq!(answers[0].headers["Stockd-Status"], "409");
    assert_eq!(answers[0].body["code"], "purchase_limit_exceeded");
    assert_eq!(app.ledger_rows("TV", "reserve").await, 0, "no hold taken");
    app.assert_audit_clean().await;
}

/// Found in review: answers on the queue carried no writer position, so a sender could
/// not read its own reservation back from a replica behind the writer. Every answer a
/// unit of work gave carries `Stockd-Consistency-Token`, as over HTTP, the replayed one
/// too.
async fn a_commands_answers_carry_the_writers_position(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    for delivery in 0..2 {
        nats.publish_command(
            &command("HOT", 1),
            Some("positioned"),
            &format!("message-{delivery}"),
        )
        .await;
        answer(&intake, &app, 1).await;
    }

    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "positioned", 2);
    let positions: Vec<domain::ConsistencyToken> = answers
        .iter()
        .map(|answer| {
            let token = answer
                .headers
                .get("Stockd-Consistency-Token")
                .unwrap_or_else(|| panic!("no position on {answer:?}"));
            domain::ConsistencyToken::parse(token).expect("a consistency token")
        })
        .collect();
    assert!(positions[1] >= positions[0], "{positions:?}");
    assert_eq!(answers[0].headers.get("Retry-After"), None);
}

/// Found in review: a command's size was bounded only by NATS's payload limit, and
/// every one of a batch was parsed whole. The stream stockd creates refuses a command
/// larger than an HTTP request body, and one taken by a stream an operator created
/// without that bound is refused with 413 before it is parsed, and acknowledged.
async fn a_command_larger_than_a_request_body_is_refused(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    // Past the stream's bound too, which leaves room for headers beside the body.
    let padding = "x".repeat(domain::limits::REQUEST_BODY_BYTES_MAX + 8 * 1024);
    let large = json!({
        "shop": "default",
        "lines": [{"sku": "HOT", "quantity": 1}],
        "padding": padding,
    })
    .to_string()
    .into_bytes();

    let stockds_stream = intake(&nats, settings()).await;
    let refused = nats
        .try_publish_command(&large, Some("large-1"), "message-large-1")
        .await;
    assert!(refused.is_err(), "{refused:?}");
    drop(stockds_stream);
    nats.delete_stream(bus::intake::COMMAND_STREAM).await;
    nats.create_command_stream_without_limits().await;
    let intake = intake(&nats, settings()).await;
    nats.publish_command(&large, Some("large-2"), "message-large-2")
        .await;
    let handled = answer(&intake, &app, 1).await;
    let after = intake.step(&state(&app)).await.expect("intake step");

    assert_eq!(handled, [Handled::Poison]);
    assert_eq!(after, [], "never delivered again");
    let answers = answers(&nats).await;
    assert_identical_answers(&answers, "large-2", 1);
    assert_eq!(answers[0].headers["Stockd-Status"], "413");
    assert_eq!(answers[0].body["code"], "invalid_argument");
    assert_eq!(app.counters("HOT").await, (10, 0), "nothing reserved");
}

/// Found in review: the command stream was bounded by age only, so any publisher could
/// fill NATS's disk. It holds `stored_commands_max` commands; a publish beyond is
/// refused, and its sender hears it, rather than an older command being dropped.
async fn a_full_command_stream_refuses_the_next_command(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let mut settings = settings();
    settings.consumer.stored_commands_max = 2;
    let intake = intake(&nats, settings).await;
    for index in 0..2 {
        nats.publish_command(
            &command("HOT", 1),
            Some(&format!("kept-{index}")),
            &format!("message-{index}"),
        )
        .await;
    }

    let refused = nats
        .try_publish_command(&command("HOT", 1), Some("one-too-many"), "message-2")
        .await;

    assert!(refused.is_err(), "{refused:?}");
    answer(&intake, &app, 2).await;
    assert_eq!(
        app.counters("HOT").await,
        (8, 2),
        "the two kept are answered"
    );
}

/// Found in review: the command stream kept answered commands for a day, and a consumer
/// created again (deleted by hand, or its state lost) started from the oldest: every
/// command of the day was delivered again, and one whose key had been purged meanwhile
/// would have reserved a second time. An answered command is now forgotten.
async fn a_consumer_created_again_delivers_no_command_already_answered(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HOT", 10).await;
    let intake = intake(&nats, settings()).await;
    nats.publish_command(&command("HOT", 2), Some("answered-once"), "message-1")
        .await;
    answer(&intake, &app, 1).await;
    // The acknowledgement is sent without waiting for the server's word.
    acceptance::wait_until_async("the answered command is acknowledged", || async {
        intake.unacknowledged().await.expect("consumer info") == 0
    })
    .await;

    nats.delete_intake_consumer().await;
    let failed = intake.step(&state(&app)).await;
    assert!(failed.is_err(), "the consumer is gone: {failed:?}");
    let mut after = Vec::new();
    for _ in 0..3 {
        after.extend(intake.step(&state(&app)).await.expect("intake step"));
    }
    nats.publish_command(&command("HOT", 1), Some("after-the-clean-up"), "message-2")
        .await;
    let answered = answer(&intake, &app, 1).await;

    assert_eq!(after, [], "nothing delivered again");
    assert_eq!(answered.len(), 1, "{answered:?}");
    let keys: Vec<String> = answers(&nats)
        .await
        .into_iter()
        .map(|answer| answer.headers["Idempotency-Key"].clone())
        .collect();
    assert_eq!(keys, ["answered-once", "after-the-clean-up"]);
    assert_eq!(app.counters("HOT").await, (7, 3));
}

/// Found in review of the fix above: a command naming a campaign this instance does not
/// route yet (created on another instance within the last second) heard `not_found`,
/// and storing that would have refused it for good. That answer is not stored: once the
/// instance's list has the campaign, the same command delivered again takes its unit.
async fn a_command_naming_a_campaign_this_instance_does_not_route_yet_is_not_refused_for_good(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 10).await;
    let elsewhere = app.another_instance().await;
    let id = campaign(&elsewhere, "TV", 4, 1, 0).await;
    let intake = intake(&nats, settings()).await;
    let body = shoppers_command(1, Some(&id));

    // Between the deliveries, this instance's campaign worker reads the new campaign.
    let answers = delivered_twice_around((&nats, &intake, &app), &body, "just-created", 0).await;

    assert_eq!(answers.len(), 2, "{answers:?}");
    assert_eq!(answers[0].headers["Stockd-Status"], "404");
    assert_eq!(answers[1].headers["Stockd-Status"], "201", "{answers:?}");
    assert_eq!(app.ledger_rows("TV", "reserve").await, 1);
    app.assert_audit_clean().await;
}

/// The value of a line of the metrics page: `series` is the name with its labels.
async fn metric(app: &TestApp, series: &str) -> Option<f64> {
    let page = app
        .send(acceptance::Call::get("/metrics").admin())
        .await
        .body;
    page.lines()
        .find(|line| line.split(' ').next() == Some(series))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

/// Found in review: nothing showed the commands waiting in `STOCKD_COMMANDS`, so a
/// queue growing faster than the instances took from it went unseen. The shared
/// consumer's backlog is read after each empty fetch (and once a second while
/// commands keep coming) and shown as gauges.
async fn the_commands_waiting_at_the_consumer_are_read_and_shown(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("QUEUED", 10).await;
    let intake = intake(&nats, settings()).await;
    for index in 0..3 {
        nats.publish_command(
            &command("QUEUED", 1),
            Some(&format!("queued-{index}")),
            &format!("m-{index}"),
        )
        .await;
    }

    let waiting = intake.backlog().await.unwrap();
    let page_shows = metric(&app, "stockd_intake_commands_waiting").await;
    answer(&intake, &app, 3).await;
    // An empty fetch reads the backlog again.
    assert_eq!(intake.step(&state(&app)).await.unwrap(), []);
    let done = intake.backlog().await.unwrap();

    assert_eq!(
        waiting,
        bus::intake::Backlog {
            waiting: 3,
            in_flight: 0
        }
    );
    // The gauge is the process's: under `cargo test` another test may have set it
    // since, so only its presence is checked here.
    assert!(page_shows.is_some(), "the waiting commands are on the page");
    assert!(
        metric(&app, "stockd_intake_commands_in_flight")
            .await
            .is_some()
    );
    assert_eq!(done, bus::intake::Backlog::default());
    assert_eq!(app.counters("QUEUED").await, (7, 3));
}

/// Found in review: an intake that could not attach (NATS unreachable, JetStream off)
/// tried again every second, logged at DEBUG and counted nothing. Each failed try now
/// counts as a failed intake step, `stockd_intake_attached` says whether it is
/// attached, and once NATS is back the commands that waited are taken.
async fn an_intake_that_cannot_attach_counts_each_try_and_takes_commands_once_nats_is_back(
    backend: Backend,
) {
    let mut nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LATE", 10).await;
    let bus = nats.bus().await;
    nats.stop();
    acceptance::wait_until("the bus saw NATS go", || !bus.is_connected()).await;
    let errors = "stockd_worker_errors_total{worker=\"intake\"}";
    let before = metric(&app, errors).await.unwrap_or(0.0);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(api::intake::attach_and_run(
        state(&app),
        bus,
        settings(),
        shutdown.clone(),
    ));

    acceptance::wait_until_async("two failed tries are counted", || async {
        metric(&app, errors).await.unwrap_or(0.0) - before >= 2.0
    })
    .await;
    let detached = metric(&app, "stockd_intake_attached").await;
    nats.start_again().await;
    // The streams are the intake's to create: a command is taken once it has attached
    // (one published twice meanwhile is one message, by its id).
    acceptance::wait_until_async("the intake created its streams again", || async {
        nats.try_publish_command(&command("LATE", 2), Some("late-1"), "m-late-1")
            .await
            .is_ok()
    })
    .await;
    acceptance::wait_until_async("the command that waited is taken", || async {
        app.counters("LATE").await == (8, 2)
    })
    .await;
    shutdown.cancel();
    running.await.unwrap();

    // Under `cargo test` another test's intake may share the gauge: only present.
    assert!(detached.is_some(), "the intake's state is on the page");
}

/// Found in review: a command was worked on with no word to JetStream, so one that
/// waited past the consumer's acknowledgement wait (for a lock here; in a campaign's
/// line, for its turn) was delivered again to the next fetch, using up a delivery and
/// running twice at once. The intake now says every half wait that it is still on it.
async fn a_command_worked_on_past_the_acknowledgement_wait_is_not_delivered_again(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One writer: a reservation never waits for another session's row lock.
        return;
    }
    let nats = TestNats::start().await;
    let app =
        TestApp::spawn_with_lock_timeout(backend, acceptance::test_engine_config(), 60_000).await;
    app.stocked_sku("SLOW", 5).await;
    let mut short = settings();
    short.consumer.ack_wait = Duration::from_secs(1);
    let intake = std::sync::Arc::new(intake(&nats, short).await);
    nats.publish_command(&command("SLOW", 1), Some("slow"), "m-slow")
        .await;
    let mut holder = app.database.hold_stock_row_lock("SLOW").await;
    let stepping = {
        let (intake, state) = (std::sync::Arc::clone(&intake), state(&app));
        tokio::spawn(async move { intake.step(&state).await })
    };
    app.database.wait_until_blocked_by(&mut holder).await;
    let bus = nats.bus().await;
    let another_instance = bus
        .reserve_consumer(&intake.settings().consumer)
        .await
        .unwrap();

    // Three acknowledgement waits for a delivery that never comes.
    let delivered_again = another_instance
        .fetch(1, Duration::from_secs(3))
        .await
        .unwrap();
    holder.execute("ROLLBACK").await.unwrap();
    let handled = stepping.await.unwrap().unwrap();

    assert_eq!(
        delivered_again.len(),
        0,
        "the command went to another instance while it was worked on"
    );
    assert_eq!(
        handled,
        vec![Handled::Answered {
            status: 201,
            replayed: false
        }]
    );
    assert_eq!(app.counters("SLOW").await, (4, 1));
}

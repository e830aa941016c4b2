//! Flash-sale campaigns (issue 19): a campaign carves its units out of regular stock
//! into buckets of its own, sells only those while it runs (falling through from an
//! empty bucket to the others), keeps each shopper within its limit, answers "sold out"
//! from memory for a bounded time, and gives what is left back at its end — every move
//! ledgered, the audit clean throughout.

use acceptance::{Backend, Call, START, TestApp, TestResponse, mirrored_tests, send_concurrently};
use serde_json::{Value, json};

mirrored_tests!(
    an_answered_ticket_is_gone_once_its_retention_has_passed,
    a_campaign_carves_its_units_out_of_regular_stock_and_sells_only_those,
    an_empty_bucket_sends_requests_on_to_the_others_until_every_one_is_empty,
    before_its_start_a_campaign_is_refused_by_name_and_regular_sales_go_on,
    a_shopper_buys_no_more_than_the_campaigns_limit_however_many_requests_race,
    orders_and_checkouts_draw_from_the_campaign_too,
    a_checkout_whose_first_bucket_is_empty_takes_its_campaign_line_from_another,
    a_campaign_created_without_a_limit_keeps_its_skus_limit,
    a_campaign_ended_early_gives_back_what_is_left_at_once_and_sells_no_more,
    a_campaign_ended_before_its_start_never_starts,
    a_campaign_ended_on_another_instance_is_not_routed_here_after_the_next_refresh,
    ending_a_campaign_that_ended_does_not_exist_or_is_malformed_is_refused_and_changes_nothing,
    a_cart_sees_and_checks_out_the_units_of_a_running_campaign,
    at_its_end_what_is_left_goes_back_to_regular_stock_ledgered,
    deleting_a_sku_ends_its_campaign_and_gives_its_units_back,
    a_sold_out_campaign_is_answered_from_memory_within_the_recheck_bound_only,
    a_campaign_created_elsewhere_is_routed_here_after_the_next_refresh,
    malformed_unauthorized_and_impossible_campaigns_are_refused_and_change_nothing,
    a_shop_at_its_open_campaign_limit_is_refused_and_nothing_is_carved,
    a_checkout_that_left_its_campaign_line_out_does_not_mark_the_shopper_at_the_limit,
    a_buckets_warehouse_cannot_be_named_by_a_request,
    the_audit_finds_a_campaign_whose_units_do_not_add_up,
    beyond_its_waiting_room_a_campaign_answers_429_with_retry_after_and_changes_nothing,
    a_retry_of_an_answered_request_hears_its_answer_while_the_waiting_room_is_full,
    a_caller_that_prefers_to_wait_gets_a_ticket_served_in_order_and_answered_once,
    a_request_without_a_ticket_waits_its_turn_with_the_connection_held,
    a_retry_of_a_request_waiting_in_line_is_not_refused_from_memory,
    the_limit_and_one_place_per_shopper_are_checked_before_a_place_is_taken,
    a_retried_create_gets_its_first_answer_even_after_the_campaign_ended,
    buckets_written_as_a_whole_number_with_a_fraction_are_that_number,
    a_key_remembered_while_sold_out_replays_only_the_request_it_answered,
    a_clock_that_steps_back_does_not_stretch_the_sold_out_bound,
    the_end_step_counts_a_hold_committed_while_it_waited_for_the_buckets,
    goods_returned_after_a_campaign_closed_go_back_to_regular_stock_ledgered,
    a_return_into_a_closed_campaigns_bucket_takes_the_source_row_before_the_event_counter,
    the_audit_finds_units_left_in_a_closed_campaigns_bucket,
    a_late_payment_over_the_campaigns_limit_is_refunded,
    a_late_payment_after_the_campaign_ended_takes_its_unit_from_regular_stock,
    a_late_payment_whose_bucket_was_emptied_takes_its_unit_from_another,
    a_refusal_for_another_lines_stock_does_not_make_the_campaign_sold_out,
    a_refusal_of_more_units_than_a_bucket_holds_does_not_refuse_fewer,
    another_shops_caller_naming_a_campaign_is_refused_before_hearing_of_it,
    a_shopper_found_at_the_limit_is_refused_before_taking_a_place_within_the_bound,
    a_shopper_refused_more_than_the_headroom_may_still_take_what_fits,
    a_key_whose_caller_went_away_before_its_hold_was_answered_hears_its_hold_not_sold_out,
    a_retried_hold_or_order_naming_its_campaign_hears_its_first_answer_after_the_end,
    campaigns_of_one_sku_created_at_once_open_one_and_refuse_the_rest,
    a_key_answered_before_a_restart_replays_where_memory_finds_the_campaign_sold_out,
    a_unit_released_elsewhere_into_a_bucket_known_short_is_found_before_a_refusal_is_stored,
    campaigns_kept_open_by_a_held_unit_do_not_hold_back_the_end_of_later_ones,
    an_ended_campaign_kept_open_by_a_held_unit_does_not_lock_its_skus_row_again,
    a_request_sent_again_while_it_waits_in_the_line_takes_no_second_place,
    units_an_end_step_returns_sell_at_once_though_the_campaign_stays_open,
    a_retry_hears_its_first_answer_though_a_campaign_started_since_would_refuse_it,
    a_hold_that_waited_in_the_campaigns_line_lasts_its_whole_ttl_from_its_turn,
    a_request_that_waited_past_the_campaigns_end_takes_no_campaign_unit,
    a_request_waiting_when_the_campaign_is_ended_early_takes_no_campaign_unit,
    a_campaign_whose_end_fails_holds_back_neither_the_other_ends_nor_new_routes,
    a_request_memory_cannot_judge_takes_a_place_in_the_line_though_the_campaign_sold_out,
    a_new_campaign_is_routed_though_an_ended_one_of_its_sku_is_still_open,
    a_sold_out_finding_is_dated_when_its_request_was_sent_not_answered,
    a_campaign_refused_for_a_sku_that_does_not_exist_is_refused_again_after_it_was_created,
    a_shopper_found_at_the_limit_is_dated_when_the_request_was_sent_not_answered,
    a_key_whose_record_was_purged_is_not_replayed_from_memory,
    a_shutdown_lets_the_requests_of_tickets_handed_out_run_in_their_turn,
    a_tickets_answer_carries_the_position_of_its_write_and_the_202_none,
    a_tickets_position_counts_only_the_places_still_waiting_ahead,
    the_product_view_shows_what_a_reservation_could_take_around_a_campaign,
    a_shelf_operation_reports_the_availability_the_product_view_shows_around_a_campaign,
    an_instance_whose_clock_runs_ahead_starts_no_campaign_early,
    on_an_instance_whose_clock_runs_ahead_carts_and_shelf_results_see_the_sale_as_reservations_do,
);

const HOUR_SECONDS: i64 = 3600;

async fn create_campaign(app: &TestApp, key: &str, body: Value) -> TestResponse {
    app.send(
        Call::post("/v1/admin/campaigns")
            .admin()
            .key(key)
            .json(&body),
    )
    .await
}

/// A campaign of `quantity` units of `sku` over `buckets`, running from now for an hour.
async fn running_campaign(
    app: &TestApp,
    sku: &str,
    quantity: i64,
    buckets: u32,
    per_user_limit: Option<i64>,
) -> String {
    let mut body = json!({
        "sku": sku,
        "quantity": quantity,
        "buckets": buckets,
        "starts_at": START.to_rfc3339(),
        "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
    });
    if let Some(limit) = per_user_limit {
        body["per_user_limit"] = json!(limit);
    }
    let created = create_campaign(app, &format!("campaign-{sku}"), body).await;
    assert_eq!(created.status, 201, "{created:?}");
    created.json()["campaign_id"].as_str().unwrap().to_owned()
}

async fn campaign(app: &TestApp, id: &str) -> Value {
    let read = app
        .send(Call::get(format!("/v1/admin/campaigns/{id}")).admin())
        .await;
    assert_eq!(read.status, 200, "{read:?}");
    read.json()
}

fn reserve_call(key: &str, sku: &str, user: &str) -> Call {
    Call::post("/v1/reservations").key(key).json(&json!({
        "lines": [{"sku": sku, "quantity": 1}],
        "user_id": user,
    }))
}

/// The first line of a reservation (or an order's) was taken from a campaign's bucket.
fn assert_drew_from_a_bucket(reservation: &Value) {
    let warehouse = reservation["lines"][0]["warehouse"]
        .as_str()
        .unwrap_or_default();
    assert!(warehouse.starts_with("campaign-"), "{reservation}");
}

fn statuses(responses: &[TestResponse]) -> (usize, usize) {
    let created = responses
        .iter()
        .filter(|response| response.status == 201)
        .count();
    let sold_out = responses
        .iter()
        .filter(|response| response.code().as_deref() == Some("insufficient_stock"))
        .count();
    (created, sold_out)
}

/// Found in review: deleting a SKU left its campaign open until its end, however far
/// (an end has no bound), its carved units in the buckets where no movement reaches
/// them. A deleted SKU's campaign is ended by the next step: what is left goes back to
/// the SKU's regular row, ledgered (where a write-off can reach it), and it closes.
async fn deleting_a_sku_ends_its_campaign_and_gives_its_units_back(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KETTLE", 10).await;
    let id = running_campaign(&app, "KETTLE", 5, 2, None).await;
    let regular = || async {
        let sku = app.sku("KETTLE").await;
        sku["warehouses"]
            .as_array()
            .unwrap()
            .iter()
            .find(|level| level["warehouse"] == "default")
            .and_then(|level| level["available"].as_i64())
    };
    assert!(app.engine.campaign_step().await.unwrap().is_empty());
    assert_eq!(regular().await, Some(5), "five carved out");
    let deleted = app
        .shelf(None, json!({"operation": "delete", "sku_ids": ["KETTLE"]}))
        .await;
    assert_eq!(deleted.status, 200, "{deleted:?}");

    let closed = app.engine.campaign_step().await.unwrap();

    assert_eq!(closed.len(), 1, "{closed:?}");
    let done = campaign(&app, &id).await;
    assert_eq!(done["phase"], "ENDED");
    assert_eq!(
        (done["returned"].as_i64(), done["left"].as_i64()),
        (Some(5), Some(0))
    );
    assert!(done["closed_at"].is_string(), "{done}");
    assert_eq!(
        regular().await,
        Some(10),
        "the five are back in the regular row"
    );
    app.assert_audit_clean().await;
}

async fn a_campaign_carves_its_units_out_of_regular_stock_and_sells_only_those(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("PHONE", 100).await;

    let id = running_campaign(&app, "PHONE", 10, 4, None).await;

    let created = campaign(&app, &id).await;
    assert_eq!(
        (
            created["left"].as_i64(),
            created["held"].as_i64(),
            created["sold"].as_i64()
        ),
        (Some(10), Some(0), Some(0))
    );
    assert_eq!(created["phase"], "RUNNING");
    let shares: Vec<i64> = created["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|bucket| bucket["available"].as_i64().unwrap())
        .collect();
    assert_eq!(shares, [3, 3, 2, 2]);
    let regular = app.sku("PHONE").await;
    let default_row = regular["warehouses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["warehouse"] == "default")
        .unwrap()
        .clone();
    assert_eq!(
        default_row["available"], 90,
        "the campaign's units left the regular row"
    );

    let calls = (0..25)
        .map(|index| reserve_call(&format!("buyer-{index}"), "PHONE", &format!("user-{index}")))
        .collect();
    let responses = send_concurrently(&app, calls).await;

    assert_eq!(
        statuses(&responses),
        (10, 15),
        "exactly the campaign's units are sold"
    );
    let after = campaign(&app, &id).await;
    assert_eq!(
        (after["left"].as_i64(), after["held"].as_i64()),
        (Some(0), Some(10))
    );
    let regular = app.sku("PHONE").await;
    let default_row = regular["warehouses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["warehouse"] == "default")
        .unwrap()
        .clone();
    assert_eq!(
        default_row["available"], 90,
        "regular stock untouched while the campaign runs"
    );
    let first = responses
        .iter()
        .find(|response| response.status == 201)
        .unwrap();
    assert_drew_from_a_bucket(&first.json());
    app.assert_audit_clean().await;
}

async fn an_empty_bucket_sends_requests_on_to_the_others_until_every_one_is_empty(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAMP", 8).await;
    let id = running_campaign(&app, "LAMP", 8, 8, None).await;

    // One at a time: whatever bucket each key starts at, every unit is found.
    let mut answers = Vec::new();
    for index in 0..9 {
        answers.push(
            app.send(reserve_call(&format!("lamp-{index}"), "LAMP", "someone"))
                .await,
        );
    }

    assert_eq!(statuses(&answers), (8, 1));
    let mut buckets: Vec<String> = answers[..8]
        .iter()
        .map(|answer| {
            answer.json()["lines"][0]["warehouse"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    buckets.sort();
    buckets.dedup();
    assert_eq!(buckets.len(), 8, "one unit from each bucket");
    assert_eq!(campaign(&app, &id).await["left"], 0);
    // The refusal was decided by the database and stored: a retry replays it, even
    // while this instance answers new requests from memory.
    let again = app.send(reserve_call("lamp-8", "LAMP", "someone")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, answers[8].body);
    app.assert_audit_clean().await;
}

async fn before_its_start_a_campaign_is_refused_by_name_and_regular_sales_go_on(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 10).await;
    let later = create_campaign(
        &app,
        "tv-campaign",
        json!({
            "sku": "TV", "quantity": 4,
            "starts_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
            "ends_at": START.plus_seconds(2 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(later.status, 201, "{later:?}");
    assert_eq!(later.json()["phase"], "SCHEDULED");
    let id = later.json()["campaign_id"].as_str().unwrap().to_owned();
    let before = app.contents_except_idempotency_records().await;

    let named = app
        .send(Call::post("/v1/reservations").key("early").json(&json!({
            "lines": [{"sku": "TV", "quantity": 1}], "campaign_id": id,
        })))
        .await;

    assert_eq!(named.status, 409, "{named:?}");
    assert_eq!(named.code().as_deref(), Some("campaign_not_started"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    let regular = app.reserve("regular", &[("TV", 1)]).await;
    assert_eq!(regular.status, 201, "{regular:?}");
    assert_eq!(regular.json()["lines"][0]["warehouse"], "default");
    // Once it runs, the same SKU draws from the campaign.
    app.clock.advance_seconds(HOUR_SECONDS);
    let during = app.reserve("during", &[("TV", 1)]).await;
    assert_drew_from_a_bucket(&during.json());
    assert_eq!(campaign(&app, &id).await["held"], 1);
    app.assert_audit_clean().await;
}

async fn a_shopper_buys_no_more_than_the_campaigns_limit_however_many_requests_race(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SHOE", 50).await;
    running_campaign(&app, "SHOE", 20, 4, Some(2)).await;
    // Five instances on one database: each has a waiting room of its own (one place per
    // shopper there), so the requests meet only in the database, which holds the limit.
    let mut instances = vec![app.clone()];
    for _ in 0..4 {
        let instance = app.another_instance().await;
        instance.engine.campaign_step().await.unwrap();
        instances.push(instance);
    }

    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(30));
    let tasks: Vec<_> = (0..30)
        .map(|index| {
            let instance = instances[index % instances.len()].clone();
            let barrier = std::sync::Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                instance
                    .send(reserve_call(&format!("greedy-{index}"), "SHOE", "greedy"))
                    .await
            })
        })
        .collect();
    let mut responses = Vec::new();
    for task in tasks {
        responses.push(task.await.unwrap());
    }

    let codes: Vec<_> = responses.iter().map(TestResponse::code).collect();
    let created = responses
        .iter()
        .filter(|response| response.status == 201)
        .count();
    let refused = responses
        .iter()
        .filter(|response| {
            matches!(
                response.code().as_deref(),
                Some("purchase_limit_exceeded" | "rate_limited")
            )
        })
        .count();
    assert!((1..=2).contains(&created), "{codes:?}");
    assert_eq!(created + refused, 30, "{codes:?}");
    // However the race went, the shopper reaches the limit and not one unit beyond.
    let mut bought = created;
    for attempt in 0..3 {
        let more = app
            .send(reserve_call(
                &format!("greedy-after-{attempt}"),
                "SHOE",
                "greedy",
            ))
            .await;
        if more.status == 201 {
            bought += 1;
        } else {
            assert_eq!(
                more.code().as_deref(),
                Some("purchase_limit_exceeded"),
                "{more:?}"
            );
        }
    }
    assert_eq!(bought, 2, "{codes:?}");
    let other = app.send(reserve_call("modest", "SHOE", "modest")).await;
    assert_eq!(
        other.status, 201,
        "another shopper is unaffected: {other:?}"
    );
    // A campaign with a limit counts only named shoppers.
    let anonymous = app.reserve("nobody", &[("SHOE", 1)]).await;
    assert_eq!(
        anonymous.code().as_deref(),
        Some("failed_precondition"),
        "{anonymous:?}"
    );
    app.assert_audit_clean().await;
}

async fn orders_and_checkouts_draw_from_the_campaign_too(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("BAG", 10).await;
    let id = running_campaign(&app, "BAG", 3, 2, Some(1)).await;

    let order = app.create_order("bag-order", "ann", &[("BAG", 1)]).await;

    assert_eq!(order.status, 201, "{order:?}");
    assert_drew_from_a_bucket(&order.json()["reservation"]);
    let second = app.create_order("bag-order-2", "ann", &[("BAG", 1)]).await;
    assert_eq!(
        second.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "{second:?}"
    );
    let cart = app
        .send(
            Call::put("/v1/carts/bob/items/BAG")
                .key("bob-cart")
                .json(&json!({"quantity": 1})),
        )
        .await;
    assert_eq!(cart.status, 200, "{cart:?}");
    let checkout = app
        .send(Call::post("/v1/carts/bob/checkout").key("bob-checkout"))
        .await;
    assert_eq!(checkout.status, 201, "{checkout:?}");
    assert_eq!(campaign(&app, &id).await["held"], 2);
    app.assert_audit_clean().await;
}

/// Found in review: a checkout of a campaign line and another, whose first bucket was
/// empty (emptied by a hold this process saw succeed, so not known short), left the
/// campaign line out as `out_of_stock` though the other bucket held a unit, and stored
/// that order under its key for good. A bucket found short sends the checkout on to
/// the next, as it does a reservation; only the last bucket's word leaves a line out.
async fn a_checkout_whose_first_bucket_is_empty_takes_its_campaign_line_from_another(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 10).await;
    app.stocked_sku("MUG", 5).await;
    let id = running_campaign(&app, "TV", 2, 2, None).await;
    let drain = key_starting_at(&app, "tv-drain", 0, 2).await;
    let drained = app.reserve(&drain, &[("TV", 1)]).await;
    assert_eq!(drained.status, 201, "{drained:?}");
    assert!(
        drained.json()["lines"][0]["warehouse"]
            .as_str()
            .unwrap()
            .ends_with("-0"),
        "{drained:?}"
    );
    for sku in ["TV", "MUG"] {
        let put = app
            .send(
                Call::put(format!("/v1/carts/bob/items/{sku}"))
                    .key(format!("bob-cart-{sku}"))
                    .json(&json!({"quantity": 1})),
            )
            .await;
        assert_eq!(put.status, 200, "{put:?}");
    }
    let key = key_starting_at(&app, "bob-checkout", 0, 2).await;

    let checkout = app
        .send(Call::post("/v1/carts/bob/checkout").key(&key))
        .await;

    assert_eq!(checkout.status, 201, "{checkout:?}");
    let body = checkout.json();
    let mut ordered: Vec<&str> = body["reservation"]["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|line| line["sku"].as_str().unwrap())
        .collect();
    ordered.sort_unstable();
    assert_eq!(ordered, ["MUG", "TV"], "{body}");
    assert_eq!(body["skipped"], json!([]), "{body}");
    assert_eq!(campaign(&app, &id).await["held"], 2);
    app.assert_audit_clean().await;
}

/// Found in review: a campaign created without a per-user limit sold its units with
/// none, lifting the SKU's own "one per customer" for as long as it ran (a request
/// without a `user_id` took five). It takes the SKU's limit now, over its own units.
async fn a_campaign_created_without_a_limit_keeps_its_skus_limit(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TV", 100).await;
    let limited = app
        .send(
            Call::put("/v1/skus/TV")
                .admin()
                .key("tv-limit")
                .json(&json!({"per_user_limit": 1})),
        )
        .await;
    assert_eq!(limited.status, 200, "{limited:?}");
    let id = running_campaign(&app, "TV", 40, 2, None).await;
    assert_eq!(campaign(&app, &id).await["per_user_limit"], 1);
    let before = app.contents_except_idempotency_records().await;

    let anonymous = app.reserve("tv-anonymous", &[("TV", 5)]).await;
    let five = app
        .send(
            Call::post("/v1/reservations")
                .key("tv-ann-five")
                .json(&json!({
                    "lines": [{"sku": "TV", "quantity": 5}],
                    "user_id": "ann",
                })),
        )
        .await;

    assert_eq!(
        anonymous.code().as_deref(),
        Some("failed_precondition"),
        "{anonymous:?}"
    );
    assert_eq!(
        five.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "{five:?}"
    );
    assert_eq!(app.contents_except_idempotency_records().await, before);
    let one = app.send(reserve_call("tv-ann-one", "TV", "ann")).await;
    assert_eq!(one.status, 201, "{one:?}");
    assert_drew_from_a_bucket(&one.json());
    let second = app.send(reserve_call("tv-ann-two", "TV", "ann")).await;
    assert_eq!(
        second.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "{second:?}"
    );
    app.assert_audit_clean().await;
}

fn end_call(id: &str, key: &str) -> Call {
    Call::post(format!("/v1/admin/campaigns/{id}/end"))
        .admin()
        .key(key)
}

/// Found in review: a campaign could not be stopped before its end, however wrong its
/// quantity or date: its units stayed out of regular stock until then. An end now
/// moves its end to now; what is left goes back to regular stock at once (ledgered),
/// a unit held then stays held and comes back when released, and the SKU sells from
/// regular stock again.
async fn a_campaign_ended_early_gives_back_what_is_left_at_once_and_sells_no_more(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KETTLE", 10).await;
    let id = running_campaign(&app, "KETTLE", 4, 2, None).await;
    let held = app.send(reserve_call("kettle-held", "KETTLE", "ann")).await;
    assert_eq!(held.status, 201, "{held:?}");
    assert_drew_from_a_bucket(&held.json());
    app.clock.advance_seconds(60);

    let ended = app.send(end_call(&id, "end-kettle")).await;

    assert_eq!(ended.status, 200, "{ended:?}");
    assert_eq!(ended.json()["phase"], "ENDED", "{ended:?}");
    assert_eq!(
        ended.json()["ends_at"],
        START.plus_seconds(60).to_rfc3339(),
        "{ended:?}"
    );
    let after = campaign(&app, &id).await;
    assert_eq!(
        (&after["left"], &after["held"], &after["returned"]),
        (&json!(0), &json!(1), &json!(3)),
        "{after}"
    );
    let regular = app
        .send(reserve_call("kettle-after", "KETTLE", "bob"))
        .await;
    assert_eq!(regular.status, 201, "{regular:?}");
    assert_eq!(regular.json()["lines"][0]["warehouse"], "default");
    let retried = app.send(end_call(&id, "end-kettle")).await;
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, ended.body);
    // The unit held at the end comes back to regular stock once released.
    let reservation = held.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(
        app.release(&reservation, "kettle-release").await.status,
        200
    );
    app.engine.campaign_step().await.unwrap();
    let closed = campaign(&app, &id).await;
    assert_eq!(closed["returned"], 4, "{closed}");
    assert!(closed["closed_at"].is_string(), "{closed}");
    assert_eq!(app.counters("KETTLE").await.0, 9, "ten less bob's one");
    app.assert_audit_clean().await;
}

/// A campaign ended before its start never runs: its units go back at once, and at
/// the hour it was to start the SKU sells from regular stock.
async fn a_campaign_ended_before_its_start_never_starts(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TOASTER", 10).await;
    campaign_of_ten_starting_in_an_hour(&app, "TOASTER").await;
    let id = running_id(&app, "TOASTER");

    let ended = app.send(end_call(&id, "end-toaster")).await;

    assert_eq!(ended.status, 200, "{ended:?}");
    let after = campaign(&app, &id).await;
    assert_eq!(after["returned"], 10, "{after}");
    assert!(after["closed_at"].is_string(), "{after}");
    app.clock.advance_seconds(HOUR_SECONDS + 60);
    let sold = app.reserve("toaster-later", &[("TOASTER", 1)]).await;
    assert_eq!(sold.status, 201, "{sold:?}");
    assert_eq!(sold.json()["lines"][0]["warehouse"], "default");
    app.assert_audit_clean().await;
}

async fn a_campaign_ended_on_another_instance_is_not_routed_here_after_the_next_refresh(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // Two instances on one SQLite file are not a deployment stockd supports.
        return;
    }
    let app = TestApp::spawn(backend).await;
    let other = app.another_instance().await;
    app.stocked_sku("HEATER", 10).await;
    let id = running_campaign(&app, "HEATER", 4, 2, None).await;
    other.engine.campaign_step().await.unwrap();
    let before = other.reserve("heater-before", &[("HEATER", 1)]).await;
    assert_drew_from_a_bucket(&before.json());

    let ended = app.send(end_call(&id, "end-heater")).await;
    assert_eq!(ended.status, 200, "{ended:?}");
    other.engine.campaign_step().await.unwrap();
    let after = other.reserve("heater-after", &[("HEATER", 1)]).await;

    assert_eq!(after.status, 201, "{after:?}");
    assert_eq!(
        after.json()["lines"][0]["warehouse"],
        "default",
        "{after:?}"
    );
    app.assert_audit_clean().await;
}

async fn ending_a_campaign_that_ended_does_not_exist_or_is_malformed_is_refused_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FAN", 10).await;
    let id = running_campaign(&app, "FAN", 4, 2, None).await;
    app.clock.advance_seconds(HOUR_SECONDS);
    app.engine.campaign_step().await.unwrap();
    let before = app.contents().await;
    let rows_before = app.contents_except_idempotency_records().await;

    for (label, call, status) in [
        ("malformed id", end_call("cmp_nope", "end-malformed"), 400),
        (
            "a body with a field",
            end_call(&id, "end-with-body").json(&json!({"at": "now"})),
            400,
        ),
        (
            "no key",
            Call::post(format!("/v1/admin/campaigns/{id}/end")).admin(),
            400,
        ),
    ] {
        let answer = app.send(call).await;
        assert_eq!(answer.status, status, "{label}: {answer:?}");
        assert_eq!(app.contents().await, before, "{label}: nothing stored");
    }
    let unknown = app
        .send(end_call("cmp_0000000000000000000000000000", "end-unknown"))
        .await;
    assert_eq!(unknown.status, 404, "{unknown:?}");
    let ended = app.send(end_call(&id, "end-fan")).await;
    assert_eq!(
        ended.code().as_deref(),
        Some("illegal_transition"),
        "{ended:?}"
    );
    assert_eq!(
        app.contents_except_idempotency_records().await,
        rows_before,
        "refusals change nothing"
    );
    app.assert_audit_clean().await;
}

/// A shop that puts all of a SKU's stock into its flash sale: while the campaign runs,
/// a cart counts the units of the campaign's fullest bucket (a checkout's line draws
/// from one bucket), and a checkout orders from them. Before, a cart counted the regular stock only, found
/// none, and the checkout refused the line.
async fn a_cart_sees_and_checks_out_the_units_of_a_running_campaign(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAMP", 4).await;
    let id = running_campaign(&app, "LAMP", 4, 2, None).await;
    for (user, quantity) in [("bob", 2), ("cy", 2), ("dee", 3)] {
        let put = app
            .send(
                Call::put(format!("/v1/carts/{user}/items/LAMP"))
                    .key(format!("{user}-cart"))
                    .json(&json!({"quantity": quantity})),
            )
            .await;
        assert_eq!(put.status, 200, "{put:?}");
    }
    let cart = app.send(Call::get("/v1/carts/bob")).await.json();
    assert_eq!(cart["orderable_lines"], 1, "{cart}");
    // Two buckets of two: a line of three, which one bucket cannot serve, is shown so.
    let cart = app.send(Call::get("/v1/carts/dee")).await.json();
    assert_eq!(
        cart["lines"][0]["problem"], "quantity_above_available",
        "{cart}"
    );

    let checkout = app
        .send(Call::post("/v1/carts/bob/checkout").key("bob-checkout"))
        .await;

    assert_eq!(checkout.status, 201, "{checkout:?}");
    assert_drew_from_a_bucket(&checkout.json()["reservation"]);
    assert_eq!(campaign(&app, &id).await["held"], 2);
    // Once the campaign has ended, a cart counts the regular stock again: none.
    app.clock.advance_seconds(HOUR_SECONDS);
    let cart = app.send(Call::get("/v1/carts/cy")).await.json();
    assert_eq!(cart["orderable_lines"], 0, "{cart}");
    assert_eq!(cart["lines"][0]["problem"], "out_of_stock", "{cart}");
    app.assert_audit_clean().await;
}

async fn at_its_end_what_is_left_goes_back_to_regular_stock_ledgered(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("COAT", 20).await;
    let id = running_campaign(&app, "COAT", 10, 3, None).await;
    let kept = app.reserve("kept", &[("COAT", 2)]).await;
    let held = app.reserve("held", &[("COAT", 1)]).await;
    let kept_id = kept.json()["reservation_id"].as_str().unwrap().to_owned();
    let held_id = held.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.confirm(&kept_id, "confirm-kept").await.status, 200);

    app.clock.advance_seconds(HOUR_SECONDS);
    let closed = app.engine.campaign_step().await.unwrap();

    assert!(
        closed.is_empty(),
        "a unit is still held: the campaign stays open for it"
    );
    let ended = campaign(&app, &id).await;
    assert_eq!(ended["phase"], "ENDED");
    assert_eq!(
        (
            ended["returned"].as_i64(),
            ended["left"].as_i64(),
            ended["held"].as_i64(),
            ended["sold"].as_i64()
        ),
        (Some(7), Some(0), Some(1), Some(2))
    );
    assert_eq!(
        app.counters("COAT").await.0,
        17,
        "10 − 3 carved back onto 10 regular"
    );
    // After the end the SKU sells from regular stock again.
    let after = app.reserve("after-end", &[("COAT", 1)]).await;
    assert_eq!(after.json()["lines"][0]["warehouse"], "default");
    // The held unit released later goes back too, and the campaign closes.
    assert_eq!(app.release(&held_id, "release-held").await.status, 200);
    let closed = app.engine.campaign_step().await.unwrap();
    assert_eq!(closed.len(), 1);
    let done = campaign(&app, &id).await;
    assert_eq!(
        (done["returned"].as_i64(), done["held"].as_i64()),
        (Some(8), Some(0))
    );
    assert!(done["closed_at"].is_string());
    assert!(
        app.engine.campaign_step().await.unwrap().is_empty(),
        "a closed campaign is done"
    );
    app.assert_audit_clean().await;
}

async fn a_sold_out_campaign_is_answered_from_memory_within_the_recheck_bound_only(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("GPU", 5).await;
    running_campaign(&app, "GPU", 2, 1, None).await;
    let first = app.reserve("gpu-1", &[("GPU", 1)]).await;
    assert_eq!(app.reserve("gpu-2", &[("GPU", 1)]).await.status, 201);
    let refused = app.reserve("gpu-3", &[("GPU", 1)]).await;
    assert_eq!(refused.code().as_deref(), Some("insufficient_stock"));
    assert!(
        refused.body.contains("requested"),
        "decided by the database: {refused:?}"
    );

    let from_memory = app.reserve("gpu-4", &[("GPU", 1)]).await;

    assert_eq!(from_memory.status, 409);
    assert_eq!(from_memory.code().as_deref(), Some("insufficient_stock"));
    assert!(from_memory.body.contains("sold out"), "{from_memory:?}");
    // The database's refusal was a unit of work, stored under its key: a later read may
    // wait for its position. The memory answer wrote nothing, so it carries none, and
    // no round trip was spent reading one.
    assert!(
        refused.headers.contains_key("stockd-consistency-token"),
        "{refused:?}"
    );
    assert!(
        !from_memory.headers.contains_key("stockd-consistency-token"),
        "{from_memory:?}"
    );
    assert!(
        app.store
            .idempotency_record(&store::ScopedKey::new(
                &app.service_principal().await,
                &domain::IdempotencyKey::parse("gpu-4").unwrap()
            ))
            .await
            .unwrap()
            .is_none(),
        "a memory answer stores nothing"
    );
    // A unit comes back; within the bound this instance still says sold out…
    let id = first.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.release(&id, "release-gpu-1").await.status, 200);
    let still = app.reserve("gpu-5", &[("GPU", 1)]).await;
    assert!(still.body.contains("sold out"), "{still:?}");
    // …and past it the database decides again, and sells the unit.
    let recheck = app.engine.config().sold_out_recheck_milliseconds;
    app.clock.advance_milliseconds(recheck);
    let sold = app.reserve("gpu-6", &[("GPU", 1)]).await;
    assert_eq!(sold.status, 201, "{sold:?}");
    app.assert_audit_clean().await;
}

async fn a_campaign_created_elsewhere_is_routed_here_after_the_next_refresh(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    if backend == Backend::Sqlite {
        // Two instances on one SQLite file are not a deployment stockd supports.
        return;
    }
    let other = app.another_instance().await;
    app.stocked_sku("WATCH", 10).await;
    running_campaign(&app, "WATCH", 3, 1, None).await;

    let before_refresh = other.reserve("w-1", &[("WATCH", 1)]).await;
    other.engine.campaign_step().await.unwrap();
    let after_refresh = other.reserve("w-2", &[("WATCH", 1)]).await;

    assert_eq!(
        before_refresh.json()["lines"][0]["warehouse"],
        "default",
        "not known there yet"
    );
    assert_drew_from_a_bucket(&after_refresh.json());
    app.assert_audit_clean().await;
}

async fn malformed_unauthorized_and_impossible_campaigns_are_refused_and_change_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CAMERA", 5).await;
    let south = app.create_operator("sam", "south").await;
    let before = app.contents().await;
    let rows_before = app.contents_except_idempotency_records().await;
    let start = START.to_rfc3339();
    let end = START.plus_seconds(HOUR_SECONDS).to_rfc3339();
    for (label, body, status) in [
        (
            "no quantity",
            json!({"sku": "CAMERA", "starts_at": start, "ends_at": end}),
            400,
        ),
        (
            "zero",
            json!({"sku": "CAMERA", "quantity": 0, "starts_at": start, "ends_at": end}),
            400,
        ),
        (
            "too many buckets",
            json!({"sku": "CAMERA", "quantity": 5, "buckets": 65, "starts_at": start, "ends_at": end}),
            400,
        ),
        (
            "more buckets than units",
            json!({"sku": "CAMERA", "quantity": 2, "buckets": 3, "starts_at": start, "ends_at": end}),
            400,
        ),
        (
            "end before start",
            json!({"sku": "CAMERA", "quantity": 2, "starts_at": end, "ends_at": start}),
            400,
        ),
        (
            "ended already",
            json!({"sku": "CAMERA", "quantity": 2, "starts_at": START.plus_seconds(-7200).to_rfc3339(), "ends_at": START.plus_seconds(-3600).to_rfc3339()}),
            400,
        ),
        (
            "ending more than a year ahead (a mistyped year)",
            json!({"sku": "CAMERA", "quantity": 2, "starts_at": start, "ends_at": START.plus_seconds(367 * 86_400).to_rfc3339()}),
            400,
        ),
        (
            "unknown field",
            json!({"sku": "CAMERA", "quantity": 2, "starts_at": start, "ends_at": end, "price": 1}),
            400,
        ),
        (
            "a bucket's warehouse",
            json!({"sku": "CAMERA", "quantity": 2, "starts_at": start, "ends_at": end, "warehouse": "campaign-0123456789ab-0"}),
            400,
        ),
        (
            "unknown sku, more buckets than units",
            json!({"sku": "NOPE", "quantity": 2, "buckets": 3, "starts_at": start, "ends_at": end}),
            400,
        ),
    ] {
        let answer = create_campaign(&app, &format!("bad-{}", label.replace(' ', "-")), body).await;
        assert_eq!(answer.status, status, "{label}: {answer:?}");
        assert_eq!(app.contents().await, before, "{label}: nothing stored");
    }
    let foreign = app
        .send(
            Call::post("/v1/admin/campaigns")
                .bearer(&south)
                .key("foreign")
                .json(&json!({"sku": "CAMERA", "quantity": 2, "starts_at": start, "ends_at": end})),
        )
        .await;
    assert_eq!(foreign.status, 403, "{foreign:?}");
    assert_eq!(app.contents().await, before, "refusals change nothing");
    let unknown = create_campaign(
        &app,
        "bad-unknown-sku",
        json!({"sku": "NOPE", "quantity": 2, "starts_at": start, "ends_at": end}),
    )
    .await;
    assert_eq!(unknown.status, 404, "{unknown:?}");
    assert_eq!(
        app.contents_except_idempotency_records().await,
        rows_before,
        "a refusal of the SKU stores its answer and nothing else"
    );
    let too_big = create_campaign(
        &app,
        "too-big",
        json!({"sku": "CAMERA", "quantity": 6, "starts_at": start, "ends_at": end}),
    )
    .await;
    assert_eq!(
        too_big.code().as_deref(),
        Some("insufficient_stock"),
        "{too_big:?}"
    );
    running_campaign(&app, "CAMERA", 2, 1, None).await;
    let second = create_campaign(
        &app,
        "second",
        json!({"sku": "CAMERA", "quantity": 1, "starts_at": start, "ends_at": end}),
    )
    .await;
    assert_eq!(
        second.code().as_deref(),
        Some("failed_precondition"),
        "{second:?}"
    );
    app.assert_audit_clean().await;
}

async fn a_buckets_warehouse_cannot_be_named_by_a_request(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("PEN", 10).await;
    let id = running_campaign(&app, "PEN", 4, 2, None).await;
    let warehouse = campaign(&app, &id).await;
    let code = &id[id.len() - 12..];
    let bucket = format!("campaign-{code}-0");
    assert_eq!(warehouse["buckets"].as_array().unwrap().len(), 2);
    let before = app.contents_except_idempotency_records().await;

    let reserve = app
        .send(
            Call::post("/v1/reservations")
                .key("direct")
                .json(&json!({"lines": [{"sku": "PEN", "quantity": 1, "warehouse": bucket}]})),
        )
        .await;
    let receive = app
        .send(
            Call::post("/v1/skus/PEN/stock-movements")
                .admin()
                .key("direct-receive")
                .json(&json!({"kind": "receive", "quantity": 5, "warehouse": bucket})),
        )
        .await;

    assert_eq!(reserve.status, 400, "{reserve:?}");
    assert_eq!(receive.status, 400, "{receive:?}");
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn the_audit_finds_a_campaign_whose_units_do_not_add_up(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("RING", 10).await;
    let id = running_campaign(&app, "RING", 4, 2, None).await;
    app.assert_audit_clean().await;

    // Units said to have gone back that no ledger row moved.
    let mut connection = app.database.raw_connection().await;
    connection
        .execute(&format!(
            "UPDATE campaign SET returned = 1 WHERE id = '{id}'"
        ))
        .await
        .unwrap();

    let audit = app.audit().await;
    assert_eq!(audit["ok"], false);
    let checks: Vec<&str> = audit["differences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|difference| difference["check"].as_str().unwrap())
        .collect();
    assert!(checks.contains(&"campaign_bucket_units"), "{checks:?}");
    assert!(checks.contains(&"campaign_source_units"), "{checks:?}");
}

/// The campaign's line in this process, with its one running slot held by the test:
/// every request that comes now waits (or is refused) until `held` is dropped.
async fn hold_the_line(
    app: &TestApp,
    sku: &str,
) -> (
    std::sync::Arc<engine::admission::WaitingRoom>,
    engine::admission::Turn,
) {
    let room = app
        .engine
        .campaign_waiting_room(&domain::SkuCode::parse(sku).unwrap())
        .expect("the campaign runs here");
    let held = room.enter(None).expect("the line is empty").turn().await;
    (room, held)
}

/// The id of the campaign running on `sku` here.
fn running_id(app: &TestApp, sku: &str) -> String {
    app.engine
        .campaign_route(&domain::SkuCode::parse(sku).unwrap())
        .expect("the campaign runs here")
        .id
        .to_string()
}

/// A campaign's line admitting one request at a time, with `places` places.
fn narrow_line(places: usize) -> engine::EngineConfig {
    engine::EngineConfig {
        campaign_in_flight_max: 1,
        campaign_waiting_room_max: places,
        ..acceptance::test_engine_config()
    }
}

fn waiting_reserve_call(key: &str, sku: &str, user: &str) -> Call {
    reserve_call(key, sku, user).header("prefer", "respond-async")
}

/// Polls a ticket until its request is answered (through the suite's condition wait:
/// how long it takes decides nothing, a ticket never answered fails the test).
async fn answered_ticket(app: &TestApp, poll: &str) -> Value {
    let answered = std::sync::Mutex::new(None);
    acceptance::wait_until_async("the ticket is answered", || async {
        let ticket = app.send(Call::get(poll)).await;
        if ticket.status == 200 {
            assert_eq!(ticket.json()["status"], "ANSWERED", "{ticket:?}");
            *answered.lock().unwrap() = Some(ticket.json());
            return true;
        }
        assert_eq!(ticket.status, 202, "{ticket:?}");
        assert_eq!(ticket.json()["status"], "WAITING");
        false
    })
    .await;
    answered.into_inner().unwrap().expect("answered")
}

/// A campaign running on `sku` (stocked here), a reservation of it by "ann" that got a
/// ticket while the line was held, and the ticket answered: the 202 and its poll URL.
async fn a_ticket_answered(app: &TestApp, sku: &str) -> (TestResponse, String) {
    app.stocked_sku(sku, 10).await;
    running_campaign(app, sku, 4, 1, None).await;
    let (_, held) = hold_the_line(app, sku).await;
    let ticket = app
        .send(waiting_reserve_call(&format!("{sku}-ann"), sku, "ann"))
        .await;
    assert_eq!(ticket.status, 202, "{ticket:?}");
    let poll = ticket.json()["poll"].as_str().unwrap().to_owned();
    drop(held);
    answered_ticket(app, &poll).await;
    (ticket, poll)
}

/// Found in review: a retry whose first answer was lost (a 201: the unit is held for
/// the shopper) was refused 429 while the line was full, again and again until it
/// emptied, while the hold's time ran out unconfirmed. It hears its answer.
async fn a_retry_of_an_answered_request_hears_its_answer_while_the_waiting_room_is_full(
    backend: Backend,
) {
    let app = TestApp::spawn_with(backend, narrow_line(1)).await;
    app.stocked_sku("CONSOLE", 10).await;
    running_campaign(&app, "CONSOLE", 5, 2, None).await;
    let first = app.send(reserve_call("answered", "CONSOLE", "alice")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let (room, held) = hold_the_line(&app, "CONSOLE").await;
    let _waiting = room.enter(None).expect("the one place");

    let retry = app.send(reserve_call("answered", "CONSOLE", "alice")).await;
    let fresh = app.send(reserve_call("fresh", "CONSOLE", "bob")).await;

    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(fresh.status, 429, "{fresh:?}");
    assert_eq!(fresh.code().as_deref(), Some("rate_limited"));
    drop(held);
}

async fn beyond_its_waiting_room_a_campaign_answers_429_with_retry_after_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn_with(backend, narrow_line(1)).await;
    app.stocked_sku("CONSOLE", 10).await;
    running_campaign(&app, "CONSOLE", 5, 2, None).await;
    let (room, held) = hold_the_line(&app, "CONSOLE").await;
    let waiting = room.enter(None).expect("the one place");
    let before = app.contents().await;

    let refused = app.send(reserve_call("c-1", "CONSOLE", "alice")).await;
    let refused_async = app
        .send(waiting_reserve_call("c-2", "CONSOLE", "bob"))
        .await;

    for response in [&refused, &refused_async] {
        assert_eq!(response.status, 429, "{response:?}");
        assert_eq!(response.code().as_deref(), Some("rate_limited"));
        assert!(response.header("retry-after").is_some(), "{response:?}");
    }
    assert_eq!(app.contents().await, before, "nothing was stored");
    drop(waiting);
    drop(held);
    let served = app.send(reserve_call("c-1", "CONSOLE", "alice")).await;
    assert_eq!(
        served.status, 201,
        "the same key goes through once there is room: {served:?}"
    );
    app.assert_audit_clean().await;
}

/// Found in review: a ticket's position was its number less the last served, so the
/// places given up ahead of it (callers that timed out) still counted until the next
/// turn was handed over.
async fn a_tickets_position_counts_only_the_places_still_waiting_ahead(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("QUEUED", 10).await;
    running_campaign(&app, "QUEUED", 2, 1, None).await;
    let (room, held) = hold_the_line(&app, "QUEUED").await;
    let first = room.enter(None).expect("a place");
    let second = room.enter(None).expect("a place");
    let ticket = app
        .send(waiting_reserve_call("t-dora", "QUEUED", "dora"))
        .await;
    assert_eq!(ticket.status, 202, "{ticket:?}");
    assert_eq!(ticket.json()["position"], 2, "{ticket:?}");
    let poll = ticket.json()["poll"].as_str().unwrap().to_owned();

    drop(first);
    let after_one_gave_up = app.send(Call::get(&poll)).await.json();
    drop(second);
    let after_both_gave_up = app.send(Call::get(&poll)).await.json();

    assert_eq!(after_one_gave_up["position"], 1, "{after_one_gave_up}");
    assert_eq!(after_both_gave_up["position"], 0, "{after_both_gave_up}");
    drop(held);
    assert_eq!(answered_ticket(&app, &poll).await["answer"]["status"], 201);
    app.assert_audit_clean().await;
}

async fn a_caller_that_prefers_to_wait_gets_a_ticket_served_in_order_and_answered_once(
    backend: Backend,
) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("TICKETED", 10).await;
    running_campaign(&app, "TICKETED", 2, 1, None).await;
    let (room, held) = hold_the_line(&app, "TICKETED").await;

    let mut tickets = Vec::new();
    for (index, user) in ["ann", "ben", "cat"].into_iter().enumerate() {
        let ticket = app
            .send(waiting_reserve_call(&format!("t-{user}"), "TICKETED", user))
            .await;
        assert_eq!(ticket.status, 202, "{ticket:?}");
        assert_eq!(ticket.header("preference-applied"), Some("respond-async"));
        let body = ticket.json();
        assert_eq!(body["status"], "WAITING");
        assert_eq!(body["position"], index, "{body}");
        assert_eq!(ticket.header("location"), body["poll"].as_str());
        tickets.push(body["poll"].as_str().unwrap().to_owned());
    }
    assert_eq!(room.waiting(), 3);
    // Only the holder sees its ticket.
    let stranger = app.as_service_of("south").await;
    let hidden = stranger.send(Call::get(&tickets[0])).await;
    assert_eq!(hidden.status, 404, "{hidden:?}");
    let campaign_id = running_id(&app, "TICKETED");
    assert_eq!(
        campaign(&app, &campaign_id).await["held"],
        0,
        "nobody ran yet"
    );

    drop(held);
    let answers = [
        answered_ticket(&app, &tickets[0]).await,
        answered_ticket(&app, &tickets[1]).await,
        answered_ticket(&app, &tickets[2]).await,
    ];

    // Two units, served first come first served: ann and ben got them, cat did not.
    assert_eq!(answers[0]["answer"]["status"], 201, "{}", answers[0]);
    assert_eq!(answers[1]["answer"]["status"], 201, "{}", answers[1]);
    assert_eq!(answers[2]["answer"]["status"], 409, "{}", answers[2]);
    assert_eq!(answers[2]["answer"]["body"]["code"], "insufficient_stock");
    // Answered once: polling again shows the same answer, and the request's key
    // replays it; two reservations exist, no more.
    assert_eq!(answered_ticket(&app, &tickets[0]).await, answers[0]);
    let replay = app.send(reserve_call("t-ann", "TICKETED", "ann")).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.json()["reservation_id"],
        answers[0]["answer"]["body"]["reservation_id"]
    );
    assert_eq!(campaign(&app, &campaign_id).await["held"], 2);
    app.assert_audit_clean().await;
}

async fn a_request_without_a_ticket_waits_its_turn_with_the_connection_held(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("QUEUED", 10).await;
    running_campaign(&app, "QUEUED", 3, 1, None).await;
    let (room, held) = hold_the_line(&app, "QUEUED").await;

    let waiting = {
        let app = app.clone();
        tokio::spawn(async move { app.send(reserve_call("q-1", "QUEUED", "dan")).await })
    };
    while room.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    assert!(!waiting.is_finished());
    drop(held);
    let answer = waiting.await.unwrap();

    assert_eq!(answer.status, 201, "{answer:?}");
    app.assert_audit_clean().await;
}

/// A request waiting in the campaign's line (here with a ticket) may still hold a unit
/// given back while it waits. A retry of its key while this process knows the campaign
/// sold out is therefore told the request is in progress (409 `request_in_progress`,
/// taking no second place), not "sold out" from memory (which
/// the waiting request could contradict with a 201 stored under the same key). At its
/// turn, the request itself is answered from memory like any other: a line that found
/// the campaign sold out costs the database nothing more.
async fn a_retry_of_a_request_waiting_in_line_is_not_refused_from_memory(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("WAITED", 10).await;
    running_campaign(&app, "WAITED", 1, 1, None).await;
    let first = app.send(reserve_call("w-ann", "WAITED", "ann")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let (room, held) = hold_the_line(&app, "WAITED").await;
    let ben = app
        .send(waiting_reserve_call("w-ben", "WAITED", "ben"))
        .await;
    assert_eq!(ben.status, 202, "{ben:?}");
    // A place of the test's between ben's and cat's keeps cat waiting after ben.
    let between = room.enter(None).expect("a place");
    let cat = app
        .send(waiting_reserve_call("w-cat", "WAITED", "cat"))
        .await;
    assert_eq!(cat.status, 202, "{cat:?}");
    drop(held);
    let ben = answered_ticket(&app, ben.json()["poll"].as_str().unwrap()).await;
    assert_eq!(ben["answer"]["body"]["code"], "insufficient_stock", "{ben}");
    let route = app
        .engine
        .campaign_route(&domain::SkuCode::parse("WAITED").unwrap())
        .unwrap();
    let recheck = acceptance::test_engine_config().sold_out_recheck_milliseconds;
    assert!(
        route.known_sold_out(1, app.clock_now(), recheck),
        "ben's answer taught this process the campaign is sold out"
    );

    let retry = app.send(reserve_call("w-cat", "WAITED", "cat")).await;

    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(
        retry.code().as_deref(),
        Some("request_in_progress"),
        "{retry:?}"
    );
    drop(between);
    let cat = answered_ticket(&app, cat.json()["poll"].as_str().unwrap()).await;
    assert_eq!(cat["answer"]["body"]["code"], "insufficient_stock", "{cat}");
    assert!(
        cat["answer"]["body"]["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("not recorded under the key"),
        "answered from memory at its turn: {cat}"
    );
    app.assert_audit_clean().await;
}

async fn the_limit_and_one_place_per_shopper_are_checked_before_a_place_is_taken(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("LIMITED", 10).await;
    running_campaign(&app, "LIMITED", 5, 1, Some(1)).await;
    let (room, held) = hold_the_line(&app, "LIMITED").await;
    let before = app.contents().await;

    let too_many = app
        .send(
            Call::post("/v1/reservations")
                .key("l-2")
                .header("prefer", "respond-async")
                .json(&json!({"lines": [{"sku": "LIMITED", "quantity": 2}], "user_id": "eve"})),
        )
        .await;
    let anonymous = app
        .send(
            Call::post("/v1/reservations")
                .key("l-anonymous")
                .header("prefer", "respond-async")
                .json(&json!({"lines": [{"sku": "LIMITED", "quantity": 1}]})),
        )
        .await;
    assert_eq!(too_many.status, 409, "{too_many:?}");
    assert_eq!(too_many.code().as_deref(), Some("purchase_limit_exceeded"));
    assert_eq!(anonymous.code().as_deref(), Some("failed_precondition"));
    assert_eq!(room.waiting(), 0, "neither took a place");
    assert_eq!(app.contents().await, before);

    let first = app
        .send(waiting_reserve_call("l-first", "LIMITED", "eve"))
        .await;
    assert_eq!(first.status, 202, "{first:?}");
    let second = app
        .send(waiting_reserve_call("l-second", "LIMITED", "eve"))
        .await;
    assert_eq!(second.status, 429, "{second:?}");
    assert_eq!(second.code().as_deref(), Some("rate_limited"));
    assert!(second.body.contains("already has a request waiting"));
    assert_eq!(room.waiting(), 1);

    drop(held);
    let answer = answered_ticket(&app, first.json()["poll"].as_str().unwrap()).await;
    assert_eq!(answer["answer"]["status"], 201, "{answer}");
    app.assert_audit_clean().await;
}

async fn a_retried_create_gets_its_first_answer_even_after_the_campaign_ended(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAMP", 10).await;
    let body = json!({
        "sku": "LAMP",
        "quantity": 3,
        "starts_at": START.to_rfc3339(),
        "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
    });
    let created = create_campaign(&app, "lamp-sale", body.clone()).await;
    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(
        created.json()["buckets"].as_array().unwrap().len(),
        3,
        "no more buckets than units when none are named"
    );

    app.clock.advance_seconds(2 * HOUR_SECONDS);
    let retried = create_campaign(&app, "lamp-sale", body).await;

    assert_eq!(retried.status, 201, "{retried:?}");
    assert!(retried.replayed());
    assert_eq!(retried.json()["campaign_id"], created.json()["campaign_id"]);
}

async fn buckets_written_as_a_whole_number_with_a_fraction_are_that_number(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KETTLE", 30).await;

    let created = create_campaign(
        &app,
        "kettle-sale",
        json!({
            "sku": "KETTLE",
            "quantity": 20.0,
            "buckets": 5.0,
            "starts_at": START.to_rfc3339(),
            "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;

    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(created.json()["buckets"].as_array().unwrap().len(), 5);
    let fraction = create_campaign(
        &app,
        "kettle-sale-2",
        json!({
            "sku": "KETTLE",
            "quantity": 2,
            "buckets": 1.5,
            "starts_at": START.to_rfc3339(),
            "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(fraction.status, 400, "{fraction:?}");
    assert_eq!(fraction.code().as_deref(), Some("invalid_argument"));
}

async fn a_key_remembered_while_sold_out_replays_only_the_request_it_answered(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAMP", 5).await;
    running_campaign(&app, "LAMP", 1, 1, None).await;
    let first = app.send(reserve_call("lamp-1", "LAMP", "alice")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let refused = app.send(reserve_call("lamp-2", "LAMP", "bob")).await;
    assert!(
        refused.body.contains("requested"),
        "by the database: {refused:?}"
    );
    let before = app.contents().await;

    // The campaign is sold out in memory now; the key answered alice's request.
    let same = app.send(reserve_call("lamp-1", "LAMP", "alice")).await;
    let other_user = app.send(reserve_call("lamp-1", "LAMP", "bob")).await;
    let as_an_order = app
        .send(Call::post("/v1/orders").key("lamp-1").json(&json!({
            "lines": [{"sku": "LAMP", "quantity": 1}],
            "user_id": "alice",
        })))
        .await;

    assert_eq!(same.status, 201, "{same:?}");
    assert_eq!(same.body, first.body, "the first answer, replayed");
    for reused in [&other_user, &as_an_order] {
        assert_eq!(reused.status, 422, "{reused:?}");
        assert_eq!(reused.code().as_deref(), Some("idempotency_key_reused"));
    }
    assert_eq!(
        app.contents().await,
        before,
        "answered from memory, nothing written"
    );
    app.assert_audit_clean().await;
}

async fn a_clock_that_steps_back_does_not_stretch_the_sold_out_bound(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FAN", 5).await;
    running_campaign(&app, "FAN", 1, 1, None).await;
    assert_eq!(app.reserve("fan-1", &[("FAN", 1)]).await.status, 201);
    assert!(
        app.reserve("fan-2", &[("FAN", 1)])
            .await
            .body
            .contains("requested")
    );
    assert!(
        app.reserve("fan-3", &[("FAN", 1)])
            .await
            .body
            .contains("sold out")
    );

    // The clock steps back ten minutes (still inside the campaign's hour): the finding
    // now lies in the future, and is not trusted.
    app.clock.advance_seconds(HOUR_SECONDS / 2);
    assert!(
        app.reserve("fan-4", &[("FAN", 1)])
            .await
            .body
            .contains("requested")
    );
    assert!(
        app.reserve("fan-5", &[("FAN", 1)])
            .await
            .body
            .contains("sold out")
    );
    app.clock.advance_seconds(-600);
    let after_the_step = app.reserve("fan-6", &[("FAN", 1)]).await;

    assert_eq!(after_the_step.code().as_deref(), Some("insufficient_stock"));
    assert!(
        after_the_step.body.contains("requested"),
        "decided by the database again: {after_the_step:?}"
    );
    app.assert_audit_clean().await;
}

/// The warehouse of bucket `bucket` of campaign `id`.
fn bucket_warehouse(id: &str, bucket: u32) -> String {
    format!("campaign-{}-{bucket}", &id[id.len() - 12..])
}

async fn the_end_step_counts_a_hold_committed_while_it_waited_for_the_buckets(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("DESK", 5).await;
    let id = running_campaign(&app, "DESK", 2, 1, None).await;
    app.clock.advance_seconds(HOUR_SECONDS);
    // A batch routed before the end takes a unit from the bucket and has not committed.
    let mut batch = app.database.hold_stock_row_lock("DESK").await;
    batch
        .execute(&format!(
            "UPDATE stock SET available = available - 1, reserved = reserved + 1 \
             WHERE sku = 'DESK' AND warehouse = '{}'",
            bucket_warehouse(&id, 0)
        ))
        .await
        .unwrap();

    let engine = app.engine.clone();
    let step = tokio::spawn(async move { engine.campaign_step().await });
    app.database.wait_until_blocked_by(&mut batch).await;
    batch.execute("COMMIT").await.unwrap();
    let closed = step.await.unwrap().unwrap();

    assert!(closed.is_empty(), "a unit is held: the campaign stays open");
    let ended = campaign(&app, &id).await;
    assert!(ended["closed_at"].is_null(), "{ended:#}");
    assert_eq!(
        (
            ended["held"].as_i64(),
            ended["left"].as_i64(),
            ended["returned"].as_i64()
        ),
        (Some(1), Some(0), Some(1))
    );
}

/// One KETTLE sold and paid in a campaign (3 units, 2 buckets) that then ended and
/// closed: the app, its gateway (kept serving), the campaign's id and the order.
async fn a_kettle_sold_in_a_closed_campaign(
    backend: Backend,
) -> (TestApp, acceptance::payments::TestGateway, String, String) {
    let app = TestApp::spawn(backend).await;
    let gateway = acceptance::payments::TestGateway::start(&app).await;
    app.stocked_sku("KETTLE", 10).await;
    let id = running_campaign(&app, "KETTLE", 3, 2, Some(1)).await;
    let order = app.order_of("ann", &[("KETTLE", 1)]).await;
    let events = app.webhook_events().await;
    let paid = app.pay(&order, "pay-kettle", "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    app.wait_for_webhook_events(events + 1).await;
    app.clock.advance_seconds(HOUR_SECONDS);
    assert_eq!(app.engine.campaign_step().await.unwrap().len(), 1);
    (app, gateway, id, order)
}

async fn goods_returned_after_a_campaign_closed_go_back_to_regular_stock_ledgered(
    backend: Backend,
) {
    let (app, _gateway, id, order) = a_kettle_sold_in_a_closed_campaign(backend).await;
    assert_eq!(
        app.counters("KETTLE").await.0,
        9,
        "7 regular and 2 unsold back"
    );

    let returned = app
        .send(
            Call::post(format!("/v1/orders/{order}/return"))
                .admin()
                .key("return-kettle"),
        )
        .await;

    assert_eq!(returned.status, 200, "{returned:?}");
    assert_eq!(
        app.counters("KETTLE").await,
        (10, 0),
        "the unit is on sale again"
    );
    let done = campaign(&app, &id).await;
    assert_eq!(
        (
            done["left"].as_i64(),
            done["held"].as_i64(),
            done["returned"].as_i64()
        ),
        (Some(0), Some(0), Some(3))
    );
    app.assert_audit_clean().await;
}

/// Found in review: a return into a closed campaign's bucket locked the campaign's
/// source row only after appending its events, which lock the SKU's event counter,
/// while a receive into the source row takes the row and then the counter: the two
/// deadlocked. The return now locks the source row with its lines' rows, first.
async fn a_return_into_a_closed_campaigns_bucket_takes_the_source_row_before_the_event_counter(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One writer at a time: no row locks to take in an order.
        return;
    }
    let (app, _gateway, _, order) = a_kettle_sold_in_a_closed_campaign(backend).await;
    // A receive into the source row, between its row and the SKU's event counter.
    let mut receive = app.database.hold_stock_row_lock("KETTLE").await;

    let returning = tokio::spawn({
        let app = app.clone();
        let order = order.clone();
        async move {
            app.send(
                Call::post(format!("/v1/orders/{order}/return"))
                    .admin()
                    .key("return-kettle"),
            )
            .await
        }
    });
    app.database.wait_until_blocked_by(&mut receive).await;
    let counter = app
        .database
        .raw_connection()
        .await
        .execute("SELECT 1 FROM outbox_sequence WHERE aggregate_id = 'KETTLE' FOR UPDATE NOWAIT")
        .await;
    receive.execute("ROLLBACK").await.unwrap();
    let returned = returning.await.unwrap();

    assert!(
        counter.is_ok(),
        "the waiting return holds no lock on the SKU's event counter: {counter:?}"
    );
    assert_eq!(returned.status, 200, "{returned:?}");
    assert_eq!(app.counters("KETTLE").await, (10, 0));
    app.assert_audit_clean().await;
}

async fn the_audit_finds_units_left_in_a_closed_campaigns_bucket(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("VASE", 10).await;
    let id = running_campaign(&app, "VASE", 2, 1, None).await;
    app.clock.advance_seconds(HOUR_SECONDS);
    assert_eq!(app.engine.campaign_step().await.unwrap().len(), 1);
    // A second campaign on the same SKU, running: its full buckets are not the first's.
    app.clock.advance_seconds(1);
    let body = json!({
        "sku": "VASE",
        "quantity": 2,
        "buckets": 1,
        "starts_at": app.clock_now().to_rfc3339(),
        "ends_at": app.clock_now().plus_seconds(HOUR_SECONDS).to_rfc3339(),
    });
    assert_eq!(create_campaign(&app, "vase-again", body).await.status, 201);
    app.assert_audit_clean().await;

    // A unit put into the closed campaign's bucket, ledgered as a receipt: every
    // counter agrees with its ledger, but nothing can ever move that unit again.
    let mut connection = app.database.raw_connection().await;
    let bucket = bucket_warehouse(&id, 0);
    connection
        .execute(&format!(
            "UPDATE stock SET available = available + 1 WHERE sku = 'VASE' AND warehouse = '{bucket}'"
        ))
        .await
        .unwrap();
    connection
        .execute(&format!(
            "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, reference, created_at) \
             VALUES ('VASE', '{bucket}', 'receive', 1, 0, 'test', 0)"
        ))
        .await
        .unwrap();

    let audit = app.audit().await;
    assert_eq!(audit["ok"], false);
    let differences = audit["differences"].as_array().unwrap();
    assert_eq!(differences.len(), 1, "{audit:#}");
    assert_eq!(differences[0]["check"], "campaign_closed_bucket_units");
    assert_eq!(differences[0]["actual"], 1);
}

async fn a_late_payment_over_the_campaigns_limit_is_refunded(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let gateway = acceptance::payments::TestGateway::start(&app).await;
    app.stocked_sku("PHONE", 10).await;
    running_campaign(&app, "PHONE", 5, 2, Some(1)).await;
    // Ann's first order waits for a customer action past its hold, and its stock goes
    // back (her tally with it).
    let first = app.order_of("ann", &[("PHONE", 1)]).await;
    let pending = app
        .pay(&first, "pay-first", "pm_sandbox_requires_action")
        .await;
    assert_eq!(pending.status, 202, "{pending:?}");
    app.clock.advance_seconds(901);
    assert_eq!(app.engine.reconcile_step().await.unwrap().len(), 1);
    app.wait_for_order_status(&first, "EXPIRED").await;
    // She buys her one unit with a second order.
    let second = app.order_of("ann", &[("PHONE", 1)]).await;
    assert_eq!(
        app.pay(&second, "pay-second", "pm_card_visa").await.status,
        200
    );

    // Then the first payment succeeds after all: taking the unit again would pass the
    // campaign's limit, so it is refunded.
    let intents = gateway.intents_for(&first);
    assert_eq!(intents.len(), 1, "{intents:?}");
    assert_eq!(gateway.force_success(&intents[0].id).await, 200);
    app.wait_for_order_status(&first, "REFUND_PENDING").await;
    assert_eq!(app.engine.refund_step().await.unwrap().len(), 1);
    assert_eq!(app.order(&first).await["status"], "REFUNDED");
    assert_eq!(app.order(&second).await["status"], "PAID");
    app.assert_audit_clean().await;
}

/// An order of one campaign unit whose payment waits for the shopper past its hold:
/// the order expires and its unit goes back to its bucket. Answers the order and its
/// payment intent.
async fn an_order_expired_while_its_payment_waited(
    app: &TestApp,
    gateway: &acceptance::payments::TestGateway,
    sku: &str,
) -> (String, String) {
    let order = app.order_of("ann", &[(sku, 1)]).await;
    let pending = app
        .pay(&order, "pay-late", "pm_sandbox_requires_action")
        .await;
    assert_eq!(pending.status, 202, "{pending:?}");
    app.clock.advance_seconds(901);
    assert_eq!(app.engine.reconcile_step().await.unwrap().len(), 1);
    app.wait_for_order_status(&order, "EXPIRED").await;
    let intents = gateway.intents_for(&order);
    assert_eq!(intents.len(), 1, "{intents:?}");
    (order, intents[0].id.clone())
}

/// Found in review: a late payment took its unit again only from the bucket its order
/// had held, so once the campaign had ended (its units back in regular stock, the
/// very unit paid for among them) every late payment of it was refunded. It takes the
/// unit where the campaign's units went, and the order is `PAID`, its line saying so.
async fn a_late_payment_after_the_campaign_ended_takes_its_unit_from_regular_stock(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let gateway = acceptance::payments::TestGateway::start(&app).await;
    app.stocked_sku("PHONE", 10).await;
    let id = running_campaign(&app, "PHONE", 5, 2, Some(1)).await;
    let (order, intent) = an_order_expired_while_its_payment_waited(&app, &gateway, "PHONE").await;
    app.clock.advance_seconds(HOUR_SECONDS);
    app.engine.campaign_step().await.unwrap();
    assert!(campaign(&app, &id).await["closed_at"].is_string());

    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&order, "PAID").await;

    let paid = app.order(&order).await;
    assert_eq!(paid["lines"][0]["warehouse"], "default", "{paid}");
    assert_eq!(paid["reservation"]["status"], "CONFIRMED", "{paid}");
    assert_eq!(app.counters("PHONE").await, (9, 0));
    app.assert_audit_clean().await;
}

/// The same while the campaign runs: the order's bucket was emptied meanwhile, and the
/// unit is taken from another bucket that holds one, not refunded.
async fn a_late_payment_whose_bucket_was_emptied_takes_its_unit_from_another(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let gateway = acceptance::payments::TestGateway::start(&app).await;
    app.stocked_sku("WATCH", 10).await;
    let id = running_campaign(&app, "WATCH", 2, 2, None).await;
    let (order, intent) = an_order_expired_while_its_payment_waited(&app, &gateway, "WATCH").await;
    let held_in = app.order(&order).await["lines"][0]["warehouse"]
        .as_str()
        .unwrap()
        .to_owned();
    let bucket: u32 = held_in.rsplit('-').next().unwrap().parse().unwrap();
    let drain = key_starting_at(&app, "watch-drain", bucket, 2).await;
    let drained = app.reserve(&drain, &[("WATCH", 1)]).await;
    assert_eq!(drained.json()["lines"][0]["warehouse"], held_in.as_str());

    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&order, "PAID").await;

    let paid = app.order(&order).await;
    let taken_from = paid["lines"][0]["warehouse"].as_str().unwrap();
    assert_ne!(taken_from, held_in, "{paid}");
    assert!(taken_from.starts_with("campaign-"), "{paid}");
    assert_eq!(paid["reservation"]["lines"][0]["warehouse"], taken_from);
    let after = campaign(&app, &id).await;
    assert_eq!(
        (&after["sold"], &after["held"], &after["left"]),
        (&json!(1), &json!(1), &json!(0)),
        "{after}"
    );
    app.assert_audit_clean().await;
}

async fn a_refusal_for_another_lines_stock_does_not_make_the_campaign_sold_out(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CUP", 20).await;
    app.stocked_sku("SAUCER", 0).await;
    running_campaign(&app, "CUP", 10, 2, None).await;

    let with_saucer = app
        .reserve("cup-and-saucer", &[("CUP", 1), ("SAUCER", 1)])
        .await;
    let cup = app.reserve("cup", &[("CUP", 1)]).await;

    assert_eq!(with_saucer.code().as_deref(), Some("insufficient_stock"));
    assert!(with_saucer.body.contains("SAUCER"), "{with_saucer:?}");
    assert_eq!(cup.status, 201, "the cups are all there: {cup:?}");
    assert_drew_from_a_bucket(&cup.json());
    app.assert_audit_clean().await;
}

async fn a_refusal_of_more_units_than_a_bucket_holds_does_not_refuse_fewer(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("PLATE", 20).await;
    let id = running_campaign(&app, "PLATE", 4, 2, None).await;

    // Two in each bucket: three fit in none of them.
    let three = app.reserve("three-plates", &[("PLATE", 3)]).await;
    let three_again = app.reserve("three-plates-again", &[("PLATE", 3)]).await;
    let one = app.reserve("one-plate", &[("PLATE", 1)]).await;

    assert_eq!(three.code().as_deref(), Some("insufficient_stock"));
    assert!(
        three.body.contains("requested"),
        "by the database: {three:?}"
    );
    assert!(
        three_again.body.contains("sold out"),
        "three are known not to fit: {three_again:?}"
    );
    assert_eq!(one.status, 201, "one fits: {one:?}");
    assert_eq!(campaign(&app, &id).await["left"], 3);
    app.assert_audit_clean().await;
}

async fn another_shops_caller_naming_a_campaign_is_refused_before_hearing_of_it(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("RADIO", 10).await;
    app.receive_in("RADIO", 5, Some("north-1")).await;
    let later = create_campaign(
        &app,
        "radio-campaign",
        json!({
            "sku": "RADIO", "quantity": 4,
            "starts_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
            "ends_at": START.plus_seconds(2 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    let id = later.json()["campaign_id"].as_str().unwrap().to_owned();
    let north = app.as_service_of("north").await;
    let before = app.contents_except_idempotency_records().await;
    let named = |warehouse: &str| {
        Call::post("/v1/reservations").json(&json!({
            "lines": [{"sku": "RADIO", "quantity": 1, "warehouse": warehouse}],
            "campaign_id": id,
        }))
    };

    let other_shop = north.send(named("default").key("north-radio")).await;
    let other_warehouse = app.send(named("north-1").key("radio-north-1")).await;

    assert_eq!(other_shop.status, 403, "{other_shop:?}");
    assert!(!other_shop.body.contains("starts at"), "{other_shop:?}");
    assert_eq!(
        other_warehouse.status, 404,
        "not this line's campaign: {other_warehouse:?}"
    );
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn a_shopper_found_at_the_limit_is_refused_before_taking_a_place_within_the_bound(
    backend: Backend,
) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("LIMITED", 10).await;
    running_campaign(&app, "LIMITED", 5, 1, Some(1)).await;
    let bought = app.send(reserve_call("eve-1", "LIMITED", "eve")).await;
    assert_eq!(bought.status, 201, "{bought:?}");
    let (room, held) = hold_the_line(&app, "LIMITED").await;
    let before = app.contents().await;

    let again = app
        .send(waiting_reserve_call("eve-2", "LIMITED", "eve"))
        .await;
    let other_shopper = app
        .send(waiting_reserve_call("ann-1", "LIMITED", "ann"))
        .await;
    let retry = app
        .send(waiting_reserve_call("eve-1", "LIMITED", "eve"))
        .await;

    assert_eq!(again.status, 409, "{again:?}");
    assert_eq!(again.code().as_deref(), Some("purchase_limit_exceeded"));
    assert_eq!(other_shopper.status, 202, "{other_shopper:?}");
    assert_eq!(
        retry.status, 202,
        "the key answered here waits for its answer: {retry:?}"
    );
    assert_eq!(room.waiting(), 2, "eve's second request took no place");
    assert_eq!(app.contents().await, before, "nothing ran yet");
    drop(held);
    let replayed = answered_ticket(&app, retry.json()["poll"].as_str().unwrap()).await;
    assert_eq!(replayed["answer"]["status"], 201, "{replayed}");
    // Past the bound the database decides again (and still says no).
    let recheck = app.engine.config().sold_out_recheck_milliseconds;
    app.clock.advance_milliseconds(recheck);
    let asked = app.send(reserve_call("eve-3", "LIMITED", "eve")).await;
    assert_eq!(asked.code().as_deref(), Some("purchase_limit_exceeded"));
    assert!(!asked.body.contains("this instance found"), "{asked:?}");
    app.assert_audit_clean().await;
}

async fn a_shopper_refused_more_than_the_headroom_may_still_take_what_fits(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("MUG", 20).await;
    running_campaign(&app, "MUG", 10, 1, Some(3)).await;
    let units = |key: &str, quantity: i64| {
        Call::post("/v1/reservations").key(key).json(&json!({
            "lines": [{"sku": "MUG", "quantity": quantity}],
            "user_id": "zoe",
        }))
    };
    assert_eq!(app.send(units("zoe-1", 2)).await.status, 201);

    let two_more = app.send(units("zoe-2", 2)).await;
    let two_again = app.send(units("zoe-3", 2)).await;
    let one_more = app.send(units("zoe-4", 1)).await;

    assert_eq!(two_more.code().as_deref(), Some("purchase_limit_exceeded"));
    assert!(
        !two_more.body.contains("this instance found"),
        "the database's: {two_more:?}"
    );
    assert!(
        two_again.body.contains("this instance found"),
        "from memory: {two_again:?}"
    );
    assert_eq!(
        one_more.status, 201,
        "one fits the limit of 3: {one_more:?}"
    );
    app.assert_audit_clean().await;
}

async fn a_key_whose_caller_went_away_before_its_hold_was_answered_hears_its_hold_not_sold_out(
    backend: Backend,
) {
    let http = acceptance::http_with_request_bound(200);
    let app = TestApp::spawn_with_http(backend, &http).await;
    app.stocked_sku("DESK", 5).await;
    let id = running_campaign(&app, "DESK", 2, 1, None).await;
    let mut lock = app.database.hold_stock_row_lock("DESK").await;
    if backend != Backend::Sqlite {
        // SQLite's lock above is the whole database's; elsewhere, the bucket's row.
        lock.execute(&format!(
            "SELECT available FROM stock WHERE sku = 'DESK' AND warehouse = '{}' FOR UPDATE",
            bucket_warehouse(&id, 0)
        ))
        .await
        .unwrap();
    }
    let cut = app.reserve("desk-both", &[("DESK", 2)]).await;
    assert_eq!(cut.status, 503, "{cut:?}");
    lock.execute("ROLLBACK").await.unwrap();
    acceptance::wait_until_async("the cut request's hold committed", || async {
        campaign(&app, &id).await["held"].as_i64() == Some(2)
    })
    .await;
    assert_eq!(app.reserve("desk-1", &[("DESK", 1)]).await.status, 409);
    let remembered = app.reserve("desk-2", &[("DESK", 1)]).await;
    assert!(remembered.body.contains("sold out"), "{remembered:?}");

    let retried = app.reserve("desk-both", &[("DESK", 2)]).await;

    assert_eq!(
        retried.status, 201,
        "its hold, not a sold-out from memory: {retried:?}"
    );
    assert!(retried.replayed(), "{retried:?}");
    app.assert_audit_clean().await;
}

/// A request that named its running campaign and was answered 201 (the answer lost on
/// the way), retried after the campaign ended (and closed): the key holds the answer,
/// and the retry hears it, not "the campaign ended" or "no such campaign".
async fn a_retried_hold_or_order_naming_its_campaign_hears_its_first_answer_after_the_end(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("HAT", 10).await;
    let id = running_campaign(&app, "HAT", 4, 2, None).await;
    let hold = || {
        Call::post("/v1/reservations").key("hat-hold").json(&json!({
            "lines": [{"sku": "HAT", "quantity": 1}], "campaign_id": id,
        }))
    };
    let order = || {
        Call::post("/v1/orders").key("hat-order").json(&json!({
            "user_id": "ann", "lines": [{"sku": "HAT", "quantity": 1}], "campaign_id": id,
        }))
    };
    let held = app.send(hold()).await;
    assert_eq!(held.status, 201, "{held:?}");
    assert_drew_from_a_bucket(&held.json());
    let ordered = app.send(order()).await;
    assert_eq!(ordered.status, 201, "{ordered:?}");
    let reservation = held.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.confirm(&reservation, "hat-confirm").await.status, 200);
    let order_id = ordered.json()["order_id"].as_str().unwrap().to_owned();
    let cancelled = app
        .send(Call::post(format!("/v1/orders/{order_id}/cancel")).key("hat-cancel"))
        .await;
    assert_eq!(cancelled.status, 200, "{cancelled:?}");

    app.clock.advance_seconds(2 * HOUR_SECONDS);
    assert_eq!(app.engine.campaign_step().await.unwrap().len(), 1, "closed");
    let contents = app.contents().await;

    for (first, retried) in [
        (held, app.send(hold()).await),
        (ordered, app.send(order()).await),
    ] {
        assert_eq!(retried.status, 201, "{retried:?}");
        assert!(retried.replayed(), "{retried:?}");
        assert_eq!(retried.body, first.body);
    }
    assert_eq!(app.contents().await, contents, "nothing held again");
    // A new key naming the closed campaign is refused as before.
    let fresh = app
        .send(Call::post("/v1/reservations").key("hat-late").json(&json!({
            "lines": [{"sku": "HAT", "quantity": 1}], "campaign_id": id,
        })))
        .await;
    assert!(matches!(fresh.status, 404 | 409), "{fresh:?}");
}

async fn campaigns_of_one_sku_created_at_once_open_one_and_refuse_the_rest(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("RUSH", 100).await;
    let calls = (0..8)
        .map(|attempt| {
            Call::post("/v1/admin/campaigns")
                .admin()
                .key(format!("rush-{attempt}"))
                .json(&json!({
                    "sku": "RUSH", "quantity": 5, "buckets": 2,
                    "starts_at": START.to_rfc3339(),
                    "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
                }))
        })
        .collect();

    let answers = acceptance::send_concurrently(&app, calls).await;

    let created = answers.iter().filter(|answer| answer.status == 201).count();
    assert_eq!(created, 1, "{answers:?}");
    for answer in answers.iter().filter(|answer| answer.status != 201) {
        assert_eq!(answer.status, 409, "{answer:?}");
        assert_eq!(answer.code().as_deref(), Some("failed_precondition"));
    }
    let winner = answers.iter().find(|answer| answer.status == 201).unwrap();
    let opened = campaign(&app, winner.json()["campaign_id"].as_str().unwrap()).await;
    assert_eq!(opened["left"], 5, "{opened}");
    app.assert_audit_clean().await;
}

/// The campaign's memory, as the SKU's: a key answered before a restart is replayed
/// where memory finds the campaign sold out.
async fn a_key_answered_before_a_restart_replays_where_memory_finds_the_campaign_sold_out(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CONSOLE", 10).await;
    running_campaign(&app, "CONSOLE", 1, 1, Some(1)).await;
    let held = app
        .send(reserve_call("console-ann", "CONSOLE", "ann"))
        .await;
    assert_eq!(held.status, 201, "{held:?}");
    assert_drew_from_a_bucket(&held.json());
    let app = app.restart().await;
    app.engine.campaign_step().await.unwrap();
    let refused = app
        .send(reserve_call("console-bob", "CONSOLE", "bob"))
        .await;
    assert_eq!(
        refused.code().as_deref(),
        Some("insufficient_stock"),
        "{refused:?}"
    );
    let from_memory = app
        .send(reserve_call("console-cat", "CONSOLE", "cat"))
        .await;
    assert!(from_memory.body.contains("sold out"), "{from_memory:?}");
    let contents = app.contents().await;

    let retried = app
        .send(reserve_call("console-ann", "CONSOLE", "ann"))
        .await;

    assert_eq!(retried.status, 201, "{retried:?}");
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, held.body);
    assert_eq!(app.contents().await, contents, "nothing held twice");
}

/// A key of the service principal whose walk through `buckets` starts at `bucket`.
async fn key_starting_at(app: &TestApp, prefix: &str, bucket: u32, buckets: u32) -> String {
    let principal = app.service_principal().await;
    (0..1000)
        .map(|attempt| format!("{prefix}-{attempt}"))
        .find(|key| {
            let scoped =
                store::ScopedKey::new(&principal, &domain::IdempotencyKey::parse(key).unwrap());
            engine::campaigns::first_bucket_of_key(scoped.as_str(), buckets) == bucket
        })
        .expect("one key in a thousand starts there")
}

/// Seed 000's buckets: `insufficient_stock` only when every bucket is empty. A bucket
/// this instance found short, refilled by a release on another instance within the
/// re-check bound: a request that finds its other bucket empty must try the refilled
/// one before a refusal is stored under its key for good.
async fn a_unit_released_elsewhere_into_a_bucket_known_short_is_found_before_a_refusal_is_stored(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // Two instances on one SQLite file are not a deployment stockd supports.
        return;
    }
    let app = TestApp::spawn(backend).await;
    let elsewhere = app.another_instance().await;
    app.stocked_sku("CAMERA", 10).await;
    running_campaign(&app, "CAMERA", 2, 2, None).await;
    let first = key_starting_at(&app, "camera-first", 0, 2).await;
    let second = key_starting_at(&app, "camera-second", 0, 2).await;
    let third = key_starting_at(&app, "camera-third", 1, 2).await;
    let taken = app.reserve(&first, &[("CAMERA", 1)]).await;
    assert_eq!(taken.status, 201, "{taken:?}");
    assert!(
        taken.json()["lines"][0]["warehouse"]
            .as_str()
            .unwrap()
            .ends_with("-0")
    );
    // Bucket 0 is empty: found short here, and bucket 1 sells.
    let next = app.reserve(&second, &[("CAMERA", 1)]).await;
    assert!(
        next.json()["lines"][0]["warehouse"]
            .as_str()
            .unwrap()
            .ends_with("-1"),
        "{next:?}"
    );
    let id = taken.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(elsewhere.release(&id, "camera-release").await.status, 200);

    let refilled = app.reserve(&third, &[("CAMERA", 1)]).await;

    assert_eq!(
        refilled.status, 201,
        "bucket 0 holds a unit again: {refilled:?}"
    );
    assert!(
        refilled.json()["lines"][0]["warehouse"]
            .as_str()
            .unwrap()
            .ends_with("-0")
    );
    app.assert_audit_clean().await;
}

fn reserve_for_a_day(key: &str, sku: &str) -> Call {
    Call::post("/v1/reservations").key(key).json(&json!({
        "lines": [{"sku": sku, "quantity": 1}], "ttl_seconds": 86_400,
    }))
}

/// A campaign that ended with a unit still held stays open (for that unit); the end
/// step looks at a bounded number of campaigns, and goes on after the last of a full
/// step, so such campaigns cannot keep a later one's units from going back.
async fn campaigns_kept_open_by_a_held_unit_do_not_hold_back_the_end_of_later_ones(
    backend: Backend,
) {
    let config = engine::EngineConfig {
        campaigns_ended_per_step_max: 1,
        ..acceptance::test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("KEPT", 10).await;
    app.stocked_sku("LATER", 10).await;
    running_campaign(&app, "KEPT", 3, 1, None).await;
    // A second later: LATER's id sorts after KEPT's (ids begin with their minting time).
    app.clock.advance_seconds(1);
    let later = create_campaign(
        &app,
        "later-campaign",
        json!({
            "sku": "LATER", "quantity": 5, "buckets": 1,
            "starts_at": START.plus_seconds(1).to_rfc3339(),
            "ends_at": START.plus_seconds(2 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(later.status, 201, "{later:?}");
    let later = later.json()["campaign_id"].as_str().unwrap().to_owned();
    let held = app.send(reserve_for_a_day("kept-hold", "KEPT")).await;
    assert_eq!(held.status, 201, "{held:?}");
    app.clock.advance_seconds(3 * HOUR_SECONDS);

    let first = app.engine.campaign_step().await.unwrap();
    let second = app.engine.campaign_step().await.unwrap();

    assert!(
        first.is_empty(),
        "KEPT stays open for its held unit: {first:?}"
    );
    assert_eq!(
        second.iter().map(ToString::to_string).collect::<Vec<_>>(),
        std::slice::from_ref(&later),
        "the next step goes on to LATER"
    );
    assert_eq!(campaign(&app, &later).await["returned"], 5);
    app.assert_audit_clean().await;
}

/// Units an end step moves back from a campaign that stays open (a unit is still held)
/// are stock come back: a "sold out" this instance found for the SKU's regular stock
/// before is forgotten, and the next request buys one at once.
async fn units_an_end_step_returns_sell_at_once_though_the_campaign_stays_open(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("ALLIN", 10).await;
    running_campaign(&app, "ALLIN", 10, 1, None).await;
    let held = app.send(reserve_for_a_day("allin-hold", "ALLIN")).await;
    assert_eq!(held.status, 201, "{held:?}");
    app.clock.advance_seconds(2 * HOUR_SECONDS);
    // After the end, regular stock is empty until the step: found short here.
    let refused = app.reserve("allin-before", &[("ALLIN", 1)]).await;
    assert_eq!(
        refused.code().as_deref(),
        Some("insufficient_stock"),
        "{refused:?}"
    );

    let closed = app.engine.campaign_step().await.unwrap();
    let after = app.reserve("allin-after", &[("ALLIN", 1)]).await;

    assert!(closed.is_empty(), "a unit is still held");
    assert_eq!(after.status, 201, "the 9 units are back: {after:?}");
    app.assert_audit_clean().await;
}

/// A retry hears its key's first answer even when a campaign that started since would
/// refuse the same request at its door: more units than the campaign's limit, or no
/// user. Both were holds of regular stock when they were first answered.
async fn a_retry_hears_its_first_answer_though_a_campaign_started_since_would_refuse_it(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LAMP", 10).await;
    let later = create_campaign(
        &app,
        "lamp-campaign",
        json!({
            "sku": "LAMP", "quantity": 4, "per_user_limit": 1,
            "starts_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
            "ends_at": START.plus_seconds(2 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(later.status, 201, "{later:?}");
    let two_lamps = |key: &str| {
        Call::post("/v1/reservations").key(key).json(&json!({
            "lines": [{"sku": "LAMP", "quantity": 2}], "user_id": "alice",
        }))
    };
    let anonymous = |key: &str| {
        Call::post("/v1/reservations")
            .key(key)
            .json(&json!({"lines": [{"sku": "LAMP", "quantity": 1}]}))
    };
    let first_two = app.send(two_lamps("two-lamps")).await;
    let first_anonymous = app.send(anonymous("one-lamp")).await;
    for first in [&first_two, &first_anonymous] {
        assert_eq!(first.status, 201, "{first:?}");
        assert_eq!(first.json()["lines"][0]["warehouse"], "default");
    }

    app.clock.advance_seconds(HOUR_SECONDS);
    let retried_two = app.send(two_lamps("two-lamps")).await;
    let retried_anonymous = app.send(anonymous("one-lamp")).await;

    for (retried, first) in [
        (&retried_two, &first_two),
        (&retried_anonymous, &first_anonymous),
    ] {
        assert_eq!(retried.status, 201, "{retried:?}");
        assert!(retried.replayed(), "{retried:?}");
        assert_eq!(
            retried.json()["reservation_id"],
            first.json()["reservation_id"]
        );
    }
    // New requests of the same shapes are refused at the campaign's door.
    let more = app.send(two_lamps("two-more-lamps")).await;
    assert_eq!(
        more.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "{more:?}"
    );
    let nameless = app.send(anonymous("another-lamp")).await;
    assert_eq!(
        nameless.code().as_deref(),
        Some("failed_precondition"),
        "{nameless:?}"
    );
}

/// Time spent waiting in a campaign's line is not taken out of the hold: its ttl runs
/// from its turn, so a ticket is never answered with a hold that already expired.
async fn a_hold_that_waited_in_the_campaigns_line_lasts_its_whole_ttl_from_its_turn(
    backend: Backend,
) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("PATIENT", 10).await;
    running_campaign(&app, "PATIENT", 3, 1, None).await;
    let (_room, held) = hold_the_line(&app, "PATIENT").await;
    let ticket = app
        .send(
            Call::post("/v1/reservations")
                .key("patient")
                .header("prefer", "respond-async")
                .json(&json!({
                    "lines": [{"sku": "PATIENT", "quantity": 1}], "user_id": "pat",
                    "ttl_seconds": 60,
                })),
        )
        .await;
    let order_ticket = app
        .send(
            Call::post("/v1/orders")
                .key("patient-order")
                .header("prefer", "respond-async")
                .json(&json!({
                    "lines": [{"sku": "PATIENT", "quantity": 1}], "user_id": "quinn",
                    "ttl_seconds": 60,
                })),
        )
        .await;
    for waiting in [&ticket, &order_ticket] {
        assert_eq!(waiting.status, 202, "{waiting:?}");
    }

    app.clock.advance_seconds(120);
    drop(held);
    for waiting in [&ticket, &order_ticket] {
        let answered = answered_ticket(&app, waiting.json()["poll"].as_str().unwrap()).await;
        assert_eq!(answered["answer"]["status"], 201, "{answered}");
        assert_eq!(
            answered["answer"]["body"]["expires_at"],
            START.plus_seconds(180).to_rfc3339(),
            "sixty seconds from its turn: {answered}"
        );
    }
    app.assert_audit_clean().await;
}

/// How a campaign ends while requests wait in its line.
#[derive(Clone, Copy)]
enum Ending {
    /// Its end comes.
    AtItsEnd,
    /// An operator ends it before its end (`POST …/end`): the route the waiting
    /// requests arrived by still carries the old end.
    Early,
}

/// A request still waiting in a campaign's line when the campaign ends takes no unit
/// of it at its turn: it is decided as one arriving then would be, from regular stock,
/// and one that named the campaign is refused (not stored under its key).
async fn a_request_that_waited_past_the_campaigns_end_takes_no_campaign_unit(backend: Backend) {
    requests_waiting_when_the_campaign_ends_take_no_campaign_unit(backend, Ending::AtItsEnd).await;
}

/// Found in review: the requests waiting when an operator ended a campaign early were
/// decided by the route they arrived by, with its old end: they walked the campaign's
/// buckets (emptied by the end), and the one that named the campaign heard a stored
/// "sold out" instead of the refusal README promises.
async fn a_request_waiting_when_the_campaign_is_ended_early_takes_no_campaign_unit(
    backend: Backend,
) {
    requests_waiting_when_the_campaign_ends_take_no_campaign_unit(backend, Ending::Early).await;
}

async fn requests_waiting_when_the_campaign_ends_take_no_campaign_unit(
    backend: Backend,
    ending: Ending,
) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("LATE", 10).await;
    running_campaign(&app, "LATE", 3, 1, None).await;
    let id = running_id(&app, "LATE");
    let (_room, held) = hold_the_line(&app, "LATE").await;
    let unnamed = app
        .send(waiting_reserve_call("late-ann", "LATE", "ann"))
        .await;
    let named_call = || {
        Call::post("/v1/reservations")
            .key("late-bob")
            .header("prefer", "respond-async")
            .json(&json!({
                "lines": [{"sku": "LATE", "quantity": 1}], "user_id": "bob", "campaign_id": id,
            }))
    };
    let named = app.send(named_call()).await;
    for ticket in [&unnamed, &named] {
        assert_eq!(ticket.status, 202, "{ticket:?}");
    }

    match ending {
        Ending::AtItsEnd => app.clock.advance_seconds(HOUR_SECONDS),
        Ending::Early => {
            let ended = app.send(end_call(&id, "end-late")).await;
            assert_eq!(ended.status, 200, "{ended:?}");
        }
    }
    drop(held);
    let unnamed = answered_ticket(&app, unnamed.json()["poll"].as_str().unwrap()).await;
    let named = answered_ticket(&app, named.json()["poll"].as_str().unwrap()).await;

    assert_eq!(unnamed["answer"]["status"], 201, "{unnamed}");
    assert_eq!(
        unnamed["answer"]["body"]["lines"][0]["warehouse"], "default",
        "{unnamed}"
    );
    assert_eq!(named["answer"]["status"], 409, "{named}");
    assert_eq!(
        named["answer"]["body"]["code"], "failed_precondition",
        "{named}"
    );
    assert_eq!(campaign(&app, &id).await["held"], 0);
    let retried = app.send(named_call()).await;
    // Ended early, the campaign gave back what was left and closed: a request naming
    // it now names no open campaign.
    let refused_now = match ending {
        Ending::AtItsEnd => 409,
        Ending::Early => 404,
    };
    assert_eq!(retried.status, refused_now, "{retried:?}");
    assert!(
        !retried.replayed(),
        "the refusal was not stored: {retried:?}"
    );
    app.assert_audit_clean().await;
}

/// A campaign whose end fails (here its SKU's stock row is held past the lock bound)
/// rolls back alone: the step still ends the other due campaigns and reads the open
/// campaigns again, so one created on another instance is routed here, and the next
/// step ends the one that failed.
async fn a_campaign_whose_end_fails_holds_back_neither_the_other_ends_nor_new_routes(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    for sku in ["STUCK", "FREED", "NEWER"] {
        app.stocked_sku(sku, 10).await;
    }
    let stuck = running_campaign(&app, "STUCK", 2, 1, None).await;
    // A campaign's id begins with its creation time: STUCK's end is tried first.
    app.clock.advance_seconds(1);
    let freed = running_campaign(&app, "FREED", 2, 1, None).await;
    assert!(stuck < freed);
    app.clock.advance_seconds(HOUR_SECONDS);
    let elsewhere = app.another_instance().await;
    let newer = create_campaign(
        &elsewhere,
        "newer-campaign",
        json!({
            "sku": "NEWER", "quantity": 2,
            "starts_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
            "ends_at": START.plus_seconds(2 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(newer.status, 201, "{newer:?}");
    let newer_sku = domain::SkuCode::parse("NEWER").unwrap();
    assert!(
        app.engine.campaign_route(&newer_sku).is_none(),
        "not read yet"
    );
    let mut held = app.database.hold_stock_row_lock("STUCK").await;

    let failed = app.engine.campaign_step().await;

    assert!(failed.is_err(), "{failed:?}");
    assert!(
        app.engine.campaign_route(&newer_sku).is_some(),
        "the open campaigns were read again"
    );
    assert!(campaign(&app, &stuck).await["closed_at"].is_null());
    // SQLite's one writer: the held lock stops every end, not only STUCK's.
    if app.backend() != Backend::Sqlite {
        let freed_now = campaign(&app, &freed).await;
        assert!(!freed_now["closed_at"].is_null(), "{freed_now:#}");
    }
    held.execute("ROLLBACK").await.unwrap();
    app.engine.campaign_step().await.unwrap();
    for id in [&stuck, &freed] {
        let ended = campaign(&app, id).await;
        assert!(!ended["closed_at"].is_null(), "{ended:#}");
        assert_eq!(ended["returned"], 2, "{ended:#}");
    }
    app.assert_audit_clean().await;
}

/// Memory refuses a request for a sold-out campaign without the database only when the
/// key probe finds no answer under its key. When the probe cannot tell (here its read
/// waits past the lock bound behind a lock on the keys' table), the request may walk
/// every bucket: it takes a place in the campaign's line like any other, so the line's
/// bounds hold while the probe is down, and a full line answers 429 storing nothing.
async fn a_request_memory_cannot_judge_takes_a_place_in_the_line_though_the_campaign_sold_out(
    backend: Backend,
) {
    if backend != Backend::Postgres {
        // The probe's read is stalled by a table lock: SQLite's readers never wait,
        // and MySQL's table locks wait on a bound of their own (`lock_wait_timeout`).
        return;
    }
    let app = TestApp::spawn_with_lock_timeout(backend, narrow_line(1), 300).await;
    app.stocked_sku("FLOODED", 5).await;
    running_campaign(&app, "FLOODED", 1, 1, None).await;
    let sold = app.send(reserve_call("f-ann", "FLOODED", "ann")).await;
    assert_eq!(sold.status, 201, "{sold:?}");
    let refused = app.send(reserve_call("f-ben", "FLOODED", "ben")).await;
    assert_eq!(refused.code().as_deref(), Some("insufficient_stock"));
    let route = app
        .engine
        .campaign_route(&domain::SkuCode::parse("FLOODED").unwrap())
        .unwrap();
    let recheck = acceptance::test_engine_config().sold_out_recheck_milliseconds;
    assert!(route.known_sold_out(1, app.clock_now(), recheck));
    let (room, held) = hold_the_line(&app, "FLOODED").await;
    let place = room.enter(None).expect("the one place");
    let before = app.contents().await;
    let mut keys_locked = app.database.raw_connection().await;
    keys_locked.execute("BEGIN").await.unwrap();
    keys_locked
        .execute("LOCK TABLE idempotency_record IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();

    let unjudged = app.send(reserve_call("f-cat", "FLOODED", "cat")).await;

    keys_locked.execute("ROLLBACK").await.unwrap();
    assert_eq!(unjudged.status, 429, "{unjudged:?}");
    assert_eq!(unjudged.code().as_deref(), Some("rate_limited"));
    assert_eq!(app.contents().await, before, "nothing was stored");
    drop(place);
    drop(held);
    let judged = app.send(reserve_call("f-dan", "FLOODED", "dan")).await;
    assert_eq!(
        judged.code().as_deref(),
        Some("insufficient_stock"),
        "{judged:?}"
    );
}

/// A campaign the worker ended stays open while a unit of it is held, and a new one of
/// the same SKU may start meanwhile. Requests go to the new one, even when its id
/// sorts first (ids begin with the creating instance's clock, here one running behind).
async fn a_new_campaign_is_routed_though_an_ended_one_of_its_sku_is_still_open(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KETTLE", 10).await;
    let first = running_campaign(&app, "KETTLE", 2, 1, None).await;
    let held = app.send(reserve_for_a_day("kettle-held", "KETTLE")).await;
    assert_eq!(held.status, 201, "{held:?}");
    app.clock.advance_seconds(HOUR_SECONDS);
    app.engine.campaign_step().await.unwrap();
    assert!(
        campaign(&app, &first).await["closed_at"].is_null(),
        "a unit is held"
    );
    // An instance whose clock runs two hours behind creates the next campaign.
    app.clock.advance_seconds(-2 * HOUR_SECONDS);
    let next = create_campaign(
        &app,
        "kettle-again",
        json!({
            "sku": "KETTLE", "quantity": 3,
            "starts_at": app.clock_now().to_rfc3339(),
            "ends_at": app.clock_now().plus_seconds(4 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(next.status, 201, "{next:?}");
    let next = next.json()["campaign_id"].as_str().unwrap().to_owned();
    assert!(next < first, "the new id sorts first");
    app.clock.advance_seconds(2 * HOUR_SECONDS);

    app.engine.campaign_step().await.unwrap();
    let sold = app.reserve("kettle-new", &[("KETTLE", 1)]).await;

    assert_eq!(sold.status, 201, "{sold:?}");
    let next_buckets = bucket_warehouse(&next, 0).trim_end_matches('0').to_owned();
    let warehouse = sold.json()["lines"][0]["warehouse"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(warehouse.starts_with(&next_buckets), "{sold:?}");
    assert_eq!(running_id(&app, "KETTLE"), next);
    app.assert_audit_clean().await;
}

/// Memory's "sold out" is dated when the request that found it was sent, not when the
/// answer came back: a slow round trip (here the bucket's row held by another session
/// while the clock moves) does not stretch the re-check bound.
async fn a_sold_out_finding_is_dated_when_its_request_was_sent_not_answered(backend: Backend) {
    if backend == Backend::Sqlite {
        // Its writers queue inside the process: no session outside holds a row.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SLOW", 5).await;
    let id = running_campaign(&app, "SLOW", 1, 1, None).await;
    assert_eq!(app.reserve("slow-1", &[("SLOW", 1)]).await.status, 201);
    let mut lock = app.database.raw_connection().await;
    lock.execute("BEGIN").await.unwrap();
    lock.execute(&format!(
        "SELECT available FROM stock WHERE sku = 'SLOW' AND warehouse = '{}' FOR UPDATE",
        bucket_warehouse(&id, 0)
    ))
    .await
    .unwrap();
    let request = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("slow-2", &[("SLOW", 1)]).await })
    };
    app.database.wait_until_blocked_by(&mut lock).await;
    let recheck = acceptance::test_engine_config().sold_out_recheck_milliseconds;
    app.clock.advance_milliseconds(recheck - 100);
    lock.execute("ROLLBACK").await.unwrap();
    let refused = request.await.unwrap();
    assert_eq!(
        refused.code().as_deref(),
        Some("insufficient_stock"),
        "{refused:?}"
    );

    app.clock.advance_milliseconds(200);

    let route = app
        .engine
        .campaign_route(&domain::SkuCode::parse("SLOW").unwrap())
        .unwrap();
    assert!(
        !route.known_sold_out(1, app.clock_now(), recheck),
        "the finding is older than the bound, counted from when its request was sent"
    );
}

/// A campaign of a SKU that does not exist is refused (404) and the refusal is
/// stored under the key: once the SKU is created and stocked, the retry hears the
/// same 404 rather than carving a campaign nobody was told of. A caller that may
/// create no campaign hears 403 whether the SKU exists or not.
async fn a_campaign_refused_for_a_sku_that_does_not_exist_is_refused_again_after_it_was_created(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let body = json!({
        "sku": "LATER",
        "quantity": 2,
        "starts_at": START.to_rfc3339(),
        "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
    });
    let service = app
        .send(
            Call::post("/v1/admin/campaigns")
                .key("service-campaign")
                .json(&body),
        )
        .await;
    let refused = create_campaign(&app, "campaign-later", body.clone()).await;
    app.stocked_sku("LATER", 5).await;

    let retried = create_campaign(&app, "campaign-later", body).await;

    assert_eq!(service.status, 403, "{service:?}");
    assert_eq!(refused.status, 404, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("not_found"));
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, refused.body);
    assert_eq!(app.counters("LATER").await, (5, 0), "no unit carved out");
}

/// Found in review: as a bucket's finding, a shopper found at the campaign's limit is
/// dated when the request went to the database, not when it was answered: a hold of
/// theirs released while the request waited is not outlived by more than the bound.
async fn a_shopper_found_at_the_limit_is_dated_when_the_request_was_sent_not_answered(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // Its writers queue inside the process: no session outside holds a row.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SLOWLIM", 5).await;
    let id = running_campaign(&app, "SLOWLIM", 4, 1, Some(1)).await;
    let first = app.send(reserve_call("alice-1", "SLOWLIM", "alice")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let recheck = acceptance::test_engine_config().sold_out_recheck_milliseconds;
    // What the first hold taught memory is past its bound: the next request goes to
    // the database.
    app.clock.advance_milliseconds(recheck + 1);
    let mut lock = app.database.raw_connection().await;
    lock.execute("BEGIN").await.unwrap();
    lock.execute(&format!(
        "SELECT available FROM stock WHERE sku = 'SLOWLIM' AND warehouse = '{}' FOR UPDATE",
        bucket_warehouse(&id, 0)
    ))
    .await
    .unwrap();
    let request = {
        let app = app.clone();
        tokio::spawn(async move { app.send(reserve_call("alice-2", "SLOWLIM", "alice")).await })
    };
    app.database.wait_until_blocked_by(&mut lock).await;
    app.clock.advance_milliseconds(recheck - 100);
    lock.execute("ROLLBACK").await.unwrap();
    let refused = request.await.unwrap();
    assert_eq!(
        refused.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "{refused:?}"
    );

    app.clock.advance_milliseconds(200);

    let route = app
        .engine
        .campaign_route(&domain::SkuCode::parse("SLOWLIM").unwrap())
        .unwrap();
    let alice = domain::UserId::parse("alice").unwrap();
    assert!(
        !route.known_at_limit(&alice, 1, app.clock_now(), recheck),
        "the finding is older than the bound, counted from when its request was sent"
    );
}

/// Found in review: memory kept a campaign's answers by count only, while the database
/// purges a key's record once the retention has passed. A key sent again after that,
/// while the campaign was known sold out, was answered the day-old 201 from memory,
/// though for the database it was a new request. Memory now forgets an answer with
/// its record: the resent key hears what a new request hears, sold out.
async fn a_key_whose_record_was_purged_is_not_replayed_from_memory(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("KETTLE", 5).await;
    let created = create_campaign(
        &app,
        "campaign-kettle",
        json!({
            "sku": "KETTLE",
            "quantity": 1,
            "starts_at": START.to_rfc3339(),
            "ends_at": START.plus_seconds(3 * 24 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(created.status, 201, "{created:?}");
    let first = app.send(reserve_call("kettle-1", "KETTLE", "alice")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let retention = acceptance::test_engine_config().idempotency_retention_seconds;
    app.clock.advance_seconds(retention + 60);
    app.engine.purge_step().await.expect("purge step");
    // Sold out, freshly known: memory answers the campaign's requests now.
    let refused = app.send(reserve_call("kettle-2", "KETTLE", "bob")).await;
    assert_eq!(
        refused.code().as_deref(),
        Some("insufficient_stock"),
        "{refused:?}"
    );

    let resent = app.send(reserve_call("kettle-1", "KETTLE", "alice")).await;

    assert_eq!(resent.status, 409, "{resent:?}");
    assert_eq!(resent.code().as_deref(), Some("insufficient_stock"));
}

/// Found in review: a ticket's request waited for its turn in a task nobody waited
/// for, so a shutdown with no connection left closed the store under it: a caller
/// answered 202 found no ticket when it polled again, and its request never ran. A
/// shutdown now waits (within its grace) for those requests to run in their turn.
async fn a_shutdown_lets_the_requests_of_tickets_handed_out_run_in_their_turn(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("CLOSING", 10).await;
    running_campaign(&app, "CLOSING", 4, 1, None).await;
    let (_, held) = hold_the_line(&app, "CLOSING").await;
    let ticket = app
        .send(waiting_reserve_call("closing-ann", "CLOSING", "ann"))
        .await;
    assert_eq!(ticket.status, 202, "{ticket:?}");
    let finishing = tokio::spawn({
        let engine = app.engine.clone();
        async move {
            engine
                .finish_tickets(std::time::Duration::from_secs(60))
                .await
        }
    });

    drop(held);
    let all_ran = finishing.await.unwrap();

    assert!(all_ran, "the ticket's request ran within the grace");
    let answered = app
        .send(Call::get(ticket.json()["poll"].as_str().unwrap()))
        .await;
    assert_eq!(answered.status, 200, "{answered:?}");
    assert_eq!(answered.json()["status"], "ANSWERED");
    let route = running_id(&app, "CLOSING");
    assert_eq!(campaign(&app, &route).await["held"], 1);
}

/// Found in review: the 202 that hands out a ticket carried the writer's position
/// before its request had run, and the answered ticket carried none: a read sent with
/// that token could be served by a replica without the hold. The 202 carries none now,
/// and the answered ticket the position of its request's write.
async fn a_tickets_answer_carries_the_position_of_its_write_and_the_202_none(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    let (ticket, poll) = a_ticket_answered(&app, "TOKENED").await;

    let answered = app.send(Call::get(&poll)).await;

    assert_eq!(
        ticket.header("stockd-consistency-token"),
        None,
        "the 202 carries no position: {ticket:?}"
    );
    assert_eq!(answered.status, 200, "{answered:?}");
    let token = answered
        .header("stockd-consistency-token")
        .expect("the answered ticket carries its write's position");
    let reservation = answered.json()["answer"]["body"]["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let read = app
        .send(
            Call::get(format!("/v1/reservations/{reservation}"))
                .header("stockd-consistency-token", token),
        )
        .await;
    assert_eq!(read.status, 200, "{read:?}");
}

/// Found in review: answered tickets were dropped only when another ticket was
/// answered, so the last ones of a campaign were served for ever. Past the retention
/// the ticket is gone (404), like any other.
async fn an_answered_ticket_is_gone_once_its_retention_has_passed(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    let (_, poll) = a_ticket_answered(&app, "KEPT").await;
    let retention = acceptance::test_engine_config().campaign_ticket_retention_seconds;

    app.clock.advance_seconds(retention);
    let within = app.send(Call::get(&poll)).await;
    app.clock.advance_seconds(1);
    let past = app.send(Call::get(&poll)).await;

    assert_eq!(
        within.status, 200,
        "kept for the whole retention: {within:?}"
    );
    assert_eq!(past.status, 404, "{past:?}");
    assert_eq!(past.json()["code"], "not_found");
}

/// Found in review: the shopper's product view summed every stock row of a SKU, a
/// campaign's buckets included. Before the campaign started it showed the units
/// carved out for it as on sale while every reservation was refused; it now shows what
/// a reservation could take: the regular stock before and after, the campaign's
/// buckets while it runs.
async fn the_product_view_shows_what_a_reservation_could_take_around_a_campaign(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(acceptance::ProductSpec::complete("default", &["VIEWED"]))
        .await;
    app.receive("VIEWED", 10).await;
    let on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    assert_eq!(on.status, 200, "{on:?}");
    campaign_of_ten_starting_in_an_hour(&app, "VIEWED").await;
    let shown = |app: &TestApp| {
        let app = app.clone();
        let product = product.clone();
        async move {
            let view = app
                .send(Call::get(format!("/v1/products/{product}")).anonymous())
                .await;
            assert_eq!(view.status, 200, "{view:?}");
            let sku = view.json()["skus"][0].clone();
            (
                sku["availability"].as_str().unwrap().to_owned(),
                sku["available"].as_i64().unwrap(),
            )
        }
    };

    let before = shown(&app).await;
    let refused = app.reserve("before-the-start", &[("VIEWED", 1)]).await;
    app.clock.advance_seconds(HOUR_SECONDS);
    let during = shown(&app).await;

    assert_eq!(
        before,
        ("temporarily_out_of_stock".to_owned(), 0),
        "every unit waits in the campaign"
    );
    assert_eq!(
        refused.code().as_deref(),
        Some("insufficient_stock"),
        "{refused:?}"
    );
    assert_eq!(during, ("on_sale".to_owned(), 10), "the campaign's units");
}

/// A campaign of 10 units of `sku` in 2 buckets, from an hour after START for an hour.
async fn campaign_of_ten_starting_in_an_hour(app: &TestApp, sku: &str) {
    let created = create_campaign(
        app,
        &format!("campaign-{sku}"),
        json!({
            "sku": sku,
            "quantity": 10,
            "buckets": 2,
            "starts_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
            "ends_at": START.plus_seconds(2 * HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(created.status, 201, "{created:?}");
}

/// Found in review: a shelf operation's `availability` summed every stock row of the
/// SKU, a campaign's buckets included, so putting a SKU whose every unit waits in a
/// campaign not yet started back on sale said `on_sale` while the product view (and
/// every reservation) said there was nothing. It now says what the view says.
async fn a_shelf_operation_reports_the_availability_the_product_view_shows_around_a_campaign(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(acceptance::ProductSpec::complete("default", &["SHELVED"]))
        .await;
    app.receive("SHELVED", 10).await;
    campaign_of_ten_starting_in_an_hour(&app, "SHELVED").await;
    let off_and_on = |app: &TestApp| {
        let app = app.clone();
        let product = product.clone();
        async move {
            let off = app
                .shelf(None, json!({"operation": "off", "product_ids": [product]}))
                .await;
            assert_eq!(off.status, 200, "{off:?}");
            let on = app
                .shelf(None, json!({"operation": "on", "product_ids": [product]}))
                .await;
            assert_eq!(on.status, 200, "{on:?}");
            let reported = on.json()["results"][0]["availability"].clone();
            let view = app
                .send(Call::get(format!("/v1/products/{product}")).anonymous())
                .await;
            assert_eq!(view.status, 200, "{view:?}");
            (reported, view.json()["skus"][0]["availability"].clone())
        }
    };

    let before = off_and_on(&app).await;
    app.clock.advance_seconds(HOUR_SECONDS);
    let during = off_and_on(&app).await;

    assert_eq!(
        before,
        (
            json!("temporarily_out_of_stock"),
            json!("temporarily_out_of_stock")
        ),
        "every unit waits in the campaign"
    );
    assert_eq!(
        during,
        (json!("on_sale"), json!("on_sale")),
        "the campaign's units"
    );
}

/// Found in review: a campaign past its end, kept open by a unit an unpaid order holds
/// (for up to a day), locked its buckets and its SKU's row at every end step (every
/// second, on every instance), though nothing could move: the SKU's row is where its
/// sales go once the campaign ended. Such a campaign is now passed over on an unlocked
/// read: with the SKU's row held by another transaction, the step does not wait for it.
async fn an_ended_campaign_kept_open_by_a_held_unit_does_not_lock_its_skus_row_again(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("COAT", 20).await;
    let id = running_campaign(&app, "COAT", 10, 3, None).await;
    let held = app.reserve("held", &[("COAT", 1)]).await;
    let held_id = held.json()["reservation_id"].as_str().unwrap().to_owned();
    app.clock.advance_seconds(HOUR_SECONDS);
    assert!(app.engine.campaign_step().await.unwrap().is_empty());
    assert_eq!(campaign(&app, &id).await["held"], 1);
    let mut lock = app.database.hold_stock_row_lock("COAT").await;

    let step = app.engine.campaign_step().await;

    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(
        step.unwrap(),
        Vec::new(),
        "nothing to move, nothing waited for"
    );
    // The held unit comes back: the next step moves it and closes the campaign.
    assert_eq!(app.release(&held_id, "release-held").await.status, 200);
    assert_eq!(app.engine.campaign_step().await.unwrap().len(), 1);
    let done = campaign(&app, &id).await;
    assert_eq!(
        (done["returned"].as_i64(), done["held"].as_i64()),
        (Some(10), Some(0))
    );
    app.assert_audit_clean().await;
}

/// Found in review: a request sent again under its key while it waited in a
/// campaign's line (its 202 lost, or a client resending) took another place and
/// another ticket each time: one client resending one request could fill the line
/// and crowd out every other shopper. It now hears its ticket again (or, without
/// `Prefer: respond-async`, 409 `request_in_progress`) and takes no place; another
/// request under the same key hears 422 `idempotency_key_reused`, as anywhere.
async fn a_request_sent_again_while_it_waits_in_the_line_takes_no_second_place(backend: Backend) {
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("RESENT", 10).await;
    running_campaign(&app, "RESENT", 4, 1, None).await;
    let (room, held) = hold_the_line(&app, "RESENT").await;
    let first = app
        .send(waiting_reserve_call("resent-ann", "RESENT", "ann"))
        .await;
    assert_eq!(first.status, 202, "{first:?}");
    let poll = first.json()["poll"].as_str().unwrap().to_owned();

    let mut again = Vec::new();
    for _ in 0..4 {
        again.push(
            app.send(waiting_reserve_call("resent-ann", "RESENT", "ann"))
                .await,
        );
    }
    let in_place = app.send(reserve_call("resent-ann", "RESENT", "ann")).await;
    // Another request under the same key is not a resend of the waiting one.
    let another = app
        .send(
            Call::post("/v1/reservations")
                .key("resent-ann")
                .header("prefer", "respond-async")
                .json(&json!({"lines": [{"sku": "RESENT", "quantity": 2}], "user_id": "ann"})),
        )
        .await;

    assert_eq!(room.waiting(), 1, "one place for the one request");
    assert_eq!(another.status, 422, "{another:?}");
    assert_eq!(another.code().as_deref(), Some("idempotency_key_reused"));
    for response in &again {
        assert_eq!(response.status, 202, "{response:?}");
        assert_eq!(response.json()["poll"], poll.as_str(), "the same ticket");
    }
    assert_eq!(in_place.status, 409, "{in_place:?}");
    assert_eq!(in_place.code().as_deref(), Some("request_in_progress"));
    drop(held);
    let answered = answered_ticket(&app, &poll).await;
    assert_eq!(answered["answer"]["status"], 201, "{answered}");
    assert_eq!(app.counters("RESENT").await.1, 1, "reserved once");
    app.assert_audit_clean().await;
}

/// Found in review: whether a campaign runs was judged by each instance's own clock, so
/// an instance whose clock ran ahead sold a flash sale's units before its start. It is
/// judged by the clock held back by how far it was last seen ahead of the database
/// server's.
async fn an_instance_whose_clock_runs_ahead_starts_no_campaign_early(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    if backend == Backend::Sqlite {
        // One process holds the database: its clock is the only one.
        return;
    }
    app.clock_at_the_databases();
    app.stocked_sku("TV", 10).await;
    let starts_at = app.clock_now().plus_seconds(120);
    let created = create_campaign(
        &app,
        "tv-campaign",
        json!({
            "sku": "TV", "quantity": 4,
            "starts_at": starts_at.to_rfc3339(),
            "ends_at": starts_at.plus_seconds(HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.json()["campaign_id"].as_str().unwrap().to_owned();
    // This instance's clock jumps three minutes ahead of the database server's: by it,
    // the campaign runs.
    app.clock_runs_ahead_of_the_database(180).await;

    let named = app
        .send(Call::post("/v1/reservations").key("early").json(&json!({
            "lines": [{"sku": "TV", "quantity": 1}], "campaign_id": id,
        })))
        .await;
    let regular = app.reserve("regular", &[("TV", 1)]).await;

    assert_eq!(named.status, 409, "{named:?}");
    assert_eq!(named.code().as_deref(), Some("campaign_not_started"));
    assert_eq!(regular.status, 201, "{regular:?}");
    assert_eq!(regular.json()["lines"][0]["warehouse"], "default");
    app.assert_audit_clean().await;
}

/// Found in review of the fix above: the cart (and so the checkout) and a shelf
/// operation's `availability` still judged whether a campaign runs by the instance's
/// own clock, so on an instance running ahead they saw a sale the reservations did not.
/// They judge it as the reservations do.
async fn on_an_instance_whose_clock_runs_ahead_carts_and_shelf_results_see_the_sale_as_reservations_do(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    if backend == Backend::Sqlite {
        // One process holds the database: its clock is the only one.
        return;
    }
    app.clock_at_the_databases();
    let product = app
        .create_product(acceptance::ProductSpec::complete("default", &["AHEAD"]))
        .await;
    app.receive("AHEAD", 10).await;
    let first_on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    assert_eq!(first_on.status, 200, "{first_on:?}");
    let starts_at = app.clock_now().plus_seconds(120);
    let created = create_campaign(
        &app,
        "campaign-ahead",
        json!({
            "sku": "AHEAD", "quantity": 10,
            "starts_at": starts_at.to_rfc3339(),
            "ends_at": starts_at.plus_seconds(HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(created.status, 201, "{created:?}");
    app.clock_runs_ahead_of_the_database(180).await;

    let put = app
        .send(
            Call::put("/v1/carts/early-bird/items/AHEAD")
                .key("cart-early-bird")
                .json(&json!({"quantity": 1})),
        )
        .await;
    let cart = app.send(Call::get("/v1/carts/early-bird")).await;
    let on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    let reserved = app.reserve("early-bird", &[("AHEAD", 1)]).await;

    assert_eq!(put.status, 200, "{put:?}");
    assert_eq!(
        cart.json()["lines"][0]["problem"],
        "out_of_stock",
        "every unit waits in the campaign: {cart:?}"
    );
    assert_eq!(
        on.json()["results"][0]["availability"],
        "temporarily_out_of_stock",
        "{on:?}"
    );
    assert_eq!(reserved.status, 409, "{reserved:?}");
    assert_eq!(reserved.code().as_deref(), Some("insufficient_stock"));
}

/// Found in review: a shop could open a campaign on every SKU it has, for up to a year
/// each. Each has a waiting room of its own (10,000 places by default) in every
/// process, and every process reads them all again each second. A shop now has at
/// most `campaigns_open_per_shop_max` open at once; one more is refused, nothing
/// carved; another shop's room is its own, and a closed campaign frees its place.
async fn a_shop_at_its_open_campaign_limit_is_refused_and_nothing_is_carved(backend: Backend) {
    let config = engine::EngineConfig {
        campaigns_open_per_shop_max: 2,
        ..acceptance::test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    for sku in ["OPEN-1", "OPEN-2", "OPEN-3"] {
        app.stocked_sku(sku, 10).await;
    }
    let first = running_campaign(&app, "OPEN-1", 2, 1, None).await;
    running_campaign(&app, "OPEN-2", 2, 1, None).await;
    let before = app.contents_except_idempotency_records().await;

    let body = json!({
        "sku": "OPEN-3", "quantity": 2,
        "starts_at": START.to_rfc3339(),
        "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
    });
    let third = create_campaign(&app, "third-campaign", body.clone()).await;

    assert_eq!(third.status, 409, "{third:?}");
    assert_eq!(third.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);

    // Another shop's campaigns are counted apart.
    app.create_product(acceptance::ProductSpec::complete("south", &["SOUTH-1"]))
        .await;
    app.receive("SOUTH-1", 10).await;
    let south = create_campaign(
        &app,
        "south-campaign",
        json!({
            "sku": "SOUTH-1", "quantity": 2,
            "starts_at": START.to_rfc3339(),
            "ends_at": START.plus_seconds(HOUR_SECONDS).to_rfc3339(),
        }),
    )
    .await;
    assert_eq!(south.status, 201, "{south:?}");

    // Ended with nothing held, the first closes and frees its place.
    let ended = app.send(end_call(&first, "end-first")).await;
    assert_eq!(ended.status, 200, "{ended:?}");
    assert!(!campaign(&app, &first).await["closed_at"].is_null());
    let now_fits = create_campaign(&app, "third-campaign-again", body).await;
    assert_eq!(now_fits.status, 201, "{now_fits:?}");
    app.assert_audit_clean().await;
}

/// Found in review: a checkout's success taught this instance that its shopper held
/// the campaign's whole limit, though the checkout may have left the campaign line out
/// (its bucket found empty in the order's transaction, the other lines ordered). For
/// the re-check bound the shopper's next request for the SKU was refused from memory
/// as `purchase_limit_exceeded`, with nothing held. Only a success that holds every
/// line teaches that now.
async fn a_checkout_that_left_its_campaign_line_out_does_not_mark_the_shopper_at_the_limit(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // Two instances on one database: SQLite's file is one process's.
        return;
    }
    let app = TestApp::spawn_with(backend, narrow_line(10)).await;
    app.stocked_sku("LAMP", 1).await;
    app.stocked_sku("SOCK", 5).await;
    running_campaign(&app, "LAMP", 1, 1, Some(1)).await;
    for sku in ["LAMP", "SOCK"] {
        let put = app
            .send(
                Call::put(format!("/v1/carts/ann/items/{sku}"))
                    .key(format!("ann-{sku}"))
                    .json(&json!({"quantity": 1})),
            )
            .await;
        assert_eq!(put.status, 200, "{put:?}");
    }
    let (room, held) = hold_the_line(&app, "LAMP").await;
    let checkout = {
        let app = app.clone();
        tokio::spawn(async move {
            app.send(Call::post("/v1/carts/ann/checkout").key("ann-checkout"))
                .await
        })
    };
    acceptance::wait_until("the checkout waits in the campaign's line", || {
        room.waiting() == 1
    })
    .await;
    // Another instance sells the campaign's one unit meanwhile.
    let elsewhere = app.another_instance().await;
    elsewhere.engine.campaign_step().await.unwrap();
    let bobs = elsewhere
        .send(reserve_call("bob-lamp", "LAMP", "bob"))
        .await;
    assert_eq!(bobs.status, 201, "{bobs:?}");
    drop(held);
    let checkout = checkout.await.unwrap();
    assert_eq!(checkout.status, 201, "{checkout:?}");
    let body = checkout.json();
    let ordered: Vec<&str> = body["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|line| line["sku"].as_str().unwrap())
        .collect();
    assert_eq!(ordered, ["SOCK"], "{checkout:?}");
    // Bob's unit comes back to the campaign here.
    let bobs_id = bobs.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.release(&bobs_id, "bob-release").await.status, 200);

    let anns = app.send(reserve_call("ann-lamp", "LAMP", "ann")).await;

    assert_eq!(anns.status, 201, "ann holds no lamp: {anns:?}");
    app.assert_audit_clean().await;
}

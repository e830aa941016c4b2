//! Orders and payments end to end, against the project's gateway sandbox over real
//! HTTP: one test per fault the sandbox can inject, each checking the order, its
//! reservation, the stock counters, the number of charges at the gateway (never two
//! for one order) and the audit; then crashes, concurrency, expiry, cancel and returns.

use acceptance::payments::{TestGateway, WEBHOOK_SECRET};
use acceptance::{
    Backend, Call, TestApp, mirrored_tests, mirrored_tests_alone, send_concurrently,
    test_engine_config,
};
use serde_json::{Value, json};

// These read counters of the process-wide metrics recorder.
mirrored_tests_alone!(
    metrics_count_payment_outcomes_and_show_the_unknown_backlog,
    a_refund_the_gateway_refuses_is_marked_failed_and_not_tried_again,
);

mirrored_tests!(
    the_first_reconciliation_look_waits_for_the_requests_own_call_to_give_up,
    with_a_ten_second_gateway_timeout_one_reconciliation_step_settles_its_whole_batch,
    a_second_card_while_another_requests_payment_runs_is_not_answered_with_that_payment,
    unpaid_orders_falling_due_together_expire_in_one_go_not_a_batch_per_interval,
    a_payment_unknown_past_the_gateways_key_lifetime_is_found_by_its_metadata,
    a_payment_unknown_tells_the_client_none_of_the_gateways_words_nor_its_address,
    a_webhook_delivered_again_is_answered_without_asking_the_gateway,
    an_attempt_claimed_just_before_its_hold_ends_stays_leased_for_the_whole_lease,
    an_attempt_that_never_reached_the_gateway_fails_once_its_key_expired,
    a_success_webhook_past_the_key_lifetime_is_checked_by_the_gateways_search,
    a_payment_whose_id_an_answer_named_is_read_by_its_id_after_its_key_expired,
    a_stale_failure_webhook_of_a_payment_charged_meanwhile_pays_the_order,
    a_failure_webhook_fails_an_attempt_only_once_the_gateway_confirms_it,
    the_audit_finds_an_order_line_or_amount_that_differs_from_its_hold,
    an_order_whose_stock_row_is_broken_does_not_stop_the_others_expiring,
    a_whole_batch_of_broken_orders_does_not_stop_the_orders_behind_it_expiring,
    a_stock_row_held_open_does_not_stop_the_other_orders_expiring,
    a_refund_the_gateway_refused_is_sent_again_when_staff_decide_so,
    a_refund_settled_outside_stockd_is_recorded_and_its_order_is_refunded,
    only_a_refused_refund_is_resolved_and_bad_requests_change_nothing,
    a_late_success_leaves_the_rows_a_paid_order_leaves,
    an_order_reserves_its_stock_and_is_priced_from_its_skus,
    an_order_for_more_than_the_stock_is_refused_and_changes_nothing,
    a_successful_payment_marks_the_order_paid_and_confirms_its_stock,
    a_declined_card_fails_the_attempt_and_the_stock_goes_back_when_the_hold_ends,
    after_a_decline_another_card_pays_the_same_order_while_its_hold_lasts,
    an_order_takes_a_bounded_number_of_payment_attempts,
    the_database_refuses_a_second_successful_attempt_for_an_order,
    an_abandoned_payment_is_cancelled_at_the_gateway_before_its_stock_goes_back,
    an_abandoned_payment_keeps_its_stock_while_the_gateway_cannot_cancel_it,
    a_second_charge_for_a_paid_order_is_refunded_and_the_order_stays_paid,
    a_second_charge_heard_again_is_answered_and_refunded_once,
    an_abandoned_payment_that_can_be_neither_cancelled_nor_read_keeps_its_stock,
    an_abandoned_3ds_payment_gives_its_stock_back_at_the_first_look_after_the_hold,
    an_unknown_outcome_is_asked_about_less_and_less_often,
    a_retry_of_a_pay_whose_attempt_was_declined_meanwhile_learns_the_decline,
    a_slow_gateway_answer_is_waited_for_and_applied,
    a_charge_whose_answer_times_out_is_unknown_until_the_webhook_says_paid,
    a_lost_answer_is_unknown_until_the_webhook_says_paid,
    a_payment_whose_webhook_never_comes_is_settled_by_the_answer,
    a_webhook_delivered_three_times_has_one_effect,
    a_stale_failure_after_a_success_changes_nothing,
    a_success_after_the_hold_ended_takes_the_stock_again_when_it_is_there,
    a_success_after_the_hold_ended_is_refunded_when_the_stock_is_gone,
    an_unknown_outcome_is_never_released_by_expiry_and_reconciliation_finds_the_charge,
    a_process_killed_while_waiting_for_the_gateway_is_recovered_by_reconciliation,
    a_payment_that_never_reached_the_gateway_is_completed_by_reconciliation_with_its_key,
    fifty_concurrent_pay_calls_on_one_order_charge_once,
    a_retried_pay_request_replays_its_first_answer,
    the_same_event_and_the_same_payment_under_another_event_id_apply_once,
    webhooks_with_a_bad_or_stale_signature_are_refused_and_change_nothing,
    an_unpaid_order_past_its_hold_expires_and_cannot_be_paid,
    cancelling_an_unpaid_order_gives_its_stock_back_once,
    cancelling_a_paid_order_refunds_it_once,
    a_refunded_orders_units_no_longer_count_against_the_shoppers_limit,
    a_paid_order_whose_refund_cannot_be_written_is_not_cancelled,
    a_refund_not_confirmed_is_tried_again_less_and_less_often,
    an_order_with_a_payment_in_flight_cannot_be_cancelled,
    a_return_puts_the_goods_back_once_and_keeps_the_sale_status,
    reconciliation_on_two_instances_settles_each_attempt_once,
    reconciliation_asks_about_no_attempt_once_its_lease_could_end_meanwhile,
    the_refund_worker_issues_no_refund_once_its_lease_could_end_meanwhile,
    malformed_order_and_payment_requests_are_refused_and_change_nothing,
    the_audit_catches_an_order_that_disagrees_with_its_reservation,
    the_audit_catches_money_owed_and_kept_or_given_back_without_cause,
    a_webhook_about_an_intent_stockd_did_not_create_changes_nothing,
    sandbox_payment_methods_are_refused_when_the_gateway_is_real,
    one_key_paying_two_orders_on_two_instances_at_once_charges_one_card,
    a_payment_the_previous_processs_own_sandbox_held_fails_after_a_restart,
    a_return_is_refused_for_an_order_whose_stock_was_given_back,
    the_audit_catches_a_return_of_goods_that_were_never_sold,
    the_audit_catches_a_return_row_that_takes_units_away,
    a_success_after_the_hold_ended_is_refunded_when_the_sku_went_off_the_shelf,
    a_success_after_the_hold_ended_is_refunded_when_the_sku_was_deleted,
    an_order_whose_total_is_zero_is_refused_and_changes_nothing,
    a_payment_method_the_gateway_does_not_know_fails_the_attempt_at_once,
    an_order_whose_total_does_not_fit_in_64_bits_is_refused_and_changes_nothing,
    a_pay_answer_is_kept_with_its_effect_or_not_at_all,
    a_late_success_waiting_behind_a_shelf_change_sees_the_sku_go_off_the_shelf,
    a_refund_the_gateway_answers_failed_or_pending_is_not_refunded_until_it_succeeds,
    a_pay_key_whose_answer_is_not_stored_yet_is_refused_for_another_payment,
    a_pending_refund_the_gateway_cannot_find_is_left_to_a_person_saying_so,
    a_refund_settled_elsewhere_meanwhile_does_not_hold_up_the_rest_of_its_batch,
    a_reconciled_answer_that_cannot_be_applied_does_not_hold_up_the_rest_of_its_batch,
    a_gateways_long_failure_message_is_recorded_cut_to_the_reason_bound,
    an_order_whose_sku_went_off_the_shelf_is_not_charged_and_keeps_its_hold,
    a_retried_pay_learns_its_own_attempts_end_not_another_requests_payment,
    a_retried_pay_whose_card_failed_does_not_hear_paid_from_another_card,
    the_sandbox_refuses_what_stripe_refuses_and_asks_every_caller_for_its_key,
);

const SKU: &str = "TEA-250G";
/// Stock of [`SKU`] at the start of every test; its price is 100 (minor units).
const STOCK: i64 = 10;
const HOLD_SECONDS: i64 = 900;

/// An instance with a sandbox gateway and [`STOCK`] units of [`SKU`].
async fn shop(backend: Backend) -> (TestApp, TestGateway) {
    let app = TestApp::spawn(backend).await;
    let gateway = TestGateway::start(&app).await;
    app.stocked_sku(SKU, STOCK).await;
    (app, gateway)
}

fn key(purpose: &str) -> String {
    format!("{purpose}-{:016x}", rand::random::<u64>())
}

/// Asserts the order's, its reservation's and its payment's statuses.
async fn assert_statuses(app: &TestApp, order: &str, expected: (&str, &str, &str)) {
    let (order_status, reservation_status, payment_status) = app.order_statuses(order).await;
    assert_eq!(
        (
            order_status.as_str(),
            reservation_status.as_str(),
            payment_status.as_str()
        ),
        expected,
        "order {order}: {:#}",
        app.order(order).await
    );
}

/// The statuses an order went through, oldest first.
async fn history(app: &TestApp, order: &str) -> Vec<String> {
    app.order(order).await["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|entry| entry["to"].as_str().expect("to").to_owned())
        .collect()
}

/// The end state of a paid order of `quantity` units: charged once, stock sold.
async fn assert_paid_once(app: &TestApp, gateway: &TestGateway, order: &str, quantity: i64) {
    assert_statuses(app, order, ("PAID", "CONFIRMED", "SUCCEEDED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK - quantity, 0));
    assert_eq!(gateway.charges_for(order), 1, "charges at the gateway");
    assert_eq!(
        history(app, order)
            .await
            .iter()
            .filter(|status| *status == "PAID")
            .count(),
        1,
        "the order became PAID once"
    );
    app.assert_audit_clean().await;
}

/// Waits until the webhook endpoint acknowledged `count` deliveries.
async fn wait_for_deliveries(gateway: &TestGateway, count: u64) {
    let what = format!("the sandbox delivered {count} webhooks");
    acceptance::wait_until(&what, || {
        gateway.sandbox.stats().deliveries_acknowledged >= count
    })
    .await;
}

/// The payment intent the sandbox holds for `order` (there is at most one).
fn intent_of(gateway: &TestGateway, order: &str) -> gateway::PaymentIntent {
    let intents = gateway.intents_for(order);
    assert_eq!(intents.len(), 1, "intents for {order}: {intents:?}");
    intents.into_iter().next().expect("one intent")
}

async fn an_order_reserves_its_stock_and_is_priced_from_its_skus(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    app.stocked_sku("MUG", 5).await;
    let response = app
        .create_order(&key("order"), "user-1", &[(SKU, 3), ("MUG", 2)])
        .await;
    assert_eq!(response.status, 201, "{response:?}");
    let created = response.json();
    assert_eq!(created["status"], "PENDING_PAYMENT");
    assert_eq!(created["amount"], 500, "3 × 100 + 2 × 100");
    assert_eq!(created["currency"], "CNY");
    assert_eq!(created["user_id"], "user-1");
    assert_eq!(created["reservation"]["status"], "RESERVED");
    assert_eq!(created["payment"], Value::Null);
    let order = created["order_id"].as_str().expect("id").to_owned();
    assert!(order.starts_with("ord_"), "{order}");
    let mut shown = app.order(&order).await;
    let as_of = shown
        .as_object_mut()
        .and_then(|fields| fields.remove("as_of"));
    assert!(
        as_of.is_some_and(|as_of| as_of.is_string()),
        "a display answer says how fresh it is"
    );
    assert_eq!(shown, created, "GET shows what POST answered");
    assert_eq!(app.counters(SKU).await, (STOCK - 3, 3));
    assert_eq!(app.counters("MUG").await, (3, 2));
    assert_eq!(history(&app, &order).await, ["PENDING_PAYMENT"]);
    app.assert_audit_clean().await;
}

async fn an_order_for_more_than_the_stock_is_refused_and_changes_nothing(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    app.stocked_sku("MUG", 5).await;
    let before = app.contents_except_idempotency_records().await;
    let response = app
        .create_order(&key("order"), "user-1", &[("MUG", 1), (SKU, STOCK + 1)])
        .await;
    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("insufficient_stock"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn a_successful_payment_marks_the_order_paid_and_confirms_its_stock(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let response = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["status"], "PAID");
    wait_for_deliveries(&gateway, 1).await;
    assert_eq!(app.webhook_events().await, 1);
    assert_paid_once(&app, &gateway, &order, 2).await;
    assert_eq!(
        history(&app, &order).await,
        ["PENDING_PAYMENT", "PAYMENT_PROCESSING", "PAID"]
    );
}

/// A decline fails the attempt, not the sale: the order keeps its hold for another
/// card (issue 13, defect 8), and gives the stock back when the hold ends unpaid.
async fn a_declined_card_fails_the_attempt_and_the_stock_goes_back_when_the_hold_ends(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let response = app.pay(&order, &key("pay"), "pm_card_chargeDeclined").await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["status"], "PAYMENT_FAILED");
    wait_for_deliveries(&gateway, 1).await;
    assert_statuses(&app, &order, ("PAYMENT_FAILED", "RESERVED", "FAILED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK - 2, 2), "the hold is kept");
    assert_eq!(gateway.charges_for(&order), 0);
    app.assert_audit_clean().await;
    app.clock.advance_seconds(HOLD_SECONDS);
    assert_eq!(
        app.engine.order_expiry_step().await.expect("order expiry"),
        [domain::OrderId::parse(&order).expect("order id")]
    );
    assert_statuses(&app, &order, ("EXPIRED", "RELEASED", "FAILED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    assert_eq!(app.ledger_rows(SKU, "release").await, 1);
    let late = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(late.status, 409, "{late:?}");
    assert_eq!(gateway.charges_for(&order), 0);
    app.assert_audit_clean().await;
}

/// Found in review: a declined order took payment attempts without end while its hold
/// lasted (card testing looks like this), each adding rows every view of the order
/// renders. The attempt past the bound is refused, stored under its key, and sends
/// nothing to the gateway; the order keeps its hold.
async fn an_order_takes_a_bounded_number_of_payment_attempts(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let attempts_max = domain::limits::PAYMENT_ATTEMPTS_PER_ORDER_MAX;
    for attempt in 0..attempts_max {
        let declined = app
            .pay(
                &order,
                &key(&format!("card-{attempt}")),
                "pm_card_chargeDeclined",
            )
            .await;
        assert_eq!(declined.json()["status"], "PAYMENT_FAILED", "{declined:?}");
    }

    let one_too_many = key("card-one-too-many");
    let refused = app.pay(&order, &one_too_many, "pm_card_visa").await;

    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("failed_precondition"));
    assert_eq!(
        gateway.intents_for(&order).len(),
        usize::try_from(attempts_max).unwrap(),
        "nothing sent for the attempt past the bound"
    );
    assert_eq!(app.order(&order).await["status"], "PAYMENT_FAILED");
    assert_eq!(app.counters(SKU).await, (STOCK - 2, 2), "the hold is kept");
    let retried = app.pay(&order, &one_too_many, "pm_card_visa").await;
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, refused.body);
}

/// Issue 13, defect 8 (seed 000's payment_attempt table): after a decline the shopper
/// tries another card on the same order while its hold lasts; each attempt has its own
/// key, the first answer of each is replayed, and one charge pays the order.
async fn after_a_decline_another_card_pays_the_same_order_while_its_hold_lasts(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let first_key = key("pay-first-card");
    let declined = app.pay(&order, &first_key, "pm_card_chargeDeclined").await;
    assert_eq!(declined.json()["status"], "PAYMENT_FAILED", "{declined:?}");
    let second_key = key("pay-second-card");
    let paid = app.pay(&order, &second_key, "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    assert_eq!(paid.json()["status"], "PAID");
    let view = app.order(&order).await;
    let attempts = view["payment_attempts"].as_array().expect("attempts");
    let statuses: Vec<&str> = attempts
        .iter()
        .map(|attempt| attempt["status"].as_str().expect("status"))
        .collect();
    assert_eq!(statuses, ["FAILED", "SUCCEEDED"], "{view:#}");
    assert_eq!(view["payment"]["status"], "SUCCEEDED");
    assert_eq!(
        gateway.intents_for(&order).len(),
        2,
        "one intent per attempt"
    );
    // Each key keeps its own first answer; a third card finds the order paid.
    let replayed = app.pay(&order, &first_key, "pm_card_chargeDeclined").await;
    assert!(replayed.replayed());
    assert_eq!(replayed.body, declined.body);
    let third = app
        .pay(&order, &key("pay-third-card"), "pm_card_mastercard")
        .await;
    assert_eq!(third.status, 200, "{third:?}");
    assert_eq!(third.json()["status"], "PAID");
    assert_eq!(
        gateway.intents_for(&order).len(),
        2,
        "nothing sent for the third"
    );
    assert_eq!(
        history(&app, &order).await,
        [
            "PENDING_PAYMENT",
            "PAYMENT_PROCESSING",
            "PAYMENT_FAILED",
            "PAYMENT_PROCESSING",
            "PAID"
        ]
    );
    assert_paid_once(&app, &gateway, &order, 2).await;
}

/// Issue 13, defect 8: the database itself refuses a second succeeded attempt (and a
/// second running one) for one order.
async fn the_database_refuses_a_second_successful_attempt_for_an_order(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    app.pay(&order, &key("pay"), "pm_card_chargeDeclined").await;
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(paid.json()["status"], "PAID", "{paid:?}");
    let mut connection = app.database.raw_connection().await;
    let failed = format!(
        "UPDATE payment_attempt SET status = 'SUCCEEDED' WHERE order_id = '{order}' AND status = 'FAILED'"
    );
    assert!(
        connection.execute(&failed).await.is_err(),
        "a second success"
    );
    let running = format!(
        "INSERT INTO payment_attempt (id, order_id, attempt_number, gateway_key, payment_method, status, amount_minor, \
         currency, reconcile_after, created_at, updated_at) VALUES ('pay_x1', '{order}', 3, 'k3', 'pm_card_visa', \
         'PROCESSING', 100, 'CNY', 0, 0, 0), ('pay_x2', '{order}', 4, 'k4', 'pm_card_visa', 'PROCESSING', 100, 'CNY', 0, 0, 0)"
    );
    assert!(
        connection.execute(&running).await.is_err(),
        "two running attempts"
    );
    assert_eq!(gateway.charges_for(&order), 1);
    app.assert_audit_clean().await;
}

/// Issue 13, defect 7: a payment still unresolved when the hold ends is cancelled at
/// the gateway before the stock goes back, so the customer can no longer complete it
/// and pay for goods that were given back.
async fn an_abandoned_payment_is_cancelled_at_the_gateway_before_its_stock_goes_back(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    assert_eq!(
        intent_of(&gateway, &order).status,
        gateway::PaymentIntentStatus::Canceled
    );
    assert_eq!(
        gateway.complete_action(&intent).await,
        409,
        "too late to complete"
    );
    assert_eq!(gateway.charges_for(&order), 0);
    assert_statuses(&app, &order, ("EXPIRED", "RELEASED", "FAILED")).await;
    app.assert_audit_clean().await;
}

/// Issue 13, defect 7: while the gateway cannot be reached to cancel, nothing is given
/// back: the hold stays until the gateway confirms the payment will not complete.
async fn an_abandoned_payment_keeps_its_stock_while_the_gateway_cannot_cancel_it(backend: Backend) {
    an_abandoned_payment_keeps_its_stock_while_the_gateway_refuses(backend, Refuse::Cancels).await;
}

/// Found in review: when the cancel of an abandoned payment was refused and the read of
/// its intent that followed was refused too (a 404: the account or address changed),
/// the payment was taken as failed and its stock given back, with nothing known of the
/// money (a look that learns nothing keeps the hold everywhere else). It stays held
/// until the gateway says what became of the payment.
async fn an_abandoned_payment_that_can_be_neither_cancelled_nor_read_keeps_its_stock(
    backend: Backend,
) {
    an_abandoned_payment_keeps_its_stock_while_the_gateway_refuses(
        backend,
        Refuse::CancelsAndLaterReads,
    )
    .await;
}

/// A payment left at its customer step past the hold, looked at by another instance
/// whose gateway proxy refuses what `refused` names: the stock stays held; once the
/// gateway answers again, the payment is cancelled and the stock given back.
async fn an_abandoned_payment_keeps_its_stock_while_the_gateway_refuses(
    backend: Backend,
    refused: Refuse,
) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    app.clock.advance_seconds(HOLD_SECONDS + 1);
    let other = app.another_instance().await;
    let proxy = FlakyGateway::start(&gateway, refused).await;
    proxy.attach(&other);

    let resolved = other.engine.reconcile_step().await.expect("reconcile step");

    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_eq!(resolved[0].1, None, "still unknown");
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    assert_eq!(app.counters(SKU).await, (STOCK - 2, 2));
    // Answered again: cancelled, then released.
    proxy.stop_refusing();
    app.clock.advance_seconds(3600);
    let resolved = other.engine.reconcile_step().await.expect("reconcile step");
    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_statuses(&app, &order, ("EXPIRED", "RELEASED", "FAILED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    assert_eq!(gateway.charges_for(&order), 0);
    app.assert_audit_clean().await;
}

/// What [`FlakyGateway`] answers 503 to, or, for `CancelsAndLaterReads`, 404: a cancel,
/// and every read of an intent after the first cancel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Refuse {
    Cancels,
    Everything,
    CancelsAndLaterReads,
}

/// A gateway in front of the sandbox that passes calls through, except those it
/// answers 503 until told to stop. A holding one refuses nothing and keeps each call
/// until the test lets one through, as a gateway slow to answer would.
struct FlakyGateway {
    url: String,
    refusing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Calls that reached the proxy.
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Permits for held calls to go on; `None` when calls are not held.
    held: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    _shutdown: tokio_util::sync::DropGuard,
}

impl FlakyGateway {
    async fn start(gateway: &TestGateway, refused: Refuse) -> FlakyGateway {
        FlakyGateway::spawn(gateway, refused, None).await
    }

    async fn holding(gateway: &TestGateway) -> FlakyGateway {
        let proxy = FlakyGateway::spawn(
            gateway,
            Refuse::Everything,
            Some(std::sync::Arc::new(tokio::sync::Semaphore::new(0))),
        )
        .await;
        proxy.stop_refusing();
        proxy
    }

    fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn let_one_through(&self) {
        self.held.as_ref().expect("a holding proxy").add_permits(1);
    }

    async fn spawn(
        gateway: &TestGateway,
        refused: Refuse,
        held: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    ) -> FlakyGateway {
        let upstream = gateway.url.clone();
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = std::sync::Arc::clone(&calls);
        let hold = held.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let shutdown = tokio_util::sync::CancellationToken::new();
        let stop = shutdown.clone();
        let client = reqwest::Client::new();
        let refusing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let refuse = std::sync::Arc::clone(&refusing);
        let cancelled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let router = axum::Router::new().fallback(move |request: axum::extract::Request| {
            let upstream = upstream.clone();
            let client = client.clone();
            let refuse = refuse.load(std::sync::atomic::Ordering::SeqCst);
            let hold = hold.clone();
            let cancelled = std::sync::Arc::clone(&cancelled);
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                use axum::response::IntoResponse;
                if let Some(hold) = hold {
                    hold.acquire().await.expect("the hold stays open").forget();
                }
                if refuse && refused == Refuse::CancelsAndLaterReads {
                    let cancel = request.uri().path().ends_with("/cancel");
                    if cancel {
                        cancelled.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    let read_after_cancel = request.method() == axum::http::Method::GET
                        && cancelled.load(std::sync::atomic::Ordering::SeqCst);
                    if cancel || read_after_cancel {
                        return (axum::http::StatusCode::NOT_FOUND, "no such payment intent")
                            .into_response();
                    }
                }
                if refuse
                    && (refused == Refuse::Everything
                        || (refused == Refuse::Cancels
                            && request.uri().path().ends_with("/cancel")))
                {
                    return (
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "down for maintenance",
                    )
                        .into_response();
                }
                let method = request.method().clone();
                let path = request.uri().to_string();
                let headers = request.headers().clone();
                let body = axum::body::to_bytes(request.into_body(), 1 << 20)
                    .await
                    .expect("request body");
                let mut forwarded = client.request(method, format!("{upstream}{path}"));
                for (name, value) in &headers {
                    if name != "host" && name != "content-length" {
                        forwarded = forwarded.header(name, value);
                    }
                }
                let answer = forwarded
                    .body(body)
                    .send()
                    .await
                    .expect("sandbox reachable");
                let status = answer.status().as_u16();
                let body = answer.bytes().await.expect("answer body");
                (
                    axum::http::StatusCode::from_u16(status).expect("status"),
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    body,
                )
                    .into_response()
            }
        });
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        });
        FlakyGateway {
            url,
            refusing,
            calls,
            held,
            _shutdown: shutdown.drop_guard(),
        }
    }

    fn stop_refusing(&self) {
        self.refusing
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    fn attach(&self, app: &TestApp) {
        app.engine
            .attach_payments(acceptance::payments::payments_at(
                &self.url,
                acceptance::payments::GATEWAY_TIMEOUT_MILLISECONDS,
                true,
            ));
    }

    /// Another instance of `app`'s, whose payments go through a proxy refusing
    /// everything (payments are attached once per process: the other instance takes
    /// the proxy's).
    async fn refusing_in_front_of(app: &TestApp, gateway: &TestGateway) -> (TestApp, FlakyGateway) {
        let other = app.another_instance().await;
        let proxy = FlakyGateway::start(gateway, Refuse::Everything).await;
        proxy.attach(&other);
        (other, proxy)
    }
}

async fn a_slow_gateway_answer_is_waited_for_and_applied(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app.pay(&order, &key("pay"), "pm_sandbox_slow").await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["status"], "PAID");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn a_charge_whose_answer_times_out_is_unknown_until_the_webhook_says_paid(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("payment_unknown"));
    app.wait_for_order_status(&order, "PAID").await;
    assert_paid_once(&app, &gateway, &order, 1).await;
    assert_eq!(
        app.ledger_rows(SKU, "release").await,
        0,
        "never released on a guess"
    );
}

async fn a_lost_answer_is_unknown_until_the_webhook_says_paid(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_lost_response")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("payment_unknown"));
    app.wait_for_order_status(&order, "PAID").await;
    assert_paid_once(&app, &gateway, &order, 1).await;
    assert_eq!(app.ledger_rows(SKU, "release").await, 0);
}

async fn a_payment_whose_webhook_never_comes_is_settled_by_the_answer(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app.pay(&order, &key("pay"), "pm_sandbox_no_webhook").await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(gateway.sandbox.stats().events_sent, 0);
    assert_eq!(app.webhook_events().await, 0);
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn a_webhook_delivered_three_times_has_one_effect(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app.pay(&order, &key("pay"), "pm_sandbox_webhook_3x").await;
    assert_eq!(response.status, 200, "{response:?}");
    wait_for_deliveries(&gateway, 3).await;
    assert_eq!(app.webhook_events().await, 1, "one event, remembered once");
    assert_eq!(app.ledger_rows(SKU, "confirm").await, 1);
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn a_stale_failure_after_a_success_changes_nothing(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_webhooks_out_of_order")
        .await;
    assert_eq!(response.status, 200, "{response:?}");
    wait_for_deliveries(&gateway, 2).await;
    assert_eq!(app.webhook_events().await, 2, "both events are remembered");
    assert_eq!(app.ledger_rows(SKU, "release").await, 0);
    assert_paid_once(&app, &gateway, &order, 1).await;
}

/// An order whose payment waits for a customer action until after its hold ended:
/// reconciliation hears "not completed" and gives the stock back (`EXPIRED`).
async fn order_abandoned_while_awaiting_action(
    app: &TestApp,
    gateway: &TestGateway,
    quantity: i64,
) -> (String, String) {
    let order = app.order_of("user-1", &[(SKU, quantity)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("payment_unknown"));
    assert_statuses(
        app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    app.clock.advance_seconds(HOLD_SECONDS + 1);
    assert!(
        app.engine
            .order_expiry_step()
            .await
            .expect("expiry step")
            .is_empty()
    );
    assert_statuses(
        app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    let resolved = app.engine.reconcile_step().await.expect("reconcile step");
    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_statuses(app, &order, ("EXPIRED", "RELEASED", "FAILED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    assert_eq!(gateway.charges_for(&order), 0);
    let intent = intent_of(gateway, &order).id;
    (order, intent)
}

async fn a_success_after_the_hold_ended_takes_the_stock_again_when_it_is_there(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&order, "PAID").await;
    assert_paid_once(&app, &gateway, &order, 2).await;
    assert_eq!(
        history(&app, &order).await,
        ["PENDING_PAYMENT", "PAYMENT_PROCESSING", "EXPIRED", "PAID"]
    );
    assert_eq!(gateway.sandbox.stats().refunds, 0);
}

/// Issue 14: one reservation writer per backend. A late success writes the order's new
/// reservation through the writer every path uses: once paid, its rows are those of an
/// order paid in time (the same lines, `CONFIRMED`, a `reserve` and a `confirm` ledger
/// row per line).
async fn a_late_success_leaves_the_rows_a_paid_order_leaves(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (late, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&late, "PAID").await;
    let in_time = app.order_of("user-1", &[(SKU, 2)]).await;
    let paid = app.pay(&in_time, &key("pay-in-time"), "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    let contents = app.contents().await;
    let mut rows = Vec::new();
    for order in [&late, &in_time] {
        let view = app.order(order).await;
        let reservation = view["reservation"]["reservation_id"]
            .as_str()
            .expect("the order's reservation")
            .to_owned();
        rows.push(acceptance::reservation_rows(&contents, &reservation));
    }
    assert_eq!(
        rows[0].len(),
        4,
        "a reservation, a line, two ledger rows: {rows:?}"
    );
    assert_eq!(rows[0][0][1], "CONFIRMED");
    assert_eq!(
        rows[0], rows[1],
        "the late success's rows and the paid order's"
    );
    app.assert_audit_clean().await;
}

async fn a_success_after_the_hold_ended_is_refunded_when_the_stock_is_gone(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    // Someone else buys everything that was given back.
    paid_order(&app, "user-2", STOCK).await;
    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&order, "REFUND_PENDING").await;
    let refunded = app.engine.refund_step().await.expect("refund step");
    assert_eq!(refunded.len(), 1);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    let view = app.order(&order).await;
    assert_eq!(view["status"], "REFUNDED");
    assert_eq!(view["refund"]["status"], "SUCCEEDED");
    assert_eq!(view["refund"]["amount"], 200);
    assert_eq!(gateway.sandbox.stats().refunds, 1, "refunded once");
    assert_eq!(gateway.charges_for(&order), 1);
    assert_eq!(app.counters(SKU).await, (0, 0), "the rival's sale stands");
    assert_eq!(
        history(&app, &order).await,
        [
            "PENDING_PAYMENT",
            "PAYMENT_PROCESSING",
            "EXPIRED",
            "REFUND_PENDING",
            "REFUNDED"
        ]
    );
    app.assert_audit_clean().await;
}

async fn an_unknown_outcome_is_never_released_by_expiry_and_reconciliation_finds_the_charge(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 3)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    app.clock.advance_seconds(HOLD_SECONDS + 1);
    assert!(
        app.engine
            .order_expiry_step()
            .await
            .expect("expiry")
            .is_empty()
    );
    assert!(
        app.engine
            .expire_step()
            .await
            .expect("reservation expiry")
            .released
            .is_empty()
    );
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    assert_eq!(
        app.counters(SKU).await,
        (STOCK - 3, 3),
        "nothing released on a guess"
    );
    let resolved = app.engine.reconcile_step().await.expect("reconcile");
    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_paid_once(&app, &gateway, &order, 3).await;
}

async fn a_process_killed_while_waiting_for_the_gateway_is_recovered_by_reconciliation(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let paying = {
        let app = app.clone();
        let order = order.clone();
        tokio::spawn(async move {
            app.pay(&order, "pay-killed", "pm_sandbox_charge_then_timeout")
                .await
        })
    };
    acceptance::wait_until("the gateway charged", || gateway.charges_for(&order) == 1).await;
    // The process dies: the request's task is dropped before the answer arrives.
    paying.abort();
    assert!(paying.await.is_err_and(|error| error.is_cancelled()));
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    let restarted = app.clone().restart().await;
    gateway.attach(&restarted);
    assert!(
        restarted
            .engine
            .reconcile_step()
            .await
            .expect("reconcile")
            .is_empty(),
        "an attempt is not asked about before its threshold"
    );
    restarted.clock.advance_seconds(11);
    let resolved = restarted.engine.reconcile_step().await.expect("reconcile");
    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_paid_once(&restarted, &gateway, &order, 1).await;
    // The client's retry of its interrupted request now learns the outcome.
    let retried = restarted
        .pay(&order, "pay-killed", "pm_sandbox_charge_then_timeout")
        .await;
    assert_eq!(retried.status, 200, "{retried:?}");
    assert_eq!(retried.json()["status"], "PAID");
    assert_eq!(gateway.charges_for(&order), 1);
}

/// A payment attempt of `order` committed (the order `PAYMENT_PROCESSING`), after
/// which the process died before calling the gateway: nothing was sent.
async fn attempt_begun_before_a_crash(app: &TestApp, order: &str) {
    let order_id = domain::OrderId::parse(order).expect("order id");
    let now = app.clock_now();
    let claim = store::IdempotencyClaim {
        key: store::ScopedKey::new(
            &domain::Principal::Admin,
            &domain::IdempotencyKey::parse("pay-before-the-crash").expect("key"),
        ),
        fingerprint: "pay".to_owned(),
    };
    let begun = app
        .store
        .begin_payment(
            &claim,
            &order_id,
            &domain::PaymentAttemptId::generate(now, 7),
            "pm_card_visa",
            now.plus_milliseconds(10_000),
            now.plus_seconds(-24 * 3600),
            (now, now),
            api::renderer().as_ref(),
        )
        .await
        .expect("begin payment");
    assert!(
        matches!(begun, store::BeginPayment::Started(_)),
        "{begun:?}"
    );
}

async fn a_payment_that_never_reached_the_gateway_is_completed_by_reconciliation_with_its_key(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    attempt_begun_before_a_crash(&app, &order).await;
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    assert_eq!(gateway.intents_for(&order).len(), 0);
    app.clock.advance_seconds(11);
    let resolved = app.engine.reconcile_step().await.expect("reconcile");
    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_paid_once(&app, &gateway, &order, 1).await;
    // Asking again (a second worker, a late retry) uses the same key: still one charge.
    app.clock.advance_seconds(60);
    assert!(
        app.engine
            .reconcile_step()
            .await
            .expect("reconcile")
            .is_empty()
    );
    assert_eq!(gateway.charges_for(&order), 1);
}

async fn fifty_concurrent_pay_calls_on_one_order_charge_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let calls: Vec<Call> = (0..50)
        .map(|index| {
            Call::post(format!("/v1/orders/{order}/pay"))
                .key(format!("pay-{index}"))
                .json(&json!({"payment_method": "pm_card_visa"}))
        })
        .collect();
    let responses = send_concurrently(&app, calls).await;
    let mut paid = 0;
    for response in &responses {
        match (response.status, response.code().as_deref()) {
            (200, None) => {
                assert_eq!(response.json()["status"], "PAID", "{response:?}");
                paid += 1;
            }
            (202, Some("payment_unknown")) => {}
            // Another request's payment was running: this one tried no card.
            (409, Some("request_in_progress")) => {}
            other => panic!("unexpected answer {other:?}: {response:?}"),
        }
    }
    assert!(paid >= 1, "someone saw the payment succeed");
    app.wait_for_order_status(&order, "PAID").await;
    assert_eq!(app.ledger_rows(SKU, "confirm").await, 1);
    assert_eq!(gateway.intents_for(&order).len(), 1, "one payment intent");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn a_retried_pay_request_replays_its_first_answer(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let first = app.pay(&order, "pay-once", "pm_card_visa").await;
    assert_eq!(first.status, 200, "{first:?}");
    let second = app.pay(&order, "pay-once", "pm_card_visa").await;
    assert_eq!(second.status, 200);
    assert!(second.replayed());
    assert_eq!(second.body, first.body, "byte for byte");
    let another_caller = app.pay(&order, "pay-twice", "pm_card_visa").await;
    assert_eq!(another_caller.status, 200, "{another_caller:?}");
    assert_eq!(
        another_caller.json()["status"],
        "PAID",
        "the outcome, not a second charge"
    );
    assert!(!another_caller.replayed());
    let other_body = app.pay(&order, "pay-once", "pm_card_mastercard").await;
    assert_eq!(other_body.status, 422, "{other_body:?}");
    assert_eq!(other_body.code().as_deref(), Some("idempotency_key_reused"));
    assert_paid_once(&app, &gateway, &order, 1).await;
}

/// A `payment_intent.succeeded` event for `intent`, signed at the sandbox's time.
fn signed_event(
    app: &TestApp,
    event_id: &str,
    intent: &gateway::PaymentIntent,
    timestamp_offset_seconds: i64,
) -> (String, String) {
    signed_event_of_kind(
        app,
        event_id,
        "payment_intent.succeeded",
        intent,
        timestamp_offset_seconds,
    )
}

fn signed_event_of_kind(
    app: &TestApp,
    event_id: &str,
    kind: &str,
    intent: &gateway::PaymentIntent,
    timestamp_offset_seconds: i64,
) -> (String, String) {
    let now_seconds = app.clock_now().unix_milliseconds().div_euclid(1000);
    let payload = json!({
        "id": event_id,
        "object": "event",
        "type": kind,
        "created": now_seconds,
        "data": {"object": intent},
    })
    .to_string();
    let signature = gateway::signature::sign(
        WEBHOOK_SECRET,
        now_seconds + timestamp_offset_seconds,
        payload.as_bytes(),
    );
    (payload, signature)
}

fn webhook_call(payload: &str, signature: Option<&str>) -> Call {
    let mut call =
        Call::post("/v1/payments/webhook").raw(payload.to_owned(), Some("application/json"));
    call.signature = signature.map(str::to_owned);
    call
}

/// An order whose gateway charge happened while stockd heard nothing (no answer, no
/// webhook): only a webhook the test sends can settle it.
async fn charged_but_unheard(
    app: &TestApp,
    gateway: &TestGateway,
) -> (String, gateway::PaymentIntent) {
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    let intent = intent_of(gateway, &order);
    assert_eq!(intent.status, gateway::PaymentIntentStatus::Succeeded);
    (order, intent)
}

async fn the_same_event_and_the_same_payment_under_another_event_id_apply_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = charged_but_unheard(&app, &gateway).await;
    let (payload, signature) = signed_event(&app, "evt_same", &intent, 0);
    let calls = (0..3)
        .map(|_| webhook_call(&payload, Some(&signature)))
        .collect();
    let responses = send_concurrently(&app, calls).await;
    for response in &responses {
        assert_eq!(response.status, 200, "{response:?}");
    }
    let duplicates = responses
        .iter()
        .filter(|response| response.json()["duplicate"] == true)
        .count();
    assert_eq!(duplicates, 2, "{responses:?}");
    let (payload, signature) = signed_event(&app, "evt_other", &intent, 0);
    let response = app.send(webhook_call(&payload, Some(&signature))).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(app.webhook_events().await, 2);
    assert_eq!(app.ledger_rows(SKU, "confirm").await, 1);
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn webhooks_with_a_bad_or_stale_signature_are_refused_and_change_nothing(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = charged_but_unheard(&app, &gateway).await;
    let before = app.contents().await;
    let (payload, good_signature) = signed_event(&app, "evt_1", &intent, 0);
    let (_, stale_signature) = signed_event(&app, "evt_1", &intent, -301);
    let (_, future_signature) = signed_event(&app, "evt_1", &intent, 301);
    let forged = gateway::signature::sign(
        "whsec_someone_else",
        app.clock_now().unix_milliseconds() / 1000,
        payload.as_bytes(),
    );
    let tampered = payload.replace("succeeded", "succeeded ");
    for (payload, signature) in [
        (payload.as_str(), None),
        (payload.as_str(), Some("garbage")),
        (payload.as_str(), Some("t=1,v1=00")),
        (payload.as_str(), Some(stale_signature.as_str())),
        (payload.as_str(), Some(future_signature.as_str())),
        (payload.as_str(), Some(forged.as_str())),
        (tampered.as_str(), Some(good_signature.as_str())),
    ] {
        let response = app.send(webhook_call(payload, signature)).await;
        assert_eq!(response.status, 401, "{signature:?}: {response:?}");
        assert_eq!(response.code().as_deref(), Some("unauthorized"));
        assert_eq!(response.content_type(), "application/problem+json");
    }
    let not_an_event = "{\"hello\": 1}";
    let signature = gateway::signature::sign(
        WEBHOOK_SECRET,
        app.clock_now().unix_milliseconds() / 1000,
        not_an_event.as_bytes(),
    );
    let response = app.send(webhook_call(not_an_event, Some(&signature))).await;
    assert_eq!(response.status, 400, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("invalid_argument"));
    // A body past the limit, signed or not, is refused before anything reads it.
    let oversized = format!(
        "{{\"padding\": \"{}\"}}",
        "x".repeat(domain::limits::REQUEST_BODY_BYTES_MAX)
    );
    let signature = gateway::signature::sign(
        WEBHOOK_SECRET,
        app.clock_now().unix_milliseconds() / 1000,
        oversized.as_bytes(),
    );
    let response = app.send(webhook_call(&oversized, Some(&signature))).await;
    assert_eq!(response.status, 413, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("invalid_argument"));
    assert_eq!(app.contents().await, before);
    // The genuine one still works afterwards.
    let response = app
        .send(webhook_call(&payload, Some(&good_signature)))
        .await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

/// What a shopper is charged for and can return is the order's lines; what left stock
/// for it is its reservation's lines, which the ledger checks. A line or an amount
/// written around stockd is a difference the audit reports.
async fn the_audit_finds_an_order_line_or_amount_that_differs_from_its_hold(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    app.assert_audit_clean().await;
    let mut connection = app.database.raw_connection().await;

    connection
        .execute(&format!(
            "UPDATE order_line SET quantity = quantity + 1 WHERE order_id = '{order}'"
        ))
        .await
        .unwrap();
    let audit = app.audit().await;
    assert_eq!(audit["ok"], false, "{audit:#}");
    let checks: Vec<&str> = audit["differences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|difference| difference["check"].as_str().unwrap())
        .collect();
    assert!(
        checks.contains(&"order_line_vs_reservation_line"),
        "{audit:#}"
    );
    assert!(checks.contains(&"order_amount_vs_lines"), "{audit:#}");

    connection
        .execute(&format!(
            "UPDATE order_line SET quantity = quantity - 1 WHERE order_id = '{order}'"
        ))
        .await
        .unwrap();
    app.assert_audit_clean().await;
    connection
        .execute(&format!(
            "UPDATE customer_order SET amount_minor = 1 WHERE id = '{order}'"
        ))
        .await
        .unwrap();
    let audit = app.audit().await;
    assert_eq!(
        audit["differences"][0]["check"], "order_amount_vs_lines",
        "{audit:#}"
    );
    assert_eq!(audit["differences_total"], 1, "{audit:#}");
}

/// A stock row edited by hand to hold fewer units reserved than a due order's hold:
/// that order cannot give its stock back and stays as it is, reported; the other due
/// orders expire all the same, now and in every later step.
async fn an_order_whose_stock_row_is_broken_does_not_stop_the_others_expiring(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    app.stocked_sku("BROKEN", 5).await;
    let broken = app.order_of("user-1", &[("BROKEN", 2)]).await;
    let sound = app.order_of("user-2", &[(SKU, 1)]).await;
    let mut connection = app.database.raw_connection().await;
    connection
        .execute("UPDATE stock SET reserved = 0 WHERE sku = 'BROKEN'")
        .await
        .unwrap();
    app.clock.advance_seconds(HOLD_SECONDS + 1);

    let expired = app.engine.order_expiry_step().await.expect("expiry");

    let expired: Vec<String> = expired.iter().map(ToString::to_string).collect();
    assert_eq!(expired, std::slice::from_ref(&sound));
    assert_statuses(&app, &sound, ("EXPIRED", "RELEASED", "none")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    assert_eq!(app.order(&broken).await["status"], "PENDING_PAYMENT");
    // The next step meets the broken order again, and nothing else is stopped by it.
    let later = app.order_of("user-3", &[(SKU, 1)]).await;
    app.clock.advance_seconds(HOLD_SECONDS + 1);
    let next = app.engine.order_expiry_step().await.expect("expiry");
    let next: Vec<String> = next.iter().map(ToString::to_string).collect();
    assert_eq!(next, [later]);
}

/// Found in review: a stock row another session held open made the order expiry wait
/// the lock bound and fail, every step, on the same claim: no unpaid order of any SKU
/// gave its stock back while it stayed held. The orders on the held row are now left
/// for later and the others expire; the held ones expire once the row is free.
/// (SQLite: a held write lock is the whole database's.)
async fn a_stock_row_held_open_does_not_stop_the_other_orders_expiring(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 1_000).await;
    let _gateway = TestGateway::start(&app).await;
    app.stocked_sku(SKU, STOCK).await;
    app.stocked_sku("HELD", 5).await;
    // Due first, so every claim starts with it.
    let held = app.order_of("user-1", &[("HELD", 2)]).await;
    app.clock.advance_seconds(1);
    let free = app.order_of("user-2", &[(SKU, 1)]).await;
    app.clock.advance_seconds(HOLD_SECONDS + 1);
    let mut holder = app.database.hold_stock_row_lock("HELD").await;

    let expired = app
        .engine
        .order_expiry_step()
        .await
        .expect("the step succeeds");

    let expired: Vec<String> = expired.iter().map(ToString::to_string).collect();
    assert_eq!(expired, std::slice::from_ref(&free));
    assert_statuses(&app, &free, ("EXPIRED", "RELEASED", "none")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    assert_eq!(app.order(&held).await["status"], "PENDING_PAYMENT");
    holder.execute("ROLLBACK").await.unwrap();
    let next = app
        .engine
        .order_expiry_step()
        .await
        .expect("the step succeeds");
    let next: Vec<String> = next.iter().map(ToString::to_string).collect();
    assert_eq!(next, std::slice::from_ref(&held));
    assert_statuses(&app, &held, ("EXPIRED", "RELEASED", "none")).await;
    assert_eq!(app.counters("HELD").await, (5, 0));
}

/// As many broken orders as one step claims, due first: the next step claims the due
/// orders behind them instead of the same broken ones again; the pass after that
/// starts from the beginning and tries the broken ones again.
async fn a_whole_batch_of_broken_orders_does_not_stop_the_orders_behind_it_expiring(
    backend: Backend,
) {
    let config = engine::EngineConfig {
        order_expiry_batch_size: 2,
        ..acceptance::test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku(SKU, STOCK).await;
    app.stocked_sku("BROKEN", 5).await;
    let broken = [
        app.order_of("user-1", &[("BROKEN", 1)]).await,
        app.order_of("user-2", &[("BROKEN", 1)]).await,
    ];
    app.clock.advance_seconds(1);
    let sound = app.order_of("user-3", &[(SKU, 1)]).await;
    let mut connection = app.database.raw_connection().await;
    connection
        .execute("UPDATE stock SET reserved = 0 WHERE sku = 'BROKEN'")
        .await
        .unwrap();
    app.clock.advance_seconds(HOLD_SECONDS + 1);

    let first = app.engine.order_expiry_step().await.expect("expiry");
    assert!(first.is_empty(), "{first:?}");

    let second = app.engine.order_expiry_step().await.expect("expiry");
    let second: Vec<String> = second.iter().map(ToString::to_string).collect();
    assert_eq!(second, std::slice::from_ref(&sound));
    assert_statuses(&app, &sound, ("EXPIRED", "RELEASED", "none")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));

    for order in &broken {
        assert_eq!(app.order(order).await["status"], "PENDING_PAYMENT");
    }
    // Mended by a person, the broken orders expire in the next pass, which starts
    // from the beginning again.
    connection
        .execute("UPDATE stock SET reserved = 2 WHERE sku = 'BROKEN'")
        .await
        .unwrap();
    let third = app.engine.order_expiry_step().await.expect("expiry");
    let mut third: Vec<String> = third.iter().map(ToString::to_string).collect();
    third.sort();
    let mut broken = broken.to_vec();
    broken.sort();
    assert_eq!(third, broken);
    app.assert_audit_clean().await;
}

/// Five due orders, claimed two at a time, with an hour between the worker's steps:
/// the worker goes on at once after a full claim, so all five expire without waiting
/// two hours.
async fn unpaid_orders_falling_due_together_expire_in_one_go_not_a_batch_per_interval(
    backend: Backend,
) {
    let config = engine::EngineConfig {
        order_expiry_batch_size: 2,
        payment_worker_interval_milliseconds: 3_600_000,
        ..acceptance::test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku(SKU, STOCK).await;
    let mut orders = Vec::new();
    for user in 0..5 {
        orders.push(app.order_of(&format!("user-{user}"), &[(SKU, 1)]).await);
    }
    app.clock.advance_seconds(HOLD_SECONDS + 1);

    let shutdown = tokio_util::sync::CancellationToken::new();
    let workers = tokio_util::task::TaskTracker::new();
    engine::workers::spawn_workers(&app.engine, &workers, &shutdown);
    acceptance::wait_until_async("every due order expired", || async {
        app.counters(SKU).await == (STOCK, 0)
    })
    .await;
    shutdown.cancel();
    workers.close();
    workers.wait().await;

    for order in &orders {
        assert_statuses(&app, order, ("EXPIRED", "RELEASED", "none")).await;
    }
    app.assert_audit_clean().await;
}

async fn an_unpaid_order_past_its_hold_expires_and_cannot_be_paid(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 4)]).await;
    app.clock.advance_seconds(HOLD_SECONDS - 1);
    assert!(
        app.engine
            .order_expiry_step()
            .await
            .expect("expiry")
            .is_empty()
    );
    app.clock.advance_seconds(2);
    // The plain reservation sweeper leaves an order's reservation to the order worker.
    assert!(
        app.engine
            .expire_step()
            .await
            .expect("reservation expiry")
            .released
            .is_empty()
    );
    let expired = app.engine.order_expiry_step().await.expect("expiry");
    assert_eq!(expired.len(), 1);
    assert_statuses(&app, &order, ("EXPIRED", "RELEASED", "none")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    assert!(
        app.engine
            .order_expiry_step()
            .await
            .expect("expiry")
            .is_empty()
    );
    let response = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("illegal_transition"));
    assert_eq!(
        gateway.intents_for(&order).len(),
        0,
        "the gateway was never asked"
    );
    assert_eq!(app.ledger_rows(SKU, "release").await, 1);
    app.assert_audit_clean().await;
}

/// An order of `quantity` units of [`SKU`], paid by card. Returns once its one webhook
/// has been recorded too, so a test's "nothing changed" snapshots never race it.
async fn paid_order(app: &TestApp, user: &str, quantity: i64) -> String {
    let events = app.webhook_events().await;
    let order = app.order_of(user, &[(SKU, quantity)]).await;
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    app.wait_for_webhook_events(events + 1).await;
    order
}

async fn cancel(app: &TestApp, order: &str) -> acceptance::TestResponse {
    app.send(Call::post(format!("/v1/orders/{order}/cancel")).key(key("cancel")))
        .await
}

/// Cancelling a paid order (a refund follows) is a staff decision: the admin's here.
async fn cancel_as_staff(app: &TestApp, order: &str) -> acceptance::TestResponse {
    app.send(
        Call::post(format!("/v1/orders/{order}/cancel"))
            .admin()
            .key(key("cancel")),
    )
    .await
}

async fn cancelling_an_unpaid_order_gives_its_stock_back_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 4)]).await;
    let response = cancel(&app, &order).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["status"], "CANCELLED");
    assert_statuses(&app, &order, ("CANCELLED", "RELEASED", "none")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    let before = app.contents_except_idempotency_records().await;
    let again = cancel(&app, &order).await;
    assert_eq!(again.status, 409, "{again:?}");
    assert_eq!(again.code().as_deref(), Some("illegal_transition"));
    let pay = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(pay.code().as_deref(), Some("illegal_transition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_eq!(gateway.intents_for(&order).len(), 0);
    assert_eq!(app.ledger_rows(SKU, "release").await, 1);
    app.assert_audit_clean().await;
}

async fn cancelling_a_paid_order_refunds_it_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 2).await;
    let before = app.contents().await;
    let by_checkout = cancel(&app, &order).await;
    assert_eq!(by_checkout.status, 403, "{by_checkout:?}");
    assert_eq!(by_checkout.code().as_deref(), Some("forbidden"));
    assert_eq!(
        app.contents().await,
        before,
        "a refused role writes nothing, not even its key"
    );
    let response = cancel_as_staff(&app, &order).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["status"], "REFUND_PENDING");
    let again = cancel_as_staff(&app, &order).await;
    assert_eq!(again.code().as_deref(), Some("illegal_transition"));
    assert_eq!(app.engine.refund_step().await.expect("refunds").len(), 1);
    assert_eq!(app.engine.refund_step().await.expect("refunds"), []);
    assert_statuses(&app, &order, ("REFUNDED", "CONFIRMED", "SUCCEEDED")).await;
    assert_eq!(gateway.sandbox.stats().refunds, 1);
    assert_eq!(gateway.charges_for(&order), 1);
    // The goods were sold; they come back to stock only through a return.
    assert_eq!(app.counters(SKU).await, (STOCK - 2, 0));
    app.assert_audit_clean().await;
}

/// Found in review: a shopper's units of a SKU count against its per-user limit while
/// held or bought. A paid order cancelled by staff (refunded) kept counting them: the
/// shopper could never buy the SKU again.
async fn a_refunded_orders_units_no_longer_count_against_the_shoppers_limit(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let limited = app
        .send(
            Call::put(format!("/v1/skus/{SKU}"))
                .admin()
                .key(key("limit"))
                .json(&serde_json::json!({"per_user_limit": 2})),
        )
        .await;
    assert_eq!(limited.status, 200, "{limited:?}");
    let order = paid_order(&app, "user-1", 2).await;
    let over = app.create_order(&key("over"), "user-1", &[(SKU, 1)]).await;
    assert_eq!(
        over.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "{over:?}"
    );

    assert_eq!(cancel_as_staff(&app, &order).await.status, 200);

    let again = app.create_order(&key("again"), "user-1", &[(SKU, 2)]).await;
    assert_eq!(
        again.status, 201,
        "the refunded units count no more: {again:?}"
    );
    let beyond = app
        .create_order(&key("beyond"), "user-1", &[(SKU, 1)])
        .await;
    assert_eq!(
        beyond.code().as_deref(),
        Some("purchase_limit_exceeded"),
        "the new order's units count: {beyond:?}"
    );
    app.assert_audit_clean().await;
}

/// Found in review: the refund of a cancelled paid order was written with `ON CONFLICT
/// DO NOTHING` and its row count not read: with a refund of the paying attempt there
/// already (broken data), the order moved to `REFUND_PENDING` with no refund to issue,
/// waiting for good. Nothing is written now.
async fn a_paid_order_whose_refund_cannot_be_written_is_not_cancelled(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    let mut connection = app.database.raw_connection().await;
    connection
        .execute(&format!(
            "INSERT INTO refund (id, order_id, attempt_id, gateway_key, status, amount_minor, currency, reason, \
             next_try_at, created_at, updated_at) \
             SELECT 'rfd_0000000000000000000000000001', order_id, id, 'by-hand', 'FAILED', amount_minor, currency, 'by hand', 0, 0, 0 \
             FROM payment_attempt WHERE order_id = '{order}' AND status = 'SUCCEEDED'"
        ))
        .await
        .unwrap();
    let before = app.contents_except_idempotency_records().await;

    let cancelled = cancel_as_staff(&app, &order).await;

    assert!(cancelled.status >= 500, "{cancelled:?}");
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_statuses(&app, &order, ("PAID", "CONFIRMED", "SUCCEEDED")).await;
}

async fn a_refund_not_confirmed_is_tried_again_less_and_less_often(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    assert_eq!(cancel_as_staff(&app, &order).await.status, 200);
    let lease_milliseconds = 30_000;
    let claimed_at = |milliseconds: i64| {
        let store = app.store.clone();
        async move {
            store
                .claim_refunds(
                    domain::Timestamp::from_unix_milliseconds(milliseconds),
                    10,
                    lease_milliseconds,
                )
                .await
                .expect("claim refunds")
                .len()
        }
    };

    // Each claim is a try the gateway did not confirm (nothing settles the refund
    // here): the next one may come a lease later at first, then twice as long each
    // time, never more than an hour.
    let mut now = app.clock_now().unix_milliseconds();
    let waits_seconds = [30, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600];
    for (tries, wait_seconds) in waits_seconds.into_iter().enumerate() {
        assert_eq!(claimed_at(now).await, 1, "try {tries}");
        let wait = wait_seconds * 1000;
        assert_eq!(claimed_at(now + wait - 1).await, 0, "try {tries}: leased");
        now += wait;
    }
    assert_eq!(claimed_at(now).await, 1);
}

async fn an_order_with_a_payment_in_flight_cannot_be_cancelled(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    let before = app.contents_except_idempotency_records().await;
    let refused = cancel(&app, &order).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("illegal_transition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    // The customer completes the action; the success is applied as usual.
    let intent = intent_of(&gateway, &order).id;
    assert_eq!(gateway.complete_action(&intent).await, 200);
    app.wait_for_order_status(&order, "PAID").await;
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn return_goods(app: &TestApp, order: &str, admin: bool) -> acceptance::TestResponse {
    let call = Call::post(format!("/v1/orders/{order}/return")).key(key("return"));
    app.send(if admin {
        call.admin()
    } else {
        call.anonymous()
    })
    .await
}

async fn a_return_puts_the_goods_back_once_and_keeps_the_sale_status(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let unpaid = app.order_of("user-1", &[(SKU, 1)]).await;
    let order = paid_order(&app, "user-1", 3).await;
    assert_eq!(app.counters(SKU).await, (STOCK - 4, 1));
    let sale_status = app.sku(SKU).await["sale_status"].clone();
    let before = app.contents_except_idempotency_records().await;
    let anonymous = return_goods(&app, &order, false).await;
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    let not_paid = return_goods(&app, &unpaid, true).await;
    assert_eq!(not_paid.status, 409, "{not_paid:?}");
    assert_eq!(not_paid.code().as_deref(), Some("illegal_transition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    let response = return_goods(&app, &order, true).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["returned"], true);
    // The answer names the return's ledger row, which the caller can look up.
    let return_ids = response.json()["return_movement_ids"].clone();
    assert_eq!(return_ids, json!([format!("{order}.return.0")]));
    let row = app
        .send(Call::get(format!("/v1/stock-movements/{order}.return.0")).admin())
        .await;
    assert_eq!(row.status, 200, "{row:?}");
    assert_eq!(
        (
            &row.json()["kind"],
            &row.json()["sku"],
            &row.json()["available_delta"]
        ),
        (&json!("return"), &json!(SKU), &json!(3))
    );
    assert_eq!(
        app.counters(SKU).await,
        (STOCK - 1, 1),
        "three units back on the shelf"
    );
    assert_eq!(app.ledger_rows(SKU, "return").await, 1);
    let after_first = app.contents_except_idempotency_records().await;
    let twice = return_goods(&app, &order, true).await;
    assert_eq!(twice.status, 409, "{twice:?}");
    assert_eq!(twice.code().as_deref(), Some("illegal_transition"));
    assert_eq!(app.contents_except_idempotency_records().await, after_first);
    assert_eq!(app.sku(SKU).await["sale_status"], sale_status);
    assert_eq!(gateway.charges_for(&order), 1);
    app.assert_audit_clean().await;
}

/// Found in review: a reconciliation step went on through its whole batch (50
/// attempts, three gateway calls each, every call up to the gateway's timeout) long
/// after its 30 s lease had ended and another instance could claim the same attempts.
/// Now an attempt is only asked about while its worst case ends within the lease.
async fn reconciliation_asks_about_no_attempt_once_its_lease_could_end_meanwhile(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let mut orders = Vec::new();
    for _ in 0..2 {
        let order = app.order_of("user-1", &[(SKU, 1)]).await;
        let response = app
            .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
            .await;
        assert_eq!(response.status, 202, "{response:?}");
        orders.push(order);
    }
    app.clock.advance_seconds(11);
    let slow = app.another_instance().await;
    let proxy = FlakyGateway::holding(&gateway).await;
    proxy.attach(&slow);
    let step = tokio::spawn(async move { slow.engine.reconcile_step().await });
    acceptance::wait_until("the first attempt's call reaches the gateway", || {
        proxy.calls() == 1
    })
    .await;
    // The gateway answers the first attempt when the lease has too little left for
    // another attempt's calls to end within it.
    app.clock
        .advance_milliseconds(engine::EngineConfig::default().reconcile_lease_milliseconds - 500);
    proxy.let_one_through();
    let resolved = step_within_a_minute(step).await.expect("reconcile step");
    assert_eq!(resolved.len(), 1, "only the first attempt: {resolved:?}");
    assert_eq!(proxy.calls(), 1, "the second attempt was not asked about");
    // The other attempt went back, due at once and its try not counted: another
    // instance asks about it now.
    assert_eq!(
        app.database
            .raw_connection()
            .await
            .texts("SELECT CASE reconcile_tries WHEN 0 THEN 'none' WHEN 1 THEN 'one' END FROM payment_attempt ORDER BY reconcile_tries")
            .await,
        [Some("none".to_owned()), Some("one".to_owned())]
    );
    let resolved = app.engine.reconcile_step().await.expect("reconcile step");
    assert_eq!(resolved.len(), 1, "{resolved:?}");
    for order in &orders {
        assert_statuses(&app, order, ("PAID", "CONFIRMED", "SUCCEEDED")).await;
        assert_eq!(gateway.charges_for(order), 1);
    }
    app.assert_audit_clean().await;
}

/// The refund worker's lease bounds its batch the same way.
async fn the_refund_worker_issues_no_refund_once_its_lease_could_end_meanwhile(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let mut orders = Vec::new();
    for user in ["user-1", "user-2"] {
        let order = paid_order(&app, user, 1).await;
        let cancelled = cancel_as_staff(&app, &order).await;
        assert_eq!(cancelled.status, 200, "{cancelled:?}");
        orders.push(order);
    }
    let slow = app.another_instance().await;
    let proxy = FlakyGateway::holding(&gateway).await;
    proxy.attach(&slow);
    let step = tokio::spawn(async move { slow.engine.refund_step().await });
    acceptance::wait_until("the first refund reaches the gateway", || {
        proxy.calls() == 1
    })
    .await;
    app.clock
        .advance_milliseconds(engine::EngineConfig::default().refund_retry_milliseconds - 500);
    proxy.let_one_through();
    let refunded = step_within_a_minute(step).await.expect("refund step");
    assert_eq!(refunded.len(), 1, "only the first refund: {refunded:?}");
    assert_eq!(proxy.calls(), 1, "the second refund was not sent");
    assert_eq!(gateway.sandbox.stats().refunds, 1);
    assert_eq!(
        app.database
            .raw_connection()
            .await
            .texts("SELECT CASE tries WHEN 0 THEN 'none' WHEN 1 THEN 'one' END FROM refund ORDER BY tries")
            .await,
        [Some("none".to_owned()), Some("one".to_owned())],
        "the unsent refund went back, its try not counted"
    );
    let refunded = app.engine.refund_step().await.expect("refund step");
    assert_eq!(refunded.len(), 1, "{refunded:?}");
    assert_eq!(gateway.sandbox.stats().refunds, 2);
    for order in &orders {
        assert_statuses(&app, order, ("REFUNDED", "CONFIRMED", "SUCCEEDED")).await;
    }
    app.assert_audit_clean().await;
}

/// A worker step spawned by a test, awaited with a bound: a step that calls the
/// holding proxy again (the defect) would otherwise wait for ever.
async fn step_within_a_minute<T>(step: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(60), step)
        .await
        .expect("the step made a call it should not have made, and waits on it")
        .expect("step task")
}

async fn reconciliation_on_two_instances_settles_each_attempt_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let other = app.another_instance().await;
    gateway.attach(&other);
    let mut orders = Vec::new();
    for _ in 0..6 {
        let order = app.order_of("user-1", &[(SKU, 1)]).await;
        let response = app
            .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
            .await;
        assert_eq!(response.status, 202, "{response:?}");
        orders.push(order);
    }
    app.clock.advance_seconds(11);
    let (first, second) = tokio::join!(app.engine.reconcile_step(), other.engine.reconcile_step());
    let mut resolved: Vec<String> = first
        .expect("first instance")
        .into_iter()
        .chain(second.expect("second instance"))
        .map(|(attempt, _)| attempt.as_str().to_owned())
        .collect();
    resolved.sort();
    let count = resolved.len();
    resolved.dedup();
    assert_eq!(resolved.len(), count, "no attempt was claimed twice");
    assert_eq!(count, orders.len());
    for order in &orders {
        assert_statuses(&app, order, ("PAID", "CONFIRMED", "SUCCEEDED")).await;
        assert_eq!(gateway.charges_for(order), 1);
    }
    assert_eq!(app.counters(SKU).await, (STOCK - 6, 0));
    app.assert_audit_clean().await;
}

async fn malformed_order_and_payment_requests_are_refused_and_change_nothing(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    app.create_sku("UNPRICED-MUG").await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let before = app.contents_except_idempotency_records().await;
    let line = |quantity: Value| json!({"user_id": "user-1", "lines": [{"sku": SKU, "quantity": quantity}]});
    let too_many_lines: Vec<Value> = (0..101)
        .map(|index| json!({"sku": format!("SKU-{index}"), "quantity": 1}))
        .collect();
    let bad_orders = [
        line(json!(0)),
        line(json!(-1)),
        line(json!(1.5)),
        line(json!("3")),
        line(json!(1_000_000_000_000_i64)),
        json!({"user_id": "user-1", "lines": []}),
        json!({"user_id": "user-1", "lines": too_many_lines}),
        json!({"lines": [{"sku": SKU, "quantity": 1}]}),
        json!({"user_id": "", "lines": [{"sku": SKU, "quantity": 1}]}),
        json!({"user_id": "x".repeat(200), "lines": [{"sku": SKU, "quantity": 1}]}),
        json!({"user_id": "user 1; DROP TABLE stock", "lines": [{"sku": SKU, "quantity": 1}]}),
        json!({"user_id": "user-1", "lines": [{"sku": SKU, "quantity": 1}], "ttl_seconds": 0}),
        json!({"user_id": "user-1", "lines": [{"sku": SKU, "quantity": 1}], "ttl_seconds": 10_000_000}),
        json!({"user_id": "user-1", "lines": [{"sku": SKU, "quantity": 1}], "amount": 1}),
        json!({"user_id": "user-1", "lines": [{"sku": SKU, "quantity": 1}, {"sku": SKU, "quantity": 2}]}),
        json!({"user_id": "user-1", "lines": [{"sku": "UNPRICED-MUG", "quantity": 1}]}),
        json!([1, 2, 3]),
    ];
    for body in bad_orders {
        let response = app
            .send(Call::post("/v1/orders").key(key("bad-order")).json(&body))
            .await;
        assert!(
            (400..500).contains(&response.status),
            "{body}: {response:?}"
        );
        assert_eq!(
            response.content_type(),
            "application/problem+json",
            "{body}"
        );
        assert!(
            matches!(
                response.code().as_deref(),
                Some("invalid_argument" | "insufficient_stock")
            ),
            "{body}: {response:?}"
        );
    }
    let missing_key = app
        .send(
            Call::post("/v1/orders")
                .json(&json!({"user_id": "u", "lines": [{"sku": SKU, "quantity": 1}]})),
        )
        .await;
    assert_eq!(missing_key.status, 400, "{missing_key:?}");
    let not_json = app
        .send(
            Call::post("/v1/orders")
                .key(key("bad"))
                .raw("{\"user_id\":", Some("application/json")),
        )
        .await;
    assert_eq!(not_json.code().as_deref(), Some("invalid_argument"));
    for method in [
        json!(""),
        json!("pm card"),
        json!("x".repeat(300)),
        json!(5),
        Value::Null,
    ] {
        let response = app
            .send(
                Call::post(format!("/v1/orders/{order}/pay"))
                    .key(key("bad-pay"))
                    .json(&json!({"payment_method": method})),
            )
            .await;
        assert_eq!(response.status, 400, "{method}: {response:?}");
        assert_eq!(response.code().as_deref(), Some("invalid_argument"));
    }
    for path in [
        "/v1/orders/not-an-order/pay",
        "/v1/orders/ord_'%20OR%201=1/pay",
    ] {
        let response = app
            .send(
                Call::post(path)
                    .key(key("bad-pay"))
                    .json(&json!({"payment_method": "pm_card_visa"})),
            )
            .await;
        assert_eq!(response.status, 400, "{path}: {response:?}");
    }
    let unknown = app
        .pay(
            "ord_0000000000000000000000000000",
            &key("pay"),
            "pm_card_visa",
        )
        .await;
    assert_eq!(unknown.status, 404, "{unknown:?}");
    assert_eq!(unknown.code().as_deref(), Some("not_found"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_eq!(
        gateway.sandbox.stats().intents.len(),
        0,
        "the gateway was never called"
    );
}

async fn metrics_count_payment_outcomes_and_show_the_unknown_backlog(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    for method in [
        "pm_card_visa",
        "pm_card_chargeDeclined",
        "pm_sandbox_requires_action",
    ] {
        let order = app.order_of("user-1", &[(SKU, 1)]).await;
        app.pay(&order, &key("pay"), method).await;
    }
    app.clock.advance_seconds(30);
    let resolved = app.engine.reconcile_step().await.expect("reconcile");
    assert_eq!(resolved.len(), 1);
    let text = app.send(Call::get("/metrics").admin()).await.body;
    for line in [
        r#"stockd_payments_total{outcome="succeeded",source="pay"} 1"#,
        r#"stockd_payments_total{outcome="failed",source="pay"} 1"#,
        r#"stockd_payments_total{outcome="unknown",source="pay"} 1"#,
        r#"stockd_reconciliations_total{result="still_unknown"} 1"#,
        "stockd_payment_attempts_unresolved 1",
        "stockd_payment_oldest_unresolved_age_seconds 30",
        "stockd_refunds_pending 0",
    ] {
        assert!(
            text.lines().any(|candidate| candidate == line),
            "{line} missing from:\n{text}"
        );
    }
    assert_eq!(gateway.sandbox.stats().charges, 1);
}

async fn the_audit_catches_an_order_that_disagrees_with_its_reservation(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    let audit = app.audit().await;
    assert_eq!(audit["ok"], true, "{audit:#}");
    assert_eq!(audit["orders_checked"], 1);
    // A lost update (or a hand edit) marks the paid order expired.
    let mut connection = app.database.raw_connection().await;
    let statement = format!("UPDATE customer_order SET status = 'EXPIRED' WHERE id = '{order}'");
    assert_eq!(connection.execute(&statement).await, Ok(1));
    let audit = app.audit().await;
    assert_eq!(audit["ok"], false, "{audit:#}");
    let differences = audit["differences"].as_array().expect("differences");
    assert_eq!(differences.len(), 1, "{audit:#}");
    assert_eq!(differences[0]["check"], "order_vs_reservation_and_payment");
    assert!(
        differences[0]["reference"]
            .as_str()
            .expect("reference")
            .starts_with(&order),
        "{audit:#}"
    );
}

/// Found in review: the audit checked stock, holds and order statuses, never the money:
/// a refunded order whose refund did not go back, a refund of another amount than the
/// charge, a charge of another amount than the order all read as clean. Each hand edit
/// below is now a difference of its own check, and undone, the audit is clean again.
async fn the_audit_catches_money_owed_and_kept_or_given_back_without_cause(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    assert_eq!(cancel_as_staff(&app, &order).await.status, 200);
    assert_eq!(app.engine.refund_step().await.expect("refunds").len(), 1);
    assert_statuses(&app, &order, ("REFUNDED", "CONFIRMED", "SUCCEEDED")).await;
    app.assert_audit_clean().await;
    let mut connection = app.database.raw_connection().await;
    let checks_after = |edit: &'static str, undo: &'static str| {
        let app = app.clone();
        let order = order.clone();
        async move {
            let mut connection = app.database.raw_connection().await;
            let edit = edit.replace("{order}", &order);
            assert_eq!(connection.execute(&edit).await, Ok(1), "{edit}");
            let audit = app.audit().await;
            let undo = undo.replace("{order}", &order);
            assert_eq!(connection.execute(&undo).await, Ok(1), "{undo}");
            let mut checks: Vec<String> = audit["differences"]
                .as_array()
                .expect("differences")
                .iter()
                .map(|difference| difference["check"].as_str().unwrap().to_owned())
                .collect();
            checks.sort();
            checks
        }
    };

    assert_eq!(
        checks_after(
            "UPDATE refund SET status = 'PENDING' WHERE order_id = '{order}'",
            "UPDATE refund SET status = 'SUCCEEDED' WHERE order_id = '{order}'",
        )
        .await,
        ["payment_vs_refund"],
        "a refunded order whose refund never went back"
    );
    assert_eq!(
        checks_after(
            "UPDATE refund SET amount_minor = amount_minor + 1 WHERE order_id = '{order}'",
            "UPDATE refund SET amount_minor = amount_minor - 1 WHERE order_id = '{order}'",
        )
        .await,
        ["refund_amount_vs_payment"],
        "more given back than was charged"
    );
    assert_eq!(
        checks_after(
            "UPDATE payment_attempt SET amount_minor = amount_minor + 1 WHERE order_id = '{order}'",
            "UPDATE payment_attempt SET amount_minor = amount_minor - 1 WHERE order_id = '{order}'",
        )
        .await,
        ["payment_amount_vs_order", "refund_amount_vs_payment"],
        "more charged than the order's amount"
    );
    assert_eq!(
        checks_after(
            "DELETE FROM refund WHERE order_id = '{order}'",
            "INSERT INTO refund (id, order_id, attempt_id, gateway_key, status, amount_minor, currency, reason, \
             next_try_at, created_at, updated_at) \
             SELECT 'rfd_0000000000000000000000000002', order_id, id, 'by-hand', 'SUCCEEDED', amount_minor, currency, \
             'by hand', 0, 0, 0 FROM payment_attempt WHERE order_id = '{order}'",
        )
        .await,
        ["payment_vs_refund"],
        "a refunded order with no refund at all"
    );
    connection
        .execute(&format!(
            "UPDATE refund SET status = 'PENDING' WHERE order_id = '{order}'"
        ))
        .await
        .unwrap();
    connection
        .execute(&format!(
            "UPDATE customer_order SET status = 'PAID' WHERE id = '{order}'"
        ))
        .await
        .unwrap();
    let audit = app.audit().await;
    let checks: Vec<&str> = audit["differences"]
        .as_array()
        .expect("differences")
        .iter()
        .map(|difference| difference["check"].as_str().unwrap())
        .collect();
    assert_eq!(
        checks,
        ["payment_vs_refund"],
        "a paid order with money owed back: {audit:#}"
    );
}

/// Metadata names the attempt, but anyone who can create intents on the same gateway
/// account can write metadata: stockd applies an event only for the intent it created
/// (its id as the gateway answers the attempt's own key, its amount and currency).
async fn a_webhook_about_an_intent_stockd_did_not_create_changes_nothing(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = charged_but_unheard(&app, &gateway).await;
    let before = app.contents_except_idempotency_records().await;

    let mut forged = intent.clone();
    forged.id = "pi_forged_by_someone_else".to_owned();
    let mut cheaper = intent.clone();
    cheaper.amount = 1;
    let mut other_currency = intent.clone();
    other_currency.currency = "usd".to_owned();
    for (label, event_id, tampered) in [
        ("another intent", "evt_forged", &forged),
        ("another amount", "evt_cheaper", &cheaper),
        ("another currency", "evt_currency", &other_currency),
    ] {
        let (payload, signature) = signed_event(&app, event_id, tampered, 0);
        let response = app.send(webhook_call(&payload, Some(&signature))).await;
        assert_eq!(response.status, 200, "{label}: {response:?}");
        assert_eq!(
            app.order_statuses(&order).await,
            (
                "PAYMENT_PROCESSING".to_owned(),
                "RESERVED".to_owned(),
                "PROCESSING".to_owned()
            ),
            "{label}"
        );
    }
    let after = app.contents_except_idempotency_records().await;
    assert_eq!(
        after.split("webhook_event\n").next(),
        before.split("webhook_event\n").next(),
        "only the ignored events were recorded"
    );

    let (payload, signature) = signed_event(&app, "evt_genuine", &intent, 0);
    let genuine = app.send(webhook_call(&payload, Some(&signature))).await;
    assert_eq!(genuine.status, 200, "{genuine:?}");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn sandbox_payment_methods_are_refused_when_the_gateway_is_real(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let gateway = TestGateway::start_as_real_gateway(&app).await;
    app.stocked_sku(SKU, STOCK).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let before = app.contents().await;

    let refused = app
        .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
        .await;

    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents().await, before);
    assert!(gateway.intents_for(&order).is_empty());
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(
        paid.status, 200,
        "a real gateway's method still pays: {paid:?}"
    );
}

/// Issue 13, defect 1: a late success that found no stock leaves the order
/// `REFUND_PENDING` with a released reservation. Those goods never left stock, so
/// they cannot come back: a return would create stock from nothing.
async fn a_return_is_refused_for_an_order_whose_stock_was_given_back(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    paid_order(&app, "user-2", STOCK).await;
    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&order, "REFUND_PENDING").await;
    assert_statuses(&app, &order, ("REFUND_PENDING", "RELEASED", "SUCCEEDED")).await;
    // Deliveries so far: the rival's payment and the late success; then the refund's.
    for (refund_state, deliveries) in [("pending", 2), ("refunded", 3)] {
        wait_for_deliveries(&gateway, deliveries).await;
        let before = app.contents_except_idempotency_records().await;
        let response = return_goods(&app, &order, true).await;
        assert_eq!(response.status, 409, "{refund_state}: {response:?}");
        assert_eq!(response.code().as_deref(), Some("illegal_transition"));
        assert_eq!(app.contents_except_idempotency_records().await, before);
        assert_eq!(app.counters(SKU).await, (0, 0), "no stock from nothing");
        app.engine.refund_step().await.expect("refund step");
    }
    assert_eq!(app.order(&order).await["status"], "REFUNDED");
    assert_eq!(app.ledger_rows(SKU, "return").await, 0);
    app.assert_audit_clean().await;
}

/// Issue 13, defect 1: the audit checks every `return` ledger row against what the
/// order sold, so a return of goods that never left stock cannot hide behind a ledger
/// row that makes the counters agree.
async fn the_audit_catches_a_return_of_goods_that_were_never_sold(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, _intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    let sold = paid_order(&app, "user-2", 3).await;
    let returned = return_goods(&app, &sold, true).await;
    assert_eq!(returned.status, 200, "{returned:?}");
    app.assert_audit_clean().await;
    // A hand edit (or the defect) returns the expired order's two units: counters and
    // ledger agree with each other, but the order sold nothing.
    let mut connection = app.database.raw_connection().await;
    let insert = format!(
        "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
         VALUES ('{SKU}', 'default', 'return', 2, 0, '{order}', NULL, 0)"
    );
    assert_eq!(connection.execute(&insert).await, Ok(1));
    let bump = format!("UPDATE stock SET available = available + 2 WHERE sku = '{SKU}'");
    assert_eq!(connection.execute(&bump).await, Ok(1));
    let audit = app.audit().await;
    assert_eq!(audit["ok"], false, "{audit:#}");
    let differences = audit["differences"].as_array().expect("differences");
    assert_eq!(differences.len(), 1, "{audit:#}");
    assert_eq!(differences[0]["check"], "returned_more_than_sold");
    assert_eq!(differences[0]["reference"], order.as_str());
    assert_eq!(differences[0]["expected"], 0);
    assert_eq!(differences[0]["actual"], 2);
}

/// Found in review: a `return` row that took units away passed the audit whenever the
/// order's returns still summed to no more than it sold, with the counters moved along
/// (the units lost, unseen). Every return row must put units back.
async fn the_audit_catches_a_return_row_that_takes_units_away(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let sold = paid_order(&app, "user-2", 3).await;
    let returned = return_goods(&app, &sold, true).await;
    assert_eq!(returned.status, 200, "{returned:?}");
    app.assert_audit_clean().await;
    let mut connection = app.database.raw_connection().await;
    let insert = format!(
        "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
         VALUES ('{SKU}', 'default', 'return', -1, 0, '{sold}', NULL, 0)"
    );
    assert_eq!(connection.execute(&insert).await, Ok(1));
    let lose = format!("UPDATE stock SET available = available - 1 WHERE sku = '{SKU}'");
    assert_eq!(connection.execute(&lose).await, Ok(1));

    let audit = app.audit().await;

    assert_eq!(audit["ok"], false, "{audit:#}");
    let differences = audit["differences"].as_array().expect("differences");
    assert_eq!(differences.len(), 1, "{audit:#}");
    assert_eq!(differences[0]["check"], "return_not_an_increase");
    assert_eq!(differences[0]["reference"], sold.as_str());
    assert_eq!(differences[0]["actual"], -1);
}

/// Issue 13, defect 2: a success after the hold ended takes the stock again only as a
/// new sale would: a SKU taken off the shelf (or deleted) meanwhile is not sold again,
/// and the order is refunded instead.
async fn late_success_after_a_shelf_change(backend: Backend, operation: &str) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    let changed = app
        .shelf(None, json!({"operation": operation, "sku_ids": [SKU]}))
        .await;
    assert_eq!(changed.status, 200, "{changed:?}");
    assert_eq!(gateway.force_success(&intent).await, 200);
    app.wait_for_order_status(&order, "REFUND_PENDING").await;
    assert_statuses(&app, &order, ("REFUND_PENDING", "RELEASED", "SUCCEEDED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0), "nothing sold again");
    assert_eq!(
        app.engine.refund_step().await.expect("refund step").len(),
        1
    );
    assert_eq!(app.order(&order).await["status"], "REFUNDED");
    app.assert_audit_clean().await;
}

async fn a_success_after_the_hold_ended_is_refunded_when_the_sku_went_off_the_shelf(
    backend: Backend,
) {
    late_success_after_a_shelf_change(backend, "off").await;
}

async fn a_success_after_the_hold_ended_is_refunded_when_the_sku_was_deleted(backend: Backend) {
    late_success_after_a_shelf_change(backend, "delete").await;
}

/// Issue 13, defect 6: nothing to charge is not an order; the gateway would refuse it
/// and the stock would wait for an answer that never comes.
async fn an_order_whose_total_is_zero_is_refused_and_changes_nothing(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let free = app
        .send(
            Call::put("/v1/skus/FREE-SAMPLE")
                .admin()
                .key(key("sku"))
                .json(&json!({"title": "Free sample", "price": 0, "currency": "CNY"})),
        )
        .await;
    assert_eq!(free.status, 201, "{free:?}");
    app.receive("FREE-SAMPLE", 5).await;
    let before = app.contents_except_idempotency_records().await;
    let response = app
        .create_order(&key("order"), "user-1", &[("FREE-SAMPLE", 2)])
        .await;
    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    app.assert_audit_clean().await;
}

/// Issue 13, defect 6: a definitive refusal (a 4xx other than 409/429) is a failure,
/// not an unknown outcome: the attempt fails at once and nothing is left to reconcile
/// (the order keeps its hold for another payment method, as after a decline).
async fn a_payment_method_the_gateway_does_not_know_fails_the_attempt_at_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let response = app.pay(&order, &key("pay"), "pm_card_doesNotExist").await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["status"], "PAYMENT_FAILED");
    assert_statuses(&app, &order, ("PAYMENT_FAILED", "RESERVED", "FAILED")).await;
    let view = app.order(&order).await;
    let reason = view["payment"]["failure_reason"]
        .as_str()
        .unwrap_or_default();
    assert!(reason.contains("payment_method"), "{view:#}");
    assert_eq!(
        app.counters(SKU).await,
        (STOCK - 2, 2),
        "held for another method"
    );
    assert_eq!(gateway.charges_for(&order), 0);
    assert!(
        gateway.intents_for(&order).is_empty(),
        "no intent was created"
    );
    assert_eq!(app.engine.reconcile_step().await.expect("reconcile"), []);
    app.assert_audit_clean().await;
}

/// Issue 13, defect 6: a refund the gateway refuses (here: the payment was refunded
/// from the gateway's dashboard already) is marked failed, counted for the alert and
/// left for a person; it is not sent again for ever.
async fn a_refund_the_gateway_refuses_is_marked_failed_and_not_tried_again(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    let intent = intent_of(&gateway, &order).id;
    assert_eq!(gateway.refund_outside_stockd(&intent).await, 200);
    let cancelled = cancel_as_staff(&app, &order).await;
    assert_eq!(cancelled.status, 200, "{cancelled:?}");
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    let view = app.order(&order).await;
    assert_eq!(view["status"], "REFUND_PENDING", "{view:#}");
    assert_eq!(view["refund"]["status"], "FAILED", "{view:#}");
    assert_eq!(
        gateway.sandbox.stats().refunds,
        1,
        "only the dashboard's refund"
    );
    app.clock.advance_seconds(24 * 3600);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    assert_eq!(gateway.sandbox.stats().refunds, 1);
    let metrics = app.send(Call::get("/metrics").admin()).await.body;
    assert!(metrics.contains("stockd_refunds_failed 1"), "{metrics}");
    assert!(
        metrics.contains("stockd_refunds_total{result=\"refused\"} 1"),
        "{metrics}"
    );
    app.assert_audit_clean().await;
}

/// A cancelled paid order whose refund the gateway refused, and the refund's id.
async fn refused_refund(app: &TestApp, gateway: &TestGateway) -> (String, String) {
    let order = paid_order(app, "user-1", 1).await;
    gateway.sandbox.answer_next_refunds_with("failed", 1);
    let cancelled = cancel_as_staff(app, &order).await;
    assert_eq!(cancelled.status, 200, "{cancelled:?}");
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    let view = app.order(&order).await;
    assert_eq!(view["refund"]["status"], "FAILED", "{view:#}");
    let refund = view["refund"]["refund_id"].as_str().unwrap().to_owned();
    (order, refund)
}

fn resolve_call(order: &str, refund: &str, key: &str, body: Value) -> Call {
    Call::post(format!("/v1/orders/{order}/refunds/{refund}/resolve"))
        .key(key)
        .json(&body)
}

/// Found in review: a refund the gateway refused was `FAILED` for good, its order
/// `REFUND_PENDING` and `StockdRefundRefused` firing for ever, and nothing but a hand
/// edit could move either. Staff now decide: here, once the bank says yes, the refund
/// is sent again as a new refund (a new gateway key) and settles the order.
async fn a_refund_the_gateway_refused_is_sent_again_when_staff_decide_so(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, refund) = refused_refund(&app, &gateway).await;
    let body = json!({"resolution": "send_again", "remark": "the bank lifted its block"});

    let resolved = app
        .send(resolve_call(&order, &refund, "resolve-1", body.clone()).admin())
        .await;

    assert_eq!(resolved.status, 200, "{resolved:?}");
    let view = resolved.json();
    assert_eq!(view["status"], "REFUND_PENDING", "{view:#}");
    assert_eq!(view["refund"]["status"], "PENDING", "{view:#}");
    assert_eq!(view["refund"]["resolution"]["resolution"], "send_again");
    assert_eq!(view["refund"]["resolution"]["by"], "admin");
    assert_eq!(
        view["refund"]["resolution"]["remark"],
        "the bank lifted its block"
    );
    let replay = app
        .send(resolve_call(&order, &refund, "resolve-1", body).admin())
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, resolved.body);
    let settled = app.engine.refund_step().await.expect("refund step");
    assert_eq!(settled.len(), 1, "sent again and settled");
    let view = app.order(&order).await;
    assert_eq!(view["status"], "REFUNDED", "{view:#}");
    assert_eq!(view["refund"]["status"], "SUCCEEDED", "{view:#}");
    assert_eq!(
        gateway.sandbox.stats().refunds,
        2,
        "the refused refund and the new one"
    );
    let metrics = app.send(Call::get("/metrics").admin()).await.body;
    assert!(metrics.contains("stockd_refunds_failed 0"), "{metrics}");
    app.assert_audit_clean().await;
}

/// The other decision: the payment was refunded from the gateway's dashboard (so the
/// gateway refused stockd's refund), and an operator of the shop records that. The
/// order is `REFUNDED`, nothing is sent, and who decided is kept.
async fn a_refund_settled_outside_stockd_is_recorded_and_its_order_is_refunded(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    let intent = intent_of(&gateway, &order).id;
    assert_eq!(gateway.refund_outside_stockd(&intent).await, 200);
    assert_eq!(cancel_as_staff(&app, &order).await.status, 200);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    let refund = app.order(&order).await["refund"]["refund_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let olga = app.create_operator("olga", "default").await;

    let resolved = app
        .send(
            resolve_call(
                &order,
                &refund,
                "resolve-elsewhere",
                json!({"resolution": "refunded_elsewhere", "remark": "refunded from the dashboard"}),
            )
            .bearer(&olga),
        )
        .await;

    assert_eq!(resolved.status, 200, "{resolved:?}");
    let view = resolved.json();
    assert_eq!(view["status"], "REFUNDED", "{view:#}");
    assert_eq!(view["refund"]["status"], "SUCCEEDED", "{view:#}");
    assert_eq!(view["refund"]["resolution"]["by"], "operator:olga");
    let last = view["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["to"], "REFUNDED", "{view:#}");
    assert!(
        last["reason"].as_str().unwrap().contains("outside stockd"),
        "{view:#}"
    );
    app.clock.advance_seconds(24 * 3600);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    assert_eq!(
        gateway.sandbox.stats().refunds,
        1,
        "only the dashboard's refund"
    );
    app.assert_audit_clean().await;
}

/// A refund still owed (or settled) is not a person's to resolve: 409, and nothing
/// changes; nor do an unknown refund, another order's refund or a malformed request.
async fn only_a_refused_refund_is_resolved_and_bad_requests_change_nothing(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (refused_order, refused) = refused_refund(&app, &gateway).await;
    let owed_order = paid_order(&app, "user-2", 1).await;
    assert_eq!(cancel_as_staff(&app, &owed_order).await.status, 200);
    let owed = app.order(&owed_order).await["refund"]["refund_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let good = |resolution: &str| json!({"resolution": resolution, "remark": "checked"});
    let long_remark = "x".repeat(domain::limits::REMARK_LENGTH_MAX + 1);
    let cases = vec![
        (
            "a refund still owed",
            resolve_call(&owed_order, &owed, "r-1", good("send_again")),
            409,
            "illegal_transition",
        ),
        (
            "a refund still owed, settled elsewhere",
            resolve_call(&owed_order, &owed, "r-2", good("refunded_elsewhere")),
            409,
            "illegal_transition",
        ),
        (
            "another order's refund",
            resolve_call(&owed_order, &refused, "r-3", good("send_again")),
            404,
            "not_found",
        ),
        (
            "an unknown refund",
            resolve_call(
                &refused_order,
                "rfd_0000000000000000000000000000",
                "r-4",
                good("send_again"),
            ),
            404,
            "not_found",
        ),
        (
            "an unknown order",
            resolve_call(
                "ord_0000000000000000000000000000",
                &refused,
                "r-5",
                good("send_again"),
            ),
            404,
            "not_found",
        ),
        (
            "a malformed refund id",
            resolve_call(&refused_order, "refund-1", "r-6", good("send_again")),
            400,
            "invalid_argument",
        ),
        (
            "an unknown resolution",
            resolve_call(&refused_order, &refused, "r-7", good("forget_it")),
            400,
            "invalid_argument",
        ),
        (
            "no remark",
            resolve_call(
                &refused_order,
                &refused,
                "r-8",
                json!({"resolution": "send_again"}),
            ),
            400,
            "invalid_argument",
        ),
        (
            "a blank remark",
            resolve_call(
                &refused_order,
                &refused,
                "r-9",
                json!({"resolution": "send_again", "remark": "   "}),
            ),
            400,
            "invalid_argument",
        ),
        (
            "a remark with a control character",
            resolve_call(
                &refused_order,
                &refused,
                "r-10",
                json!({"resolution": "send_again", "remark": "ok\u{7}"}),
            ),
            400,
            "invalid_argument",
        ),
        (
            "a remark too long",
            resolve_call(
                &refused_order,
                &refused,
                "r-11",
                json!({"resolution": "send_again", "remark": long_remark}),
            ),
            400,
            "invalid_argument",
        ),
        (
            "an unknown field",
            resolve_call(
                &refused_order,
                &refused,
                "r-12",
                json!({"resolution": "send_again", "remark": "ok", "amount": 1}),
            ),
            400,
            "invalid_argument",
        ),
    ];
    let orders_before = (
        app.order(&refused_order).await,
        app.order(&owed_order).await,
    );
    for (label, call, status, code) in cases {
        // A malformed request stores nothing; a refusal of the stored state (404,
        // 409) is stored under its key, and changes nothing else.
        let before = app.contents().await;
        let response = app.send(call.admin()).await;
        assert_eq!(response.status, status, "{label}: {response:?}");
        assert_eq!(response.code().as_deref(), Some(code), "{label}");
        assert_eq!(
            response.content_type(),
            "application/problem+json",
            "{label}"
        );
        if status == 400 {
            assert_eq!(app.contents().await, before, "{label}: nothing changed");
        }
    }
    let orders_after = (
        app.order(&refused_order).await,
        app.order(&owed_order).await,
    );
    assert_eq!(
        orders_after, orders_before,
        "neither order nor refund moved"
    );
    app.assert_audit_clean().await;
}

/// Issue 13, defect 10: ten lines of a million units at the highest price sum past
/// `i64::MAX`; the total is summed with checked arithmetic and the order refused.
async fn an_order_whose_total_does_not_fit_in_64_bits_is_refused_and_changes_nothing(
    backend: Backend,
) {
    let (app, _gateway) = shop(backend).await;
    let skus: Vec<String> = (0..10).map(|index| format!("GOLD-{index}")).collect();
    for sku in &skus {
        let created = app
            .send(Call::put(format!("/v1/skus/{sku}")).admin().key(key("sku")).json(
                &json!({"title": "Gold bar", "price": domain::limits::PRICE_MINOR_MAX, "currency": "CNY"}),
            ))
            .await;
        assert_eq!(created.status, 201, "{created:?}");
        app.receive(sku, domain::limits::QUANTITY_MAX).await;
    }
    let lines: Vec<(&str, i64)> = skus
        .iter()
        .map(|sku| (sku.as_str(), domain::limits::QUANTITY_MAX))
        .collect();
    let before = app.contents_except_idempotency_records().await;
    let response = app.create_order(&key("order"), "user-1", &lines).await;
    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

/// Makes the database refuse to store any answer under a key containing
/// `crash-answer`: the effect of a use case that stores its answer apart would then
/// commit without it, as after a crash between the two. A claim without an answer
/// (`status_code` 0, withdrawn before its transaction commits) is let through.
async fn refuse_answers_for_crash_keys(app: &TestApp) {
    let mut connection = app.database.raw_connection().await;
    let statements: &[&str] = match app.backend() {
        Backend::Sqlite => &[
            "CREATE TRIGGER refuse_crash_answer BEFORE INSERT ON idempotency_record \
             WHEN NEW.key LIKE '%crash-answer%' AND NEW.status_code <> 0 \
             BEGIN SELECT RAISE(ABORT, 'injected crash'); END",
            "CREATE TRIGGER refuse_crash_answer_update BEFORE UPDATE ON idempotency_record \
             WHEN NEW.key LIKE '%crash-answer%' BEGIN SELECT RAISE(ABORT, 'injected crash'); END",
        ],
        Backend::Postgres => &[
            "CREATE FUNCTION refuse_crash_answer() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.key LIKE '%crash-answer%' AND NEW.status_code <> 0 THEN \
             RAISE EXCEPTION 'injected crash'; END IF; \
             RETURN NEW; END $$",
            "CREATE TRIGGER refuse_crash_answer BEFORE INSERT OR UPDATE ON idempotency_record \
             FOR EACH ROW EXECUTE FUNCTION refuse_crash_answer()",
        ],
        Backend::Mysql => &[
            "CREATE TRIGGER refuse_crash_answer BEFORE INSERT ON idempotency_record FOR EACH ROW \
             BEGIN IF NEW.key LIKE '%crash-answer%' AND NEW.status_code <> 0 THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected crash'; END IF; END",
            "CREATE TRIGGER refuse_crash_answer_update BEFORE UPDATE ON idempotency_record FOR EACH ROW \
             BEGIN IF NEW.key LIKE '%crash-answer%' THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected crash'; END IF; END",
        ],
    };
    for statement in statements {
        assert_eq!(connection.execute(statement).await, Ok(0), "{statement}");
    }
}

/// Issue 13, defect 5: the pay call's answer commits in the transaction that applies
/// the gateway's answer. When the answer cannot be stored, nothing of the settle is
/// kept either: the order is still processing and a retry (or reconciliation) settles
/// it, with the gateway's keyed replay, charging once.
async fn a_pay_answer_is_kept_with_its_effect_or_not_at_all(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    refuse_answers_for_crash_keys(&app).await;
    let pay_key = key("pay-crash-answer");
    let crashed = app.pay(&order, &pay_key, "pm_sandbox_no_webhook").await;
    assert_eq!(crashed.status, 500, "{crashed:?}");
    assert_eq!(gateway.charges_for(&order), 1, "the money moved");
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    let stored_key = app.stored_key(&pay_key).await;
    assert!(
        !app.contents().await.contains(&stored_key),
        "no answer stored without its effect"
    );
    let mut connection = app.database.raw_connection().await;
    for trigger in ["refuse_crash_answer", "refuse_crash_answer_update"] {
        let drop = format!(
            "DROP TRIGGER IF EXISTS {trigger}{}",
            match app.backend() {
                Backend::Sqlite | Backend::Mysql => String::new(),
                Backend::Postgres => " ON idempotency_record".to_owned(),
            }
        );
        assert!(connection.execute(&drop).await.is_ok(), "{drop}");
    }
    let retried = app.pay(&order, &pay_key, "pm_sandbox_no_webhook").await;
    assert_eq!(retried.status, 200, "{retried:?}");
    assert_eq!(retried.json()["status"], "PAID");
    let replayed = app.pay(&order, &pay_key, "pm_sandbox_no_webhook").await;
    assert!(replayed.replayed());
    assert_eq!(replayed.body, retried.body);
    assert_paid_once(&app, &gateway, &order, 2).await;
}

/// Issue 13: the shelf race of a reservation, through a late success: the payment's
/// webhook arrives while a shelf change holds the SKU's stock rows, and the stock is
/// not taken again for a SKU that change took off the shelf.
async fn a_late_success_waiting_behind_a_shelf_change_sees_the_sku_go_off_the_shelf(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = order_abandoned_while_awaiting_action(&app, &gateway, 2).await;
    let mut shelf_change = app.database.hold_stock_row_lock(SKU).await;
    assert_eq!(gateway.force_success(&intent).await, 200);
    app.database.wait_until_blocked_by(&mut shelf_change).await;
    shelf_change
        .execute(&format!(
            "UPDATE sku SET sale_status = 'OFF_SHELF', version = version + 1 WHERE code = '{SKU}'"
        ))
        .await
        .expect("take the SKU off the shelf");
    shelf_change.execute("COMMIT").await.expect("commit");
    app.wait_for_order_status(&order, "REFUND_PENDING").await;
    assert_statuses(&app, &order, ("REFUND_PENDING", "RELEASED", "SUCCEEDED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    app.assert_audit_clean().await;
}

/// An order paid by a second card after its first was declined, whose declined intent
/// the gateway then completes after all, that success's webhook delivered: the order
/// and the declined (now charged) intent.
async fn a_second_charge(app: &TestApp, gateway: &TestGateway) -> (String, String) {
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    app.pay(&order, &key("pay"), "pm_card_chargeDeclined").await;
    let declined_intent = intent_of(gateway, &order).id;
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(paid.json()["status"], "PAID", "{paid:?}");
    wait_for_deliveries(gateway, 2).await;
    assert_eq!(gateway.force_success(&declined_intent).await, 200);
    wait_for_deliveries(gateway, 3).await;
    (order, declined_intent)
}

/// Found by the state machine test: a gateway that completes a declined intent after
/// another card paid the order charges it twice. The second charge is recorded, not
/// applied, and refunded on its own; the order stays paid, with one charge kept.
async fn a_second_charge_for_a_paid_order_is_refunded_and_the_order_stays_paid(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, _) = a_second_charge(&app, &gateway).await;
    let view = app.order(&order).await;
    assert_eq!(view["status"], "PAID", "{view:#}");
    assert_eq!(
        view["refunds"].as_array().map(Vec::len),
        Some(1),
        "{view:#}"
    );
    assert_eq!(view["refunds"][0]["status"], "PENDING");
    assert!(
        view["refund"].is_null(),
        "the paying charge is not refunded"
    );
    assert_eq!(gateway.charges_for(&order), 2);
    assert_eq!(
        app.engine.refund_step().await.expect("refund step").len(),
        1
    );
    let view = app.order(&order).await;
    assert_eq!(view["status"], "PAID", "{view:#}");
    assert_eq!(view["refunds"][0]["status"], "SUCCEEDED");
    assert_eq!(gateway.sandbox.stats().refunds, 1);
    assert_eq!(app.counters(SKU).await, (STOCK - 1, 0));
    app.assert_audit_clean().await;
}

/// Found in review: a second charge, once recorded (its attempt `FAILED`, its refund
/// written), heard again — the same webhook redelivered because its acknowledgement
/// was lost, the same payment under another event id, or the pay call's answer
/// arriving after the webhook's — was applied again: the refund's insert found the
/// first one and the answer was a 500, every time, so the gateway kept redelivering.
/// It is answered now (a redelivery as a duplicate), and refunded once.
async fn a_second_charge_heard_again_is_answered_and_refunded_once(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, declined_intent) = a_second_charge(&app, &gateway).await;
    assert_eq!(
        app.order(&order).await["refunds"].as_array().map(Vec::len),
        Some(1)
    );
    let succeeded = gateway
        .intents_for(&order)
        .into_iter()
        .find(|intent| intent.id == declined_intent)
        .expect("the second charge's intent");
    let events_before = app.webhook_events().await;
    let (payload, signature) = signed_event(&app, "evt_second_again", &succeeded, 0);

    let again = app.send(webhook_call(&payload, Some(&signature))).await;
    let redelivered = app.send(webhook_call(&payload, Some(&signature))).await;

    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(redelivered.status, 200, "{redelivered:?}");
    assert_eq!(redelivered.json()["duplicate"], true, "{redelivered:?}");
    let view = app.order(&order).await;
    assert_eq!(view["status"], "PAID", "{view:#}");
    assert_eq!(
        view["refunds"].as_array().map(Vec::len),
        Some(1),
        "{view:#}"
    );
    assert_eq!(app.webhook_events().await, events_before + 1);
    assert_eq!(
        app.engine.refund_step().await.expect("refund step").len(),
        1
    );
    assert_eq!(gateway.sandbox.stats().refunds, 1);
    app.assert_audit_clean().await;
}

/// Found in review: an attempt waiting for the shopper's 3-D Secure step was looked at
/// less and less often (the lease, then doubling), though the gateway answered each
/// time, so a payment abandoned there kept its stock well past the hold: paid 600 s
/// into a 900 s hold, it was given back at 1,060 s (with a day's hold, up to an hour
/// late). A look is never put past the hold's end, so the first one after it cancels
/// the payment and gives the stock back.
async fn an_abandoned_3ds_payment_gives_its_stock_back_at_the_first_look_after_the_hold(
    backend: Backend,
) {
    let (app, _gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    app.clock.advance_seconds(600);
    let pending = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(pending.status, 202, "{pending:?}");

    let mut given_back_at = None;
    for step in 1..=60 {
        app.clock.advance_seconds(10);
        app.engine.reconcile_step().await.expect("reconcile step");
        if app.order(&order).await["status"] == "EXPIRED" {
            given_back_at = Some(600 + step * 10);
            break;
        }
    }

    assert_eq!(given_back_at, Some(900), "seconds after the order");
    assert_eq!(app.counters(SKU).await, (STOCK, 0));
    app.assert_audit_clean().await;
}

/// Issue 13, defect 6: a gateway answering 5xx leaves the outcome unknown, asked about
/// again after the lease, then twice as long after every look that learns nothing.
async fn an_unknown_outcome_is_asked_about_less_and_less_often(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (other, proxy) = FlakyGateway::refusing_in_front_of(&app, &gateway).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let unknown = other.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(unknown.status, 202, "{unknown:?}");
    assert_eq!(unknown.code().as_deref(), Some("payment_unknown"));
    // Looked at 10 s after the call, then after 30, 60 and 120 seconds more.
    let mut looks = Vec::new();
    for _ in 0..22 {
        app.clock.advance_seconds(10);
        let claimed = other.engine.reconcile_step().await.expect("reconcile step");
        looks.push(claimed.len());
    }
    let at: Vec<usize> = looks
        .iter()
        .enumerate()
        .filter(|(_, claimed)| **claimed > 0)
        .map(|(index, _)| (index + 1) * 10)
        .collect();
    assert_eq!(at, [10, 40, 100, 220], "seconds after the call: {looks:?}");
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    proxy.stop_refusing();
    app.clock.advance_seconds(240);
    other.engine.reconcile_step().await.expect("reconcile step");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

/// Found in review: a pay answered 202 stores nothing; when reconciliation then learns
/// the attempt was declined, a retry of that request (same key) must learn the decline,
/// not start a second attempt (a second charge, had the card been good this time).
async fn a_retry_of_a_pay_whose_attempt_was_declined_meanwhile_learns_the_decline(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let (other, proxy) = FlakyGateway::refusing_in_front_of(&app, &gateway).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let pay_key = key("pay");
    let unknown = other.pay(&order, &pay_key, "pm_card_chargeDeclined").await;
    assert_eq!(unknown.status, 202, "{unknown:?}");
    app.clock.advance_seconds(10);
    assert_eq!(
        app.engine.reconcile_step().await.expect("reconcile").len(),
        1
    );
    assert_statuses(&app, &order, ("PAYMENT_FAILED", "RESERVED", "FAILED")).await;
    proxy.stop_refusing();
    for instance in [&app, &other] {
        let retried = instance
            .pay(&order, &pay_key, "pm_card_chargeDeclined")
            .await;
        assert_eq!(retried.status, 200, "{retried:?}");
        assert_eq!(retried.json()["status"], "PAYMENT_FAILED");
    }
    let view = app.order(&order).await;
    assert_eq!(
        view["payment_attempts"].as_array().map(Vec::len),
        Some(1),
        "{view:#}"
    );
    assert_eq!(gateway.intents_for(&order).len(), 1, "nothing sent again");
    // Another card, another request: that one may pay.
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(paid.json()["status"], "PAID", "{paid:?}");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

async fn a_refund_the_gateway_answers_failed_or_pending_is_not_refunded_until_it_succeeds(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let failed = paid_order(&app, "user-1", 1).await;
    let pending = paid_order(&app, "user-2", 1).await;

    gateway.sandbox.answer_next_refunds_with("failed", 1);
    assert_eq!(cancel_as_staff(&app, &failed).await.status, 200);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    gateway.sandbox.answer_next_refunds_with("pending", 1);
    assert_eq!(cancel_as_staff(&app, &pending).await.status, 200);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);

    let view = app.order(&failed).await;
    assert_eq!(view["status"], "REFUND_PENDING", "{view:#}");
    assert_eq!(
        view["refund"]["status"], "FAILED",
        "a person decides: {view:#}"
    );
    let view = app.order(&pending).await;
    assert_eq!(view["status"], "REFUND_PENDING", "{view:#}");
    assert_eq!(
        view["refund"]["status"], "PENDING",
        "asked again later: {view:#}"
    );
    let metrics = app.send(Call::get("/metrics").admin()).await.body;
    assert!(metrics.contains("stockd_refunds_failed 1"), "{metrics}");

    // Still pending when read again; once the bank answered, the next read settles it.
    app.clock.advance_seconds(3600);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    assert_eq!(gateway.sandbox.complete_pending_refunds(), 1);
    app.clock.advance_seconds(3600);
    assert_eq!(
        app.engine.refund_step().await.expect("refund step").len(),
        1
    );
    assert_eq!(app.order(&pending).await["status"], "REFUNDED");
    assert_eq!(
        app.order(&failed).await["status"],
        "REFUND_PENDING",
        "a person decides"
    );
    assert_eq!(
        gateway.sandbox.stats().refunds,
        2,
        "each refund created once at the gateway, the pending one read, not sent again"
    );
    // A refund's status changes once, from PENDING (`REFUND_TRANSITIONS`): a settled
    // one cannot be failed, nor a failed one settled; the same answer again is a no-op.
    let refund_of = |view: Value| {
        domain::RefundId::parse(view["refund"]["refund_id"].as_str().unwrap()).unwrap()
    };
    let (settled, refused) = (
        refund_of(app.order(&pending).await),
        refund_of(app.order(&failed).await),
    );
    let now = app.clock_now();
    let before = app.contents().await;
    assert!(app.store.fail_refund(&settled, "late", now).await.is_err());
    assert!(
        app.store
            .settle_refund(&refused, "re_late", now)
            .await
            .is_err()
    );
    app.store
        .settle_refund(&settled, "re_again", now)
        .await
        .unwrap();
    app.store.fail_refund(&refused, "again", now).await.unwrap();
    assert_eq!(app.contents().await, before, "nothing changed");
    app.assert_audit_clean().await;
}

async fn a_pay_key_whose_answer_is_not_stored_yet_is_refused_for_another_payment(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let first = app.order_of("user-1", &[(SKU, 1)]).await;
    let second = app.order_of("user-2", &[(SKU, 1)]).await;
    let pay_key = key("pay");
    // The first payment waits for the customer: its answer is unknown, nothing stored.
    let waiting = app
        .pay(&first, &pay_key, "pm_sandbox_requires_action")
        .await;
    assert_eq!(waiting.status, 202, "{waiting:?}");
    let before = app.contents().await;

    let other_order = app.pay(&second, &pay_key, "pm_card_visa").await;
    let other_method = app.pay(&first, &pay_key, "pm_card_visa").await;
    let same_again = app
        .pay(&first, &pay_key, "pm_sandbox_requires_action")
        .await;

    for reused in [&other_order, &other_method] {
        assert_eq!(reused.status, 422, "{reused:?}");
        assert_eq!(reused.code().as_deref(), Some("idempotency_key_reused"));
    }
    assert_eq!(
        same_again.status, 202,
        "the same request learns its outcome: {same_again:?}"
    );
    assert_eq!(app.contents().await, before, "no charge, no change");
    assert_eq!(gateway.charges_for(&second), 0);
    assert_statuses(&app, &second, ("PENDING_PAYMENT", "RESERVED", "none")).await;
    // Keys are remembered for a day: past it the key names a new payment.
    app.clock.advance_seconds(24 * 3600 + 1);
    let later = app.order_of("user-3", &[(SKU, 1)]).await;
    let reused_later = app.pay(&later, &pay_key, "pm_card_visa").await;
    assert_eq!(reused_later.status, 200, "{reused_later:?}");
}

async fn a_pending_refund_the_gateway_cannot_find_is_left_to_a_person_saying_so(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = paid_order(&app, "user-1", 1).await;
    gateway.sandbox.answer_next_refunds_with("pending", 1);
    assert_eq!(cancel_as_staff(&app, &order).await.status, 200);
    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);
    gateway.sandbox.forget_refunds();
    app.clock.advance_seconds(3600);

    assert_eq!(app.engine.refund_step().await.expect("refund step"), []);

    let view = app.order(&order).await;
    assert_eq!(view["status"], "REFUND_PENDING", "{view:#}");
    assert_eq!(view["refund"]["status"], "FAILED", "{view:#}");
    let reason = view["refund"]["failure_reason"]
        .as_str()
        .unwrap_or_default();
    assert!(reason.contains("could not be read"), "{view:#}");
    app.assert_audit_clean().await;
}

async fn a_refund_settled_elsewhere_meanwhile_does_not_hold_up_the_rest_of_its_batch(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One writer: no other instance can settle a refund between a claim and its
        // answer, and no row lock to hold the worker at that point.
        return;
    }
    let (app, _gateway) = shop(backend).await;
    let first = paid_order(&app, "user-1", 1).await;
    let second = paid_order(&app, "user-2", 1).await;
    assert_eq!(cancel_as_staff(&app, &first).await.status, 200);
    app.clock.advance_seconds(1);
    assert_eq!(cancel_as_staff(&app, &second).await.status, 200);
    let first_refund = app.order(&first).await["refund"]["refund_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Holding the first order's lock stops the worker right before it records the
    // first refund's answer; meanwhile another instance (past its lease) records
    // another answer for it.
    let mut other_instance = app.database.raw_connection().await;
    other_instance.execute("BEGIN").await.unwrap();
    other_instance
        .execute(&format!(
            "SELECT status FROM customer_order WHERE id = '{first}' FOR UPDATE"
        ))
        .await
        .unwrap();
    let engine = app.engine.clone();
    let step = tokio::spawn(async move { engine.refund_step().await });
    app.database
        .wait_until_blocked_by(&mut other_instance)
        .await;
    other_instance
        .execute(&format!(
            "UPDATE refund SET status = 'FAILED', failure_reason = 'settled elsewhere' WHERE id = '{first_refund}'"
        ))
        .await
        .unwrap();
    other_instance.execute("COMMIT").await.unwrap();

    let settled = step
        .await
        .unwrap()
        .expect("the step goes on past the first refund");

    assert_eq!(settled.len(), 1, "{settled:?}");
    assert_eq!(app.order(&second).await["status"], "REFUNDED");
    let view = app.order(&first).await;
    assert_eq!(
        view["refund"]["status"], "FAILED",
        "the other answer stands: {view:#}"
    );
}

async fn a_reconciled_answer_that_cannot_be_applied_does_not_hold_up_the_rest_of_its_batch(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One writer and no row lock to hold one order while the other is settled.
        return;
    }
    let app =
        TestApp::spawn_with_lock_timeout(backend, acceptance::test_engine_config(), 100).await;
    let gateway = TestGateway::start(&app).await;
    app.stocked_sku(SKU, STOCK).await;
    gateway.sandbox.stop_webhooks();
    let mut orders = Vec::new();
    for user in ["user-1", "user-2"] {
        let order = app.order_of(user, &[(SKU, 1)]).await;
        let response = app
            .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
            .await;
        assert_eq!(response.status, 202, "{response:?}");
        orders.push(order);
    }
    // Another session holds the first order: applying its answer times out on the lock.
    let mut holder = app.database.raw_connection().await;
    holder.execute("BEGIN").await.unwrap();
    holder
        .execute(&format!(
            "SELECT status FROM customer_order WHERE id = '{}' FOR UPDATE",
            orders[0]
        ))
        .await
        .unwrap();
    app.clock.advance_seconds(11);

    let resolved = app
        .engine
        .reconcile_step()
        .await
        .expect("the step goes on past the attempt it could not settle");

    assert_eq!(resolved.len(), 2, "{resolved:?}");
    assert_statuses(&app, &orders[1], ("PAID", "CONFIRMED", "SUCCEEDED")).await;
    holder.execute("ROLLBACK").await.unwrap();
    assert_eq!(app.order(&orders[0]).await["status"], "PAYMENT_PROCESSING");
    // After its lease the attempt is asked again, and its answer applied.
    app.clock.advance_seconds(3_600);
    app.engine.reconcile_step().await.expect("reconcile");
    assert_statuses(&app, &orders[0], ("PAID", "CONFIRMED", "SUCCEEDED")).await;
    assert_eq!(gateway.charges_for(&orders[0]), 1);
    app.assert_audit_clean().await;
}

async fn a_gateways_long_failure_message_is_recorded_cut_to_the_reason_bound(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    let attempt = app.order(&order).await["payment"]["attempt_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let attempt = domain::PaymentAttemptId::parse(&attempt).unwrap();
    // A gateway that explains a decline at length (MySQL's reason columns hold 1,000
    // characters; a longer value failed the settle there).
    let reason = "Your card was declined: ".to_owned() + &"ж".repeat(3_000);

    let settled = app
        .store
        .settle_payment(
            &attempt,
            &store::GatewayOutcome::Failed {
                payment_id: None,
                reason,
            },
            "webhook",
            engine::Clock::now(&app.clock),
        )
        .await
        .expect("a long reason does not fail the settle");

    assert_eq!(settled, Some(domain::OrderStatus::PaymentFailed));
    let view = app.order(&order).await;
    let recorded = view["payment"]["failure_reason"].as_str().unwrap();
    assert!(
        recorded.starts_with("Your card was declined: жжж"),
        "{recorded}"
    );
    assert!(recorded.ends_with('…'), "{recorded}");
    assert_eq!(
        recorded.chars().count(),
        domain::limits::REASON_LENGTH_MAX + 1
    );
    let history = view["history"].as_array().unwrap();
    let last = history.last().unwrap()["reason"].as_str().unwrap();
    assert!(
        last.chars().count() <= domain::limits::REASON_LENGTH_MAX + 1,
        "{last}"
    );
    app.assert_audit_clean().await;
}

async fn an_order_whose_sku_went_off_the_shelf_is_not_charged_and_keeps_its_hold(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let off = app
        .shelf(None, json!({"operation": "off", "sku_ids": [SKU]}))
        .await;
    assert_eq!(off.status, 200, "{off:?}");
    let before = app.contents_except_idempotency_records().await;

    let refused = app.pay(&order, &key("pay"), "pm_card_visa").await;

    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("off_shelf"));
    assert!(refused.body.contains("OFF_SHELF"), "{refused:?}");
    assert_eq!(
        gateway.intents_for(&order).len(),
        0,
        "the gateway was not called"
    );
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_statuses(&app, &order, ("PENDING_PAYMENT", "RESERVED", "none")).await;
    // Back on sale, the order is paid as any other.
    let on = app
        .shelf(None, json!({"operation": "on", "sku_ids": [SKU]}))
        .await;
    assert_eq!(on.status, 200, "{on:?}");
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    assert_statuses(&app, &order, ("PAID", "CONFIRMED", "SUCCEEDED")).await;
    assert_eq!(gateway.charges_for(&order), 1);
    app.assert_audit_clean().await;
}

/// Fails the order's running attempt as a webhook would (the shopper gave up on the
/// check); answers the attempt's id.
async fn fail_the_running_attempt(app: &TestApp, order: &str) -> String {
    let attempt = app.order(order).await["payment"]["attempt_id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.store
        .settle_payment(
            &domain::PaymentAttemptId::parse(&attempt).unwrap(),
            &store::GatewayOutcome::Failed {
                payment_id: None,
                reason: "authentication failed".to_owned(),
            },
            "webhook",
            engine::Clock::now(&app.clock),
        )
        .await
        .unwrap();
    attempt
}

/// An order whose first pay, waiting for the shopper's check (its answer a 202, so
/// nothing stored under its key), then failed (the shopper gave up on the check):
/// the order, that pay's key and its attempt's id.
async fn a_first_pay_that_failed_unheard(app: &TestApp) -> (String, String, String) {
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let first_key = key("pay");
    let first = app
        .pay(&order, &first_key, "pm_sandbox_requires_action")
        .await;
    assert_eq!(first.status, 202, "{first:?}");
    let first_attempt = fail_the_running_attempt(app, &order).await;
    (order, first_key, first_attempt)
}

async fn a_retried_pay_learns_its_own_attempts_end_not_another_requests_payment(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, first_key, first_attempt) = a_first_pay_that_failed_unheard(&app).await;
    // …and another request pays with another card, which waits for its check.
    let second = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(second.status, 202, "{second:?}");

    let retried = app
        .pay(&order, &first_key, "pm_sandbox_requires_action")
        .await;

    assert_eq!(retried.status, 409, "{retried:?}");
    assert_eq!(retried.code().as_deref(), Some("illegal_transition"));
    assert!(
        retried.body.contains(&first_attempt) && retried.body.contains("FAILED"),
        "the retry hears its own attempt's end: {retried:?}"
    );
    // The second payment completes; the first request's answer stays its own.
    let intent = gateway
        .intents_for(&order)
        .into_iter()
        .find(|intent| intent.status == gateway::protocol::PaymentIntentStatus::RequiresAction)
        .expect("the second attempt waits for its check");
    assert_eq!(gateway.complete_action(&intent.id).await, 200);
    app.wait_for_order_status(&order, "PAID").await;
    let again = app
        .pay(&order, &first_key, "pm_sandbox_requires_action")
        .await;
    assert_eq!(again.status, 409, "{again:?}");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(gateway.charges_for(&order), 1);
    app.assert_audit_clean().await;
}

/// Found in review: the pay call's answer was lost after the charge, so stockd knows
/// neither the outcome nor the intent's id; then a stale `payment_failed` of the same
/// intent arrives (webhooks come in any order), before the success, which is lost.
/// The failure was applied as the event said: the attempt failed, and the order gave
/// its stock back when its hold ended, with the money taken and nothing to refund it.
/// The intent's state at the gateway now decides: it succeeded, so the order is paid.
async fn a_stale_failure_webhook_of_a_payment_charged_meanwhile_pays_the_order(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = charged_but_unheard(&app, &gateway).await;
    let mut stale = intent.clone();
    stale.status = gateway::PaymentIntentStatus::RequiresPaymentMethod;
    let (payload, signature) = signed_event_of_kind(
        &app,
        "evt_stale_failure",
        "payment_intent.payment_failed",
        &stale,
        0,
    );

    let delivered = app.send(webhook_call(&payload, Some(&signature))).await;

    assert_eq!(delivered.status, 200, "{delivered:?}");
    assert_paid_once(&app, &gateway, &order, 1).await;
}

/// A failure webhook is applied as far as the gateway's own state confirms it: while
/// the intent still awaits the shopper's action, a `payment_failed` changes nothing
/// (the hold stays, reconciliation asks again); once the intent is cancelled at the
/// gateway, a `canceled` event fails the attempt and the order.
async fn a_failure_webhook_fails_an_attempt_only_once_the_gateway_confirms_it(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let paying = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(paying.status, 202, "{paying:?}");
    let intent = intent_of(&gateway, &order);
    let mut claimed_failed = intent.clone();
    claimed_failed.status = gateway::PaymentIntentStatus::RequiresPaymentMethod;
    let (early, early_signature) = signed_event_of_kind(
        &app,
        "evt_early_failure",
        "payment_intent.payment_failed",
        &claimed_failed,
        0,
    );

    let unconfirmed = app.send(webhook_call(&early, Some(&early_signature))).await;

    assert_eq!(unconfirmed.status, 200, "{unconfirmed:?}");
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    let cancelled = match gateway.cancel_intent(&intent.id).await {
        gateway::CallOutcome::Answered(cancelled) => cancelled,
        other => panic!("the sandbox cancels an intent awaiting action: {other:?}"),
    };
    let (late, late_signature) = signed_event_of_kind(
        &app,
        "evt_cancelled",
        "payment_intent.canceled",
        &cancelled,
        0,
    );
    let confirmed = app.send(webhook_call(&late, Some(&late_signature))).await;
    assert_eq!(confirmed.status, 200, "{confirmed:?}");
    let (order_status, _, payment_status) = app.order_statuses(&order).await;
    assert_eq!(
        (order_status.as_str(), payment_status.as_str()),
        ("PAYMENT_FAILED", "FAILED")
    );
    assert_eq!(gateway.charges_for(&order), 0);
}

/// A payment charged while its answer was lost stays unknown for a day (no webhook
/// arrives): past the key's lifetime the create is not sent again (the gateway would
/// run it as a new payment), and the gateway's search by the attempt's metadata finds
/// the payment: the order is paid once. Before, it stayed `PAYMENT_PROCESSING` for
/// good, its stock held and the card charged, with nothing in stockd to settle it.
async fn a_payment_unknown_past_the_gateways_key_lifetime_is_found_by_its_metadata(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    app.clock
        .advance_seconds(sandbox::KEY_LIFETIME_SECONDS + 3600);

    let resolved = app.engine.reconcile_step().await.expect("reconcile");

    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_eq!(
        resolved[0].1,
        Some(domain::OrderStatus::Paid),
        "{resolved:?}"
    );
    assert_eq!(
        gateway.intents_for(&order).len(),
        1,
        "no payment created again"
    );
    assert_paid_once(&app, &gateway, &order, 1).await;
    // The customer presses pay again, a day later: the order is paid.
    let again = app.pay(&order, &key("pay-again"), "pm_card_visa").await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["status"], "PAID");
    assert_eq!(gateway.charges_for(&order), 1);
}

/// A `succeeded` webhook about an attempt past its key's lifetime, whose payment's id
/// stockd never heard (its answer was lost, no webhook came for a day), is checked with
/// the gateway's search instead of ignored: the order is paid once.
async fn a_success_webhook_past_the_key_lifetime_is_checked_by_the_gateways_search(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let (order, intent) = charged_but_unheard(&app, &gateway).await;
    app.clock
        .advance_seconds(sandbox::KEY_LIFETIME_SECONDS + 3600);
    let (payload, signature) = signed_event(&app, "evt_a_day_late", &intent, 0);

    let delivered = app.send(webhook_call(&payload, Some(&signature))).await;

    assert_eq!(delivered.status, 200, "{delivered:?}");
    assert_paid_once(&app, &gateway, &order, 1).await;
    assert_eq!(
        gateway.intents_for(&order).len(),
        1,
        "no payment created again"
    );
}

/// The attempt is committed, then the process dies before the gateway call, and
/// nobody asks about it for a day: past the key's lifetime the gateway's search finds
/// no payment of it, so none was made. The attempt fails (the order can be paid again
/// while its hold lasts, or expires) instead of staying unknown for good.
async fn an_attempt_that_never_reached_the_gateway_fails_once_its_key_expired(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    attempt_begun_before_a_crash(&app, &order).await;
    // Just past the time creates are sent again, a payment made by the last of them
    // may not be in the search's index yet: nothing found says nothing then.
    app.clock.advance_seconds(23 * 3600 + 1800);
    let early = app.engine.reconcile_step().await.expect("reconcile");
    assert_eq!(early, vec![(early[0].0.clone(), None)], "still unknown");
    assert_statuses(
        &app,
        &order,
        ("PAYMENT_PROCESSING", "RESERVED", "PROCESSING"),
    )
    .await;
    app.clock.advance_seconds(2 * 3600);

    let resolved = app.engine.reconcile_step().await.expect("reconcile");

    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_eq!(gateway.intents_for(&order).len(), 0, "nothing was created");
    assert_statuses(&app, &order, ("PAYMENT_FAILED", "RESERVED", "FAILED")).await;
    assert_eq!(gateway.charges_for(&order), 0);
    app.assert_audit_clean().await;
}

/// The id of a payment an answer named (here one awaiting the customer's action) is
/// kept, and later looks read the payment by it: a day later, past the key's
/// lifetime, the action completed meanwhile pays the order once, where sending the
/// create again would have made a second payment (and abandoned the order for it).
async fn a_payment_whose_id_an_answer_named_is_read_by_its_id_after_its_key_expired(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    let intent = intent_of(&gateway, &order).id;
    assert_eq!(gateway.complete_action(&intent).await, 200);
    app.clock
        .advance_seconds(sandbox::KEY_LIFETIME_SECONDS + 3600);

    let resolved = app.engine.reconcile_step().await.expect("reconcile");

    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_eq!(
        gateway.intents_for(&order).len(),
        1,
        "no payment created again"
    );
    assert_paid_once(&app, &gateway, &order, 1).await;
}

/// Found in review: a retry of a pay whose attempt failed while its answer was not
/// stored yet, after another request's card paid the order, was answered 200 `PAID`
/// (and that was stored under its key): its client believed the declined card paid.
async fn a_retried_pay_whose_card_failed_does_not_hear_paid_from_another_card(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let (order, first_key, first_attempt) = a_first_pay_that_failed_unheard(&app).await;
    let second = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(second.status, 200, "{second:?}");
    assert_eq!(second.json()["status"], "PAID");

    let retried = app
        .pay(&order, &first_key, "pm_sandbox_requires_action")
        .await;

    assert_eq!(retried.status, 409, "{retried:?}");
    assert_eq!(retried.code().as_deref(), Some("illegal_transition"));
    assert!(
        retried.body.contains(&first_attempt)
            && retried.body.contains("FAILED")
            && retried.body.contains("PAID through another payment"),
        "the retry hears its own attempt's end: {retried:?}"
    );
    let again = app
        .pay(&order, &first_key, "pm_sandbox_requires_action")
        .await;
    assert_eq!(again.status, 409, "{again:?}");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(gateway.charges_for(&order), 1);
    app.assert_audit_clean().await;
}

/// Found in review: stockd's creates lacked `allow_redirects=never`, which Stripe
/// requires (API 2023-08-16 on) of a confirmation without `return_url`, so every
/// payment through Stripe would have been refused; the sandbox now refuses the same.
/// And its reads and controls answered anyone: on staging, `force_success` sends a
/// signed "succeeded" webhook.
async fn the_sandbox_refuses_what_stripe_refuses_and_asks_every_caller_for_its_key(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let paid = app.pay(&order, &key("pay"), "pm_card_visa").await;
    assert_eq!(
        paid.status, 200,
        "stockd's own create is accepted: {paid:?}"
    );
    let intent = intent_of(&gateway, &order).id;
    gateway::install_crypto_provider();
    let http = reqwest::Client::new();
    let may_redirect = http
        .post(format!("{}/v1/payment_intents", gateway.url))
        .bearer_auth(acceptance::payments::GATEWAY_API_KEY)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("amount=100&currency=cny&payment_method=pm_card_visa&confirm=true")
        .send()
        .await
        .unwrap();
    assert_eq!(may_redirect.status().as_u16(), 400);
    let body: Value = serde_json::from_str(&may_redirect.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("return_url")
    );
    for (method, path) in [
        ("GET", format!("/v1/payment_intents/{intent}")),
        ("GET", "/_sandbox/stats".to_owned()),
        (
            "GET",
            "/v1/payment_intents/search?query=metadata%5B%27order_id%27%5D%3A%27x%27".to_owned(),
        ),
        (
            "POST",
            format!("/_sandbox/payment_intents/{intent}/force_success"),
        ),
        (
            "POST",
            format!("/_sandbox/payment_intents/{intent}/complete_action"),
        ),
    ] {
        let url = format!("{}{path}", gateway.url);
        let request = match method {
            "GET" => http.get(&url),
            _ => http.post(&url),
        };
        let answer = request.send().await.unwrap();
        assert_eq!(
            answer.status().as_u16(),
            401,
            "{method} {path} without the key"
        );
    }
    let with_key = http
        .get(format!("{}/v1/payment_intents/{intent}", gateway.url))
        .bearer_auth(acceptance::payments::GATEWAY_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(with_key.status().as_u16(), 200);
    assert_eq!(
        gateway.sandbox.stats().intents.len(),
        1,
        "nothing else was created"
    );
    assert_eq!(gateway.charges_for(&order), 1);
}

/// Found in review: a second request, with another card, while the first request's
/// payment waited for its check, was answered with the first card's payment: asked
/// about at the gateway, its decline would have been stored under the second request's
/// key, which then replayed "declined" for a card never tried. It is now told another
/// payment is in progress (409 `request_in_progress`, nothing stored); retried once
/// that payment failed, it pays with its own card.
async fn a_second_card_while_another_requests_payment_runs_is_not_answered_with_that_payment(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let first = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(first.status, 202, "{first:?}");
    let second_key = key("pay");

    let told = app.pay(&order, &second_key, "pm_card_visa").await;

    assert_eq!(told.status, 409, "{told:?}");
    assert_eq!(told.code().as_deref(), Some("request_in_progress"));
    assert_eq!(
        gateway.intents_for(&order).len(),
        1,
        "the second card was not tried"
    );
    assert_eq!(app.order(&order).await["status"], "PAYMENT_PROCESSING");
    // The first payment fails (the shopper gave up on the check).
    fail_the_running_attempt(&app, &order).await;
    let retried = app.pay(&order, &second_key, "pm_card_visa").await;
    assert_eq!(retried.status, 200, "{retried:?}");
    assert_eq!(retried.json()["status"], "PAID");
    assert_eq!(gateway.charges_for(&order), 1);
    app.assert_audit_clean().await;
}

/// Found in review: a step started a row only while its worst case (four gateway calls
/// at the timeout) ended within the 30 s lease. With the timeout at 10 s that was 40 s:
/// past the lease before any row started, so every step asked about its first row
/// only and handed the rest back, however fast the gateway answered — after an outage,
/// the backlog drained one payment per step. The lease is now at least twice a row's
/// worst case.
async fn with_a_ten_second_gateway_timeout_one_reconciliation_step_settles_its_whole_batch(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let mut orders = Vec::new();
    for _ in 0..5 {
        let order = app.order_of("user-1", &[(SKU, 1)]).await;
        let response = app
            .pay(&order, &key("pay"), "pm_sandbox_charge_then_timeout")
            .await;
        assert_eq!(response.status, 202, "{response:?}");
        orders.push(order);
    }
    app.clock.advance_seconds(11);
    let patient = app.another_instance().await;
    gateway.attach_with_timeout(&patient, 10_000);

    let resolved = patient
        .engine
        .reconcile_step()
        .await
        .expect("reconcile step");

    assert_eq!(resolved.len(), 5, "{resolved:?}");
    for order in &orders {
        assert_statuses(&app, order, ("PAID", "CONFIRMED", "SUCCEEDED")).await;
        assert_eq!(gateway.charges_for(order), 1);
    }
    app.assert_audit_clean().await;
}

/// Found in review: the first look came 10 s after the attempt started, whatever the
/// gateway timeout: at 10 s or more, reconciliation could send the keyed create while
/// the request's own was still in flight, hear 409 and put the next look off, doubling.
/// It now comes no earlier than twice the timeout.
async fn the_first_reconciliation_look_waits_for_the_requests_own_call_to_give_up(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    // The shop's own instance has its gateway at a one-second timeout already.
    let patient = app.another_instance().await;
    gateway.attach_with_timeout(&patient, 10_000);
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let response = patient
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(response.status, 202, "{response:?}");

    app.clock.advance_seconds(11);
    let early = patient
        .engine
        .reconcile_step()
        .await
        .expect("reconcile step");
    app.clock.advance_seconds(10);
    let due = patient
        .engine
        .reconcile_step()
        .await
        .expect("reconcile step");

    assert!(early.is_empty(), "not asked before 20 s: {early:?}");
    assert_eq!(due.len(), 1, "{due:?}");
}

/// Found in review: two pays under one key for two orders, on two instances at once,
/// each locked its own order and saw no attempt of the other's, which had not
/// committed: both charged a card, and one customer heard 422 after their money moved.
/// The key is now claimed before anything is decided and held to the commit, so the
/// second waits for the first and finds its attempt.
async fn one_key_paying_two_orders_on_two_instances_at_once_charges_one_card(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    let other = app.another_instance().await;
    gateway.attach(&other);
    let first = app.order_of("user-1", &[(SKU, 1)]).await;
    let second = app.order_of("user-2", &[(SKU, 1)]).await;
    // Every new attempt is held back until both pays have begun, so that neither has
    // committed when the other looks for the key's attempts. SQLite has one writer:
    // there the two begin one after the other, and the second finds the first's.
    let mut holder = app.database.raw_connection().await;
    let (hold, release): (&[&str], &str) = match backend {
        Backend::Sqlite => (&[], ""),
        Backend::Postgres => (
            &["BEGIN", "LOCK TABLE payment_attempt IN SHARE MODE"],
            "COMMIT",
        ),
        Backend::Mysql => (&["LOCK TABLES payment_attempt READ"], "UNLOCK TABLES"),
    };
    for statement in hold {
        holder.execute(statement).await.expect(statement);
    }
    let pay_key = key("two-orders");
    let pays = [
        (app.clone(), first.clone()),
        (other.clone(), second.clone()),
    ]
    .map(|(instance, order)| {
        let pay_key = pay_key.clone();
        tokio::spawn(async move { instance.pay(&order, &pay_key, "pm_card_visa").await })
    });
    if backend != Backend::Sqlite {
        app.database.wait_until_blocking(&mut holder, 2).await;
        holder.execute(release).await.expect(release);
    }
    let mut statuses = Vec::new();
    for pay in pays {
        let response = pay.await.expect("pay task");
        statuses.push((response.status, response.code()));
    }
    statuses.sort();

    assert_eq!(
        statuses,
        [
            (200, None),
            (422, Some("idempotency_key_reused".to_owned()))
        ]
    );
    assert_eq!(
        gateway.charges_for(&first) + gateway.charges_for(&second),
        1,
        "one card charged"
    );
    app.assert_audit_clean().await;
}

/// Found in review: `stockd serve` without a gateway URL runs a sandbox of its own,
/// which keeps its books in memory. After a restart, a payment the old process's
/// sandbox held (waiting for its 3-D Secure check, say) was read back as "not found",
/// taken as "unknown", asked about forever, and its order held its stock for good. A
/// payment this process's own sandbox cannot find, whose id carries another sandbox's
/// mark, now fails: no money moved for it, and its order is paid again or expires.
async fn a_payment_the_previous_processs_own_sandbox_held_fails_after_a_restart(backend: Backend) {
    let (app, _gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 2)]).await;
    let response = app
        .pay(
            &order,
            &key("pay-before-restart"),
            "pm_sandbox_requires_action",
        )
        .await;
    assert_eq!(response.status, 202, "{response:?}");
    app.clock.advance_seconds(1);
    // The process restarts: its own sandbox starts again, with empty books.
    let restarted = app.another_instance().await;
    let _fresh = TestGateway::start_as_own_sandbox(&restarted).await;
    app.clock.advance_seconds(HOLD_SECONDS + 1);

    let resolved = restarted
        .engine
        .reconcile_step()
        .await
        .expect("reconcile step");
    let expired = restarted
        .engine
        .order_expiry_step()
        .await
        .expect("order expiry step");

    assert_eq!(resolved.len(), 1, "{resolved:?}");
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_statuses(&app, &order, ("EXPIRED", "RELEASED", "FAILED")).await;
    assert_eq!(app.counters(SKU).await, (STOCK, 0), "the stock came back");
    app.assert_audit_clean().await;
}

/// Found in review: a payment whose outcome is unknown answered 202 with the gateway's
/// own words in `detail`: a proxy's error page (its first 200 characters), or the
/// connection error, which names the gateway's URL. They are in the log; the client
/// hears a fixed sentence.
async fn a_payment_unknown_tells_the_client_none_of_the_gateways_words_nor_its_address(
    backend: Backend,
) {
    let (app, gateway) = shop(backend).await;
    let (behind_a_proxy, _proxy) = FlakyGateway::refusing_in_front_of(&app, &gateway).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;

    let answered_by_a_proxy = behind_a_proxy
        .pay(&order, &key("pay"), "pm_card_visa")
        .await;

    assert_eq!(answered_by_a_proxy.status, 202, "{answered_by_a_proxy:?}");
    assert_eq!(
        answered_by_a_proxy.code().as_deref(),
        Some("payment_unknown")
    );
    assert!(
        !answered_by_a_proxy.body.contains("maintenance"),
        "{answered_by_a_proxy:?}"
    );

    let closed_port = acceptance::free_port();
    let cut_off = app.another_instance().await;
    cut_off
        .engine
        .attach_payments(acceptance::payments::payments_at(
            &format!("http://127.0.0.1:{closed_port}"),
            acceptance::payments::GATEWAY_TIMEOUT_MILLISECONDS,
            true,
        ));
    let other_order = app.order_of("user-2", &[(SKU, 1)]).await;

    let unreachable = cut_off
        .pay(&other_order, &key("pay-2"), "pm_card_visa")
        .await;

    assert_eq!(unreachable.status, 202, "{unreachable:?}");
    assert!(
        !unreachable.body.contains(&closed_port.to_string()),
        "{unreachable:?}"
    );
    assert!(!unreachable.body.contains("127.0.0.1"), "{unreachable:?}");
}

/// Found in review: every delivery of a webhook asked the gateway about its intent (a
/// failure is checked against the intent's own state) before finding the event was
/// delivered before. Each redelivery cost gateway calls, and while the gateway was
/// unreachable a plain redelivery was answered 503. It is now answered from the
/// record of the event.
async fn a_webhook_delivered_again_is_answered_without_asking_the_gateway(backend: Backend) {
    let (app, gateway) = shop(backend).await;
    gateway.sandbox.stop_webhooks();
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let paying = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(paying.status, 202, "{paying:?}");
    let mut claimed_failed = intent_of(&gateway, &order);
    claimed_failed.status = gateway::PaymentIntentStatus::RequiresPaymentMethod;
    let (payload, signature) = signed_event_of_kind(
        &app,
        "evt_failure",
        "payment_intent.payment_failed",
        &claimed_failed,
        0,
    );
    let (receiver, proxy) = FlakyGateway::refusing_in_front_of(&app, &gateway).await;
    proxy.stop_refusing();
    let first = receiver
        .send(webhook_call(&payload, Some(&signature)))
        .await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.json()["duplicate"], false, "{first:?}");
    let asked_for_the_first = proxy.calls();
    assert!(
        asked_for_the_first > 0,
        "a failure is checked at the gateway"
    );

    let again = receiver
        .send(webhook_call(&payload, Some(&signature)))
        .await;

    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["duplicate"], true, "{again:?}");
    assert_eq!(
        proxy.calls(),
        asked_for_the_first,
        "the gateway was asked again"
    );
}

/// Found in review: an attempt claimed for reconciliation was leased until its order's
/// hold end when that came sooner (so the first look after it abandons the payment
/// promptly). Claimed a second before the hold ended, it was free for another
/// process a second later, while the first still asked the gateway about it: two
/// processes asked about the same attempt at once. The lease now holds whole.
async fn an_attempt_claimed_just_before_its_hold_ends_stays_leased_for_the_whole_lease(
    backend: Backend,
) {
    let (app, _gateway) = shop(backend).await;
    let order = app.order_of("user-1", &[(SKU, 1)]).await;
    let paying = app
        .pay(&order, &key("pay"), "pm_sandbox_requires_action")
        .await;
    assert_eq!(paying.status, 202, "{paying:?}");
    app.clock.advance_seconds(HOLD_SECONDS - 1);
    let lease_milliseconds = 30_000;
    let claimed = app
        .store
        .claim_attempts_to_reconcile(app.clock_now(), 10, lease_milliseconds)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");

    // Past the hold's end, within the lease: another process finds nothing to claim.
    app.clock.advance_seconds(2);
    let claimed_again = app
        .store
        .claim_attempts_to_reconcile(app.clock_now(), 10, lease_milliseconds)
        .await
        .unwrap();
    assert!(claimed_again.is_empty(), "{claimed_again:?}");

    // Once the lease has ended, the first look after the hold's end is due.
    app.clock.advance_seconds(30);
    let due = app
        .store
        .claim_attempts_to_reconcile(app.clock_now(), 10, lease_milliseconds)
        .await
        .unwrap();
    assert_eq!(due.len(), 1, "{due:?}");
}

//! Scheduled shelf changes: minute precision, applied once across instances and after
//! a restart, skipped (and logged) when the SKU was deleted.

use acceptance::{Backend, Call, ProductSpec, START, TestApp, mirrored_tests};
use domain::Timestamp;
use serde_json::json;

mirrored_tests!(
    a_schedule_applies_at_the_start_of_its_minute_and_is_logged_as_scheduled,
    a_schedule_due_while_the_process_was_down_is_applied_after_the_restart,
    two_instances_apply_one_schedule_once,
    a_schedule_of_a_deleted_sku_is_skipped_and_logged,
    schedules_in_the_past_or_without_a_time_are_refused,
    a_retried_schedule_whose_minute_has_passed_replays_its_first_answer,
    a_schedule_waits_for_an_edit_of_its_sku_and_is_applied_after_it,
);

fn at_minutes(minutes: i64) -> String {
    START.plus_seconds(minutes * 60).to_rfc3339()
}

async fn pending_product(app: &TestApp, skus: &[&str]) -> String {
    app.create_product(ProductSpec::complete("north", skus))
        .await
}

async fn a_schedule_applies_at_the_start_of_its_minute_and_is_logged_as_scheduled(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let product = pending_product(&app, &["LATER"]).await;
    // 10 minutes and 30 seconds from now: due at the start of minute 10.
    let scheduled_at = START.plus_seconds(630).to_rfc3339();
    let scheduled = app
        .shelf(
            None,
            json!({"operation": "on_at", "product_ids": [product], "scheduled_at": scheduled_at}),
        )
        .await;
    assert_eq!(scheduled.status, 200, "{scheduled:?}");
    let result = &scheduled.json()["results"][0];
    assert_eq!(result["outcome"], "scheduled");
    assert_eq!(result["due_at"], at_minutes(10));
    assert_eq!(
        app.engine.next_schedule_due().await.unwrap(),
        Some(START.plus_seconds(600))
    );

    app.clock.advance_seconds(599);
    assert!(
        app.engine.schedule_step().await.unwrap().is_empty(),
        "not due yet"
    );
    assert_eq!(app.sale_status(&product, "LATER").await.0, "PENDING_REVIEW");
    app.clock.advance_seconds(1);
    let applied = app.engine.schedule_step().await.unwrap();

    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0].status, "APPLIED");
    assert_eq!(app.sale_status(&product, "LATER").await.0, "ON_SHELF");
    let log = app.shelf_log(&format!("&product={product}")).await;
    assert_eq!(log.len(), 1);
    assert_eq!(log[0]["operation"], "on_at");
    assert_eq!(log[0]["operator_type"], "scheduled");
    assert_eq!(log[0]["created_at"], at_minutes(10));
    assert_eq!(app.engine.next_schedule_due().await.unwrap(), None);
}

async fn a_schedule_due_while_the_process_was_down_is_applied_after_the_restart(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = pending_product(&app, &["OVERNIGHT"]).await;
    app.shelf(
        None,
        json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(5)}),
    )
    .await;

    let app = app.restart().await;
    app.clock.advance_seconds(3600);
    let applied = app.engine.schedule_step().await.unwrap();

    assert_eq!(applied.len(), 1);
    assert_eq!(app.sale_status(&product, "OVERNIGHT").await.0, "ON_SHELF");
}

async fn two_instances_apply_one_schedule_once(backend: Backend) {
    let first = TestApp::spawn(backend).await;
    let second = first.another_instance().await;
    let product = pending_product(&first, &["ONCE-1", "ONCE-2", "ONCE-3"]).await;
    first
        .shelf(
            None,
            json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(1)}),
        )
        .await;
    first.clock.advance_seconds(120);

    let (from_first, from_second) =
        tokio::join!(first.engine.schedule_step(), second.engine.schedule_step());

    let applied = from_first.unwrap().len() + from_second.unwrap().len();
    assert_eq!(
        applied, 3,
        "three schedules, each applied by exactly one instance"
    );
    let log = first.shelf_log(&format!("&product={product}")).await;
    assert_eq!(log.len(), 3, "{log:?}");
    assert!(first.engine.schedule_step().await.unwrap().is_empty());
}

async fn a_schedule_of_a_deleted_sku_is_skipped_and_logged(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = pending_product(&app, &["DOOMED"]).await;
    app.shelf(
        None,
        json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(30)}),
    )
    .await;
    let deleted = app
        .send(
            Call::new(
                axum::http::Method::DELETE,
                format!("/v1/products/{product}"),
            )
            .admin()
            .key("delete"),
        )
        .await;
    assert_eq!(deleted.status, 200);

    app.clock.advance_seconds(1800);
    let applied = app.engine.schedule_step().await.unwrap();

    assert_eq!(applied[0].status, "SKIPPED");
    let log = app.shelf_log(&format!("&product={product}")).await;
    let last = log.last().unwrap();
    assert_eq!(last["operation"], "on_at");
    assert_eq!(last["to"], "DELETED");
    assert!(last["remark"].as_str().unwrap().contains("skipped"));
    assert_eq!(app.sale_status(&product, "DOOMED").await.0, "DELETED");
}

async fn schedules_in_the_past_or_without_a_time_are_refused(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = pending_product(&app, &["WHEN"]).await;
    let before = app.contents_except_idempotency_records().await;
    let this_minute =
        Timestamp::from_unix_milliseconds(START.unix_milliseconds() + 30_000).to_rfc3339();

    for body in [
        json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(-1)}),
        json!({"operation": "on_at", "product_ids": [product], "scheduled_at": this_minute}),
        json!({"operation": "on_at", "product_ids": [product]}),
        json!({"operation": "on", "product_ids": [product], "scheduled_at": at_minutes(5)}),
        json!({"operation": "off_at", "product_ids": [product], "scheduled_at": "tomorrow"}),
        json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(60 * 24 * 400)}),
    ] {
        let refused = app.shelf(None, body.clone()).await;
        assert_eq!(refused.status, 400, "{body}: {refused:?}");
        assert_eq!(refused.code().as_deref(), Some("invalid_argument"));
    }
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_eq!(app.engine.next_schedule_due().await.unwrap(), None);
}

/// Issue 13, defect 4: the first result wins even when the checks it passed would now
/// fail: a retry of a scheduled change after its minute has passed (and the change was
/// applied) answers what the first call answered, and schedules nothing more.
async fn a_retried_schedule_whose_minute_has_passed_replays_its_first_answer(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = pending_product(&app, &["RETRIED"]).await;
    let call = || {
        Call::post("/v1/admin/shelf").admin().key("schedule-once").json(
            &json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(5)}),
        )
    };
    let first = app.send(call()).await;
    assert_eq!(first.status, 200, "{first:?}");
    app.clock.advance_seconds(6 * 60);
    assert_eq!(app.engine.schedule_step().await.unwrap().len(), 1);
    let contents = app.contents().await;
    let retried = app.send(call()).await;
    assert_eq!(retried.status, 200, "{retried:?}");
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, first.body);
    assert_eq!(app.contents().await, contents, "nothing scheduled again");
    assert_eq!(app.engine.next_schedule_due().await.unwrap(), None);
}

async fn a_schedule_waits_for_an_edit_of_its_sku_and_is_applied_after_it(backend: Backend) {
    if backend == Backend::Sqlite {
        // One writer: an edit cannot commit inside the scheduler's transaction.
        return;
    }
    let app = TestApp::spawn(backend).await;
    let product = pending_product(&app, &["EDITED"]).await;
    let scheduled = app
        .shelf(
            None,
            json!({"operation": "on_at", "product_ids": [product], "scheduled_at": at_minutes(1)}),
        )
        .await;
    assert_eq!(scheduled.status, 200, "{scheduled:?}");
    app.clock.advance_seconds(120);
    // An edit of the SKU (its title: a new version, no stock lock) in flight while the
    // schedule comes due.
    let mut editor = app.database.raw_connection().await;
    editor.execute("BEGIN").await.unwrap();
    editor
        .execute("UPDATE sku SET title = 'Edited', version = version + 1 WHERE code = 'EDITED'")
        .await
        .unwrap();
    let engine = app.engine.clone();
    let step = tokio::spawn(async move { engine.schedule_step().await });
    app.database.wait_until_blocked_by(&mut editor).await;
    editor.execute("COMMIT").await.unwrap();

    let applied = step.await.unwrap().unwrap();

    assert_eq!(applied.len(), 1);
    assert_eq!(
        applied[0].status, "APPLIED",
        "not refused as changed concurrently: {applied:?}"
    );
    assert_eq!(app.sale_status(&product, "EDITED").await.0, "ON_SHELF");
}

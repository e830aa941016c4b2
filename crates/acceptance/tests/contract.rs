//! The API as its OpenAPI document describes it (issue 18): each case here is something
//! the fuzzer (`.ci/schemathesis/run`) found where the server and the document
//! disagreed, kept as a regression test once both said the same.

use acceptance::{Backend, Call, TestApp, mirrored_tests};
use serde_json::{Value, json};

mirrored_tests!(
    an_optional_body_may_be_left_out_or_an_empty_object_but_not_null,
    a_number_written_with_a_zero_fraction_is_the_integer_it_equals,
    skus_of_several_shops_in_one_reservation_fail_a_precondition_and_change_nothing,
    a_limited_sku_reserved_without_a_user_fails_a_precondition_and_changes_nothing,
    a_service_key_name_is_bounded_as_sent_not_as_trimmed,
    a_feed_cursor_longer_than_eighteen_digits_is_refused,
    expected_versions_are_non_negative_integers,
    a_products_expected_version_is_a_non_negative_integer,
    the_document_states_the_constraints_the_server_enforces,
);

async fn an_optional_body_may_be_left_out_or_an_empty_object_but_not_null(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let mut confirmed = 0;
    for (key, body) in [("none", None), ("object", Some("{}"))] {
        let reserved = app.reserve(&format!("hold-{key}"), &[("TEA", 1)]).await;
        let id = reserved.json()["reservation_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let mut call =
            Call::post(format!("/v1/reservations/{id}/confirm")).key(format!("confirm-{key}"));
        if let Some(body) = body {
            call = call.raw(body, Some("application/json"));
        }
        let answer = app.send(call).await;
        assert_eq!(answer.status, 200, "{key}: {answer:?}");
        confirmed += 1;
    }
    assert_eq!(app.counters("TEA").await, (5 - confirmed, 0));
    // The document says "an object, or nothing": `null` is neither, and changes nothing.
    let held = app.reserve("hold-null", &[("TEA", 1)]).await;
    let id = held.json()["reservation_id"].as_str().unwrap().to_owned();
    let before = app.contents_except_idempotency_records().await;
    let null = app
        .send(
            Call::post(format!("/v1/reservations/{id}/confirm"))
                .key("confirm-null")
                .raw("null", Some("application/json")),
        )
        .await;
    assert_eq!(null.status, 400, "{null:?}");
    assert_eq!(null.code().as_deref(), Some("invalid_argument"));
    // Nor is an array, though serde reads a struct from its fields in order
    // (schemathesis seed 745757643 sent `[]` to revoke a service key).
    for (key, body) in [("empty-array", "[]"), ("array", "[1]")] {
        let array = app
            .send(
                Call::post(format!("/v1/reservations/{id}/confirm"))
                    .key(format!("confirm-{key}"))
                    .raw(body, Some("application/json")),
            )
            .await;
        assert_eq!(array.status, 400, "{key}: {array:?}");
        assert_eq!(array.code().as_deref(), Some("invalid_argument"));
    }
    let positional = app
        .send(Call::post("/v1/reservations").key("positional").raw(
            r#"[[{"sku": "TEA", "quantity": 1}]]"#,
            Some("application/json"),
        ))
        .await;
    assert_eq!(positional.status, 400, "{positional:?}");
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn a_number_written_with_a_zero_fraction_is_the_integer_it_equals(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5000).await;
    let reserve = |key: &'static str, quantity: Value| {
        let app = app.clone();
        async move {
            app.send(Call::post("/v1/reservations").key(key).json(&json!({
                "lines": [{"sku": "TEA", "quantity": quantity}],
                "ttl_seconds": 60.0,
            })))
            .await
        }
    };

    let whole = reserve("whole", json!(2.0)).await;
    let exponent = reserve("exponent", json!(1e3)).await;
    let fraction = reserve("fraction", json!(1.5)).await;

    assert_eq!(whole.status, 201, "{whole:?}");
    assert_eq!(whole.json()["lines"][0]["quantity"], 2);
    assert_eq!(exponent.status, 201, "{exponent:?}");
    assert_eq!(exponent.json()["lines"][0]["quantity"], 1000);
    assert_eq!(fraction.status, 400, "{fraction:?}");
    assert_eq!(app.counters("TEA").await, (5000 - 1002, 1002));
}

async fn skus_of_several_shops_in_one_reservation_fail_a_precondition_and_change_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("NORTH-TEA", 5).await;
    let south = app
        .send(
            Call::put("/v1/skus/SOUTH-TEA")
                .admin()
                .key("south-sku")
                .json(&json!({"title": "Tea", "price": 100, "currency": "CNY", "shop": "south"})),
        )
        .await;
    assert_eq!(south.status, 201, "{south:?}");
    app.receive("SOUTH-TEA", 5).await;
    let before = app.contents_except_idempotency_records().await;

    let mixed = app
        .send(Call::post("/v1/reservations").admin().key("mixed").json(&json!({
            "lines": [{"sku": "NORTH-TEA", "quantity": 1}, {"sku": "SOUTH-TEA", "quantity": 1}],
        })))
        .await;

    assert_eq!(mixed.status, 409, "{mixed:?}");
    assert_eq!(mixed.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn a_limited_sku_reserved_without_a_user_fails_a_precondition_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LIMITED", 5).await;
    let limited = app
        .send(
            Call::put("/v1/skus/LIMITED")
                .admin()
                .key("limit")
                .json(&json!({"per_user_limit": 1})),
        )
        .await;
    assert_eq!(limited.status, 200, "{limited:?}");
    let before = app.contents_except_idempotency_records().await;

    let anonymous = app.reserve("no-user", &[("LIMITED", 1)]).await;

    assert_eq!(anonymous.status, 409, "{anonymous:?}");
    assert_eq!(anonymous.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
}

async fn a_service_key_name_is_bounded_as_sent_not_as_trimmed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let create = |key: &'static str, name: String| {
        let app = app.clone();
        async move {
            app.send(
                Call::post("/v1/admin/service-keys")
                    .admin()
                    .key(key)
                    .json(&json!({"shop": "default", "name": name})),
            )
            .await
        }
    };
    let before = app.contents().await;

    let padded = create("padded", format!("{} ", "n".repeat(64))).await;
    let blank = create("blank", "   ".into()).await;

    assert_eq!(padded.status, 400, "{padded:?}");
    assert_eq!(blank.status, 400, "{blank:?}");
    assert_eq!(app.contents().await, before);
    let trimmed = create("trimmed", format!(" {} ", "n".repeat(60))).await;
    assert_eq!(trimmed.status, 201, "{trimmed:?}");
    assert_eq!(trimmed.json()["name"], "n".repeat(60));
}

async fn a_feed_cursor_longer_than_eighteen_digits_is_refused(backend: Backend) {
    let app = TestApp::spawn(backend).await;

    let eighteen = app
        .send(Call::get("/v1/events?after=999999999999999999").admin())
        .await;
    let nineteen = app
        .send(Call::get("/v1/events?after=1000000000000000000").admin())
        .await;

    // Eighteen digits parse; no database numbered that many events, so the cursor is
    // past the newest one.
    assert_eq!(eighteen.status, 404, "{eighteen:?}");
    assert!(
        eighteen.body.contains("past the newest event"),
        "{eighteen:?}"
    );
    assert_eq!(nineteen.status, 400, "{nineteen:?}");
    assert_eq!(nineteen.code().as_deref(), Some("invalid_argument"));
}

async fn expected_versions_are_non_negative_integers(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(acceptance::ProductSpec::complete("default", &["SHELF-1"]))
        .await;
    let shelf = |key: &'static str, versions: Value| {
        let app = app.clone();
        let product = product.clone();
        async move {
            app.send(Call::post("/v1/admin/shelf").admin().key(key).json(&json!({
                "operation": "on",
                "product_ids": [product],
                "expected_versions": versions,
            })))
            .await
        }
    };
    let before = app.contents().await;

    let negative = shelf("negative", json!({"SHELF-1": -1})).await;
    let bad_code = shelf("bad-code", json!({"not a code": 1})).await;

    assert_eq!(negative.status, 400, "{negative:?}");
    assert_eq!(bad_code.status, 400, "{bad_code:?}");
    assert_eq!(app.contents().await, before);
    let version = app.sku("SHELF-1").await["version"].as_i64().unwrap();
    let whole = shelf("whole", json!({"SHELF-1": version as f64})).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    assert_eq!(whole.json()["changed"], 1);
}

async fn a_products_expected_version_is_a_non_negative_integer(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(acceptance::ProductSpec::complete("default", &["EDITED-1"]))
        .await;
    let edit = |key: &'static str, version: Value| {
        let app = app.clone();
        let product = product.clone();
        async move {
            app.send(
                Call::patch(format!("/v1/products/{product}"))
                    .admin()
                    .key(key)
                    .json(&json!({"title": "Renamed", "expected_version": version})),
            )
            .await
        }
    };
    let before = app.contents().await;

    let refused = [
        edit("negative", json!(-1)).await,
        edit("text", json!("1")).await,
        edit("fraction", json!(1.5)).await,
        edit("past-i64", json!(9_223_372_036_854_775_808_u64)).await,
        edit("null-object", json!({})).await,
    ];

    for answer in &refused {
        assert_eq!(answer.status, 400, "{answer:?}");
        assert_eq!(answer.code().as_deref(), Some("invalid_argument"));
        assert!(answer.body.contains("expected_version"), "{answer:?}");
    }
    assert_eq!(app.contents().await, before);
    // The bounds themselves are versions: stale here, so refused by the product.
    for (key, bound) in [("zero", json!(0)), ("largest", json!(i64::MAX))] {
        let stale = edit(key, bound).await;
        assert_eq!(stale.status, 409, "{stale:?}");
        assert_eq!(stale.code().as_deref(), Some("version_conflict"));
    }
    let before_refusals = before
        .split("idempotency_record\n")
        .next()
        .unwrap_or_default();
    assert_eq!(
        app.contents_except_idempotency_records().await,
        before_refusals
    );
    let version = app.staff_product(&product).await["version"]
        .as_i64()
        .unwrap();
    let whole = edit("whole", json!(version as f64)).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let absent = edit("null", Value::Null).await;
    assert_eq!(absent.status, 200, "{absent:?}");
}

/// A few of the constraints the document must state, read back from `/openapi.json`
/// as a client generator reads them.
async fn the_document_states_the_constraints_the_server_enforces(backend: Backend) {
    let app = TestApp::spawn(backend).await;

    let document = app.send(Call::get("/openapi.json").anonymous()).await;

    assert_eq!(document.status, 200);
    let document = document.json();
    assert_eq!(document["openapi"], "3.1.0");
    let schemas = &document["components"]["schemas"];
    assert_eq!(schemas["SkuCode"]["maxLength"], 64);
    assert!(schemas["SkuCode"]["pattern"].is_string());
    assert_eq!(schemas["Quantity"]["type"], "integer");
    assert_eq!(schemas["Quantity"]["minimum"], 1);
    assert_eq!(schemas["Quantity"]["maximum"], 1_000_000);
    assert_eq!(
        schemas["CreateReservationRequest"]["additionalProperties"],
        false
    );
    assert_eq!(
        schemas["CreateReservationRequest"]["properties"]["lines"]["maxItems"],
        50
    );
    let reserve = &document["paths"]["/v1/reservations"]["post"];
    for status in [
        "201", "400", "401", "403", "404", "408", "409", "413", "415", "422", "429", "503",
    ] {
        assert!(
            reserve["responses"].get(status).is_some(),
            "POST /v1/reservations documents {status}"
        );
    }
    let conflict = &reserve["responses"]["409"];
    assert_eq!(
        conflict["content"]["application/problem+json"]["schema"]["$ref"],
        "#/components/schemas/Problem409"
    );
    let described = conflict["description"].as_str().unwrap();
    let schema_codes = &schemas["Problem409"]["properties"]["code"]["enum"];
    for code in [
        "insufficient_stock",
        "off_shelf",
        "failed_precondition",
        "request_in_progress",
    ] {
        assert!(
            described.contains(code),
            "409 of reservations names {code}: {described}"
        );
        assert!(
            schema_codes.as_array().unwrap().contains(&json!(code)),
            "Problem409 has {code}"
        );
    }
}

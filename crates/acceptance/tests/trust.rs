//! Trust boundaries (DESIGN.md, principle 11 and the trust model): every `/v1` call has
//! a principal, acts only inside its shop and only within its role, and what an order
//! holds only the order's flow may move. Every refusal leaves the database as it was.

use acceptance::{Backend, Call, ProductSpec, TestApp, TestResponse, mirrored_tests};
use axum::http::Method;
use serde_json::{Value, json};

mirrored_tests!(
    a_shop_at_its_active_service_key_limit_is_refused_and_its_keys_are_listed_before_revoked_ones,
    a_token_no_stored_secret_could_be_is_unknown_without_asking_the_database,
    a_key_found_before_is_looked_up_again_past_a_flood_of_made_up_tokens_after_a_revocation,
    looking_up_a_token_does_not_wait_for_the_writer,
    instances_started_together_on_a_new_database_keep_one_generated_admin_token,
    every_route_refuses_a_caller_without_a_known_credential_and_changes_nothing,
    a_credential_of_another_shop_is_forbidden_everywhere_and_changes_nothing,
    admin_only_routes_refuse_operators_and_staff_routes_refuse_service_keys,
    confirming_or_releasing_an_order_held_reservation_is_refused_and_the_order_flow_still_works,
    two_principals_sending_the_same_key_at_once_get_two_independent_effects,
    a_shopper_never_passes_a_per_user_limit_however_many_requests_race,
    one_request_over_the_limit_across_two_warehouses_is_refused_and_fails_no_one_else,
    many_shoppers_racing_at_once_each_get_their_limit_and_their_tallies_count_it,
    a_shopper_at_the_open_hold_bound_is_refused_until_a_hold_ends,
    a_revoked_service_key_is_refused_here_at_once_and_elsewhere_within_the_cache_bound,
    a_revoked_operator_is_refused_here_at_once_and_elsewhere_within_the_cache_bound,
    a_principal_over_its_request_rate_is_answered_429_with_retry_after,
    an_operator_sees_only_its_shops_audit_differences,
    an_operators_audit_finds_its_shops_differences_behind_a_thousand_of_another_shops,
    readiness_never_shows_the_database_error,
    an_unreachable_database_is_answered_503_without_the_drivers_words,
    the_service_key_secret_is_shown_once_and_listed_never,
    a_sku_of_another_shop_unknown_at_the_check_is_refused_by_the_transaction_and_changes_nothing,
    an_operator_sees_only_its_shops_skus_on_the_metrics_page,
);

/// Shop `north` with a product (two SKUs on sale, stock), an order, a plain
/// reservation and a cart line, made by north's service key; returns the ids.
struct NorthShop {
    north: TestApp,
    product: String,
    order: String,
    reservation: String,
    campaign: String,
    schedule: String,
}

async fn north_shop(app: &TestApp) -> NorthShop {
    let product = app
        .create_product(ProductSpec::complete("north", &["N-1", "N-2"]))
        .await;
    let on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    assert_eq!(on.status, 200, "{on:?}");
    app.receive("N-1", 10).await;
    app.receive("N-2", 10).await;
    let north = app.as_service_of("north").await;
    let order = north
        .create_order("north-order", "alice", &[("N-1", 1)])
        .await;
    assert_eq!(order.status, 201, "{order:?}");
    let reservation = north.reserve("north-hold", &[("N-2", 1)]).await;
    assert_eq!(reservation.status, 201, "{reservation:?}");
    let cart = north
        .send(
            Call::put("/v1/carts/alice/items/N-1")
                .key("north-cart")
                .json(&json!({"quantity": 1})),
        )
        .await;
    assert_eq!(cart.status, 200, "{cart:?}");
    // A campaign of N-2 that starts tomorrow: its unit is carved out now, its SKU
    // sells from regular stock until then.
    let campaign = app
        .send(
            Call::post("/v1/admin/campaigns")
                .admin()
                .key("north-campaign")
                .json(&json!({
                    "sku": "N-2", "quantity": 1, "per_user_limit": 1,
                    "starts_at": acceptance::START.plus_seconds(86_400).to_rfc3339(),
                    "ends_at": acceptance::START.plus_seconds(2 * 86_400).to_rfc3339(),
                })),
        )
        .await;
    assert_eq!(campaign.status, 201, "{campaign:?}");
    // A shelf change north's staff scheduled for tomorrow.
    let scheduled = app
        .shelf(
            None,
            json!({"operation": "off_at", "product_ids": [product],
                   "scheduled_at": acceptance::START.plus_seconds(86_400).to_rfc3339()}),
        )
        .await;
    assert_eq!(scheduled.status, 200, "{scheduled:?}");
    NorthShop {
        north,
        product,
        order: order.json()["order_id"].as_str().unwrap().to_owned(),
        reservation: reservation.json()["reservation_id"]
            .as_str()
            .unwrap()
            .to_owned(),
        campaign: campaign.json()["campaign_id"].as_str().unwrap().to_owned(),
        schedule: scheduled.json()["results"][0]["schedule_id"]
            .as_str()
            .unwrap()
            .to_owned(),
    }
}

/// Every route that needs a credential, as `(label, call)`, each acting on north's
/// things. The bodies are valid: only the credential decides.
fn every_protected_call(shop: &NorthShop) -> Vec<(&'static str, Call)> {
    let product = &shop.product;
    let order = &shop.order;
    let reservation = &shop.reservation;
    let movement = json!({"kind": "receive", "quantity": 1});
    vec![
        (
            "save sku",
            Call::put("/v1/skus/N-1")
                .key("t-sku")
                .json(&json!({"title": "x"})),
        ),
        ("read sku", Call::get("/v1/skus/N-1")),
        (
            "stock movement",
            Call::post("/v1/skus/N-1/stock-movements")
                .key("t-move")
                .json(&movement),
        ),
        (
            "reserve",
            Call::post("/v1/reservations")
                .key("t-reserve")
                .json(&json!({"lines": [{"sku": "N-1", "quantity": 1}]})),
        ),
        (
            "read reservation",
            Call::get(format!("/v1/reservations/{reservation}")),
        ),
        (
            "read stock movement",
            Call::get(format!("/v1/stock-movements/{reservation}.reserve.0")),
        ),
        (
            "confirm reservation",
            Call::post(format!("/v1/reservations/{reservation}/confirm")).key("t-confirm"),
        ),
        (
            "release reservation",
            Call::post(format!("/v1/reservations/{reservation}/release")).key("t-release"),
        ),
        ("audit", Call::get("/v1/audit")),
        ("metrics", Call::get("/metrics")),
        (
            "create campaign",
            Call::post("/v1/admin/campaigns")
                .key("t-campaign")
                .json(&json!({
                    "sku": "N-1", "quantity": 1,
                    "starts_at": acceptance::START.to_rfc3339(),
                    "ends_at": acceptance::START.plus_seconds(3_600).to_rfc3339(),
                })),
        ),
        (
            "read campaign",
            Call::get(format!("/v1/admin/campaigns/{}", shop.campaign)),
        ),
        (
            "end campaign",
            Call::post(format!("/v1/admin/campaigns/{}/end", shop.campaign)).key("t-end-campaign"),
        ),
        // Tickets are their holder's alone: anyone else hears 404 (tested in
        // acceptance::campaigns); here only the credential check.
        (
            "read ticket",
            Call::get("/v1/tickets/tkt_0000000000000000000000000000"),
        ),
        (
            "create order",
            Call::post("/v1/orders")
                .key("t-order")
                .json(&json!({"user_id": "bob", "lines": [{"sku": "N-1", "quantity": 1}]})),
        ),
        ("read order", Call::get(format!("/v1/orders/{order}"))),
        (
            "pay order",
            Call::post(format!("/v1/orders/{order}/pay"))
                .key("t-pay")
                .json(&json!({"payment_method": "pm_card_visa"})),
        ),
        (
            "cancel order",
            Call::post(format!("/v1/orders/{order}/cancel")).key("t-cancel"),
        ),
        (
            "return order",
            Call::post(format!("/v1/orders/{order}/return")).key("t-return"),
        ),
        (
            "resolve refund",
            Call::post(format!(
                "/v1/orders/{order}/refunds/rfd_0000000000000000000000000000/resolve"
            ))
            .key("t-resolve")
            .json(&json!({"resolution": "send_again", "remark": "the bank said yes"})),
        ),
        (
            "create product",
            Call::post("/v1/products").key("t-product").json(&json!({
                "title": "P", "category": "c", "supplier": "s", "shop": "north",
                "skus": [{"sku": "N-NEW", "price": 1, "currency": "CNY"}]
            })),
        ),
        (
            "update product",
            Call::patch(format!("/v1/products/{product}"))
                .key("t-patch")
                .json(&json!({"title": "renamed"})),
        ),
        (
            "delete product",
            Call::new(Method::DELETE, format!("/v1/products/{product}")).key("t-delete"),
        ),
        (
            "staff product view",
            Call::get(format!("/v1/admin/products/{product}")),
        ),
        (
            "shelf operation",
            Call::post("/v1/admin/shelf")
                .key("t-shelf")
                .json(&json!({"operation": "off", "product_ids": [product]})),
        ),
        ("shelf log", Call::get("/v1/admin/shelf-log")),
        ("list products", Call::get("/v1/admin/products?shop=north")),
        (
            "list schedules",
            Call::get("/v1/admin/schedules?shop=north"),
        ),
        (
            "cancel schedule",
            Call::post(format!("/v1/admin/schedules/{}/cancel", shop.schedule)).key("t-unschedule"),
        ),
        ("list orders", Call::get("/v1/orders?shop=north")),
        ("who am i", Call::get("/v1/me")),
        (
            "create operator",
            Call::post("/v1/admin/operators")
                .key("t-operator")
                .json(&json!({"operator_id": "mallory", "shop": "north"})),
        ),
        (
            "create service key",
            Call::post("/v1/admin/service-keys")
                .key("t-key")
                .json(&json!({"shop": "north", "name": "x"})),
        ),
        ("list service keys", Call::get("/v1/admin/service-keys")),
        (
            "revoke service key",
            Call::new(
                Method::DELETE,
                "/v1/admin/service-keys/key_0000000000000000000000000000",
            )
            .key("t-revoke"),
        ),
        (
            "revoke operator",
            Call::new(Method::DELETE, "/v1/admin/operators/nobody").key("t-revoke-operator"),
        ),
        (
            "put cart item",
            Call::put("/v1/carts/alice/items/N-2")
                .key("t-cart")
                .json(&json!({"quantity": 1})),
        ),
        (
            "delete cart item",
            Call::new(Method::DELETE, "/v1/carts/alice/items/N-1").key("t-uncart"),
        ),
        ("read cart", Call::get("/v1/carts/alice")),
        (
            "checkout",
            Call::post("/v1/carts/alice/checkout").key("t-checkout"),
        ),
        ("read events", Call::get("/v1/events")),
    ]
}

/// Operations no credential guards: the shopper's product view, the gateway's
/// webhook (its signature is its credential), health, the documents and the pages
/// (the console calls the API with the credential its user pastes).
const OPEN_OPERATIONS: &[(&str, &str)] = &[
    ("GET", "/v1/products/{id}"),
    ("POST", "/v1/payments/webhook"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
    ("GET", "/"),
    ("GET", "/docs"),
    ("GET", "/console"),
    ("GET", "/assets/{file}"),
];

/// Whether `path` (a call's, its query left off) is an instance of `template`.
fn path_matches(template: &str, path: &str) -> bool {
    let path = path.split('?').next().unwrap_or_default();
    let (template, path): (Vec<&str>, Vec<&str>) =
        (template.split('/').collect(), path.split('/').collect());
    template.len() == path.len()
        && template
            .iter()
            .zip(&path)
            .all(|(part, segment)| part.starts_with('{') || part == segment)
}

/// Sends each call; each must be refused with `status` and `code`, and nothing in the
/// database may change.
async fn assert_each_refused(
    app: &TestApp,
    calls: Vec<(&'static str, Call)>,
    status: u16,
    code: &str,
) {
    assert_each_refused_unnamed(app, calls, status, code, None).await;
}

/// [`assert_each_refused`], and no refusal names `hidden` (another shop's code: a
/// caller must not learn which shop holds what it named).
async fn assert_each_refused_unnamed(
    app: &TestApp,
    calls: Vec<(&'static str, Call)>,
    status: u16,
    code: &str,
    hidden: Option<&str>,
) {
    let before = app.contents().await;
    for (label, call) in calls {
        let response = app.send(call).await;
        assert_eq!(response.status, status, "{label}: {response:?}");
        assert_eq!(response.code().as_deref(), Some(code), "{label}");
        if let Some(hidden) = hidden {
            assert!(!response.body.contains(hidden), "{label}: {response:?}");
        }
        assert_eq!(
            response.content_type(),
            "application/problem+json",
            "{label}"
        );
        assert_eq!(
            app.contents().await,
            before,
            "{label}: the database changed"
        );
    }
}

async fn every_route_refuses_a_caller_without_a_known_credential_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let shop = north_shop(&app).await;
    // Every documented operation is here, so a new route that forgets its
    // credential check fails this test.
    let document = app
        .send(Call::get("/openapi.json").anonymous())
        .await
        .json();
    let calls = every_protected_call(&shop);
    let mut missing = Vec::new();
    for (template, operations) in document["paths"].as_object().unwrap() {
        for method in operations.as_object().unwrap().keys() {
            let method = method.to_uppercase();
            let covered = OPEN_OPERATIONS.contains(&(method.as_str(), template.as_str()))
                || calls.iter().any(|(_, call)| {
                    call.method.as_str() == method && path_matches(template, &call.path)
                });
            if !covered {
                missing.push(format!("{method} {template}"));
            }
        }
    }
    assert_eq!(
        missing,
        Vec::<String>::new(),
        "operations this test does not call"
    );
    let anonymous: Vec<_> = every_protected_call(&shop)
        .into_iter()
        .map(|(label, call)| (label, call.anonymous()))
        .collect();
    assert_each_refused(&app, anonymous, 401, "unauthorized").await;
    // Tokens of every stored shape, looked up in the database, and one of none.
    for token in [
        "stockd_sk_not-a-key-anyone-was-given".to_owned(),
        format!("stockd_sk_{}", "0".repeat(64)),
        "ab".repeat(32),
    ] {
        let unknown: Vec<_> = every_protected_call(&shop)
            .into_iter()
            .map(|(label, call)| (label, call.bearer(&token)))
            .collect();
        assert_each_refused(&app, unknown, 401, "unauthorized").await;
    }
    // The shopper's product view is the one open route.
    let product = app
        .send(Call::get(format!("/v1/products/{}", shop.product)).anonymous())
        .await;
    assert_eq!(product.status, 200, "{product:?}");
}

async fn a_credential_of_another_shop_is_forbidden_everywhere_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let shop = north_shop(&app).await;
    let south_service = app.create_service_key("south", "south-checkout").await;
    let south_operator = app.create_operator("sam", "south").await;
    // Each call goes with the south credential whose role may make it: a service key
    // for what a checkout does, an operator for what staff do.
    let staff_routes = [
        "save sku",
        "stock movement",
        "return order",
        "create product",
        "update product",
        "staff product view",
        "shelf operation",
        "list products",
        "list schedules",
        "cancel schedule",
        "create campaign",
        "end campaign",
    ];
    let service_routes = [
        "read sku",
        "read campaign",
        "reserve",
        "read reservation",
        "read stock movement",
        "confirm reservation",
        "release reservation",
        "create order",
        "read order",
        "list orders",
        "pay order",
        "cancel order",
        "put cart item",
        "delete cart item",
    ];
    let calls: Vec<_> = every_protected_call(&shop)
        .into_iter()
        .filter_map(|(label, call)| {
            if staff_routes.contains(&label) {
                Some((label, call.bearer(&south_operator)))
            } else if service_routes.contains(&label) {
                Some((label, call.bearer(&south_service)))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(calls.len(), staff_routes.len() + service_routes.len());
    assert_each_refused_unnamed(&app, calls, 403, "forbidden", Some("north")).await;
    // What a south key reads of a shopper's cart is south's lines: none.
    let cart = app
        .send(Call::get("/v1/carts/alice").bearer(&south_service))
        .await;
    assert_eq!(cart.status, 200);
    assert_eq!(cart.json()["lines"], json!([]));
    assert_eq!(
        shop.north.send(Call::get("/v1/carts/alice")).await.json()["lines"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "north's line is untouched"
    );
}

async fn admin_only_routes_refuse_operators_and_staff_routes_refuse_service_keys(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let shop = north_shop(&app).await;
    let north_operator = app.create_operator("nora", "north").await;
    let admin_only = [
        "delete product",
        "create operator",
        "create service key",
        "list service keys",
        "revoke service key",
        "revoke operator",
    ];
    let calls: Vec<_> = every_protected_call(&shop)
        .into_iter()
        .filter(|(label, _)| admin_only.contains(label))
        .map(|(label, call)| (label, call.bearer(&north_operator)))
        .collect();
    assert_eq!(calls.len(), admin_only.len());
    assert_each_refused(&app, calls, 403, "forbidden").await;
    let mut deleting = shop_operation(&shop.product, "delete");
    deleting.credential = acceptance::Credential::Bearer(north_operator.clone());
    assert_each_refused(&app, vec![("shelf delete", deleting)], 403, "forbidden").await;

    // North's own checkout backend may sell in north, never run its shop.
    let staff_only = [
        "save sku",
        "stock movement",
        "return order",
        "resolve refund",
        "create product",
        "update product",
        "delete product",
        "staff product view",
        "shelf operation",
        "shelf log",
        "audit",
        "metrics",
        "list products",
        "list schedules",
        "cancel schedule",
        "create campaign",
        "end campaign",
    ];
    let calls: Vec<_> = every_protected_call(&shop)
        .into_iter()
        .filter(|(label, _)| staff_only.contains(label))
        .collect();
    assert_eq!(calls.len(), staff_only.len());
    assert_each_refused(&shop.north, calls, 403, "forbidden").await;
    // And a north operator never sells, nor cancels an unpaid order (a paid one is
    // its decision).
    let selling: Vec<_> = every_protected_call(&shop)
        .into_iter()
        .filter(|(label, _)| {
            [
                "reserve",
                "create order",
                "pay order",
                "checkout",
                "cancel order",
            ]
            .contains(label)
        })
        .map(|(label, call)| (label, call.bearer(&north_operator)))
        .collect();
    assert_each_refused(&app, selling, 403, "forbidden").await;
}

fn shop_operation(product: &str, operation: &str) -> Call {
    Call::post("/v1/admin/shelf")
        .key(format!("t-shelf-{operation}"))
        .json(&json!({"operation": operation, "product_ids": [product]}))
}

/// The attack of issue 12: an order's reservation confirmed (goods out without
/// payment) or released (stock back while the order waits) through the reservation
/// endpoints.
async fn confirming_or_releasing_an_order_held_reservation_is_refused_and_the_order_flow_still_works(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let gateway = acceptance::payments::TestGateway::start(&app).await;
    let shop = north_shop(&app).await;
    let north = &shop.north;
    let order = north.order(&shop.order).await;
    let held = order["reservation"]["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(order["reservation"]["order_id"], shop.order.as_str());
    let counters = north.counters("N-1").await;
    let before = app.contents().await;

    for (label, response) in [
        ("confirm", north.confirm(&held, "attack-confirm").await),
        ("release", north.release(&held, "attack-release").await),
        (
            "confirm as the admin",
            app.send(
                Call::post(format!("/v1/reservations/{held}/confirm"))
                    .admin()
                    .key("attack-admin"),
            )
            .await,
        ),
    ] {
        assert_eq!(response.status, 409, "{label}: {response:?}");
        assert_eq!(response.code().as_deref(), Some("illegal_transition"));
    }

    assert_eq!(
        app.contents().await,
        before,
        "nothing stored, nothing moved"
    );
    assert_eq!(north.counters("N-1").await, counters);
    app.assert_audit_clean().await;
    let paid = north
        .pay(&shop.order, "pay-after-attack", "pm_card_visa")
        .await;
    assert_eq!(paid.status, 200, "{paid:?}");
    assert_eq!(paid.json()["status"], "PAID");
    // The order-expiry worker keeps expiring other orders.
    let unpaid = north.order_of("carol", &[("N-2", 1)]).await;
    app.clock.advance_seconds(3600);
    let expired = app.engine.order_expiry_step().await.expect("order expiry");
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(north.order(&unpaid).await["status"], "EXPIRED");
    app.assert_audit_clean().await;
    assert_eq!(gateway.charges_for(&shop.order), 1);
}

async fn two_principals_sending_the_same_key_at_once_get_two_independent_effects(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SHARED", 10).await;
    let other = app.as_service_of("default").await;
    let body = json!({"lines": [{"sku": "SHARED", "quantity": 1}]});
    let send = |app: &TestApp| {
        let app = app.clone();
        let call = Call::post("/v1/reservations")
            .key("the-same-key")
            .json(&body);
        tokio::spawn(async move { app.send(call).await })
    };
    let (first, second) = (send(&app), send(&other));
    let (first, second) = (first.await.unwrap(), second.await.unwrap());

    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(second.status, 201, "{second:?}");
    assert!(!first.replayed() && !second.replayed());
    assert_ne!(
        first.json()["reservation_id"],
        second.json()["reservation_id"]
    );
    assert_eq!(app.counters("SHARED").await, (8, 2));
    // Each principal's retry replays its own first answer, never the other's.
    let retry = other
        .send(
            Call::post("/v1/reservations")
                .key("the-same-key")
                .json(&body),
        )
        .await;
    assert!(retry.replayed());
    assert_eq!(retry.body, second.body);
}

async fn set_per_user_limit(app: &TestApp, sku: &str, limit: Value) {
    let response = app
        .send(
            Call::put(format!("/v1/skus/{sku}"))
                .admin()
                .key(format!("limit-{sku}-{limit}"))
                .json(&json!({"per_user_limit": limit})),
        )
        .await;
    assert_eq!(response.status, 200, "{response:?}");
}

fn reservation_for(user: &str, key: &str, sku: &str, quantity: i64) -> Call {
    Call::post("/v1/reservations").key(key).json(&json!({
        "lines": [{"sku": sku, "quantity": quantity}],
        "user_id": user,
    }))
}

async fn a_shopper_never_passes_a_per_user_limit_however_many_requests_race(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LIMITED", 100).await;
    set_per_user_limit(&app, "LIMITED", json!(3)).await;

    let calls = (0..50)
        .map(|index| reservation_for("alice", &format!("alice-{index}"), "LIMITED", 1))
        .collect();
    let responses = acceptance::send_concurrently(&app, calls).await;

    let accepted: Vec<&TestResponse> = responses
        .iter()
        .filter(|response| response.status == 201)
        .collect();
    assert_eq!(accepted.len(), 3, "{responses:?}");
    for refused in responses.iter().filter(|response| response.status != 201) {
        assert_eq!(refused.status, 409, "{refused:?}");
        assert_eq!(refused.code().as_deref(), Some("purchase_limit_exceeded"));
    }
    assert_eq!(app.counters("LIMITED").await, (97, 3));
    // Another shopper is unaffected; an order counts like a reservation.
    let bob = app
        .send(reservation_for("bob", "bob-1", "LIMITED", 3))
        .await;
    assert_eq!(bob.status, 201, "{bob:?}");
    let order = app
        .create_order("alice-order", "alice", &[("LIMITED", 1)])
        .await;
    assert_eq!(order.code().as_deref(), Some("purchase_limit_exceeded"));
    // A request that names no shopper cannot be counted, so it is refused.
    let anonymous = app.reserve("nobody", &[("LIMITED", 1)]).await;
    assert_eq!(anonymous.status, 409, "{anonymous:?}");
    assert_eq!(anonymous.code().as_deref(), Some("failed_precondition"));
    // A released hold gives its units back; a confirmed one keeps counting.
    let first = accepted[0].json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let second = accepted[1].json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(app.release(&first, "alice-release").await.status, 200);
    assert_eq!(app.confirm(&second, "alice-confirm").await.status, 200);
    let again = app
        .send(reservation_for("alice", "alice-again", "LIMITED", 1))
        .await;
    assert_eq!(again.status, 201, "{again:?}");
    let over = app
        .send(reservation_for("alice", "alice-over", "LIMITED", 1))
        .await;
    assert_eq!(over.code().as_deref(), Some("purchase_limit_exceeded"));
    app.assert_audit_clean().await;
}

/// Many shoppers in the same batches: their tallies are read and written together (one
/// statement each on PostgreSQL), new tallies and existing ones alike.
async fn many_shoppers_racing_at_once_each_get_their_limit_and_their_tallies_count_it(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CROWD", 1_000).await;
    set_per_user_limit(&app, "CROWD", json!(2)).await;
    let shoppers: Vec<String> = (0..24).map(|index| format!("shopper-{index:02}")).collect();
    // A third of them already hold one unit: their tallies exist before the race.
    for shopper in shoppers.iter().step_by(3) {
        let first = app
            .send(reservation_for(
                shopper,
                &format!("{shopper}-early"),
                "CROWD",
                1,
            ))
            .await;
        assert_eq!(first.status, 201, "{first:?}");
    }

    let calls = shoppers
        .iter()
        .flat_map(|shopper| {
            (0..3).map(move |attempt| {
                reservation_for(shopper, &format!("{shopper}-race-{attempt}"), "CROWD", 1)
            })
        })
        .collect();
    let responses = acceptance::send_concurrently(&app, calls).await;

    for (index, shopper) in shoppers.iter().enumerate() {
        let theirs = &responses[index * 3..index * 3 + 3];
        let held_before = if index % 3 == 0 { 1 } else { 0 };
        let accepted = theirs
            .iter()
            .filter(|response| response.status == 201)
            .count();
        assert_eq!(accepted, 2 - held_before, "{shopper}: {theirs:?}");
        for refused in theirs.iter().filter(|response| response.status != 201) {
            assert_eq!(refused.status, 409, "{refused:?}");
            assert_eq!(refused.code().as_deref(), Some("purchase_limit_exceeded"));
        }
    }
    let contents = app.contents().await;
    for shopper in &shoppers {
        let bought = acceptance::rows_where(&contents, "shopper_purchase", 1, shopper);
        assert_eq!(bought.len(), 1, "{shopper}: {bought:?}");
        assert_eq!(bought[0][2], "CROWD");
        assert_eq!(bought[0][3], "2", "{shopper}: {bought:?}");
        let holds = acceptance::rows_where(&contents, "shopper_hold", 1, shopper);
        assert_eq!(holds.len(), 1, "{shopper}: {holds:?}");
        assert_eq!(holds[0][2], "2", "{shopper}: {holds:?}");
    }
    assert_eq!(app.counters("CROWD").await, (1_000 - 48, 48));
    app.assert_audit_clean().await;
}

async fn a_shopper_at_the_open_hold_bound_is_refused_until_a_hold_ends(backend: Backend) {
    let app = TestApp::spawn_with_limits(backend, store::StoreLimits { open_holds_max: 2 }).await;
    app.stocked_sku("HELD", 10).await;
    let first = app.send(reservation_for("alice", "h-1", "HELD", 1)).await;
    let order = app.create_order("h-2", "alice", &[("HELD", 1)]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(order.status, 201, "{order:?}");
    let before = app.contents_except_idempotency_records().await;

    let third = app.send(reservation_for("alice", "h-3", "HELD", 1)).await;

    assert_eq!(third.status, 409, "{third:?}");
    assert_eq!(third.code().as_deref(), Some("purchase_limit_exceeded"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    assert_eq!(
        app.send(reservation_for("bob", "h-bob", "HELD", 1))
            .await
            .status,
        201
    );
    let id = first.json()["reservation_id"].as_str().unwrap().to_owned();
    assert_eq!(app.release(&id, "h-release").await.status, 200);
    let fourth = app.send(reservation_for("alice", "h-4", "HELD", 1)).await;
    assert_eq!(fourth.status, 201, "a released hold makes room: {fourth:?}");
}

async fn a_revoked_service_key_is_refused_here_at_once_and_elsewhere_within_the_cache_bound(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("REVOKED", 5).await;
    let other_instance = app.another_instance().await;
    let created = app
        .send(
            Call::post("/v1/admin/service-keys")
                .admin()
                .key("to-revoke")
                .json(&json!({"shop": "default", "name": "leaked"})),
        )
        .await;
    let secret = created.json()["secret"].as_str().unwrap().to_owned();
    let key_id = created.json()["key_id"].as_str().unwrap().to_owned();
    let read = Call::get("/v1/skus/REVOKED").bearer(&secret);
    assert_eq!(app.send(read.clone()).await.status, 200);
    assert_eq!(other_instance.send(read.clone()).await.status, 200);

    let revoked = app
        .send(
            Call::new(Method::DELETE, format!("/v1/admin/service-keys/{key_id}"))
                .admin()
                .key("revoke"),
        )
        .await;
    assert_eq!(revoked.status, 200, "{revoked:?}");
    assert!(revoked.json()["revoked_at"].is_string());

    let here = app.send(read.clone()).await;
    assert_eq!(
        here.status, 401,
        "refused at once where it was revoked: {here:?}"
    );
    // The other instance read the key less than the bound ago: it may still trust it,
    // for at most that long.
    let bound = engine::EngineConfig::default().credential_cache_milliseconds;
    app.clock.advance_milliseconds(bound - 1);
    assert_eq!(other_instance.send(read.clone()).await.status, 200);
    app.clock.advance_milliseconds(1);
    let elsewhere = other_instance.send(read.clone()).await;
    assert_eq!(
        elsewhere.status, 401,
        "refused within the bound: {elsewhere:?}"
    );
    let reserving = other_instance
        .send(
            Call::post("/v1/reservations")
                .bearer(&secret)
                .key("after-revoke")
                .json(&json!({"lines": [{"sku": "REVOKED", "quantity": 1}]})),
        )
        .await;
    assert_eq!(reserving.status, 401);
    assert_eq!(app.counters("REVOKED").await, (5, 0));
}

async fn a_revoked_operator_is_refused_here_at_once_and_elsewhere_within_the_cache_bound(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let shop = north_shop(&app).await;
    let other_instance = app.another_instance().await;
    let token = app.create_operator("leaver", "north").await;
    let read = Call::get(format!("/v1/admin/products/{}", shop.product)).bearer(&token);
    assert_eq!(app.send(read.clone()).await.status, 200);
    assert_eq!(other_instance.send(read.clone()).await.status, 200);
    let revoke = |key: &str| {
        Call::new(Method::DELETE, "/v1/admin/operators/leaver")
            .admin()
            .key(key)
    };

    let revoked = app.send(revoke("revoke-leaver")).await;

    assert_eq!(revoked.status, 200, "{revoked:?}");
    assert_eq!(revoked.json()["operator_id"], "leaver");
    assert_eq!(revoked.json()["shop"], "north");
    assert!(revoked.json()["revoked_at"].is_string(), "{revoked:?}");
    let here = app.send(read.clone()).await;
    assert_eq!(
        here.status, 401,
        "refused at once where it was revoked: {here:?}"
    );
    let bound = engine::EngineConfig::default().credential_cache_milliseconds;
    app.clock.advance_milliseconds(bound);
    let elsewhere = other_instance.send(read.clone()).await;
    assert_eq!(
        elsewhere.status, 401,
        "refused within the bound: {elsewhere:?}"
    );
    let before = app.contents().await;
    let taking_down = app
        .send(
            shop_operation(&shop.product, "off")
                .bearer(&token)
                .key("after-leaving"),
        )
        .await;
    assert_eq!(taking_down.status, 401, "{taking_down:?}");
    assert_eq!(
        app.contents().await,
        before,
        "a revoked token changes nothing"
    );
    // Revoking again answers the same; an unknown operator is not found; the id stays
    // taken.
    let again = app.send(revoke("revoke-leaver-again")).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["revoked_at"], revoked.json()["revoked_at"]);
    let unknown = app
        .send(
            Call::new(Method::DELETE, "/v1/admin/operators/never-was")
                .admin()
                .key("revoke-unknown"),
        )
        .await;
    assert_eq!(unknown.status, 404, "{unknown:?}");
    assert_eq!(unknown.code().as_deref(), Some("not_found"));
    let recreated = app
        .send(
            Call::post("/v1/admin/operators")
                .admin()
                .key("recreate-leaver")
                .json(&json!({"operator_id": "leaver", "shop": "north"})),
        )
        .await;
    assert_eq!(recreated.code().as_deref(), Some("already_exists"));
    // The names stockd writes into the shelf log itself are taken too, in any case
    // (`Admin` in the log would read as the admin's change).
    for reserved in [
        "admin",
        "scheduler",
        "system",
        "Admin",
        "SCHEDULER",
        "System",
    ] {
        let taken = app
            .send(
                Call::post("/v1/admin/operators")
                    .admin()
                    .key(format!("create-{reserved}"))
                    .json(&json!({"operator_id": reserved, "shop": "north"})),
            )
            .await;
        assert_eq!(taken.status, 409, "{reserved}: {taken:?}");
        assert_eq!(
            taken.code().as_deref(),
            Some("already_exists"),
            "{reserved}"
        );
    }
}

async fn a_principal_over_its_request_rate_is_answered_429_with_retry_after(backend: Backend) {
    // Five at once, then one an hour: the test is done long before the next one. (The
    // admin, a principal too, makes four calls setting up.)
    let http = api::http::HttpConfig {
        rate_limit_requests_per_second: 1.0 / 3600.0,
        rate_limit_burst: 5,
        ..api::http::HttpConfig::default()
    };
    let app = TestApp::spawn_with_http(backend, &http).await;
    app.stocked_sku("RATED", 10).await;
    let other = app.as_service_of("default").await;
    for index in 0..5 {
        let within = app
            .reserve(&format!("rated-{index}"), &[("RATED", 1)])
            .await;
        assert_eq!(within.status, 201, "within the burst: {within:?}");
    }
    let before = app.contents().await;
    let limited = app.reserve("rated-5", &[("RATED", 1)]).await;

    assert_eq!(limited.status, 429, "{limited:?}");
    assert_eq!(limited.code().as_deref(), Some("rate_limited"));
    let retry_after: u64 = limited.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        retry_after > 3000,
        "the next request is an hour away: {retry_after}"
    );
    assert_eq!(
        app.contents().await,
        before,
        "a limited request changes nothing"
    );
    // Another principal has its own rate.
    assert_eq!(other.reserve("other-1", &[("RATED", 1)]).await.status, 201);
}

async fn an_operator_sees_only_its_shops_audit_differences(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let shop = north_shop(&app).await;
    let _ = shop;
    let product = app
        .create_product(ProductSpec::complete("south", &["S-1"]))
        .await;
    let _ = product;
    app.receive("S-1", 5).await;
    let mut tamper = app.database.raw_connection().await;
    tamper
        .execute("UPDATE stock SET available = available + 7 WHERE sku IN ('N-2', 'S-1')")
        .await
        .unwrap();
    let north_operator = app.create_operator("nina", "north").await;

    let admin_view = app.audit().await;
    let operator_view = app
        .send(Call::get("/v1/audit").bearer(&north_operator))
        .await
        .json();

    let skus = |audit: &Value| -> Vec<String> {
        audit["differences"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|difference| difference["sku"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(skus(&admin_view).contains(&"S-1".to_owned()));
    assert!(skus(&admin_view).contains(&"N-2".to_owned()));
    assert_eq!(operator_view["ok"], false);
    assert!(
        skus(&operator_view).iter().all(|sku| sku == "N-2"),
        "{operator_view}"
    );
    assert!(!skus(&operator_view).is_empty());
}

async fn an_operators_audit_finds_its_shops_differences_behind_a_thousand_of_another_shops(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    north_shop(&app).await;
    // A south SKU that sorts before north's, with 400 stock rows no ledger row
    // explains: 1,200 differences, listed before north's one.
    app.create_product(ProductSpec::complete("south", &["A-SOUTH"]))
        .await;
    let mut tamper = app.database.raw_connection().await;
    for warehouse in 0..400 {
        tamper
            .execute(&format!(
                "INSERT INTO stock (sku, warehouse, available, reserved, version, updated_at) \
                 VALUES ('A-SOUTH', 'w{warehouse:04}', 1, 1, 1, 0)"
            ))
            .await
            .unwrap();
    }
    tamper
        .execute("UPDATE stock SET available = available + 7 WHERE sku = 'N-1'")
        .await
        .unwrap();
    let north_operator = app.create_operator("nina", "north").await;

    let admin_view = app.audit().await;
    let operator_view = app
        .send(Call::get("/v1/audit").bearer(&north_operator))
        .await
        .json();

    assert!(
        admin_view["differences_total"].as_i64().unwrap() > 1_000,
        "{}",
        admin_view["differences_total"]
    );
    assert_eq!(operator_view["ok"], false, "{operator_view}");
    assert_eq!(operator_view["differences_total"], 1, "{operator_view}");
    assert_eq!(
        operator_view["differences"][0]["sku"], "N-1",
        "{operator_view}"
    );
}

async fn readiness_never_shows_the_database_error(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.store.close().await;

    let ready = app.send(Call::get("/readyz").anonymous()).await;

    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(ready.json()["detail"], "the database is unreachable");
    assert!(ready.headers.contains_key("retry-after"));
}

/// Found in review: a 503 carried the driver's message (`attempted to acquire a
/// connection on a closed pool`, `Connection refused`, a full disk's path) to any
/// caller. The message is logged; the caller gets a fixed sentence.
async fn an_unreachable_database_is_answered_503_without_the_drivers_words(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("CLOSED", 5).await;
    app.store.close().await;

    let read = app.send(Call::get("/v1/skus/CLOSED").admin()).await;
    let write = app.reserve("while-closed", &[("CLOSED", 1)]).await;

    for answer in [&read, &write] {
        assert_eq!(answer.status, 503, "{answer:?}");
        assert_eq!(answer.code().as_deref(), Some("unavailable"), "{answer:?}");
        assert_eq!(
            answer.json()["detail"],
            api::problem::DATABASE_UNAVAILABLE_DETAIL,
            "{answer:?}"
        );
        assert!(answer.headers.contains_key("retry-after"), "{answer:?}");
    }
}

async fn the_service_key_secret_is_shown_once_and_listed_never(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let create = Call::post("/v1/admin/service-keys")
        .admin()
        .key("shown-once")
        .json(&json!({"shop": "north", "name": "north checkout"}));
    let first = app.send(create.clone()).await;
    let replay = app.send(create).await;
    let listed = app.send(Call::get("/v1/admin/service-keys").admin()).await;

    assert_eq!(first.status, 201);
    let secret = first.json()["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("stockd_sk_"));
    assert!(replay.replayed());
    assert!(replay.json().get("secret").is_none(), "{replay:?}");
    assert!(!listed.body.contains(&secret));
    assert!(
        !app.contents().await.contains(&secret),
        "only its hash is stored"
    );
    let keys = listed.json()["service_keys"].as_array().unwrap().clone();
    assert!(
        keys.iter()
            .any(|key| key["name"] == "north checkout" && key["shop"] == "north")
    );
}

/// Found in review: the engine checks the caller's shop against a SKU's before the
/// transaction, but a SKU it did not know then (created since, maybe by another shop)
/// passed unchecked. A stock movement was then applied to another shop's SKU, and a
/// cart's, a reservation's or an order's refusal of another shop's SKU was stored as
/// the key's answer. The store is
/// called here as the engine calls it after finding no such SKU: shop `north` required,
/// the SKU in shop `default`.
async fn a_sku_of_another_shop_unknown_at_the_check_is_refused_by_the_transaction_and_changes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("SOUTH-1", 5).await;
    let before = app.contents().await;
    let now = app.clock_now();
    let north = domain::ShopCode::parse("north").expect("shop");
    let sku = domain::SkuCode::parse("SOUTH-1").expect("sku");
    let claim = |key: &str| store::IdempotencyClaim {
        key: store::ScopedKey::new(
            &domain::Principal::Admin,
            &domain::IdempotencyKey::parse(key).expect("key"),
        ),
        fingerprint: key.to_owned(),
    };
    let movement = store::StockMovement {
        id: domain::MovementId::generate(now, 1),
        shop: domain::ShopScope::Required(north.clone()),
        sku: sku.clone(),
        warehouse: domain::WarehouseCode::default_warehouse(),
        quantity: store::MovementQuantity::Adjust(
            serde_json::from_str::<domain::AdjustmentQuantity>("-5").expect("quantity"),
        ),
    };

    let moved = app
        .store
        .record_movement(&claim("move"), &movement, now, api::renderer().as_ref())
        .await
        .expect("record movement");
    let carted = app
        .store
        .set_cart_item(
            &claim("cart"),
            &north,
            &domain::UserId::parse("alice").expect("user"),
            &sku,
            Some(1),
            (now, now),
            api::renderer().as_ref(),
        )
        .await
        .expect("set cart item");
    let lines = vec![domain::ReservationLine {
        sku: sku.clone(),
        warehouse: domain::WarehouseCode::default_warehouse(),
        quantity: domain::Quantity::new(1).expect("quantity"),
    }];
    let expires_at = now.plus_seconds(600);
    let reservation = store::ReserveRequest {
        claim: claim("reserve"),
        id: domain::ReservationId::generate(now, 2),
        lines: lines.clone(),
        ttl_seconds: 600,
        shop: domain::ShopScope::Required(north.clone()),
        user: None,
        reference: domain::OrderReference::default(),
        undecided_when_short: false,
    };
    let reserved = app
        .store
        .reserve_batch(
            std::slice::from_ref(&reservation),
            now,
            api::renderer().as_ref(),
            &mut store::LockTurn::free(),
        )
        .await
        .expect("reserve batch")
        .outcomes;
    let order = store::NewOrder {
        id: domain::OrderId::generate(now, 3),
        shop: domain::ShopScope::Required(north.clone()),
        user: domain::UserId::parse("alice").expect("user"),
        reservation_id: domain::ReservationId::generate(now, 4),
        lines,
        expires_at,
        skipped: None,
        reference: domain::OrderReference::default(),
        undecided_when_short: false,
    };
    let ordered = app
        .store
        .create_order(&claim("order"), &order, now, api::renderer().as_ref())
        .await
        .expect("create order");

    assert!(
        matches!(moved, store::Idempotent::Forbidden(_)),
        "{moved:?}"
    );
    assert!(
        matches!(carted, store::Idempotent::Forbidden(_)),
        "{carted:?}"
    );
    assert!(
        matches!(reserved.as_slice(), [store::Idempotent::Forbidden(_)]),
        "{reserved:?}"
    );
    assert!(
        matches!(ordered, store::Idempotent::Forbidden(_)),
        "{ordered:?}"
    );
    assert_eq!(
        app.contents().await,
        before,
        "no stock moved, no cart line, no hold, no order, no key stored"
    );
}

/// Found in review: `/metrics` named every shop's most retried SKUs, with their counts,
/// to the operator of any shop. An operator now sees only its shop's SKUs there; the
/// admin (and the metrics token) all of them.
async fn an_operator_sees_only_its_shops_skus_on_the_metrics_page(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let shop = north_shop(&app).await;
    app.stocked_sku("SOUTH-1", 5).await;
    for _ in 0..2 {
        let north = shop.north.reserve("north-again", &[("N-2", 1)]).await;
        assert_eq!(north.status, 201, "{north:?}");
        let south = app.reserve("south-again", &[("SOUTH-1", 1)]).await;
        assert_eq!(south.status, 201, "{south:?}");
    }
    let operator = app.create_operator("nora", "north").await;

    let seen_by_operator = app.send(Call::get("/metrics").bearer(&operator)).await;
    let seen_by_admin = app.send(Call::get("/metrics").admin()).await;

    assert_eq!(seen_by_operator.status, 200);
    let north_line = "stockd_hot_sku_duplicate_requests_total{sku=\"N-2\"} 1";
    let south_line = "stockd_hot_sku_duplicate_requests_total{sku=\"SOUTH-1\"} 1";
    assert!(
        seen_by_operator.body.contains(north_line),
        "{}",
        seen_by_operator.body
    );
    assert!(
        !seen_by_operator.body.contains("SOUTH-1"),
        "{}",
        seen_by_operator.body
    );
    assert!(
        seen_by_admin.body.contains(north_line),
        "{}",
        seen_by_admin.body
    );
    assert!(
        seen_by_admin.body.contains(south_line),
        "{}",
        seen_by_admin.body
    );
}

/// Found in review: the limit was checked line by line, so one request for a SKU
/// limited to 1 per shopper, one unit from each of two warehouses, passed the plan;
/// the database's tally check (which sees the SKU's units together) then refused the
/// batch's write on every retry, and the request, with every request batched with it,
/// heard 503. It is now refused by itself (409) and the others are served.
async fn one_request_over_the_limit_across_two_warehouses_is_refused_and_fails_no_one_else(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.create_sku("SPLIT").await;
    app.receive_in("SPLIT", 5, Some("east")).await;
    app.receive_in("SPLIT", 5, Some("west")).await;
    set_per_user_limit(&app, "SPLIT", json!(1)).await;
    let both = Call::post("/v1/reservations").key("ann-both").json(&json!({
        "lines": [
            {"sku": "SPLIT", "warehouse": "east", "quantity": 1},
            {"sku": "SPLIT", "warehouse": "west", "quantity": 1},
        ],
        "user_id": "ann",
    }));
    let others = (0..4).map(|index| {
        Call::post("/v1/reservations")
            .key(format!("other-{index}"))
            .json(&json!({
                "lines": [{"sku": "SPLIT", "warehouse": "east", "quantity": 1}],
                "user_id": format!("shopper-{index}"),
            }))
    });

    let answers =
        acceptance::send_concurrently(&app, std::iter::once(both).chain(others).collect()).await;

    assert_eq!(answers[0].status, 409, "{:?}", answers[0]);
    assert_eq!(
        answers[0].code().as_deref(),
        Some("purchase_limit_exceeded")
    );
    for other in &answers[1..] {
        assert_eq!(other.status, 201, "{other:?}");
    }
    assert_eq!(app.counters("SPLIT").await, (6, 4));
    app.assert_audit_clean().await;
}

/// Found in review: instances started together on a new database each found no admin
/// token, generated one and replaced whatever was stored: one instance's printed token
/// (printed once) no longer worked, or a start failed on the other's row. Only the
/// first stored is kept, and only its instance prints it.
async fn instances_started_together_on_a_new_database_keep_one_generated_admin_token(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let other = app.another_instance().await;

    let (first, second) = tokio::join!(
        app.engine.ensure_admin_token(),
        other.engine.ensure_admin_token()
    );

    let printed: Vec<domain::Secret> = [first.unwrap(), second.unwrap()]
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(printed.len(), 1, "exactly one instance printed a token");
    let stored = app
        .database
        .raw_connection()
        .await
        .texts("SELECT secret_hash FROM credential WHERE kind = 'admin'")
        .await;
    assert_eq!(
        stored,
        vec![Some(engine::credentials::token_hash(printed[0].expose()))],
        "the printed token is the one stored"
    );
    assert_eq!(
        app.engine
            .ensure_admin_token()
            .await
            .unwrap()
            .map(|token| token.expose().to_owned()),
        None,
        "a later start keeps it"
    );
}

/// Found in review: any caller may send a bearer token, and every token this process
/// had not cached was looked up in the database, unbounded. A token of a length no
/// stored secret has is now unknown without a lookup (the database closed here: the
/// lookup would fail).
async fn a_token_no_stored_secret_could_be_is_unknown_without_asking_the_database(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.store.close().await;

    let short = app.engine.authenticate("guess-1234").await;
    let stored_shape = app.engine.authenticate(&"ab".repeat(32)).await;

    assert_eq!(short.unwrap(), None);
    assert!(
        stored_shape.is_err(),
        "a token shaped like a stored one is looked up"
    );
}

/// Found in review: only tokens this process has never found wait for one of the few
/// lookup turns (a flood of made-up ones sheds itself, 429). A credential known here
/// was told apart by its cached answer, and a revocation forgets every cached answer:
/// right after one, every shop's own key queued behind the flood and was shed. It is
/// now still known as found before, and only its answer is read again.
async fn a_key_found_before_is_looked_up_again_past_a_flood_of_made_up_tokens_after_a_revocation(
    backend: Backend,
) {
    let hold_the_credentials = match backend {
        // A SQLite reader never waits for a writer (WAL): no lookup can be held.
        Backend::Sqlite => return,
        Backend::Postgres => "LOCK TABLE credential IN ACCESS EXCLUSIVE MODE",
        Backend::Mysql => "LOCK TABLES credential WRITE",
    };
    let app = TestApp::spawn(backend).await;
    let checkout = app.create_service_key("default", "checkout").await;
    let leaked = app
        .send(
            Call::post("/v1/admin/service-keys")
                .admin()
                .key("leaked-key")
                .json(&json!({"shop": "default", "name": "leaked"})),
        )
        .await;
    let leaked_id = leaked.json()["key_id"].as_str().unwrap().to_owned();
    assert!(app.engine.authenticate(&checkout).await.unwrap().is_some());
    let revoked = app
        .send(
            Call::new(
                Method::DELETE,
                format!("/v1/admin/service-keys/{leaked_id}"),
            )
            .admin()
            .key("revoke-leaked"),
        )
        .await;
    assert_eq!(revoked.status, 200, "{revoked:?}");
    let mut held = app.database.raw_connection().await;
    if backend == Backend::Postgres {
        held.execute("BEGIN").await.unwrap();
    }
    held.execute(hold_the_credentials).await.unwrap();
    // Made-up tokens of a stored secret's shape, as many as there are lookup turns and
    // more: every turn is taken, and waits for the table.
    let flood: Vec<_> = (0..6)
        .map(|_| {
            let engine = app.engine.clone();
            tokio::spawn(async move {
                let made_up = format!("{:064x}", rand::random::<u128>());
                engine.authenticate(&made_up).await
            })
        })
        .collect();
    app.database.wait_until_blocking(&mut held, 4).await;

    let returning = {
        let engine = app.engine.clone();
        let checkout = checkout.clone();
        tokio::spawn(async move { engine.authenticate(&checkout).await })
    };
    // The key's lookup waits for the table too, a fifth waiter past the four turns
    // (shed, it would never get there, and this wait gives up).
    app.database.wait_until_blocking(&mut held, 5).await;
    let release = match backend {
        Backend::Mysql => "UNLOCK TABLES",
        _ => "ROLLBACK",
    };
    held.execute(release).await.unwrap();

    let answer = returning.await.unwrap();
    assert!(
        matches!(answer, Ok(Some(_))),
        "the key found before is looked up, not shed: {answer:?}"
    );
    for made_up in flood {
        assert!(!matches!(made_up.await.unwrap(), Ok(Some(_))));
    }
}

/// Found in review: on SQLite the lookup of an unknown token used the writer's own
/// connection, the one every reservation batch waits for: a flood of made-up tokens
/// queued in front of the sales, and a sale holding the writer held every new login.
/// It now reads through the read pool.
async fn looking_up_a_token_does_not_wait_for_the_writer(backend: Backend) {
    if backend != Backend::Sqlite {
        // PostgreSQL and MySQL read and write through one pool: the lookups' own
        // bound on running at once is what keeps them from taking it all.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 5).await;
    let mut lock = app.database.hold_stock_row_lock("TEA").await;
    // One reservation holds the writer, waiting for the file's lock; a second waits
    // for the writer.
    let holding = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("holding", &[("TEA", 1)]).await })
    };
    let queued = {
        let app = app.clone();
        tokio::spawn(async move { app.reserve("queued", &[("TEA", 1)]).await })
    };
    acceptance::wait_until("a reservation waits for the writer", || {
        app.store.pool_usage().waiting >= 1
    })
    .await;

    let looked_up = app.engine.authenticate(&"ab".repeat(32)).await;

    let writer_still_held = !holding.is_finished();
    lock.execute("ROLLBACK").await.unwrap();
    assert_eq!(looked_up.unwrap(), None);
    assert!(writer_still_held, "the lookup did not wait for the writer");
    holding.await.unwrap();
    queued.await.unwrap();
}

/// Found in review: the service-key listing stopped at 1,000 keys, newest first,
/// revoked ones included, so after enough rotations a shop's oldest active keys fell
/// off it and could no longer be seen to be revoked. A shop now has at most 100 active
/// keys (the next is refused, `failed_precondition`, and nothing is created until one
/// is revoked), and a listing shows the active keys before the revoked ones.
async fn a_shop_at_its_active_service_key_limit_is_refused_and_its_keys_are_listed_before_revoked_ones(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let create = |key: String| {
        Call::post("/v1/admin/service-keys")
            .admin()
            .key(key)
            .json(&json!({"shop": "crowded", "name": "checkout"}))
    };
    let oldest = app.send(create("crowded-0".into())).await;
    assert_eq!(oldest.status, 201, "{oldest:?}");
    let oldest = oldest.json()["key_id"].as_str().unwrap().to_owned();
    let limit = domain::limits::SERVICE_KEYS_ACTIVE_PER_SHOP_MAX;
    let mut newest = String::new();
    for index in 1..limit {
        let created = app.send(create(format!("crowded-{index}"))).await;
        assert_eq!(created.status, 201, "{created:?}");
        newest = created.json()["key_id"].as_str().unwrap().to_owned();
    }
    let before = app.contents_except_idempotency_records().await;

    let refused = app.send(create("crowded-over".into())).await;

    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("failed_precondition"));
    assert_eq!(app.contents_except_idempotency_records().await, before);
    // Another shop's keys are counted apart.
    app.create_service_key("other", "checkout").await;
    let revoked = app
        .send(
            Call::new(Method::DELETE, format!("/v1/admin/service-keys/{newest}"))
                .admin()
                .key("revoke-newest"),
        )
        .await;
    assert_eq!(revoked.status, 200, "{revoked:?}");
    let room = app.send(create("crowded-room".into())).await;
    assert_eq!(room.status, 201, "{room:?}");
    // A thousand revoked keys newer than every active one: the listing still shows
    // the oldest active key.
    let mut connection = app.database.raw_connection().await;
    let now = app.clock_now().plus_seconds(60).unix_milliseconds();
    let rows: Vec<String> = (0..1000)
        .map(|index| {
            format!("('service', 'key_ffff{index:024x}', 'old', 'crowded', 'hash-{index}', {now}, {now})")
        })
        .collect();
    connection
        .execute(&format!(
            "INSERT INTO credential (kind, id, name, shop, secret_hash, created_at, revoked_at) VALUES {}",
            rows.join(", ")
        ))
        .await
        .unwrap();
    let listed = app.send(Call::get("/v1/admin/service-keys").admin()).await;
    let keys = listed.json()["service_keys"].as_array().unwrap().clone();
    assert!(
        keys.iter().any(|key| key["key_id"] == oldest.as_str()),
        "{listed:?}"
    );
    let first_revoked = keys
        .iter()
        .position(|key| !key["revoked_at"].is_null())
        .unwrap();
    assert!(
        keys[first_revoked..]
            .iter()
            .all(|key| !key["revoked_at"].is_null()),
        "active keys first"
    );
}

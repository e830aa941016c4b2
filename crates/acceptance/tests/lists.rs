//! The lists the operations console reads (issue 18): products by category and
//! supplier, pending schedules, orders by shopper, and who a credential is. Each stays
//! inside its caller's shop.

use acceptance::{Backend, Call, ProductSpec, START, TestApp, mirrored_tests};
use serde_json::{Value, json};

mirrored_tests!(
    the_product_list_pages_through_products_and_filters_by_category_and_supplier,
    an_operator_lists_only_its_own_shops_products_and_schedules,
    pending_schedules_are_listed_by_due_time_and_leave_the_list_once_applied,
    orders_are_listed_newest_first_by_shopper_within_the_callers_shop,
    who_am_i_names_the_role_and_shop_of_each_credential,
    malformed_list_queries_are_refused_and_change_nothing,
);

fn product(
    shop: &'static str,
    category: &'static str,
    supplier: &'static str,
    skus: &'static [&'static str],
) -> ProductSpec<'static> {
    ProductSpec {
        category,
        supplier,
        ..ProductSpec::complete(shop, skus)
    }
}

fn ids(page: &Value, list: &str, id: &str) -> Vec<String> {
    page[list]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item[id].as_str().unwrap().to_owned())
        .collect()
}

async fn the_product_list_pages_through_products_and_filters_by_category_and_supplier(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let milk = app
        .create_product(product("north", "dairy", "farm", &["L-MILK"]))
        .await;
    // Ids sort by their minting time: a millisecond apart, the list's order is known.
    app.clock.advance_seconds(1);
    let bread = app
        .create_product(product("north", "bakery", "mill", &["L-BREAD"]))
        .await;
    app.clock.advance_seconds(1);
    let cheese = app
        .create_product(product("north", "dairy", "mill", &["L-CHEESE"]))
        .await;

    let everything = app.send(Call::get("/v1/admin/products").admin()).await;
    let first = app
        .send(Call::get("/v1/admin/products?limit=2").admin())
        .await;
    let dairy = app
        .send(Call::get("/v1/admin/products?category=dairy").admin())
        .await;
    let dairy_of_the_mill = app
        .send(Call::get("/v1/admin/products?category=dairy&supplier=mill").admin())
        .await;

    assert_eq!(everything.status, 200, "{everything:?}");
    assert_eq!(
        ids(&everything.json(), "products", "product_id"),
        [milk.as_str(), bread.as_str(), cheese.as_str()]
    );
    assert_eq!(
        everything.json()["next_after"],
        Value::Null,
        "one page holds them all"
    );
    assert_eq!(
        ids(&first.json(), "products", "product_id"),
        [milk.as_str(), bread.as_str()]
    );
    let after = first.json()["next_after"].as_str().unwrap().to_owned();
    assert_eq!(after, bread);
    let rest = app
        .send(Call::get(format!("/v1/admin/products?limit=2&after={after}")).admin())
        .await;
    assert_eq!(
        ids(&rest.json(), "products", "product_id"),
        [cheese.as_str()]
    );
    assert_eq!(
        ids(&dairy.json(), "products", "product_id"),
        [milk.as_str(), cheese.as_str()]
    );
    assert_eq!(
        ids(&dairy_of_the_mill.json(), "products", "product_id"),
        [cheese.as_str()]
    );
    let listed = &everything.json()["products"][0];
    assert_eq!(listed["skus"][0]["sku"], "L-MILK");
    assert_eq!(listed["skus"][0]["sale_status"], "PENDING_REVIEW");
}

async fn an_operator_lists_only_its_own_shops_products_and_schedules(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let north = app
        .create_product(product("north", "dairy", "farm", &["N-MILK"]))
        .await;
    let south = app
        .create_product(product("south", "dairy", "farm", &["S-MILK"]))
        .await;
    for product in [north.as_str(), south.as_str()] {
        let scheduled = app
            .shelf(
                None,
                json!({"operation": "on_at", "product_ids": [product], "scheduled_at": START.plus_seconds(600).to_rfc3339()}),
            )
            .await;
        assert_eq!(scheduled.status, 200, "{scheduled:?}");
    }
    let nora = app.create_operator("nora", "north").await;

    let products = app
        .send(Call::get("/v1/admin/products").bearer(&nora))
        .await;
    let schedules = app
        .send(Call::get("/v1/admin/schedules").bearer(&nora))
        .await;
    let foreign = app
        .send(Call::get("/v1/admin/products?shop=south").bearer(&nora))
        .await;
    let foreign_schedules = app
        .send(Call::get("/v1/admin/schedules?shop=south").bearer(&nora))
        .await;

    assert_eq!(
        ids(&products.json(), "products", "product_id"),
        [north.as_str()]
    );
    assert_eq!(ids(&schedules.json(), "schedules", "sku"), ["N-MILK"]);
    assert_eq!(foreign.status, 403, "{foreign:?}");
    assert_eq!(foreign_schedules.status, 403, "{foreign_schedules:?}");
    let all = app.send(Call::get("/v1/admin/schedules").admin()).await;
    assert_eq!(ids(&all.json(), "schedules", "sku").len(), 2);
    let service = app.as_service_of("north").await;
    let refused = service.send(Call::get("/v1/admin/products")).await;
    assert_eq!(
        refused.status, 403,
        "a checkout backend reads no staff list: {refused:?}"
    );
}

async fn pending_schedules_are_listed_by_due_time_and_leave_the_list_once_applied(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let later = app
        .create_product(product("north", "dairy", "farm", &["LATER"]))
        .await;
    let sooner = app
        .create_product(product("north", "dairy", "farm", &["SOONER"]))
        .await;
    for (product, operation, minutes) in [(&later, "on_at", 20), (&sooner, "on_at", 10)] {
        let scheduled = app
            .shelf(
                None,
                json!({"operation": operation, "product_ids": [product], "scheduled_at": START.plus_seconds(minutes * 60).to_rfc3339(), "remark": "campaign"}),
            )
            .await;
        assert_eq!(scheduled.status, 200, "{scheduled:?}");
    }

    let pending = app.send(Call::get("/v1/admin/schedules").admin()).await;

    assert_eq!(pending.status, 200, "{pending:?}");
    let schedules = pending.json()["schedules"].clone();
    assert_eq!(
        ids(&pending.json(), "schedules", "sku"),
        ["SOONER", "LATER"]
    );
    assert_eq!(schedules[0]["status"], "PENDING");
    assert_eq!(schedules[0]["operation"], "on");
    assert_eq!(schedules[0]["product_id"], json!(sooner));
    assert_eq!(schedules[0]["due_at"], START.plus_seconds(600).to_rfc3339());
    assert_eq!(schedules[0]["remark"], "campaign");
    assert_eq!(schedules[0]["operator_id"], "admin");
    app.clock.advance_seconds(600);
    assert_eq!(app.engine.schedule_step().await.unwrap().len(), 1);
    let after = app.send(Call::get("/v1/admin/schedules").admin()).await;
    assert_eq!(ids(&after.json(), "schedules", "sku"), ["LATER"]);
    let applied = app
        .send(Call::get("/v1/admin/schedules?status=APPLIED").admin())
        .await;
    assert_eq!(ids(&applied.json(), "schedules", "sku"), ["SOONER"]);
    assert_eq!(applied.json()["schedules"][0]["status"], "APPLIED");
}

async fn orders_are_listed_newest_first_by_shopper_within_the_callers_shop(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 20).await;
    let south_sku = app
        .send(
            Call::put("/v1/skus/S-TEA")
                .admin()
                .key("south-sku")
                .json(&json!({"title": "Tea", "price": 100, "currency": "CNY", "shop": "south"})),
        )
        .await;
    assert_eq!(south_sku.status, 201);
    app.receive("S-TEA", 5).await;
    let mut alice = Vec::new();
    for index in 0..3 {
        let order = app
            .create_order(&format!("alice-{index}"), "alice", &[("TEA", 1)])
            .await;
        assert_eq!(order.status, 201, "{order:?}");
        alice.push(order.json()["order_id"].as_str().unwrap().to_owned());
        app.clock.advance_seconds(1);
    }
    let bob = app.create_order("bob-0", "bob", &[("TEA", 1)]).await;
    let bob = bob.json()["order_id"].as_str().unwrap().to_owned();
    let south = app.as_service_of("south").await;
    let south_order = south
        .create_order("south-0", "alice", &[("S-TEA", 1)])
        .await;
    assert_eq!(south_order.status, 201, "{south_order:?}");

    let mine = app.send(Call::get("/v1/orders?user_id=alice")).await;
    let page = app
        .send(Call::get("/v1/orders?user_id=alice&limit=2"))
        .await;
    let everyone = app.send(Call::get("/v1/orders")).await;
    let south_alice = south.send(Call::get("/v1/orders?user_id=alice")).await;
    let foreign = south.send(Call::get("/v1/orders?shop=default")).await;
    let admin = app
        .send(Call::get("/v1/orders?user_id=alice").admin())
        .await;

    let newest_first: Vec<String> = alice.iter().rev().cloned().collect();
    assert_eq!(mine.status, 200, "{mine:?}");
    assert_eq!(ids(&mine.json(), "orders", "order_id"), newest_first);
    assert_eq!(mine.json()["orders"][0]["status"], "PENDING_PAYMENT");
    assert_eq!(mine.json()["orders"][0]["amount"], 100);
    assert_eq!(ids(&page.json(), "orders", "order_id"), newest_first[..2]);
    let before = page.json()["next_before"].as_str().unwrap().to_owned();
    let rest = app
        .send(Call::get(format!(
            "/v1/orders?user_id=alice&limit=2&before={before}"
        )))
        .await;
    assert_eq!(ids(&rest.json(), "orders", "order_id"), newest_first[2..]);
    assert_eq!(ids(&everyone.json(), "orders", "order_id")[0], bob);
    assert_eq!(
        ids(&everyone.json(), "orders", "order_id").len(),
        4,
        "the default shop's only"
    );
    assert_eq!(ids(&south_alice.json(), "orders", "order_id").len(), 1);
    assert_eq!(foreign.status, 403, "{foreign:?}");
    assert_eq!(
        ids(&admin.json(), "orders", "order_id").len(),
        4,
        "both shops' alice"
    );
}

async fn who_am_i_names_the_role_and_shop_of_each_credential(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let nora = app.create_operator("nora", "north").await;
    let key = app.create_service_key("north", "checkout").await;

    let admin = app.send(Call::get("/v1/me").admin()).await.json();
    let operator = app.send(Call::get("/v1/me").bearer(&nora)).await.json();
    let service = app.send(Call::get("/v1/me").bearer(&key)).await.json();
    let nobody = app.send(Call::get("/v1/me").anonymous()).await;

    assert_eq!(admin["role"], "admin");
    assert_eq!(admin["shop"], Value::Null);
    assert_eq!(
        (
            &operator["role"],
            &operator["shop"],
            &operator["operator_id"]
        ),
        (&json!("operator"), &json!("north"), &json!("nora"))
    );
    assert_eq!(
        (&service["role"], &service["shop"]),
        (&json!("service"), &json!("north"))
    );
    assert!(service["key_id"].as_str().unwrap().starts_with("key_"));
    assert_eq!(nobody.status, 401);
}

async fn malformed_list_queries_are_refused_and_change_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.create_product(product("north", "dairy", "farm", &["Q-MILK"]))
        .await;
    let before = app.contents().await;
    for path in [
        "/v1/admin/products?limit=0",
        "/v1/admin/products?limit=201",
        "/v1/admin/products?category=no%20spaces",
        "/v1/admin/products?after=prd_nothex",
        "/v1/admin/products?colour=red",
        "/v1/admin/schedules?status=DONE",
        "/v1/admin/schedules?limit=-1",
        "/v1/orders?user_id=",
        "/v1/orders?before=ord_1",
        "/v1/orders?limit=1.5",
    ] {
        let answer = app.send(Call::get(path).admin()).await;
        assert_eq!(answer.status, 400, "{path}: {answer:?}");
        assert_eq!(answer.code().as_deref(), Some("invalid_argument"), "{path}");
    }
    assert_eq!(app.contents().await, before);
}

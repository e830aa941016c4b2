//! The display cache in Redis (issue 16; seed 003 §4.4, §5.1), against a
//! `redis-server` of each test's own: the shopper's product view is served from the
//! cache after a miss, dropped by the outbox's events (a shelf change, the last unit
//! sold) and never refilled with what a reader saw before a change; a cart shows a
//! SKU taken off the shelf at once; with Redis stopped the reads are still right; and
//! nothing that decides a sale reads the cache.

use acceptance::redis_server::TestRedis;
use acceptance::{
    Backend, Call, ProductSpec, TestApp, mirrored_tests, mirrored_tests_alone, wait_until_async,
};
use cache::{CacheKey, Lookup};
use domain::FeedCursor;
use serde_json::{Value, json};

mirrored_tests!(
    the_product_view_is_served_from_the_cache_after_a_miss,
    a_shelf_change_reaches_a_cart_at_once_and_the_product_view_with_its_event,
    the_sale_of_the_last_unit_reaches_the_product_view_with_its_event,
    a_fill_that_read_before_a_change_cannot_store_the_old_state,
    a_read_that_sends_its_consistency_token_is_not_served_from_the_cache,
    nothing_that_decides_a_sale_reads_the_cache,
    a_new_price_or_title_reaches_the_product_view_with_its_event,
    the_cache_serves_reads_only_once_its_invalidator_knows_where_to_start,
    a_view_a_campaign_start_changes_within_a_copys_lifetime_is_not_cached,
    made_up_product_ids_leave_nothing_in_redis_that_outlives_a_value,
);

// These read counters of the process-wide metrics recorder.
mirrored_tests_alone!(with_redis_stopped_the_reads_are_right_and_the_errors_are_counted);

/// A shop with a product on the shelf: (app, product id, invalidation cursor).
async fn shop(backend: Backend, redis: &TestRedis, stock: i64) -> (TestApp, String, FeedCursor) {
    let (app, product) = shop_without_cache(backend, stock).await;
    app.engine.attach_display_cache(redis.cache());
    app.sequence_all_events().await;
    let cursor = app.engine.latest_event_cursor().await.unwrap();
    (app, product, cursor)
}

/// A shop with a product on the shelf, its reads not yet cached: (app, product id).
async fn shop_without_cache(backend: Backend, stock: i64) -> (TestApp, String) {
    let app = TestApp::spawn(backend).await;
    let product = app
        .create_product(ProductSpec::complete("default", &["MILK-1L"]))
        .await;
    app.receive("MILK-1L", stock).await;
    let on = app
        .shelf(None, json!({"operation": "on", "product_ids": [product]}))
        .await;
    assert_eq!(on.status, 200, "{on:?}");
    (app, product)
}

/// What the outbox worker and the invalidator do on their own: number the events and
/// drop what they make stale.
async fn propagate(app: &TestApp, cursor: &mut FeedCursor) {
    app.sequence_all_events().await;
    let step = app
        .engine
        .cache_invalidation_step(*cursor)
        .await
        .expect("invalidation step");
    *cursor = step.cursor;
}

async fn view(app: &TestApp, product: &str) -> (String, Value) {
    let response = app
        .send(Call::get(format!("/v1/products/{product}")).anonymous())
        .await;
    assert_eq!(response.status, 200, "{response:?}");
    let served_by = response
        .headers
        .get("stockd-served-by")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (served_by, response.json())
}

fn availability(view: &Value) -> String {
    view["skus"][0]["availability"].as_str().unwrap().to_owned()
}

/// Reads the view (following the events between reads) until `wanted`, a bounded
/// number of times.
async fn view_until(app: &TestApp, product: &str, cursor: &mut FeedCursor, wanted: &str) {
    for _ in 0..100 {
        propagate(app, cursor).await;
        if availability(&view(app, product).await.1) == wanted {
            return;
        }
    }
    panic!("the product view never showed {wanted}");
}

async fn the_product_view_is_served_from_the_cache_after_a_miss(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, _) = shop(backend, &redis, 5).await;

    let (first_by, first) = view(&app, &product).await;
    let (second_by, second) = view(&app, &product).await;

    assert_eq!(first_by, "primary", "the miss reads the database");
    assert_eq!(second_by, "cache");
    assert_eq!(first, second, "the cache shows what the database showed");
    assert_eq!(availability(&second), "on_sale");
}

async fn a_shelf_change_reaches_a_cart_at_once_and_the_product_view_with_its_event(
    backend: Backend,
) {
    let redis = TestRedis::start().await;
    let (app, product, mut cursor) = shop(backend, &redis, 5).await;
    let put = app
        .send(
            Call::put("/v1/carts/alice/items/MILK-1L")
                .key("cart-1")
                .json(&json!({"quantity": 1})),
        )
        .await;
    assert_eq!(put.status, 200, "{put:?}");
    assert_eq!(
        view(&app, &product).await.1["skus"][0]["availability"],
        "on_sale"
    );
    assert_eq!(view(&app, &product).await.0, "cache");

    let off = app
        .shelf(None, json!({"operation": "off", "product_ids": [product]}))
        .await;
    assert_eq!(off.status, 200);

    // The cart reads the database: the change shows at once, before any event.
    let cart = app.send(Call::get("/v1/carts/alice")).await.json();
    assert_eq!(cart["lines"][0]["problem"], "off_shelf", "{cart}");
    view_until(&app, &product, &mut cursor, "off_shelf").await;
    assert_eq!(
        view(&app, &product).await.0,
        "cache",
        "cached again, now off the shelf"
    );
}

async fn a_new_price_or_title_reaches_the_product_view_with_its_event(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, mut cursor) = shop(backend, &redis, 5).await;
    assert_eq!(view(&app, &product).await.1["skus"][0]["price"], 250);
    assert_eq!(view(&app, &product).await.0, "cache");

    let repriced = app
        .send(
            Call::put("/v1/skus/MILK-1L")
                .admin()
                .key("reprice")
                .json(&json!({"price": 300})),
        )
        .await;
    assert_eq!(repriced.status, 200, "{repriced:?}");
    propagate(&app, &mut cursor).await;
    let (served_by, shown) = view(&app, &product).await;
    assert_eq!(served_by, "primary", "the change dropped the cached view");
    assert_eq!(shown["skus"][0]["price"], 300, "{shown}");

    let renamed = app
        .send(
            Call::patch(format!("/v1/products/{product}"))
                .admin()
                .key("rename")
                .json(&json!({"title": "Oat milk"})),
        )
        .await;
    assert_eq!(renamed.status, 200, "{renamed:?}");
    propagate(&app, &mut cursor).await;
    let (served_by, shown) = view(&app, &product).await;
    assert_eq!(served_by, "primary", "the change dropped the cached view");
    assert_eq!(shown["title"], "Oat milk", "{shown}");
}

async fn the_sale_of_the_last_unit_reaches_the_product_view_with_its_event(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, mut cursor) = shop(backend, &redis, 1).await;
    assert_eq!(availability(&view(&app, &product).await.1), "on_sale");
    assert_eq!(view(&app, &product).await.0, "cache");

    assert_eq!(app.reserve("last-one", &[("MILK-1L", 1)]).await.status, 201);

    view_until(&app, &product, &mut cursor, "temporarily_out_of_stock").await;
}

async fn a_fill_that_read_before_a_change_cannot_store_the_old_state(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, mut cursor) = shop(backend, &redis, 5).await;
    let cache = app.engine.display_cache().unwrap().clone();
    let key = CacheKey::ProductView(product.clone());
    // A reader misses and reads the database…
    let Lookup::Miss(ticket) = cache.lookup(&key).await.unwrap() else {
        panic!("nothing was cached yet");
    };
    let (_, before) = view_bypassing_the_cache(&app, &product).await;
    assert_eq!(availability(&before), "on_sale");
    // …the SKU goes off the shelf and its event drops the key…
    app.shelf(None, json!({"operation": "off", "product_ids": [product]}))
        .await;
    propagate(&app, &mut cursor).await;

    // …and the reader's late fill with what it read before is refused.
    let stored = cache.fill(&ticket, &before.to_string()).await.unwrap();

    assert!(!stored, "a fill that read before the change stores nothing");
    let (served_by, now) = view(&app, &product).await;
    assert_eq!(served_by, "primary", "still a miss");
    assert_eq!(availability(&now), "off_shelf");
    assert_eq!(availability(&view(&app, &product).await.1), "off_shelf");
}

/// The view as the database shows it (a consistency token bypasses the cache).
async fn view_bypassing_the_cache(app: &TestApp, product: &str) -> (String, Value) {
    let response = app
        .send(
            Call::get(format!("/v1/products/{product}"))
                .anonymous()
                .consistency_token("0/0"),
        )
        .await;
    assert_eq!(response.status, 200, "{response:?}");
    let served_by = response.headers["stockd-served-by"]
        .to_str()
        .unwrap()
        .to_owned();
    (served_by, response.json())
}

async fn a_read_that_sends_its_consistency_token_is_not_served_from_the_cache(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, _) = shop(backend, &redis, 5).await;
    view(&app, &product).await;
    assert_eq!(view(&app, &product).await.0, "cache");
    let reserved = app.reserve("mine", &[("MILK-1L", 5)]).await;
    let token = reserved.headers["stockd-consistency-token"]
        .to_str()
        .unwrap()
        .to_owned();

    let response = app
        .send(
            Call::get(format!("/v1/products/{product}"))
                .anonymous()
                .consistency_token(token),
        )
        .await;

    assert_eq!(response.headers["stockd-served-by"], "primary");
    assert_eq!(
        availability(&response.json()),
        "temporarily_out_of_stock",
        "the caller sees its own write at once"
    );
}

async fn nothing_that_decides_a_sale_reads_the_cache(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, _) = shop(backend, &redis, 5).await;
    app.shelf(None, json!({"operation": "off", "product_ids": [product]}))
        .await;
    // Someone writes a lie into the cache: the SKU on sale with plenty of stock.
    let (_, mut lie) = view_bypassing_the_cache(&app, &product).await;
    lie["skus"][0]["availability"] = json!("on_sale");
    lie["skus"][0]["available"] = json!(1000);
    redis
        .set(
            &format!("stockd:v1:product-view:{product}"),
            &lie.to_string(),
        )
        .await;
    assert_eq!(
        availability(&view(&app, &product).await.1),
        "on_sale",
        "the cache shows"
    );

    let reserved = app.reserve("decided", &[("MILK-1L", 1)]).await;
    let ordered = app
        .send(
            Call::post("/v1/orders")
                .key("decided-order")
                .json(&json!({"user_id": "u1", "lines": [{"sku": "MILK-1L", "quantity": 1}]})),
        )
        .await;

    assert_eq!(
        reserved.code().as_deref(),
        Some("off_shelf"),
        "{reserved:?}"
    );
    assert_eq!(ordered.code().as_deref(), Some("off_shelf"), "{ordered:?}");
    assert_eq!(app.counters("MILK-1L").await, (5, 0));
}

async fn with_redis_stopped_the_reads_are_right_and_the_errors_are_counted(backend: Backend) {
    let mut redis = TestRedis::start().await;
    let (app, product, mut cursor) = shop(backend, &redis, 5).await;
    view(&app, &product).await;
    assert_eq!(view(&app, &product).await.0, "cache");

    redis.stop();
    app.shelf(None, json!({"operation": "off", "product_ids": [product]}))
        .await;
    app.sequence_all_events().await;
    assert!(
        app.engine.cache_invalidation_step(cursor).await.is_err(),
        "the drop waits for Redis"
    );

    let (served_by, shown) = view(&app, &product).await;
    assert_eq!(served_by, "primary", "Redis down: the database answers");
    assert_eq!(availability(&shown), "off_shelf");
    let metrics = app.send(Call::get("/metrics").admin()).await.body;
    let errors: f64 = metrics
        .lines()
        .filter(|line| line.starts_with("stockd_cache_errors_total"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(errors >= 2.0, "{metrics}");

    redis.start_again().await;
    propagate(&app, &mut cursor).await;
    let mut shown = String::new();
    for _ in 0..100 {
        let (_, value) = view(&app, &product).await;
        shown = availability(&value);
        if shown == "off_shelf" {
            break;
        }
    }
    assert_eq!(shown, "off_shelf", "Redis back: right again");
}

/// One step's drops go to Redis a few hundred keys per call: every key of a step larger
/// than one call is dropped all the same, and a fill that read before the drop cannot
/// store.
#[tokio::test]
async fn a_drop_of_more_keys_than_one_call_takes_drops_every_one() {
    let redis = TestRedis::start().await;
    let cache = redis.cache();
    let keys: Vec<CacheKey> = (0..=cache::KEYS_PER_INVALIDATION_MAX)
        .map(|index| CacheKey::ProductView(format!("product-{index}")))
        .collect();
    let mut stale = Vec::new();
    for key in &keys {
        let Lookup::Miss(ticket) = cache.lookup(key).await.unwrap() else {
            panic!("an empty cache misses");
        };
        assert!(cache.fill(&ticket, "shown").await.unwrap());
        let Lookup::Hit(_) = cache.lookup(key).await.unwrap() else {
            panic!("filled");
        };
        stale.push(ticket);
    }

    cache.invalidate(&keys).await.unwrap();

    for (key, ticket) in keys.iter().zip(&stale) {
        let Lookup::Miss(_) = cache.lookup(key).await.unwrap() else {
            panic!("{key:?} was not dropped");
        };
        assert!(
            !cache.fill(ticket, "old").await.unwrap(),
            "{key:?}: a fill from before the drop stored"
        );
    }
}

/// Redis restarted without persistence (or a generation evicted) forgets every key's
/// generation. A reader that missed before, and read the database before a change made
/// since, still cannot store what it read: not when the key had been dropped before
/// (a count starting over would give the same number again), and not when its
/// generation was lost after the change's drop (a missing one would read as the
/// ticket's).
#[tokio::test]
async fn a_fill_from_before_redis_restarted_cannot_store_after_a_change() {
    let mut redis = TestRedis::start().await;
    let cache = redis.cache();
    let dropped_before = CacheKey::ProductView("dropped-before".into());
    let lost_after_the_drop = CacheKey::ProductView("lost-after-the-drop".into());
    cache
        .invalidate(std::slice::from_ref(&dropped_before))
        .await
        .unwrap();
    let Lookup::Miss(ticket_of_dropped_before) = cache.lookup(&dropped_before).await.unwrap()
    else {
        panic!("a dropped key misses");
    };
    let Lookup::Miss(ticket_of_lost_after_the_drop) =
        cache.lookup(&lost_after_the_drop).await.unwrap()
    else {
        panic!("an empty cache misses");
    };
    cache
        .invalidate(std::slice::from_ref(&lost_after_the_drop))
        .await
        .unwrap();

    redis.stop();
    redis.start_again().await;
    // The change to the first key comes after the restart; its drop reaches Redis once
    // the connection is back.
    wait_until_async("the cache reaches Redis again", || {
        let cache = cache.clone();
        let key = dropped_before.clone();
        async move { cache.invalidate(&[key]).await.is_ok() }
    })
    .await;

    assert!(
        !cache.fill(&ticket_of_dropped_before, "old").await.unwrap(),
        "a fill from before the restart stored over a change made after it"
    );
    assert!(
        !cache
            .fill(&ticket_of_lost_after_the_drop, "old")
            .await
            .unwrap(),
        "a fill from before a drop whose generation the restart lost stored"
    );
    // A reader that misses now fills as usual.
    for key in [&dropped_before, &lost_after_the_drop] {
        let Lookup::Miss(ticket) = cache.lookup(key).await.unwrap() else {
            panic!("{key:?}: nothing was stored, so it misses");
        };
        assert!(cache.fill(&ticket, "new").await.unwrap(), "{key:?}");
        assert_eq!(
            cache.lookup(key).await.unwrap(),
            Lookup::Hit("new".into()),
            "{key:?}"
        );
    }
}

/// The invalidator drops what the events after its start cursor make stale. A value
/// filled before that cursor was read could hold what a reader saw before a change
/// whose event lies before the cursor: no step would ever drop it. So reads use the
/// cache only once the cursor is read.
async fn the_cache_serves_reads_only_once_its_invalidator_knows_where_to_start(backend: Backend) {
    let lock_the_start_cursor = match backend {
        // A SQLite reader never waits for a writer (WAL): the start cursor's read
        // cannot be held back.
        Backend::Sqlite => return,
        Backend::Postgres => "LOCK TABLE outbox_relay IN ACCESS EXCLUSIVE MODE",
        Backend::Mysql => "LOCK TABLES outbox_relay WRITE",
    };
    let redis = TestRedis::start().await;
    let (app, product) = shop_without_cache(backend, 5).await;
    let mut held = app.database.raw_connection().await;
    if backend == Backend::Postgres {
        held.execute("BEGIN").await.unwrap();
    }
    held.execute(lock_the_start_cursor).await.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let workers = tokio_util::task::TaskTracker::new();

    engine::workers::spawn_cache_invalidator(&app.engine, redis.cache(), &workers, &shutdown);
    app.database.wait_until_blocked_by(&mut held).await;
    let served_while_starting = [view(&app, &product).await.0, view(&app, &product).await.0];

    let release = match backend {
        Backend::Mysql => "UNLOCK TABLES",
        _ => "ROLLBACK",
    };
    held.execute(release).await.unwrap();
    assert_eq!(
        served_while_starting,
        ["primary", "primary"],
        "no read used the cache before the invalidator's start cursor was read"
    );
    wait_until_async(
        "the invalidator has started and reads use the cache",
        || async { view(&app, &product).await.0 == "cache" },
    )
    .await;
    shutdown.cancel();
    workers.close();
    workers.wait().await;
}

/// Found in review: a campaign's start changes the product view (its units count from
/// then on) with nothing written at that moment, so no event dropped the copy cached
/// just before: shoppers read "out of stock" for up to a minute into the sale. A view
/// that a campaign's start or end changes within a copy's lifetime is not cached.
async fn a_view_a_campaign_start_changes_within_a_copys_lifetime_is_not_cached(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, product, mut cursor) = shop(backend, &redis, 5).await;
    let starts_in_seconds = 30;
    let created = app
        .send(
            Call::post("/v1/admin/campaigns")
                .admin()
                .key("campaign-milk")
                .json(&json!({
                    "sku": "MILK-1L",
                    "quantity": 5,
                    "buckets": 1,
                    "starts_at": acceptance::START.plus_seconds(starts_in_seconds).to_rfc3339(),
                    "ends_at": acceptance::START.plus_seconds(3600).to_rfc3339(),
                })),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    app.engine.campaign_step().await.expect("campaign step");
    propagate(&app, &mut cursor).await;

    let (_, before_the_start) = view(&app, &product).await;
    let (again_by, _) = view(&app, &product).await;
    app.clock.advance_seconds(starts_in_seconds);
    let (at_the_start_by, at_the_start) = view(&app, &product).await;
    let (later_by, _) = view(&app, &product).await;

    assert_eq!(availability(&before_the_start), "temporarily_out_of_stock");
    assert_ne!(again_by, "cache", "not cached across the start");
    assert_ne!(at_the_start_by, "cache");
    assert_eq!(availability(&at_the_start), "on_sale", "{at_the_start}");
    assert_eq!(later_by, "cache", "cached again: the end is an hour away");
}

/// `GET /v1/products/{id}` needs no credential, so anyone may ask for made-up ids. Each
/// misses, and a miss sets the key's generation: one that lived a day would let a
/// stranger fill Redis (86 million keys a day at a thousand ids a second). What a miss
/// sets lives no longer than a value.
async fn made_up_product_ids_leave_nothing_in_redis_that_outlives_a_value(backend: Backend) {
    let redis = TestRedis::start().await;
    let (app, _product, _) = shop(backend, &redis, 5).await;
    let value_ttl = redis.cache().value_ttl();

    for index in 0..20 {
        let made_up = format!("prd_{index:028x}");
        let response = app
            .send(Call::get(format!("/v1/products/{made_up}")).anonymous())
            .await;
        assert_eq!(response.status, 404, "{response:?}");
    }

    let keys: Vec<_> = redis
        .keys_with_their_time_left()
        .await
        .into_iter()
        .filter(|(key, _)| key.contains("prd_0000"))
        .collect();
    assert_eq!(
        keys.len(),
        20,
        "each made-up id missed and set its generation: {keys:?}"
    );
    for (key, left) in &keys {
        let left = left.unwrap_or_else(|| panic!("{key} is kept for good"));
        assert!(
            left <= value_ttl,
            "{key} lives {left:?}, longer than a value ({value_ttl:?})"
        );
    }
}

/// A byte pipe between the cache and Redis that can go silent: it keeps the connection
/// open and forwards nothing more, like a partition or a stalled server.
struct SilencingPipe {
    address: std::net::SocketAddr,
    silent: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Bytes the cache sent on its first connection after the pipe went silent.
    sent_while_silent_on_the_first_connection: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl SilencingPipe {
    async fn to(redis: &TestRedis) -> SilencingPipe {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let silent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let upstream = redis.url().trim_start_matches("redis://").to_owned();
        let (pipe_silent, pipe_sent) = (silent.clone(), sent.clone());
        tokio::spawn(async move {
            let mut first = true;
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let (silent, sent, counted) = (pipe_silent.clone(), pipe_sent.clone(), first);
                first = false;
                tokio::spawn(async move {
                    let mut buffer = [0_u8; 4096];
                    while let Ok(read) = from_client.read(&mut buffer).await {
                        if read == 0 {
                            break;
                        }
                        if silent.load(Ordering::SeqCst) {
                            if counted {
                                sent.fetch_add(read, Ordering::SeqCst);
                            }
                            continue;
                        }
                        if to_server.write_all(&buffer[..read]).await.is_err() {
                            break;
                        }
                    }
                });
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
            }
        });
        SilencingPipe {
            address,
            silent,
            sent_while_silent_on_the_first_connection: sent,
        }
    }

    fn go_silent(&self) {
        self.silent.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn sent_while_silent(&self) -> usize {
        self.sent_while_silent_on_the_first_connection
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A Redis that took the connection and then went silent costs the request that finds
/// out the whole timeout; the requests after it do not send on that connection again
/// (each would wait the timeout too): they go to the database at once, and a later one
/// connects afresh.
#[tokio::test]
async fn a_redis_gone_silent_after_connecting_costs_one_request_the_timeout_not_every_one() {
    let redis = TestRedis::start().await;
    let pipe = SilencingPipe::to(&redis).await;
    let mut config = cache::CacheConfig::new(format!("redis://{}", pipe.address));
    config.timeout = std::time::Duration::from_millis(200);
    let cache = cache::DisplayCache::new(config).unwrap();
    let key = CacheKey::ProductView("product-1".into());
    let Lookup::Miss(_) = cache.lookup(&key).await.unwrap() else {
        panic!("an empty cache misses");
    };

    pipe.go_silent();
    let found_out = cache.lookup(&key).await;
    assert!(
        found_out
            .as_ref()
            .is_err_and(|error| error.0.contains("no answer")),
        "{found_out:?}"
    );
    let sent_by_the_request_that_found_out = pipe.sent_while_silent();
    assert!(sent_by_the_request_that_found_out > 0);

    for _ in 0..5 {
        assert!(cache.lookup(&key).await.is_err());
    }
    assert_eq!(
        pipe.sent_while_silent(),
        sent_by_the_request_that_found_out,
        "a later request sent on the silent connection (and waited the timeout)"
    );
}

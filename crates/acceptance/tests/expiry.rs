//! The expiry worker: reservations past `expires_at` are released exactly once, even
//! with several workers racing, and their stock returns.

use std::collections::HashSet;

use acceptance::{Backend, Call, TestApp, mirrored_tests, test_engine_config};
use serde_json::json;

mirrored_tests!(
    an_expired_reservation_is_released_and_its_stock_returns,
    a_reservation_is_not_released_before_its_expiry,
    a_second_expiry_run_releases_nothing,
    two_workers_racing_release_each_reservation_once,
    expiry_works_in_bounded_batches,
    confirming_or_releasing_an_expired_reservation_is_an_illegal_transition,
    a_reservation_past_its_expiry_is_never_confirmed_even_before_the_sweep_runs,
    the_backlog_counts_the_due_holds_only,
    on_an_instance_whose_clock_runs_ahead_the_backlog_counts_only_what_its_expiry_releases,
    a_hold_whose_stock_row_is_broken_does_not_stop_the_others_expiring,
    a_whole_batch_of_broken_holds_does_not_stop_the_holds_behind_it_expiring,
    a_stock_row_held_open_does_not_stop_the_other_holds_expiring,
    the_order_expiry_claim_reads_the_due_orders_through_their_indexes,
    a_full_disk_fails_the_expiry_step_instead_of_reporting_holds_broken,
    an_instance_whose_clock_runs_ahead_releases_no_hold_before_its_end,
);

/// Makes every insert into the ledger fail as a full disk does (PostgreSQL's 53100,
/// MySQL's 1021), until the returned statement drops the trigger again.
async fn fill_the_disk(app: &TestApp) -> &'static str {
    let mut connection = app.database.raw_connection().await;
    let (create, drop): (&[&str], _) = match app.backend() {
        Backend::Postgres => (
            &[
                "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; END $$",
                "CREATE TRIGGER disk_full BEFORE INSERT ON stock_ledger \
                 FOR EACH ROW EXECUTE FUNCTION disk_full()",
            ],
            "DROP TRIGGER disk_full ON stock_ledger",
        ),
        Backend::Mysql => (
            &[
                "CREATE TRIGGER disk_full BEFORE INSERT ON stock_ledger FOR EACH ROW \
               SIGNAL SQLSTATE 'HY000' SET MESSAGE_TEXT = 'Disk full', MYSQL_ERRNO = 1021",
            ],
            "DROP TRIGGER disk_full",
        ),
        Backend::Sqlite => unreachable!("SQLite has no error a trigger can raise as a full disk"),
    };
    for statement in create {
        connection.execute(statement).await.unwrap();
    }
    drop
}

/// Found in review: the expiry worker took every database error it did not know for
/// a hold's broken data, so a full disk (or memory, or an I/O error) marked each due
/// hold as stuck, counted it in `stockd_reservations_expiry_failed_total` (a critical
/// alert blaming the data) and reported the step a success. The server's state is now
/// `unavailable`: the step fails, nothing is counted stuck, and a client hears 503.
async fn a_full_disk_fails_the_expiry_step_instead_of_reporting_holds_broken(backend: Backend) {
    if backend == Backend::Sqlite {
        // No trigger can make SQLite answer SQLITE_FULL.
        return;
    }
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FULL", 5).await;
    let id = reserve_with_ttl(&app, "hold", "FULL", 2, 60).await;
    let drop_trigger = fill_the_disk(&app).await;
    app.clock.advance_seconds(61);

    let step = app.engine.expire_step().await;
    let reserved = app.reserve("while-full", &[("FULL", 1)]).await;

    assert!(
        matches!(step, Err(engine::EngineError::DatabaseUnavailable(_))),
        "{step:?}"
    );
    assert_eq!(reserved.status, 503, "{reserved:?}");
    assert_eq!(reserved.code().as_deref(), Some("unavailable"));
    assert_eq!(app.counters("FULL").await, (3, 2), "nothing moved");
    let mut connection = app.database.raw_connection().await;
    connection.execute(drop_trigger).await.unwrap();
    let step = app.engine.expire_step().await.unwrap();
    assert_eq!(
        step.released
            .iter()
            .map(|id| id.as_str())
            .collect::<Vec<_>>(),
        [id.as_str()],
        "released once the disk has room"
    );
    assert_eq!(app.counters("FULL").await, (5, 0));
}

async fn reserve_with_ttl(
    app: &TestApp,
    key: &str,
    sku: &str,
    quantity: i64,
    ttl_seconds: i64,
) -> String {
    let response = app
        .send(Call::post("/v1/reservations").key(key).json(
            &json!({"lines": [{"sku": sku, "quantity": quantity}], "ttl_seconds": ttl_seconds}),
        ))
        .await;
    assert_eq!(response.status, 201, "{response:?}");
    response.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn an_expired_reservation_is_released_and_its_stock_returns(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FRESH", 5).await;
    let id = reserve_with_ttl(&app, "hold", "FRESH", 3, 60).await;
    assert_eq!(app.counters("FRESH").await, (2, 3));

    app.clock.advance_seconds(61);
    let step = app.engine.expire_step().await.unwrap();

    assert_eq!(
        step.released
            .iter()
            .map(|id| id.as_str())
            .collect::<Vec<_>>(),
        vec![id.as_str()]
    );
    assert!(!step.more_waiting);
    assert_eq!(app.counters("FRESH").await, (5, 0));
    let reservation = app
        .send(Call::get(format!("/v1/reservations/{id}")))
        .await
        .json();
    assert_eq!(reservation["status"], "RELEASED");
    assert_eq!(reservation["release_reason"], "expired");
    assert_eq!(app.ledger_rows("FRESH", "release").await, 1);
    app.assert_audit_clean().await;
}

async fn a_reservation_is_not_released_before_its_expiry(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FRESH", 5).await;
    reserve_with_ttl(&app, "hold", "FRESH", 3, 60).await;

    app.clock.advance_seconds(59);
    let step = app.engine.expire_step().await.unwrap();

    assert!(step.released.is_empty());
    assert_eq!(app.counters("FRESH").await, (2, 3));
}

async fn a_second_expiry_run_releases_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("FRESH", 5).await;
    reserve_with_ttl(&app, "hold", "FRESH", 3, 60).await;
    app.clock.advance_seconds(120);
    assert_eq!(app.engine.expire_step().await.unwrap().released.len(), 1);

    let second = app.engine.expire_step().await.unwrap();

    assert!(second.released.is_empty());
    assert_eq!(app.counters("FRESH").await, (5, 0), "stock returned once");
    assert_eq!(app.ledger_rows("FRESH", "release").await, 1);
    app.assert_audit_clean().await;
}

async fn two_workers_racing_release_each_reservation_once(backend: Backend) {
    let config = engine::EngineConfig {
        expiry_batch_size: 7,
        ..test_engine_config()
    };
    let first = TestApp::spawn_with(backend, config.clone()).await;
    let second = TestApp::on(first.database.clone(), first.clock.clone(), config).await;
    for sku in ["ALPHA", "BETA"] {
        first.stocked_sku(sku, 100).await;
    }
    let mut reserved = HashSet::new();
    for index in 0..60 {
        let sku = if index % 2 == 0 { "ALPHA" } else { "BETA" };
        reserved.insert(reserve_with_ttl(&first, &format!("hold-{index}"), sku, 1, 30).await);
    }
    first.clock.advance_seconds(31);

    let run = |app: TestApp| async move {
        let mut released = Vec::new();
        for _ in 0..100 {
            let step = app.engine.expire_step().await.unwrap();
            if step.released.is_empty() {
                break;
            }
            released.extend(step.released.into_iter().map(|id| id.as_str().to_owned()));
        }
        released
    };
    let (from_first, from_second) = tokio::join!(
        tokio::spawn(run(first.clone())),
        tokio::spawn(run(second.clone()))
    );
    let mut all: Vec<String> = from_first.unwrap();
    all.extend(from_second.unwrap());

    let distinct: HashSet<String> = all.iter().cloned().collect();
    assert_eq!(all.len(), 60, "sixty releases in total, none twice");
    assert_eq!(distinct, reserved);
    for sku in ["ALPHA", "BETA"] {
        assert_eq!(first.counters(sku).await, (100, 0), "{sku}");
        assert_eq!(first.ledger_rows(sku, "release").await, 30, "{sku}");
    }
    first.assert_audit_clean().await;
}

async fn expiry_works_in_bounded_batches(backend: Backend) {
    let config = engine::EngineConfig {
        expiry_batch_size: 5,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("BATCH", 20).await;
    for index in 0..12 {
        reserve_with_ttl(&app, &format!("hold-{index}"), "BATCH", 1, 10).await;
    }
    app.clock.advance_seconds(11);

    let sizes: Vec<(usize, bool)> = [
        app.engine.expire_step().await.unwrap(),
        app.engine.expire_step().await.unwrap(),
        app.engine.expire_step().await.unwrap(),
    ]
    .into_iter()
    .map(|step| (step.released.len(), step.more_waiting))
    .collect();

    assert_eq!(sizes, vec![(5, true), (5, true), (2, false)]);
    assert_eq!(app.counters("BATCH").await, (20, 0));
}

async fn confirming_or_releasing_an_expired_reservation_is_an_illegal_transition(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LATE", 5).await;
    let id = reserve_with_ttl(&app, "hold", "LATE", 2, 10).await;
    app.clock.advance_seconds(11);
    app.engine.expire_step().await.unwrap();

    let confirm = app.confirm(&id, "late-confirm").await;
    let release = app.release(&id, "late-release").await;

    assert_eq!(confirm.code().as_deref(), Some("illegal_transition"));
    assert_eq!(release.code().as_deref(), Some("illegal_transition"));
    assert_eq!(app.counters("LATE").await, (5, 0));
    app.assert_audit_clean().await;
}

/// Issue 13, defect 9: the clock inside the confirming transaction decides, not the
/// sweep: a hold past `expires_at` is answered as expired and stays unsold until the
/// sweep gives its stock back. A release is still accepted.
async fn a_reservation_past_its_expiry_is_never_confirmed_even_before_the_sweep_runs(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("LATE", 5).await;
    let late = reserve_with_ttl(&app, "hold-late", "LATE", 2, 10).await;
    let on_time = reserve_with_ttl(&app, "hold-on-time", "LATE", 1, 60).await;
    app.clock.advance_seconds(10);
    let before = app.contents_except_idempotency_records().await;
    let confirm = app.confirm(&late, "late-confirm").await;
    assert_eq!(confirm.status, 409, "{confirm:?}");
    assert_eq!(confirm.code().as_deref(), Some("illegal_transition"));
    assert!(
        confirm.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("expired"),
        "{confirm:?}"
    );
    assert_eq!(app.contents_except_idempotency_records().await, before);
    let retried = app.confirm(&late, "late-confirm").await;
    assert_eq!(retried.status, 409);
    assert!(retried.replayed(), "the first answer is replayed");
    assert_eq!(app.confirm(&on_time, "on-time-confirm").await.status, 200);
    assert_eq!(app.engine.expire_step().await.unwrap().released.len(), 1);
    assert_eq!(
        app.counters("LATE").await,
        (4, 0),
        "one unit sold, two back"
    );
    app.assert_audit_clean().await;
}

async fn the_backlog_counts_the_due_holds_only(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("BREAD", 10).await;
    reserve_with_ttl(&app, "soon-1", "BREAD", 1, 60).await;
    reserve_with_ttl(&app, "soon-2", "BREAD", 1, 60).await;
    reserve_with_ttl(&app, "later", "BREAD", 1, 600).await;
    let confirmed = reserve_with_ttl(&app, "paid", "BREAD", 1, 60).await;
    assert_eq!(app.confirm(&confirmed, "paid-confirm").await.status, 200);

    app.clock.advance_seconds(61);

    assert_eq!(app.store.expiry_backlog(app.clock_now()).await.unwrap(), 2);
    app.engine.expire_step().await.unwrap();
    assert_eq!(app.store.expiry_backlog(app.clock_now()).await.unwrap(), 0);
}

/// A stock row edited by hand to hold fewer units reserved than a due hold: that hold
/// cannot be released, and stays `RESERVED` for a person (reported by the step); the
/// other due holds are released all the same, now and in every later step.
async fn a_hold_whose_stock_row_is_broken_does_not_stop_the_others_expiring(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("BROKEN", 5).await;
    app.stocked_sku("SOUND", 5).await;
    let broken = reserve_with_ttl(&app, "broken-hold", "BROKEN", 2, 60).await;
    let sound = reserve_with_ttl(&app, "sound-hold", "SOUND", 1, 61).await;
    let mut connection = app.database.raw_connection().await;
    connection
        .execute("UPDATE stock SET reserved = 0 WHERE sku = 'BROKEN'")
        .await
        .unwrap();
    app.clock.advance_seconds(120);

    let step = app.engine.expire_step().await.unwrap();

    let released: Vec<String> = step.released.iter().map(ToString::to_string).collect();
    assert_eq!(released, std::slice::from_ref(&sound), "{step:?}");
    assert_eq!(status_of(&app, &sound).await, "RELEASED");
    assert_eq!(status_of(&app, &broken).await, "RESERVED");
    assert_eq!(app.counters("SOUND").await, (5, 0));
    // The next step meets the broken hold again, and nothing else is stopped by it.
    let later = reserve_with_ttl(&app, "later-hold", "SOUND", 1, 1).await;
    app.clock.advance_seconds(5);
    let next = app.engine.expire_step().await.unwrap();
    let released: Vec<String> = next.released.iter().map(ToString::to_string).collect();
    assert_eq!(released, [later], "{next:?}");
}

/// Found in review: a stock row another session held open (an operator's `SELECT …
/// FOR UPDATE` left in a transaction) made the step wait the lock bound and fail,
/// every step, on the same claim: while it stayed held no hold of any SKU expired.
/// The holds on the held row are now left for later and the others released; the
/// held ones go once the row is free. (SQLite: a held write lock is the whole
/// database's, so nothing else could be released either.)
async fn a_stock_row_held_open_does_not_stop_the_other_holds_expiring(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let app = TestApp::spawn_with_lock_timeout(backend, test_engine_config(), 1_000).await;
    app.stocked_sku("HELD", 5).await;
    app.stocked_sku("FREE", 5).await;
    // Due first, so every claim starts with them.
    let held_first = reserve_with_ttl(&app, "held-first", "HELD", 1, 60).await;
    let held_second = reserve_with_ttl(&app, "held-second", "HELD", 1, 61).await;
    let free = reserve_with_ttl(&app, "free-hold", "FREE", 2, 62).await;
    app.clock.advance_seconds(120);
    let mut holder = app.database.hold_stock_row_lock("HELD").await;

    let step = app.engine.expire_step().await.expect("the step succeeds");

    let released: Vec<String> = step.released.iter().map(ToString::to_string).collect();
    assert_eq!(released, std::slice::from_ref(&free), "{step:?}");
    assert_eq!(status_of(&app, &free).await, "RELEASED");
    assert_eq!(app.counters("FREE").await, (5, 0));
    assert_eq!(status_of(&app, &held_first).await, "RESERVED");
    assert_eq!(status_of(&app, &held_second).await, "RESERVED");
    holder.execute("ROLLBACK").await.unwrap();
    let next = app.engine.expire_step().await.expect("the step succeeds");
    let mut released: Vec<String> = next.released.iter().map(ToString::to_string).collect();
    released.sort();
    let mut expected = vec![held_first, held_second];
    expected.sort();
    assert_eq!(released, expected, "{next:?}");
    assert_eq!(app.counters("HELD").await, (5, 0));
    assert_eq!(app.audit().await["differences_total"], 0);
}

/// As many broken holds as one step claims, due first: the next step claims the due
/// holds behind them instead of the same broken ones again (which, before, would have
/// kept every other hold from expiring, with the worker running without pause).
/// Once a claim reaches the end of the due holds, the next pass tries the broken ones
/// again.
async fn a_whole_batch_of_broken_holds_does_not_stop_the_holds_behind_it_expiring(
    backend: Backend,
) {
    let config = engine::EngineConfig {
        expiry_batch_size: 2,
        ..test_engine_config()
    };
    let app = TestApp::spawn_with(backend, config).await;
    app.stocked_sku("BROKEN", 5).await;
    app.stocked_sku("SOUND", 5).await;
    let broken = [
        reserve_with_ttl(&app, "broken-hold-1", "BROKEN", 1, 60).await,
        reserve_with_ttl(&app, "broken-hold-2", "BROKEN", 1, 60).await,
    ];
    let sound = reserve_with_ttl(&app, "sound-hold", "SOUND", 1, 61).await;
    let mut connection = app.database.raw_connection().await;
    connection
        .execute("UPDATE stock SET reserved = 0 WHERE sku = 'BROKEN'")
        .await
        .unwrap();
    app.clock.advance_seconds(120);

    let first = app.engine.expire_step().await.unwrap();
    assert!(first.released.is_empty(), "{first:?}");
    assert!(first.more_waiting, "a full claim: {first:?}");

    let second = app.engine.expire_step().await.unwrap();
    let released: Vec<String> = second.released.iter().map(ToString::to_string).collect();
    assert_eq!(released, std::slice::from_ref(&sound), "{second:?}");
    assert!(!second.more_waiting, "the end of the due holds: {second:?}");
    assert_eq!(app.counters("SOUND").await, (5, 0));

    // The next pass starts from the beginning: the broken holds are claimed (and
    // reported) again, and still nothing moves them.
    let third = app.engine.expire_step().await.unwrap();
    assert!(third.released.is_empty(), "{third:?}");
    assert!(third.more_waiting, "{third:?}");
    for hold in &broken {
        assert_eq!(status_of(&app, hold).await, "RESERVED");
    }
}

async fn status_of(app: &TestApp, reservation: &str) -> String {
    let read = app
        .send(Call::get(format!("/v1/reservations/{reservation}")))
        .await;
    read.json()["status"].as_str().unwrap().to_owned()
}

/// The order expiry's claim reads the unpaid and the declined orders through their
/// partial indexes, never the whole order table (which only grows: paid orders stay).
/// PostgreSQL is told to avoid a sequential scan, so the plan shows whether an index
/// can answer at all; on MySQL, whose optimizer's choice on a near-empty table says
/// nothing, the plan must name the index on (status, expires_at) as one it can use.
async fn the_order_expiry_claim_reads_the_due_orders_through_their_indexes(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut connection = app.database.plan_connection().await;
    let claim = match backend {
        Backend::Sqlite => {
            <sqlx::SqliteConnection as store::backend::Dialect>::CLAIM_EXPIRED_ORDERS
        }
        Backend::Postgres => <sqlx::PgConnection as store::backend::Dialect>::CLAIM_EXPIRED_ORDERS,
        Backend::Mysql => <sqlx::MySqlConnection as store::backend::Dialect>::CLAIM_EXPIRED_ORDERS,
    };
    let mut plan = String::new();
    for statement in claim {
        let statement = statement
            .replace("$1", "1000")
            .replace("$2", "100")
            .replace("$3", "0")
            .replace("$4", "''");
        plan.push_str(&connection.plan_of(&statement).await);
        plan.push('\n');
    }

    if backend == Backend::Mysql {
        // One statement a status, each through the index on (status, expires_at).
        assert_eq!(claim.len(), 2);
        assert!(
            plan.matches("customer_order_holding").count() >= 2,
            "{plan}"
        );
        return;
    }
    assert!(plan.contains("customer_order_open"), "{plan}");
    assert!(plan.contains("customer_order_declined"), "{plan}");
}

/// Found in review: a hold's end is written by the instance that took it and was
/// judged by the sweeping instance's own clock, so an instance whose clock ran ahead
/// released every instance's holds early (and their stock was sold again), and refused
/// their confirms. Hold ends are now judged by the instance's clock held back by how far
/// it was last seen ahead of the database server's.
async fn an_instance_whose_clock_runs_ahead_releases_no_hold_before_its_end(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    if backend == Backend::Sqlite {
        // One process holds the database: its clock is the only one.
        return;
    }
    app.clock_at_the_databases();
    app.stocked_sku("SKEW", 5).await;
    let kept = reserve_with_ttl(&app, "hold-skew", "SKEW", 2, 30).await;
    let confirmed = reserve_with_ttl(&app, "hold-confirmed", "SKEW", 1, 30).await;
    // This instance's clock jumps 40 s ahead of the database server's (which has
    // moved on by the test's milliseconds only): by it, both holds ended.
    app.clock_runs_ahead_of_the_database(40).await;

    let step = app.engine.expire_step().await.expect("expire step");
    let confirm = app.confirm(&confirmed, "confirm-skew").await;

    assert_eq!(step.released, [], "no hold ended by the database's clock");
    assert_eq!(confirm.status, 200, "{confirm:?}");
    // Only the judgement of the end is held back: what the confirm wrote carries this
    // instance's time, as everything else it writes does.
    let written = app
        .database
        .raw_connection()
        .await
        .texts(&format!(
            "SELECT CASE WHEN updated_at = {now} THEN 'now' ELSE 'held back' END \
             FROM reservation WHERE id = '{confirmed}'",
            now = app.clock_now().unix_milliseconds()
        ))
        .await;
    assert_eq!(written, [Some("now".to_owned())]);
    assert_eq!(status_of(&app, &kept).await, "RESERVED");
    assert_eq!(app.counters("SKEW").await, (2, 2));
    app.assert_audit_clean().await;
}

/// Found in review: the backlog gauge (and the open-holds gauges) judged a hold's end
/// by the instance's own clock, while the expiry worker judges it by that clock held
/// back by how far it runs ahead of the database's. On an instance running ahead the
/// gauge counted holds the worker rightly left alone, and `StockdExpiryBacklog` fired
/// for nothing. Both now judge alike.
async fn on_an_instance_whose_clock_runs_ahead_the_backlog_counts_only_what_its_expiry_releases(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    if backend == Backend::Sqlite {
        // One process holds the database: its clock is the only one.
        return;
    }
    app.clock_at_the_databases();
    app.stocked_sku("BREAD", 10).await;
    reserve_with_ttl(&app, "soon", "BREAD", 1, 60).await;
    // This instance's clock jumps three minutes ahead of the database server's: by it,
    // the hold has ended; by the database's, it has not.
    app.clock_runs_ahead_of_the_database(180).await;

    assert!(app.engine.expire_step().await.unwrap().released.is_empty());
    assert_eq!(app.engine.expiry_backlog().await.unwrap(), 0);
    assert_eq!(app.engine.gauges().await.unwrap().expired_backlog, 0);
    assert_eq!(app.engine.gauges().await.unwrap().reserved, 1);
}

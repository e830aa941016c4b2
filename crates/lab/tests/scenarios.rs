//! The lab's acceptance scenarios, run end to end against an in-process stockd over
//! real HTTP on both backends. Each one fails if the report would show an oversell, a
//! duplicate effect, an unexplained failure or an unclean audit.

use acceptance::{Backend, mirrored_tests, mysql_url, postgres_url};
use lab::report::Class;
use lab::{BenchOptions, Plan, Report, Scenario, Target};

mirrored_tests!(
    the_last_unit_scenario_sells_exactly_one_unit_and_replays_every_duplicate,
    the_limited_scenario_sells_exactly_the_stock,
    the_bad_input_scenario_refuses_everything_and_changes_nothing,
    the_hot_scenario_with_duplicates_takes_one_unit_per_key,
    the_flash_sale_sells_exactly_its_units_within_each_shoppers_limit,
    a_spread_run_over_a_grown_ledger_writes_its_history_and_stays_clean,
);

async fn run(backend: Backend, scenario: Scenario, options: BenchOptions) -> Report {
    let postgres = match backend {
        Backend::Sqlite => None,
        Backend::Postgres => Some(postgres_url()),
        Backend::Mysql => Some(mysql_url()),
    };
    let target = Target::in_process(postgres.as_deref(), 8, engine::EngineConfig::default())
        .await
        .unwrap();
    let plan = Plan::new(scenario, &options, "test").unwrap();
    let report = lab::runner::run(plan, &target).await;
    target.stop().await;
    let report = report.unwrap();
    assert!(report.passed(), "{}", report.render_text());
    report
}

async fn the_last_unit_scenario_sells_exactly_one_unit_and_replays_every_duplicate(
    backend: Backend,
) {
    let report = run(backend, Scenario::LastUnit, BenchOptions::default()).await;

    assert_eq!(report.requests_sent, 150);
    assert_eq!(report.count(Class::Success), 1);
    // Every other answer is "sold out": the database's, replayed to the copies of a
    // key it answered, or an instance's memory's, stored under no key, so each copy of
    // such a key hears it afresh (alike: the judge in `run` checks replays and effects).
    let replayed = report.count(Class::ReplayedDuplicate);
    assert!(replayed <= 50, "{}", report.render_text());
    assert_eq!(
        replayed + report.count(Class::InsufficientStock),
        149,
        "{}",
        report.render_text()
    );
    assert_eq!((report.available_total, report.reserved_total), (0, 1));
    assert!(report.audit.ok);
}

async fn the_limited_scenario_sells_exactly_the_stock(backend: Backend) {
    let options = BenchOptions {
        requests: Some(300),
        ..BenchOptions::default()
    };
    let report = run(backend, Scenario::Limited, options).await;

    assert_eq!(report.count(Class::Success), 10);
    assert_eq!(report.count(Class::InsufficientStock), 290);
    assert_eq!((report.available_total, report.reserved_total), (0, 10));
}

async fn the_bad_input_scenario_refuses_everything_and_changes_nothing(backend: Backend) {
    let options = BenchOptions {
        requests: Some(64),
        ..BenchOptions::default()
    };
    let report = run(backend, Scenario::BadInput, options).await;

    assert_eq!(report.count(Class::Success), 0);
    assert!(
        report.count(Class::InvalidArgument) >= 56,
        "{}",
        report.render_text()
    );
    assert_eq!((report.available_total, report.reserved_total), (5, 0));
}

async fn the_hot_scenario_with_duplicates_takes_one_unit_per_key(backend: Backend) {
    let options = BenchOptions {
        requests: Some(400),
        clients: Some(16),
        duplicate_ratio: Some(0.25),
        ..BenchOptions::default()
    };
    let report = run(backend, Scenario::Hot, options).await;

    let successes = report.count(Class::Success);
    let replays = report.count(Class::ReplayedDuplicate);
    assert_eq!(successes + replays, 400, "{}", report.render_text());
    assert!(replays > 0, "some requests were duplicates");
    assert_eq!(
        report.reserved_total, successes as i64,
        "one unit per distinct key"
    );
}

async fn a_spread_run_over_a_grown_ledger_writes_its_history_and_stays_clean(backend: Backend) {
    let options = BenchOptions {
        skus: Some(30),
        ledger_rows: Some(1_000),
        requests: Some(200),
        clients: Some(8),
        ..BenchOptions::default()
    };
    let report = run(backend, Scenario::Spread, options).await;

    // 1,000 rows over 30 SKUs is 17 pairs each (the pair numbers need two digits).
    assert_eq!(report.history_ledger_rows, 30 * 17 * 2);
    assert_eq!(
        report.count(Class::Success),
        200,
        "{}",
        report.render_text()
    );
    assert_eq!(report.stock_initial_total, 30 * 100_000);
    assert_eq!(report.reserved_total, 200, "the history moved no counter");
    assert!(report.audit.ok, "{}", report.render_text());
}

async fn the_flash_sale_sells_exactly_its_units_within_each_shoppers_limit(backend: Backend) {
    let options = BenchOptions {
        stock: Some(40),
        users: Some(60),
        per_user_limit: Some(2),
        requests: Some(2_000),
        buckets: Some(4),
        clients: Some(32),
        ..BenchOptions::default()
    };
    let report = run(backend, Scenario::FlashSale, options).await;

    assert_eq!(report.count(Class::Success), 40, "{}", report.render_text());
    let campaign = report.campaign.clone().expect("the campaign is reported");
    assert_eq!((campaign.held, campaign.left, campaign.buckets), (40, 0, 4));
    assert!(campaign.most_units_one_buyer_got <= 2);
    // Every answer is of a known class: a unit, sold out, over the limit, or a
    // shopper's second request while the first waits.
    let known = [
        Class::Success,
        Class::InsufficientStock,
        Class::PurchaseLimitExceeded,
        Class::RateLimited,
    ];
    let answered: u64 = known.iter().map(|class| report.count(*class)).sum();
    assert_eq!(answered, 2_000, "{}", report.render_text());
    assert!(
        report
            .latency_by_class
            .contains_key(&Class::InsufficientStock)
    );
    assert!(report.sold_out_answers_per_second > 0.0);
    assert!(report.audit.ok);
}

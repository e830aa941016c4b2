//! `stockd gate` as a release manager runs it: every item of seed 002's acceptance list
//! on one database, a pass/fail line per item, and the evidence page of §十三.3 with
//! every section; exit 0 only when every item ran and held. Without `--cluster` the
//! cluster drills do not run, so the gate here is incomplete (exit 1) with every item
//! it ran held; the verdict's rule is unit-tested in `lab::gate`.

use acceptance::{Backend, mirrored_tests};

const STOCKD: &str = env!("CARGO_BIN_EXE_stockd");

mirrored_tests!(the_release_gate_holds_every_item_it_runs_and_is_incomplete_without_the_cluster);

/// The evidence page's sections (seed 002 §十三.3), in order.
const SECTIONS: [&str; 6] = [
    "## Items",
    "## Environment",
    "## Data size",
    "## Concurrency model",
    "## Latency and outcomes",
    "## Final reconciliation",
];

/// Items every gate runs, and those that need a database server.
const ALWAYS: [&str; 11] = [
    "scenario last-unit",
    "scenario limited",
    "scenario ample",
    "scenario multi-sku",
    "scenario bad-input",
    "order number used once",
    "drill lost-response",
    "drill lock-timeout",
    "drill compensation-failure",
    "drill duplicate-delivery",
    "three-way reconciliation",
];
const WITH_A_SERVER: [&str; 2] = ["drill deadlock", "drill drop-before-commit"];

async fn the_release_gate_holds_every_item_it_runs_and_is_incomplete_without_the_cluster(
    backend: Backend,
) {
    if !backend.available().await {
        return;
    }
    let scratch = std::env::temp_dir().join(format!("stockd-gate-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&scratch).unwrap();
    let evidence = scratch.join("evidence.md");
    let mut command = std::process::Command::new(STOCKD);
    command.args(["gate", "--evidence"]).arg(&evidence);
    match backend {
        Backend::Sqlite => {}
        Backend::Postgres => {
            command.args(["--database-url", &acceptance::postgres_url()]);
        }
        Backend::Mysql => {
            command.args(["--database-url", &acceptance::mysql_url()]);
        }
    }
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap();
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    let page = std::fs::read_to_string(&evidence).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&scratch);

    assert_eq!(
        output.status.code(),
        Some(1),
        "{printed}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(printed.contains("gate: INCOMPLETE"), "{printed}");
    assert!(page.contains("Result: **INCOMPLETE**"), "{page}");
    assert!(!page.contains("| FAIL |"), "no item failed: {page}");
    for item in ["drill failover", "drill replica-lag"] {
        assert!(page.contains(&format!("| {item} | not run |")), "{page}");
    }
    let mut last = 0;
    for section in SECTIONS {
        let at = page
            .find(section)
            .unwrap_or_else(|| panic!("no {section}: {page}"));
        assert!(at > last, "{section} out of order");
        last = at;
    }
    let passed = |item: &str| page.contains(&format!("| {item} | pass |"));
    for item in ALWAYS {
        assert!(passed(item), "{item} did not pass: {page}");
    }
    for item in WITH_A_SERVER {
        if backend == Backend::Sqlite {
            assert!(page.contains(&format!("| {item} | not run |")), "{page}");
        } else {
            assert!(passed(item), "{item} did not pass: {page}");
        }
    }
    assert!(page.contains("| database and version |"));
    assert!(
        page.contains("| last-unit | 1 | 1 |"),
        "the stock-1 scenario's data size"
    );
}

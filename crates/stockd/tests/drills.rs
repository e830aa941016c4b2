//! The fault drills as a user runs them: `stockd drill lock-timeout`, `deadlock`,
//! `lost-response`, `compensation-failure` and `drop-before-commit` on every backend, each exiting 0 only when what it checks held and
//! writing its report. They start stockd on a scratch database of the machine's
//! servers (`STOCKD_TEST_POSTGRES_URL`, `STOCKD_TEST_MYSQL_URL`).

use acceptance::{Backend, mirrored_tests};

const STOCKD: &str = env!("CARGO_BIN_EXE_stockd");

mirrored_tests!(
    the_lock_timeout_drill_holds_and_writes_its_report,
    the_deadlock_drill_holds_where_the_database_can_deadlock,
    the_lost_response_drill_holds_and_writes_its_report,
    the_compensation_failure_drill_holds_and_writes_its_report,
    the_drop_before_commit_drill_holds_where_there_is_a_connection_to_cut,
);

/// What a drill printed and wrote, and how it exited.
struct Ran {
    code: Option<i32>,
    printed: String,
    errors: String,
    report: Option<serde_json::Value>,
}

async fn run_drill(name: &str, backend: Backend) -> Option<Ran> {
    if !backend.available().await {
        return None;
    }
    let report_path = std::env::temp_dir().join(format!(
        "stockd-drill-{name}-{:016x}.json",
        rand::random::<u64>()
    ));
    let mut command = std::process::Command::new(STOCKD);
    command.args(["drill", name, "--json"]).arg(&report_path);
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
    let report = std::fs::read_to_string(&report_path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    let _ = std::fs::remove_file(&report_path);
    Some(Ran {
        code: output.status.code(),
        printed: String::from_utf8_lossy(&output.stdout).into_owned(),
        errors: String::from_utf8_lossy(&output.stderr).into_owned(),
        report,
    })
}

fn assert_held(ran: &Ran, drill: &str, checks: usize) {
    assert_eq!(ran.code, Some(0), "{}\n{}", ran.printed, ran.errors);
    assert!(ran.printed.contains("verdict: HELD"), "{}", ran.printed);
    let report = ran.report.as_ref().expect("the JSON report");
    assert_eq!(report["drill"], drill);
    assert_eq!(report["held"], true);
    assert_eq!(report["checks"].as_array().unwrap().len(), checks);
}

async fn the_lock_timeout_drill_holds_and_writes_its_report(backend: Backend) {
    let Some(ran) = run_drill("lock-timeout", backend).await else {
        return;
    };
    assert_held(&ran, "lock-timeout", 6);
    let figures = &ran.report.as_ref().unwrap()["figures"];
    assert!(figures["waited_milliseconds"].as_u64().unwrap() >= 900);
}

async fn the_deadlock_drill_holds_where_the_database_can_deadlock(backend: Backend) {
    let Some(ran) = run_drill("deadlock", backend).await else {
        return;
    };
    if backend == Backend::Sqlite {
        // One writer at a time: nothing to drill, and the drill says so.
        assert_eq!(ran.code, Some(2), "{}", ran.printed);
        assert!(
            ran.errors.contains("SQLite has one writer"),
            "{}",
            ran.errors
        );
        return;
    }
    assert_held(&ran, "deadlock", 4);
    let figures = &ran.report.as_ref().unwrap()["figures"];
    assert!(figures["deadlocks"].as_f64().unwrap() >= 3.0);
    assert!(figures["placed"].as_u64().unwrap() < figures["orders"].as_u64().unwrap());
}

async fn the_lost_response_drill_holds_and_writes_its_report(backend: Backend) {
    let Some(ran) = run_drill("lost-response", backend).await else {
        return;
    };
    assert_held(&ran, "lost-response", 4);
}

async fn the_compensation_failure_drill_holds_and_writes_its_report(backend: Backend) {
    let Some(ran) = run_drill("compensation-failure", backend).await else {
        return;
    };
    assert_held(&ran, "compensation-failure", 5);
    let figures = &ran.report.as_ref().unwrap()["figures"];
    assert!(figures["retries"].as_f64().unwrap() >= 3.0);
    assert!(figures["pending_peak"].as_f64().unwrap() >= 1.0);
}

async fn the_drop_before_commit_drill_holds_where_there_is_a_connection_to_cut(backend: Backend) {
    let Some(ran) = run_drill("drop-before-commit", backend).await else {
        return;
    };
    if backend == Backend::Sqlite {
        // An embedded database: no connection between stockd and it to cut.
        assert_eq!(ran.code, Some(2), "{}", ran.printed);
        assert!(
            ran.errors.contains("SQLite has no connection to cut"),
            "{}",
            ran.errors
        );
        return;
    }
    assert_held(&ran, "drop-before-commit", 5);
    assert_eq!(ran.report.as_ref().unwrap()["figures"]["cuts"], 1);
}

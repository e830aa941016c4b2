//! `stockd gate` (seed 002 §十五.4: "把库存为 1 的并发测试、提交后响应丢失、主库切换、消息重复
//! 和三方对账纳入发布门禁"): the seed's acceptance list run against one database, with
//! a pass/fail line per item and the release evidence of §十三.3 (database and
//! version, machine, data size, concurrency model, mean/p95/p99, successes, failures
//! by class, final reconciliation) written as Markdown. Exit 0 only when every item
//! ran and held.
//!
//! Items: the scenarios stock 1 (with duplicate keys), stock 10, stock 100 in waves,
//! opposing multi-SKU orders and bad input, each on a fresh stockd; the order-number
//! rule; every drill this machine can run (`deadlock` and `drop-before-commit` need
//! PostgreSQL or MySQL, `duplicate-delivery` a `nats-server` binary, `failover` and
//! `replica-lag` the local cluster, asked for with `--cluster`); and the three-way
//! reconciliation over all of them. An item that cannot run here is listed as not run,
//! with the reason, and leaves the gate INCOMPLETE (exit 1): passed only when every item
//! ran and held.

use std::path::PathBuf;
use std::time::Instant;

use hyper::Method;
use serde::Serialize;
use serde_json::json;

use crate::client::{HttpConnection, WireRequest, authorization};
use crate::drill::DrillReport;
use crate::evidence::Environment;
use crate::fault_drills::FaultDrillOptions;
use crate::report::{Class, Report};
use crate::scenario::{BenchOptions, Plan, Scenario};
use crate::target::Target;

/// What to run the gate on and where to write its evidence.
#[derive(Debug, Clone)]
pub struct GateOptions {
    /// `postgres://…` or `mysql://…` (a scratch schema or database per item), or
    /// `None` for temporary SQLite files.
    pub database_url: Option<String>,
    pub evidence: PathBuf,
    /// Also run the cluster drills (`failover`, `replica-lag`) on deploy/local-cluster.
    pub cluster: bool,
    /// The command as typed (secrets taken out), for the evidence page.
    pub command_line: String,
}

/// One line of the gate.
#[derive(Debug, Clone, Serialize)]
pub struct GateItem {
    pub name: String,
    /// `None`: not run here (the detail says why).
    pub held: Option<bool>,
    pub detail: String,
    pub seconds: f64,
}

/// The gate's verdict. The seed puts every item in the gate (主库切换 and 消息重复
/// included): one this machine could not run leaves the gate unproven, not passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every item ran and held.
    Pass,
    /// None failed, but some did not run here.
    Incomplete,
    /// An item failed.
    Fail,
}

impl Verdict {
    pub fn of(items: &[GateItem]) -> Verdict {
        if items.iter().any(|item| item.held == Some(false)) {
            Verdict::Fail
        } else if items.iter().any(|item| item.held.is_none()) {
            Verdict::Incomplete
        } else {
            Verdict::Pass
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Incomplete => "INCOMPLETE",
            Verdict::Fail => "FAIL",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct GateReport {
    /// Every item ran and held (the verdict is `Pass`).
    pub passed: bool,
    pub verdict: Verdict,
    pub items: Vec<GateItem>,
    #[serde(skip)]
    pub scenarios: Vec<Report>,
    pub database: String,
}

/// The scenarios of the seed's acceptance list, in the order the evidence shows them.
const SCENARIOS: [Scenario; 5] = [
    Scenario::LastUnit,
    Scenario::Limited,
    Scenario::Ample,
    Scenario::MultiSku,
    Scenario::BadInput,
];

pub async fn gate(options: GateOptions) -> Result<GateReport, String> {
    let server = options.database_url.as_deref();
    let mut items = Vec::new();
    let mut scenarios = Vec::new();
    let mut database = String::from("unknown");
    for scenario in SCENARIOS {
        let started = Instant::now();
        let target = Target::in_process(server, 16, engine::EngineConfig::default()).await?;
        if let Some(version) = &target.database_version {
            database = version.clone();
        }
        let run_id = format!("{:08x}", rand::random::<u32>());
        let outcome = async {
            let plan = Plan::new(scenario, &BenchOptions::default(), &run_id)?;
            crate::runner::run(plan, &target).await
        }
        .await;
        target.stop().await;
        let report = outcome?;
        items.push(GateItem {
            name: format!("scenario {}", scenario.name()),
            held: Some(report.passed()),
            detail: scenario_detail(&report),
            seconds: started.elapsed().as_secs_f64(),
        });
        scenarios.push(report);
    }
    items.push(order_number_rule(server).await?);
    for (name, run) in drills(&options) {
        let started = Instant::now();
        let item = match run {
            Err(reason) => GateItem {
                name: format!("drill {name}"),
                held: None,
                detail: reason,
                seconds: 0.0,
            },
            Ok(drill) => match drill.await {
                Ok(report) => GateItem {
                    name: format!("drill {name}"),
                    held: Some(report.held),
                    detail: drill_detail(&report),
                    seconds: started.elapsed().as_secs_f64(),
                },
                Err(error) => GateItem {
                    name: format!("drill {name}"),
                    held: Some(false),
                    detail: format!("could not run: {error}"),
                    seconds: started.elapsed().as_secs_f64(),
                },
            },
        };
        items.push(item);
    }
    items.push(reconciliation(&scenarios, &items));
    let verdict = Verdict::of(&items);
    let report = GateReport {
        passed: verdict == Verdict::Pass,
        verdict,
        items,
        scenarios,
        database,
    };
    let page = render(
        &report,
        &Environment::read(report.database.clone()),
        &options.command_line,
    );
    std::fs::write(&options.evidence, page)
        .map_err(|error| format!("cannot write {}: {error}", options.evidence.display()))?;
    Ok(report)
}

type DrillRun = std::pin::Pin<Box<dyn std::future::Future<Output = Result<DrillReport, String>>>>;

/// Every drill, with how to run it here or why it cannot.
fn drills(options: &GateOptions) -> Vec<(&'static str, Result<DrillRun, String>)> {
    let fault = || FaultDrillOptions {
        database_url: options.database_url.clone(),
    };
    let server = options
        .database_url
        .as_deref()
        .is_some_and(|url| url.starts_with("postgres") || url.starts_with("mysql://"));
    let needs_server = "needs PostgreSQL or MySQL (--database-url)".to_owned();
    let nats_server =
        std::env::var("STOCKD_NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
    let needs_cluster = "needs the local cluster (--cluster)".to_owned();
    let run = |future: DrillRun| -> Result<DrillRun, String> { Ok(future) };
    vec![
        (
            "lost-response",
            run(Box::pin(crate::fault_drills::lost_response(fault()))),
        ),
        (
            "lock-timeout",
            run(Box::pin(crate::fault_drills::lock_timeout(fault()))),
        ),
        (
            "deadlock",
            if server {
                run(Box::pin(crate::fault_drills::deadlock(fault())))
            } else {
                Err(needs_server.clone())
            },
        ),
        (
            "drop-before-commit",
            if server {
                run(Box::pin(crate::fault_drills::drop_before_commit(fault())))
            } else {
                Err(needs_server)
            },
        ),
        (
            "compensation-failure",
            run(Box::pin(crate::fault_drills::compensation_failure(fault()))),
        ),
        (
            "duplicate-delivery",
            if std::path::Path::new(&nats_server).exists() {
                run(Box::pin(crate::duplicate_drill::duplicate_delivery(
                    crate::duplicate_drill::DuplicateDeliveryOptions::default(),
                )))
            } else {
                Err(format!("needs {nats_server}"))
            },
        ),
        (
            "failover",
            if options.cluster {
                run(Box::pin(crate::drill::failover(
                    crate::drill::FailoverOptions {
                        clients: 4,
                        before_kill: std::time::Duration::from_secs(2),
                        after_recovery: std::time::Duration::from_secs(2),
                    },
                )))
            } else {
                Err(needs_cluster.clone())
            },
        ),
        (
            "replica-lag",
            if options.cluster {
                run(Box::pin(crate::drill::replica_lag(
                    crate::drill::ReplicaLagOptions::default(),
                )))
            } else {
                Err(needs_cluster)
            },
        ),
    ]
}

/// The rule of seed 002 §十.1: an order number under another request id is refused and
/// changes nothing; under its own request id it replays.
async fn order_number_rule(server: Option<&str>) -> Result<GateItem, String> {
    let started = Instant::now();
    let target = Target::in_process(server, 4, engine::EngineConfig::default()).await?;
    let outcome = order_number_checks(&target).await;
    target.stop().await;
    let (held, detail) = outcome?;
    Ok(GateItem {
        name: "order number used once".into(),
        held: Some(held),
        detail,
        seconds: started.elapsed().as_secs_f64(),
    })
}

async fn order_number_checks(target: &Target) -> Result<(bool, String), String> {
    let admin = authorization(target.admin_token.expose());
    let send = |request: WireRequest| {
        let admin = admin.clone();
        async move {
            HttpConnection::new(target.address)
                .send(&request.authorized(admin))
                .await
        }
    };
    const SKU: &str = "GATE-ORDER-REF";
    send(
        WireRequest::json(
            Method::PUT,
            format!("/v1/skus/{SKU}"),
            &json!({"title": "Gate SKU", "price": 100, "currency": "CNY"}),
        )
        .key("gate-sku"),
    )
    .await?;
    send(
        WireRequest::json(
            Method::POST,
            format!("/v1/skus/{SKU}/stock-movements"),
            &json!({"kind": "receive", "quantity": 5}),
        )
        .key("gate-receive"),
    )
    .await?;
    let body =
        json!({"lines": [{"sku": SKU, "quantity": 1}], "order_ref": "GATE-SO-1", "source": "gate"});
    let reserve = |key: &str| WireRequest::json(Method::POST, "/v1/reservations", &body).key(key);
    let first = send(reserve("gate-first")).await?;
    let other = send(reserve("gate-second")).await?;
    let same = send(reserve("gate-first")).await?;
    let sku = send(WireRequest::get(format!("/v1/skus/{SKU}")))
        .await?
        .json()?;
    let audit = send(WireRequest::get("/v1/audit")).await?.json()?;
    let held = first.status == 201
        && other.status == 409
        && other.code().as_deref() == Some("order_ref_reused")
        && same.status == 201
        && same.replayed
        && sku["reserved"] == 1
        && audit["ok"] == true;
    Ok((
        held,
        format!(
            "first {}, another key {} {}, the same key {} (replayed {}), reserved {}, audit {}",
            first.status,
            other.status,
            other.code().unwrap_or_default(),
            same.status,
            same.replayed,
            sku["reserved"],
            if audit["ok"] == true {
                "clean"
            } else {
                "NOT CLEAN"
            }
        ),
    ))
}

/// The three-way check over everything the gate ran: every scenario's audit, and every
/// item's own audit check.
fn reconciliation(scenarios: &[Report], items: &[GateItem]) -> GateItem {
    let unclean: Vec<&str> = scenarios
        .iter()
        .filter(|report| !report.audit.ok)
        .map(|report| report.scenario)
        .collect();
    let failed_items = items.iter().filter(|item| item.held == Some(false)).count();
    GateItem {
        name: "three-way reconciliation".into(),
        held: Some(unclean.is_empty()),
        detail: format!(
            "ledger = counters = reservations on {} scenario databases{}; each drill checks its own ({failed_items} items failed)",
            scenarios.len(),
            if unclean.is_empty() {
                String::new()
            } else {
                format!(", NOT CLEAN after {}", unclean.join(", "))
            }
        ),
        seconds: 0.0,
    }
}

fn scenario_detail(report: &Report) -> String {
    let mut detail = format!(
        "{} requests, {} successes, p99 {:.1} ms, audit {}",
        report.requests_sent,
        report.count(Class::Success),
        report.latency.p99_milliseconds,
        if report.audit.ok {
            "clean"
        } else {
            "NOT CLEAN"
        }
    );
    if !report.violations.is_empty() {
        detail.push_str(&format!("; violations: {}", report.violations.join("; ")));
    }
    detail
}

fn drill_detail(report: &DrillReport) -> String {
    let broken: Vec<&str> = report
        .checks
        .iter()
        .filter(|check| !check.held)
        .map(|check| check.name.as_str())
        .collect();
    if broken.is_empty() {
        format!("{} checks held", report.checks.len())
    } else {
        format!("BROKEN: {}", broken.join("; "))
    }
}

/// The evidence page: a line per item, then §十三.3's sections.
pub fn render(report: &GateReport, environment: &Environment, command: &str) -> String {
    let mut page = String::new();
    let mut line = |text: String| {
        page.push_str(&text);
        page.push('\n');
    };
    line("# Release gate".into());
    line(String::new());
    line(format!("Result: **{}**", report.verdict.name()));
    if report.verdict == Verdict::Incomplete {
        line(String::new());
        line(
            "Items marked `not run` could not run on this machine: the gate is not passed \
             until they run (on the release's database, with `--cluster` where the cluster \
             exists)."
                .into(),
        );
    }
    line(String::new());
    line(format!("Command: `{command}`"));
    line(String::new());
    line("## Items".into());
    line(String::new());
    line("| item | verdict | detail | seconds |".into());
    line("| --- | --- | --- | --- |".into());
    for item in &report.items {
        let verdict = match item.held {
            Some(true) => "pass",
            Some(false) => "FAIL",
            None => "not run",
        };
        line(format!(
            "| {} | {verdict} | {} | {:.1} |",
            item.name,
            item.detail.replace('|', "/"),
            item.seconds
        ));
    }
    line(String::new());
    line("## Environment".into());
    line(String::new());
    line("| item | value |".into());
    line("| --- | --- |".into());
    line(format!(
        "| database and version | {} |",
        environment.database
    ));
    line(format!(
        "| stockd | {} ({} build) |",
        environment.stockd_version, environment.build_profile
    ));
    line(format!(
        "| machine | {} cores, {} memory, {} |",
        environment.cores, environment.memory, environment.cpu
    ));
    line(format!(
        "| operating system | {} |",
        environment.operating_system
    ));
    line(String::new());
    line("## Data size".into());
    line(String::new());
    line("| scenario | SKUs | stock received | requests |".into());
    line("| --- | --- | --- | --- |".into());
    for scenario in &report.scenarios {
        line(format!(
            "| {} | {} | {} | {} |",
            scenario.scenario,
            scenario.skus_checked,
            scenario.stock_initial_total,
            scenario.requests_sent
        ));
    }
    line(String::new());
    line("## Concurrency model".into());
    line(String::new());
    line(
        "Each scenario runs on a fresh stockd in this process (its own runtime and threads) \
         on a fresh database; its clients each hold one keep-alive HTTP/1.1 connection and send \
         the next request as soon as the previous one is answered (closed loop). Every request \
         carries its own Idempotency-Key; duplicates reuse an earlier key with the same body."
            .into(),
    );
    line(String::new());
    line("| scenario | clients |".into());
    line("| --- | --- |".into());
    for scenario in &report.scenarios {
        line(format!("| {} | {} |", scenario.scenario, scenario.clients));
    }
    line(String::new());
    line("## Latency and outcomes".into());
    line(String::new());
    let classes: Vec<&str> = Class::ALL.iter().map(|class| class.name()).collect();
    line(format!(
        "| scenario | mean ms | p95 ms | p99 ms | {} |",
        classes.join(" | ")
    ));
    line(format!(
        "| --- | --- | --- | --- | {} |",
        vec!["---"; classes.len()].join(" | ")
    ));
    for scenario in &report.scenarios {
        let counts: Vec<String> = Class::ALL
            .iter()
            .map(|class| scenario.count(*class).to_string())
            .collect();
        line(format!(
            "| {} | {:.2} | {:.2} | {:.2} | {} |",
            scenario.scenario,
            scenario.latency.mean_milliseconds,
            scenario.latency.p95_milliseconds,
            scenario.latency.p99_milliseconds,
            counts.join(" | ")
        ));
    }
    line(String::new());
    line("## Final reconciliation".into());
    line(String::new());
    line(
        "| scenario | received | available | reserved | taken by the successes seen | audit |"
            .into(),
    );
    line("| --- | --- | --- | --- | --- | --- |".into());
    for scenario in &report.scenarios {
        line(format!(
            "| {} | {} | {} | {} | {} | {} ({} differences) |",
            scenario.scenario,
            scenario.stock_initial_total,
            scenario.available_total,
            scenario.reserved_total,
            scenario.taken_by_successes_total,
            if scenario.audit.ok {
                "clean"
            } else {
                "NOT CLEAN"
            },
            scenario.audit.differences_total
        ));
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(held: Option<bool>) -> GateItem {
        GateItem {
            name: "item".into(),
            held,
            detail: String::new(),
            seconds: 0.0,
        }
    }

    #[test]
    fn the_gate_passes_only_when_every_item_ran_and_held() {
        assert_eq!(
            Verdict::of(&[item(Some(true)), item(Some(true))]),
            Verdict::Pass
        );
        assert_eq!(
            Verdict::of(&[item(Some(true)), item(None)]),
            Verdict::Incomplete
        );
        assert_eq!(Verdict::of(&[item(None), item(Some(false))]), Verdict::Fail);
    }
}

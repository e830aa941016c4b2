//! Release evidence (seed 002 十三.3): what ran where, how, with which results, and
//! whether the books balanced afterwards — as a Markdown page.

use serde::Serialize;

use crate::report::{Class, Report};

/// The machine and build a run happened on.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub database: String,
    pub stockd_version: &'static str,
    pub build_profile: &'static str,
    pub cores: usize,
    pub memory: String,
    pub cpu: String,
    pub operating_system: String,
}

fn first_line_with(path: &str, prefix: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find(|line| line.starts_with(prefix))
        .and_then(|line| line.split_once(':'))
        .map(|(_, value)| value.trim().to_owned())
}

impl Environment {
    pub fn read(database: String) -> Environment {
        Environment {
            database,
            stockd_version: env!("CARGO_PKG_VERSION"),
            build_profile: if cfg!(debug_assertions) {
                "debug (figures are not comparable)"
            } else {
                "release"
            },
            cores: std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(0),
            memory: first_line_with("/proc/meminfo", "MemTotal")
                .unwrap_or_else(|| "unknown".into()),
            cpu: first_line_with("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown".into()),
            operating_system: std::fs::read_to_string("/proc/version")
                .map(|text| {
                    text.split_whitespace()
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_else(|_| std::env::consts::OS.to_owned()),
        }
    }
}

/// The evidence page for one run.
pub fn render(report: &Report, environment: &Environment, command: &str) -> String {
    let mut page = String::new();
    let mut line = |text: &str| {
        page.push_str(text);
        page.push('\n');
    };
    line(&format!(
        "# Release evidence: scenario `{}`",
        report.scenario
    ));
    line("");
    line(&format!(
        "Result: **{}**",
        if report.passed() { "PASS" } else { "FAIL" }
    ));
    line("");
    line("## Environment");
    line("");
    line("| item | value |");
    line("| --- | --- |");
    line(&format!(
        "| database and version | {} |",
        environment.database
    ));
    line(&format!(
        "| stockd | {} ({} build) |",
        environment.stockd_version, environment.build_profile
    ));
    line(&format!(
        "| machine | {} cores, {} memory, {} |",
        environment.cores, environment.memory, environment.cpu
    ));
    line(&format!(
        "| operating system | {} |",
        environment.operating_system
    ));
    line(&format!(
        "| target | {} ({}) |",
        report.target, report.backend
    ));
    line("");
    line("## Concurrency model");
    line("");
    line(&format!(
        "{} clients, each one keep-alive HTTP/1.1 connection sending its next request as soon as the \
         previous one is answered (closed loop). Every reservation carries its own Idempotency-Key; \
         duplicates reuse an earlier key with the same body.",
        report.clients
    ));
    line("");
    line(&format!("Command: `{command}`"));
    line("");
    line("## Results");
    line("");
    line("| measure | value |");
    line("| --- | --- |");
    line(&format!("| requests sent | {} |", report.requests_sent));
    line(&format!("| elapsed | {:.2} s |", report.elapsed_seconds));
    line(&format!(
        "| throughput | {:.0} requests/s, {:.0} successes/s |",
        report.requests_per_second, report.successes_per_second
    ));
    line(&format!(
        "| latency p50 / p95 / p99 / max | {:.2} / {:.2} / {:.2} / {:.2} ms |",
        report.latency.p50_milliseconds,
        report.latency.p95_milliseconds,
        report.latency.p99_milliseconds,
        report.latency.max_milliseconds
    ));
    if let Some(batches) = &report.batches {
        line(&format!("| combiner batches | {} |", batches.render()));
    }
    line("");
    line("## Failure classification");
    line("");
    line("| class | count |");
    line("| --- | --- |");
    for class in Class::ALL {
        line(&format!("| {} | {} |", class.name(), report.count(class)));
    }
    line("");
    line("## Final reconciliation");
    line("");
    line(&format!(
        "Stock received {}, available {}, reserved {} over {} SKUs; units taken by the successes the clients saw: {}.",
        report.stock_initial_total,
        report.available_total,
        report.reserved_total,
        report.skus_checked,
        report.taken_by_successes_total
    ));
    line(&format!(
        "Three-way audit (ledger, counters, reservations): {} ({} differences).",
        if report.audit.ok {
            "clean"
        } else {
            "NOT CLEAN"
        },
        report.audit.differences_total
    ));
    line("");
    if report.violations.is_empty() {
        line("No oversell, no duplicate effect, every failure explained.");
    } else {
        line("Violations:");
        line("");
        for violation in &report.violations {
            line(&format!("- {violation}"));
        }
    }
    page
}

/// The command line as typed, with every secret taken out: the values of
/// `--admin-token` and the passwords of URLs. Evidence pages get published.
pub fn redacted_command(arguments: &[String]) -> String {
    let mut redacted = Vec::with_capacity(arguments.len());
    let mut hide_next = false;
    for argument in arguments {
        if hide_next {
            redacted.push("<redacted>".to_owned());
            hide_next = false;
        } else if argument == "--admin-token" {
            redacted.push(argument.clone());
            hide_next = true;
        } else if let Some((flag, _)) = argument.split_once('=')
            && flag == "--admin-token"
        {
            redacted.push(format!("{flag}=<redacted>"));
        } else {
            redacted.push(domain::redact_urls_in(argument));
        }
    }
    redacted.join(" ")
}

#[cfg(test)]
mod redaction_tests {
    use super::*;

    #[test]
    fn the_command_line_in_evidence_holds_no_token_and_no_password() {
        let typed: Vec<String> = [
            "stockd",
            "bench",
            "hot",
            "--admin-token",
            "s3cret-token",
            "--url=http://127.0.0.1:8080",
            "--admin-token=other-secret",
            "--database-url",
            "postgres://stockd:hunter2@db.internal/shop",
        ]
        .iter()
        .map(|part| (*part).to_owned())
        .collect();
        let shown = redacted_command(&typed);
        for secret in ["s3cret-token", "other-secret", "hunter2"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("postgres://stockd:<redacted>@db.internal/shop"));
        assert!(shown.contains("bench hot"));
    }
}

//! stockd's load lab: the seeds' acceptance scenarios as commands, reports that answer
//! the seeds' questions, release evidence, and the strategy comparison. Linked into the
//! `stockd` binary for `stockd bench` and `stockd lab`, never into the server's crates.

pub mod client;
pub mod cluster;
pub mod drill;
pub mod duplicate_drill;
pub mod evidence;
pub mod fault_drills;
pub mod gate;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod strategies;
pub mod target;

use std::path::PathBuf;

pub use report::Report;
pub use scenario::{BenchOptions, Plan, Scenario};
pub use target::Target;

/// Everything `stockd bench` was asked to do.
#[derive(Debug, Clone)]
pub struct BenchCommand {
    pub scenario: Scenario,
    pub options: BenchOptions,
    /// A running stockd; `None` starts one in this process on a fresh database.
    pub url: Option<String>,
    pub admin_token: Option<domain::Secret>,
    /// For the in-process server: `postgres://…` (a fresh schema), `mysql://…` (a fresh
    /// database), or `None` for a temporary SQLite file.
    pub database_url: Option<String>,
    /// Database connections of the in-process server.
    pub pool_size: u32,
    /// The in-process server's engine settings (batching).
    pub engine_config: engine::EngineConfig,
    pub json: Option<PathBuf>,
    pub evidence: Option<PathBuf>,
    /// The command as typed, for the evidence page.
    pub command_line: String,
}

/// Runs a scenario, prints the report, writes the JSON and evidence files asked for.
pub async fn bench(command: BenchCommand) -> Result<Report, String> {
    let target = match &command.url {
        Some(url) => {
            let token = command.admin_token.clone().ok_or(
                "--url needs the server's admin token (--admin-token or STOCKD_ADMIN_TOKEN)",
            )?;
            Target::remote(url, token).await?
        }
        None => {
            let server = command
                .database_url
                .as_deref()
                .filter(|url| url.starts_with("postgres") || url.starts_with("mysql://"));
            Target::in_process(server, command.pool_size, command.engine_config.clone()).await?
        }
    };
    let database = target.database_version.clone().unwrap_or_else(|| {
        format!(
            "the stockd at {} (its own database)",
            command.url.as_deref().unwrap_or("?")
        )
    });
    let run_id = format!("{:08x}", rand::random::<u32>());
    let outcome = async {
        let plan = Plan::new(command.scenario, &command.options, &run_id)?;
        runner::run(plan, &target).await
    }
    .await;
    target.stop().await;
    let report = outcome?;
    println!("{}", report.render_text());
    if let Some(path) = &command.json {
        let json = serde_json::to_string_pretty(&report).map_err(|error| error.to_string())?;
        std::fs::write(path, json)
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    if let Some(path) = &command.evidence {
        let environment = evidence::Environment::read(database);
        let page = evidence::render(&report, &environment, &command.command_line);
        std::fs::write(path, page)
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    }
    Ok(report)
}

//! The local cluster (`deploy/local-cluster`) as the drills see it: its ports, who
//! leads, and the two faults they inject (a leader's PostgreSQL killed, a replica's
//! replay paused). The shell scripts own starting and stopping it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sqlx::Connection;

/// The contract's ports (`deploy/local-cluster/cluster.sh` sets the same).
pub const WRITE_PORT: u16 = 15432;
pub const READ_PORT: u16 = 15433;
/// PostgreSQL of node1, node2, node3 listen on this plus 1, 2, 3.
const NODE_PORT_BASE: u16 = 15500;
pub const NODES: [&str; 3] = ["node1", "node2", "node3"];
/// Longest wait for `up`, and for a new leader after a fault.
pub const UP_TIMEOUT: Duration = Duration::from_secs(180);
pub const LEADER_TIMEOUT: Duration = Duration::from_secs(60);

pub fn write_url() -> String {
    format!("postgres://postgres@127.0.0.1:{WRITE_PORT}/postgres")
}

pub fn read_url() -> String {
    format!("postgres://postgres@127.0.0.1:{READ_PORT}/postgres")
}

pub fn node_url(node: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{}/postgres", node_port(node))
}

/// The port of `node`'s PostgreSQL (never through HAProxy).
pub fn node_port(node: &str) -> u16 {
    let index = NODES.iter().position(|name| *name == node).unwrap_or(0);
    NODE_PORT_BASE + 1 + index as u16
}

/// The cluster's scripts and its data directory.
#[derive(Debug, Clone)]
pub struct LocalCluster {
    scripts: PathBuf,
    data: PathBuf,
}

/// What a node said when asked who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRole {
    Primary,
    Replica,
    Down,
}

impl LocalCluster {
    /// Finds `deploy/local-cluster` from `STOCKD_LOCAL_CLUSTER` or the current directory
    /// and its parents (a test runs in its crate's directory).
    pub fn locate() -> Result<LocalCluster, String> {
        let scripts = match std::env::var_os("STOCKD_LOCAL_CLUSTER") {
            Some(path) => PathBuf::from(path),
            None => {
                let start = std::env::current_dir().map_err(|error| error.to_string())?;
                start
                    .ancestors()
                    .map(|directory| directory.join("deploy/local-cluster"))
                    .find(|candidate| candidate.join("up").is_file())
                    .ok_or("no deploy/local-cluster here or above: run from the repository, or set STOCKD_LOCAL_CLUSTER")?
            }
        };
        let data = std::env::var_os("STOCKD_CLUSTER_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("stockd-local-cluster"));
        Ok(LocalCluster { scripts, data })
    }

    fn script(&self, name: &str) -> PathBuf {
        self.scripts.join(name)
    }

    /// Whether `status` reports a leader and two replicas behind both ports.
    pub fn is_up(&self) -> bool {
        std::process::Command::new(self.script("status"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// Starts the cluster unless it is up (`up` is idempotent).
    pub async fn ensure_up(&self) -> Result<(), String> {
        if self.is_up() {
            return Ok(());
        }
        let script = self.script("up");
        let output = tokio::task::spawn_blocking(move || {
            std::process::Command::new(&script)
                .stdout(std::process::Stdio::null())
                .output()
        })
        .await
        .map_err(|error| error.to_string())?
        .map_err(|error| format!("cannot run deploy/local-cluster/up: {error}"))?;
        if !output.status.success() {
            return Err(format!(
                "deploy/local-cluster/up failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(())
    }

    /// Waits until the cluster is whole again (a leader, two streaming replicas).
    pub async fn wait_until_whole(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        while !self.is_up() {
            if Instant::now() > deadline {
                return Err(format!(
                    "the cluster was not whole again within {} s",
                    timeout.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }

    /// Every node's role, asked of its PostgreSQL directly.
    pub async fn roles(&self) -> Vec<(&'static str, NodeRole)> {
        let mut roles = Vec::with_capacity(NODES.len());
        for node in NODES {
            roles.push((node, node_role(node).await));
        }
        roles
    }

    /// What `node` says it is now.
    pub async fn role(&self, node: &str) -> NodeRole {
        node_role(node).await
    }

    pub async fn leader(&self) -> Option<&'static str> {
        self.first_with_role(NodeRole::Primary).await
    }

    /// A node that is a replica now.
    pub async fn replica(&self) -> Option<&'static str> {
        self.first_with_role(NodeRole::Replica).await
    }

    async fn first_with_role(&self, wanted: NodeRole) -> Option<&'static str> {
        self.roles()
            .await
            .into_iter()
            .find(|(_, role)| *role == wanted)
            .map(|(node, _)| node)
    }

    /// Waits for a leader other than `old`; answers it and when it was seen.
    pub async fn wait_for_new_leader(
        &self,
        old: &str,
        timeout: Duration,
    ) -> Result<(&'static str, Instant), String> {
        let deadline = Instant::now() + timeout;
        loop {
            for (node, role) in self.roles().await {
                if node != old && role == NodeRole::Primary {
                    return Ok((node, Instant::now()));
                }
            }
            if Instant::now() > deadline {
                return Err(format!("no new leader within {} s", timeout.as_secs()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Pauses or resumes Patroni's management of the cluster (`patronictl pause|resume
    /// --wait`). Patroni resumes a replica's paused replay on its own (PostgreSQL 14+)
    /// unless management is paused, so the replica-lag drill pauses it meanwhile.
    pub async fn set_management_paused(&self, paused: bool) -> Result<(), String> {
        let config = self.data.join("node1.yml");
        let verb = if paused { "pause" } else { "resume" };
        let output = tokio::task::spawn_blocking(move || {
            std::process::Command::new("patronictl")
                .arg("-c")
                .arg(&config)
                .args([verb, "--wait"])
                .output()
        })
        .await
        .map_err(|error| error.to_string())?
        .map_err(|error| format!("cannot run patronictl: {error}"))?;
        if !output.status.success() {
            return Err(format!(
                "patronictl {verb} failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(())
    }

    /// SIGKILL to `node`'s postmaster (its pid from the data directory's
    /// `postmaster.pid`), as a crash would.
    pub fn kill_postgres(&self, node: &str) -> Result<u32, String> {
        let pid_file = self.data.join(node).join("data/postmaster.pid");
        let pid = read_pid(&pid_file)?;
        let status = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .map_err(|error| format!("cannot run kill: {error}"))?;
        if !status.success() {
            return Err(format!("kill -KILL {pid} failed"));
        }
        Ok(pid)
    }
}

fn read_pid(path: &Path) -> Result<u32, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    text.lines()
        .next()
        .and_then(|line| line.trim().parse().ok())
        .ok_or_else(|| format!("{} holds no pid", path.display()))
}

/// A short-lived connection to one node (never through HAProxy).
pub async fn connect_node(node: &str) -> Result<sqlx::PgConnection, String> {
    let connect = sqlx::PgConnection::connect(&node_url(node));
    match tokio::time::timeout(Duration::from_secs(2), connect).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) => Err(format!("{node}: {error}")),
        Err(_) => Err(format!("{node}: no answer within 2 s")),
    }
}

async fn node_role(node: &str) -> NodeRole {
    let Ok(mut connection) = connect_node(node).await else {
        return NodeRole::Down;
    };
    let in_recovery: Result<bool, sqlx::Error> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut connection)
        .await;
    let _ = connection.close().await;
    match in_recovery {
        Ok(true) => NodeRole::Replica,
        Ok(false) => NodeRole::Primary,
        Err(_) => NodeRole::Down,
    }
}

/// How many sessions of `application_name` a node has open.
pub async fn sessions_named(node: &str, application_name: &str) -> Result<i64, String> {
    let mut connection = connect_node(node).await?;
    let count =
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(application_name)
            .fetch_one(&mut connection)
            .await
            .map_err(|error| format!("{node}: {error}"));
    let _ = connection.close().await;
    count
}

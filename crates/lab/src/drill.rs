//! Drills as commands (seed 002 §十.2, 十.4): each injects one real fault into a real
//! deployment, checks what must hold, prints a verdict and reports figures. `failover`
//! and `replica-lag` run against `deploy/local-cluster`, starting it when it is down.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::Method;
use serde::Serialize;
use serde_json::json;

use crate::client::{HttpConnection, WireReply, WireRequest, authorization};
use crate::cluster::{self, LEADER_TIMEOUT, LocalCluster, NodeRole, UP_TIMEOUT};
use crate::target::{InProcessOptions, Target};

/// One thing a drill checks, and whether it held.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub held: bool,
    pub detail: String,
}

/// A drill's verdict and figures, as printed and written with `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct DrillReport {
    pub drill: &'static str,
    pub held: bool,
    pub checks: Vec<Check>,
    pub figures: serde_json::Value,
}

impl DrillReport {
    pub(crate) fn new(
        drill: &'static str,
        checks: Vec<Check>,
        figures: serde_json::Value,
    ) -> DrillReport {
        DrillReport {
            drill,
            held: checks.iter().all(|check| check.held),
            checks,
            figures,
        }
    }

    /// The verdict as lines for a terminal.
    pub fn render(&self) -> String {
        let mut text = format!("drill {}\n", self.drill);
        for check in &self.checks {
            let mark = if check.held { "held  " } else { "BROKEN" };
            text.push_str(&format!("  {mark} {}: {}\n", check.name, check.detail));
        }
        text.push_str(&format!(
            "  figures: {}\n",
            serde_json::to_string(&self.figures).unwrap_or_default()
        ));
        text.push_str(if self.held {
            "verdict: HELD\n"
        } else {
            "verdict: BROKEN\n"
        });
        text
    }
}

pub(crate) fn check(name: &str, held: bool, detail: impl Into<String>) -> Check {
    Check {
        name: name.to_owned(),
        held,
        detail: detail.into(),
    }
}

/// The drills `stockd drill` knows.
pub const DRILLS: [&str; 8] = [
    "failover",
    "replica-lag",
    "duplicate-delivery",
    "lock-timeout",
    "deadlock",
    "lost-response",
    "compensation-failure",
    "drop-before-commit",
];

/// Settings of the failover drill.
#[derive(Debug, Clone)]
pub struct FailoverOptions {
    /// Clients sending reservations at once.
    pub clients: usize,
    /// Load before the leader is killed.
    pub before_kill: Duration,
    /// Load after the first acknowledged write on the new leader.
    pub after_recovery: Duration,
}

impl Default for FailoverOptions {
    fn default() -> FailoverOptions {
        FailoverOptions {
            clients: 8,
            before_kill: Duration::from_secs(3),
            after_recovery: Duration::from_secs(3),
        }
    }
}

/// Attempts to get a definite answer for a request whose first answer was lost or 503.
const RETRY_ROUNDS_MAX: u32 = 100;
const RETRY_PAUSE: Duration = Duration::from_millis(200);
const HOT_SKU: &str = "drill-hot";
/// Stock far above what a drill can reserve, so every request has a unit.
const HOT_SKU_STOCK: i64 = domain::limits::QUANTITY_MAX;

/// A stockd the drill started, and an admin connection to it.
struct Drilled {
    target: Target,
    authorization: Option<hyper::header::HeaderValue>,
}

impl Drilled {
    async fn start(options: InProcessOptions) -> Result<Drilled, String> {
        let target = Target::in_process_with(Some(&cluster::write_url()), options).await?;
        let authorization = authorization(target.admin_token.expose());
        Ok(Drilled {
            target,
            authorization,
        })
    }

    fn connection(&self) -> HttpConnection {
        HttpConnection::new(self.target.address)
    }

    async fn send(&self, request: WireRequest) -> Result<WireReply, String> {
        self.connection()
            .send(&request.authorized(self.authorization.clone()))
            .await
    }

    async fn stocked_sku(&self, sku: &str, quantity: i64) -> Result<(), String> {
        let key = format!("drill-sku-{sku}-{}", rand::random::<u64>());
        let created = self
            .send(
                WireRequest::json(
                    Method::PUT,
                    format!("/v1/skus/{sku}"),
                    &json!({"title": sku}),
                )
                .key(key.clone()),
            )
            .await?;
        if created.status >= 300 {
            return Err(format!("creating {sku}: {}", created.status));
        }
        self.receive(sku, quantity).await.map(|_| ())
    }

    /// Receives stock; answers the write's consistency token.
    async fn receive(&self, sku: &str, quantity: i64) -> Result<String, String> {
        let key = format!("drill-receive-{sku}-{}", rand::random::<u64>());
        let received = self
            .send(
                WireRequest::json(
                    Method::POST,
                    format!("/v1/skus/{sku}/stock-movements"),
                    &json!({"kind": "receive", "quantity": quantity}),
                )
                .key(key),
            )
            .await?;
        if received.status >= 300 {
            return Err(format!("receiving {sku}: {}", received.status));
        }
        received
            .consistency_token
            .ok_or_else(|| "a write answered without Stockd-Consistency-Token".to_owned())
    }

    async fn audit_is_clean(&self) -> Result<bool, String> {
        let audit = self.send(WireRequest::get("/v1/audit")).await?;
        Ok(audit.json()?["ok"] == true)
    }

    async fn metrics(&self) -> Result<String, String> {
        let reply = self.send(WireRequest::get("/metrics")).await?;
        Ok(String::from_utf8_lossy(&reply.body).into_owned())
    }

    async fn stop(self) {
        self.target.stop().await;
    }
}

/// The value of the first sample of `metric` (any labels) in a Prometheus page.
fn metric_value(page: &str, metric: &str) -> Option<f64> {
    page.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

/// What one reservation request got.
#[derive(Debug, Clone)]
enum Answer {
    Acknowledged {
        reservation: String,
    },
    /// A definite refusal (4xx other than the transient ones).
    Refused {
        status: u16,
    },
    /// 503, or no answer at all: the outcome is unknown until a retry tells.
    Unknown {
        reason: String,
    },
}

#[derive(Debug, Clone)]
struct Sent {
    key: String,
    sent_at: Instant,
    answered_at: Instant,
    answer: Answer,
}

fn answer_of(result: Result<WireReply, String>) -> Answer {
    match result {
        Ok(reply) if reply.status == 201 => match reply.json() {
            Ok(body) => Answer::Acknowledged {
                reservation: body["reservation_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            },
            Err(error) => Answer::Unknown { reason: error },
        },
        // A retry can still change these: a server error or overload, and a key whose
        // first request is still running (`request_in_progress`: retry later).
        Ok(reply)
            if reply.status >= 500
                || reply.status == 429
                || (reply.status == 409
                    && reply.code().as_deref() == Some("request_in_progress")) =>
        {
            Answer::Unknown {
                reason: format!("{} {}", reply.status, reply.code().unwrap_or_default()),
            }
        }
        Ok(reply) => Answer::Refused {
            status: reply.status,
        },
        Err(error) => Answer::Unknown { reason: error },
    }
}

fn reservation_request(key: &str) -> WireRequest {
    WireRequest::json(
        Method::POST,
        "/v1/reservations",
        &json!({"lines": [{"sku": HOT_SKU, "quantity": 1}], "ttl_seconds": 3600}),
    )
    .key(key.to_owned())
}

/// Reservations from `clients` clients until `stop`, every one recorded.
fn start_load(
    drilled: &Drilled,
    clients: usize,
    run: &str,
    stop: &Arc<AtomicBool>,
    sent: &Arc<Mutex<Vec<Sent>>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|client| {
            let mut connection = drilled.connection();
            let authorization = drilled.authorization.clone();
            let stop = stop.clone();
            let sent = sent.clone();
            let run = run.to_owned();
            tokio::spawn(async move {
                let mut number = 0_u64;
                while !stop.load(Ordering::Relaxed) {
                    number += 1;
                    let key = format!("drill-{run}-{client}-{number}");
                    let request = reservation_request(&key).authorized(authorization.clone());
                    let sent_at = Instant::now();
                    let answer = answer_of(connection.send(&request).await);
                    let unknown = matches!(answer, Answer::Unknown { .. });
                    sent.lock().unwrap_or_else(|p| p.into_inner()).push(Sent {
                        key,
                        sent_at,
                        answered_at: Instant::now(),
                        answer,
                    });
                    if unknown {
                        // A client backs off on 503 as Retry-After asks, instead of
                        // spinning against a database that is changing leaders.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            })
        })
        .collect()
}

fn acknowledged_count(sent: &Mutex<Vec<Sent>>, after: Option<Instant>) -> usize {
    sent.lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|request| after.is_none_or(|after| request.sent_at > after))
        .filter(|request| matches!(request.answer, Answer::Acknowledged { .. }))
        .count()
}

/// `stockd drill failover`: reservation load, the leader's PostgreSQL killed with
/// SIGKILL mid-load, load on through the new leader, every lost or 503 answer retried
/// with its own key, then: nothing acknowledged lost, nothing applied twice, a clean
/// audit, and seed 002 §十.4's three points.
pub async fn failover(options: FailoverOptions) -> Result<DrillReport, String> {
    let cluster = LocalCluster::locate()?;
    cluster.ensure_up().await?;
    cluster.wait_until_whole(UP_TIMEOUT).await?;
    let drilled = Drilled::start(InProcessOptions {
        pool_size: 16,
        // A request waits at most this for a connection while there is no leader: it
        // is answered 503 rather than held.
        acquire_timeout_milliseconds: 2_000,
        workers: true,
        ..InProcessOptions::default()
    })
    .await?;
    let result = failover_on(&cluster, &drilled, &options).await;
    drilled.stop().await;
    // Leave the cluster whole for whatever runs next.
    let whole = cluster.wait_until_whole(UP_TIMEOUT).await;
    let mut report = result?;
    report.checks.push(check(
        "the cluster is whole again afterwards",
        whole.is_ok(),
        whole
            .err()
            .unwrap_or_else(|| "a leader and two replicas".into()),
    ));
    report.held = report.checks.iter().all(|check| check.held);
    Ok(report)
}

/// Sets its flag when dropped: the load's clients stop however their drill ends.
struct StopOnReturn(Arc<AtomicBool>);

impl Drop for StopOnReturn {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn failover_on(
    cluster: &LocalCluster,
    drilled: &Drilled,
    options: &FailoverOptions,
) -> Result<DrillReport, String> {
    drilled.stocked_sku(HOT_SKU, HOT_SKU_STOCK).await?;
    let old_leader = cluster.leader().await.ok_or("the cluster has no leader")?;
    let run = format!("{:08x}", rand::random::<u32>());
    let stop = Arc::new(AtomicBool::new(false));
    // The load stops on every way out, a failure's `?` included: its clients would
    // otherwise go on sending while the gate runs its next items.
    let _stop_on_return = StopOnReturn(Arc::clone(&stop));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let clients = start_load(drilled, options.clients.max(1), &run, &stop, &sent);

    tokio::time::sleep(options.before_kill).await;
    let acknowledged_before_kill = acknowledged_count(&sent, None);
    let killed_pid = cluster.kill_postgres(old_leader)?;
    let killed_at = Instant::now();
    let new_leader = cluster
        .wait_for_new_leader(old_leader, LEADER_TIMEOUT)
        .await;
    // Load goes on until writes have been acknowledged on the new leader for a while.
    let deadline = Instant::now() + LEADER_TIMEOUT;
    let mut first_after: Option<Instant> = None;
    while Instant::now() < deadline {
        if first_after.is_none() && acknowledged_count(&sent, Some(killed_at)) > 0 {
            first_after = Some(Instant::now());
        }
        if first_after.is_some_and(|first| first.elapsed() >= options.after_recovery) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        let _ = client.await;
    }
    let load_seconds = started.elapsed().as_secs_f64();
    let (new_leader, new_leader_seen) = new_leader?;

    let mut sent = std::mem::take(&mut *sent.lock().unwrap_or_else(|p| p.into_inner()));
    let figures_of_load = load_figures(&sent, killed_at);
    let retried = retry_unknown(drilled, &mut sent).await;
    let verified = verify_reservations(drilled, &sent).await?;
    let workers = workers_resume(drilled).await;
    let audit_clean = drilled.audit_is_clean().await?;
    let points = seed_points(cluster, old_leader, new_leader).await;

    let requests = sent.len();
    let mut checks = vec![
        check(
            "no acknowledged reservation was lost",
            verified.lost == 0,
            format!(
                "{} acknowledged during the load, {} missing afterwards",
                figures_of_load.acknowledged, verified.lost
            ),
        ),
        check(
            "no key was applied twice",
            verified.duplicated == 0,
            format!(
                "{} reservation rows for {} keys answered 201 ({} keys with two effects)",
                verified.rows, verified.distinct_acknowledged, verified.duplicated
            ),
        ),
        check(
            "every lost or 503 answer got a definite answer on retry",
            retried.still_unknown == 0,
            format!(
                "{} retried with their own key: {} now acknowledged, {} refused, {} still unknown",
                retried.retried, retried.acknowledged, retried.refused, retried.still_unknown
            ),
        ),
        check(
            "the audit is clean",
            audit_clean,
            "ledger = counters = reservations",
        ),
        check(
            "writes were acknowledged before the kill and after it",
            acknowledged_before_kill > 0 && figures_of_load.acknowledged_after_kill > 0,
            format!(
                "{acknowledged_before_kill} before, {} after",
                figures_of_load.acknowledged_after_kill
            ),
        ),
    ];
    checks.push(workers);
    let internal_errors: usize = figures_of_load
        .reasons
        .iter()
        .filter(|(reason, _)| reason.starts_with('5') && !reason.starts_with("503"))
        .map(|(_, count)| count)
        .sum();
    checks.push(check(
        "every failure during the switch was answered 503, never another 5xx",
        internal_errors == 0,
        format!("{internal_errors} answers were a 5xx other than 503"),
    ));
    // The SKU holds far more than the load takes: a refusal is a wrong answer.
    let refused = sent
        .iter()
        .filter(|request| matches!(request.answer, Answer::Refused { .. }))
        .count();
    checks.push(check(
        "no reservation was refused (the stock is ample)",
        refused == 0,
        format!("{refused} refused"),
    ));
    checks.extend(points);
    let figures = json!({
        "requests": requests,
        "acknowledged": figures_of_load.acknowledged,
        "acknowledged_after_retry": verified.distinct_acknowledged,
        "answered_503_or_lost": figures_of_load.unknown,
        "lost": verified.lost,
        "duplicated": verified.duplicated,
        "unavailable_seconds": figures_of_load.unavailable_seconds,
        "new_leader_after_seconds": new_leader_seen.duration_since(killed_at).as_secs_f64(),
        "load_seconds": load_seconds,
        "clients": options.clients,
        "old_leader": old_leader,
        "killed_pid": killed_pid,
        "new_leader": new_leader,
        "unknown_reasons": figures_of_load.reasons,
    });
    Ok(DrillReport::new("failover", checks, figures))
}

struct LoadFigures {
    acknowledged: usize,
    acknowledged_after_kill: usize,
    unknown: usize,
    /// The longest stretch without an acknowledged write, from the kill on: backends
    /// of a killed postmaster may still commit for a moment (their synchronous standby
    /// still acknowledges), so the outage is the gap, not "the first write after the
    /// kill".
    unavailable_seconds: f64,
    reasons: BTreeMap<String, usize>,
}

fn load_figures(sent: &[Sent], killed_at: Instant) -> LoadFigures {
    let acknowledged = |request: &&Sent| matches!(request.answer, Answer::Acknowledged { .. });
    let mut answered: Vec<Instant> = sent
        .iter()
        .filter(acknowledged)
        .map(|request| request.answered_at)
        .collect();
    answered.sort();
    let longest_gap = answered
        .windows(2)
        .filter(|pair| pair[1] >= killed_at)
        .map(|pair| pair[1].duration_since(pair[0]))
        .max();
    let mut reasons = BTreeMap::new();
    for request in sent {
        let reason = match &request.answer {
            Answer::Unknown { reason } => reason.chars().take(60).collect(),
            Answer::Refused { status } => format!("refused {status}"),
            Answer::Acknowledged { .. } => continue,
        };
        *reasons.entry(reason).or_insert(0) += 1;
    }
    LoadFigures {
        acknowledged: sent.iter().filter(acknowledged).count(),
        acknowledged_after_kill: sent
            .iter()
            .filter(acknowledged)
            .filter(|request| request.sent_at > killed_at)
            .count(),
        unknown: sent
            .iter()
            .filter(|request| matches!(request.answer, Answer::Unknown { .. }))
            .count(),
        unavailable_seconds: longest_gap.map_or(f64::NAN, |gap| gap.as_secs_f64()),
        reasons,
    }
}

#[derive(Debug, Default)]
struct Retried {
    retried: usize,
    acknowledged: usize,
    refused: usize,
    still_unknown: usize,
}

/// Sends every request whose answer is unknown again with its own key, until the
/// answer is definite or the rounds run out. Answers replace the unknown ones.
async fn retry_unknown(drilled: &Drilled, sent: &mut [Sent]) -> Retried {
    let mut retried = Retried::default();
    let mut connection = drilled.connection();
    for request in sent.iter_mut() {
        if !matches!(request.answer, Answer::Unknown { .. }) {
            continue;
        }
        retried.retried += 1;
        for _ in 0..RETRY_ROUNDS_MAX {
            let reply = connection
                .send(&reservation_request(&request.key).authorized(drilled.authorization.clone()))
                .await;
            request.answer = answer_of(reply);
            if !matches!(request.answer, Answer::Unknown { .. }) {
                break;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        match request.answer {
            Answer::Acknowledged { .. } => retried.acknowledged += 1,
            Answer::Refused { .. } => retried.refused += 1,
            Answer::Unknown { .. } => retried.still_unknown += 1,
        }
    }
    retried
}

struct Verified {
    lost: usize,
    duplicated: usize,
    rows: usize,
    distinct_acknowledged: usize,
}

/// Every acknowledged reservation must exist, and no key may have made two: the
/// reservations on the hot SKU are exactly the keys answered 201, one each.
async fn verify_reservations(drilled: &Drilled, sent: &[Sent]) -> Result<Verified, String> {
    let mut by_key: HashMap<&str, &str> = HashMap::new();
    let mut lost = 0;
    let mut connection = drilled.connection();
    for request in sent {
        let Answer::Acknowledged { reservation } = &request.answer else {
            continue;
        };
        by_key.insert(&request.key, reservation);
        let found = connection
            .send(
                &WireRequest::get(format!("/v1/reservations/{reservation}"))
                    .authorized(drilled.authorization.clone()),
            )
            .await?;
        if found.status != 200 || found.json()?["status"] != "RESERVED" {
            lost += 1;
        }
    }
    let sku = drilled
        .send(WireRequest::get(format!("/v1/skus/{HOT_SKU}")))
        .await?
        .json()?;
    let rows = usize::try_from(sku["reserved"].as_i64().unwrap_or(-1)).unwrap_or(usize::MAX);
    Ok(Verified {
        lost,
        duplicated: rows.saturating_sub(by_key.len()),
        rows,
        distinct_acknowledged: by_key.len(),
    })
}

/// The workers run on through the switch: a reservation made on the new leader with a
/// one-second hold is released by the expiry worker, not by anything the drill does.
async fn workers_resume(drilled: &Drilled) -> Check {
    let name = "the workers resume on the new writer";
    let key = format!("drill-expiry-{}", rand::random::<u64>());
    let request = WireRequest::json(
        Method::POST,
        "/v1/reservations",
        &json!({"lines": [{"sku": HOT_SKU, "quantity": 1}], "ttl_seconds": 1}),
    )
    .key(key);
    let reservation = match drilled.send(request).await {
        Ok(reply) if reply.status == 201 => reply
            .json()
            .ok()
            .and_then(|body| body["reservation_id"].as_str().map(str::to_owned)),
        _ => None,
    };
    let Some(reservation) = reservation else {
        return check(
            name,
            false,
            "a reservation with a one-second hold was refused",
        );
    };
    let started = Instant::now();
    while started.elapsed() < METRIC_TIMEOUT {
        let shown = drilled
            .send(WireRequest::get(format!("/v1/reservations/{reservation}")))
            .await
            .ok()
            .and_then(|reply| reply.json().ok());
        if shown.is_some_and(|body| body["status"] == "RELEASED") {
            return check(
                name,
                true,
                format!(
                    "a one-second hold was released by the expiry worker after {:.1} s",
                    started.elapsed().as_secs_f64()
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    check(
        name,
        false,
        format!(
            "a one-second hold was still held after {} s",
            METRIC_TIMEOUT.as_secs()
        ),
    )
}

/// Seed 002 §十.4: the old leader no longer takes writes, the new one does, and stockd
/// no longer talks to the old one (its writer sessions are named `stockd`).
async fn seed_points(cluster: &LocalCluster, old: &str, new: &str) -> Vec<Check> {
    // The old node comes back as a replica once Patroni has rewound it.
    let deadline = Instant::now() + LEADER_TIMEOUT;
    let mut old_role = NodeRole::Down;
    while Instant::now() < deadline {
        old_role = cluster.role(old).await;
        if old_role == NodeRole::Replica {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let new_role = cluster.role(new).await;
    let old_sessions = cluster::sessions_named(old, "stockd").await;
    let new_sessions = cluster::sessions_named(new, "stockd").await;
    vec![
        check(
            "the old leader no longer takes writes",
            old_role != NodeRole::Primary,
            format!("{old} is {old_role:?} (read-only in recovery, or down)"),
        ),
        check(
            "the new leader takes writes",
            new_role == NodeRole::Primary,
            format!("{new} is {new_role:?}"),
        ),
        check(
            "stockd no longer talks to the old leader",
            old_sessions.as_ref().is_ok_and(|count| *count == 0) || old_role == NodeRole::Down,
            format!(
                "stockd writer sessions on {old}: {}, on {new}: {}",
                describe(&old_sessions),
                describe(&new_sessions)
            ),
        ),
    ]
}

fn describe(count: &Result<i64, String>) -> String {
    match count {
        Ok(count) => count.to_string(),
        Err(error) => format!("unknown ({error})"),
    }
}

/// Settings of the replica-lag drill.
#[derive(Debug, Clone)]
pub struct ReplicaLagOptions {
    /// `STOCKD_REPLICA_LAG_SECONDS_MAX` of the drilled stockd.
    pub lag_seconds_max: f64,
    /// Display reads sent with a fresh token while replay is paused.
    pub tokened_reads: usize,
}

impl Default for ReplicaLagOptions {
    fn default() -> ReplicaLagOptions {
        ReplicaLagOptions {
            lag_seconds_max: 1.0,
            tokened_reads: 20,
        }
    }
}

/// Longest wait for a metric to move or a replica to return.
const METRIC_TIMEOUT: Duration = Duration::from_secs(30);

/// `stockd drill replica-lag`: pauses replay on one replica (`pg_wal_replay_pause()`)
/// and shows that display reads with a fresh token are served by the primary, that
/// decisions read the writer, that the lag metric and the rotation flag move, and that
/// after resuming the replica returns to the rotation.
pub async fn replica_lag(options: ReplicaLagOptions) -> Result<DrillReport, String> {
    let cluster = LocalCluster::locate()?;
    cluster.ensure_up().await?;
    cluster.wait_until_whole(UP_TIMEOUT).await?;
    let replica = cluster
        .replica()
        .await
        .ok_or("the cluster has no replica")?;
    let engine_config = engine::EngineConfig {
        replica_sample_interval_milliseconds: 200,
        ..engine::EngineConfig::default()
    };
    let drilled = Drilled::start(InProcessOptions {
        replica_urls: vec![cluster::node_url(replica)],
        replica_lag_seconds_max: Some(options.lag_seconds_max),
        engine_config,
        workers: true,
        ..InProcessOptions::default()
    })
    .await?;
    let result = match cluster.set_management_paused(true).await {
        Ok(()) => replica_lag_on(&drilled, replica, &options).await,
        Err(error) => Err(error),
    };
    // Replay and Patroni resume whatever happened: the cluster is left as it was found.
    let resumed = set_replay(replica, false)
        .await
        .and(cluster.set_management_paused(false).await);
    drilled.stop().await;
    let mut report = result?;
    report.checks.push(check(
        "replay resumed afterwards",
        resumed.is_ok(),
        resumed
            .err()
            .unwrap_or_else(|| format!("{replica} replays again, Patroni manages the cluster")),
    ));
    report.held = report.checks.iter().all(|check| check.held);
    Ok(report)
}

async fn set_replay(node: &str, paused: bool) -> Result<(), String> {
    let mut connection = cluster::connect_node(node).await?;
    let statement = if paused {
        "SELECT pg_wal_replay_pause()"
    } else {
        "SELECT pg_wal_replay_resume()"
    };
    sqlx::query(statement)
        .execute(&mut connection)
        .await
        .map_err(|error| format!("{node}: {error}"))?;
    Ok(())
}

/// Waits until `metric` satisfies `wanted`; answers its last value.
async fn wait_for_metric(
    drilled: &Drilled,
    metric: &str,
    wanted: impl Fn(f64) -> bool,
    writes_meanwhile: bool,
) -> Result<f64, f64> {
    let deadline = Instant::now() + METRIC_TIMEOUT;
    let mut last = f64::NAN;
    while Instant::now() < deadline {
        if let Ok(page) = drilled.metrics().await
            && let Some(value) = metric_value(&page, metric)
        {
            last = value;
            if wanted(value) {
                return Ok(value);
            }
        }
        if writes_meanwhile {
            // The primary moves on while the replica stands still.
            let _ = drilled.receive(HOT_SKU, 1).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

struct SkuRead {
    served_by: String,
    available: i64,
}

async fn read_sku(drilled: &Drilled, token: Option<&str>) -> Result<SkuRead, String> {
    let mut request = WireRequest::get(format!("/v1/skus/{HOT_SKU}"));
    if let Some(token) = token {
        request = request.consistency_token(token);
    }
    let reply = drilled.send(request).await?;
    if reply.status != 200 {
        return Err(format!("GET /v1/skus/{HOT_SKU}: {}", reply.status));
    }
    Ok(SkuRead {
        served_by: reply.served_by.clone().unwrap_or_default(),
        available: reply.json()?["available"].as_i64().unwrap_or(-1),
    })
}

async fn replica_lag_on(
    drilled: &Drilled,
    replica: &str,
    options: &ReplicaLagOptions,
) -> Result<DrillReport, String> {
    let mut checks = Vec::new();
    drilled.stocked_sku(HOT_SKU, 100).await?;
    let joined = wait_for_metric(drilled, "stockd_replica_in_rotation", |v| v == 1.0, false).await;
    checks.push(check(
        "the replica joins the rotation",
        joined.is_ok(),
        format!(
            "stockd_replica_in_rotation = {}",
            joined.unwrap_or_else(|v| v)
        ),
    ));

    set_replay(replica, true).await?;
    let paused_at = Instant::now();
    let token = drilled.receive(HOT_SKU, 5).await?;
    let mut served_by_primary = 0;
    let mut saw_the_write = 0;
    for _ in 0..options.tokened_reads {
        let read = read_sku(drilled, Some(&token)).await?;
        served_by_primary += usize::from(read.served_by == "primary");
        saw_the_write += usize::from(read.available >= 105);
    }
    checks.push(check(
        "display reads with a fresh token are served by the primary",
        served_by_primary == options.tokened_reads && saw_the_write == options.tokened_reads,
        format!(
            "{served_by_primary} of {} served by the primary, {saw_the_write} saw the write",
            options.tokened_reads
        ),
    ));
    let untokened = read_sku(drilled, None).await?;
    let stale_shown = untokened.served_by == "replica" && untokened.available < 105;

    // A decision that needs the write: only the writer has 105 units.
    let decided = drilled
        .send(
            WireRequest::json(
                Method::POST,
                "/v1/reservations",
                &json!({"lines": [{"sku": HOT_SKU, "quantity": 105}]}),
            )
            .key(format!("drill-lag-{}", rand::random::<u64>())),
        )
        .await?;
    let writer_sessions = cluster::sessions_named(replica, "stockd").await;
    checks.push(check(
        "no decision read goes to the lagging replica",
        decided.status == 201 && writer_sessions.as_ref().is_ok_and(|count| *count == 0),
        format!(
            "a reservation of all 105 units answered {}; stockd writer sessions on {replica}: {}",
            decided.status,
            describe(&writer_sessions)
        ),
    ));

    let lag_seconds = wait_for_metric(
        drilled,
        "stockd_replica_lag_seconds",
        |value| value > options.lag_seconds_max,
        true,
    )
    .await;
    let lag_bytes = metric_value(&drilled.metrics().await?, "stockd_replica_lag_bytes");
    let left = wait_for_metric(drilled, "stockd_replica_in_rotation", |v| v == 0.0, true).await;
    let left_after = paused_at.elapsed().as_secs_f64();
    checks.push(check(
        "the lag metric and the rotation flag move",
        lag_seconds.is_ok() && left.is_ok() && lag_bytes.is_some_and(|bytes| bytes > 0.0),
        format!(
            "lag {:.2} s (bound {} s), {} bytes; in rotation {}",
            lag_seconds.unwrap_or_else(|v| v),
            options.lag_seconds_max,
            lag_bytes.unwrap_or(f64::NAN),
            left.unwrap_or_else(|v| v)
        ),
    ));
    let out_of_rotation = read_sku(drilled, None).await?;
    checks.push(check(
        "out of the rotation, even reads without a token go to the primary",
        out_of_rotation.served_by == "primary",
        format!("served by {}", out_of_rotation.served_by),
    ));

    set_replay(replica, false).await?;
    let resumed_at = Instant::now();
    let back = wait_for_metric(drilled, "stockd_replica_in_rotation", |v| v == 1.0, false).await;
    let back_after = resumed_at.elapsed().as_secs_f64();
    let latest = drilled.receive(HOT_SKU, 1).await?;
    // The replica needs a moment to replay the latest write; until then the primary
    // answers, which is the point. A bounded number of reads, no sleep.
    let mut caught_up = None;
    for attempt in 1..=200 {
        let read = read_sku(drilled, Some(&latest)).await?;
        if read.served_by == "replica" {
            caught_up = Some(attempt);
            break;
        }
    }
    checks.push(check(
        "after resuming, the replica returns to the rotation and serves tokened reads",
        back.is_ok() && caught_up.is_some(),
        format!(
            "back in rotation after {back_after:.2} s; a read with the latest token served by the replica at attempt {}",
            caught_up.map_or("never".into(), |attempt| attempt.to_string())
        ),
    ));
    let figures = json!({
        "replica": replica,
        "lag_seconds_max": options.lag_seconds_max,
        "left_rotation_after_seconds": left_after,
        "returned_after_seconds": back_after,
        "lag_bytes_when_out": lag_bytes,
        "untokened_read_while_paused": {
            "served_by": untokened.served_by,
            "showed_stale_stock": stale_shown,
        },
    });
    Ok(DrillReport::new("replica-lag", checks, figures))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_is_read_from_a_prometheus_page_whatever_its_labels() {
        let page = "# TYPE stockd_replica_in_rotation gauge\n\
                    stockd_replica_in_rotation{replica=\"postgres://x\"} 1\n\
                    stockd_replica_lag_seconds{replica=\"postgres://x\"} 0.25\n\
                    stockd_replica_lag_seconds_peak{replica=\"postgres://x\"} 3\n";
        assert_eq!(metric_value(page, "stockd_replica_in_rotation"), Some(1.0));
        assert_eq!(metric_value(page, "stockd_replica_lag_seconds"), Some(0.25));
        assert_eq!(metric_value(page, "stockd_replica_lag_bytes"), None);
    }

    #[test]
    fn a_report_holds_only_when_every_check_held() {
        let held = DrillReport::new(
            "x",
            vec![check("a", true, ""), check("b", true, "")],
            json!({}),
        );
        assert!(held.held);
        assert!(held.render().contains("verdict: HELD"));
        let broken = DrillReport::new(
            "x",
            vec![check("a", true, ""), check("b", false, "")],
            json!({}),
        );
        assert!(!broken.held);
        assert!(broken.render().contains("BROKEN b"));
    }

    #[test]
    fn an_answer_is_unknown_only_when_a_retry_could_change_it() {
        assert!(matches!(
            answer_of(Err("connection reset".into())),
            Answer::Unknown { .. }
        ));
        let reply = |status| WireReply {
            status,
            replayed: false,
            consistency_token: None,
            served_by: None,
            body: hyper::body::Bytes::from_static(b"{\"reservation_id\":\"res_1\"}"),
        };
        assert!(matches!(answer_of(Ok(reply(503))), Answer::Unknown { .. }));
        assert!(matches!(answer_of(Ok(reply(502))), Answer::Unknown { .. }));
        let in_progress = WireReply {
            body: hyper::body::Bytes::from_static(b"{\"code\":\"request_in_progress\"}"),
            ..reply(409)
        };
        assert!(matches!(answer_of(Ok(in_progress)), Answer::Unknown { .. }));
        assert!(matches!(
            answer_of(Ok(reply(409))),
            Answer::Refused { status: 409 }
        ));
        assert!(matches!(
            answer_of(Ok(reply(201))),
            Answer::Acknowledged { reservation } if reservation == "res_1"
        ));
    }
}

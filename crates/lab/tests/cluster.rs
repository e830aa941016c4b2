//! Tests on the local cluster (`deploy/local-cluster`: three PostgreSQL nodes under
//! Patroni, HAProxy in front), which `.ci/run` starts. They inject real faults into a
//! cluster they share, so they run one at a time: a mutex here for `cargo test`, the
//! `cluster` test group in `.config/nextest.toml` for nextest. Outside CI, a machine
//! without the cluster skips them loudly; under `CI=true` that is a failure.

use std::time::Duration;

use domain::{ServedBy, SkuCode, Timestamp};
use lab::cluster::{self, LocalCluster};
use lab::drill;
use sqlx::Connection;
use store::{ReadHandle, Store, StoreConfig};
use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cluster, started when its packages are there; `None` (after a loud notice)
/// where it cannot be, which fails under `CI=true`.
async fn cluster_or_skip(test: &str) -> Option<LocalCluster> {
    let started = match LocalCluster::locate() {
        Ok(cluster) => match cluster.ensure_up().await {
            Ok(()) => Ok(cluster),
            Err(error) => Err(error),
        },
        Err(error) => Err(error),
    };
    match started {
        Ok(cluster) => Some(cluster),
        Err(error) => {
            let notice = format!(
                "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
                 !! SKIPPED: cluster test {test}: {error}\n\
                 !! Run deploy/local-cluster/up (needs patroni, etcd-server, haproxy).\n\
                 !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
            );
            if std::env::var("CI").is_ok_and(|value| value == "true") {
                panic!("{notice}CI=true: a skipped cluster test is a failure");
            }
            eprintln!("{notice}");
            None
        }
    }
}

async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().await
}

fn failed_checks(report: &drill::DrillReport) -> Vec<String> {
    report
        .checks
        .iter()
        .filter(|check| !check.held)
        .map(|check| format!("{}: {}", check.name, check.detail))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_replica_never_serves_a_read_that_carries_a_token() {
    let _turn = one_at_a_time().await;
    if cluster_or_skip("stale replica").await.is_none() {
        return;
    }
    let report = drill::replica_lag(drill::ReplicaLagOptions::default())
        .await
        .expect("the drill runs");
    assert!(
        report.held,
        "{:?}\n{}",
        failed_checks(&report),
        report.render()
    );
    let tokened = report
        .checks
        .iter()
        .find(|check| check.name.starts_with("display reads with a fresh token"))
        .expect("the tokened reads were checked");
    assert!(tokened.held, "{}", tokened.detail);
    // The replica really was behind: a read without a token showed the old stock.
    assert_eq!(
        report.figures["untokened_read_while_paused"]["showed_stale_stock"],
        true,
        "{}",
        report.render()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_mid_load_keeps_every_acknowledged_reservation() {
    let _turn = one_at_a_time().await;
    if cluster_or_skip("failover").await.is_none() {
        return;
    }
    let report = drill::failover(drill::FailoverOptions {
        clients: 4,
        before_kill: Duration::from_secs(2),
        after_recovery: Duration::from_secs(2),
    })
    .await
    .expect("the drill runs");
    assert!(
        report.held,
        "{:?}\n{}",
        failed_checks(&report),
        report.render()
    );
    assert_eq!(report.figures["lost"], 0);
    assert_eq!(report.figures["duplicated"], 0);
    assert!(
        report.figures["acknowledged"].as_u64().unwrap_or(0) > 0,
        "{}",
        report.render()
    );
    assert_ne!(report.figures["old_leader"], report.figures["new_leader"]);
}

/// A TCP relay to `target` that can be cut (every connection through it ends at once)
/// or frozen (every connection stays open and nothing more goes through: a host that
/// stopped, or a network that drops packets without resetting connections).
struct Relay {
    address: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    async fn to(target: std::net::SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (frozen, _) = tokio::sync::watch::channel(false);
        let freezes = frozen.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut freeze = freezes.subscribe();
                connections.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let frozen = tokio::select! {
                            _ = copy_bidirectional(&mut inbound, &mut outbound) => false,
                            waited = freeze.wait_for(|frozen| *frozen) => waited.is_ok(),
                        };
                        if frozen {
                            // Both ends stay open; nothing moves any more.
                            std::future::pending::<()>().await;
                        }
                    }
                });
            }
        });
        Relay {
            address,
            task,
            frozen,
        }
    }

    /// The replica disappears: the listener closes and every relayed connection drops.
    fn cut(self) {
        self.task.abort();
    }

    /// The replica stops answering: connections stay open, nothing comes back.
    fn freeze(&self) {
        self.frozen.send_replace(true);
    }
}

/// A store on a scratch schema of the cluster whose one replica is reached through
/// `relay`, once that replica has served a display read; and the writer connection
/// that drops the schema at the end ([`drop_scratch_schema`]).
async fn store_reading_a_replica_through(
    relay: &Relay,
    code: &SkuCode,
    now: Timestamp,
) -> (Store, String, sqlx::PgConnection) {
    // A scratch schema on the writer; the replica sees it once replayed.
    let schema = format!("stockd_cluster_{:08x}", rand::random::<u32>());
    let mut admin = sqlx::PgConnection::connect(&cluster::write_url())
        .await
        .expect("the write port answers");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut admin)
        .await
        .expect("a schema");
    let mut config = StoreConfig::new(cluster::write_url());
    config.postgres_schema = Some(schema.clone());
    config.replicas.urls = vec![format!("postgres://postgres@{}/postgres", relay.address)];
    let store = Store::connect(&config).await.expect("the store connects");
    store.migrate().await.expect("migrations");

    // Into the rotation: three good samples in a row (each one a round trip).
    let mut in_rotation = false;
    for _ in 0..100 {
        in_rotation = store.sample_replicas().await[0].in_rotation;
        if in_rotation {
            break;
        }
    }
    assert!(in_rotation, "the replica joined the rotation");
    // Served by the replica while it is there (once the schema has replayed there;
    // until then the read fails there and is served by the primary: keep asking).
    // Under a loaded suite the replay can take seconds, so the bound is time, not a
    // count of tries; it only keeps a replica that never serves from hanging the run.
    let replayed_within = Duration::from_secs(60);
    let served_by_replica = tokio::time::timeout(replayed_within, async {
        loop {
            let shown = store
                .display_sku(&ReadHandle::display(None), code, now)
                .await
                .expect("a display read");
            if shown.served_by == ServedBy::Replica {
                break;
            }
            store.sample_replicas().await;
        }
    })
    .await
    .is_ok();
    assert!(served_by_replica, "the replica served a display read");
    (store, schema, admin)
}

async fn drop_scratch_schema(store: Store, schema: &str, mut admin: sqlx::PgConnection) {
    store.close().await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&mut admin)
    .await;
}

async fn a_replica_behind_a_relay() -> Option<Relay> {
    let cluster = cluster_or_skip("replica behind a relay").await?;
    cluster
        .wait_until_whole(cluster::UP_TIMEOUT)
        .await
        .expect("a whole cluster");
    let replica = cluster.replica().await.expect("a replica");
    let replica_port = cluster::node_port(replica);
    Some(Relay::to(([127, 0, 0, 1], replica_port).into()).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_disappears_leaves_reads_working() {
    let _turn = one_at_a_time().await;
    let Some(relay) = a_replica_behind_a_relay().await else {
        return;
    };
    let code = SkuCode::parse("TV-1").expect("a code");
    let now = Timestamp::from_unix_milliseconds(1_800_000_000_000);
    let (store, schema, admin) = store_reading_a_replica_through(&relay, &code, now).await;

    relay.cut();
    for _ in 0..5 {
        let shown = store
            .display_sku(&ReadHandle::display(None), &code, now)
            .await
            .expect("reads keep working without the replica");
        assert_eq!(shown.served_by, ServedBy::Primary);
        assert_eq!(shown.value, None, "the writer's answer: no such SKU yet");
    }
    let health = store.sample_replicas().await;
    assert!(!health[0].in_rotation, "{health:?}");
    assert_eq!(
        health[0].lag_seconds, None,
        "an unreachable replica has no lag"
    );
    store
        .ping()
        .await
        .expect("the writer's health does not depend on the replica");
    drop_scratch_schema(store, &schema, admin).await;
}

/// Without a bound of its own, a call on a replica that stopped answering waits for as
/// long as the replica stays silent; this guard only keeps such a regression from
/// holding the run.
const SILENT_REPLICA_GUARD: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_does_not_wait_on_a_replica_that_stopped_answering() {
    let _turn = one_at_a_time().await;
    let Some(relay) = a_replica_behind_a_relay().await else {
        return;
    };
    let code = SkuCode::parse("TV-1").expect("a code");
    let now = Timestamp::from_unix_milliseconds(1_800_000_000_000);
    let (store, schema, admin) = store_reading_a_replica_through(&relay, &code, now).await;

    relay.freeze();
    // The replica is still in the rotation: this read picks it, gets no answer, and
    // goes to the primary, taking the replica out of the rotation.
    let shown = tokio::time::timeout(
        SILENT_REPLICA_GUARD,
        store.display_sku(&ReadHandle::display(None), &code, now),
    )
    .await
    .expect("a read does not wait on a replica that stopped answering")
    .expect("a display read");
    assert_eq!(shown.served_by, ServedBy::Primary);
    assert_eq!(shown.value, None, "the writer's answer: no such SKU yet");
    let health = tokio::time::timeout(SILENT_REPLICA_GUARD, store.sample_replicas())
        .await
        .expect("the monitor's sample ends");
    assert!(!health[0].in_rotation, "{health:?}");
    // Ends the frozen connections, so closing the replica's pool has nothing to wait on.
    relay.cut();
    drop_scratch_schema(store, &schema, admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_takes_a_replica_that_stopped_answering_out_of_the_rotation() {
    let _turn = one_at_a_time().await;
    let Some(relay) = a_replica_behind_a_relay().await else {
        return;
    };
    let code = SkuCode::parse("TV-1").expect("a code");
    let now = Timestamp::from_unix_milliseconds(1_800_000_000_000);
    let (store, schema, admin) = store_reading_a_replica_through(&relay, &code, now).await;

    relay.freeze();
    // The sample's query goes out on a connection the pool holds open, and no answer
    // comes back.
    let health = tokio::time::timeout(SILENT_REPLICA_GUARD, store.sample_replicas())
        .await
        .expect("the monitor's sample does not wait on a replica that stopped answering");
    assert!(!health[0].in_rotation, "{health:?}");
    assert_eq!(health[0].lag_seconds, None, "a silent replica has no lag");
    let shown = tokio::time::timeout(
        SILENT_REPLICA_GUARD,
        store.display_sku(&ReadHandle::display(None), &code, now),
    )
    .await
    .expect("reads keep working")
    .expect("a display read");
    assert_eq!(shown.served_by, ServedBy::Primary);
    store
        .ping()
        .await
        .expect("the writer's health does not depend on the replica");
    relay.cut();
    drop_scratch_schema(store, &schema, admin).await;
}

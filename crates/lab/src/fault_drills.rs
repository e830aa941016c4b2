//! The fault drills of seed 002 §十 that need no cluster: `lock-timeout`, `deadlock`
//! and `lost-response`. Each starts stockd in this process on a scratch database (a
//! temporary SQLite file, a new schema on the PostgreSQL server named by
//! `--database-url`, or a new database on the MySQL server named there), injects its
//! fault with a connection of its own or a TCP proxy it controls, and checks what must
//! hold. Nothing is mocked: the server, the database and the sockets are real.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::client::{HttpConnection, WireReply, WireRequest, authorization};
use crate::drill::{Check, DrillReport, check};
use crate::target::{InProcessOptions, RawDatabase, Target};

/// Longest wait for anything a drill waits on.
const WAIT: Duration = Duration::from_secs(30);

/// Settings of the fault drills.
#[derive(Debug, Clone, Default)]
pub struct FaultDrillOptions {
    /// `postgres://…` or `mysql://…` for a scratch schema or database there; unset:
    /// a temporary SQLite file (the deadlock drill needs a server with row locks).
    pub database_url: Option<String>,
}

/// A stockd started for one drill.
struct Drilled {
    target: Target,
    client: DrillClient,
}

impl std::ops::Deref for Drilled {
    type Target = DrillClient;
    fn deref(&self) -> &DrillClient {
        &self.client
    }
}

/// How a drill talks to its stockd: as the admin, one connection per request.
pub(crate) struct DrillClient {
    pub(crate) address: SocketAddr,
    pub(crate) authorization: Option<hyper::header::HeaderValue>,
}

impl Drilled {
    async fn start(
        options: &FaultDrillOptions,
        lock_timeout_milliseconds: u64,
    ) -> Result<Drilled, String> {
        let target = Target::in_process_with(
            options.database_url.as_deref(),
            InProcessOptions {
                pool_size: 8,
                lock_timeout_milliseconds,
                ..InProcessOptions::default()
            },
        )
        .await?;
        let client = DrillClient {
            address: target.address,
            authorization: authorization(target.admin_token.expose()),
        };
        Ok(Drilled { target, client })
    }

    async fn stop(self) {
        self.target.stop().await;
    }
}

impl DrillClient {
    pub(crate) async fn send(&self, request: WireRequest) -> Result<WireReply, String> {
        self.send_to(self.address, request).await
    }

    async fn send_to(
        &self,
        address: SocketAddr,
        request: WireRequest,
    ) -> Result<WireReply, String> {
        HttpConnection::new(address)
            .send(&request.authorized(self.authorization.clone()))
            .await
    }

    pub(crate) async fn stock(&self, sku: &str, quantity: i64) -> Result<(), String> {
        let created = self
            .send(
                WireRequest::json(
                    Method::PUT,
                    format!("/v1/skus/{sku}"),
                    &json!({"title": "Drill SKU", "price": 100, "currency": "CNY"}),
                )
                .key(format!("drill-sku-{sku}")),
            )
            .await?;
        let received = self
            .send(
                WireRequest::json(
                    Method::POST,
                    format!("/v1/skus/{sku}/stock-movements"),
                    &json!({"kind": "receive", "quantity": quantity}),
                )
                .key(format!("drill-receive-{sku}")),
            )
            .await?;
        if created.status >= 300 || received.status >= 300 {
            return Err(format!(
                "stocking {sku}: {} / {}",
                created.status, received.status
            ));
        }
        Ok(())
    }

    /// (available, reserved) of a SKU.
    pub(crate) async fn counters(&self, sku: &str) -> Result<(i64, i64), String> {
        let found = self
            .send(WireRequest::get(format!("/v1/skus/{sku}")))
            .await?
            .json()?;
        Ok((
            found["available"].as_i64().unwrap_or(-1),
            found["reserved"].as_i64().unwrap_or(-1),
        ))
    }

    /// The sum of a metric's samples whose name and labels start with `prefix`.
    pub(crate) async fn metric(&self, prefix: &str) -> Result<f64, String> {
        let page = self.send(WireRequest::get("/metrics")).await?;
        Ok(String::from_utf8_lossy(&page.body)
            .lines()
            .filter(|line| line.starts_with(prefix))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum())
    }

    async fn audit_check(&self) -> Result<Check, String> {
        let audit = self.send(WireRequest::get("/v1/audit")).await?.json()?;
        Ok(check(
            "the audit is clean",
            audit["ok"] == true,
            format!(
                "{} differences",
                audit["differences"].as_array().map_or(0, Vec::len)
            ),
        ))
    }
}

fn reservation(sku: &str, quantity: i64, key: &str) -> WireRequest {
    WireRequest::json(
        Method::POST,
        "/v1/reservations",
        &json!({"lines": [{"sku": sku, "quantity": quantity}]}),
    )
    .key(key)
}

/// An order of a shopper of its own (one shopper's open holds are bounded).
fn order(lines: &[(&str, i64)], key: &str) -> WireRequest {
    let lines: Vec<_> = lines
        .iter()
        .map(|(sku, quantity)| json!({"sku": sku, "quantity": quantity}))
        .collect();
    WireRequest::json(
        Method::POST,
        "/v1/orders",
        &json!({"user_id": unique("drill-shopper"), "lines": lines}),
    )
    .key(key)
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// Takes a stock row's lock the way another program would, in an open transaction.
async fn hold_stock_row(raw: &mut RawDatabase, sku: &str) -> Result<(), String> {
    if raw.backend() == "sqlite" {
        // SQLite's one lock is the database's write lock.
        return raw.execute("BEGIN IMMEDIATE").await.map(drop);
    }
    raw.execute("BEGIN").await?;
    raw.execute(&format!(
        "SELECT available FROM stock WHERE sku = '{sku}' AND warehouse = 'default' FOR UPDATE"
    ))
    .await
    .map(drop)
}

/// `stockd drill lock-timeout` (seed 002 §十.5): a transaction holds the stock row; a
/// reservation waiting for it answers `lock_timeout` within the bound and changes
/// nothing; after the release its retry with the same key succeeds once.
pub async fn lock_timeout(options: FaultDrillOptions) -> Result<DrillReport, String> {
    const BOUND_MILLISECONDS: u64 = 1_000;
    let drilled = Drilled::start(&options, BOUND_MILLISECONDS).await?;
    let outcome = lock_timeout_checks(&drilled, BOUND_MILLISECONDS).await;
    drilled.stop().await;
    outcome
}

async fn lock_timeout_checks(
    drilled: &Drilled,
    bound_milliseconds: u64,
) -> Result<DrillReport, String> {
    const SKU: &str = "DRILL-LOCK";
    drilled.stock(SKU, 5).await?;
    let mut holder = drilled.target.raw_database().await?;
    hold_stock_row(&mut holder, SKU).await?;
    let key = unique("drill-lock");

    let started = Instant::now();
    let waited = drilled.send(reservation(SKU, 1, &key)).await?;
    let waited_for = started.elapsed();
    let during = drilled.counters(SKU).await?;
    holder.execute("ROLLBACK").await?;
    let retried = drilled.send(reservation(SKU, 1, &key)).await?;
    let after = drilled.counters(SKU).await?;

    let bound = Duration::from_millis(bound_milliseconds);
    let mut checks = vec![
        check(
            "the waiting reservation answers lock_timeout",
            waited.status == 503 && waited.code().as_deref() == Some("lock_timeout"),
            format!("{} {}", waited.status, waited.code().unwrap_or_default()),
        ),
        // Within the bound: it waited for the lock (not refused at once) and gave up
        // at the bound, give or take the machine's scheduling. (PostgreSQL's fast path
        // waits the bound; the batch transaction that finds out which row is held then
        // waits only a tenth of a second.)
        check(
            "it waited the bound and no longer",
            waited_for >= bound.mul_f64(0.9) && waited_for <= bound + Duration::from_secs(5),
            format!(
                "{} ms for a bound of {bound_milliseconds} ms",
                waited_for.as_millis()
            ),
        ),
        check(
            "the held row is untouched",
            during == (5, 0),
            format!("available {}, reserved {}", during.0, during.1),
        ),
        check(
            "after the release the retry with the same key succeeds once",
            retried.status == 201 && !retried.replayed && after == (4, 1),
            format!(
                "{} (replayed {}), available {}, reserved {}",
                retried.status, retried.replayed, after.0, after.1
            ),
        ),
    ];
    let lock_waits = drilled
        .metric("stockd_db_lock_waits_total{operation=\"reserve\"}")
        .await?;
    checks.push(check(
        "the wait is counted",
        lock_waits >= 1.0,
        format!("stockd_db_lock_waits_total{{operation=\"reserve\"}} {lock_waits}"),
    ));
    checks.push(drilled.audit_check().await?);
    Ok(DrillReport::new(
        "lock-timeout",
        checks,
        json!({
            "backend": drilled.target.backend,
            "bound_milliseconds": bound_milliseconds,
            "waited_milliseconds": waited_for.as_millis(),
        }),
    ))
}

/// `stockd drill deadlock` (seed 002 §十.6): opposing multi-SKU orders under load
/// while another program takes the same rows in the opposite order. stockd sorts its
/// own rows, so the cycles the database breaks are with that program: each broken
/// one is counted and the order retried; every order ends 201 or
/// `insufficient_stock`, none sees a deadlock.
pub async fn deadlock(options: FaultDrillOptions) -> Result<DrillReport, String> {
    if options.database_url.is_none() {
        return Err(
            "the deadlock drill needs PostgreSQL or MySQL (--database-url): SQLite has one writer and cannot deadlock"
                .into(),
        );
    }
    let drilled = Drilled::start(&options, 10_000).await?;
    let outcome = deadlock_checks(&drilled).await;
    drilled.stop().await;
    outcome
}

/// Orders the load sends, and forced cycles.
const DEADLOCK_CLIENTS: usize = 4;
const DEADLOCK_ORDERS_PER_CLIENT: usize = 10;
const DEADLOCK_FORCED_CYCLES: usize = 3;

async fn deadlock_checks(drilled: &Drilled) -> Result<DrillReport, String> {
    const FIRST: &str = "DRILL-DEAD-A";
    const SECOND: &str = "DRILL-DEAD-B";
    // Less than the load asks for: the last orders find the SKUs sold out.
    let stock = i64::try_from(
        DEADLOCK_FORCED_CYCLES + DEADLOCK_CLIENTS * DEADLOCK_ORDERS_PER_CLIENT * 3 / 4,
    )
    .unwrap_or(0);
    drilled.stock(FIRST, stock).await?;
    drilled.stock(SECOND, stock).await?;
    let mut other = drilled.target.raw_database().await?;
    prepare_the_other_program(&mut other).await?;

    // The forced cycles, one at a time: the other program holds the second row, an
    // order takes the first and waits for the second, the other program asks for
    // the first. The database breaks each cycle by rolling the order back; stockd
    // runs it again.
    let mut forced = Vec::new();
    for _ in 0..DEADLOCK_FORCED_CYCLES {
        forced.push(force_one_cycle(drilled, &mut other, FIRST, SECOND).await?);
    }

    // Then the load: orders naming the SKUs in both orders from several clients at
    // once. stockd takes rows in one order, so these never form a cycle.
    let load: Vec<_> = (0..DEADLOCK_CLIENTS)
        .map(|client| {
            let address = drilled.target.address;
            let authorization = drilled.authorization.clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut connection = HttpConnection::new(address);
                for index in 0..DEADLOCK_ORDERS_PER_CLIENT {
                    let lines: &[(&str, i64)] = if (client + index) % 2 == 0 {
                        &[(FIRST, 1), (SECOND, 1)]
                    } else {
                        &[(SECOND, 1), (FIRST, 1)]
                    };
                    let request = order(lines, &unique("drill-deadlock-load"))
                        .authorized(authorization.clone());
                    statuses.push(match connection.send(&request).await {
                        Ok(reply) => (reply.status, reply.code()),
                        Err(error) => (0, Some(error)),
                    });
                }
                statuses
            })
        })
        .collect();
    let mut answers = forced.clone();
    for client in load {
        answers.extend(client.await.map_err(|error| error.to_string())?);
    }
    let others: Vec<String> = answers
        .iter()
        .filter(|(status, code)| {
            !(*status == 201 || (*status == 409 && code.as_deref() == Some("insufficient_stock")))
        })
        .map(|(status, code)| format!("{status} {}", code.as_deref().unwrap_or("")))
        .collect();

    let surfaced = others.len();
    let placed = answers.iter().filter(|(status, _)| *status == 201).count();
    let deadlocks = drilled.metric("stockd_db_deadlocks_total").await?;
    let first = drilled.counters(FIRST).await?;
    let second = drilled.counters(SECOND).await?;
    let placed_units = i64::try_from(placed).unwrap_or(-1);
    let checks = vec![
        check(
            "every order ends placed or insufficient_stock",
            surfaced == 0,
            format!(
                "{} answers, {placed} placed, {surfaced} other {:?}",
                answers.len(),
                others.iter().take(5).collect::<Vec<_>>()
            ),
        ),
        check(
            "the forced cycles were broken by the database and retried",
            deadlocks >= DEADLOCK_FORCED_CYCLES as f64
                && forced.iter().all(|(status, _)| *status == 201),
            format!("stockd_db_deadlocks_total {deadlocks}, forced orders {forced:?}"),
        ),
        check(
            "each placed order holds one unit of each SKU",
            first.1 == placed_units && second.1 == placed_units,
            format!(
                "{FIRST} reserved {}, {SECOND} reserved {}, {placed} placed",
                first.1, second.1
            ),
        ),
        drilled.audit_check().await?,
    ];
    Ok(DrillReport::new(
        "deadlock",
        checks,
        json!({
            "backend": drilled.target.backend,
            "orders": answers.len(),
            "placed": placed,
            "deadlocks": deadlocks,
            "forced_cycles": DEADLOCK_FORCED_CYCLES,
        }),
    ))
}

/// Makes the other program the transaction the database keeps: PostgreSQL's session
/// checks for cycles much later than stockd's (which check after the default second);
/// InnoDB rolls back the lighter transaction, so the other program's writes rows of a
/// table of its own first.
async fn prepare_the_other_program(other: &mut RawDatabase) -> Result<(), String> {
    match other.backend() {
        "postgres" => other
            .execute("SET deadlock_timeout = '60s'")
            .await
            .map(drop),
        "mysql" => other
            .execute("CREATE TABLE drill_ballast (id INT PRIMARY KEY)")
            .await
            .map(drop),
        backend => Err(format!("the deadlock drill cannot run on {backend}")),
    }
}

async fn force_one_cycle(
    drilled: &Drilled,
    other: &mut RawDatabase,
    first: &str,
    second: &str,
) -> Result<(u16, Option<String>), String> {
    other.execute("BEGIN").await?;
    if other.backend() == "mysql" {
        other.execute("DELETE FROM drill_ballast").await?;
        let rows: Vec<String> = (1..=200).map(|id| format!("({id})")).collect();
        other
            .execute(&format!(
                "INSERT INTO drill_ballast (id) VALUES {}",
                rows.join(",")
            ))
            .await?;
    }
    other
        .execute(&format!(
            "UPDATE stock SET available = available WHERE sku = '{second}'"
        ))
        .await?;
    let placed = {
        let address = drilled.target.address;
        let request = order(&[(first, 1), (second, 1)], &unique("drill-deadlock-forced"))
            .authorized(drilled.authorization.clone());
        tokio::spawn(async move { HttpConnection::new(address).send(&request).await })
    };
    if let Err(error) = wait_until_someone_waits(drilled).await {
        let _ = other.execute("ROLLBACK").await;
        let reply = placed.await.map_err(|error| error.to_string())?;
        return Err(format!("{error}: the order answered {reply:?}"));
    }
    let closing = other
        .execute(&format!(
            "UPDATE stock SET available = available WHERE sku = '{first}'"
        ))
        .await;
    let _ = other.execute("ROLLBACK").await;
    closing.map_err(|error| format!("the database rolled the other program back: {error}"))?;
    let reply = placed.await.map_err(|error| error.to_string())??;
    Ok((reply.status, reply.code()))
}

/// Waits until a session waits for a lock (the forced order behind the other
/// program's row).
async fn wait_until_someone_waits(drilled: &Drilled) -> Result<(), String> {
    let mut observer = drilled.target.raw_database().await?;
    let query = match observer.backend() {
        "postgres" => {
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' LIMIT 1"
        }
        // InnoDB's lock tables were seen to miss such waits; the session list does
        // not: a statement of this database running for a while (nothing else runs
        // during a forced cycle).
        _ => {
            "SELECT 1 FROM information_schema.PROCESSLIST WHERE DB = DATABASE() \
              AND ID <> CONNECTION_ID() AND COMMAND IN ('Query', 'Execute') AND TIME_MS > 50 LIMIT 1"
        }
    };
    let deadline = Instant::now() + WAIT;
    loop {
        // A statement answering one row: someone waits.
        if observer.fetch_exists(query).await? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the forced order never waited for the held row".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `stockd drill lost-response` (seed 002 §十.2): a TCP proxy between the client and
/// stockd drops the answer to a reservation after the server committed it; the client
/// sends the request again with the same key and gets the first answer, and the
/// reservation took stock once.
pub async fn lost_response(options: FaultDrillOptions) -> Result<DrillReport, String> {
    let drilled = Drilled::start(&options, 2_000).await?;
    let outcome = lost_response_checks(&drilled).await;
    drilled.stop().await;
    outcome
}

async fn lost_response_checks(drilled: &Drilled) -> Result<DrillReport, String> {
    const SKU: &str = "DRILL-LOST";
    drilled.stock(SKU, 5).await?;
    let proxy = DroppingProxy::start(drilled.target.address).await?;
    proxy.drop_next_response();
    let key = unique("drill-lost");

    // The lab's client sends a request again with its key when the connection breaks
    // before an answer: the retry a shop's client must make.
    let answered = drilled
        .send_to(proxy.address, reservation(SKU, 1, &key))
        .await?;
    let dropped = proxy.dropped();
    let counters = drilled.counters(SKU).await?;

    let dropped_body = dropped.as_deref().and_then(|response| {
        let split = response
            .windows(4)
            .position(|window| window == b"\r\n\r\n")?;
        serde_json::from_slice::<serde_json::Value>(&response[split + 4..]).ok()
    });
    let answered_body = answered.json().ok();
    let checks = vec![
        check(
            "the first answer was lost after the commit",
            dropped_body
                .as_ref()
                .is_some_and(|body| body["status"] == "RESERVED"),
            format!(
                "the proxy dropped {} bytes",
                dropped.as_ref().map_or(0, Vec::len)
            ),
        ),
        check(
            "the retry with the same key gets the first answer",
            answered.status == 201 && answered.replayed && answered_body == dropped_body,
            format!(
                "{} (replayed {}), same body {}",
                answered.status,
                answered.replayed,
                answered_body == dropped_body
            ),
        ),
        check(
            "one effect",
            counters == (4, 1),
            format!("available {}, reserved {}", counters.0, counters.1),
        ),
        drilled.audit_check().await?,
    ];
    Ok(DrillReport::new(
        "lost-response",
        checks,
        json!({"backend": drilled.target.backend, "reservation": answered_body}),
    ))
}

/// A TCP proxy in front of stockd whose fault point drops the next response: it reads
/// the whole answer from the server (so the server has finished), keeps it, and closes
/// the client's connection without sending a byte.
struct DroppingProxy {
    address: SocketAddr,
    armed: Arc<AtomicBool>,
    dropped: Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl DroppingProxy {
    async fn start(upstream: SocketAddr) -> Result<DroppingProxy, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|error| error.to_string())?;
        let address = listener.local_addr().map_err(|error| error.to_string())?;
        let armed = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(std::sync::Mutex::new(None));
        let accepting = {
            let armed = Arc::clone(&armed);
            let dropped = Arc::clone(&dropped);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let armed = Arc::clone(&armed);
                    let dropped = Arc::clone(&dropped);
                    tokio::spawn(async move {
                        let _ = relay(client, upstream, &armed, &dropped).await;
                    });
                }
            })
        };
        Ok(DroppingProxy {
            address,
            armed,
            dropped,
            accepting,
        })
    }

    fn drop_next_response(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    fn dropped(&self) -> Option<Vec<u8>> {
        self.dropped
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

impl Drop for DroppingProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// Longest answer the proxy keeps when it drops one.
const DROPPED_RESPONSE_BYTES_MAX: usize = 1 << 20;

async fn relay(
    client: tokio::net::TcpStream,
    upstream: SocketAddr,
    armed: &AtomicBool,
    dropped: &std::sync::Mutex<Option<Vec<u8>>>,
) -> Result<(), std::io::Error> {
    let server = tokio::net::TcpStream::connect(upstream).await?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut buffer = vec![0_u8; 16 * 1024];
    loop {
        let read = server_read.read(&mut buffer).await?;
        if read == 0 {
            break;
        }
        if armed.load(Ordering::SeqCst) {
            let mut response = buffer[..read].to_vec();
            while !complete_response(&response) && response.len() < DROPPED_RESPONSE_BYTES_MAX {
                let more = server_read.read(&mut buffer).await?;
                if more == 0 {
                    break;
                }
                response.extend_from_slice(&buffer[..more]);
            }
            armed.store(false, Ordering::SeqCst);
            *dropped
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(response);
            // The client's connection ends here, its answer unsent.
            upward.abort();
            return Ok(());
        }
        client_write.write_all(&buffer[..read]).await?;
    }
    upward.abort();
    Ok(())
}

/// Whether `response` holds a whole HTTP/1.1 answer with a `content-length` body.
fn complete_response(response: &[u8]) -> bool {
    let Some(split) = response.windows(4).position(|window| window == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse::<usize>().ok())
        .unwrap_or(0);
    response.len() >= split + 4 + length
}

/// Refund calls the gateway fails in the compensation-failure drill.
const REFUND_FAILURES: u32 = 3;

/// `stockd drill compensation-failure` (seed 002 §十: a compensation that fails): a paid
/// order is cancelled, and the gateway's refund service answers 500 to the first
/// refund calls, then recovers. stockd keeps the refund pending (the backlog metric
/// the `StockdRefundBacklog` alert reads shows it), sends it again with the same key,
/// and ends with one refund and the order `REFUNDED`. Starts a gateway sandbox in this
/// process and `stockd serve` (this binary) on a scratch database.
pub async fn compensation_failure(options: FaultDrillOptions) -> Result<DrillReport, String> {
    let scratch = std::env::temp_dir().join(format!(
        "stockd-drill-compensation-{:016x}",
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&scratch).map_err(|error| error.to_string())?;
    let database = SpawnedDatabase::create(options.database_url.as_deref(), &scratch).await?;
    let outcome = compensation_run(&database).await;
    database.remove().await;
    let _ = std::fs::remove_dir_all(&scratch);
    outcome
}

/// The database of a `stockd serve` a drill spawns: a SQLite file in the drill's
/// scratch directory, a new schema on PostgreSQL, or a new database on MySQL.
enum SpawnedDatabase {
    Sqlite(String),
    Postgres {
        url: String,
        schema: String,
    },
    Mysql {
        server: String,
        database: String,
        url: String,
    },
}

impl SpawnedDatabase {
    async fn create(
        url: Option<&str>,
        scratch: &std::path::Path,
    ) -> Result<SpawnedDatabase, String> {
        if let Some(url) = url {
            crate::target::database_on_this_machine(url)?;
        }
        let name = format!("stockd_drill_{:016x}", rand::random::<u64>());
        match url {
            None => Ok(SpawnedDatabase::Sqlite(format!(
                "sqlite://{}",
                scratch.join("stockd.db").display()
            ))),
            Some(url) if url.starts_with("mysql://") => {
                let database_url = crate::target::create_mysql_database(url, &name).await?;
                Ok(SpawnedDatabase::Mysql {
                    server: url.to_owned(),
                    database: name,
                    url: database_url,
                })
            }
            Some(url) => {
                use sqlx::Connection;
                let mut connection = sqlx::PgConnection::connect(url)
                    .await
                    .map_err(|error| format!("cannot reach PostgreSQL: {error}"))?;
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
                    .execute(&mut connection)
                    .await
                    .map_err(|error| format!("cannot create schema {name}: {error}"))?;
                Ok(SpawnedDatabase::Postgres {
                    url: url.to_owned(),
                    schema: name,
                })
            }
        }
    }

    /// The variables that point `stockd serve` at it.
    fn variables(&self) -> Vec<(&'static str, String)> {
        match self {
            SpawnedDatabase::Sqlite(url) | SpawnedDatabase::Mysql { url, .. } => {
                vec![("STOCKD_DATABASE_URL", url.clone())]
            }
            SpawnedDatabase::Postgres { url, schema } => vec![
                ("STOCKD_DATABASE_URL", url.clone()),
                ("STOCKD_DATABASE_SCHEMA", schema.clone()),
            ],
        }
    }

    fn backend(&self) -> &'static str {
        match self {
            SpawnedDatabase::Sqlite(_) => "sqlite",
            SpawnedDatabase::Postgres { .. } => "postgres",
            SpawnedDatabase::Mysql { .. } => "mysql",
        }
    }

    async fn remove(self) {
        match self {
            SpawnedDatabase::Sqlite(_) => {}
            SpawnedDatabase::Mysql {
                server, database, ..
            } => crate::target::drop_mysql_database(&server, &database).await,
            SpawnedDatabase::Postgres { url, schema } => {
                use sqlx::Connection;
                if let Ok(mut connection) = sqlx::PgConnection::connect(&url).await {
                    let statement = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
                    let _ = sqlx::query(sqlx::AssertSqlSafe(statement))
                        .execute(&mut connection)
                        .await;
                }
            }
        }
    }
}

async fn compensation_run(database: &SpawnedDatabase) -> Result<DrillReport, String> {
    use crate::duplicate_drill::{Running, free_port, wait_for_port};
    const SKU: &str = "DRILL-REFUND";
    let port = free_port()?;
    let admin_token = format!("drill-{:016x}", rand::random::<u64>());
    let webhook_secret = format!("whsec_drill_{:016x}", rand::random::<u64>());
    let api_key = format!("sk_drill_{:016x}", rand::random::<u64>());

    // The gateway: the sandbox, over real HTTP, its refund service failing first.
    let mut config = sandbox::SandboxConfig::new(webhook_secret.clone());
    config.api_key = Some(api_key.clone());
    config.webhook_url = Some(format!("http://127.0.0.1:{port}/v1/payments/webhook"));
    let gateway = sandbox::Sandbox::new(config);
    gateway.fail_next_refunds(REFUND_FAILURES);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|error| error.to_string())?;
    let gateway_address = listener.local_addr().map_err(|error| error.to_string())?;
    let stop_gateway = tokio_util::sync::CancellationToken::new();
    {
        let serving = gateway.clone();
        let stop = stop_gateway.clone();
        tokio::spawn(async move { serving.serve(listener, stop).await });
    }
    let _stop_gateway = stop_gateway.drop_guard();

    let mut server =
        std::process::Command::new(std::env::current_exe().map_err(|error| error.to_string())?);
    server
        .arg("serve")
        .env("STOCKD_LISTEN", format!("127.0.0.1:{port}"))
        .env("STOCKD_ADMIN_TOKEN", &admin_token)
        .env("STOCKD_GATEWAY_URL", format!("http://{gateway_address}"))
        .env("STOCKD_GATEWAY", "sandbox")
        .env("STOCKD_WEBHOOK_SECRET", &webhook_secret)
        .env("STOCKD_GATEWAY_API_KEY", &api_key)
        .env("STOCKD_REFUND_RETRY_MILLISECONDS", "200")
        .env("STOCKD_LOG", "warn")
        .env_remove("STOCKD_NATS_URL")
        .env_remove("STOCKD_REDIS_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for (name, value) in database.variables() {
        server.env(name, value);
    }
    let _server = Running(
        server
            .spawn()
            .map_err(|error| format!("cannot start stockd serve: {error}"))?,
    );
    wait_for_port(port).await?;
    let stockd = DrillClient {
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        authorization: authorization(&admin_token),
    };
    stockd.stock(SKU, 5).await?;

    let order = stockd
        .send(order(&[(SKU, 1)], &unique("drill-refund-order")))
        .await?
        .json()?;
    let order_id = order["order_id"]
        .as_str()
        .ok_or_else(|| format!("no order: {order}"))?
        .to_owned();
    stockd
        .send(
            WireRequest::json(
                Method::POST,
                format!("/v1/orders/{order_id}/pay"),
                &json!({"payment_method": "pm_card_visa"}),
            )
            .key(unique("drill-refund-pay")),
        )
        .await?;
    let paid = wait_for_order_status(&stockd, &order_id, "PAID").await?;
    let cancelled = stockd
        .send(
            WireRequest::json(
                Method::POST,
                format!("/v1/orders/{order_id}/cancel"),
                &json!({}),
            )
            .key(unique("drill-refund-cancel")),
        )
        .await?;

    // Until the order is refunded: the backlog as the alert sees it.
    let deadline = Instant::now() + WAIT;
    let mut pending_peak = 0.0_f64;
    let final_status = loop {
        pending_peak = pending_peak.max(stockd.metric("stockd_refunds_pending").await?);
        let status = order_status(&stockd, &order_id).await?;
        if status == "REFUNDED" || Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let retries = stockd
        .metric("stockd_refunds_total{result=\"retry\"}")
        .await?;
    let pending_after = stockd.metric("stockd_refunds_pending").await?;
    let stats = gateway.stats();
    let refunds_listed = stockd
        .send(WireRequest::get(format!("/v1/orders/{order_id}")))
        .await?
        .json()?["refunds"]
        .as_array()
        .map_or(0, Vec::len);

    let checks = vec![
        check(
            "the order was paid, then cancelled into a refund",
            paid && cancelled.status == 200,
            format!("paid {paid}, cancel answered {}", cancelled.status),
        ),
        check(
            "the gateway's refund service failed, and stockd sent the refund again",
            stats.refunds_failed == u64::from(REFUND_FAILURES)
                && retries >= f64::from(REFUND_FAILURES),
            format!(
                "{} refund calls failed at the gateway, stockd_refunds_total{{result=\"retry\"}} {retries}",
                stats.refunds_failed
            ),
        ),
        check(
            "the backlog showed while the refund was owed",
            pending_peak >= 1.0 && pending_after == 0.0,
            format!("stockd_refunds_pending peaked at {pending_peak}, {pending_after} after"),
        ),
        check(
            "one refund, and the order is REFUNDED",
            final_status == "REFUNDED" && stats.refunds == 1 && refunds_listed == 1,
            format!(
                "order {final_status}, {} refunds at the gateway, {refunds_listed} on the order",
                stats.refunds
            ),
        ),
        stockd.audit_check().await?,
    ];
    Ok(DrillReport::new(
        "compensation-failure",
        checks,
        json!({
            "backend": database.backend(),
            "refund_failures": REFUND_FAILURES,
            "retries": retries,
            "pending_peak": pending_peak,
        }),
    ))
}

async fn order_status(stockd: &DrillClient, order_id: &str) -> Result<String, String> {
    let order = stockd
        .send(WireRequest::get(format!("/v1/orders/{order_id}")))
        .await?
        .json()?;
    Ok(order["status"].as_str().unwrap_or_default().to_owned())
}

/// Whether the order reached `status` within the drill's wait.
async fn wait_for_order_status(
    stockd: &DrillClient,
    order_id: &str,
    status: &str,
) -> Result<bool, String> {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if order_status(stockd, order_id).await? == status {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(false)
}

/// `stockd drill drop-before-commit` (seed 002 §十: the connection lost before
/// COMMIT): stockd reaches the database through a TCP proxy the drill controls; its
/// fault point closes the connection when the next `COMMIT` comes through, so the
/// database never receives it and rolls the transaction back. The order's request
/// answers 503 (the outcome was unknown to stockd), nothing was applied, and the retry
/// with the same key places the order once. PostgreSQL or MySQL: SQLite has no
/// connection to cut.
pub async fn drop_before_commit(options: FaultDrillOptions) -> Result<DrillReport, String> {
    let Some(url) = options.database_url.as_deref() else {
        return Err(
            "the drop-before-commit drill needs PostgreSQL or MySQL (--database-url): SQLite has no connection to cut"
                .into(),
        );
    };
    let (upstream, commit) = if url.starts_with("mysql://") {
        (server_address(url, 3306)?, MYSQL_COMMIT)
    } else {
        (server_address(url, 5432)?, POSTGRES_COMMIT)
    };
    let proxy = CommitCuttingProxy::start(upstream, commit).await?;
    let proxied = url.replacen(&upstream_text(url)?, &proxy.address.to_string(), 1);
    let drilled = Drilled::start(
        &FaultDrillOptions {
            database_url: Some(proxied),
        },
        2_000,
    )
    .await?;
    let outcome = drop_before_commit_checks(&drilled, &proxy).await;
    drilled.stop().await;
    outcome
}

/// PostgreSQL's simple-query message `COMMIT`: `Q`, its length (4 + 7), the text.
const POSTGRES_COMMIT: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";
/// MySQL's `COM_QUERY COMMIT` packet: a 3-byte length (7), sequence 0, 0x03, the text.
const MYSQL_COMMIT: &[u8] = b"\x07\0\0\0\x03COMMIT";

async fn drop_before_commit_checks(
    drilled: &Drilled,
    proxy: &CommitCuttingProxy,
) -> Result<DrillReport, String> {
    const SKU: &str = "DRILL-COMMIT";
    drilled.stock(SKU, 5).await?;
    let key = unique("drill-commit");
    // One body for every attempt: a retry is the same request.
    let body = order(&[(SKU, 1)], &key);
    let request = || body.clone();

    proxy.cut_next_commit();
    let cut = drilled.send(request()).await?;
    let after_cut = drilled.counters(SKU).await?;
    let cuts = proxy.cuts();
    let retried = drilled.send(request()).await?;
    let after_retry = drilled.counters(SKU).await?;
    let again = drilled.send(request()).await?;
    let after_again = drilled.counters(SKU).await?;

    let checks = vec![
        check(
            "the connection was cut before COMMIT reached the database",
            cuts == 1,
            format!("{cuts} COMMIT cut by the proxy"),
        ),
        check(
            "the request answered 503 unavailable (its outcome unknown to stockd)",
            cut.status == 503 && cut.code().as_deref() == Some("unavailable"),
            format!("{} {}", cut.status, cut.code().unwrap_or_default()),
        ),
        check(
            "nothing was applied",
            after_cut == (5, 0),
            format!("available {}, reserved {}", after_cut.0, after_cut.1),
        ),
        check(
            "the retry with the same key places the order once",
            retried.status == 201
                && !retried.replayed
                && after_retry == (4, 1)
                && again.status == 201
                && again.replayed
                && after_again == (4, 1),
            format!(
                "{} then {} (replayed {}), available {}, reserved {}",
                retried.status, again.status, again.replayed, after_again.0, after_again.1
            ),
        ),
        drilled.audit_check().await?,
    ];
    Ok(DrillReport::new(
        "drop-before-commit",
        checks,
        json!({"backend": drilled.target.backend, "cuts": cuts}),
    ))
}

/// The `host:port` text of a database URL (after the credentials, before the path).
pub(crate) fn upstream_text(url: &str) -> Result<String, String> {
    let rest = url
        .split_once("://")
        .map(|(_, rest)| rest)
        .ok_or_else(|| format!("not a URL: {}", domain::redact_url(url)))?;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    Ok(rest[..end].to_owned())
}

/// Where a database URL's server listens (loopback only: the drill cuts connections).
fn server_address(url: &str, default_port: u16) -> Result<SocketAddr, String> {
    let text = upstream_text(url)?;
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) => (
            host.to_owned(),
            port.parse::<u16>()
                .map_err(|_| format!("bad port in {}", domain::redact_url(url)))?,
        ),
        None => (text.clone(), default_port),
    };
    let host = if host == "localhost" {
        "127.0.0.1".to_owned()
    } else {
        host
    };
    let address: SocketAddr = format!("{host}:{port}")
        .parse()
        .map_err(|_| format!("the drill needs a numeric loopback host, not '{host}'"))?;
    if !address.ip().is_loopback() {
        return Err(format!(
            "the drill only cuts connections to loopback, not {address}"
        ));
    }
    Ok(address)
}

/// A TCP proxy between stockd and its database whose fault point closes the
/// connection that is about to send `COMMIT`, without forwarding it.
struct CommitCuttingProxy {
    address: SocketAddr,
    armed: Arc<AtomicBool>,
    cuts: Arc<std::sync::atomic::AtomicU64>,
    accepting: tokio::task::JoinHandle<()>,
}

impl CommitCuttingProxy {
    async fn start(
        upstream: SocketAddr,
        commit: &'static [u8],
    ) -> Result<CommitCuttingProxy, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|error| error.to_string())?;
        let address = listener.local_addr().map_err(|error| error.to_string())?;
        let armed = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let accepting = {
            let armed = Arc::clone(&armed);
            let cuts = Arc::clone(&cuts);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let armed = Arc::clone(&armed);
                    let cuts = Arc::clone(&cuts);
                    tokio::spawn(async move {
                        let _ = relay_cutting_commit(client, upstream, commit, &armed, &cuts).await;
                    });
                }
            })
        };
        Ok(CommitCuttingProxy {
            address,
            armed,
            cuts,
            accepting,
        })
    }

    fn cut_next_commit(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    fn cuts(&self) -> u64 {
        self.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for CommitCuttingProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn relay_cutting_commit(
    client: tokio::net::TcpStream,
    upstream: SocketAddr,
    commit: &'static [u8],
    armed: &AtomicBool,
    cuts: &std::sync::atomic::AtomicU64,
) -> Result<(), std::io::Error> {
    let server = tokio::net::TcpStream::connect(upstream).await?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let downward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    });
    let mut buffer = vec![0_u8; 16 * 1024];
    // The last bytes of the previous read: a message split across two reads is found.
    let mut carried: Vec<u8> = Vec::new();
    loop {
        let read = client_read.read(&mut buffer).await?;
        if read == 0 {
            break;
        }
        let mut window = std::mem::take(&mut carried);
        let carried_length = window.len();
        window.extend_from_slice(&buffer[..read]);
        if armed.load(Ordering::SeqCst)
            && let Some(at) = window
                .windows(commit.len())
                .position(|bytes| bytes == commit)
        {
            armed.store(false, Ordering::SeqCst);
            cuts.fetch_add(1, Ordering::SeqCst);
            // What came before the COMMIT goes through; the COMMIT never does, and
            // both sides of the connection close.
            if at > carried_length {
                server_write.write_all(&window[carried_length..at]).await?;
            }
            downward.abort();
            return Ok(());
        }
        server_write.write_all(&buffer[..read]).await?;
        let keep = commit.len().saturating_sub(1).min(window.len());
        carried = window[window.len() - keep..].to_vec();
    }
    downward.abort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_url_is_sent_through_the_proxy_by_its_host_and_port() {
        let url = "postgres://postgres:secret@127.0.0.1:5432/postgres?sslmode=disable";
        assert_eq!(upstream_text(url).unwrap(), "127.0.0.1:5432");
        assert_eq!(
            server_address(url, 5432).unwrap(),
            SocketAddr::from(([127, 0, 0, 1], 5432))
        );
        assert_eq!(
            server_address("mysql://root@localhost", 3306).unwrap(),
            SocketAddr::from(([127, 0, 0, 1], 3306))
        );
        assert!(server_address("postgres://db.example.com:5432/x", 5432).is_err());
    }

    #[test]
    fn a_response_is_complete_once_its_whole_body_arrived() {
        let head = b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\n";
        let mut response = head.to_vec();
        assert!(!complete_response(&response));
        response.extend_from_slice(b"{\"a\"");
        assert!(!complete_response(&response));
        response.extend_from_slice(b"}");
        assert!(complete_response(&response));
        assert!(!complete_response(
            b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n"
        ));
    }
}

//! `stockd drill duplicate-delivery` (seed 002 §十.3: "对同一消息投递三次，验证消费者是否
//! 只完成一次有效扣减"): starts NATS (unless given one) and a real `stockd serve`
//! (this binary, its in-process gateway sandbox, a scratch SQLite database), then
//! publishes the same reservation command three times — distinct message ids, one
//! `Idempotency-Key` — and pays an order whose webhook the gateway delivers three
//! times. Checks one effect each, three identical answers, and a clean audit.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use hyper::Method;
use serde_json::{Value, json};

use crate::client::{WireRequest, authorization};
use crate::drill::{DrillReport, check};
use crate::fault_drills::DrillClient;

/// Longest wait for anything the drill waits on (a server starting, an answer, the
/// webhooks).
const WAIT: Duration = Duration::from_secs(30);
const SKU: &str = "DRILL-DUPLICATE";
const STOCK: i64 = 10;

/// Settings of the drill.
#[derive(Debug, Clone, Default)]
pub struct DuplicateDeliveryOptions {
    /// A NATS with JetStream to use; unset: the drill starts `nats-server -js` of its
    /// own on a free port.
    pub nats_url: Option<String>,
}

/// A child process killed when dropped.
pub(crate) struct Running(pub(crate) Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub async fn duplicate_delivery(options: DuplicateDeliveryOptions) -> Result<DrillReport, String> {
    let scratch = std::env::temp_dir().join(format!(
        "stockd-drill-duplicate-{:016x}",
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&scratch).map_err(|error| error.to_string())?;
    let outcome = run(&options, &scratch).await;
    let _ = std::fs::remove_dir_all(&scratch);
    outcome
}

async fn run(
    options: &DuplicateDeliveryOptions,
    scratch: &std::path::Path,
) -> Result<DrillReport, String> {
    let (_nats, nats_url) = match &options.nats_url {
        Some(url) => {
            // A drill publishes its commands there: this machine's NATS only.
            crate::target::database_on_this_machine(url).map_err(|_| {
                format!(
                    "--nats-url must name a NATS server on this machine, not {}",
                    domain::redact_url(url)
                )
            })?;
            (None, url.clone())
        }
        None => {
            let port = free_port()?;
            let binary = std::env::var("STOCKD_NATS_SERVER")
                .unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
            let child = Command::new(&binary)
                .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                .arg(scratch.join("nats"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|error| format!("cannot start {binary}: {error}"))?;
            let running = Running(child);
            wait_for_port(port).await?;
            (Some(running), format!("nats://127.0.0.1:{port}"))
        }
    };
    let port = free_port()?;
    let admin_token = format!("drill-{:016x}", rand::random::<u64>());
    let server = Command::new(std::env::current_exe().map_err(|error| error.to_string())?)
        .arg("serve")
        .env("STOCKD_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "STOCKD_DATABASE_URL",
            format!("sqlite://{}", scratch.join("stockd.db").display()),
        )
        .env("STOCKD_ADMIN_TOKEN", &admin_token)
        .env("STOCKD_NATS_URL", &nats_url)
        .env("STOCKD_LOG", "warn")
        .env_remove("STOCKD_GATEWAY_URL")
        .env_remove("STOCKD_REDIS_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|error| format!("cannot start stockd serve: {error}"))?;
    let _server = Running(server);
    wait_for_port(port).await?;
    let stockd = DrillClient {
        address: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        authorization: authorization(&admin_token),
    };
    stockd.stock(SKU, STOCK).await?;

    let mut checks = Vec::new();
    let queue = queue_part(&stockd, &nats_url, &mut checks).await?;
    let webhook = webhook_part(&stockd, &mut checks).await?;
    let audit = stockd.send(WireRequest::get("/v1/audit")).await?.json()?;
    checks.push(check(
        "the audit is clean",
        audit["ok"] == true,
        format!(
            "{} differences",
            audit["differences"].as_array().map_or(0, Vec::len)
        ),
    ));
    Ok(DrillReport::new(
        "duplicate-delivery",
        checks,
        json!({"queue": queue, "webhook": webhook, "nats": domain::redact_url(&nats_url)}),
    ))
}

/// The same command three times: one reservation, three identical answers.
async fn queue_part(
    stockd: &DrillClient,
    nats_url: &str,
    checks: &mut Vec<crate::drill::Check>,
) -> Result<Value, String> {
    let client = async_nats::connect(nats_url)
        .await
        .map_err(|error| format!("NATS at {}: {error}", domain::redact_url(nats_url)))?;
    let context = jetstream::new(client);
    // The server creates the command stream when its intake attaches.
    let deadline = Instant::now() + WAIT;
    while context
        .get_stream(bus::intake::COMMAND_STREAM)
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            return Err("the server's intake never created its stream".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let key = format!("drill-command-{:016x}", rand::random::<u64>());
    let body = json!({"shop": "default", "lines": [{"sku": SKU, "quantity": 1}]}).to_string();
    let started = Instant::now();
    for delivery in 1..=3 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("{key}-delivery-{delivery}").as_str());
        headers.insert("Idempotency-Key", key.as_str());
        publish_until_stored(&context, headers, &body, deadline).await?;
    }
    let answers = loop {
        let answers = answers_for(&context, &key).await?;
        if answers.len() >= 3 || Instant::now() > deadline {
            break answers;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let answered_in = started.elapsed();
    let identical = answers.len() == 3 && answers.iter().all(|answer| *answer == answers[0]);
    checks.push(check(
        "three deliveries, three identical answers",
        identical,
        format!(
            "{} answers on {} (status {})",
            answers.len(),
            bus::intake::RESERVE_RESULT_SUBJECT,
            answers
                .first()
                .map_or("none".to_owned(), |answer| answer.0.clone())
        ),
    ));
    let counters = stockd.counters(SKU).await?;
    checks.push(check(
        "one reservation",
        counters == (STOCK - 1, 1),
        format!("available {}, reserved {}", counters.0, counters.1),
    ));
    Ok(json!({
        "deliveries": 3,
        "answers": answers.len(),
        "answered_in_milliseconds": answered_in.as_millis(),
    }))
}

/// Publishes one delivery and waits for JetStream to store it. A stream the server
/// has just created can answer "no stream found" for a moment (nobody listens on its
/// subjects yet; seen on a loaded 2-core machine): the same delivery is sent again,
/// under the same `Nats-Msg-Id` (JetStream keeps one), until `deadline`.
async fn publish_until_stored(
    context: &jetstream::Context,
    headers: async_nats::HeaderMap,
    body: &str,
    deadline: Instant,
) -> Result<(), String> {
    loop {
        let stored = match context
            .publish_with_headers(
                bus::intake::RESERVE_COMMAND_SUBJECT,
                headers.clone(),
                body.to_owned().into(),
            )
            .await
        {
            Ok(acknowledgement) => acknowledgement.await,
            Err(error) => return Err(error.to_string()),
        };
        match stored {
            Ok(_) => return Ok(()),
            Err(error)
                if error.kind() == jetstream::context::PublishErrorKind::StreamNotFound
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// The answers on the result stream under `key`: (status, body).
async fn answers_for(
    context: &jetstream::Context,
    key: &str,
) -> Result<Vec<(String, String)>, String> {
    let Ok(mut stream) = context.get_stream(bus::intake::RESULT_STREAM).await else {
        return Ok(Vec::new());
    };
    let last = stream
        .info()
        .await
        .map_err(|error| error.to_string())?
        .state
        .last_sequence;
    let mut answers = Vec::new();
    for sequence in 1..=last {
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let header = |name: &str| {
            message
                .headers
                .get(name)
                .map(|value| value.as_str().to_owned())
        };
        if header("Idempotency-Key").as_deref() == Some(key) {
            answers.push((
                header("Stockd-Status").unwrap_or_default(),
                String::from_utf8_lossy(&message.payload).into_owned(),
            ));
        }
    }
    Ok(answers)
}

/// A payment whose webhook the gateway delivers three times: paid once.
async fn webhook_part(
    stockd: &DrillClient,
    checks: &mut Vec<crate::drill::Check>,
) -> Result<Value, String> {
    let before = stockd.metric("stockd_webhooks_total").await?;
    let order = stockd
        .send(
            WireRequest::json(
                Method::POST,
                "/v1/orders",
                &json!({"user_id": "drill-user", "lines": [{"sku": SKU, "quantity": 1}]}),
            )
            .key("drill-order"),
        )
        .await?
        .json()?;
    let order_id = order["order_id"]
        .as_str()
        .ok_or_else(|| format!("no order: {order}"))?
        .to_owned();
    let paid = stockd
        .send(
            WireRequest::json(
                Method::POST,
                format!("/v1/orders/{order_id}/pay"),
                &json!({"payment_method": "pm_sandbox_webhook_3x"}),
            )
            .key("drill-pay"),
        )
        .await?;
    let deadline = Instant::now() + WAIT;
    let mut deliveries = 0.0;
    while Instant::now() < deadline {
        deliveries = stockd.metric("stockd_webhooks_total").await? - before;
        if deliveries >= 3.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let duplicates = stockd
        .metric("stockd_webhooks_total{duplicate=\"true\"}")
        .await?;
    checks.push(check(
        "three webhook deliveries, two recognised as repeats",
        deliveries >= 3.0 && duplicates >= 2.0,
        format!(
            "{deliveries} deliveries, {duplicates} repeats (pay answered {})",
            paid.status
        ),
    ));
    let order = stockd
        .send(WireRequest::get(format!("/v1/orders/{order_id}")))
        .await?
        .json()?;
    let counters = stockd.counters(SKU).await?;
    let held = order["status"] == "PAID" && counters == (STOCK - 2, 1);
    checks.push(check(
        "the order is paid once",
        held,
        format!(
            "order {}, available {}, reserved {} (the command's hold and the paid unit)",
            order["status"], counters.0, counters.1
        ),
    ));
    Ok(json!({"deliveries": deliveries, "repeats": duplicates, "order_status": order["status"]}))
}

pub(crate) fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|error| error.to_string())?;
    Ok(listener
        .local_addr()
        .map_err(|error| error.to_string())?
        .port())
}

pub(crate) async fn wait_for_port(port: u16) -> Result<(), String> {
    let deadline = Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            return Err(format!("nothing listened on port {port} within {WAIT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

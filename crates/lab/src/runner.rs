//! Running a plan against a target: set up the SKUs, let the clients loose, read the
//! counters and the audit back, and build the report.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hyper::Method;
use indicatif::{ProgressBar, ProgressStyle};

use crate::client::{HttpConnection, WireReply, WireRequest};
use crate::report::{
    AuditSummary, BatchSizes, CampaignSummary, Class, Latency, Record, Report, SkuCounters,
    campaign_violations, class_counts, missing_answers, surfaced_deadlocks, taken_by_successes,
    units_by_user, violations,
};
use crate::scenario::{Plan, RECEIVE_QUANTITY_MAX, RequestSpec, Stop};
use crate::target::{RawDatabase, Target};
use engine::Clock;

/// Connections used to create SKUs and read them back (a million-SKU catalog takes
/// minutes to create one request at a time).
const SETUP_CONNECTIONS: usize = 64;
/// At most this many SKUs are listed by name in a report.
const SKUS_IN_QUESTION_MAX: usize = 20;

fn hash_body(body: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    body.hash(&mut hasher);
    hasher.finish()
}

async fn expect_success(
    connection: &mut HttpConnection,
    request: &WireRequest,
    what: &str,
) -> Result<WireReply, String> {
    let reply = connection.send(request).await?;
    if (200..300).contains(&reply.status) {
        Ok(reply)
    } else {
        Err(format!(
            "{what} answered {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ))
    }
}

/// Runs `work` over `items` on `connections` connections at once.
async fn for_each_on_connections<Item, Output, Work, Attempt>(
    target: &Target,
    items: Vec<Item>,
    connections: usize,
    work: Work,
) -> Result<Vec<Output>, String>
where
    Item: Send + 'static,
    Output: Send + 'static,
    Work: Fn(HttpConnection, Item) -> Attempt + Send + Sync + 'static,
    Attempt: std::future::Future<Output = (HttpConnection, Result<Output, String>)> + Send,
{
    let total = items.len();
    let queue = Arc::new(std::sync::Mutex::new(
        items.into_iter().enumerate().collect::<Vec<_>>(),
    ));
    let work = Arc::new(work);
    let mut tasks = Vec::new();
    for _ in 0..connections.clamp(1, total.max(1)) {
        let queue = Arc::clone(&queue);
        let work = Arc::clone(&work);
        let address = target.address;
        tasks.push(tokio::spawn(async move {
            let mut connection = HttpConnection::new(address);
            let mut outputs = Vec::new();
            loop {
                let next = queue
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .pop();
                let Some((position, item)) = next else { break };
                let (returned, output) = work(connection, item).await;
                connection = returned;
                outputs.push((position, output?));
            }
            Ok::<_, String>(outputs)
        }));
    }
    let mut outputs = Vec::with_capacity(total);
    for task in tasks {
        outputs.extend(task.await.map_err(|error| error.to_string())??);
    }
    outputs.sort_by_key(|(position, _)| *position);
    Ok(outputs.into_iter().map(|(_, output)| output).collect())
}

/// A service key of shop `default` for the run's requests (a checkout backend's
/// credential); returns its secret. Never printed or written into a report.
pub async fn create_service_key(plan: &Plan, target: &Target) -> Result<domain::Secret, String> {
    let mut connection = HttpConnection::new(target.address);
    let create = WireRequest::json(
        Method::POST,
        "/v1/admin/service-keys".to_owned(),
        &serde_json::json!({"shop": "default", "name": format!("bench-{}", plan.run_id)}),
    )
    .key(format!("bench-{}-service-key", plan.run_id))
    .bearer(target.admin_token.expose());
    let reply = expect_success(&mut connection, &create, "creating a service key").await?;
    let body = reply.json()?;
    body["secret"]
        .as_str()
        .map(domain::Secret::new)
        .ok_or_else(|| "the service key answer has no secret".to_owned())
}

/// Creates the plan's SKUs and receives their stock (in movements of at most a
/// million units each).
pub async fn set_up(plan: &Plan, target: &Target) -> Result<(), String> {
    let token = target.admin_token.expose().to_owned();
    let run_id = plan.run_id.clone();
    let skus = plan.skus.clone();
    for_each_on_connections(target, skus, SETUP_CONNECTIONS, move |mut connection, sku| {
        let token = token.clone();
        let run_id = run_id.clone();
        async move {
            let result = async {
                let create = WireRequest::json(
                    Method::PUT,
                    format!("/v1/skus/{}", sku.code),
                    &serde_json::json!({"title": format!("bench {}", sku.code), "price": 100, "currency": "CNY"}),
                )
                .key(format!("bench-{run_id}-create-{}", sku.code))
                .bearer(&token);
                expect_success(&mut connection, &create, "creating a SKU").await?;
                let mut remaining = sku.stock;
                let mut movement = 0;
                while remaining > 0 {
                    let quantity = remaining.min(RECEIVE_QUANTITY_MAX);
                    let receive = WireRequest::json(
                        Method::POST,
                        format!("/v1/skus/{}/stock-movements", sku.code),
                        &serde_json::json!({"kind": "receive", "quantity": quantity}),
                    )
                    .key(format!("bench-{run_id}-receive-{}-{movement}", sku.code))
                    .bearer(&token);
                    expect_success(&mut connection, &receive, "receiving stock").await?;
                    remaining -= quantity;
                    movement += 1;
                }
                Ok(())
            }
            .await;
            (connection, result)
        }
    })
    .await
    .map(|_| ())
}

/// Starts the plan's flash-sale campaign on its first SKU, running from a second ago
/// for an hour (the whole run); answers its id.
async fn start_campaign(plan: &Plan, target: &Target) -> Result<Option<String>, String> {
    let Some(campaign) = &plan.campaign else {
        return Ok(None);
    };
    let now = engine::SystemClock.now();
    let mut body = serde_json::json!({
        "sku": plan.skus[0].code,
        "quantity": campaign.quantity,
        "per_user_limit": campaign.per_user_limit,
        "starts_at": now.plus_seconds(-1).to_rfc3339(),
        "ends_at": now.plus_seconds(3600).to_rfc3339(),
    });
    if let Some(buckets) = campaign.buckets {
        body["buckets"] = serde_json::json!(buckets);
    }
    let create = WireRequest::json(Method::POST, "/v1/admin/campaigns", &body)
        .key(format!("bench-{}-campaign", plan.run_id))
        .bearer(target.admin_token.expose());
    let mut connection = HttpConnection::new(target.address);
    let reply = expect_success(&mut connection, &create, "starting the campaign").await?;
    let created = reply.json()?;
    created["campaign_id"]
        .as_str()
        .map(|id| Some(id.to_owned()))
        .ok_or_else(|| "the campaign answer has no campaign_id".to_owned())
}

/// The campaign after the run, with what the clients saw each shopper get.
async fn read_campaign(
    plan: &Plan,
    target: &Target,
    id: &str,
    records: &[Record],
) -> Result<CampaignSummary, String> {
    let mut connection = HttpConnection::new(target.address);
    let read =
        WireRequest::get(format!("/v1/admin/campaigns/{id}")).bearer(target.admin_token.expose());
    let body = expect_success(&mut connection, &read, "reading the campaign")
        .await?
        .json()?;
    let number = |field: &str| {
        body[field]
            .as_i64()
            .ok_or_else(|| format!("the campaign has no {field}"))
    };
    let units = units_by_user(records, |key_index| plan.user_of(key_index));
    let asked = plan
        .campaign
        .as_ref()
        .map(|campaign| campaign.per_user_limit)
        .ok_or("the run has no campaign")?;
    Ok(CampaignSummary {
        campaign_id: id.to_owned(),
        quantity: number("quantity")?,
        buckets: body["buckets"].as_array().map_or(0, Vec::len),
        // The shoppers are judged by the limit the run asked for, not by what the
        // server says it holds: a server that stored another would pass its own test.
        per_user_limit: asked,
        per_user_limit_shown: number("per_user_limit")?,
        sold: number("sold")?,
        held: number("held")?,
        left: number("left")?,
        buyers: units.len() as u64,
        most_units_one_buyer_got: units.values().copied().max().unwrap_or(0),
    })
}

fn progress_bar(plan: &Plan) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let (length, template) = match plan.stop {
        Stop::AfterRequests(requests) => (requests, "{bar:40} {pos}/{len} requests {elapsed}"),
        Stop::AfterDuration(duration) => (duration.as_secs().max(1), "{bar:40} {pos}/{len} s"),
    };
    let bar = ProgressBar::new(length);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// Sends the plan's requests from `plan.clients` connections and records every answer.
pub async fn drive(
    plan: &Arc<Plan>,
    target: &Target,
    service_key: &domain::Secret,
) -> (Vec<Record>, Duration) {
    let progress = progress_bar(plan);
    let started = Instant::now();
    let mut records = Vec::new();
    let waves = plan.waves.max(1) as u64;
    match plan.stop {
        Stop::AfterRequests(total) => {
            records.reserve(usize::try_from(total).unwrap_or(0));
            let per_wave = total.div_ceil(waves);
            let mut first = 0;
            while first < total {
                let end = (first + per_wave).min(total);
                records.extend(
                    drive_range(plan, target, service_key, first, Some(end), None, &progress).await,
                );
                first = end;
            }
        }
        Stop::AfterDuration(duration) => {
            let deadline = started + duration;
            let ticker = {
                let progress = progress.clone();
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        progress.inc(1);
                    }
                })
            };
            records = drive_range(
                plan,
                target,
                service_key,
                0,
                None,
                Some(deadline),
                &ProgressBar::hidden(),
            )
            .await;
            ticker.abort();
        }
    }
    progress.finish_and_clear();
    (records, started.elapsed())
}

/// Clients take request numbers from `first` on, until `end` or `deadline`.
async fn drive_range(
    plan: &Arc<Plan>,
    target: &Target,
    service_key: &domain::Secret,
    first: u64,
    end: Option<u64>,
    deadline: Option<Instant>,
    progress: &ProgressBar,
) -> Vec<Record> {
    let next = Arc::new(AtomicU64::new(first));
    let clients = match end {
        Some(end) => plan.clients.min((end - first) as usize).max(1),
        None => plan.clients,
    };
    // Each client's share of a counted run, with room for the uneven split: records
    // grown by doubling while the run is measured cost the load generator page faults
    // and copies on the cores the service under test shares (about 5 % of the samples
    // in a profile of the flash sale).
    let per_client = end.map_or(0, |end| {
        usize::try_from((end - first).div_ceil(clients as u64) * 2).unwrap_or(0)
    });
    let barrier = Arc::new(tokio::sync::Barrier::new(clients));
    let mut tasks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let plan = Arc::clone(plan);
        let next = Arc::clone(&next);
        let barrier = Arc::clone(&barrier);
        let progress = progress.clone();
        let address = target.address;
        let authorization = crate::client::authorization(service_key.expose());
        tasks.push(tokio::spawn(async move {
            let mut connection = HttpConnection::new(address);
            let mut records = Vec::with_capacity(per_client);
            // Open every connection before the first request, so the start is
            // simultaneous (the seeds' "concurrent" requests).
            let _ = connection.send(&WireRequest::get("/healthz")).await;
            barrier.wait().await;
            loop {
                if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                    break;
                }
                let index = next.fetch_add(1, Ordering::Relaxed);
                if end.is_some_and(|end| index >= end) {
                    break;
                }
                let spec = plan.request(index);
                let request = match &spec {
                    // Requests that must be refused for lack of a credential carry none.
                    RequestSpec::Malformed(malformed) if malformed.expected_status == 401 => {
                        plan.wire_request(&spec)
                    }
                    _ => plan.wire_request(&spec).authorized(authorization.clone()),
                };
                let sent = Instant::now();
                let reply = connection.send(&request).await;
                let latency_microseconds =
                    sent.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
                let (key_index, expected) = match &spec {
                    RequestSpec::Reserve { key_index, .. } => (Some(*key_index), None),
                    RequestSpec::Malformed(malformed) => (
                        None,
                        Some((
                            malformed.label,
                            malformed.expected_status,
                            malformed.expected_code,
                        )),
                    ),
                };
                records.push(match reply {
                    Ok(reply) => Record {
                        index,
                        key_index,
                        status: reply.status,
                        code: reply.code(),
                        replayed: reply.replayed,
                        body_hash: hash_body(&reply.body),
                        latency_microseconds,
                        expected,
                        error: None,
                        from_memory: reply.answered_from_memory(),
                    },
                    Err(error) => Record {
                        index,
                        key_index,
                        status: 0,
                        code: None,
                        replayed: false,
                        body_hash: 0,
                        latency_microseconds,
                        expected,
                        error: Some(error),
                        from_memory: false,
                    },
                });
                progress.inc(1);
            }
            records
        }));
    }
    let mut records = Vec::with_capacity(end.map_or(0, |end| (end - first) as usize));
    for task in tasks {
        match task.await {
            Ok(mut from_client) => records.append(&mut from_client),
            // Its answers are lost; the judge counts them missing.
            Err(error) => eprintln!("lab: a load client ended without its answers: {error}"),
        }
    }
    records
}

/// Reads every SKU's counters back.
async fn read_counters(
    plan: &Plan,
    target: &Target,
    taken: Vec<i64>,
) -> Result<Vec<SkuCounters>, String> {
    let items: Vec<(usize, String, i64)> = plan
        .skus
        .iter()
        .enumerate()
        .map(|(index, sku)| (index, sku.code.clone(), sku.stock))
        .collect();
    let taken = Arc::new(taken);
    let token = target.admin_token.expose().to_owned();
    for_each_on_connections(
        target,
        items,
        SETUP_CONNECTIONS,
        move |mut connection, (index, code, stock)| {
            let taken = Arc::clone(&taken);
            let token = token.clone();
            async move {
                let result = async {
                    let reply = expect_success(
                        &mut connection,
                        &WireRequest::get(format!("/v1/skus/{code}")).bearer(&token),
                        "reading a SKU",
                    )
                    .await?;
                    let body = reply.json()?;
                    Ok(SkuCounters {
                        code: code.clone(),
                        initial_stock: stock,
                        taken_by_successes: taken[index],
                        available: body["available"].as_i64().ok_or("SKU without available")?,
                        reserved: body["reserved"].as_i64().ok_or("SKU without reserved")?,
                    })
                }
                .await;
                (connection, result)
            }
        },
    )
    .await
}

async fn read_audit(target: &Target) -> Result<AuditSummary, String> {
    let mut connection = HttpConnection::new(target.address);
    let audit = WireRequest::get("/v1/audit").bearer(target.admin_token.expose());
    let reply = expect_success(&mut connection, &audit, "the audit").await?;
    let body = reply.json()?;
    Ok(AuditSummary {
        ok: body["ok"].as_bool().ok_or("audit without ok")?,
        differences_total: body["differences_total"].as_i64().unwrap_or(-1),
    })
}

/// Most ledger rows of history one statement writes: each is its own transaction, and
/// none holds the database for long.
const HISTORY_ROWS_PER_STATEMENT: u64 = 1_000_000;

/// Writes the plan's history into the ledger (see [`Plan::history_ledger_rows`]) with
/// the lab's own connection, before any client starts; answers the rows written.
async fn write_history(plan: &Plan, target: &Target) -> Result<u64, String> {
    if plan.history_ledger_rows == 0 {
        return Ok(0);
    }
    let stock_rows = plan.skus.len() as u64;
    let pairs_per_row = plan.history_ledger_rows.div_ceil(2 * stock_rows);
    let pairs_per_statement = (HISTORY_ROWS_PER_STATEMENT / (2 * stock_rows)).max(1);
    let now = engine::SystemClock.now();
    let mut raw = target.raw_database().await?;
    let mut written = 0;
    let mut pairs_done = 0;
    while pairs_done < pairs_per_row {
        let pairs = pairs_per_statement.min(pairs_per_row - pairs_done);
        written += raw
            .execute(&history_statement(&plan.run_id, pairs, now))
            .await
            .map_err(|error| format!("writing ledger history: {error}"))?;
        pairs_done += pairs;
    }
    // Let the database settle before the clients start, so the run measures the grown
    // ledger and not the bulk write: statistics read, and (PostgreSQL) the dirty pages
    // flushed, so no checkpoint of the history's WAL lands inside the run.
    let settle: &[&str] = match raw {
        RawDatabase::Postgres(_) => &["VACUUM (ANALYZE) stock_ledger", "CHECKPOINT"],
        RawDatabase::Mysql(_) => &["ANALYZE TABLE stock_ledger"],
        RawDatabase::Sqlite(_) => &["ANALYZE stock_ledger", "PRAGMA wal_checkpoint(TRUNCATE)"],
    };
    for statement in settle {
        raw.execute(statement)
            .await
            .map_err(|error| format!("settling after the ledger history ({statement}): {error}"))?;
    }
    Ok(written)
}

/// One statement that writes `pairs` pairs of `adjust` rows (+1 and -1) for every
/// stock row of the run, in SQL that SQLite, PostgreSQL and MySQL read alike: the pair
/// numbers come from a cross join of decimal digits, not from a dialect's series.
fn history_statement(run_id: &str, pairs: u64, now: domain::Timestamp) -> String {
    let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
        UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
        UNION ALL SELECT 8 UNION ALL SELECT 9)";
    // Digits enough for the largest pair number, `pairs - 1`.
    let places = pairs
        .saturating_sub(1)
        .checked_ilog10()
        .map_or(1, |log| log as usize + 1);
    let tables: Vec<String> = (0..places)
        .map(|place| format!("{digits} AS d{place}"))
        .collect();
    let number: Vec<String> = (0..places)
        .map(|place| format!("{} * d{place}.d", 10_u64.pow(place as u32)))
        .collect();
    // The run id is the lab's own (letters and digits), safe inside a literal.
    format!(
        "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, \
         reference, idempotency_key, created_at) \
         SELECT stock.sku, stock.warehouse, 'adjust', side.delta, 0, 'bench-{run_id}-history', \
         NULL, {} \
         FROM stock \
         CROSS JOIN (SELECT 1 AS delta UNION ALL SELECT -1) AS side \
         CROSS JOIN (SELECT {} AS n FROM {}) AS pair \
         WHERE pair.n < {pairs} AND stock.sku LIKE 'bench-{run_id}-%'",
        now.unix_milliseconds(),
        number.join(" + "),
        tables.join(" CROSS JOIN "),
    )
}

/// Set up, drive, read back, judge.
pub async fn run(plan: Plan, target: &Target) -> Result<Report, String> {
    set_up(&plan, target).await?;
    let history_ledger_rows = write_history(&plan, target).await?;
    let campaign_id = start_campaign(&plan, target).await?;
    let service_key = create_service_key(&plan, target).await?;
    let plan = Arc::new(plan);
    let (records, elapsed) = drive(&plan, target, &service_key).await;
    let campaign = match &campaign_id {
        Some(id) => Some(read_campaign(&plan, target, id, &records).await?),
        None => None,
    };
    let taken = taken_by_successes(
        &records,
        |key_index| plan.lines_of(key_index),
        plan.skus.len(),
    );
    let counters = read_counters(&plan, target, taken).await?;
    let audit = read_audit(target).await?;
    let batches = HttpConnection::new(target.address)
        .send(&WireRequest::get("/metrics").bearer(target.admin_token.expose()))
        .await
        .ok()
        .and_then(|reply| BatchSizes::parse(&String::from_utf8_lossy(&reply.body)));
    let mut found = violations(&records, &counters, &audit, plan.expected_successes);
    found.extend(missing_answers(plan.request_count(), records.len()));
    if plan.scenario.promises_no_deadlock() {
        found.extend(surfaced_deadlocks(&records));
    }
    if let Some(campaign) = &campaign {
        found.extend(campaign_violations(campaign));
    }
    let classes = class_counts(&records);
    let seconds = elapsed.as_secs_f64().max(f64::EPSILON);
    let successes = classes.get(&Class::Success).copied().unwrap_or(0);
    let sold_out = classes.get(&Class::InsufficientStock).copied().unwrap_or(0);
    let successful: Vec<Record> = records
        .iter()
        .filter(|record| record.class() == Class::Success)
        .cloned()
        .collect();
    let skus_in_question = counters
        .iter()
        .filter(|sku| {
            sku.reserved != sku.taken_by_successes
                || sku.available + sku.reserved != sku.initial_stock
        })
        .take(SKUS_IN_QUESTION_MAX)
        .cloned()
        .collect();
    Ok(Report {
        scenario: plan.scenario.name(),
        target: format!("http://{}", target.address),
        backend: target.backend.unwrap_or("remote").to_owned(),
        clients: plan.clients,
        requests_sent: records.len() as u64,
        elapsed_seconds: seconds,
        requests_per_second: records.len() as f64 / seconds,
        successes_per_second: successes as f64 / seconds,
        classes,
        latency: Latency::of(&records),
        latency_of_successes: Latency::of(&successful),
        latency_by_class: Latency::by_class(&records),
        sold_out_answers_per_second: sold_out as f64 / seconds,
        campaign,
        skus_checked: counters.len(),
        history_ledger_rows,
        stock_initial_total: counters.iter().map(|sku| sku.initial_stock).sum(),
        taken_by_successes_total: counters.iter().map(|sku| sku.taken_by_successes).sum(),
        available_total: counters.iter().map(|sku| sku.available).sum(),
        reserved_total: counters.iter().map(|sku| sku.reserved).sum(),
        skus_in_question,
        audit,
        batches,
        violations: found,
    })
}

//! The scenarios of seed 002 (sections 七 and 十) as plans: which SKUs with how much
//! stock, how many clients, when to stop, and what request number `i` is. Request
//! contents derive from the seed and the index alone, so a duplicate of request `j`
//! can be rebuilt anywhere without shared state.

use std::time::Duration;

use hyper::Method;
use hyper::body::Bytes;

use crate::client::WireRequest;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Stock 1; 100 concurrent distinct requests, 10 of them repeated 5 times.
    LastUnit,
    /// Stock 10; 1000 concurrent requests.
    Limited,
    /// Stock 100; 100 requests in 10 waves of 10 (low contention).
    Ample,
    /// One SKU with plenty of stock; N clients for a duration (throughput).
    Hot,
    /// Many SKUs chosen at random (throughput).
    Spread,
    /// Orders of 2–5 SKUs in random order (deadlock pressure).
    MultiSku,
    /// Malformed and hostile requests; each must be refused and change nothing.
    BadInput,
    /// A campaign of `--stock` units with a per-user limit; `--requests` from
    /// `--users` shoppers at once (seed 000's 秒杀, seed 002 §十一.3).
    FlashSale,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::LastUnit,
        Scenario::Limited,
        Scenario::Ample,
        Scenario::Hot,
        Scenario::Spread,
        Scenario::MultiSku,
        Scenario::BadInput,
        Scenario::FlashSale,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::LastUnit => "last-unit",
            Scenario::Limited => "limited",
            Scenario::Ample => "ample",
            Scenario::Hot => "hot",
            Scenario::Spread => "spread",
            Scenario::MultiSku => "multi-sku",
            Scenario::BadInput => "bad-input",
            Scenario::FlashSale => "flash-sale",
        }
    }

    /// Whether the scenario exists to show that deadlocks never reach a caller: then a
    /// `retry_exhausted` answer (a deadlock retried past its bound) fails the run,
    /// where elsewhere it is a refusal like any other.
    pub fn promises_no_deadlock(self) -> bool {
        self == Scenario::MultiSku
    }

    pub fn parse(text: &str) -> Result<Scenario, String> {
        Scenario::ALL
            .into_iter()
            .find(|scenario| scenario.name() == text)
            .ok_or_else(|| {
                let names: Vec<&str> = Scenario::ALL
                    .iter()
                    .map(|scenario| scenario.name())
                    .collect();
                format!(
                    "unknown scenario '{text}'; choose one of {}",
                    names.join(", ")
                )
            })
    }
}

/// Bounds on what a command line may ask for, so a typo cannot exhaust the machine.
pub const CLIENTS_MAX: usize = 4096;
pub const SKUS_MAX: usize = 1_000_000;
/// History written into the ledger before a run (`--ledger-rows`).
pub const LEDGER_ROWS_MAX: u64 = 100_000_000;
pub const REQUESTS_MAX: u64 = 100_000_000;
pub const DURATION_MAX: Duration = Duration::from_secs(3600);
pub const USERS_MAX: u64 = 100_000_000;
/// A flash sale's units: one campaign holds at most one stock movement's worth.
pub const FLASH_SALE_STOCK_MAX: i64 = domain::limits::QUANTITY_MAX;
/// One stock movement may receive at most this many units (`domain::limits`).
pub const RECEIVE_QUANTITY_MAX: i64 = domain::limits::QUANTITY_MAX;

/// What the command line asked for; `None` takes the scenario's default.
#[derive(Debug, Clone, Default)]
pub struct BenchOptions {
    pub clients: Option<usize>,
    pub duration: Option<Duration>,
    pub requests: Option<u64>,
    pub skus: Option<usize>,
    /// Lines per order, as an inclusive range.
    pub lines_per_order: Option<(usize, usize)>,
    /// Share of requests that repeat an earlier request with the same key.
    pub duplicate_ratio: Option<f64>,
    /// Flash sale: the campaign's units.
    pub stock: Option<i64>,
    /// Flash sale: distinct shoppers the requests come from.
    pub users: Option<u64>,
    /// Flash sale: most units one shopper may buy.
    pub per_user_limit: Option<i64>,
    /// Flash sale: the campaign's buckets (the server's default when absent).
    pub buckets: Option<u32>,
    /// Ledger rows of history written before the clients start (see
    /// [`Plan::history_ledger_rows`]).
    pub ledger_rows: Option<u64>,
    pub seed: u64,
}

/// The campaign a flash sale sells from: created after the SKUs, running at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CampaignSetup {
    pub quantity: i64,
    pub buckets: Option<u32>,
    pub per_user_limit: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuSetup {
    pub code: String,
    pub stock: i64,
}

/// When the clients stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    AfterRequests(u64),
    AfterDuration(Duration),
}

/// A malformed request and the refusal it must get.
#[derive(Debug, Clone)]
pub struct Malformed {
    pub label: &'static str,
    pub request: WireRequest,
    pub expected_status: u16,
    pub expected_code: &'static str,
}

/// What request number `i` is.
#[derive(Debug, Clone)]
pub enum RequestSpec {
    /// A reservation under key number `key_index`; `lines` are (SKU index, quantity).
    Reserve {
        key_index: u64,
        lines: Vec<(usize, i64)>,
    },
    Malformed(Malformed),
}

#[derive(Debug, Clone)]
pub struct Plan {
    pub scenario: Scenario,
    /// Prefixes every SKU code and idempotency key, so runs against one server never
    /// collide.
    pub run_id: String,
    pub skus: Vec<SkuSetup>,
    pub clients: usize,
    pub stop: Stop,
    /// The requests are sent in this many waves, each after the previous finished.
    pub waves: usize,
    /// When known in advance: exactly this many reservations must succeed.
    pub expected_successes: Option<u64>,
    pub duplicate_ratio: f64,
    pub lines_per_order: (usize, usize),
    pub seed: u64,
    /// A flash sale's campaign on the first SKU.
    pub campaign: Option<CampaignSetup>,
    /// Shoppers the requests come from (`user_id`); 0: requests name none.
    pub users: u64,
    /// At least this many ledger rows of history are written before the clients start,
    /// so a run measures a ledger that has grown, as a shop's does over months: pairs
    /// of `adjust` rows (+1, -1) spread evenly over the plan's SKUs, which change no
    /// counter and leave the audit clean. In-process servers only.
    pub history_ledger_rows: u64,
    malformed: Vec<Malformed>,
}

/// SplitMix64: a tiny, good-enough mixer so request `i` is a pure function of the seed.
pub fn mix(seed: u64, index: u64) -> u64 {
    let mut value = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    value = (value ^ (value >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    value ^ (value >> 31)
}

fn fraction(value: u64) -> f64 {
    (value >> 11) as f64 / (1_u64 << 53) as f64
}

impl Plan {
    pub fn new(scenario: Scenario, options: &BenchOptions, run_id: &str) -> Result<Plan, String> {
        let sku = |name: &str, stock: i64| SkuSetup {
            code: format!("bench-{run_id}-{name}"),
            stock,
        };
        let clients_or = |default: usize| options.clients.unwrap_or(default);
        let timed = |default_seconds: u64| match (options.requests, options.duration) {
            (Some(requests), _) => Stop::AfterRequests(requests),
            (None, Some(duration)) => Stop::AfterDuration(duration),
            (None, None) => Stop::AfterDuration(Duration::from_secs(default_seconds)),
        };
        let mut plan = Plan {
            scenario,
            run_id: run_id.to_owned(),
            skus: Vec::new(),
            clients: 1,
            stop: Stop::AfterRequests(0),
            waves: 1,
            expected_successes: None,
            duplicate_ratio: options.duplicate_ratio.unwrap_or(0.0),
            lines_per_order: options.lines_per_order.unwrap_or((1, 1)),
            seed: options.seed,
            campaign: None,
            users: 0,
            history_ledger_rows: options.ledger_rows.unwrap_or(0),
            malformed: Vec::new(),
        };
        match scenario {
            Scenario::LastUnit => {
                plan.skus = vec![sku("last-unit", 1)];
                plan.stop = Stop::AfterRequests(150);
                plan.clients = clients_or(150);
                plan.expected_successes = Some(1);
                plan.duplicate_ratio = 0.0;
            }
            Scenario::Limited => {
                let requests = options.requests.unwrap_or(1000);
                plan.skus = vec![sku("limited", 10)];
                plan.stop = Stop::AfterRequests(requests);
                plan.clients = clients_or(requests.min(1000) as usize);
                plan.expected_successes = Some(requests.min(10));
            }
            Scenario::Ample => {
                let requests = options.requests.unwrap_or(100);
                plan.skus = vec![sku("ample", 100)];
                plan.stop = Stop::AfterRequests(requests);
                plan.waves = 10;
                plan.clients = clients_or(10);
                plan.expected_successes = Some(requests.min(100));
            }
            Scenario::Hot => {
                plan.skus = vec![sku("hot", 50_000_000)];
                plan.stop = timed(10);
                plan.clients = clients_or(64);
            }
            Scenario::Spread => {
                let count = options.skus.unwrap_or(10_000);
                plan.skus = (0..count)
                    .map(|index| sku(&format!("spread-{index}"), 100_000))
                    .collect();
                plan.stop = timed(10);
                plan.clients = clients_or(64);
            }
            Scenario::MultiSku => {
                let count = options.skus.unwrap_or(20);
                plan.skus = (0..count)
                    .map(|index| sku(&format!("multi-{index}"), 1_000_000))
                    .collect();
                plan.stop = timed(10);
                plan.clients = clients_or(64);
                plan.lines_per_order = options.lines_per_order.unwrap_or((2, 5));
            }
            Scenario::BadInput => {
                plan.skus = vec![sku("bad-input", 5)];
                plan.malformed = malformed_requests(&plan.skus[0].code, run_id);
                let requests = options.requests.unwrap_or(plan.malformed.len() as u64);
                plan.stop = Stop::AfterRequests(requests);
                plan.clients = clients_or(16);
                plan.expected_successes = Some(0);
                plan.duplicate_ratio = 0.0;
            }
            Scenario::FlashSale => {
                let stock = options.stock.unwrap_or(1_000);
                let requests = options.requests.unwrap_or(200_000);
                let per_user_limit = options.per_user_limit.unwrap_or(1);
                plan.users = options.users.unwrap_or(50_000);
                plan.skus = vec![sku("flash-sale", stock)];
                plan.stop = Stop::AfterRequests(requests);
                plan.clients = clients_or(256);
                plan.campaign = Some(CampaignSetup {
                    quantity: stock,
                    buckets: options.buckets,
                    per_user_limit,
                });
                // Demand is far above supply (checked below), so every unit sells.
                plan.expected_successes = Some(u64::try_from(stock).unwrap_or(0));
            }
        }
        plan.check()?;
        Ok(plan)
    }

    fn check(&self) -> Result<(), String> {
        if self.clients == 0 || self.clients > CLIENTS_MAX {
            return Err(format!("--clients must be between 1 and {CLIENTS_MAX}"));
        }
        if self.skus.is_empty() || self.skus.len() > SKUS_MAX {
            return Err(format!("--skus must be between 1 and {SKUS_MAX}"));
        }
        if self.history_ledger_rows > LEDGER_ROWS_MAX {
            return Err(format!("--ledger-rows must be at most {LEDGER_ROWS_MAX}"));
        }
        match self.stop {
            Stop::AfterRequests(requests) if requests == 0 || requests > REQUESTS_MAX => {
                return Err(format!("--requests must be between 1 and {REQUESTS_MAX}"));
            }
            Stop::AfterDuration(duration) if duration.is_zero() || duration > DURATION_MAX => {
                return Err("--duration must be between 1s and 3600s".into());
            }
            _ => {}
        }
        if !(0.0..=0.9).contains(&self.duplicate_ratio) {
            return Err("--duplicate-ratio must be between 0 and 0.9".into());
        }
        let (lines_min, lines_max) = self.lines_per_order;
        if lines_min == 0
            || lines_min > lines_max
            || lines_max > domain::limits::RESERVATION_LINES_MAX
        {
            return Err("--lines-per-order must be MIN-MAX with 1 <= MIN <= MAX <= 50".into());
        }
        if let Some(campaign) = &self.campaign {
            self.check_flash_sale(campaign)?;
        }
        if lines_max > self.skus.len() {
            return Err(format!(
                "--lines-per-order asks for up to {lines_max} distinct SKUs but the scenario has {}",
                self.skus.len()
            ));
        }
        Ok(())
    }

    /// A flash sale's numbers, and demand enough that every unit must sell: at least
    /// twice as many requests as units, and shoppers enough to buy them all.
    fn check_flash_sale(&self, campaign: &CampaignSetup) -> Result<(), String> {
        if !(1..=FLASH_SALE_STOCK_MAX).contains(&campaign.quantity) {
            return Err(format!(
                "--stock must be between 1 and {FLASH_SALE_STOCK_MAX}"
            ));
        }
        if !(1..=domain::limits::QUANTITY_MAX).contains(&campaign.per_user_limit) {
            return Err("--per-user-limit must be between 1 and 1000000".into());
        }
        if self.users == 0 || self.users > USERS_MAX {
            return Err(format!("--users must be between 1 and {USERS_MAX}"));
        }
        if let Some(buckets) = campaign.buckets
            && (buckets == 0
                || buckets > domain::campaign::CAMPAIGN_BUCKETS_MAX
                || i64::from(buckets) > campaign.quantity)
        {
            return Err("--buckets must be between 1 and 64, and no more than --stock".into());
        }
        let requests = self.request_count().unwrap_or(0);
        let stock = u64::try_from(campaign.quantity).unwrap_or(u64::MAX);
        if requests < stock.saturating_mul(2) {
            return Err(format!(
                "--requests must be at least twice --stock ({}) so that every unit must sell",
                stock.saturating_mul(2)
            ));
        }
        let limit = u64::try_from(campaign.per_user_limit).unwrap_or(0);
        if self.users.saturating_mul(limit) < stock.saturating_mul(2) {
            return Err(
                "--users times --per-user-limit must be at least twice --stock so that every unit must sell"
                    .into(),
            );
        }
        Ok(())
    }

    /// The shopper of key number `key_index` (flash sale), spread over `users`.
    pub fn user_of(&self, key_index: u64) -> Option<u64> {
        (self.users > 0).then(|| mix(self.seed ^ 0xF1A5, key_index) % self.users)
    }

    /// The idempotency key of key number `key_index`.
    pub fn key(&self, key_index: u64) -> String {
        format!("bench-{}-{key_index}", self.run_id)
    }

    /// Request number `index`.
    pub fn request(&self, index: u64) -> RequestSpec {
        match self.scenario {
            Scenario::BadInput => {
                let position = (index % self.malformed.len() as u64) as usize;
                let mut malformed = self.malformed[position].clone();
                if let Some(key) = &malformed.request.idempotency_key {
                    malformed.request.idempotency_key = Some(format!("{key}-{index}"));
                }
                RequestSpec::Malformed(malformed)
            }
            Scenario::LastUnit => {
                // Requests 0..100 are distinct; 100..150 repeat keys 0..10, five times each.
                let key_index = if index < 100 {
                    index
                } else {
                    (index - 100) / 5
                };
                RequestSpec::Reserve {
                    key_index,
                    lines: vec![(0, 1)],
                }
            }
            _ => {
                let key_index = self.key_index_of(index);
                RequestSpec::Reserve {
                    key_index,
                    lines: self.lines_of(key_index),
                }
            }
        }
    }

    /// With probability `duplicate_ratio`, request `index` repeats an earlier key.
    fn key_index_of(&self, index: u64) -> u64 {
        if index == 0 || self.duplicate_ratio == 0.0 {
            return index;
        }
        let draw = mix(self.seed ^ 0xD0D0, index);
        if fraction(draw) < self.duplicate_ratio {
            mix(self.seed ^ 0xE1E1, index) % index
        } else {
            index
        }
    }

    /// The lines of key number `key_index`: distinct SKUs in random order.
    pub fn lines_of(&self, key_index: u64) -> Vec<(usize, i64)> {
        let sku_count = self.skus.len();
        let (lines_min, lines_max) = self.lines_per_order;
        let span = (lines_max - lines_min + 1) as u64;
        let line_count = lines_min + (mix(self.seed ^ 0x1111, key_index) % span) as usize;
        let mut lines: Vec<(usize, i64)> = Vec::with_capacity(line_count);
        let mut draw = 0_u64;
        while lines.len() < line_count {
            let sku = (mix(self.seed ^ 0x2222 ^ draw, key_index) % sku_count as u64) as usize;
            draw += 1;
            if !lines.iter().any(|(existing, _)| *existing == sku) {
                lines.push((sku, 1));
            }
        }
        lines
    }

    /// The HTTP request for `spec`.
    pub fn wire_request(&self, spec: &RequestSpec) -> WireRequest {
        match spec {
            RequestSpec::Reserve { key_index, lines } => {
                let body = ReserveBody {
                    lines: lines
                        .iter()
                        .map(|(sku, quantity)| ReserveLine {
                            quantity: *quantity,
                            sku: &self.skus[*sku].code,
                        })
                        .collect(),
                    ttl_seconds: domain::limits::RESERVATION_TTL_SECONDS_MAX,
                    user_id: self.user_of(*key_index).map(|user| format!("user-{user}")),
                };
                WireRequest::json(Method::POST, "/v1/reservations", &body).key(self.key(*key_index))
            }
            RequestSpec::Malformed(malformed) => malformed.request.clone(),
        }
    }

    /// Requests in a fixed-size plan, if it has one.
    pub fn request_count(&self) -> Option<u64> {
        match self.stop {
            Stop::AfterRequests(requests) => Some(requests),
            Stop::AfterDuration(_) => None,
        }
    }
}

/// A reservation's body as the lab sends it. Serialized from borrowed fields rather
/// than built as a `serde_json::Value` (a map and a string copy per field): the load
/// generator shares the server's two cores, and that was about a tenth of its
/// instructions per request (docs/BENCHMARKS.md, twenty-fourth session). The fields
/// are in the order a `Value` would write them (by name), so the bytes are the same.
#[derive(serde::Serialize)]
struct ReserveBody<'a> {
    lines: Vec<ReserveLine<'a>>,
    ttl_seconds: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    user_id: Option<String>,
}

#[derive(serde::Serialize)]
struct ReserveLine<'a> {
    quantity: i64,
    sku: &'a str,
}

fn raw(
    path: &str,
    key: Option<&str>,
    body: &str,
    content_type: Option<&'static str>,
) -> WireRequest {
    WireRequest {
        method: Method::POST,
        path: path.to_owned(),
        idempotency_key: key.map(str::to_owned),
        authorization: None,
        content_type,
        consistency_token: None,
        body: Bytes::from(body.to_owned()),
    }
}

/// The hostile and malformed inputs of seed 002 十.1 and more: every one must be
/// refused with `invalid_argument` and change nothing.
pub fn malformed_requests(sku: &str, run_id: &str) -> Vec<Malformed> {
    let json = Some("application/json");
    let line = |quantity: &str| format!(r#"{{"lines":[{{"sku":"{sku}","quantity":{quantity}}}]}}"#);
    let key = format!("bench-{run_id}-bad");
    let key = Some(key.as_str());
    let invalid = |label, request| Malformed {
        label,
        request,
        expected_status: 400,
        expected_code: "invalid_argument",
    };
    vec![
        invalid("quantity 0", raw("/v1/reservations", key, &line("0"), json)),
        invalid(
            "quantity -1",
            raw("/v1/reservations", key, &line("-1"), json),
        ),
        invalid(
            "quantity 2^63",
            raw("/v1/reservations", key, &line("9223372036854775808"), json),
        ),
        invalid(
            "quantity 1e30",
            raw("/v1/reservations", key, &line("1e30"), json),
        ),
        invalid(
            "quantity 1.5",
            raw("/v1/reservations", key, &line("1.5"), json),
        ),
        invalid(
            "quantity \"3\"",
            raw("/v1/reservations", key, &line("\"3\""), json),
        ),
        invalid(
            "quantity null",
            raw("/v1/reservations", key, &line("null"), json),
        ),
        invalid(
            "quantity above the limit",
            raw("/v1/reservations", key, &line("1000001"), json),
        ),
        invalid(
            "no lines",
            raw("/v1/reservations", key, r#"{"lines":[]}"#, json),
        ),
        invalid(
            "unknown field",
            raw(
                "/v1/reservations",
                key,
                &line("1").replace("]}", r#"],"admin":true}"#),
                json,
            ),
        ),
        invalid(
            "SQL in the sku",
            raw(
                "/v1/reservations",
                key,
                r#"{"lines":[{"sku":"x'; DROP TABLE stock;--","quantity":1}]}"#,
                json,
            ),
        ),
        invalid(
            "not JSON",
            raw("/v1/reservations", key, "{\"lines\":", json),
        ),
        invalid(
            "no Idempotency-Key",
            raw("/v1/reservations", None, &line("1"), json),
        ),
        Malformed {
            label: "not declared as JSON",
            request: raw("/v1/reservations", key, &line("1"), Some("text/plain")),
            expected_status: 415,
            expected_code: "invalid_argument",
        },
        Malformed {
            label: "body over 64 KiB",
            request: raw(
                "/v1/reservations",
                key,
                &format!(
                    r#"{{"lines":[{{"sku":"{sku}","quantity":1}}],"pad":"{}"}}"#,
                    "x".repeat(70_000)
                ),
                json,
            ),
            expected_status: 413,
            expected_code: "invalid_argument",
        },
        Malformed {
            label: "receive without the admin token",
            request: raw(
                &format!("/v1/skus/{sku}/stock-movements"),
                key,
                r#"{"kind":"receive","quantity":1000}"#,
                json,
            ),
            expected_status: 401,
            expected_code: "unauthorized",
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(scenario: Scenario, options: BenchOptions) -> Plan {
        Plan::new(scenario, &options, "t").unwrap()
    }

    #[test]
    fn last_unit_sends_a_hundred_distinct_keys_and_repeats_ten_of_them_five_times() {
        let plan = plan(Scenario::LastUnit, BenchOptions::default());
        assert_eq!(plan.stop, Stop::AfterRequests(150));
        let mut uses = std::collections::HashMap::new();
        for index in 0..150 {
            let RequestSpec::Reserve { key_index, .. } = plan.request(index) else {
                panic!()
            };
            *uses.entry(key_index).or_insert(0) += 1;
        }
        assert_eq!(uses.len(), 100);
        assert_eq!(uses.values().filter(|count| **count == 6).count(), 10);
        assert_eq!(plan.skus[0].stock, 1);
        assert_eq!(plan.expected_successes, Some(1));
    }

    /// The body as the lab built it before it serialized typed fields: a document of
    /// `serde_json::Value`s, which writes its keys in name order.
    fn reservation_body_as_a_document(
        plan: &Plan,
        key_index: u64,
        lines: &[(usize, i64)],
    ) -> String {
        let lines: Vec<serde_json::Value> = lines
            .iter()
            .map(|(sku, quantity)| {
                serde_json::json!({"sku": plan.skus[*sku].code, "quantity": quantity})
            })
            .collect();
        let mut body = serde_json::json!({"lines": lines, "ttl_seconds": domain::limits::RESERVATION_TTL_SECONDS_MAX});
        if let Some(user) = plan.user_of(key_index) {
            body["user_id"] = serde_json::json!(format!("user-{user}"));
        }
        body.to_string()
    }

    #[test]
    fn a_reservation_body_is_byte_for_byte_the_document_it_replaced() {
        let flash_sale = plan(Scenario::FlashSale, BenchOptions::default());
        let multi_sku = plan(Scenario::MultiSku, BenchOptions::default());
        for plan in [&flash_sale, &multi_sku] {
            for key_index in 0..200 {
                let lines = plan.lines_of(key_index);
                let expected = reservation_body_as_a_document(plan, key_index, &lines);
                let request = plan.wire_request(&RequestSpec::Reserve { key_index, lines });
                assert_eq!(std::str::from_utf8(&request.body).unwrap(), expected);
                assert_eq!(request.content_type, Some("application/json"));
            }
        }
        // Quantities the plans never choose, and a code that needs escaping.
        let mut odd = plan(Scenario::MultiSku, BenchOptions::default());
        odd.skus[0].code = "TEA \"green\" \\ 茶".into();
        let lines = vec![(0, i64::MAX), (1, -1), (0, 0)];
        let expected = reservation_body_as_a_document(&odd, 7, &lines);
        let request = odd.wire_request(&RequestSpec::Reserve {
            key_index: 7,
            lines,
        });
        assert_eq!(std::str::from_utf8(&request.body).unwrap(), expected);
        assert!(
            flash_sale.user_of(0).is_some(),
            "the flash sale names users"
        );
        assert!(multi_sku.user_of(0).is_none(), "multi-sku names none");
    }

    #[test]
    fn limited_expects_exactly_as_many_successes_as_units() {
        let plan = plan(Scenario::Limited, BenchOptions::default());
        assert_eq!(
            (plan.skus[0].stock, plan.expected_successes),
            (10, Some(10))
        );
        assert_eq!(plan.request_count(), Some(1000));
    }

    #[test]
    fn duplicates_repeat_an_earlier_key_with_the_same_lines() {
        let options = BenchOptions {
            duplicate_ratio: Some(0.5),
            skus: Some(50),
            ..BenchOptions::default()
        };
        let plan = plan(Scenario::Spread, options);
        let mut duplicates = 0;
        for index in 1..2000 {
            let RequestSpec::Reserve { key_index, lines } = plan.request(index) else {
                panic!()
            };
            assert!(key_index <= index);
            assert_eq!(
                lines,
                plan.lines_of(key_index),
                "a key always carries the same body"
            );
            if key_index != index {
                duplicates += 1;
            }
        }
        assert!(
            (800..1200).contains(&duplicates),
            "about half are duplicates: {duplicates}"
        );
    }

    #[test]
    fn multi_sku_orders_hold_two_to_five_distinct_skus() {
        let plan = plan(Scenario::MultiSku, BenchOptions::default());
        for key_index in 0..500 {
            let lines = plan.lines_of(key_index);
            assert!((2..=5).contains(&lines.len()));
            let mut skus: Vec<usize> = lines.iter().map(|(sku, _)| *sku).collect();
            skus.sort_unstable();
            skus.dedup();
            assert_eq!(skus.len(), lines.len(), "no SKU twice in one order");
        }
    }

    #[test]
    fn every_bad_input_request_expects_a_client_error() {
        let plan = plan(Scenario::BadInput, BenchOptions::default());
        for index in 0..plan.request_count().unwrap() {
            let RequestSpec::Malformed(malformed) = plan.request(index) else {
                panic!()
            };
            assert!(
                (400..500).contains(&malformed.expected_status),
                "{}",
                malformed.label
            );
        }
    }

    #[test]
    fn out_of_range_options_are_refused() {
        for options in [
            BenchOptions {
                clients: Some(0),
                ..BenchOptions::default()
            },
            BenchOptions {
                clients: Some(CLIENTS_MAX + 1),
                ..BenchOptions::default()
            },
            BenchOptions {
                duplicate_ratio: Some(1.5),
                ..BenchOptions::default()
            },
            BenchOptions {
                lines_per_order: Some((3, 2)),
                ..BenchOptions::default()
            },
            BenchOptions {
                requests: Some(0),
                ..BenchOptions::default()
            },
        ] {
            assert!(
                Plan::new(Scenario::Hot, &options, "t").is_err(),
                "{options:?}"
            );
        }
    }

    #[test]
    fn a_flash_sale_spreads_its_requests_over_its_shoppers_and_expects_every_unit_sold() {
        let options = BenchOptions {
            stock: Some(10),
            users: Some(100),
            requests: Some(1_000),
            ..BenchOptions::default()
        };
        let plan = plan(Scenario::FlashSale, options);
        assert_eq!(plan.expected_successes, Some(10));
        assert_eq!(
            plan.campaign.as_ref().map(|campaign| campaign.quantity),
            Some(10)
        );
        let users: std::collections::HashSet<u64> =
            (0..1_000).filter_map(|key| plan.user_of(key)).collect();
        assert!(users.len() > 90 && users.iter().all(|user| *user < 100));
        let body = String::from_utf8_lossy(&plan.wire_request(&plan.request(7)).body).into_owned();
        assert!(body.contains("\"user_id\":\"user-"), "{body}");
    }

    #[test]
    fn a_flash_sale_without_demand_enough_to_sell_out_is_refused() {
        for options in [
            BenchOptions {
                stock: Some(100),
                requests: Some(150),
                ..BenchOptions::default()
            },
            BenchOptions {
                stock: Some(100),
                users: Some(10),
                per_user_limit: Some(1),
                ..BenchOptions::default()
            },
            BenchOptions {
                stock: Some(3),
                buckets: Some(4),
                ..BenchOptions::default()
            },
        ] {
            assert!(
                Plan::new(Scenario::FlashSale, &options, "t").is_err(),
                "{options:?}"
            );
        }
    }

    #[test]
    fn scenario_names_round_trip() {
        for scenario in Scenario::ALL {
            assert_eq!(Scenario::parse(scenario.name()), Ok(scenario));
        }
        assert!(Scenario::parse("fast").is_err());
    }
}

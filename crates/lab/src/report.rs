//! What a run found: outcomes split by class, latency percentiles, throughput, final
//! counters, the audit — and the violations that make the command fail: an oversell, a
//! duplicate effect, an unexplained failure, an unclean audit, a missed expectation.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

/// How one answer is counted. Insufficient stock is a business outcome, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Success,
    ReplayedDuplicate,
    InsufficientStock,
    PurchaseLimitExceeded,
    RateLimited,
    RequestInProgress,
    LockTimeout,
    RetryExhausted,
    Unavailable,
    InvalidArgument,
    Other,
}

impl Class {
    pub const ALL: [Class; 11] = [
        Class::Success,
        Class::ReplayedDuplicate,
        Class::InsufficientStock,
        Class::PurchaseLimitExceeded,
        Class::RateLimited,
        Class::RequestInProgress,
        Class::LockTimeout,
        Class::RetryExhausted,
        Class::Unavailable,
        Class::InvalidArgument,
        Class::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Success => "success",
            Class::ReplayedDuplicate => "replayed duplicate",
            Class::InsufficientStock => "insufficient stock",
            Class::PurchaseLimitExceeded => "purchase limit",
            Class::RateLimited => "rate limited",
            Class::RequestInProgress => "request in progress",
            Class::LockTimeout => "lock timeout",
            Class::RetryExhausted => "retry exhausted",
            Class::Unavailable => "unavailable",
            Class::InvalidArgument => "invalid argument",
            Class::Other => "other",
        }
    }
}

/// Sorts an answer into its class. `status` 0 means no answer (transport failure).
pub fn classify(status: u16, code: Option<&str>, replayed: bool) -> Class {
    if replayed {
        return Class::ReplayedDuplicate;
    }
    if (200..300).contains(&status) {
        return Class::Success;
    }
    match code {
        Some("insufficient_stock") => Class::InsufficientStock,
        Some("purchase_limit_exceeded") => Class::PurchaseLimitExceeded,
        Some("rate_limited") => Class::RateLimited,
        Some("request_in_progress") => Class::RequestInProgress,
        Some("lock_timeout") => Class::LockTimeout,
        Some("retry_exhausted") => Class::RetryExhausted,
        Some("unavailable") => Class::Unavailable,
        Some("invalid_argument") => Class::InvalidArgument,
        _ => Class::Other,
    }
}

/// One request as the client saw it.
#[derive(Debug, Clone)]
pub struct Record {
    /// The request number in the plan.
    pub index: u64,
    /// The idempotency key number, for reservations.
    pub key_index: Option<u64>,
    pub status: u16,
    pub code: Option<String>,
    pub replayed: bool,
    /// A hash of the body, to check replays return the first answer.
    pub body_hash: u64,
    pub latency_microseconds: u64,
    /// What a malformed request was expected to get, if it was one.
    pub expected: Option<(&'static str, u16, &'static str)>,
    /// Transport error text, if no answer came.
    pub error: Option<String>,
    /// A refusal an instance gave from its memory (a sold-out SKU or campaign, a
    /// shopper at the limit): stored under no key, so another copy of the request is
    /// answered afresh, not replayed.
    pub from_memory: bool,
}

impl Record {
    pub fn class(&self) -> Class {
        classify(self.status, self.code.as_deref(), self.replayed)
    }

    /// Whether the server stored this answer under its key (so later requests with the
    /// key must replay it). Transient refusals and validation errors are not stored.
    fn stored_fresh(&self) -> bool {
        !self.replayed
            && !self.from_memory
            && self.error.is_none()
            && (self.status < 500)
            && !matches!(
                self.code.as_deref(),
                Some("invalid_argument" | "request_in_progress")
            )
            && !matches!(self.status, 401 | 413 | 415 | 422 | 429)
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    pub p50_milliseconds: f64,
    pub p95_milliseconds: f64,
    pub p99_milliseconds: f64,
    pub max_milliseconds: f64,
    pub mean_milliseconds: f64,
}

impl Latency {
    /// The latency of every class that answered.
    pub fn by_class(records: &[Record]) -> BTreeMap<Class, Latency> {
        let mut by_class: BTreeMap<Class, Vec<u64>> = BTreeMap::new();
        for record in records {
            by_class
                .entry(record.class())
                .or_default()
                .push(record.latency_microseconds);
        }
        by_class
            .into_iter()
            .map(|(class, latencies)| (class, Latency::of_microseconds(latencies)))
            .collect()
    }

    pub fn of(records: &[Record]) -> Latency {
        Latency::of_microseconds(records.iter().map(|record| record.latency_microseconds))
    }

    /// Percentiles of latencies given in microseconds (recorded up to ten minutes,
    /// three significant digits).
    pub fn of_microseconds(latencies: impl IntoIterator<Item = u64>) -> Latency {
        let Ok(mut histogram) = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)
        else {
            return Latency::default();
        };
        for latency in latencies {
            let _ = histogram.record(latency.clamp(1, 600_000_000));
        }
        if histogram.is_empty() {
            return Latency::default();
        }
        let milliseconds = |microseconds: u64| microseconds as f64 / 1000.0;
        Latency {
            p50_milliseconds: milliseconds(histogram.value_at_quantile(0.50)),
            p95_milliseconds: milliseconds(histogram.value_at_quantile(0.95)),
            p99_milliseconds: milliseconds(histogram.value_at_quantile(0.99)),
            max_milliseconds: milliseconds(histogram.max()),
            mean_milliseconds: histogram.mean() / 1000.0,
        }
    }
}

/// A SKU's counters read back after the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkuCounters {
    pub code: String,
    pub initial_stock: i64,
    /// Units the fresh successes took, by the client's count.
    pub taken_by_successes: i64,
    pub available: i64,
    pub reserved: i64,
}

/// A flash sale's campaign as the server reports it after the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CampaignSummary {
    pub campaign_id: String,
    pub quantity: i64,
    pub buckets: usize,
    /// The limit the run asked for, which the shoppers are judged by.
    pub per_user_limit: i64,
    /// The limit the campaign shows.
    pub per_user_limit_shown: i64,
    pub sold: i64,
    pub held: i64,
    pub left: i64,
    /// Shoppers who got at least one unit, and the most units any one of them got.
    pub buyers: u64,
    pub most_units_one_buyer_got: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AuditSummary {
    pub ok: bool,
    pub differences_total: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: &'static str,
    pub target: String,
    pub backend: String,
    pub clients: usize,
    pub requests_sent: u64,
    pub elapsed_seconds: f64,
    pub requests_per_second: f64,
    pub successes_per_second: f64,
    pub classes: BTreeMap<Class, u64>,
    pub latency: Latency,
    pub latency_of_successes: Latency,
    /// Latency of each class that answered at least once.
    pub latency_by_class: BTreeMap<Class, Latency>,
    /// `insufficient_stock` answers per second of the run: how fast "sold out" is said.
    pub sold_out_answers_per_second: f64,
    /// The flash sale's campaign, read back.
    pub campaign: Option<CampaignSummary>,
    pub skus_checked: usize,
    /// Ledger rows of history written before the clients started.
    pub history_ledger_rows: u64,
    /// Totals over every SKU of the scenario.
    pub stock_initial_total: i64,
    pub taken_by_successes_total: i64,
    pub available_total: i64,
    pub reserved_total: i64,
    /// SKUs whose counters disagree with what the clients saw (at most 20 listed).
    pub skus_in_question: Vec<SkuCounters>,
    pub audit: AuditSummary,
    /// The server's combiner batches, read from its `/metrics` after the run.
    pub batches: Option<BatchSizes>,
    pub violations: Vec<String>,
}

/// How many reservations the server's combiner folded into each transaction.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BatchSizes {
    pub batches: u64,
    pub mean: f64,
    /// (upper bound, batches of at most that size), cumulative as Prometheus gives it.
    pub cumulative: Vec<(String, u64)>,
}

impl BatchSizes {
    /// Reads `stockd_combiner_batch_size` out of a Prometheus text page.
    pub fn parse(page: &str) -> Option<BatchSizes> {
        let mut sizes = BatchSizes::default();
        let mut sum = 0.0;
        for line in page.lines() {
            let Some((name, value)) = line.rsplit_once(' ') else {
                continue;
            };
            if let Some(rest) = name.strip_prefix("stockd_combiner_batch_size_bucket{le=\"") {
                let bound = rest.trim_end_matches("\"}").to_owned();
                sizes
                    .cumulative
                    .push((bound, value.parse::<f64>().ok()? as u64));
            } else if name == "stockd_combiner_batch_size_sum" {
                sum = value.parse().ok()?;
            } else if name == "stockd_combiner_batch_size_count" {
                sizes.batches = value.parse::<f64>().ok()? as u64;
            }
        }
        if sizes.batches == 0 {
            return None;
        }
        sizes.mean = sum / sizes.batches as f64;
        Some(sizes)
    }

    /// `≤1 12%, ≤2 20%, …` — the share of batches up to each bound.
    pub fn render(&self) -> String {
        let shares: Vec<String> = self
            .cumulative
            .iter()
            .map(|(bound, count)| {
                format!(
                    "<={bound} {:.0}%",
                    *count as f64 * 100.0 / self.batches as f64
                )
            })
            .collect();
        format!(
            "{} batches, mean {:.1} reservations; {}",
            self.batches,
            self.mean,
            shares.join(", ")
        )
    }
}

impl Report {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn count(&self, class: Class) -> u64 {
        self.classes.get(&class).copied().unwrap_or(0)
    }
}

/// Units each SKU's fresh successes took, from the plan's lines.
pub fn taken_by_successes(
    records: &[Record],
    lines_of_key: impl Fn(u64) -> Vec<(usize, i64)>,
    sku_count: usize,
) -> Vec<i64> {
    let mut taken = vec![0_i64; sku_count];
    for record in records {
        if record.class() == Class::Success
            && let Some(key_index) = record.key_index
        {
            for (sku, quantity) in lines_of_key(key_index) {
                taken[sku] += quantity;
            }
        }
    }
    taken
}

/// Units each shopper's fresh successes took (one unit per success: a flash sale's
/// requests ask for one), by `user_of` of the success's key.
pub fn units_by_user(
    records: &[Record],
    user_of: impl Fn(u64) -> Option<u64>,
) -> HashMap<u64, i64> {
    let mut units = HashMap::new();
    for record in records {
        if record.class() == Class::Success
            && let Some(user) = record.key_index.and_then(&user_of)
        {
            *units.entry(user).or_insert(0) += 1;
        }
    }
    units
}

/// A flash sale's own judgement: the campaign sold out exactly (nothing left, sold and
/// held adding up to its units), and no shopper got more than the limit.
pub fn campaign_violations(campaign: &CampaignSummary) -> Vec<String> {
    let mut found = Vec::new();
    if campaign.left != 0 || campaign.sold + campaign.held != campaign.quantity {
        found.push(format!(
            "campaign {}: {} units, but sold {} + held {} with {} left",
            campaign.campaign_id, campaign.quantity, campaign.sold, campaign.held, campaign.left
        ));
    }
    if campaign.per_user_limit_shown != campaign.per_user_limit {
        found.push(format!(
            "campaign {}: shows a per-user limit of {}, the run asked for {}",
            campaign.campaign_id, campaign.per_user_limit_shown, campaign.per_user_limit
        ));
    }
    if campaign.most_units_one_buyer_got > campaign.per_user_limit {
        found.push(format!(
            "PURCHASE LIMIT: a shopper got {} units, the limit is {}",
            campaign.most_units_one_buyer_got, campaign.per_user_limit
        ));
    }
    found
}

/// A fixed-size plan whose answers are not all recorded: a client that ended early
/// (a panic) took its answers with it, and what it sent was never judged.
pub fn missing_answers(planned: Option<u64>, recorded: usize) -> Option<String> {
    let planned = planned?;
    (recorded as u64 != planned)
        .then(|| format!("{planned} requests in the plan, {recorded} answers recorded"))
}

/// The deadlocks that reached callers: requests answered `retry_exhausted` (their
/// unit of work was rolled back by deadlocks past its retries). A scenario that
/// promises none ([`crate::scenario::Scenario::promises_no_deadlock`]) fails on any.
pub fn surfaced_deadlocks(records: &[Record]) -> Option<String> {
    let count = records
        .iter()
        .filter(|record| record.expected.is_none() && record.class() == Class::RetryExhausted)
        .count();
    (count > 0)
        .then(|| format!("a deadlock reached callers: {count} requests answered retry_exhausted"))
}

/// Everything that makes a run fail, in words an operator can act on.
pub fn violations(
    records: &[Record],
    counters: &[SkuCounters],
    audit: &AuditSummary,
    expected_successes: Option<u64>,
) -> Vec<String> {
    let mut found = Vec::new();

    let mut answers_by_key: HashMap<u64, Vec<&Record>> = HashMap::new();
    for record in records {
        if let Some(key_index) = record.key_index {
            answers_by_key.entry(key_index).or_default().push(record);
        }
    }
    let mut duplicate_effects = 0;
    let mut replay_mismatches = 0;
    for answers in answers_by_key.values() {
        let stored: Vec<&&Record> = answers
            .iter()
            .filter(|record| record.stored_fresh())
            .collect();
        if stored.len() > 1 {
            duplicate_effects += 1;
        }
        if let Some(first) = stored.first() {
            replay_mismatches += answers
                .iter()
                .filter(|record| {
                    record.replayed
                        && (record.status, record.body_hash) != (first.status, first.body_hash)
                })
                .count();
        }
    }
    if duplicate_effects > 0 {
        found.push(format!(
            "duplicate effect: {duplicate_effects} keys were executed more than once"
        ));
    }
    if replay_mismatches > 0 {
        found.push(format!(
            "{replay_mismatches} replays differ from the first answer for their key"
        ));
    }

    for sku in counters {
        if sku.taken_by_successes > sku.initial_stock {
            found.push(format!(
                "OVERSELL: {} had {} units but successes took {}",
                sku.code, sku.initial_stock, sku.taken_by_successes
            ));
        }
        if sku.available < 0 || sku.reserved < 0 {
            found.push(format!(
                "{}: a counter is negative ({} / {})",
                sku.code, sku.available, sku.reserved
            ));
        }
        if sku.available + sku.reserved != sku.initial_stock {
            found.push(format!(
                "{}: on hand is {} but {} were received",
                sku.code,
                sku.available + sku.reserved,
                sku.initial_stock
            ));
        }
        if sku.reserved != sku.taken_by_successes {
            found.push(format!(
                "{}: {} units reserved but the clients saw successes take {}",
                sku.code, sku.reserved, sku.taken_by_successes
            ));
        }
    }

    let successes = records
        .iter()
        .filter(|record| record.class() == Class::Success)
        .count() as u64;
    match expected_successes {
        Some(expected) if successes != expected => found.push(format!(
            "expected exactly {expected} successes, saw {successes}"
        )),
        // A run with stock to sell and no count known in advance (the timed ones) must
        // still sell: one that saw only refusals (every answer 503, say) measured
        // nothing, however well each failure is explained.
        None if successes == 0 => {
            found.push("no reservation succeeded: the run measured refusals only".to_owned())
        }
        _ => {}
    }

    let mut unexplained: BTreeMap<String, u64> = BTreeMap::new();
    for record in records {
        if let Some((label, status, code)) = record.expected {
            if record.status != status || record.code.as_deref() != Some(code) {
                *unexplained
                    .entry(format!(
                        "'{label}' answered {} {} instead of {status} {code}",
                        record.status,
                        record.code.as_deref().unwrap_or("-")
                    ))
                    .or_insert(0) += 1;
            }
            continue;
        }
        if let Some(error) = &record.error {
            *unexplained
                .entry(format!("no answer: {error}"))
                .or_insert(0) += 1;
        } else if matches!(record.class(), Class::Other | Class::InvalidArgument) {
            // The lab's own requests (those not made malformed on purpose) are
            // valid: a refusal of them as invalid is the lab's or the server's fault.
            *unexplained
                .entry(format!(
                    "unexplained answer {} {}",
                    record.status,
                    record.code.as_deref().unwrap_or("-")
                ))
                .or_insert(0) += 1;
        }
    }
    for (what, count) in unexplained {
        found.push(format!("{what} (x{count})"));
    }

    if !audit.ok {
        found.push(format!(
            "the audit is not clean: {} differences",
            audit.differences_total
        ));
    }
    found
}

pub fn class_counts(records: &[Record]) -> BTreeMap<Class, u64> {
    let mut counts: BTreeMap<Class, u64> = Class::ALL.iter().map(|class| (*class, 0)).collect();
    for record in records {
        *counts.entry(record.class()).or_insert(0) += 1;
    }
    counts
}

impl Report {
    /// The human-readable summary printed after a run.
    pub fn render_text(&self) -> String {
        let mut text = String::new();
        let mut line = |content: String| {
            text.push_str(&content);
            text.push('\n');
        };
        line(format!(
            "scenario {} on {} ({}), {} clients",
            self.scenario, self.target, self.backend, self.clients
        ));
        line(format!(
            "requests {}  in {:.2} s  = {:.0} requests/s, {:.0} successes/s",
            self.requests_sent,
            self.elapsed_seconds,
            self.requests_per_second,
            self.successes_per_second
        ));
        line(format!(
            "latency ms  p50 {:.2}  p95 {:.2}  p99 {:.2}  max {:.2}",
            self.latency.p50_milliseconds,
            self.latency.p95_milliseconds,
            self.latency.p99_milliseconds,
            self.latency.max_milliseconds
        ));
        line("outcomes               count     p50 ms   p95 ms   p99 ms".to_owned());
        for (class, count) in &self.classes {
            if *count > 0 || matches!(class, Class::Success | Class::Other) {
                let latency = self
                    .latency_by_class
                    .get(class)
                    .cloned()
                    .unwrap_or_default();
                line(format!(
                    "  {:<20}{count:>7}  {:>8.2} {:>8.2} {:>8.2}",
                    class.name(),
                    latency.p50_milliseconds,
                    latency.p95_milliseconds,
                    latency.p99_milliseconds
                ));
            }
        }
        if let Some(campaign) = &self.campaign {
            line(format!(
                "campaign {}  {} units in {} buckets, limit {} per shopper: sold {}  held {}  left {}",
                campaign.campaign_id,
                campaign.quantity,
                campaign.buckets,
                campaign.per_user_limit,
                campaign.sold,
                campaign.held,
                campaign.left
            ));
            line(format!(
                "buyers {} (at most {} units each)  sold-out answers {:.0}/s",
                campaign.buyers,
                campaign.most_units_one_buyer_got,
                self.sold_out_answers_per_second
            ));
        } else if self.sold_out_answers_per_second > 0.0 {
            line(format!(
                "sold-out answers {:.0}/s",
                self.sold_out_answers_per_second
            ));
        }
        line(format!(
            "stock  received {}  available {}  reserved {}  ({} SKUs checked)",
            self.stock_initial_total, self.available_total, self.reserved_total, self.skus_checked
        ));
        if self.history_ledger_rows > 0 {
            line(format!(
                "ledger {} rows of history written before the clients started",
                self.history_ledger_rows
            ));
        }
        if let Some(batches) = &self.batches {
            line(format!("batches {}", batches.render()));
        }
        line(format!(
            "audit  {} ({} differences)",
            if self.audit.ok { "clean" } else { "NOT CLEAN" },
            self.audit.differences_total
        ));
        if self.violations.is_empty() {
            line(
                "result PASS: no oversell, no duplicate effect, every failure explained".to_owned(),
            );
        } else {
            line("result FAIL".to_owned());
            for violation in &self.violations {
                line(format!("  - {violation}"));
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        key_index: u64,
        status: u16,
        code: Option<&str>,
        replayed: bool,
        body_hash: u64,
    ) -> Record {
        Record {
            index: 0,
            key_index: Some(key_index),
            status,
            code: code.map(str::to_owned),
            replayed,
            body_hash,
            latency_microseconds: 1000,
            expected: None,
            error: None,
            from_memory: false,
        }
    }

    fn counters(initial: i64, taken: i64, available: i64, reserved: i64) -> Vec<SkuCounters> {
        vec![SkuCounters {
            code: "S".into(),
            initial_stock: initial,
            taken_by_successes: taken,
            available,
            reserved,
        }]
    }

    fn clean() -> AuditSummary {
        AuditSummary {
            ok: true,
            differences_total: 0,
        }
    }

    fn sale(sold: i64, held: i64, left: i64, most: i64) -> CampaignSummary {
        CampaignSummary {
            campaign_id: "cmp_x".into(),
            quantity: 10,
            buckets: 4,
            per_user_limit: 1,
            per_user_limit_shown: 1,
            sold,
            held,
            left,
            buyers: 10,
            most_units_one_buyer_got: most,
        }
    }

    #[test]
    fn a_flash_sale_fails_when_units_are_left_or_a_shopper_passed_the_limit() {
        assert!(campaign_violations(&sale(0, 10, 0, 1)).is_empty());
        assert_eq!(campaign_violations(&sale(0, 9, 1, 1)).len(), 1);
        assert_eq!(campaign_violations(&sale(0, 10, 0, 2)).len(), 1);
    }

    #[test]
    fn a_run_missing_answers_fails_and_a_timed_run_is_not_counted() {
        assert!(missing_answers(Some(1000), 1000).is_none());
        assert!(missing_answers(Some(1000), 995).is_some());
        assert!(missing_answers(None, 995).is_none());
    }

    #[test]
    fn a_flash_sale_is_judged_by_the_limit_the_run_asked_for_not_the_one_the_server_shows() {
        // The server stored 5 where 1 was asked, and a shopper got 3: both are found.
        let stored_wrong = CampaignSummary {
            per_user_limit_shown: 5,
            ..sale(0, 10, 0, 3)
        };
        let found = campaign_violations(&stored_wrong);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found
                .iter()
                .any(|violation| violation.contains("PURCHASE LIMIT"))
        );
    }

    #[test]
    fn units_are_counted_per_shopper_from_fresh_successes_only() {
        let records = vec![
            record(1, 201, None, false, 1),
            record(2, 201, None, false, 2),
            record(2, 201, None, true, 2),
            record(3, 409, Some("purchase_limit_exceeded"), false, 3),
        ];
        let units = units_by_user(&records, |key| Some(key % 2));
        assert_eq!(units.get(&1), Some(&1));
        assert_eq!(units.get(&0), Some(&1));
        assert_eq!(
            classify(429, Some("rate_limited"), false),
            Class::RateLimited
        );
    }

    #[test]
    fn batch_sizes_are_read_from_a_prometheus_page() {
        let page = "# TYPE stockd_combiner_batch_size histogram\n\
            stockd_combiner_batch_size_bucket{le=\"1\"} 2\n\
            stockd_combiner_batch_size_bucket{le=\"64\"} 10\n\
            stockd_combiner_batch_size_bucket{le=\"+Inf\"} 10\n\
            stockd_combiner_batch_size_sum 202\n\
            stockd_combiner_batch_size_count 10\n";
        let sizes = BatchSizes::parse(page).unwrap();
        assert_eq!(sizes.batches, 10);
        assert!((sizes.mean - 20.2).abs() < 1e-9);
        assert_eq!(sizes.cumulative[0], ("1".to_owned(), 2));
        assert!(BatchSizes::parse("nothing here").is_none());
    }

    #[test]
    fn answers_are_classified_by_replay_status_and_code() {
        assert_eq!(classify(201, None, false), Class::Success);
        assert_eq!(classify(201, None, true), Class::ReplayedDuplicate);
        assert_eq!(
            classify(409, Some("insufficient_stock"), true),
            Class::ReplayedDuplicate
        );
        assert_eq!(
            classify(409, Some("insufficient_stock"), false),
            Class::InsufficientStock
        );
        assert_eq!(
            classify(503, Some("lock_timeout"), false),
            Class::LockTimeout
        );
        assert_eq!(
            classify(503, Some("retry_exhausted"), false),
            Class::RetryExhausted
        );
        assert_eq!(
            classify(503, Some("unavailable"), false),
            Class::Unavailable
        );
        assert_eq!(
            classify(400, Some("invalid_argument"), false),
            Class::InvalidArgument
        );
        assert_eq!(classify(500, Some("internal"), false), Class::Other);
        assert_eq!(classify(0, None, false), Class::Other);
    }

    /// Found in review: the release gate's `multi-sku` item promises that no deadlock
    /// reaches a caller, but a `retry_exhausted` answer was a refusal like any other,
    /// and the run held.
    #[test]
    fn a_retry_exhausted_answer_is_a_surfaced_deadlock() {
        let refused = record(0, 409, Some("insufficient_stock"), false, 1);
        let deadlocked = record(1, 503, Some("retry_exhausted"), false, 2);
        assert_eq!(surfaced_deadlocks(std::slice::from_ref(&refused)), None);
        let found = surfaced_deadlocks(&[refused, deadlocked]).expect("one surfaced");
        assert!(found.contains("1 requests"), "{found}");
        assert!(crate::scenario::Scenario::MultiSku.promises_no_deadlock());
        assert!(!crate::scenario::Scenario::Hot.promises_no_deadlock());
    }

    #[test]
    fn a_clean_run_has_no_violations() {
        let records = vec![
            record(0, 201, None, false, 7),
            record(0, 201, None, true, 7),
            record(1, 409, Some("insufficient_stock"), false, 9),
        ];
        assert!(violations(&records, &counters(1, 1, 0, 1), &clean(), Some(1)).is_empty());
    }

    #[test]
    fn more_taken_than_received_is_an_oversell() {
        let records = vec![
            record(0, 201, None, false, 1),
            record(1, 201, None, false, 2),
        ];
        let found = violations(&records, &counters(1, 2, 0, 1), &clean(), None);
        assert!(
            found
                .iter()
                .any(|violation| violation.starts_with("OVERSELL")),
            "{found:?}"
        );
    }

    #[test]
    fn refusals_from_memory_are_not_stored_answers_and_two_of_them_are_no_duplicate_effect() {
        let from_memory = || Record {
            from_memory: true,
            ..record(7, 409, Some("insufficient_stock"), false, 9)
        };
        let duplicate_effect = |records: &[Record]| {
            violations(records, &counters(1, 0, 1, 0), &clean(), None)
                .iter()
                .any(|violation| violation.starts_with("duplicate effect"))
        };
        assert!(!duplicate_effect(&[from_memory(), from_memory()]));
        let stored = || record(7, 409, Some("insufficient_stock"), false, 9);
        assert!(duplicate_effect(&[stored(), stored()]));
    }

    #[test]
    fn a_key_executed_twice_is_a_duplicate_effect() {
        let records = vec![
            record(0, 201, None, false, 1),
            record(0, 201, None, false, 2),
        ];
        let found = violations(&records, &counters(5, 2, 3, 2), &clean(), None);
        assert!(
            found
                .iter()
                .any(|violation| violation.starts_with("duplicate effect")),
            "{found:?}"
        );
    }

    #[test]
    fn a_run_with_no_success_count_known_that_sold_nothing_fails() {
        let refused = vec![
            record(0, 503, Some("unavailable"), false, 1),
            record(1, 503, Some("lock_timeout"), false, 2),
        ];
        let found = violations(&refused, &counters(5, 0, 5, 0), &clean(), None);
        assert!(
            found
                .iter()
                .any(|violation| violation.starts_with("no reservation succeeded")),
            "{found:?}"
        );
    }

    #[test]
    fn a_valid_request_refused_as_invalid_is_unexplained() {
        let records = vec![
            record(0, 201, None, false, 1),
            record(1, 400, Some("invalid_argument"), false, 2),
        ];
        let found = violations(&records, &counters(5, 1, 4, 1), &clean(), None);
        assert!(
            found
                .iter()
                .any(|violation| violation.starts_with("unexplained answer 400 invalid_argument")),
            "{found:?}"
        );
    }

    #[test]
    fn a_transient_failure_followed_by_a_success_is_not_a_duplicate_effect() {
        let records = vec![
            record(0, 503, Some("lock_timeout"), false, 1),
            record(0, 201, None, false, 2),
        ];
        assert!(violations(&records, &counters(5, 1, 4, 1), &clean(), None).is_empty());
    }

    #[test]
    fn a_replay_that_differs_from_the_first_answer_is_reported() {
        let records = vec![
            record(0, 201, None, false, 1),
            record(0, 201, None, true, 2),
        ];
        let found = violations(&records, &counters(5, 1, 4, 1), &clean(), None);
        assert!(
            found
                .iter()
                .any(|violation| violation.contains("replays differ")),
            "{found:?}"
        );
    }

    #[test]
    fn unexplained_answers_and_transport_errors_fail_the_run() {
        let mut broken = record(0, 0, None, false, 0);
        broken.error = Some("connection reset".into());
        let records = vec![record(1, 500, Some("internal"), false, 0), broken];
        let found = violations(&records, &counters(5, 0, 5, 0), &clean(), Some(0));
        assert_eq!(found.len(), 2, "{found:?}");
    }

    #[test]
    fn a_malformed_request_must_get_its_expected_refusal() {
        let mut refused = record(0, 400, Some("invalid_argument"), false, 0);
        refused.key_index = None;
        refused.expected = Some(("quantity 0", 400, "invalid_argument"));
        let mut accepted = refused.clone();
        accepted.status = 201;
        accepted.code = None;
        assert!(violations(&[refused], &counters(5, 0, 5, 0), &clean(), Some(0)).is_empty());
        assert!(!violations(&[accepted], &counters(5, 0, 5, 0), &clean(), Some(0)).is_empty());
    }

    #[test]
    fn counters_that_disagree_with_the_clients_or_the_audit_fail_the_run() {
        let records = vec![record(0, 201, None, false, 1)];
        assert!(!violations(&records, &counters(5, 1, 4, 2), &clean(), None).is_empty());
        let dirty = AuditSummary {
            ok: false,
            differences_total: 3,
        };
        assert!(!violations(&records, &counters(5, 1, 4, 1), &dirty, None).is_empty());
    }

    #[test]
    fn a_missed_expected_success_count_fails_the_run() {
        let records = vec![record(0, 201, None, false, 1)];
        let found = violations(&records, &counters(10, 1, 9, 1), &clean(), Some(10));
        assert_eq!(
            found,
            vec!["expected exactly 10 successes, saw 1".to_owned()]
        );
    }
}

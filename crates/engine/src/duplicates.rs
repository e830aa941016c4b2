//! Which SKUs the duplicate requests are about (seed 002 §九.2: "某个热门 SKU 可能达到
//! 18%"), with bounded memory and bounded label cardinality.
//!
//! Every replayed reservation, order or checkout counts once for each of its SKUs. The
//! tally keeps at most [`TRACKED_SKUS_MAX`] SKUs with the Space-Saving rule: a SKU not
//! yet tracked when the tally is full takes the place of the least counted one and
//! inherits its count. So a SKU with more than 1/`TRACKED_SKUS_MAX` of all duplicates
//! is always tracked (a flash-sale SKU with 18 % of them certainly), and a count
//! overstates by at most what it inherited.
//! `/metrics` exports the [`HOT_SKUS_EXPORTED`] highest as
//! `stockd_hot_sku_duplicate_requests_total{sku}`.

use std::collections::HashMap;
use std::sync::Mutex;

/// SKUs the tally follows at once.
pub const TRACKED_SKUS_MAX: usize = 1_000;
/// SKUs exported as labels: the cardinality bound of the metric.
pub const HOT_SKUS_EXPORTED: usize = 10;

#[derive(Debug)]
pub struct DuplicateTally {
    counts: Mutex<HashMap<String, u64>>,
    tracked_max: usize,
}

impl Default for DuplicateTally {
    fn default() -> DuplicateTally {
        DuplicateTally::with_capacity(TRACKED_SKUS_MAX)
    }
}

impl DuplicateTally {
    pub fn with_capacity(tracked_max: usize) -> DuplicateTally {
        DuplicateTally {
            counts: Mutex::new(HashMap::new()),
            tracked_max: tracked_max.max(1),
        }
    }

    /// Counts one duplicate request for each of `skus`.
    pub fn record<'a>(&self, skus: impl IntoIterator<Item = &'a str>) {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for sku in skus {
            if let Some(count) = counts.get_mut(sku) {
                *count += 1;
                continue;
            }
            let inherited = if counts.len() >= self.tracked_max {
                let least = counts
                    .iter()
                    .min_by(|left, right| left.1.cmp(right.1).then_with(|| right.0.cmp(left.0)))
                    .map(|(sku, count)| (sku.clone(), *count));
                match least {
                    Some((sku, count)) => {
                        counts.remove(&sku);
                        count
                    }
                    None => 0,
                }
            } else {
                0
            };
            counts.insert(sku.to_owned(), inherited + 1);
        }
    }

    /// The `limit` most duplicated SKUs, highest first (ties by code).
    pub fn top(&self, limit: usize) -> Vec<(String, u64)> {
        let counts = self
            .counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut ranked: Vec<(String, u64)> = counts
            .iter()
            .map(|(sku, count)| (sku.clone(), *count))
            .collect();
        ranked.sort_by(|left, right| right.1.cmp(&left.1).then_with(|| left.0.cmp(&right.0)));
        ranked.truncate(limit);
        ranked
    }
}

/// The exported lines of `stockd_hot_sku_duplicate_requests_total`, in Prometheus's
/// text format. SKU codes are letters, digits, `-`, `_` and `.`: nothing to escape.
pub fn render_hot_skus(top: &[(String, u64)]) -> String {
    let mut text = String::from(
        "# HELP stockd_hot_sku_duplicate_requests_total Duplicate requests per SKU, for the most duplicated SKUs only.\n\
         # TYPE stockd_hot_sku_duplicate_requests_total counter\n",
    );
    for (sku, count) in top {
        text.push_str(&format!(
            "stockd_hot_sku_duplicate_requests_total{{sku=\"{sku}\"}} {count}\n"
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_duplicated_skus_come_first_and_only_as_many_as_asked() {
        let tally = DuplicateTally::default();
        for _ in 0..5 {
            tally.record(["HOT"]);
        }
        tally.record(["WARM", "HOT"]);
        tally.record(["WARM", "COLD"]);

        assert_eq!(
            tally.top(2),
            vec![("HOT".to_owned(), 6), ("WARM".to_owned(), 2)]
        );
    }

    #[test]
    fn a_sku_with_more_than_its_share_is_never_pushed_out_by_rare_ones() {
        // 60 of 160 duplicates: more than a third, with room for three SKUs.
        let tally = DuplicateTally::with_capacity(3);
        for _ in 0..60 {
            tally.record(["HOT"]);
        }
        for rare in 0..100 {
            tally.record([format!("RARE-{rare}").as_str()]);
        }

        let top = tally.top(1);
        assert_eq!(top[0].0, "HOT");
        assert_eq!(
            top[0].1, 60,
            "a SKU tracked from its first duplicate is counted exactly"
        );
        assert_eq!(tally.top(10).len(), 3, "the tally stays within its bound");
    }

    #[test]
    fn the_rendered_lines_name_each_sku_once_with_its_count() {
        let text = render_hot_skus(&[("HOT".to_owned(), 6), ("WARM".to_owned(), 2)]);

        assert!(text.contains("# TYPE stockd_hot_sku_duplicate_requests_total counter\n"));
        assert!(text.contains("stockd_hot_sku_duplicate_requests_total{sku=\"HOT\"} 6\n"));
        assert!(text.contains("stockd_hot_sku_duplicate_requests_total{sku=\"WARM\"} 2\n"));
    }
}

//! Flash-sale campaigns (seed 000: "为秒杀活动设置独立的库存令牌"; seed 002 §十一.3: "库存分桶").
//!
//! A campaign carves a quantity out of one SKU's available stock into stock of its own,
//! split over N buckets: each bucket is a stock row of the SKU in a warehouse that only
//! stockd names (`campaign-<code>-<bucket>`), so a bucket is locked, counted, ledgered,
//! reserved from, released to and audited exactly like any stock row, and batches on
//! different buckets commit in parallel. Regular sales never name those warehouses; a
//! campaign's reservations never touch the regular rows.
//!
//! Pure: ids, codes, the split and the campaign's phase at an instant.

use std::fmt;

use crate::code::{SkuCode, WarehouseCode};
use crate::error::ParseError;
use crate::id::CampaignId;
use crate::time::Timestamp;

/// What every warehouse code stockd gives a campaign bucket starts with. A request
/// that names such a warehouse itself is refused: buckets are reached only through
/// their campaign.
pub const BUCKET_WAREHOUSE_PREFIX: &str = "campaign-";

/// Most buckets one campaign may have.
pub const CAMPAIGN_BUCKETS_MAX: u32 = 64;

/// A campaign's short code: the 12 hex digits of randomness at the end of its id. It
/// names the campaign's buckets and its shoppers' tally, both within code lengths.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CampaignCode(String);

impl CampaignCode {
    pub fn of(id: &CampaignId) -> CampaignCode {
        let text = id.as_str();
        CampaignCode(text[text.len() - 12..].to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The warehouse code of bucket `bucket` (0-based).
    pub fn bucket_warehouse(&self, bucket: u32) -> WarehouseCode {
        WarehouseCode::parse(&format!("{BUCKET_WAREHOUSE_PREFIX}{}-{bucket}", self.0))
            .expect("a bucket's code is a well-formed warehouse code")
    }

    /// The SKU code a shopper's campaign purchases are tallied under: the campaign's
    /// per-user limit counts the campaign's units only, not the SKU's regular sales.
    pub fn tally_sku(&self) -> SkuCode {
        SkuCode::parse(&format!("{BUCKET_WAREHOUSE_PREFIX}{}", self.0))
            .expect("a campaign's tally code is a well-formed SKU code")
    }
}

impl fmt::Display for CampaignCode {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// Whether a warehouse code is one stockd gives campaign buckets.
pub fn is_bucket_warehouse(warehouse: &WarehouseCode) -> bool {
    warehouse.as_str().starts_with(BUCKET_WAREHOUSE_PREFIX)
}

/// The campaign code and bucket of a bucket's warehouse code.
pub fn bucket_of(warehouse: &WarehouseCode) -> Option<(CampaignCode, u32)> {
    let rest = warehouse.as_str().strip_prefix(BUCKET_WAREHOUSE_PREFIX)?;
    let (code, bucket) = rest.split_once('-')?;
    let well_formed = code.len() == 12 && code.bytes().all(|byte| byte.is_ascii_hexdigit());
    let bucket: u32 = bucket.parse().ok()?;
    (well_formed && bucket < CAMPAIGN_BUCKETS_MAX).then(|| (CampaignCode(code.to_owned()), bucket))
}

/// The SKU a line's units are tallied under for per-user limits: the campaign's tally
/// code for a bucket's line, the SKU itself otherwise.
pub fn tally_sku(sku: &SkuCode, warehouse: &WarehouseCode) -> SkuCode {
    match bucket_of(warehouse) {
        Some((code, _)) => code.tally_sku(),
        None => sku.clone(),
    }
}

/// `quantity` split over `buckets` as evenly as whole units go: the first
/// `quantity % buckets` buckets get one more.
pub fn split(quantity: i64, buckets: u32) -> Vec<i64> {
    let buckets = i64::from(buckets.max(1));
    (0..buckets)
        .map(|bucket| quantity / buckets + i64::from(bucket < quantity % buckets))
        .collect()
}

/// Where a campaign stands at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CampaignPhase {
    /// Before `starts_at`: its stock waits; requests naming it are refused
    /// (`campaign_not_started`), the SKU's others take regular stock.
    Scheduled,
    /// From `starts_at` to `ends_at`: every reservation and order of the SKU (in the
    /// campaign's warehouse) draws from the campaign.
    Running,
    /// From `ends_at`: what is left goes back to regular stock.
    Ended,
}

impl CampaignPhase {
    pub fn at(now: Timestamp, starts_at: Timestamp, ends_at: Timestamp) -> CampaignPhase {
        if now < starts_at {
            CampaignPhase::Scheduled
        } else if now < ends_at {
            CampaignPhase::Running
        } else {
            CampaignPhase::Ended
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CampaignPhase::Scheduled => "SCHEDULED",
            CampaignPhase::Running => "RUNNING",
            CampaignPhase::Ended => "ENDED",
        }
    }
}

/// The units of a SKU a shopper's reservation could take now, from its stock rows'
/// `(warehouse, available)`: while a campaign runs on it (`running`: the campaign's
/// code and source warehouse), its buckets' (a line in the campaign's warehouse draws
/// from one of them) and the SKU's other warehouses'; otherwise its regular stock, not
/// the units carved out into a campaign that has not started or whose rest has not
/// gone back yet. The product view and a shelf operation's `availability` both say it.
pub fn shopper_available<'level>(
    levels: impl IntoIterator<Item = (&'level WarehouseCode, i64)>,
    running: Option<(&CampaignCode, &WarehouseCode)>,
) -> i64 {
    levels
        .into_iter()
        .filter(|(warehouse, _)| {
            let bucket = bucket_of(warehouse);
            match running {
                Some((code, source)) => match bucket {
                    Some((of, _)) => of == *code,
                    None => *warehouse != source,
                },
                None => bucket.is_none(),
            }
        })
        .map(|(_, available)| available)
        .sum()
}

/// Checks a campaign's numbers: 1..=`quantity_max` units, 1..=[`CAMPAIGN_BUCKETS_MAX`]
/// buckets (no more than units), a start before the end.
pub fn check_campaign(
    quantity: i64,
    buckets: u32,
    starts_at: Timestamp,
    ends_at: Timestamp,
) -> Result<(), ParseError> {
    if !(1..=CAMPAIGN_BUCKETS_MAX).contains(&buckets) {
        return Err(ParseError::new(format!(
            "buckets must be 1 to {CAMPAIGN_BUCKETS_MAX}"
        )));
    }
    if i64::from(buckets) > quantity {
        return Err(ParseError::new(
            "a campaign needs at least one unit per bucket",
        ));
    }
    if ends_at <= starts_at {
        return Err(ParseError::new("ends_at must be after starts_at"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> CampaignId {
        CampaignId::generate(
            Timestamp::from_unix_milliseconds(1_700_000_000_000),
            0xabcdef,
        )
    }

    #[test]
    fn a_bucket_warehouse_names_its_campaign_and_bucket() {
        let code = CampaignCode::of(&id());
        let warehouse = code.bucket_warehouse(7);
        assert!(is_bucket_warehouse(&warehouse));
        assert_eq!(bucket_of(&warehouse), Some((code.clone(), 7)));
        assert_eq!(
            tally_sku(&SkuCode::parse("TEA").unwrap(), &warehouse),
            code.tally_sku()
        );
        let regular = WarehouseCode::default_warehouse();
        assert!(!is_bucket_warehouse(&regular));
        assert_eq!(bucket_of(&regular), None);
        assert_eq!(
            tally_sku(&SkuCode::parse("TEA").unwrap(), &regular).as_str(),
            "TEA"
        );
    }

    #[test]
    fn a_split_gives_every_unit_to_one_bucket_and_differs_by_one_at_most() {
        assert_eq!(split(10, 3), [4, 3, 3]);
        assert_eq!(split(1000, 8), [125; 8]);
        assert_eq!(split(5, 5), [1; 5]);
        for (quantity, buckets) in [(1, 1), (7, 2), (1001, 64), (64, 64)] {
            let parts = split(quantity, buckets);
            assert_eq!(parts.iter().sum::<i64>(), quantity);
            assert!(parts.iter().max().unwrap() - parts.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn a_campaign_runs_from_its_start_to_its_end() {
        let start = Timestamp::from_unix_milliseconds(1_000);
        let end = Timestamp::from_unix_milliseconds(2_000);
        assert_eq!(
            CampaignPhase::at(Timestamp::from_unix_milliseconds(999), start, end),
            CampaignPhase::Scheduled
        );
        assert_eq!(CampaignPhase::at(start, start, end), CampaignPhase::Running);
        assert_eq!(CampaignPhase::at(end, start, end), CampaignPhase::Ended);
    }

    #[test]
    fn a_campaign_needs_units_for_its_buckets_and_a_start_before_its_end() {
        let start = Timestamp::from_unix_milliseconds(1_000);
        let end = Timestamp::from_unix_milliseconds(2_000);
        assert!(check_campaign(10, 4, start, end).is_ok());
        assert!(check_campaign(3, 4, start, end).is_err());
        assert!(check_campaign(10, 0, start, end).is_err());
        assert!(check_campaign(100, 65, start, end).is_err());
        assert!(check_campaign(10, 2, end, start).is_err());
    }
}

//! Products (SPUs) and the record of who changed what on the shelf.

use serde::Serialize;

use crate::code::{CategoryCode, ImageUrl, OperatorId, ShopCode, SkuCode, SupplierCode};
use crate::error::ParseError;
use crate::id::{ProductId, ScheduleId};
use crate::principal::Principal;
use crate::sale_status::{SaleStatus, ShelfOperation};
use crate::sku::Sku;
use crate::time::Timestamp;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Product {
    pub id: ProductId,
    pub title: String,
    pub image_url: Option<ImageUrl>,
    pub category: CategoryCode,
    pub supplier: SupplierCode,
    pub shop: ShopCode,
    pub version: i64,
    /// Set by a delete; a deleted product stays readable for its orders and logs.
    pub deleted_at: Option<Timestamp>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// Ordered by SKU code.
    pub skus: Vec<Sku>,
}

/// Who made a shelf change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OperatorType {
    /// A person, through the admin API.
    Manual,
    /// A schedule that came due.
    Scheduled,
    /// stockd itself.
    System,
}

impl OperatorType {
    pub fn as_str(self) -> &'static str {
        match self {
            OperatorType::Manual => "manual",
            OperatorType::Scheduled => "scheduled",
            OperatorType::System => "system",
        }
    }

    pub fn parse(text: &str) -> Result<OperatorType, ParseError> {
        match text {
            "manual" => Ok(OperatorType::Manual),
            "scheduled" => Ok(OperatorType::Scheduled),
            "system" => Ok(OperatorType::System),
            _ => Err(ParseError::new(format!("unknown operator type '{text}'"))),
        }
    }
}

/// One line of the shelf log (seed 003 §2.3): every sale-status change, repeats
/// included, and every skipped schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShelfLogEntry {
    pub id: i64,
    pub product_id: Option<ProductId>,
    pub sku: SkuCode,
    pub operator_id: OperatorId,
    pub operator_type: OperatorType,
    pub from_status: SaleStatus,
    pub to_status: SaleStatus,
    /// `on`, `off`, `delete`, `on_at`, `off_at`.
    pub operation: String,
    /// The SKU already had the status: a success that changed nothing.
    pub repeated: bool,
    pub remark: String,
    pub created_at: Timestamp,
}

/// How an operation is named in the log: the scheduled ones as `on_at` / `off_at`.
pub fn operation_label(operation: ShelfOperation, scheduled: bool) -> &'static str {
    match (operation, scheduled) {
        (ShelfOperation::On, true) => "on_at",
        (ShelfOperation::Off, true) => "off_at",
        (ShelfOperation::Delete, true) => "delete_at",
        (operation, false) => operation.as_str(),
    }
}

/// Who acts: an operator of one shop, or the admin (no shop: every shop).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub operator: OperatorId,
    pub operator_type: OperatorType,
    pub shop: Option<ShopCode>,
}

impl Actor {
    /// The holder of the admin token.
    pub fn admin() -> Actor {
        Actor {
            operator: known_operator("admin"),
            operator_type: OperatorType::Manual,
            shop: None,
        }
    }

    /// The schedule worker.
    pub fn scheduler() -> Actor {
        Actor {
            operator: known_operator("scheduler"),
            operator_type: OperatorType::Scheduled,
            shop: None,
        }
    }

    pub fn is_admin(&self) -> bool {
        self.shop.is_none()
    }

    /// The actor a shelf change records for `principal`. Service keys never change the
    /// shelf (`domain::PERMISSIONS`), so they appear only if that table changes.
    pub fn of(principal: &Principal) -> Actor {
        match principal {
            Principal::Admin => Actor::admin(),
            Principal::Operator { id, shop } => Actor {
                operator: id.clone(),
                operator_type: OperatorType::Manual,
                shop: Some(shop.clone()),
            },
            Principal::Service { key, shop } => Actor {
                // A minted key id is a valid operator id (letters, digits, '_').
                operator: OperatorId::parse(key.as_str())
                    .unwrap_or_else(|_| known_operator("service")),
                operator_type: OperatorType::System,
                shop: Some(shop.clone()),
            },
        }
    }
}

/// stockd's own operator names; they are valid codes, so parsing cannot fail.
fn known_operator(name: &'static str) -> OperatorId {
    match OperatorId::parse(name) {
        Ok(id) => id,
        Err(error) => unreachable!("'{name}' is a valid operator id: {error}"),
    }
}

/// A scheduled shelf change's status: `PENDING` until it comes due, then settled once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleStatus {
    /// Still to come.
    Pending,
    Applied,
    /// Its SKU was deleted before it came due.
    Skipped,
    /// The change was refused when it came due (a product missing a field).
    Refused,
    /// Withdrawn by staff before it came due.
    Cancelled,
}

/// Every status change of a scheduled change: a pending one is applied, skipped,
/// refused or cancelled, once.
pub const SCHEDULE_TRANSITIONS: &[(ScheduleStatus, ScheduleStatus)] = &[
    (ScheduleStatus::Pending, ScheduleStatus::Applied),
    (ScheduleStatus::Pending, ScheduleStatus::Skipped),
    (ScheduleStatus::Pending, ScheduleStatus::Refused),
    (ScheduleStatus::Pending, ScheduleStatus::Cancelled),
];

impl ScheduleStatus {
    pub const ALL: [ScheduleStatus; 5] = [
        ScheduleStatus::Pending,
        ScheduleStatus::Applied,
        ScheduleStatus::Skipped,
        ScheduleStatus::Refused,
        ScheduleStatus::Cancelled,
    ];

    /// Whether [`SCHEDULE_TRANSITIONS`] allows this change.
    pub fn may_become(self, to: ScheduleStatus) -> bool {
        SCHEDULE_TRANSITIONS.contains(&(self, to))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ScheduleStatus::Pending => "PENDING",
            ScheduleStatus::Applied => "APPLIED",
            ScheduleStatus::Skipped => "SKIPPED",
            ScheduleStatus::Refused => "REFUSED",
            ScheduleStatus::Cancelled => "CANCELLED",
        }
    }

    pub fn parse(text: &str) -> Option<ScheduleStatus> {
        ScheduleStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
    }
}

/// How a scheduled change repeats. A daily one ("off at 20:00 every day", seed 003
/// §1.2's fresh food) leaves its next occurrence pending when it settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recurrence {
    /// Every 24 hours after its first due time: a fixed UTC interval, so in a time
    /// zone with daylight saving the local hour moves by one twice a year.
    Daily,
}

const DAY_MILLISECONDS: i64 = 86_400_000;

impl Recurrence {
    pub fn as_str(self) -> &'static str {
        match self {
            Recurrence::Daily => "daily",
        }
    }

    pub fn parse(text: &str) -> Option<Recurrence> {
        (text == "daily").then_some(Recurrence::Daily)
    }

    /// The first occurrence after `now` of a series whose occurrence was due at
    /// `due_at`. Occurrences missed while nothing ran (the service was down for
    /// days) are not replayed one by one: the one that settles stands for them, as
    /// the last of them would have left the shelf the same way.
    pub fn next_due(self, due_at: Timestamp, now: Timestamp) -> Timestamp {
        let latest = self.latest_slot(due_at, now).unix_milliseconds();
        Timestamp::from_unix_milliseconds(latest.saturating_add(DAY_MILLISECONDS))
    }

    /// The last slot at or before `now` of a series whose occurrence was due at
    /// `due_at` (`due_at` itself when it is not late by a whole period): the time a
    /// late occurrence stands for. One SKU's late occurrences of several series (off
    /// at 20:00, on at 06:00) apply in the order of these slots, so the SKU ends as
    /// the last missed slot would have left it.
    pub fn latest_slot(self, due_at: Timestamp, now: Timestamp) -> Timestamp {
        let due = due_at.unix_milliseconds();
        let late = now.unix_milliseconds().saturating_sub(due).max(0);
        let periods = late / DAY_MILLISECONDS;
        Timestamp::from_unix_milliseconds(due.saturating_add(periods * DAY_MILLISECONDS))
    }
}

/// The id of a daily series' occurrence due at `due_at`: minted from the series and
/// the due time alone (FNV-1a), so the same occurrence can only ever be written once
/// (its primary key would collide).
pub fn next_occurrence_id(series: &ScheduleId, due_at: Timestamp) -> ScheduleId {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    let due = due_at.unix_milliseconds().to_be_bytes();
    for byte in series.as_str().bytes().chain(due) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(PRIME);
    }
    ScheduleId::generate(due_at, hash)
}

#[cfg(test)]
mod schedule_tests {
    use super::*;

    #[test]
    fn a_schedule_is_settled_once_from_pending_and_never_changes_after() {
        for from in ScheduleStatus::ALL {
            for to in ScheduleStatus::ALL {
                assert_eq!(
                    from.may_become(to),
                    from == ScheduleStatus::Pending && to != ScheduleStatus::Pending,
                    "{from:?} to {to:?}"
                );
            }
            assert_eq!(ScheduleStatus::parse(from.as_str()), Some(from));
        }
    }

    #[test]
    fn a_daily_series_comes_back_a_day_later_or_at_the_first_slot_after_a_late_run() {
        let daily = Recurrence::Daily;
        let due = Timestamp::from_unix_milliseconds(1_000 * DAY_MILLISECONDS + 72_000_000);
        // Settled on time: the same minute tomorrow.
        assert_eq!(
            daily.next_due(due, due).unix_milliseconds(),
            due.unix_milliseconds() + DAY_MILLISECONDS
        );
        // Three days and an hour late: the next slot still in the future, not the
        // three missed ones.
        let late = Timestamp::from_unix_milliseconds(
            due.unix_milliseconds() + 3 * DAY_MILLISECONDS + 3_600_000,
        );
        assert_eq!(
            daily.next_due(due, late).unix_milliseconds(),
            due.unix_milliseconds() + 4 * DAY_MILLISECONDS
        );
        // Exactly one period late: the slot at `now` is already due, so the next.
        let one_day = Timestamp::from_unix_milliseconds(due.unix_milliseconds() + DAY_MILLISECONDS);
        assert_eq!(
            daily.next_due(due, one_day).unix_milliseconds(),
            due.unix_milliseconds() + 2 * DAY_MILLISECONDS
        );
        // The slots a late occurrence stands for: its own when not a day late, else
        // the last one passed.
        assert_eq!(daily.latest_slot(due, due), due);
        assert_eq!(
            daily.latest_slot(due, late).unix_milliseconds(),
            due.unix_milliseconds() + 3 * DAY_MILLISECONDS
        );
        assert_eq!(Recurrence::parse(daily.as_str()), Some(daily));
        assert_eq!(Recurrence::parse("weekly"), None);
    }

    #[test]
    fn an_occurrence_id_depends_on_its_series_and_due_time_only() {
        let first = ScheduleId::generate(Timestamp::from_unix_milliseconds(5), 7);
        let other = ScheduleId::generate(Timestamp::from_unix_milliseconds(5), 8);
        let due = Timestamp::from_unix_milliseconds(DAY_MILLISECONDS);
        let later = Timestamp::from_unix_milliseconds(2 * DAY_MILLISECONDS);
        assert_eq!(
            next_occurrence_id(&first, due),
            next_occurrence_id(&first, due)
        );
        assert_ne!(
            next_occurrence_id(&first, due),
            next_occurrence_id(&first, later)
        );
        assert_ne!(
            next_occurrence_id(&first, due),
            next_occurrence_id(&other, due)
        );
        let id = next_occurrence_id(&first, due);
        assert_eq!(ScheduleId::parse(id.as_str()), Ok(id));
    }
}

//! Products (SPUs) and the record of who changed what on the shelf.

use serde::Serialize;

use crate::code::{CategoryCode, ImageUrl, OperatorId, ShopCode, SkuCode, SupplierCode};
use crate::error::ParseError;
use crate::id::ProductId;
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
}

/// Every status change of a scheduled change: a pending one is applied, skipped or
/// refused, once.
pub const SCHEDULE_TRANSITIONS: &[(ScheduleStatus, ScheduleStatus)] = &[
    (ScheduleStatus::Pending, ScheduleStatus::Applied),
    (ScheduleStatus::Pending, ScheduleStatus::Skipped),
    (ScheduleStatus::Pending, ScheduleStatus::Refused),
];

impl ScheduleStatus {
    pub const ALL: [ScheduleStatus; 4] = [
        ScheduleStatus::Pending,
        ScheduleStatus::Applied,
        ScheduleStatus::Skipped,
        ScheduleStatus::Refused,
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
        }
    }

    pub fn parse(text: &str) -> Option<ScheduleStatus> {
        ScheduleStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
    }
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
}

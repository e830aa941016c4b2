//! Products (SPUs) and the record of who changed what on the shelf.

use serde::Serialize;

use crate::code::{CategoryCode, ImageUrl, OperatorId, ShopCode, SkuCode, SupplierCode};
use crate::error::ParseError;
use crate::id::ProductId;
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

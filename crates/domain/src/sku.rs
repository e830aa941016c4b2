//! A SKU as stockd reports it: catalogue fields plus its stock counters.

use serde::Serialize;

use crate::code::{ShopCode, SkuCode, WarehouseCode};
use crate::id::ProductId;
use crate::money::{Currency, PriceMinor};
use crate::sale_status::SaleStatus;
use crate::time::Timestamp;

/// Counters of one (sku, warehouse) row. On hand = available + reserved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StockLevel {
    pub warehouse: WarehouseCode,
    pub available: i64,
    pub reserved: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sku {
    pub code: SkuCode,
    /// The product (SPU) this SKU belongs to; `None` for SKUs created on their own.
    pub product_id: Option<ProductId>,
    /// The shop that sells it; fixed once the SKU exists.
    pub shop: ShopCode,
    pub title: String,
    /// The selling unit's description (`250ml x 24`).
    pub spec: String,
    pub price: Option<PriceMinor>,
    pub currency: Option<Currency>,
    pub low_stock_threshold: i64,
    /// Most units one shopper may hold or have bought; `None`: no limit.
    pub per_user_limit: Option<i64>,
    pub sale_status: SaleStatus,
    pub version: i64,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// One entry per warehouse that ever held this SKU, ordered by warehouse code.
    pub stock: Vec<StockLevel>,
}

impl Sku {
    pub fn available(&self) -> i64 {
        self.stock.iter().map(|level| level.available).sum()
    }

    pub fn reserved(&self) -> i64 {
        self.stock.iter().map(|level| level.reserved).sum()
    }
}

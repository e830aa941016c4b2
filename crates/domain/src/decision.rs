//! Business refusals and the shop a reservation must belong to: what the pure decisions
//! (`plan`, the cart, the order table) hand back to the store.

use crate::{ErrorCode, ShopCode};

/// A business refusal. Stored and replayed like a success: the first result wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub code: ErrorCode,
    pub detail: String,
}

impl Rejection {
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> Rejection {
        Rejection {
            code,
            detail: detail.into(),
        }
    }
}

/// Which shop a reservation's SKUs must belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShopScope {
    /// Every SKU was found in this shop before the request was queued (a SKU's shop
    /// never changes), so nothing is left to check.
    Verified(ShopCode),
    /// Every SKU must belong to this shop (the caller's); some were unknown when the
    /// request was checked, so the reserving transaction checks.
    Required(ShopCode),
    /// The admin named a SKU unknown when the request was checked: any one shop,
    /// found by the reserving transaction.
    Any,
}

//! What goes into and comes out of the catalog's units of work: products, shelf
//! changes and schedules, operators, carts.

use std::collections::HashMap;

use domain::{
    CategoryCode, Currency, ErrorCode, ImageUrl, OperatorId, OperatorType, PriceMinor, Principal,
    ProductId, SaleStatus, ScheduleId, ServiceKeyId, ShelfOperation, ShopCode, SkuCode,
    SupplierCode, Timestamp, Title, UserId,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSku {
    pub code: SkuCode,
    pub price: PriceMinor,
    pub currency: Currency,
    pub spec: String,
    pub per_user_limit: Option<i64>,
}

/// A product to create, with its SKUs. Every SKU starts `PENDING_REVIEW`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewProduct {
    pub id: ProductId,
    pub title: Title,
    pub image_url: Option<ImageUrl>,
    pub category: CategoryCode,
    pub supplier: SupplierCode,
    pub shop: ShopCode,
    pub skus: Vec<NewSku>,
}

/// Product fields to change; `None` keeps a field. The shop never changes: it decides
/// who may touch the product.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProductChanges {
    pub title: Option<Title>,
    pub image_url: Option<ImageUrl>,
    pub category: Option<CategoryCode>,
    pub supplier: Option<SupplierCode>,
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

/// Which SKUs a shelf operation names: the union of the listed products and SKUs and
/// the products of a category or supplier — within `shop` when given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetSelector {
    pub product_ids: Vec<ProductId>,
    pub skus: Vec<SkuCode>,
    pub category: Option<CategoryCode>,
    pub supplier: Option<SupplierCode>,
    pub shop: Option<ShopCode>,
}

/// A SKU a shelf operation resolved to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ShelfTarget {
    pub sku: SkuCode,
    pub product_id: Option<ProductId>,
    pub shop: Option<ShopCode>,
}

/// A shelf operation to apply now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShelfChange {
    pub operation: ShelfOperation,
    pub targets: Vec<ShelfTarget>,
    /// Versions the operator saw; a SKU whose version moved since is refused with
    /// `version_conflict` rather than overwritten.
    pub expected_versions: HashMap<SkuCode, i64>,
    pub actor: Actor,
    pub remark: String,
    /// The log names scheduled operations `on_at` / `off_at`.
    pub scheduled: bool,
}

/// A shelf operation to apply at `due_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShelfScheduling {
    pub operation: ShelfOperation,
    pub targets: Vec<(ScheduleId, ShelfTarget)>,
    pub due_at: Timestamp,
    pub actor: Actor,
    pub remark: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShelfOutcome {
    Changed {
        from: SaleStatus,
        to: SaleStatus,
        version: i64,
    },
    Repeated {
        status: SaleStatus,
    },
    Refused {
        code: ErrorCode,
        reason: String,
        missing: Vec<&'static str>,
    },
    Scheduled {
        schedule_id: ScheduleId,
        due_at: Timestamp,
    },
}

impl ShelfOutcome {
    pub fn succeeded(&self) -> bool {
        !matches!(self, ShelfOutcome::Refused { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShelfResult {
    pub sku: SkuCode,
    pub product_id: Option<ProductId>,
    pub outcome: ShelfOutcome,
}

/// What one schedule step did with one due schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedSchedule {
    pub id: ScheduleId,
    pub sku: SkuCode,
    /// `APPLIED`, `SKIPPED` (the SKU was deleted) or `REFUSED`.
    pub status: &'static str,
    pub outcome: String,
}

/// Filters of the shelf log; `after_id` pages forward.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShelfLogQuery {
    pub product_id: Option<ProductId>,
    pub sku: Option<SkuCode>,
    pub shop: Option<ShopCode>,
    pub since: Option<Timestamp>,
    pub after_id: Option<i64>,
    pub limit: i64,
}

/// A cart line with what the catalog says about its SKU now (`None`: unknown SKU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CartLine {
    pub sku: SkuCode,
    pub quantity: i64,
    pub current: Option<CartSku>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CartSku {
    pub title: String,
    pub price: Option<PriceMinor>,
    pub currency: Option<Currency>,
    pub sale_status: SaleStatus,
    /// Available in the default warehouse, where carts check out from.
    pub available: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cart {
    pub user: UserId,
    /// Ordered by SKU code.
    pub lines: Vec<CartLine>,
}

/// Why a cart line cannot be ordered now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CartProblem {
    NotFound,
    Deleted,
    OffShelf,
    OutOfStock,
    /// More in the cart than is available.
    QuantityAboveAvailable,
}

impl CartProblem {
    pub fn as_str(self) -> &'static str {
        match self {
            CartProblem::NotFound => "not_found",
            CartProblem::Deleted => "deleted",
            CartProblem::OffShelf => "off_shelf",
            CartProblem::OutOfStock => "out_of_stock",
            CartProblem::QuantityAboveAvailable => "quantity_above_available",
        }
    }

    pub fn code(self) -> ErrorCode {
        match self {
            CartProblem::NotFound => ErrorCode::NotFound,
            CartProblem::Deleted | CartProblem::OffShelf => ErrorCode::OffShelf,
            CartProblem::OutOfStock | CartProblem::QuantityAboveAvailable => {
                ErrorCode::InsufficientStock
            }
        }
    }
}

impl CartLine {
    /// Whether the line could be ordered right now, and why not. A snapshot: the
    /// reservation at checkout decides.
    pub fn problem(&self) -> Option<CartProblem> {
        let Some(current) = &self.current else {
            return Some(CartProblem::NotFound);
        };
        match current.sale_status {
            SaleStatus::Deleted => Some(CartProblem::Deleted),
            SaleStatus::OffShelf | SaleStatus::PendingReview => Some(CartProblem::OffShelf),
            SaleStatus::OnShelf if current.available == 0 => Some(CartProblem::OutOfStock),
            SaleStatus::OnShelf if current.available < self.quantity => {
                Some(CartProblem::QuantityAboveAvailable)
            }
            SaleStatus::OnShelf => None,
        }
    }
}

/// A line a checkout left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedLine {
    pub sku: SkuCode,
    pub quantity: i64,
    pub problem: CartProblem,
}

/// A credential to store: an operator's token or a service key's secret, as a hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCredential {
    pub kind: CredentialKind,
    pub id: String,
    pub name: String,
    pub shop: Option<ShopCode>,
    pub secret_hash: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialKind {
    Admin,
    Operator,
    Service,
}

impl CredentialKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CredentialKind::Admin => "admin",
            CredentialKind::Operator => "operator",
            CredentialKind::Service => "service",
        }
    }
}

/// A service key as listed (never with its secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceKey {
    pub id: ServiceKeyId,
    pub name: String,
    pub shop: ShopCode,
    pub created_at: Timestamp,
    pub revoked_at: Option<Timestamp>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(quantity: i64, status: SaleStatus, available: i64) -> CartLine {
        CartLine {
            sku: SkuCode::parse("S").unwrap(),
            quantity,
            current: Some(CartSku {
                title: String::new(),
                price: None,
                currency: None,
                sale_status: status,
                available,
            }),
        }
    }

    #[test]
    fn a_cart_line_says_why_it_cannot_be_ordered() {
        assert_eq!(line(2, SaleStatus::OnShelf, 5).problem(), None);
        assert_eq!(
            line(2, SaleStatus::OnShelf, 0).problem(),
            Some(CartProblem::OutOfStock)
        );
        assert_eq!(
            line(6, SaleStatus::OnShelf, 5).problem(),
            Some(CartProblem::QuantityAboveAvailable)
        );
        assert_eq!(
            line(1, SaleStatus::OffShelf, 5).problem(),
            Some(CartProblem::OffShelf)
        );
        assert_eq!(
            line(1, SaleStatus::PendingReview, 5).problem(),
            Some(CartProblem::OffShelf)
        );
        assert_eq!(
            line(1, SaleStatus::Deleted, 5).problem(),
            Some(CartProblem::Deleted)
        );
        let unknown = CartLine {
            sku: SkuCode::parse("S").unwrap(),
            quantity: 1,
            current: None,
        };
        assert_eq!(unknown.problem(), Some(CartProblem::NotFound));
    }
}

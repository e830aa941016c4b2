//! What goes into and comes out of the catalog's units of work: products, shelf
//! changes and schedules, operators, carts.

use std::collections::HashMap;

pub use domain::cart::{CartLine, CartProblem, CartSku};
pub use domain::catalog::Actor;

use domain::{
    CategoryCode, Currency, ErrorCode, ImageUrl, PriceMinor, ProductId, SaleStatus, ScheduleId,
    ServiceKeyId, ShelfOperation, ShopCode, SkuCode, SupplierCode, Timestamp, Title, UserId,
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
    /// The product's version the editor saw; a product that moved since is refused
    /// with `version_conflict` rather than overwritten.
    pub expected_version: Option<i64>,
}

impl ProductChanges {
    /// The names of the fields this sets, as `sku.changed` lists them.
    pub fn field_names(&self) -> Vec<&'static str> {
        [
            ("title", self.title.is_some()),
            ("image_url", self.image_url.is_some()),
            ("category", self.category.is_some()),
            ("supplier", self.supplier.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
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
    /// `Some` repeats the change (every day at the same minute) until cancelled.
    pub recurrence: Option<domain::Recurrence>,
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
    /// For a SKU on the shelf after the operation, what shoppers now see: put on the
    /// shelf with no stock, it is `TemporarilyOutOfStock`, not simply on sale (seed
    /// 003 §1.2).
    pub availability: Option<domain::Availability>,
}

/// What one schedule step did with one due schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedSchedule {
    pub id: ScheduleId,
    pub sku: SkuCode,
    /// `APPLIED`, `SKIPPED` (the SKU was deleted) or `REFUSED`.
    pub status: &'static str,
    pub outcome: String,
    /// A daily schedule's next occurrence, left pending.
    pub next: Option<ScheduleId>,
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cart {
    pub user: UserId,
    /// Ordered by SKU code.
    pub lines: Vec<CartLine>,
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
            shop: domain::ShopCode::default_shop(),
            sku: SkuCode::parse("S").unwrap(),
            quantity,
            current: Some(CartSku {
                title: String::new(),
                price: Some(domain::PriceMinor::new(100).unwrap()),
                currency: Some(domain::Currency::parse("EUR").unwrap()),
                sale_status: status,
                available,
                purchase_limit: None,
                purchased: 0,
                campaign: None,
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
            current: None,
            ..line(1, SaleStatus::OnShelf, 1)
        };
        assert_eq!(unknown.problem(), Some(CartProblem::NotFound));
    }
}

/// Which products the staff's list shows: every one, or those of one shop, category
/// and supplier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProductFilter {
    pub shop: Option<ShopCode>,
    pub category: Option<CategoryCode>,
    pub supplier: Option<SupplierCode>,
}

/// A scheduled shelf change as the staff's list shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleRecord {
    pub id: ScheduleId,
    pub sku: SkuCode,
    pub product_id: Option<ProductId>,
    /// `on` or `off`.
    pub operation: String,
    pub due_at: Timestamp,
    /// `PENDING`, `APPLIED`, `SKIPPED`, `REFUSED` or `CANCELLED`.
    pub status: String,
    pub operator_id: String,
    pub shop: Option<ShopCode>,
    pub remark: String,
    pub outcome: String,
    pub created_at: Timestamp,
    /// When it settled: applied, skipped, refused or cancelled.
    pub applied_at: Option<Timestamp>,
    /// The first occurrence's id: a daily schedule's occurrences share it, a one-off
    /// schedule is its own.
    pub series_id: ScheduleId,
    /// `daily`, or `None` for a one-off.
    pub recurrence: Option<String>,
}

/// What one step of the campaign worker did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndStep {
    /// The campaigns it closed.
    pub closed: Vec<domain::CampaignId>,
    /// Units it moved from buckets back to their SKUs' rows.
    pub units_returned: i64,
    /// The last campaign it looked at.
    pub last: Option<domain::CampaignId>,
    /// It looked at as many as it was allowed: more may be due after `last`.
    pub full: bool,
    /// The campaigns whose end failed (a lock timeout, a difference it refused to
    /// move), with the error: each rolled back alone, and the step went on to the
    /// next, so one campaign cannot hold back the end of the others.
    pub failed: Vec<(domain::CampaignId, String)>,
}

/// A campaign to create: its id and terms, checked by the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCampaign {
    pub id: domain::CampaignId,
    pub shop: ShopCode,
    pub sku: SkuCode,
    pub warehouse: domain::WarehouseCode,
    pub quantity: i64,
    pub buckets: u32,
    pub per_user_limit: Option<i64>,
    pub starts_at: Timestamp,
    pub ends_at: Timestamp,
    /// The most campaigns the shop may have open, this one included
    /// ([`domain::limits::CAMPAIGNS_OPEN_PER_SHOP_MAX`] unless configured).
    pub open_in_shop_max: i64,
}

/// A campaign with where its units are: in its buckets (left, held), sold, or back in
/// regular stock (returned at its end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Campaign {
    pub id: domain::CampaignId,
    pub code: domain::CampaignCode,
    pub shop: ShopCode,
    pub sku: SkuCode,
    pub warehouse: domain::WarehouseCode,
    pub quantity: i64,
    pub buckets: u32,
    pub per_user_limit: Option<i64>,
    pub starts_at: Timestamp,
    pub ends_at: Timestamp,
    pub created_at: Timestamp,
    /// When what was left went back (the first end step after `ends_at`).
    pub ended_at: Option<Timestamp>,
    /// When the buckets were found empty after the end: nothing more can come back.
    pub closed_at: Option<Timestamp>,
    /// Available in the buckets now.
    pub left: i64,
    /// Reserved in the buckets now (held by reservations and unpaid orders).
    pub held: i64,
    /// Units that went back to regular stock.
    pub returned: i64,
    /// Per bucket: (available, reserved).
    pub bucket_counts: Vec<(i64, i64)>,
}

impl Campaign {
    /// Where the campaign stands at `now`: ended once what was left went back, even
    /// before `ends_at` (its SKU was deleted).
    pub fn phase(&self, now: Timestamp) -> domain::CampaignPhase {
        if self.ended_at.is_some() {
            domain::CampaignPhase::Ended
        } else {
            domain::CampaignPhase::at(now, self.starts_at, self.ends_at)
        }
    }

    /// Units confirmed (sold): what left the buckets other than back to regular stock.
    pub fn sold(&self) -> i64 {
        self.quantity - self.returned - self.left - self.held
    }
}

//! Wire types of the catalog: products, shelf operations, the shelf log, operators,
//! carts and checkout.

use std::collections::HashMap;

use domain::{
    Availability, CategoryCode, Currency, ImageUrl, OperatorId, PriceMinor, Product, ProductId,
    ProductTitle, Quantity, ShelfLogEntry, ShopCode, Sku, SkuCode, SupplierCode, Timestamp,
    TtlSeconds,
};
use serde::{Deserialize, Serialize};
use store::{Cart, ShelfOutcome, ShelfResult, SkippedLine};
use utoipa::ToSchema;

// ---- requests ----

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSkuRequest {
    #[schema(value_type = crate::openapi::schemas::SkuCode)]
    pub sku: SkuCode,
    #[schema(value_type = crate::openapi::schemas::PriceMinor)]
    pub price: PriceMinor,
    #[schema(value_type = crate::openapi::schemas::Currency)]
    pub currency: Currency,
    #[serde(default)]
    #[schema(value_type = Option<crate::openapi::schemas::Spec>)]
    pub spec: Option<String>,
    /// Most units one shopper may hold or have bought.
    #[schema(value_type = Option<crate::openapi::schemas::PerUserLimit>)]
    pub per_user_limit: Option<domain::PerUserLimit>,
}

/// `POST /v1/products`. Each SKU code once.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProductRequest {
    #[schema(value_type = crate::openapi::schemas::ProductTitle)]
    pub title: ProductTitle,
    #[serde(default)]
    #[schema(value_type = Option<crate::openapi::schemas::ImageUrl>)]
    pub image_url: Option<ImageUrl>,
    #[schema(value_type = crate::openapi::schemas::CategoryCode)]
    pub category: CategoryCode,
    #[schema(value_type = crate::openapi::schemas::SupplierCode)]
    pub supplier: SupplierCode,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: ShopCode,
    /// 1–100 SKUs, each code once.
    #[schema(min_items = 1, max_items = 100)]
    pub skus: Vec<NewSkuRequest>,
}

/// `PATCH /v1/products/{id}`. The shop cannot change.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateProductRequest {
    #[schema(value_type = Option<crate::openapi::schemas::ProductTitle>)]
    pub title: Option<ProductTitle>,
    #[schema(value_type = Option<crate::openapi::schemas::ImageUrl>)]
    pub image_url: Option<ImageUrl>,
    #[schema(value_type = Option<crate::openapi::schemas::CategoryCode>)]
    pub category: Option<CategoryCode>,
    #[schema(value_type = Option<crate::openapi::schemas::SupplierCode>)]
    pub supplier: Option<SupplierCode>,
    /// The product's `version` the editor saw: when it moved since (another edit, or a
    /// shelf change of one of its SKUs, scheduled ones included), the edit is refused
    /// with 409 `version_conflict` and changes nothing, instead of overwriting what the
    /// other editor saved. A deleted product answers 404 either way. Without it the
    /// edit applies to the product as it is.
    #[schema(value_type = Option<i64>, minimum = 0)]
    pub expected_version: Option<domain::Version>,
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShelfOperationWire {
    On,
    Off,
    OnAt,
    OffAt,
    Delete,
}

/// How a scheduled shelf change repeats.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RepeatWire {
    /// Every 24 hours after `scheduled_at`, until cancelled.
    Daily,
}

/// `POST /v1/admin/shelf`. The targets are the SKUs of `product_ids`, `sku_ids`,
/// `category` and `supplier` together: name at least one, at most 1,000 `product_ids`
/// and `sku_ids` together, resolving to at most 1,000 SKUs. `scheduled_at` goes with
/// `on_at` and `off_at` and only with them: a minute in the future, within a year;
/// `repeat` goes with `on_at` and `off_at` only.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ShelfOperationRequest {
    pub operation: ShelfOperationWire,
    #[serde(default)]
    #[schema(value_type = Vec<crate::openapi::schemas::ProductId>, max_items = 1000)]
    pub product_ids: Vec<ProductId>,
    #[serde(default)]
    #[schema(value_type = Vec<crate::openapi::schemas::SkuCode>, max_items = 1000)]
    pub sku_ids: Vec<SkuCode>,
    #[schema(value_type = Option<crate::openapi::schemas::CategoryCode>)]
    pub category: Option<CategoryCode>,
    #[schema(value_type = Option<crate::openapi::schemas::SupplierCode>)]
    pub supplier: Option<SupplierCode>,
    /// The shop the operation acts in: `category` and `supplier` are looked up in it
    /// (they are a shop's own, so the same code may name another shop's products),
    /// and a named id of another shop is refused (404). An operator's is its own shop
    /// whether named or not (another shop: 403); the admin's, without it, every shop.
    #[schema(value_type = Option<crate::openapi::schemas::ShopCode>)]
    pub shop: Option<ShopCode>,
    /// Required by `on_at` and `off_at`; applied at the start of that minute.
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub scheduled_at: Option<Timestamp>,
    /// With `on_at` and `off_at` only: `daily` applies the change again every 24 hours
    /// (the same minute in UTC) until the schedule is cancelled.
    pub repeat: Option<RepeatWire>,
    #[schema(value_type = Option<crate::openapi::schemas::Remark>)]
    pub remark: Option<String>,
    /// Versions the operator saw, per SKU; a SKU that moved since is refused with
    /// `version_conflict` instead of being overwritten. Each must be a SKU the
    /// operation changes (else 409). With the operations applied
    /// now only: a schedule (`on_at`, `off_at`) naming them is refused (400).
    #[serde(default)]
    #[schema(schema_with = expected_versions_schema)]
    pub expected_versions: HashMap<SkuCode, domain::Version>,
}

/// A map from SKU code to the version the operator saw.
fn expected_versions_schema() -> utoipa::openapi::schema::Schema {
    serde_json::from_value(serde_json::json!({
        "type": "object",
        "description": "Versions the operator saw, per SKU code; a SKU that moved since is refused with `version_conflict`. Each must be a SKU the operation changes (else 409 `failed_precondition`). With the operations applied now only: a schedule (`on_at`, `off_at`) naming them is refused with 400 `invalid_argument`.",
        "maxProperties": domain::limits::SHELF_TARGETS_MAX,
        "propertyNames": {
            "type": "string",
            "minLength": 1,
            "maxLength": domain::limits::SKU_CODE_LENGTH_MAX,
            "pattern": crate::openapi::schemas::CODE_PATTERN,
        },
        "additionalProperties": {"type": "integer", "format": "int64", "minimum": 0},
    }))
    .expect("a well-formed schema")
}

/// `POST /v1/admin/operators`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOperatorRequest {
    #[schema(value_type = crate::openapi::schemas::OperatorId)]
    pub operator_id: OperatorId,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: ShopCode,
}

/// `PUT /v1/carts/{user}/items/{sku}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CartItemRequest {
    #[schema(value_type = crate::openapi::schemas::Quantity)]
    pub quantity: Quantity,
}

/// `POST /v1/carts/{user}/checkout`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckoutRequest {
    #[schema(value_type = Option<crate::openapi::schemas::TtlSeconds>)]
    pub ttl_seconds: Option<TtlSeconds>,
}

// ---- responses ----

#[derive(Debug, Serialize, ToSchema)]
pub struct StaffSkuBody<'a> {
    pub sku: &'a str,
    pub spec: &'a str,
    pub price: Option<i64>,
    pub currency: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::SaleStatus)]
    pub sale_status: &'static str,
    pub version: i64,
    pub available: i64,
    pub reserved: i64,
}

impl<'a> StaffSkuBody<'a> {
    fn new(sku: &'a Sku) -> StaffSkuBody<'a> {
        StaffSkuBody {
            sku: sku.code.as_str(),
            spec: &sku.spec,
            price: sku.price.map(PriceMinor::get),
            currency: sku.currency.as_ref().map(Currency::as_str),
            sale_status: sku.sale_status.as_str(),
            version: sku.version,
            available: sku.available(),
            reserved: sku.reserved(),
        }
    }
}

/// A product as staff see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProductBody<'a> {
    #[schema(value_type = crate::openapi::schemas::ProductId)]
    pub product_id: &'a str,
    pub title: &'a str,
    pub image_url: Option<&'a str>,
    pub category: &'a str,
    pub supplier: &'a str,
    pub shop: &'a str,
    pub version: i64,
    pub deleted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub deleted_at: Option<Timestamp>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub updated_at: Timestamp,
    pub skus: Vec<StaffSkuBody<'a>>,
}

impl<'a> ProductBody<'a> {
    pub fn new(product: &'a Product) -> ProductBody<'a> {
        ProductBody {
            product_id: product.id.as_str(),
            title: &product.title,
            image_url: product.image_url.as_ref().map(ImageUrl::as_str),
            category: product.category.as_str(),
            supplier: product.supplier.as_str(),
            shop: product.shop.as_str(),
            version: product.version,
            deleted: product.deleted_at.is_some(),
            deleted_at: product.deleted_at,
            created_at: product.created_at,
            updated_at: product.updated_at,
            skus: product.skus.iter().map(StaffSkuBody::new).collect(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ShopperSkuBody<'a> {
    pub sku: &'a str,
    pub spec: &'a str,
    pub price: Option<i64>,
    pub currency: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::Availability)]
    pub availability: Availability,
    /// Units that can be bought now (0 unless on sale).
    pub available: i64,
}

/// `GET /v1/products/{id}`: what a shopper sees. A display, read without locks: the
/// reservation at checkout decides.
#[derive(Debug, Serialize, ToSchema)]
pub struct ShopperProductBody<'a> {
    #[schema(value_type = crate::openapi::schemas::ProductId)]
    pub product_id: &'a str,
    pub title: &'a str,
    pub image_url: Option<&'a str>,
    pub category: &'a str,
    pub skus: Vec<ShopperSkuBody<'a>>,
}

impl<'a> ShopperProductBody<'a> {
    /// `available` says how many units of a SKU a shopper could reserve now.
    pub fn new(product: &'a Product, available: impl Fn(&Sku) -> i64) -> ShopperProductBody<'a> {
        ShopperProductBody {
            product_id: product.id.as_str(),
            title: &product.title,
            image_url: product.image_url.as_ref().map(ImageUrl::as_str),
            category: product.category.as_str(),
            skus: product
                .skus
                .iter()
                .filter(|sku| sku.sale_status.is_shown_to_shoppers())
                .map(|sku| {
                    let available = available(sku);
                    let availability = Availability::of(sku.sale_status, available);
                    ShopperSkuBody {
                        sku: sku.code.as_str(),
                        spec: &sku.spec,
                        price: sku.price.map(PriceMinor::get),
                        currency: sku.currency.as_ref().map(Currency::as_str),
                        availability,
                        available: if availability == Availability::OnSale {
                            available
                        } else {
                            0
                        },
                    }
                })
                .collect(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ShelfResultBody<'a> {
    pub sku: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product_id: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::ShelfOutcome)]
    pub outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::SaleStatus>)]
    pub from: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::SaleStatus>)]
    pub to: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::ErrorCode>)]
    pub code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<&'static str>,
    /// On the shelf after the operation: what shoppers now see (`on_sale`, or
    /// `temporarily_out_of_stock` when it went on the shelf with no stock).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::Availability>)]
    pub availability: Option<domain::Availability>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::ScheduleId>)]
    pub schedule_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub due_at: Option<Timestamp>,
}

/// `POST /v1/admin/shelf`: the counts and each target's result.
#[derive(Debug, Serialize, ToSchema)]
pub struct ShelfResultsBody<'a> {
    pub changed: usize,
    pub repeated: usize,
    pub scheduled: usize,
    pub refused: usize,
    pub results: Vec<ShelfResultBody<'a>>,
}

impl<'a> ShelfResultsBody<'a> {
    pub fn new(results: &'a [ShelfResult]) -> ShelfResultsBody<'a> {
        let results: Vec<ShelfResultBody<'a>> = results.iter().map(ShelfResultBody::new).collect();
        let count = |outcome: &str| {
            results
                .iter()
                .filter(|body| body.outcome == outcome)
                .count()
        };
        ShelfResultsBody {
            changed: count("changed"),
            repeated: count("repeated"),
            scheduled: count("scheduled"),
            refused: count("refused"),
            results,
        }
    }
}

impl<'a> ShelfResultBody<'a> {
    pub fn new(result: &'a ShelfResult) -> ShelfResultBody<'a> {
        let mut body = ShelfResultBody {
            sku: result.sku.as_str(),
            product_id: result.product_id.as_ref().map(ProductId::as_str),
            outcome: "",
            from: None,
            to: None,
            version: None,
            code: None,
            reason: None,
            missing: Vec::new(),
            availability: result.availability,
            schedule_id: None,
            due_at: None,
        };
        match &result.outcome {
            ShelfOutcome::Changed { from, to, version } => {
                body.outcome = "changed";
                body.from = Some(from.as_str());
                body.to = Some(to.as_str());
                body.version = Some(*version);
            }
            ShelfOutcome::Repeated { status } => {
                body.outcome = "repeated";
                body.from = Some(status.as_str());
                body.to = Some(status.as_str());
            }
            ShelfOutcome::Refused {
                code,
                reason,
                missing,
            } => {
                body.outcome = "refused";
                body.code = Some(code.as_str());
                body.reason = Some(reason);
                body.missing = missing.clone();
            }
            ShelfOutcome::Scheduled {
                schedule_id,
                due_at,
            } => {
                body.outcome = "scheduled";
                body.schedule_id = Some(schedule_id.as_str());
                body.due_at = Some(*due_at);
            }
        }
        body
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ShelfLogEntryBody<'a> {
    pub id: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product_id: Option<&'a str>,
    pub sku: &'a str,
    pub operator_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::OperatorType)]
    pub operator_type: &'static str,
    #[schema(value_type = crate::openapi::schemas::SaleStatus)]
    pub from: &'static str,
    #[schema(value_type = crate::openapi::schemas::SaleStatus)]
    pub to: &'static str,
    pub operation: &'a str,
    pub repeated: bool,
    pub remark: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
}

/// `GET /v1/admin/shelf-log`: a page, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct ShelfLogPageBody<'a> {
    pub entries: Vec<ShelfLogEntryBody<'a>>,
    /// The `after` of the next page: this page's last id, or, for an empty page, the
    /// `after` it was asked with (`null` only when neither exists).
    pub next_after: Option<i64>,
}

/// `POST /v1/admin/operators`: the token is in this answer only.
#[derive(Debug, Serialize, ToSchema)]
pub struct OperatorCreatedBody<'a> {
    #[schema(value_type = crate::openapi::schemas::OperatorId)]
    pub operator_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    /// Shown in the first answer only (`null` on a replay); stockd keeps its hash.
    pub token: Option<&'a str>,
    pub note: &'static str,
}

/// An operator whose token was revoked.
#[derive(Debug, Serialize, ToSchema)]
pub struct OperatorRevokedBody<'a> {
    #[schema(value_type = crate::openapi::schemas::OperatorId)]
    pub operator_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub revoked_at: Timestamp,
}

impl<'a> ShelfLogEntryBody<'a> {
    pub fn new(entry: &'a ShelfLogEntry) -> ShelfLogEntryBody<'a> {
        ShelfLogEntryBody {
            id: entry.id,
            product_id: entry.product_id.as_ref().map(ProductId::as_str),
            sku: entry.sku.as_str(),
            operator_id: entry.operator_id.as_str(),
            operator_type: entry.operator_type.as_str(),
            from: entry.from_status.as_str(),
            to: entry.to_status.as_str(),
            operation: &entry.operation,
            repeated: entry.repeated,
            remark: &entry.remark,
            created_at: entry.created_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CartLineBody<'a> {
    /// The shop the line was put in for: a service key sees its own shop's lines only,
    /// the admin every shop's, told apart by this.
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    pub sku: &'a str,
    pub quantity: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub title: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub price: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<&'a str>,
    pub orderable: bool,
    /// Why the line cannot be ordered now. Invalid lines are shown, not hidden.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::CartProblem>)]
    pub problem: Option<&'static str>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CartBody<'a> {
    pub user: &'a str,
    pub lines: Vec<CartLineBody<'a>>,
    pub orderable_lines: usize,
}

impl<'a> CartBody<'a> {
    pub fn new(cart: &'a Cart) -> CartBody<'a> {
        let lines: Vec<CartLineBody<'a>> = cart
            .lines
            .iter()
            .zip(domain::cart::problems_of(&cart.lines))
            .map(|(line, problem)| CartLineBody {
                shop: line.shop.as_str(),
                sku: line.sku.as_str(),
                quantity: line.quantity,
                title: line.current.as_ref().map(|current| current.title.as_str()),
                price: line
                    .current
                    .as_ref()
                    .and_then(|current| current.price.map(PriceMinor::get)),
                currency: line
                    .current
                    .as_ref()
                    .and_then(|current| current.currency.as_ref().map(Currency::as_str)),
                orderable: problem.is_none(),
                problem: problem.map(|problem| problem.as_str()),
            })
            .collect();
        let orderable_lines = lines.iter().filter(|line| line.orderable).count();
        CartBody {
            user: cart.user.as_str(),
            lines,
            orderable_lines,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SkippedLineBody<'a> {
    pub sku: &'a str,
    pub quantity: i64,
    #[schema(value_type = crate::openapi::schemas::CartProblem)]
    pub problem: &'static str,
}

pub fn skipped_lines(skipped: &[SkippedLine]) -> Vec<SkippedLineBody<'_>> {
    skipped
        .iter()
        .map(|line| SkippedLineBody {
            sku: line.sku.as_str(),
            quantity: line.quantity,
            problem: line.problem.as_str(),
        })
        .collect()
}

/// `GET /v1/admin/products`: a page, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProductsPageBody<'a> {
    pub products: Vec<ProductBody<'a>>,
    /// The `after` of the next page (`null` when this page is the last).
    #[schema(value_type = Option<crate::openapi::schemas::ProductId>)]
    pub next_after: Option<&'a str>,
}

/// A scheduled shelf change.
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleBody<'a> {
    #[schema(value_type = crate::openapi::schemas::ScheduleId)]
    pub schedule_id: &'a str,
    pub sku: &'a str,
    #[schema(value_type = Option<crate::openapi::schemas::ProductId>)]
    pub product_id: Option<&'a str>,
    /// `on` or `off`.
    #[schema(value_type = String, pattern = "^(on|off)$")]
    pub operation: &'a str,
    /// The start of the minute it applies at.
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub due_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::ScheduleStatus)]
    pub status: &'a str,
    pub operator_id: &'a str,
    pub shop: Option<&'a str>,
    pub remark: &'a str,
    /// What happened when it came due (empty while pending).
    pub outcome: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    /// When it settled: applied, skipped, refused or cancelled.
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub applied_at: Option<Timestamp>,
    /// The first occurrence's id: every occurrence of a daily schedule carries it; a
    /// one-off schedule's is its own id. Cancelling it cancels what is pending.
    #[schema(value_type = crate::openapi::schemas::ScheduleId)]
    pub series_id: &'a str,
    /// `daily`, or null for a one-off.
    #[schema(value_type = Option<String>, pattern = "^daily$")]
    pub repeat: Option<&'a str>,
}

impl<'a> ScheduleBody<'a> {
    pub fn new(schedule: &'a store::ScheduleRecord) -> ScheduleBody<'a> {
        ScheduleBody {
            schedule_id: schedule.id.as_str(),
            sku: schedule.sku.as_str(),
            product_id: schedule.product_id.as_ref().map(ProductId::as_str),
            operation: &schedule.operation,
            due_at: schedule.due_at,
            status: &schedule.status,
            operator_id: &schedule.operator_id,
            shop: schedule.shop.as_ref().map(ShopCode::as_str),
            remark: &schedule.remark,
            outcome: &schedule.outcome,
            created_at: schedule.created_at,
            applied_at: schedule.applied_at,
            series_id: schedule.series_id.as_str(),
            repeat: schedule.recurrence.as_deref(),
        }
    }
}

/// `GET /v1/admin/schedules`.
#[derive(Debug, Serialize, ToSchema)]
pub struct SchedulesBody<'a> {
    pub schedules: Vec<ScheduleBody<'a>>,
}

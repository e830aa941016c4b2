//! Wire types: what goes over HTTP, and the renderer that turns outcomes into the
//! stored bytes a client receives (and receives again on replay).

use domain::{
    AdjustmentQuantity, Currency, ErrorCode, LowStockThreshold, PerUserLimit, PriceMinor, Quantity,
    Reservation, Sku, SkuCode, Timestamp, Title, TtlSeconds, UserId, WarehouseCode,
};
use domain::{OperatorId, Product, ShopCode};
use serde::{Deserialize, Deserializer, Serialize};
use store::{
    AuditReport, Cart, MovementRecord, Rejection, ResponseRenderer, ServiceKey, ShelfOutcome,
    ShelfResult, SkippedLine, StoredResponse,
};
use utoipa::ToSchema;

use crate::problem::{problem_body, status_for};

// ---- requests ----

/// A field that may be absent (keep), `null` (remove) or a value (set).
fn present_or_null<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(deserializer).map(Some)
}

/// `PUT /v1/skus/{sku}`. Absent fields keep their current value.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SaveSkuRequest {
    #[schema(value_type = Option<crate::openapi::schemas::Title>)]
    pub title: Option<Title>,
    #[schema(value_type = Option<crate::openapi::schemas::PriceMinor>)]
    pub price: Option<PriceMinor>,
    #[schema(value_type = Option<crate::openapi::schemas::Currency>)]
    pub currency: Option<Currency>,
    #[schema(value_type = Option<crate::openapi::schemas::LowStockThreshold>)]
    pub low_stock_threshold: Option<LowStockThreshold>,
    /// The shop of a new SKU (the caller's by default); a SKU's shop never changes.
    #[schema(value_type = Option<crate::openapi::schemas::ShopCode>)]
    pub shop: Option<ShopCode>,
    /// Most units one shopper may hold or have bought; `null` removes the limit.
    #[serde(default, deserialize_with = "present_or_null")]
    #[schema(value_type = Option<crate::openapi::schemas::PerUserLimit>)]
    pub per_user_limit: Option<Option<PerUserLimit>>,
    /// The SKU's `version` the editor saw: when it moved since (another edit, a shelf
    /// change), the edit is refused with 409 `version_conflict` and changes nothing,
    /// instead of overwriting what the other editor saved. It never creates a SKU
    /// (404 `not_found`). Without it the edit applies to the SKU as it is.
    #[schema(value_type = Option<i64>, minimum = 0)]
    pub expected_version: Option<domain::Version>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MovementKindWire {
    Receive,
    Adjust,
}

/// `POST /v1/skus/{sku}/stock-movements`. `quantity` is checked against the kind
/// after parsing: receive takes 1..=1000000, adjust a non-zero ±1000000.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MovementRequest {
    pub kind: MovementKindWire,
    pub quantity: AdjustmentQuantity,
    pub warehouse: Option<WarehouseCode>,
}

/// The movement's schema: which quantities a kind takes is a choice between two
/// bodies, which the derived schema of one struct could not say. Each is a named
/// component, so a generated client has a type per kind.
impl utoipa::PartialSchema for MovementRequest {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::RefOr::T(
            serde_json::from_value(serde_json::json!({
                "description": "`receive` adds units; `adjust` corrects available stock by a non-zero amount, never below zero.",
                "oneOf": [
                    {"$ref": "#/components/schemas/ReceiveMovement"},
                    {"$ref": "#/components/schemas/AdjustMovement"},
                ],
                "discriminator": {"propertyName": "kind", "mapping": {
                    "receive": "#/components/schemas/ReceiveMovement",
                    "adjust": "#/components/schemas/AdjustMovement",
                }},
            }))
            .expect("a well-formed schema"),
        )
    }
}

impl ToSchema for MovementRequest {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use crate::openapi::schemas::{AdjustmentQuantity, Quantity, WarehouseCode};
        use utoipa::PartialSchema;
        schemas.push((
            "ReceiveMovement".into(),
            movement_kind_schema("receive", "Quantity"),
        ));
        schemas.push((
            "AdjustMovement".into(),
            movement_kind_schema("adjust", "AdjustmentQuantity"),
        ));
        schemas.push((Quantity::name().into(), Quantity::schema()));
        schemas.push((
            AdjustmentQuantity::name().into(),
            AdjustmentQuantity::schema(),
        ));
        schemas.push((WarehouseCode::name().into(), WarehouseCode::schema()));
    }
}

/// One kind of movement: its `kind`, the quantity it takes, the warehouse.
fn movement_kind_schema(
    kind: &str,
    quantity: &str,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::RefOr::T(
        serde_json::from_value(serde_json::json!({
            "type": "object",
            "additionalProperties": false,
            "required": ["kind", "quantity"],
            "properties": {
                "kind": {"type": "string", "enum": [kind]},
                "quantity": {"$ref": format!("#/components/schemas/{quantity}")},
                "warehouse": {"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/WarehouseCode"}]},
            },
        }))
        .expect("a well-formed schema"),
    )
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReservationLineRequest {
    #[schema(value_type = crate::openapi::schemas::SkuCode)]
    pub sku: SkuCode,
    #[schema(value_type = crate::openapi::schemas::Quantity)]
    pub quantity: Quantity,
    /// `default` when absent.
    #[schema(value_type = Option<crate::openapi::schemas::WarehouseCode>)]
    pub warehouse: Option<WarehouseCode>,
}

impl ReservationLineRequest {
    /// The line as the engine takes it: the default warehouse when none is named.
    pub fn into_line(self) -> domain::ReservationLine {
        domain::ReservationLine {
            sku: self.sku,
            warehouse: self
                .warehouse
                .unwrap_or_else(WarehouseCode::default_warehouse),
            quantity: self.quantity,
        }
    }
}

/// `POST /v1/reservations`. Each (sku, warehouse) once in `lines`, every SKU of one shop.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateReservationRequest {
    /// 1–50 lines, each (sku, warehouse) once, all of one shop.
    #[schema(min_items = 1, max_items = 50)]
    pub lines: Vec<ReservationLineRequest>,
    /// 900 (`STOCKD_RESERVATION_TTL_SECONDS_DEFAULT`) when absent.
    #[schema(value_type = Option<crate::openapi::schemas::TtlSeconds>)]
    pub ttl_seconds: Option<TtlSeconds>,
    /// The shopper the hold is for: counted against the open-hold bound and the
    /// SKUs' per-user limits (required on a SKU that has one).
    #[schema(value_type = Option<crate::openapi::schemas::UserId>)]
    pub user_id: Option<UserId>,
    /// The shop's order number: used once per shop (another Idempotency-Key with it
    /// is refused as `order_ref_reused`).
    #[schema(value_type = Option<crate::openapi::schemas::OrderRef>)]
    pub order_ref: Option<domain::OrderRef>,
    /// The calling channel (`web`, `app`, `pos`, …), recorded with the reservation.
    #[schema(value_type = Option<crate::openapi::schemas::RequestSource>)]
    pub source: Option<domain::RequestSource>,
    /// The campaign the request means to buy from: refused `campaign_not_started`
    /// before its start. Without it a running campaign of a line's SKU is used anyway.
    #[schema(value_type = Option<crate::openapi::schemas::CampaignId>)]
    pub campaign_id: Option<domain::CampaignId>,
}

/// Confirm and release take no fields; an empty body or `{}` is accepted.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EmptyRequest {}

// ---- responses ----

#[derive(Debug, Serialize, ToSchema)]
pub struct StockLevelBody<'a> {
    pub warehouse: &'a str,
    pub available: i64,
    pub reserved: i64,
    pub on_hand: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SkuBody<'a> {
    #[schema(value_type = crate::openapi::schemas::SkuCode)]
    pub sku: &'a str,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    pub title: &'a str,
    pub price: Option<i64>,
    pub currency: Option<&'a str>,
    pub low_stock_threshold: i64,
    pub per_user_limit: Option<i64>,
    #[schema(value_type = crate::openapi::schemas::SaleStatus)]
    pub sale_status: &'static str,
    pub version: i64,
    pub available: i64,
    pub reserved: i64,
    pub on_hand: i64,
    /// On shelf with `available` at or below the threshold (and a threshold set).
    pub low_stock: bool,
    pub warehouses: Vec<StockLevelBody<'a>>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub updated_at: Timestamp,
}

impl<'a> SkuBody<'a> {
    pub fn new(sku: &'a Sku) -> SkuBody<'a> {
        let available = sku.available();
        let reserved = sku.reserved();
        SkuBody {
            sku: sku.code.as_str(),
            shop: sku.shop.as_str(),
            title: &sku.title,
            price: sku.price.map(PriceMinor::get),
            currency: sku.currency.as_ref().map(Currency::as_str),
            low_stock_threshold: sku.low_stock_threshold,
            per_user_limit: sku.per_user_limit,
            sale_status: sku.sale_status.as_str(),
            version: sku.version,
            available,
            reserved,
            on_hand: available + reserved,
            low_stock: sku.low_stock_threshold > 0 && available <= sku.low_stock_threshold,
            warehouses: sku
                .stock
                .iter()
                .map(|level| StockLevelBody {
                    warehouse: level.warehouse.as_str(),
                    available: level.available,
                    reserved: level.reserved,
                    on_hand: level.available + level.reserved,
                })
                .collect(),
            created_at: sku.created_at,
            updated_at: sku.updated_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReservationLineBody<'a> {
    pub sku: &'a str,
    pub warehouse: &'a str,
    pub quantity: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReservationBody<'a> {
    #[schema(value_type = crate::openapi::schemas::ReservationId)]
    pub reservation_id: &'a str,
    /// The shopper it holds stock for, when the caller named one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_id: Option<&'a str>,
    /// The order that holds it; only that order's flow confirms or releases it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::OrderId>)]
    pub order_id: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::ReservationStatus)]
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::openapi::schemas::ReleaseReason>)]
    pub release_reason: Option<&'static str>,
    /// The shop's order number, when the request gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order_ref: Option<&'a str>,
    /// The calling channel, when the request named one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub expires_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub updated_at: Timestamp,
    pub lines: Vec<ReservationLineBody<'a>>,
    /// The ledger rows this reservation wrote (seed 002 §十三.1's 流水号): a reserve row
    /// per line (`<reservation_id>.reserve.<line>`), then a confirm or release row per
    /// line once it left `RESERVED`; each is `GET /v1/stock-movements/{movement_id}`.
    #[schema(value_type = Vec<crate::openapi::schemas::LedgerMovementId>)]
    pub movement_ids: Vec<String>,
}

impl<'a> ReservationBody<'a> {
    pub fn new(reservation: &'a Reservation) -> ReservationBody<'a> {
        ReservationBody {
            reservation_id: reservation.id.as_str(),
            user_id: reservation.user.as_ref().map(UserId::as_str),
            order_id: reservation.order_id.as_ref().map(|order| order.as_str()),
            status: reservation.status.as_str(),
            release_reason: reservation.release_reason.map(|reason| reason.as_str()),
            order_ref: reservation
                .reference
                .order_ref
                .as_ref()
                .map(domain::OrderRef::as_str),
            source: reservation
                .reference
                .source
                .as_ref()
                .map(domain::RequestSource::as_str),
            expires_at: reservation.expires_at,
            created_at: reservation.created_at,
            updated_at: reservation.updated_at,
            lines: reservation
                .lines
                .iter()
                .map(|line| ReservationLineBody {
                    sku: line.sku.as_str(),
                    warehouse: line.warehouse.as_str(),
                    quantity: line.quantity.get(),
                })
                .collect(),
            movement_ids: domain::LedgerMovementId::of_reservation(reservation)
                .iter()
                .map(ToString::to_string)
                .collect(),
        }
    }
}

/// `GET /v1/stock-movements/{movement_id}`: one ledger row.
#[derive(Debug, Serialize, ToSchema)]
pub struct LedgerMovementBody<'a> {
    #[schema(value_type = crate::openapi::schemas::LedgerMovementId)]
    pub movement_id: String,
    /// The row's number in the ledger (ascending in the order rows were written).
    pub ledger_id: i64,
    #[schema(value_type = crate::openapi::schemas::LedgerKind)]
    pub kind: &'a str,
    pub sku: &'a str,
    pub warehouse: &'a str,
    pub shop: Option<&'a str>,
    pub available_delta: i64,
    pub reserved_delta: i64,
    /// The movement, reservation or order that caused it.
    pub reference: &'a str,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
}

impl<'a> LedgerMovementBody<'a> {
    pub fn new(movement: &'a store::LedgerMovement) -> LedgerMovementBody<'a> {
        LedgerMovementBody {
            movement_id: movement.movement_id.to_string(),
            ledger_id: movement.ledger_id,
            kind: &movement.kind,
            sku: movement.sku.as_str(),
            warehouse: movement.warehouse.as_str(),
            shop: movement.shop.as_ref().map(ShopCode::as_str),
            available_delta: movement.available_delta,
            reserved_delta: movement.reserved_delta,
            reference: &movement.reference,
            created_at: movement.created_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MovementBody<'a> {
    /// The movement's ledger row: `GET /v1/stock-movements/{movement_id}`.
    #[schema(value_type = crate::openapi::schemas::MovementId)]
    pub movement_id: &'a str,
    pub sku: &'a str,
    pub warehouse: &'a str,
    #[schema(value_type = String, pattern = "^(receive|adjust)$")]
    pub kind: &'static str,
    pub quantity: i64,
    /// The row's counters after the movement.
    pub available: i64,
    pub reserved: i64,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AuditDifferenceBody<'a> {
    pub check: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sku: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warehouse: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shop: Option<&'a str>,
    pub expected: i64,
    pub actual: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AuditBody<'a> {
    pub ok: bool,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub checked_at: Timestamp,
    pub stock_rows_checked: i64,
    pub reservation_lines_checked: i64,
    pub orders_checked: i64,
    pub ledger_rows_checked: i64,
    pub differences_total: i64,
    pub differences: Vec<AuditDifferenceBody<'a>>,
}

impl<'a> AuditBody<'a> {
    pub fn new(report: &'a AuditReport) -> AuditBody<'a> {
        AuditBody {
            ok: report.ok(),
            checked_at: report.checked_at,
            stock_rows_checked: report.stock_rows_checked,
            reservation_lines_checked: report.reservation_lines_checked,
            orders_checked: report.orders_checked,
            ledger_rows_checked: report.ledger_rows_checked,
            differences_total: report.differences_total,
            differences: report
                .differences
                .iter()
                .map(|difference| AuditDifferenceBody {
                    check: difference.check,
                    sku: difference.sku.as_deref(),
                    warehouse: difference.warehouse.as_deref(),
                    reference: difference.reference.as_deref(),
                    shop: difference.shop.as_deref(),
                    expected: difference.expected,
                    actual: difference.actual,
                })
                .collect(),
        }
    }
}

fn json<T: Serialize>(status: u16, value: &T) -> StoredResponse {
    // Serializing these plain structs cannot fail; an empty object would be a bug
    // visible in every test.
    StoredResponse {
        status,
        body: serde_json::to_string(value).unwrap_or_else(|_| String::from("{}")),
    }
}

/// Renders outcomes as the HTTP layer's JSON. Handed to the engine at startup.
#[derive(Debug, Default, Clone, Copy)]
pub struct HttpRenderer;

impl ResponseRenderer for HttpRenderer {
    fn sku_saved(&self, sku: &Sku, created: bool) -> StoredResponse {
        json(if created { 201 } else { 200 }, &SkuBody::new(sku))
    }

    fn movement_recorded(&self, movement: &MovementRecord) -> StoredResponse {
        json(
            201,
            &MovementBody {
                movement_id: movement.id.as_str(),
                sku: movement.sku.as_str(),
                warehouse: movement.warehouse.as_str(),
                kind: movement.kind.as_str(),
                quantity: movement.available_delta,
                available: movement.available,
                reserved: movement.reserved,
                created_at: movement.created_at,
            },
        )
    }

    fn reservation_created(&self, reservation: &Reservation) -> StoredResponse {
        json(201, &ReservationBody::new(reservation))
    }

    fn reservation_changed(&self, reservation: &Reservation) -> StoredResponse {
        json(200, &ReservationBody::new(reservation))
    }

    fn rejected(&self, rejection: &Rejection) -> StoredResponse {
        StoredResponse {
            status: status_for(rejection.code).as_u16(),
            body: problem_body(rejection.code, &rejection.detail),
        }
    }

    fn product_saved(&self, product: &Product, created: bool) -> StoredResponse {
        json(
            if created { 201 } else { 200 },
            &crate::catalog_wire::ProductBody::new(product),
        )
    }

    /// 200 with every target's result when at least one succeeded; when all were
    /// refused, the problem of the first refusal (a `version_conflict` first), with the
    /// results as an extension member.
    fn shelf_results(&self, results: &[ShelfResult]) -> StoredResponse {
        let summary = crate::catalog_wire::ShelfResultsBody::new(results);
        if results.iter().any(|result| result.outcome.succeeded()) {
            return json(200, &summary);
        }
        let refusals = || {
            results.iter().filter_map(|result| match &result.outcome {
                ShelfOutcome::Refused { code, reason, .. } => Some((*code, reason.as_str())),
                _ => None,
            })
        };
        let (code, reason) = refusals()
            .find(|(code, _)| *code == ErrorCode::VersionConflict)
            .or_else(|| refusals().next())
            .unwrap_or((ErrorCode::InvalidArgument, "nothing to do"));
        let status = status_for(code);
        let mut problem: serde_json::Value = serde_json::from_str(&problem_body(code, reason))
            .unwrap_or_else(|_| serde_json::json!({}));
        problem["results"] = serde_json::to_value(&summary.results).unwrap_or_default();
        StoredResponse {
            status: status.as_u16(),
            body: problem.to_string(),
        }
    }

    fn operator_created(
        &self,
        operator: &OperatorId,
        shop: &ShopCode,
        token: Option<&str>,
    ) -> StoredResponse {
        json(
            201,
            &crate::catalog_wire::OperatorCreatedBody {
                operator_id: operator.as_str(),
                shop: shop.as_str(),
                token,
                note: "the token is shown in the first answer only; stockd keeps just its hash",
            },
        )
    }

    fn service_key_created(&self, key: &ServiceKey, secret: Option<&str>) -> StoredResponse {
        json(201, &ServiceKeyBody::new(key, secret))
    }

    fn service_key_revoked(&self, key: &ServiceKey) -> StoredResponse {
        json(200, &ServiceKeyBody::new(key, None))
    }

    fn operator_revoked(
        &self,
        operator: &OperatorId,
        shop: &ShopCode,
        revoked_at: Timestamp,
    ) -> StoredResponse {
        json(
            200,
            &crate::catalog_wire::OperatorRevokedBody {
                operator_id: operator.as_str(),
                shop: shop.as_str(),
                revoked_at,
            },
        )
    }

    fn cart(&self, cart: &Cart) -> StoredResponse {
        json(200, &crate::catalog_wire::CartBody::new(cart))
    }

    fn order(&self, order: &store::Order, created: bool) -> StoredResponse {
        json(
            if created { 201 } else { 200 },
            &crate::order_wire::OrderBody::new(order),
        )
    }

    fn schedule_cancelled(&self, schedule: &store::ScheduleRecord) -> StoredResponse {
        json(200, &crate::catalog_wire::ScheduleBody::new(schedule))
    }

    fn campaign_created(&self, campaign: &store::Campaign) -> StoredResponse {
        json(201, &CampaignBody::new(campaign, campaign.created_at))
    }

    fn campaign_ended_early(&self, campaign: &store::Campaign) -> StoredResponse {
        json(200, &CampaignBody::new(campaign, campaign.ends_at))
    }

    fn checked_out(&self, order: &store::Order, skipped: &[SkippedLine]) -> StoredResponse {
        json(
            201,
            &crate::order_wire::CheckedOutBody {
                order: crate::order_wire::OrderBody::new(order),
                skipped: crate::catalog_wire::skipped_lines(skipped),
            },
        )
    }
}

/// A service key as answered: the secret in the creating answer only.
#[derive(Debug, Serialize, ToSchema)]
pub struct ServiceKeyBody<'a> {
    #[schema(value_type = crate::openapi::schemas::ServiceKeyId)]
    pub key_id: &'a str,
    pub shop: &'a str,
    pub name: &'a str,
    /// Present (once) when the key was just created; stockd keeps only its hash.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<&'a str>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub revoked_at: Option<Timestamp>,
}

/// `GET /v1/admin/service-keys`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ServiceKeysBody<'a> {
    pub service_keys: Vec<ServiceKeyBody<'a>>,
}

/// `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthBody {
    #[schema(value_type = String, pattern = "^ok$")]
    pub status: &'static str,
}

/// `GET /readyz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReadyBody {
    #[schema(value_type = String, pattern = "^ready$")]
    pub status: &'static str,
    /// `sqlite`, `postgres` or `mysql`.
    pub database: &'static str,
}

/// One event of `GET /v1/events` (and of NATS subject `stockd.events.<type>`).
#[derive(Debug, Serialize, ToSchema)]
pub struct EventBody {
    /// `<aggregate>/<aggregate_id>/<sequence>`.
    pub id: String,
    #[schema(value_type = crate::openapi::schemas::EventType)]
    pub r#type: String,
    /// `reservation`, `order`, `payment`, `stock` or `sku`.
    pub aggregate: String,
    pub aggregate_id: String,
    /// The aggregate's events 1, 2, 3… in commit order.
    pub sequence: i64,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub occurred_at: String,
    /// The change; names its `shop`.
    #[schema(value_type = Object)]
    pub data: serde_json::Value,
}

/// `GET /v1/events`: a page.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventsPageBody {
    /// The events, in the type above (built by the store, documented here).
    #[schema(value_type = Vec<EventBody>)]
    pub events: Vec<serde_json::Value>,
    #[schema(value_type = crate::openapi::schemas::FeedCursor)]
    pub next_cursor: String,
}

impl<'a> ServiceKeyBody<'a> {
    pub fn new(key: &'a ServiceKey, secret: Option<&'a str>) -> ServiceKeyBody<'a> {
        ServiceKeyBody {
            key_id: key.id.as_str(),
            shop: key.shop.as_str(),
            name: &key.name,
            secret,
            created_at: key.created_at,
            revoked_at: key.revoked_at,
        }
    }
}

/// `POST /v1/admin/service-keys`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateServiceKeyRequest {
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: ShopCode,
    #[schema(value_type = crate::openapi::schemas::ServiceKeyName)]
    pub name: String,
}

/// A service key's name as stored: at most [`SERVICE_KEY_NAME_LENGTH_MAX`] characters
/// as sent, no control characters or line separators, not only white space; kept without the white space
/// around it.
///
/// [`SERVICE_KEY_NAME_LENGTH_MAX`]: domain::limits::SERVICE_KEY_NAME_LENGTH_MAX
pub fn service_key_name(raw: &str) -> Result<&str, String> {
    let length_max = domain::limits::SERVICE_KEY_NAME_LENGTH_MAX;
    let trimmed = raw.trim();
    if trimmed.is_empty()
        || raw.chars().count() > length_max
        || raw.chars().any(domain::unfit_for_text)
    {
        return Err(format!(
            "name must be 1 to {length_max} characters without control characters or line separators, not only white space"
        ));
    }
    Ok(trimmed)
}

/// Reads the `code` of a stored problem body, for counting replayed outcomes.
pub fn code_of_problem(body: &str) -> Option<ErrorCode> {
    #[derive(Deserialize)]
    struct CodeOnly {
        code: String,
    }
    serde_json::from_str::<CodeOnly>(body)
        .ok()
        .and_then(|only| ErrorCode::parse(&only.code))
}

/// `GET /v1/me`: who the credential is.
#[derive(Debug, Serialize, ToSchema)]
pub struct WhoAmIBody<'a> {
    /// `admin`, `operator` or `service`.
    #[schema(value_type = String, pattern = "^(admin|operator|service)$")]
    pub role: &'static str,
    /// The shop it acts in (`null`: the admin, every shop).
    #[schema(value_type = Option<crate::openapi::schemas::ShopCode>)]
    pub shop: Option<&'a str>,
    #[schema(value_type = Option<crate::openapi::schemas::OperatorId>)]
    pub operator_id: Option<&'a str>,
    #[schema(value_type = Option<crate::openapi::schemas::ServiceKeyId>)]
    pub key_id: Option<&'a str>,
}

impl<'a> WhoAmIBody<'a> {
    pub fn new(principal: &'a domain::Principal) -> WhoAmIBody<'a> {
        let (operator_id, key_id) = match principal {
            domain::Principal::Admin => (None, None),
            domain::Principal::Operator { id, .. } => (Some(id.as_str()), None),
            domain::Principal::Service { key, .. } => (None, Some(key.as_str())),
        };
        WhoAmIBody {
            role: principal.role().as_str(),
            shop: principal.shop().map(ShopCode::as_str),
            operator_id,
            key_id,
        }
    }
}

/// `POST /v1/admin/campaigns`: a flash sale of one SKU.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCampaignRequest {
    #[schema(value_type = crate::openapi::schemas::SkuCode)]
    pub sku: SkuCode,
    /// Units carved out of the SKU's available stock in `warehouse` for the campaign.
    #[schema(value_type = crate::openapi::schemas::Quantity)]
    pub quantity: Quantity,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub starts_at: Timestamp,
    /// After `starts_at`, in the future, and at most 366 days ahead; what is left then
    /// goes back to regular stock.
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub ends_at: Timestamp,
    /// Most units one shopper may buy in the campaign (requests must then name `user_id`);
    /// when absent, the SKU's own `per_user_limit` at the campaign's creation, if any.
    #[schema(value_type = Option<crate::openapi::schemas::PerUserLimit>)]
    pub per_user_limit: Option<PerUserLimit>,
    /// Stock rows the campaign's units are split over (4 by default, or one per unit
    /// when there are fewer; at most 64 and no more than the units): batches on
    /// different buckets commit in parallel.
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 64)]
    pub buckets: Option<domain::CampaignBuckets>,
    /// `default` when absent.
    #[schema(value_type = Option<crate::openapi::schemas::WarehouseCode>)]
    pub warehouse: Option<WarehouseCode>,
}

/// One bucket of a campaign.
#[derive(Debug, Serialize, ToSchema)]
pub struct CampaignBucketBody {
    pub bucket: u32,
    pub available: i64,
    pub reserved: i64,
}

/// A place in a campaign's waiting room: where it stands, or the answer of its request.
#[derive(Debug, Serialize, ToSchema)]
pub struct TicketBody {
    #[schema(value_type = crate::openapi::schemas::TicketId)]
    pub ticket_id: String,
    #[schema(value_type = crate::openapi::schemas::CampaignId)]
    pub campaign_id: String,
    /// `WAITING` until the request ran, then `ANSWERED`.
    #[schema(value_type = String, pattern = "^(WAITING|ANSWERED)$")]
    pub status: &'static str,
    /// Places ahead of this one while it waits (0: next); null once answered.
    pub position: Option<u64>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub issued_at: Timestamp,
    /// Where to poll: this ticket's URL.
    pub poll: String,
    /// The request's answer once it ran, as the request would have had it at once.
    pub answer: Option<TicketAnswerBody>,
}

/// A ticket's request, answered: its status and body (the reservation or order, or a
/// problem document).
#[derive(Debug, Serialize, ToSchema)]
pub struct TicketAnswerBody {
    #[schema(minimum = 200, maximum = 599)]
    pub status: u16,
    #[schema(value_type = Object)]
    pub body: serde_json::Value,
}

impl TicketBody {
    pub fn new(ticket: engine::TicketView) -> TicketBody {
        let (status, position, answer) = match ticket.state {
            engine::TicketState::Waiting { position } => ("WAITING", Some(position), None),
            engine::TicketState::Answered(answer) => {
                let (status, body) = match answer {
                    Ok(reply) => (
                        reply.response.status,
                        serde_json::from_str(&reply.response.body)
                            .unwrap_or(serde_json::Value::Null),
                    ),
                    Err(error) => {
                        let error = crate::problem::ApiError::from(error);
                        let body = crate::problem::problem_body_with_status(
                            error.code,
                            error.status,
                            &error.detail,
                        );
                        (
                            error.status.as_u16(),
                            serde_json::from_str(&body).unwrap_or(serde_json::Value::Null),
                        )
                    }
                };
                ("ANSWERED", None, Some(TicketAnswerBody { status, body }))
            }
        };
        TicketBody {
            poll: format!("/v1/tickets/{}", ticket.id),
            ticket_id: ticket.id.as_str().to_owned(),
            campaign_id: ticket.campaign.as_str().to_owned(),
            status,
            position,
            issued_at: ticket.issued_at,
            answer,
        }
    }
}

/// A campaign and where its units are.
#[derive(Debug, Serialize, ToSchema)]
pub struct CampaignBody<'a> {
    #[schema(value_type = crate::openapi::schemas::CampaignId)]
    pub campaign_id: &'a str,
    #[schema(value_type = crate::openapi::schemas::ShopCode)]
    pub shop: &'a str,
    #[schema(value_type = crate::openapi::schemas::SkuCode)]
    pub sku: &'a str,
    #[schema(value_type = crate::openapi::schemas::WarehouseCode)]
    pub warehouse: &'a str,
    #[schema(value_type = String, pattern = "^(SCHEDULED|RUNNING|ENDED)$")]
    pub phase: &'static str,
    pub quantity: i64,
    pub per_user_limit: Option<i64>,
    /// Confirmed (paid) units.
    pub sold: i64,
    /// Units held by open reservations and unpaid orders.
    pub held: i64,
    /// Units still available in the buckets.
    pub left: i64,
    /// Units that went back to regular stock after the end.
    pub returned: i64,
    pub buckets: Vec<CampaignBucketBody>,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub starts_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub ends_at: Timestamp,
    #[schema(value_type = crate::openapi::schemas::Timestamp)]
    pub created_at: Timestamp,
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub ended_at: Option<Timestamp>,
    #[schema(value_type = Option<crate::openapi::schemas::Timestamp>)]
    pub closed_at: Option<Timestamp>,
}

impl<'a> CampaignBody<'a> {
    pub fn new(campaign: &'a store::Campaign, now: Timestamp) -> CampaignBody<'a> {
        CampaignBody {
            campaign_id: campaign.id.as_str(),
            shop: campaign.shop.as_str(),
            sku: campaign.sku.as_str(),
            warehouse: campaign.warehouse.as_str(),
            phase: campaign.phase(now).as_str(),
            quantity: campaign.quantity,
            per_user_limit: campaign.per_user_limit,
            sold: campaign.sold(),
            held: campaign.held,
            left: campaign.left,
            returned: campaign.returned,
            buckets: campaign
                .bucket_counts
                .iter()
                .zip(0..)
                .map(|((available, reserved), bucket)| CampaignBucketBody {
                    bucket,
                    available: *available,
                    reserved: *reserved,
                })
                .collect(),
            starts_at: campaign.starts_at,
            ends_at: campaign.ends_at,
            created_at: campaign.created_at,
            ended_at: campaign.ended_at,
            closed_at: campaign.closed_at,
        }
    }
}

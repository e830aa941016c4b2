//! The OpenAPI 3.1 document served at `/openapi.json`, generated from the handlers'
//! `#[utoipa::path]` annotations and the wire types they parse and answer.
//!
//! Three sources, each in one place:
//! - the routes: [`routes`] registers every handler with the router *and* the document
//!   (`utoipa_axum::routes!`), so a route cannot exist undocumented;
//! - the constraints: the schemas of the domain's values ([`schemas`]) are written from
//!   the domain's own limits (`domain::limits`, each newtype's `MIN`/`MAX`), and a test
//!   in this module checks every pattern against the domain's parser;
//! - the errors: [`OPERATIONS`] names, per operation, the action it authorizes (its
//!   security is the roles `domain::PERMISSIONS` gives that action) and the codes only
//!   it can answer; the codes every operation of its kind can answer (a credential, a
//!   body, an `Idempotency-Key`, a path id) are added by [`finish`] from the
//!   operation's own parameters. Each status's problem schema names exactly its codes,
//!   through `problem::status_for`, the server's one mapping.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use domain::{Action, ErrorCode, Role};
use serde_json::{Map, Value, json};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::problem::status_for;

/// The schemas of the domain's values: what the server accepts, stated so a generated
/// client (and a fuzzer) knows it.
pub mod schemas {
    use domain::limits::{
        CATALOG_CODE_LENGTH_MAX, IDEMPOTENCY_KEY_LENGTH_MAX, IMAGE_URL_LENGTH_MAX,
        ORDER_REF_LENGTH_MAX, PRICE_MINOR_MAX, REMARK_LENGTH_MAX, REQUEST_SOURCE_LENGTH_MAX,
        SERVICE_KEY_NAME_LENGTH_MAX, SKU_CODE_LENGTH_MAX, SPEC_LENGTH_MAX, TITLE_LENGTH_MAX,
        WAREHOUSE_CODE_LENGTH_MAX,
    };
    use serde_json::{Value, json};
    use utoipa::openapi::{RefOr, schema::Schema};

    /// Codes (SKUs, warehouses, shops…): ASCII letters, digits, `-`, `_`, `.`,
    /// starting with a letter or digit (`domain::code`).
    pub const CODE_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]*$";
    /// Text without control characters (Unicode category Cc) or line separators
    /// (U+2028, U+2029), as `domain::unfit_for_text`.
    pub const TEXT_PATTERN: &str = "^[^\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029]*$";
    /// Text with at least one character that is not white space, and no control
    /// characters or line separators.
    pub const NON_BLANK_TEXT_PATTERN: &str = "^[^\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029]*[^\\s\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029][^\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029]*$";
    /// An http(s) URL of visible ASCII (`domain::ImageUrl`).
    pub const IMAGE_URL_PATTERN: &str = "^(https://[!-~]+|http://[!-~]{2,})$";
    /// Visible ASCII (`domain::IdempotencyKey`).
    pub const IDEMPOTENCY_KEY_PATTERN: &str = "^[!-~]+$";
    pub const CURRENCY_PATTERN: &str = "^[A-Z]{3}$";
    pub const PAYMENT_METHOD_PATTERN: &str = "^[A-Za-z0-9_]{1,255}$";
    /// A PostgreSQL log position, as `Stockd-Consistency-Token` carries it.
    pub const CONSISTENCY_TOKEN_PATTERN: &str = "^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$";
    /// A feed cursor: a non-negative decimal integer that fits 63 bits.
    pub const CURSOR_PATTERN: &str = "^[0-9]{1,18}$";
    /// A movement id (`domain::LedgerMovementId`).
    pub const MOVEMENT_ID_PATTERN: &str = "^(mov_[0-9a-f]{28}|rsv_[0-9a-f]{28}\\.(reserve|confirm|release)\\.(0|[1-9][0-9]{0,3})|ord_[0-9a-f]{28}\\.return\\.(0|[1-9][0-9]{0,3}))$";

    fn parse(value: Value) -> RefOr<Schema> {
        RefOr::T(serde_json::from_value(value).expect("a well-formed schema"))
    }

    /// The pattern of an id minted with `prefix` (`domain::id`).
    pub fn minted_id_pattern(prefix: &str) -> String {
        format!("^{prefix}[0-9a-f]{{28}}$")
    }

    /// The characters a code may start with, and those it may go on with (`domain::code`).
    const CODE_FIRST_CHARACTERS: &str =
        "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    const CODE_CHARACTERS: &str =
        "-.0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz";

    /// A regular-expression class of `characters` (ASCII, sorted), runs written as ranges.
    fn character_class(characters: impl Iterator<Item = u8>) -> String {
        let characters: std::collections::BTreeSet<u8> = characters.collect();
        let mut class = String::from("[");
        let mut characters = characters.into_iter().peekable();
        while let Some(first) = characters.next() {
            let mut last = first;
            while characters.peek() == Some(&(last + 1)) {
                last = characters.next().unwrap_or(last);
            }
            // Inside a class only `-` needs escaping; `\-` is valid in JavaScript's
            // unicode mode, Python and Rust alike.
            let write = |class: &mut String, character: u8| {
                if character == b'-' {
                    class.push('\\');
                }
                class.push(char::from(character));
            };
            write(&mut class, first);
            if last > first + 1 {
                class.push('-');
            }
            if last > first {
                write(&mut class, last);
            }
        }
        class.push(']');
        class
    }

    /// The code pattern without the codes that start with `prefix`, written without
    /// look-ahead: Rust's `regex`, and some clients' validators, have none. At each
    /// position the code either leaves the prefix (any other character, then any
    /// code) or follows it one more character, and may end there, short of all of it.
    pub fn code_pattern_refusing_prefix(prefix: &str) -> String {
        fn from(prefix: &[u8], position: usize) -> String {
            let allowed = if position == 0 {
                CODE_FIRST_CHARACTERS
            } else {
                CODE_CHARACTERS
            };
            let expected = prefix[position];
            let others = character_class(allowed.bytes().filter(|&c| c != expected));
            let any = character_class(CODE_CHARACTERS.bytes());
            let mut alternatives = format!("{others}{any}*");
            if position + 1 < prefix.len() {
                let literal = if expected == b'.' {
                    "\\.".to_owned()
                } else {
                    char::from(expected).to_string()
                };
                alternatives.push_str(&format!("|{literal}(?:{})?", from(prefix, position + 1)));
            }
            format!("(?:{alternatives})")
        }
        assert!(
            !prefix.is_empty()
                && prefix
                    .bytes()
                    .all(|byte| CODE_CHARACTERS.as_bytes().contains(&byte)),
            "a refused prefix is made of code characters"
        );
        format!("^{}$", from(prefix.as_bytes(), 0))
    }

    fn code(description: &str, length_max: usize, example: &str) -> Value {
        json!({
            "type": "string", "minLength": 1, "maxLength": length_max,
            "pattern": CODE_PATTERN, "description": description, "examples": [example],
        })
    }

    fn bounded(description: &str, minimum: i64, maximum: i64, example: i64) -> Value {
        json!({
            "type": "integer", "format": "int64", "minimum": minimum, "maximum": maximum,
            "description": description, "examples": [example],
        })
    }

    fn minted(description: &str, prefix: &str) -> Value {
        json!({
            "type": "string", "pattern": minted_id_pattern(prefix),
            "description": description,
            "examples": [format!("{prefix}019ae1f2a3b4c5d6e7f8a9b0c1d2")],
        })
    }

    /// Declares a named schema (a component) from its JSON.
    macro_rules! named_schema {
        ($(#[$meta:meta])* $name:ident => $value:expr) => {
            $(#[$meta])*
            pub struct $name;

            impl utoipa::PartialSchema for $name {
                fn schema() -> RefOr<Schema> {
                    parse($value)
                }
            }

            impl utoipa::ToSchema for $name {}
        };
    }

    named_schema!(SkuCode => code("A SKU's code, as the shop names it.", SKU_CODE_LENGTH_MAX, "MILK-1L"));
    named_schema!(WarehouseCode => {
        // Codes that start with `campaign-` are the buckets stockd gives a campaign's
        // units (`domain::campaign`): a request reaches them only through the campaign.
        let mut schema = code("A warehouse's code; stock is counted per (SKU, warehouse). `default` when a request names none. Codes that start with `campaign-` are campaigns' stock buckets, which stockd names: a request may not.", WAREHOUSE_CODE_LENGTH_MAX, "default");
        schema["pattern"] = Value::String(code_pattern_refusing_prefix(domain::campaign::BUCKET_WAREHOUSE_PREFIX));
        schema
    });
    named_schema!(ShopCode => code("A shop; every credential but the admin's acts inside one.", CATALOG_CODE_LENGTH_MAX, "demo-market"));
    named_schema!(CategoryCode => code("A product category.", CATALOG_CODE_LENGTH_MAX, "dairy"));
    named_schema!(SupplierCode => code("A product's supplier.", CATALOG_CODE_LENGTH_MAX, "bright-dairy"));
    named_schema!(OperatorId => code("An operator (staff of one shop).", CATALOG_CODE_LENGTH_MAX, "alice-ops"));
    named_schema!(UserId => code("A shopper, as the shop's checkout names them.", CATALOG_CODE_LENGTH_MAX, "alice"));
    named_schema!(OrderRef => code("The shop's own order number: used once per shop.", ORDER_REF_LENGTH_MAX, "SO-2026-0001"));
    named_schema!(RequestSource => code("The calling channel (web, app, pos, mq).", REQUEST_SOURCE_LENGTH_MAX, "web"));
    named_schema!(Title => json!({
        "type": "string", "maxLength": TITLE_LENGTH_MAX, "pattern": TEXT_PATTERN,
        "description": "A name for people: any text without control characters or line separators (U+2028, U+2029).",
        "examples": ["Whole milk 1 L"],
    }));
    named_schema!(ProductTitle => json!({
        "type": "string", "minLength": 1, "maxLength": TITLE_LENGTH_MAX, "pattern": NON_BLANK_TEXT_PATTERN,
        "description": "A product's name for shoppers: text without control characters or line separators, not blank.",
        "examples": ["Whole milk 1 L"],
    }));
    named_schema!(Spec => json!({
        "type": "string", "maxLength": SPEC_LENGTH_MAX, "pattern": TEXT_PATTERN,
        "description": "What distinguishes this SKU of the product (size, colour).",
        "examples": ["1 L"],
    }));
    named_schema!(Remark => json!({
        "type": "string", "maxLength": REMARK_LENGTH_MAX, "pattern": TEXT_PATTERN,
        "description": "Why, recorded in the shelf log.",
    }));
    named_schema!(RefundRemark => json!({
        "type": "string", "minLength": 1, "maxLength": REMARK_LENGTH_MAX, "pattern": NON_BLANK_TEXT_PATTERN,
        "description": "Why a refused refund was resolved so, or what was done instead: not blank.",
        "examples": ["refunded by bank transfer 4711"],
    }));
    named_schema!(ServiceKeyName => json!({
        "type": "string", "minLength": 1, "maxLength": SERVICE_KEY_NAME_LENGTH_MAX,
        "pattern": NON_BLANK_TEXT_PATTERN,
        "description": "A name for people (stored without surrounding white space).",
        "examples": ["checkout"],
    }));
    named_schema!(ImageUrl => json!({
        "type": "string", "minLength": 9, "maxLength": IMAGE_URL_LENGTH_MAX,
        "pattern": IMAGE_URL_PATTERN,
        "description": "An http or https URL of visible ASCII.",
        "examples": ["https://images.example/milk.png"],
    }));
    named_schema!(Currency => json!({
        "type": "string", "pattern": CURRENCY_PATTERN,
        "description": "An ISO 4217 code.", "examples": ["CNY"],
    }));
    named_schema!(PaymentMethod => json!({
        "type": "string", "minLength": 1, "maxLength": 255, "pattern": PAYMENT_METHOD_PATTERN,
        "description": "The gateway's payment method token. The sandbox knows pm_card_visa (pays), pm_card_chargeDeclined (declined) and the pm_sandbox_* faults (docs/PAYMENTS.md).",
        "examples": ["pm_card_visa"],
    }));
    named_schema!(PriceMinor => bounded("A price in minor units (fen, cents).", 0, PRICE_MINOR_MAX, 599));
    named_schema!(Quantity => bounded("Units: a JSON integer.", domain::Quantity::MIN, domain::Quantity::MAX, 1));
    named_schema!(PerUserLimit => bounded("Most units one shopper may hold or have bought.", domain::PerUserLimit::MIN, domain::PerUserLimit::MAX, 2));
    named_schema!(TtlSeconds => bounded("How long the hold lasts.", domain::TtlSeconds::MIN, domain::TtlSeconds::MAX, 900));
    named_schema!(LowStockThreshold => bounded("Available units at or below which an on-shelf SKU counts as low on stock; 0 turns it off.", domain::LowStockThreshold::MIN, domain::LowStockThreshold::MAX, 5));
    named_schema!(AdjustmentQuantity => json!({
        "description": "A non-zero correction of available stock.",
        "oneOf": [
            {"type": "integer", "format": "int64", "minimum": domain::AdjustmentQuantity::MIN, "maximum": -1},
            {"type": "integer", "format": "int64", "minimum": 1, "maximum": domain::AdjustmentQuantity::MAX},
        ],
    }));
    named_schema!(Timestamp => json!({
        "type": "string", "format": "date-time",
        "description": "RFC 3339; answers are UTC with milliseconds.",
        "examples": ["2026-12-02T08:30:00.000Z"],
    }));
    named_schema!(IdempotencyKey => json!({
        "type": "string", "minLength": 1, "maxLength": IDEMPOTENCY_KEY_LENGTH_MAX,
        "pattern": IDEMPOTENCY_KEY_PATTERN,
        "description": "Names this request: a retry with the same key gets the first answer again (header Idempotent-Replayed: true); the same key with another request is refused (422).",
        "examples": ["checkout-7f3a9c"],
    }));
    named_schema!(ConsistencyToken => json!({
        "type": "string", "maxLength": 17, "pattern": CONSISTENCY_TOKEN_PATTERN,
        "description": "A write's answer's Stockd-Consistency-Token: a display read that sends it back sees that write. A token past the writer's position names no write and is refused (400): on databases stockd does not replicate (SQLite, MySQL) every write answers 0/0, so any other token is.",
        "examples": ["16/B374D848"],
    }));
    named_schema!(FeedCursor => json!({
        "type": "string", "pattern": CURSOR_PATTERN,
        "description": "An earlier page's next_cursor; 0 for the start.", "examples": ["0"],
    }));
    named_schema!(LedgerMovementId => json!({
        "type": "string", "pattern": MOVEMENT_ID_PATTERN,
        "description": "A ledger row: a receive's or adjust's movement_id, a reservation's rsv_….reserve|confirm|release.LINE, an order's ord_….return.LINE.",
        "examples": ["rsv_019ae1f2a3b4c5d6e7f8a9b0c1d2.reserve.0"],
    }));
    named_schema!(ReservationId => minted("A reservation.", domain::ReservationId::PREFIX));
    named_schema!(CampaignId => minted("A flash-sale campaign.", domain::CampaignId::PREFIX));
    named_schema!(TicketId => minted("A place in a campaign's waiting room.", domain::TicketId::PREFIX));
    named_schema!(OrderId => minted("An order.", domain::OrderId::PREFIX));
    named_schema!(ProductId => minted("A product.", domain::ProductId::PREFIX));
    named_schema!(MovementId => minted("A receive or adjust movement.", domain::MovementId::PREFIX));
    named_schema!(ServiceKeyId => minted("A service key (public; its secret is not).", domain::ServiceKeyId::PREFIX));
    named_schema!(ScheduleId => minted("A scheduled shelf change.", domain::ScheduleId::PREFIX));
    named_schema!(PaymentAttemptId => minted("A payment attempt.", domain::PaymentAttemptId::PREFIX));
    named_schema!(RefundId => minted("A refund.", domain::RefundId::PREFIX));

    /// An enumeration of the strings `values`.
    fn one_of(description: &str, values: Vec<&'static str>) -> Value {
        json!({"type": "string", "enum": values, "description": description})
    }

    named_schema!(ReservationStatus => one_of("RESERVED → CONFIRMED | RELEASED.", domain::ReservationStatus::ALL.map(|status| status.as_str()).to_vec()));
    named_schema!(OrderStatus => one_of("An order's status (docs/PAYMENTS.md has the machine).", domain::OrderStatus::ALL.map(|status| status.as_str()).to_vec()));
    named_schema!(SaleStatus => one_of("PENDING_REVIEW → ON_SHELF | OFF_SHELF, OFF_SHELF ⇄ ON_SHELF, any → DELETED.", domain::SaleStatus::ALL.map(|status| status.as_str()).to_vec()));
    named_schema!(AttemptStatus => one_of("A payment attempt's status.", vec!["PROCESSING", "SUCCEEDED", "FAILED"]));
    named_schema!(ReleaseReason => one_of("Why a reservation was released.", vec!["requested", "expired"]));
    named_schema!(Availability => one_of("What a shopper sees for a SKU.", vec!["on_sale", "temporarily_out_of_stock", "off_shelf"]));
    named_schema!(OperatorType => one_of("Who made a shelf change.", vec!["manual", "scheduled", "system"]));
    named_schema!(CartProblem => one_of("Why a cart line cannot be ordered now.", vec!["not_found", "deleted", "off_shelf", "out_of_stock", "quantity_above_available", "no_price", "above_purchase_limit", "other_currency", "other_campaign"]));
    named_schema!(LedgerKind => one_of("What a ledger row did.", vec!["receive", "adjust", "reserve", "confirm", "release", "return"]));
    named_schema!(EventType => one_of("An event's type.", domain::EventType::ALL.map(|event| event.as_str()).to_vec()));
    named_schema!(ScheduleStatus => one_of("A scheduled change's status: PENDING (to come), APPLIED, SKIPPED (its SKU was deleted), REFUSED, CANCELLED (withdrawn by staff).", engine::catalog::ScheduleStatus::ALL.map(|status| status.as_str()).to_vec()));
    named_schema!(ShelfOutcome => one_of("What became of one target.", vec!["changed", "repeated", "refused", "scheduled"]));
    named_schema!(AssetName => json!({
        "type": "string", "enum": crate::pages::asset_names(),
        "description": "A file of the pages.",
    }));
    named_schema!(ErrorCode => one_of("A problem's stable code.", domain::ErrorCode::ALL.map(|code| code.as_str()).to_vec()));

    named_schema!(
        /// RFC 9457 problem details: every error answer, `application/problem+json`.
        Problem => json!({
            "type": "object",
            "description": "RFC 9457 problem details. `code` is stable; `detail` is for people. A shelf operation refused whole adds `results`.",
            "required": ["type", "title", "status", "code", "detail"],
            "properties": {
                "type": {"type": "string", "description": "urn:stockd:problem:<code>"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "code": {"$ref": "#/components/schemas/ErrorCode"},
                "detail": {"type": "string"},
            },
        })
    );

    /// Every schema of this module, by name: parameters name them too, and the
    /// document's components must hold each one referenced.
    pub fn all() -> Vec<(String, RefOr<Schema>)> {
        use utoipa::{PartialSchema, ToSchema};
        macro_rules! each {
            ($($name:ident),* $(,)?) => {
                vec![$(($name::name().into_owned(), $name::schema())),*]
            };
        }
        each!(
            SkuCode,
            WarehouseCode,
            ShopCode,
            CategoryCode,
            SupplierCode,
            OperatorId,
            UserId,
            OrderRef,
            RequestSource,
            Title,
            ProductTitle,
            Spec,
            Remark,
            RefundRemark,
            ServiceKeyName,
            ImageUrl,
            Currency,
            PaymentMethod,
            PriceMinor,
            Quantity,
            PerUserLimit,
            TtlSeconds,
            LowStockThreshold,
            AdjustmentQuantity,
            Timestamp,
            IdempotencyKey,
            ConsistencyToken,
            FeedCursor,
            LedgerMovementId,
            ReservationId,
            CampaignId,
            TicketId,
            OrderId,
            ProductId,
            MovementId,
            ServiceKeyId,
            ScheduleId,
            PaymentAttemptId,
            RefundId,
            ReservationStatus,
            OrderStatus,
            SaleStatus,
            AttemptStatus,
            ReleaseReason,
            Availability,
            OperatorType,
            CartProblem,
            LedgerKind,
            EventType,
            ShelfOutcome,
            ScheduleStatus,
            AssetName,
            ErrorCode,
            Problem,
        )
    }
}

/// What the document says of one operation beyond its annotation: the actions whose
/// roles may call it (none: anyone) and the problems only it answers.
pub struct Operation {
    pub id: &'static str,
    pub actions: &'static [Action],
    /// Also callable with `STOCKD_METRICS_TOKEN`.
    pub metrics_token: bool,
    pub problems: &'static [ErrorCode],
}

const fn operation(
    id: &'static str,
    actions: &'static [Action],
    problems: &'static [ErrorCode],
) -> Operation {
    Operation {
        id,
        actions,
        metrics_token: false,
        problems,
    }
}

use ErrorCode::{
    AlreadyExists, CampaignNotStarted, FailedPrecondition, IllegalTransition, InsufficientStock,
    InvalidArgument, NotFound, OffShelf, OrderRefReused, PaymentUnknown, PurchaseLimitExceeded,
    Unauthorized, VersionConflict,
};

/// Every operation of the document. A test checks each annotated handler has a row
/// and each row an operation.
pub const OPERATIONS: &[Operation] = &[
    operation("landing", &[], &[]),
    operation("docs", &[], &[]),
    operation("console", &[], &[]),
    operation("asset", &[], &[]),
    operation("healthz", &[], &[]),
    operation("readyz", &[], &[]),
    Operation {
        id: "metrics",
        actions: &[Action::Audit],
        metrics_token: true,
        problems: &[],
    },
    operation("openapi", &[], &[]),
    operation(
        "save_sku",
        &[Action::EditCatalog],
        &[
            AlreadyExists,
            IllegalTransition,
            FailedPrecondition,
            VersionConflict,
            NotFound,
        ],
    ),
    operation("get_sku", &[Action::ViewStock], &[NotFound]),
    operation(
        "record_movement",
        &[Action::MoveStock],
        &[
            NotFound,
            InsufficientStock,
            FailedPrecondition,
            IllegalTransition,
        ],
    ),
    operation("get_stock_movement", &[Action::ViewStock], &[NotFound]),
    operation(
        "create_campaign",
        &[Action::MoveStock],
        &[
            NotFound,
            InsufficientStock,
            FailedPrecondition,
            IllegalTransition,
        ],
    ),
    operation("get_campaign", &[Action::ViewStock], &[NotFound]),
    operation(
        "end_campaign",
        &[Action::MoveStock],
        &[NotFound, IllegalTransition],
    ),
    operation(
        "get_ticket",
        &[Action::Reserve, Action::PlaceOrder],
        &[NotFound],
    ),
    operation(
        "create_reservation",
        &[Action::Reserve],
        &[
            NotFound,
            InsufficientStock,
            OffShelf,
            PurchaseLimitExceeded,
            OrderRefReused,
            FailedPrecondition,
            CampaignNotStarted,
        ],
    ),
    operation("get_reservation", &[Action::Reserve], &[NotFound]),
    operation(
        "confirm_reservation",
        &[Action::Reserve],
        &[NotFound, IllegalTransition, OffShelf],
    ),
    operation(
        "release_reservation",
        &[Action::Reserve],
        &[NotFound, IllegalTransition],
    ),
    operation("audit", &[Action::Audit], &[]),
    operation("events", &[Action::ReadEvents], &[NotFound]),
    operation(
        "create_order",
        &[Action::PlaceOrder],
        &[
            NotFound,
            InsufficientStock,
            OffShelf,
            PurchaseLimitExceeded,
            OrderRefReused,
            FailedPrecondition,
            CampaignNotStarted,
        ],
    ),
    operation("get_order", &[Action::ViewOrders], &[NotFound]),
    operation(
        "pay",
        &[Action::PlaceOrder],
        &[
            NotFound,
            IllegalTransition,
            OffShelf,
            FailedPrecondition,
            PaymentUnknown,
        ],
    ),
    operation(
        "cancel",
        &[Action::PlaceOrder, Action::CancelPaidOrder],
        &[NotFound, IllegalTransition],
    ),
    operation(
        "return_goods",
        &[Action::ReturnGoods],
        &[NotFound, IllegalTransition],
    ),
    operation(
        "resolve_refund",
        &[Action::ResolveRefund],
        &[NotFound, IllegalTransition],
    ),
    operation("webhook", &[], &[InvalidArgument, Unauthorized]),
    operation("create_product", &[Action::EditCatalog], &[AlreadyExists]),
    operation("shopper_product", &[], &[NotFound]),
    operation(
        "update_product",
        &[Action::EditCatalog],
        &[NotFound, IllegalTransition, VersionConflict],
    ),
    operation(
        "delete_product",
        &[Action::DeleteCatalog],
        &[NotFound, IllegalTransition, VersionConflict],
    ),
    operation("staff_product", &[Action::ViewStaffData], &[NotFound]),
    operation(
        "shelf",
        &[Action::ChangeShelf],
        &[
            NotFound,
            IllegalTransition,
            VersionConflict,
            FailedPrecondition,
        ],
    ),
    operation("shelf_log", &[Action::ViewStaffData], &[]),
    operation("list_products", &[Action::ViewStaffData], &[]),
    operation("list_schedules", &[Action::ViewStaffData], &[]),
    operation(
        "cancel_schedule",
        &[Action::ChangeShelf],
        &[NotFound, IllegalTransition],
    ),
    operation("list_orders", &[Action::ViewOrders], &[]),
    operation("who_am_i", &[Action::Identify], &[]),
    operation(
        "create_operator",
        &[Action::ManageCredentials],
        &[AlreadyExists],
    ),
    // Its id is minted by stockd: nothing the caller sends can be taken.
    operation(
        "create_service_key",
        &[Action::ManageCredentials],
        &[FailedPrecondition],
    ),
    operation("service_keys", &[Action::ManageCredentials], &[]),
    operation("revoke_operator", &[Action::ManageCredentials], &[NotFound]),
    operation(
        "revoke_service_key",
        &[Action::ManageCredentials],
        &[NotFound],
    ),
    operation(
        "put_cart_item",
        &[Action::UseCarts],
        &[NotFound, OffShelf, FailedPrecondition],
    ),
    operation("delete_cart_item", &[Action::UseCarts], &[NotFound]),
    operation("get_cart", &[Action::UseCarts], &[]),
    operation(
        "checkout",
        &[Action::UseCarts],
        &[
            NotFound,
            InsufficientStock,
            OffShelf,
            PurchaseLimitExceeded,
            FailedPrecondition,
            VersionConflict,
        ],
    ),
];

/// Where an answer leads: (operation, status, operation it leads to, the target's
/// parameters as OpenAPI runtime expressions). A generated client and a fuzzer's
/// stateful phase follow them from a created thing to the calls about it.
struct Link {
    from: &'static str,
    status: &'static str,
    to: &'static str,
    parameters: &'static [(&'static str, &'static str)],
}

const fn link(
    from: &'static str,
    status: &'static str,
    to: &'static str,
    parameters: &'static [(&'static str, &'static str)],
) -> Link {
    Link {
        from,
        status,
        to,
        parameters,
    }
}

const LINKS: &[Link] = &[
    link(
        "create_reservation",
        "201",
        "get_reservation",
        &[("id", "$response.body#/reservation_id")],
    ),
    link(
        "create_reservation",
        "201",
        "confirm_reservation",
        &[("id", "$response.body#/reservation_id")],
    ),
    link(
        "create_reservation",
        "201",
        "release_reservation",
        &[("id", "$response.body#/reservation_id")],
    ),
    link(
        "create_reservation",
        "201",
        "get_stock_movement",
        &[("movement_id", "$response.body#/movement_ids/0")],
    ),
    link(
        "create_order",
        "201",
        "get_order",
        &[("id", "$response.body#/order_id")],
    ),
    link(
        "create_order",
        "201",
        "pay",
        &[("id", "$response.body#/order_id")],
    ),
    link(
        "create_order",
        "201",
        "cancel",
        &[("id", "$response.body#/order_id")],
    ),
    link(
        "create_order",
        "201",
        "return_goods",
        &[("id", "$response.body#/order_id")],
    ),
    link(
        "checkout",
        "201",
        "get_order",
        &[("id", "$response.body#/order_id")],
    ),
    link(
        "checkout",
        "201",
        "pay",
        &[("id", "$response.body#/order_id")],
    ),
    link(
        "create_product",
        "201",
        "shopper_product",
        &[("id", "$response.body#/product_id")],
    ),
    link(
        "create_product",
        "201",
        "staff_product",
        &[("id", "$response.body#/product_id")],
    ),
    link(
        "create_product",
        "201",
        "update_product",
        &[("id", "$response.body#/product_id")],
    ),
    link(
        "create_product",
        "201",
        "delete_product",
        &[("id", "$response.body#/product_id")],
    ),
    link(
        "save_sku",
        "201",
        "get_sku",
        &[("sku", "$response.body#/sku")],
    ),
    link(
        "create_campaign",
        "201",
        "get_campaign",
        &[("id", "$response.body#/campaign_id")],
    ),
    link(
        "create_campaign",
        "201",
        "end_campaign",
        &[("id", "$response.body#/campaign_id")],
    ),
    link(
        "save_sku",
        "201",
        "record_movement",
        &[("sku", "$response.body#/sku")],
    ),
    link(
        "record_movement",
        "201",
        "get_stock_movement",
        &[("movement_id", "$response.body#/movement_id")],
    ),
    link(
        "create_service_key",
        "201",
        "revoke_service_key",
        &[("key_id", "$response.body#/key_id")],
    ),
    link(
        "create_operator",
        "201",
        "revoke_operator",
        &[("operator_id", "$response.body#/operator_id")],
    ),
    link(
        "put_cart_item",
        "200",
        "get_cart",
        &[("user", "$request.path.user")],
    ),
    link(
        "put_cart_item",
        "200",
        "checkout",
        &[("user", "$request.path.user")],
    ),
    link(
        "put_cart_item",
        "200",
        "delete_cart_item",
        &[("user", "$request.path.user"), ("sku", "$request.path.sku")],
    ),
];

/// The security scheme of each role's credential.
fn scheme_of(role: Role) -> &'static str {
    match role {
        Role::Admin => "adminToken",
        Role::Operator => "operatorToken",
        Role::Service => "serviceKey",
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "stockd",
        description = "Inventory reservations and orders: the system of record that decides who gets the last unit. Every mutating call carries an Idempotency-Key; errors are RFC 9457 problem documents with a stable `code`. The operations console is at /console, this reference at /docs.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    tags(
        (name = "stock", description = "SKUs, their counters and stock movements"),
        (name = "reservations", description = "Holds on stock: reserve, confirm, release"),
        (name = "orders", description = "Orders, payments, cancellations and returns"),
        (name = "catalog", description = "Products and the shopper's view"),
        (name = "shelf", description = "Sale status: on and off the shelf, now or at a minute; the shelf log"),
        (name = "carts", description = "Shoppers' carts and checkout"),
        (name = "credentials", description = "Operators and service keys (admin)"),
        (name = "operations", description = "Health, audit, events and metrics"),
        (name = "pages", description = "Pages for people: this reference, the operations console"),
    )
)]
struct ApiDoc;

/// Every documented route: each handler goes to the router and to the document at once.
pub fn routes() -> OpenApiRouter<AppState> {
    use crate::{catalog_routes, order_routes, routes};
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(crate::pages::landing))
        .routes(routes!(crate::pages::docs))
        .routes(routes!(crate::pages::console))
        .routes(routes!(crate::pages::asset))
        .routes(routes!(routes::healthz))
        .routes(routes!(routes::readyz))
        .routes(routes!(crate::metrics::render))
        .routes(routes!(routes::openapi))
        .routes(routes!(routes::save_sku, routes::get_sku))
        .routes(routes!(routes::record_movement))
        .routes(routes!(routes::get_stock_movement))
        .routes(routes!(routes::create_campaign))
        .routes(routes!(routes::get_campaign))
        .routes(routes!(routes::end_campaign))
        .routes(routes!(routes::get_ticket))
        .routes(routes!(routes::create_reservation))
        .routes(routes!(routes::get_reservation))
        .routes(routes!(routes::confirm_reservation))
        .routes(routes!(routes::release_reservation))
        .routes(routes!(routes::audit))
        .routes(routes!(routes::events))
        .routes(routes!(
            order_routes::create_order,
            order_routes::list_orders
        ))
        .routes(routes!(order_routes::get_order))
        .routes(routes!(order_routes::pay))
        .routes(routes!(order_routes::cancel))
        .routes(routes!(order_routes::return_goods))
        .routes(routes!(order_routes::resolve_refund))
        .routes(routes!(order_routes::webhook))
        .routes(routes!(catalog_routes::create_product))
        .routes(routes!(
            catalog_routes::shopper_product,
            catalog_routes::update_product,
            catalog_routes::delete_product
        ))
        .routes(routes!(catalog_routes::staff_product))
        .routes(routes!(catalog_routes::list_products))
        .routes(routes!(catalog_routes::list_schedules))
        .routes(routes!(catalog_routes::cancel_schedule))
        .routes(routes!(routes::who_am_i))
        .routes(routes!(catalog_routes::shelf))
        .routes(routes!(catalog_routes::shelf_log))
        .routes(routes!(catalog_routes::create_operator))
        .routes(routes!(catalog_routes::revoke_operator))
        .routes(routes!(routes::create_service_key, routes::service_keys))
        .routes(routes!(routes::revoke_service_key))
        .routes(routes!(
            catalog_routes::put_cart_item,
            catalog_routes::delete_cart_item
        ))
        .routes(routes!(catalog_routes::get_cart))
        .routes(routes!(catalog_routes::checkout))
}

/// The document as served: generated once, then finished.
pub static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    let document = routes().into_openapi();
    let value = serde_json::to_value(&document).expect("the document serializes");
    serde_json::to_string(&finish(value)).expect("the document serializes")
});

const PROBLEM_TYPE: &str = "application/problem+json";

/// A problem code answered with a status other than `status_for(code)`'s.
struct Unusual {
    status: u16,
    code: ErrorCode,
    description: &'static str,
}

/// Applies the rules every operation of a kind shares, and [`OPERATIONS`]: security,
/// the problems, and the headers of display reads, writes and refusals.
pub fn finish(mut document: Value) -> Value {
    let Some(paths) = document.get_mut("paths").and_then(Value::as_object_mut) else {
        return document;
    };
    // The codes each status is answered with, over every operation: one problem schema
    // per status. (An `allOf` narrowing the common schema per operation would be more
    // precise, but client generators cannot merge a narrowed `status`; each operation's
    // own codes are listed in its response's description.)
    let mut problems: BTreeMap<u16, BTreeSet<&'static str>> = BTreeMap::new();
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for (method, operation) in item.iter_mut() {
            let Some(operation) = operation.as_object_mut() else {
                continue;
            };
            finish_operation(path, method, operation, &mut problems);
        }
    }
    let components = document
        .as_object_mut()
        .expect("the document is an object")
        .entry("components")
        .or_insert_with(|| json!({}));
    components["securitySchemes"] = json!({
        "adminToken": {"type": "http", "scheme": "bearer", "description": "STOCKD_ADMIN_TOKEN: every shop, every action."},
        "operatorToken": {"type": "http", "scheme": "bearer", "description": "An operator's token (POST /v1/admin/operators): staff of one shop."},
        "serviceKey": {"type": "http", "scheme": "bearer", "description": "A service key's secret (POST /v1/admin/service-keys): one shop's checkout backend."},
        "metricsToken": {"type": "http", "scheme": "bearer", "description": "STOCKD_METRICS_TOKEN: /metrics only."},
    });
    let schemas = components
        .as_object_mut()
        .expect("components is an object")
        .entry("schemas")
        .or_insert_with(|| json!({}));
    for (name, schema) in schemas::all() {
        schemas[name] = serde_json::to_value(schema).expect("a schema serializes");
    }
    for (status, codes) in problems {
        schemas[problem_schema_name(status)] = json!({
            "type": "object",
            "description": format!("A problem answered with status {status}: RFC 9457 problem details with one of these stable codes."),
            "required": ["type", "title", "status", "code", "detail"],
            "properties": {
                "type": {"type": "string", "description": "urn:stockd:problem:<code>"},
                "title": {"type": "string"},
                "status": {"type": "integer", "enum": [status]},
                "code": {"type": "string", "enum": codes.into_iter().collect::<Vec<_>>()},
                "detail": {"type": "string"},
            },
        });
    }
    document
}

fn problem_schema_name(status: u16) -> String {
    format!("Problem{status}")
}

fn finish_operation(
    path: &str,
    method: &str,
    operation: &mut Map<String, Value>,
    problems: &mut BTreeMap<u16, BTreeSet<&'static str>>,
) {
    let id = operation
        .get("operationId")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let declared = OPERATIONS
        .iter()
        .find(|declared| declared.id == id)
        .unwrap_or_else(|| panic!("{method} {path} ({id}) has no row in OPERATIONS"));
    let parameters: Vec<(String, String)> = operation
        .get("parameters")
        .and_then(Value::as_array)
        .map(|parameters| {
            parameters
                .iter()
                .map(|parameter| {
                    (
                        parameter["in"].as_str().unwrap_or_default().to_owned(),
                        parameter["name"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    // An optional parameter is one that may be left out, never one sent as `null`.
    if let Some(declared_parameters) = operation
        .get_mut("parameters")
        .and_then(Value::as_array_mut)
    {
        for parameter in declared_parameters {
            let schema = &mut parameter["schema"];
            if let Some(choices) = schema.get("oneOf").and_then(Value::as_array)
                && choices.len() == 2
                && let Some(other) = choices
                    .iter()
                    .find(|choice| choice.get("type") != Some(&json!("null")))
            {
                *schema = other.clone();
            }
        }
    }
    // An optional body likewise: left out, not `null` (the server takes `null` too).
    if let Some(schema) = operation
        .get_mut("requestBody")
        .and_then(|body| body.pointer_mut("/content/application~1json/schema"))
        && let Some(choices) = schema.get("oneOf").and_then(Value::as_array)
        && choices.len() == 2
        && let Some(other) = choices
            .iter()
            .find(|choice| choice.get("type") != Some(&json!("null")))
    {
        *schema = other.clone();
    }
    let has = |place: &str| parameters.iter().any(|(location, _)| location == place);
    let has_header = |name: &str| {
        parameters
            .iter()
            .any(|(location, header)| location == "header" && header.eq_ignore_ascii_case(name))
    };
    let has_body = operation.contains_key("requestBody");
    let keyed = has_header("Idempotency-Key");
    let displayed = has_header("Stockd-Consistency-Token");
    let secured = !declared.actions.is_empty();

    // Security: the roles the table gives the operation's actions.
    if secured {
        let mut schemes: Vec<&str> = vec![scheme_of(Role::Admin)];
        for role in [Role::Operator, Role::Service] {
            if declared
                .actions
                .iter()
                .any(|action| domain::principal::role_may(role, *action))
            {
                schemes.push(scheme_of(role));
            }
        }
        if declared.metrics_token {
            schemes.push("metricsToken");
        }
        operation.insert(
            "security".into(),
            Value::Array(
                schemes
                    .iter()
                    .map(|scheme| json!({ *scheme: [] }))
                    .collect(),
            ),
        );
    } else {
        operation.insert("security".into(), json!([]));
    }

    // Problems: the operation's own, and those of its kind.
    let mut codes: Vec<ErrorCode> = declared.problems.to_vec();
    let mut unusual: Vec<Unusual> = Vec::new();
    codes.extend([ErrorCode::Internal, ErrorCode::Unavailable]);
    if path.starts_with("/v1/") {
        codes.extend([ErrorCode::LockTimeout, ErrorCode::RetryExhausted]);
    }
    if secured {
        codes.extend([
            ErrorCode::Unauthorized,
            ErrorCode::Forbidden,
            ErrorCode::RateLimited,
        ]);
    }
    if has("path") || has("query") || has_body || keyed || displayed {
        codes.push(ErrorCode::InvalidArgument);
    }
    if has("path") {
        codes.push(ErrorCode::NotFound);
    }
    if keyed {
        codes.extend([
            ErrorCode::RequestInProgress,
            ErrorCode::IdempotencyKeyReused,
        ]);
    }
    if has_body || id == "webhook" {
        unusual.push(Unusual {
            status: 408,
            code: ErrorCode::InvalidArgument,
            description: "The body did not arrive within the server's bound; the connection is closed.",
        });
        unusual.push(Unusual {
            status: 413,
            code: ErrorCode::InvalidArgument,
            description: "The body is larger than 64 KiB.",
        });
    }
    // The webhook reads its body raw (its signature covers the bytes), whatever its
    // content type.
    if has_body && id != "webhook" {
        unusual.push(Unusual {
            status: 415,
            code: ErrorCode::InvalidArgument,
            description: "The body is not application/json.",
        });
    }
    if secured {
        unusual.push(Unusual {
            status: 429,
            code: ErrorCode::Unavailable,
            description: "Too many credentials this instance has not seen lately are being looked up at once (a flood of unknown tokens); a credential it found before is not held back.",
        });
    }
    if id == "create_reservation" {
        unusual.push(Unusual {
            status: 429,
            code: ErrorCode::Unavailable,
            description: "The reservation queue is full.",
        });
    }
    if matches!(
        id.as_str(),
        "create_reservation" | "create_order" | "checkout"
    ) {
        unusual.push(Unusual {
            status: 429,
            code: ErrorCode::RateLimited,
            description: "A running campaign's waiting room is full here, or this user already has a request waiting or running in it.",
        });
    }
    codes.sort_by_key(|code| code.as_str());
    codes.dedup();

    for Link {
        status,
        to,
        parameters,
        ..
    } in LINKS.iter().filter(|link| link.from == id)
    {
        let link = json!({
            "operationId": to,
            "parameters": parameters.iter().map(|(name, expression)| (name.to_string(), json!(expression))).collect::<Map<String, Value>>(),
        });
        if let Some(response) = operation
            .get_mut("responses")
            .and_then(|responses| responses.get_mut(*status))
            .and_then(Value::as_object_mut)
        {
            let links = response.entry("links").or_insert_with(|| json!({}));
            links[to.to_string()] = link;
        }
    }

    let responses = operation
        .entry("responses")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .expect("responses is an object");
    let mut by_status: Vec<(u16, Vec<ErrorCode>, Vec<&'static str>)> = Vec::new();
    let mut add = |status: u16, code: ErrorCode, note: Option<&'static str>| match by_status
        .iter_mut()
        .find(|(known, _, _)| *known == status)
    {
        Some((_, codes, notes)) => {
            if !codes.contains(&code) {
                codes.push(code);
            }
            notes.extend(note);
        }
        None => by_status.push((status, vec![code], note.into_iter().collect())),
    };
    for code in &codes {
        add(status_for(*code).as_u16(), *code, None);
    }
    for extra in &unusual {
        add(extra.status, extra.code, Some(extra.description));
    }
    for (status, codes, notes) in by_status {
        let listed: Vec<String> = codes.iter().map(|code| format!("`{code}`")).collect();
        let mut description = listed.join(", ");
        for note in notes {
            // Notes are sentences: each ends with its own full stop.
            description.push_str(if description.ends_with('.') {
                " "
            } else {
                ". "
            });
            description.push_str(note);
        }
        problems
            .entry(status)
            .or_default()
            .extend(codes.iter().map(|code| code.as_str()));
        let schema =
            json!({"$ref": format!("#/components/schemas/{}", problem_schema_name(status))});
        let mut response = json!({
            "description": description,
            "content": {PROBLEM_TYPE: {"schema": schema}},
        });
        if status == 429 || status == 503 {
            response["headers"] = json!({"Retry-After": {
                "description": "Seconds to wait before retrying (with the same Idempotency-Key).",
                "required": true,
                "schema": {"type": "integer", "minimum": 1},
            }});
        }
        let key = status.to_string();
        match responses.get_mut(&key) {
            // An answer that is a success or a problem by its body (202 of `pay`).
            Some(existing) => merge_problem(existing, response),
            None => {
                responses.insert(key, response);
            }
        }
    }

    // Headers of the answers that carry them.
    for (status, response) in responses.iter_mut() {
        let success = status.starts_with('2');
        let mut headers = response
            .get("headers")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        // 422 (`idempotency_key_reused`) answers a key used for another request: it
        // is never stored, replayed or stamped.
        let stored = !matches!(
            status.as_str(),
            "401" | "408" | "413" | "415" | "422" | "429" | "500" | "503"
        );
        if keyed && stored {
            headers.insert(
                "Idempotent-Replayed".into(),
                json!({
                    "description": "`true` on an answer given again for a retried Idempotency-Key.",
                    "schema": {"type": "string", "enum": ["true"]},
                }),
            );
            if success || status == "409" {
                headers.insert(
                    "Stockd-Consistency-Token".into(),
                    json!({
                        "description": "The writer's position after this write: send it back on a display read to see the write. Absent on a refusal decided before anything was written (a campaign's sold-out answer from memory): keep the token you had.",
                        "schema": {"$ref": "#/components/schemas/ConsistencyToken"},
                    }),
                );
            }
        }
        if displayed && success {
            // A display answer carries the data's time; `displayed_json` adds it.
            if let Some(schema) = response.pointer_mut("/content/application~1json/schema") {
                let body = schema.take();
                *schema = json!({"allOf": [body, {
                    "type": "object",
                    "required": ["as_of"],
                    "properties": {"as_of": {
                        "$ref": "#/components/schemas/Timestamp",
                        "description": "The data's time (a replica's lags the primary's).",
                    }},
                }]});
            }
            headers.insert(
                "Stockd-Served-By".into(),
                json!({
                    "description": "Who served the read: primary, replica or cache.",
                    "required": true,
                    "schema": {"type": "string", "enum": ["primary", "replica", "cache"]},
                }),
            );
        }
        let response = response.as_object_mut().expect("a response is an object");
        if headers.is_empty() {
            response.remove("headers");
        } else {
            response.insert("headers".into(), Value::Object(headers));
        }
    }
}

/// Adds a problem's content to a response that has a success content too.
fn merge_problem(existing: &mut Value, problem: Value) {
    if let (Some(content), Some(problem_content)) = (
        existing.get_mut("content").and_then(Value::as_object_mut),
        problem.get("content").and_then(Value::as_object),
    ) {
        for (media_type, schema) in problem_content {
            content.insert(media_type.clone(), schema.clone());
        }
    }
    if let (Some(description), Some(problem_description)) = (
        existing.get("description").and_then(Value::as_str),
        problem.get("description").and_then(Value::as_str),
    ) {
        existing["description"] = Value::from(format!("{description}; or {problem_description}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn document() -> Value {
        serde_json::from_str(&DOCUMENT).unwrap()
    }

    #[test]
    fn every_operation_has_a_row_and_every_row_an_operation() {
        let document = document();
        let mut documented = Vec::new();
        for item in document["paths"].as_object().unwrap().values() {
            for operation in item.as_object().unwrap().values() {
                documented.push(operation["operationId"].as_str().unwrap().to_owned());
            }
        }
        documented.sort();
        let mut declared: Vec<String> = OPERATIONS.iter().map(|row| row.id.to_owned()).collect();
        declared.sort();
        assert_eq!(documented, declared);
    }

    #[test]
    fn the_document_is_openapi_3_1_and_every_reference_resolves() {
        let document = document();
        assert_eq!(document["openapi"], "3.1.0");
        let text = document.to_string();
        for reference in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = &reference[..reference.find('"').unwrap()];
            assert!(
                document["components"]["schemas"].get(name).is_some(),
                "#/components/schemas/{name} is referenced but missing"
            );
        }
    }

    #[test]
    fn every_problem_status_names_codes_the_server_answers_with_it() {
        let document = document();
        for (path, item) in document["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                for (status, response) in operation["responses"].as_object().unwrap() {
                    let Some(problem) = response["content"].get(PROBLEM_TYPE) else {
                        continue;
                    };
                    let name = problem["schema"]["$ref"]
                        .as_str()
                        .unwrap()
                        .trim_start_matches("#/components/schemas/");
                    let codes =
                        document["components"]["schemas"][name]["properties"]["code"]["enum"]
                            .as_array()
                            .unwrap();
                    let description = response["description"].as_str().unwrap();
                    assert!(!description.is_empty(), "{method} {path} {status}");
                    assert!(!codes.is_empty(), "{method} {path} {status}");
                    for code in codes {
                        let code = ErrorCode::parse(code.as_str().unwrap()).unwrap();
                        let usual = status_for(code).as_u16().to_string() == *status;
                        let unusual = matches!(
                            (code, status.as_str()),
                            (ErrorCode::InvalidArgument, "408" | "413" | "415")
                                | (ErrorCode::Unavailable, "429")
                        );
                        assert!(usual || unusual, "{method} {path}: {code} under {status}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_link_leads_from_a_documented_answer_to_an_operation() {
        let document = document();
        let mut operations = Vec::new();
        let mut linked = 0;
        for item in document["paths"].as_object().unwrap().values() {
            for operation in item.as_object().unwrap().values() {
                operations.push(operation["operationId"].as_str().unwrap().to_owned());
                for response in operation["responses"].as_object().unwrap().values() {
                    linked += response
                        .get("links")
                        .and_then(Value::as_object)
                        .map_or(0, Map::len);
                }
            }
        }
        assert_eq!(
            linked,
            LINKS.len(),
            "every link lands on a documented status"
        );
        for link in LINKS {
            assert!(
                operations.iter().any(|operation| operation == link.from),
                "{}",
                link.from
            );
            assert!(
                operations.iter().any(|operation| operation == link.to),
                "{}",
                link.to
            );
        }
    }

    #[test]
    fn security_follows_the_permission_table() {
        let document = document();
        let reserve = &document["paths"]["/v1/reservations"]["post"]["security"];
        assert_eq!(reserve, &json!([{"adminToken": []}, {"serviceKey": []}]));
        let delete = &document["paths"]["/v1/products/{id}"]["delete"]["security"];
        assert_eq!(delete, &json!([{"adminToken": []}]));
        let shopper = &document["paths"]["/v1/products/{id}"]["get"]["security"];
        assert_eq!(shopper, &json!([]));
        let metrics = &document["paths"]["/metrics"]["get"]["security"];
        assert_eq!(
            metrics,
            &json!([{"adminToken": []}, {"operatorToken": []}, {"metricsToken": []}])
        );
    }

    /// Every string of up to three characters over an alphabet that crosses each
    /// pattern's edges, and strings around each length limit.
    fn corpus() -> Vec<String> {
        let alphabet = [
            "a", "Z", "0", "9", "-", "_", ".", " ", "/", ":", "[", "!", "~", "f", "F", "h", "t",
            "p", "s", "\u{7f}", "\u{85}", "\u{a0}", "\t", "\n", "é", "漢", "\u{2028}", "\u{2029}",
        ];
        let mut strings = vec![String::new()];
        let mut previous = vec![String::new()];
        for _ in 0..3 {
            let mut next = Vec::new();
            for prefix in &previous {
                for letter in alphabet {
                    next.push(format!("{prefix}{letter}"));
                }
            }
            strings.extend(next.iter().cloned());
            previous = next;
        }
        for length in [
            8, 16, 17, 28, 31, 32, 33, 63, 64, 65, 199, 200, 201, 254, 255, 256,
        ] {
            strings.push("a".repeat(length));
            strings.push(format!("{}é", "a".repeat(length - 1)));
            strings.push(format!("https://{}", "a".repeat(length)));
            strings.push(format!(" {}", "b".repeat(length)));
        }
        // Around the prefix of campaigns' bucket warehouses: every proper prefix of
        // it, it, and codes that leave it at each position.
        let bucket_prefix = domain::campaign::BUCKET_WAREHOUSE_PREFIX;
        for length in 1..=bucket_prefix.len() {
            let start = &bucket_prefix[..length];
            strings.push(start.to_owned());
            for next in ["x", "-", ".", "_", "0", "C", " ", "campaign-"] {
                strings.push(format!("{start}{next}"));
            }
            strings.push(format!("{}X", &bucket_prefix[..length - 1]));
        }
        strings.push(format!("{bucket_prefix}0123456789ab-1"));
        strings.push("Campaign-0123456789ab-1".to_owned());
        for prefix in ["rsv_", "ord_", "mov_", "prd_", "key_"] {
            strings.push(format!("{prefix}{}", "0a".repeat(14)));
            strings.push(format!("{prefix}{}", "0A".repeat(14)));
            strings.push(format!("{prefix}{}", "0a".repeat(13)));
        }
        let reservation = format!("rsv_{}", "0a".repeat(14));
        let order = format!("ord_{}", "0a".repeat(14));
        for tail in [
            ".reserve.0",
            ".confirm.12",
            ".release.9999",
            ".reserve.10000",
            ".reserve.01",
            ".return.0",
            ".take.1",
            ".reserve",
        ] {
            strings.push(format!("{reservation}{tail}"));
            strings.push(format!("{order}{tail}"));
        }
        strings.extend(
            [
                "16/B374D848",
                "0/0",
                "123456789/0",
                "a/b",
                "/1",
                "1/",
                "01234567/89abcdef",
                "ABCDEFGH/12345678",
            ]
            .map(String::from),
        );
        strings.extend(
            [
                "0",
                "007",
                "123456789012345678",
                "1234567890123456789",
                "-1",
                "+1",
                "1.0",
            ]
            .map(String::from),
        );
        strings.extend(
            [
                "http://ab",
                "http://a",
                "https://a",
                "https://",
                "http://a b",
                "ftp://x.y",
                "HTTPS://x.y",
            ]
            .map(String::from),
        );
        strings
    }

    /// The pattern and length bounds a schema states, as one predicate.
    fn schema_accepts(schema: &Value, pattern: &regex::Regex, text: &str) -> bool {
        let length = text.chars().count();
        let min = schema["minLength"].as_u64().unwrap_or(0) as usize;
        let max = schema["maxLength"]
            .as_u64()
            .map_or(usize::MAX, |max| max as usize);
        pattern.is_match(text) && (min..=max).contains(&length)
    }

    fn component(name: &str) -> Value {
        document()["components"]["schemas"][name].clone()
    }

    #[test]
    fn every_pattern_accepts_exactly_what_the_server_parses() {
        type Parser = fn(&str) -> bool;
        let parsers: Vec<(&str, Parser)> = vec![
            ("SkuCode", |text| domain::SkuCode::parse(text).is_ok()),
            ("WarehouseCode", |text| {
                domain::WarehouseCode::parse(text)
                    .is_ok_and(|warehouse| !domain::campaign::is_bucket_warehouse(&warehouse))
            }),
            ("ShopCode", |text| domain::ShopCode::parse(text).is_ok()),
            ("CategoryCode", |text| {
                domain::CategoryCode::parse(text).is_ok()
            }),
            ("SupplierCode", |text| {
                domain::SupplierCode::parse(text).is_ok()
            }),
            ("OperatorId", |text| domain::OperatorId::parse(text).is_ok()),
            ("UserId", |text| domain::UserId::parse(text).is_ok()),
            ("OrderRef", |text| domain::OrderRef::parse(text).is_ok()),
            ("RequestSource", |text| {
                domain::RequestSource::parse(text).is_ok()
            }),
            ("Title", |text| domain::Title::parse(text).is_ok()),
            ("ProductTitle", |text| {
                domain::ProductTitle::parse(text).is_ok()
            }),
            ("ImageUrl", |text| domain::ImageUrl::parse(text).is_ok()),
            ("Currency", |text| domain::Currency::parse(text).is_ok()),
            ("PaymentMethod", |text| {
                domain::PaymentMethod::parse(text).is_ok()
            }),
            ("IdempotencyKey", |text| {
                domain::IdempotencyKey::parse(text).is_ok()
            }),
            ("ConsistencyToken", |text| {
                domain::ConsistencyToken::parse(text).is_ok()
            }),
            ("FeedCursor", |text| domain::FeedCursor::parse(text).is_ok()),
            ("LedgerMovementId", |text| {
                domain::LedgerMovementId::parse(text).is_ok()
            }),
            ("ReservationId", |text| {
                domain::ReservationId::parse(text).is_ok()
            }),
            ("OrderId", |text| domain::OrderId::parse(text).is_ok()),
            ("ProductId", |text| domain::ProductId::parse(text).is_ok()),
            ("MovementId", |text| domain::MovementId::parse(text).is_ok()),
            ("ServiceKeyId", |text| {
                domain::ServiceKeyId::parse(text).is_ok()
            }),
            ("ServiceKeyName", |text| {
                crate::wire::service_key_name(text).is_ok()
            }),
            ("RefundRemark", |text| {
                crate::order_routes::refund_remark(text.to_owned()).is_ok()
            }),
        ];
        let corpus = corpus();
        for (name, parses) in parsers {
            let schema = component(name);
            let pattern = regex::Regex::new(schema["pattern"].as_str().unwrap()).unwrap();
            for text in &corpus {
                assert_eq!(
                    schema_accepts(&schema, &pattern, text),
                    parses(text),
                    "{name}: the schema and the parser disagree on {text:?}"
                );
            }
        }
    }

    #[test]
    fn every_integer_schema_states_the_bounds_the_server_enforces() {
        let bounded: [(&str, i64, i64); 5] = [
            ("Quantity", domain::Quantity::MIN, domain::Quantity::MAX),
            (
                "PerUserLimit",
                domain::PerUserLimit::MIN,
                domain::PerUserLimit::MAX,
            ),
            (
                "TtlSeconds",
                domain::TtlSeconds::MIN,
                domain::TtlSeconds::MAX,
            ),
            (
                "LowStockThreshold",
                domain::LowStockThreshold::MIN,
                domain::LowStockThreshold::MAX,
            ),
            ("PriceMinor", 0, domain::limits::PRICE_MINOR_MAX),
        ];
        for (name, min, max) in bounded {
            let schema = component(name);
            assert_eq!(
                (schema["minimum"].as_i64(), schema["maximum"].as_i64()),
                (Some(min), Some(max)),
                "{name}"
            );
            let parses =
                |value: i64| serde_json::from_value::<domain::Quantity>(json!(value)).is_ok();
            if name == "Quantity" {
                assert!(parses(min) && parses(max) && !parses(min - 1) && !parses(max + 1));
            }
        }
    }
}

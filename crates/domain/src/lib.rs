//! stockd's vocabulary.
//!
//! Everything here is pure: parsing newtypes, limits, state machines as transition
//! tables, error codes. No IO, no async, no database or HTTP types. Other crates
//! accept these types instead of raw strings and integers, so a value that reached the
//! engine has already been validated.

pub mod campaign;
pub mod cart;
pub mod catalog;
pub mod code;
pub mod decision;
pub mod error;
pub mod event;
pub mod hex;
pub mod id;
pub mod ledger;
pub mod limits;
pub mod money;
pub mod order;
pub mod plan;
pub mod principal;
pub mod quantity;
pub mod replication;
pub mod reservation;
pub mod sale_status;
pub mod secret;
pub mod sku;
pub mod time;

pub use campaign::{CampaignCode, CampaignPhase};
pub use catalog::{
    OperatorType, Product, Recurrence, SCHEDULE_TRANSITIONS, ScheduleStatus, ShelfLogEntry,
    next_occurrence_id, operation_label,
};
pub use code::{
    CategoryCode, ImageUrl, OperatorId, OrderRef, ProductTitle, RequestSource, ShopCode, SkuCode,
    SupplierCode, Title, UserId, WarehouseCode, unfit_for_text,
};
pub use decision::{Rejection, ShopScope};
pub use error::{ErrorCode, ParseError};
pub use event::{Aggregate, EventType, FeedCursor, event_id};
pub use hex::lower_hex;
pub use id::{
    CampaignId, IdempotencyKey, MovementId, OrderId, PaymentAttemptId, ProductId, RefundId,
    ReservationId, ScheduleId, ServiceKeyId, TicketId,
};
pub use ledger::{LedgerMovementId, ReservationMove};
pub use money::{Currency, PriceMinor};
pub use order::{
    AttemptStatus, IllegalOrderTransition, ORDER_TRANSITIONS, OrderStatus, PaymentMethod,
    REFUND_RESOLUTIONS, REFUND_TRANSITIONS, RefundResolution, RefundStatus,
    SECOND_CHARGE_REASON_PREFIX, refund_agrees,
};
pub use principal::{Action, Denied, Principal, Role, authorize, outside_own_shop};
pub use quantity::{
    AdjustmentQuantity, CampaignBuckets, LowStockThreshold, PerUserLimit, Quantity, TtlSeconds,
    Version,
};
pub use replication::{ConsistencyToken, Fallback, LagSample, Rotation, ServedBy};
pub use reservation::{
    IllegalTransition, OrderReference, ReleaseReason, Reservation, ReservationLine,
    ReservationStatus, check_lines,
};
pub use sale_status::{
    Availability, Completeness, SALE_STATUS_TRANSITIONS, SaleStatus, ShelfDecision, ShelfOperation,
    decide_shelf_change,
};
pub use secret::{Secret, constant_time_equal, is_loopback_host, redact_url, redact_urls_in};
pub use sku::{Sku, StockLevel};
pub use time::Timestamp;

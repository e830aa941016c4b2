//! What goes into and comes out of the store's units of work.

use domain::{
    AdjustmentQuantity, ConsistencyToken, Currency, IdempotencyKey, MovementId, OperatorId,
    PriceMinor, Principal, Product, Quantity, Reservation, ReservationId, ReservationLine,
    ShopCode, Sku, SkuCode, Timestamp, UserId, WarehouseCode,
};

use crate::catalog::{Cart, ServiceKey, ShelfResult, SkippedLine};

/// An HTTP response exactly as it was first sent: replays return these bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub body: String,
}

/// An idempotency key in its caller's namespace, `"<principal scope> <key>"`: records
/// are keyed by (principal, key), so two callers never share a key space — one cannot
/// read another's answers or block its keys by sending the same key first.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ScopedKey(String);

impl ScopedKey {
    pub fn new(principal: &Principal, key: &IdempotencyKey) -> ScopedKey {
        let mut scoped = String::with_capacity(48 + key.as_str().len());
        principal.write_scope(&mut scoped);
        scoped.push(' ');
        scoped.push_str(key.as_str());
        ScopedKey(scoped)
    }

    /// The stored form, as written to `idempotency_record.key`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key is a queued command's (the queue intake's scope).
    pub fn is_queue_intake(&self) -> bool {
        self.0
            .starts_with(domain::principal::QUEUE_INTAKE_SCOPE_PREFIX)
    }

    /// The key as the client sent it.
    pub fn client_key(&self) -> &str {
        self.0
            .split_once(' ')
            .map_or(self.0.as_str(), |(_, key)| key)
    }
}

/// An idempotency key and the fingerprint of the request that carries it. The record is
/// written in the same transaction as the effect, so a crash cannot separate them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyClaim {
    pub key: ScopedKey,
    /// Digest of method, path and canonical body: the same key with another request is
    /// refused rather than replayed.
    pub fingerprint: String,
}

/// How an idempotent unit of work ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Idempotent {
    /// It ran now; this response was stored with its effect.
    Executed(StoredResponse),
    /// The key was used before by the same request: this is the first response.
    Replayed(StoredResponse),
    /// The key was used before by a different request.
    KeyReused,
    /// The caller's role may not do this to what the unit of work found under its
    /// locks (a service key cancelling a paid order, an operator an unpaid one):
    /// nothing was written, not even the key, as for any refused credential.
    Forbidden(String),
    /// Nothing was decided or stored: a campaign's bucket was short while others may
    /// hold units (`undecided_when_short`). The engine sends the request to another.
    Undecided,
}

/// How a reservation batch reached the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchPath {
    /// PostgreSQL's whole-batch fast path: one statement, committed with it.
    OneRoundTrip,
    /// The batch transaction: keys looked up, rows locked, each request decided.
    Transaction,
}

impl BatchPath {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchPath::OneRoundTrip => "one_round_trip",
            BatchPath::Transaction => "transaction",
        }
    }
}

/// A reservation batch's outcomes, one per request in order, and how it was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchApplied {
    pub outcomes: Vec<Idempotent>,
    pub path: BatchPath,
    /// The writer's position after the batch's commit when the path read it with the
    /// commit (PostgreSQL's one round trip); `None`: the caller reads it.
    pub position: Option<ConsistencyToken>,
}

pub use domain::{Rejection, ShopScope};

/// Turns outcomes into the bytes a client receives. The HTTP layer implements it; the
/// store calls it inside the transaction so the stored response commits with the effect.
pub trait ResponseRenderer: Send + Sync {
    fn sku_saved(&self, sku: &Sku, created: bool) -> StoredResponse;
    fn movement_recorded(&self, movement: &MovementRecord) -> StoredResponse;
    fn reservation_created(&self, reservation: &Reservation) -> StoredResponse;
    fn reservation_changed(&self, reservation: &Reservation) -> StoredResponse;
    fn rejected(&self, rejection: &Rejection) -> StoredResponse;
    fn product_saved(&self, product: &Product, created: bool) -> StoredResponse;
    /// Per-target results of a shelf operation (applied now or scheduled).
    fn shelf_results(&self, results: &[ShelfResult]) -> StoredResponse;
    /// A new operator; the token only in the first answer (`None` in the stored one).
    fn operator_created(
        &self,
        operator: &OperatorId,
        shop: &ShopCode,
        token: Option<&str>,
    ) -> StoredResponse;
    /// A new service key; the secret only in the first answer (`None` in the stored one).
    fn service_key_created(&self, key: &ServiceKey, secret: Option<&str>) -> StoredResponse;
    fn service_key_revoked(&self, key: &ServiceKey) -> StoredResponse;
    /// An operator whose token no longer authenticates (since `revoked_at`).
    fn operator_revoked(
        &self,
        operator: &OperatorId,
        shop: &ShopCode,
        revoked_at: Timestamp,
    ) -> StoredResponse;
    fn cart(&self, cart: &Cart) -> StoredResponse;
    /// An order (201 when `created`).
    fn order(&self, order: &crate::orders::Order, created: bool) -> StoredResponse;
    /// The order a checkout created (201), with the cart lines it left out.
    fn checked_out(&self, order: &crate::orders::Order, skipped: &[SkippedLine]) -> StoredResponse;
    /// A new campaign (201).
    fn campaign_created(&self, campaign: &crate::catalog::Campaign) -> StoredResponse;
    /// A campaign a person ended before its time (200).
    fn campaign_ended_early(&self, campaign: &crate::catalog::Campaign) -> StoredResponse;
    /// A schedule as it stands after a cancel (200).
    fn schedule_cancelled(&self, schedule: &crate::catalog::ScheduleRecord) -> StoredResponse;
}

/// Fields of a SKU to set; `None` leaves a field as it is (or at its default on create).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SkuChanges {
    pub title: Option<String>,
    pub price: Option<PriceMinor>,
    pub currency: Option<Currency>,
    pub low_stock_threshold: Option<i64>,
    /// The shop of a new SKU (default `default`); for an existing one it must be the
    /// shop it already has.
    pub shop: Option<ShopCode>,
    /// `Some(None)` removes the limit, `Some(Some(n))` sets it.
    pub per_user_limit: Option<Option<i64>>,
    /// The SKU's `version` the editor saw: the edit applies only while the SKU is still
    /// at it (409 `version_conflict` otherwise), and never creates a SKU.
    pub expected_version: Option<i64>,
}

impl SkuChanges {
    /// The names of the fields this sets, as `sku.changed` lists them.
    pub fn field_names(&self) -> Vec<&'static str> {
        [
            ("title", self.title.is_some()),
            ("price", self.price.is_some()),
            ("currency", self.currency.is_some()),
            ("low_stock_threshold", self.low_stock_threshold.is_some()),
            ("per_user_limit", self.per_user_limit.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovementKind {
    /// Goods arrived: available grows.
    Receive,
    /// A count found more or fewer units than recorded: available moves either way.
    Adjust,
}

impl MovementKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MovementKind::Receive => "receive",
            MovementKind::Adjust => "adjust",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MovementQuantity {
    Receive(Quantity),
    Adjust(AdjustmentQuantity),
}

impl MovementQuantity {
    pub fn kind(&self) -> MovementKind {
        match self {
            MovementQuantity::Receive(_) => MovementKind::Receive,
            MovementQuantity::Adjust(_) => MovementKind::Adjust,
        }
    }

    /// The change to `available`.
    pub fn available_delta(&self) -> i64 {
        match self {
            MovementQuantity::Receive(quantity) => quantity.get(),
            MovementQuantity::Adjust(quantity) => quantity.get(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockMovement {
    pub id: MovementId,
    /// The shop the SKU must belong to: checked again under the transaction, for a SKU
    /// the engine did not know when it checked (created since, maybe in another shop).
    pub shop: ShopScope,
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub quantity: MovementQuantity,
}

/// A movement after it was applied, with the row's counters afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovementRecord {
    pub id: MovementId,
    pub kind: MovementKind,
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub available_delta: i64,
    pub available: i64,
    pub reserved: i64,
    pub created_at: Timestamp,
}

/// One ledger row, found by its movement id (`GET /v1/stock-movements/{id}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerMovement {
    pub movement_id: domain::LedgerMovementId,
    /// The row's own number in `stock_ledger` (ascending in insertion order).
    pub ledger_id: i64,
    pub kind: String,
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub available_delta: i64,
    pub reserved_delta: i64,
    /// The movement, reservation or order that caused it.
    pub reference: String,
    /// The SKU's shop (`None` only for a row whose SKU is gone).
    pub shop: Option<ShopCode>,
    pub created_at: Timestamp,
}

/// One request of a reservation batch. Lines are distinct per (sku, warehouse).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    pub claim: IdempotencyClaim,
    pub id: ReservationId,
    pub lines: Vec<ReservationLine>,
    /// How long the hold lasts, counted from when its batch is decided: time spent in
    /// the combiner's queue or waiting for a lock is not taken out of it.
    pub ttl_seconds: i64,
    pub shop: ShopScope,
    /// The shopper, when named: counted against the open-hold bound and per-user limits.
    pub user: Option<UserId>,
    /// The shop's order number and the channel, when given (`order_reference`).
    pub reference: domain::OrderReference,
    /// A campaign's request sent to one bucket while others may hold units: left
    /// undecided ([`Idempotent::Undecided`]) rather than refused when its bucket is short.
    pub undecided_when_short: bool,
}

/// Confirm or release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationAction {
    Confirm,
    Release,
}

/// What one expiry step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpiryOutcome {
    pub released: Vec<ReservationId>,
    /// Claimed, due, and left `RESERVED` because releasing them failed on their data
    /// (with why): a person's to look at; the others were released.
    pub stuck: Vec<(ReservationId, String)>,
    /// Claimed, due, and left `RESERVED` because another transaction held a stock row
    /// of theirs past the lock bound: a later step releases them.
    pub deferred: Vec<ReservationId>,
    /// Where the next step's claim resumes (see [`ExpiryCursor`]).
    pub resume_after: Option<ExpiryCursor>,
}

/// Where an expiry claim resumes: after the last row a full claim took, in the claim's
/// order (the hold's end, then the id). A step that could not move some of what it
/// claimed (broken data, left for a person) would otherwise claim the same rows first
/// again at every step: once a whole batch of them stood first in line, no other due
/// row would ever be claimed, and the worker, always finding a full batch, would run
/// step after step without pause. With the cursor, the next step claims the rows
/// behind them; a claim that finds fewer rows than its limit has reached the end of
/// the due rows, and the next one starts from the beginning again, so stuck rows are
/// retried once per pass. `None`: from the beginning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiryCursor {
    pub(crate) expires_at_milliseconds: i64,
    pub(crate) id: String,
}

/// Counts the metrics endpoint reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservationGauges {
    /// `RESERVED` rows: the open holds.
    pub reserved: i64,
    /// `RESERVED` rows already past `expires_at`: the expiry worker's backlog.
    pub expired_backlog: i64,
}

/// One disagreement found by the audit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditDifference {
    /// What was compared: `ledger_vs_available`, `ledger_vs_reserved`,
    /// `open_reservations_vs_reserved`, `reservation_ledger`, `orphan_ledger_row`,
    /// `order_vs_reservation_and_payment`, `returned_more_than_sold`, `return_not_an_increase`,
    /// `campaign_bucket_units`, `campaign_source_units`, `campaign_closed_bucket_units`.
    pub check: &'static str,
    pub sku: Option<String>,
    pub warehouse: Option<String>,
    pub reference: Option<String>,
    /// The shop the difference is about, when the check knows it (order checks); the
    /// engine finds the others' from their SKU.
    pub shop: Option<String>,
    pub expected: i64,
    pub actual: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditReport {
    pub checked_at: Timestamp,
    pub stock_rows_checked: i64,
    pub reservation_lines_checked: i64,
    pub orders_checked: i64,
    pub ledger_rows_checked: i64,
    /// The first [`AUDIT_DIFFERENCES_REPORTED_MAX`] differences.
    pub differences: Vec<AuditDifference>,
    pub differences_total: i64,
}

impl AuditReport {
    pub fn ok(&self) -> bool {
        self.differences_total == 0
    }
}

/// An audit lists at most this many differences (and counts all of them).
pub const AUDIT_DIFFERENCES_REPORTED_MAX: usize = 1000;

/// Orders the row-lock step of reservation batches that run at the same time, so a
/// batch never overtakes the one before it: a batch waits for `after` (the previous
/// batch has its row locks, or gave up) before locking rows itself, and signals
/// `locked` once it holds its own. Batches may overlap everything else — beginning
/// the transaction, looking up keys, rendering answers — which is how the combiner
/// keeps the database busy while answers travel back to clients.
#[derive(Debug, Default)]
pub struct LockTurn {
    pub after: Option<tokio::sync::oneshot::Receiver<()>>,
    pub locked: Option<tokio::sync::oneshot::Sender<()>>,
}

impl LockTurn {
    /// No ordering: lock as soon as ready.
    pub fn free() -> LockTurn {
        LockTurn::default()
    }

    /// Waits for the previous batch (or for it to be dropped, which also ends its turn).
    pub async fn wait(&mut self) {
        if let Some(after) = self.after.take() {
            let _ = after.await;
        }
    }

    /// Lets the next batch lock.
    pub fn pass(&mut self) {
        if let Some(locked) = self.locked.take() {
            let _ = locked.send(());
        }
    }
}

//! The store: one method per atomic unit of work, on SQLite, PostgreSQL and
//! MySQL/MariaDB.
//!
//! Every method that changes stock runs one short transaction that touches stock rows
//! in (sku, warehouse) order, checks the affected-row count of every conditional
//! update, writes its ledger rows, and stores the response for its idempotency key —
//! all committed together. No method calls anything but the database.
//!
//! Units of work are written once (`units`), generic over a [`backend::Backend`]; what
//! differs between databases lives in one module per backend (`backends`). See
//! `docs/ARCHITECTURE.md` for the code map.

pub mod backend;
pub mod backends;
pub mod catalog;
pub mod error;
pub mod model;
pub mod observe;
pub mod orders;
pub mod plan;
pub mod replicas;
pub mod sql;
pub mod units;

use backends::mysql::MysqlBackend;
use backends::postgres::PostgresBackend;
use backends::sqlite::SqliteBackend;
use units::Units;

use domain::{
    ConsistencyToken, FeedCursor, OperatorId, OrderId, OrderStatus, PaymentAttemptId, Principal,
    Product, ProductId, RefundId, Reservation, ReservationId, ScheduleId, ServiceKeyId,
    ShelfLogEntry, ShopCode, Sku, SkuCode, Timestamp, UserId,
};

pub use backend::{DatabaseActivity, PoolUsage};
pub use catalog::*;
pub use error::StoreError;
pub use model::*;
pub use orders::*;
pub use replicas::{Displayed, ReadHandle, ReplicaConfig, ReplicaHealth};
/// The live auditor's page of changed orders, for the plan tests.
pub use units::audit::ORDERS_CHANGED_FROM as LIVE_AUDIT_ORDERS_PAGE;
pub use units::live_audit::{LiveAuditRound, OrdersWindow};
pub use units::outbox::{
    EVENTS_PER_STEP_MAX, NATS_RELAY, OutboxBacklog, PublishedEvent, RelayPeek, SEQUENCER,
};
pub use units::shelf::shelf_log_listing;

/// How to reach the database and how long to wait for it.
#[derive(Clone)]
pub struct StoreConfig {
    /// `sqlite://path/to/file.db` or `postgres://…`.
    pub database_url: String,
    /// Connections in the (read) pool. SQLite writes always use one connection.
    pub pool_size: u32,
    /// Longest wait for a row lock (PostgreSQL `lock_timeout`) or for SQLite's write
    /// lock held by another process (`busy_timeout`).
    pub lock_timeout_milliseconds: u64,
    /// Longest any one statement may run (PostgreSQL `statement_timeout`).
    pub statement_timeout_milliseconds: u64,
    /// Longest wait for a pooled connection.
    pub acquire_timeout_milliseconds: u64,
    /// PostgreSQL schema to use instead of the default `search_path`.
    pub postgres_schema: Option<String>,
    /// Bounds the units of work enforce.
    pub limits: StoreLimits,
    /// Replicas for display reads (PostgreSQL only).
    pub replicas: ReplicaConfig,
}

/// Bounds on what one shopper may hold, enforced inside the reserving transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Most open holds (reservations still `RESERVED`, an unpaid order's included) one
    /// shopper of a shop may have at once.
    pub open_holds_max: i64,
}

impl Default for StoreLimits {
    fn default() -> StoreLimits {
        StoreLimits {
            open_holds_max: domain::limits::USER_OPEN_HOLDS_MAX_DEFAULT,
        }
    }
}

/// The URL's password never reaches a log through `{:?}`.
impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("StoreConfig")
            .field("database_url", &domain::redact_url(&self.database_url))
            .field("pool_size", &self.pool_size)
            .field("lock_timeout_milliseconds", &self.lock_timeout_milliseconds)
            .field(
                "statement_timeout_milliseconds",
                &self.statement_timeout_milliseconds,
            )
            .field(
                "acquire_timeout_milliseconds",
                &self.acquire_timeout_milliseconds,
            )
            .field("postgres_schema", &self.postgres_schema)
            .field("limits", &self.limits)
            .field(
                "replica_urls",
                &self
                    .replicas
                    .urls
                    .iter()
                    .map(|url| domain::redact_url(url))
                    .collect::<Vec<_>>(),
            )
            .field("replica_lag_seconds_max", &self.replicas.lag_seconds_max)
            .finish()
    }
}

impl StoreConfig {
    pub fn new(database_url: impl Into<String>) -> StoreConfig {
        StoreConfig {
            database_url: database_url.into(),
            pool_size: 16,
            lock_timeout_milliseconds: 2_000,
            statement_timeout_milliseconds: 30_000,
            acquire_timeout_milliseconds: 5_000,
            postgres_schema: None,
            limits: StoreLimits::default(),
            replicas: ReplicaConfig::default(),
        }
    }

    /// The URL with its password hidden, for messages.
    pub fn redacted_url(&self) -> String {
        domain::redact_url(&self.database_url)
    }

    /// MySQL or MariaDB (`mysql://` or `mariadb://`).
    pub fn is_mysql(&self) -> bool {
        self.database_url.starts_with("mysql://") || self.database_url.starts_with("mariadb://")
    }

    pub fn is_postgres(&self) -> bool {
        self.database_url.starts_with("postgres://")
            || self.database_url.starts_with("postgresql://")
    }
}

/// The database behind stockd. Dispatches each unit of work to its backend.
#[derive(Debug, Clone)]
pub enum Store {
    Sqlite(Units<SqliteBackend>),
    Postgres(Units<PostgresBackend>),
    Mysql(Units<MysqlBackend>),
}

macro_rules! dispatch {
    ($store:expr, $backend:ident => $call:expr) => {
        match $store {
            Store::Sqlite($backend) => $call,
            Store::Postgres($backend) => $call,
            Store::Mysql($backend) => $call,
        }
    };
}

impl Store {
    /// Connects without migrating. `serve` and `migrate` call [`Store::migrate`] next.
    pub async fn connect(config: &StoreConfig) -> Result<Store, StoreError> {
        if !config.replicas.urls.is_empty() && !config.is_postgres() {
            return Err(StoreError::Unavailable(
                "STOCKD_REPLICA_URLS is supported with PostgreSQL only".into(),
            ));
        }
        if config.is_postgres() {
            Ok(Store::Postgres(Units::new(
                PostgresBackend::connect(config).await?,
            )))
        } else if config.is_mysql() {
            Ok(Store::Mysql(Units::new(
                MysqlBackend::connect(config).await?,
            )))
        } else if config.database_url.starts_with("sqlite:") {
            Ok(Store::Sqlite(Units::new(
                SqliteBackend::connect(config).await?,
            )))
        } else {
            // Only the scheme is quoted: cut short, a URL could keep its password
            // and lose the `@` that marks it as one to redact.
            Err(StoreError::Unavailable(format!(
                "database URL must start with sqlite:, postgres:// or mysql:// (got '{}')",
                config
                    .database_url
                    .split(':')
                    .next()
                    .unwrap_or_default()
                    .chars()
                    .take(20)
                    .collect::<String>()
            )))
        }
    }

    pub fn backend_name(&self) -> &'static str {
        use backend::Backend;
        match self {
            Store::Sqlite(_) => SqliteBackend::NAME,
            Store::Postgres(_) => PostgresBackend::NAME,
            Store::Mysql(_) => MysqlBackend::NAME,
        }
    }

    /// Whether a write lock is the whole database's (SQLite): a lock wait then says
    /// nothing of which row, every writer waits on it.
    pub fn locks_whole_database(&self) -> bool {
        matches!(self, Store::Sqlite(_))
    }

    pub async fn close(&self) {
        dispatch!(self, store => store.close().await)
    }

    /// Whether display reads may go to replicas (`STOCKD_REPLICA_URLS` was given).
    pub fn has_replicas(&self) -> bool {
        dispatch!(self, store => store.has_replicas())
    }

    /// The same store through a writer pool of its own, of at most `connections`,
    /// opened lazily by whichever runtime first uses it (PostgreSQL); `None` on SQLite
    /// (its one writer is shared) and MySQL (measured slower). [`Store::close`] on it
    /// closes only that pool.
    pub fn with_own_pool(&self, connections: u32) -> Option<Store> {
        match self {
            Store::Sqlite(store) => store.with_own_pool(connections).map(Store::Sqlite),
            Store::Postgres(store) => store.with_own_pool(connections).map(Store::Postgres),
            Store::Mysql(store) => store.with_own_pool(connections).map(Store::Mysql),
        }
    }

    /// What the database pools are doing now (no database call).
    pub fn pool_usage(&self) -> backend::PoolUsage {
        dispatch!(self, store => store.pool_usage())
    }
}

/// Every unit of work, forwarded to the backend the store was opened on. The list below
/// is the store's whole interface: a method is declared once here and written once in
/// the units of work both backends share.
macro_rules! forward {
    ($(
        $(#[$attribute:meta])*
        fn $name:ident(&self $(, $argument:ident: $type:ty)* $(,)?) -> $output:ty;
    )*) => {
        impl Store {
            $(
                $(#[$attribute])*
                // A forwarder takes what its unit of work takes, however many inputs.
                #[allow(clippy::too_many_arguments)]
                pub async fn $name(&self $(, $argument: $type)*) -> $output {
                    match self {
                        Store::Sqlite(store) => store.$name($($argument),*).await,
                        Store::Postgres(store) => store.$name($($argument),*).await,
                        Store::Mysql(store) => store.$name($($argument),*).await,
                    }
                }
            )*
        }
    };
}

forward! {
    /// Applies missing migrations; returns the versions applied now.
    fn migrate(&self) -> Result<Vec<i64>, StoreError>;
    /// Whether the database holds exactly the migrations this binary knows, for a
    /// command that reads without migrating (`stockd audit`).
    fn check_schema(&self) -> Result<(), StoreError>;
    fn database_version(&self) -> Result<String, StoreError>;
    fn ping(&self) -> Result<(), StoreError>;
    /// The writer's view of a SKU (for decisions and tests); pages use `display_sku`.
    fn sku(&self, code: &SkuCode) -> Result<Option<Sku>, StoreError>;
    fn display_sku(&self, reader: &ReadHandle, code: &SkuCode, now: Timestamp) -> Result<Displayed<Option<Sku>>, StoreError>;
    fn display_product(&self, reader: &ReadHandle, id: &ProductId, now: Timestamp) -> Result<Displayed<Option<Product>>, StoreError>;
    fn display_cart(&self, reader: &ReadHandle, shop: Option<&ShopCode>, user: &UserId, now: Timestamp) -> Result<Displayed<Cart>, StoreError>;
    fn display_order(&self, reader: &ReadHandle, id: &OrderId, now: Timestamp) -> Result<Displayed<Option<Order>>, StoreError>;
    fn display_shelf_log(&self, reader: &ReadHandle, query: &ShelfLogQuery, now: Timestamp) -> Result<Displayed<Vec<ShelfLogEntry>>, StoreError>;
    /// The writer's position after every commit finished so far: a write answer's
    /// `Stockd-Consistency-Token`.
    fn consistency_token(&self) -> Result<ConsistencyToken, StoreError>;
    /// One step of the replica monitor (nothing without replicas).
    fn sample_replicas(&self) -> Vec<ReplicaHealth>;
    fn reservation(&self, id: &ReservationId) -> Result<Option<Reservation>, StoreError>;
    /// The ledger row a movement id names (`GET /v1/stock-movements/{id}`).
    fn ledger_movement(&self, id: &domain::LedgerMovementId) -> Result<Option<LedgerMovement>, StoreError>;
    /// The shops of these SKUs (the ones that exist). A SKU's shop never changes.
    fn sku_shops(&self, codes: &[&SkuCode]) -> Result<std::collections::HashMap<SkuCode, ShopCode>, StoreError>;
    /// Which of `keys` hold an idempotency record.
    fn keys_with_records(&self, keys: &[&str]) -> Result<std::collections::HashSet<String>, StoreError>;
    fn idempotency_record(&self, key: &ScopedKey) -> Result<Option<(String, StoredResponse)>, StoreError>;
    fn store_response(&self, claim: &IdempotencyClaim, response: &StoredResponse, now: Timestamp) -> Result<Idempotent, StoreError>;
    fn upsert_sku(&self, claim: &IdempotencyClaim, code: &SkuCode, changes: &SkuChanges, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn record_movement(&self, claim: &IdempotencyClaim, movement: &StockMovement, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn reserve_batch(&self, requests: &[ReserveRequest], now: Timestamp, renderer: &dyn ResponseRenderer, turn: &mut LockTurn) -> Result<BatchApplied, StoreError>;
    fn change_reservation(&self, claim: &IdempotencyClaim, id: &ReservationId, action: ReservationAction, clocks: (Timestamp, Timestamp), renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn expire_batch(&self, now: Timestamp, hold_ends_by: Timestamp, limit: i64, cursor: Option<&ExpiryCursor>) -> Result<ExpiryOutcome, StoreError>;
    fn purge_idempotency_records(&self, created_before: Timestamp, limit: i64) -> Result<u64, StoreError>;
    fn reservation_gauges(&self, now: Timestamp) -> Result<ReservationGauges, StoreError>;
    fn expiry_backlog(&self, now: Timestamp) -> Result<i64, StoreError>;
    fn audit(&self, now: Timestamp, shop: Option<&ShopCode>) -> Result<AuditReport, StoreError>;
    /// One round of the live auditor: the counters, open holds and recently changed
    /// orders checked from the checkpoint on.
    fn live_audit_round(&self, now: Timestamp, settle_before: Timestamp, orders: &OrdersWindow, recount: bool) -> Result<LiveAuditRound, StoreError>;
    fn contents(&self) -> Result<String, StoreError>;
    fn create_product(&self, claim: &IdempotencyClaim, product: &NewProduct, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn update_product(&self, claim: &IdempotencyClaim, id: &ProductId, changes: &ProductChanges, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn product(&self, id: &ProductId) -> Result<Option<Product>, StoreError>;
    fn create_campaign(&self, claim: &IdempotencyClaim, campaign: &NewCampaign, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn end_campaign_early(&self, claim: &IdempotencyClaim, id: &domain::CampaignId, ends_at: Timestamp, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn campaign(&self, id: &domain::CampaignId) -> Result<Option<Campaign>, StoreError>;
    /// The campaigns not closed yet, without counters: what the engine routes by.
    fn open_campaigns(&self) -> Result<Vec<Campaign>, StoreError>;
    /// One step of the campaign worker: what is left at the end goes back.
    fn end_campaigns(&self, clocks: (Timestamp, Timestamp), limit: i64, after: Option<&domain::CampaignId>) -> Result<EndStep, StoreError>;
    /// The staff's product list: oldest first, filtered, after a product id.
    fn products_page(&self, filter: &ProductFilter, after: Option<&ProductId>, limit: i64) -> Result<Vec<Product>, StoreError>;
    /// Schedules of one status by due time, after a schedule when given.
    fn schedules(&self, shop: Option<&ShopCode>, status: &str, after: Option<&ScheduleId>, limit: i64) -> Result<Vec<ScheduleRecord>, StoreError>;
    /// One schedule.
    fn schedule(&self, id: &ScheduleId) -> Result<Option<ScheduleRecord>, StoreError>;
    /// Withdraws the pending occurrence of the series `id` belongs to.
    fn cancel_schedule(&self, claim: &IdempotencyClaim, id: &ScheduleId, actor: &Actor, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    /// Orders newest first, of a shop and a shopper when given, older than `before`.
    fn order_summaries(&self, shop: Option<&ShopCode>, user: Option<&UserId>, before: Option<&OrderId>, limit: i64) -> Result<Vec<OrderSummary>, StoreError>;
    fn resolve_shelf_targets(&self, selector: &TargetSelector) -> Result<Vec<ShelfTarget>, StoreError>;
    fn change_shelf(&self, claim: &IdempotencyClaim, change: &ShelfChange, clocks: (Timestamp, Timestamp), renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn schedule_shelf(&self, claim: &IdempotencyClaim, scheduling: &ShelfScheduling, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn next_schedule_due(&self) -> Result<Option<Timestamp>, StoreError>;
    fn apply_due_schedules(&self, clocks: (Timestamp, Timestamp), limit: i64) -> Result<Vec<AppliedSchedule>, StoreError>;
    fn create_operator(&self, claim: &IdempotencyClaim, operator: &OperatorId, shop: &ShopCode, token_hash: &str, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn create_service_key(&self, claim: &IdempotencyClaim, key: &ServiceKey, secret_hash: &str, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn revoke_service_key(&self, claim: &IdempotencyClaim, key: &ServiceKeyId, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn revoke_operator(&self, claim: &IdempotencyClaim, operator: &OperatorId, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn service_keys(&self, shop: Option<&ShopCode>, limit: i64) -> Result<Vec<ServiceKey>, StoreError>;
    fn principal_by_secret_hash(&self, secret_hash: &str) -> Result<Option<Principal>, StoreError>;
    fn admin_credential_exists(&self) -> Result<bool, StoreError>;
    fn store_first_admin_secret(&self, secret_hash: &str, now: Timestamp) -> Result<bool, StoreError>;
    fn replace_admin_secret(&self, secret_hash: &str, now: Timestamp) -> Result<(), StoreError>;
    /// Deletes the stored (generated) admin token, if any: answers whether one was.
    fn retire_admin_secret(&self) -> Result<bool, StoreError>;
    fn set_cart_item(&self, claim: &IdempotencyClaim, shop: &ShopCode, user: &UserId, sku: &SkuCode, quantity: Option<i64>, clocks: (Timestamp, Timestamp), renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn cart(&self, shop: Option<&ShopCode>, user: &UserId, now: Timestamp) -> Result<Cart, StoreError>;
    fn create_order(&self, claim: &IdempotencyClaim, order: &NewOrder, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn order_shop(&self, id: &OrderId) -> Result<Option<ShopCode>, StoreError>;
    fn order(&self, id: &OrderId) -> Result<Option<Order>, StoreError>;
    fn begin_payment(&self, claim: &IdempotencyClaim, order: &OrderId, attempt: &PaymentAttemptId, payment_method: &str, reconcile_after: Timestamp, keys_since: Timestamp, clocks: (Timestamp, Timestamp), renderer: &dyn ResponseRenderer) -> Result<BeginPayment, StoreError>;
    fn settle_payment_with_answer(&self, claim: &IdempotencyClaim, attempt: &PaymentAttemptId, outcome: &GatewayOutcome, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn fail_refund(&self, refund: &RefundId, reason: &str, now: Timestamp) -> Result<(), StoreError>;
    fn settle_payment(&self, attempt: &PaymentAttemptId, outcome: &GatewayOutcome, source: &str, now: Timestamp) -> Result<Option<OrderStatus>, StoreError>;
    /// Whether a webhook event with this id was applied (or ignored) before.
    fn webhook_event_seen(&self, event_id: &str) -> Result<bool, StoreError>;
    fn apply_payment_event(&self, event_id: &str, event_type: &str, payment_id: &str, attempt: Option<&PaymentAttemptId>, outcome: Option<&GatewayOutcome>, now: Timestamp) -> Result<Option<String>, StoreError>;
    fn payment_attempt(&self, attempt: Option<&PaymentAttemptId>, payment_id: &str) -> Result<Option<AttemptToCall>, StoreError>;
    fn note_gateway_payment_id(&self, attempt: &PaymentAttemptId, payment_id: &str) -> Result<(), StoreError>;
    fn claim_attempts_to_reconcile(&self, now: Timestamp, limit: i64, lease_milliseconds: i64) -> Result<Vec<AttemptToCall>, StoreError>;
    fn give_back_attempts(&self, attempts: &[PaymentAttemptId], now: Timestamp) -> Result<(), StoreError>;
    fn expire_orders(&self, now: Timestamp, hold_ends_by: Timestamp, limit: i64, cursor: Option<&ExpiryCursor>) -> Result<OrderExpiry, StoreError>;
    fn cancel_order(&self, claim: &IdempotencyClaim, order: &OrderId, rights: CancelRights, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn claim_refunds(&self, now: Timestamp, limit: i64, lease_milliseconds: i64) -> Result<Vec<RefundToIssue>, StoreError>;
    fn give_back_refunds(&self, refunds: &[RefundId], now: Timestamp) -> Result<(), StoreError>;
    fn settle_refund(&self, refund: &RefundId, gateway_refund_id: &str, now: Timestamp) -> Result<(), StoreError>;
    fn note_refund_at_gateway(&self, refund: &RefundId, gateway_refund_id: &str, now: Timestamp) -> Result<(), StoreError>;
    fn return_order(&self, claim: &IdempotencyClaim, order: &OrderId, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn resolve_refund(&self, claim: &IdempotencyClaim, order: &OrderId, refund: &RefundId, decision: &RefundDecision, now: Timestamp, renderer: &dyn ResponseRenderer) -> Result<Idempotent, StoreError>;
    fn payment_gauges(&self, now: Timestamp) -> Result<PaymentGauges, StoreError>;
    /// One sequencer step: numbers committed outbox rows in the order they are found.
    fn sequence_events(&self, limit: i64) -> Result<u64, StoreError>;
    fn events_after(&self, cursor: FeedCursor, shop: Option<&ShopCode>, limit: i64) -> Result<Vec<PublishedEvent>, StoreError>;
    fn outbox_backlog(&self, relay: Option<&str>, relay_seen_since: Timestamp) -> Result<OutboxBacklog, StoreError>;
    fn prune_events(&self, before: Timestamp, relay: Option<&str>, limit: i64) -> Result<u64, StoreError>;
    fn peek_relay(&self, relay: &str) -> Result<RelayPeek, StoreError>;
    fn claim_relay(&self, relay: &str, holder: &str, now: Timestamp, lease_until: Timestamp) -> Result<Option<i64>, StoreError>;
    fn mark_relayed(&self, relay: &str, holder: &str, position: i64) -> Result<bool, StoreError>;
    fn release_relay(&self, relay: &str, holder: &str, now: Timestamp) -> Result<(), StoreError>;
    fn latest_event_position(&self) -> Result<i64, StoreError>;
    fn first_kept_event_position(&self) -> Result<i64, StoreError>;
    fn products_of_skus(&self, skus: &[String]) -> Result<Vec<String>, StoreError>;
    /// Stock rows with a negative counter (the CHECK constraints make it 0; a row
    /// written around them would not be).
    fn negative_stock_rows(&self) -> Result<i64, StoreError>;
    /// The sampled session gauges: lock waiters, long transactions, stock scans.
    fn database_activity(&self, long_transaction_milliseconds: i64) -> Result<DatabaseActivity, StoreError>;
    fn clock_ahead_of_database(&self, local_now: &(dyn Fn() -> Timestamp + Sync)) -> Result<Option<i64>, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_config_never_prints_the_database_password() {
        let config = StoreConfig::new("postgres://stockd:hunter2@db.internal:5432/shop");
        let printed = format!("{config:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("postgres://stockd:<redacted>@db.internal:5432/shop"));
    }

    /// The units of work shared by both backends, as compiled into them.
    const SHARED_SOURCES: [&str; 19] = [
        include_str!("units/audit.rs"),
        include_str!("units/batch.rs"),
        include_str!("units/campaigns.rs"),
        include_str!("units/carts.rs"),
        include_str!("units/catalog.rs"),
        include_str!("units/credentials.rs"),
        include_str!("units/decode.rs"),
        include_str!("units/idempotency.rs"),
        include_str!("units/live_audit.rs"),
        include_str!("units/migrations.rs"),
        include_str!("units/orders.rs"),
        include_str!("units/outbox.rs"),
        include_str!("units/payments.rs"),
        include_str!("units/refunds.rs"),
        include_str!("units/reservations.rs"),
        include_str!("units/schedules.rs"),
        include_str!("units/shelf.rs"),
        include_str!("units/stock.rs"),
        include_str!("units/tallies.rs"),
    ];

    /// A replica is reached only through a display read's handle: the only units of
    /// work that take one are the `display_*` reads of the contract's list, and no
    /// other unit of work opens a display transaction.
    #[test]
    fn only_display_reads_can_reach_a_replica() {
        let sources = SHARED_SOURCES.concat();
        let mut display_units = Vec::new();
        for (position, _) in sources.match_indices("displayed!(") {
            let before = &sources[..position];
            let function = before.rfind("pub async fn ").expect("inside a function");
            let name: String = before[function + "pub async fn ".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            display_units.push(name);
        }
        display_units.sort();
        assert_eq!(
            display_units,
            [
                "display_cart",
                "display_order",
                "display_product",
                "display_shelf_log",
                "display_sku"
            ]
        );
        assert_eq!(
            sources.matches("begin_display(").count(),
            0,
            "units of work open display transactions only through displayed!"
        );
        assert_eq!(
            sources.matches("reader: &ReadHandle").count(),
            display_units.len(),
            "only the display reads take a read handle"
        );
    }

    /// Every reservation status change goes through `ReservationStatus::transition`:
    /// one `UPDATE reservation SET status` (in `move_reservation`, which checks the
    /// table first), and every reservation is born `RESERVED`. The late-success path
    /// used to insert its reservation `CONFIRMED`, past the table.
    #[test]
    fn reservation_statuses_are_written_only_through_the_transition_table() {
        let sources = SHARED_SOURCES.concat();
        assert_eq!(
            sources.matches("UPDATE reservation SET status").count(),
            1,
            "one writer of reservation.status"
        );
        let writer = sources
            .find("async fn move_reservation")
            .expect("move_reservation exists");
        let update = sources
            .find("UPDATE reservation SET status")
            .expect("the one update");
        let decided = sources[writer..update].contains("decide_move(");
        assert!(
            decided,
            "move_reservation decides the move before it writes"
        );
        let decider = sources.find("fn decide_move(").expect("decide_move exists");
        let decider_end = sources[decider..].find("\n}\n").expect("its end") + decider;
        assert!(
            sources[decider..decider_end].contains("current.transition(target)"),
            "decide_move goes through the transition table"
        );
        assert!(
            !sources.contains("INSERT INTO reservation"),
            "units of work write reservations only through Dialect::write_reservations"
        );
        // Each backend has one writer of reservation rows, and it writes them RESERVED.
        for (backend, source) in [
            ("sqlite", include_str!("backends/sqlite.rs")),
            ("mysql", include_str!("backends/mysql.rs")),
            (
                "postgres",
                include_str!("../migrations/postgres/0014_reservation_orders.sql"),
            ),
        ] {
            for table in [
                "INSERT INTO reservation (",
                "INSERT INTO reservation_line (",
            ] {
                assert_eq!(
                    source.matches(table).count()
                        + source.matches(&table.replace(" (", "\n")).count(),
                    1,
                    "{backend}: one writer of {table}"
                );
            }
            let insert = source
                .split("INSERT INTO reservation")
                .nth(1)
                .expect("the reservation insert");
            assert!(
                insert[..insert.find(';').unwrap_or(insert.len())].contains("'RESERVED'"),
                "{backend}: a reservation inserted with another status"
            );
        }
        assert_eq!(
            sources.matches("UPDATE customer_order SET status").count(),
            1,
            "one writer of customer_order.status (move_order, through OrderStatus::transition)"
        );
    }

    /// Refunds, payment attempts and scheduled shelf changes change status in one
    /// place each, which asks its transition table before it writes.
    #[test]
    fn refund_attempt_and_schedule_statuses_are_written_only_through_their_tables() {
        let sources = SHARED_SOURCES.concat();
        for (update, writer) in [
            ("UPDATE refund SET status", "async fn move_refund"),
            (
                "UPDATE payment_attempt SET status",
                "async fn set_attempt_status",
            ),
            (
                "UPDATE shelf_schedule SET status",
                "async fn settle_schedule",
            ),
        ] {
            assert_eq!(sources.matches(update).count(), 1, "one writer: {update}");
            let writer_at = sources.find(writer).expect("the writer exists");
            let update_at = sources.find(update).expect("the one update");
            assert!(
                writer_at < update_at && sources[writer_at..update_at].contains(".may_become("),
                "{writer} asks its transition table before `{update}`"
            );
        }
    }
}

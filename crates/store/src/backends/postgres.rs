//! PostgreSQL, for production: several stockd processes may share one database.
//!
//! Row locks (`FOR UPDATE`) order concurrent writers, `SKIP LOCKED` lets several
//! workers claim distinct rows, and every connection carries a `lock_timeout` so a lock
//! wait is bounded. Commits are durable (`synchronous_commit` is left at `on`).

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use domain::{ConsistencyToken, Fallback, ShopCode, SkuCode, Timestamp};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgRow};
use sqlx::{PgConnection, PgPool, Postgres, Row as _, TypeInfo, ValueRef};

use crate::backend::{Backend, Dialect, FoundRecords, Migration, NewReservation};
use crate::backends::replicas::{ReplicaSet, WriterPosition};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, StoredResponse};
use crate::plan::{BatchWritten, PurchaseKey, ShopperKey, SkuFacts, StockKey, WholeBatch};
use crate::replicas::{ReadHandle, ReplicaHealth, Served};
use crate::sql::{Cell, Statement, Value, text_of};
use crate::{StoreConfig, StoreLimits};

/// The PostgreSQL database: one pool for the writer, shared by every unit of work, and
/// a pool per replica for display reads.
#[derive(Debug, Clone)]
pub struct PostgresBackend {
    pool: PgPool,
    limits: StoreLimits,
    watch: crate::backend::PoolWatch,
    replicas: Arc<ReplicaSet>,
    position: WriterPosition,
}

/// The options every connection carries, writer's and replicas' alike.
fn connect_options(url: &str, config: &StoreConfig) -> Result<PgConnectOptions, StoreError> {
    let mut options = PgConnectOptions::from_str(url)
        .map_err(|error| StoreError::Unavailable(domain::redact_urls_in(&error.to_string())))?;
    let lock_timeout = format!("{}ms", config.lock_timeout_milliseconds);
    let statement_timeout = format!("{}ms", config.statement_timeout_milliseconds);
    options = options.options([
        ("lock_timeout", lock_timeout.as_str()),
        ("statement_timeout", statement_timeout.as_str()),
        ("synchronous_commit", "on"),
    ]);
    if let Some(schema) = &config.postgres_schema {
        options = options.options([("search_path", schema.as_str())]);
    }
    Ok(options)
}

impl PostgresBackend {
    pub async fn connect(config: &StoreConfig) -> Result<PostgresBackend, StoreError> {
        // The writer's sessions are named, so a drill can tell which node stockd writes to.
        let options = connect_options(&config.database_url, config)?.application_name("stockd");
        let pool = crate::backend::pool_options()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(Duration::from_millis(config.acquire_timeout_milliseconds))
            .connect_with(options)
            .await?;
        let replicas = ReplicaSet::connect(&config.replicas, config.pool_size, |url| {
            connect_options(url, config)
        })?;
        Ok(PostgresBackend {
            watch: crate::backend::PoolWatch::default(),
            pool,
            limits: config.limits,
            replicas: Arc::new(replicas),
            position: WriterPosition::new(),
        })
    }
}

impl Backend for PostgresBackend {
    type Connection = PgConnection;
    type Transaction = sqlx::Transaction<'static, Postgres>;
    type Pooled = PoolConnection<Postgres>;

    crate::backend::one_pool_backend_methods!(replicas);

    /// Replicas serve display reads, which never go through this pool: it has none,
    /// so closing it leaves the replicas' pools to their owner.
    ///
    /// Its sessions (the combiner's) run without `statement_timeout`. The hot path's
    /// procedure commits inside its `CALL`, and PostgreSQL keeps the statement's timer
    /// running through that commit (a top-level `COMMIT` disarms it first): the timer
    /// would cut short the commit's wait for a synchronous standby, which PostgreSQL
    /// turns into a WARNING and a commit that is local only, and the batch would be
    /// acknowledged unreplicated. Lock waits stay bounded by `lock_timeout`; a stalled
    /// standby holds the batch as it holds any commit, until it (or Patroni, choosing
    /// another) answers.
    fn with_own_pool(&self, connections: u32) -> Option<Self> {
        let options = (*self.pool.connect_options())
            .clone()
            .options([("statement_timeout", "0")]);
        Some(PostgresBackend {
            pool: crate::backend::sibling_pool(&self.pool, connections, options),
            replicas: Arc::new(ReplicaSet::none()),
            ..self.clone()
        })
    }

    const NAME: &'static str = "postgres";

    /// The audit compares several tables, so it reads them from one snapshot.
    async fn begin_snapshot(&self) -> Result<Self::Transaction, StoreError> {
        Ok(self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?)
    }

    async fn begin_display(
        &self,
        reader: &ReadHandle,
    ) -> Result<(Self::Transaction, Served), StoreError> {
        let fallback = match self.replicas.pick() {
            None => Fallback::NoReplicaInRotation,
            Some(index) => match self.replicas.begin_on(index, reader.token()).await {
                Ok(served) => return Ok(served),
                Err(fallback) => fallback,
            },
        };
        // A token no write's answer carried (made up far ahead, or another
        // database's) would send every read that sends it to the writer, past the
        // replicas and the display cache: one position read, shared by every caller
        // waiting for one, tells it from a real write's.
        if let Some(token) = reader.token() {
            let reached = self.position.after_commit(&self.pool).await?;
            if !token.is_reached_by(reached) {
                return Err(StoreError::TokenAhead(token));
            }
        }
        Ok((self.pool.begin().await?, Served::primary(Some(fallback))))
    }

    fn display_failed(&self, served: &Served, error: &StoreError) {
        if let Some(index) = served.replica {
            self.replicas.failed(index, error);
        }
    }

    async fn consistency_token(&self) -> Result<ConsistencyToken, StoreError> {
        self.position.after_commit(&self.pool).await
    }

    fn has_replicas(&self) -> bool {
        !self.replicas.is_empty()
    }

    async fn sample_replicas(&self) -> Vec<ReplicaHealth> {
        if self.replicas.is_empty() {
            return Vec::new();
        }
        self.replicas.sample(&self.pool).await
    }

    async fn reserve_whole_batch(
        &self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<WholeBatch, StoreError> {
        bulk::reserve_whole_batch(&self.pool, totals, reservations, records, now).await
    }
}

crate::backend::finish_through_sqlx!(Postgres);

/// SQLSTATEs that mean "run the transaction again".
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";
/// `lock_timeout` passed.
const LOCK_NOT_AVAILABLE: &str = "55P03";
/// `statement_timeout` passed (or the statement was cancelled).
const QUERY_CANCELED: &str = "57014";

/// The server is going away or not yet there: a restart, a crash, a failover.
const ADMIN_SHUTDOWN: &str = "57P01";
const CRASH_SHUTDOWN: &str = "57P02";
const CANNOT_CONNECT_NOW: &str = "57P03";
/// A write reached a node in recovery: the address still led to a demoted leader.
const READ_ONLY_SQL_TRANSACTION: &str = "25006";
const TOO_MANY_CONNECTIONS: &str = "53300";
/// Class 08: the connection itself failed.
const CONNECTION_EXCEPTION_CLASS: &str = "08";
/// The server ran out of disk or memory, or failed at I/O: its state for a while, not
/// the request's rows, so 503, and the expiry worker does not take it for a broken
/// hold. Not the rest of classes 53 and 58: a configured limit the statement exceeds
/// (53400) or a file missing or doubled (58P01, 58P02) come back at every retry.
const INSUFFICIENT_RESOURCES: &str = "53000";
const DISK_FULL: &str = "53100";
const OUT_OF_MEMORY: &str = "53200";
const SYSTEM_ERROR: &str = "58000";
const IO_ERROR: &str = "58030";

/// PostgreSQL's errors by SQLSTATE. Everything a failover can raise is `Unavailable`
/// (503 with `Retry-After`): the outcome of that unit of work is unknown or nothing,
/// and a retry with the same key finds the committed answer or runs anew.
pub(crate) fn classify_database(error: &sqlx::postgres::PgDatabaseError) -> StoreError {
    let message = error.message().to_owned();
    match error.code() {
        SERIALIZATION_FAILURE => StoreError::Retryable(message),
        // The detail names the processes and the locks of the cycle.
        DEADLOCK_DETECTED => StoreError::Deadlock(match error.detail() {
            Some(detail) => format!("{message} ({detail})"),
            None => message,
        }),
        LOCK_NOT_AVAILABLE => StoreError::LockTimeout(message),
        QUERY_CANCELED
        | ADMIN_SHUTDOWN
        | CRASH_SHUTDOWN
        | CANNOT_CONNECT_NOW
        | READ_ONLY_SQL_TRANSACTION
        | TOO_MANY_CONNECTIONS => StoreError::Unavailable(message),
        INSUFFICIENT_RESOURCES | DISK_FULL | OUT_OF_MEMORY | SYSTEM_ERROR | IO_ERROR => {
            StoreError::Unavailable(message)
        }
        code if code.starts_with(CONNECTION_EXCEPTION_CLASS) => StoreError::Unavailable(message),
        code => StoreError::Database(format!("{message} (code {code})")),
    }
}

/// A statement as an sqlx query: PostgreSQL's own `$1`, `$2`, … placeholders, and
/// every value typed (an integer NULL is an `int8` NULL).
fn query_of(statement: Statement<'_>) -> sqlx::query::Query<'static, Postgres, PgArguments> {
    let mut query = sqlx::query(text_of(statement.text));
    for value in statement.values {
        query = match value {
            Value::Integer(value) => query.bind(value),
            Value::Text(value) => query.bind(value),
        };
    }
    query
}

/// PostgreSQL types every column: integers of any width, text of any kind.
fn cell(row: &PgRow, position: usize) -> Result<Cell, StoreError> {
    let value = row.try_get_raw(position)?;
    if value.is_null() {
        return Ok(Cell::Null);
    }
    let kind = value.type_info().name().to_owned();
    match kind.as_str() {
        "INT8" => Ok(Cell::Integer(row.try_get::<i64, _>(position)?)),
        "INT4" => Ok(Cell::Integer(i64::from(row.try_get::<i32, _>(position)?))),
        "INT2" => Ok(Cell::Integer(i64::from(row.try_get::<i16, _>(position)?))),
        "BOOL" => Ok(Cell::Integer(i64::from(row.try_get::<bool, _>(position)?))),
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" => Ok(Cell::Text(row.try_get(position)?)),
        other => Err(StoreError::Database(format!("a column of type {other}"))),
    }
}

crate::sql::connection_as_written!(PgConnection, query_of, cell);

/// Row locks (`FOR UPDATE`) order concurrent writers and `SKIP LOCKED` lets several
/// workers claim distinct rows; a reservation batch's rows travel as arrays.
impl Dialect for PgConnection {
    const SELECT_RESERVATION_FOR_UPDATE: &'static str = "SELECT status, order_id, shop, user_id, expires_at FROM reservation WHERE id = $1 FOR UPDATE";
    /// `SKIP LOCKED`: a reservation another worker is releasing is left to it.
    const CLAIM_EXPIRED_RESERVATIONS: &'static str = "SELECT id, expires_at FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL \
         AND expires_at >= $3 AND (expires_at > $3 OR id > $4) \
         ORDER BY expires_at, id LIMIT $2 \
         FOR UPDATE SKIP LOCKED";
    /// The audit's join of every reservation line with its ledger rows.
    const AUDIT_RESERVATION_LINES: &'static str = "SELECT reservation.id, reservation.status, \
         line.sku, line.warehouse, line.quantity, \
         COALESCE(CAST(SUM(ledger.available_delta) AS BIGINT), 0), \
         COALESCE(CAST(SUM(ledger.reserved_delta) AS BIGINT), 0) \
         FROM reservation JOIN reservation_line line ON line.reservation_id = reservation.id \
         LEFT JOIN stock_ledger ledger ON ledger.reference = reservation.id \
         AND ledger.sku = line.sku AND ledger.warehouse = line.warehouse \
         GROUP BY reservation.id, reservation.status, line.sku, line.warehouse, line.quantity \
         ORDER BY reservation.id, line.sku, line.warehouse";
    const VERSION_QUERY: &'static str = "SELECT version()";
    /// A tenth of a second: long enough for a holder that just committed to be gone.
    const SHORT_LOCK_WAIT: Option<&'static str> = Some("SET LOCAL lock_timeout = '100ms'");
    /// Every session of the database, stockd's or not: an operator's console holding
    /// a row blocks sales just the same.
    const SESSIONS_WAITING_ON_LOCKS: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    );
    /// Idle-in-transaction sessions included: they hold their locks the longest.
    const LONG_TRANSACTIONS: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND xact_start < clock_timestamp() - $1 * INTERVAL '1 millisecond'",
    );
    /// The statistics collector's count for this schema's stock table.
    const STOCK_SEQUENTIAL_SCANS: Option<&'static str> = Some(
        "SELECT COALESCE(CAST(SUM(seq_scan) AS BIGINT), 0) FROM pg_stat_user_tables \
         WHERE relname = 'stock' AND schemaname = current_schema()",
    );
    /// The table's main fork as it is now (not `relpages`, which waits for a VACUUM or
    /// an ANALYZE).
    const STOCK_PAGES: Option<&'static str> = Some(
        "SELECT CAST(pg_relation_size(format('%I.stock', current_schema())::regclass) / 8192 \
         AS BIGINT)",
    );
    /// `clock_timestamp()`, not `now()`: the statement's own instant, not its
    /// transaction's start.
    const DATABASE_CLOCK_UNIX_MILLISECONDS: Option<&'static str> =
        Some("SELECT CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)");
    /// Serializes migrations of one schema across processes; released at commit.
    // A migration is not a request: it may run (an index built on a large table) and
    // be waited for (instances started together) far past the request path's bounds,
    // under which simultaneous starts failed with lock_timeout and a long migration
    // could never apply. The DDL's own lock waits keep the configured bound: a
    // migration waiting behind a long transaction fails fast rather than queue every
    // request behind its lock.
    const MIGRATION_LOCK: Option<&'static str> = Some(
        "SET LOCAL statement_timeout = 0; \
         SET LOCAL lock_timeout = '15min'; \
         SELECT pg_advisory_xact_lock(hashtext('stockd_migrate:' || current_schema())); \
         SET LOCAL lock_timeout TO DEFAULT",
    );
    /// `SKIP LOCKED`: a schedule another process is applying is left to it.
    const CLAIM_DUE_SCHEDULES: &'static str = "SELECT id, sku, operation, remark, due_at, recurrence, series_id FROM shelf_schedule \
         WHERE status = 'PENDING' AND due_at <= $1 ORDER BY due_at, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    const CLAIM_DUE_SCHEDULES_OF_SKU: &'static str = "SELECT id, sku, operation, remark, due_at, recurrence, series_id FROM shelf_schedule \
         WHERE status = 'PENDING' AND sku = $2 AND due_at <= $1 ORDER BY due_at, id FOR UPDATE SKIP LOCKED";
    const CLAIM_PENDING_SCHEDULES_OF_SKU: &'static str = "SELECT id FROM shelf_schedule WHERE status = 'PENDING' AND sku = $1 ORDER BY id FOR UPDATE SKIP LOCKED";

    const SELECT_ORDER_FOR_UPDATE: &'static str =
        "SELECT status, reservation_id, expires_at FROM customer_order WHERE id = $1 FOR UPDATE";
    const SELECT_ATTEMPT_STATUS_FOR_UPDATE: &'static str =
        "SELECT status FROM payment_attempt WHERE id = $1 FOR UPDATE";
    const LOCK_CART_LINES: &'static str =
        "SELECT sku, quantity FROM cart_item WHERE user_id = $1 AND shop = $2 FOR UPDATE";
    const LOCK_SKU_ROW: &'static str = "SELECT version FROM sku WHERE code = $1 FOR UPDATE";
    const SHARE_SKU_ROW: &'static str =
        "SELECT shop, sale_status FROM sku WHERE code = $1 FOR SHARE";
    /// Orders past their hold that still hold their stock: unpaid, or declined. The
    /// statuses are spelled as an `OR`: each arm matches one partial index (unpaid,
    /// declined) and the two are read together; an `IN` list matches neither, and
    /// every step read the whole table, which only grows (140 ms against 1.4 ms at
    /// 1,000,000 paid orders, docs/BENCHMARKS.md).
    const CLAIM_EXPIRED_ORDERS: &'static [&'static str] = &[
        "SELECT customer_order.id, customer_order.expires_at FROM customer_order \
         JOIN reservation ON reservation.id = customer_order.reservation_id \
         WHERE (customer_order.status = 'PENDING_PAYMENT' OR customer_order.status = 'PAYMENT_FAILED') AND customer_order.expires_at <= $1 \
         AND reservation.status = 'RESERVED' \
         AND customer_order.expires_at >= $3 AND (customer_order.expires_at > $3 OR customer_order.id > $4) \
         ORDER BY customer_order.expires_at, customer_order.id LIMIT $2 FOR UPDATE OF customer_order SKIP LOCKED",
    ];
    const CLAIM_ATTEMPTS_TO_RECONCILE: &'static str = "SELECT id FROM payment_attempt \
         WHERE status = 'PROCESSING' AND reconcile_after <= $1 ORDER BY reconcile_after, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    const CLAIM_REFUNDS: &'static str = "SELECT id, order_id, attempt_id, gateway_key, amount_minor, currency, tries, gateway_refund_id FROM refund \
         WHERE status = 'PENDING' AND next_try_at <= $1 ORDER BY next_try_at, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    const MIGRATIONS: &'static [Migration] = &[
        (
            1,
            "reservation_core",
            include_str!("../../migrations/postgres/0001_reservation_core.sql"),
        ),
        (
            2,
            "ledger_reference_index",
            include_str!("../../migrations/postgres/0002_ledger_reference_index.sql"),
        ),
        (
            3,
            "reservation_line_key",
            include_str!("../../migrations/postgres/0003_reservation_line_key.sql"),
        ),
        (
            4,
            "catalog",
            include_str!("../../migrations/postgres/0004_catalog.sql"),
        ),
        (
            5,
            "orders",
            include_str!("../../migrations/postgres/0005_orders.sql"),
        ),
        (
            6,
            "reservation_batch_functions",
            include_str!("../../migrations/postgres/0006_reservation_batch_functions.sql"),
        ),
        (
            7,
            "reservation_batch_plans",
            include_str!("../../migrations/postgres/0007_reservation_batch_plans.sql"),
        ),
        (
            8,
            "reservation_batch_index_plans",
            include_str!("../../migrations/postgres/0008_reservation_batch_index_plans.sql"),
        ),
        (
            9,
            "trust",
            include_str!("../../migrations/postgres/0009_trust.sql"),
        ),
        (
            10,
            "refusals",
            include_str!("../../migrations/postgres/0010_refusals.sql"),
        ),
        (
            11,
            "payment_attempts",
            include_str!("../../migrations/postgres/0011_payment_attempts.sql"),
        ),
        (
            12,
            "refund_per_attempt",
            include_str!("../../migrations/postgres/0012_refund_per_attempt.sql"),
        ),
        (
            13,
            "attempt_request_key",
            include_str!("../../migrations/postgres/0013_attempt_request_key.sql"),
        ),
        (
            14,
            "reservation_orders",
            include_str!("../../migrations/postgres/0014_reservation_orders.sql"),
        ),
        (
            15,
            "outbox",
            include_str!("../../migrations/postgres/0015_outbox.sql"),
        ),
        (
            16,
            "live_audit",
            include_str!("../../migrations/postgres/0016_live_audit.sql"),
        ),
        (
            17,
            "order_references",
            include_str!("../../migrations/postgres/0017_order_references.sql"),
        ),
        (
            18,
            "campaigns",
            include_str!("../../migrations/postgres/0018_campaigns.sql"),
        ),
        (
            19,
            "whole_batch_position",
            include_str!("../../migrations/postgres/0019_whole_batch_position.sql"),
        ),
        (
            20,
            "static_key_lookup",
            include_str!("../../migrations/postgres/0020_static_key_lookup.sql"),
        ),
        (
            21,
            "outbox_created_unindexed",
            include_str!("../../migrations/postgres/0021_outbox_created_unindexed.sql"),
        ),
        (
            22,
            "attempt_request_key_alone",
            include_str!("../../migrations/postgres/0022_attempt_request_key_alone.sql"),
        ),
        (
            23,
            "schedule_series",
            include_str!("../../migrations/postgres/0023_schedule_series.sql"),
        ),
        (
            24,
            "ledger_no_truncate",
            include_str!("../../migrations/postgres/0024_ledger_no_truncate.sql"),
        ),
        (
            25,
            "schedule_sku_pending",
            include_str!("../../migrations/postgres/0025_schedule_sku_pending.sql"),
        ),
        (
            26,
            "refund_resolution",
            include_str!("../../migrations/postgres/0026_refund_resolution.sql"),
        ),
        (
            27,
            "shelf_log_sku",
            include_str!("../../migrations/postgres/0027_shelf_log_sku.sql"),
        ),
    ];
    /// Not oldest first: the records' index is a BRIN index (migration 0003), which
    /// cannot give rows in order, so `ORDER BY created_at` read and sorted every
    /// expired record to delete a batch of them. Unordered, the scan stops at the limit.
    const PURGE_IDEMPOTENCY_RECORDS: &'static str = "DELETE FROM idempotency_record WHERE key IN (\
         SELECT key FROM idempotency_record WHERE created_at < $1 LIMIT $2)";
    /// PostgreSQL takes the whole-batch fast path: it saves the round trips of a
    /// transaction (begin, key lookup, lock, write, commit) on the hot row.
    const WHOLE_BATCH_FAST_PATH: bool = true;

    /// Serializes shelf batches of one shop across processes, until the commit: two
    /// overlapping batches never interleave.
    async fn lock_shop(&mut self, shop: &ShopCode) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('stockd_shelf:' || $1))")
            .bind(shop.as_str())
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    /// Per schema: stockd databases in other schemas of the same PostgreSQL database
    /// (tests run so) do not wait for each other's shelf logs.
    async fn lock_shelf_log(&mut self) -> Result<(), StoreError> {
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtext('stockd_shelf_log:' || current_schema()))",
        )
        .execute(&mut *self)
        .await?;
        Ok(())
    }

    /// Locks every stock row of these SKUs in the order reservations lock them, so a
    /// sale-status change and a reservation of the same SKU serialize.
    async fn lock_stock_of_skus(&mut self, skus: &[&SkuCode]) -> Result<(), StoreError> {
        let codes: Vec<String> = skus.iter().map(|sku| sku.as_str().to_owned()).collect();
        sqlx::query(
            "SELECT 1 FROM stock WHERE sku = ANY($1) \
             ORDER BY sku COLLATE \"C\", warehouse COLLATE \"C\" FOR UPDATE",
        )
        .bind(codes)
        .persistent(false)
        .execute(&mut *self)
        .await?;
        Ok(())
    }

    async fn existing_records(&mut self, keys: &[&str]) -> Result<FoundRecords, StoreError> {
        bulk::existing_records(self, keys).await
    }

    async fn lock_open_holds(
        &mut self,
        shoppers: &[ShopperKey],
    ) -> Result<HashMap<ShopperKey, i64>, StoreError> {
        bulk::lock_open_holds(self, shoppers).await
    }

    async fn lock_purchases(
        &mut self,
        purchases: &[PurchaseKey],
    ) -> Result<HashMap<PurchaseKey, i64>, StoreError> {
        bulk::lock_purchases(self, purchases).await
    }

    async fn add_open_holds_of_all(
        &mut self,
        added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
    ) -> Result<u64, StoreError> {
        bulk::add_open_holds_of_all(self, added, open_holds_max).await
    }

    async fn lock_tallies_of_all(
        &mut self,
        shoppers: &[ShopperKey],
        purchases: &[PurchaseKey],
    ) -> Result<crate::backend::LockedTallies, StoreError> {
        bulk::lock_tallies_of_all(self, shoppers, purchases).await
    }

    async fn add_tallies_of_all(
        &mut self,
        holds_added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
        purchases_added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<(u64, u64), StoreError> {
        bulk::add_tallies_of_all(
            self,
            holds_added,
            open_holds_max,
            purchases_added,
            quantity_max,
        )
        .await
    }

    async fn add_purchases_of_all(
        &mut self,
        added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<u64, StoreError> {
        bulk::add_purchases_of_all(self, added, quantity_max).await
    }

    async fn lock_stock_rows(
        &mut self,
        wanted: &[StockKey],
    ) -> Result<(BTreeMap<StockKey, i64>, HashMap<SkuCode, SkuFacts>), StoreError> {
        bulk::lock_stock_rows(self, wanted).await
    }

    async fn sku_facts(
        &mut self,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
        bulk::sku_facts(self, skus).await
    }

    /// The same statement as [`Dialect::write_batch`], without records.
    async fn write_reservations(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        let written = bulk::write_batch(self, totals, reservations, &[], now).await?;
        Ok(written.rows_taken)
    }

    async fn write_batch(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<BatchWritten, StoreError> {
        bulk::write_batch(self, totals, reservations, records, now).await
    }
}

/// The reservation batch's bulk statements: each passes its rows as arrays read with
/// `UNNEST`, so a batch of any size costs the same few round trips.
///
/// The reads of tables that grow with every request (`idempotency_record`) are sent
/// unprepared (`persistent(false)`), so PostgreSQL plans each one for the table as it
/// is now. A prepared statement's cached generic plan, made while a fresh table was
/// nearly empty, kept sequential scans while the table grew to hundreds of thousands
/// of rows: throughput fell by two thirds within seconds.
///
/// The row-locking read is prepared: it sits on the hot row's critical path, where an
/// unprepared statement costs a second round trip (parse and describe, then execute),
/// and the tables it reads (`stock`, `sku`) grow only when SKUs are added — the next
/// `ANALYZE` replaces its cached plan. Prepared, it took `hot` from about 16,000 to
/// 19,000 reservations per second (docs/BENCHMARKS.md).
mod bulk {
    use std::collections::{BTreeMap, HashMap};

    use domain::{SaleStatus, SkuCode, Timestamp};
    use sqlx::Row;

    use sqlx::Arguments;
    use sqlx::error::BoxDynError;
    use sqlx::postgres::PgArguments;

    use crate::units::decode::{
        LockedStockRow, SkuFactsRow, corrupt, locked_stock_of, sku_facts_of, split_tally_rows,
        stored_response, tallies_of,
    };

    type Tx = sqlx::PgConnection;
    use crate::backend::NewReservation;
    use crate::error::StoreError;
    use crate::model::{IdempotencyClaim, StoredResponse};
    use crate::plan::{BatchWritten, PurchaseKey, ShopperKey, SkuFacts, StockKey, WholeBatch};

    pub async fn existing_records(
        transaction: &mut Tx,
        keys: &[&str],
    ) -> Result<HashMap<String, (String, Option<StoredResponse>)>, StoreError> {
        let keys: Vec<String> = keys.iter().map(|key| (*key).to_owned()).collect();
        let found = sqlx::query(
            "SELECT key, fingerprint, status_code, body FROM idempotency_record WHERE key = ANY($1)",
        )
        .bind(keys)
        .persistent(false)
        .fetch_all(&mut *transaction)
        .await?;
        let mut records = HashMap::with_capacity(found.len());
        for row in &found {
            let response = stored_response(row.try_get("status_code")?, row.try_get("body")?)?;
            records.insert(row.try_get("key")?, (row.try_get("fingerprint")?, response));
        }
        Ok(records)
    }

    /// Locks the rows in byte order of (sku, warehouse) — `COLLATE "C"`, the order the
    /// Rust code sorts in everywhere else — so every writer takes them in one order;
    /// reads their SKUs' sale status with them.
    ///
    /// The SKU rows are share-locked too (after the stock rows: a shelf change locks the
    /// stock rows before it updates the SKU, so this order cannot deadlock with it). A
    /// row that is only joined is read from the statement's snapshot even when the
    /// statement had to wait for a lock: a reservation queued behind a shelf change
    /// would see the status from before the change and sell an off-shelf SKU. A locked
    /// row is re-read at its newest version once the lock is granted.
    pub async fn lock_stock_rows(
        transaction: &mut Tx,
        wanted: &[StockKey],
    ) -> Result<(BTreeMap<StockKey, i64>, HashMap<SkuCode, SkuFacts>), StoreError> {
        if wanted.is_empty() {
            return Ok((BTreeMap::new(), HashMap::new()));
        }
        let skus: Vec<String> = wanted
            .iter()
            .map(|(sku, _)| sku.as_str().to_owned())
            .collect();
        let warehouses: Vec<String> = wanted
            .iter()
            .map(|(_, warehouse)| warehouse.as_str().to_owned())
            .collect();
        let statement = "SELECT stock.sku, stock.warehouse, stock.available, sku.sale_status, sku.shop, \
             sku.per_user_limit FROM stock \
             JOIN UNNEST($1::text[], $2::text[]) AS wanted (sku, warehouse) \
             ON stock.sku = wanted.sku AND stock.warehouse = wanted.warehouse \
             JOIN sku ON sku.code = stock.sku \
             ORDER BY stock.sku COLLATE \"C\", stock.warehouse COLLATE \"C\" FOR UPDATE OF stock FOR SHARE OF sku";
        let described = crate::sql::Described::locking(statement);
        let found = described
            .run(
                sqlx::query_as::<_, LockedStockRow>(statement)
                    .bind(skus)
                    .bind(warehouses)
                    .fetch_all(&mut *transaction),
            )
            .await
            .map_err(|error| described.explain(error))?;
        locked_stock_of(found)
    }

    /// The shoppers' open-hold tallies, locked in byte order of (shop, user) — the
    /// order the Rust code sorts keys in, which every writer of tallies follows.
    pub async fn lock_open_holds(
        transaction: &mut Tx,
        shoppers: &[ShopperKey],
    ) -> Result<HashMap<ShopperKey, i64>, StoreError> {
        Ok(lock_tallies_of_all(transaction, shoppers, &[]).await?.0)
    }

    /// What the shoppers hold or bought of limited SKUs, locked in byte order of
    /// (shop, user, sku).
    pub async fn lock_purchases(
        transaction: &mut Tx,
        purchases: &[PurchaseKey],
    ) -> Result<HashMap<PurchaseKey, i64>, StoreError> {
        Ok(lock_tallies_of_all(transaction, &[], purchases).await?.1)
    }

    /// Both kinds of tally in one statement: the open holds locked first, in byte order
    /// of (shop, user), then the purchases, in byte order of (shop, user, sku) — the
    /// order the Rust code sorts keys in, which every writer of tallies follows. Each
    /// is a materialized CTE, so each runs once, whole, in the order the `UNION ALL`
    /// reads them. An open-hold row has no SKU. Unprepared: the tally tables grow with
    /// every new shopper (see the module's note).
    pub async fn lock_tallies_of_all(
        transaction: &mut Tx,
        shoppers: &[ShopperKey],
        purchases: &[PurchaseKey],
    ) -> Result<crate::backend::LockedTallies, StoreError> {
        if shoppers.is_empty() && purchases.is_empty() {
            return Ok((HashMap::new(), HashMap::new()));
        }
        let rows = sqlx::query(
            "WITH holds AS MATERIALIZED ( \
                 SELECT tally.shop, tally.user_id, tally.open_holds FROM shopper_hold AS tally \
                 JOIN UNNEST($1::text[], $2::text[]) AS wanted (shop, user_id) \
                 ON tally.shop = wanted.shop AND tally.user_id = wanted.user_id \
                 ORDER BY tally.shop COLLATE \"C\", tally.user_id COLLATE \"C\" FOR UPDATE OF tally), \
             purchases AS MATERIALIZED ( \
                 SELECT tally.shop, tally.user_id, tally.sku, tally.quantity FROM shopper_purchase AS tally \
                 JOIN UNNEST($3::text[], $4::text[], $5::text[]) AS wanted (shop, user_id, sku) \
                 ON tally.shop = wanted.shop AND tally.user_id = wanted.user_id AND tally.sku = wanted.sku \
                 ORDER BY tally.shop COLLATE \"C\", tally.user_id COLLATE \"C\", tally.sku COLLATE \"C\" \
                 FOR UPDATE OF tally) \
             SELECT shop, user_id, NULL::text AS sku, open_holds AS count FROM holds \
             UNION ALL SELECT shop, user_id, sku, quantity FROM purchases",
        )
        .bind(shoppers.iter().map(|key| key.0.as_str()).collect::<Vec<_>>())
        .bind(shoppers.iter().map(|key| key.1.as_str()).collect::<Vec<_>>())
        .bind(purchases.iter().map(|key| key.0.as_str()).collect::<Vec<_>>())
        .bind(purchases.iter().map(|key| key.1.as_str()).collect::<Vec<_>>())
        .bind(purchases.iter().map(|key| key.2.as_str()).collect::<Vec<_>>())
        .persistent(false)
        .fetch_all(&mut *transaction)
        .await?;
        let (holds, bought) = split_tally_rows(crate::sql::rows_of(rows, super::cell)?);
        Ok((
            tallies_of(shoppers, &holds)?,
            tallies_of(purchases, &bought)?,
        ))
    }

    /// Every shopper's new open holds in one statement, inserted in key order (the
    /// `BTreeMap`'s), each under the bound of `Dialect::add_open_holds_of_all`, a new tally
    /// too. Answers the rows written.
    pub async fn add_open_holds_of_all(
        transaction: &mut Tx,
        added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
    ) -> Result<u64, StoreError> {
        Ok(
            add_tallies_of_all(transaction, added, open_holds_max, &BTreeMap::new(), 0)
                .await?
                .0,
        )
    }

    /// Every key's new units in one statement, in key order, each under the bound of
    /// `Dialect::add_purchases_of_all` (the SKU's or the campaign's per-user limit, else
    /// `quantity_max`). Answers the rows written.
    pub async fn add_purchases_of_all(
        transaction: &mut Tx,
        added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<u64, StoreError> {
        Ok(
            add_tallies_of_all(transaction, &BTreeMap::new(), 0, added, quantity_max)
                .await?
                .1,
        )
    }

    /// Both tally writes of a batch in one statement, each in key order (the
    /// `BTreeMap`s'): the open holds under `open_holds_max`, then the purchases under
    /// the SKU's or the campaign's per-user limit (else `quantity_max`); a new tally is
    /// created. The open holds' CTE is read first, so it runs first. Answers the rows
    /// each wrote (an insert or update refused by its bound returns no row).
    pub async fn add_tallies_of_all(
        transaction: &mut Tx,
        holds_added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
        purchases_added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<(u64, u64), StoreError> {
        if holds_added.is_empty() && purchases_added.is_empty() {
            return Ok((0, 0));
        }
        let row = sqlx::query(
            "WITH holds AS ( \
                 INSERT INTO shopper_hold (shop, user_id, open_holds) \
                 SELECT added.shop, added.user_id, added.holds \
                 FROM UNNEST($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS added (shop, user_id, holds, ordinal) \
                 WHERE added.holds <= $4 ORDER BY added.ordinal \
                 ON CONFLICT (shop, user_id) DO UPDATE SET open_holds = shopper_hold.open_holds + excluded.open_holds \
                 WHERE shopper_hold.open_holds + excluded.open_holds <= $4 \
                 RETURNING 1), \
             purchases AS ( \
                 INSERT INTO shopper_purchase (shop, user_id, sku, quantity) \
                 SELECT added.shop, added.user_id, added.sku, added.quantity \
                 FROM UNNEST($5::text[], $6::text[], $7::text[], $8::bigint[]) WITH ORDINALITY \
                     AS added (shop, user_id, sku, quantity, ordinal) \
                 WHERE (EXISTS (SELECT 1 FROM sku WHERE sku.code = added.sku) \
                        OR EXISTS (SELECT 1 FROM campaign WHERE campaign.tally_sku = added.sku)) \
                 AND added.quantity <= COALESCE((SELECT per_user_limit FROM sku WHERE sku.code = added.sku), \
                     (SELECT per_user_limit FROM campaign WHERE campaign.tally_sku = added.sku), $9) \
                 ORDER BY added.ordinal \
                 ON CONFLICT (shop, user_id, sku) DO UPDATE SET quantity = shopper_purchase.quantity + excluded.quantity \
                 WHERE shopper_purchase.quantity + excluded.quantity <= \
                 COALESCE((SELECT per_user_limit FROM sku WHERE sku.code = excluded.sku), \
                     (SELECT per_user_limit FROM campaign WHERE campaign.tally_sku = excluded.sku), $9) \
                 RETURNING 1) \
             SELECT (SELECT COUNT(*) FROM holds) AS holds, (SELECT COUNT(*) FROM purchases) AS purchases",
        )
        .bind(holds_added.keys().map(|key| key.0.as_str()).collect::<Vec<_>>())
        .bind(holds_added.keys().map(|key| key.1.as_str()).collect::<Vec<_>>())
        .bind(holds_added.values().copied().collect::<Vec<i64>>())
        .bind(open_holds_max)
        .bind(purchases_added.keys().map(|key| key.0.as_str()).collect::<Vec<_>>())
        .bind(purchases_added.keys().map(|key| key.1.as_str()).collect::<Vec<_>>())
        .bind(purchases_added.keys().map(|key| key.2.as_str()).collect::<Vec<_>>())
        .bind(purchases_added.values().copied().collect::<Vec<i64>>())
        .bind(quantity_max)
        .fetch_one(&mut *transaction)
        .await?;
        let written = |column: &str| -> Result<u64, StoreError> {
            let count: i64 = row.try_get(column)?;
            u64::try_from(count).map_err(|error| corrupt("a count of tally rows written", error))
        };
        Ok((written("holds")?, written("purchases")?))
    }

    pub async fn sku_facts(
        transaction: &mut Tx,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
        if skus.is_empty() {
            return Ok(HashMap::new());
        }
        let codes: Vec<String> = skus.iter().map(|sku| sku.as_str().to_owned()).collect();
        let found = sqlx::query_as::<_, SkuFactsRow>(
            "SELECT code, sale_status, shop, per_user_limit FROM sku WHERE code = ANY($1)",
        )
        .bind(codes)
        .persistent(false)
        .fetch_all(&mut *transaction)
        .await?;
        sku_facts_of(found)
    }

    /// A batch's rows as the columns the server-side functions take (migration 0006):
    /// one array per column, read there with `UNNEST`.
    struct BatchColumns {
        total_skus: Vec<String>,
        total_warehouses: Vec<String>,
        total_quantities: Vec<i64>,
        reservation_ids: Vec<String>,
        reservation_expiries: Vec<i64>,
        reservation_keys: Vec<Option<String>>,
        reservation_shops: Vec<String>,
        reservation_users: Vec<Option<String>>,
        reservation_orders: Vec<Option<String>>,
        line_reservations: Vec<String>,
        line_numbers: Vec<i64>,
        line_skus: Vec<String>,
        line_warehouses: Vec<String>,
        line_quantities: Vec<i64>,
        line_keys: Vec<String>,
        record_keys: Vec<String>,
        record_fingerprints: Vec<String>,
        record_statuses: Vec<i64>,
        record_bodies: Vec<String>,
    }

    impl BatchColumns {
        /// Idempotency records go in key order, so two processes inserting
        /// overlapping keys wait for each other instead of deadlocking.
        fn new(
            totals: &BTreeMap<StockKey, i64>,
            reservations: &[NewReservation<'_>],
            records: &[(&IdempotencyClaim, &StoredResponse)],
        ) -> BatchColumns {
            let mut columns = BatchColumns {
                total_skus: Vec::with_capacity(totals.len()),
                total_warehouses: Vec::with_capacity(totals.len()),
                total_quantities: Vec::with_capacity(totals.len()),
                reservation_ids: Vec::with_capacity(reservations.len()),
                reservation_expiries: Vec::with_capacity(reservations.len()),
                reservation_keys: Vec::with_capacity(reservations.len()),
                reservation_shops: Vec::with_capacity(reservations.len()),
                reservation_users: Vec::with_capacity(reservations.len()),
                reservation_orders: Vec::with_capacity(reservations.len()),
                line_reservations: Vec::new(),
                line_numbers: Vec::new(),
                line_skus: Vec::new(),
                line_warehouses: Vec::new(),
                line_quantities: Vec::new(),
                line_keys: Vec::new(),
                record_keys: Vec::with_capacity(records.len()),
                record_fingerprints: Vec::with_capacity(records.len()),
                record_statuses: Vec::with_capacity(records.len()),
                record_bodies: Vec::with_capacity(records.len()),
            };
            for ((sku, warehouse), quantity) in totals {
                columns.total_skus.push(sku.as_str().to_owned());
                columns.total_warehouses.push(warehouse.as_str().to_owned());
                columns.total_quantities.push(*quantity);
            }
            for reservation in reservations {
                columns.push_reservation(reservation);
            }
            let mut sorted_records: Vec<&(&IdempotencyClaim, &StoredResponse)> =
                records.iter().collect();
            sorted_records.sort_by(|left, right| left.0.key.as_str().cmp(right.0.key.as_str()));
            for (claim, response) in sorted_records {
                columns.record_keys.push(claim.key.as_str().to_owned());
                columns.record_fingerprints.push(claim.fingerprint.clone());
                columns.record_statuses.push(i64::from(response.status));
                columns.record_bodies.push(response.body.clone());
            }
            columns
        }

        /// One reservation's columns, and its lines'.
        fn push_reservation(&mut self, reservation: &NewReservation<'_>) {
            self.reservation_ids
                .push(reservation.id.as_str().to_owned());
            self.reservation_shops
                .push(reservation.shop.as_str().to_owned());
            self.reservation_users
                .push(reservation.user.map(str::to_owned));
            self.reservation_orders
                .push(reservation.order.map(|order| order.as_str().to_owned()));
            self.reservation_expiries
                .push(reservation.expires_at.unix_milliseconds());
            self.reservation_keys
                .push(reservation.request_key.map(str::to_owned));
            for (line_number, line) in reservation.lines.iter().enumerate() {
                self.line_reservations
                    .push(reservation.id.as_str().to_owned());
                self.line_numbers
                    .push(i64::try_from(line_number).unwrap_or(i64::MAX));
                self.line_skus.push(line.sku.as_str().to_owned());
                self.line_warehouses
                    .push(line.warehouse.as_str().to_owned());
                self.line_quantities.push(line.quantity.get());
                self.line_keys.push(reservation.ledger_key.to_owned());
            }
        }

        /// The functions' arguments: `leading` ones first, then the columns in the
        /// functions' parameter order; the reservations' orders last when the function
        /// takes them (`stockd_write_reservation_batch`, migration 0014).
        fn into_arguments(
            self,
            leading: impl FnOnce(&mut PgArguments) -> Result<(), BoxDynError>,
            with_orders: bool,
        ) -> Result<PgArguments, StoreError> {
            let orders = self.reservation_orders;
            let mut arguments = PgArguments::default();
            let added = leading(&mut arguments)
                .and_then(|()| arguments.add(self.total_skus))
                .and_then(|()| arguments.add(self.total_warehouses))
                .and_then(|()| arguments.add(self.total_quantities))
                .and_then(|()| arguments.add(self.reservation_ids))
                .and_then(|()| arguments.add(self.reservation_expiries))
                .and_then(|()| arguments.add(self.reservation_keys))
                .and_then(|()| arguments.add(self.reservation_shops))
                .and_then(|()| arguments.add(self.reservation_users))
                .and_then(|()| arguments.add(self.line_reservations))
                .and_then(|()| arguments.add(self.line_numbers))
                .and_then(|()| arguments.add(self.line_skus))
                .and_then(|()| arguments.add(self.line_warehouses))
                .and_then(|()| arguments.add(self.line_quantities))
                .and_then(|()| arguments.add(self.line_keys))
                .and_then(|()| arguments.add(self.record_keys))
                .and_then(|()| arguments.add(self.record_fingerprints))
                .and_then(|()| arguments.add(self.record_statuses))
                .and_then(|()| arguments.add(self.record_bodies))
                .and_then(|()| {
                    if with_orders {
                        arguments.add(orders)
                    } else {
                        Ok(())
                    }
                });
            added.map_err(|error| corrupt("batch arguments", error))?;
            Ok(arguments)
        }
    }

    /// Writes reservations, and a batch's idempotency records, in one statement (one
    /// round trip): the conditional updates of the stock rows, the reservations, their
    /// lines and ledger rows, and the records (`stockd_write_reservation_batch`, which
    /// writes the rows through `stockd_insert_reservation_rows`, the one writer the
    /// whole-batch fast path uses too; migrations 0006 and 0014).
    pub async fn write_batch(
        transaction: &mut Tx,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<BatchWritten, StoreError> {
        let arguments = BatchColumns::new(totals, reservations, records)
            .into_arguments(|arguments| arguments.add(now.unix_milliseconds()), true)?;
        let (rows_taken, records_stored): (i64, i64) = sqlx::query_as_with(
            "SELECT written.rows_taken, written.records_stored \
             FROM stockd_write_reservation_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
             $11, $12, $13, $14, $15, $16, $17, $18, $19, $20) AS written",
            arguments,
        )
        .fetch_one(&mut *transaction)
        .await
        .map_err(|error| {
            if is_unique_violation(&error) {
                // Another process committed one of these keys since they were looked
                // up (the only unique key a validated batch can repeat): the batch
                // runs again and finds it.
                return StoreError::Retryable(format!("a unique key was taken meanwhile: {error}"));
            }
            match StoreError::from(error) {
                // Another process holds one of these keys in an open transaction.
                StoreError::LockTimeout(_) => StoreError::KeyInFlight,
                other => other,
            }
        })?;
        Ok(BatchWritten {
            rows_taken: u64::try_from(rows_taken).unwrap_or(0),
            records_stored: u64::try_from(records_stored).unwrap_or(0),
        })
    }

    /// A unique constraint refused a row. The batch functions insert idempotency
    /// records without `ON CONFLICT` (migration 0007): their callers looked the keys up
    /// first, so this is the rare key committed by another process in between.
    fn is_unique_violation(error: &sqlx::Error) -> bool {
        const UNIQUE_VIOLATION: &str = "23505";
        matches!(error, sqlx::Error::Database(database) if database.code().as_deref() == Some(UNIQUE_VIOLATION))
    }

    /// SQLSTATEs raised by `stockd_reserve_whole_batch` (migration 0006). Since
    /// migration 0007 a key committed by another process meanwhile surfaces as a
    /// unique violation before SK001's check is reached; the check stays as a guard.
    const KEY_COMMITTED_MEANWHILE: &str = "SK001";
    const TOTALS_CHANGED_UNDER_LOCK: &str = "SK002";
    const NO_LONGER_FITS: &str = "SK003";

    /// The hot path's one round trip: outside any transaction, `stockd_reserve_whole_batch`
    /// looks up the keys, locks the rows in the usual order, and when every request
    /// fits writes the batch; the procedure around it (migration 0019) commits it
    /// (`synchronous_commit` is on, so the answer comes after the flush) and reads the
    /// writer's position after the commit, which the batch's answers carry. Anything
    /// else — a key seen before, a row short of stock, an off-shelf SKU, a lock wait
    /// that timed out, a key another process committed meanwhile — writes nothing, and
    /// the caller decides the batch request by request in its own transaction.
    pub async fn reserve_whole_batch(
        pool: &sqlx::PgPool,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<WholeBatch, StoreError> {
        let sellable: Vec<String> = SaleStatus::ALL
            .into_iter()
            .filter(|status| status.is_sellable())
            .map(|status| status.as_str().to_owned())
            .collect();
        let now = now.unix_milliseconds();
        let arguments = BatchColumns::new(totals, reservations, records).into_arguments(
            |arguments| {
                arguments.add(sellable)?;
                arguments.add(now)
            },
            false,
        )?;
        // The two trailing NULLs stand for the procedure's OUT parameters.
        const WHOLE_BATCH: &str = "CALL stockd_reserve_whole_batch_committed($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
             $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, NULL, NULL)";
        let described = crate::sql::Described::locking(WHOLE_BATCH);
        let answer: Result<(String, Option<String>), sqlx::Error> = described
            .run(sqlx::query_as_with(WHOLE_BATCH, arguments).fetch_one(pool))
            .await;
        match answer {
            Ok((answer, Some(position))) if answer == "applied" => Ok(WholeBatch::Applied(
                crate::backends::replicas::position(&position)?,
            )),
            Ok((answer, None)) if answer == "replay" || answer == "does_not_fit" => {
                Ok(WholeBatch::NotApplied)
            }
            Ok((answer, _)) => Err(corrupt("whole batch answer", answer)),
            Err(sqlx::Error::Database(error))
                if matches!(
                    error.code().as_deref(),
                    Some(KEY_COMMITTED_MEANWHILE | NO_LONGER_FITS)
                ) =>
            {
                Ok(WholeBatch::NotApplied)
            }
            // Another process committed one of the keys after the lookup.
            Err(error) if is_unique_violation(&error) => Ok(WholeBatch::NotApplied),
            Err(sqlx::Error::Database(error))
                if error.code().as_deref() == Some(TOTALS_CHANGED_UNDER_LOCK) =>
            {
                Err(StoreError::Invariant(error.message().to_owned()))
            }
            Err(error) => match described.explain(error) {
                // A stock row or a key held longer than `lock_timeout`: the batch
                // transaction tells which, and answers accordingly.
                StoreError::LockTimeout(_) => Ok(WholeBatch::WaitedOutTheLock),
                other => Err(other),
            },
        }
    }
}

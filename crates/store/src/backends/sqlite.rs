//! The embedded default: one SQLite file in WAL mode with `synchronous=FULL`.
//!
//! SQLite allows one writer at a time. Rather than let connections race for the write
//! lock (and spin in SQLite's busy handler), all writes go through one connection,
//! lent by a fair lock ([`writer`]), so writers queue inside the process in the order
//! they asked, and every write transaction starts with `BEGIN IMMEDIATE` so it holds
//! the lock from its first statement. Reads use a pool of their own and see WAL
//! snapshots without blocking the writer.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use domain::{ShopCode, SkuCode, Timestamp};
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteJournalMode, SqliteRow, SqliteSynchronous,
};
use sqlx::{Row as _, Sqlite, SqliteConnection, SqlitePool, TypeInfo, ValueRef};

use crate::backend::{Backend, Dialect, FoundRecords, LockedStock, Migration, NewReservation};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, StoredResponse};
use crate::plan::{BatchWritten, PurchaseKey, ShopperKey, SkuFacts, StockKey};
use crate::sql::{Cell, Statement, Value, text_of};
use crate::units::decode::{
    LockedStockRow, SkuFactsRow, TallyKey, locked_stock_of, sku_facts_of, split_tally_rows,
    stored_response, tallies_of,
};
use crate::{StoreConfig, StoreLimits};

mod checkpointer;
mod jsonb;
mod writer;

/// The SQLite database: one writer and a pool of readers.
#[derive(Debug, Clone)]
pub struct SqliteBackend {
    write: writer::Writer,
    /// Copies the WAL into the database file beside the writer; stopped when the last
    /// clone of the backend goes.
    checkpointer: std::sync::Arc<checkpointer::Checkpointer>,
    read: SqlitePool,
    limits: StoreLimits,
    watch: crate::backend::PoolWatch,
}

impl SqliteBackend {
    pub async fn connect(config: &StoreConfig) -> Result<SqliteBackend, StoreError> {
        let options = SqliteConnectOptions::from_str(&config.database_url)
            .map_err(|error| StoreError::Unavailable(error.to_string()))?;
        if let Some(parent) = Path::new(options.get_filename()).parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|error| {
                StoreError::Unavailable(format!(
                    "cannot create directory {}: {error}",
                    parent.display()
                ))
            })?;
        }
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_millis(config.lock_timeout_milliseconds));
        let acquire_timeout = Duration::from_millis(config.acquire_timeout_milliseconds);
        let writer_options = options.clone().pragma(
            "wal_autocheckpoint",
            checkpointer::WRITER_AUTOCHECKPOINT_PAGES.to_string(),
        );
        let write = writer::Writer::new(writer_options, acquire_timeout, WRITER_SESSION);
        write.open().await?;
        let checkpointer = checkpointer::Checkpointer::start(&options).await?;
        let read = crate::backend::pool_options()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(acquire_timeout)
            .connect_with(options.read_only(true))
            .await?;
        Ok(SqliteBackend {
            watch: crate::backend::PoolWatch::default(),
            write,
            checkpointer: std::sync::Arc::new(checkpointer),
            read,
            limits: config.limits,
        })
    }
}

// The reads' macros come before the `Backend` impl that uses them: a `macro_rules!` is
// visible only below its definition.

/// The idempotency records of the keys in `$1`.
macro_rules! select_records {
    () => {
        "SELECT key, fingerprint, status_code, body FROM idempotency_record \
         WHERE key IN (SELECT value FROM jsonb_each($1))"
    };
}

/// The stock rows named in a parameter ([`stock_keys`]) with their SKUs' facts
/// ([`LockedStockRow`]).
macro_rules! select_stock_rows {
    ($parameter:literal) => {
        concat!(
            "SELECT stock.sku, stock.warehouse, stock.available, sku.sale_status, sku.shop, \
             sku.per_user_limit FROM stock JOIN sku ON sku.code = stock.sku \
             WHERE (stock.sku, stock.warehouse) IN (SELECT value ->> 0, value ->> 1 FROM jsonb_each(",
            $parameter,
            "))"
        )
    };
}

impl SqliteBackend {
    /// Lends the writer and sends `query`, whose first statement is `BEGIN IMMEDIATE`,
    /// as one command; answers the transaction (open from here: dropped before its end,
    /// it is rolled back) and the results of the statements after `BEGIN`. As in
    /// `begin_write`, the lock wait (and the waiters' gauge) lasts until `BEGIN`
    /// answers: the first result of the query's stream is its.
    async fn begin_with(
        &self,
        query: sqlx::query::Query<'_, Sqlite, SqliteArguments>,
    ) -> Result<(writer::WriteTransaction, Vec<StatementResult>), StoreError> {
        use futures_util::TryStreamExt as _;
        let started = std::time::Instant::now();
        let lent = self.watch.acquiring(self.write.lend()).await?;
        let mut transaction = writer::WriteTransaction::begun_by_first_statement(lent);
        // Several statements in one query: see `run_statements`.
        #[allow(deprecated)]
        let mut results = query.fetch_many(transaction.connection());
        let begun = self.watch.acquiring(results.try_next()).await;
        crate::observe::record_lock_wait(started.elapsed());
        if !matches!(begun?, Some(sqlx::Either::Left(_))) {
            return Err(StoreError::Invariant(
                "BEGIN IMMEDIATE answered rows, or nothing".into(),
            ));
        }
        let results: Vec<_> = results.try_collect().await?;
        Ok((transaction, results))
    }
}

/// What one statement of several sent together answers: its count, or a row.
type StatementResult = sqlx::Either<sqlx::sqlite::SqliteQueryResult, SqliteRow>;

impl Backend for SqliteBackend {
    type Connection = SqliteConnection;
    type Transaction = writer::SqliteTransaction;
    type Pooled = writer::SqlitePooled;

    const NAME: &'static str = "sqlite";

    /// One writer per database file: a second pool would only wait for its lock.
    fn with_own_pool(&self, _connections: u32) -> Option<Self> {
        None
    }

    /// SQLite's one lock is the database's write lock, waited for here (the write
    /// connection, then `BEGIN IMMEDIATE` against other processes): this wait is the
    /// backend's lock wait.
    async fn begin_write(&self) -> Result<Self::Transaction, StoreError> {
        let started = std::time::Instant::now();
        // The wait for another process's lock (`BEGIN IMMEDIATE`) is a wait for the
        // writer too: counted with the waiters (`stockd_db_pool_waiting`).
        let begun = self
            .watch
            .acquiring(async { writer::WriteTransaction::begin(self.write.lend().await?).await })
            .await;
        crate::observe::record_lock_wait(started.elapsed());
        begun.map(writer::SqliteTransaction::Write)
    }

    /// `BEGIN IMMEDIATE` travels with the batch's first read, in one command to the
    /// connection's thread: one hand-off fewer of a batch's four. As in `begin_write`,
    /// the lock wait (and the waiters' gauge) lasts until `BEGIN` answers.
    async fn begin_write_reading(
        &self,
        keys: &[&str],
        wanted: &[StockKey],
    ) -> Result<(Self::Transaction, FoundRecords, LockedStock), StoreError> {
        let query = sqlx::query(concat!(
            "BEGIN IMMEDIATE;\n",
            select_records!(),
            ";\n",
            select_stock_rows!("$2")
        ))
        .bind(rows(keys))
        .bind(stock_keys(wanted));
        let (transaction, results) = self.begin_with(query).await?;
        let (records, stock) = records_and_stock_of(&results)?;
        Ok((
            writer::SqliteTransaction::Write(transaction),
            records,
            stock,
        ))
    }

    /// The writes, the database's check of their counts and `COMMIT` as one command to
    /// the connection's thread: one hand-off fewer than writing, checking here, then
    /// committing. A count other than planned stops the command before `COMMIT`, and
    /// the transaction, dropped open, is rolled back. Either count short is an
    /// invariant broken here (`StoreError::Invariant`, not retried): the write lock is
    /// held from the batch's first read, so no other process can have committed one of
    /// its keys or changed a row since.
    async fn write_batch_and_commit(
        &self,
        transaction: Self::Transaction,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let writer::SqliteTransaction::Write(mut transaction) = transaction else {
            return Err(StoreError::Invariant(
                "a reservation batch was written in a read transaction".into(),
            ));
        };
        let query = with_reservation_rows(WRITE_BATCH_THEN_COMMIT, totals, reservations, now)
            .bind(record_rows(records))
            .bind(i64::try_from(totals.len()).unwrap_or(i64::MAX))
            .bind(i64::try_from(records.len()).unwrap_or(i64::MAX));
        // The update, its check, four inserts, the records, their check and `COMMIT`.
        run_statements(transaction.connection(), query, 9).await?;
        transaction.ended_by_last_statement();
        Ok(())
    }

    /// The whole step as one command to the connection's thread (the writer's lock
    /// serializes sequencers): `BEGIN IMMEDIATE`, the numbering from the sequencer's
    /// row, the row advanced by the count just numbered (and checked to be one row),
    /// `COMMIT`. Under a hot sale it runs about fifty times a second, each time between
    /// two reservation batches.
    async fn sequence_waiting_events(&self, limit: i64) -> Result<u64, StoreError> {
        let (transaction, results) = self
            .begin_with(sqlx::query(SEQUENCE_WAITING_EVENTS).bind(limit))
            .await?;
        transaction.ended_by_last_statement();
        // After `BEGIN`: the numbering, the row advanced, its check and `COMMIT`.
        let counts = counts_of(results, 4)?;
        Ok(counts[0])
    }

    /// The read pool reads the same file as the writer: nothing there is stale.
    async fn begin_writer_read(&self) -> Result<Self::Transaction, StoreError> {
        let begun = self.watch.acquiring(self.read.begin()).await;
        begun.map(writer::SqliteTransaction::Read)
    }

    /// A deferred read transaction sees one WAL snapshot from its first read on.
    async fn begin_snapshot(&self) -> Result<Self::Transaction, StoreError> {
        self.begin_writer_read().await
    }

    async fn writer_read_connection(&self) -> Result<Self::Pooled, StoreError> {
        let acquired = self.watch.acquiring(self.read.acquire()).await;
        acquired.map(writer::SqlitePooled::Read)
    }

    async fn write_connection(&self) -> Result<Self::Pooled, StoreError> {
        let lent = self.watch.acquiring(self.write.lend()).await;
        lent.map(writer::SqlitePooled::Write)
    }

    fn pool_usage(&self) -> crate::backend::PoolUsage {
        let mut usage = self.watch.usage(&[&self.read]);
        let writer = self.write.usage();
        usage.active += writer.active;
        usage.idle += writer.idle;
        usage
    }

    fn limits(&self) -> &StoreLimits {
        &self.limits
    }

    async fn close(&self) {
        self.checkpointer.stop().await;
        self.write.close().await;
        self.read.close().await;
    }
}

/// SQLite result codes. A plain `SQLITE_BUSY` (or `SQLITE_BUSY_TIMEOUT`) arrives only
/// after the busy handler waited the whole `busy_timeout` for another process's write
/// lock: that is a lock timeout, reported like PostgreSQL's `55P03`. The other busy
/// and locked variants (recovery, snapshot, shared-cache locks) are transient
/// conflicts worth another attempt.
const SQLITE_BUSY: i64 = 5;
const SQLITE_BUSY_TIMEOUT: i64 = 773;
const SQLITE_LOCKED: i64 = 6;
/// A trigger's `RAISE(ABORT, …)`: only the schema's own guards raise (append-only
/// tables, a batch's counts).
const SQLITE_CONSTRAINT_TRIGGER: i64 = 1811;
/// Out of memory, an I/O error, a full disk: the machine's state for a while, not the
/// request's rows (as PostgreSQL's 53100, 53200 and 58030).
const SQLITE_NOMEM: i64 = 7;
const SQLITE_IOERR: i64 = 10;
const SQLITE_FULL: i64 = 13;

/// SQLite's errors by (extended) result code.
pub(crate) fn classify_database(error: &sqlx::sqlite::SqliteError) -> StoreError {
    use sqlx::error::DatabaseError;
    let message = error.message().to_owned();
    let code = error
        .code()
        .and_then(|code| code.parse::<i64>().ok())
        .unwrap_or_default();
    if code == SQLITE_BUSY || code == SQLITE_BUSY_TIMEOUT {
        return StoreError::LockTimeout(message);
    }
    if code == SQLITE_CONSTRAINT_TRIGGER {
        return StoreError::Invariant(message);
    }
    let primary_code = code & 0xFF;
    if primary_code == SQLITE_BUSY || primary_code == SQLITE_LOCKED {
        return StoreError::Retryable(message);
    }
    if [SQLITE_NOMEM, SQLITE_IOERR, SQLITE_FULL].contains(&primary_code) {
        return StoreError::Unavailable(message);
    }
    StoreError::Database(format!("{message} (code {code})"))
}

/// A statement as an sqlx query: SQLite binds `$1`, `$2`, … by number, as written.
fn query_of(statement: Statement<'_>) -> sqlx::query::Query<'static, Sqlite, SqliteArguments> {
    let mut query = sqlx::query(text_of(statement.text));
    for value in statement.values {
        query = match value {
            Value::Integer(value) => query.bind(value),
            Value::Text(value) => query.bind(value.map(|text| text.into_owned())),
        };
    }
    query
}

/// SQLite is dynamically typed: each value says what it holds.
fn cell(row: &SqliteRow, position: usize) -> Result<Cell, StoreError> {
    let value = row.try_get_raw(position)?;
    if value.is_null() {
        return Ok(Cell::Null);
    }
    let kind = value.type_info().name().to_owned();
    match kind.as_str() {
        "INTEGER" | "BOOLEAN" => Ok(Cell::Integer(row.try_get(position)?)),
        "TEXT" => Ok(Cell::Text(row.try_get(position)?)),
        other => Err(StoreError::Database(format!("a column of type {other}"))),
    }
}

crate::sql::connection_as_written!(SqliteConnection, query_of, cell);

/// A statement's rows as one JSONB array, read back with `jsonb_each`: a row is a
/// string (one column), or a tuple or list of strings, integers and nulls.
/// Written straight from the borrowed fields, as SQLite's own binary JSON: JSON text
/// had to be parsed again on the writer's thread ([`jsonb`]).
fn rows<Row: jsonb::Element>(rows: impl IntoIterator<Item = Row>) -> Vec<u8> {
    jsonb::array_of(rows)
}

/// Both kinds of tally in one statement (SQLite takes no row locks: the write lock
/// of `BEGIN IMMEDIATE` is the only one): the open holds as rows without a SKU, then
/// the purchases, split as PostgreSQL's combined read is.
async fn read_tallies(
    connection: &mut SqliteConnection,
    shoppers: &[ShopperKey],
    purchases: &[PurchaseKey],
) -> Result<crate::backend::LockedTallies, StoreError> {
    if shoppers.is_empty() && purchases.is_empty() {
        return Ok((HashMap::new(), HashMap::new()));
    }
    let found = sqlx::query(
        "SELECT shop, user_id, NULL AS sku, open_holds AS count FROM shopper_hold \
         WHERE (shop, user_id) IN (SELECT value ->> 0, value ->> 1 FROM jsonb_each($1)) \
         UNION ALL SELECT shop, user_id, sku, quantity FROM shopper_purchase \
         WHERE (shop, user_id, sku) IN (SELECT value ->> 0, value ->> 1, value ->> 2 FROM jsonb_each($2))",
    )
    .bind(rows(shoppers.iter().map(TallyKey::columns)))
    .bind(rows(purchases.iter().map(TallyKey::columns)))
    .fetch_all(&mut *connection)
    .await?;
    let (holds, bought) = split_tally_rows(crate::sql::rows_of(found, cell)?);
    Ok((
        tallies_of(shoppers, &holds)?,
        tallies_of(purchases, &bought)?,
    ))
}

/// Both tally writes of a batch, sent as one command ([`run_statements`]): each
/// shopper's new open holds under `open_holds_max` (`$1`, `$2`), then each key's new
/// units under the SKU's or the campaign's per-user limit, else `quantity_max` (`$3`,
/// `$4`); a new tally is created. Answers the rows each wrote.
async fn add_tallies(
    connection: &mut SqliteConnection,
    holds_added: &BTreeMap<ShopperKey, i64>,
    open_holds_max: i64,
    purchases_added: &BTreeMap<PurchaseKey, i64>,
    quantity_max: i64,
) -> Result<(u64, u64), StoreError> {
    if holds_added.is_empty() && purchases_added.is_empty() {
        return Ok((0, 0));
    }
    let holds = rows(
        holds_added
            .iter()
            .map(|((shop, user), holds)| (shop.as_str(), user.as_str(), holds)),
    );
    let purchases = rows(purchases_added.iter().map(|((shop, user, sku), quantity)| {
        (shop.as_str(), user.as_str(), sku.as_str(), quantity)
    }));
    // `WHERE` before `ON CONFLICT`: without it SQLite reads `ON` as a join's.
    let query = sqlx::query(
        "INSERT INTO shopper_hold (shop, user_id, open_holds) \
         SELECT value ->> 0, value ->> 1, value ->> 2 FROM jsonb_each($1) \
         WHERE value ->> 2 <= $2 \
         ON CONFLICT (shop, user_id) DO UPDATE SET open_holds = shopper_hold.open_holds + excluded.open_holds \
         WHERE shopper_hold.open_holds + excluded.open_holds <= $2;
         INSERT INTO shopper_purchase (shop, user_id, sku, quantity) \
         SELECT added.shop, added.user_id, added.sku, added.quantity \
         FROM (SELECT value ->> 0 AS shop, value ->> 1 AS user_id, value ->> 2 AS sku, \
               value ->> 3 AS quantity FROM jsonb_each($3)) AS added \
         WHERE (EXISTS (SELECT 1 FROM sku WHERE sku.code = added.sku) \
                OR EXISTS (SELECT 1 FROM campaign WHERE campaign.tally_sku = added.sku)) \
         AND added.quantity <= COALESCE((SELECT per_user_limit FROM sku WHERE sku.code = added.sku), \
             (SELECT per_user_limit FROM campaign WHERE campaign.tally_sku = added.sku), $4) \
         ON CONFLICT (shop, user_id, sku) DO UPDATE SET quantity = shopper_purchase.quantity + excluded.quantity \
         WHERE shopper_purchase.quantity + excluded.quantity <= \
         COALESCE((SELECT per_user_limit FROM sku WHERE sku.code = excluded.sku), \
             (SELECT per_user_limit FROM campaign WHERE campaign.tally_sku = excluded.sku), $4)",
    )
    .bind(holds)
    .bind(open_holds_max)
    .bind(purchases)
    .bind(quantity_max);
    let counts = run_statements(connection, query, 2).await?;
    Ok((counts[0], counts[1]))
}

/// Stock rows' keys as the parameter [`select_stock_rows!`] reads.
fn stock_keys(wanted: &[StockKey]) -> Vec<u8> {
    rows(
        wanted
            .iter()
            .map(|(sku, warehouse)| (sku.as_str(), warehouse.as_str())),
    )
}

/// The records read by [`select_records!`], by key.
fn records_of<'a>(
    found: impl IntoIterator<Item = &'a SqliteRow>,
) -> Result<FoundRecords, StoreError> {
    let mut records = HashMap::new();
    for row in found {
        let response = stored_response(row.try_get("status_code")?, row.try_get("body")?)?;
        records.insert(row.try_get("key")?, (row.try_get("fingerprint")?, response));
    }
    Ok(records)
}

/// The records' rows, then (after the first statement's end) the stock rows: what
/// [`select_records!`] and [`select_stock_rows!`] sent together answer.
fn records_and_stock_of(
    results: &[StatementResult],
) -> Result<(FoundRecords, LockedStock), StoreError> {
    use sqlx::FromRow as _;
    let mut statements = results.split(|result| result.is_left());
    let (Some(records), Some(stock)) = (statements.next(), statements.next()) else {
        return Err(StoreError::Invariant(
            "two reads sent together answered fewer than two results".into(),
        ));
    };
    let stock = stock
        .iter()
        .filter_map(|row| row.as_ref().right())
        .map(LockedStockRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let records = records_of(records.iter().filter_map(|row| row.as_ref().right()))?;
    Ok((records, locked_stock_of(stock)?))
}

/// SQLite has one writer, and `BEGIN IMMEDIATE` takes its lock at the first statement:
/// no row locks to take, and the reads of a write transaction are current until the
/// commit. A reservation batch's rows travel as one JSONB parameter ([`rows`]) read
/// with `jsonb_each`, so a batch of any size costs the same few statements (every
/// statement is a round trip to sqlx's SQLite worker thread). `jsonb_each`, not
/// `json_each`: it hands each row (an array) over as JSONB, which `value ->> N` reads
/// directly, where `json_each` hands over its text and every `->>` parses that text
/// again (docs/BENCHMARKS.md, twenty-second session).
impl Dialect for SqliteConnection {
    const SELECT_RESERVATION_FOR_UPDATE: &'static str =
        "SELECT status, order_id, shop, user_id, expires_at FROM reservation WHERE id = $1";
    const CLAIM_EXPIRED_RESERVATIONS: &'static str = "SELECT id, expires_at FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL \
         AND expires_at >= $3 AND (expires_at > $3 OR id > $4) \
         ORDER BY expires_at, id LIMIT $2";
    /// `INDEXED BY`: without statistics SQLite's planner has picked other plans for
    /// this join (once the (sku, warehouse) index, which made the audit quadratic on a
    /// hot SKU), so the one index that fits is named.
    const AUDIT_RESERVATION_LINES: &'static str = "SELECT reservation.id, reservation.status, \
         line.sku, line.warehouse, line.quantity, \
         COALESCE(CAST(SUM(ledger.available_delta) AS BIGINT), 0), \
         COALESCE(CAST(SUM(ledger.reserved_delta) AS BIGINT), 0) \
         FROM reservation JOIN reservation_line line ON line.reservation_id = reservation.id \
         LEFT JOIN stock_ledger ledger INDEXED BY stock_ledger_reference ON ledger.reference = reservation.id \
         AND ledger.sku = line.sku AND ledger.warehouse = line.warehouse \
         GROUP BY reservation.id, reservation.status, line.sku, line.warehouse, line.quantity \
         ORDER BY reservation.id, line.sku, line.warehouse";
    const CLAIM_DUE_SCHEDULES: &'static str = "SELECT id, sku, operation, remark, due_at, recurrence, series_id FROM shelf_schedule \
         WHERE status = 'PENDING' AND due_at <= $1 ORDER BY due_at, id LIMIT $2";
    const CLAIM_DUE_SCHEDULES_OF_SKU: &'static str = "SELECT id, sku, operation, remark, due_at, recurrence, series_id FROM shelf_schedule \
         WHERE status = 'PENDING' AND sku = $2 AND due_at <= $1 ORDER BY due_at, id";
    const CLAIM_PENDING_SCHEDULES_OF_SKU: &'static str =
        "SELECT id FROM shelf_schedule WHERE status = 'PENDING' AND sku = $1 ORDER BY id";
    const SELECT_ORDER_FOR_UPDATE: &'static str =
        "SELECT status, reservation_id, expires_at FROM customer_order WHERE id = $1";
    const SELECT_ATTEMPT_STATUS_FOR_UPDATE: &'static str =
        "SELECT status FROM payment_attempt WHERE id = $1";
    // One writer: requests on a cart run one after the other anyway.
    const LOCK_CART_LINES: &'static str =
        "SELECT sku, quantity FROM cart_item WHERE user_id = $1 AND shop = $2";
    const LOCK_SKU_ROW: &'static str = "SELECT version FROM sku WHERE code = $1";
    const SHARE_SKU_ROW: &'static str = "SELECT shop, sale_status FROM sku WHERE code = $1";
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
         ORDER BY customer_order.expires_at, customer_order.id LIMIT $2",
    ];
    const CLAIM_ATTEMPTS_TO_RECONCILE: &'static str = "SELECT id FROM payment_attempt \
         WHERE status = 'PROCESSING' AND reconcile_after <= $1 ORDER BY reconcile_after, id LIMIT $2";
    const CLAIM_REFUNDS: &'static str = "SELECT id, order_id, attempt_id, gateway_key, amount_minor, currency, tries, gateway_refund_id FROM refund \
         WHERE status = 'PENDING' AND next_try_at <= $1 ORDER BY next_try_at, id LIMIT $2";
    const VERSION_QUERY: &'static str = "SELECT 'SQLite ' || sqlite_version()";
    /// SQLite has no sessions to look at: one process writes, and its waiters are the
    /// pool's (`stockd_db_pool_waiting`, docs/OPERATIONS.md).
    const SESSIONS_WAITING_ON_LOCKS: Option<&'static str> = None;
    const LONG_TRANSACTIONS: Option<&'static str> = None;
    const STOCK_SEQUENTIAL_SCANS: Option<&'static str> = None;
    const STOCK_PAGES: Option<&'static str> = None;
    /// The database is a file of this process, on this machine's clock.
    const DATABASE_CLOCK_UNIX_MILLISECONDS: Option<&'static str> = None;
    /// The write lock taken by `BEGIN IMMEDIATE` serializes migrations too.
    const MIGRATION_LOCK: Option<&'static str> = None;
    const MIGRATIONS: &'static [Migration] = &[
        (
            1,
            "reservation_core",
            include_str!("../../migrations/sqlite/0001_reservation_core.sql"),
        ),
        (
            2,
            "ledger_reference_index",
            include_str!("../../migrations/sqlite/0002_ledger_reference_index.sql"),
        ),
        (
            3,
            "reservation_line_key",
            include_str!("../../migrations/sqlite/0003_reservation_line_key.sql"),
        ),
        (
            4,
            "catalog",
            include_str!("../../migrations/sqlite/0004_catalog.sql"),
        ),
        (
            5,
            "orders",
            include_str!("../../migrations/sqlite/0005_orders.sql"),
        ),
        (
            6,
            "trust",
            include_str!("../../migrations/sqlite/0006_trust.sql"),
        ),
        (
            7,
            "refusals",
            include_str!("../../migrations/sqlite/0007_refusals.sql"),
        ),
        (
            8,
            "payment_attempts",
            include_str!("../../migrations/sqlite/0008_payment_attempts.sql"),
        ),
        (
            9,
            "refund_per_attempt",
            include_str!("../../migrations/sqlite/0009_refund_per_attempt.sql"),
        ),
        (
            10,
            "attempt_request_key",
            include_str!("../../migrations/sqlite/0010_attempt_request_key.sql"),
        ),
        (
            11,
            "outbox",
            include_str!("../../migrations/sqlite/0011_outbox.sql"),
        ),
        (
            12,
            "live_audit",
            include_str!("../../migrations/sqlite/0012_live_audit.sql"),
        ),
        (
            13,
            "order_references",
            include_str!("../../migrations/sqlite/0013_order_references.sql"),
        ),
        (
            14,
            "campaigns",
            include_str!("../../migrations/sqlite/0014_campaigns.sql"),
        ),
        (
            15,
            "attempt_request_key_alone",
            include_str!("../../migrations/sqlite/0015_attempt_request_key_alone.sql"),
        ),
        (
            16,
            "schedule_series",
            include_str!("../../migrations/sqlite/0016_schedule_series.sql"),
        ),
        (
            17,
            "schedule_sku_pending",
            include_str!("../../migrations/sqlite/0017_schedule_sku_pending.sql"),
        ),
        (
            18,
            "refund_resolution",
            include_str!("../../migrations/sqlite/0018_refund_resolution.sql"),
        ),
        (
            19,
            "shelf_log_sku",
            include_str!("../../migrations/sqlite/0019_shelf_log_sku.sql"),
        ),
    ];
    /// SQLite's one writer serializes sequencers: no row lock to take.
    const SELECT_SEQUENCER_FOR_UPDATE: &'static str =
        "SELECT through_position FROM outbox_relay WHERE name = 'sequencer'";
    /// SQLite runs in the process: see [`Backend::reserve_whole_batch`].
    const WHOLE_BATCH_FAST_PATH: bool = false;
    /// Reading a stock row takes no lock here, and each statement is a hand-off to the
    /// connection's thread and back: a batch reads both in one.
    const READS_RECORDS_WITH_STOCK_ROWS: bool = true;

    /// SQLite's single writer already serializes every shelf batch.
    async fn lock_shop(&mut self, _shop: &ShopCode) -> Result<(), StoreError> {
        Ok(())
    }

    /// `BEGIN IMMEDIATE` already holds the write lock: one writer at a time.
    async fn lock_shelf_log(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    /// `BEGIN IMMEDIATE` already holds the write lock: nothing more to lock.
    async fn lock_stock_of_skus(&mut self, _skus: &[&SkuCode]) -> Result<(), StoreError> {
        Ok(())
    }

    async fn existing_records(&mut self, keys: &[&str]) -> Result<FoundRecords, StoreError> {
        let found = sqlx::query(select_records!())
            .bind(rows(keys))
            .fetch_all(&mut *self)
            .await?;
        records_of(&found)
    }

    /// SQLite has no row locks: `BEGIN IMMEDIATE` already holds the database's write
    /// lock, so these reads are current until the commit.
    async fn lock_stock_rows(
        &mut self,
        wanted: &[StockKey],
    ) -> Result<(BTreeMap<StockKey, i64>, HashMap<SkuCode, SkuFacts>), StoreError> {
        if wanted.is_empty() {
            return Ok((BTreeMap::new(), HashMap::new()));
        }
        let found = sqlx::query_as::<_, LockedStockRow>(select_stock_rows!("$1"))
            .bind(stock_keys(wanted))
            .fetch_all(&mut *self)
            .await?;
        locked_stock_of(found)
    }

    async fn lock_open_holds(
        &mut self,
        shoppers: &[ShopperKey],
    ) -> Result<HashMap<ShopperKey, i64>, StoreError> {
        Ok(read_tallies(self, shoppers, &[]).await?.0)
    }

    async fn lock_purchases(
        &mut self,
        purchases: &[PurchaseKey],
    ) -> Result<HashMap<PurchaseKey, i64>, StoreError> {
        Ok(read_tallies(self, &[], purchases).await?.1)
    }

    async fn lock_tallies_of_all(
        &mut self,
        shoppers: &[ShopperKey],
        purchases: &[PurchaseKey],
    ) -> Result<crate::backend::LockedTallies, StoreError> {
        read_tallies(self, shoppers, purchases).await
    }

    async fn add_open_holds_of_all(
        &mut self,
        added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
    ) -> Result<u64, StoreError> {
        Ok(
            add_tallies(self, added, open_holds_max, &BTreeMap::new(), 0)
                .await?
                .0,
        )
    }

    async fn add_purchases_of_all(
        &mut self,
        added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<u64, StoreError> {
        Ok(add_tallies(self, &BTreeMap::new(), 0, added, quantity_max)
            .await?
            .1)
    }

    async fn add_tallies_of_all(
        &mut self,
        holds_added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
        purchases_added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<(u64, u64), StoreError> {
        add_tallies(
            self,
            holds_added,
            open_holds_max,
            purchases_added,
            quantity_max,
        )
        .await
    }

    async fn sku_facts(
        &mut self,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
        if skus.is_empty() {
            return Ok(HashMap::new());
        }
        let found = sqlx::query_as::<_, SkuFactsRow>(
            "SELECT code, sale_status, shop, per_user_limit FROM sku \
             WHERE code IN (SELECT value FROM jsonb_each($1))",
        )
        .bind(rows(skus.iter().map(|sku| sku.as_str())))
        .fetch_all(&mut *self)
        .await?;
        sku_facts_of(found)
    }

    /// The stock rows' updates and the reservations' rows: one statement per table,
    /// rows passed as JSONB, sent to the connection's thread as one command.
    async fn write_reservations(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        let counts = run_statements(
            self,
            with_reservation_rows(WRITE_RESERVATIONS, totals, reservations, now),
            5,
        )
        .await?;
        Ok(counts[0])
    }

    /// Writes a decided batch: the reservations' rows, then the records, as one
    /// command (see [`run_statements`]).
    async fn write_batch(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<BatchWritten, StoreError> {
        let counts = run_statements(
            self,
            with_reservation_rows(WRITE_BATCH, totals, reservations, now)
                .bind(record_rows(records)),
            6,
        )
        .await?;
        Ok(BatchWritten {
            rows_taken: counts[0],
            records_stored: counts[counts.len() - 1],
        })
    }
}

/// The one writer of reservations' rows, as statements run together. Parameters:
/// `$1` the stock rows' totals, `$2` now, `$3` the reservations, `$4` their lines,
/// `$5` their ledger rows (JSONB arrays; an empty one writes nothing). The first
/// statement's count is how many stock rows it took from.
macro_rules! reservation_write_statements {
    () => {
        concat!(stock_take_statement!(), reservation_insert_statements!())
    };
}

/// Takes each row's total (`$1`) from its available count, under the condition that
/// it is there.
macro_rules! stock_take_statement {
    () => {
        "UPDATE stock SET available = available - batch.total, reserved = reserved + batch.total, \
         version = version + 1, updated_at = $2 \
         FROM (SELECT value ->> 0 AS sku, value ->> 1 AS warehouse, value ->> 2 AS total FROM jsonb_each($1)) AS batch \
         WHERE stock.sku = batch.sku AND stock.warehouse = batch.warehouse AND stock.available >= batch.total;"
    };
}

/// The reservations (`$3`), their lines (`$4`), ledger rows (`$5`) and events.
macro_rules! reservation_insert_statements {
    () => {
        "
         INSERT INTO reservation (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at, \
         shop, user_id, order_id) \
         SELECT value ->> 0, 'RESERVED', NULL, value ->> 1, value ->> 2, $2, $2, value ->> 3, value ->> 4, value ->> 5 \
         FROM jsonb_each($3);
         INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity) \
         SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4 FROM jsonb_each($4);
         INSERT INTO stock_ledger \
         (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
         SELECT value ->> 0, value ->> 1, 'reserve', -(value ->> 2), value ->> 2, value ->> 3, value ->> 4, $2 \
         FROM jsonb_each($5);
         INSERT INTO outbox (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at) \
         SELECT 'reservation', value ->> 0, 1, 'reservation.created', value ->> 3, NULL, $2 \
         FROM jsonb_each($3) ORDER BY key;"
    };
}

/// The batch's idempotency records (`$6`: key, fingerprint, status, body); its count is
/// how many it stored.
macro_rules! record_insert_statement {
    () => {
        "
         INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
         SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, $2 FROM jsonb_each($6) WHERE true \
         ON CONFLICT (key) DO NOTHING;"
    };
}

/// Refuses, through [`WRITER_SESSION`]'s trigger, when the statement just before
/// changed other than the parameter's count of rows: SQLite's `changes()` is the count
/// of the last statement that finished. The row is inserted only then, and the
/// trigger aborts the statement, so the commit after it never runs.
macro_rules! changed_as_planned_check {
    ($parameter:literal) => {
        concat!(
            "
         INSERT INTO temp.batch_changed_as_planned (changed, planned) \
         SELECT changes(), ",
            $parameter,
            " WHERE changes() <> ",
            $parameter,
            ";"
        )
    };
}

/// Run on the writer connection when it opens: the view and trigger that
/// [`changed_as_planned_check!`] inserts into (temporary: they belong to the
/// connection, not to the schema).
pub(super) const WRITER_SESSION: &str = "CREATE TEMP VIEW IF NOT EXISTS batch_changed_as_planned (changed, planned) AS SELECT 0, 0; \
     CREATE TEMP TRIGGER IF NOT EXISTS batch_changed_other_than_planned \
     INSTEAD OF INSERT ON batch_changed_as_planned \
     BEGIN SELECT RAISE(ABORT, 'a batch statement changed another count of rows than planned'); END;";

/// The reservations' writes. Their `reservation.created` event rows come from the
/// reservations' own parameter (the body is read from these rows when the event is:
/// `units::outbox`).
const WRITE_RESERVATIONS: &str = reservation_write_statements!();

/// The reservations' writes, then the batch's idempotency records; the last
/// statement's count is how many it stored.
const WRITE_BATCH: &str = concat!(reservation_write_statements!(), record_insert_statement!());

/// A batch's writes checked and committed in one command: the stock rows taken must
/// be `$7`, the records stored `$8`, or the commit is not reached (and the transaction
/// is rolled back when dropped).
const WRITE_BATCH_THEN_COMMIT: &str = concat!(
    stock_take_statement!(),
    changed_as_planned_check!("$7"),
    reservation_insert_statements!(),
    record_insert_statement!(),
    changed_as_planned_check!("$8"),
    "
     COMMIT;"
);

/// Idempotency records as the parameter [`record_insert_statement!`] reads.
fn record_rows(records: &[(&IdempotencyClaim, &StoredResponse)]) -> Vec<u8> {
    rows(records.iter().map(|(claim, response)| {
        (
            claim.key.as_str(),
            claim.fingerprint.as_str(),
            response.status,
            response.body.as_str(),
        )
    }))
}

/// A sequencer step ([`Backend::sequence_waiting_events`]) as one command: up to `$1`
/// events without a position numbered after the sequencer's last, in `id` order, and
/// the sequencer advanced by their count (`changes()`: the statement just before's).
const SEQUENCE_WAITING_EVENTS: &str = concat!(
    "BEGIN IMMEDIATE;
     UPDATE outbox SET position = relay.through_position + waiting.ordinal \
     FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY id) AS ordinal FROM outbox \
           WHERE position IS NULL ORDER BY id LIMIT $1) AS waiting, \
          (SELECT through_position FROM outbox_relay WHERE name = 'sequencer') AS relay \
     WHERE outbox.id = waiting.id;
     UPDATE outbox_relay SET through_position = through_position + changes() \
     WHERE name = 'sequencer';",
    changed_as_planned_check!("1"),
    "
     COMMIT;"
);

/// `statements` (one of those above) with the reservations' five parameters bound.
fn with_reservation_rows<'q>(
    statements: &'static str,
    totals: &BTreeMap<StockKey, i64>,
    reservations: &[NewReservation<'_>],
    now: Timestamp,
) -> sqlx::query::Query<'q, Sqlite, SqliteArguments> {
    let totals = rows(
        totals
            .iter()
            .map(|((sku, warehouse), total)| (sku.as_str(), warehouse.as_str(), total)),
    );
    let mut lines = Vec::new();
    let mut ledger = Vec::new();
    for reservation in reservations {
        for (line_number, line) in reservation.lines.iter().enumerate() {
            let quantity = line.quantity.get();
            lines.push((
                reservation.id.as_str(),
                line_number,
                line.sku.as_str(),
                line.warehouse.as_str(),
                quantity,
            ));
            ledger.push((
                line.sku.as_str(),
                line.warehouse.as_str(),
                quantity,
                reservation.id.as_str(),
                reservation.ledger_key,
            ));
        }
    }
    let reservations = rows(reservations.iter().map(|reservation| {
        (
            reservation.id.as_str(),
            reservation.expires_at.unix_milliseconds(),
            reservation.request_key,
            reservation.shop.as_str(),
            reservation.user,
            reservation.order.map(|order| order.as_str()),
        )
    }));
    sqlx::query(statements)
        .bind(totals)
        .bind(now.unix_milliseconds())
        .bind(reservations)
        .bind(rows(lines))
        .bind(rows(ledger))
}

/// Runs several statements as one command to the connection's own thread, answering
/// each statement's count of changed rows in order. A batch writes five or six tables;
/// sent one by one, each statement would cost a hand-off to that thread and back, and
/// on a busy machine every hand-off waits for a core. (sqlx marks several statements
/// in one query as deprecated for drivers other than SQLite; SQLite runs them in order
/// inside the one transaction, binding `$N` to the same parameter in each.)
async fn run_statements(
    connection: &mut SqliteConnection,
    query: sqlx::query::Query<'_, Sqlite, SqliteArguments>,
    expected: usize,
) -> Result<Vec<u64>, StoreError> {
    use futures_util::TryStreamExt as _;
    #[allow(deprecated)]
    let results: Vec<_> = query.fetch_many(&mut *connection).try_collect().await?;
    counts_of(results, expected)
}

/// Each statement's count of changed rows, in order, of at least `expected` statements.
fn counts_of(results: Vec<StatementResult>, expected: usize) -> Result<Vec<u64>, StoreError> {
    let counts: Vec<u64> = results
        .into_iter()
        .filter_map(|result| result.left().map(|done| done.rows_affected()))
        .collect();
    if counts.len() < expected {
        return Err(StoreError::Invariant(format!(
            "{expected} statements sent together answered {} counts",
            counts.len()
        )));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::writer::tests::DatabaseFile;
    use super::{SqliteBackend, rows};
    use crate::backend::{Backend as _, Dialect, Finish as _};
    use crate::error::StoreError;
    use crate::plan::StockKey;
    use domain::{SkuCode, WarehouseCode};
    use sqlx::{Connection as _, Row as _, SqliteConnection};

    /// Every awkward string a row can carry: quotes, backslashes, control characters,
    /// a NUL, markup, U+2028, emoji, nothing at all, and one longer than a two-byte
    /// size holds.
    fn awkward_strings() -> Vec<String> {
        vec![
            "key \"one\"".to_owned(),
            "{\"code\":\"insufficient_stock\",\"detail\":\"tab\t, quote \\\", 雪\"}".to_owned(),
            "back\\slash and \u{1} and \n and \u{0}".to_owned(),
            "</script>\u{2028}🍵".to_owned(),
            String::new(),
            "long ".repeat(14_000),
        ]
    }

    #[tokio::test]
    async fn sqlite_reads_the_rows_back_as_the_values_they_were_written_from() {
        let mut connection = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let strings = awkward_strings();
        let written: Vec<(&str, i64, Option<&str>)> = strings
            .iter()
            .zip([i64::MIN, -1, 0, 7, 1_700_000_000_000, i64::MAX])
            .enumerate()
            .map(|(position, (text, number))| {
                (
                    text.as_str(),
                    number,
                    (position % 2 == 0).then_some(text.as_str()),
                )
            })
            .collect();
        let found = sqlx::query(
            "SELECT value ->> 0, value ->> 1, typeof(value ->> 1), value ->> 2 \
             FROM jsonb_each($1) ORDER BY key",
        )
        .bind(rows(written.iter().copied()))
        .fetch_all(&mut connection)
        .await
        .unwrap();
        assert_eq!(found.len(), written.len());
        for (row, (text, number, maybe)) in found.iter().zip(&written) {
            assert_eq!(row.get::<String, _>(0), *text);
            assert_eq!(row.get::<i64, _>(1), *number);
            assert_eq!(row.get::<String, _>(2), "integer");
            assert_eq!(row.get::<Option<String>, _>(3).as_deref(), *maybe);
        }
    }

    #[tokio::test]
    async fn sqlite_renders_the_rows_as_the_json_serde_writes_for_them() {
        let mut connection = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let strings = awkward_strings();
        let cases = [
            (
                rows(
                    strings
                        .iter()
                        .map(|text| (text.as_str(), 42_usize, None::<&str>)),
                ),
                serde_json::to_value(
                    strings
                        .iter()
                        .map(|text| (text.as_str(), 42_usize, None::<&str>))
                        .collect::<Vec<_>>(),
                ),
            ),
            (
                rows(vec![vec!["a", "b"], vec![]]),
                serde_json::to_value([vec!["a", "b"], vec![]]),
            ),
            (
                rows(Vec::<(&str, i64)>::new()),
                serde_json::to_value(Vec::<(&str, i64)>::new()),
            ),
            (
                rows(["one", "t\"wo"]),
                serde_json::to_value(["one", "t\"wo"]),
            ),
            (
                rows([("shop", "user", 3_u16, 503_i64)]),
                serde_json::to_value([("shop", "user", 3_u16, 503_i64)]),
            ),
        ];
        for (blob, expected) in cases {
            let rendered: String = sqlx::query_scalar("SELECT json($1)")
                .bind(blob)
                .fetch_one(&mut connection)
                .await
                .unwrap();
            let rendered: serde_json::Value = serde_json::from_str(&rendered).unwrap();
            assert_eq!(rendered, expected.unwrap());
        }
    }

    /// The columns a batch's first read reads, with two records, two SKUs and three
    /// stock rows (`TEA` in `default` has 5).
    const BATCH_READ_TABLES: &str = "CREATE TABLE idempotency_record (key TEXT PRIMARY KEY, fingerprint TEXT, \
         status_code INTEGER, body TEXT); \
         CREATE TABLE sku (code TEXT PRIMARY KEY, sale_status TEXT, shop TEXT, per_user_limit INTEGER); \
         CREATE TABLE stock (sku TEXT, warehouse TEXT, available INTEGER, PRIMARY KEY (sku, warehouse)); \
         INSERT INTO idempotency_record VALUES ('k1', 'f1', 201, '{\"id\":\"rsv_1\"}'), ('k2', 'f2', 0, ''); \
         INSERT INTO sku VALUES ('TEA', 'ON_SHELF', 'shop-a', 2), ('COFFEE', 'OFF_SHELF', 'shop-b', NULL); \
         INSERT INTO stock VALUES ('TEA', 'default', 5), ('TEA', 'north', 0), ('COFFEE', 'default', 9);";

    fn stock_key(sku: &str, warehouse: &str) -> StockKey {
        (
            SkuCode::parse(sku).unwrap(),
            WarehouseCode::parse(warehouse).unwrap(),
        )
    }

    #[tokio::test]
    async fn records_and_stock_rows_read_with_begin_are_what_the_two_reads_answer_apart() {
        let file = DatabaseFile::new("begun-reading-cases");
        let backend = backend_with_a_batch_to_read(&file).await;
        let all_rows = vec![
            stock_key("COFFEE", "default"),
            stock_key("TEA", "default"),
            stock_key("TEA", "north"),
            stock_key("NONE", "default"),
        ];
        let cases: [(&[&str], Vec<_>); 5] = [
            (&["k1", "k2", "k3"], all_rows.clone()),
            (&["k3"], all_rows.clone()),
            (&["k1"], vec![]),
            (&[], vec![stock_key("TEA", "north")]),
            (&[], vec![]),
        ];
        for (keys, wanted) in cases {
            let (mut transaction, records_together, stock_together) =
                backend.begin_write_reading(keys, &wanted).await.unwrap();
            let records = transaction.existing_records(keys).await.unwrap();
            let stock = transaction.lock_stock_rows(&wanted).await.unwrap();
            transaction.rollback().await.unwrap();
            assert_eq!(
                (records_together, stock_together),
                (records, stock),
                "keys {keys:?}, rows {wanted:?}"
            );
        }
        let (transaction, records, (available, facts)) = backend
            .begin_write_reading(&["k1", "k2"], &all_rows)
            .await
            .unwrap();
        transaction.rollback().await.unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records["k1"].1.as_ref().unwrap().status, 201);
        assert_eq!(records["k2"].1, None, "a record without an answer yet");
        assert_eq!(available.len(), 3);
        assert_eq!(available[&stock_key("TEA", "default")], 5);
        assert_eq!(
            facts[&SkuCode::parse("COFFEE").unwrap()].per_user_limit,
            None
        );
    }

    /// A backend on a file of its own holding [`BATCH_READ_TABLES`], whose writer waits
    /// 50 ms for another process's write lock.
    async fn backend_with_a_batch_to_read(file: &DatabaseFile) -> SqliteBackend {
        let mut config = crate::StoreConfig::new(file.url());
        config.lock_timeout_milliseconds = 50;
        let backend = SqliteBackend::connect(&config).await.unwrap();
        sqlx::raw_sql(BATCH_READ_TABLES)
            .execute(&mut *backend.write_connection().await.unwrap())
            .await
            .unwrap();
        backend
    }

    /// Another process's connection to `file`, waiting `busy` for the write lock.
    async fn other_process(file: &DatabaseFile, busy: Duration) -> SqliteConnection {
        SqliteConnection::connect_with(&file.options().busy_timeout(busy))
            .await
            .unwrap()
    }

    /// Nothing holds the write lock: the transaction before was committed.
    async fn assert_another_process_can_write_at_once(file: &DatabaseFile) {
        let mut other = other_process(file, Duration::ZERO).await;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    }

    async fn tea_available(connection: &mut SqliteConnection) -> i64 {
        sqlx::query_scalar(
            "SELECT available FROM stock WHERE sku = 'TEA' AND warehouse = 'default'",
        )
        .fetch_one(connection)
        .await
        .unwrap()
    }

    const TAKE_ONE_TEA: &str =
        "UPDATE stock SET available = available - 1 WHERE sku = 'TEA' AND warehouse = 'default'";

    /// A write begun with a batch's first read that has taken one TEA, not committed.
    async fn begun_taking_one_tea(backend: &SqliteBackend) -> super::writer::SqliteTransaction {
        let (mut transaction, _, _) = backend
            .begin_write_reading(&["k1"], &[stock_key("TEA", "default")])
            .await
            .unwrap();
        sqlx::query(TAKE_ONE_TEA)
            .execute(&mut *transaction)
            .await
            .unwrap();
        transaction
    }

    #[tokio::test]
    async fn a_write_begun_with_its_first_read_reads_its_keys_and_rows_and_holds_the_write_lock() {
        let file = DatabaseFile::new("begun-reading");
        let backend = backend_with_a_batch_to_read(&file).await;
        let wanted = [stock_key("TEA", "default"), stock_key("NONE", "default")];
        let (mut transaction, records, stock) = backend
            .begin_write_reading(&["k1", "k3"], &wanted)
            .await
            .unwrap();
        assert_eq!(records.len(), 1);
        assert_eq!(stock.0[&stock_key("TEA", "default")], 5);
        // Another process cannot begin to write while the transaction is open.
        let mut other = other_process(&file, Duration::ZERO).await;
        let refused = sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await;
        assert!(refused.is_err(), "the write lock was not held: {refused:?}");
        sqlx::query(TAKE_ONE_TEA)
            .execute(&mut *transaction)
            .await
            .unwrap();
        transaction.commit().await.unwrap();
        assert_eq!(tea_available(&mut other).await, 4);
    }

    #[tokio::test]
    async fn a_write_begun_with_its_first_read_and_dropped_before_its_end_leaves_nothing_and_frees_the_lock()
     {
        let file = DatabaseFile::new("begun-reading-dropped");
        let backend = backend_with_a_batch_to_read(&file).await;
        let transaction = begun_taking_one_tea(&backend).await;
        drop(transaction);
        // Nobody takes the writer again: another process gets the write lock within
        // its busy timeout only if the dropped transaction was rolled back.
        let mut other = other_process(&file, Duration::from_secs(5)).await;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        assert_eq!(tea_available(&mut other).await, 5);
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    }

    #[tokio::test]
    async fn a_write_that_cannot_begin_for_another_process_lock_fails_and_leaves_the_writer_usable()
    {
        let file = DatabaseFile::new("begun-reading-busy");
        let backend = backend_with_a_batch_to_read(&file).await;
        let mut other = other_process(&file, Duration::ZERO).await;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        let refused = backend
            .begin_write_reading(&["k1"], &[stock_key("TEA", "default")])
            .await;
        assert!(
            matches!(refused, Err(StoreError::LockTimeout(_))),
            "{:?}",
            refused.map(|_| ())
        );
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
        let transaction = begun_taking_one_tea(&backend).await;
        transaction.commit().await.unwrap();
        assert_eq!(tea_available(&mut other).await, 4);
    }

    /// A migrated backend on a file of its own with `TEA` in `default`: 5 available.
    async fn migrated_backend(file: &DatabaseFile) -> SqliteBackend {
        let backend = SqliteBackend::connect(&crate::StoreConfig::new(file.url()))
            .await
            .unwrap();
        crate::units::Units::new(backend.clone())
            .migrate()
            .await
            .unwrap();
        sqlx::raw_sql(
            "INSERT INTO sku (code, created_at, updated_at) VALUES ('TEA', 0, 0); \
             INSERT INTO stock (sku, warehouse, available, reserved, version, updated_at) \
             VALUES ('TEA', 'default', 5, 0, 1, 0); \
             INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
             VALUES ('committed', 'f', 201, '{}', 0);",
        )
        .execute(&mut *backend.write_connection().await.unwrap())
        .await
        .unwrap();
        backend
    }

    /// What a batch wrote: TEA's available count, reservations, ledger rows, events and
    /// idempotency records.
    async fn written(backend: &SqliteBackend) -> (i64, i64, i64, i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT available FROM stock WHERE sku = 'TEA'), \
             (SELECT COUNT(*) FROM reservation), (SELECT COUNT(*) FROM stock_ledger), \
             (SELECT COUNT(*) FROM outbox), (SELECT COUNT(*) FROM idempotency_record)",
        )
        .fetch_one(&mut *backend.writer_read_connection().await.unwrap())
        .await
        .unwrap()
    }

    /// Writes and commits one reservation of `quantity` TEA under `key` on the writer,
    /// with the stock rows' totals `totals`.
    async fn write_one_and_commit(
        backend: &SqliteBackend,
        key: &str,
        quantity: i64,
        totals: &BTreeMap<StockKey, i64>,
    ) -> Result<(), StoreError> {
        let now = domain::Timestamp::from_unix_milliseconds(1_700_000_000_000);
        let id = domain::ReservationId::generate(now, 7);
        let shop = domain::ShopCode::default_shop();
        let lines = [domain::ReservationLine {
            sku: SkuCode::parse("TEA").unwrap(),
            warehouse: WarehouseCode::parse("default").unwrap(),
            quantity: domain::Quantity::new(quantity).unwrap(),
        }];
        let reservation = crate::backend::NewReservation {
            id: &id,
            expires_at: now.plus_seconds(900),
            request_key: Some(key),
            ledger_key: key,
            shop: &shop,
            user: None,
            order: None,
            lines: &lines,
        };
        let claim = crate::model::IdempotencyClaim {
            key: crate::model::ScopedKey::new(
                &domain::Principal::Admin,
                &domain::IdempotencyKey::parse(key).unwrap(),
            ),
            fingerprint: "f".into(),
        };
        let response = crate::model::StoredResponse {
            status: 201,
            body: "{}".into(),
        };
        let transaction = backend.begin_write().await?;
        backend
            .write_batch_and_commit(
                transaction,
                totals,
                &[reservation],
                &[(&claim, &response)],
                now,
            )
            .await
    }

    #[tokio::test]
    async fn a_batch_written_as_planned_is_committed_with_its_writes() {
        let file = DatabaseFile::new("write-and-commit");
        let backend = migrated_backend(&file).await;
        let totals = BTreeMap::from([(stock_key("TEA", "default"), 2)]);
        write_one_and_commit(&backend, "k1", 2, &totals)
            .await
            .unwrap();
        assert_eq!(written(&backend).await, (3, 1, 1, 1, 2));
        assert_another_process_can_write_at_once(&file).await;
    }

    #[tokio::test]
    async fn a_batch_that_takes_fewer_stock_rows_than_planned_fails_before_its_commit_and_leaves_nothing()
     {
        let file = DatabaseFile::new("write-short-stock");
        let backend = migrated_backend(&file).await;
        // Six of five: the conditional update takes nothing from the row.
        let totals = BTreeMap::from([(stock_key("TEA", "default"), 6)]);
        let refused = write_one_and_commit(&backend, "k1", 6, &totals).await;
        assert!(
            matches!(refused, Err(StoreError::Invariant(_))),
            "{refused:?}"
        );
        assert_eq!(written(&backend).await, (5, 0, 0, 0, 1));
        // The writer writes again, and the next batch is whole.
        let totals = BTreeMap::from([(stock_key("TEA", "default"), 1)]);
        write_one_and_commit(&backend, "k2", 1, &totals)
            .await
            .unwrap();
        assert_eq!(written(&backend).await, (4, 1, 1, 1, 2));
    }

    #[tokio::test]
    async fn a_batch_that_stores_fewer_records_than_planned_fails_before_its_commit_and_leaves_nothing()
     {
        let file = DatabaseFile::new("write-short-records");
        let backend = migrated_backend(&file).await;
        let totals = BTreeMap::from([(stock_key("TEA", "default"), 1)]);
        // Committed already (by another process, say): the insert stores nothing.
        let key = crate::model::ScopedKey::new(
            &domain::Principal::Admin,
            &domain::IdempotencyKey::parse("k1").unwrap(),
        );
        sqlx::query("UPDATE idempotency_record SET key = $1 WHERE key = 'committed'")
            .bind(key.as_str())
            .execute(&mut *backend.write_connection().await.unwrap())
            .await
            .unwrap();
        let refused = write_one_and_commit(&backend, "k1", 1, &totals).await;
        assert!(
            matches!(refused, Err(StoreError::Invariant(_))),
            "{refused:?}"
        );
        assert_eq!(written(&backend).await, (5, 0, 0, 0, 1));
    }
    /// Three committed events without a position.
    async fn with_three_waiting_events(backend: &SqliteBackend) {
        sqlx::raw_sql(
            "INSERT INTO outbox (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at) \
             VALUES ('reservation', 'rsv_a', 1, 'reservation.created', 'default', NULL, 0), \
             ('reservation', 'rsv_b', 1, 'reservation.created', 'default', NULL, 0), \
             ('reservation', 'rsv_c', 1, 'reservation.created', 'default', NULL, 0);",
        )
        .execute(&mut *backend.write_connection().await.unwrap())
        .await
        .unwrap();
    }

    /// The events' positions in `id` order, and the sequencer's last position.
    async fn positions(backend: &SqliteBackend) -> (Vec<Option<i64>>, Option<i64>) {
        let mut connection = backend.writer_read_connection().await.unwrap();
        let positions = sqlx::query_scalar("SELECT position FROM outbox ORDER BY id")
            .fetch_all(&mut *connection)
            .await
            .unwrap();
        let last = sqlx::query_scalar(
            "SELECT through_position FROM outbox_relay WHERE name = 'sequencer'",
        )
        .fetch_optional(&mut *connection)
        .await
        .unwrap();
        (positions, last)
    }

    #[tokio::test]
    async fn a_sequencer_step_numbers_waiting_events_in_write_order_after_the_last_position() {
        let file = DatabaseFile::new("sequence");
        let backend = migrated_backend(&file).await;
        with_three_waiting_events(&backend).await;
        assert_eq!(backend.sequence_waiting_events(2).await.unwrap(), 2);
        assert_eq!(
            positions(&backend).await,
            (vec![Some(1), Some(2), None], Some(2))
        );
        assert_eq!(backend.sequence_waiting_events(2).await.unwrap(), 1);
        assert_eq!(
            positions(&backend).await,
            (vec![Some(1), Some(2), Some(3)], Some(3))
        );
        assert_another_process_can_write_at_once(&file).await;
    }

    #[tokio::test]
    async fn a_sequencer_step_without_its_row_fails_before_its_commit_and_numbers_nothing() {
        let file = DatabaseFile::new("sequence-without-row");
        let backend = migrated_backend(&file).await;
        with_three_waiting_events(&backend).await;
        sqlx::query("DELETE FROM outbox_relay WHERE name = 'sequencer'")
            .execute(&mut *backend.write_connection().await.unwrap())
            .await
            .unwrap();
        let refused = backend.sequence_waiting_events(2).await;
        assert!(
            matches!(refused, Err(StoreError::Invariant(_))),
            "{refused:?}"
        );
        assert_eq!(positions(&backend).await, (vec![None, None, None], None));
    }

    #[tokio::test]
    async fn the_wal_is_copied_beside_the_writer_which_checkpoints_itself_only_past_its_bound() {
        let file = DatabaseFile::new("checkpointed-beside-writer");
        let backend = migrated_backend(&file).await;
        let mut writer = backend.write_connection().await.unwrap();
        let (bound,): (i64,) = sqlx::query_as("PRAGMA wal_autocheckpoint")
            .fetch_one(&mut *writer)
            .await
            .unwrap();
        let (pages, page_size): (i64, i64) =
            sqlx::query_as("SELECT * FROM pragma_page_count, pragma_page_size")
                .fetch_one(&mut *writer)
                .await
                .unwrap();
        drop(writer);
        assert_eq!(
            bound,
            i64::from(super::checkpointer::WRITER_AUTOCHECKPOINT_PAGES)
        );

        // The migrations' pages, far fewer than the writer's bound, reach the database
        // file only through the backend's checkpointer.
        let database_length = || std::fs::metadata(file.path()).unwrap().len();
        let copied = backend
            .checkpointer
            .wait_for_step(|| database_length() >= u64::try_from(pages * page_size).unwrap())
            .await;
        assert!(
            copied,
            "the database file holds {} of {} bytes",
            database_length(),
            pages * page_size
        );
        backend.close().await;
    }
}

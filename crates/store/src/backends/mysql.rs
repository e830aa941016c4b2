//! MySQL 8 and MariaDB ≥ 10.6: the shops' usual database (seed 003 measures on MySQL).
//!
//! What this backend does differently, all in this file:
//!
//! - **Placeholders.** The units of work write `$1`, `$2`, …; MySQL binds `?` by
//!   position. [`translate`] rewrites each statement once (cached by its text) and
//!   binds the values in the order the `?`s appear, repeating a value a statement
//!   names twice. It also spells what MySQL spells otherwise: `CAST(… AS SIGNED)` for
//!   `CAST(… AS BIGINT)`, and the column `key` (a reserved word) quoted.
//! - **Upserts.** `INSERT … ON CONFLICT (…) DO NOTHING` runs as a plain `INSERT` whose
//!   duplicate-key error (1062, which rolls back the statement, not the transaction)
//!   means "nothing written". The guarded upserts (`ON CONFLICT … DO UPDATE … WHERE`),
//!   which MySQL cannot express with a trustworthy row count, are a conditional
//!   `UPDATE` and then an `INSERT` ([`Dialect`] methods below).
//! - **Row counts.** sqlx sets `CLIENT_FOUND_ROWS`: an `UPDATE` reports the rows it
//!   matched, not the rows it changed. Every conditional update of the units of work
//!   changes a column (`version = version + 1`, a counter by a non-zero amount), so
//!   matched and changed agree and the affected-row checks hold.
//! - **No `UPDATE … RETURNING`** (MariaDB has it for `INSERT` and `DELETE` only): a
//!   stock change reads its counters back with a `SELECT` under the row lock it holds.
//! - **Isolation.** Every session runs `READ COMMITTED`, as PostgreSQL does by default:
//!   each statement sees what committed before it, and InnoDB takes no gap locks. The
//!   audit reads one consistent snapshot (`REPEATABLE READ`, `WITH CONSISTENT SNAPSHOT`).
//! - **Locks and timeouts.** `innodb_lock_wait_timeout` is set per session from the
//!   store's lock bound (whole seconds, rounded up); `max_statement_time` (MariaDB) or
//!   `max_execution_time` (MySQL) from the statement bound. Deadlock 1213 (which rolls
//!   back the whole transaction) is retried as a whole unit of work, like PostgreSQL's
//!   40P01; lock wait timeout 1205 is a lock timeout, like 55P03. Workers claim rows
//!   with `FOR UPDATE SKIP LOCKED`. A shop's shelf batches serialize on a row of
//!   `shelf_batch_lock` (MySQL has no transaction-scoped advisory lock).
//! - **Batches** travel as multi-row `VALUES` lists, a few statements per batch; there
//!   is no whole-batch fast path (no stored procedure).
//! - **Migrations** are not serialized across processes (DDL commits by itself on
//!   MySQL): run `stockd migrate` once before starting several instances.
//!
//! Durability is the server's: run it with `innodb_flush_log_at_trx_commit=1` and, with
//! a binary log, `sync_binlog=1` (docs/OPERATIONS.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use domain::{ShopCode, SkuCode, Timestamp};
use futures_util::stream::BoxStream;
use futures_util::{StreamExt, TryStreamExt};
use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, MySqlPool, Row as _, TypeInfo, ValueRef};

use crate::backend::{Backend, Dialect, FoundRecords, LockedStock, Migration, NewReservation};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, StoredResponse};
use crate::plan::{BatchWritten, PurchaseKey, ShopperKey, SkuFacts, StockKey};
use crate::sql::{
    Cell, Connection, Row, Statement, Text, Value, built_statement, rows_of, statement, stream_of,
};
use crate::units::decode::{
    SkuFactsRow, TallyKey, sku_facts_of, stock_key_of, stored_response, tallies_of,
};
use crate::{StoreConfig, StoreLimits};

/// Rows one multi-row `INSERT` of a batch carries at most, so a statement's
/// placeholders stay far below MySQL's limit of 65,535.
const BATCH_INSERT_ROWS_MAX: usize = 500;

/// Placeholders one statement of a row of placeholders per key takes at most: MySQL
/// refuses a statement with more than 65,535 (error 1390), and a batch's keys are
/// bounded only by its requests times their lines (10,000 × 50 shoppers' units). Past
/// it the keys go in chunks, in their order, so locks are still taken in key order.
const PLACEHOLDERS_PER_STATEMENT_MAX: usize = 60_000;

/// Keys of `width` placeholders each that one statement takes, with `extra` more.
fn keys_per_statement(width: usize, extra: usize) -> usize {
    ((PLACEHOLDERS_PER_STATEMENT_MAX - extra) / width.max(1)).max(1)
}

/// The MySQL or MariaDB database: one pool, shared by every unit of work.
#[derive(Debug, Clone)]
pub struct MysqlBackend {
    pool: MySqlPool,
    limits: StoreLimits,
    watch: crate::backend::PoolWatch,
    /// MariaDB names the statement bound `max_statement_time`, MySQL
    /// `max_execution_time` (which bounds only reads).
    mariadb: bool,
}

/// The session settings every connection starts with.
fn session_settings(config: &StoreConfig, mariadb: bool) -> Vec<String> {
    let lock_wait_seconds = config.lock_timeout_milliseconds.div_ceil(1_000).max(1);
    vec![
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
        format!("SET SESSION innodb_lock_wait_timeout = {lock_wait_seconds}"),
        statement_bound(mariadb, config.statement_timeout_milliseconds),
    ]
}

/// The session's statement bound, 0 for none: named `max_statement_time` (seconds) on
/// MariaDB, `max_execution_time` (milliseconds, reads only) on MySQL.
fn statement_bound(mariadb: bool, milliseconds: u64) -> String {
    if mariadb {
        format!(
            "SET SESSION max_statement_time = {}",
            milliseconds as f64 / 1_000.0
        )
    } else {
        format!("SET SESSION max_execution_time = {milliseconds}")
    }
}

impl MysqlBackend {
    pub async fn connect(config: &StoreConfig) -> Result<MysqlBackend, StoreError> {
        let options = MySqlConnectOptions::from_str(&config.database_url)
            .map_err(|error| StoreError::Unavailable(error.to_string()))?
            .charset("utf8mb4")
            .collation("utf8mb4_bin");
        // One connection first, to learn which server this is (the statement bound
        // has a different name on MariaDB and on MySQL). Outside the pool, so bounded
        // here as the pool bounds its own: a server that takes the connection and
        // never speaks would hold the start for good.
        let bound = Duration::from_millis(config.acquire_timeout_milliseconds);
        let probing = async {
            let mut probe = sqlx::ConnectOptions::connect(&options).await?;
            let version: String = sqlx::query_scalar("SELECT VERSION()")
                .fetch_one(&mut probe)
                .await?;
            let _ = sqlx::Connection::close(probe).await;
            Ok::<String, sqlx::Error>(version)
        };
        let version = tokio::time::timeout(bound, probing)
            .await
            .map_err(|_| StoreError::Unavailable(format!("no answer within {bound:?}")))??;
        let mariadb = version.contains("MariaDB");
        let settings = Arc::new(session_settings(config, mariadb));
        let pool = crate::backend::pool_options()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(Duration::from_millis(config.acquire_timeout_milliseconds))
            .after_connect(move |connection, _| {
                let settings = Arc::clone(&settings);
                Box::pin(async move {
                    for setting in settings.iter() {
                        sqlx::raw_sql(sqlx::AssertSqlSafe(setting.clone()))
                            .execute(&mut *connection)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await?;
        Ok(MysqlBackend {
            watch: crate::backend::PoolWatch::default(),
            pool,
            limits: config.limits,
            mariadb,
        })
    }
}

impl Backend for MysqlBackend {
    type Connection = MySqlConnection;
    type Transaction = sqlx::Transaction<'static, MySql>;
    type Pooled = PoolConnection<MySql>;

    crate::backend::one_pool_backend_methods!();

    /// Measured and not kept (docs/BENCHMARKS.md, twentieth session): with a pool of
    /// its own on a thread of its own, the combiner's row-locking statements on
    /// MariaDB waited about 40 ms in every flash-sale batch, against about 1.5 ms
    /// sharing the pool, for a reason not yet found.
    fn with_own_pool(&self, _connections: u32) -> Option<Self> {
        None
    }

    const NAME: &'static str = "mysql";

    /// Without the session's statement bound: MariaDB's `max_statement_time` applies
    /// to DDL too, and killed at 30 s a migration rewriting a large table would stop
    /// half applied (DDL commits by itself), at every start. The connection is closed
    /// when the migrations are done, so the unbounded session never serves a request.
    async fn migration_connection(&self) -> Result<Self::Pooled, StoreError> {
        let mut connection = self.watch.acquiring(self.pool.acquire()).await?;
        connection.close_on_drop();
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement_bound(self.mariadb, 0)))
            .execute(&mut *connection)
            .await?;
        Ok(connection)
    }

    /// The audit compares several tables, so it reads them from one snapshot. `SET
    /// TRANSACTION` applies to the next transaction of the session only.
    async fn begin_snapshot(&self) -> Result<Self::Transaction, StoreError> {
        Ok(self
            .pool
            .begin_with(
                "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; \
                 START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY",
            )
            .await?)
    }
}

crate::backend::finish_through_sqlx!(MySql);

/// Deadlock: InnoDB rolled the whole transaction back.
const ER_LOCK_DEADLOCK: u16 = 1213;
/// `innodb_lock_wait_timeout` passed.
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// A locking read found a row changed since the snapshot (MariaDB's snapshot check).
const ER_CHECKREAD: u16 = 1020;
/// `max_statement_time` (MariaDB) or `max_execution_time` (MySQL) passed.
const ER_STATEMENT_TIMEOUT: u16 = 1969;
const ER_QUERY_TIMEOUT: u16 = 3024;
const ER_TOO_MANY_CONNECTIONS: u16 = 1040;
/// The server is read-only (`--read-only`, `super_read_only`): a demoted primary, a
/// switchover under way. As PostgreSQL's 25006, it is the writer changing: 503.
const ER_OPTION_PREVENTS_STATEMENT: u16 = 1290;
const ER_READ_ONLY_MODE: u16 = 1836;
/// The server is shutting down, or ended this session or statement (a proxy or an
/// operator moving sessions off it).
const ER_SERVER_SHUTDOWN: u16 = 1053;
const ER_QUERY_INTERRUPTED: u16 = 1317;
const ER_CONNECTION_KILLED: u16 = 1927;
/// The server ran out of disk or memory: its state for a while, not the request's
/// rows (as PostgreSQL's 53100 and 53200). Not a table at its size limit (1114), a
/// lock table or sort buffer too small for the statement (1206, 1038): those come
/// back at every retry.
const ER_DISK_FULL: u16 = 1021;
const ER_OUTOFMEMORY: u16 = 1037;
const ER_OUT_OF_RESOURCES: u16 = 1041;
/// A unique key refused a row.
const ER_DUP_ENTRY: u16 = 1062;

/// The order expiry's claim of the orders in `$status` (see
/// `Dialect::CLAIM_EXPIRED_ORDERS` for MySQL: one statement a status).
macro_rules! claim_expired_orders_of {
    ($status:literal) => {
        concat!(
            "SELECT customer_order.id, customer_order.expires_at FROM customer_order \
             JOIN reservation ON reservation.id = customer_order.reservation_id \
             WHERE customer_order.status = '",
            $status,
            "' AND customer_order.expires_at <= $1 \
             AND reservation.status = 'RESERVED' \
             AND customer_order.expires_at >= $3 AND (customer_order.expires_at > $3 OR customer_order.id > $4) \
             ORDER BY customer_order.expires_at, customer_order.id LIMIT $2 FOR UPDATE SKIP LOCKED"
        )
    };
}

/// MySQL's errors by error number.
pub(crate) fn classify_database(error: &sqlx::mysql::MySqlDatabaseError) -> StoreError {
    let message = error.message().to_owned();
    match error.number() {
        ER_LOCK_DEADLOCK => StoreError::Deadlock(message),
        ER_CHECKREAD => StoreError::Retryable(message),
        ER_LOCK_WAIT_TIMEOUT => StoreError::LockTimeout(message),
        ER_STATEMENT_TIMEOUT
        | ER_QUERY_TIMEOUT
        | ER_TOO_MANY_CONNECTIONS
        | ER_OPTION_PREVENTS_STATEMENT
        | ER_READ_ONLY_MODE
        | ER_SERVER_SHUTDOWN
        | ER_QUERY_INTERRUPTED
        | ER_CONNECTION_KILLED
        | ER_DISK_FULL
        | ER_OUTOFMEMORY
        | ER_OUT_OF_RESOURCES => StoreError::Unavailable(message),
        number => StoreError::Database(format!("{message} (error {number})")),
    }
}

fn is_duplicate_key(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database)
        if database
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|error| error.number() == ER_DUP_ENTRY))
}

/// A statement in MySQL's spelling.
#[derive(Debug)]
struct Translated {
    text: Arc<str>,
    /// For each `?` in order, the index of the value it binds.
    order: Vec<usize>,
    /// The statement was an `INSERT … ON CONFLICT … DO NOTHING`: a duplicate key means
    /// nothing was written.
    duplicate_means_nothing: bool,
}

/// Rewrites a statement written for PostgreSQL's placeholders into MySQL's spelling.
fn translate(text: &str) -> Result<Translated, StoreError> {
    let (body, duplicate_means_nothing) = match text.find("ON CONFLICT") {
        None => (text, false),
        Some(start) if text.trim_end().ends_with("DO NOTHING") => (&text[..start], true),
        Some(_) => {
            return Err(StoreError::Database(format!(
                "an upsert without a MySQL spelling: {text}"
            )));
        }
    };
    let (text, order) = placeholders_and_words(&body.replace(" AS BIGINT)", " AS SIGNED)"))?;
    Ok(Translated {
        text: Arc::from(text),
        order,
        duplicate_means_nothing,
    })
}

/// `$N` to `?` (with the value index each `?` binds) and `key` to `` `key` ``, outside
/// string literals.
fn placeholders_and_words(body: &str) -> Result<(String, Vec<usize>), StoreError> {
    let mut out = String::with_capacity(body.len() + 8);
    let mut order = Vec::new();
    let characters: Vec<char> = body.chars().collect();
    let mut position = 0;
    let mut in_literal = false;
    while position < characters.len() {
        let character = characters[position];
        if in_literal {
            out.push(character);
            if character == '\'' {
                in_literal = false;
            }
            position += 1;
        } else if character == '\'' {
            in_literal = true;
            out.push(character);
            position += 1;
        } else if character == '$'
            && characters
                .get(position + 1)
                .is_some_and(char::is_ascii_digit)
        {
            let start = position + 1;
            let mut end = start;
            while characters.get(end).is_some_and(char::is_ascii_digit) {
                end += 1;
            }
            let number: String = characters[start..end].iter().collect();
            let number: usize = number
                .parse()
                .map_err(|_| StoreError::Database(format!("placeholder ${number}")))?;
            if number == 0 {
                return Err(StoreError::Database("placeholder $0".into()));
            }
            order.push(number - 1);
            out.push('?');
            position = end;
        } else if character.is_ascii_alphanumeric() || character == '_' {
            let start = position;
            while characters
                .get(position)
                .is_some_and(|next| next.is_ascii_alphanumeric() || *next == '_')
            {
                position += 1;
            }
            let word: String = characters[start..position].iter().collect();
            let qualified = start > 0 && characters[start - 1] == '.';
            if word == "key" && !qualified {
                out.push_str("`key`");
            } else {
                out.push_str(&word);
            }
        } else {
            out.push(character);
            position += 1;
        }
    }
    Ok((out, order))
}

/// Literal statements already translated, by their text's address and length.
type TranslationCache = Mutex<HashMap<(usize, usize), Arc<Translated>>>;

/// Each literal statement is translated once; its text's address names it.
fn translated(text: &Text) -> Result<Arc<Translated>, StoreError> {
    static CACHE: OnceLock<TranslationCache> = OnceLock::new();
    match text {
        Text::Built(text) => Ok(Arc::new(translate(text)?)),
        Text::Static(text) => {
            let name = (text.as_ptr() as usize, text.len());
            let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
            if let Some(found) = cache
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .get(&name)
            {
                return Ok(Arc::clone(found));
            }
            let fresh = Arc::new(translate(text)?);
            cache
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .insert(name, Arc::clone(&fresh));
            Ok(fresh)
        }
    }
}

/// An sqlx query in MySQL's spelling, and whether a duplicate key means "nothing
/// written" for it.
type MysqlQuery = (sqlx::query::Query<'static, MySql, MySqlArguments>, bool);

/// A statement as an sqlx query, with its values bound in `?` order.
fn query_of(statement: Statement<'_>) -> Result<MysqlQuery, StoreError> {
    let translated = translated(&statement.text)?;
    let mut query = sqlx::query(sqlx::AssertSqlSafe(Arc::clone(&translated.text)));
    for index in &translated.order {
        let value = statement.values.get(*index).ok_or_else(|| {
            StoreError::Database(format!("no value for placeholder ${}", index + 1))
        })?;
        query = match value {
            Value::Integer(value) => query.bind(*value),
            Value::Text(value) => query.bind(value.as_ref().map(|text| text.to_string())),
        };
    }
    Ok((query, translated.duplicate_means_nothing))
}

/// MySQL reports each column's type; sums arrive as `DECIMAL`, read as their text.
fn cell(row: &MySqlRow, position: usize) -> Result<Cell, StoreError> {
    let value = row.try_get_raw(position)?;
    if value.is_null() {
        return Ok(Cell::Null);
    }
    let kind = value.type_info().name().to_owned();
    match kind.as_str() {
        "BIGINT" | "INT" | "MEDIUMINT" | "SMALLINT" | "TINYINT" | "BOOLEAN" => {
            Ok(Cell::Integer(row.try_get::<i64, _>(position)?))
        }
        "BIGINT UNSIGNED" | "INT UNSIGNED" | "MEDIUMINT UNSIGNED" | "SMALLINT UNSIGNED"
        | "TINYINT UNSIGNED" => {
            let value: u64 = row.try_get(position)?;
            Ok(Cell::Integer(i64::try_from(value).map_err(|error| {
                StoreError::Database(format!("an unsigned column out of range: {error}"))
            })?))
        }
        "DECIMAL" => {
            let text: String = row.try_get_unchecked(position)?;
            let whole = text.split('.').next().unwrap_or_default();
            Ok(Cell::Integer(whole.parse().map_err(|error| {
                StoreError::Database(format!("a decimal column holds {text}: {error}"))
            })?))
        }
        "NULL" => Ok(Cell::Null),
        // Text columns with a binary collation (utf8mb4_bin) carry the BINARY flag, so
        // their type names say VARBINARY or BLOB; sqlx reads them as text by collation.
        _ => Ok(Cell::Text(row.try_get(position)?)),
    }
}

use crate::sql::Described;

impl Connection for MySqlConnection {
    async fn execute<'a>(&'a mut self, statement: Statement<'a>) -> Result<u64, StoreError> {
        let described = Described::of(&statement);
        let (query, duplicate_means_nothing) = query_of(statement)?;
        match described.run(query.execute(&mut *self)).await {
            Ok(result) => Ok(result.rows_affected()),
            Err(error) if duplicate_means_nothing && is_duplicate_key(&error) => Ok(0),
            Err(error) => Err(described.explain(error)),
        }
    }

    async fn fetch_all<'a>(&'a mut self, statement: Statement<'a>) -> Result<Vec<Row>, StoreError> {
        let described = Described::of(&statement);
        let (query, _) = query_of(statement)?;
        let found = described
            .run(query.fetch_all(&mut *self))
            .await
            .map_err(|error| described.explain(error))?;
        rows_of(found, cell)
    }

    async fn fetch_optional<'a>(
        &'a mut self,
        statement: Statement<'a>,
    ) -> Result<Option<Row>, StoreError> {
        let described = Described::of(&statement);
        let (query, _) = query_of(statement)?;
        let found = described
            .run(query.fetch_optional(&mut *self))
            .await
            .map_err(|error| described.explain(error))?;
        Ok(rows_of(found.into_iter().collect(), cell)?.pop())
    }

    fn fetch_stream<'a>(
        &'a mut self,
        statement: Statement<'a>,
    ) -> BoxStream<'a, Result<Row, StoreError>> {
        match query_of(statement) {
            Ok((query, _)) => {
                let rows = query.fetch(self).map_err(StoreError::from).boxed();
                stream_of(rows, cell)
            }
            Err(error) => futures_util::stream::once(async move { Err(error) }).boxed(),
        }
    }

    async fn execute_script(&mut self, script: &'static str) -> Result<(), StoreError> {
        sqlx::raw_sql(script).execute(&mut *self).await?;
        Ok(())
    }
}

/// `$1, $2, …, $count`.
fn list_of_placeholders(count: usize) -> String {
    (1..=count)
        .map(|number| format!("${number}"))
        .collect::<Vec<String>>()
        .join(", ")
}

/// Row locks (`FOR UPDATE`) order concurrent writers and `SKIP LOCKED` lets several
/// workers claim distinct rows (see the module's header for everything else).
impl Dialect for MySqlConnection {
    const SELECT_RESERVATION_FOR_UPDATE: &'static str = "SELECT status, order_id, shop, user_id, expires_at FROM reservation WHERE id = $1 FOR UPDATE";
    const CLAIM_EXPIRED_RESERVATIONS: &'static str = "SELECT id, expires_at FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL \
         AND expires_at >= $3 AND (expires_at > $3 OR id > $4) \
         ORDER BY expires_at, id LIMIT $2 \
         FOR UPDATE SKIP LOCKED";
    const AUDIT_RESERVATION_LINES: &'static str = "SELECT reservation.id, reservation.status, \
         line.sku, line.warehouse, line.quantity, \
         COALESCE(CAST(SUM(ledger.available_delta) AS SIGNED), 0), \
         COALESCE(CAST(SUM(ledger.reserved_delta) AS SIGNED), 0) \
         FROM reservation JOIN reservation_line line ON line.reservation_id = reservation.id \
         LEFT JOIN stock_ledger ledger ON ledger.reference = reservation.id \
         AND ledger.sku = line.sku AND ledger.warehouse = line.warehouse \
         GROUP BY reservation.id, reservation.status, line.sku, line.warehouse, line.quantity \
         ORDER BY reservation.id, line.sku, line.warehouse";
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
    /// `LOCK IN SHARE MODE`: MariaDB has no `FOR SHARE`.
    const SHARE_SKU_ROW: &'static str =
        "SELECT shop, sale_status FROM sku WHERE code = $1 LOCK IN SHARE MODE";
    /// Orders past their hold that still hold their stock: unpaid, or declined, one
    /// statement each. InnoDB keeps the lock of every row a locking read reads, and
    /// the two statuses cannot be read in `(expires_at, id)` order from one index: read
    /// together, sorted and then cut to the batch, every expired order was locked. Each
    /// status is read in order through `(status, expires_at)` up to the limit, so a
    /// step locks at most twice its batch. (MariaDB also locks what a derived table
    /// reads inside a locking read.) MariaDB has no `FOR UPDATE OF`: the joined
    /// reservation rows are locked too.
    const CLAIM_EXPIRED_ORDERS: &'static [&'static str] = &[
        claim_expired_orders_of!("PENDING_PAYMENT"),
        claim_expired_orders_of!("PAYMENT_FAILED"),
    ];
    const CLAIM_ATTEMPTS_TO_RECONCILE: &'static str = "SELECT id FROM payment_attempt \
         WHERE status = 'PROCESSING' AND reconcile_after <= $1 ORDER BY reconcile_after, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    const CLAIM_REFUNDS: &'static str = "SELECT id, order_id, attempt_id, gateway_key, amount_minor, currency, tries, gateway_refund_id FROM refund \
         WHERE status = 'PENDING' AND next_try_at <= $1 ORDER BY next_try_at, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    const VERSION_QUERY: &'static str = "SELECT VERSION()";
    /// InnoDB's transactions of the whole server (it has no per-database view).
    /// `trx_started` is in the server's system time zone (InnoDB formats it with
    /// `localtime_r`), while the driver sets this session's zone to UTC: the bound is
    /// compared in the system zone, or a server east of UTC would never count a long
    /// transaction and one west of it would count them all.
    const SESSIONS_WAITING_ON_LOCKS: Option<&'static str> =
        Some("SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'");
    const LONG_TRANSACTIONS: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM information_schema.innodb_trx \
         WHERE trx_mysql_thread_id <> CONNECTION_ID() \
         AND trx_started < CONVERT_TZ(NOW(6), @@session.time_zone, 'SYSTEM') \
             - INTERVAL ($1 * 1000) MICROSECOND",
    );
    /// Neither MySQL nor MariaDB counts scans per table without extra plugins
    /// (MariaDB's `userstat`); the plan tests stand in (docs/OPERATIONS.md).
    const STOCK_SEQUENTIAL_SCANS: Option<&'static str> = None;
    const STOCK_PAGES: Option<&'static str> = None;
    /// `SYSDATE(3)`, not `NOW(3)`: the instant the function runs, not the statement's
    /// start. `UNIX_TIMESTAMP` reads it in the session's zone, whatever that is.
    const DATABASE_CLOCK_UNIX_MILLISECONDS: Option<&'static str> =
        Some("SELECT CAST(FLOOR(UNIX_TIMESTAMP(SYSDATE(3)) * 1000) AS SIGNED)");
    /// See the module's header: DDL commits by itself, so a lock held by a migration's
    /// transaction would not serialize it. A named lock belongs to the session, and
    /// outlives the commits: instances started together migrate one after the other.
    const MIGRATION_LOCK: Option<&'static str> = None;
    const MIGRATION_SESSION_LOCK: Option<(&'static str, &'static str)> = Some((
        // MySQL refuses lock names past 64 characters, and a database's name may be
        // 64 long: a long one is hashed. A shorter one keeps the name earlier versions
        // lock, so an old and a new instance starting together still take turns.
        "SELECT GET_LOCK(CONCAT('stockd_migrate:', \
         IF(CHAR_LENGTH(DATABASE()) <= 49, DATABASE(), SHA1(DATABASE()))), 1)",
        "SELECT RELEASE_LOCK(CONCAT('stockd_migrate:', \
         IF(CHAR_LENGTH(DATABASE()) <= 49, DATABASE(), SHA1(DATABASE()))))",
    ));
    const MIGRATIONS: &'static [Migration] = &[
        (
            1,
            "schema",
            include_str!("../../migrations/mysql/0001_schema.sql"),
        ),
        (
            2,
            "outbox",
            include_str!("../../migrations/mysql/0002_outbox.sql"),
        ),
        (
            3,
            "live_audit",
            include_str!("../../migrations/mysql/0003_live_audit.sql"),
        ),
        (
            4,
            "order_references",
            include_str!("../../migrations/mysql/0004_order_references.sql"),
        ),
        (
            5,
            "campaigns",
            include_str!("../../migrations/mysql/0005_campaigns.sql"),
        ),
        (
            6,
            "attempt_request_key_alone",
            include_str!("../../migrations/mysql/0006_attempt_request_key_alone.sql"),
        ),
        (
            7,
            "schedule_series",
            include_str!("../../migrations/mysql/0007_schedule_series.sql"),
        ),
        (
            8,
            "refund_resolution",
            include_str!("../../migrations/mysql/0008_refund_resolution.sql"),
        ),
        (
            9,
            "shelf_log_sku",
            include_str!("../../migrations/mysql/0009_shelf_log_sku.sql"),
        ),
    ];
    /// MySQL cannot `LIMIT` a subquery of `IN`, but limits a `DELETE` itself.
    const PURGE_IDEMPOTENCY_RECORDS: &'static str =
        "DELETE FROM idempotency_record WHERE created_at < $1 ORDER BY created_at LIMIT $2";
    const WHOLE_BATCH_FAST_PATH: bool = false;

    /// InnoDB reads the rows an `UPDATE … JOIN` selects with shared locks, so the
    /// join would wait for a transaction that wrote an event and has not committed;
    /// a plain read skips it. The ids come from that read, and `FIELD` numbers each
    /// by its place in their list (one statement, a scan of at most `limit` ids a
    /// row, in the server's own code).
    async fn number_waiting_events(&mut self, last: i64, limit: i64) -> Result<u64, StoreError> {
        let ids: Vec<i64> =
            statement("SELECT id FROM outbox WHERE position IS NULL ORDER BY id LIMIT $1")
                .bind(limit)
                .fetch_all_scalar(&mut *self)
                .await?;
        if ids.is_empty() {
            return Ok(0);
        }
        let listed = (0..ids.len())
            .map(|index| format!("${}", index + 2))
            .collect::<Vec<_>>()
            .join(", ");
        let mut update = built_statement(format!(
            "UPDATE outbox SET position = $1 + FIELD(id, {listed}) \
             WHERE position IS NULL AND id IN ({listed})"
        ))
        .bind(last);
        for id in &ids {
            update = update.bind(*id);
        }
        let numbered = update.execute(&mut *self).await?;
        if numbered != ids.len() as u64 {
            return Err(StoreError::Invariant(format!(
                "the sequencer numbered {numbered} of {} rows it holds the lock for",
                ids.len()
            )));
        }
        Ok(numbered)
    }

    /// No `RETURNING` on an upsert: the counter is read back under the lock the
    /// upsert took.
    async fn next_event_sequence(
        &mut self,
        aggregate: &str,
        aggregate_id: &str,
    ) -> Result<i64, StoreError> {
        statement(
            "INSERT INTO outbox_sequence (aggregate, aggregate_id, last_sequence) VALUES ($1, $2, 1) \
             ON DUPLICATE KEY UPDATE last_sequence = last_sequence + 1",
        )
        .bind(aggregate)
        .bind(aggregate_id)
        .execute(&mut *self)
        .await?;
        statement(
            "SELECT last_sequence FROM outbox_sequence WHERE aggregate = $1 AND aggregate_id = $2",
        )
        .bind(aggregate)
        .bind(aggregate_id)
        .fetch_one_scalar(&mut *self)
        .await
    }

    /// Two statements for all the shoppers: the tallies that exist grow by one conditional `UPDATE … JOIN`,
    /// the ones that do not are created by one `INSERT … SELECT`. A tally the update
    /// refused is not inserted, and one another process inserted meanwhile makes the
    /// insert write nothing: either way fewer rows than keys, and the caller retries.
    async fn add_open_holds_of_all(
        &mut self,
        added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
    ) -> Result<u64, StoreError> {
        let added: Vec<(&ShopperKey, &i64)> = added.iter().collect();
        let mut written = 0;
        for chunk in added.chunks(keys_per_statement(3, 1)) {
            written += add_open_holds_of(self, chunk, open_holds_max).await?;
        }
        Ok(written)
    }

    /// Two statements for all the keys, as [`Self::add_open_holds_of_all`] does, each
    /// under the bounds of [`Dialect::add_purchases_of_all`].
    async fn add_purchases_of_all(
        &mut self,
        added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> Result<u64, StoreError> {
        let added: Vec<(&PurchaseKey, &i64)> = added.iter().collect();
        let mut written = 0;
        for chunk in added.chunks(keys_per_statement(4, 1)) {
            written += add_purchases_of(self, chunk, quantity_max).await?;
        }
        Ok(written)
    }

    async fn receive_stock(
        &mut self,
        sku: &str,
        warehouse: &str,
        received: i64,
        now: Timestamp,
        on_hand_max: i64,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        // MySQL has no conditional upsert whose row count says which way it went: add
        // to the row, else create it. A receipt that found no row can meet the one a
        // concurrent receipt just created (its insert waits for that commit, then
        // inserts nothing); the row is there now, so it adds to it. Only a row that is
        // there and would pass the bound is a refusal.
        if add_received(self, sku, warehouse, received, now, on_hand_max).await? == 0 {
            if received > on_hand_max {
                return Ok(None);
            }
            let inserted = statement(
                "INSERT INTO stock (sku, warehouse, available, reserved, version, updated_at) \
                 VALUES ($1, $2, $3, 0, 1, $4) ON CONFLICT (sku, warehouse) DO NOTHING",
            )
            .bind(sku)
            .bind(warehouse)
            .bind(received)
            .bind(now.unix_milliseconds())
            .execute(&mut *self)
            .await?;
            if inserted == 0
                && add_received(self, sku, warehouse, received, now, on_hand_max).await? == 0
            {
                return Ok(None);
            }
        }
        counters_of(self, sku, warehouse).await.map(Some)
    }

    async fn adjust_stock(
        &mut self,
        sku: &str,
        warehouse: &str,
        delta: i64,
        now: Timestamp,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let updated = statement(
            "UPDATE stock SET available = available + $3, version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2 AND available + $3 >= 0",
        )
        .bind(sku)
        .bind(warehouse)
        .bind(delta)
        .bind(now.unix_milliseconds())
        .execute(&mut *self)
        .await?;
        if updated == 0 {
            return Ok(None);
        }
        counters_of(self, sku, warehouse).await.map(Some)
    }

    async fn put_cart_item(
        &mut self,
        user: &str,
        sku: &str,
        shop: &str,
        quantity: i64,
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        statement(
            "INSERT INTO cart_item (user_id, sku, shop, quantity, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $5) \
             ON DUPLICATE KEY UPDATE quantity = VALUES(quantity), updated_at = VALUES(updated_at)",
        )
        .bind(user)
        .bind(sku)
        .bind(shop)
        .bind(quantity)
        .bind(now.unix_milliseconds())
        .execute(self)
        .await
    }

    /// The shop's row of `shelf_batch_lock`, created on first use, stays locked until
    /// the commit: the update always changes it, so the lock is exclusive.
    async fn lock_shop(&mut self, shop: &ShopCode) -> Result<(), StoreError> {
        statement(
            "INSERT INTO shelf_batch_lock (shop, batches) VALUES ($1, 1) \
             ON DUPLICATE KEY UPDATE batches = batches + 1",
        )
        .bind(shop.as_str())
        .execute(self)
        .await?;
        Ok(())
    }

    /// The shops' lock table's row of the empty code, which no shop has.
    async fn lock_shelf_log(&mut self) -> Result<(), StoreError> {
        statement(
            "INSERT INTO shelf_batch_lock (shop, batches) VALUES ('', 1) \
             ON DUPLICATE KEY UPDATE batches = batches + 1",
        )
        .execute(self)
        .await?;
        Ok(())
    }

    /// Locks every stock row of these SKUs in primary-key order, which is the global
    /// (sku, warehouse) byte order under `utf8mb4_bin`.
    async fn lock_stock_of_skus(&mut self, skus: &[&SkuCode]) -> Result<(), StoreError> {
        if skus.is_empty() {
            return Ok(());
        }
        let mut locking = built_statement(format!(
            "SELECT 1 FROM stock FORCE INDEX (PRIMARY) WHERE sku IN ({}) ORDER BY sku, warehouse FOR UPDATE",
            list_of_placeholders(skus.len())
        ));
        for sku in skus {
            locking = locking.bind(sku.as_str());
        }
        locking.fetch_all_rows(self).await?;
        Ok(())
    }

    async fn existing_records(&mut self, keys: &[&str]) -> Result<FoundRecords, StoreError> {
        let mut records = HashMap::with_capacity(keys.len());
        if keys.is_empty() {
            return Ok(records);
        }
        let mut lookup = built_statement(format!(
            "SELECT key, fingerprint, status_code, body FROM idempotency_record WHERE key IN ({})",
            list_of_placeholders(keys.len())
        ));
        for key in keys {
            lookup = lookup.bind(*key);
        }
        for row in lookup.fetch_all_rows(self).await? {
            let response = stored_response(row.try_get("status_code")?, row.try_get("body")?)?;
            records.insert(row.try_get("key")?, (row.try_get("fingerprint")?, response));
        }
        Ok(records)
    }

    /// Locks the rows in primary-key order, then reads their SKUs' facts.
    ///
    /// The rows alone are locked, through the primary key whatever the table's size:
    /// on a small table MariaDB's optimizer scans instead, and a scan's `FOR UPDATE`
    /// waits for (and locks) every row it passes, so a batch of one SKU waited for a
    /// batch of another. MariaDB has no `FOR UPDATE OF`: a join would lock the SKUs'
    /// rows too, exclusively, and a campaign's buckets (rows of one SKU) would commit
    /// one after another instead of side by side. The facts are a second, plain read:
    /// it starts after the stock locks are granted, and every writer of a SKU's status
    /// or limit takes its stock rows first, so READ COMMITTED reads them as they are.
    async fn lock_stock_rows(&mut self, wanted: &[StockKey]) -> Result<LockedStock, StoreError> {
        if wanted.is_empty() {
            return Ok((BTreeMap::new(), HashMap::new()));
        }
        let mut available = BTreeMap::new();
        // `wanted` is in key order: chunk after chunk, the locks still are.
        for chunk in wanted.chunks(keys_per_statement(2, 0)) {
            let mut locking = built_statement(format!(
                "SELECT sku, warehouse, available FROM stock FORCE INDEX (PRIMARY) \
                 WHERE (sku, warehouse) IN ({}) ORDER BY sku, warehouse FOR UPDATE",
                rows_from_template(chunk.len(), "(?, ?)")
            ));
            for (sku, warehouse) in chunk {
                locking = locking.bind(sku.as_str()).bind(warehouse.as_str());
            }
            let found: Vec<(String, String, i64)> = locking.fetch_all_as(&mut *self).await?;
            for (sku, warehouse, count) in found {
                available.insert(stock_key_of(&sku, &warehouse)?, count);
            }
        }
        let skus: BTreeSet<&SkuCode> = available.keys().map(|(sku, _)| sku).collect();
        let skus: Vec<&SkuCode> = skus.into_iter().collect();
        let facts = self.sku_facts(&skus).await?;
        Ok((available, facts))
    }

    /// All the shoppers' tallies in one statement, locked in primary-key order like
    /// [`Dialect::lock_stock_rows`].
    async fn lock_open_holds(
        &mut self,
        shoppers: &[ShopperKey],
    ) -> Result<HashMap<ShopperKey, i64>, StoreError> {
        lock_tallies(
            self,
            "SELECT shop, user_id, open_holds FROM shopper_hold FORCE INDEX (PRIMARY) \
             WHERE (shop, user_id) IN ({keys}) ORDER BY shop, user_id FOR UPDATE",
            shoppers,
        )
        .await
    }

    /// All the shoppers' units of limited SKUs in one statement, locked in
    /// primary-key order.
    async fn lock_purchases(
        &mut self,
        purchases: &[PurchaseKey],
    ) -> Result<HashMap<PurchaseKey, i64>, StoreError> {
        lock_tallies(
            self,
            "SELECT shop, user_id, sku, quantity FROM shopper_purchase FORCE INDEX (PRIMARY) \
             WHERE (shop, user_id, sku) IN ({keys}) ORDER BY shop, user_id, sku FOR UPDATE",
            purchases,
        )
        .await
    }

    async fn sku_facts(
        &mut self,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
        let mut found: Vec<SkuFactsRow> = Vec::with_capacity(skus.len());
        for chunk in skus.chunks(keys_per_statement(1, 0)) {
            let mut lookup = built_statement(format!(
                "SELECT code, sale_status, shop, per_user_limit FROM sku WHERE code IN ({})",
                list_of_placeholders(chunk.len())
            ));
            for sku in chunk {
                lookup = lookup.bind(sku.as_str());
            }
            found.extend(lookup.fetch_all_as::<SkuFactsRow>(&mut *self).await?);
        }
        sku_facts_of(found)
    }

    /// One conditional update per stock row, then the reservations, their lines and
    /// ledger rows as multi-row inserts.
    async fn write_reservations(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        let mut rows_taken = 0;
        for ((sku, warehouse), total) in totals {
            rows_taken += statement(
                "UPDATE stock SET available = available - $3, reserved = reserved + $3, \
                 version = version + 1, updated_at = $4 \
                 WHERE sku = $1 AND warehouse = $2 AND available >= $3",
            )
            .bind(sku.as_str())
            .bind(warehouse.as_str())
            .bind(*total)
            .bind(now.unix_milliseconds())
            .execute(&mut *self)
            .await?;
        }
        insert_reservations(self, reservations, now).await?;
        Ok(rows_taken)
    }

    /// The reservations' rows, then the idempotency records as multi-row inserts, in
    /// key order, so two processes inserting overlapping keys wait instead of
    /// deadlocking.
    async fn write_batch(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<BatchWritten, StoreError> {
        let mut written = BatchWritten {
            rows_taken: self.write_reservations(totals, reservations, now).await?,
            records_stored: 0,
        };
        let mut sorted: Vec<&(&IdempotencyClaim, &StoredResponse)> = records.iter().collect();
        sorted.sort_by(|left, right| left.0.key.as_str().cmp(right.0.key.as_str()));
        for chunk in sorted.chunks(BATCH_INSERT_ROWS_MAX) {
            let mut insert = built_statement(format!(
                "INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
                 VALUES {} ON CONFLICT (key) DO NOTHING",
                rows_from_template(chunk.len(), "(?, ?, ?, ?, ?)")
            ));
            for (claim, response) in chunk {
                insert = insert
                    .bind(claim.key.as_str())
                    .bind(claim.fingerprint.as_str())
                    .bind(i64::from(response.status))
                    .bind(response.body.as_str())
                    .bind(now.unix_milliseconds());
            }
            written.records_stored +=
                insert
                    .execute(&mut *self)
                    .await
                    .map_err(|error| match error {
                        // Another process holds one of these keys in an open transaction (as
                        // PostgreSQL's batch says it): not this batch's rows. InnoDB's
                        // duplicate check may also wait on the gap beside another key
                        // being written; either way the batch changed nothing and a
                        // retry under the same key is safe.
                        StoreError::LockTimeout(_) => StoreError::KeyInFlight,
                        other => other,
                    })?;
        }
        Ok(written)
    }
}

/// Adds `received` to an existing stock row within the on-hand bound; the rows changed.
async fn add_received(
    connection: &mut MySqlConnection,
    sku: &str,
    warehouse: &str,
    received: i64,
    now: Timestamp,
    on_hand_max: i64,
) -> Result<u64, StoreError> {
    statement(
        "UPDATE stock SET available = available + $3, version = version + 1, updated_at = $4 \
         WHERE sku = $1 AND warehouse = $2 AND available + reserved + $3 <= $5",
    )
    .bind(sku)
    .bind(warehouse)
    .bind(received)
    .bind(now.unix_milliseconds())
    .bind(on_hand_max)
    .execute(connection)
    .await
}

/// A stock row's counters, read under the lock the caller's update holds.
async fn counters_of(
    connection: &mut MySqlConnection,
    sku: &str,
    warehouse: &str,
) -> Result<(i64, i64), StoreError> {
    statement("SELECT available, reserved FROM stock WHERE sku = $1 AND warehouse = $2")
        .bind(sku)
        .bind(warehouse)
        .fetch_one_as(connection)
        .await
}

/// Runs a tally-locking `statement` whose `{keys}` becomes a row of placeholders per
/// key and which answers the key columns, then the count.
async fn lock_tallies<K: TallyKey>(
    connection: &mut MySqlConnection,
    statement: &str,
    asked: &[K],
) -> Result<HashMap<K, i64>, StoreError> {
    let Some(width) = asked.first().map(|key| key.columns().len()) else {
        return Ok(HashMap::new());
    };
    let row = format!("({})", vec!["?"; width].join(", "));
    let mut tallies = HashMap::with_capacity(asked.len());
    // `asked` is in key order: chunk after chunk, the locks still are.
    for chunk in asked.chunks(keys_per_statement(width, 0)) {
        let mut locking =
            built_statement(statement.replace("{keys}", &rows_from_template(chunk.len(), &row)));
        for key in chunk {
            for column in key.columns() {
                locking = locking.bind(column);
            }
        }
        tallies.extend(tallies_of(
            chunk,
            &locking.fetch_all_rows(&mut *connection).await?,
        )?);
    }
    Ok(tallies)
}

/// One chunk of [`Dialect::add_open_holds_of_all`]: the update of the tallies that
/// exist, then the insert of those that do not.
async fn add_open_holds_of(
    connection: &mut MySqlConnection,
    added: &[(&ShopperKey, &i64)],
    open_holds_max: i64,
) -> Result<u64, StoreError> {
    if added.is_empty() {
        return Ok(0);
    }
    let keys = union_of_rows(added.len(), &["shop", "user_id", "holds"]);
    let bound = format!("${}", added.len() * 3 + 1);
    let bind_all = |mut statement: Statement<'static>| {
        for ((shop, user), holds) in added {
            statement = statement
                .bind(shop.as_str().to_owned())
                .bind(user.as_str().to_owned())
                .bind(**holds);
        }
        statement.bind(open_holds_max)
    };
    let updated = bind_all(built_statement(format!(
        "UPDATE shopper_hold JOIN ({keys}) AS added \
         ON shopper_hold.shop = added.shop AND shopper_hold.user_id = added.user_id \
         SET shopper_hold.open_holds = shopper_hold.open_holds + added.holds \
         WHERE shopper_hold.open_holds + added.holds <= {bound}"
    )))
    .execute(&mut *connection)
    .await?;
    let inserted = bind_all(built_statement(format!(
        "INSERT INTO shopper_hold (shop, user_id, open_holds) \
         SELECT added.shop, added.user_id, added.holds FROM ({keys}) AS added \
         WHERE added.holds <= {bound} AND NOT EXISTS (SELECT 1 FROM shopper_hold AS tally \
             WHERE tally.shop = added.shop AND tally.user_id = added.user_id) \
         ON CONFLICT (shop, user_id) DO NOTHING"
    )))
    .execute(&mut *connection)
    .await?;
    Ok(updated + inserted)
}

/// One chunk of [`Dialect::add_purchases_of_all`], as [`add_open_holds_of`].
async fn add_purchases_of(
    connection: &mut MySqlConnection,
    added: &[(&PurchaseKey, &i64)],
    quantity_max: i64,
) -> Result<u64, StoreError> {
    if added.is_empty() {
        return Ok(0);
    }
    let keys = union_of_rows(added.len(), &["shop", "user_id", "sku", "quantity"]);
    let limit = format!(
        "COALESCE((SELECT per_user_limit FROM sku WHERE sku.code = added.sku), \
         (SELECT per_user_limit FROM campaign WHERE campaign.tally_sku = added.sku), ${})",
        added.len() * 4 + 1
    );
    let bind_all = |mut statement: Statement<'static>| {
        for ((shop, user, sku), quantity) in added {
            statement = statement
                .bind(shop.as_str().to_owned())
                .bind(user.as_str().to_owned())
                .bind(sku.as_str().to_owned())
                .bind(**quantity);
        }
        statement.bind(quantity_max)
    };
    let updated = bind_all(built_statement(format!(
        "UPDATE shopper_purchase JOIN ({keys}) AS added \
         ON shopper_purchase.shop = added.shop AND shopper_purchase.user_id = added.user_id \
         AND shopper_purchase.sku = added.sku \
         SET shopper_purchase.quantity = shopper_purchase.quantity + added.quantity \
         WHERE shopper_purchase.quantity + added.quantity <= {limit}"
    )))
    .execute(&mut *connection)
    .await?;
    let inserted = bind_all(built_statement(format!(
        "INSERT INTO shopper_purchase (shop, user_id, sku, quantity) \
         SELECT added.shop, added.user_id, added.sku, added.quantity FROM ({keys}) AS added \
         WHERE (EXISTS (SELECT 1 FROM sku WHERE sku.code = added.sku) \
                OR EXISTS (SELECT 1 FROM campaign WHERE campaign.tally_sku = added.sku)) \
         AND added.quantity <= {limit} \
         AND NOT EXISTS (SELECT 1 FROM shopper_purchase AS tally WHERE tally.shop = added.shop \
             AND tally.user_id = added.user_id AND tally.sku = added.sku) \
         ON CONFLICT (shop, user_id, sku) DO NOTHING"
    )))
    .execute(&mut *connection)
    .await?;
    Ok(updated + inserted)
}

/// A derived table of `rows` rows of placeholders, numbered on across them, its
/// columns named in the first: `union_of_rows(2, &["a", "b"])` is
/// `SELECT $1 AS a, $2 AS b UNION ALL SELECT $3, $4`.
fn union_of_rows(rows: usize, columns: &[&str]) -> String {
    let mut number = 0;
    (0..rows)
        .map(|row| {
            let cells = columns
                .iter()
                .map(|column| {
                    number += 1;
                    if row == 0 {
                        format!("${number} AS {column}")
                    } else {
                        format!("${number}")
                    }
                })
                .collect::<Vec<String>>()
                .join(", ");
            format!("SELECT {cells}")
        })
        .collect::<Vec<String>>()
        .join(" UNION ALL ")
}

/// `rows` copies of `template`, each `?` of it numbered on from the one before:
/// `rows_from_template(2, "(?, 'x', ?)")` is `($1, 'x', $2), ($3, 'x', $4)`.
fn rows_from_template(rows: usize, template: &str) -> String {
    let mut number = 0;
    (0..rows)
        .map(|_| {
            template
                .split('?')
                .enumerate()
                .map(|(index, piece)| {
                    if index == 0 {
                        piece.to_owned()
                    } else {
                        number += 1;
                        format!("${number}{piece}")
                    }
                })
                .collect::<String>()
        })
        .collect::<Vec<String>>()
        .join(", ")
}

/// The accepted requests' reservations, lines and ledger rows, as multi-row inserts.
async fn insert_reservations(
    connection: &mut MySqlConnection,
    reservations: &[NewReservation<'_>],
    now: Timestamp,
) -> Result<(), StoreError> {
    for chunk in reservations.chunks(BATCH_INSERT_ROWS_MAX) {
        let mut insert = built_statement(format!(
            "INSERT INTO reservation (id, status, release_reason, expires_at, idempotency_key, \
             created_at, updated_at, shop, user_id, order_id) VALUES {}",
            rows_from_template(chunk.len(), "(?, 'RESERVED', NULL, ?, ?, ?, ?, ?, ?, ?)")
        ));
        for reservation in chunk {
            insert = insert
                .bind(reservation.id.as_str())
                .bind(reservation.expires_at.unix_milliseconds())
                .bind(reservation.request_key)
                .bind(now.unix_milliseconds())
                .bind(now.unix_milliseconds())
                .bind(reservation.shop.as_str())
                .bind(reservation.user)
                .bind(reservation.order.map(|order| order.as_str()));
        }
        insert.execute(&mut *connection).await?;
    }
    let lines: Vec<(&NewReservation<'_>, usize, &domain::ReservationLine)> = reservations
        .iter()
        .flat_map(|reservation| {
            reservation
                .lines
                .iter()
                .enumerate()
                .map(move |(number, line)| (reservation, number, line))
        })
        .collect();
    for chunk in lines.chunks(BATCH_INSERT_ROWS_MAX) {
        let mut insert = built_statement(format!(
            "INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity) \
             VALUES {}",
            rows_from_template(chunk.len(), "(?, ?, ?, ?, ?)")
        ));
        let mut ledger = built_statement(format!(
            "INSERT INTO stock_ledger (sku, warehouse, kind, available_delta, reserved_delta, \
             reference, idempotency_key, created_at) VALUES {}",
            rows_from_template(chunk.len(), "(?, ?, 'reserve', ?, ?, ?, ?, ?)")
        ));
        for (reservation, number, line) in chunk {
            let quantity = line.quantity.get();
            insert = insert
                .bind(reservation.id.as_str())
                .bind(i64::try_from(*number).unwrap_or(i64::MAX))
                .bind(line.sku.as_str())
                .bind(line.warehouse.as_str())
                .bind(quantity);
            ledger = ledger
                .bind(line.sku.as_str())
                .bind(line.warehouse.as_str())
                .bind(-quantity)
                .bind(quantity)
                .bind(reservation.id.as_str())
                .bind(reservation.ledger_key)
                .bind(now.unix_milliseconds());
        }
        insert.execute(&mut *connection).await?;
        ledger.execute(&mut *connection).await?;
    }
    crate::units::outbox::append_reservations_created(connection, reservations, now).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_question_marks_bound_in_the_order_they_appear() {
        let translated = translate(
            "UPDATE stock SET reserved = reserved - $3 WHERE sku = $1 AND reserved >= $3",
        )
        .unwrap();
        assert_eq!(
            &*translated.text,
            "UPDATE stock SET reserved = reserved - ? WHERE sku = ? AND reserved >= ?"
        );
        assert_eq!(translated.order, vec![2, 0, 2]);
        assert!(!translated.duplicate_means_nothing);
    }

    #[test]
    fn the_key_column_is_quoted_but_not_inside_literals_or_other_words() {
        let translated = translate(
            "SELECT key, idempotency_key, record.key FROM idempotency_record WHERE key = '$1 key' AND key = $1",
        )
        .unwrap();
        assert_eq!(
            &*translated.text,
            "SELECT `key`, idempotency_key, record.key FROM idempotency_record WHERE `key` = '$1 key' AND `key` = ?"
        );
        assert_eq!(translated.order, vec![0]);
    }

    #[test]
    fn insert_or_nothing_becomes_a_plain_insert_whose_duplicate_means_nothing() {
        let translated = translate(
            "INSERT INTO order_return (order_id, created_at) VALUES ($1, $2) ON CONFLICT (order_id) DO NOTHING",
        )
        .unwrap();
        assert_eq!(
            translated.text.trim_end(),
            "INSERT INTO order_return (order_id, created_at) VALUES (?, ?)"
        );
        assert!(translated.duplicate_means_nothing);
    }

    #[test]
    fn casts_to_bigint_are_spelled_signed() {
        let translated = translate("SELECT CAST(SUM(quantity) AS BIGINT) FROM stock").unwrap();
        assert_eq!(
            &*translated.text,
            "SELECT CAST(SUM(quantity) AS SIGNED) FROM stock"
        );
    }

    #[test]
    fn an_upsert_that_updates_has_no_translation_and_is_refused() {
        let refused = translate(
            "INSERT INTO cart_item (user_id) VALUES ($1) ON CONFLICT (user_id) DO UPDATE SET quantity = 1",
        );
        assert!(
            matches!(refused, Err(StoreError::Database(_))),
            "{refused:?}"
        );
    }

    #[test]
    fn rows_from_a_template_number_their_placeholders_on() {
        assert_eq!(
            rows_from_template(2, "(?, 'x', ?)"),
            "($1, 'x', $2), ($3, 'x', $4)"
        );
    }

    #[test]
    fn a_union_of_rows_names_its_columns_once_and_numbers_its_placeholders_on() {
        assert_eq!(
            union_of_rows(3, &["a", "b"]),
            "SELECT $1 AS a, $2 AS b UNION ALL SELECT $3, $4 UNION ALL SELECT $5, $6"
        );
    }
}

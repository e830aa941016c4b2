//! The embedded default: one SQLite file in WAL mode with `synchronous=FULL`.
//!
//! SQLite allows one writer at a time. Rather than let connections race for the write
//! lock (and spin in SQLite's busy handler), all writes go through a pool of exactly one
//! connection, so writers queue fairly inside the process, and every write transaction
//! starts with `BEGIN IMMEDIATE` so it holds the lock from its first statement. Reads
//! use a separate pool and see WAL snapshots without blocking the writer.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};

use crate::StoreConfig;

type Db = Sqlite;
type BackendStore = SqliteStore;

#[derive(Debug, Clone)]
pub struct SqliteStore {
    write: SqlitePool,
    read: SqlitePool,
    limits: crate::StoreLimits,
}

mod dialect {
    pub const SELECT_RESERVATION_FOR_UPDATE: &str =
        "SELECT status, order_id, shop, user_id, expires_at FROM reservation WHERE id = $1";
    /// The single writer already serializes every tally change.
    pub const SELECT_SHOPPER_HOLD_FOR_UPDATE: &str =
        "SELECT open_holds FROM shopper_hold WHERE shop = $1 AND user_id = $2";
    pub const SELECT_SHOPPER_PURCHASE_FOR_UPDATE: &str =
        "SELECT quantity FROM shopper_purchase WHERE shop = $1 AND user_id = $2 AND sku = $3";
    pub const CLAIM_EXPIRED_RESERVATIONS: &str = "SELECT id FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL \
         ORDER BY expires_at, id LIMIT $2";
    /// `INDEXED BY`: without statistics SQLite's planner has picked other plans for
    /// this join (once the (sku, warehouse) index, which made the audit quadratic on a
    /// hot SKU), so the one index that fits is named.
    pub const AUDIT_RESERVATION_LINES: &str = "SELECT reservation.id, reservation.status, \
         line.sku, line.warehouse, line.quantity, \
         COALESCE(CAST(SUM(ledger.available_delta) AS BIGINT), 0), \
         COALESCE(CAST(SUM(ledger.reserved_delta) AS BIGINT), 0) \
         FROM reservation JOIN reservation_line line ON line.reservation_id = reservation.id \
         LEFT JOIN stock_ledger ledger INDEXED BY stock_ledger_reference ON ledger.reference = reservation.id \
         AND ledger.sku = line.sku AND ledger.warehouse = line.warehouse \
         GROUP BY reservation.id, reservation.status, line.sku, line.warehouse, line.quantity \
         ORDER BY reservation.id, line.sku, line.warehouse";
    pub const VERSION_QUERY: &str = "SELECT 'SQLite ' || sqlite_version()";
    /// The write lock taken by `BEGIN IMMEDIATE` serializes migrations too.
    pub const MIGRATION_LOCK: Option<&str> = None;
    /// SQLite's single writer already serializes every shelf batch.
    pub async fn lock_shop(
        _transaction: &mut super::Tx,
        _shop: &domain::ShopCode,
    ) -> Result<(), crate::StoreError> {
        Ok(())
    }

    /// `BEGIN IMMEDIATE` already holds the write lock: nothing more to lock.
    pub async fn lock_stock_of_skus(
        _transaction: &mut super::Tx,
        _skus: &[&domain::SkuCode],
    ) -> Result<(), crate::StoreError> {
        Ok(())
    }

    pub const CLAIM_DUE_SCHEDULES: &str = "SELECT id, sku, operation, remark FROM shelf_schedule \
         WHERE status = 'PENDING' AND due_at <= $1 ORDER BY due_at, id LIMIT $2";

    pub const SELECT_ORDER_FOR_UPDATE: &str =
        "SELECT status, reservation_id, expires_at FROM customer_order WHERE id = $1";
    pub const SELECT_ATTEMPT_STATUS_FOR_UPDATE: &str =
        "SELECT status FROM payment_attempt WHERE id = $1";
    /// Orders past their hold that still hold their stock: unpaid, or declined.
    pub const CLAIM_EXPIRED_ORDERS: &str = "SELECT customer_order.id FROM customer_order \
         JOIN reservation ON reservation.id = customer_order.reservation_id \
         WHERE customer_order.status IN ('PENDING_PAYMENT', 'PAYMENT_FAILED') AND customer_order.expires_at <= $1 \
         AND reservation.status = 'RESERVED' \
         ORDER BY customer_order.expires_at, customer_order.id LIMIT $2";
    pub const CLAIM_ATTEMPTS_TO_RECONCILE: &str = "SELECT id FROM payment_attempt \
         WHERE status = 'PROCESSING' AND reconcile_after <= $1 ORDER BY reconcile_after, id LIMIT $2";
    pub const CLAIM_REFUNDS: &str = "SELECT id, order_id, attempt_id, gateway_key, amount_minor, currency, tries FROM refund \
         WHERE status = 'PENDING' AND next_try_at <= $1 ORDER BY next_try_at, id LIMIT $2";
    pub const MIGRATIONS: &[(i64, &str, &str)] = &[
        (
            1,
            "reservation_core",
            include_str!("../migrations/sqlite/0001_reservation_core.sql"),
        ),
        (
            2,
            "ledger_reference_index",
            include_str!("../migrations/sqlite/0002_ledger_reference_index.sql"),
        ),
        (
            3,
            "reservation_line_key",
            include_str!("../migrations/sqlite/0003_reservation_line_key.sql"),
        ),
        (
            4,
            "catalog",
            include_str!("../migrations/sqlite/0004_catalog.sql"),
        ),
        (
            5,
            "orders",
            include_str!("../migrations/sqlite/0005_orders.sql"),
        ),
        (
            6,
            "trust",
            include_str!("../migrations/sqlite/0006_trust.sql"),
        ),
        (
            7,
            "refusals",
            include_str!("../migrations/sqlite/0007_refusals.sql"),
        ),
        (
            8,
            "payment_attempts",
            include_str!("../migrations/sqlite/0008_payment_attempts.sql"),
        ),
        (
            9,
            "refund_per_attempt",
            include_str!("../migrations/sqlite/0009_refund_per_attempt.sql"),
        ),
        (
            10,
            "attempt_request_key",
            include_str!("../migrations/sqlite/0010_attempt_request_key.sql"),
        ),
    ];
}

impl SqliteStore {
    pub async fn connect(config: &StoreConfig) -> Result<SqliteStore, crate::StoreError> {
        let options = SqliteConnectOptions::from_str(&config.database_url)
            .map_err(|error| crate::StoreError::Unavailable(error.to_string()))?;
        if let Some(parent) = Path::new(options.get_filename()).parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|error| {
                crate::StoreError::Unavailable(format!(
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
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(acquire_timeout)
            .connect_with(options.clone())
            .await?;
        let read = SqlitePoolOptions::new()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(acquire_timeout)
            .connect_with(options.read_only(true))
            .await?;
        Ok(SqliteStore {
            write,
            read,
            limits: config.limits,
        })
    }

    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, Sqlite>, crate::StoreError> {
        Ok(self.write.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn begin_read(&self) -> Result<sqlx::Transaction<'static, Sqlite>, crate::StoreError> {
        Ok(self.read.begin().await?)
    }

    /// A deferred read transaction sees one WAL snapshot from its first read on.
    async fn begin_snapshot(
        &self,
    ) -> Result<sqlx::Transaction<'static, Sqlite>, crate::StoreError> {
        self.begin_read().await
    }

    fn read_pool(&self) -> &SqlitePool {
        &self.read
    }

    fn write_pool(&self) -> &SqlitePool {
        &self.write
    }

    fn limits(&self) -> &crate::StoreLimits {
        &self.limits
    }

    pub async fn close(&self) {
        self.write.close().await;
        self.read.close().await;
    }
}

include!("shared.rs");
include!("shared_catalog.rs");
include!("shared_orders.rs");

/// The reservation batch's bulk statements. Each takes its rows as one JSON parameter
/// read with `json_each`, so a batch of any size costs the same few statements (every
/// statement is a round trip to sqlx's SQLite worker thread).
mod bulk {
    use std::collections::{BTreeMap, HashMap};

    use domain::{ShopCode, SkuCode, Timestamp, WarehouseCode};
    use serde_json::json;
    use sqlx::Row;

    use super::{Tx, corrupt};
    use crate::error::StoreError;
    use crate::model::{IdempotencyClaim, ReserveRequest, StoredResponse};
    use crate::plan::{BatchWritten, SkuFacts, StockKey, WholeBatch};

    fn rows(values: Vec<serde_json::Value>) -> String {
        serde_json::Value::Array(values).to_string()
    }

    /// SQLite runs in the process: a batch transaction has no round trips to save, so
    /// there is no whole-batch fast path.
    pub const WHOLE_BATCH_FAST_PATH: bool = false;

    /// Never called (see [`WHOLE_BATCH_FAST_PATH`]); writes nothing.
    pub async fn reserve_whole_batch(
        _pool: &sqlx::SqlitePool,
        _totals: &BTreeMap<StockKey, i64>,
        _accepted: &[(&ReserveRequest, &ShopCode)],
        _records: &[(&IdempotencyClaim, &StoredResponse)],
        _now: Timestamp,
    ) -> Result<WholeBatch, StoreError> {
        Ok(WholeBatch::NotApplied)
    }

    pub async fn existing_records(
        transaction: &mut Tx,
        keys: &[&str],
    ) -> Result<HashMap<String, (String, Option<StoredResponse>)>, StoreError> {
        let found = sqlx::query(
            "SELECT key, fingerprint, status_code, body FROM idempotency_record \
             WHERE key IN (SELECT value FROM json_each($1))",
        )
        .bind(serde_json::to_string(keys).map_err(|error| corrupt("keys", error))?)
        .fetch_all(&mut **transaction)
        .await?;
        let mut records = HashMap::with_capacity(found.len());
        for row in &found {
            let status_code: i64 = row.try_get("status_code")?;
            let response = if status_code == 0 {
                None
            } else {
                let status =
                    u16::try_from(status_code).map_err(|error| corrupt("status code", error))?;
                Some(StoredResponse {
                    status,
                    body: row.try_get("body")?,
                })
            };
            records.insert(row.try_get("key")?, (row.try_get("fingerprint")?, response));
        }
        Ok(records)
    }

    /// SQLite has no row locks: `BEGIN IMMEDIATE` already holds the database's write
    /// lock, so these reads are current until the commit.
    pub async fn lock_stock_rows(
        transaction: &mut Tx,
        wanted: &[StockKey],
    ) -> Result<(BTreeMap<StockKey, i64>, HashMap<SkuCode, SkuFacts>), StoreError> {
        if wanted.is_empty() {
            return Ok((BTreeMap::new(), HashMap::new()));
        }
        let parameter = rows(
            wanted
                .iter()
                .map(|(sku, warehouse)| json!([sku.as_str(), warehouse.as_str()]))
                .collect(),
        );
        let found = sqlx::query_as::<_, (String, String, i64, String, String, Option<i64>)>(
            "SELECT stock.sku, stock.warehouse, stock.available, sku.sale_status, sku.shop, \
             sku.per_user_limit FROM stock JOIN sku ON sku.code = stock.sku \
             WHERE (stock.sku, stock.warehouse) IN (SELECT value ->> 0, value ->> 1 FROM json_each($1))",
        )
        .bind(parameter)
        .fetch_all(&mut **transaction)
        .await?;
        let mut available = BTreeMap::new();
        let mut skus = HashMap::new();
        for (sku, warehouse, count, status, shop, per_user_limit) in found {
            let sku = SkuCode::parse(&sku).map_err(|error| corrupt("sku code", error))?;
            let warehouse =
                WarehouseCode::parse(&warehouse).map_err(|error| corrupt("warehouse", error))?;
            skus.insert(
                sku.clone(),
                super::decode_sku_facts(&status, &shop, per_user_limit)?,
            );
            available.insert((sku, warehouse), count);
        }
        Ok((available, skus))
    }

    pub async fn sku_facts(
        transaction: &mut Tx,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, SkuFacts>, StoreError> {
        if skus.is_empty() {
            return Ok(HashMap::new());
        }
        let codes: Vec<&str> = skus.iter().map(|sku| sku.as_str()).collect();
        let found = sqlx::query_as::<_, (String, String, String, Option<i64>)>(
            "SELECT code, sale_status, shop, per_user_limit FROM sku \
             WHERE code IN (SELECT value FROM json_each($1))",
        )
        .bind(serde_json::to_string(&codes).map_err(|error| corrupt("codes", error))?)
        .fetch_all(&mut **transaction)
        .await?;
        let mut facts = HashMap::with_capacity(found.len());
        for (code, status, shop, per_user_limit) in found {
            facts.insert(
                SkuCode::parse(&code).map_err(|error| corrupt("sku code", error))?,
                super::decode_sku_facts(&status, &shop, per_user_limit)?,
            );
        }
        Ok(facts)
    }

    /// Writes a decided batch: one statement per table, rows passed as JSON.
    pub async fn write_batch(
        transaction: &mut Tx,
        totals: &BTreeMap<StockKey, i64>,
        accepted: &[(&ReserveRequest, &ShopCode)],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<BatchWritten, StoreError> {
        let mut written = BatchWritten {
            rows_taken: 0,
            records_stored: 0,
        };
        if !totals.is_empty() {
            let parameter = rows(
                totals
                    .iter()
                    .map(|((sku, warehouse), total)| {
                        json!([sku.as_str(), warehouse.as_str(), total])
                    })
                    .collect(),
            );
            written.rows_taken = sqlx::query(
                "UPDATE stock SET available = available - batch.total, reserved = reserved + batch.total, \
                 version = version + 1, updated_at = $2 \
                 FROM (SELECT value ->> 0 AS sku, value ->> 1 AS warehouse, value ->> 2 AS total FROM json_each($1)) AS batch \
                 WHERE stock.sku = batch.sku AND stock.warehouse = batch.warehouse AND stock.available >= batch.total",
            )
            .bind(parameter)
            .bind(now.unix_milliseconds())
            .execute(&mut **transaction)
            .await?
            .rows_affected();
        }
        if !accepted.is_empty() {
            insert_reservations(transaction, accepted, now).await?;
        }
        if !records.is_empty() {
            let parameter = rows(
                records
                    .iter()
                    .map(|(claim, response)| {
                        json!([
                            claim.key.as_str(),
                            claim.fingerprint,
                            response.status,
                            response.body
                        ])
                    })
                    .collect(),
            );
            written.records_stored = sqlx::query(
                "INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
                 SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, $2 FROM json_each($1) WHERE true \
                 ON CONFLICT (key) DO NOTHING",
            )
            .bind(parameter)
            .bind(now.unix_milliseconds())
            .execute(&mut **transaction)
            .await?
            .rows_affected();
        }
        Ok(written)
    }

    async fn insert_reservations(
        transaction: &mut Tx,
        accepted: &[(&ReserveRequest, &ShopCode)],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let reservations = rows(
            accepted
                .iter()
                .map(|(request, shop)| {
                    json!([
                        request.id.as_str(),
                        request.expires_at.unix_milliseconds(),
                        request.claim.key.as_str(),
                        shop.as_str(),
                        request.user.as_ref().map(|user| user.as_str())
                    ])
                })
                .collect(),
        );
        let mut lines = Vec::new();
        let mut ledger = Vec::new();
        for (request, _) in accepted {
            for (line_number, line) in request.lines.iter().enumerate() {
                let quantity = line.quantity.get();
                lines.push(json!([
                    request.id.as_str(),
                    line_number,
                    line.sku.as_str(),
                    line.warehouse.as_str(),
                    quantity
                ]));
                ledger.push(json!([
                    line.sku.as_str(),
                    line.warehouse.as_str(),
                    quantity,
                    request.id.as_str(),
                    request.claim.key.as_str()
                ]));
            }
        }
        sqlx::query(
            "INSERT INTO reservation (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at, \
             shop, user_id) \
             SELECT value ->> 0, 'RESERVED', NULL, value ->> 1, value ->> 2, $2, $2, value ->> 3, value ->> 4 \
             FROM json_each($1)",
        )
        .bind(reservations)
        .bind(now.unix_milliseconds())
        .execute(&mut **transaction)
        .await?;
        sqlx::query(
            "INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity) \
             SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4 FROM json_each($1)",
        )
        .bind(rows(lines))
        .execute(&mut **transaction)
        .await?;
        sqlx::query(
            "INSERT INTO stock_ledger \
             (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
             SELECT value ->> 0, value ->> 1, 'reserve', -(value ->> 2), value ->> 2, value ->> 3, value ->> 4, $2 \
             FROM json_each($1)",
        )
        .bind(rows(ledger))
        .bind(now.unix_milliseconds())
        .execute(&mut **transaction)
        .await?;
        Ok(())
    }
}

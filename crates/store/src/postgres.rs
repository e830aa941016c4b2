//! PostgreSQL, for production: several stockd processes may share one database.
//!
//! Row locks (`FOR UPDATE`) order concurrent writers, `SKIP LOCKED` lets several
//! workers claim distinct rows, and every connection carries a `lock_timeout` so a lock
//! wait is bounded. Commits are durable (`synchronous_commit` is left at `on`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::StoreConfig;

type Db = Postgres;
type BackendStore = PostgresStore;

#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

mod dialect {
    pub const SELECT_RESERVATION_STATUS_FOR_UPDATE: &str =
        "SELECT status FROM reservation WHERE id = $1 FOR UPDATE";
    /// `SKIP LOCKED`: a reservation another worker is releasing is left to it.
    pub const CLAIM_EXPIRED_RESERVATIONS: &str = "SELECT id FROM reservation \
         WHERE status = 'RESERVED' AND expires_at <= $1 AND order_id IS NULL \
         ORDER BY expires_at, id LIMIT $2 \
         FOR UPDATE SKIP LOCKED";
    /// The audit's join of every reservation line with its ledger rows.
    pub const AUDIT_RESERVATION_LINES: &str = "SELECT reservation.id, reservation.status, \
         line.sku, line.warehouse, line.quantity, \
         COALESCE(CAST(SUM(ledger.available_delta) AS BIGINT), 0), \
         COALESCE(CAST(SUM(ledger.reserved_delta) AS BIGINT), 0) \
         FROM reservation JOIN reservation_line line ON line.reservation_id = reservation.id \
         LEFT JOIN stock_ledger ledger ON ledger.reference = reservation.id \
         AND ledger.sku = line.sku AND ledger.warehouse = line.warehouse \
         GROUP BY reservation.id, reservation.status, line.sku, line.warehouse, line.quantity \
         ORDER BY reservation.id, line.sku, line.warehouse";
    pub const VERSION_QUERY: &str = "SELECT version()";
    /// Serializes migrations of one schema across processes; released at commit.
    pub const MIGRATION_LOCK: Option<&str> =
        Some("SELECT pg_advisory_xact_lock(hashtext('stockd_migrate:' || current_schema()))");
    /// Serializes shelf batches of one shop across processes, until the commit: two
    /// overlapping batches never interleave.
    pub async fn lock_shop(
        transaction: &mut super::Tx,
        shop: &domain::ShopCode,
    ) -> Result<(), crate::StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('stockd_shelf:' || $1))")
            .bind(shop.as_str())
            .execute(&mut **transaction)
            .await?;
        Ok(())
    }

    /// Locks every stock row of these SKUs in the order reservations lock them, so a
    /// sale-status change and a reservation of the same SKU serialize.
    pub async fn lock_stock_of_skus(
        transaction: &mut super::Tx,
        skus: &[&domain::SkuCode],
    ) -> Result<(), crate::StoreError> {
        let codes: Vec<String> = skus.iter().map(|sku| sku.as_str().to_owned()).collect();
        sqlx::query(
            "SELECT 1 FROM stock WHERE sku = ANY($1) \
             ORDER BY sku COLLATE \"C\", warehouse COLLATE \"C\" FOR UPDATE",
        )
        .bind(codes)
        .persistent(false)
        .execute(&mut **transaction)
        .await?;
        Ok(())
    }

    /// `SKIP LOCKED`: a schedule another process is applying is left to it.
    pub const CLAIM_DUE_SCHEDULES: &str = "SELECT id, sku, operation, remark FROM shelf_schedule \
         WHERE status = 'PENDING' AND due_at <= $1 ORDER BY due_at, id LIMIT $2 FOR UPDATE SKIP LOCKED";

    pub const SELECT_ORDER_FOR_UPDATE: &str =
        "SELECT status, reservation_id, expires_at FROM customer_order WHERE id = $1 FOR UPDATE";
    pub const SELECT_ATTEMPT_STATUS_FOR_UPDATE: &str =
        "SELECT status FROM payment_attempt WHERE id = $1 FOR UPDATE";
    pub const CLAIM_EXPIRED_ORDERS: &str = "SELECT id FROM customer_order \
         WHERE status = 'PENDING_PAYMENT' AND expires_at <= $1 ORDER BY expires_at, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    pub const CLAIM_ATTEMPTS_TO_RECONCILE: &str = "SELECT id FROM payment_attempt \
         WHERE status = 'PROCESSING' AND reconcile_after <= $1 ORDER BY reconcile_after, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    pub const CLAIM_REFUNDS: &str = "SELECT id, order_id, gateway_key, amount_minor, currency FROM refund \
         WHERE status = 'PENDING' AND next_try_at <= $1 ORDER BY next_try_at, id LIMIT $2 FOR UPDATE SKIP LOCKED";
    pub const MIGRATIONS: &[(i64, &str, &str)] = &[
        (
            1,
            "reservation_core",
            include_str!("../migrations/postgres/0001_reservation_core.sql"),
        ),
        (
            2,
            "ledger_reference_index",
            include_str!("../migrations/postgres/0002_ledger_reference_index.sql"),
        ),
        (
            3,
            "reservation_line_key",
            include_str!("../migrations/postgres/0003_reservation_line_key.sql"),
        ),
        (
            4,
            "catalog",
            include_str!("../migrations/postgres/0004_catalog.sql"),
        ),
        (
            5,
            "orders",
            include_str!("../migrations/postgres/0005_orders.sql"),
        ),
    ];
}

impl PostgresStore {
    pub async fn connect(config: &StoreConfig) -> Result<PostgresStore, crate::StoreError> {
        let mut options = PgConnectOptions::from_str(&config.database_url)
            .map_err(|error| crate::StoreError::Unavailable(error.to_string()))?;
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
        let pool = PgPoolOptions::new()
            .max_connections(config.pool_size.max(1))
            .acquire_timeout(Duration::from_millis(config.acquire_timeout_milliseconds))
            .connect_with(options)
            .await?;
        Ok(PostgresStore { pool })
    }

    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, Postgres>, crate::StoreError> {
        Ok(self.pool.begin().await?)
    }

    async fn begin_read(&self) -> Result<sqlx::Transaction<'static, Postgres>, crate::StoreError> {
        Ok(self.pool.begin().await?)
    }

    /// The audit compares several tables, so it reads them from one snapshot.
    async fn begin_snapshot(
        &self,
    ) -> Result<sqlx::Transaction<'static, Postgres>, crate::StoreError> {
        Ok(self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?)
    }

    fn read_pool(&self) -> &PgPool {
        &self.pool
    }

    fn write_pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

include!("shared.rs");
include!("shared_catalog.rs");
include!("shared_orders.rs");

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

    use domain::{SaleStatus, SkuCode, Timestamp, WarehouseCode};
    use sqlx::Row;

    use super::{Tx, corrupt};
    use crate::error::StoreError;
    use crate::model::{IdempotencyClaim, ReserveRequest, StoredResponse};
    use crate::plan::{BatchWritten, StockKey};

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
    ) -> Result<(BTreeMap<StockKey, i64>, HashMap<SkuCode, SaleStatus>), StoreError> {
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
        let statement = "SELECT stock.sku, stock.warehouse, stock.available, sku.sale_status FROM stock \
             JOIN UNNEST($1::text[], $2::text[]) AS wanted (sku, warehouse) \
             ON stock.sku = wanted.sku AND stock.warehouse = wanted.warehouse \
             JOIN sku ON sku.code = stock.sku \
             ORDER BY stock.sku COLLATE \"C\", stock.warehouse COLLATE \"C\" FOR UPDATE OF stock FOR SHARE OF sku";
        let found = sqlx::query_as::<_, (String, String, i64, String)>(statement)
            .bind(skus)
            .bind(warehouses)
            .fetch_all(&mut **transaction)
            .await?;
        let mut available = BTreeMap::new();
        let mut statuses = HashMap::new();
        for (sku, warehouse, count, status) in found {
            let sku = SkuCode::parse(&sku).map_err(|error| corrupt("sku code", error))?;
            let warehouse =
                WarehouseCode::parse(&warehouse).map_err(|error| corrupt("warehouse", error))?;
            let status =
                SaleStatus::parse(&status).map_err(|error| corrupt("sale status", error))?;
            statuses.insert(sku.clone(), status);
            available.insert((sku, warehouse), count);
        }
        Ok((available, statuses))
    }

    pub async fn sale_statuses(
        transaction: &mut Tx,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, SaleStatus>, StoreError> {
        if skus.is_empty() {
            return Ok(HashMap::new());
        }
        let codes: Vec<String> = skus.iter().map(|sku| sku.as_str().to_owned()).collect();
        let found = sqlx::query_as::<_, (String, String)>(
            "SELECT code, sale_status FROM sku WHERE code = ANY($1)",
        )
        .bind(codes)
        .persistent(false)
        .fetch_all(&mut **transaction)
        .await?;
        let mut statuses = HashMap::with_capacity(found.len());
        for (code, status) in found {
            statuses.insert(
                SkuCode::parse(&code).map_err(|error| corrupt("sku code", error))?,
                SaleStatus::parse(&status).map_err(|error| corrupt("sale status", error))?,
            );
        }
        Ok(statuses)
    }

    /// Writes a decided batch in one statement (one round trip): the conditional
    /// updates of the stock rows, the reservations, their lines and ledger rows, and
    /// the idempotency records, as data-modifying common table expressions.
    /// Idempotency records go in key order, so two processes inserting overlapping
    /// keys wait for each other instead of deadlocking.
    pub async fn write_batch(
        transaction: &mut Tx,
        totals: &BTreeMap<StockKey, i64>,
        accepted: &[&ReserveRequest],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> Result<BatchWritten, StoreError> {
        let total_skus: Vec<String> = totals
            .keys()
            .map(|(sku, _)| sku.as_str().to_owned())
            .collect();
        let total_warehouses: Vec<String> = totals
            .keys()
            .map(|(_, warehouse)| warehouse.as_str().to_owned())
            .collect();
        let total_quantities: Vec<i64> = totals.values().copied().collect();

        let reservation_ids: Vec<String> = accepted
            .iter()
            .map(|request| request.id.as_str().to_owned())
            .collect();
        let reservation_expiries: Vec<i64> = accepted
            .iter()
            .map(|request| request.expires_at.unix_milliseconds())
            .collect();
        let reservation_keys: Vec<String> = accepted
            .iter()
            .map(|request| request.claim.key.as_str().to_owned())
            .collect();

        let mut line_reservations = Vec::new();
        let mut line_numbers = Vec::new();
        let mut line_skus = Vec::new();
        let mut line_warehouses = Vec::new();
        let mut line_quantities = Vec::new();
        let mut line_keys = Vec::new();
        for request in accepted {
            for (line_number, line) in request.lines.iter().enumerate() {
                line_reservations.push(request.id.as_str().to_owned());
                line_numbers.push(i64::try_from(line_number).unwrap_or(i64::MAX));
                line_skus.push(line.sku.as_str().to_owned());
                line_warehouses.push(line.warehouse.as_str().to_owned());
                line_quantities.push(line.quantity.get());
                line_keys.push(request.claim.key.as_str().to_owned());
            }
        }

        let mut sorted_records: Vec<&(&IdempotencyClaim, &StoredResponse)> =
            records.iter().collect();
        sorted_records.sort_by(|left, right| left.0.key.as_str().cmp(right.0.key.as_str()));
        let record_keys: Vec<String> = sorted_records
            .iter()
            .map(|(claim, _)| claim.key.as_str().to_owned())
            .collect();
        let record_fingerprints: Vec<String> = sorted_records
            .iter()
            .map(|(claim, _)| claim.fingerprint.clone())
            .collect();
        let record_statuses: Vec<i64> = sorted_records
            .iter()
            .map(|(_, response)| i64::from(response.status))
            .collect();
        let record_bodies: Vec<String> = sorted_records
            .iter()
            .map(|(_, response)| response.body.clone())
            .collect();

        let (rows_taken, records_stored): (i64, i64) = sqlx::query_as(
            "WITH taken AS ( \
                 UPDATE stock SET available = stock.available - batch.total, \
                 reserved = stock.reserved + batch.total, version = stock.version + 1, updated_at = $1 \
                 FROM UNNEST($2::text[], $3::text[], $4::bigint[]) AS batch (sku, warehouse, total) \
                 WHERE stock.sku = batch.sku AND stock.warehouse = batch.warehouse \
                 AND stock.available >= batch.total RETURNING 1), \
             reservations AS ( \
                 INSERT INTO reservation (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at) \
                 SELECT id, 'RESERVED', NULL, expires_at, key, $1, $1 \
                 FROM UNNEST($5::text[], $6::bigint[], $7::text[]) AS batch (id, expires_at, key) RETURNING 1), \
             lines AS ( \
                 INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity) \
                 SELECT * FROM UNNEST($8::text[], $9::bigint[], $10::text[], $11::text[], $12::bigint[]) RETURNING 1), \
             ledger AS ( \
                 INSERT INTO stock_ledger \
                 (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
                 SELECT sku, warehouse, 'reserve', -quantity, quantity, reference, key, $1 \
                 FROM UNNEST($10::text[], $11::text[], $12::bigint[], $8::text[], $13::text[]) \
                 AS batch (sku, warehouse, quantity, reference, key) RETURNING 1), \
             records AS ( \
                 INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
                 SELECT key, fingerprint, status, body, $1 \
                 FROM UNNEST($14::text[], $15::text[], $16::bigint[], $17::text[]) AS batch (key, fingerprint, status, body) \
                 ON CONFLICT (key) DO NOTHING RETURNING 1) \
             SELECT (SELECT COUNT(*) FROM taken), (SELECT COUNT(*) FROM records)",
        )
        .bind(now.unix_milliseconds())
        .bind(total_skus)
        .bind(total_warehouses)
        .bind(total_quantities)
        .bind(reservation_ids)
        .bind(reservation_expiries)
        .bind(reservation_keys)
        .bind(line_reservations)
        .bind(line_numbers)
        .bind(line_skus)
        .bind(line_warehouses)
        .bind(line_quantities)
        .bind(line_keys)
        .bind(record_keys)
        .bind(record_fingerprints)
        .bind(record_statuses)
        .bind(record_bodies)
        .fetch_one(&mut **transaction)
        .await
        .map_err(|error| match StoreError::from(error) {
            // Another process holds one of these keys in an open transaction.
            StoreError::LockTimeout(_) => StoreError::KeyInFlight,
            other => other,
        })?;
        Ok(BatchWritten {
            rows_taken: u64::try_from(rows_taken).unwrap_or(0),
            records_stored: u64::try_from(records_stored).unwrap_or(0),
        })
    }
}

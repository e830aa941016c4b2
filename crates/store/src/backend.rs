//! What a backend must provide: the one named place where SQLite, PostgreSQL and
//! MySQL/MariaDB differ. Units of work (`crate::units`) are written once against these
//! traits; each backend implements them in `crate::backends::<name>`.
//!
//! - [`Backend`]: pools, how a transaction begins (SQLite's `BEGIN IMMEDIATE`,
//!   PostgreSQL's snapshot for the audit), and the whole-batch fast path, which
//!   runs outside any transaction.
//! - [`Dialect`]: the statements whose text differs (row locks, `SKIP LOCKED`,
//!   migrations, the engine's version), the locks some backends need and others get
//!   for free (a shop's shelf batches, a SKU's stock rows), and how a reservation
//!   batch's rows travel to the database (JSON on SQLite, arrays on PostgreSQL).
//! - [`crate::sql::Connection`]: running a statement in the dialect (binding values,
//!   spelling placeholders, classifying errors).
//!
//! Adding a fourth backend is adding a module under `backends/` that implements these
//! three traits, its migrations under `migrations/<name>/`, and a variant of
//! [`crate::Store`].

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::ops::DerefMut;

use domain::{
    ConsistencyToken, OrderId, ReservationId, ReservationLine, ShopCode, SkuCode, Timestamp,
};

use crate::StoreLimits;
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, ReserveRequest, StoredResponse};
use crate::plan::{BatchWritten, PurchaseKey, ShopperKey, SkuFacts, StockKey, WholeBatch};
use crate::replicas::{ReadHandle, ReplicaHealth, Served};
use crate::sql::{Connection, statement};

/// One migration: its version, its name (checked against the database's record) and
/// its SQL script.
pub type Migration = (i64, &'static str, &'static str);

/// An idempotency record found by key: its request fingerprint and, once its unit of
/// work committed, its stored response.
pub type FoundRecords = HashMap<String, (String, Option<StoredResponse>)>;

/// A reservation to write. Every path that creates reservations (the batch
/// transaction, the whole-batch fast path, orders, checkouts, late successes) describes
/// its reservations so and hands them to the backend's one writer
/// ([`Dialect::write_reservations`], or [`Dialect::write_batch`] built on the same
/// statements), so they all leave the same rows.
#[derive(Debug, Clone, Copy)]
pub struct NewReservation<'a> {
    pub id: &'a ReservationId,
    pub expires_at: Timestamp,
    /// The key stored on the reservation: its request's (a late success has none).
    pub request_key: Option<&'a str>,
    /// The key its `reserve` ledger rows name: the request's, or a late payment's id.
    pub ledger_key: &'a str,
    pub shop: &'a ShopCode,
    pub user: Option<&'a str>,
    /// The order that holds it, when an order does.
    pub order: Option<&'a OrderId>,
    pub lines: &'a [ReservationLine],
}

impl<'a> NewReservation<'a> {
    /// The accepted requests of a reservation batch (no order holds them).
    pub fn of_batch(
        accepted: &[(&'a ReserveRequest, &'a ShopCode)],
        now: Timestamp,
    ) -> Vec<NewReservation<'a>> {
        accepted
            .iter()
            .map(|(request, shop)| NewReservation {
                id: &request.id,
                expires_at: now.plus_seconds(request.ttl_seconds),
                request_key: Some(request.claim.key.as_str()),
                ledger_key: request.claim.key.as_str(),
                shop,
                user: request.user.as_ref().map(|user| user.as_str()),
                order: None,
                lines: &request.lines,
            })
            .collect()
    }
}

/// Locked stock rows' available counts, and the facts of their SKUs.
pub type LockedStock = (BTreeMap<StockKey, i64>, HashMap<SkuCode, SkuFacts>);

/// The statements and locks that differ between databases, implemented by each
/// backend's connection type. Where a default is given it is the statement SQLite and
/// PostgreSQL share (`ON CONFLICT … DO UPDATE … WHERE`, `UPDATE … RETURNING`); MySQL
/// and MariaDB, which have neither, write their own.
/// A batch's tallies as read under its locks: open holds by shopper, and units held or
/// bought by (shopper, SKU or campaign tally).
pub type LockedTallies = (HashMap<ShopperKey, i64>, HashMap<PurchaseKey, i64>);

pub trait Dialect: Connection {
    /// A reservation's row, locked until the commit where the database has row locks.
    const SELECT_RESERVATION_FOR_UPDATE: &'static str;
    /// Open reservations past their hold (`$1`), at most `$2`, past the cursor (`$3`,
    /// `$4`: after [`crate::ExpiryCursor`]), skipping those another worker holds.
    const CLAIM_EXPIRED_RESERVATIONS: &'static str;
    /// The audit's join of every reservation line with its ledger rows.
    const AUDIT_RESERVATION_LINES: &'static str;
    /// Pending schedules that are due, skipping those another worker holds.
    const CLAIM_DUE_SCHEDULES: &'static str;
    /// The schedules of one SKU (`$2`) due at or before `$1`, with the columns of
    /// `CLAIM_DUE_SCHEDULES`, skipping those another worker holds.
    const CLAIM_DUE_SCHEDULES_OF_SKU: &'static str;
    /// A SKU's (`$1`) pending schedules, skipping those another worker holds: the
    /// worker applying one finds the SKU deleted and skips it.
    const CLAIM_PENDING_SCHEDULES_OF_SKU: &'static str;
    /// An order's row, locked.
    const SELECT_ORDER_FOR_UPDATE: &'static str;
    /// A payment attempt's status, locked.
    const SELECT_ATTEMPT_STATUS_FOR_UPDATE: &'static str;
    /// A shopper's cart lines in one shop (`sku`, `quantity`), locked: two requests
    /// adding lines to one cart count its lines one after the other, and two checkouts
    /// of one cart order its lines once.
    const LOCK_CART_LINES: &'static str;
    /// A SKU's own row, locked: a shelf change (scheduled or not) reads its version and
    /// changes it with nothing (a title edit, say) slipping in between.
    const LOCK_SKU_ROW: &'static str;
    /// A SKU's own row and its status, share-locked: a stock movement waits for a
    /// delete in flight (which holds [`Dialect::LOCK_SKU_ROW`]) while other movements of
    /// the SKU go on beside it.
    const SHARE_SKU_ROW: &'static str;
    /// Orders past their hold that still hold stock, bound as
    /// [`Dialect::CLAIM_EXPIRED_RESERVATIONS`] is, skipping locked ones: one statement,
    /// or several whose claims are merged in `(expires_at, id)` order and cut to the
    /// limit (where one statement would lock more than it claims).
    const CLAIM_EXPIRED_ORDERS: &'static [&'static str];
    /// Payment attempts whose outcome is due to be asked about, skipping locked ones.
    const CLAIM_ATTEMPTS_TO_RECONCILE: &'static str;
    /// Refunds due to be issued, skipping locked ones.
    const CLAIM_REFUNDS: &'static str;
    /// The engine's name and version.
    const VERSION_QUERY: &'static str;
    /// Run first in a batch transaction after the fast path waited out the lock bound:
    /// the row was just held for a whole bound, so this transaction waits only briefly
    /// before answering `lock_timeout` (PostgreSQL `SET LOCAL lock_timeout`). `None`
    /// where there is no fast path.
    const SHORT_LOCK_WAIT: Option<&'static str> = None;
    /// Sessions of this database waiting for a lock right now, where the database
    /// shows them (`stockd_db_sessions_waiting_on_locks`).
    const SESSIONS_WAITING_ON_LOCKS: Option<&'static str>;
    /// Transactions of this database open longer than `$1` milliseconds, not counting
    /// the asking session (`stockd_db_long_transactions`).
    const LONG_TRANSACTIONS: Option<&'static str>;
    /// Sequential scans of the stock table since the statistics were reset
    /// (`stockd_db_stock_sequential_scans_total`).
    const STOCK_SEQUENTIAL_SCANS: Option<&'static str>;
    /// The stock table's size in 8 KiB pages (`stockd_db_stock_pages`), where scans
    /// are counted: on a table of a few pages a scan is the planner's cheapest plan,
    /// not a missing index.
    const STOCK_PAGES: Option<&'static str>;
    /// The database server's clock as it runs the statement, in Unix milliseconds
    /// (`stockd_clock_ahead_of_database_seconds`). `None` where the database is this
    /// process's own file, on this machine's clock.
    const DATABASE_CLOCK_UNIX_MILLISECONDS: Option<&'static str>;
    /// Run (as a script) at the start of each migration's transaction, when the
    /// database needs a lock to serialize migrations across processes: it takes the
    /// lock, waiting as long as another process's migration may take.
    const MIGRATION_LOCK: Option<&'static str>;
    /// Where DDL commits by itself (MySQL), a lock no transaction can hold: taken on one
    /// session for the whole run of migrations, `(take, give back)`. `take` answers 1
    /// once the lock is held, 0 when another process held it past its own wait (kept
    /// below the statement bound), and is sent again until
    /// `MIGRATION_LOCK_WAIT_MAX` has passed.
    const MIGRATION_SESSION_LOCK: Option<(&'static str, &'static str)> = None;
    /// The backend's migrations, in order.
    const MIGRATIONS: &'static [Migration];
    /// Deletes up to `$2` idempotency records created before `$1` (oldest first where
    /// the index gives them in order).
    const PURGE_IDEMPOTENCY_RECORDS: &'static str = "DELETE FROM idempotency_record WHERE key IN (\
         SELECT key FROM idempotency_record WHERE created_at < $1 ORDER BY created_at LIMIT $2)";
    /// The sequencer's `outbox_relay` row (its last position), locked until the commit.
    const SELECT_SEQUENCER_FOR_UPDATE: &'static str =
        "SELECT through_position FROM outbox_relay WHERE name = 'sequencer' FOR UPDATE";
    /// Whether a batch of reservations that all fit is written by one statement
    /// outside any transaction ([`Backend::reserve_whole_batch`]).
    const WHOLE_BATCH_FAST_PATH: bool;
    /// Whether a batch transaction reads its keys' records and its stock rows at once
    /// ([`Backend::begin_write_reading`]), before it knows which requests
    /// a committed record decides: so it reads the rows of every request in the batch.
    /// The extra rows change nothing (the plan looks up only the lines of the requests
    /// left to decide), but they are locked too where reading locks, so only a backend
    /// whose reads take no lock and whose round trips are dear sets it (SQLite).
    const READS_RECORDS_WITH_STOCK_ROWS: bool = false;

    /// The next number in an aggregate's event count (`outbox_sequence`, migration
    /// 0015), its row locked until the commit so the aggregate's events commit in
    /// number order.
    fn next_event_sequence(
        &mut self,
        aggregate: &str,
        aggregate_id: &str,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send {
        async move {
            statement(
                "INSERT INTO outbox_sequence (aggregate, aggregate_id, last_sequence) VALUES ($1, $2, 1) \
                 ON CONFLICT (aggregate, aggregate_id) DO UPDATE SET last_sequence = outbox_sequence.last_sequence + 1 \
                 RETURNING last_sequence",
            )
            .bind(aggregate)
            .bind(aggregate_id)
            .fetch_one_scalar(&mut *self)
            .await
        }
    }

    /// The sequencer's step under its lock: numbers up to `limit` committed events
    /// without a position, in id order, `last + 1` onwards, and answers how many. One
    /// statement, so one snapshot: the count is how far the sequencer moved. A join
    /// to a numbered subquery costs a step of 500 one index walk; the `CASE id WHEN …`
    /// of 500 arms it replaced compared each row with every arm.
    fn number_waiting_events(
        &mut self,
        last: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        async move {
            statement(
                "UPDATE outbox SET position = $1 + waiting.ordinal \
                 FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY id) AS ordinal FROM outbox \
                       WHERE position IS NULL ORDER BY id LIMIT $2) AS waiting \
                 WHERE outbox.id = waiting.id",
            )
            .bind(last)
            .bind(limit)
            .execute(&mut *self)
            .await
        }
    }

    /// Locks (where the database has row locks) and reads the open-hold tallies of
    /// these shoppers, in the order given (key order), with as few statements as the
    /// backend can: a batch's shoppers are read under its stock rows' locks. A shopper
    /// without a tally has none in the answer.
    fn lock_open_holds(
        &mut self,
        shoppers: &[ShopperKey],
    ) -> impl Future<Output = Result<HashMap<ShopperKey, i64>, StoreError>> + Send;

    /// Locks and reads what these shoppers hold or bought of these SKUs (a campaign's
    /// units under its tally SKU), like [`Dialect::lock_open_holds`].
    fn lock_purchases(
        &mut self,
        purchases: &[PurchaseKey],
    ) -> impl Future<Output = Result<HashMap<PurchaseKey, i64>, StoreError>> + Send;

    /// Both kinds of tally a batch decides with, locked and read: the open holds, then
    /// the purchases, each in key order — what [`Dialect::lock_open_holds`] and
    /// [`Dialect::lock_purchases`] answer one after the other, in one statement where
    /// the backend can (a round trip less under the batch's stock-row locks).
    fn lock_tallies_of_all(
        &mut self,
        shoppers: &[ShopperKey],
        purchases: &[PurchaseKey],
    ) -> impl Future<Output = Result<LockedTallies, StoreError>> + Send {
        async move {
            let holds = self.lock_open_holds(shoppers).await?;
            let bought = self.lock_purchases(purchases).await?;
            Ok((holds, bought))
        }
    }

    /// Both tally writes of a decided batch: [`Dialect::add_open_holds_of_all`], then
    /// [`Dialect::add_purchases_of_all`], in one statement where the backend can.
    /// Answers the rows each wrote.
    fn add_tallies_of_all(
        &mut self,
        holds_added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
        purchases_added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> impl Future<Output = Result<(u64, u64), StoreError>> + Send {
        async move {
            let holds = self
                .add_open_holds_of_all(holds_added, open_holds_max)
                .await?;
            let purchases = self
                .add_purchases_of_all(purchases_added, quantity_max)
                .await?;
            Ok((holds, purchases))
        }
    }

    /// Adds each shopper's new open holds to its tally (creating it), in key order,
    /// unless that would pass `open_holds_max`. Answers the rows written: `added.len()`
    /// when none was refused.
    fn add_open_holds_of_all(
        &mut self,
        added: &BTreeMap<ShopperKey, i64>,
        open_holds_max: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Adds each key's new units to what the shopper bought of the SKU (creating the
    /// row), in key order, unless that would pass the SKU's per-user limit, or the
    /// campaign's for a campaign's tally SKU (`quantity_max` without either); a key
    /// of no SKU or campaign is not written. Answers the rows written: `added.len()`
    /// when none was refused.
    fn add_purchases_of_all(
        &mut self,
        added: &BTreeMap<PurchaseKey, i64>,
        quantity_max: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Adds `received` (> 0) units to a stock row's `available` (creating the row)
    /// unless its on-hand count would pass `on_hand_max`. Answers the row's
    /// (available, reserved) after the change, or `None` when refused.
    fn receive_stock(
        &mut self,
        sku: &str,
        warehouse: &str,
        received: i64,
        now: Timestamp,
        on_hand_max: i64,
    ) -> impl Future<Output = Result<Option<(i64, i64)>, StoreError>> + Send {
        async move {
            statement(
                "INSERT INTO stock (sku, warehouse, available, reserved, version, updated_at) \
                 VALUES ($1, $2, $3, 0, 1, $4) \
                 ON CONFLICT (sku, warehouse) DO UPDATE SET available = stock.available + excluded.available, \
                 version = stock.version + 1, updated_at = excluded.updated_at \
                 WHERE stock.available + stock.reserved + excluded.available <= $5 \
                 RETURNING available, reserved",
            )
            .bind(sku)
            .bind(warehouse)
            .bind(received)
            .bind(now.unix_milliseconds())
            .bind(on_hand_max)
            .fetch_optional_as(self)
                .await
        }
    }

    /// Adds `delta` to a stock row's `available` unless it would go below zero: a
    /// movement's write-off (< 0), or a return's units (> 0), which left this row when
    /// their order was paid. A return is not capped like a receive: the goods are
    /// back on hand whatever the row holds, and the ledger says so.
    /// Answers the row's (available, reserved) after the change, or `None` when
    /// refused or when the row does not exist.
    fn adjust_stock(
        &mut self,
        sku: &str,
        warehouse: &str,
        delta: i64,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<(i64, i64)>, StoreError>> + Send {
        async move {
            statement(
                "UPDATE stock SET available = available + $3, version = version + 1, updated_at = $4 \
                 WHERE sku = $1 AND warehouse = $2 AND available + $3 >= 0 \
                 RETURNING available, reserved",
            )
            .bind(sku)
            .bind(warehouse)
            .bind(delta)
            .bind(now.unix_milliseconds())
            .fetch_optional_as(self)
                .await
        }
    }

    /// Sets a cart line's quantity, creating the line.
    fn put_cart_item(
        &mut self,
        user: &str,
        sku: &str,
        shop: &str,
        quantity: i64,
        now: Timestamp,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        async move {
            statement(
                "INSERT INTO cart_item (user_id, sku, shop, quantity, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $5) \
                 ON CONFLICT (user_id, sku) DO UPDATE SET quantity = excluded.quantity, updated_at = excluded.updated_at",
            )
            .bind(user)
            .bind(sku)
            .bind(shop)
            .bind(quantity)
            .bind(now.unix_milliseconds())
            .execute(self)
                .await
        }
    }

    /// Serializes shelf batches of one shop until the commit.
    fn lock_shop(&mut self, shop: &ShopCode)
    -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Serializes the writers of the shelf log from their lines' insert, the last
    /// thing before the commit, to the commit. The log is paged by id, and an id is
    /// drawn at the insert, not at the commit: without it, a batch of one shop could
    /// draw lower ids than another shop's batch yet commit after it, and a reader
    /// already past the second's ids (`after`) would never see the first's entries.
    fn lock_shelf_log(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Locks every stock row of these SKUs in the global (sku, warehouse) order.
    fn lock_stock_of_skus(
        &mut self,
        skus: &[&SkuCode],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The idempotency records of these keys.
    fn existing_records(
        &mut self,
        keys: &[&str],
    ) -> impl Future<Output = Result<FoundRecords, StoreError>> + Send;

    /// Locks these stock rows in the global order; answers their available counts and
    /// their SKUs' facts. A row that does not exist is absent from the answer.
    fn lock_stock_rows(
        &mut self,
        wanted: &[StockKey],
    ) -> impl Future<Output = Result<LockedStock, StoreError>> + Send;

    /// The facts (sale status, shop, per-user limit) of these SKUs.
    fn sku_facts(
        &mut self,
        skus: &[&SkuCode],
    ) -> impl Future<Output = Result<HashMap<SkuCode, SkuFacts>, StoreError>> + Send;

    /// The one writer of reservations: takes each stock row's total with a conditional
    /// update (answering how many rows it took), and inserts the reservations
    /// (`RESERVED`) with their lines and `reserve` ledger rows.
    fn write_reservations(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Writes a decided reservation batch: what [`Dialect::write_reservations`] writes,
    /// and the idempotency records.
    fn write_batch(
        &mut self,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> impl Future<Output = Result<BatchWritten, StoreError>> + Send;
}

/// A transaction's end: every backend's transaction commits or rolls back through
/// this, so a unit of work never sees the driver's error type.
pub trait Finish: Sized + Send {
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn rollback(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A database reached through pools: where transactions and connections come from.
pub trait Backend: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// The driver's connection, which runs statements in the backend's dialect.
    type Connection: Dialect;
    /// A transaction; dereferences to its connection.
    type Transaction: DerefMut<Target = Self::Connection> + Finish;
    /// A connection taken from a pool outside any transaction.
    type Pooled: DerefMut<Target = Self::Connection> + Send;

    /// The name `Store::backend_name` reports.
    const NAME: &'static str;

    /// A transaction that will write: holds the write lock from its first statement
    /// where the database has a single writer.
    fn begin_write(&self) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;
    /// A write transaction with a reservation batch's first read: the idempotency
    /// records of these keys and these stock rows, as [`Dialect::existing_records`] and
    /// [`Dialect::lock_stock_rows`] answer them, for a backend that sets
    /// [`Dialect::READS_RECORDS_WITH_STOCK_ROWS`]. SQLite sends its `BEGIN IMMEDIATE`
    /// and both reads as one command; this default begins, then reads one after the
    /// other, and is only as good as the two reads.
    fn begin_write_reading(
        &self,
        keys: &[&str],
        wanted: &[StockKey],
    ) -> impl Future<Output = Result<(Self::Transaction, FoundRecords, LockedStock), StoreError>> + Send
    {
        async move {
            let mut transaction = self.begin_write().await?;
            let records = transaction.existing_records(keys).await?;
            let stock = transaction.lock_stock_rows(wanted).await?;
            Ok((transaction, records, stock))
        }
    }
    /// Writes a decided reservation batch ([`Dialect::write_batch`]), checks that it
    /// changed the rows and stored the records it planned to
    /// ([`check_written`](crate::units::batch::check_written)), and commits. SQLite
    /// sends the writes, the database's check of their counts and `COMMIT` as one
    /// command; this default writes, checks, then commits.
    fn write_batch_and_commit(
        &self,
        transaction: Self::Transaction,
        totals: &BTreeMap<StockKey, i64>,
        reservations: &[NewReservation<'_>],
        records: &[(&IdempotencyClaim, &StoredResponse)],
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            let mut transaction = transaction;
            let written = transaction
                .write_batch(totals, reservations, records, now)
                .await?;
            crate::units::batch::check_written(&written, totals.len(), records.len())?;
            transaction.commit().await
        }
    }
    /// A sequencer step's write: numbers up to `limit` committed events that have no
    /// position yet, in write order, after the last position handed out, advances the
    /// sequencer's row and commits; answers how many it numbered. SQLite sends it as
    /// one command; this default reads the locked row, numbers, advances, then commits.
    fn sequence_waiting_events(
        &self,
        limit: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        crate::units::outbox::sequence_waiting_events(self, limit)
    }
    /// A transaction on the writer that only reads: for reads that decide.
    fn begin_writer_read(
        &self,
    ) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;
    /// A read-only transaction whose reads all see one snapshot (the audit's).
    fn begin_snapshot(&self) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;
    /// A connection that reads the writer's data outside any transaction, for reads
    /// that decide (SQLite: its read pool, on the same file).
    fn writer_read_connection(
        &self,
    ) -> impl Future<Output = Result<Self::Pooled, StoreError>> + Send;
    /// A connection of the writer, for statements outside a transaction (migrations'
    /// bookkeeping).
    fn write_connection(&self) -> impl Future<Output = Result<Self::Pooled, StoreError>> + Send;

    /// The connection a run of migrations holds its session lock on
    /// (`MIGRATION_SESSION_LOCK`): by default the writer's. A backend whose sessions
    /// carry a statement bound lifts it here (a migration may rewrite a large table for
    /// minutes, and one killed half way is not rolled back where DDL commits by itself).
    fn migration_connection(
        &self,
    ) -> impl Future<Output = Result<Self::Pooled, StoreError>> + Send {
        self.write_connection()
    }

    /// A transaction for a display read: on a replica in the rotation that can serve
    /// `reader` (replayed past its token), otherwise on the writer — the default, for
    /// backends stockd does not replicate, whose writes all answer the origin: a
    /// token past it names no write and is refused. The only way to a replica.
    fn begin_display(
        &self,
        reader: &ReadHandle,
    ) -> impl Future<Output = Result<(Self::Transaction, Served), StoreError>> + Send {
        let ahead = reader
            .token()
            .filter(|token| !token.is_reached_by(domain::ConsistencyToken::ORIGIN));
        async move {
            if let Some(token) = ahead {
                return Err(StoreError::TokenAhead(token));
            }
            Ok((
                self.begin_writer_read().await?,
                Served::primary(Some(domain::Fallback::NoReplicaInRotation)),
            ))
        }
    }

    /// A display read on the replica that `served` names failed: it leaves the
    /// rotation (the read is then run again on the writer).
    fn display_failed(&self, served: &Served, error: &StoreError) {
        let _ = (served, error);
    }

    /// A position at or past every commit finished before the call (the
    /// `Stockd-Consistency-Token` of a write's answer). Backends without replicas
    /// answer the origin, which every reader has passed.
    fn consistency_token(
        &self,
    ) -> impl Future<Output = Result<ConsistencyToken, StoreError>> + Send {
        async { Ok(ConsistencyToken::ORIGIN) }
    }

    /// Whether display reads may go to replicas at all.
    fn has_replicas(&self) -> bool {
        false
    }

    /// One step of the replica monitor: samples every replica's lag and updates the
    /// rotation. Nothing without replicas.
    fn sample_replicas(&self) -> impl Future<Output = Vec<ReplicaHealth>> + Send {
        async { Vec::new() }
    }
    fn limits(&self) -> &StoreLimits;
    /// What the pools are doing now.
    fn pool_usage(&self) -> PoolUsage;
    fn close(&self) -> impl Future<Output = ()> + Send;

    /// The same database through a writer pool of its own, of at most `connections`,
    /// connecting lazily: a connection's socket belongs to the runtime that opened it,
    /// so a pool used from another runtime should be opened there. Closing it closes
    /// only its own pool. `None` where the pool is to be shared: SQLite's one writer,
    /// and MySQL, where an own pool was measured slower.
    fn with_own_pool(&self, connections: u32) -> Option<Self>;

    /// The whole-batch fast path (see [`Dialect::WHOLE_BATCH_FAST_PATH`]): looks up the
    /// keys, locks the rows and, when every request fits, writes and commits the batch
    /// in one round trip. Anything else writes nothing and answers
    /// [`WholeBatch::NotApplied`], as a backend without the fast path always does
    /// (the default; it is never called there).
    fn reserve_whole_batch(
        &self,
        _totals: &BTreeMap<StockKey, i64>,
        _reservations: &[NewReservation<'_>],
        _records: &[(&IdempotencyClaim, &StoredResponse)],
        _now: Timestamp,
    ) -> impl Future<Output = Result<WholeBatch, StoreError>> + Send {
        async { Ok(WholeBatch::NotApplied) }
    }
}

/// What the database shows of its sessions, for the sampled lock and transaction
/// gauges; `None` where the backend cannot tell (docs/OPERATIONS.md says what
/// replaces each there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DatabaseActivity {
    pub sessions_waiting_on_locks: Option<i64>,
    pub long_transactions: Option<i64>,
    pub stock_sequential_scans: Option<i64>,
    pub stock_pages: Option<i64>,
    /// How far this instance's clock is ahead of the database server's (behind when
    /// negative), read against the middle of the query's round trip.
    pub clock_ahead_of_database_milliseconds: Option<i64>,
}

/// What a backend's pools are doing, for the pool gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    /// Connections lent out.
    pub active: u64,
    /// Connections open and free.
    pub idle: u64,
    /// Callers waiting for a connection (and its `BEGIN`) right now.
    pub waiting: i64,
    /// Waits that gave up (`acquire_timeout_milliseconds`) since the start.
    pub acquire_timeouts: u64,
}

/// A pooled connection idle at least this long is pinged before it is handed out.
pub const PING_WHEN_IDLE_FOR_MILLISECONDS: u64 = 1_000;

/// Pool options with the acquire test every stockd pool uses. sqlx pings a connection
/// when it is released (and closes it if that fails) and, by default, again when it is
/// acquired: a round trip before every batch's call, which cost the hot path about a
/// tenth at 64 clients (docs/BENCHMARKS.md, twelfth session). A connection released less than
/// [`PING_WHEN_IDLE_FOR_MILLISECONDS`] ago was just found alive, so only one idle longer
/// is pinged first: a connection the server dropped while it sat idle (a restart, a
/// failover, an idle timeout) is still replaced before use.
pub fn pool_options<Database: sqlx::Database>() -> sqlx::pool::PoolOptions<Database> {
    pool_options_pinging_after(std::time::Duration::from_millis(
        PING_WHEN_IDLE_FOR_MILLISECONDS,
    ))
}

/// [`pool_options`] with another idle bound (tests use zero: no waiting for the bound).
pub fn pool_options_pinging_after<Database: sqlx::Database>(
    bound: std::time::Duration,
) -> sqlx::pool::PoolOptions<Database> {
    sqlx::pool::PoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(move |connection, metadata| {
            Box::pin(async move {
                if metadata.idle_for >= bound {
                    sqlx::Connection::ping(connection).await?;
                }
                Ok(true)
            })
        })
}

/// A pool like `pool` (its timeouts and checks) whose sessions connect with `options`
/// (the caller's copy of `pool`'s, changed where it needs), holding at most
/// `connections`, each opened when first needed. It has no reaper:
/// sqlx would run the reaper on the runtime that creates the pool, not the one that
/// uses it; its few connections are busy, and a dead one is found by the ping before
/// it is lent out (`pool_options`).
pub(crate) fn sibling_pool<Database: sqlx::Database>(
    pool: &sqlx::Pool<Database>,
    connections: u32,
    options: <Database::Connection as sqlx::Connection>::Options,
) -> sqlx::Pool<Database> {
    pool.options()
        .clone()
        .min_connections(0)
        .max_connections(connections.max(1))
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options)
}

/// Counts who waits for a pooled connection, and the waits that timed out: sqlx's
/// pools report their size and idle connections, not their queue.
#[derive(Debug, Clone, Default)]
pub struct PoolWatch {
    waiting: std::sync::Arc<std::sync::atomic::AtomicI64>,
    acquire_timeouts: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl PoolWatch {
    /// Runs `acquire` (a pool's `acquire` or `begin`) counted as a wait.
    pub(crate) async fn acquiring<T>(
        &self,
        acquire: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        use std::sync::atomic::Ordering;
        struct Waiting<'a>(&'a std::sync::atomic::AtomicI64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&self.waiting);
        let acquired = acquire.await;
        drop(waiting);
        if matches!(acquired, Err(sqlx::Error::PoolTimedOut)) {
            self.acquire_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        acquired.map_err(StoreError::from)
    }

    /// The usage of `pools`, watched by this.
    pub(crate) fn usage<D: sqlx::Database>(&self, pools: &[&sqlx::Pool<D>]) -> PoolUsage {
        use std::sync::atomic::Ordering;
        let mut usage = PoolUsage {
            waiting: self.waiting.load(Ordering::Relaxed).max(0),
            acquire_timeouts: self.acquire_timeouts.load(Ordering::Relaxed),
            ..PoolUsage::default()
        };
        for pool in pools {
            let size = u64::from(pool.size());
            let idle = u64::try_from(pool.num_idle()).unwrap_or(u64::MAX);
            usage.idle += idle.min(size);
            usage.active += size.saturating_sub(idle);
        }
        usage
    }
}

/// Implements [`Finish`] for an sqlx database's transactions.
macro_rules! finish_through_sqlx {
    ($database:ty) => {
        impl $crate::backend::Finish for sqlx::Transaction<'static, $database> {
            async fn commit(self) -> Result<(), $crate::error::StoreError> {
                Ok(sqlx::Transaction::commit(self).await?)
            }

            async fn rollback(self) -> Result<(), $crate::error::StoreError> {
                Ok(sqlx::Transaction::rollback(self).await?)
            }
        }
    };
}
pub(crate) use finish_through_sqlx;

/// The [`Backend`] methods of a backend that keeps one pool (`self.pool`) for every unit
/// of work and its bounds in `self.limits`: written inside its `impl Backend`.
/// `$also` names fields whose own `close` runs after the pool's (a backend's replicas).
macro_rules! one_pool_backend_methods {
    ($($also:ident),*) => {
        async fn begin_write(&self) -> Result<Self::Transaction, $crate::error::StoreError> {
            self.watch.acquiring(self.pool.begin()).await
        }

        async fn begin_writer_read(&self) -> Result<Self::Transaction, $crate::error::StoreError> {
            self.watch.acquiring(self.pool.begin()).await
        }

        async fn writer_read_connection(&self) -> Result<Self::Pooled, $crate::error::StoreError> {
            self.watch.acquiring(self.pool.acquire()).await
        }

        async fn write_connection(&self) -> Result<Self::Pooled, $crate::error::StoreError> {
            self.watch.acquiring(self.pool.acquire()).await
        }

        fn pool_usage(&self) -> $crate::backend::PoolUsage {
            self.watch.usage(&[&self.pool])
        }

        fn limits(&self) -> &$crate::StoreLimits {
            &self.limits
        }

        async fn close(&self) {
            self.pool.close().await;
            $(self.$also.close().await;)*
        }
    };
}
pub(crate) use one_pool_backend_methods;

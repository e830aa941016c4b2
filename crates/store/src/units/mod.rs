//! The units of work: each is written once, generic over the [`Backend`] it runs on.
//!
//! A unit of work opens one short transaction, touches stock rows in (sku, warehouse)
//! order, checks the affected-row count of every conditional update, writes its ledger
//! rows and stores its answer under its idempotency key, all committed together. No
//! unit of work calls anything but the database.

pub(crate) mod audit;
pub(crate) mod batch;
pub(crate) mod campaigns;
pub(crate) mod carts;
pub(crate) mod catalog;
pub(crate) mod credentials;
pub(crate) mod decode;
pub(crate) mod idempotency;
pub mod live_audit;
pub(crate) mod migrations;
pub(crate) mod orders;
pub mod outbox;
pub(crate) mod payments;
pub(crate) mod refunds;
pub(crate) mod reservations;
pub(crate) mod schedules;
pub(crate) mod shelf;
pub(crate) mod stock;
pub(crate) mod tallies;

use domain::{ConsistencyToken, Timestamp};

use crate::backend::Backend;
use crate::error::StoreError;
use crate::replicas::{Displayed, ReadHandle, ReplicaHealth};

/// The units of work of one backend; [`crate::Store`] holds one per backend it speaks.
#[derive(Debug, Clone)]
pub struct Units<B: Backend> {
    backend: B,
    /// Shared by the clones, as the backend's pool is.
    campaign_limits: std::sync::Arc<batch::CampaignLimits>,
}

impl<B: Backend> Units<B> {
    pub fn new(backend: B) -> Units<B> {
        Units {
            backend,
            campaign_limits: std::sync::Arc::default(),
        }
    }

    async fn begin_write(&self) -> Result<B::Transaction, StoreError> {
        self.backend.begin_write().await
    }

    async fn begin_writer_read(&self) -> Result<B::Transaction, StoreError> {
        self.backend.begin_writer_read().await
    }

    async fn begin_snapshot(&self) -> Result<B::Transaction, StoreError> {
        self.backend.begin_snapshot().await
    }

    async fn writer_read_connection(&self) -> Result<B::Pooled, StoreError> {
        self.backend.writer_read_connection().await
    }

    async fn write_connection(&self) -> Result<B::Pooled, StoreError> {
        self.backend.write_connection().await
    }

    /// The writer's position after every commit finished so far.
    pub async fn consistency_token(&self) -> Result<ConsistencyToken, StoreError> {
        self.backend.consistency_token().await
    }

    pub fn has_replicas(&self) -> bool {
        self.backend.has_replicas()
    }

    /// One step of the replica monitor.
    pub async fn sample_replicas(&self) -> Vec<ReplicaHealth> {
        self.backend.sample_replicas().await
    }

    pub fn pool_usage(&self) -> crate::backend::PoolUsage {
        self.backend.pool_usage()
    }

    pub async fn negative_stock_rows(&self) -> Result<i64, StoreError> {
        crate::sql::statement("SELECT COUNT(*) FROM stock WHERE available < 0 OR reserved < 0")
            .fetch_one_scalar(&mut *self.writer_read_connection().await?)
            .await
    }

    /// The sampled session gauges, from one connection, each query where the backend
    /// has one (the clock's is [`Units::clock_ahead_of_database`]).
    pub async fn database_activity(
        &self,
        long_transaction_milliseconds: i64,
    ) -> Result<crate::backend::DatabaseActivity, StoreError> {
        use crate::backend::Dialect;
        use crate::sql::statement;
        let mut connection = self.writer_read_connection().await?;
        let mut activity = crate::backend::DatabaseActivity::default();
        if let Some(query) = <B::Connection as Dialect>::SESSIONS_WAITING_ON_LOCKS {
            activity.sessions_waiting_on_locks =
                Some(statement(query).fetch_one_scalar(&mut *connection).await?);
        }
        if let Some(query) = <B::Connection as Dialect>::LONG_TRANSACTIONS {
            activity.long_transactions = Some(
                statement(query)
                    .bind(long_transaction_milliseconds)
                    .fetch_one_scalar(&mut *connection)
                    .await?,
            );
        }
        if let Some(query) = <B::Connection as Dialect>::STOCK_SEQUENTIAL_SCANS {
            activity.stock_sequential_scans =
                Some(statement(query).fetch_one_scalar(&mut *connection).await?);
        }
        if let Some(query) = <B::Connection as Dialect>::STOCK_PAGES {
            activity.stock_pages = Some(statement(query).fetch_one_scalar(&mut *connection).await?);
        }
        Ok(activity)
    }

    /// How far `local_now` (the instance's clock) is ahead of the database server's,
    /// where the backend can tell. On its own, not among the gauges of
    /// [`Units::database_activity`]: those read tables a least-privileged user may not
    /// (MySQL's `innodb_trx` wants `PROCESS`), and the clock must not go unread with
    /// them.
    pub async fn clock_ahead_of_database(
        &self,
        local_now: &(dyn Fn() -> Timestamp + Sync),
    ) -> Result<Option<i64>, StoreError> {
        use crate::backend::Dialect;
        use crate::sql::statement;
        let Some(query) = <B::Connection as Dialect>::DATABASE_CLOCK_UNIX_MILLISECONDS else {
            return Ok(None);
        };
        let mut connection = self.writer_read_connection().await?;
        // Read on a connection already held, so a wait for the pool is not taken for
        // skew: what is left is half the round trip at most.
        let before = local_now().unix_milliseconds();
        let database: i64 = statement(query).fetch_one_scalar(&mut *connection).await?;
        let after = local_now().unix_milliseconds();
        let middle = before + (after - before) / 2;
        Ok(Some(middle - database))
    }

    fn limits(&self) -> &crate::StoreLimits {
        self.backend.limits()
    }

    pub async fn close(&self) {
        self.backend.close().await
    }

    /// These units of work through a writer pool of their own (see
    /// [`Backend::with_own_pool`]); what they cache is still shared.
    pub fn with_own_pool(&self, connections: u32) -> Option<Units<B>> {
        Some(Units {
            backend: self.backend.with_own_pool(connections)?,
            campaign_limits: std::sync::Arc::clone(&self.campaign_limits),
        })
    }
}

/// A display read: runs `$read` (an expression using the transaction `$transaction`)
/// in a transaction from [`Backend::begin_display`], so on a replica when one can
/// serve `$reader`; when the read fails there, the replica leaves the rotation and the
/// read runs again on the writer. Answers a [`Displayed`] made at `$now`.
macro_rules! displayed {
    ($units:expr, $reader:expr, $now:expr, |$transaction:ident| $read:expr) => {{
        let units = $units;
        let (mut $transaction, served) = units.begin_display($reader).await?;
        let first = $read;
        let _ = $crate::backend::Finish::rollback($transaction).await;
        match first {
            Err(error) if served.by == domain::ServedBy::Replica => {
                units.display_failed(&served, &error);
                let mut $transaction = units.begin_writer_read().await?;
                let again = $read;
                let _ = $crate::backend::Finish::rollback($transaction).await;
                let served =
                    $crate::replicas::Served::primary(Some(domain::Fallback::ReplicaFailed));
                again.map(|value| units.displayed(value, &served, $now))
            }
            result => result.map(|value| units.displayed(value, &served, $now)),
        }
    }};
}
pub(crate) use displayed;

impl<B: Backend> Units<B> {
    async fn begin_display(
        &self,
        reader: &ReadHandle,
    ) -> Result<(B::Transaction, crate::replicas::Served), StoreError> {
        self.backend.begin_display(reader).await
    }

    fn display_failed(&self, served: &crate::replicas::Served, error: &StoreError) {
        self.backend.display_failed(served, error);
    }

    fn displayed<T>(
        &self,
        value: T,
        served: &crate::replicas::Served,
        now: Timestamp,
    ) -> Displayed<T> {
        Displayed {
            value,
            served_by: served.by,
            fallback: served.fallback,
            as_of: served.as_of(now),
        }
    }
}

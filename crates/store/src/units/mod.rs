//! The units of work: each is written once, generic over the [`Backend`] it runs on.
//!
//! A unit of work opens one short transaction, touches stock rows in (sku, warehouse)
//! order, checks the affected-row count of every conditional update, writes its ledger
//! rows and stores its answer under its idempotency key, all committed together. No
//! unit of work calls anything but the database.

pub(crate) mod audit;
pub(crate) mod batch;
pub(crate) mod carts;
pub(crate) mod catalog;
pub(crate) mod credentials;
pub(crate) mod decode;
pub(crate) mod idempotency;
pub(crate) mod migrations;
pub(crate) mod orders;
pub(crate) mod payments;
pub(crate) mod refunds;
pub(crate) mod reservations;
pub(crate) mod schedules;
pub(crate) mod shelf;
pub(crate) mod stock;
pub(crate) mod tallies;

use crate::backend::Backend;
use crate::error::StoreError;

/// The units of work of one backend; [`crate::Store`] holds one per backend it speaks.
#[derive(Debug, Clone)]
pub struct Units<B: Backend> {
    backend: B,
}

impl<B: Backend> Units<B> {
    pub fn new(backend: B) -> Units<B> {
        Units { backend }
    }

    async fn begin_write(&self) -> Result<B::Transaction, StoreError> {
        self.backend.begin_write().await
    }

    async fn begin_read(&self) -> Result<B::Transaction, StoreError> {
        self.backend.begin_read().await
    }

    async fn begin_snapshot(&self) -> Result<B::Transaction, StoreError> {
        self.backend.begin_snapshot().await
    }

    async fn read_connection(&self) -> Result<B::Pooled, StoreError> {
        self.backend.read_connection().await
    }

    async fn write_connection(&self) -> Result<B::Pooled, StoreError> {
        self.backend.write_connection().await
    }

    fn limits(&self) -> &crate::StoreLimits {
        self.backend.limits()
    }

    pub async fn close(&self) {
        self.backend.close().await
    }
}

//! Keeping the display cache honest: the invalidator follows the outbox's events (in
//! commit order, like any feed reader) and drops the cached view of every product an
//! event is about — the products of the SKUs whose stock, reservations or sale status
//! changed. Handlers never drop anything: a change announces itself, and the event
//! does the rest (DESIGN.md principle 12).

use std::collections::BTreeSet;
use std::sync::Arc;

use cache::{CacheKey, DisplayCache};
use domain::FeedCursor;
use serde_json::Value;
use store::PublishedEvent;

use crate::{Engine, EngineError, log_store_error};

/// Events the invalidator reads per step.
const EVENTS_PER_INVALIDATION_STEP_MAX: i64 = 1_000;

/// What one invalidation step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidationStep {
    /// Where the next step starts.
    pub cursor: FeedCursor,
    pub events: usize,
    /// Keys dropped.
    pub dropped: usize,
}

impl Engine {
    /// Serves display reads from `cache` (the product view) and starts dropping its
    /// keys on events (the worker `workers::spawn_cache_invalidator`).
    pub fn attach_display_cache(&self, cache: Arc<DisplayCache>) {
        let _ = self.inner.display_cache.set(cache);
    }

    pub fn display_cache(&self) -> Option<&Arc<DisplayCache>> {
        self.inner.display_cache.get()
    }

    /// Where an invalidator that starts now begins: after every event numbered so far
    /// (values cached before were dropped by the invalidators running then, or expire).
    pub async fn latest_event_cursor(&self) -> Result<FeedCursor, EngineError> {
        self.inner
            .store
            .latest_event_position()
            .await
            .map(FeedCursor::of_position)
            .map_err(|error| log_store_error("latest_event_position", error))
    }

    /// One invalidation step: the events after `cursor`, and the cached views they
    /// make stale dropped. The cursor moves on only once Redis took the drops, so a
    /// Redis that was down gets them when it is back.
    pub async fn cache_invalidation_step(
        &self,
        cursor: FeedCursor,
    ) -> Result<InvalidationStep, EngineError> {
        let Some(cache) = self.display_cache() else {
            return Ok(InvalidationStep {
                cursor,
                events: 0,
                dropped: 0,
            });
        };
        let events = self
            .inner
            .store
            .events_after(cursor, None, EVENTS_PER_INVALIDATION_STEP_MAX)
            .await
            .map_err(|error| log_store_error("invalidation_events", error))?;
        let Some(last) = events.last() else {
            return Ok(InvalidationStep {
                cursor,
                events: 0,
                dropped: 0,
            });
        };
        let next = FeedCursor::of_position(last.position);
        let (skus, mut products) = touched(&events);
        let skus: Vec<String> = skus.into_iter().collect();
        let owners = self
            .inner
            .store
            .products_of_skus(&skus)
            .await
            .map_err(|error| log_store_error("products_of_skus", error))?;
        products.extend(owners);
        let keys: Vec<CacheKey> = products.into_iter().map(CacheKey::ProductView).collect();
        if let Err(error) = cache.invalidate(&keys).await {
            metrics::counter!("stockd_cache_errors_total", "operation" => "invalidate")
                .increment(1);
            return Err(EngineError::Unavailable(error.to_string()));
        }
        metrics::counter!("stockd_cache_invalidations_total").increment(keys.len() as u64);
        Ok(InvalidationStep {
            cursor: next,
            events: events.len(),
            dropped: keys.len(),
        })
    }
}

/// The SKUs and products events are about: a reservation's lines, a movement's or a
/// shelf change's SKU, a shelf change's product.
fn touched(events: &[PublishedEvent]) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut skus = BTreeSet::new();
    let mut products = BTreeSet::new();
    for event in events {
        let data = &event.data;
        if let Some(sku) = data.get("sku").and_then(Value::as_str) {
            skus.insert(sku.to_owned());
        }
        if let Some(product) = data.get("product_id").and_then(Value::as_str) {
            products.insert(product.to_owned());
        }
        for line in data
            .get("lines")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(sku) = line.get("sku").and_then(Value::as_str) {
                skus.insert(sku.to_owned());
            }
        }
    }
    (skus, products)
}

//! Which shop a SKU belongs to, remembered by this process.
//!
//! A SKU's shop is set when the SKU is created and never changes, and SKUs are never
//! removed (a delete is a sale status). So a shop once read stays true for good: the
//! reservation path checks a caller's shop against this map without a database round
//! trip, and only a SKU this process has not seen costs a read. The reserving
//! transaction checks the shop again for any SKU that was unknown here.

use std::collections::HashMap;
use std::sync::RwLock;

use domain::{Action, Principal, ShopCode, SkuCode, authorize};
use store::ShopScope;

use crate::{Engine, EngineError, log_store_error};

/// SKUs remembered at most; past it the map starts over (every entry is cheap to read
/// again).
const SKU_SHOPS_REMEMBERED_MAX: usize = 200_000;

#[derive(Default)]
pub struct SkuShops {
    known: RwLock<HashMap<SkuCode, ShopCode>>,
}

impl SkuShops {
    fn get(&self, sku: &SkuCode) -> Option<ShopCode> {
        self.known
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(sku)
            .cloned()
    }

    /// The one shop of `skus` when every one of them is known here; `None` when some
    /// are not, or they name several shops (the slow path sorts that out).
    fn common_shop(&self, skus: &[&SkuCode]) -> Option<ShopCode> {
        let known = self
            .known
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut common: Option<&ShopCode> = None;
        for sku in skus {
            let shop = known.get(*sku)?;
            if common.is_some_and(|first| first != shop) {
                return None;
            }
            common = Some(shop);
        }
        common.cloned()
    }

    fn remember(&self, found: HashMap<SkuCode, ShopCode>) {
        let mut known = self
            .known
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if known.len() + found.len() > SKU_SHOPS_REMEMBERED_MAX {
            known.clear();
        }
        known.extend(found);
    }
}

impl Engine {
    /// The shops of `skus` that exist, from memory where this process has seen them.
    pub(crate) async fn shops_of(
        &self,
        skus: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, ShopCode>, EngineError> {
        let shops = &self.inner.sku_shops;
        let mut found = HashMap::with_capacity(skus.len());
        let mut unknown = Vec::new();
        for sku in skus {
            match shops.get(sku) {
                Some(shop) => {
                    found.insert((*sku).clone(), shop);
                }
                None => unknown.push(*sku),
            }
        }
        if !unknown.is_empty() {
            let read = self
                .inner
                .store
                .sku_shops(&unknown)
                .await
                .map_err(|error| log_store_error("sku_shops", error))?;
            found.extend(read.clone());
            shops.remember(read);
        }
        Ok(found)
    }

    /// Checks that `principal` may take `action` on every one of `skus`, which must
    /// all be of one shop, and says how far that was verified: every SKU known (its
    /// shop checked here), or some unknown (the transaction checks them).
    pub(crate) async fn scope_of_skus(
        &self,
        principal: &Principal,
        action: Action,
        skus: &[&SkuCode],
    ) -> Result<ShopScope, EngineError> {
        authorize(principal, action, None).map_err(|denied| EngineError::Forbidden(denied.0))?;
        // The hot path: every SKU seen before, all of one shop; no map built.
        if let Some(shop) = self.inner.sku_shops.common_shop(skus) {
            authorize(principal, action, Some(&shop))
                .map_err(|denied| EngineError::Forbidden(denied.0))?;
            return Ok(ShopScope::Verified(shop));
        }
        // A SKU not seen before: boxed, so the hot path's future stays small.
        let shops = crate::cold(self.shops_of(skus)).await?;
        let mut shop: Option<&ShopCode> = None;
        for found in shops.values() {
            authorize(principal, action, Some(found))
                .map_err(|denied| EngineError::Forbidden(denied.0))?;
            match shop {
                Some(first) if first != found => {
                    return Err(EngineError::Refused {
                        code: domain::ErrorCode::FailedPrecondition,
                        detail: "a reservation's SKUs must all belong to one shop".into(),
                    });
                }
                _ => shop = Some(found),
            }
        }
        Ok(match (shop, shops.len() == skus.len()) {
            (Some(shop), true) => ShopScope::Verified(shop.clone()),
            (Some(shop), false) => ShopScope::Required(shop.clone()),
            (None, _) => match principal.shop() {
                Some(own) => ShopScope::Required(own.clone()),
                None => ShopScope::Any,
            },
        })
    }

    /// The shop of one SKU, or `not_found`.
    pub(crate) async fn shop_of(&self, sku: &SkuCode) -> Result<Option<ShopCode>, EngineError> {
        Ok(self.shops_of(&[sku]).await?.remove(sku))
    }
}

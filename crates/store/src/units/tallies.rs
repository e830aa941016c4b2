//! Per-shopper tallies (open holds, purchases of a SKU): locked after the stock rows,
//! in key order, by every writer that changes them.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::decode::expect_one_row;
use super::reservations::{Moved, reservation_lines_of};
use super::stock::STOCK_ON_HAND_MAX;
use crate::backend::Dialect;
use crate::error::StoreError;
use crate::model::{ReservationAction, ReserveRequest};
use crate::plan::{PurchaseKey, ShopperKey, SkuFacts, Tallies};
use crate::sql::statement;
use domain::{ShopCode, SkuCode, UserId};
use std::collections::HashMap;

/// Locks and reads the tallies of the shoppers that `requests` name (open holds, and
/// units of SKUs with a per-user limit), in key order. Reservations without a user
/// read nothing.
pub(crate) async fn lock_tallies<'a, C: Dialect>(
    transaction: &mut C,
    requests: impl Iterator<Item = &'a ReserveRequest>,
    skus: &HashMap<SkuCode, SkuFacts>,
    open_holds_max: i64,
) -> Result<Tallies, StoreError> {
    let mut shoppers: Vec<ShopperKey> = Vec::new();
    let mut purchases: Vec<PurchaseKey> = Vec::new();
    for request in requests {
        let Some(user) = &request.user else { continue };
        // The shop the request will be decided in: its first SKU's (a request of
        // several shops is refused anyway).
        let Some(shop) = request
            .lines
            .first()
            .and_then(|line| skus.get(&line.sku))
            .map(|facts| facts.shop.clone())
        else {
            continue;
        };
        for line in &request.lines {
            if domain::plan::limit_of(line, skus).is_some() {
                purchases.push((
                    shop.clone(),
                    user.clone(),
                    domain::campaign::tally_sku(&line.sku, &line.warehouse),
                ));
            }
        }
        shoppers.push((shop, user.clone()));
    }
    read_tallies(transaction, shoppers, purchases, open_holds_max).await
}

/// The tallies of these shoppers, locked (PostgreSQL) in key order.
pub(crate) async fn read_tallies<C: Dialect>(
    transaction: &mut C,
    mut shoppers: Vec<ShopperKey>,
    mut purchases: Vec<PurchaseKey>,
    open_holds_max: i64,
) -> Result<Tallies, StoreError> {
    shoppers.sort();
    shoppers.dedup();
    purchases.sort();
    purchases.dedup();
    let mut tallies = Tallies {
        open_holds_max,
        ..Tallies::default()
    };
    let (holds, bought) = transaction
        .lock_tallies_of_all(&shoppers, &purchases)
        .await?;
    for shopper in shoppers {
        let open = holds.get(&shopper).copied().unwrap_or(0);
        tallies.open_holds.insert(shopper, open);
    }
    for purchase in purchases {
        let quantity = bought.get(&purchase).copied().unwrap_or(0);
        tallies.purchased.insert(purchase, quantity);
    }
    Ok(tallies)
}

/// Adds a decided batch's holds and units to the shoppers' tallies. Each write is
/// conditional on the bound (the open-hold bound, the SKU's per-user limit), so the
/// database refuses what the decision should never have allowed: a tally another
/// process moved since it was read makes the batch retry, and then decide again.
pub(crate) async fn add_to_tallies<C: Dialect>(
    transaction: &mut C,
    holds_added: &std::collections::BTreeMap<ShopperKey, i64>,
    purchases_added: &std::collections::BTreeMap<PurchaseKey, i64>,
    open_holds_max: i64,
) -> Result<(), StoreError> {
    let (holds_written, purchases_written) = transaction
        .add_tallies_of_all(
            holds_added,
            open_holds_max,
            purchases_added,
            STOCK_ON_HAND_MAX,
        )
        .await?;
    let expected = holds_added.len() as u64;
    if holds_written != expected {
        return Err(StoreError::Retryable(format!(
            "the open holds of {} of {expected} shoppers changed since they were read",
            expected.saturating_sub(holds_written)
        )));
    }
    let expected = purchases_added.len() as u64;
    if purchases_written != expected {
        return Err(StoreError::Retryable(format!(
            "what {} of {expected} shoppers hold of a limited sku changed since it was read",
            expected.saturating_sub(purchases_written)
        )));
    }
    Ok(())
}

/// Gives back the units a confirmed reservation counted against its shopper's per-user
/// limits: its order was cancelled after payment and is refunded, so the purchase did
/// not happen and the shopper may buy again. (Its open hold went back at the confirm.)
/// Lowered at most to zero: a tally that holds less than the order's units was written
/// by the first-purchase race, and the refund must not fail on it.
pub(crate) async fn give_back_refunded_units<C: Dialect>(
    transaction: &mut C,
    reservation: &domain::ReservationId,
) -> Result<(), StoreError> {
    let shopper: Option<(Option<String>, Option<String>)> =
        statement("SELECT shop, user_id FROM reservation WHERE id = $1")
            .bind(reservation.as_str())
            .fetch_optional_as(&mut *transaction)
            .await?;
    let Some((Some(shop), Some(user))) = shopper else {
        return Ok(());
    };
    let mut units: std::collections::BTreeMap<SkuCode, i64> = Default::default();
    for line in reservation_lines_of(&mut *transaction, reservation).await? {
        *units
            .entry(domain::campaign::tally_sku(&line.sku, &line.warehouse))
            .or_insert(0) += line.quantity.get();
    }
    for (sku, quantity) in units {
        statement(
            "UPDATE shopper_purchase SET quantity = CASE WHEN quantity >= $4 THEN quantity - $4 ELSE 0 END \
             WHERE shop = $1 AND user_id = $2 AND sku = $3",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(sku.as_str())
        .bind(quantity)
        .execute(&mut *transaction)
        .await?;
    }
    Ok(())
}

/// Gives back what the moved reservations counted against their shoppers, in key
/// order: one open hold each, and on release their units.
pub(crate) async fn give_back_tallies<C: Dialect>(
    transaction: &mut C,
    moved: &[Moved<'_>],
) -> Result<(), StoreError> {
    let mut holds: std::collections::BTreeMap<&ShopperKey, i64> = Default::default();
    let mut units: std::collections::BTreeMap<(&ShopCode, &UserId, SkuCode), i64> =
        Default::default();
    for done in moved {
        let Some(shopper) = &done.shopper else {
            continue;
        };
        *holds.entry(shopper).or_insert(0) += 1;
        if done.action == ReservationAction::Release {
            for line in &done.lines {
                // A campaign's units go back to its tally, not the SKU's.
                let tally = domain::campaign::tally_sku(&line.sku, &line.warehouse);
                *units.entry((&shopper.0, &shopper.1, tally)).or_insert(0) += line.quantity.get();
            }
        }
    }
    for ((shop, user), count) in holds {
        let updated = statement(
            "UPDATE shopper_hold SET open_holds = open_holds - $3 \
             WHERE shop = $1 AND user_id = $2 AND open_holds >= $3",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(count)
        .execute(&mut *transaction)
        .await?;
        expect_one_row(updated, "giving back a shopper's open hold")?;
    }
    for ((shop, user, sku), quantity) in units {
        let updated = statement(
            "UPDATE shopper_purchase SET quantity = quantity - $4 \
             WHERE shop = $1 AND user_id = $2 AND sku = $3 AND quantity >= $4",
        )
        .bind(shop.as_str())
        .bind(user.as_str())
        .bind(sku.as_str())
        .bind(quantity)
        .execute(&mut *transaction)
        .await?;
        expect_one_row(updated, "giving back a shopper's units")?;
    }
    Ok(())
}

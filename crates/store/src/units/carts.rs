//! Carts: setting a line, reading a cart with what stands in each line's way, and
//! (inside a checkout's order transaction) checking and removing the lines it takes.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use std::collections::HashMap;

use super::decode::{invariant, parse_stored, price_of};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::{Units, displayed};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{Cart, CartLine, CartSku};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, Rejection, ResponseRenderer};
use crate::replicas::{Displayed, ReadHandle};
use crate::sql::statement;
use domain::campaign::BUCKET_WAREHOUSE_PREFIX;
use domain::{ErrorCode, ReservationLine, SaleStatus, ShopCode, SkuCode, Timestamp, UserId};

/// Inside a checkout's order transaction: whether the cart still holds every line the
/// order takes, with the quantity the checkout read. The lines are locked until the
/// commit, so a second checkout of the same cart (under another key) waits here and
/// then finds them gone. `Err`: the cart changed since it was read (a line ordered by
/// another checkout, or its quantity changed); nothing may be ordered.
pub(crate) async fn cart_lines_as_read<C: Dialect>(
    transaction: &mut C,
    shop: &ShopCode,
    user: &UserId,
    lines: &[ReservationLine],
) -> Result<Result<(), Rejection>, StoreError> {
    let held: HashMap<String, i64> = statement(C::LOCK_CART_LINES)
        .bind(user.as_str())
        .bind(shop.as_str())
        .fetch_all_as::<(String, i64)>(&mut *transaction)
        .await?
        .into_iter()
        .collect();
    let changed: Vec<&str> = lines
        .iter()
        .filter(|line| held.get(line.sku.as_str()) != Some(&line.quantity.get()))
        .map(|line| line.sku.as_str())
        .collect();
    if changed.is_empty() {
        return Ok(Ok(()));
    }
    Ok(Err(Rejection::new(
        ErrorCode::VersionConflict,
        format!(
            "the cart of '{user}' changed while it was checked out ({} no longer as read: ordered by another checkout, or its quantity changed); read the cart and check out again",
            changed.join(", ")
        ),
    )))
}

/// Takes the lines a checkout's order holds out of the cart, in the order's own
/// transaction, after [`cart_lines_as_read`] found and locked them.
pub(crate) async fn remove_checked_out_lines<C: Dialect>(
    transaction: &mut C,
    shop: &ShopCode,
    user: &UserId,
    lines: &[ReservationLine],
) -> Result<(), StoreError> {
    for line in lines {
        let removed = statement(
            "DELETE FROM cart_item WHERE user_id = $1 AND shop = $2 AND sku = $3 AND quantity = $4",
        )
        .bind(user.as_str())
        .bind(shop.as_str())
        .bind(line.sku.as_str())
        .bind(line.quantity.get())
        .execute(&mut *transaction)
        .await?;
        if removed != 1 {
            return Err(invariant(format!(
                "the locked cart line of '{user}' for sku '{}' vanished before the checkout removed it",
                line.sku
            )));
        }
    }
    Ok(())
}

/// A shopper's cart at `now`, each line with what a checkout would find: the SKU's
/// units available in the default warehouse, or, while a campaign runs on the SKU
/// there, the units in its fullest bucket (a checkout's line draws from one of the
/// campaign's buckets then, and the regular stock is not for it).
pub(crate) async fn load_cart<C: Dialect>(
    connection: &mut C,
    shop: Option<&ShopCode>,
    user: &UserId,
    now: Timestamp,
) -> Result<Cart, StoreError> {
    let rows = statement(
        "SELECT cart_item.shop, cart_item.sku, cart_item.quantity, sku.title, sku.price_minor, sku.currency, sku.sale_status, \
         COALESCE(stock.available, 0) AS available, campaign.code AS campaign_code, \
         CASE WHEN campaign.code IS NULL THEN sku.per_user_limit ELSE campaign.per_user_limit END AS purchase_limit, \
         COALESCE(purchase.quantity, 0) AS purchased \
         FROM cart_item LEFT JOIN sku ON sku.code = cart_item.sku \
         LEFT JOIN stock ON stock.sku = cart_item.sku AND stock.warehouse = 'default' \
         LEFT JOIN campaign ON campaign.open_sku = cart_item.sku AND campaign.warehouse = 'default' \
         AND campaign.starts_at <= $3 AND campaign.ends_at > $3 \
         LEFT JOIN shopper_purchase purchase ON purchase.shop = cart_item.shop \
         AND purchase.user_id = cart_item.user_id \
         AND purchase.sku = COALESCE(campaign.tally_sku, cart_item.sku) \
         WHERE cart_item.user_id = $1 AND ($2 IS NULL OR cart_item.shop = $2) \
         ORDER BY cart_item.shop, cart_item.sku",
    )
    .bind(user.as_str())
    .bind(shop.map(ShopCode::as_str))
    .bind(now.unix_milliseconds())
    .fetch_all_rows(&mut *connection)
    .await?;
    let mut lines = Vec::with_capacity(rows.len());
    for row in &rows {
        let sku: String = row.try_get("sku")?;
        let status: Option<String> = row.try_get("sale_status")?;
        let campaign: Option<String> = row.try_get("campaign_code")?;
        let available = match &campaign {
            None => row.try_get("available")?,
            Some(code) => {
                // A checkout's line takes its units from one bucket: what the fullest
                // bucket holds is what a line can be. Matched in code, not with
                // `LIKE` (whose case rules differ between the databases).
                let bucket_prefix = format!("{BUCKET_WAREHOUSE_PREFIX}{code}-");
                let rows: Vec<(String, i64)> =
                    statement("SELECT warehouse, available FROM stock WHERE sku = $1")
                        .bind(sku.as_str())
                        .fetch_all_as(&mut *connection)
                        .await?;
                rows.iter()
                    .filter(|(warehouse, _)| warehouse.starts_with(&bucket_prefix))
                    .map(|(_, available)| *available)
                    .max()
                    .unwrap_or(0)
            }
        };
        let current = match status {
            None => None,
            Some(status) => {
                let (price, currency) = price_of(row)?;
                Some(CartSku {
                    title: row.try_get("title")?,
                    price,
                    currency,
                    sale_status: parse_stored("sale status", &status, SaleStatus::parse)?,
                    available,
                    purchase_limit: row.try_get("purchase_limit")?,
                    purchased: row.try_get("purchased")?,
                    campaign,
                })
            }
        };
        let line_shop: String = row.try_get("shop")?;
        lines.push(CartLine {
            shop: parse_stored("shop", &line_shop, ShopCode::parse)?,
            sku: parse_stored("sku code", &sku, SkuCode::parse)?,
            quantity: row.try_get("quantity")?,
            current,
        });
    }
    Ok(Cart {
        user: user.clone(),
        lines,
    })
}

impl<B: Backend> Units<B> {
    /// Sets (or, with `None`, removes) a cart line and answers with the whole cart (the
    /// lines of `shop`: a shopper's lines of other shops are theirs).
    #[allow(clippy::too_many_arguments)] // one unit of work's inputs; grouping them would name nothing
    pub async fn set_cart_item(
        &self,
        claim: &IdempotencyClaim,
        shop: &ShopCode,
        user: &UserId,
        sku: &SkuCode,
        quantity: Option<i64>,
        (now, campaigns_by): (Timestamp, Timestamp),
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let owner: Option<(String, String)> =
            statement("SELECT shop, sale_status FROM sku WHERE code = $1")
                .bind(sku.as_str())
                .fetch_optional_as(&mut *transaction)
                .await?;
        if let Some((owner, _)) = &owner
            && owner != shop.as_str()
        {
            // Checked before the transaction too; a SKU created in another shop since
            // is refused here the same way: a 403 stores nothing, not even the key.
            transaction.rollback().await?;
            return Ok(Idempotent::Forbidden(format!(
                "sku '{sku}' belongs to another shop"
            )));
        }
        let refusal = match (quantity, owner) {
            (Some(_), None) => Some(Rejection::new(
                ErrorCode::NotFound,
                format!("sku '{sku}' does not exist"),
            )),
            // Off the shelf means not to be put in a cart (seed 003 §1.2: "不可加购");
            // a line that went off after it was added stays, shown with its problem,
            // until the shopper removes it.
            (Some(_), Some((_, status))) if status != SaleStatus::OnShelf.as_str() => {
                Some(Rejection::new(
                    ErrorCode::OffShelf,
                    format!("sku '{sku}' is not on sale ({status}): it cannot be put in a cart"),
                ))
            }
            (Some(quantity), Some(_)) => {
                // Locked first, then counted by a statement of its own, which sees a
                // line another request committed while this one waited for the lock.
                statement(<B::Connection as Dialect>::LOCK_CART_LINES)
                    .bind(user.as_str())
                    .bind(shop.as_str())
                    .fetch_all_as::<(String, i64)>(&mut *transaction)
                    .await?;
                let lines: i64 = statement(
                    "SELECT COUNT(*) FROM cart_item WHERE user_id = $1 AND shop = $2 AND sku <> $3",
                )
                .bind(user.as_str())
                .bind(shop.as_str())
                .bind(sku.as_str())
                .fetch_one_scalar(&mut *transaction)
                .await?;
                if lines >= domain::limits::CART_LINES_MAX as i64 {
                    Some(Rejection::new(
                        ErrorCode::FailedPrecondition,
                        format!(
                            "a cart holds at most {} lines",
                            domain::limits::CART_LINES_MAX
                        ),
                    ))
                } else {
                    transaction
                        .put_cart_item(user.as_str(), sku.as_str(), shop.as_str(), quantity, now)
                        .await?;
                    None
                }
            }
            (None, _) => {
                statement("DELETE FROM cart_item WHERE user_id = $1 AND sku = $2 AND shop = $3")
                    .bind(user.as_str())
                    .bind(sku.as_str())
                    .bind(shop.as_str())
                    .execute(&mut *transaction)
                    .await?;
                None
            }
        };
        let response = match refusal {
            Some(rejection) => renderer.rejected(&rejection),
            None => {
                renderer.cart(&load_cart(&mut *transaction, Some(shop), user, campaigns_by).await?)
            }
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// A shopper's cart: the lines of `shop`, or every line (the admin) with `None`.
    pub async fn cart(
        &self,
        shop: Option<&ShopCode>,
        user: &UserId,
        now: Timestamp,
    ) -> Result<Cart, StoreError> {
        let mut transaction = self.begin_writer_read().await?;
        let cart = load_cart(&mut *transaction, shop, user, now).await;
        transaction.rollback().await?;
        cart
    }

    /// A shopper's cart as a page shows it, a display read (a checkout reads the
    /// writer's).
    pub async fn display_cart(
        &self,
        reader: &ReadHandle,
        shop: Option<&ShopCode>,
        user: &UserId,
        now: Timestamp,
    ) -> Result<Displayed<Cart>, StoreError> {
        displayed!(self, reader, now, |transaction| load_cart(
            &mut *transaction,
            shop,
            user,
            now
        )
        .await)
    }
}

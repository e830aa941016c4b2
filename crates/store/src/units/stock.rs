//! SKUs and their stock counters: the standalone SKU upsert, receiving and adjusting
//! stock (each a ledgered movement), and moving a reservation line's units between
//! `available` and `reserved`.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::decode::{corrupt, expect_one_row, invariant, price_of};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::outbox::{NewEvent, Sequence, announce_sku_changed, append_event};
use super::{Units, displayed};
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{
    IdempotencyClaim, Idempotent, LedgerMovement, MovementRecord, Rejection, ReservationAction,
    ResponseRenderer, ShopScope, SkuChanges, StockMovement,
};
use crate::replicas::{Displayed, ReadHandle};
use crate::sql::{Row, statement};
use domain::{
    Currency, ErrorCode, EventType, LedgerMovementId, PriceMinor, ProductId, ReservationId,
    ReservationLine, SaleStatus, ShopCode, Sku, SkuCode, StockLevel, Timestamp, WarehouseCode,
};
use serde_json::json;
use std::collections::HashMap;

/// The largest `available + reserved` a row may reach; see `domain::limits`.
pub(crate) const STOCK_ON_HAND_MAX: i64 = domain::limits::STOCK_ON_HAND_MAX;

/// One append-only ledger row: a change of a (sku, warehouse) row's counters and what
/// caused it.
pub(crate) struct LedgerEntry<'a> {
    pub(crate) sku: &'a SkuCode,
    pub(crate) warehouse: &'a WarehouseCode,
    pub(crate) kind: &'static str,
    pub(crate) available_delta: i64,
    pub(crate) reserved_delta: i64,
    /// The reservation or movement id that caused the change.
    pub(crate) reference: &'a str,
    pub(crate) idempotency_key: Option<&'a str>,
}

pub(crate) async fn insert_ledger_row<C: Dialect>(
    transaction: &mut C,
    entry: LedgerEntry<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    statement(
        "INSERT INTO stock_ledger \
         (sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(entry.sku.as_str())
    .bind(entry.warehouse.as_str())
    .bind(entry.kind)
    .bind(entry.available_delta)
    .bind(entry.reserved_delta)
    .bind(entry.reference)
    .bind(entry.idempotency_key)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

pub(crate) fn decode_sku_row(row: &Row, stock: Vec<StockLevel>) -> Result<Sku, StoreError> {
    let code: String = row.try_get("code")?;
    let shop: String = row.try_get("shop")?;
    let product_id: Option<String> = row.try_get("product_id")?;
    let (price, currency) = price_of(row)?;
    let sale_status: String = row.try_get("sale_status")?;
    Ok(Sku {
        code: SkuCode::parse(&code).map_err(|error| corrupt("sku code", error))?,
        product_id: product_id
            .as_deref()
            .map(ProductId::parse)
            .transpose()
            .map_err(|error| corrupt("product id", error))?,
        shop: ShopCode::parse(&shop).map_err(|error| corrupt("shop", error))?,
        title: row.try_get("title")?,
        spec: row.try_get("spec")?,
        price,
        currency,
        low_stock_threshold: row.try_get("low_stock_threshold")?,
        per_user_limit: row.try_get("per_user_limit")?,
        sale_status: SaleStatus::parse(&sale_status)
            .map_err(|error| corrupt("sale status", error))?,
        version: row.try_get("version")?,
        created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        updated_at: Timestamp::from_unix_milliseconds(row.try_get("updated_at")?),
        stock,
    })
}

pub(crate) async fn load_sku<C: Dialect>(
    connection: &mut C,
    code: &SkuCode,
) -> Result<Option<Sku>, StoreError> {
    let Some(row) = statement(
        "SELECT code, product_id, shop, title, spec, price_minor, currency, low_stock_threshold, \
         per_user_limit, sale_status, version, created_at, updated_at FROM sku WHERE code = $1",
    )
    .bind(code.as_str())
    .fetch_optional_row(&mut *connection)
    .await?
    else {
        return Ok(None);
    };
    let stock_rows = statement(
        "SELECT warehouse, available, reserved FROM stock WHERE sku = $1 ORDER BY warehouse",
    )
    .bind(code.as_str())
    .fetch_all_rows(&mut *connection)
    .await?;
    let mut stock = Vec::with_capacity(stock_rows.len());
    for stock_row in &stock_rows {
        let warehouse: String = stock_row.try_get("warehouse")?;
        stock.push(StockLevel {
            warehouse: WarehouseCode::parse(&warehouse)
                .map_err(|error| corrupt("warehouse", error))?,
            available: stock_row.try_get("available")?,
            reserved: stock_row.try_get("reserved")?,
        });
    }
    decode_sku_row(&row, stock).map(Some)
}

/// Moves `quantity` units of a line between `available` and `reserved` (release) or out
/// of `reserved` (confirm), guarded so a counter can never go below zero.
pub(crate) async fn settle_line<C: Dialect>(
    transaction: &mut C,
    line: &ReservationLine,
    action: ReservationAction,
    reservation: &ReservationId,
    key: Option<&str>,
    now: Timestamp,
) -> Result<(), StoreError> {
    let quantity = line.quantity.get();
    let (text, kind, available_delta) = match action {
        ReservationAction::Confirm => (
            "UPDATE stock SET reserved = reserved - $3, version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2 AND reserved >= $3",
            "confirm",
            0,
        ),
        ReservationAction::Release => (
            "UPDATE stock SET available = available + $3, reserved = reserved - $3, \
             version = version + 1, updated_at = $4 \
             WHERE sku = $1 AND warehouse = $2 AND reserved >= $3",
            "release",
            quantity,
        ),
    };
    let updated = statement(text)
        .bind(line.sku.as_str())
        .bind(line.warehouse.as_str())
        .bind(quantity)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
    expect_one_row(updated, "settling a reservation line")?;
    insert_ledger_row(
        transaction,
        LedgerEntry {
            sku: &line.sku,
            warehouse: &line.warehouse,
            kind,
            available_delta,
            reserved_delta: -quantity,
            reference: reservation.as_str(),
            idempotency_key: key,
        },
        now,
    )
    .await
}

/// Applies one movement's counter change. `Err` is a business refusal, stored as the
/// response; nothing has been written when it is returned.
pub(crate) async fn apply_movement<C: Dialect>(
    transaction: &mut C,
    movement: &StockMovement,
    now: Timestamp,
) -> Result<Result<MovementRecord, Rejection>, StoreError> {
    // The SKU's stock rows first, then its own row, as a shelf change takes them: a
    // delete either committed before the status is read here or waits for this
    // movement. The SKU's row too, not only its stock rows: a SKU that has none yet
    // (its first receipt) shares no stock lock with a delete, which then committed
    // under a receipt that had read the status before it. Shared: movements of the SKU
    // do not wait for each other here.
    transaction.lock_stock_of_skus(&[&movement.sku]).await?;
    let sku_row: Option<(String, String)> = statement(C::SHARE_SKU_ROW)
        .bind(movement.sku.as_str())
        .fetch_optional_as(&mut *transaction)
        .await?;
    let Some((shop, sale_status)) = sku_row else {
        return Ok(Err(Rejection::new(
            ErrorCode::NotFound,
            format!("sku '{}' does not exist", movement.sku),
        )));
    };
    if let ShopScope::Verified(required) | ShopScope::Required(required) = &movement.shop
        && required.as_str() != shop
    {
        return Ok(Err(Rejection::new(
            ErrorCode::Forbidden,
            domain::outside_own_shop(required),
        )));
    }
    let delta = movement.quantity.available_delta();
    // A deleted SKU is never sold again: units received into it could never leave but
    // by a write-off, which stays allowed (an adjust down) for what it still holds.
    if delta > 0 && sale_status == SaleStatus::Deleted.as_str() {
        return Ok(Err(Rejection::new(
            ErrorCode::IllegalTransition,
            format!(
                "sku '{}' is deleted: stock cannot be added to it (an adjust down still writes off what it holds)",
                movement.sku
            ),
        )));
    }
    let counters = if delta > 0 {
        transaction
            .receive_stock(
                movement.sku.as_str(),
                movement.warehouse.as_str(),
                delta,
                now,
                STOCK_ON_HAND_MAX,
            )
            .await?
    } else {
        transaction
            .adjust_stock(
                movement.sku.as_str(),
                movement.warehouse.as_str(),
                delta,
                now,
            )
            .await?
    };
    let Some((available, reserved)) = counters else {
        let rejection = if delta > 0 {
            Rejection::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "receiving {delta} would put more than {STOCK_ON_HAND_MAX} units on hand for sku '{}' in warehouse '{}'",
                    movement.sku, movement.warehouse
                ),
            )
        } else {
            Rejection::new(
                ErrorCode::InsufficientStock,
                format!(
                    "cannot remove {} units of sku '{}' from warehouse '{}': not that many available",
                    -delta, movement.sku, movement.warehouse
                ),
            )
        };
        return Ok(Err(rejection));
    };
    append_event(
        transaction,
        NewEvent {
            event_type: EventType::StockMoved,
            aggregate_id: movement.sku.as_str(),
            shop: &shop,
            sequence: Sequence::Counted,
            data: json!({
                "movement_id": movement.id.as_str(),
                "sku": movement.sku.as_str(),
                "shop": shop,
                "warehouse": movement.warehouse.as_str(),
                "kind": movement.quantity.kind().as_str(),
                "available_delta": delta,
                "available": available,
                "reserved": reserved,
            }),
        },
        now,
    )
    .await?;
    Ok(Ok(MovementRecord {
        id: movement.id.clone(),
        kind: movement.quantity.kind(),
        sku: movement.sku.clone(),
        warehouse: movement.warehouse.clone(),
        available_delta: delta,
        available,
        reserved,
        created_at: now,
    }))
}

/// Changes an existing SKU's fields. A change naming another shop is refused (a SKU's
/// shop never changes); a new per-user limit first locks the SKU's stock rows, which a
/// reservation locks before it reads the limit (like the sale status), so a new limit
/// cannot slip past a reservation that commits after it.
pub(crate) async fn update_existing_sku<C: Dialect>(
    transaction: &mut C,
    code: &SkuCode,
    changes: &SkuChanges,
    now: Timestamp,
) -> Result<Result<(), Rejection>, StoreError> {
    let existing: Option<(String, String, i64)> =
        statement("SELECT shop, sale_status, version FROM sku WHERE code = $1")
            .bind(code.as_str())
            .fetch_optional_as(&mut *transaction)
            .await?;
    // Only an edit naming the version it saw gets here without the row (nothing is
    // created for it): a SKU is never removed, so it never existed.
    let Some((existing_shop, status, version)) = existing else {
        return Ok(Err(Rejection::new(
            ErrorCode::NotFound,
            format!(
                "sku '{code}' does not exist: expected_version names an edit of a SKU that was read"
            ),
        )));
    };
    if let Some(wanted) = &changes.shop
        && wanted.as_str() != existing_shop
    {
        return Ok(Err(Rejection::new(
            ErrorCode::AlreadyExists,
            format!(
                "sku '{code}' already exists in shop '{existing_shop}'; a SKU's shop never changes"
            ),
        )));
    }
    if changes.field_names().is_empty() {
        // A PUT naming no field changes nothing: no new version, no `sku.changed`
        // naming nothing. A deleted SKU answers as it does to an edit; one naming a
        // version checks that the SKU is still at it.
        if status == SaleStatus::Deleted.as_str() {
            return Ok(Err(deleted_sku_is_never_edited(code)));
        }
        if let Some(expected) = changes.expected_version
            && expected != version
        {
            return Ok(Err(sku_moved_on(code, version, expected)));
        }
        return Ok(Ok(()));
    }
    if changes.per_user_limit.is_some() {
        transaction.lock_stock_of_skus(&[code]).await?;
    }
    // On sale needs a price an order can charge, and a SKU of no product a title (the
    // shelf's rule, `load_shelf_state`): an edit must not take either away behind the
    // shelf's back, leaving a SKU that shows as on sale and takes cart lines while
    // every checkout of it is refused, or that sells with no name. Read under the SKU's
    // row lock, which a shelf change takes (after the stock rows, as here) before it
    // puts the SKU on sale.
    let priced_at_zero = changes.price.is_some_and(|price| price.get() == 0);
    let titled_blank = changes
        .title
        .as_deref()
        .is_some_and(|title| title.trim().is_empty());
    if priced_at_zero || titled_blank {
        super::shelf::lock_sku_rows(&mut *transaction, &[code.as_str()]).await?;
        let (status, product): (String, Option<String>) =
            statement("SELECT sale_status, product_id FROM sku WHERE code = $1")
                .bind(code.as_str())
                .fetch_one_as(&mut *transaction)
                .await?;
        let on_sale = status == SaleStatus::OnShelf.as_str();
        if on_sale && priced_at_zero {
            return Ok(Err(Rejection::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "sku '{code}' is on sale, which needs a price above 0: take it off the shelf first"
                ),
            )));
        }
        // A product's SKU is named by its product's title, not its own.
        if on_sale && titled_blank && product.is_none() {
            return Ok(Err(Rejection::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "sku '{code}' is on sale, which needs a title: take it off the shelf first"
                ),
            )));
        }
    }
    let updated = statement(
        "UPDATE sku SET title = COALESCE($2, title), price_minor = COALESCE($3, price_minor), \
         currency = COALESCE($4, currency), \
         low_stock_threshold = COALESCE($5, low_stock_threshold), \
         per_user_limit = CASE WHEN $6 = 1 THEN $7 ELSE per_user_limit END, \
         version = version + 1, updated_at = $8 WHERE code = $1 AND sale_status <> $9 \
         AND ($10 IS NULL OR version = $10)",
    )
    .bind(code.as_str())
    .bind(changes.title.as_deref())
    .bind(changes.price.map(PriceMinor::get))
    .bind(changes.currency.as_ref().map(Currency::as_str))
    .bind(changes.low_stock_threshold)
    .bind(i64::from(changes.per_user_limit.is_some()))
    .bind(changes.per_user_limit.flatten())
    .bind(now.unix_milliseconds())
    .bind(SaleStatus::Deleted.as_str())
    .bind(changes.expected_version)
    .execute(&mut *transaction)
    .await?;
    // The row exists (its shop was read above) and a SKU is never removed: no row
    // updated means it is deleted, which is terminal, so its fields, its version and
    // its event feed stay as the delete left them, or, for an edit naming the version
    // it saw, that another change moved the SKU past it (the condition is checked on
    // the row as it stands once its lock is held, so two such edits cannot both pass).
    if updated == 0 {
        let (status, version): (String, i64) =
            statement("SELECT sale_status, version FROM sku WHERE code = $1")
                .bind(code.as_str())
                .fetch_one_as(&mut *transaction)
                .await?;
        if status == SaleStatus::Deleted.as_str() {
            return Ok(Err(deleted_sku_is_never_edited(code)));
        }
        let expected = changes
            .expected_version
            .ok_or_else(|| invariant(format!("sku '{code}' was not updated")))?;
        return Ok(Err(sku_moved_on(code, version, expected)));
    }
    expect_one_row(updated, "updating a sku")?;
    Ok(Ok(()))
}

/// A stock row's available units, read without a lock (0 when there is no row).
pub(crate) async fn available_in<C: Dialect>(
    transaction: &mut C,
    sku: &SkuCode,
    warehouse: &WarehouseCode,
) -> Result<i64, StoreError> {
    let available: Option<i64> =
        statement("SELECT available FROM stock WHERE sku = $1 AND warehouse = $2")
            .bind(sku.as_str())
            .bind(warehouse.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
    Ok(available.unwrap_or(0))
}

fn sku_moved_on(code: &SkuCode, version: i64, expected: i64) -> Rejection {
    Rejection::new(
        ErrorCode::VersionConflict,
        format!(
            "sku '{code}' is at version {version}, not {expected}: it changed since it was read"
        ),
    )
}

fn deleted_sku_is_never_edited(code: &SkuCode) -> Rejection {
    Rejection::new(
        ErrorCode::IllegalTransition,
        format!("sku '{code}' is deleted: a deleted SKU is never edited"),
    )
}

impl<B: Backend> Units<B> {
    pub async fn sku(&self, code: &SkuCode) -> Result<Option<Sku>, StoreError> {
        let mut transaction = self.begin_writer_read().await?;
        let sku = load_sku(&mut *transaction, code).await;
        transaction.rollback().await?;
        sku
    }

    /// `GET /v1/skus/{sku}`, a display read.
    pub async fn display_sku(
        &self,
        reader: &ReadHandle,
        code: &SkuCode,
        now: Timestamp,
    ) -> Result<Displayed<Option<Sku>>, StoreError> {
        displayed!(self, reader, now, |transaction| load_sku(
            &mut *transaction,
            code
        )
        .await)
    }

    /// The ledger row a movement id names, read on the writer (a caller looks up what
    /// it was just answered). The id names the row by its reference, kind and line:
    /// a reservation's or order's line number gives the (sku, warehouse) of the row.
    pub async fn ledger_movement(
        &self,
        id: &LedgerMovementId,
    ) -> Result<Option<LedgerMovement>, StoreError> {
        // The three statements share their columns; `concat!` keeps each one literal.
        macro_rules! ledger_row_where {
            ($joins_and_conditions:literal) => {
                concat!(
                    "SELECT ledger.id, ledger.kind, ledger.sku, ledger.warehouse, \
                     ledger.available_delta, ledger.reserved_delta, ledger.created_at, sku.shop \
                     FROM stock_ledger ledger LEFT JOIN sku ON sku.code = ledger.sku ",
                    $joins_and_conditions
                )
            };
        }
        let query = match id {
            LedgerMovementId::Stock(movement) => statement(ledger_row_where!(
                "WHERE ledger.reference = $1 AND ledger.kind IN ('receive', 'adjust')"
            ))
            .bind(movement.as_str()),
            LedgerMovementId::Reservation {
                reservation,
                movement,
                line,
            } => statement(ledger_row_where!(
                "JOIN reservation_line line ON line.reservation_id = ledger.reference \
                 AND line.sku = ledger.sku AND line.warehouse = ledger.warehouse \
                 WHERE ledger.reference = $1 AND ledger.kind = $2 AND line.line_number = $3"
            ))
            .bind(reservation.as_str())
            .bind(movement.as_str())
            .bind(i64::from(*line)),
            LedgerMovementId::Return { order, line } => statement(ledger_row_where!(
                "JOIN order_line line ON line.order_id = ledger.reference \
                 AND line.sku = ledger.sku AND line.warehouse = ledger.warehouse \
                 WHERE ledger.reference = $1 AND ledger.kind = 'return' AND line.line_number = $2"
            ))
            .bind(order.as_str())
            .bind(i64::from(*line)),
        };
        let rows = query
            .fetch_all_rows(&mut *self.writer_read_connection().await?)
            .await?;
        let row = match rows.as_slice() {
            [] => return Ok(None),
            [row] => row,
            _ => {
                return Err(invariant(format!(
                    "movement id {id} names {} ledger rows",
                    rows.len()
                )));
            }
        };
        let sku: String = row.try_get("sku")?;
        let warehouse: String = row.try_get("warehouse")?;
        let shop: Option<String> = row.try_get("shop")?;
        Ok(Some(LedgerMovement {
            movement_id: id.clone(),
            ledger_id: row.try_get("id")?,
            kind: row.try_get("kind")?,
            sku: SkuCode::parse(&sku).map_err(|error| corrupt("sku code", error))?,
            warehouse: WarehouseCode::parse(&warehouse)
                .map_err(|error| corrupt("warehouse", error))?,
            available_delta: row.try_get("available_delta")?,
            reserved_delta: row.try_get("reserved_delta")?,
            reference: id.reference().to_owned(),
            shop: shop
                .as_deref()
                .map(ShopCode::parse)
                .transpose()
                .map_err(|error| corrupt("shop", error))?,
            created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        }))
    }

    /// The shops of these SKUs (the ones that exist), read on the writer: the engine
    /// caches them for good, so a stale replica must not answer.
    pub async fn sku_shops(
        &self,
        codes: &[&SkuCode],
    ) -> Result<HashMap<SkuCode, ShopCode>, StoreError> {
        let mut shops = HashMap::with_capacity(codes.len());
        for code in codes {
            let shop: Option<String> = statement("SELECT shop FROM sku WHERE code = $1")
                .bind(code.as_str())
                .fetch_optional_scalar(&mut *self.write_connection().await?)
                .await?;
            if let Some(shop) = shop {
                shops.insert(
                    (*code).clone(),
                    ShopCode::parse(&shop).map_err(|error| corrupt("shop", error))?,
                );
            }
        }
        Ok(shops)
    }

    /// Creates a SKU or updates the given fields of an existing one.
    pub async fn upsert_sku(
        &self,
        claim: &IdempotencyClaim,
        code: &SkuCode,
        changes: &SkuChanges,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let shop = changes.shop.clone().unwrap_or_else(ShopCode::default_shop);
        // An edit naming the version it saw never creates the SKU.
        let inserted = if changes.expected_version.is_some() {
            0
        } else {
            statement(
            "INSERT INTO sku (code, shop, title, price_minor, currency, low_stock_threshold, \
             per_user_limit, sale_status, version, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'ON_SHELF', 1, $8, $8) ON CONFLICT (code) DO NOTHING",
        )
        .bind(code.as_str())
        .bind(shop.as_str())
        .bind(changes.title.as_deref().unwrap_or(""))
        .bind(changes.price.map(PriceMinor::get))
        .bind(changes.currency.as_ref().map(Currency::as_str))
        .bind(changes.low_stock_threshold.unwrap_or(0))
        .bind(changes.per_user_limit.flatten())
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?
        };
        let created = inserted == 1;
        if !created
            && let Err(rejection) =
                update_existing_sku(&mut *transaction, code, changes, now).await?
        {
            let response = renderer.rejected(&rejection);
            return commit_with_answer(transaction, claim, response).await;
        }
        let sku = load_sku(&mut *transaction, code)
            .await?
            .ok_or_else(|| invariant("a sku vanished inside its own transaction"))?;
        // A change to a SKU a shopper may have been shown; a new one has not been
        // shown anywhere yet (no product view holds it), and announces nothing.
        if !created && !changes.field_names().is_empty() {
            announce_sku_changed(
                &mut *transaction,
                sku.code.as_str(),
                sku.shop.as_str(),
                sku.product_id.as_ref().map(|product| product.as_str()),
                &changes.field_names(),
                now,
            )
            .await?;
        }
        let response = renderer.sku_saved(&sku, created);
        commit_with_answer(transaction, claim, response).await
    }

    /// Receives or adjusts stock in one warehouse, with its ledger row.
    pub async fn record_movement(
        &self,
        claim: &IdempotencyClaim,
        movement: &StockMovement,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let outcome = apply_movement(&mut *transaction, movement, now).await?;
        if let Err(rejection) = &outcome
            && rejection.code == ErrorCode::Forbidden
        {
            // A 403 stores nothing, not even the key.
            transaction.rollback().await?;
            return Ok(Idempotent::Forbidden(rejection.detail.clone()));
        }
        let response = match outcome {
            Ok(record) => {
                insert_ledger_row(
                    &mut *transaction,
                    LedgerEntry {
                        sku: &movement.sku,
                        warehouse: &movement.warehouse,
                        kind: movement.quantity.kind().as_str(),
                        available_delta: record.available_delta,
                        reserved_delta: 0,
                        reference: movement.id.as_str(),
                        idempotency_key: Some(claim.key.as_str()),
                    },
                    now,
                )
                .await?;
                renderer.movement_recorded(&record)
            }
            Err(rejection) => renderer.rejected(&rejection),
        };
        commit_with_answer(transaction, claim, response).await
    }
}

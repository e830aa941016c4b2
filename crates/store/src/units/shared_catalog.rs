//! The catalog's units of work (seed 003), written once for every backend.
//!
//! A sale-status change locks the SKU's stock rows before it reads or writes the
//! status: a reservation reads the status after locking the same rows, so the two
//! serialize, and a SKU taken off the shelf cannot be sold by a reservation that
//! commits afterwards.

use super::shared::*;
#[allow(unused_imports)]
use std::collections::HashMap;

use domain::{
    Currency, ErrorCode, PriceMinor, ProductId, SaleStatus, ShopCode, SkuCode, Timestamp, UserId,
};

use super::Units;
use crate::backend::{Backend, Finish};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, Rejection, ResponseRenderer};
use crate::sql::{Connection, built_statement, statement};
use std::collections::BTreeSet;

use domain::{
    CategoryCode, Completeness, ImageUrl, OperatorId, OperatorType, Principal, Product, ScheduleId,
    ServiceKeyId, ShelfDecision, ShelfLogEntry, ShelfOperation, SupplierCode, Title,
    decide_shelf_change, operation_label,
};

use crate::catalog::{
    Actor, AppliedSchedule, Cart, CartLine, CartSku, CredentialKind, NewCredential, NewProduct,
    ProductChanges, ServiceKey, ShelfChange, ShelfLogQuery, ShelfOutcome, ShelfResult,
    ShelfScheduling, ShelfTarget, TargetSelector,
};

/// SKUs a shelf operation's lookup reads at most (a category or supplier query's LIMIT,
/// where product lookups stop): one more than an operation may change
/// (`domain::limits::SHELF_TARGETS_MAX`), so an operation naming too many is seen.
pub(crate) const SHELF_TARGETS_READ_MAX: i64 = domain::limits::SHELF_TARGETS_MAX as i64 + 1;

pub(crate) fn parse_stored<T>(
    what: &str,
    text: &str,
    parse: impl Fn(&str) -> Result<T, domain::ParseError>,
) -> Result<T, StoreError> {
    parse(text).map_err(|error| corrupt(what, error))
}

pub(crate) async fn load_product<C: Connection>(
    connection: &mut C,
    id: &ProductId,
) -> Result<Option<Product>, StoreError> {
    let Some(row) = statement(
        "SELECT title, image_url, category, supplier, shop, version, deleted_at, created_at, updated_at \
         FROM product WHERE id = $1",
    )
    .bind(id.as_str())
    .fetch_optional_row(&mut *connection)
    .await?
    else {
        return Ok(None);
    };
    let codes: Vec<String> = statement("SELECT code FROM sku WHERE product_id = $1 ORDER BY code")
        .bind(id.as_str())
        .fetch_all_scalar(&mut *connection)
        .await?;
    let mut skus = Vec::with_capacity(codes.len());
    for code in codes {
        let code = parse_stored("sku code", &code, SkuCode::parse)?;
        if let Some(sku) = load_sku(&mut *connection, &code).await? {
            skus.push(sku);
        }
    }
    let image_url: Option<String> = row.try_get("image_url")?;
    let category: String = row.try_get("category")?;
    let supplier: String = row.try_get("supplier")?;
    let shop: String = row.try_get("shop")?;
    let deleted_at: Option<i64> = row.try_get("deleted_at")?;
    Ok(Some(Product {
        id: id.clone(),
        title: row.try_get("title")?,
        image_url: image_url
            .as_deref()
            .map(|url| parse_stored("image url", url, ImageUrl::parse))
            .transpose()?,
        category: parse_stored("category", &category, CategoryCode::parse)?,
        supplier: parse_stored("supplier", &supplier, SupplierCode::parse)?,
        shop: parse_stored("shop", &shop, ShopCode::parse)?,
        version: row.try_get("version")?,
        deleted_at: deleted_at.map(Timestamp::from_unix_milliseconds),
        created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        updated_at: Timestamp::from_unix_milliseconds(row.try_get("updated_at")?),
        skus,
    }))
}

/// A SKU's sale state as a shelf change needs it.
pub(crate) struct ShelfState {
    pub(crate) status: SaleStatus,
    pub(crate) version: i64,
    pub(crate) completeness: Completeness,
}

pub(crate) async fn load_shelf_state<C: Connection>(
    connection: &mut C,
    sku: &SkuCode,
) -> Result<Option<ShelfState>, StoreError> {
    let row = statement(
        "SELECT sku.sale_status, sku.version, sku.title AS sku_title, sku.price_minor, sku.product_id, \
         product.title AS product_title, product.image_url FROM sku \
         LEFT JOIN product ON product.id = sku.product_id WHERE sku.code = $1",
    )
    .bind(sku.as_str())
    .fetch_optional_row(&mut *connection)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let status: String = row.try_get("sale_status")?;
    let product_id: Option<String> = row.try_get("product_id")?;
    let price: Option<i64> = row.try_get("price_minor")?;
    let completeness = match product_id {
        // A product needs its title, image and price before its SKUs go on sale.
        Some(_) => {
            let title: Option<String> = row.try_get("product_title")?;
            let image_url: Option<String> = row.try_get("image_url")?;
            Completeness {
                has_title: title.is_some_and(|title| !title.trim().is_empty()),
                has_image: image_url.is_some_and(|url| !url.is_empty()),
                has_price: price.is_some(),
            }
        }
        // A SKU created on its own (`PUT /v1/skus`) has no product and no image.
        None => {
            let title: String = row.try_get("sku_title")?;
            Completeness {
                has_title: !title.trim().is_empty(),
                has_image: true,
                has_price: price.is_some(),
            }
        }
    };
    Ok(Some(ShelfState {
        status: parse_stored("sale status", &status, SaleStatus::parse)?,
        version: row.try_get("version")?,
        completeness,
    }))
}

pub(crate) struct LogLine<'a> {
    pub(crate) target: &'a ShelfTarget,
    pub(crate) actor: &'a Actor,
    pub(crate) from: SaleStatus,
    pub(crate) to: SaleStatus,
    pub(crate) operation: &'a str,
    pub(crate) repeated: bool,
    pub(crate) remark: &'a str,
}

pub(crate) async fn insert_shelf_log<C: Connection>(
    transaction: &mut C,
    line: LogLine<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    statement(
        "INSERT INTO shelf_log (product_id, sku, operator_id, operator_type, from_status, to_status, \
         operation, repeated, remark, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(line.target.product_id.as_ref().map(ProductId::as_str))
    .bind(line.target.sku.as_str())
    .bind(line.actor.operator.as_str())
    .bind(line.actor.operator_type.as_str())
    .bind(line.from.as_str())
    .bind(line.to.as_str())
    .bind(line.operation)
    .bind(i64::from(line.repeated))
    .bind(line.remark)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

/// What a shelf change does to one locked target: changed (logged), repeated (logged),
/// or refused (unknown SKU, stale version, a step the table lacks, an incomplete
/// product).
pub(crate) async fn shelf_outcome<C: Connection>(
    transaction: &mut C,
    change: &ShelfChange,
    target: &ShelfTarget,
    operation: &str,
    now: Timestamp,
) -> Result<ShelfOutcome, StoreError> {
    let refused =
        |code: ErrorCode, reason: String, missing: Vec<&'static str>| ShelfOutcome::Refused {
            code,
            reason,
            missing,
        };
    let Some(state) = load_shelf_state(transaction, &target.sku).await? else {
        return Ok(refused(
            ErrorCode::NotFound,
            format!("sku '{}' does not exist", target.sku),
            Vec::new(),
        ));
    };
    if let Some(expected) = change.expected_versions.get(&target.sku)
        && *expected != state.version
    {
        return Ok(refused(
            ErrorCode::VersionConflict,
            format!(
                "sku '{}' is at version {}, not {expected}: it changed since it was read",
                target.sku, state.version
            ),
            Vec::new(),
        ));
    }
    let outcome = match decide_shelf_change(state.status, change.operation, state.completeness) {
        ShelfDecision::Change { from, to } => {
            let updated = statement(
                "UPDATE sku SET sale_status = $2, version = version + 1, updated_at = $3 \
                 WHERE code = $1 AND sale_status = $4 AND version = $5",
            )
            .bind(target.sku.as_str())
            .bind(to.as_str())
            .bind(now.unix_milliseconds())
            .bind(from.as_str())
            .bind(state.version)
            .execute(&mut *transaction)
            .await?;
            if updated != 1 {
                return Ok(refused(
                    ErrorCode::VersionConflict,
                    format!("sku '{}' changed concurrently", target.sku),
                    Vec::new(),
                ));
            }
            let line = LogLine {
                target,
                actor: &change.actor,
                from,
                to,
                operation,
                repeated: false,
                remark: &change.remark,
            };
            insert_shelf_log(transaction, line, now).await?;
            ShelfOutcome::Changed {
                from,
                to,
                version: state.version + 1,
            }
        }
        ShelfDecision::Repeat(status) => {
            let line = LogLine {
                target,
                actor: &change.actor,
                from: status,
                to: status,
                operation,
                repeated: true,
                remark: &change.remark,
            };
            insert_shelf_log(transaction, line, now).await?;
            ShelfOutcome::Repeated { status }
        }
        illegal @ ShelfDecision::Illegal { .. } => {
            return Ok(refused(
                ErrorCode::IllegalTransition,
                format!("sku '{}': {illegal}", target.sku),
                Vec::new(),
            ));
        }
        incomplete @ ShelfDecision::Incomplete(_) => {
            let ShelfDecision::Incomplete(missing) = &incomplete else {
                unreachable!()
            };
            return Ok(refused(
                ErrorCode::IllegalTransition,
                format!("sku '{}': {incomplete}", target.sku),
                missing.clone(),
            ));
        }
    };
    Ok(outcome)
}

/// Applies one shelf operation to its targets inside `transaction`: locks the shops
/// (so batches of one shop never interleave) and the targets' stock rows, then
/// decides each target through the transition table and writes the change and its
/// log line.
pub(crate) async fn apply_shelf_change<C: Connection>(
    transaction: &mut C,
    change: &ShelfChange,
    now: Timestamp,
) -> Result<Vec<ShelfResult>, StoreError> {
    let shops: BTreeSet<&ShopCode> = change
        .targets
        .iter()
        .filter_map(|target| target.shop.as_ref())
        .collect();
    for shop in shops {
        transaction.lock_shop(shop).await?;
    }
    let mut targets: Vec<&ShelfTarget> = change.targets.iter().collect();
    targets.sort();
    targets.dedup_by(|left, right| left.sku == right.sku);
    let skus: Vec<&SkuCode> = targets.iter().map(|target| &target.sku).collect();
    transaction.lock_stock_of_skus(&skus).await?;

    let operation = operation_label(change.operation, change.scheduled);
    let mut results = Vec::with_capacity(targets.len());
    let mut touched_products: BTreeSet<&ProductId> = BTreeSet::new();
    for target in targets {
        let outcome = shelf_outcome(transaction, change, target, operation, now).await?;
        if let (ShelfOutcome::Changed { .. }, Some(product)) = (&outcome, &target.product_id) {
            touched_products.insert(product);
        }
        results.push(ShelfResult {
            sku: target.sku.clone(),
            product_id: target.product_id.clone(),
            outcome,
        });
    }
    for product in touched_products {
        // A product is deleted once every one of its SKUs is.
        statement(
            "UPDATE product SET version = version + 1, updated_at = $2, \
             deleted_at = CASE WHEN deleted_at IS NULL AND NOT EXISTS ( \
                 SELECT 1 FROM sku WHERE sku.product_id = product.id AND sku.sale_status <> 'DELETED') \
                 THEN $2 ELSE deleted_at END \
             WHERE id = $1",
        )
        .bind(product.as_str())
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
    }
    Ok(results)
}

/// A SKU as a shelf operation's target, with its product and shop as stored.
pub(crate) fn shelf_target(
    sku: SkuCode,
    product_id: Option<&str>,
    shop: Option<&str>,
) -> Result<ShelfTarget, StoreError> {
    Ok(ShelfTarget {
        sku,
        product_id: product_id
            .map(|id| parse_stored("product id", id, ProductId::parse))
            .transpose()?,
        shop: shop
            .map(|shop| parse_stored("shop", shop, ShopCode::parse))
            .transpose()?,
    })
}

/// A claimed schedule: its id, SKU, operation, remark and the target it changes.
pub(crate) type DueSchedule = (ScheduleId, SkuCode, ShelfOperation, String, ShelfTarget);

/// Claims up to `limit` due schedules and locks what they will change — every shop,
/// then every stock row, in the order a shelf change takes them — before the first
/// change: applied one by one, the batch would take a shop's lock after another SKU's
/// stock rows and could deadlock against a shelf batch or a reservation.
pub(crate) async fn claim_due_schedules<C: Connection>(
    transaction: &mut C,
    now: Timestamp,
    limit: i64,
) -> Result<Vec<DueSchedule>, StoreError> {
    let claimed = statement(C::CLAIM_DUE_SCHEDULES)
        .bind(now.unix_milliseconds())
        .bind(limit)
        .fetch_all_as::<(String, String, String, String)>(&mut *transaction)
        .await?;
    let mut due = Vec::with_capacity(claimed.len());
    for (id, sku, operation, remark) in claimed {
        let id = parse_stored("schedule id", &id, ScheduleId::parse)?;
        let sku = parse_stored("sku code", &sku, SkuCode::parse)?;
        let operation = parse_stored("operation", &operation, ShelfOperation::parse)?;
        let target = statement(
            "SELECT sku.product_id, product.shop FROM sku LEFT JOIN product ON product.id = sku.product_id \
             WHERE sku.code = $1",
        )
        .bind(sku.as_str())
        .fetch_optional_as::<(Option<String>, Option<String>)>(&mut *transaction)
        .await?;
        let Some((product_id, shop)) = target else {
            return Err(invariant(format!(
                "schedule {id} names a sku that does not exist"
            )));
        };
        let target = shelf_target(sku.clone(), product_id.as_deref(), shop.as_deref())?;
        due.push((id, sku, operation, remark, target));
    }
    let shops: BTreeSet<&ShopCode> = due
        .iter()
        .filter_map(|(_, _, _, _, target)| target.shop.as_ref())
        .collect();
    for shop in shops {
        transaction.lock_shop(shop).await?;
    }
    let mut skus: Vec<&SkuCode> = due.iter().map(|(_, sku, _, _, _)| sku).collect();
    skus.sort();
    skus.dedup();
    transaction.lock_stock_of_skus(&skus).await?;
    Ok(due)
}

impl<B: Backend> Units<B> {
    pub async fn create_product(
        &self,
        claim: &IdempotencyClaim,
        product: &NewProduct,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        // The product's rows go in under a savepoint: when a SKU code is taken, they
        // are rolled back and only the stored refusal remains.
        statement("SAVEPOINT product_rows")
            .execute(&mut *transaction)
            .await?;
        let response = match insert_product(&mut *transaction, product, now).await? {
            Ok(()) => {
                statement("RELEASE SAVEPOINT product_rows")
                    .execute(&mut *transaction)
                    .await?;
                let created = load_product(&mut *transaction, &product.id)
                    .await?
                    .ok_or_else(|| invariant("a product vanished inside its own transaction"))?;
                renderer.product_saved(&created, true)
            }
            Err(rejection) => {
                statement("ROLLBACK TO SAVEPOINT product_rows")
                    .execute(&mut *transaction)
                    .await?;
                renderer.rejected(&rejection)
            }
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    pub async fn update_product(
        &self,
        claim: &IdempotencyClaim,
        id: &ProductId,
        changes: &ProductChanges,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let updated = statement(
            "UPDATE product SET title = COALESCE($2, title), image_url = COALESCE($3, image_url), \
             category = COALESCE($4, category), supplier = COALESCE($5, supplier), \
             version = version + 1, updated_at = $6 WHERE id = $1 AND deleted_at IS NULL",
        )
        .bind(id.as_str())
        .bind(changes.title.as_ref().map(Title::as_str))
        .bind(changes.image_url.as_ref().map(ImageUrl::as_str))
        .bind(changes.category.as_ref().map(CategoryCode::as_str))
        .bind(changes.supplier.as_ref().map(SupplierCode::as_str))
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        let response = if updated == 1 {
            let product = load_product(&mut *transaction, id)
                .await?
                .ok_or_else(|| invariant("a product vanished inside its own transaction"))?;
            renderer.product_saved(&product, false)
        } else {
            renderer.rejected(&Rejection::new(
                ErrorCode::NotFound,
                format!("product '{id}' does not exist or was deleted"),
            ))
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    pub async fn product(&self, id: &ProductId) -> Result<Option<Product>, StoreError> {
        let mut transaction = self.begin_read().await?;
        let product = load_product(&mut *transaction, id).await;
        transaction.rollback().await?;
        product
    }

    /// The SKUs a shelf operation names, with their products and shops. Products,
    /// categories and suppliers may hold many SKUs: each lookup stops about one past
    /// what an operation may change, enough for the caller to refuse it without
    /// loading them all.
    pub async fn resolve_shelf_targets(
        &self,
        selector: &TargetSelector,
    ) -> Result<Vec<ShelfTarget>, StoreError> {
        let mut found: BTreeSet<(String, Option<String>, Option<String>)> = BTreeSet::new();
        let select = "SELECT sku.code, sku.product_id, sku.shop FROM sku \
                      LEFT JOIN product ON product.id = sku.product_id";
        for product in &selector.product_ids {
            let rows = built_statement(format!("{select} WHERE sku.product_id = $1"))
                .bind(product.as_str())
                .fetch_all_as::<(String, Option<String>, Option<String>)>(
                    &mut *self.read_connection().await?,
                )
                .await?;
            found.extend(rows);
            // A thousand products of a hundred SKUs each would be read whole before
            // the refusal; past the limit the rest cannot change the answer.
            if found.len() as i64 >= SHELF_TARGETS_READ_MAX {
                break;
            }
        }
        for sku in &selector.skus {
            let rows = built_statement(format!("{select} WHERE sku.code = $1"))
                .bind(sku.as_str())
                .fetch_all_as::<(String, Option<String>, Option<String>)>(
                    &mut *self.read_connection().await?,
                )
                .await?;
            found.extend(rows);
        }
        if let Some(category) = &selector.category {
            let rows = built_statement(format!(
                "{select} WHERE product.category = $1 AND ($2 IS NULL OR sku.shop = $2) LIMIT $3"
            ))
            .bind(category.as_str())
            .bind(selector.shop.as_ref().map(ShopCode::as_str))
            .bind(SHELF_TARGETS_READ_MAX)
            .fetch_all_as::<(String, Option<String>, Option<String>)>(
                &mut *self.read_connection().await?,
            )
            .await?;
            found.extend(rows);
        }
        if let Some(supplier) = &selector.supplier {
            let rows = built_statement(format!(
                "{select} WHERE product.supplier = $1 AND ($2 IS NULL OR sku.shop = $2) LIMIT $3"
            ))
            .bind(supplier.as_str())
            .bind(selector.shop.as_ref().map(ShopCode::as_str))
            .bind(SHELF_TARGETS_READ_MAX)
            .fetch_all_as::<(String, Option<String>, Option<String>)>(
                &mut *self.read_connection().await?,
            )
            .await?;
            found.extend(rows);
        }
        let mut targets = Vec::with_capacity(found.len());
        for (sku, product, shop) in found {
            let sku = parse_stored("sku code", &sku, SkuCode::parse)?;
            targets.push(shelf_target(sku, product.as_deref(), shop.as_deref())?);
        }
        Ok(targets)
    }

    /// Applies a shelf operation now, under its idempotency key.
    pub async fn change_shelf(
        &self,
        claim: &IdempotencyClaim,
        change: &ShelfChange,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let results = apply_shelf_change(&mut *transaction, change, now).await?;
        let response = renderer.shelf_results(&results);
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Records shelf operations to apply at `due_at`.
    pub async fn schedule_shelf(
        &self,
        claim: &IdempotencyClaim,
        scheduling: &ShelfScheduling,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let mut results = Vec::with_capacity(scheduling.targets.len());
        for (id, target) in &scheduling.targets {
            statement(
                "INSERT INTO shelf_schedule (id, sku, operation, due_at, status, operator_id, shop, remark, created_at) \
                 VALUES ($1, $2, $3, $4, 'PENDING', $5, $6, $7, $8)",
            )
            .bind(id.as_str())
            .bind(target.sku.as_str())
            .bind(scheduling.operation.as_str())
            .bind(scheduling.due_at.unix_milliseconds())
            .bind(scheduling.actor.operator.as_str())
            .bind(target.shop.as_ref().map(ShopCode::as_str))
            .bind(&scheduling.remark)
            .bind(now.unix_milliseconds())
            .execute(&mut *transaction)
            .await?;
            results.push(ShelfResult {
                sku: target.sku.clone(),
                product_id: target.product_id.clone(),
                outcome: ShelfOutcome::Scheduled {
                    schedule_id: id.clone(),
                    due_at: scheduling.due_at,
                },
            });
        }
        let response = renderer.shelf_results(&results);
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// The earliest pending schedule, for the worker's timer.
    pub async fn next_schedule_due(&self) -> Result<Option<Timestamp>, StoreError> {
        let due: Option<i64> =
            statement("SELECT MIN(due_at) FROM shelf_schedule WHERE status = 'PENDING'")
                .fetch_one_scalar(&mut *self.read_connection().await?)
                .await?;
        Ok(due.map(Timestamp::from_unix_milliseconds))
    }

    /// Applies up to `limit` schedules due at or before `now`, each exactly once even
    /// with several processes (claimed with `SKIP LOCKED` on PostgreSQL). A schedule of
    /// a deleted SKU is skipped and logged.
    pub async fn apply_due_schedules(
        &self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<AppliedSchedule>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let due = claim_due_schedules(&mut *transaction, now, limit).await?;
        let mut applied = Vec::with_capacity(due.len());
        for (id, sku, operation, remark, target) in due {
            let actor = Actor::scheduler();
            let current = load_shelf_state(&mut *transaction, &sku).await?;
            let (status, outcome) = if current
                .as_ref()
                .is_some_and(|state| state.status == SaleStatus::Deleted)
            {
                let line = LogLine {
                    target: &target,
                    actor: &actor,
                    from: SaleStatus::Deleted,
                    to: SaleStatus::Deleted,
                    operation: operation_label(operation, true),
                    repeated: false,
                    remark: "schedule skipped: the SKU was deleted",
                };
                insert_shelf_log(&mut *transaction, line, now).await?;
                ("SKIPPED", "the SKU was deleted".to_owned())
            } else {
                let change = ShelfChange {
                    operation,
                    targets: vec![target.clone()],
                    expected_versions: Default::default(),
                    actor,
                    remark,
                    scheduled: true,
                };
                let results = apply_shelf_change(&mut *transaction, &change, now).await?;
                match results.first().map(|result| &result.outcome) {
                    Some(ShelfOutcome::Refused { reason, .. }) => ("REFUSED", reason.clone()),
                    Some(ShelfOutcome::Repeated { status }) => {
                        ("APPLIED", format!("already {}", status.as_str()))
                    }
                    Some(ShelfOutcome::Changed { from, to, .. }) => {
                        ("APPLIED", format!("{} to {}", from.as_str(), to.as_str()))
                    }
                    _ => ("REFUSED", "nothing to apply".to_owned()),
                }
            };
            let updated = statement(
                "UPDATE shelf_schedule SET status = $2, outcome = $3, applied_at = $4 WHERE id = $1 AND status = 'PENDING'",
            )
            .bind(id.as_str())
            .bind(status)
            .bind(&outcome)
            .bind(now.unix_milliseconds())
            .execute(&mut *transaction)
            .await?;
            expect_one_row(updated, "settling a claimed schedule")?;
            applied.push(AppliedSchedule {
                id,
                sku,
                status,
                outcome,
            });
        }
        transaction.commit().await?;
        Ok(applied)
    }

    pub async fn shelf_log(&self, query: &ShelfLogQuery) -> Result<Vec<ShelfLogEntry>, StoreError> {
        let rows = statement(
            "SELECT shelf_log.id, shelf_log.product_id, shelf_log.sku, operator_id, operator_type, from_status, \
             to_status, operation, repeated, remark, shelf_log.created_at FROM shelf_log \
             LEFT JOIN sku ON sku.code = shelf_log.sku \
             WHERE ($1 IS NULL OR shelf_log.product_id = $1) AND ($2 IS NULL OR shelf_log.sku = $2) \
             AND ($3 IS NULL OR sku.shop = $3) AND ($4 IS NULL OR shelf_log.created_at >= $4) \
             AND ($5 IS NULL OR shelf_log.id > $5) \
             ORDER BY shelf_log.id LIMIT $6",
        )
        .bind(query.product_id.as_ref().map(ProductId::as_str))
        .bind(query.sku.as_ref().map(SkuCode::as_str))
        .bind(query.shop.as_ref().map(ShopCode::as_str))
        .bind(query.since.map(Timestamp::unix_milliseconds))
        .bind(query.after_id)
        .bind(query.limit)
        .fetch_all_rows(&mut *self.read_connection().await?)
        .await?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in &rows {
            let product_id: Option<String> = row.try_get("product_id")?;
            let sku: String = row.try_get("sku")?;
            let operator_id: String = row.try_get("operator_id")?;
            let operator_type: String = row.try_get("operator_type")?;
            let from: String = row.try_get("from_status")?;
            let to: String = row.try_get("to_status")?;
            let repeated: i64 = row.try_get("repeated")?;
            entries.push(ShelfLogEntry {
                id: row.try_get("id")?,
                product_id: product_id
                    .as_deref()
                    .map(|id| parse_stored("product id", id, ProductId::parse))
                    .transpose()?,
                sku: parse_stored("sku code", &sku, SkuCode::parse)?,
                operator_id: parse_stored("operator id", &operator_id, OperatorId::parse)?,
                operator_type: parse_stored("operator type", &operator_type, OperatorType::parse)?,
                from_status: parse_stored("status", &from, SaleStatus::parse)?,
                to_status: parse_stored("status", &to, SaleStatus::parse)?,
                operation: row.try_get("operation")?,
                repeated: repeated == 1,
                remark: row.try_get("remark")?,
                created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
            });
        }
        Ok(entries)
    }

    pub async fn create_operator(
        &self,
        claim: &IdempotencyClaim,
        operator: &OperatorId,
        shop: &ShopCode,
        token_hash: &str,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let credential = NewCredential {
            kind: CredentialKind::Operator,
            id: operator.as_str().to_owned(),
            name: operator.as_str().to_owned(),
            shop: Some(shop.clone()),
            secret_hash: token_hash.to_owned(),
        };
        let response = if insert_credential(&mut *transaction, &credential, now).await? {
            renderer.operator_created(operator, shop, None)
        } else {
            renderer.rejected(&Rejection::new(
                ErrorCode::AlreadyExists,
                format!("operator '{operator}' already exists"),
            ))
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// A new service key of a shop; only the hash of its secret is stored.
    pub async fn create_service_key(
        &self,
        claim: &IdempotencyClaim,
        key: &ServiceKey,
        secret_hash: &str,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let credential = NewCredential {
            kind: CredentialKind::Service,
            id: key.id.as_str().to_owned(),
            name: key.name.clone(),
            shop: Some(key.shop.clone()),
            secret_hash: secret_hash.to_owned(),
        };
        if !insert_credential(&mut *transaction, &credential, now).await? {
            return Err(invariant("a freshly minted service key id was taken"));
        }
        let response = renderer.service_key_created(key, None);
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Revokes a service key: from now on its secret authenticates nobody.
    pub async fn revoke_service_key(
        &self,
        claim: &IdempotencyClaim,
        key: &ServiceKeyId,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        statement(
            "UPDATE credential SET revoked_at = $2 WHERE kind = 'service' AND id = $1 AND revoked_at IS NULL",
        )
        .bind(key.as_str())
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        let response = match load_service_key(&mut *transaction, key).await? {
            Some(revoked) => renderer.service_key_revoked(&revoked),
            None => renderer.rejected(&Rejection::new(
                ErrorCode::NotFound,
                format!("service key '{key}' does not exist"),
            )),
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// Service keys, newest first (of one shop when given).
    pub async fn service_keys(
        &self,
        shop: Option<&ShopCode>,
        limit: i64,
    ) -> Result<Vec<ServiceKey>, StoreError> {
        let rows = statement(
            "SELECT id, name, shop, created_at, revoked_at FROM credential \
             WHERE kind = 'service' AND ($1 IS NULL OR shop = $1) ORDER BY created_at DESC, id LIMIT $2",
        )
        .bind(shop.map(ShopCode::as_str))
        .bind(limit)
        .fetch_all_as::<(String, String, Option<String>, i64, Option<i64>)>(&mut *self.read_connection().await?)
        .await?;
        rows.into_iter().map(decode_service_key).collect()
    }

    /// The principal whose secret hashes to `secret_hash`, unless revoked.
    pub async fn principal_by_secret_hash(
        &self,
        secret_hash: &str,
    ) -> Result<Option<Principal>, StoreError> {
        let row = statement(
            "SELECT kind, id, shop FROM credential WHERE secret_hash = $1 AND revoked_at IS NULL",
        )
        .bind(secret_hash)
        .fetch_optional_as::<(String, String, Option<String>)>(&mut *self.write_connection().await?)
        .await?;
        let Some((kind, id, shop)) = row else {
            return Ok(None);
        };
        let shop = shop
            .as_deref()
            .map(|shop| parse_stored("shop", shop, ShopCode::parse))
            .transpose()?;
        let principal = match (kind.as_str(), shop) {
            ("admin", None) => Principal::Admin,
            ("operator", Some(shop)) => Principal::Operator {
                id: parse_stored("operator id", &id, OperatorId::parse)?,
                shop,
            },
            ("service", Some(shop)) => Principal::Service {
                key: parse_stored("service key id", &id, ServiceKeyId::parse)?,
                shop,
            },
            _ => return Err(invariant(format!("credential {kind}/{id} is malformed"))),
        };
        Ok(Some(principal))
    }

    /// Whether an admin token was stored (a generated one, kept across restarts).
    pub async fn admin_credential_exists(&self) -> Result<bool, StoreError> {
        let found: Option<String> =
            statement("SELECT id FROM credential WHERE kind = 'admin' AND revoked_at IS NULL")
                .fetch_optional_scalar(&mut *self.write_connection().await?)
                .await?;
        Ok(found.is_some())
    }

    /// Stores the admin token's hash, replacing any earlier one (rotation).
    pub async fn replace_admin_secret(
        &self,
        secret_hash: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        statement("DELETE FROM credential WHERE kind = 'admin'")
            .execute(&mut *transaction)
            .await?;
        let credential = NewCredential {
            kind: CredentialKind::Admin,
            id: "admin".to_owned(),
            name: "admin".to_owned(),
            shop: None,
            secret_hash: secret_hash.to_owned(),
        };
        if !insert_credential(&mut *transaction, &credential, now).await? {
            return Err(invariant("the admin credential could not be stored"));
        }
        transaction.commit().await?;
        Ok(())
    }

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
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let owner: Option<String> = statement("SELECT shop FROM sku WHERE code = $1")
            .bind(sku.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
        let refusal = match (quantity, owner) {
            (_, Some(owner)) if owner != shop.as_str() => Some(Rejection::new(
                ErrorCode::Forbidden,
                format!("sku '{sku}' belongs to another shop"),
            )),
            (Some(_), None) => Some(Rejection::new(
                ErrorCode::NotFound,
                format!("sku '{sku}' does not exist"),
            )),
            (Some(quantity), Some(_)) => {
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
                        ErrorCode::InvalidArgument,
                        format!(
                            "a cart holds at most {} lines",
                            domain::limits::CART_LINES_MAX
                        ),
                    ))
                } else {
                    statement(
                        "INSERT INTO cart_item (user_id, sku, shop, quantity, created_at, updated_at) \
                         VALUES ($1, $2, $3, $4, $5, $5) \
                         ON CONFLICT (user_id, sku) DO UPDATE SET quantity = excluded.quantity, updated_at = excluded.updated_at",
                    )
                    .bind(user.as_str())
                    .bind(sku.as_str())
                    .bind(shop.as_str())
                    .bind(quantity)
                    .bind(now.unix_milliseconds())
                    .execute(&mut *transaction)
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
            None => renderer.cart(&load_cart(&mut *transaction, Some(shop), user).await?),
        };
        complete_claim(&mut *transaction, claim, &response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response))
    }

    /// A shopper's cart: the lines of `shop`, or every line (the admin) with `None`.
    pub async fn cart(&self, shop: Option<&ShopCode>, user: &UserId) -> Result<Cart, StoreError> {
        let mut transaction = self.begin_read().await?;
        let cart = load_cart(&mut *transaction, shop, user).await;
        transaction.rollback().await?;
        cart
    }

    /// Removes the lines a checkout ordered, unless their quantity changed meanwhile.
    pub async fn remove_ordered_cart_items(
        &self,
        user: &UserId,
        ordered: &[(SkuCode, i64)],
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        for (sku, quantity) in ordered {
            statement("DELETE FROM cart_item WHERE user_id = $1 AND sku = $2 AND quantity = $3")
                .bind(user.as_str())
                .bind(sku.as_str())
                .bind(quantity)
                .execute(&mut *transaction)
                .await?;
        }
        transaction.commit().await?;
        Ok(())
    }
}

/// Inserts a credential; `false` when its (kind, id) is taken.
pub(crate) async fn insert_credential<C: Connection>(
    transaction: &mut C,
    credential: &NewCredential,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let inserted = statement(
        "INSERT INTO credential (kind, id, name, shop, secret_hash, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (kind, id) DO NOTHING",
    )
    .bind(credential.kind.as_str())
    .bind(&credential.id)
    .bind(&credential.name)
    .bind(credential.shop.as_ref().map(ShopCode::as_str))
    .bind(&credential.secret_hash)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(inserted == 1)
}

pub(crate) fn decode_service_key(
    (id, name, shop, created_at, revoked_at): (String, String, Option<String>, i64, Option<i64>),
) -> Result<ServiceKey, StoreError> {
    Ok(ServiceKey {
        id: parse_stored("service key id", &id, ServiceKeyId::parse)?,
        name,
        shop: parse_stored("shop", shop.as_deref().unwrap_or(""), ShopCode::parse)?,
        created_at: Timestamp::from_unix_milliseconds(created_at),
        revoked_at: revoked_at.map(Timestamp::from_unix_milliseconds),
    })
}

pub(crate) async fn load_service_key<C: Connection>(
    connection: &mut C,
    key: &ServiceKeyId,
) -> Result<Option<ServiceKey>, StoreError> {
    let row = statement(
        "SELECT id, name, shop, created_at, revoked_at FROM credential WHERE kind = 'service' AND id = $1",
    )
    .bind(key.as_str())
    .fetch_optional_as::<(String, String, Option<String>, i64, Option<i64>)>(&mut *connection)
    .await?;
    row.map(decode_service_key).transpose()
}

pub(crate) async fn load_cart<C: Connection>(
    connection: &mut C,
    shop: Option<&ShopCode>,
    user: &UserId,
) -> Result<Cart, StoreError> {
    let rows = statement(
        "SELECT cart_item.sku, cart_item.quantity, sku.title, sku.price_minor, sku.currency, sku.sale_status, \
         COALESCE(stock.available, 0) AS available \
         FROM cart_item LEFT JOIN sku ON sku.code = cart_item.sku \
         LEFT JOIN stock ON stock.sku = cart_item.sku AND stock.warehouse = 'default' \
         WHERE cart_item.user_id = $1 AND ($2 IS NULL OR cart_item.shop = $2) ORDER BY cart_item.sku",
    )
    .bind(user.as_str())
    .bind(shop.map(ShopCode::as_str))
    .fetch_all_rows(&mut *connection)
    .await?;
    let mut lines = Vec::with_capacity(rows.len());
    for row in &rows {
        let sku: String = row.try_get("sku")?;
        let status: Option<String> = row.try_get("sale_status")?;
        let current = match status {
            None => None,
            Some(status) => {
                let price: Option<i64> = row.try_get("price_minor")?;
                let currency: Option<String> = row.try_get("currency")?;
                Some(CartSku {
                    title: row.try_get("title")?,
                    price: price
                        .map(PriceMinor::new)
                        .transpose()
                        .map_err(|error| corrupt("price", error))?,
                    currency: currency
                        .as_deref()
                        .map(|text| parse_stored("currency", text, Currency::parse))
                        .transpose()?,
                    sale_status: parse_stored("sale status", &status, SaleStatus::parse)?,
                    available: row.try_get("available")?,
                })
            }
        };
        lines.push(CartLine {
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

/// Inserts a product and its SKUs (`PENDING_REVIEW`). `Err` when a SKU code is
/// taken; the caller rolls its savepoint back.
pub(crate) async fn insert_product<C: Connection>(
    connection: &mut C,
    product: &NewProduct,
    now: Timestamp,
) -> Result<Result<(), Rejection>, StoreError> {
    statement(
        "INSERT INTO product (id, title, image_url, category, supplier, shop, version, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $7)",
    )
    .bind(product.id.as_str())
    .bind(product.title.as_str())
    .bind(product.image_url.as_ref().map(ImageUrl::as_str))
    .bind(product.category.as_str())
    .bind(product.supplier.as_str())
    .bind(product.shop.as_str())
    .bind(now.unix_milliseconds())
    .execute(&mut *connection)
    .await?;
    for sku in &product.skus {
        let inserted = statement(
            "INSERT INTO sku (code, product_id, shop, title, spec, price_minor, currency, low_stock_threshold, \
             per_user_limit, sale_status, version, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 0, $8, 'PENDING_REVIEW', 1, $9, $9) ON CONFLICT (code) DO NOTHING",
        )
        .bind(sku.code.as_str())
        .bind(product.id.as_str())
        .bind(product.shop.as_str())
        .bind(product.title.as_str())
        .bind(&sku.spec)
        .bind(sku.price.get())
        .bind(sku.currency.as_str())
        .bind(sku.per_user_limit)
        .bind(now.unix_milliseconds())
        .execute(&mut *connection)
        .await?;
        if inserted != 1 {
            return Ok(Err(Rejection::new(
                ErrorCode::AlreadyExists,
                format!("sku '{}' already exists", sku.code),
            )));
        }
    }
    Ok(Ok(()))
}

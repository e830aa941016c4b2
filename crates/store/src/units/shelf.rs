//! Shelf status (seed 003): resolving an operation's targets, deciding and applying a
//! sale-status change under the stock rows' locks, and the shelf log.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::campaigns::shopper_available;
use super::decode::parse_stored;
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::outbox::{NewEvent, Sequence, append_event};
use super::schedules::cancel_schedules_of_deleted_sku;
use super::{Units, displayed};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{
    Actor, ShelfChange, ShelfLogQuery, ShelfOutcome, ShelfResult, ShelfTarget, TargetSelector,
};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, ResponseRenderer};
use crate::replicas::{Displayed, ReadHandle};
use crate::sql::{built_statement, statement};
use domain::{
    CategoryCode, Completeness, ErrorCode, EventType, OperatorId, OperatorType, ProductId,
    SaleStatus, ShelfDecision, ShelfLogEntry, ShopCode, SkuCode, SupplierCode, Timestamp,
    decide_shelf_change, operation_label,
};
use serde_json::json;
use std::borrow::Borrow;
use std::collections::BTreeSet;

#[allow(unused_imports)]
/// SKUs a shelf operation's lookup reads at most (a category or supplier query's LIMIT,
/// where product lookups stop): one more than an operation may change
/// (`domain::limits::SHELF_TARGETS_MAX`), so an operation naming too many is seen.
pub(crate) const SHELF_TARGETS_READ_MAX: i64 = domain::limits::SHELF_TARGETS_MAX as i64 + 1;

/// A SKU's sale state as a shelf change needs it.
pub(crate) struct ShelfState {
    pub(crate) status: SaleStatus,
    pub(crate) version: i64,
    pub(crate) completeness: Completeness,
}

pub(crate) async fn load_shelf_state<C: Dialect>(
    connection: &mut C,
    sku: &SkuCode,
) -> Result<Option<ShelfState>, StoreError> {
    let row = statement(
        "SELECT sku.sale_status, sku.version, sku.title AS sku_title, sku.price_minor, sku.currency, sku.product_id, \
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
    let currency: Option<String> = row.try_get("currency")?;
    // A price an order can charge: above zero (an order of nothing to pay is refused)
    // and in a currency.
    let has_price = price.is_some_and(|minor| minor > 0) && currency.is_some();
    let completeness = match product_id {
        // A product needs its title, image and price before its SKUs go on sale.
        Some(_) => {
            let title: Option<String> = row.try_get("product_title")?;
            let image_url: Option<String> = row.try_get("image_url")?;
            Completeness {
                has_title: title.is_some_and(|title| !title.trim().is_empty()),
                has_image: image_url.is_some_and(|url| !url.is_empty()),
                has_price,
            }
        }
        // A SKU created on its own (`PUT /v1/skus`) has no product and no image.
        None => {
            let title: String = row.try_get("sku_title")?;
            Completeness {
                has_title: !title.trim().is_empty(),
                has_image: true,
                has_price,
            }
        }
    };
    Ok(Some(ShelfState {
        status: parse_stored("sale status", &status, SaleStatus::parse)?,
        version: row.try_get("version")?,
        completeness,
    }))
}

/// A shelf-log line, kept until its transaction writes its lines last
/// ([`insert_shelf_log`]).
pub(crate) struct LogLine {
    pub(crate) target: ShelfTarget,
    pub(crate) actor: Actor,
    pub(crate) from: SaleStatus,
    pub(crate) to: SaleStatus,
    pub(crate) operation: &'static str,
    pub(crate) repeated: bool,
    pub(crate) remark: String,
}

/// Writes a transaction's shelf-log lines, the last thing it does before its commit:
/// the log's lock first ([`Dialect::lock_shelf_log`]), so ids are drawn in commit
/// order, held only from here to the commit, waiting on nothing else meanwhile.
pub(crate) async fn insert_shelf_log<C: Dialect>(
    transaction: &mut C,
    lines: Vec<LogLine>,
    now: Timestamp,
) -> Result<(), StoreError> {
    if lines.is_empty() {
        return Ok(());
    }
    transaction.lock_shelf_log().await?;
    for line in lines {
        insert_shelf_log_line(&mut *transaction, line, now).await?;
    }
    Ok(())
}

async fn insert_shelf_log_line<C: Dialect>(
    transaction: &mut C,
    line: LogLine,
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
    .bind(line.remark.as_str())
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

/// A sale-status change decided for one target.
#[derive(Clone, Copy)]
pub(crate) struct ShelfStep<'a> {
    pub(crate) target: &'a ShelfTarget,
    pub(crate) operation: &'a str,
    pub(crate) from: SaleStatus,
    pub(crate) to: SaleStatus,
}

/// Writes a decided sale-status change: a conditional update on (status, version) (its
/// shelf-log line is the caller's to write, last). A SKU that changed since it was
/// read is refused.
pub(crate) async fn change_sale_status<C: Dialect>(
    transaction: &mut C,
    step: ShelfStep<'_>,
    version: i64,
    now: Timestamp,
) -> Result<ShelfOutcome, StoreError> {
    let updated = statement(
        "UPDATE sku SET sale_status = $2, version = version + 1, updated_at = $3 \
         WHERE code = $1 AND sale_status = $4 AND version = $5",
    )
    .bind(step.target.sku.as_str())
    .bind(step.to.as_str())
    .bind(now.unix_milliseconds())
    .bind(step.from.as_str())
    .bind(version)
    .execute(&mut *transaction)
    .await?;
    if updated != 1 {
        return Ok(ShelfOutcome::Refused {
            code: ErrorCode::VersionConflict,
            reason: format!("sku '{}' changed concurrently", step.target.sku),
            missing: Vec::new(),
        });
    }
    if step.to == SaleStatus::Deleted {
        cancel_schedules_of_deleted_sku(&mut *transaction, &step.target.sku, now).await?;
    }
    let shop = match &step.target.shop {
        Some(shop) => shop.as_str().to_owned(),
        None => {
            statement("SELECT shop FROM sku WHERE code = $1")
                .bind(step.target.sku.as_str())
                .fetch_one_scalar(&mut *transaction)
                .await?
        }
    };
    append_event(
        transaction,
        NewEvent {
            event_type: EventType::SkuSaleStatusChanged,
            aggregate_id: step.target.sku.as_str(),
            shop: &shop,
            sequence: Sequence::Counted,
            data: json!({
                "sku": step.target.sku.as_str(),
                "shop": shop,
                "product_id": step.target.product_id.as_ref().map(|product| product.as_str()),
                "from": step.from.as_str(),
                "to": step.to.as_str(),
                "operation": step.operation,
            }),
        },
        now,
    )
    .await?;
    Ok(ShelfOutcome::Changed {
        from: step.from,
        to: step.to,
        version: version + 1,
    })
}

/// The refusal of a change whose operator read the SKU at another version.
pub(crate) fn version_conflict(
    change: &ShelfChange,
    target: &ShelfTarget,
    version: i64,
) -> Option<ShelfOutcome> {
    let expected = change.expected_versions.get(&target.sku)?;
    (*expected != version).then(|| ShelfOutcome::Refused {
        code: ErrorCode::VersionConflict,
        reason: format!(
            "sku '{}' is at version {version}, not {expected}: it changed since it was read",
            target.sku
        ),
        missing: Vec::new(),
    })
}

/// What a shelf change does to one locked target: changed (logged), repeated (logged),
/// or refused (unknown SKU, stale version, a step the table lacks, an incomplete
/// product).
pub(crate) async fn shelf_outcome<C: Dialect>(
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
    if let Some(conflict) = version_conflict(change, target, state.version) {
        return Ok(conflict);
    }
    let outcome = match decide_shelf_change(state.status, change.operation, state.completeness) {
        ShelfDecision::Change { from, to } => {
            let step = ShelfStep {
                target,
                operation,
                from,
                to,
            };
            change_sale_status(transaction, step, state.version, now).await?
        }
        ShelfDecision::Repeat(status) => ShelfOutcome::Repeated { status },
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

/// Locks the shops of `targets`, each once, in code order: every writer of a shop's
/// shelf takes them so, and two batches of one shop never interleave.
pub(crate) async fn lock_shops_of<C: Dialect, T: Borrow<ShelfTarget> + Sync>(
    transaction: &mut C,
    targets: &[T],
) -> Result<(), StoreError> {
    let shops: BTreeSet<&ShopCode> = targets
        .iter()
        .filter_map(|target| target.borrow().shop.as_ref())
        .collect();
    for shop in shops {
        transaction.lock_shop(shop).await?;
    }
    Ok(())
}

/// Locks the SKUs' own rows, in the order given (callers give code order, the order
/// every writer of a SKU's row takes them in).
pub(crate) async fn lock_sku_rows<C: Dialect, S: AsRef<str> + Sync>(
    transaction: &mut C,
    skus: &[S],
) -> Result<(), StoreError> {
    for sku in skus {
        statement(C::LOCK_SKU_ROW)
            .bind(sku.as_ref())
            .fetch_optional_scalar::<i64>(&mut *transaction)
            .await?;
    }
    Ok(())
}

/// Applies one shelf operation to its targets inside `transaction`: locks the shops
/// (so batches of one shop never interleave) and the targets' stock rows, then
/// decides each target through the transition table and writes the change. Its log
/// lines go to `log`, which the caller writes last ([`insert_shelf_log`]): the log's
/// lock is then held only from there to the commit, never across other work.
pub(crate) async fn apply_shelf_change<C: Dialect>(
    transaction: &mut C,
    change: &ShelfChange,
    (now, campaigns_by): (Timestamp, Timestamp),
    log: &mut Vec<LogLine>,
) -> Result<Vec<ShelfResult>, StoreError> {
    lock_shops_of(transaction, &change.targets).await?;
    let mut targets: Vec<&ShelfTarget> = change.targets.iter().collect();
    targets.sort();
    targets.dedup_by(|left, right| left.sku == right.sku);
    let skus: Vec<&SkuCode> = targets.iter().map(|target| &target.sku).collect();
    transaction.lock_stock_of_skus(&skus).await?;
    // After the stock rows, as a reservation takes them. An edit that bumps a SKU's
    // version (its title or price) takes no stock lock: without the SKU's own lock it
    // could commit between the version read and the change, and an operation that
    // named no version (a scheduled one, an urgent take-down) would be refused as
    // "changed concurrently".
    lock_sku_rows(transaction, &skus).await?;

    let operation = operation_label(change.operation, change.scheduled);
    let mut results = Vec::with_capacity(targets.len());
    let mut touched_products: BTreeSet<&ProductId> = BTreeSet::new();
    for target in targets {
        let outcome = shelf_outcome(transaction, change, target, operation, now).await?;
        let logged = match outcome {
            ShelfOutcome::Changed { from, to, .. } => Some((from, to, false)),
            ShelfOutcome::Repeated { status } => Some((status, status, true)),
            ShelfOutcome::Refused { .. } | ShelfOutcome::Scheduled { .. } => None,
        };
        if let Some((from, to, repeated)) = logged {
            log.push(LogLine {
                target: target.clone(),
                actor: change.actor.clone(),
                from,
                to,
                operation,
                repeated,
                remark: change.remark.clone(),
            });
        }
        if let (ShelfOutcome::Changed { .. }, Some(product)) = (&outcome, &target.product_id) {
            touched_products.insert(product);
        }
        let on_shelf = matches!(
            outcome,
            ShelfOutcome::Changed {
                to: SaleStatus::OnShelf,
                ..
            } | ShelfOutcome::Repeated {
                status: SaleStatus::OnShelf
            }
        );
        let availability = if on_shelf {
            // Whether a campaign runs, as the product view judges it.
            let available = shopper_available(transaction, &target.sku, campaigns_by).await?;
            Some(domain::Availability::of(SaleStatus::OnShelf, available))
        } else {
            None
        };
        results.push(ShelfResult {
            sku: target.sku.clone(),
            product_id: target.product_id.clone(),
            outcome,
            availability,
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

impl<B: Backend> Units<B> {
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
                    &mut *self.writer_read_connection().await?,
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
                    &mut *self.writer_read_connection().await?,
                )
                .await?;
            found.extend(rows);
        }
        // Products by category or by supplier, the same query on either column. A
        // deleted SKU is left out: no operation changes it, and a category's deleted
        // SKUs, which stay for good, would count towards the limit (a category that
        // ever held more than it could never be named again) and fill the results
        // with refusals. Named by id, it is still refused as such.
        for (column, value) in [
            (
                "category",
                selector.category.as_ref().map(CategoryCode::as_str),
            ),
            (
                "supplier",
                selector.supplier.as_ref().map(SupplierCode::as_str),
            ),
        ] {
            let Some(value) = value else { continue };
            let rows = built_statement(format!(
                "{select} WHERE product.{column} = $1 AND ($2 IS NULL OR sku.shop = $2) \
                 AND sku.sale_status <> 'DELETED' LIMIT $3"
            ))
            .bind(value)
            .bind(selector.shop.as_ref().map(ShopCode::as_str))
            .bind(SHELF_TARGETS_READ_MAX)
            .fetch_all_as::<(String, Option<String>, Option<String>)>(
                &mut *self.writer_read_connection().await?,
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
        (now, campaigns_by): (Timestamp, Timestamp),
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let mut log = Vec::new();
        let results =
            apply_shelf_change(&mut *transaction, change, (now, campaigns_by), &mut log).await?;
        insert_shelf_log(&mut *transaction, log, now).await?;
        let response = renderer.shelf_results(&results);
        commit_with_answer(transaction, claim, response).await
    }

    /// The shelf log, a display read.
    pub async fn display_shelf_log(
        &self,
        reader: &ReadHandle,
        query: &ShelfLogQuery,
        now: Timestamp,
    ) -> Result<Displayed<Vec<ShelfLogEntry>>, StoreError> {
        displayed!(self, reader, now, |transaction| load_shelf_log(
            &mut *transaction,
            query
        )
        .await)
    }
}

/// The statement that lists the shelf log's entries `query` selects: its text, then
/// the text values and the numbers its placeholders take in order, then the limit.
/// Only the filters given are in the text: `$n IS NULL OR column = $n` keeps a
/// planner from the index of the column given (PostgreSQL plans a prepared statement
/// once for every value), and a shop's log read by SKU scanned the whole log for it.
pub fn shelf_log_listing(query: &ShelfLogQuery) -> (String, Vec<&str>, Vec<i64>) {
    let mut conditions: Vec<String> = Vec::new();
    let mut texts: Vec<&str> = Vec::new();
    let mut numbers: Vec<i64> = Vec::new();
    for (column, value) in [
        (
            "shelf_log.product_id",
            query.product_id.as_ref().map(ProductId::as_str),
        ),
        ("shelf_log.sku", query.sku.as_ref().map(SkuCode::as_str)),
        ("sku.shop", query.shop.as_ref().map(ShopCode::as_str)),
    ] {
        if let Some(value) = value {
            texts.push(value);
            conditions.push(format!("{column} = ${}", texts.len()));
        }
    }
    for (condition, value) in [
        (
            "shelf_log.created_at >=",
            query.since.map(Timestamp::unix_milliseconds),
        ),
        ("shelf_log.id >", query.after_id),
    ] {
        if let Some(value) = value {
            numbers.push(value);
            conditions.push(format!("{condition} ${}", texts.len() + numbers.len()));
        }
    }
    let filter = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {} ", conditions.join(" AND "))
    };
    let text = format!(
        "SELECT shelf_log.id, shelf_log.product_id, shelf_log.sku, operator_id, operator_type, from_status, \
         to_status, operation, repeated, remark, shelf_log.created_at FROM shelf_log \
         LEFT JOIN sku ON sku.code = shelf_log.sku \
         {filter}ORDER BY shelf_log.id LIMIT ${}",
        texts.len() + numbers.len() + 1
    );
    (text, texts, numbers)
}

/// The shelf log's entries that `query` selects, oldest first.
async fn load_shelf_log<C: Dialect>(
    connection: &mut C,
    query: &ShelfLogQuery,
) -> Result<Vec<ShelfLogEntry>, StoreError> {
    let (text, texts, numbers) = shelf_log_listing(query);
    let mut listing = built_statement(text);
    for value in texts {
        listing = listing.bind(value);
    }
    for value in numbers {
        listing = listing.bind(value);
    }
    let rows = listing.bind(query.limit).fetch_all_rows(connection).await?;
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

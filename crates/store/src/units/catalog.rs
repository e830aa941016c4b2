//! Products and their SKUs (seed 003): creating and updating a product.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::decode::{expect_one_row, invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::outbox::announce_sku_changed;
use super::shelf::lock_sku_rows;
use super::stock::load_sku;
use super::{Units, displayed};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{NewProduct, ProductChanges, ProductFilter};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, Rejection, ResponseRenderer};
use crate::replicas::{Displayed, ReadHandle};
use crate::sql::statement;
use domain::{
    CategoryCode, ErrorCode, ImageUrl, Product, ProductId, SaleStatus, ShopCode, SkuCode,
    SupplierCode, Timestamp, Title,
};

async fn load_products_page<C: Dialect>(
    connection: &mut C,
    filter: &ProductFilter,
    after: Option<&ProductId>,
    limit: i64,
) -> Result<Vec<Product>, StoreError> {
    let ids: Vec<String> = statement(
        "SELECT id FROM product WHERE ($1 IS NULL OR shop = $1) \
         AND ($2 IS NULL OR category = $2) AND ($3 IS NULL OR supplier = $3) \
         AND ($4 IS NULL OR id > $4) ORDER BY id LIMIT $5",
    )
    .bind(filter.shop.as_ref().map(ShopCode::as_str))
    .bind(filter.category.as_ref().map(CategoryCode::as_str))
    .bind(filter.supplier.as_ref().map(SupplierCode::as_str))
    .bind(after.map(ProductId::as_str))
    .bind(limit)
    .fetch_all_scalar(&mut *connection)
    .await?;
    let mut products = Vec::with_capacity(ids.len());
    for id in ids {
        let id = parse_stored("product id", &id, ProductId::parse)?;
        if let Some(product) = load_product(&mut *connection, &id).await? {
            products.push(product);
        }
    }
    Ok(products)
}

pub(crate) async fn load_product<C: Dialect>(
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

/// Inserts a product and its SKUs (`PENDING_REVIEW`). `Err` when a SKU code is
/// taken; the caller rolls its savepoint back.
pub(crate) async fn insert_product<C: Dialect>(
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
        commit_with_answer(transaction, claim, response).await
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
        // Locks in the order a shelf change takes them (its SKU rows by code, their
        // event counters, then the product), so the two never wait on each other in a
        // cycle; and two edits of one product queue at its first SKU row, so the
        // second reads the title the first left.
        let skus: Vec<(String, String)> =
            statement("SELECT code, sale_status FROM sku WHERE product_id = $1 ORDER BY code")
                .bind(id.as_str())
                .fetch_all_as(&mut *transaction)
                .await?;
        // Byte order, as every other writer sorts its SKUs: `ORDER BY code` follows the
        // database's collation, which on PostgreSQL need not be bytewise.
        let mut codes: Vec<&str> = skus.iter().map(|(code, _)| code.as_str()).collect();
        codes.sort_unstable();
        lock_sku_rows(&mut *transaction, &codes).await?;
        let current: Option<(String, String, i64)> = statement(
            "SELECT title, shop, version FROM product WHERE id = $1 AND deleted_at IS NULL",
        )
        .bind(id.as_str())
        .fetch_optional_as(&mut *transaction)
        .await?;
        let Some((old_title, shop, version)) = current else {
            let response = renderer.rejected(&Rejection::new(
                ErrorCode::NotFound,
                format!("product '{id}' does not exist or was deleted"),
            ));
            return commit_with_answer(transaction, claim, response).await;
        };
        // Read under the product's SKU rows' locks: every writer of the product's version
        // (an edit, a shelf change of one of its SKUs) takes one of them first, so the
        // version cannot move between this check and the update.
        if let Some(expected) = changes.expected_version
            && expected != version
        {
            let response = renderer.rejected(&Rejection::new(
                ErrorCode::VersionConflict,
                format!(
                    "product '{id}' is at version {version}, not {expected}: it changed since it was read"
                ),
            ));
            return commit_with_answer(transaction, claim, response).await;
        }
        let fields = changes.field_names();
        // An edit that sets nothing (`{}`, or only the version it expects) changes
        // nothing: no new version, no `sku.changed` naming no field. It answers the
        // product as it stands, a check that the version is still the one seen.
        if !fields.is_empty() {
            if let Some(title) = &changes.title {
                // A product's SKUs show its title as their own (carts, orders, the SKU
                // view): those still showing the product's old one take the new one; a
                // SKU given a title of its own keeps it.
                statement(
                    "UPDATE sku SET title = $2, version = version + 1, updated_at = $3 \
                     WHERE product_id = $1 AND title = $4 AND sale_status <> $5",
                )
                .bind(id.as_str())
                .bind(title.as_str())
                .bind(now.unix_milliseconds())
                .bind(old_title.as_str())
                // A deleted SKU is terminal: it keeps the title it was deleted with.
                .bind(SaleStatus::Deleted.as_str())
                .execute(&mut *transaction)
                .await?;
            }
            let deleted = SaleStatus::Deleted.as_str();
            for (code, _) in skus.iter().filter(|(_, status)| status != deleted) {
                announce_sku_changed(
                    &mut *transaction,
                    code,
                    &shop,
                    Some(id.as_str()),
                    &fields,
                    now,
                )
                .await?;
            }
            let updated = statement(
                "UPDATE product SET title = COALESCE($2, title), image_url = COALESCE($3, image_url), \
                 category = COALESCE($4, category), supplier = COALESCE($5, supplier), \
                 version = version + 1, updated_at = $6 \
                 WHERE id = $1 AND deleted_at IS NULL AND version = $7",
            )
            .bind(id.as_str())
            .bind(changes.title.as_ref().map(Title::as_str))
            .bind(changes.image_url.as_ref().map(ImageUrl::as_str))
            .bind(changes.category.as_ref().map(CategoryCode::as_str))
            .bind(changes.supplier.as_ref().map(SupplierCode::as_str))
            .bind(now.unix_milliseconds())
            .bind(version)
            .execute(&mut *transaction)
            .await?;
            expect_one_row(updated, "updating a product read under its SKU rows' locks")?;
        }
        let product = load_product(&mut *transaction, id)
            .await?
            .ok_or_else(|| invariant("a product vanished inside its own transaction"))?;
        let response = renderer.product_saved(&product, false);
        commit_with_answer(transaction, claim, response).await
    }

    pub async fn product(&self, id: &ProductId) -> Result<Option<Product>, StoreError> {
        let mut transaction = self.begin_writer_read().await?;
        let product = load_product(&mut *transaction, id).await;
        transaction.rollback().await?;
        product
    }

    /// Products oldest first, each with its SKUs (the staff's list): of one shop, one
    /// category and one supplier when given, after the product `after`, at most
    /// `limit`. Deleted products are listed too (`deleted_at` set).
    pub async fn products_page(
        &self,
        filter: &ProductFilter,
        after: Option<&ProductId>,
        limit: i64,
    ) -> Result<Vec<Product>, StoreError> {
        let mut transaction = self.begin_writer_read().await?;
        let products = load_products_page(&mut *transaction, filter, after, limit).await;
        transaction.rollback().await?;
        products
    }

    /// The shopper's product view, a display read.
    pub async fn display_product(
        &self,
        reader: &ReadHandle,
        id: &ProductId,
        now: Timestamp,
    ) -> Result<Displayed<Option<Product>>, StoreError> {
        displayed!(self, reader, now, |transaction| load_product(
            &mut *transaction,
            id
        )
        .await)
    }
}

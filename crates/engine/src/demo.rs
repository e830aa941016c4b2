//! A small supermarket catalog for trying every endpoint at once (`stockd seed`,
//! `stockd serve --demo`). Loading it twice changes nothing: every step carries a fixed
//! idempotency key, so the second time each one replays; and since keys are forgotten
//! after their retention (a day), what is there already is looked for first: a product
//! whose SKU exists is left as it is (its stock is not received again), and so is the
//! operator and the service key.

use std::collections::HashMap;

use domain::{
    CategoryCode, Currency, IdempotencyKey, ImageUrl, OperatorId, PriceMinor, Principal, Quantity,
    ShelfOperation, ShopCode, SkuCode, SupplierCode, Title,
};
use store::{IdempotencyClaim, MovementQuantity, ScopedKey, TargetSelector};

use crate::catalog::{DraftSku, ProductDraft, ShelfRequest};
use crate::{Engine, EngineError};

/// What the demo loaded, for the command line to print.
#[derive(Debug, Clone, Default)]
pub struct DemoSummary {
    pub product_ids: Vec<String>,
    pub skus: Vec<String>,
    /// The demo operator's token, when this load created the operator.
    pub operator_token: Option<String>,
    /// The demo checkout backend's service key secret, when this load created it.
    pub service_secret: Option<String>,
}

struct DemoProduct {
    key: &'static str,
    title: &'static str,
    image: Option<&'static str>,
    category: &'static str,
    supplier: &'static str,
    /// (sku, price in fen, spec, units received)
    skus: &'static [(&'static str, i64, &'static str, i64)],
    on_shelf: bool,
}

const SHOP: &str = "demo-market";

const CATALOG: &[DemoProduct] = &[
    DemoProduct {
        key: "milk",
        title: "Fresh milk",
        image: Some("https://images.example.com/demo/milk.jpg"),
        category: "dairy",
        supplier: "bright-dairy",
        skus: &[
            ("MILK-1L", 599, "1 L bottle", 120),
            ("MILK-1L-X6", 3299, "6 x 1 L", 20),
        ],
        on_shelf: true,
    },
    DemoProduct {
        key: "yogurt",
        title: "Plain yogurt",
        image: Some("https://images.example.com/demo/yogurt.jpg"),
        category: "dairy",
        supplier: "bright-dairy",
        skus: &[("YOGURT-150G", 399, "150 g cup", 60)],
        on_shelf: true,
    },
    DemoProduct {
        key: "bread",
        title: "Whole-wheat bread",
        image: Some("https://images.example.com/demo/bread.jpg"),
        category: "bakery",
        supplier: "golden-bakery",
        skus: &[("BREAD-WW-500G", 1299, "500 g loaf", 1)],
        on_shelf: true,
    },
    DemoProduct {
        key: "eggs",
        title: "Free-range eggs",
        image: Some("https://images.example.com/demo/eggs.jpg"),
        category: "fresh",
        supplier: "green-farm",
        skus: &[("EGGS-10", 1599, "box of 10", 0)],
        on_shelf: true,
    },
    DemoProduct {
        key: "mooncake",
        title: "Seasonal mooncakes",
        image: None,
        category: "bakery",
        supplier: "golden-bakery",
        skus: &[("MOONCAKE-4", 8800, "gift box of 4", 30)],
        on_shelf: false,
    },
];

fn claim(key: String) -> Result<IdempotencyClaim, EngineError> {
    let key = IdempotencyKey::parse(&key).map_err(|error| EngineError::Internal(error.0))?;
    Ok(IdempotencyClaim {
        key: ScopedKey::new(&Principal::Admin, &key),
        fingerprint: format!("demo-catalog-v1:{}", key.as_str()),
    })
}

fn parsed<T>(
    parse: impl Fn(&str) -> Result<T, domain::ParseError>,
    text: &str,
) -> Result<T, EngineError> {
    parse(text).map_err(|error| EngineError::Internal(format!("demo catalog: {error}")))
}

/// A demo product's opening stock, received; its SKUs noted in the summary.
async fn receive_demo_stock(
    engine: &Engine,
    product: &DemoProduct,
    summary: &mut DemoSummary,
) -> Result<(), EngineError> {
    let admin = Principal::Admin;
    for (code, _, _, units) in product.skus {
        summary.skus.push((*code).to_owned());
        // A SKU with a stock row had its opening stock received by an earlier load
        // (rows are made by a receipt): received again once the key was forgotten,
        // it would be booked twice.
        let received = stored_sku(engine, code)
            .await?
            .is_some_and(|sku| !sku.stock.is_empty());
        if *units > 0 && !received {
            let quantity = Quantity::new(*units).map_err(|error| EngineError::Internal(error.0))?;
            engine
                .record_movement(
                    &admin,
                    &claim(format!("demo-receive-{code}"))?,
                    parsed(SkuCode::parse, code)?,
                    None,
                    MovementQuantity::Receive(quantity),
                )
                .await?;
        }
    }
    Ok(())
}

/// A demo SKU as stored, if an earlier load created it.
async fn stored_sku(engine: &Engine, code: &str) -> Result<Option<domain::Sku>, EngineError> {
    engine
        .inner
        .store
        .sku(&parsed(SkuCode::parse, code)?)
        .await
        .map_err(|error| crate::log_store_error("demo_catalog", error))
}

/// One demo product: created, its stock received, and put on the shelf when it is
/// complete. Answers its id.
async fn load_demo_product(
    engine: &Engine,
    shop: &ShopCode,
    product: &DemoProduct,
    summary: &mut DemoSummary,
) -> Result<String, EngineError> {
    let admin = Principal::Admin;
    // What an earlier load did is looked for first, each step on its own: a load cut
    // short (a stop, a lock timeout) is finished, not skipped, and nothing is done
    // twice once the fixed keys are forgotten (after their retention).
    let first_sku = match product.skus.first() {
        Some((code, ..)) => stored_sku(engine, code).await?,
        None => None,
    };
    let product_id = match first_sku.as_ref().and_then(|sku| sku.product_id.as_ref()) {
        Some(id) => id.as_str().to_owned(),
        None => create_demo_product(engine, shop, product).await?,
    };
    receive_demo_stock(engine, product, summary).await?;
    // Put on the shelf only from review, as the first load would have: a product an
    // operator took off since stays off.
    let in_review = stored_sku(engine, product.skus.first().map_or("", |(code, ..)| *code))
        .await?
        .is_some_and(|sku| sku.sale_status == domain::SaleStatus::PendingReview);
    if product.on_shelf && in_review {
        let request = ShelfRequest {
            operation: ShelfOperation::On,
            scheduled_at: None,
            recurrence: None,
            selector: TargetSelector {
                product_ids: vec![parsed(domain::ProductId::parse, &product_id)?],
                ..TargetSelector::default()
            },
            expected_versions: HashMap::new(),
            remark: "demo catalog".into(),
        };
        engine
            .shelf(
                &admin,
                &claim(format!("demo-shelf-{}", product.key))?,
                request,
            )
            .await?;
    }
    Ok(product_id)
}

/// Creates a demo product; answers its id.
async fn create_demo_product(
    engine: &Engine,
    shop: &ShopCode,
    product: &DemoProduct,
) -> Result<String, EngineError> {
    let admin = Principal::Admin;
    let mut skus = Vec::new();
    for (code, price, spec, _) in product.skus {
        skus.push(DraftSku {
            code: parsed(SkuCode::parse, code)?,
            price: PriceMinor::new(*price).map_err(|error| EngineError::Internal(error.0))?,
            currency: parsed(Currency::parse, "CNY")?,
            spec: (*spec).to_owned(),
            per_user_limit: None,
        });
    }
    let draft = ProductDraft {
        title: parsed(Title::parse, product.title)?,
        image_url: product
            .image
            .map(|url| parsed(ImageUrl::parse, url))
            .transpose()?,
        category: parsed(CategoryCode::parse, product.category)?,
        supplier: parsed(SupplierCode::parse, product.supplier)?,
        shop: shop.clone(),
        skus,
    };
    let reply = engine
        .create_product(
            &admin,
            &claim(format!("demo-product-{}", product.key))?,
            draft,
        )
        .await?;
    let body: serde_json::Value = serde_json::from_str(&reply.response.body)
        .map_err(|error| EngineError::Internal(format!("demo catalog: {error}")))?;
    Ok(body["product_id"]
        .as_str()
        .ok_or_else(|| EngineError::Internal(format!("demo catalog: {}", reply.response.body)))?
        .to_owned())
}

/// Loads the demo catalog: five products in shop `demo-market` (one left pending
/// review: it has no image), their stock (eggs at zero: temporarily out of stock),
/// an operator `demo-operator` of that shop and a service key `demo-checkout` for its
/// checkout backend.
pub async fn load_demo_catalog(engine: &Engine) -> Result<DemoSummary, EngineError> {
    let admin = Principal::Admin;
    let mut summary = DemoSummary::default();
    let shop = parsed(ShopCode::parse, SHOP)?;
    for product in CATALOG {
        let product_id = load_demo_product(engine, &shop, product, &mut summary).await?;
        summary.product_ids.push(product_id);
    }
    let operator = parsed(OperatorId::parse, "demo-operator")?;
    let reply = engine
        .create_operator(&admin, &claim("demo-operator".into())?, &operator, &shop)
        .await?;
    if !reply.replayed {
        let body: serde_json::Value =
            serde_json::from_str(&reply.response.body).unwrap_or_default();
        summary.operator_token = body["token"].as_str().map(str::to_owned);
    }
    let existing = engine.service_keys(&admin).await?;
    if existing
        .iter()
        .any(|key| key.shop == shop && key.name == "demo-checkout" && key.revoked_at.is_none())
    {
        return Ok(summary);
    }
    let reply = engine
        .create_service_key(
            &admin,
            &claim("demo-checkout".into())?,
            &shop,
            "demo-checkout",
        )
        .await?;
    if !reply.replayed {
        let body: serde_json::Value =
            serde_json::from_str(&reply.response.body).unwrap_or_default();
        summary.service_secret = body["secret"].as_str().map(str::to_owned);
    }
    Ok(summary)
}

//! The catalog's use cases (seed 003): products, shelf operations now and on a
//! schedule, the shelf log, operators, carts and checkout.

use std::collections::{BTreeSet, HashMap};

use domain::limits::{PRODUCT_SKUS_MAX, SCHEDULE_HORIZON_SECONDS_MAX, SHELF_TARGETS_MAX};
use domain::{
    Action, CategoryCode, Currency, Denied, ErrorCode, ImageUrl, OrderId, PriceMinor, Principal,
    Product, ProductId, Quantity, Recurrence, ReservationId, ReservationLine, ScheduleId,
    ShelfLogEntry, ShelfOperation, ShopCode, SkuCode, SupplierCode, Timestamp, Title, TtlSeconds,
    UserId, WarehouseCode, authorize,
};
use store::{
    Actor, AppliedSchedule, Cart, Displayed, IdempotencyClaim, NewOrder, NewProduct, NewSku,
    ProductChanges, ReadHandle, ShelfChange, ShelfLogQuery, ShelfScheduling, ShelfTarget,
    SkippedLine, TargetSelector,
};

use crate::{Engine, EngineError, Reply, forbidden, log_store_error};

/// A product as an operator submits it.
#[derive(Debug, Clone)]
pub struct ProductDraft {
    pub title: Title,
    pub image_url: Option<ImageUrl>,
    pub category: CategoryCode,
    pub supplier: SupplierCode,
    pub shop: ShopCode,
    pub skus: Vec<DraftSku>,
}

/// One SKU of a product draft.
#[derive(Debug, Clone)]
pub struct DraftSku {
    pub code: SkuCode,
    pub price: PriceMinor,
    pub currency: Currency,
    pub spec: String,
    pub per_user_limit: Option<i64>,
}

/// A shelf operation as an operator submits it.
#[derive(Debug, Clone)]
pub struct ShelfRequest {
    pub operation: ShelfOperation,
    /// `Some` schedules the operation (`on_at`, `off_at`) instead of applying it now.
    pub scheduled_at: Option<Timestamp>,
    /// `Some` repeats a scheduled operation every day at the same minute.
    pub recurrence: Option<Recurrence>,
    pub selector: TargetSelector,
    pub expected_versions: HashMap<SkuCode, i64>,
    pub remark: String,
}

const MINUTE_MILLISECONDS: i64 = 60_000;

/// A shelf change to schedule, its targets resolved.
struct Scheduled {
    operation: ShelfOperation,
    /// The start of the minute it applies at, checked by [`due_minute`].
    due_at: Timestamp,
    recurrence: Option<Recurrence>,
    targets: Vec<ShelfTarget>,
    actor: Actor,
    remark: String,
}

impl Engine {
    /// `POST /v1/products`: a product and its SKUs, all `PENDING_REVIEW`.
    pub async fn create_product(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        draft: ProductDraft,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::EditCatalog, Some(&draft.shop)).map_err(forbidden)?;
        if draft.skus.is_empty() || draft.skus.len() > PRODUCT_SKUS_MAX {
            return Err(EngineError::InvalidArgument(format!(
                "skus must hold 1 to {PRODUCT_SKUS_MAX} entries"
            )));
        }
        let distinct: BTreeSet<&SkuCode> = draft.skus.iter().map(|sku| &sku.code).collect();
        if distinct.len() != draft.skus.len() {
            return Err(EngineError::InvalidArgument(
                "a SKU code appears twice".into(),
            ));
        }
        for sku in &draft.skus {
            crate::refuse_stockds_own_sku_code(&sku.code)?;
        }
        let now = self.now();
        let product = NewProduct {
            id: ProductId::generate(now, rand::random()),
            title: draft.title,
            image_url: draft.image_url,
            category: draft.category,
            supplier: draft.supplier,
            shop: draft.shop,
            skus: draft
                .skus
                .into_iter()
                .map(|sku| NewSku {
                    code: sku.code,
                    price: sku.price,
                    currency: sku.currency,
                    spec: sku.spec,
                    per_user_limit: sku.per_user_limit,
                })
                .collect(),
        };
        let renderer = self.inner.renderer.as_ref();
        self.idempotent("create_product", claim, || {
            self.retried("create_product", || {
                self.inner
                    .store
                    .create_product(claim, &product, self.now(), renderer)
            })
        })
        .await
    }

    /// The product with its SKUs and stock, or `not_found`.
    pub async fn product(&self, id: &ProductId) -> Result<Product, EngineError> {
        self.inner
            .store
            .product(id)
            .await
            .map_err(|error| log_store_error("get_product", error))?
            .ok_or_else(|| EngineError::NotFound(format!("product '{id}' does not exist")))
    }

    /// The shopper's product view, a display read.
    pub async fn display_product(
        &self,
        reader: &ReadHandle,
        id: &ProductId,
    ) -> Result<Displayed<Product>, EngineError> {
        let product = self
            .inner
            .store
            .display_product(reader, id, self.now())
            .await
            .map_err(|error| log_store_error("get_product", error))?;
        crate::counted_display(product)
            .found()
            .ok_or_else(|| EngineError::NotFound(format!("product '{id}' does not exist")))
    }

    /// The product, if `principal` may see it as staff.
    pub async fn product_for(
        &self,
        principal: &Principal,
        id: &ProductId,
    ) -> Result<Product, EngineError> {
        authorize(principal, Action::ViewStaffData, None).map_err(forbidden)?;
        let product = self.product(id).await?;
        authorize(principal, Action::ViewStaffData, Some(&product.shop)).map_err(forbidden)?;
        Ok(product)
    }

    /// `PATCH /v1/products/{id}`.
    pub async fn update_product(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        id: &ProductId,
        changes: ProductChanges,
    ) -> Result<Reply, EngineError> {
        // A product's shop never changes, so checking it before the transaction holds.
        authorize(principal, Action::EditCatalog, None).map_err(forbidden)?;
        // A product that does not exist is answered like one deleted: stored.
        let product = match self.product(id).await {
            Ok(product) => product,
            Err(refusal) => {
                return self
                    .refusal_under_key("update_product", claim, refusal)
                    .await;
            }
        };
        authorize(principal, Action::EditCatalog, Some(&product.shop)).map_err(forbidden)?;
        let renderer = self.inner.renderer.as_ref();
        self.idempotent("update_product", claim, || {
            self.retried("update_product", || {
                self.inner
                    .store
                    .update_product(claim, id, &changes, self.now(), renderer)
            })
        })
        .await
    }

    /// `POST /v1/admin/shelf`: on, off or delete, now or at a minute in the future.
    pub async fn shelf(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        request: ShelfRequest,
    ) -> Result<Reply, EngineError> {
        let action = match request.operation {
            ShelfOperation::Delete => Action::DeleteCatalog,
            ShelfOperation::On | ShelfOperation::Off => Action::ChangeShelf,
        };
        authorize(principal, action, None).map_err(forbidden)?;
        if request.recurrence.is_some() && request.scheduled_at.is_none() {
            return Err(EngineError::InvalidArgument(
                "repeat goes with on_at or off_at".into(),
            ));
        }
        // A schedule applies at its minute, to whatever version each SKU has then: a
        // version check the caller asks for could not be kept, so it is refused
        // rather than dropped unsaid.
        if !request.expected_versions.is_empty() && request.scheduled_at.is_some() {
            return Err(EngineError::InvalidArgument(
                "expected_versions go with on and off (applied now), not with on_at or off_at"
                    .into(),
            ));
        }
        // The targets a selector names and the minute a schedule may name change with
        // time: a retry answers what the first call answered, before either is checked.
        if let Some(first) = self.first_answer("shelf", claim).await? {
            return Ok(first);
        }
        // The request's own checks before the catalog's: a malformed one stores nothing.
        let due_at = request
            .scheduled_at
            .map(|scheduled_at| due_minute(request.operation, scheduled_at, self.held_back_now()))
            .transpose()?;
        let actor = Actor::of(principal);
        // Targets that name nothing, too much or what does not exist are a refusal of
        // the catalog as it stands: stored, so a retry after a SKU is created hears it
        // again rather than applying.
        let targets = match self
            .shelf_targets(principal, action, &actor, request.selector)
            .await
        {
            Ok(targets) => targets,
            Err(refusal) => return self.refusal_under_key("shelf", claim, refusal).await,
        };
        let renderer = self.inner.renderer.as_ref();
        match due_at {
            None => {
                // A version check on a SKU the operation does not change would be
                // answered as kept without being made: the caller's guard is refused
                // (changing nothing), not dropped unsaid. What the selector resolves
                // to is the catalog's state: a refusal of it, stored like the others.
                if let Some(sku) = request
                    .expected_versions
                    .keys()
                    .filter(|sku| !targets.iter().any(|target| target.sku == **sku))
                    .min()
                {
                    let refusal = EngineError::Refused {
                        code: domain::ErrorCode::FailedPrecondition,
                        detail: format!(
                            "expected_versions names sku '{sku}', which this operation does not change"
                        ),
                    };
                    return self.refusal_under_key("shelf", claim, refusal).await;
                }
                let change = ShelfChange {
                    operation: request.operation,
                    targets,
                    expected_versions: request.expected_versions,
                    actor: actor.clone(),
                    remark: request.remark,
                    scheduled: false,
                };
                self.idempotent("shelf", claim, || {
                    self.retried("shelf", || {
                        self.inner.store.change_shelf(
                            claim,
                            &change,
                            (self.now(), self.held_back_now()),
                            renderer,
                        )
                    })
                })
                .await
            }
            Some(due_at) => {
                let scheduled = Scheduled {
                    operation: request.operation,
                    due_at,
                    recurrence: request.recurrence,
                    targets,
                    actor,
                    remark: request.remark,
                };
                self.schedule_shelf(claim, scheduled).await
            }
        }
    }

    /// The SKUs a shelf operation names, each one the caller may change: refused when the
    /// selector names nothing, too many or none that exist.
    async fn shelf_targets(
        &self,
        principal: &Principal,
        action: Action,
        actor: &Actor,
        selector: TargetSelector,
    ) -> Result<Vec<ShelfTarget>, EngineError> {
        let mut selector = selector;
        let names_something = !selector.product_ids.is_empty()
            || !selector.skus.is_empty()
            || selector.category.is_some()
            || selector.supplier.is_some();
        if !names_something {
            return Err(EngineError::InvalidArgument(
                "name the targets: product_ids, sku_ids, category or supplier".into(),
            ));
        }
        if selector.product_ids.len() + selector.skus.len() > SHELF_TARGETS_MAX {
            return Err(EngineError::InvalidArgument(format!(
                "at most {SHELF_TARGETS_MAX} targets"
            )));
        }
        let named_shop = selector.shop.clone();
        if let Some(shop) = &actor.shop {
            // An operator's category and supplier operations stay within its shop.
            if selector.shop.as_ref().is_some_and(|named| named != shop) {
                return Err(EngineError::Forbidden(format!(
                    "an operator of shop '{shop}' acts in that shop only"
                )));
            }
            selector.shop = Some(shop.clone());
        }
        let targets = self
            .inner
            .store
            .resolve_shelf_targets(&selector)
            .await
            .map_err(|error| log_store_error("resolve_shelf_targets", error))?;
        // The caller's shop first: another shop's SKU is refused as such (403, not
        // stored), before a refusal of what was not found, which is stored.
        for target in &targets {
            authorize(principal, action, target.shop.as_ref()).map_err(forbidden)?;
        }
        // A named shop narrows the ids too: an admin's `delete` naming one shop never
        // reaches another's SKU it also named by mistake.
        if let Some(named) = &named_shop
            && let Some(target) = targets
                .iter()
                .find(|target| target.shop.as_ref() != Some(named))
        {
            return Err(EngineError::NotFound(format!(
                "sku '{}' is not of shop '{named}'",
                target.sku
            )));
        }
        if targets.is_empty() {
            return Err(EngineError::NotFound("the operation names no SKU".into()));
        }
        if targets.len() > SHELF_TARGETS_MAX {
            // The store stops reading one past the limit, so the count is a floor.
            return Err(EngineError::Refused {
                code: ErrorCode::FailedPrecondition,
                detail: format!(
                    "the operation names more than {SHELF_TARGETS_MAX} SKUs; at most \
                     {SHELF_TARGETS_MAX} at once"
                ),
            });
        }
        refuse_unmatched_names(&selector, &targets)?;
        Ok(targets)
    }

    /// Records a shelf change for the start of the minute it names.
    async fn schedule_shelf(
        &self,
        claim: &IdempotencyClaim,
        scheduled: Scheduled,
    ) -> Result<Reply, EngineError> {
        let renderer = self.inner.renderer.as_ref();
        let now = self.now();
        let due_at = scheduled.due_at;
        let scheduling = ShelfScheduling {
            operation: scheduled.operation,
            targets: scheduled
                .targets
                .into_iter()
                .map(|target| (ScheduleId::generate(now, rand::random()), target))
                .collect(),
            due_at,
            actor: scheduled.actor,
            remark: scheduled.remark,
            recurrence: scheduled.recurrence,
        };
        let reply = self
            .idempotent("schedule_shelf", claim, || {
                self.retried("schedule_shelf", || {
                    self.inner
                        .store
                        .schedule_shelf(claim, &scheduling, self.now(), renderer)
                })
            })
            .await?;
        self.inner.schedules_changed.notify_one();
        Ok(reply)
    }

    /// `DELETE /v1/products/{id}`: every SKU of the product to `DELETED` (admin only).
    pub async fn delete_product(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        id: &ProductId,
    ) -> Result<Reply, EngineError> {
        let request = ShelfRequest {
            operation: ShelfOperation::Delete,
            scheduled_at: None,
            recurrence: None,
            selector: TargetSelector {
                product_ids: vec![id.clone()],
                ..TargetSelector::default()
            },
            expected_versions: HashMap::new(),
            remark: "product deleted".into(),
        };
        self.shelf(principal, claim, request).await
    }

    /// One step of the schedule worker: applies a batch of due schedules (with every
    /// due schedule of its SKUs), judged due by [`Engine::held_back_now`]: an
    /// instance whose clock runs ahead applies none early.
    pub async fn schedule_step(&self) -> Result<Vec<AppliedSchedule>, EngineError> {
        let applied = self
            .retried("apply_schedules", || {
                self.inner.store.apply_due_schedules(
                    (self.now(), self.held_back_now()),
                    self.inner.config.schedule_batch_size,
                )
            })
            .await?;
        metrics::counter!("stockd_shelf_schedules_applied_total").increment(applied.len() as u64);
        Ok(applied)
    }

    pub async fn next_schedule_due(&self) -> Result<Option<Timestamp>, EngineError> {
        self.inner
            .store
            .next_schedule_due()
            .await
            .map_err(|error| log_store_error("next_schedule", error))
    }

    /// Waits until a new schedule is recorded in this process.
    pub async fn schedules_changed(&self) {
        self.inner.schedules_changed.notified().await;
    }

    /// `GET /v1/admin/shelf-log`: an operator sees only its shop. A display read.
    /// `GET /v1/admin/products`: the staff's product list, an operator's own shop's.
    pub async fn products_page(
        &self,
        principal: &Principal,
        mut filter: store::ProductFilter,
        after: Option<&ProductId>,
        limit: i64,
    ) -> Result<Vec<Product>, EngineError> {
        authorize(principal, Action::ViewStaffData, filter.shop.as_ref()).map_err(forbidden)?;
        if let Some(shop) = principal.shop() {
            filter.shop = Some(shop.clone());
        }
        self.inner
            .store
            .products_page(&filter, after, limit)
            .await
            .map_err(|error| log_store_error("products_page", error))
    }

    /// `GET /v1/admin/schedules`: schedules of one status by due time, after the
    /// schedule `after` when given, an operator's own shop's.
    pub async fn schedules(
        &self,
        principal: &Principal,
        shop: Option<&ShopCode>,
        status: ScheduleStatus,
        after: Option<&ScheduleId>,
        limit: i64,
    ) -> Result<Vec<store::ScheduleRecord>, EngineError> {
        authorize(principal, Action::ViewStaffData, shop).map_err(forbidden)?;
        let shop = principal.shop().or(shop);
        self.inner
            .store
            .schedules(shop, status.as_str(), after, limit)
            .await
            .map_err(|error| log_store_error("schedules", error))
    }

    /// `POST /v1/admin/schedules/{id}/cancel`: withdraws the pending occurrence of the
    /// schedule's series (the schedule itself while it is pending; a daily one's next
    /// occurrence after it applied), for staff who may change its shop's shelf.
    pub async fn cancel_schedule(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        id: &ScheduleId,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::ChangeShelf, None).map_err(forbidden)?;
        // A schedule's shop never changes: checked before the unit of work, it
        // still holds when the unit of work runs.
        let schedule = self
            .inner
            .store
            .schedule(id)
            .await
            .map_err(|error| log_store_error("schedule", error))?;
        if let Some(schedule) = &schedule {
            authorize(principal, Action::ChangeShelf, schedule.shop.as_ref()).map_err(forbidden)?;
            // `authorize` lets any shop's staff near what no shop owns.
            if schedule.shop.is_none() && principal.shop().is_some() {
                return Err(forbidden(Denied(
                    "a standalone SKU's schedule is the admin's".into(),
                )));
            }
        }
        let actor = Actor::of(principal);
        let renderer = self.inner.renderer.as_ref();
        let reply = self
            .idempotent("cancel_schedule", claim, || {
                self.retried("cancel_schedule", || {
                    self.inner
                        .store
                        .cancel_schedule(claim, id, &actor, self.now(), renderer)
                })
            })
            .await?;
        self.inner.schedules_changed.notify_one();
        Ok(reply)
    }

    pub async fn shelf_log(
        &self,
        principal: &Principal,
        mut query: ShelfLogQuery,
        reader: &ReadHandle,
    ) -> Result<Displayed<Vec<ShelfLogEntry>>, EngineError> {
        authorize(principal, Action::ViewStaffData, None).map_err(forbidden)?;
        if let Some(shop) = principal.shop() {
            query.shop = Some(shop.clone());
        }
        self.inner
            .store
            .display_shelf_log(reader, &query, self.now())
            .await
            .map(crate::counted_display)
            .map_err(|error| log_store_error("shelf_log", error))
    }

    /// `PUT` (with a quantity) or `DELETE` (without) `/v1/carts/{user}/items/{sku}`. A
    /// cart holds no stock; a shopper's cart in a shop holds that shop's SKUs.
    pub async fn set_cart_item(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        user: &UserId,
        sku: &SkuCode,
        quantity: Option<Quantity>,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::UseCarts, None).map_err(forbidden)?;
        let shop = match self.shop_of(sku).await? {
            Some(shop) => shop,
            // An unknown SKU: the store answers `not_found` (or removes nothing).
            None => principal
                .shop()
                .cloned()
                .unwrap_or_else(ShopCode::default_shop),
        };
        authorize(principal, Action::UseCarts, Some(&shop)).map_err(forbidden)?;
        let renderer = self.inner.renderer.as_ref();
        let quantity = quantity.map(Quantity::get);
        self.idempotent("cart", claim, || {
            self.retried("cart", || {
                self.inner.store.set_cart_item(
                    claim,
                    &shop,
                    user,
                    sku,
                    quantity,
                    (self.now(), self.held_back_now()),
                    renderer,
                )
            })
        })
        .await
    }

    /// A shopper's cart: the lines of the caller's shop (the admin sees every line).
    pub async fn cart(&self, principal: &Principal, user: &UserId) -> Result<Cart, EngineError> {
        authorize(principal, Action::UseCarts, None).map_err(forbidden)?;
        self.inner
            .store
            .cart(principal.shop(), user, self.held_back_now())
            .await
            .map_err(|error| log_store_error("cart", error))
    }

    /// `GET /v1/carts/{user}`: the cart as a page shows it, a display read.
    pub async fn display_cart(
        &self,
        principal: &Principal,
        user: &UserId,
        reader: &ReadHandle,
    ) -> Result<Displayed<Cart>, EngineError> {
        authorize(principal, Action::UseCarts, None).map_err(forbidden)?;
        self.inner
            .store
            .display_cart(reader, principal.shop(), user, self.held_back_now())
            .await
            .map(crate::counted_display)
            .map_err(|error| log_store_error("cart", error))
    }

    /// `POST /v1/carts/{user}/checkout`: an order (`PENDING_PAYMENT`) of the lines that
    /// can be ordered now, reporting the others, and refused when none can. The order
    /// holds its stock like any order: paid, cancelled or expired through the order.
    /// Off-shelf and stock are checked again inside the order's transaction.
    pub async fn checkout(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        user: &UserId,
        ttl: Option<TtlSeconds>,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::UseCarts, None).map_err(forbidden)?;
        // A retry answers from its stored result, even after the cart was emptied.
        if let Some(first) = self.first_answer("checkout", claim).await? {
            return Ok(first);
        }
        // A refusal of the cart as read here is stored under the key like one the
        // order's transaction reaches, and a retry of a checkout that ordered meanwhile
        // (the cart now empty, or holding only what it skipped) hears the order.
        let order = match self.checkout_order(principal, user, ttl).await {
            Ok(order) => order,
            Err(refusal) => return self.refusal_under_key("checkout", claim, refusal).await,
        };
        // A checkout waits in a campaign's line with its connection held: carts offer
        // no ticket.
        // The order's transaction takes the ordered lines out of the cart, or refuses
        // when the cart changed since it was read here.
        self.place_order(principal, "checkout", claim, order, false, false)
            .await?
            .answered()
    }

    /// The order a checkout of the cart as read now places, or why it places none.
    async fn checkout_order(
        &self,
        principal: &Principal,
        user: &UserId,
        ttl: Option<TtlSeconds>,
    ) -> Result<NewOrder, EngineError> {
        let cart = self.cart(principal, user).await?;
        // Nothing to check out: the request is well formed, the cart holds no line.
        if cart.lines.is_empty() {
            return Err(EngineError::NotFound(format!(
                "the cart of '{user}' is empty: nothing to check out"
            )));
        }
        let (lines, skipped) = orderable_lines(&cart)?;
        // A cart holds more lines than an order may: the shopper chooses what to leave.
        if lines.len() > domain::limits::RESERVATION_LINES_MAX {
            return Err(EngineError::Refused {
                code: ErrorCode::FailedPrecondition,
                detail: format!(
                    "the cart has {} lines that can be ordered; an order holds at most {}: remove some and check out again",
                    lines.len(),
                    domain::limits::RESERVATION_LINES_MAX
                ),
            });
        }
        let skus: Vec<&SkuCode> = lines.iter().map(|line| &line.sku).collect();
        let shop = self
            .scope_of_skus(principal, Action::UseCarts, &skus)
            .await
            .map_err(|error| match error {
                EngineError::Refused {
                    code: ErrorCode::FailedPrecondition,
                    ..
                } => EngineError::Refused {
                    code: ErrorCode::FailedPrecondition,
                    detail: "the cart holds SKUs of several shops; check out as one shop's \
                             service key"
                        .into(),
                },
                other => other,
            })?;
        let ttl_seconds = ttl.map_or(
            self.inner.config.reservation_ttl_seconds_default,
            TtlSeconds::get,
        );
        Ok(new_checkout_order(
            self.now(),
            shop,
            user,
            lines,
            skipped,
            ttl_seconds,
        ))
    }
}

/// The start of the minute a shelf change scheduled for `scheduled_at` applies at: a
/// minute in the future, within a year; deletes are never scheduled.
fn due_minute(
    operation: ShelfOperation,
    scheduled_at: Timestamp,
    now: Timestamp,
) -> Result<Timestamp, EngineError> {
    if operation == ShelfOperation::Delete {
        return Err(EngineError::InvalidArgument(
            "deletes cannot be scheduled".into(),
        ));
    }
    // Minute precision: the change applies at the start of the named minute.
    let due_at = Timestamp::from_unix_milliseconds(
        scheduled_at
            .unix_milliseconds()
            .div_euclid(MINUTE_MILLISECONDS)
            * MINUTE_MILLISECONDS,
    );
    if due_at <= now {
        return Err(EngineError::InvalidArgument(format!(
            "scheduled_at must be a minute in the future (now is {now})"
        )));
    }
    if due_at > now.plus_seconds(SCHEDULE_HORIZON_SECONDS_MAX) {
        return Err(EngineError::InvalidArgument(
            "scheduled_at is more than a year ahead".into(),
        ));
    }
    Ok(due_at)
}

/// Names in an operation shown at most in a refusal's detail.
const UNMATCHED_NAMES_SHOWN_MAX: usize = 10;

/// Every SKU and product an operation names by id must be found: an operation that
/// names one that does not exist (or a product without a SKU) is refused as a whole,
/// changing nothing, rather than applied to the rest while reporting success (seed 003
/// §3.1: taking a product that does not exist off the shelf "succeeded"). Categories
/// and suppliers select what they hold, which may be nothing.
fn refuse_unmatched_names(
    selector: &TargetSelector,
    targets: &[ShelfTarget],
) -> Result<(), EngineError> {
    let skus: std::collections::HashSet<&SkuCode> =
        targets.iter().map(|target| &target.sku).collect();
    let products: std::collections::HashSet<&ProductId> = targets
        .iter()
        .filter_map(|target| target.product_id.as_ref())
        .collect();
    let unmatched: Vec<String> = selector
        .skus
        .iter()
        .filter(|sku| !skus.contains(sku))
        .map(|sku| format!("sku '{sku}'"))
        .chain(
            selector
                .product_ids
                .iter()
                .filter(|product| !products.contains(product))
                .map(|product| format!("product '{product}'")),
        )
        .collect();
    if unmatched.is_empty() {
        return Ok(());
    }
    let shown: Vec<&str> = unmatched
        .iter()
        .take(UNMATCHED_NAMES_SHOWN_MAX)
        .map(String::as_str)
        .collect();
    let more = unmatched.len().saturating_sub(shown.len());
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    Err(EngineError::NotFound(format!(
        "the operation names what does not exist (or a product without a SKU): {}{more}; nothing was changed",
        shown.join(", ")
    )))
}

/// A cart's lines split into what can be ordered now and what cannot (with why); a
/// cart with nothing to order is refused with the first line's problem.
fn orderable_lines(cart: &Cart) -> Result<(Vec<ReservationLine>, Vec<SkippedLine>), EngineError> {
    let mut lines = Vec::new();
    let mut skipped = Vec::new();
    for (line, problem) in cart
        .lines
        .iter()
        .zip(domain::cart::problems_of(&cart.lines))
    {
        match problem {
            Some(problem) => skipped.push(SkippedLine {
                sku: line.sku.clone(),
                quantity: line.quantity,
                problem,
            }),
            None => lines.push(ReservationLine {
                sku: line.sku.clone(),
                warehouse: WarehouseCode::default_warehouse(),
                quantity: Quantity::new(line.quantity)
                    .map_err(|error| EngineError::Internal(error.0))?,
            }),
        }
    }
    if lines.is_empty() {
        let first = skipped[0].problem;
        let reasons: Vec<String> = skipped
            .iter()
            .map(|line| format!("{} ({})", line.sku, line.problem.as_str()))
            .collect();
        return Err(EngineError::Refused {
            code: first.code(),
            detail: format!(
                "no line of the cart can be ordered now: {}",
                reasons.join(", ")
            ),
        });
    }
    Ok((lines, skipped))
}

/// The order a checkout places: the orderable lines, held for `ttl_seconds`, with the
/// lines it skipped for the answer.
fn new_checkout_order(
    now: Timestamp,
    shop: store::ShopScope,
    user: &UserId,
    lines: Vec<ReservationLine>,
    skipped: Vec<SkippedLine>,
    ttl_seconds: i64,
) -> NewOrder {
    NewOrder {
        id: OrderId::generate(now, rand::random()),
        shop,
        user: user.clone(),
        reservation_id: ReservationId::generate(now, rand::random()),
        lines,
        expires_at: now.plus_seconds(ttl_seconds),
        skipped: Some(skipped),
        reference: domain::OrderReference::default(),
        undecided_when_short: false,
    }
}

/// A scheduled shelf change's status, as `GET /v1/admin/schedules` filters by it.
pub use domain::ScheduleStatus;

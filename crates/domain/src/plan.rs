//! Deciding a reservation batch in memory, after its stock rows are locked and before
//! anything is written. Pure, so the all-or-nothing and arrival-order rules are tested
//! without a database.

use std::collections::{BTreeMap, HashMap};

use crate::campaign::tally_sku;
use crate::{
    ErrorCode, Rejection, ReservationLine, SaleStatus, ShopCode, ShopScope, SkuCode, UserId,
    WarehouseCode,
};

pub type StockKey = (SkuCode, WarehouseCode);
/// A shopper: user ids are the shop's own, so they are unique within a shop only.
pub type ShopperKey = (ShopCode, UserId);
/// A shopper's tally of one SKU.
pub type PurchaseKey = (ShopCode, UserId, SkuCode);

/// What the reserving transaction read about a SKU, under the lock of its stock rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuFacts {
    pub sale_status: SaleStatus,
    pub shop: ShopCode,
    pub per_user_limit: Option<i64>,
}

/// One request to decide: its lines and who it is for.
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest<'a> {
    pub lines: &'a [ReservationLine],
    pub shop: &'a ShopScope,
    pub user: Option<&'a UserId>,
    /// The request's order number is taken by a committed request with another key:
    /// refused before anything else.
    pub order_ref_taken: bool,
    /// The request's order number, if any: an earlier request of the batch that was
    /// accepted with it takes it (one that was refused does not).
    pub order_ref: Option<&'a crate::OrderRef>,
    /// A campaign's request sent to one of its buckets while others may still hold
    /// units: when its bucket is short (and no other line is) it is left undecided
    /// (nothing stored), for the engine to send to another bucket, instead of refused
    /// as `insufficient_stock`.
    pub undecided_when_short: bool,
}

/// The shoppers' tallies the requests touch, read under lock, and the bound of open
/// holds per shopper. A missing entry counts as zero.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tallies {
    pub open_holds: HashMap<ShopperKey, i64>,
    pub purchased: HashMap<PurchaseKey, i64>,
    pub open_holds_max: i64,
}

/// The batch's decisions: one per request, in arrival order (an accepted request's
/// shop), the total each stock row must give up, and what the shoppers' tallies grow by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    pub decisions: Vec<Result<ShopCode, Rejection>>,
    /// Units taken from each row by the accepted requests; rows with nothing taken are
    /// absent. Ordered by (sku, warehouse): the order rows are written in.
    pub totals: BTreeMap<StockKey, i64>,
    /// New open holds per shopper (accepted requests that name a user).
    pub holds_added: BTreeMap<ShopperKey, i64>,
    /// New units per shopper and SKU (every line of an accepted request with a user),
    /// a campaign's lines under the campaign's tally code ([`crate::campaign::tally_sku`]).
    pub purchases_added: BTreeMap<PurchaseKey, i64>,
    /// Requests left undecided: their campaign bucket was short (see
    /// [`PlanRequest::undecided_when_short`]). Their decision is the refusal they would
    /// have had; nothing of theirs is written.
    pub undecided: Vec<usize>,
}

/// Accepts each request, in order, when every one of its lines fits in what the
/// requests before it left — stock, the shopper's open holds and per-user limits;
/// otherwise refuses it whole, taking nothing.
///
/// `skus` holds the SKUs that exist; `available` the locked rows' counters (a missing
/// row has nothing available).
pub fn plan_batch<'a>(
    requests: impl IntoIterator<Item = PlanRequest<'a>>,
    skus: &HashMap<SkuCode, SkuFacts>,
    available: &BTreeMap<StockKey, i64>,
    tallies: &Tallies,
) -> BatchPlan {
    let mut remaining = available.clone();
    let mut plan = BatchPlan {
        decisions: Vec::new(),
        totals: BTreeMap::new(),
        holds_added: BTreeMap::new(),
        purchases_added: BTreeMap::new(),
        undecided: Vec::new(),
    };
    let mut order_refs_accepted: std::collections::HashSet<(ShopCode, &str)> =
        std::collections::HashSet::new();
    for (index, request) in requests.into_iter().enumerate() {
        let decision =
            check_request(request, skus, &remaining, tallies, &plan).and_then(|shop| match request
                .order_ref
            {
                Some(order_ref)
                    if order_refs_accepted.contains(&(shop.clone(), order_ref.as_str())) =>
                {
                    Err(order_ref_reused())
                }
                _ => Ok(shop),
            });
        if request.undecided_when_short
            && matches!(&decision, Err(rejection) if rejection.code == ErrorCode::InsufficientStock)
            && only_buckets_short(request.lines, &remaining)
        {
            plan.undecided.push(index);
        }
        if let Ok(shop) = &decision {
            if let Some(order_ref) = request.order_ref {
                order_refs_accepted.insert((shop.clone(), order_ref.as_str()));
            }
            for line in request.lines {
                let key = (line.sku.clone(), line.warehouse.clone());
                let quantity = line.quantity.get();
                *remaining.entry(key.clone()).or_insert(0) -= quantity;
                *plan.totals.entry(key).or_insert(0) += quantity;
                if let Some(user) = request.user {
                    *plan
                        .purchases_added
                        .entry((
                            shop.clone(),
                            user.clone(),
                            tally_sku(&line.sku, &line.warehouse),
                        ))
                        .or_insert(0) += quantity;
                }
            }
            if let Some(user) = request.user {
                *plan
                    .holds_added
                    .entry((shop.clone(), user.clone()))
                    .or_insert(0) += 1;
            }
        }
        plan.decisions.push(decision);
    }
    plan
}

/// Whether every line short of stock draws from a campaign's bucket: another bucket
/// may serve the request then, and nothing can when another line is short.
fn only_buckets_short(lines: &[ReservationLine], remaining: &BTreeMap<StockKey, i64>) -> bool {
    lines
        .iter()
        .filter(|line| {
            let key = (line.sku.clone(), line.warehouse.clone());
            remaining.get(&key).copied().unwrap_or(0) < line.quantity.get()
        })
        .all(|line| crate::campaign::is_bucket_warehouse(&line.warehouse))
}

/// What the batch would take from each row if every request were accepted: the sum of
/// its lines per (sku, warehouse).
///
/// When every row holds at least its total, every SKU is on sale with no per-user
/// limit and no request names a user or an unverified shop, [`plan_batch`] accepts
/// every request with exactly these totals (each request fits in what the ones before
/// it left, since what is left covers all the requests still to come). That is what
/// lets the whole-batch fast path check totals instead of deciding per request.
pub fn totals_if_all_accepted<'a>(
    requests: impl IntoIterator<Item = &'a [ReservationLine]>,
) -> BTreeMap<StockKey, i64> {
    let mut totals: BTreeMap<StockKey, i64> = BTreeMap::new();
    for line in requests.into_iter().flatten() {
        *totals
            .entry((line.sku.clone(), line.warehouse.clone()))
            .or_insert(0) += line.quantity.get();
    }
    totals
}

/// The one shop of a request's SKUs, checked against the caller's scope.
fn shop_of_request(
    request: PlanRequest<'_>,
    skus: &HashMap<SkuCode, SkuFacts>,
) -> Result<ShopCode, Rejection> {
    let mut found: Option<&ShopCode> = None;
    for line in request.lines {
        let Some(facts) = skus.get(&line.sku) else {
            return Err(Rejection::new(
                ErrorCode::NotFound,
                format!("sku '{}' does not exist", line.sku),
            ));
        };
        match found {
            Some(shop) if *shop != facts.shop => {
                return Err(Rejection::new(
                    ErrorCode::FailedPrecondition,
                    "a reservation's SKUs must all belong to one shop",
                ));
            }
            _ => found = Some(&facts.shop),
        }
    }
    let shop = found
        .cloned()
        .ok_or_else(|| Rejection::new(ErrorCode::InvalidArgument, "a reservation needs lines"))?;
    match request.shop {
        ShopScope::Verified(required) | ShopScope::Required(required) if *required != shop => Err(
            Rejection::new(ErrorCode::Forbidden, crate::outside_own_shop(required)),
        ),
        _ => Ok(shop),
    }
}

/// The per-user limit a line counts against: its campaign's for a bucket's line (kept
/// in `skus` under the campaign's tally code), its SKU's otherwise.
pub fn limit_of(line: &ReservationLine, skus: &HashMap<SkuCode, SkuFacts>) -> Option<i64> {
    skus.get(&tally_sku(&line.sku, &line.warehouse))
        .and_then(|facts| facts.per_user_limit)
}

fn order_ref_reused() -> Rejection {
    Rejection::new(
        ErrorCode::OrderRefReused,
        "this order_ref was used by a request with another Idempotency-Key; send that key to read its answer",
    )
}

fn check_request(
    request: PlanRequest<'_>,
    skus: &HashMap<SkuCode, SkuFacts>,
    remaining: &BTreeMap<StockKey, i64>,
    tallies: &Tallies,
    plan: &BatchPlan,
) -> Result<ShopCode, Rejection> {
    if request.order_ref_taken {
        return Err(order_ref_reused());
    }
    let shop = shop_of_request(request, skus)?;
    for line in request.lines {
        let facts = &skus[&line.sku];
        if !facts.sale_status.is_sellable() {
            return Err(Rejection::new(
                ErrorCode::OffShelf,
                format!(
                    "sku '{}' is not on sale (status {})",
                    line.sku,
                    facts.sale_status.as_str()
                ),
            ));
        }
    }
    if let Some(user) = request.user {
        check_shopper_limits(request.lines, &shop, user, skus, tallies, plan)?;
    } else if let Some(line) = request
        .lines
        .iter()
        .find(|line| limit_of(line, skus).is_some())
    {
        return Err(Rejection::new(
            ErrorCode::FailedPrecondition,
            format!(
                "sku '{}' has a per-user limit: the request must name its user_id",
                line.sku
            ),
        ));
    }
    for line in request.lines {
        let key = (line.sku.clone(), line.warehouse.clone());
        let left = remaining.get(&key).copied().unwrap_or(0);
        if left < line.quantity.get() {
            return Err(Rejection::new(
                ErrorCode::InsufficientStock,
                format!(
                    "sku '{}' in warehouse '{}': requested {}, available {}",
                    line.sku,
                    line.warehouse,
                    line.quantity.get(),
                    left.max(0)
                ),
            ));
        }
    }
    Ok(shop)
}

/// The shopper's open holds and per-user limits, counting what earlier requests of the
/// batch already added.
fn check_shopper_limits(
    lines: &[ReservationLine],
    shop: &ShopCode,
    user: &UserId,
    skus: &HashMap<SkuCode, SkuFacts>,
    tallies: &Tallies,
    plan: &BatchPlan,
) -> Result<(), Rejection> {
    let shopper = (shop.clone(), user.clone());
    let holds = tallies.open_holds.get(&shopper).copied().unwrap_or(0)
        + plan.holds_added.get(&shopper).copied().unwrap_or(0);
    if holds >= tallies.open_holds_max {
        return Err(Rejection::new(
            ErrorCode::PurchaseLimitExceeded,
            format!(
                "user '{user}' already holds {holds} open reservations (at most {})",
                tallies.open_holds_max
            ),
        ));
    }
    // A request's own lines count together: one SKU in two warehouses (or a
    // campaign's SKU in two buckets) is one tally, which the database's check sees
    // whole; judged line by line, both lines passed here and the batch's tally write
    // was refused on every retry, failing every request batched with this one.
    let mut asked: HashMap<(ShopCode, UserId, SkuCode), i64> = HashMap::new();
    for line in lines {
        let Some(limit) = limit_of(line, skus) else {
            continue;
        };
        let key = (
            shop.clone(),
            user.clone(),
            tally_sku(&line.sku, &line.warehouse),
        );
        let taken = tallies.purchased.get(&key).copied().unwrap_or(0)
            + plan.purchases_added.get(&key).copied().unwrap_or(0);
        let asked = asked.entry(key).or_insert(0);
        *asked = asked.saturating_add(line.quantity.get());
        if taken.saturating_add(*asked) > limit {
            return Err(Rejection::new(
                ErrorCode::PurchaseLimitExceeded,
                format!(
                    "user '{user}' holds or bought {taken} of sku '{}' and asks for {asked}; the limit is {limit} per user",
                    line.sku
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quantity;

    fn line(sku: &str, quantity: i64) -> ReservationLine {
        ReservationLine {
            sku: SkuCode::parse(sku).unwrap(),
            warehouse: WarehouseCode::default_warehouse(),
            quantity: Quantity::new(quantity).unwrap(),
        }
    }

    fn key(sku: &str) -> StockKey {
        (
            SkuCode::parse(sku).unwrap(),
            WarehouseCode::default_warehouse(),
        )
    }

    fn facts(status: SaleStatus) -> SkuFacts {
        SkuFacts {
            sale_status: status,
            shop: ShopCode::parse("north").unwrap(),
            per_user_limit: None,
        }
    }

    fn on_shelf(skus: &[&str]) -> HashMap<SkuCode, SkuFacts> {
        skus.iter()
            .map(|sku| (SkuCode::parse(sku).unwrap(), facts(SaleStatus::OnShelf)))
            .collect()
    }

    const ANY: ShopScope = ShopScope::Any;

    #[test]
    fn a_taken_order_ref_is_refused_before_anything_is_taken() {
        let skus = on_shelf(&["A"]);
        let available = BTreeMap::from([(key("A"), 5)]);
        let lines = [line("A", 1)];
        let taken = PlanRequest {
            order_ref_taken: true,
            undecided_when_short: false,
            ..anonymous(&lines)
        };

        let plan = plan_batch(
            [taken, anonymous(&lines)],
            &skus,
            &available,
            &Tallies::default(),
        );

        assert_eq!(
            plan.decisions[0]
                .as_ref()
                .err()
                .map(|rejection| rejection.code),
            Some(ErrorCode::OrderRefReused)
        );
        assert!(plan.decisions[1].is_ok());
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 1)]));
    }

    #[test]
    fn an_order_ref_is_taken_in_a_batch_only_by_a_request_that_was_accepted() {
        let skus = on_shelf(&["A"]);
        let available = BTreeMap::from([(key("A"), 2)]);
        let too_many = [line("A", 5)];
        let fits = [line("A", 1)];
        let order_ref = crate::OrderRef::parse("SO-1").unwrap();
        let with_ref = |lines| PlanRequest {
            order_ref: Some(&order_ref),
            ..anonymous(lines)
        };

        let plan = plan_batch(
            [with_ref(&too_many), with_ref(&fits), with_ref(&fits)],
            &skus,
            &available,
            &Tallies::default(),
        );

        let codes: Vec<Option<ErrorCode>> = plan
            .decisions
            .iter()
            .map(|decision| decision.as_ref().err().map(|rejection| rejection.code))
            .collect();
        assert_eq!(
            codes,
            [
                Some(ErrorCode::InsufficientStock),
                None,
                Some(ErrorCode::OrderRefReused)
            ]
        );
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 1)]));
    }

    #[test]
    fn only_a_short_bucket_leaves_a_campaign_request_undecided() {
        let bucket = WarehouseCode::parse("campaign-0123456789ab-0").unwrap();
        let in_bucket = ReservationLine {
            warehouse: bucket.clone(),
            ..line("A", 1)
        };
        let skus = on_shelf(&["A", "B"]);
        let both = [in_bucket.clone(), line("B", 1)];
        let bucket_alone = [in_bucket];
        let sent_on = |lines| PlanRequest {
            undecided_when_short: true,
            ..anonymous(lines)
        };
        let tallies = Tallies {
            open_holds_max: 10,
            ..Tallies::default()
        };

        // The bucket is empty: another bucket may serve either request.
        let empty_bucket = BTreeMap::from([
            ((SkuCode::parse("A").unwrap(), bucket.clone()), 0),
            (key("B"), 5),
        ]);
        let plan = plan_batch(
            [sent_on(&bucket_alone), sent_on(&both)],
            &skus,
            &empty_bucket,
            &tallies,
        );
        assert_eq!(plan.undecided, [0, 1]);
        // The bucket has stock and B has none: no bucket can help, the refusal stands.
        let empty_b = BTreeMap::from([((SkuCode::parse("A").unwrap(), bucket), 5), (key("B"), 0)]);
        let plan = plan_batch([sent_on(&both)], &skus, &empty_b, &tallies);
        assert!(plan.undecided.is_empty());
        assert_eq!(
            plan.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::InsufficientStock
        );
    }

    fn anonymous(lines: &[ReservationLine]) -> PlanRequest<'_> {
        PlanRequest {
            lines,
            shop: &ANY,
            user: None,
            order_ref_taken: false,
            order_ref: None,
            undecided_when_short: false,
        }
    }

    fn decide(
        requests: &[Vec<ReservationLine>],
        skus: &HashMap<SkuCode, SkuFacts>,
        available: &BTreeMap<StockKey, i64>,
    ) -> BatchPlan {
        plan_batch(
            requests.iter().map(|lines| anonymous(lines)),
            skus,
            available,
            &Tallies {
                open_holds_max: 10,
                ..Tallies::default()
            },
        )
    }

    #[test]
    fn requests_are_served_in_arrival_order_until_stock_runs_out() {
        let requests = [vec![line("A", 2)], vec![line("A", 2)], vec![line("A", 1)]];
        let available = BTreeMap::from([(key("A"), 3)]);
        let plan = decide(&requests, &on_shelf(&["A"]), &available);
        assert!(plan.decisions[0].is_ok());
        assert_eq!(
            plan.decisions[1].as_ref().unwrap_err().code,
            ErrorCode::InsufficientStock
        );
        assert!(plan.decisions[2].is_ok());
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 3)]));
    }

    #[test]
    fn a_refused_multi_line_request_takes_nothing_from_any_line() {
        let requests = [vec![line("A", 1), line("B", 5)], vec![line("A", 1)]];
        let available = BTreeMap::from([(key("A"), 1), (key("B"), 4)]);
        let plan = decide(&requests, &on_shelf(&["A", "B"]), &available);
        assert!(plan.decisions[0].is_err());
        assert!(plan.decisions[1].is_ok());
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 1)]));
    }

    #[test]
    fn unknown_and_off_shelf_skus_are_refused_with_their_own_codes() {
        let mut statuses = on_shelf(&["A"]);
        statuses.insert(SkuCode::parse("OFF").unwrap(), facts(SaleStatus::OffShelf));
        let requests = [vec![line("MISSING", 1)], vec![line("OFF", 1)]];
        let available = BTreeMap::from([(key("OFF"), 10)]);
        let plan = decide(&requests, &statuses, &available);
        assert_eq!(
            plan.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::NotFound
        );
        assert_eq!(
            plan.decisions[1].as_ref().unwrap_err().code,
            ErrorCode::OffShelf
        );
        assert!(plan.totals.is_empty());
    }

    #[test]
    fn a_batch_whose_rows_hold_its_totals_is_accepted_whole_with_those_totals() {
        let requests = [
            vec![line("A", 2), line("B", 1)],
            vec![line("A", 3)],
            vec![line("B", 4), line("C", 1)],
            vec![line("A", 1)],
        ];
        let totals = totals_if_all_accepted(requests.iter().map(Vec::as_slice));
        assert_eq!(
            totals,
            BTreeMap::from([(key("A"), 6), (key("B"), 5), (key("C"), 1)])
        );
        // Exactly the totals available: every request fits, in any order.
        let plan = decide(&requests, &on_shelf(&["A", "B", "C"]), &totals);
        assert!(plan.decisions.iter().all(Result::is_ok));
        assert_eq!(plan.totals, totals);
        // One unit short on one row: not every request fits any more.
        let mut short = totals.clone();
        short.insert(key("B"), 4);
        let plan = decide(&requests, &on_shelf(&["A", "B", "C"]), &short);
        assert!(plan.decisions.iter().any(Result::is_err));
    }

    #[test]
    fn a_sku_of_another_shop_is_forbidden_and_mixed_shops_are_refused() {
        let mut skus = on_shelf(&["A"]);
        skus.insert(
            SkuCode::parse("SOUTH").unwrap(),
            SkuFacts {
                shop: ShopCode::parse("south").unwrap(),
                ..facts(SaleStatus::OnShelf)
            },
        );
        let available = BTreeMap::from([(key("A"), 5), (key("SOUTH"), 5)]);
        let north = ShopScope::Required(ShopCode::parse("north").unwrap());
        let foreign = [line("SOUTH", 1)];
        let mixed = [line("A", 1), line("SOUTH", 1)];
        let own = [line("A", 1)];
        let plan = plan_batch(
            [
                PlanRequest {
                    lines: &foreign,
                    shop: &north,
                    user: None,
                    order_ref_taken: false,
                    order_ref: None,
                    undecided_when_short: false,
                },
                PlanRequest {
                    lines: &mixed,
                    shop: &ANY,
                    user: None,
                    order_ref_taken: false,
                    order_ref: None,
                    undecided_when_short: false,
                },
                PlanRequest {
                    lines: &own,
                    shop: &north,
                    user: None,
                    order_ref_taken: false,
                    order_ref: None,
                    undecided_when_short: false,
                },
            ],
            &skus,
            &available,
            &Tallies::default(),
        );
        assert_eq!(
            plan.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::Forbidden
        );
        assert_eq!(
            plan.decisions[1].as_ref().unwrap_err().code,
            ErrorCode::FailedPrecondition
        );
        assert_eq!(
            plan.decisions[2].as_ref().unwrap().as_str(),
            "north",
            "the accepted request names its shop"
        );
        assert_eq!(plan.totals, BTreeMap::from([(key("A"), 1)]));
    }

    #[test]
    fn a_shopper_never_passes_a_per_user_limit_within_a_batch_or_across_batches() {
        let mut skus = on_shelf(&["LIMITED"]);
        skus.get_mut(&SkuCode::parse("LIMITED").unwrap())
            .unwrap()
            .per_user_limit = Some(2);
        let available = BTreeMap::from([(key("LIMITED"), 100)]);
        let alice = UserId::parse("alice").unwrap();
        let bob = UserId::parse("bob").unwrap();
        let north = ShopCode::parse("north").unwrap();
        let one = [line("LIMITED", 1)];
        let as_user = |user| PlanRequest {
            lines: &one,
            shop: &ANY,
            user: Some(user),
            order_ref_taken: false,
            order_ref: None,
            undecided_when_short: false,
        };
        let tallies = Tallies {
            purchased: HashMap::from([(
                (
                    north.clone(),
                    alice.clone(),
                    SkuCode::parse("LIMITED").unwrap(),
                ),
                1,
            )]),
            open_holds_max: 10,
            ..Tallies::default()
        };
        let plan = plan_batch(
            [
                as_user(&alice),
                as_user(&alice),
                as_user(&bob),
                as_user(&bob),
                as_user(&bob),
            ],
            &skus,
            &available,
            &tallies,
        );
        let codes: Vec<Option<ErrorCode>> = plan
            .decisions
            .iter()
            .map(|decision| decision.as_ref().err().map(|rejection| rejection.code))
            .collect();
        assert_eq!(
            codes,
            [
                None,
                Some(ErrorCode::PurchaseLimitExceeded),
                None,
                None,
                Some(ErrorCode::PurchaseLimitExceeded)
            ]
        );
        assert_eq!(
            plan.purchases_added.get(&(
                north.clone(),
                alice.clone(),
                SkuCode::parse("LIMITED").unwrap()
            )),
            Some(&1)
        );
        assert_eq!(plan.holds_added.get(&(north, bob)), Some(&2));
        let anonymous_request = plan_batch([anonymous(&one)], &skus, &available, &tallies);
        assert_eq!(
            anonymous_request.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::FailedPrecondition,
            "a limited SKU needs a user"
        );
    }

    #[test]
    fn a_shopper_at_the_open_hold_bound_is_refused() {
        let skus = on_shelf(&["A"]);
        let available = BTreeMap::from([(key("A"), 100)]);
        let alice = UserId::parse("alice").unwrap();
        let north = ShopCode::parse("north").unwrap();
        let one = [line("A", 1)];
        let tallies = Tallies {
            open_holds: HashMap::from([((north, alice.clone()), 1)]),
            open_holds_max: 2,
            ..Tallies::default()
        };
        let request = PlanRequest {
            lines: &one,
            shop: &ANY,
            user: Some(&alice),
            order_ref_taken: false,
            order_ref: None,
            undecided_when_short: false,
        };
        let plan = plan_batch([request, request], &skus, &available, &tallies);
        assert!(plan.decisions[0].is_ok());
        assert_eq!(
            plan.decisions[1].as_ref().unwrap_err().code,
            ErrorCode::PurchaseLimitExceeded
        );
    }

    #[test]
    fn a_row_that_does_not_exist_has_nothing_available() {
        let requests = [vec![line("A", 1)]];
        let plan = decide(&requests, &on_shelf(&["A"]), &BTreeMap::new());
        assert_eq!(
            plan.decisions[0].as_ref().unwrap_err().code,
            ErrorCode::InsufficientStock
        );
    }
}

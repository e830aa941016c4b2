//! A shopper's cart as the catalog sees it now, and the rule that says whether a line
//! could be ordered: a snapshot for the shopper, never the decision (the reservation
//! at checkout decides).

use crate::{Currency, ErrorCode, PriceMinor, SaleStatus, ShopCode, SkuCode};

/// A cart line with what the catalog says about its SKU now (`None`: unknown SKU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CartLine {
    /// The shop the line was put in for. A user id is a shop's own name for its
    /// shopper, so the admin, who sees every shop's lines under one user id, tells the
    /// shops' shoppers apart by it.
    pub shop: ShopCode,
    pub sku: SkuCode,
    pub quantity: i64,
    pub current: Option<CartSku>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CartSku {
    pub title: String,
    pub price: Option<PriceMinor>,
    pub currency: Option<Currency>,
    pub sale_status: SaleStatus,
    /// Available to a checkout: in the default warehouse, where carts check out from,
    /// or, while a campaign runs on the SKU there, in the campaign's fullest bucket (a
    /// line draws from one).
    pub available: i64,
    /// The per-user limit a checkout of the line meets: the running campaign's, or
    /// else the SKU's (`None`: no limit).
    pub purchase_limit: Option<i64>,
    /// What the shopper holds or bought under that limit already.
    pub purchased: i64,
    /// The campaign running on the SKU, whose buckets a checkout's line draws from.
    pub campaign: Option<String>,
}

impl CartSku {
    /// Whether an order can charge for it: a price above zero, in a currency (an order
    /// refuses any other line).
    pub fn has_price(&self) -> bool {
        self.price.is_some_and(|price| price.get() > 0) && self.currency.is_some()
    }
}

/// Why a cart line cannot be ordered now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CartProblem {
    NotFound,
    Deleted,
    OffShelf,
    OutOfStock,
    /// More in the cart than is available.
    QuantityAboveAvailable,
    /// On the shelf without a price an order can charge (none, zero, or no currency):
    /// a SKU created on its own can be, and is reserved so, but not ordered.
    NoPrice,
    /// With what the shopper holds or bought, more than the per-user limit.
    AbovePurchaseLimit,
    /// Priced in another currency than the cart's first orderable line of its shop:
    /// an order is in one currency.
    OtherCurrency,
    /// In another running campaign than an earlier orderable line of its shop: an
    /// order draws from one campaign at most.
    OtherCampaign,
}

impl CartProblem {
    pub fn as_str(self) -> &'static str {
        match self {
            CartProblem::NotFound => "not_found",
            CartProblem::Deleted => "deleted",
            CartProblem::OffShelf => "off_shelf",
            CartProblem::OutOfStock => "out_of_stock",
            CartProblem::QuantityAboveAvailable => "quantity_above_available",
            CartProblem::NoPrice => "no_price",
            CartProblem::AbovePurchaseLimit => "above_purchase_limit",
            CartProblem::OtherCurrency => "other_currency",
            CartProblem::OtherCampaign => "other_campaign",
        }
    }

    pub fn code(self) -> ErrorCode {
        match self {
            CartProblem::NotFound => ErrorCode::NotFound,
            CartProblem::Deleted | CartProblem::OffShelf => ErrorCode::OffShelf,
            CartProblem::OutOfStock | CartProblem::QuantityAboveAvailable => {
                ErrorCode::InsufficientStock
            }
            CartProblem::NoPrice | CartProblem::OtherCurrency | CartProblem::OtherCampaign => {
                ErrorCode::FailedPrecondition
            }
            CartProblem::AbovePurchaseLimit => ErrorCode::PurchaseLimitExceeded,
        }
    }
}

impl CartLine {
    /// Whether the line could be ordered right now, and why not. A snapshot: the
    /// reservation at checkout decides.
    pub fn problem(&self) -> Option<CartProblem> {
        let Some(current) = &self.current else {
            return Some(CartProblem::NotFound);
        };
        match current.sale_status {
            SaleStatus::Deleted => Some(CartProblem::Deleted),
            SaleStatus::OffShelf | SaleStatus::PendingReview => Some(CartProblem::OffShelf),
            SaleStatus::OnShelf if !current.has_price() => Some(CartProblem::NoPrice),
            SaleStatus::OnShelf if current.available == 0 => Some(CartProblem::OutOfStock),
            SaleStatus::OnShelf if current.available < self.quantity => {
                Some(CartProblem::QuantityAboveAvailable)
            }
            SaleStatus::OnShelf
                if current.purchase_limit.is_some_and(|limit| {
                    current.purchased.saturating_add(self.quantity) > limit
                }) =>
            {
                Some(CartProblem::AbovePurchaseLimit)
            }
            SaleStatus::OnShelf => None,
        }
    }
}

/// Each line's problem (`None`: orderable), in line order: its own, or else one the
/// lines before it in its shop give it. A checkout orders one shop's lines in one
/// order, which is in one currency and draws from one campaign at most: the first
/// orderable line decides both, and a later line in another is left out, as the
/// order would otherwise be refused whole.
pub fn problems_of(lines: &[CartLine]) -> Vec<Option<CartProblem>> {
    let mut currencies: Vec<(&ShopCode, &Currency)> = Vec::new();
    let mut campaigns: Vec<(&ShopCode, &str)> = Vec::new();
    lines
        .iter()
        .map(|line| {
            if let Some(problem) = line.problem() {
                return Some(problem);
            }
            let current = line.current.as_ref()?;
            let currency = current.currency.as_ref()?;
            if currencies
                .iter()
                .any(|(shop, first)| **shop == line.shop && *first != currency)
            {
                return Some(CartProblem::OtherCurrency);
            }
            if let Some(campaign) = current.campaign.as_deref() {
                match campaigns.iter().find(|(shop, _)| **shop == line.shop) {
                    Some((_, first)) if *first != campaign => {
                        return Some(CartProblem::OtherCampaign);
                    }
                    Some(_) => {}
                    None => campaigns.push((&line.shop, campaign)),
                }
            }
            if !currencies.iter().any(|(shop, _)| **shop == line.shop) {
                currencies.push((&line.shop, currency));
            }
            None
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(quantity: i64, sale_status: SaleStatus, available: i64) -> CartLine {
        CartLine {
            shop: ShopCode::default_shop(),
            sku: SkuCode::parse("MILK").unwrap(),
            quantity,
            current: Some(CartSku {
                title: "Milk".into(),
                price: Some(PriceMinor::new(199).unwrap()),
                currency: Some(Currency::parse("EUR").unwrap()),
                sale_status,
                available,
                purchase_limit: None,
                purchased: 0,
                campaign: None,
            }),
        }
    }

    fn with(mut line: CartLine, change: impl FnOnce(&mut CartSku)) -> CartLine {
        if let Some(current) = &mut line.current {
            change(current);
        }
        line
    }

    fn priced(mut line: CartLine, price: Option<i64>) -> CartLine {
        if let Some(current) = &mut line.current {
            current.price = price.map(|minor| PriceMinor::new(minor).unwrap());
        }
        line
    }

    #[test]
    fn a_line_on_the_shelf_with_enough_stock_has_no_problem() {
        assert_eq!(line(2, SaleStatus::OnShelf, 2).problem(), None);
    }

    #[test]
    fn each_problem_is_named_and_mapped_to_its_error_code() {
        let unknown = CartLine {
            current: None,
            ..line(1, SaleStatus::OnShelf, 1)
        };
        let cases = [
            (unknown, CartProblem::NotFound, ErrorCode::NotFound),
            (
                line(1, SaleStatus::Deleted, 5),
                CartProblem::Deleted,
                ErrorCode::OffShelf,
            ),
            (
                line(1, SaleStatus::OffShelf, 5),
                CartProblem::OffShelf,
                ErrorCode::OffShelf,
            ),
            (
                line(1, SaleStatus::PendingReview, 5),
                CartProblem::OffShelf,
                ErrorCode::OffShelf,
            ),
            (
                line(1, SaleStatus::OnShelf, 0),
                CartProblem::OutOfStock,
                ErrorCode::InsufficientStock,
            ),
            (
                line(3, SaleStatus::OnShelf, 2),
                CartProblem::QuantityAboveAvailable,
                ErrorCode::InsufficientStock,
            ),
            (
                priced(line(1, SaleStatus::OnShelf, 5), None),
                CartProblem::NoPrice,
                ErrorCode::FailedPrecondition,
            ),
            (
                priced(line(1, SaleStatus::OnShelf, 5), Some(0)),
                CartProblem::NoPrice,
                ErrorCode::FailedPrecondition,
            ),
            (
                with(line(2, SaleStatus::OnShelf, 5), |sku| {
                    sku.purchase_limit = Some(2);
                    sku.purchased = 1;
                }),
                CartProblem::AbovePurchaseLimit,
                ErrorCode::PurchaseLimitExceeded,
            ),
        ];
        for (line, problem, code) in cases {
            assert_eq!(line.problem(), Some(problem), "{line:?}");
            assert_eq!(problem.code(), code);
        }
    }

    #[test]
    fn a_line_within_the_per_user_limit_with_what_was_bought_has_no_problem() {
        let within = with(line(1, SaleStatus::OnShelf, 5), |sku| {
            sku.purchase_limit = Some(2);
            sku.purchased = 1;
        });
        assert_eq!(within.problem(), None);
    }

    #[test]
    fn a_later_line_in_another_currency_or_campaign_of_the_same_shop_is_left_out() {
        let other_shop = ShopCode::parse("other").unwrap();
        let yuan = |line: CartLine| {
            with(line, |sku| {
                sku.currency = Some(Currency::parse("CNY").unwrap())
            })
        };
        let in_campaign =
            |line: CartLine, code: &str| with(line, |sku| sku.campaign = Some(code.to_owned()));
        let lines = vec![
            // Out of stock: it decides nothing for the lines after it.
            yuan(line(1, SaleStatus::OnShelf, 0)),
            in_campaign(line(1, SaleStatus::OnShelf, 5), "a"),
            yuan(line(1, SaleStatus::OnShelf, 5)),
            in_campaign(line(1, SaleStatus::OnShelf, 5), "b"),
            in_campaign(line(1, SaleStatus::OnShelf, 5), "a"),
            line(1, SaleStatus::OnShelf, 5),
            CartLine {
                shop: other_shop.clone(),
                ..yuan(in_campaign(line(1, SaleStatus::OnShelf, 5), "b"))
            },
        ];

        assert_eq!(
            problems_of(&lines),
            vec![
                Some(CartProblem::OutOfStock),
                None,
                Some(CartProblem::OtherCurrency),
                Some(CartProblem::OtherCampaign),
                None,
                None,
                None,
            ]
        );
    }
}

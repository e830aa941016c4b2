//! A SKU's sale status: whether shoppers may buy it, independent of how much stock it
//! has.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::ParseError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SaleStatus {
    PendingReview,
    OnShelf,
    OffShelf,
    Deleted,
}

impl SaleStatus {
    pub const ALL: [SaleStatus; 4] = [
        SaleStatus::PendingReview,
        SaleStatus::OnShelf,
        SaleStatus::OffShelf,
        SaleStatus::Deleted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SaleStatus::PendingReview => "PENDING_REVIEW",
            SaleStatus::OnShelf => "ON_SHELF",
            SaleStatus::OffShelf => "OFF_SHELF",
            SaleStatus::Deleted => "DELETED",
        }
    }

    pub fn parse(text: &str) -> Result<SaleStatus, ParseError> {
        SaleStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
            .ok_or_else(|| ParseError::new(format!("unknown sale status '{text}'")))
    }

    /// Only an on-shelf SKU may be reserved or ordered.
    pub fn is_sellable(self) -> bool {
        self == SaleStatus::OnShelf
    }

    /// Whether shoppers see a SKU of this status: not while it waits for its first
    /// review, not once deleted; on or off the shelf, yes (off, as not for sale).
    pub fn is_shown_to_shoppers(self) -> bool {
        !matches!(self, SaleStatus::PendingReview | SaleStatus::Deleted)
    }
}

/// What an operator asks of a SKU's sale status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShelfOperation {
    /// Put on the shelf: sellable, if the product is complete.
    On,
    /// Take off the shelf: kept, not sellable.
    Off,
    /// Soft delete: terminal; orders, ledger and logs stay readable.
    Delete,
}

impl ShelfOperation {
    pub fn target(self) -> SaleStatus {
        match self {
            ShelfOperation::On => SaleStatus::OnShelf,
            ShelfOperation::Off => SaleStatus::OffShelf,
            ShelfOperation::Delete => SaleStatus::Deleted,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ShelfOperation::On => "on",
            ShelfOperation::Off => "off",
            ShelfOperation::Delete => "delete",
        }
    }

    pub fn parse(text: &str) -> Result<ShelfOperation, ParseError> {
        match text {
            "on" => Ok(ShelfOperation::On),
            "off" => Ok(ShelfOperation::Off),
            "delete" => Ok(ShelfOperation::Delete),
            _ => Err(ParseError::new(format!("unknown shelf operation '{text}'"))),
        }
    }
}

/// Every change a sale status may make (seed 003 §2.4). A move to the status a SKU
/// already has is not in the table: it is a repeat, which succeeds and is logged as
/// one. `DELETED` has no way out.
pub const SALE_STATUS_TRANSITIONS: &[(SaleStatus, SaleStatus)] = &[
    (SaleStatus::PendingReview, SaleStatus::OnShelf),
    (SaleStatus::PendingReview, SaleStatus::OffShelf),
    (SaleStatus::PendingReview, SaleStatus::Deleted),
    (SaleStatus::OnShelf, SaleStatus::OffShelf),
    (SaleStatus::OnShelf, SaleStatus::Deleted),
    (SaleStatus::OffShelf, SaleStatus::OnShelf),
    (SaleStatus::OffShelf, SaleStatus::Deleted),
];

/// How a requested sale-status change turned out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShelfDecision {
    /// The status changes from `from` to the target.
    Change { from: SaleStatus, to: SaleStatus },
    /// The SKU already has the target status: a success, logged as a repeat.
    Repeat(SaleStatus),
    /// Not allowed from here.
    Illegal { from: SaleStatus, to: SaleStatus },
    /// Going on sale needs these product fields first.
    Incomplete(Vec<&'static str>),
}

impl fmt::Display for ShelfDecision {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShelfDecision::Change { from, to } => {
                write!(formatter, "{} to {}", from.as_str(), to.as_str())
            }
            ShelfDecision::Repeat(status) => write!(formatter, "already {}", status.as_str()),
            ShelfDecision::Illegal { from, to } => {
                write!(
                    formatter,
                    "cannot go from {} to {}",
                    from.as_str(),
                    to.as_str()
                )
            }
            ShelfDecision::Incomplete(missing) => {
                write!(
                    formatter,
                    "cannot go on sale without {}",
                    missing.join(", ")
                )
            }
        }
    }
}

/// What a product needs before its SKUs may go on sale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completeness {
    pub has_title: bool,
    pub has_image: bool,
    pub has_price: bool,
}

impl Completeness {
    pub fn missing(self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if !self.has_title {
            missing.push("title");
        }
        if !self.has_image {
            missing.push("image");
        }
        if !self.has_price {
            missing.push("price");
        }
        missing
    }
}

/// Looks `operation` up in [`SALE_STATUS_TRANSITIONS`] from `current`.
pub fn decide_shelf_change(
    current: SaleStatus,
    operation: ShelfOperation,
    completeness: Completeness,
) -> ShelfDecision {
    let target = operation.target();
    if current == target {
        return ShelfDecision::Repeat(current);
    }
    if !SALE_STATUS_TRANSITIONS.contains(&(current, target)) {
        return ShelfDecision::Illegal {
            from: current,
            to: target,
        };
    }
    if target == SaleStatus::OnShelf {
        let missing = completeness.missing();
        if !missing.is_empty() {
            return ShelfDecision::Incomplete(missing);
        }
    }
    ShelfDecision::Change {
        from: current,
        to: target,
    }
}

/// What a shopper sees for a SKU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Availability {
    OnSale,
    /// On the shelf with nothing available: shown, not buyable.
    TemporarilyOutOfStock,
    OffShelf,
}

impl Availability {
    pub fn of(status: SaleStatus, available: i64) -> Availability {
        match (status, available > 0) {
            (SaleStatus::OnShelf, true) => Availability::OnSale,
            (SaleStatus::OnShelf, false) => Availability::TemporarilyOutOfStock,
            _ => Availability::OffShelf,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SaleStatus::*;

    const COMPLETE: Completeness = Completeness {
        has_title: true,
        has_image: true,
        has_price: true,
    };

    fn operation_for(target: SaleStatus) -> Option<ShelfOperation> {
        match target {
            OnShelf => Some(ShelfOperation::On),
            OffShelf => Some(ShelfOperation::Off),
            Deleted => Some(ShelfOperation::Delete),
            PendingReview => None,
        }
    }

    #[test]
    fn every_transition_in_the_table_changes_the_status() {
        for (from, to) in SALE_STATUS_TRANSITIONS {
            let operation = operation_for(*to).unwrap();
            assert_eq!(
                decide_shelf_change(*from, operation, COMPLETE),
                ShelfDecision::Change {
                    from: *from,
                    to: *to
                }
            );
        }
    }

    #[test]
    fn every_move_outside_the_table_is_a_repeat_or_refused() {
        for from in SaleStatus::ALL {
            for to in [OnShelf, OffShelf, Deleted] {
                let decision = decide_shelf_change(from, operation_for(to).unwrap(), COMPLETE);
                if from == to {
                    assert_eq!(decision, ShelfDecision::Repeat(from));
                } else if !SALE_STATUS_TRANSITIONS.contains(&(from, to)) {
                    assert_eq!(decision, ShelfDecision::Illegal { from, to });
                }
            }
        }
    }

    #[test]
    fn deleted_is_terminal() {
        assert_eq!(
            decide_shelf_change(Deleted, ShelfOperation::On, COMPLETE),
            ShelfDecision::Illegal {
                from: Deleted,
                to: OnShelf
            }
        );
        assert_eq!(
            decide_shelf_change(Deleted, ShelfOperation::Delete, COMPLETE),
            ShelfDecision::Repeat(Deleted)
        );
    }

    #[test]
    fn going_on_sale_reports_every_missing_field() {
        let incomplete = Completeness {
            has_title: false,
            has_image: false,
            has_price: true,
        };
        assert_eq!(
            decide_shelf_change(PendingReview, ShelfOperation::On, incomplete),
            ShelfDecision::Incomplete(vec!["title", "image"])
        );
        assert_eq!(
            decide_shelf_change(OnShelf, ShelfOperation::Off, incomplete),
            ShelfDecision::Change {
                from: OnShelf,
                to: OffShelf
            },
            "taking off the shelf needs nothing"
        );
    }

    #[test]
    fn availability_separates_out_of_stock_from_off_shelf() {
        assert_eq!(Availability::of(OnShelf, 3), Availability::OnSale);
        assert_eq!(
            Availability::of(OnShelf, 0),
            Availability::TemporarilyOutOfStock
        );
        assert_eq!(Availability::of(OffShelf, 3), Availability::OffShelf);
        assert_eq!(Availability::of(PendingReview, 3), Availability::OffShelf);
        assert_eq!(Availability::of(Deleted, 3), Availability::OffShelf);
    }
}

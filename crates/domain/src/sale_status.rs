//! A SKU's sale status: whether shoppers may buy it, independent of how much stock it
//! has.

use serde::Serialize;

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
}

//! Reservations: a hold on stock across one or more lines, and the state machine that
//! decides who may return or consume that stock.

use std::fmt;

use serde::Serialize;

use crate::code::{ShopCode, SkuCode, UserId, WarehouseCode};
use crate::error::ParseError;
use crate::id::{OrderId, ReservationId};
use crate::quantity::Quantity;
use crate::time::Timestamp;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReservationStatus {
    Reserved,
    Confirmed,
    Released,
}

/// The only status changes a reservation may make. `RESERVED → RELEASED` is the one
/// transition that returns stock and `RESERVED → CONFIRMED` the one that consumes it;
/// both leave `RESERVED`, so whoever flips the status first is the only one who moves
/// stock, however many times a release or confirm is attempted.
pub const RESERVATION_TRANSITIONS: &[(ReservationStatus, ReservationStatus)] = &[
    (ReservationStatus::Reserved, ReservationStatus::Confirmed),
    (ReservationStatus::Reserved, ReservationStatus::Released),
];

/// A status change that the transition table does not contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IllegalTransition {
    pub from: &'static str,
    pub to: &'static str,
}

impl fmt::Display for IllegalTransition {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "cannot go from {} to {}", self.from, self.to)
    }
}

impl ReservationStatus {
    pub const ALL: [ReservationStatus; 3] = [
        ReservationStatus::Reserved,
        ReservationStatus::Confirmed,
        ReservationStatus::Released,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReservationStatus::Reserved => "RESERVED",
            ReservationStatus::Confirmed => "CONFIRMED",
            ReservationStatus::Released => "RELEASED",
        }
    }

    pub fn parse(text: &str) -> Result<ReservationStatus, ParseError> {
        ReservationStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
            .ok_or_else(|| ParseError::new(format!("unknown reservation status '{text}'")))
    }

    /// Looks the change up in [`RESERVATION_TRANSITIONS`].
    pub fn transition(self, to: ReservationStatus) -> Result<ReservationStatus, IllegalTransition> {
        if RESERVATION_TRANSITIONS.contains(&(self, to)) {
            Ok(to)
        } else {
            Err(IllegalTransition {
                from: self.as_str(),
                to: to.as_str(),
            })
        }
    }
}

/// Why a reservation left `RESERVED` for `RELEASED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// A client called release.
    Requested,
    /// The expiry worker found it past `expires_at`.
    Expired,
}

impl ReleaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Requested => "requested",
            ReleaseReason::Expired => "expired",
        }
    }

    pub fn parse(text: &str) -> Result<ReleaseReason, ParseError> {
        match text {
            "requested" => Ok(ReleaseReason::Requested),
            "expired" => Ok(ReleaseReason::Expired),
            _ => Err(ParseError::new(format!("unknown release reason '{text}'"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReservationLine {
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub quantity: Quantity,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reservation {
    pub id: ReservationId,
    /// The shop of its SKUs (one shop per reservation); `None` only for reservations
    /// made before shops were recorded whose SKUs are gone.
    pub shop: Option<ShopCode>,
    /// The shopper it holds stock for, when the caller named one.
    pub user: Option<UserId>,
    /// The order that holds it: only that order's flow confirms or releases it.
    pub order_id: Option<OrderId>,
    pub status: ReservationStatus,
    pub release_reason: Option<ReleaseReason>,
    pub expires_at: Timestamp,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub lines: Vec<ReservationLine>,
    /// The shop's order number and the calling channel, when the request gave them.
    pub reference: OrderReference,
}

/// What a reservation or an order request says about where it comes from (seed 002
/// §十三.1): the shop's order number, unique per shop, and the calling channel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OrderReference {
    pub order_ref: Option<crate::OrderRef>,
    pub source: Option<crate::RequestSource>,
}

impl OrderReference {
    pub fn is_empty(&self) -> bool {
        self.order_ref.is_none() && self.source.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ReservationStatus::*;

    #[test]
    fn reserved_may_be_confirmed_or_released() {
        assert_eq!(Reserved.transition(Confirmed), Ok(Confirmed));
        assert_eq!(Reserved.transition(Released), Ok(Released));
    }

    #[test]
    fn every_transition_outside_the_table_is_refused() {
        for from in ReservationStatus::ALL {
            for to in ReservationStatus::ALL {
                let allowed = RESERVATION_TRANSITIONS.contains(&(from, to));
                assert_eq!(from.transition(to).is_ok(), allowed, "{from:?} -> {to:?}");
            }
        }
        assert_eq!(
            Confirmed.transition(Released).unwrap_err().to_string(),
            "cannot go from CONFIRMED to RELEASED"
        );
    }

    #[test]
    fn statuses_round_trip_through_their_names() {
        for status in ReservationStatus::ALL {
            assert_eq!(ReservationStatus::parse(status.as_str()), Ok(status));
        }
        assert!(ReservationStatus::parse("reserved").is_err());
    }
}

/// Checks a reservation's lines as a whole: 1 to [`RESERVATION_LINES_MAX`] lines, each
/// (sku, warehouse) at most once (a client that wants more units asks for a larger
/// quantity, so a line's meaning never depends on how duplicates would be merged).
///
/// [`RESERVATION_LINES_MAX`]: crate::limits::RESERVATION_LINES_MAX
pub fn check_lines(lines: &[ReservationLine]) -> Result<(), ParseError> {
    use crate::limits::RESERVATION_LINES_MAX;
    if lines.is_empty() || lines.len() > RESERVATION_LINES_MAX {
        return Err(ParseError::new(format!(
            "lines must hold 1 to {RESERVATION_LINES_MAX} entries"
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(lines.len());
    for line in lines {
        if !seen.insert((&line.sku, &line.warehouse)) {
            return Err(ParseError::new(format!(
                "sku '{}' appears twice for warehouse '{}'; send one line with the total quantity",
                line.sku, line.warehouse
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod line_tests {
    use super::*;

    fn line(sku: &str, warehouse: &str) -> ReservationLine {
        ReservationLine {
            sku: SkuCode::parse(sku).unwrap(),
            warehouse: WarehouseCode::parse(warehouse).unwrap(),
            quantity: Quantity::new(1).unwrap(),
        }
    }

    #[test]
    fn lines_must_be_present_bounded_and_distinct() {
        assert!(check_lines(&[]).is_err());
        assert!(check_lines(&[line("A", "w1"), line("A", "w2"), line("B", "w1")]).is_ok());
        assert!(check_lines(&[line("A", "w1"), line("A", "w1")]).is_err());
        let too_many: Vec<_> = (0..51)
            .map(|index| line(&format!("S{index}"), "w"))
            .collect();
        assert!(check_lines(&too_many).is_err());
        assert!(check_lines(&too_many[..50]).is_ok());
    }
}

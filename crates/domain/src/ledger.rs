//! The ledger's movement ids (seed 002 §十三.1: an answer carries "流水号", the id of the
//! ledger row its effect wrote, so a caller can look the result up).
//!
//! A movement id names one row of `stock_ledger` and is known before the row is written:
//! answers are rendered before any lock is taken, and the row's own numeric id is handed
//! out by the insert. So the id is derived from what identifies the row among all others:
//!
//! - a receive or adjust: its minted `mov_…` id (one ledger row each);
//! - a reservation line's move: `rsv_….reserve.N`, `….confirm.N` or `….release.N`, where
//!   N is the line's number in the reservation (0-based, the order the request named the
//!   lines in). A reservation is reserved once and leaves `RESERVED` once, so each of its
//!   lines has at most one row of each kind;
//! - an after-sale return's line: `ord_….return.N`, N the order line's number (an order
//!   is returned once).
//!
//! Pure: parsing and formatting; the store resolves an id to its row.

use std::fmt;

use crate::error::ParseError;
use crate::id::{MovementId, OrderId, ReservationId};
use crate::reservation::{Reservation, ReservationStatus};

/// The most lines a reservation or order may have is far below this; a larger line
/// number in an id is refused when parsing.
const LINE_NUMBER_MAX: u32 = 9_999;

/// What a reservation line's ledger row did to its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReservationMove {
    /// `available → reserved` when the reservation was made.
    Reserve,
    /// `reserved` consumed when it was confirmed.
    Confirm,
    /// `reserved → available` when it was released or expired.
    Release,
}

impl ReservationMove {
    /// The ledger's `kind` column for this move.
    pub fn as_str(self) -> &'static str {
        match self {
            ReservationMove::Reserve => "reserve",
            ReservationMove::Confirm => "confirm",
            ReservationMove::Release => "release",
        }
    }

    fn parse(text: &str) -> Option<ReservationMove> {
        match text {
            "reserve" => Some(ReservationMove::Reserve),
            "confirm" => Some(ReservationMove::Confirm),
            "release" => Some(ReservationMove::Release),
            _ => None,
        }
    }
}

/// One ledger row's id, as answers carry it and `GET /v1/stock-movements/{id}` takes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LedgerMovementId {
    /// A receive or adjust.
    Stock(MovementId),
    /// A reservation line reserved, confirmed or released.
    Reservation {
        reservation: ReservationId,
        movement: ReservationMove,
        line: u32,
    },
    /// An order line's goods back in stock after a return.
    Return { order: OrderId, line: u32 },
}

impl LedgerMovementId {
    pub fn parse(text: &str) -> Result<LedgerMovementId, ParseError> {
        let refused = || {
            ParseError::new(
                "movement id must be 'mov_…', 'rsv_….reserve|confirm|release.N' or \
                 'ord_….return.N' (N a line number)",
            )
        };
        if text.starts_with(MovementId::PREFIX) {
            return MovementId::parse(text)
                .map(LedgerMovementId::Stock)
                .map_err(|_| refused());
        }
        let mut parts = text.split('.');
        let (Some(reference), Some(kind), Some(line), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(refused());
        };
        let line = parse_line_number(line).ok_or_else(refused)?;
        if kind == "return" {
            let order = OrderId::parse(reference).map_err(|_| refused())?;
            return Ok(LedgerMovementId::Return { order, line });
        }
        let movement = ReservationMove::parse(kind).ok_or_else(refused)?;
        let reservation = ReservationId::parse(reference).map_err(|_| refused())?;
        Ok(LedgerMovementId::Reservation {
            reservation,
            movement,
            line,
        })
    }

    /// The ledger's `reference` column of the row: the movement, reservation or order.
    pub fn reference(&self) -> &str {
        match self {
            LedgerMovementId::Stock(movement) => movement.as_str(),
            LedgerMovementId::Reservation { reservation, .. } => reservation.as_str(),
            LedgerMovementId::Return { order, .. } => order.as_str(),
        }
    }

    /// The ledger's `kind` of the row, when the id fixes it (a stock movement's is
    /// `receive` or `adjust`, which the id does not say).
    pub fn kind(&self) -> Option<&'static str> {
        match self {
            LedgerMovementId::Stock(_) => None,
            LedgerMovementId::Reservation { movement, .. } => Some(movement.as_str()),
            LedgerMovementId::Return { .. } => Some("return"),
        }
    }

    /// The line number inside the reservation or order.
    pub fn line(&self) -> Option<u32> {
        match self {
            LedgerMovementId::Stock(_) => None,
            LedgerMovementId::Reservation { line, .. } | LedgerMovementId::Return { line, .. } => {
                Some(*line)
            }
        }
    }

    /// Every ledger row a reservation in its current status has written: a reserve row
    /// per line, and a confirm or release row per line once it left `RESERVED`.
    pub fn of_reservation(reservation: &Reservation) -> Vec<LedgerMovementId> {
        let settled = match reservation.status {
            ReservationStatus::Reserved => None,
            ReservationStatus::Confirmed => Some(ReservationMove::Confirm),
            ReservationStatus::Released => Some(ReservationMove::Release),
        };
        let lines = line_numbers(reservation.lines.len());
        let reserved = lines
            .clone()
            .map(|line| ReservationMove::Reserve.at(reservation, line));
        let settled = settled.into_iter().flat_map(|movement| {
            lines
                .clone()
                .map(move |line| movement.at(reservation, line))
        });
        reserved.chain(settled).collect()
    }

    /// The rows an order's return wrote: one per order line.
    pub fn of_return(order: &OrderId, lines: usize) -> Vec<LedgerMovementId> {
        line_numbers(lines)
            .map(|line| LedgerMovementId::Return {
                order: order.clone(),
                line,
            })
            .collect()
    }
}

impl ReservationMove {
    fn at(self, reservation: &Reservation, line: u32) -> LedgerMovementId {
        LedgerMovementId::Reservation {
            reservation: reservation.id.clone(),
            movement: self,
            line,
        }
    }
}

fn line_numbers(count: usize) -> std::ops::Range<u32> {
    0..u32::try_from(count).unwrap_or(u32::MAX)
}

/// A line number as written in an id: decimal digits without a sign or a leading zero.
fn parse_line_number(text: &str) -> Option<u32> {
    let canonical = !text.is_empty()
        && text.bytes().all(|byte| byte.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    let line: u32 = text.parse().ok().filter(|_| canonical)?;
    (line <= LINE_NUMBER_MAX).then_some(line)
}

impl fmt::Display for LedgerMovementId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerMovementId::Stock(movement) => formatter.write_str(movement.as_str()),
            LedgerMovementId::Reservation {
                reservation,
                movement,
                line,
            } => write!(formatter, "{reservation}.{}.{line}", movement.as_str()),
            LedgerMovementId::Return { order, line } => write!(formatter, "{order}.return.{line}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::{SkuCode, WarehouseCode};
    use crate::quantity::Quantity;
    use crate::reservation::{OrderReference, ReservationLine};
    use crate::time::Timestamp;

    fn reservation(status: ReservationStatus, lines: usize) -> Reservation {
        let now = Timestamp::from_unix_milliseconds(1_700_000_000_000);
        Reservation {
            id: ReservationId::generate(now, 7),
            status,
            release_reason: None,
            shop: None,
            user: None,
            order_id: None,
            reference: OrderReference::default(),
            expires_at: now,
            created_at: now,
            updated_at: now,
            lines: (0..lines)
                .map(|index| ReservationLine {
                    sku: SkuCode::parse(&format!("SKU-{index}")).unwrap(),
                    warehouse: WarehouseCode::default_warehouse(),
                    quantity: Quantity::new(1).unwrap(),
                })
                .collect(),
        }
    }

    #[test]
    fn every_kind_of_movement_id_round_trips_through_parse() {
        let now = Timestamp::from_unix_milliseconds(1_700_000_000_000);
        let ids = [
            LedgerMovementId::Stock(MovementId::generate(now, 1)),
            LedgerMovementId::Reservation {
                reservation: ReservationId::generate(now, 2),
                movement: ReservationMove::Release,
                line: 12,
            },
            LedgerMovementId::Return {
                order: OrderId::generate(now, 3),
                line: 0,
            },
        ];
        for id in ids {
            assert_eq!(LedgerMovementId::parse(&id.to_string()), Ok(id));
        }
    }

    #[test]
    fn a_reservation_shows_its_reserve_rows_and_then_its_settling_rows() {
        let held = reservation(ReservationStatus::Reserved, 2);
        let shown: Vec<String> = LedgerMovementId::of_reservation(&held)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            shown,
            [
                format!("{}.reserve.0", held.id),
                format!("{}.reserve.1", held.id)
            ]
        );
        let confirmed = reservation(ReservationStatus::Confirmed, 2);
        let kinds: Vec<Option<&str>> = LedgerMovementId::of_reservation(&confirmed)
            .iter()
            .map(LedgerMovementId::kind)
            .collect();
        assert_eq!(
            kinds,
            [
                Some("reserve"),
                Some("reserve"),
                Some("confirm"),
                Some("confirm")
            ]
        );
        let released = reservation(ReservationStatus::Released, 1);
        assert_eq!(LedgerMovementId::of_reservation(&released).len(), 2);
    }

    #[test]
    fn malformed_movement_ids_are_refused() {
        let now = Timestamp::from_unix_milliseconds(1_700_000_000_000);
        let reservation = ReservationId::generate(now, 2);
        let order = OrderId::generate(now, 3);
        for text in [
            String::new(),
            "mov_".to_owned(),
            "mov_xyz".to_owned(),
            reservation.to_string(),
            format!("{reservation}.reserve"),
            format!("{reservation}.reserve.1.2"),
            format!("{reservation}.return.1"),
            format!("{reservation}.receive.1"),
            format!("{reservation}.reserve.-1"),
            format!("{reservation}.reserve.+1"),
            format!("{reservation}.reserve.01"),
            format!("{reservation}.reserve.10000"),
            format!("{reservation}.reserve.99999999999999999999"),
            format!("{order}.reserve.0"),
            format!("{order}.return."),
            "prd_0000000000000000000000000000.return.0".to_owned(),
        ] {
            assert!(LedgerMovementId::parse(&text).is_err(), "{text:?} parsed");
        }
    }
}

//! Events: what the outbox records beside each state change, and how they are named
//! on the wire (DESIGN.md, "Events and caches"). Pure naming and parsing; the store
//! writes them in the transaction of the change, the engine relays them.

use std::fmt;

use crate::error::ParseError;

/// What an event is about. Each aggregate numbers its own events 1, 2, 3… in the
/// order they committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Aggregate {
    Reservation,
    Order,
    Payment,
    Stock,
    Sku,
}

impl Aggregate {
    pub const ALL: [Aggregate; 5] = [
        Aggregate::Reservation,
        Aggregate::Order,
        Aggregate::Payment,
        Aggregate::Stock,
        Aggregate::Sku,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Aggregate::Reservation => "reservation",
            Aggregate::Order => "order",
            Aggregate::Payment => "payment",
            Aggregate::Stock => "stock",
            Aggregate::Sku => "sku",
        }
    }

    pub fn parse(text: &str) -> Result<Aggregate, ParseError> {
        Aggregate::ALL
            .into_iter()
            .find(|aggregate| aggregate.as_str() == text)
            .ok_or_else(|| ParseError::new(format!("unknown aggregate '{text}'")))
    }
}

/// Every event stockd announces. The wire name is `<aggregate>.<event>`; the NATS
/// subject is `stockd.events.` followed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    ReservationCreated,
    ReservationConfirmed,
    ReservationReleased,
    ReservationExpired,
    OrderStatusChanged,
    PaymentSettled,
    StockMoved,
    SkuSaleStatusChanged,
    /// What a shopper is shown of a SKU changed: its own fields (title, price, limit),
    /// or its product's (title, image, category, supplier).
    SkuChanged,
}

impl EventType {
    pub const ALL: [EventType; 9] = [
        EventType::ReservationCreated,
        EventType::ReservationConfirmed,
        EventType::ReservationReleased,
        EventType::ReservationExpired,
        EventType::OrderStatusChanged,
        EventType::PaymentSettled,
        EventType::StockMoved,
        EventType::SkuSaleStatusChanged,
        EventType::SkuChanged,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::ReservationCreated => "reservation.created",
            EventType::ReservationConfirmed => "reservation.confirmed",
            EventType::ReservationReleased => "reservation.released",
            EventType::ReservationExpired => "reservation.expired",
            EventType::OrderStatusChanged => "order.status_changed",
            EventType::PaymentSettled => "payment.settled",
            EventType::StockMoved => "stock.moved",
            EventType::SkuSaleStatusChanged => "sku.sale_status_changed",
            EventType::SkuChanged => "sku.changed",
        }
    }

    pub fn parse(text: &str) -> Result<EventType, ParseError> {
        EventType::ALL
            .into_iter()
            .find(|event| event.as_str() == text)
            .ok_or_else(|| ParseError::new(format!("unknown event type '{text}'")))
    }

    pub fn aggregate(self) -> Aggregate {
        match self {
            EventType::ReservationCreated
            | EventType::ReservationConfirmed
            | EventType::ReservationReleased
            | EventType::ReservationExpired => Aggregate::Reservation,
            EventType::OrderStatusChanged => Aggregate::Order,
            EventType::PaymentSettled => Aggregate::Payment,
            EventType::StockMoved => Aggregate::Stock,
            EventType::SkuSaleStatusChanged | EventType::SkuChanged => Aggregate::Sku,
        }
    }

    /// The JetStream subject the relay publishes this event on.
    pub fn subject(self) -> String {
        format!("{EVENT_SUBJECT_PREFIX}{}", self.as_str())
    }
}

/// The JetStream stream the relay publishes to, and its subjects.
pub const EVENT_STREAM: &str = "STOCKD_EVENTS";
pub const EVENT_SUBJECT_PREFIX: &str = "stockd.events.";
pub const EVENT_SUBJECTS: &str = "stockd.events.>";

/// An event's id: `<aggregate>/<aggregate id>/<sequence>`. It is known before the
/// change commits (it is the change's own position in its aggregate), the same on
/// every retry of a publish, and the relay sends it as `Nats-Msg-Id`, so JetStream
/// drops a second publish of the same event.
pub fn event_id(aggregate: Aggregate, aggregate_id: &str, sequence: i64) -> String {
    format!("{}/{aggregate_id}/{sequence}", aggregate.as_str())
}

/// A cursor of the pull feed: the commit-ordered position of the last event a reader
/// has seen (0 before the first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct FeedCursor(i64);

impl FeedCursor {
    pub const START: FeedCursor = FeedCursor(0);

    pub fn parse(text: &str) -> Result<FeedCursor, ParseError> {
        let position: i64 = text.parse().map_err(|_| {
            ParseError::new(format!(
                "cursor '{text}' must be a non-negative integer, as an earlier page's next_cursor"
            ))
        })?;
        // At most 18 digits: every such number fits 63 bits, so the digits alone say
        // whether a cursor is well formed (positions never come near 10^18).
        if position < 0 || text.len() > 18 || !text.bytes().all(|byte| byte.is_ascii_digit()) {
            return Err(ParseError::new(format!(
                "cursor '{text}' must be a non-negative integer, as an earlier page's next_cursor"
            )));
        }
        Ok(FeedCursor(position))
    }

    pub fn of_position(position: i64) -> FeedCursor {
        FeedCursor(position.max(0))
    }

    pub fn position(self) -> i64 {
        self.0
    }
}

impl fmt::Display for FeedCursor {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_type_parses_back_and_names_its_aggregate_first() {
        for event in EventType::ALL {
            assert_eq!(EventType::parse(event.as_str()), Ok(event));
            assert!(event.as_str().starts_with(event.aggregate().as_str()));
            assert_eq!(event.subject(), format!("stockd.events.{}", event.as_str()));
        }
        assert!(EventType::parse("reservation.exploded").is_err());
    }

    #[test]
    fn an_event_id_names_aggregate_id_and_sequence() {
        assert_eq!(
            event_id(Aggregate::Reservation, "rsv_1", 2),
            "reservation/rsv_1/2"
        );
    }

    #[test]
    fn a_cursor_is_a_non_negative_integer() {
        assert_eq!(FeedCursor::parse("0"), Ok(FeedCursor::START));
        assert_eq!(FeedCursor::parse("42").map(FeedCursor::position), Ok(42));
        for bad in ["", "-1", "1.5", "abc", "+3", " 1", "99999999999999999999"] {
            assert!(FeedCursor::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }
}

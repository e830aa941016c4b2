//! Identifiers: the ones stockd mints (reservations, movements) and the one clients
//! bring (idempotency keys).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::ParseError;
use crate::hex::push_lower_hex;
use crate::limits::IDEMPOTENCY_KEY_LENGTH_MAX;
use crate::time::Timestamp;

/// Identifiers stockd mints look like `rsv_0192f3a4b5c6d7e8f9a0b1c2d3e4f5a6`: a prefix
/// naming the kind, 12 hex digits of the creation time in milliseconds (so ids sort by
/// age) and 16 hex digits of randomness supplied by the caller (domain does no IO, so it
/// does not read the operating system's random source itself).
///
/// Written into one buffer: every reservation request mints an id, and `format!`'s
/// padded hex was about 1 % of a sold-out answer's CPU (docs/BENCHMARKS.md,
/// twenty-third session).
fn mint(prefix: &str, now: Timestamp, random: u64) -> String {
    let milliseconds = now.unix_milliseconds().clamp(0, 0xFFFF_FFFF_FFFF) as u64;
    let mut text = String::with_capacity(prefix.len() + 28);
    text.push_str(prefix);
    push_lower_hex(&mut text, &milliseconds.to_be_bytes()[2..]);
    push_lower_hex(&mut text, &random.to_be_bytes());
    text
}

fn parse_minted(kind: &str, prefix: &str, text: &str) -> Result<String, ParseError> {
    let digits = text.strip_prefix(prefix);
    let well_formed = digits.is_some_and(|digits| {
        digits.len() == 28
            && digits
                .bytes()
                .all(|byte| matches!(byte, b'0'..=b'9' | b'a'..=b'f'))
    });
    if well_formed {
        Ok(text.to_owned())
    } else {
        Err(ParseError::new(format!(
            "{kind} id must be '{prefix}' followed by 28 lowercase hex digits"
        )))
    }
}

macro_rules! minted_id {
    ($(#[$meta:meta])* $name:ident, $kind:literal, $prefix:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            pub fn generate(now: Timestamp, random: u64) -> $name {
                $name(mint($prefix, now, random))
            }

            pub fn parse(text: &str) -> Result<$name, ParseError> {
                parse_minted($kind, $prefix, text).map($name)
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = ParseError;
            fn try_from(text: String) -> Result<$name, ParseError> {
                $name::parse(&text)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str(&self.0)
            }
        }
    };
}

minted_id!(
    /// Names one reservation (a hold on stock across one or more lines).
    ReservationId,
    "reservation",
    "rsv_"
);
minted_id!(
    /// Names one receive or adjust stock movement; ledger rows reference it.
    MovementId,
    "movement",
    "mov_"
);

minted_id!(
    /// Names one product (SPU).
    ProductId,
    "product",
    "prd_"
);
minted_id!(
    /// Names one scheduled shelf change.
    ScheduleId,
    "schedule",
    "sch_"
);

minted_id!(
    /// Names one order.
    OrderId,
    "order",
    "ord_"
);
minted_id!(
    /// Names one service key (a shop's checkout backend's credential). The id is
    /// public, the secret that goes with it is not.
    ServiceKeyId,
    "service key",
    "key_"
);
/// The id of [`ServiceKeyId::queue_intake`].
const QUEUE_INTAKE_KEY_ID: &str = "key_0000000000000000000000000000";

impl ServiceKeyId {
    /// The principal of a shop's queue intake (commands from NATS): a service key id
    /// no key is minted with (its time is 0), so no credential is it and its
    /// idempotency keys are a space of their own.
    pub fn queue_intake() -> ServiceKeyId {
        ServiceKeyId::parse(QUEUE_INTAKE_KEY_ID).expect("the queue intake's id is well formed")
    }

    /// Whether this is [`ServiceKeyId::queue_intake`].
    pub fn is_queue_intake(&self) -> bool {
        self.as_str() == QUEUE_INTAKE_KEY_ID
    }
}

minted_id!(
    /// Names one payment attempt of an order; the gateway call's idempotency key
    /// derives from it.
    PaymentAttemptId,
    "payment attempt",
    "pay_"
);
minted_id!(
    /// Names one refund.
    RefundId,
    "refund",
    "rfd_"
);
minted_id!(
    /// Names one flash-sale campaign.
    CampaignId,
    "campaign",
    "cmp_"
);
minted_id!(
    /// Names one place in a campaign's waiting room, handed to a caller who asked to
    /// wait without holding its connection (`Prefer: respond-async`).
    TicketId,
    "ticket",
    "tkt_"
);

/// The client's `Idempotency-Key`: 1 to 255 visible ASCII characters (0x21..=0x7E).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(text: &str) -> Result<IdempotencyKey, ParseError> {
        let length_ok = (1..=IDEMPOTENCY_KEY_LENGTH_MAX).contains(&text.len());
        let visible = text.bytes().all(|byte| (0x21..=0x7E).contains(&byte));
        if length_ok && visible {
            Ok(IdempotencyKey(text.to_owned()))
        } else {
            Err(ParseError::new(
                "Idempotency-Key must be 1 to 255 visible ASCII characters",
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_ids_round_trip_through_parse() {
        let id = ReservationId::generate(Timestamp::from_unix_milliseconds(1_700_000_000_000), 42);
        assert_eq!(ReservationId::parse(id.as_str()).unwrap(), id);
        assert_eq!(id.as_str().len(), 4 + 28);
    }

    #[test]
    fn a_minted_id_is_its_milliseconds_in_twelve_hex_digits_then_the_random_part_in_sixteen() {
        for (milliseconds, random) in [
            (0, 0),
            (1, 1),
            (1_700_000_000_123, 0x0123_4567_89ab_cdef),
            (0xFFFF_FFFF_FFFF, u64::MAX),
            (0x1_0000_0000_0000, 42),
            (-5, 7),
        ] {
            let id =
                ReservationId::generate(Timestamp::from_unix_milliseconds(milliseconds), random);
            let clamped = milliseconds.clamp(0, 0xFFFF_FFFF_FFFF);
            assert_eq!(id.as_str(), format!("rsv_{clamped:012x}{random:016x}"));
        }
    }

    #[test]
    fn minted_ids_sort_by_creation_time() {
        let earlier = ReservationId::generate(Timestamp::from_unix_milliseconds(1_000), u64::MAX);
        let later = ReservationId::generate(Timestamp::from_unix_milliseconds(1_001), 0);
        assert!(earlier < later);
    }

    #[test]
    fn ids_with_the_wrong_prefix_or_digits_are_refused() {
        let movement = MovementId::generate(Timestamp::from_unix_milliseconds(5), 7);
        assert!(ReservationId::parse(movement.as_str()).is_err());
        assert!(ReservationId::parse("rsv_XYZ").is_err());
        assert!(ReservationId::parse("rsv_0000000000000000000000000000A").is_err());
        assert!(ReservationId::parse("").is_err());
    }

    #[test]
    fn idempotency_keys_are_visible_ascii_of_bounded_length() {
        assert!(IdempotencyKey::parse("order-123:attempt/1").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        for bad in ["", "has space", "tab\t", "ünicode", &"k".repeat(256)] {
            assert!(
                IdempotencyKey::parse(bad).is_err(),
                "{bad:?} should be refused"
            );
        }
    }
}

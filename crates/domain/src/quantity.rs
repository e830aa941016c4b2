//! Quantities and durations that arrive from clients.
//!
//! Each type deserializes only from a JSON number that is an integer inside its range:
//! `1.5`, `"3"`, `null` and 2^63 are all refused with a message naming the range,
//! instead of being truncated, coerced or wrapped. A number written with a zero
//! fraction or an exponent (`1.0`, `1e3`) is the integer it equals: JSON has one number
//! type, and JSON Schema's `integer` (what `/openapi.json` promises) includes them.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::ParseError;
use crate::limits::{QUANTITY_MAX, RESERVATION_TTL_SECONDS_MAX, RESERVATION_TTL_SECONDS_MIN};

/// Deserializes a JSON integer and hands it to `check`, refusing floats, strings and
/// anything else. Integers beyond `i64` are refused as out of range by `check`'s caller.
struct StrictIntegerVisitor {
    expected: &'static str,
}

impl<'de> Visitor<'de> for StrictIntegerVisitor {
    type Value = i128;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.expected)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<i128, E> {
        Ok(i128::from(value))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<i128, E> {
        Ok(i128::from(value))
    }

    fn visit_i128<E: de::Error>(self, value: i128) -> Result<i128, E> {
        Ok(value)
    }

    fn visit_u128<E: de::Error>(self, value: u128) -> Result<i128, E> {
        Ok(i128::try_from(value).unwrap_or(i128::MAX))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<i128, E> {
        integral(value).ok_or_else(|| E::invalid_type(de::Unexpected::Float(value), &self))
    }
}

/// The integer a JSON number equals, when it equals one that fits 64 bits. Every such
/// number below 2^53 is exact in an `f64`; the ranges stockd accepts are far below it.
pub(crate) fn integral(value: f64) -> Option<i128> {
    const LIMIT: f64 = 9_223_372_036_854_775_808.0; // 2^63
    // The cast is exact when it is used: the value is whole and inside i64's range (a
    // float cast saturates otherwise, and is then thrown away).
    (value.is_finite() && value.fract() == 0.0 && value.abs() < LIMIT).then_some(value as i128)
}

fn deserialize_strict_integer<'de, D: Deserializer<'de>>(
    deserializer: D,
    expected: &'static str,
) -> Result<i128, D::Error> {
    deserializer.deserialize_i64(StrictIntegerVisitor { expected })
}

/// Declares an integer newtype that accepts `min..=max` (without zero when
/// `zero_allowed` is false), from Rust through `new` and from JSON through serde.
macro_rules! bounded_integer {
    ($(#[$meta:meta])* $name:ident, field = $field:literal, min = $min:expr, max = $max:expr,
     zero_allowed = $zero_allowed:literal, expected = $expected:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(into = "i64")]
        pub struct $name(i64);

        impl $name {
            const EXPECTED: &'static str = $expected;
            /// The smallest value accepted.
            pub const MIN: i64 = $min;
            /// The largest value accepted.
            pub const MAX: i64 = $max;
            /// Whether 0 is accepted between the bounds.
            pub const ZERO_ALLOWED: bool = $zero_allowed;

            pub fn new(value: i64) -> Result<$name, ParseError> {
                if ($min..=$max).contains(&value) && ($zero_allowed || value != 0) {
                    Ok($name(value))
                } else {
                    Err(ParseError::new(format!("{} must be {}", $field, $name::EXPECTED)))
                }
            }

            pub fn get(self) -> i64 {
                self.0
            }
        }

        impl From<$name> for i64 {
            fn from(value: $name) -> i64 {
                value.0
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<$name, D::Error> {
                let value = deserialize_strict_integer(deserializer, $name::EXPECTED)?;
                i64::try_from(value)
                    .map_err(|_| ParseError::new(format!("{} must be {}", $field, $name::EXPECTED)))
                    .and_then($name::new)
                    .map_err(de::Error::custom)
            }
        }
    };
}

bounded_integer!(
    /// A positive number of units: 1..=[`QUANTITY_MAX`].
    Quantity,
    field = "quantity",
    min = 1,
    max = QUANTITY_MAX,
    zero_allowed = false,
    expected = "an integer between 1 and 1000000"
);

bounded_integer!(
    /// Most units of a SKU one shopper may hold or have bought: 1..=[`QUANTITY_MAX`].
    PerUserLimit,
    field = "per_user_limit",
    min = 1,
    max = QUANTITY_MAX,
    zero_allowed = false,
    expected = "an integer between 1 and 1000000, or null for no limit"
);

bounded_integer!(
    /// A signed, non-zero correction of available stock: -[`QUANTITY_MAX`]..=
    /// [`QUANTITY_MAX`] without 0. Used by `adjust` movements (a count found more or
    /// fewer units).
    AdjustmentQuantity,
    field = "quantity",
    min = -QUANTITY_MAX,
    max = QUANTITY_MAX,
    zero_allowed = false,
    expected = "a non-zero integer between -1000000 and 1000000"
);

bounded_integer!(
    /// The stock rows a campaign's units are split over:
    /// 1..=[`crate::campaign::CAMPAIGN_BUCKETS_MAX`].
    CampaignBuckets,
    field = "buckets",
    min = 1,
    max = crate::campaign::CAMPAIGN_BUCKETS_MAX as i64,
    zero_allowed = false,
    expected = "an integer between 1 and 64"
);

bounded_integer!(
    /// How long a reservation holds its stock before the expiry worker releases it.
    TtlSeconds,
    field = "ttl_seconds",
    min = RESERVATION_TTL_SECONDS_MIN,
    max = RESERVATION_TTL_SECONDS_MAX,
    zero_allowed = false,
    expected = "an integer between 1 and 86400"
);

bounded_integer!(
    /// Available units at or below which an on-shelf SKU counts as low on stock; 0
    /// turns the warning off.
    LowStockThreshold,
    field = "low_stock_threshold",
    min = 0,
    max = QUANTITY_MAX,
    zero_allowed = true,
    expected = "an integer between 0 and 1000000"
);

bounded_integer!(
    /// A version a client saw (of a SKU, a product), sent back so a change made since
    /// is refused instead of overwritten.
    Version,
    field = "version",
    min = 0,
    max = i64::MAX,
    zero_allowed = true,
    expected = "a non-negative integer"
);

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_quantity(json: &str) -> Result<Quantity, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn quantity_accepts_integers_inside_the_range() {
        assert_eq!(parse_quantity("1").unwrap().get(), 1);
        assert_eq!(parse_quantity("1000000").unwrap().get(), 1_000_000);
    }

    #[test]
    fn a_number_written_with_a_zero_fraction_or_an_exponent_is_the_integer_it_equals() {
        assert_eq!(parse_quantity("1.0").unwrap().get(), 1);
        assert_eq!(parse_quantity("1e3").unwrap().get(), 1_000);
        assert_eq!(parse_quantity("2.50e1").unwrap().get(), 25);
        assert!(parse_quantity("1e7").is_err(), "still bounded");
        assert!(parse_quantity("-0.0").is_err(), "zero is still refused");
    }

    /// Schemathesis sent `4405026911322422.0` (an integer to JSON Schema): near 2^52
    /// an `f64` steps by 0.5, and a parser that is not correctly rounded read it as
    /// `…422.5` and the request was refused as fractional.
    #[test]
    fn a_large_whole_number_with_a_zero_fraction_is_read_exactly() {
        let version: Version = serde_json::from_str("4405026911322422.0").unwrap();
        assert_eq!(version.get(), 4_405_026_911_322_422);
        let version: Version = serde_json::from_str("4503599627370495.0").unwrap();
        assert_eq!(version.get(), 4_503_599_627_370_495, "2^52 - 1");
    }

    #[test]
    fn quantity_refuses_zero_negative_huge_fractional_and_non_numbers() {
        for bad in [
            "0",
            "-1",
            "1000001",
            "9223372036854775807",
            "9223372036854775808",
            "18446744073709551616",
            "1.5",
            "1.000001",
            "1e-3",
            "1e300",
            "\"3\"",
            "null",
            "true",
            "[1]",
            "{}",
        ] {
            assert!(parse_quantity(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn adjustment_quantity_allows_negative_but_never_zero() {
        assert_eq!(
            serde_json::from_str::<AdjustmentQuantity>("-5")
                .unwrap()
                .get(),
            -5
        );
        assert!(serde_json::from_str::<AdjustmentQuantity>("0").is_err());
        assert!(serde_json::from_str::<AdjustmentQuantity>("-1000001").is_err());
        assert!(serde_json::from_str::<AdjustmentQuantity>("-2.5").is_err());
    }

    #[test]
    fn low_stock_threshold_allows_zero() {
        assert_eq!(
            serde_json::from_str::<LowStockThreshold>("0")
                .unwrap()
                .get(),
            0
        );
        assert!(serde_json::from_str::<LowStockThreshold>("-1").is_err());
    }

    #[test]
    fn ttl_is_bounded_on_both_sides() {
        assert!(serde_json::from_str::<TtlSeconds>("0").is_err());
        assert!(serde_json::from_str::<TtlSeconds>("86401").is_err());
        assert_eq!(serde_json::from_str::<TtlSeconds>("60").unwrap().get(), 60);
    }
}

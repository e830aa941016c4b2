//! Prices: integer minor units (cents, fen) and an ISO 4217 currency code. Floating
//! point never touches money.

use std::fmt;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

use crate::error::ParseError;
use crate::limits::PRICE_MINOR_MAX;

/// A price in minor units: 0..=[`PRICE_MINOR_MAX`]. Zero is allowed (free samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(into = "i64")]
pub struct PriceMinor(i64);

impl PriceMinor {
    pub fn new(value: i64) -> Result<PriceMinor, ParseError> {
        if (0..=PRICE_MINOR_MAX).contains(&value) {
            Ok(PriceMinor(value))
        } else {
            Err(ParseError::new(
                "price must be an integer number of minor units between 0 and 1000000000000",
            ))
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl From<PriceMinor> for i64 {
    fn from(value: PriceMinor) -> i64 {
        value.0
    }
}

impl<'de> Deserialize<'de> for PriceMinor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<PriceMinor, D::Error> {
        // serde_json hands floats to `f64`; only exact integers are prices.
        let value = serde_json_integer(deserializer)?;
        PriceMinor::new(value).map_err(de::Error::custom)
    }
}

fn serde_json_integer<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    struct IntegerVisitor;
    impl de::Visitor<'_> for IntegerVisitor {
        type Value = i64;
        fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("an integer")
        }
        fn visit_i64<E: de::Error>(self, value: i64) -> Result<i64, E> {
            Ok(value)
        }
        fn visit_u64<E: de::Error>(self, value: u64) -> Result<i64, E> {
            i64::try_from(value).map_err(|_| E::custom("integer out of range"))
        }
        fn visit_f64<E: de::Error>(self, value: f64) -> Result<i64, E> {
            crate::quantity::integral(value)
                .and_then(|whole| i64::try_from(whole).ok())
                .ok_or_else(|| E::invalid_type(de::Unexpected::Float(value), &self))
        }
    }
    deserializer.deserialize_i64(IntegerVisitor)
}

/// An ISO 4217 alphabetic code: three uppercase ASCII letters (`CNY`, `EUR`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Currency(String);

impl Currency {
    pub fn parse(text: &str) -> Result<Currency, ParseError> {
        if text.len() == 3 && text.bytes().all(|byte| byte.is_ascii_uppercase()) {
            Ok(Currency(text.to_owned()))
        } else {
            Err(ParseError::new(
                "currency must be a three-letter uppercase ISO 4217 code such as CNY",
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Currency {
    type Error = ParseError;
    fn try_from(text: String) -> Result<Currency, ParseError> {
        Currency::parse(&text)
    }
}

impl From<Currency> for String {
    fn from(value: Currency) -> String {
        value.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_are_non_negative_integers() {
        assert_eq!(serde_json::from_str::<PriceMinor>("0").unwrap().get(), 0);
        assert_eq!(
            serde_json::from_str::<PriceMinor>("1999").unwrap().get(),
            1999
        );
        for bad in ["-1", "19.99", "\"1999\"", "1000000000001", "null"] {
            assert!(serde_json::from_str::<PriceMinor>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn currencies_are_three_uppercase_letters() {
        assert!(Currency::parse("CNY").is_ok());
        for bad in ["cny", "CN", "CNYY", "C1Y", ""] {
            assert!(Currency::parse(bad).is_err(), "{bad}");
        }
    }
}

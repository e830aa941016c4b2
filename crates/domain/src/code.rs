//! Codes that name things chosen by the shop: SKUs and warehouses.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::ParseError;
use crate::limits::{SKU_CODE_LENGTH_MAX, WAREHOUSE_CODE_LENGTH_MAX};

/// Codes are ASCII letters, digits, `-`, `_` and `.`, starting with a letter or digit.
/// The narrow alphabet keeps them safe in URLs, logs and metrics labels without escaping.
fn parse_code(kind: &str, text: &str, length_max: usize) -> Result<String, ParseError> {
    if text.is_empty() || text.len() > length_max {
        return Err(ParseError::new(format!(
            "{kind} must be 1 to {length_max} characters long"
        )));
    }
    let first_is_alphanumeric = text.as_bytes()[0].is_ascii_alphanumeric();
    let all_allowed = text
        .bytes()
        .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'));
    if !first_is_alphanumeric || !all_allowed {
        return Err(ParseError::new(format!(
            "{kind} may contain only ASCII letters, digits, '-', '_' and '.', and must start with a letter or digit"
        )));
    }
    Ok(text.to_owned())
}

/// A stock-keeping unit's code, as the shop names it (`MILK-1L`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SkuCode(String);

impl SkuCode {
    pub fn parse(text: &str) -> Result<SkuCode, ParseError> {
        parse_code("sku", text, SKU_CODE_LENGTH_MAX).map(SkuCode)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A warehouse's code. Stock is counted per (sku, warehouse).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WarehouseCode(String);

impl WarehouseCode {
    /// The warehouse used when a request names none.
    pub const DEFAULT: &'static str = "default";

    pub fn parse(text: &str) -> Result<WarehouseCode, ParseError> {
        parse_code("warehouse", text, WAREHOUSE_CODE_LENGTH_MAX).map(WarehouseCode)
    }

    pub fn default_warehouse() -> WarehouseCode {
        WarehouseCode(WarehouseCode::DEFAULT.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

macro_rules! string_newtype_conversions {
    ($name:ident) => {
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

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

/// Declares a code newtype with the shared alphabet and the given maximum length.
macro_rules! code_newtype {
    ($(#[$meta:meta])* $name:ident, $kind:literal, $length_max:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn parse(text: &str) -> Result<$name, ParseError> {
                parse_code($kind, text, $length_max).map($name)
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        string_newtype_conversions!($name);
    };
}

code_newtype!(
    /// The shop a product belongs to; operators act only within their shop.
    ShopCode,
    "shop",
    crate::limits::CATALOG_CODE_LENGTH_MAX
);
impl ShopCode {
    /// The shop of a SKU created without naming one.
    pub const DEFAULT: &'static str = "default";

    pub fn default_shop() -> ShopCode {
        ShopCode(ShopCode::DEFAULT.to_owned())
    }
}

code_newtype!(
    /// A product category (`dairy`, `bakery`), a target of batch shelf operations.
    CategoryCode,
    "category",
    crate::limits::CATALOG_CODE_LENGTH_MAX
);
code_newtype!(
    /// A product's supplier, a target of batch shelf operations.
    SupplierCode,
    "supplier",
    crate::limits::CATALOG_CODE_LENGTH_MAX
);
code_newtype!(
    /// Who did something: an operator's id, recorded in the shelf log.
    OperatorId,
    "operator id",
    crate::limits::CATALOG_CODE_LENGTH_MAX
);
code_newtype!(
    /// The shopper a cart belongs to, as the shop's checkout service names them.
    UserId,
    "user id",
    crate::limits::CATALOG_CODE_LENGTH_MAX
);

/// A product image: an `http` or `https` URL without spaces or control characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ImageUrl(String);

impl ImageUrl {
    pub fn parse(text: &str) -> Result<ImageUrl, ParseError> {
        let length_max = crate::limits::IMAGE_URL_LENGTH_MAX;
        let scheme_ok = text.starts_with("https://") || text.starts_with("http://");
        let characters_ok = text.bytes().all(|byte| byte.is_ascii_graphic());
        if scheme_ok && characters_ok && text.len() <= length_max && text.len() > "https://".len() {
            Ok(ImageUrl(text.to_owned()))
        } else {
            Err(ParseError::new(format!(
                "image_url must be an http(s) URL of at most {length_max} visible ASCII characters"
            )))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

string_newtype_conversions!(ImageUrl);

string_newtype_conversions!(SkuCode);
string_newtype_conversions!(WarehouseCode);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sku_codes_accept_the_documented_alphabet() {
        for good in ["MILK-1L", "a", "sku_1.2", &"X".repeat(64)] {
            assert!(SkuCode::parse(good).is_ok(), "{good} should parse");
        }
    }

    #[test]
    fn sku_codes_refuse_everything_else() {
        for bad in [
            "",
            "-lead",
            ".x",
            "with space",
            "slash/es",
            "ünï",
            "a;DROP",
            &"X".repeat(65),
        ] {
            assert!(SkuCode::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn warehouse_codes_are_bounded_shorter_than_sku_codes() {
        assert!(WarehouseCode::parse(&"w".repeat(32)).is_ok());
        assert!(WarehouseCode::parse(&"w".repeat(33)).is_err());
    }
}

/// Whether free text (a title, a remark, a spec, a name) may not hold `character`: a
/// control character (Unicode Cc), or the line and paragraph separators U+2028 and
/// U+2029, which are not control characters but break a line in a log viewer, a
/// console or JavaScript, so one remark could pass for two log lines.
pub fn unfit_for_text(character: char) -> bool {
    character.is_control() || matches!(character, '\u{2028}' | '\u{2029}')
}

/// A human-readable name (a SKU's title): at most [`TITLE_LENGTH_MAX`] characters, no
/// control characters or line separators ([`unfit_for_text`]), so it prints safely in
/// logs, receipts and consoles.
///
/// [`TITLE_LENGTH_MAX`]: crate::limits::TITLE_LENGTH_MAX
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Title(String);

impl Title {
    pub fn parse(text: &str) -> Result<Title, ParseError> {
        let length_max = crate::limits::TITLE_LENGTH_MAX;
        if text.chars().count() > length_max || text.chars().any(unfit_for_text) {
            return Err(ParseError::new(format!(
                "title must be at most {length_max} characters without control characters or line separators"
            )));
        }
        Ok(Title(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

string_newtype_conversions!(Title);

/// A product's title: a [`Title`] with something to read in it. Shoppers find the
/// product by it and its SKUs show it as theirs, and a product goes on the shelf only
/// with one (seed 003 §1.2); a blank one set later would put a nameless product on sale.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ProductTitle(String);

impl ProductTitle {
    pub fn parse(text: &str) -> Result<ProductTitle, ParseError> {
        let title = Title::parse(text)?;
        if title.as_str().trim().is_empty() {
            return Err(ParseError::new("a product's title must not be blank"));
        }
        Ok(ProductTitle(title.0))
    }

    pub fn into_title(self) -> Title {
        Title(self.0)
    }
}

string_newtype_conversions!(ProductTitle);

#[cfg(test)]
mod title_tests {
    use super::*;

    #[test]
    fn titles_allow_any_printable_text_up_to_the_limit() {
        assert!(Title::parse("伊利纯牛奶 250ml×24").is_ok());
        assert!(Title::parse("").is_ok());
        assert!(Title::parse(&"é".repeat(200)).is_ok());
        assert!(Title::parse(&"é".repeat(201)).is_err());
        assert!(Title::parse("line\nbreak").is_err());
    }

    #[test]
    fn a_product_title_has_something_to_read_in_it() {
        assert!(ProductTitle::parse("Oat milk").is_ok());
        assert!(ProductTitle::parse(" milk ").is_ok());
        for blank in ["", "   ", "\u{3000}"] {
            assert!(ProductTitle::parse(blank).is_err(), "{blank:?}");
        }
        assert!(ProductTitle::parse(&"é".repeat(201)).is_err());
    }
}

code_newtype!(
    /// The shop's own order number for a reservation or an order (seed 002 §十三.1):
    /// used once per shop, so a second request with another Idempotency-Key is refused
    /// (`order_ref_reused`).
    OrderRef,
    "order_ref",
    crate::limits::ORDER_REF_LENGTH_MAX
);

code_newtype!(
    /// The channel a reservation or an order came through (`web`, `app`, `pos`, `mq`),
    /// recorded with it.
    RequestSource,
    "source",
    crate::limits::REQUEST_SOURCE_LENGTH_MAX
);

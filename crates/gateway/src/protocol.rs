//! Wire types of the subset: PaymentIntents (create with confirm, retrieve), refunds,
//! and webhook events. Requests are form-encoded, as Stripe's are; responses JSON.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The PaymentIntent statuses stockd acts on (Stripe has a few more; any other value
/// is treated as "not known yet").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentIntentStatus {
    Succeeded,
    /// Declined: the payment method failed; a new one is needed.
    RequiresPaymentMethod,
    /// The customer must act (3-D Secure); no money has moved yet.
    RequiresAction,
    /// Asynchronous: no answer yet.
    Processing,
    Canceled,
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastPaymentError {
    pub code: Option<String>,
    pub message: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentIntent {
    pub id: String,
    #[serde(default = "payment_intent_object")]
    pub object: String,
    pub amount: i64,
    pub currency: String,
    pub status: PaymentIntentStatus,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub latest_charge: Option<String>,
    #[serde(default)]
    pub last_payment_error: Option<LastPaymentError>,
}

fn payment_intent_object() -> String {
    "payment_intent".to_owned()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    pub id: String,
    #[serde(default)]
    pub object: String,
    pub amount: i64,
    pub currency: String,
    pub payment_intent: String,
    pub status: String,
}

/// An error body (`{"error": {...}}`); a decline carries its PaymentIntent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub payment_intent: Option<PaymentIntent>,
}

/// A webhook event. stockd reads `payment_intent.succeeded`,
/// `payment_intent.payment_failed`, `payment_intent.canceled` and `charge.refunded`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(rename = "type")]
    pub kind: String,
    /// Unix seconds.
    pub created: i64,
    pub data: EventData,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventData {
    pub object: serde_json::Value,
}

/// A page of `GET /v1/payment_intents/search`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchResult<Object> {
    pub data: Vec<Object>,
    #[serde(default)]
    pub has_more: bool,
}

/// Stripe's search query for the objects whose metadata `key` is `value` (neither may
/// hold a quote: stockd's keys and ids do not).
pub fn metadata_query(key: &str, value: &str) -> String {
    format!("metadata['{key}']:'{value}'")
}

/// `POST /v1/payment_intents` with `confirm=true`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatePaymentIntent {
    /// Minor units.
    pub amount: i64,
    /// ISO 4217, sent lowercase as Stripe expects.
    pub currency: String,
    pub payment_method: String,
    pub metadata: BTreeMap<String, String>,
}

/// Percent-encodes for `application/x-www-form-urlencoded`.
pub fn form_encode(pairs: &[(String, String)]) -> String {
    fn encode(text: &str) -> String {
        let mut encoded = String::with_capacity(text.len());
        for byte in text.bytes() {
            match byte {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    encoded.push(byte as char)
                }
                b' ' => encoded.push('+'),
                _ => encoded.push_str(&format!("%{byte:02X}")),
            }
        }
        encoded
    }
    pairs
        .iter()
        .map(|(key, value)| format!("{}={}", encode(key), encode(value)))
        .collect::<Vec<_>>()
        .join("&")
}

impl CreatePaymentIntent {
    pub fn form(&self) -> String {
        let mut pairs = vec![
            ("amount".to_owned(), self.amount.to_string()),
            ("currency".to_owned(), self.currency.to_ascii_lowercase()),
            ("payment_method".to_owned(), self.payment_method.clone()),
            ("confirm".to_owned(), "true".to_owned()),
            // Stripe (API 2023-08-16 on) refuses to confirm without a `return_url`
            // unless redirecting payment methods are excluded: stockd charges a saved
            // payment method server-side and has no page to send a shopper back to.
            // A card needing 3-D Secure still answers `requires_action`.
            (
                "automatic_payment_methods[enabled]".to_owned(),
                "true".to_owned(),
            ),
            (
                "automatic_payment_methods[allow_redirects]".to_owned(),
                "never".to_owned(),
            ),
        ];
        for (key, value) in &self.metadata {
            pairs.push((format!("metadata[{key}]"), value.clone()));
        }
        form_encode(&pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_requests_are_form_encoded_with_metadata_in_brackets() {
        let request = CreatePaymentIntent {
            amount: 599,
            currency: "CNY".into(),
            payment_method: "pm_card_visa".into(),
            metadata: BTreeMap::from([("order_id".into(), "ord_1".into())]),
        };
        assert_eq!(
            request.form(),
            "amount=599&currency=cny&payment_method=pm_card_visa&confirm=true&automatic_payment_methods%5Benabled%5D=true&automatic_payment_methods%5Ballow_redirects%5D=never&metadata%5Border_id%5D=ord_1"
        );
    }

    #[test]
    fn unknown_statuses_are_read_as_other() {
        let intent: PaymentIntent = serde_json::from_str(
            r#"{"id":"pi_1","amount":1,"currency":"cny","status":"requires_capture"}"#,
        )
        .unwrap();
        assert_eq!(intent.status, PaymentIntentStatus::Other);
    }
}

//! Webhook signatures: the header `Stripe-Signature: t=<unix seconds>,v1=<hex>` where
//! the hex is HMAC-SHA256 of `"<t>.<payload>"` under the endpoint's secret.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const HEADER: &str = "stripe-signature";

/// How far a signature's timestamp may be from now: older (or newer) deliveries are
/// refused, so a captured request cannot be replayed later.
pub const TOLERANCE_SECONDS: i64 = 300;

fn digest(secret: &str, timestamp: i64, payload: &[u8]) -> Vec<u8> {
    // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()).unwrap_or_else(|_| unreachable!());
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(payload);
    mac.finalize().into_bytes().to_vec()
}

/// The header value for `payload` signed at `timestamp`.
pub fn sign(secret: &str, timestamp: i64, payload: &[u8]) -> String {
    format!(
        "t={timestamp},v1={}",
        domain::lower_hex(&digest(secret, timestamp, payload))
    )
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignatureError {
    Missing,
    Malformed,
    /// The timestamp is outside the tolerance: too old (a replay) or from the future.
    Stale {
        age_seconds: i64,
    },
    Mismatch,
}

impl std::fmt::Display for SignatureError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SignatureError::Missing => {
                formatter.write_str("the Stripe-Signature header is missing")
            }
            SignatureError::Malformed => {
                formatter.write_str("the Stripe-Signature header is malformed")
            }
            SignatureError::Stale { age_seconds } => write!(
                formatter,
                "the signature is {age_seconds} s away from now; at most {TOLERANCE_SECONDS} s is accepted"
            ),
            SignatureError::Mismatch => {
                formatter.write_str("the signature does not match the payload")
            }
        }
    }
}

/// Checks `header` against `payload` at `now_seconds`. Any of several `v1` values may
/// match (the gateway sends several while a secret is being rolled).
pub fn verify(
    secret: &str,
    header: Option<&str>,
    payload: &[u8],
    now_seconds: i64,
) -> Result<(), SignatureError> {
    let header = header.ok_or(SignatureError::Missing)?;
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", value)) => timestamp = value.parse::<i64>().ok(),
            Some(("v1", value)) => signatures.push(value.to_owned()),
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(SignatureError::Malformed)?;
    if signatures.is_empty() {
        return Err(SignatureError::Malformed);
    }
    // Saturating: a hostile timestamp (i64::MIN) must not overflow into a panic.
    let age_seconds = now_seconds.saturating_sub(timestamp);
    if age_seconds.saturating_abs() > TOLERANCE_SECONDS {
        return Err(SignatureError::Stale { age_seconds });
    }
    let expected = domain::lower_hex(&digest(secret, timestamp, payload));
    let matches = signatures
        .iter()
        .any(|candidate| domain::constant_time_equal(candidate.as_bytes(), expected.as_bytes()));
    if matches {
        Ok(())
    } else {
        Err(SignatureError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_payload_verifies_within_the_tolerance() {
        let header = sign("whsec_test", 1_000, b"{}");
        assert_eq!(
            verify("whsec_test", Some(&header), b"{}", 1_000 + 299),
            Ok(())
        );
    }

    #[test]
    fn tampering_a_wrong_secret_and_old_timestamps_are_refused() {
        let header = sign("whsec_test", 1_000, b"{\"amount\":1}");
        assert_eq!(
            verify("whsec_test", Some(&header), b"{\"amount\":9}", 1_000),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify("whsec_other", Some(&header), b"{\"amount\":1}", 1_000),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify("whsec_test", Some(&header), b"{\"amount\":1}", 1_301),
            Err(SignatureError::Stale { age_seconds: 301 })
        );
        assert_eq!(
            verify("whsec_test", None, b"", 1_000),
            Err(SignatureError::Missing)
        );
        assert_eq!(
            verify("whsec_test", Some("v1=abc"), b"", 1_000),
            Err(SignatureError::Malformed)
        );
    }

    /// While a secret is rolled the gateway signs with both, and sends a `v1` for each:
    /// any one of them matching the secret this stockd has is enough.
    #[test]
    fn any_of_several_signatures_may_match_while_a_secret_is_rolled() {
        let payload = b"{\"amount\":1}";
        let old = sign("whsec_old", 1_000, payload);
        let new = sign("whsec_new", 1_000, payload);
        let old_value = old.split_once(",v1=").unwrap().1;
        let both = format!("{new},v1={old_value}");
        assert_eq!(verify("whsec_old", Some(&both), payload, 1_000), Ok(()));
        assert_eq!(verify("whsec_new", Some(&both), payload, 1_000), Ok(()));
        assert_eq!(
            verify("whsec_other", Some(&both), payload, 1_000),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn a_timestamp_at_the_ends_of_the_integers_is_stale_not_a_panic() {
        for timestamp in [i64::MIN, i64::MAX] {
            let header = format!("t={timestamp},v1=00");
            assert!(
                matches!(
                    verify("whsec_test", Some(&header), b"{}", 1_000),
                    Err(SignatureError::Stale { .. })
                ),
                "{header}"
            );
        }
    }
}

//! The gateway client. Every call is bounded by a timeout and carries the attempt's
//! idempotency key, so asking again — after a timeout, a lost response, a crash — is
//! the same call and can never charge twice.

use std::sync::Once;
use std::time::Duration;

use crate::protocol::{
    CreatePaymentIntent, ErrorBody, PaymentIntent, Refund, SearchResult, form_encode,
    metadata_query,
};

/// Largest gateway answer read. A PaymentIntent or an error is a few kilobytes; a
/// larger body (a misconfigured URL serving a file, a broken proxy) is not an answer,
/// and reading it whole would hold that much memory per call.
pub const GATEWAY_RESPONSE_BYTES_MAX: usize = 1024 * 1024;

#[derive(Clone)]
pub struct GatewayConfig {
    /// `https://api.stripe.com` or the sandbox's `http://127.0.0.1:port`.
    pub base_url: String,
    /// The secret API key (`sk_…`), sent as a bearer token.
    pub api_key: String,
    /// Longest wait for one answer; past it the outcome is unknown, not failed.
    pub timeout_milliseconds: u64,
}

/// The API key `stockd serve` sends when none is set: the sandbox's. A real gateway
/// refuses it (401 on every call).
pub const SANDBOX_API_KEY: &str = "sk_test_stockd";

impl GatewayConfig {
    /// Whether this reaches a gateway safely: an http(s) URL, and off this machine TLS
    /// and a key of the shop's own. Over plain HTTP the key and every payment would
    /// travel in clear text; with the sandbox's key a real gateway answers 401 to every
    /// call, which stockd must read as "unknown" (the key may be rotated back), so each
    /// shopper's payment would hold its stock until an operator noticed.
    /// Whether this is a sandbox on this machine (a `stockd gateway-sandbox`): a
    /// loopback URL with the sandbox's key. It accepts every card.
    pub fn is_a_sandbox_on_this_machine(&self) -> bool {
        self.api_key == SANDBOX_API_KEY
            && reqwest::Url::parse(&self.base_url)
                .is_ok_and(|url| url.host_str().is_some_and(domain::is_loopback_host))
    }

    pub fn check(&self) -> Result<(), String> {
        let url = reqwest::Url::parse(&self.base_url)
            .map_err(|error| format!("STOCKD_GATEWAY_URL is not a URL: {error}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(
                "STOCKD_GATEWAY_URL must start with https:// (or http:// on this machine)".into(),
            );
        }
        let host = url.host_str().unwrap_or("");
        if domain::is_loopback_host(host) {
            return Ok(());
        }
        if url.scheme() != "https" {
            return Err(format!(
                "STOCKD_GATEWAY_URL must be https:// for a gateway off this machine ({host}): the API key would travel in clear text"
            ));
        }
        if self.api_key.trim().is_empty() || self.api_key == SANDBOX_API_KEY {
            return Err(format!(
                "STOCKD_GATEWAY_API_KEY must be the gateway's own secret key for {host}, not empty or the sandbox's default"
            ));
        }
        Ok(())
    }
}

/// The key never reaches a log through `{:?}`.
impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("GatewayConfig")
            .field("base_url", &domain::redact_url(&self.base_url))
            .field("api_key", &"<redacted>")
            .field("timeout_milliseconds", &self.timeout_milliseconds)
            .finish()
    }
}

/// What one call found out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome<T> {
    /// The gateway answered; here is the object.
    Answered(T),
    /// The card was declined (HTTP 402); the PaymentIntent when the gateway sent it.
    Declined {
        reason: String,
        intent: Option<PaymentIntent>,
    },
    /// A definitive refusal: any other 4xx (Stripe's `invalid_request_error`, an
    /// unknown payment method, an amount it will not take, a charge already refunded).
    /// The request was not carried out; sending it again would be refused again.
    Refused {
        status: u16,
        code: Option<String>,
        reason: String,
    },
    /// No usable answer: timeout, broken connection, 5xx, 409 (the same key still in
    /// flight), 429 (too many requests). Money may or may not have moved.
    Unknown(String),
}

#[derive(Debug, Clone)]
pub struct GatewayClient {
    http: reqwest::Client,
    config: GatewayConfig,
}

static CRYPTO_PROVIDER: Once = Once::new();

/// Installs the process-wide TLS crypto provider once. reqwest is built without a
/// bundled provider (to keep one crypto stack), so every `reqwest::Client` in the
/// process — the gateway client's and the sandbox's webhook sender — needs this first.
pub fn install_crypto_provider() {
    CRYPTO_PROVIDER.call_once(|| {
        // Another part of the process may have installed one already: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl GatewayClient {
    pub fn new(config: GatewayConfig) -> Result<GatewayClient, String> {
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(config.timeout_milliseconds))
            .connect_timeout(Duration::from_millis(
                config.timeout_milliseconds.min(5_000),
            ))
            .pool_max_idle_per_host(32)
            .build()
            .map_err(|error| format!("cannot build the gateway client: {error}"))?;
        Ok(GatewayClient { http, config })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_url.trim_end_matches('/'))
    }

    async fn post_form(
        &self,
        path: &str,
        idempotency_key: &str,
        form: String,
    ) -> Result<(u16, String), String> {
        let response = self
            .http
            .post(self.url(path))
            .bearer_auth(&self.config.api_key)
            .header("Idempotency-Key", idempotency_key)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(form)
            .send()
            .await
            .map_err(|error| describe(&error))?;
        let status = response.status().as_u16();
        let body = read_body(response).await?;
        Ok((status, body))
    }

    /// Creates and confirms a PaymentIntent. The same `idempotency_key` returns the
    /// first call's result (or "still in flight"): safe to send again.
    pub async fn create_payment_intent(
        &self,
        idempotency_key: &str,
        request: &CreatePaymentIntent,
    ) -> CallOutcome<PaymentIntent> {
        let (status, body) = match self
            .post_form("/v1/payment_intents", idempotency_key, request.form())
            .await
        {
            Ok(answer) => answer,
            Err(error) => return CallOutcome::Unknown(error),
        };
        interpret(status, &body)
    }

    /// Refunds a PaymentIntent (in full when `amount` is its amount).
    pub async fn refund(
        &self,
        idempotency_key: &str,
        payment_intent: &str,
        amount: i64,
    ) -> CallOutcome<Refund> {
        let form = form_encode(&[
            ("payment_intent".to_owned(), payment_intent.to_owned()),
            ("amount".to_owned(), amount.to_string()),
        ]);
        match self.post_form("/v1/refunds", idempotency_key, form).await {
            Ok((status, body)) => interpret(status, &body),
            Err(error) => CallOutcome::Unknown(error),
        }
    }

    /// Cancels a PaymentIntent that has not succeeded: once the gateway answers it
    /// `canceled`, no customer action can complete it. One that succeeded (or was
    /// cancelled) already is refused (400 `payment_intent_unexpected_state`).
    pub async fn cancel_payment_intent(
        &self,
        idempotency_key: &str,
        id: &str,
    ) -> CallOutcome<PaymentIntent> {
        match self
            .post_form(
                &format!("/v1/payment_intents/{id}/cancel"),
                idempotency_key,
                String::new(),
            )
            .await
        {
            Ok((status, body)) => interpret(status, &body),
            Err(error) => CallOutcome::Unknown(error),
        }
    }

    pub async fn retrieve_payment_intent(&self, id: &str) -> CallOutcome<PaymentIntent> {
        self.retrieve(&format!("/v1/payment_intents/{id}")).await
    }

    /// The payment intents whose metadata `key` is `value`, by the gateway's search
    /// (Stripe's index follows a create within about a minute). One page: stockd asks
    /// about one attempt's intent, of which there is one at most.
    pub async fn search_payment_intents_by_metadata(
        &self,
        key: &str,
        value: &str,
    ) -> CallOutcome<SearchResult<PaymentIntent>> {
        let query = form_encode(&[("query".to_owned(), metadata_query(key, value))]);
        self.retrieve(&format!("/v1/payment_intents/search?{query}"))
            .await
    }

    /// Reads a refund as it is now: one answered `pending` is asked about this way
    /// (sending the refund again with its key would replay the first answer).
    pub async fn retrieve_refund(&self, id: &str) -> CallOutcome<Refund> {
        self.retrieve(&format!("/v1/refunds/{id}")).await
    }

    async fn retrieve<Object: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> CallOutcome<Object> {
        let response = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.config.api_key)
            .send()
            .await;
        match response {
            Ok(response) => {
                let status = response.status().as_u16();
                match read_body(response).await {
                    Ok(body) => interpret(status, &body),
                    Err(error) => CallOutcome::Unknown(error),
                }
            }
            Err(error) => CallOutcome::Unknown(describe(&error)),
        }
    }
}

/// The answer's body, up to [`GATEWAY_RESPONSE_BYTES_MAX`]: a longer one is refused
/// as soon as its declared length or the bytes read so far pass the limit.
async fn read_body(mut response: reqwest::Response) -> Result<String, String> {
    let too_large =
        || format!("the gateway's answer is larger than {GATEWAY_RESPONSE_BYTES_MAX} bytes");
    if response
        .content_length()
        .is_some_and(|length| length > GATEWAY_RESPONSE_BYTES_MAX as u64)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|error| describe(&error))? {
        if body.len() + chunk.len() > GATEWAY_RESPONSE_BYTES_MAX {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    String::from_utf8(body).map_err(|_| "the gateway's answer is not UTF-8".to_owned())
}

fn describe(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "the gateway did not answer in time".to_owned()
    } else if error.is_connect() {
        format!("cannot reach the gateway: {error}")
    } else {
        format!("the gateway's answer was lost: {error}")
    }
}

fn interpret<T: serde::de::DeserializeOwned>(status: u16, body: &str) -> CallOutcome<T> {
    match status {
        200..=299 => match serde_json::from_str(body) {
            Ok(object) => CallOutcome::Answered(object),
            Err(error) => CallOutcome::Unknown(format!("unreadable answer ({error})")),
        },
        402 => {
            let error: Option<ErrorBody> = serde_json::from_str(body).ok();
            let reason = error
                .as_ref()
                .and_then(|error| {
                    error
                        .error
                        .message
                        .clone()
                        .or_else(|| error.error.code.clone())
                })
                .unwrap_or_else(|| "declined".to_owned());
            CallOutcome::Declined {
                reason,
                intent: error.and_then(|error| error.error.payment_intent),
            }
        }
        // 409: the same key is still being processed; 429: slow down; 401/403: stockd's
        // own credentials were refused (a rotated or wrong API key); 408: the request
        // timed out on the way; 424: a dependency of the gateway failed (it may have
        // acted before). None says anything about the payment itself: asked again
        // later, once an operator fixed the key.
        400..=499 if !matches!(status, 401 | 403 | 408 | 409 | 424 | 429) => {
            let error = serde_json::from_str::<ErrorBody>(body).ok();
            // The key is taken by a request with other parameters (a later stockd that
            // builds the request differently, replaying a call whose answer was lost).
            // That first request may have charged the card: this says nothing about
            // the payment, so it is not a refusal of it.
            if let Some(error) = error
                .as_ref()
                .filter(|error| error.error.kind == "idempotency_error")
            {
                let message = error.error.message.as_deref().unwrap_or("");
                return CallOutcome::Unknown(format!(
                    "the gateway holds another request under this Idempotency-Key ({status}): {message}"
                ));
            }
            let code = error.as_ref().and_then(|error| error.error.code.clone());
            // A body that is not the gateway's error document (a proxy's page) is for
            // the log: the reason is stored with the attempt and shown to the shop.
            let message = error
                .and_then(|error| error.error.message)
                .unwrap_or_else(|| {
                    let page: String = body.chars().take(200).collect();
                    tracing::warn!(status, %page, "the gateway refused with an answer that is not its error document");
                    "no reason given".to_owned()
                });
            CallOutcome::Refused {
                status,
                reason: match &code {
                    Some(code) => format!("gateway refused ({status} {code}): {message}"),
                    None => format!("gateway refused ({status}): {message}"),
                },
                code,
            }
        }
        _ => {
            let message = serde_json::from_str::<ErrorBody>(body)
                .ok()
                .and_then(|error| error.error.message)
                .unwrap_or_else(|| body.chars().take(200).collect());
            CallOutcome::Unknown(format!("gateway answered {status}: {message}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::PaymentIntentStatus;

    #[test]
    fn a_gateway_config_never_prints_its_api_key() {
        let config = GatewayConfig {
            base_url: "https://api.stripe.com".into(),
            api_key: "sk_live_very_secret".into(),
            timeout_milliseconds: 5_000,
        };
        let printed = format!("{config:?}");
        assert!(!printed.contains("sk_live_very_secret"), "{printed}");
        let client = GatewayClient::new(config).unwrap();
        assert!(!format!("{client:?}").contains("sk_live_very_secret"));
    }

    /// Found in review: a refusal whose body was not the gateway's error document (a
    /// proxy's page) kept its first 200 characters as the reason, which is stored with
    /// the attempt and shown to the shop (the order, its events).
    #[test]
    fn a_refusal_that_is_not_the_gateways_error_document_keeps_none_of_its_words() {
        let page = "<html>internal-lb-7 trace 9f2c: upstream refused</html>";
        let CallOutcome::Refused { status, reason, .. } = interpret::<PaymentIntent>(400, page)
        else {
            panic!()
        };
        assert_eq!(status, 400);
        assert!(!reason.contains("internal-lb-7"), "{reason}");
        assert_eq!(reason, "gateway refused (400): no reason given");
    }

    /// Found in review: a 408 (the request timed out on the way) or a 424 (a dependency
    /// of the gateway failed) was a final refusal: the attempt failed, and the success
    /// webhook of a payment the gateway made all the same was ignored for good.
    #[test]
    fn a_timeout_or_a_failed_dependency_says_nothing_of_the_payment() {
        for status in [408, 424] {
            let outcome = interpret::<PaymentIntent>(status, r#"{"error":{"type":"api_error"}}"#);
            assert!(
                matches!(outcome, CallOutcome::Unknown(_)),
                "{status}: {outcome:?}"
            );
        }
    }

    #[test]
    fn a_decline_is_read_with_its_payment_intent() {
        let body = r#"{"error":{"type":"card_error","code":"card_declined","message":"Your card was declined.",
            "payment_intent":{"id":"pi_1","amount":5,"currency":"cny","status":"requires_payment_method"}}}"#;
        let CallOutcome::Declined { reason, intent } = interpret::<PaymentIntent>(402, body) else {
            panic!()
        };
        assert_eq!(reason, "Your card was declined.");
        assert_eq!(
            intent.unwrap().status,
            PaymentIntentStatus::RequiresPaymentMethod
        );
    }

    /// A one-connection HTTP server on loopback that answers any request with
    /// `answer_head` followed by `body_bytes` bytes of JSON whitespace.
    async fn gateway_answering(answer_head: &'static str, body_bytes: usize) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut connection, _) = listener.accept().await.unwrap();
            let mut request = vec![0_u8; 64 * 1024];
            let mut read = 0;
            while !request[..read]
                .windows(4)
                .any(|window| window == b"\r\n\r\n")
            {
                read += connection.read(&mut request[read..]).await.unwrap();
            }
            connection.write_all(answer_head.as_bytes()).await.unwrap();
            let chunk = vec![b' '; 64 * 1024];
            let mut written = 0;
            while written < body_bytes {
                let size = chunk.len().min(body_bytes - written);
                // The client may hang up once it has seen enough.
                if connection.write_all(&chunk[..size]).await.is_err() {
                    return;
                }
                written += size;
            }
        });
        format!("http://{address}")
    }

    /// An answer without Content-Length: its body runs until the connection closes.
    const UNTIL_CLOSE: &str =
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n";

    fn unknown_reason<T: std::fmt::Debug>(outcome: CallOutcome<T>) -> String {
        match outcome {
            CallOutcome::Unknown(reason) => reason,
            other => panic!("expected an unknown outcome, got {other:?}"),
        }
    }

    fn client(base_url: String) -> GatewayClient {
        GatewayClient::new(GatewayConfig {
            base_url,
            api_key: "sk_test".to_owned(),
            timeout_milliseconds: 30_000,
        })
        .unwrap()
    }

    #[tokio::test]
    async fn an_answer_declared_larger_than_the_limit_is_unknown_and_not_read() {
        let head =
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 3145728\r\n\r\n";
        let gateway = gateway_answering(head, 3 * 1024 * 1024).await;

        let outcome = client(gateway).retrieve_payment_intent("pi_1").await;

        let reason = unknown_reason(outcome);
        assert!(reason.contains("larger than"), "{reason}");
    }

    #[tokio::test]
    async fn an_answer_of_unannounced_length_is_cut_off_at_the_limit() {
        let gateway = gateway_answering(UNTIL_CLOSE, GATEWAY_RESPONSE_BYTES_MAX + 1).await;

        let outcome = client(gateway)
            .create_payment_intent(
                "key-1",
                &CreatePaymentIntent {
                    amount: 100,
                    currency: "cny".to_owned(),
                    payment_method: "pm_card_visa".to_owned(),
                    metadata: std::collections::BTreeMap::new(),
                },
            )
            .await;

        let reason = unknown_reason(outcome);
        assert!(reason.contains("larger than"), "{reason}");
    }

    #[tokio::test]
    async fn an_answer_within_the_limit_is_read_whole() {
        // Whitespace only: read in full, then found not to be a PaymentIntent.
        let gateway = gateway_answering(UNTIL_CLOSE, GATEWAY_RESPONSE_BYTES_MAX).await;

        let outcome = client(gateway).retrieve_payment_intent("pi_1").await;

        let reason = unknown_reason(outcome);
        assert!(reason.starts_with("unreadable answer"), "{reason}");
    }

    #[test]
    fn other_client_errors_are_definitive_refusals() {
        let missing = r#"{"error":{"type":"invalid_request_error","code":"resource_missing","param":"payment_method","message":"No such PaymentMethod: 'pm_x'"}}"#;
        let CallOutcome::Refused {
            status,
            code,
            reason,
        } = interpret::<PaymentIntent>(400, missing)
        else {
            panic!("a 400 is a refusal")
        };
        assert_eq!((status, code.as_deref()), (400, Some("resource_missing")));
        assert!(reason.contains("No such PaymentMethod"), "{reason}");
        for status in [400, 404, 422] {
            assert!(
                matches!(
                    interpret::<PaymentIntent>(status, "{}"),
                    CallOutcome::Refused { .. }
                ),
                "{status}"
            );
        }
    }

    #[test]
    fn server_errors_and_conflicts_are_unknown_not_failed() {
        for status in [401, 403, 429] {
            assert!(
                matches!(
                    interpret::<PaymentIntent>(status, "{}"),
                    CallOutcome::Unknown(_)
                ),
                "{status}: our credentials or our rate, not the payment"
            );
        }
        assert!(matches!(
            interpret::<PaymentIntent>(500, "oops"),
            CallOutcome::Unknown(_)
        ));
        let in_flight = r#"{"error":{"type":"idempotency_error","message":"still in flight"}}"#;
        assert!(matches!(
            interpret::<PaymentIntent>(409, in_flight),
            CallOutcome::Unknown(_)
        ));
    }

    fn config(base_url: &str, api_key: &str) -> GatewayConfig {
        GatewayConfig {
            base_url: base_url.into(),
            api_key: api_key.into(),
            timeout_milliseconds: 5_000,
        }
    }

    #[test]
    fn a_gateway_off_this_machine_needs_tls_and_a_key_of_its_own() {
        assert!(
            config("https://api.stripe.com", "sk_live_shop")
                .check()
                .is_ok()
        );
        for (url, key, named) in [
            ("http://api.stripe.com", "sk_live_shop", "https://"),
            (
                "https://api.stripe.com",
                SANDBOX_API_KEY,
                "STOCKD_GATEWAY_API_KEY",
            ),
            ("https://api.stripe.com", " ", "STOCKD_GATEWAY_API_KEY"),
            ("", "sk_live_shop", "not a URL"),
            ("ftp://api.stripe.com", "sk_live_shop", "https://"),
        ] {
            let refused = config(url, key).check().expect_err(url);
            assert!(refused.contains(named), "{url} {key}: {refused}");
        }
        // The sandbox on this machine: plain HTTP and its default key are fine.
        for url in [
            "http://127.0.0.1:8090",
            "http://localhost:8090",
            "http://[::1]:8090",
        ] {
            assert!(config(url, SANDBOX_API_KEY).check().is_ok(), "{url}");
        }
    }

    #[test]
    fn a_key_taken_by_other_parameters_is_unknown_because_the_first_request_may_have_charged() {
        let taken = r#"{"error":{"type":"idempotency_error","message":"this Idempotency-Key was used with different parameters"}}"#;
        assert!(matches!(
            interpret::<PaymentIntent>(400, taken),
            CallOutcome::Unknown(_)
        ));
        // Other refusals of the request itself stay refusals.
        let invalid = r#"{"error":{"type":"invalid_request_error","code":"parameter_missing","message":"amount"}}"#;
        assert!(matches!(
            interpret::<PaymentIntent>(400, invalid),
            CallOutcome::Refused { .. }
        ));
    }
}

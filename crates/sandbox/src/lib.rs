//! `stockd gateway-sandbox`: a payment gateway speaking the same subset of Stripe's
//! PaymentIntents API as stockd's client, with state (payment intents, refunds,
//! idempotency keys, charges counted) and faults chosen per request — by the test
//! payment method the client passes, as Stripe's test mode does with test cards — or
//! for every request by configuration. It signs and sends webhooks.
//!
//! | payment method | what the sandbox does |
//! | --- | --- |
//! | `pm_card_visa`, `pm_card_mastercard`, `pm_card_amex` | charges; answers; one `payment_intent.succeeded` webhook |
//! | `pm_card_chargeDeclined` | declines (402); one `payment_intent.payment_failed` webhook |
//! | `pm_sandbox_slow` | charges after `slow_milliseconds`, then answers |
//! | `pm_sandbox_charge_then_timeout` | charges and sends the webhook, then holds the answer for `hang_milliseconds` |
//! | `pm_sandbox_lost_response` | charges and sends the webhook, then breaks the connection |
//! | `pm_sandbox_no_webhook` | charges and answers; no webhook ever |
//! | `pm_sandbox_webhook_3x` | charges and answers; the same event delivered three times |
//! | `pm_sandbox_webhooks_out_of_order` | charges and answers; `succeeded`, then a stale `payment_failed` |
//! | `pm_sandbox_requires_action` | answers `requires_action` (no money moves) until `POST /_sandbox/payment_intents/{id}/complete_action` charges it and sends the webhook: a success that can arrive after the order's hold ended |
//! | any other | refuses as Stripe does a payment method it does not know: 400 `resource_missing`, no intent created |
//!
//! `POST /v1/payment_intents/{id}/cancel` cancels an intent that has not succeeded (a
//! customer action can then no longer complete it), as Stripe's does.
//! `POST /_sandbox/payment_intents/{id}/force_success` charges an intent whatever its
//! state: a gateway completing a payment it had confirmed cancelled, for the tests of
//! stockd's late-success path.
//!
//! A refund of a payment refunded already is refused as Stripe does: 400
//! `charge_already_refunded`. `GET /v1/refunds/{id}` reads a refund as it is now; the
//! sandbox can create refunds `pending`, `failed` or `canceled`
//! (`Sandbox::answer_next_refunds_with`) and later let the pending ones succeed
//! (`Sandbox::complete_pending_refunds`). A payment with `pm_card_refundFail` succeeds,
//! and every refund of it is created `failed`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gateway::protocol::{ErrorBody, ErrorDetail, Event, EventData, LastPaymentError};
use gateway::{PaymentIntent, PaymentIntentStatus, Refund};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Where the time for webhook signatures comes from (tests share stockd's clock).
pub type SecondsClock = Arc<dyn Fn() -> i64 + Send + Sync>;

#[derive(Clone)]
pub struct SandboxConfig {
    /// The stockd endpoint webhooks go to; none: events are only recorded.
    pub webhook_url: Option<String>,
    pub webhook_secret: String,
    /// When set, requests must carry `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    pub slow_milliseconds: u64,
    pub hang_milliseconds: u64,
    /// Applied to every create, whatever the payment method.
    pub fault: Option<Fault>,
    /// Deliveries of one webhook before giving up.
    pub webhook_attempts_max: u32,
    pub clock: SecondsClock,
}

pub fn system_seconds() -> SecondsClock {
    Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or(0)
    })
}

impl SandboxConfig {
    pub fn new(webhook_secret: impl Into<String>) -> SandboxConfig {
        SandboxConfig {
            webhook_url: None,
            webhook_secret: webhook_secret.into(),
            api_key: None,
            slow_milliseconds: 2_000,
            hang_milliseconds: 30_000,
            fault: None,
            webhook_attempts_max: 5,
            clock: system_seconds(),
        }
    }
}

/// A behaviour of the sandbox for one create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Succeed,
    Decline,
    Slow,
    ChargeThenTimeout,
    LostResponse,
    NoWebhook,
    WebhookThreeTimes,
    WebhooksOutOfOrder,
    RequiresAction,
    /// Charged; every refund of the charge is created `failed` (the bank sent the
    /// money back to the merchant), as Stripe's `pm_card_refundFail` ends.
    RefundFail,
}

impl Fault {
    /// The fault a test payment method chooses; `None` for a method the sandbox does
    /// not know (it refuses those).
    pub fn from_payment_method(method: &str) -> Option<Fault> {
        Some(match method {
            "pm_card_visa" | "pm_card_mastercard" | "pm_card_amex" => Fault::Succeed,
            "pm_card_chargeDeclined" => Fault::Decline,
            "pm_sandbox_slow" => Fault::Slow,
            "pm_sandbox_charge_then_timeout" => Fault::ChargeThenTimeout,
            "pm_sandbox_lost_response" => Fault::LostResponse,
            "pm_sandbox_no_webhook" => Fault::NoWebhook,
            "pm_sandbox_webhook_3x" => Fault::WebhookThreeTimes,
            "pm_sandbox_webhooks_out_of_order" => Fault::WebhooksOutOfOrder,
            "pm_sandbox_requires_action" => Fault::RequiresAction,
            "pm_card_refundFail" => Fault::RefundFail,
            _ => return None,
        })
    }

    pub fn parse(name: &str) -> Result<Fault, String> {
        Ok(match name {
            "succeed" => Fault::Succeed,
            "decline" => Fault::Decline,
            "slow" => Fault::Slow,
            "charge_then_timeout" => Fault::ChargeThenTimeout,
            "lost_response" => Fault::LostResponse,
            "no_webhook" => Fault::NoWebhook,
            "webhook_3x" => Fault::WebhookThreeTimes,
            "webhooks_out_of_order" => Fault::WebhooksOutOfOrder,
            "requires_action" => Fault::RequiresAction,
            "refund_fail" => Fault::RefundFail,
            other => return Err(format!("unknown fault '{other}'")),
        })
    }
}

/// How long an idempotency key's answer is kept, as Stripe keeps it (at least 24
/// hours): a request under a key older than this runs as a new one.
pub const KEY_LIFETIME_SECONDS: i64 = 24 * 3600;

/// A response kept under its idempotency key.
#[derive(Clone)]
enum Keyed {
    InFlight,
    Done {
        fingerprint: String,
        status: u16,
        body: String,
        /// When the answer was kept (the sandbox's clock, seconds).
        kept_at: i64,
    },
}

#[derive(Default)]
struct Books {
    intents: HashMap<String, PaymentIntent>,
    keys: HashMap<String, Keyed>,
    refunds: HashMap<String, Refund>,
    /// Refund calls still to answer with a server error (`fail_next_refunds`).
    refund_failures_left: u32,
    /// Refund calls answered with such an error so far.
    refunds_failed: u64,
    /// The status the next refunds are created with instead of `succeeded`
    /// (`answer_next_refunds_with`), and how many are left.
    refund_status_next: Option<(String, u32)>,
    /// Intents charged with `pm_card_refundFail`: their refunds are created `failed`.
    refunds_fail_for: std::collections::HashSet<String>,
    charges: u64,
    events_sent: u64,
    deliveries_acknowledged: u64,
    next: u64,
}

#[derive(Clone)]
pub struct Sandbox {
    config: Arc<Mutex<SandboxConfig>>,
    books: Arc<Mutex<Books>>,
    http: reqwest::Client,
    /// Drawn when the sandbox starts and written into every id it mints: the books
    /// live in memory, so an id without it was minted by another sandbox (an earlier
    /// process's), whose books are gone.
    books_id: u32,
}

/// What tests and operators can read back.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub charges: u64,
    pub refunds: u64,
    /// Refund calls answered 500 by `fail_next_refunds`.
    pub refunds_failed: u64,
    pub events_sent: u64,
    /// Deliveries the webhook endpoint answered with a 2xx.
    pub deliveries_acknowledged: u64,
    pub intents: Vec<PaymentIntent>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn error_response(
    status: StatusCode,
    kind: &str,
    message: &str,
    intent: Option<PaymentIntent>,
) -> (u16, String) {
    coded_error_response(status, kind, None, message, intent)
}

/// [`error_response`] without an intent, as the response to send.
fn error_reply(status: StatusCode, kind: &str, message: &str) -> Response {
    let (status, body) = error_response(status, kind, message, None);
    json_response(status, body)
}

/// [`error_response`] with Stripe's machine-readable `code`.
fn coded_error_response(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    message: &str,
    intent: Option<PaymentIntent>,
) -> (u16, String) {
    let body = ErrorBody {
        error: ErrorDetail {
            kind: kind.to_owned(),
            code: code.map(str::to_owned),
            message: Some(message.to_owned()),
            payment_intent: intent,
        },
    };
    (
        status.as_u16(),
        serde_json::to_string(&body).unwrap_or_default(),
    )
}

fn json_response(status: u16, body: String) -> Response {
    let mut response =
        (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// A response whose body fails after the headers: the client sees the connection
/// break without an answer.
fn broken_response() -> Response {
    let failing = futures_util::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("the sandbox dropped the response"))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(failing))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `metadata['key']:'value'` as (key, value).
fn metadata_query_parts(query: &str) -> Option<(&str, &str)> {
    let rest = query.trim().strip_prefix("metadata['")?;
    let (key, rest) = rest.split_once("']:'")?;
    let value = rest.strip_suffix('\'')?;
    Some((key, value))
}

fn parse_form(body: &[u8]) -> BTreeMap<String, String> {
    fn decode(text: &str) -> String {
        let bytes = text.as_bytes();
        let mut decoded = Vec::with_capacity(bytes.len());
        let mut index = 0;
        while index < bytes.len() {
            match bytes[index] {
                b'+' => decoded.push(b' '),
                b'%' if index + 2 < bytes.len() => {
                    let hex = std::str::from_utf8(&bytes[index + 1..index + 3]).unwrap_or("");
                    match u8::from_str_radix(hex, 16) {
                        Ok(byte) => {
                            decoded.push(byte);
                            index += 2;
                        }
                        Err(_) => decoded.push(b'%'),
                    }
                }
                byte => decoded.push(byte),
            }
            index += 1;
        }
        String::from_utf8_lossy(&decoded).into_owned()
    }
    String::from_utf8_lossy(body)
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(key, value)| (decode(key), decode(value)))
        .collect()
}

impl Sandbox {
    pub fn new(config: SandboxConfig) -> Sandbox {
        gateway::install_crypto_provider();
        Sandbox {
            config: Arc::new(Mutex::new(config)),
            books: Arc::new(Mutex::new(Books::default())),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("a plain HTTP client always builds once the crypto provider is installed"),
            books_id: rand::random(),
        }
    }

    /// How every id this sandbox mints of `kind` (`pi` for payment intents) begins:
    /// one that does not begin so was minted by another sandbox.
    pub fn id_prefix(&self, kind: &str) -> String {
        format!("{kind}_{:08x}", self.books_id)
    }

    /// Points webhooks at stockd once its address is known.
    pub fn set_webhook_url(&self, url: impl Into<String>) {
        lock(&self.config).webhook_url = Some(url.into());
    }

    /// From now on events are recorded but not sent: a webhook endpoint that is down,
    /// misconfigured, or behind a firewall.
    pub fn stop_webhooks(&self) {
        lock(&self.config).webhook_url = None;
    }

    /// Answers the next `failures` refund calls with a 500 `api_error` (an outage of
    /// the gateway's refund service), then refunds again: the compensation-failure
    /// drill.
    pub fn fail_next_refunds(&self, failures: u32) {
        lock(&self.books).refund_failures_left = failures;
    }

    /// Creates the next `count` refunds with `status` (`pending`, `failed`,
    /// `canceled`, as a real gateway may answer: the bank refused the refund, or it
    /// is still on its way) instead of `succeeded`.
    pub fn answer_next_refunds_with(&self, status: &str, count: u32) {
        lock(&self.books).refund_status_next = Some((status.to_owned(), count));
    }

    /// Forgets every refund, as a gateway account switched under stockd would: a read
    /// of one answers 404.
    pub fn forget_refunds(&self) {
        lock(&self.books).refunds.clear();
    }

    /// The bank answered: every `pending` refund is `succeeded` now (read it with
    /// `GET /v1/refunds/{id}`). Answers how many moved.
    pub fn complete_pending_refunds(&self) -> usize {
        let mut books = lock(&self.books);
        let mut moved = 0;
        for refund in books.refunds.values_mut() {
            if refund.status == "pending" {
                refund.status = "succeeded".to_owned();
                moved += 1;
            }
        }
        moved
    }

    pub fn stats(&self) -> Stats {
        let books = lock(&self.books);
        let mut intents: Vec<PaymentIntent> = books.intents.values().cloned().collect();
        intents.sort_by(|left, right| left.id.cmp(&right.id));
        Stats {
            charges: books.charges,
            refunds: books.refunds.len() as u64,
            refunds_failed: books.refunds_failed,
            events_sent: books.events_sent,
            deliveries_acknowledged: books.deliveries_acknowledged,
            intents,
        }
    }

    fn mint(&self, prefix: &str) -> String {
        let mut books = lock(&self.books);
        books.next += 1;
        format!(
            "{}{:08}{:08x}",
            self.id_prefix(prefix),
            books.next,
            rand::random::<u32>()
        )
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(expected) = lock(&self.config).api_key.clone() else {
            return true;
        };
        headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .is_some_and(|presented| {
                domain::constant_time_equal(presented.as_bytes(), expected.as_bytes())
            })
    }

    /// The 401 for a request without the configured API key. Every endpoint asks for
    /// it, the reads and the `/_sandbox` controls too: a staging sandbox lists intents
    /// and can force one to succeed, which sends a signed `succeeded` webhook.
    fn unauthorized(&self, headers: &HeaderMap) -> Option<Response> {
        if self.authorized(headers) {
            return None;
        }
        Some(error_reply(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "bad API key",
        ))
    }

    /// Starts a keyed request: `Err` with the answer when the key was used before.
    fn enter_key(&self, key: Option<&str>, fingerprint: &str) -> Result<(), (u16, String)> {
        let Some(key) = key else { return Ok(()) };
        let now = (lock(&self.config).clock)();
        let mut books = lock(&self.books);
        if let Some(Keyed::Done { kept_at, .. }) = books.keys.get(key)
            && now >= kept_at.saturating_add(KEY_LIFETIME_SECONDS)
        {
            books.keys.remove(key);
        }
        match books.keys.get(key) {
            None => {
                books.keys.insert(key.to_owned(), Keyed::InFlight);
                Ok(())
            }
            Some(Keyed::InFlight) => Err(error_response(
                StatusCode::CONFLICT,
                "idempotency_error",
                "a request with this Idempotency-Key is still being processed",
                None,
            )),
            Some(Keyed::Done {
                fingerprint: first,
                status,
                body,
                ..
            }) => {
                if first == fingerprint {
                    Err((*status, body.clone()))
                } else {
                    Err(error_response(
                        StatusCode::BAD_REQUEST,
                        "idempotency_error",
                        "this Idempotency-Key was used with different parameters",
                        None,
                    ))
                }
            }
        }
    }

    fn finish_key(&self, key: Option<&str>, fingerprint: &str, answer: &(u16, String)) {
        if let Some(key) = key {
            let kept_at = (lock(&self.config).clock)();
            lock(&self.books).keys.insert(
                key.to_owned(),
                Keyed::Done {
                    fingerprint: fingerprint.to_owned(),
                    status: answer.0,
                    body: answer.1.clone(),
                    kept_at,
                },
            );
        }
    }

    /// Signs and sends an event, retrying a bounded number of times.
    fn send_event(
        &self,
        kind: &str,
        object: serde_json::Value,
        created_offset_seconds: i64,
        deliveries: u32,
    ) {
        let config = lock(&self.config).clone();
        let Some(url) = config.webhook_url.clone() else {
            return;
        };
        let event = Event {
            id: self.mint("evt"),
            object: "event".into(),
            kind: kind.to_owned(),
            created: (config.clock)() + created_offset_seconds,
            data: EventData { object },
        };
        let payload = serde_json::to_vec(&event).unwrap_or_default();
        let sandbox = self.clone();
        lock(&self.books).events_sent += u64::from(deliveries);
        tokio::spawn(async move {
            for _ in 0..deliveries {
                for attempt in 0..config.webhook_attempts_max.max(1) {
                    let signature = gateway::signature::sign(
                        &config.webhook_secret,
                        (config.clock)(),
                        &payload,
                    );
                    let delivered = sandbox
                        .http
                        .post(&url)
                        .header(gateway::signature::HEADER, signature)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(payload.clone())
                        .send()
                        .await
                        .is_ok_and(|response| response.status().is_success());
                    if delivered {
                        lock(&sandbox.books).deliveries_acknowledged += 1;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100 << attempt.min(6))).await;
                }
            }
        });
    }

    fn charge(&self, intent: &mut PaymentIntent) {
        intent.status = PaymentIntentStatus::Succeeded;
        intent.latest_charge = Some(self.mint("ch"));
        lock(&self.books).charges += 1;
    }

    async fn create_payment_intent(&self, headers: &HeaderMap, body: &[u8]) -> Response {
        if let Some(refusal) = self.unauthorized(headers) {
            return refusal;
        }
        let key = headers
            .get("idempotency-key")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let fingerprint = String::from_utf8_lossy(body).into_owned();
        if let Err((status, body)) = self.enter_key(key.as_deref(), &fingerprint) {
            return json_response(status, body);
        }
        let form = parse_form(body);
        let amount = form
            .get("amount")
            .and_then(|amount| amount.parse::<i64>().ok())
            .filter(|amount| *amount >= 0);
        let Some(amount) = amount else {
            let answer = error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "amount is required",
                None,
            );
            self.finish_key(key.as_deref(), &fingerprint, &answer);
            return json_response(answer.0, answer.1);
        };
        // Stripe's rule since API 2023-08-16: a confirmation that could redirect the
        // shopper needs a `return_url`, unless redirecting methods are excluded or the
        // shopper is away (`off_session`). Without it no payment is made at all.
        let confirms = form.get("confirm").is_some_and(|value| value == "true");
        let redirects_excluded = form
            .get("automatic_payment_methods[allow_redirects]")
            .is_some_and(|value| value == "never");
        let off_session = form.get("off_session").is_some_and(|value| value == "true");
        if confirms && !redirects_excluded && !off_session && !form.contains_key("return_url") {
            let answer = error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "a confirmation that may redirect needs return_url, \
                 or automatic_payment_methods[allow_redirects]=never",
                None,
            );
            self.finish_key(key.as_deref(), &fingerprint, &answer);
            return json_response(answer.0, answer.1);
        }
        let payment_method = form.get("payment_method").cloned().unwrap_or_default();
        let Some(chosen) = Fault::from_payment_method(&payment_method) else {
            let answer = coded_error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("resource_missing"),
                &format!("No such PaymentMethod: '{payment_method}' (param: payment_method)"),
                None,
            );
            self.finish_key(key.as_deref(), &fingerprint, &answer);
            return json_response(answer.0, answer.1);
        };
        let configured = lock(&self.config).fault;
        let fault = configured.unwrap_or(chosen);
        let metadata: BTreeMap<String, String> = form
            .iter()
            .filter_map(|(name, value)| {
                name.strip_prefix("metadata[")
                    .and_then(|rest| rest.strip_suffix(']'))
                    .map(|name| (name.to_owned(), value.clone()))
            })
            .collect();
        let mut intent = PaymentIntent {
            id: self.mint("pi"),
            object: "payment_intent".into(),
            amount,
            currency: form.get("currency").cloned().unwrap_or_default(),
            status: PaymentIntentStatus::Processing,
            metadata,
            latest_charge: None,
            last_payment_error: None,
        };
        if fault == Fault::Slow {
            let delay = lock(&self.config).slow_milliseconds;
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let answer = match fault {
            Fault::Decline => {
                intent.status = PaymentIntentStatus::RequiresPaymentMethod;
                intent.last_payment_error = Some(LastPaymentError {
                    code: Some("card_declined".into()),
                    message: Some("Your card was declined.".into()),
                });
                self.send_event(
                    "payment_intent.payment_failed",
                    serde_json::to_value(&intent).unwrap_or_default(),
                    0,
                    1,
                );
                error_response(
                    StatusCode::PAYMENT_REQUIRED,
                    "card_error",
                    "Your card was declined.",
                    Some(intent.clone()),
                )
            }
            Fault::RequiresAction => {
                intent.status = PaymentIntentStatus::RequiresAction;
                (200, serde_json::to_string(&intent).unwrap_or_default())
            }
            _ => {
                self.charge(&mut intent);
                let object = serde_json::to_value(&intent).unwrap_or_default();
                match fault {
                    Fault::NoWebhook => {}
                    Fault::WebhookThreeTimes => {
                        self.send_event("payment_intent.succeeded", object, 0, 3)
                    }
                    Fault::WebhooksOutOfOrder => {
                        self.send_event("payment_intent.succeeded", object, 0, 1);
                        let mut stale = intent.clone();
                        stale.status = PaymentIntentStatus::RequiresPaymentMethod;
                        stale.last_payment_error = Some(LastPaymentError {
                            code: Some("card_declined".into()),
                            message: Some("an earlier try".into()),
                        });
                        let sandbox = self.clone();
                        let stale = serde_json::to_value(&stale).unwrap_or_default();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            sandbox.send_event("payment_intent.payment_failed", stale, -60, 1);
                        });
                    }
                    _ => self.send_event("payment_intent.succeeded", object, 0, 1),
                }
                (200, serde_json::to_string(&intent).unwrap_or_default())
            }
        };
        {
            let mut books = lock(&self.books);
            if fault == Fault::RefundFail {
                books.refunds_fail_for.insert(intent.id.clone());
            }
            books.intents.insert(intent.id.clone(), intent);
        }
        self.finish_key(key.as_deref(), &fingerprint, &answer);
        match fault {
            Fault::ChargeThenTimeout => {
                let hang = lock(&self.config).hang_milliseconds;
                tokio::time::sleep(Duration::from_millis(hang)).await;
                json_response(answer.0, answer.1)
            }
            Fault::LostResponse => broken_response(),
            _ => json_response(answer.0, answer.1),
        }
    }

    async fn refund(&self, headers: &HeaderMap, body: &[u8]) -> Response {
        if let Some(refusal) = self.unauthorized(headers) {
            return refusal;
        }
        {
            // An outage answers before the idempotency key is recorded, as a gateway
            // whose refund service is down would: the retry with the key runs anew.
            let mut books = lock(&self.books);
            if books.refund_failures_left > 0 {
                books.refund_failures_left -= 1;
                books.refunds_failed += 1;
                drop(books);
                return error_reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "api_error",
                    "the refund service is unavailable",
                );
            }
        }
        let key = headers
            .get("idempotency-key")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let fingerprint = String::from_utf8_lossy(body).into_owned();
        if let Err((status, body)) = self.enter_key(key.as_deref(), &fingerprint) {
            return json_response(status, body);
        }
        let form = parse_form(body);
        let intent_id = form.get("payment_intent").cloned().unwrap_or_default();
        // A refund that failed or was canceled gave nothing back: the charge may be
        // refunded again, as at Stripe.
        let (intent, refunded_already) = {
            let books = lock(&self.books);
            (
                books.intents.get(&intent_id).cloned(),
                books.refunds.values().any(|refund| {
                    refund.payment_intent == intent_id
                        && !matches!(refund.status.as_str(), "failed" | "canceled")
                }),
            )
        };
        let answer = match intent {
            Some(intent) if refunded_already => coded_error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("charge_already_refunded"),
                &format!(
                    "Charge {} has already been refunded.",
                    intent.latest_charge.as_deref().unwrap_or_default()
                ),
                None,
            ),
            Some(intent) if intent.status == PaymentIntentStatus::Succeeded => {
                let amount = form
                    .get("amount")
                    .and_then(|amount| amount.parse().ok())
                    .unwrap_or(intent.amount);
                let status = {
                    let mut books = lock(&self.books);
                    let fails = books.refunds_fail_for.contains(&intent.id);
                    match &mut books.refund_status_next {
                        Some((status, left)) if *left > 0 => {
                            *left -= 1;
                            status.clone()
                        }
                        _ if fails => "failed".to_owned(),
                        _ => "succeeded".to_owned(),
                    }
                };
                let refund = Refund {
                    id: self.mint("re"),
                    object: "refund".into(),
                    amount,
                    currency: intent.currency.clone(),
                    payment_intent: intent.id.clone(),
                    status,
                };
                lock(&self.books)
                    .refunds
                    .insert(refund.id.clone(), refund.clone());
                self.send_event(
                    "charge.refunded",
                    serde_json::to_value(&intent).unwrap_or_default(),
                    0,
                    1,
                );
                (200, serde_json::to_string(&refund).unwrap_or_default())
            }
            _ => error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "no succeeded payment to refund",
                None,
            ),
        };
        self.finish_key(key.as_deref(), &fingerprint, &answer);
        json_response(answer.0, answer.1)
    }

    /// `POST /v1/payment_intents/{id}/cancel`, as Stripe's: an intent that has not
    /// succeeded (waiting for an action or a payment method) is cancelled for good, and
    /// a customer action can no longer complete it; a succeeded or cancelled one is
    /// refused with 400 `payment_intent_unexpected_state`.
    fn cancel_payment_intent(&self, headers: &HeaderMap, id: &str) -> Response {
        if let Some(refusal) = self.unauthorized(headers) {
            return refusal;
        }
        let mut books = lock(&self.books);
        let Some(intent) = books.intents.get_mut(id) else {
            let (status, body) = coded_error_response(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("resource_missing"),
                &format!("No such payment_intent: '{id}'"),
                None,
            );
            return json_response(status, body);
        };
        match intent.status {
            PaymentIntentStatus::Succeeded | PaymentIntentStatus::Canceled => {
                let (status, body) = coded_error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    Some("payment_intent_unexpected_state"),
                    "This PaymentIntent's status does not allow it to be canceled.",
                    Some(intent.clone()),
                );
                json_response(status, body)
            }
            _ => {
                intent.status = PaymentIntentStatus::Canceled;
                json_response(200, serde_json::to_string(&*intent).unwrap_or_default())
            }
        }
    }

    /// `GET /v1/payment_intents/search?query=metadata['key']:'value'`: the one form of
    /// Stripe's search query stockd sends; any other is refused with 400.
    fn search_payment_intents(&self, query: Option<&str>) -> Response {
        let Some((key, value)) = query.and_then(metadata_query_parts) else {
            return error_reply(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "the sandbox searches by one metadata field: query=metadata['key']:'value'",
            );
        };
        let data: Vec<PaymentIntent> = lock(&self.books)
            .intents
            .values()
            .filter(|intent| intent.metadata.get(key).map(String::as_str) == Some(value))
            .cloned()
            .collect();
        let body = serde_json::json!({
            "object": "search_result",
            "url": "/v1/payment_intents/search",
            "has_more": false,
            "data": data,
        });
        json_response(200, body.to_string())
    }

    /// `POST /_sandbox/payment_intents/{id}/force_success`: charges an intent whatever
    /// its state and sends the `succeeded` webhook — a gateway completing a payment
    /// after it confirmed the cancellation (a confirmation racing the cancel). Real
    /// gateways should never do it; stockd's late-success path exists for when one
    /// does, and this is how the tests drive it.
    fn force_success(&self, id: &str) -> Response {
        let Some(intent) = lock(&self.books).intents.get(id).cloned() else {
            return (StatusCode::NOT_FOUND, "no such payment intent").into_response();
        };
        if intent.status == PaymentIntentStatus::Succeeded {
            return (StatusCode::CONFLICT, "the payment intent succeeded already").into_response();
        }
        self.charge_now(intent)
    }

    /// Charges a held intent now, keeps it and sends its `succeeded` webhook.
    fn charge_now(&self, mut intent: PaymentIntent) -> Response {
        self.charge(&mut intent);
        lock(&self.books)
            .intents
            .insert(intent.id.clone(), intent.clone());
        self.send_event(
            "payment_intent.succeeded",
            serde_json::to_value(&intent).unwrap_or_default(),
            0,
            1,
        );
        json_response(200, serde_json::to_string(&intent).unwrap_or_default())
    }

    fn complete_action(&self, id: &str) -> Response {
        let intent = match lock(&self.books).intents.get(id).cloned() {
            Some(intent) if intent.status == PaymentIntentStatus::RequiresAction => intent,
            Some(_) => {
                return (StatusCode::CONFLICT, "the payment intent needs no action")
                    .into_response();
            }
            None => return (StatusCode::NOT_FOUND, "no such payment intent").into_response(),
        };
        self.charge_now(intent)
    }

    pub fn router(&self) -> Router {
        Router::new()
            .route(
                "/v1/payment_intents",
                post(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, body: Bytes| async move {
                        sandbox.create_payment_intent(&headers, &body).await
                    },
                ),
            )
            .route(
                "/v1/payment_intents/search",
                get(
                    |State(sandbox): State<Sandbox>,
                     headers: HeaderMap,
                     Query(parameters): Query<HashMap<String, String>>| async move {
                        match sandbox.unauthorized(&headers) {
                            Some(refusal) => refusal,
                            None => sandbox
                                .search_payment_intents(parameters.get("query").map(String::as_str)),
                        }
                    },
                ),
            )
            .route(
                "/v1/payment_intents/{id}",
                get(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, Path(id): Path<String>| async move {
                        if let Some(refusal) = sandbox.unauthorized(&headers) {
                            return refusal;
                        }
                        match lock(&sandbox.books).intents.get(&id) {
                            Some(intent) => json_response(
                                200,
                                serde_json::to_string(intent).unwrap_or_default(),
                            ),
                            None => error_reply(
                                StatusCode::NOT_FOUND,
                                "invalid_request_error",
                                "no such payment intent",
                            ),
                        }
                    },
                ),
            )
            .route(
                "/v1/payment_intents/{id}/cancel",
                post(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, Path(id): Path<String>| async move {
                        sandbox.cancel_payment_intent(&headers, &id)
                    },
                ),
            )
            .route(
                "/v1/refunds",
                post(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, body: Bytes| async move {
                        sandbox.refund(&headers, &body).await
                    },
                ),
            )
            .route(
                "/v1/refunds/{id}",
                get(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, Path(id): Path<String>| async move {
                        if let Some(refusal) = sandbox.unauthorized(&headers) {
                            return refusal;
                        }
                        match lock(&sandbox.books).refunds.get(&id) {
                            Some(refund) => json_response(
                                200,
                                serde_json::to_string(refund).unwrap_or_default(),
                            ),
                            None => error_reply(
                                StatusCode::NOT_FOUND,
                                "invalid_request_error",
                                "no such refund",
                            ),
                        }
                    },
                ),
            )
            .route(
                "/_sandbox/stats",
                get(
                    |State(sandbox): State<Sandbox>,
                     headers: HeaderMap,
                     Query(filter): Query<HashMap<String, String>>| async move {
                        if let Some(refusal) = sandbox.unauthorized(&headers) {
                            return refusal;
                        }
                        let mut stats = sandbox.stats();
                        if let Some(order) = filter.get("order_id") {
                            stats
                                .intents
                                .retain(|intent| intent.metadata.get("order_id") == Some(order));
                        }
                        json_response(200, serde_json::to_string(&stats).unwrap_or_default())
                    },
                ),
            )
            .route(
                "/_sandbox/payment_intents/{id}/complete_action",
                post(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, Path(id): Path<String>| async move {
                        match sandbox.unauthorized(&headers) {
                            Some(refusal) => refusal,
                            None => sandbox.complete_action(&id),
                        }
                    },
                ),
            )
            .route(
                "/_sandbox/payment_intents/{id}/force_success",
                post(
                    |State(sandbox): State<Sandbox>, headers: HeaderMap, Path(id): Path<String>| async move {
                        match sandbox.unauthorized(&headers) {
                            Some(refusal) => refusal,
                            None => sandbox.force_success(&id),
                        }
                    },
                ),
            )
            .with_state(self.clone())
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        axum::serve(listener, self.router())
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_query_stockd_sends_is_the_one_the_sandbox_reads() {
        let query = gateway::protocol::metadata_query("attempt_id", "pay_1");
        assert_eq!(metadata_query_parts(&query), Some(("attempt_id", "pay_1")));
        assert_eq!(metadata_query_parts("status:'succeeded'"), None);
    }

    #[test]
    fn forms_decode_brackets_pluses_and_percent_escapes() {
        let form = parse_form(b"amount=5&metadata%5Border_id%5D=ord_1&note=a+b%21");
        assert_eq!(form.get("amount").map(String::as_str), Some("5"));
        assert_eq!(
            form.get("metadata[order_id]").map(String::as_str),
            Some("ord_1")
        );
        assert_eq!(form.get("note").map(String::as_str), Some("a b!"));
    }

    #[test]
    fn test_payment_methods_choose_the_fault() {
        assert_eq!(
            Fault::from_payment_method("pm_card_visa"),
            Some(Fault::Succeed)
        );
        assert_eq!(Fault::from_payment_method("pm_card_doesNotExist"), None);
        assert_eq!(
            Fault::from_payment_method("pm_card_refundFail"),
            Some(Fault::RefundFail)
        );
        assert_eq!(Fault::parse("refund_fail"), Ok(Fault::RefundFail));
        assert_eq!(
            Fault::from_payment_method("pm_card_chargeDeclined"),
            Some(Fault::Decline)
        );
        assert_eq!(
            Fault::from_payment_method("pm_sandbox_lost_response"),
            Some(Fault::LostResponse)
        );
        assert_eq!(Fault::parse("webhook_3x"), Ok(Fault::WebhookThreeTimes));
        assert!(Fault::parse("explode").is_err());
    }
}

//! The payment side of the harness: the project's gateway sandbox served over real HTTP
//! on a loopback port, stockd's router served on another so the sandbox's signed
//! webhooks arrive the way they would in production, and the engine's gateway client
//! pointed at the sandbox. The sandbox reads the test's manual clock, so signatures and
//! event times move with it.

use std::sync::Arc;

use engine::Clock;
use sandbox::{Sandbox, SandboxConfig};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::{Call, TestApp, TestResponse};

pub const WEBHOOK_SECRET: &str = "whsec_stockd_test_secret";
pub const GATEWAY_API_KEY: &str = "sk_test_stockd";
/// How long the gateway client waits for an answer. A faulty sandbox answer that
/// hangs waits far longer ([`HANG_MILLISECONDS`]), so "no answer" never depends on a race.
pub const GATEWAY_TIMEOUT_MILLISECONDS: u64 = 1_000;
pub const HANG_MILLISECONDS: u64 = 60_000;

/// A sandbox gateway wired to one or more test instances. Dropping it stops serving.
pub struct TestGateway {
    pub sandbox: Sandbox,
    pub url: String,
    shutdown: CancellationToken,
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn loopback_listener() -> tokio::net::TcpListener {
    tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port")
}

impl TestGateway {
    /// Starts a sandbox, serves `app` over HTTP for its webhooks, and attaches the
    /// gateway to `app`'s engine.
    pub async fn start(app: &TestApp) -> TestGateway {
        TestGateway::start_as(app, true).await
    }

    /// [`TestGateway::start`], attached as if the sandbox were a real gateway: its own
    /// fault methods (`pm_sandbox_…`) are then refused by stockd.
    pub async fn start_as_real_gateway(app: &TestApp) -> TestGateway {
        TestGateway::start_as(app, false).await
    }

    /// [`TestGateway::start`], attached as `stockd serve` attaches the sandbox it runs
    /// itself: a payment it cannot find whose id lacks its mark was an earlier
    /// process's sandbox's.
    pub async fn start_as_own_sandbox(app: &TestApp) -> TestGateway {
        let gateway = TestGateway::start_unattached(app).await;
        let mut payments = payments_at(&gateway.url, GATEWAY_TIMEOUT_MILLISECONDS, true);
        payments.own_sandbox_payments = Some(gateway.sandbox.id_prefix("pi"));
        app.engine.attach_payments(payments);
        gateway
    }

    async fn start_as(app: &TestApp, sandbox_methods_allowed: bool) -> TestGateway {
        let gateway = TestGateway::start_unattached(app).await;
        gateway.attach_as(app, sandbox_methods_allowed);
        gateway
    }

    async fn start_unattached(app: &TestApp) -> TestGateway {
        let shutdown = CancellationToken::new();
        let clock = app.clock.clone();
        let mut config = SandboxConfig::new(WEBHOOK_SECRET);
        config.api_key = Some(GATEWAY_API_KEY.to_owned());
        config.hang_milliseconds = HANG_MILLISECONDS;
        config.slow_milliseconds = 100;
        config.clock = Arc::new(move || clock.now().unix_milliseconds().div_euclid(1000));
        let sandbox = Sandbox::new(config);
        let listener = loopback_listener().await;
        let url = format!("http://{}", listener.local_addr().expect("sandbox address"));
        let serving = sandbox.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move { serving.serve(listener, stop).await });
        let gateway = TestGateway {
            sandbox,
            url,
            shutdown,
        };
        gateway.serve_webhooks_to(app).await;
        gateway
    }

    /// Serves `app` on a loopback port and points the sandbox's webhooks at it.
    pub async fn serve_webhooks_to(&self, app: &TestApp) {
        let listener = loopback_listener().await;
        let address = listener.local_addr().expect("stockd address");
        let router = app.router.clone();
        let stop = self.shutdown.clone();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        });
        self.sandbox
            .set_webhook_url(format!("http://{address}/v1/payments/webhook"));
    }

    /// Points another instance's engine at this sandbox.
    pub fn attach(&self, app: &TestApp) {
        self.attach_as(app, true);
    }

    /// A client of this sandbox, as stockd's engine has one.
    fn client(&self) -> gateway::GatewayClient {
        gateway_client(&self.url, GATEWAY_TIMEOUT_MILLISECONDS)
    }

    /// Points `app`'s engine at this sandbox with its own gateway timeout.
    pub fn attach_with_timeout(&self, app: &TestApp, timeout_milliseconds: u64) {
        app.engine
            .attach_payments(payments_at(&self.url, timeout_milliseconds, true));
    }

    /// Cancels an intent at the gateway over HTTP, as the shop's own staff might in the
    /// gateway's dashboard: stockd hears of it only by webhook or by asking.
    pub async fn cancel_intent(
        &self,
        payment_intent: &str,
    ) -> gateway::CallOutcome<gateway::PaymentIntent> {
        self.client()
            .cancel_payment_intent(
                &format!("dashboard-cancel-{payment_intent}"),
                payment_intent,
            )
            .await
    }

    fn attach_as(&self, app: &TestApp, sandbox_methods_allowed: bool) {
        app.engine.attach_payments(payments_at(
            &self.url,
            GATEWAY_TIMEOUT_MILLISECONDS,
            sandbox_methods_allowed,
        ));
    }

    /// Charges the sandbox made for `order_id` (a charge is a payment intent that
    /// moved money).
    pub fn charges_for(&self, order_id: &str) -> usize {
        self.sandbox
            .stats()
            .intents
            .iter()
            .filter(|intent| {
                intent.metadata.get("order_id").map(String::as_str) == Some(order_id)
                    && intent.latest_charge.is_some()
            })
            .count()
    }

    /// The sandbox's payment intents for `order_id`.
    pub fn intents_for(&self, order_id: &str) -> Vec<gateway::PaymentIntent> {
        self.sandbox
            .stats()
            .intents
            .into_iter()
            .filter(|intent| intent.metadata.get("order_id").map(String::as_str) == Some(order_id))
            .collect()
    }

    /// Refunds a payment intent in full at the gateway, outside stockd (as from the
    /// gateway's dashboard); returns the HTTP status.
    pub async fn refund_outside_stockd(&self, payment_intent: &str) -> u16 {
        gateway::install_crypto_provider();
        reqwest::Client::new()
            .post(format!("{}/v1/refunds", self.url))
            .bearer_auth(GATEWAY_API_KEY)
            .header("Idempotency-Key", format!("dashboard-{payment_intent}"))
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(format!("payment_intent={payment_intent}"))
            .send()
            .await
            .expect("sandbox reachable")
            .status()
            .as_u16()
    }

    /// Makes the sandbox charge an intent whatever its state (as a gateway completing a
    /// payment it had confirmed cancelled): the way to a late success.
    pub async fn force_success(&self, payment_intent: &str) -> u16 {
        self.sandbox_control(payment_intent, "force_success").await
    }

    /// `POST /_sandbox/payment_intents/{id}/{action}` over HTTP; returns the status.
    async fn sandbox_control(&self, payment_intent: &str, action: &str) -> u16 {
        gateway::install_crypto_provider();
        reqwest::Client::new()
            .post(format!(
                "{}/_sandbox/payment_intents/{payment_intent}/{action}",
                self.url
            ))
            .bearer_auth(GATEWAY_API_KEY)
            .send()
            .await
            .expect("sandbox reachable")
            .status()
            .as_u16()
    }

    /// Completes a customer action (3-D Secure, say) on the sandbox, over HTTP.
    pub async fn complete_action(&self, payment_intent: &str) -> u16 {
        self.sandbox_control(payment_intent, "complete_action")
            .await
    }
}

impl TestApp {
    /// `POST /v1/orders` for `user` with one line per `(sku, quantity)`.
    pub async fn create_order(&self, key: &str, user: &str, lines: &[(&str, i64)]) -> TestResponse {
        let lines: Vec<Value> = lines
            .iter()
            .map(|(sku, quantity)| serde_json::json!({"sku": sku, "quantity": quantity}))
            .collect();
        self.send(
            Call::post("/v1/orders")
                .key(key)
                .json(&serde_json::json!({"user_id": user, "lines": lines})),
        )
        .await
    }

    /// Creates an order that must succeed; returns its id.
    pub async fn order_of(&self, user: &str, lines: &[(&str, i64)]) -> String {
        let response = self
            .create_order(&crate::unique_key("order"), user, lines)
            .await;
        assert_eq!(response.status, 201, "create order: {response:?}");
        response.json()["order_id"]
            .as_str()
            .expect("order id")
            .to_owned()
    }

    pub async fn pay(&self, order_id: &str, key: &str, payment_method: &str) -> TestResponse {
        self.send(
            Call::post(format!("/v1/orders/{order_id}/pay"))
                .key(key)
                .json(&serde_json::json!({"payment_method": payment_method})),
        )
        .await
    }

    pub async fn order(&self, order_id: &str) -> Value {
        let response = self.send(Call::get(format!("/v1/orders/{order_id}"))).await;
        assert_eq!(response.status, 200, "get order: {response:?}");
        response.json()
    }

    /// `(order status, reservation status, payment attempt status or "none")`.
    pub async fn order_statuses(&self, order_id: &str) -> (String, String, String) {
        let order = self.order(order_id).await;
        (
            order["status"].as_str().expect("status").to_owned(),
            order["reservation"]["status"]
                .as_str()
                .expect("reservation status")
                .to_owned(),
            order["payment"]["status"]
                .as_str()
                .unwrap_or("none")
                .to_owned(),
        )
    }

    /// Waits until the order reaches `status` (a webhook arriving, say).
    pub async fn wait_for_order_status(&self, order_id: &str, status: &str) {
        let what = format!("order {order_id} reaches {status}");
        crate::wait_until_async(&what, || async move {
            self.order(order_id).await["status"] == status
        })
        .await;
    }

    /// Waits until stockd has recorded `count` distinct webhook events.
    pub async fn wait_for_webhook_events(&self, count: usize) {
        let what = format!("stockd records {count} webhook events");
        crate::wait_until_async(
            &what,
            || async move { self.webhook_events().await >= count },
        )
        .await;
    }

    /// Distinct webhook events stockd recorded, straight from the database.
    pub async fn webhook_events(&self) -> usize {
        let contents = self.contents().await;
        contents.split("webhook_event\n").nth(1).map_or(0, |rest| {
            rest.lines().take_while(|line| line.contains('|')).count()
        })
    }
}

/// A gateway client of the HTTP server at `base_url` (the sandbox, or a proxy in front
/// of it), as stockd's engine has one.
pub fn gateway_client(base_url: &str, timeout_milliseconds: u64) -> gateway::GatewayClient {
    gateway::GatewayClient::new(gateway::GatewayConfig {
        base_url: base_url.to_owned(),
        api_key: GATEWAY_API_KEY.to_owned(),
        timeout_milliseconds,
    })
    .expect("gateway client")
}

/// The payments an engine takes through the gateway at `base_url`, its webhooks signed
/// with the tests' secret.
pub fn payments_at(
    base_url: &str,
    timeout_milliseconds: u64,
    sandbox_methods_allowed: bool,
) -> engine::payments::Payments {
    engine::payments::Payments {
        gateway: gateway_client(base_url, timeout_milliseconds),
        webhook_secret: domain::Secret::new(WEBHOOK_SECRET),
        sandbox_methods_allowed,
        own_sandbox_payments: None,
    }
}

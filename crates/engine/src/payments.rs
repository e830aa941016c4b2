//! Orders and payments (seed 000). The stock is taken in one short transaction; the
//! payment attempt is committed before the gateway is called; the gateway's answer is
//! applied by a later transaction. A timeout means "unknown": the order stays
//! `PAYMENT_PROCESSING` until the gateway says what happened — on a retry, in a
//! webhook, or when the reconciliation worker asks with the same idempotency key.

use std::collections::BTreeMap;

use domain::{
    Action, ErrorCode, OrderId, OrderStatus, PaymentAttemptId, PaymentMethod, Principal, RefundId,
    ReservationId, ShopCode, SkuCode, TtlSeconds, UserId, authorize, check_lines,
};
use gateway::protocol::Event;
use gateway::{
    CallOutcome, CreatePaymentIntent, GatewayClient, PaymentIntent, PaymentIntentStatus,
};
use store::{
    AttemptToCall, BeginPayment, Displayed, GatewayOutcome, IdempotencyClaim, NewOrder, Order,
    ReadHandle,
};

use crate::{Engine, EngineError, Reply, forbidden, log_store_error};

/// Gateway calls one reconciled attempt may make: the keyed create, a read of its
/// current state, a cancel, and a read after a refused cancel.
const RECONCILE_CALLS_PER_ATTEMPT: u64 = 4;

/// Gateway calls one `pay` request makes: the keyed create, or (a retry) one look.
const PAY_CALLS_PER_REQUEST: u64 = 1;

/// Gateway calls one refund may make: the keyed refund, or a read of a pending one.
const REFUND_CALLS_PER_REFUND: u64 = 1;

/// How long a worker's claim keeps its rows from every other instance, and whether the
/// next row still fits in it. A row is started only while its worst case (each of its
/// gateway calls running into the timeout) ends before the lease does: past the lease,
/// another instance may claim the same row and call the gateway about it at the same
/// time. The first row of a step always starts, so a lease configured shorter than one
/// row's worst case still moves (one row per step, whose calls may outlive it).
#[derive(Debug, Clone, Copy)]
struct WorkerLease {
    ends_at: domain::Timestamp,
    row_milliseconds_max: i64,
}

impl WorkerLease {
    /// The lease a step claims its rows for: the configured one, or twice one row's
    /// worst case when that is longer. Shorter, a gateway timeout set long (10 s: four
    /// calls, 40 s, past the default 30 s lease) left room for the first row only,
    /// however fast the gateway answered, and a backlog after an outage drained one
    /// row per step.
    fn milliseconds(configured: i64, gateway: &GatewayClient, calls_per_row: u64) -> i64 {
        configured.max(row_milliseconds_max(gateway, calls_per_row).saturating_mul(2))
    }

    fn claimed_at(
        now: domain::Timestamp,
        lease_milliseconds: i64,
        gateway: &GatewayClient,
        calls_per_row: u64,
    ) -> WorkerLease {
        WorkerLease {
            ends_at: domain::Timestamp::from_unix_milliseconds(
                now.unix_milliseconds().saturating_add(lease_milliseconds),
            ),
            row_milliseconds_max: row_milliseconds_max(gateway, calls_per_row),
        }
    }

    /// Whether a step that has started `started` rows may start another at `now`.
    fn has_room_for_a_row(&self, now: domain::Timestamp, started: usize) -> bool {
        started == 0
            || now
                .unix_milliseconds()
                .saturating_add(self.row_milliseconds_max)
                <= self.ends_at.unix_milliseconds()
    }
}

/// One row's worst case: each of its gateway calls running into the timeout.
fn row_milliseconds_max(gateway: &GatewayClient, calls_per_row: u64) -> i64 {
    i64::try_from(
        gateway
            .config()
            .timeout_milliseconds
            .saturating_mul(calls_per_row),
    )
    .unwrap_or(i64::MAX)
}

/// The gateway and the secret its webhooks are signed with.
#[derive(Debug, Clone)]
pub struct Payments {
    pub gateway: GatewayClient,
    pub webhook_secret: domain::Secret,
    /// Whether the gateway is the project's sandbox, whose fault methods
    /// (`pm_sandbox_…`) may then be used; a real gateway refuses them with 400.
    pub sandbox_methods_allowed: bool,
    /// When the gateway is this process's own sandbox (`stockd serve` without a
    /// gateway URL), how the ids of the payments it mints begin: it keeps its books in
    /// memory, so a payment whose id does not begin so was made through an earlier
    /// process's sandbox, went with it, and moved no money.
    pub own_sandbox_payments: Option<String>,
}

/// What a webhook delivery did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookReceipt {
    pub duplicate: bool,
    pub outcome: String,
}

/// What the gateway's answer means for an attempt; `None` when it is not known yet.
fn outcome_of(call: &CallOutcome<PaymentIntent>) -> Option<GatewayOutcome> {
    match call {
        CallOutcome::Answered(intent) => match intent.status {
            PaymentIntentStatus::Succeeded => Some(GatewayOutcome::Succeeded {
                payment_id: intent.id.clone(),
            }),
            PaymentIntentStatus::RequiresPaymentMethod | PaymentIntentStatus::Canceled => {
                Some(GatewayOutcome::Failed {
                    payment_id: Some(intent.id.clone()),
                    reason: failure_reason(intent),
                })
            }
            PaymentIntentStatus::RequiresAction
            | PaymentIntentStatus::Processing
            | PaymentIntentStatus::Other => None,
        },
        CallOutcome::Declined { reason, intent } => Some(GatewayOutcome::Failed {
            payment_id: intent.as_ref().map(|intent| intent.id.clone()),
            reason: reason.clone(),
        }),
        // Refused outright: no intent exists for the key, no money moved.
        CallOutcome::Refused { reason, .. } => Some(GatewayOutcome::Failed {
            payment_id: None,
            reason: reason.clone(),
        }),
        CallOutcome::Unknown(_) => None,
    }
}

/// Counts a gateway outcome about to be applied, by what it was and who learnt it.
fn count_settlement(outcome: &GatewayOutcome, source: &'static str) {
    let label = match outcome {
        GatewayOutcome::Succeeded { .. } => "succeeded",
        GatewayOutcome::Failed { .. } => "failed",
        GatewayOutcome::Abandoned { .. } => "abandoned",
    };
    metrics::counter!("stockd_payments_total", "outcome" => label, "source" => source).increment(1);
}

fn failure_reason(intent: &PaymentIntent) -> String {
    intent
        .last_payment_error
        .as_ref()
        .and_then(|error| error.message.clone().or_else(|| error.code.clone()))
        .unwrap_or_else(|| {
            format!(
                "payment {}",
                serde_json::to_string(&intent.status).unwrap_or_default()
            )
        })
}

fn create_request(attempt: &AttemptToCall) -> CreatePaymentIntent {
    CreatePaymentIntent {
        amount: attempt.amount_minor,
        currency: attempt.currency.clone(),
        payment_method: attempt.payment_method.clone(),
        metadata: BTreeMap::from([
            ("order_id".to_owned(), attempt.order_id.as_str().to_owned()),
            (
                "attempt_id".to_owned(),
                attempt.attempt_id.as_str().to_owned(),
            ),
        ]),
    }
}

impl Engine {
    /// Connects the engine to a payment gateway (once, at start-up).
    pub fn attach_payments(&self, payments: Payments) {
        let _ = self.inner.payments.set(payments);
    }

    pub fn payments_attached(&self) -> bool {
        self.inner.payments.get().is_some()
    }

    fn payments(&self) -> Result<&Payments, EngineError> {
        self.inner
            .payments
            .get()
            .ok_or_else(|| EngineError::Unavailable("no payment gateway is configured".into()))
    }

    /// `POST /v1/orders`: the order (`PENDING_PAYMENT`, amount from the SKUs' prices)
    /// and its reservation, in one transaction.
    pub async fn create_order(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        user: UserId,
        hold: crate::HoldRequest,
    ) -> Result<crate::Held, EngineError> {
        let crate::HoldRequest {
            lines,
            ttl,
            reference,
            campaign,
            respond_async,
        } = hold;
        check_lines(&lines).map_err(|error| EngineError::InvalidArgument(error.0))?;
        // The caller's shop first: another shop's caller learns nothing of a campaign.
        let skus: Vec<&SkuCode> = lines.iter().map(|line| &line.sku).collect();
        // As a reservation's: refused as the transaction would refuse it.
        let shop = match self
            .scope_of_skus(principal, Action::PlaceOrder, &skus)
            .await
        {
            Ok(shop) => shop,
            Err(refusal) => {
                return crate::cold(self.refusal_under_key("create_order", claim, refusal))
                    .await
                    .map(crate::Held::Answered);
            }
        };
        if let Some(campaign) = &campaign
            && let Err(refusal) = self.check_named_campaign(campaign, &lines)
        {
            return crate::cold(self.first_answer_or("create_order", claim, refusal))
                .await
                .map(crate::Held::Answered);
        }
        let now = self.now();
        let ttl_seconds = ttl.map_or(
            self.inner.config.reservation_ttl_seconds_default,
            TtlSeconds::get,
        );
        let order = NewOrder {
            id: OrderId::generate(now, rand::random()),
            shop,
            user,
            reservation_id: ReservationId::generate(now, rand::random()),
            lines,
            expires_at: now.plus_seconds(ttl_seconds),
            skipped: None,
            reference,
            undecided_when_short: false,
        };
        let named_campaign = campaign.is_some();
        self.place_order(
            principal,
            "create_order",
            claim,
            order,
            named_campaign,
            respond_async,
        )
        .await
    }

    /// Creates an order (a new order, or a cart's checkout) under its key; a line of a
    /// running campaign's SKU goes through the campaign's line and draws from its
    /// buckets, as a reservation's does.
    pub(crate) async fn place_order(
        &self,
        principal: &Principal,
        operation: &'static str,
        claim: &IdempotencyClaim,
        order: NewOrder,
        named_campaign: bool,
        respond_async: bool,
    ) -> Result<crate::Held, EngineError> {
        let arrived_at = self.now();
        let memory_may_refuse =
            crate::sold_out::memory_may_refuse(claim, order.reference.order_ref.is_some());
        let routed = match self.route_lines(&order.lines, memory_may_refuse) {
            Ok(routed) => routed,
            Err(refusal) => {
                return crate::cold(self.first_answer_or(operation, claim, refusal))
                    .await
                    .map(crate::Held::Answered);
            }
        };
        let Some(mut routed) = routed else {
            return self
                .decide_order(operation, claim.clone(), order, None)
                .await
                .map(crate::Held::Answered);
        };
        routed.all_or_nothing = order.skipped.is_none();
        let shopper = order.user.clone();
        let engine = self.clone();
        let owned_claim = claim.clone();
        let line = crate::admission::LineRequest {
            principal,
            operation,
            claim,
            routed: &routed,
            shopper: Some(&shopper),
            named_campaign,
            respond_async,
        };
        self.through_line(line, move |routed| async move {
            // The hold lasts its ttl from its turn: time spent in line is not
            // taken out of it.
            let mut order = order;
            let waited_milliseconds =
                engine.now().unix_milliseconds() - arrived_at.unix_milliseconds();
            order.expires_at = order
                .expires_at
                .plus_milliseconds(waited_milliseconds.max(0));
            engine
                .decide_order(operation, owned_claim, order, routed)
                .await
        })
        .await
    }

    /// Creates the order under its key (a campaign's line through its buckets).
    async fn decide_order(
        &self,
        operation: &'static str,
        claim: IdempotencyClaim,
        order: NewOrder,
        routed: Option<crate::campaigns::Routed>,
    ) -> Result<Reply, EngineError> {
        let claim = &claim;
        // A checkout leaves a short line out and orders the others: only the database,
        // under the locks, knows which lines those are.
        let memory_may_refuse =
            crate::sold_out::memory_may_refuse(claim, order.reference.order_ref.is_some())
                && order.skipped.is_none();
        let renderer = self.inner.renderer.as_ref();
        let lines = order.lines.clone();
        let skus = crate::retry::skus_of(&lines);
        let create = |order: NewOrder| {
            let skus = &skus;
            async move {
                self.retried_on(operation, skus, || {
                    self.inner
                        .store
                        .create_order(claim, &order, self.now(), renderer)
                })
                .await
            }
        };
        let reply = self
            .idempotent(operation, claim, || async {
                let Some(routed) = &routed else {
                    return self
                        .unless_known_short(claim, &lines, memory_may_refuse, || create(order))
                        .await;
                };
                self.through_buckets(claim, routed, |warehouse, undecided_when_short| {
                    let mut attempt = order.clone();
                    attempt.lines[routed.line].warehouse = warehouse;
                    attempt.undecided_when_short = undecided_when_short;
                    create(attempt)
                })
                .await
            })
            .await?;
        self.count_duplicate_skus(&reply, lines.iter().map(|line| &line.sku));
        Ok(reply)
    }

    /// `GET /v1/orders`: orders newest first, of the caller's shop (the admin's: every
    /// shop's, or `shop`'s), of one shopper when given.
    pub async fn order_summaries(
        &self,
        principal: &Principal,
        shop: Option<&ShopCode>,
        user: Option<&UserId>,
        before: Option<&OrderId>,
        limit: i64,
    ) -> Result<Vec<store::OrderSummary>, EngineError> {
        authorize(principal, Action::ViewOrders, shop).map_err(forbidden)?;
        let shop = principal.shop().or(shop);
        self.inner
            .store
            .order_summaries(shop, user, before, limit)
            .await
            .map_err(|error| log_store_error("order_summaries", error))
    }

    /// `GET /v1/orders/{id}`, a display read.
    pub async fn order_for(
        &self,
        principal: &Principal,
        id: &OrderId,
        reader: &ReadHandle,
    ) -> Result<Displayed<Order>, EngineError> {
        authorize(principal, Action::ViewOrders, None).map_err(forbidden)?;
        let order = self
            .inner
            .store
            .display_order(reader, id, self.now())
            .await
            .map_err(|error| log_store_error("get_order", error))?;
        let order = crate::counted_display(order)
            .found()
            .ok_or_else(|| EngineError::NotFound(format!("order '{id}' does not exist")))?;
        authorize(principal, Action::ViewOrders, Some(&order.value.shop)).map_err(forbidden)?;
        Ok(order)
    }

    /// Checks that `principal` may take one of `actions` on the order (its shop never
    /// changes, so this holds until the transaction). Returns the actions it may take
    /// there; an order that does not exist passes, for the unit of work to answer.
    async fn authorize_on_order(
        &self,
        principal: &Principal,
        order: &OrderId,
        actions: &[Action],
    ) -> Result<Vec<Action>, EngineError> {
        let shop: Option<ShopCode> = self
            .inner
            .store
            .order_shop(order)
            .await
            .map_err(|error| log_store_error("order_shop", error))?;
        let allowed: Vec<Action> = actions
            .iter()
            .copied()
            .filter(|action| authorize(principal, *action, shop.as_ref()).is_ok())
            .collect();
        if allowed.is_empty() {
            let first = actions.first().copied().unwrap_or(Action::ViewOrders);
            authorize(principal, first, shop.as_ref()).map_err(forbidden)?;
        }
        Ok(allowed)
    }

    /// `POST /v1/orders/{id}/pay`. Commits `PAYMENT_PROCESSING` and the attempt, then
    /// calls the gateway with the attempt's key. A definite answer is applied and
    /// stored under the request's key; an unknown one is answered `payment_unknown`
    /// (202) and stored nowhere: the order stays processing, nothing is released.
    pub async fn pay(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        order: &OrderId,
        method: &PaymentMethod,
    ) -> Result<Reply, EngineError> {
        self.authorize_on_order(principal, order, &[Action::PlaceOrder])
            .await?;
        let payments = self.payments()?;
        // A well-formed method this stockd's configuration cannot take: 409, not 400
        // (the request itself is valid; against the sandbox it would pay). Not stored:
        // nothing was tried.
        if method.is_sandbox_only() && !payments.sandbox_methods_allowed {
            return Err(EngineError::Refused {
                code: ErrorCode::FailedPrecondition,
                detail: format!(
                    "payment_method '{method}' exists only in stockd's gateway sandbox; this stockd takes payments through a real gateway",
                    method = method.as_str()
                ),
            });
        }
        // A failed payment, or one asked after its order's hold ended, gives the order's
        // stock back.
        let _given_back = self.stock_may_come_back();
        self.idempotent("pay", claim, || async {
            if let Some(stored) = self.stored_outcome("pay", claim).await? {
                return Ok(stored);
            }
            let now = self.now();
            let attempt_id = PaymentAttemptId::generate(now, rand::random());
            // Not before this request's own call has given up, twice over: asked while
            // the create is still in flight, the gateway answers 409 and the attempt's
            // next look is put off, doubling, before anything was learned.
            let first_look_milliseconds = self.inner.config.reconcile_after_milliseconds.max(
                row_milliseconds_max(&payments.gateway, PAY_CALLS_PER_REQUEST).saturating_mul(2),
            );
            let reconcile_after = now.plus_milliseconds(first_look_milliseconds);
            let renderer = self.inner.renderer.as_ref();
            let begun = self
                .retried("pay", || {
                    self.inner.store.begin_payment(
                        claim,
                        order,
                        &attempt_id,
                        method.as_str(),
                        reconcile_after,
                        now.plus_seconds(-self.inner.config.idempotency_retention_seconds),
                        (self.now(), self.held_back_now()),
                        renderer,
                    )
                })
                .await?;
            let (attempt, call) = match begun {
                BeginPayment::Started(attempt) => {
                    let call = self.create_and_note(payments, &attempt).await;
                    (attempt, call)
                }
                // This request's attempt, already running (a retry; or an attempt from
                // before requests' keys were recorded): asked about as reconciliation
                // asks, by its payment's id when known, and never with a create the
                // gateway could run as a new payment.
                BeginPayment::InProgress(attempt) => {
                    let call = self.ask_about(payments, &attempt).await;
                    (attempt, call)
                }
                BeginPayment::AnotherRequestRunning => {
                    return Err(EngineError::Refused {
                        code: ErrorCode::RequestInProgress,
                        detail: format!(
                            "another request's payment of order '{order}' is in progress: this request tried no card and nothing was stored under its key; retry it with the same key once that payment has its outcome"
                        ),
                    });
                }
                BeginPayment::Answered(answered) => return Ok(answered),
            };
            let Some(outcome) = outcome_of(&call) else {
                metrics::counter!("stockd_payments_total", "outcome" => "unknown", "source" => "pay").increment(1);
                // The gateway's own words (a proxy's error page, the gateway's URL in a
                // connection error) are for the log, not the shop's client.
                let detail = match &call {
                    CallOutcome::Unknown(reason) => {
                        tracing::warn!(%order, attempt = %attempt.attempt_id, %reason, "a payment's outcome is unknown");
                        "the gateway gave no answer stockd could act on (none in time, unreachable, or an error of its own)"
                    }
                    _ => "the gateway has not completed the payment yet",
                };
                return Err(EngineError::PaymentUnknown(format!(
                    "{detail}; the order stays PAYMENT_PROCESSING until the gateway says what happened"
                )));
            };
            count_settlement(&outcome, "pay");
            self.retried("pay", || {
                self.inner.store.settle_payment_with_answer(
                    claim,
                    &attempt.attempt_id,
                    &outcome,
                    self.now(),
                    renderer,
                )
            })
            .await
        })
        .await
    }

    async fn settle(
        &self,
        attempt: &PaymentAttemptId,
        outcome: &GatewayOutcome,
        source: &'static str,
    ) -> Result<Option<OrderStatus>, EngineError> {
        count_settlement(outcome, source);
        // A payment that failed gives its order's stock back.
        let _given_back = self.stock_may_come_back();
        self.retried(source, || {
            self.inner
                .store
                .settle_payment(attempt, outcome, source, self.now())
        })
        .await
    }

    /// `POST /v1/payments/webhook`: verified (signature and timestamp tolerance), then
    /// applied once per event id; a failure reported after a success changes nothing.
    pub async fn handle_webhook(
        &self,
        payload: &[u8],
        signature: Option<&str>,
    ) -> Result<WebhookReceipt, EngineError> {
        let payments = self.payments()?;
        let now_seconds = self.now().unix_milliseconds().div_euclid(1000);
        gateway::signature::verify(
            payments.webhook_secret.expose(),
            signature,
            payload,
            now_seconds,
        )
        .map_err(|error| EngineError::Unauthorized(error.to_string()))?;
        let event: Event = serde_json::from_slice(payload).map_err(|error| {
            EngineError::InvalidArgument(format!("not a webhook event: {error}"))
        })?;
        // A redelivery (gateways deliver at least once, and retry) is answered before
        // the gateway is asked about its intent: it costs no gateway call, and is
        // answered even while the gateway is unreachable. One racing the first
        // delivery is still told apart when its event is recorded.
        if self
            .inner
            .store
            .webhook_event_seen(&event.id)
            .await
            .map_err(|error| log_store_error("webhook", error))?
        {
            metrics::counter!("stockd_webhooks_total", "duplicate" => "true").increment(1);
            return Ok(WebhookReceipt {
                duplicate: true,
                outcome: "delivered before".into(),
            });
        }
        let intent: Option<PaymentIntent> = serde_json::from_value(event.data.object.clone()).ok();
        let payment_id = intent
            .as_ref()
            .map(|intent| intent.id.clone())
            .unwrap_or_default();
        let attempt = intent
            .as_ref()
            .and_then(|intent| intent.metadata.get("attempt_id"))
            .and_then(|id| PaymentAttemptId::parse(id).ok());
        let claimed = claimed_outcome(&event.kind, intent.as_ref());
        let outcome = match (claimed, &intent) {
            (Some(claimed), Some(intent)) => {
                self.verified_outcome(payments, intent, attempt.as_ref(), claimed)
                    .await?
            }
            _ => None,
        };
        // A payment that failed gives its order's stock back.
        let given_back = self.stock_may_come_back();
        let applied = self
            .retried("webhook", || {
                self.inner.store.apply_payment_event(
                    &event.id,
                    &event.kind,
                    &payment_id,
                    attempt.as_ref(),
                    outcome.as_ref(),
                    self.now(),
                )
            })
            .await?;
        if applied.is_none() {
            given_back.nothing_given_back();
        }
        let receipt = match applied {
            Some(outcome) => WebhookReceipt {
                duplicate: false,
                outcome,
            },
            None => WebhookReceipt {
                duplicate: true,
                outcome: "delivered before".into(),
            },
        };
        metrics::counter!("stockd_webhooks_total", "duplicate" => receipt.duplicate.to_string())
            .increment(1);
        Ok(receipt)
    }

    /// A webhook's outcome, if it is about an intent stockd created for the attempt it
    /// names: the intent's amount and currency must be the attempt's, and its id the
    /// one the gateway gave the attempt — or, when stockd never heard that id (the
    /// answer was lost), the one the gateway answers again for the attempt's own
    /// idempotency key; past the key's lifetime, the one the gateway's search finds by
    /// the attempt's metadata ([`Engine::find_by_metadata`]). Metadata alone proves
    /// nothing: anyone who can create intents on the same account can write it.
    async fn verified_outcome(
        &self,
        payments: &Payments,
        intent: &PaymentIntent,
        attempt: Option<&PaymentAttemptId>,
        claimed: GatewayOutcome,
    ) -> Result<Option<GatewayOutcome>, EngineError> {
        let known = self
            .inner
            .store
            .payment_attempt(attempt, &intent.id)
            .await
            .map_err(|error| log_store_error("webhook", error))?;
        let Some(known) = known else {
            return Ok(None);
        };
        if known.amount_minor != intent.amount
            || !known.currency.eq_ignore_ascii_case(&intent.currency)
        {
            tracing::warn!(
                attempt = %known.attempt_id,
                intent = %intent.id,
                "a webhook's intent does not match its attempt's amount or currency; ignored"
            );
            return Ok(None);
        }
        let ours = match &known.gateway_payment_id {
            Some(recorded) => *recorded == intent.id,
            // Past the key's lifetime a create could charge again: the gateway's search
            // by the attempt's metadata tells whether the intent is its payment.
            None if !key_still_kept(&known, self.now()) => {
                match self.find_by_metadata(payments, &known).await {
                    CallOutcome::Answered(found) => found.id == intent.id,
                    CallOutcome::Unknown(reason) => {
                        return Err(EngineError::Unavailable(format!(
                            "the gateway could not confirm the intent is this attempt's ({reason}); deliver again later"
                        )));
                    }
                    CallOutcome::Declined { .. } | CallOutcome::Refused { .. } => false,
                }
            }
            None => {
                let call = payments
                    .gateway
                    .create_payment_intent(&known.gateway_key, &create_request(&known))
                    .await;
                match call {
                    CallOutcome::Answered(answer) => answer.id == intent.id,
                    CallOutcome::Declined {
                        intent: Some(answer),
                        ..
                    } => answer.id == intent.id,
                    CallOutcome::Declined { intent: None, .. } | CallOutcome::Refused { .. } => {
                        false
                    }
                    CallOutcome::Unknown(reason) => {
                        return Err(EngineError::Unavailable(format!(
                            "the gateway could not confirm the intent is this attempt's ({reason}); deliver again later"
                        )));
                    }
                }
            }
        };
        if !ours {
            tracing::warn!(
                attempt = %known.attempt_id,
                intent = %intent.id,
                "a webhook names an intent stockd did not create for its attempt; ignored"
            );
            return Ok(None);
        }
        match claimed {
            GatewayOutcome::Succeeded { .. } => Ok(Some(claimed)),
            // A failure is news of one try, and webhooks come in any order: a stale
            // `payment_failed` of an intent that has since been charged would fail
            // an attempt whose money moved, and a failed attempt's order gives its
            // stock back with no refund. The intent's own state decides: a success
            // is applied as one, a try still running changes nothing (reconciliation
            // asks again), and only a failure the gateway confirms is applied.
            GatewayOutcome::Failed { .. } | GatewayOutcome::Abandoned { .. } => {
                let current = payments.gateway.retrieve_payment_intent(&intent.id).await;
                if let CallOutcome::Unknown(reason) = &current {
                    return Err(EngineError::Unavailable(format!(
                        "the gateway could not confirm the intent's state ({reason}); deliver again later"
                    )));
                }
                Ok(match &current {
                    CallOutcome::Answered(answered) if answered.id == intent.id => {
                        outcome_of(&current)
                    }
                    _ => None,
                })
            }
        }
    }

    /// Gives back the rows a worker step claimed but did not start, its lease having
    /// no room left for them ([`WorkerLease`]). Rows the store cannot take back wait
    /// for their lease, as a crashed step's do.
    async fn give_back_unstarted<Attempt>(
        &self,
        worker: &'static str,
        started: usize,
        unstarted: usize,
        give_back: impl Fn() -> Attempt,
    ) where
        Attempt: std::future::Future<Output = Result<(), store::StoreError>>,
    {
        tracing::info!(
            worker,
            started,
            given_back = unstarted,
            "the lease ends before another row's gateway calls could end within it; the rest goes back"
        );
        if let Err(error) = self.retried(worker, give_back).await {
            tracing::warn!(%error, "claimed rows not started could not be given back; they wait for their lease");
        }
    }

    /// One step of the reconciliation worker: asks the gateway about attempts still
    /// unresolved past the threshold, with their own idempotency key, and applies the
    /// answer. Past the order's hold, an attempt the gateway has not completed is
    /// abandoned and the stock goes back; a success arriving later is a late success.
    pub async fn reconcile_step(
        &self,
    ) -> Result<Vec<(PaymentAttemptId, Option<OrderStatus>)>, EngineError> {
        let payments = self.payments()?;
        let config = &self.inner.config;
        let claimed_at = self.now();
        let lease_milliseconds = WorkerLease::milliseconds(
            config.reconcile_lease_milliseconds,
            &payments.gateway,
            RECONCILE_CALLS_PER_ATTEMPT,
        );
        let lease = WorkerLease::claimed_at(
            claimed_at,
            lease_milliseconds,
            &payments.gateway,
            RECONCILE_CALLS_PER_ATTEMPT,
        );
        let attempts = self
            .retried("reconcile", || {
                self.inner.store.claim_attempts_to_reconcile(
                    claimed_at,
                    config.reconcile_batch_size,
                    lease_milliseconds,
                )
            })
            .await?;
        let claimed = attempts.len();
        let mut resolved = Vec::with_capacity(claimed);
        let mut attempts = attempts.into_iter();
        while let Some(attempt) = attempts.next() {
            if !lease.has_room_for_a_row(self.now(), resolved.len()) {
                // The rest of the batch goes back, due at once and not counted as a
                // try: asked about by the next step, here or elsewhere; never by two
                // at once.
                let rest: Vec<PaymentAttemptId> = std::iter::once(attempt)
                    .chain(attempts)
                    .map(|attempt| attempt.attempt_id)
                    .collect();
                self.give_back_unstarted("reconcile", resolved.len(), rest.len(), || {
                    self.inner.store.give_back_attempts(&rest, self.now())
                })
                .await;
                break;
            }
            let mut call = self.ask_about(payments, &attempt).await;
            // A keyed replay answers what the gateway said the first time; a payment
            // that was still incomplete then (a customer action, for one) may have
            // finished since. Its current state decides.
            if let CallOutcome::Answered(intent) = &call
                && outcome_of(&call).is_none()
                && attempt.gateway_payment_id.is_none()
            {
                let current = payments.gateway.retrieve_payment_intent(&intent.id).await;
                if matches!(current, CallOutcome::Answered(_)) {
                    call = current;
                }
            }
            let outcome = match (outcome_of(&call), &call) {
                (Some(outcome), _) => Some(outcome),
                // The gateway answered and the payment is not complete; the hold is over.
                (None, CallOutcome::Answered(intent)) if self.now() >= attempt.order_expires_at => {
                    self.abandon_at_the_gateway(payments, &attempt, intent)
                        .await
                }
                // Unreachable, timed out, or still in flight: ask again after the lease.
                (None, _) => None,
            };
            let status = match outcome {
                // One attempt whose answer cannot be applied (the database failed or
                // timed out on a lock) waits for its lease like an unanswered one; the
                // rest of the batch, already leased, goes on.
                Some(outcome) => match self
                    .settle(&attempt.attempt_id, &outcome, "reconciliation")
                    .await
                {
                    Ok(status) => {
                        metrics::counter!("stockd_reconciliations_total", "result" => "resolved")
                            .increment(1);
                        status
                    }
                    Err(error) => {
                        metrics::counter!("stockd_reconciliations_total", "result" => "error")
                            .increment(1);
                        tracing::warn!(
                            %error,
                            attempt = %attempt.attempt_id,
                            "a reconciled payment's answer was not applied; asked again after its lease"
                        );
                        None
                    }
                },
                None => {
                    metrics::counter!("stockd_reconciliations_total", "result" => "still_unknown")
                        .increment(1);
                    if let CallOutcome::Unknown(why) = &call {
                        // Why, for the person the unknown-payment alert calls: an
                        // unreachable gateway, or a key it holds for other parameters.
                        tracing::warn!(attempt = %attempt.attempt_id, %why, "payment still unknown");
                    }
                    None
                }
            };
            resolved.push((attempt.attempt_id, status));
        }
        Ok(resolved)
    }

    /// What the gateway says of an attempt now: its payment read by id when stockd
    /// knows the id; else the create sent again under the attempt's key (a keyed
    /// replay: the gateway answers what it did the first time, and charges nothing
    /// again); else, once the key is older than the gateway keeps keys
    /// ([`GATEWAY_KEY_LIFETIME_MILLISECONDS`]: a create under it could run as a new
    /// payment and charge the card again), the payment found by its metadata.
    async fn ask_about(
        &self,
        payments: &Payments,
        attempt: &AttemptToCall,
    ) -> CallOutcome<PaymentIntent> {
        if let Some(id) = &attempt.gateway_payment_id {
            // A read of a payment the gateway named refused (a 404 after the account
            // or URL changed, say) says nothing of whether money moved: unknown, not
            // failed.
            return match payments.gateway.retrieve_payment_intent(id).await {
                // Unless the gateway is this process's own sandbox and the payment not
                // one it minted: that one is gone with an earlier process, no
                // money moved (the sandbox's is not real), and it fails, so that its
                // order is paid again or expires instead of holding its stock for good.
                CallOutcome::Refused {
                    status: 404,
                    code,
                    reason,
                } if payments
                    .own_sandbox_payments
                    .as_deref()
                    .is_some_and(|mine| !id.starts_with(mine)) =>
                {
                    CallOutcome::Refused {
                        status: 404,
                        code,
                        reason: format!(
                            "payment '{id}' was made through the gateway sandbox of an earlier stockd process, whose books went with it: {reason}"
                        ),
                    }
                }
                CallOutcome::Refused { reason, .. } | CallOutcome::Declined { reason, .. } => {
                    CallOutcome::Unknown(format!(
                        "the gateway refused to read payment '{id}': {reason}"
                    ))
                }
                answered => answered,
            };
        }
        if !key_still_kept(attempt, self.now()) {
            return self.find_by_metadata(payments, attempt).await;
        }
        self.create_and_note(payments, attempt).await
    }

    /// An attempt past its key's lifetime whose payment's id stockd never heard: the
    /// gateway's search for the intent whose metadata names the attempt and its order,
    /// with its amount and currency. Found, it is taken as the attempt's payment (a
    /// weaker proof than the key's replay: anyone able to create intents on the
    /// account could write that metadata) and its id is recorded. Not found once the
    /// last create is older than the search's delay
    /// ([`GATEWAY_SEARCH_DELAY_MILLISECONDS_MAX`]), no payment was made: the attempt
    /// fails, and the order may be paid again or expire. A search the gateway refuses
    /// or does not answer, or one too early, says nothing: unknown.
    async fn find_by_metadata(
        &self,
        payments: &Payments,
        attempt: &AttemptToCall,
    ) -> CallOutcome<PaymentIntent> {
        let found = payments
            .gateway
            .search_payment_intents_by_metadata("attempt_id", attempt.attempt_id.as_str())
            .await;
        let intents = match found {
            CallOutcome::Answered(result) => result.data,
            CallOutcome::Unknown(reason)
            | CallOutcome::Refused { reason, .. }
            | CallOutcome::Declined { reason, .. } => {
                return CallOutcome::Unknown(format!(
                    "the payment is unknown past the gateway's key lifetime and the gateway's search did not answer: {reason}"
                ));
            }
        };
        let mut matching = intents.into_iter().filter(|intent| {
            intent.amount == attempt.amount_minor
                && intent.currency.eq_ignore_ascii_case(&attempt.currency)
                && intent.metadata.get("order_id").map(String::as_str)
                    == Some(attempt.order_id.as_str())
        });
        let Some(first) = matching.next() else {
            let age = self.now().unix_milliseconds() - attempt.created_at.unix_milliseconds();
            if age < GATEWAY_KEY_LIFETIME_MILLISECONDS + GATEWAY_SEARCH_DELAY_MILLISECONDS_MAX {
                // A create sent just before the key's lifetime ended may not be in
                // the search's index yet.
                return CallOutcome::Unknown(
                    "the gateway's search does not show this attempt's payment yet".to_owned(),
                );
            }
            tracing::warn!(
                attempt = %attempt.attempt_id,
                order = %attempt.order_id,
                "no payment of this attempt at the gateway a day after its create: none was made; the attempt fails"
            );
            return CallOutcome::Refused {
                status: 404,
                code: None,
                reason: "no payment of this attempt exists at the gateway a day after its create"
                    .to_owned(),
            };
        };
        // One key makes one intent; should there be more, a success is the one that
        // moved money.
        let intent = std::iter::once(first)
            .chain(matching)
            .max_by_key(|intent| intent.status == PaymentIntentStatus::Succeeded)
            .expect("at least the first");
        let call = CallOutcome::Answered(intent);
        self.note_payment_id(attempt, &call).await;
        call
    }

    /// Sends the attempt's create under its key, and records the payment's id when
    /// the answer names one.
    async fn create_and_note(
        &self,
        payments: &Payments,
        attempt: &AttemptToCall,
    ) -> CallOutcome<PaymentIntent> {
        let call = payments
            .gateway
            .create_payment_intent(&attempt.gateway_key, &create_request(attempt))
            .await;
        self.note_payment_id(attempt, &call).await;
        call
    }

    /// Records the payment's id from an answer that names one while the attempt has
    /// none (see `store::note_gateway_payment_id`). Best effort: without it, the next
    /// look sends the create again, as before.
    async fn note_payment_id(&self, attempt: &AttemptToCall, call: &CallOutcome<PaymentIntent>) {
        let named = match call {
            CallOutcome::Answered(intent)
            | CallOutcome::Declined {
                intent: Some(intent),
                ..
            } => intent,
            _ => return,
        };
        if attempt.gateway_payment_id.is_some() {
            return;
        }
        if let Err(error) = self
            .inner
            .store
            .note_gateway_payment_id(&attempt.attempt_id, &named.id)
            .await
        {
            tracing::warn!(%error, attempt = %attempt.attempt_id, "the payment's id was not recorded; the next look sends the create again");
        }
    }

    /// The hold ended with the payment incomplete (a customer action pending): cancel
    /// the intent at the gateway first, so it can no longer complete, and give the
    /// stock back only once the gateway says it is cancelled or failed. `None` while
    /// that is not known: asked again after the lease. A success the gateway reports
    /// instead (the customer finished just now) pays the order.
    async fn abandon_at_the_gateway(
        &self,
        payments: &Payments,
        attempt: &AttemptToCall,
        intent: &PaymentIntent,
    ) -> Option<GatewayOutcome> {
        let cancel_key = format!("{}-cancel", attempt.gateway_key);
        let abandoned = |reason: &str| GatewayOutcome::Abandoned {
            payment_id: Some(intent.id.clone()),
            reason: reason.to_owned(),
        };
        let current = match payments
            .gateway
            .cancel_payment_intent(&cancel_key, &intent.id)
            .await
        {
            CallOutcome::Answered(cancelled)
                if cancelled.status == PaymentIntentStatus::Canceled =>
            {
                metrics::counter!("stockd_payment_cancellations_total", "result" => "cancelled")
                    .increment(1);
                return Some(abandoned(
                    "not completed before the order's hold ended; cancelled at the gateway",
                ));
            }
            CallOutcome::Answered(other) => CallOutcome::Answered(other),
            // Not cancellable: it succeeded or failed meanwhile. Its state decides,
            // once read: a read refused as well (the intent not found at this key or
            // address) proves nothing about the money, so the stock stays held, as
            // after a look that learns nothing (`ask_about` reads it so too).
            CallOutcome::Refused { .. } | CallOutcome::Declined { .. } => {
                match payments.gateway.retrieve_payment_intent(&intent.id).await {
                    CallOutcome::Answered(read) => CallOutcome::Answered(read),
                    _ => {
                        metrics::counter!("stockd_payment_cancellations_total", "result" => "unknown")
                            .increment(1);
                        tracing::warn!(attempt = %attempt.attempt_id, "an abandoned payment could be neither cancelled nor read at the gateway; the stock stays held, asking again later");
                        return None;
                    }
                }
            }
            CallOutcome::Unknown(reason) => {
                metrics::counter!("stockd_payment_cancellations_total", "result" => "unknown")
                    .increment(1);
                tracing::warn!(attempt = %attempt.attempt_id, %reason, "could not cancel an abandoned payment at the gateway; the stock stays held, asking again later");
                return None;
            }
        };
        match outcome_of(&current) {
            Some(GatewayOutcome::Failed { reason, .. }) => Some(abandoned(&format!(
                "not completed before the order's hold ended: {reason}"
            ))),
            other => other,
        }
    }

    /// One step of the order worker: orders still waiting for payment past their hold
    /// expire and give their stock back.
    pub async fn order_expiry_step(&self) -> Result<Vec<OrderId>, EngineError> {
        let given_back = self.stock_may_come_back();
        let cursor = self.inner.order_expiry_cursor.get();
        let expiry = self
            .retried("expire_orders", || {
                self.inner.store.expire_orders(
                    self.now(),
                    self.held_back_now(),
                    self.inner.config.order_expiry_batch_size,
                    cursor.as_ref(),
                )
            })
            .await?;
        self.inner
            .order_expiry_cursor
            .set(expiry.resume_after.clone());
        for (order, failure) in &expiry.stuck {
            tracing::error!(%order, %failure, "a due order's stock could not be given back; the others were");
            metrics::counter!("stockd_reservations_expiry_failed_total").increment(1);
        }
        if !expiry.deferred.is_empty() {
            tracing::warn!(
                orders = expiry.deferred.len(),
                "due orders wait for stock rows another transaction holds past the lock bound; a later step expires them"
            );
        }
        let expired = expiry.expired;
        metrics::counter!("stockd_orders_expired_total").increment(expired.len() as u64);
        if expired.is_empty() {
            given_back.nothing_given_back();
        }
        Ok(expired)
    }

    /// Whether the last [`Engine::order_expiry_step`] here claimed a full batch, so
    /// more orders may be due behind it (its pass resumes after them).
    pub fn order_expiry_has_more_due(&self) -> bool {
        self.inner.order_expiry_cursor.get().is_some()
    }

    /// One step of the refund worker: issues pending refunds (idempotently, by their
    /// own key) and records the ones the gateway confirmed.
    pub async fn refund_step(&self) -> Result<Vec<RefundId>, EngineError> {
        let payments = self.payments()?;
        let config = &self.inner.config;
        let claimed_at = self.now();
        // The configured pause as it is: it is also the pause before a refund the
        // gateway refused is sent again, which an operator sets short on purpose; one
        // refund's worst case is a single call.
        let lease_milliseconds = config.refund_retry_milliseconds;
        let lease = WorkerLease::claimed_at(
            claimed_at,
            lease_milliseconds,
            &payments.gateway,
            REFUND_CALLS_PER_REFUND,
        );
        let refunds = self
            .retried("refunds", || {
                self.inner.store.claim_refunds(
                    claimed_at,
                    config.refund_batch_size,
                    lease_milliseconds,
                )
            })
            .await?;
        let mut settled = Vec::with_capacity(refunds.len());
        let mut refunds = refunds.into_iter().enumerate();
        while let Some((started, refund)) = refunds.next() {
            if !lease.has_room_for_a_row(self.now(), started) {
                // The rest goes back, due at once and not counted as a try: sent by
                // the next step, here or elsewhere; never by two at once.
                let rest: Vec<RefundId> = std::iter::once(refund)
                    .chain(refunds.map(|(_, refund)| refund))
                    .map(|refund| refund.refund_id)
                    .collect();
                self.give_back_unstarted("refunds", started, rest.len(), || {
                    self.inner.store.give_back_refunds(&rest, self.now())
                })
                .await;
                break;
            }
            // A refund the gateway answered `pending` is read again, not sent again:
            // sending it with its key would replay that first answer.
            let outcome = match &refund.gateway_refund_id {
                Some(id) => match payments.gateway.retrieve_refund(id).await {
                    // A refund of another payment is not this one's answer.
                    CallOutcome::Answered(answer)
                        if answer.payment_intent != refund.gateway_payment_id =>
                    {
                        tracing::error!(refund = %refund.refund_id, gateway_refund = %id, payment = %answer.payment_intent, "the gateway's refund read back is of another payment; not applied");
                        CallOutcome::Unknown(format!(
                            "refund {id} is of payment {}",
                            answer.payment_intent
                        ))
                    }
                    // One that cannot be read may still go through: a person decides,
                    // told why.
                    CallOutcome::Refused {
                        status,
                        code,
                        reason,
                    } => CallOutcome::Refused {
                        status,
                        code,
                        reason: format!("the gateway's refund {id} could not be read: {reason}"),
                    },
                    read => read,
                },
                None => {
                    payments
                        .gateway
                        .refund(
                            &refund.gateway_key,
                            &refund.gateway_payment_id,
                            refund.amount_minor,
                        )
                        .await
                }
            };
            // One refund's failure to record its answer (the database unreachable, or
            // another instance that held it past its lease recorded another answer:
            // a refund settles once) does not hold up the rest of the batch.
            let recorded: Result<bool, EngineError> = async {
                match outcome {
                    // A refund object is an answer, not yet the money back: only
                    // `succeeded` settles it.
                    CallOutcome::Answered(answer) if answer.status == "succeeded" => {
                        self.retried("refunds", || {
                            self.inner
                                .store
                                .settle_refund(&refund.refund_id, &answer.id, self.now())
                        })
                        .await?;
                        metrics::counter!("stockd_refunds_total", "result" => "confirmed").increment(1);
                        Ok(true)
                    }
                    CallOutcome::Answered(answer)
                        if matches!(answer.status.as_str(), "failed" | "canceled") =>
                    {
                        // The money did not go back and asking again returns the same
                        // refund: a person decides, as for a refusal.
                        let reason = format!("the gateway's refund {} is {}", answer.id, answer.status);
                        self.leave_refund_to_a_person(&refund, &reason).await?;
                        Ok(false)
                    }
                    CallOutcome::Refused { reason, .. } => {
                        // Sending it again would be refused again: a person decides (the
                        // payment may have been refunded from the gateway's dashboard).
                        self.leave_refund_to_a_person(&refund, &reason).await?;
                        Ok(false)
                    }
                    CallOutcome::Answered(answer) => {
                        // `pending` (or `requires_action`): the money is on its way, or
                        // waits for someone. Its id is kept, and the refund read again.
                        if refund.gateway_refund_id.is_none() {
                            self.retried("refunds", || {
                                self.inner.store.note_refund_at_gateway(
                                    &refund.refund_id,
                                    &answer.id,
                                    self.now(),
                                )
                            })
                            .await?;
                        }
                        metrics::counter!("stockd_refunds_total", "result" => "retry").increment(1);
                        tracing::warn!(refund = %refund.refund_id, gateway_refund = %answer.id, status = %answer.status, "refund not completed at the gateway yet; will read it again");
                        Ok(false)
                    }
                    other => {
                        metrics::counter!("stockd_refunds_total", "result" => "retry").increment(1);
                        tracing::warn!(refund = %refund.refund_id, outcome = ?other, "refund not confirmed; will try again");
                        Ok(false)
                    }
                }
            }
            .await;
            match recorded {
                Ok(true) => settled.push(refund.refund_id),
                Ok(false) => {}
                Err(error) => {
                    metrics::counter!("stockd_refunds_total", "result" => "error").increment(1);
                    tracing::error!(refund = %refund.refund_id, %error, "a refund's answer could not be recorded; it is tried again after its pause if it is still pending");
                }
            }
        }
        Ok(settled)
    }

    /// Marks a refund `FAILED` with `reason`: the gateway refused it, or ended it
    /// without the money going back. It is not sent again; a person resolves it.
    async fn leave_refund_to_a_person(
        &self,
        refund: &store::RefundToIssue,
        reason: &str,
    ) -> Result<(), EngineError> {
        self.retried("refunds", || {
            self.inner
                .store
                .fail_refund(&refund.refund_id, reason, self.now())
        })
        .await?;
        metrics::counter!("stockd_refunds_total", "result" => "refused").increment(1);
        tracing::error!(refund = %refund.refund_id, order = %refund.order_id, %reason, "the gateway refused a refund (or ended it unpaid); marked FAILED for a person to resolve");
        Ok(())
    }

    /// `POST /v1/orders/{id}/cancel`.
    /// A shop's checkout backend cancels unpaid orders; cancelling a paid one (a
    /// refund follows) is a staff decision.
    pub async fn cancel_order(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        order: &OrderId,
    ) -> Result<Reply, EngineError> {
        let allowed = self
            .authorize_on_order(
                principal,
                order,
                &[Action::PlaceOrder, Action::CancelPaidOrder],
            )
            .await?;
        let rights = store::CancelRights {
            unpaid: allowed.contains(&Action::PlaceOrder),
            paid: allowed.contains(&Action::CancelPaidOrder),
        };
        let renderer = self.inner.renderer.as_ref();
        let _given_back = self.stock_may_come_back();
        self.idempotent("cancel_order", claim, || {
            self.retried("cancel_order", || {
                self.inner
                    .store
                    .cancel_order(claim, order, rights, self.now(), renderer)
            })
        })
        .await
    }

    /// `POST /v1/orders/{id}/return`: after-sale return, once.
    pub async fn return_order(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        order: &OrderId,
    ) -> Result<Reply, EngineError> {
        self.authorize_on_order(principal, order, &[Action::ReturnGoods])
            .await?;
        let renderer = self.inner.renderer.as_ref();
        let _given_back = self.stock_may_come_back();
        self.idempotent("return_order", claim, || {
            self.retried("return_order", || {
                self.inner
                    .store
                    .return_order(claim, order, self.now(), renderer)
            })
        })
        .await
    }

    /// `POST /v1/orders/{id}/refunds/{refund_id}/resolve`: a staff decision on a refund
    /// the gateway refused: send it again, or record it refunded elsewhere.
    pub async fn resolve_refund(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        order: &OrderId,
        refund: &RefundId,
        resolution: domain::RefundResolution,
        remark: &str,
    ) -> Result<Reply, EngineError> {
        self.authorize_on_order(principal, order, &[Action::ResolveRefund])
            .await?;
        let decision = store::RefundDecision {
            resolution,
            by: principal.scope(),
            remark: remark.to_owned(),
        };
        let renderer = self.inner.renderer.as_ref();
        self.idempotent("resolve_refund", claim, || {
            self.retried("resolve_refund", || {
                self.inner.store.resolve_refund(
                    claim,
                    order,
                    refund,
                    &decision,
                    self.now(),
                    renderer,
                )
            })
        })
        .await
    }

    /// Unresolved attempts and unconfirmed refunds, for the metrics page.
    pub async fn payment_gauges(&self) -> Result<store::PaymentGauges, EngineError> {
        self.inner
            .store
            .payment_gauges(self.now())
            .await
            .map_err(|error| log_store_error("payment_gauges", error))
    }
}

/// How long stockd sends an attempt's create again under its key: less than a gateway
/// keeps keys (Stripe: at least 24 hours; past it, a create under the key runs as a
/// new payment).
pub const GATEWAY_KEY_LIFETIME_MILLISECONDS: i64 = 23 * 3600 * 1000;

/// How long after its last create an attempt's payment may still be missing from the
/// gateway's search: Stripe indexes within about a minute, later during an incident.
/// A search finding nothing proves no payment only once the last create (sent at most
/// [`GATEWAY_KEY_LIFETIME_MILLISECONDS`] after the attempt began) is this old.
pub const GATEWAY_SEARCH_DELAY_MILLISECONDS_MAX: i64 = 3600 * 1000;

/// Whether the gateway still holds the attempt's key, so a create sent again under it
/// is answered from the first one.
fn key_still_kept(attempt: &AttemptToCall, now: domain::Timestamp) -> bool {
    now.unix_milliseconds() - attempt.created_at.unix_milliseconds()
        < GATEWAY_KEY_LIFETIME_MILLISECONDS
}

/// What a webhook event claims about its payment (verified with the gateway before it
/// is applied); `None` for an event that settles nothing.
fn claimed_outcome(kind: &str, intent: Option<&PaymentIntent>) -> Option<GatewayOutcome> {
    let intent = intent?;
    match kind {
        "payment_intent.succeeded" => Some(GatewayOutcome::Succeeded {
            payment_id: intent.id.clone(),
        }),
        "payment_intent.payment_failed" | "payment_intent.canceled" => {
            Some(GatewayOutcome::Failed {
                payment_id: Some(intent.id.clone()),
                reason: failure_reason(intent),
            })
        }
        _ => None,
    }
}

//! stockd's use cases. The engine validates what the HTTP layer could not, runs each
//! unit of work through the store with bounded retries, makes retries of in-flight
//! requests wait for their original, and drives the background workers. It writes no
//! SQL and knows no HTTP.

pub mod admission;
pub mod campaigns;
pub mod catalog;
pub mod clock;
pub mod combiner;
pub mod config;
pub mod credentials;
pub mod demo;
pub mod display_cache;
pub mod duplicates;
pub mod error;
pub mod events;
pub mod in_flight;
pub mod key_probe;
pub mod payments;
pub mod relay;
pub mod retry;
pub mod shops;
pub mod sold_out;
pub mod workers;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use domain::{
    Action, ConsistencyToken, Principal, ReservationId, ReservationLine, Sku, SkuCode, Timestamp,
    TtlSeconds, UserId, WarehouseCode, authorize, check_lines,
};
use store::{
    AuditReport, Displayed, ExpiryCursor, IdempotencyClaim, Idempotent, MovementQuantity,
    ReadHandle, ReplicaHealth, ReservationAction, ReservationGauges, ReserveRequest,
    ResponseRenderer, SkuChanges, StockMovement, Store, StoreError, StoredResponse,
};
use tokio::sync::Semaphore;

pub use admission::{Held, TicketState, TicketView};
pub use clock::{Clock, ManualClock, SystemClock};
use combiner::{Combiner, Refusal};
pub use config::EngineConfig;
pub use error::EngineError;
pub use events::EventsPage;
pub use in_flight::InFlight;
use in_flight::{Entry, wait_for_owner};
use retry::with_retries_on;

/// The answer to a mutating request: the stored response, and whether it is a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub response: StoredResponse,
    pub replayed: bool,
    /// The writer's position after the commit, when the unit of work read it (the
    /// combiner does, once per batch); otherwise the HTTP layer reads it.
    pub consistency_token: Option<ConsistencyToken>,
}

/// How often a retry re-checks its original after waiting; bounds the loop when an
/// original keeps failing transiently and a new one takes its place.
const IN_FLIGHT_ROUNDS_MAX: u32 = 3;

/// What a reservation or an order asks to hold: its lines, for how long, the caller's
/// reference, and the campaign the shopper believes they are buying in (checked).
#[derive(Debug, Clone)]
pub struct HoldRequest {
    pub lines: Vec<ReservationLine>,
    pub ttl: Option<TtlSeconds>,
    pub reference: domain::OrderReference,
    pub campaign: Option<domain::CampaignId>,
    /// Whether the caller would rather hold a ticket than its connection while a
    /// campaign's line is long (`Prefer: respond-async`).
    pub respond_async: bool,
}

#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    clock: Arc<dyn Clock>,
    renderer: Arc<dyn ResponseRenderer>,
    config: EngineConfig,
    in_flight: InFlight,
    audits: AuditSlots,
    combiner: Combiner,
    /// The payment gateway, once attached.
    payments: std::sync::OnceLock<payments::Payments>,
    /// Woken when this process records a schedule, so the schedule worker re-reads
    /// the next due time.
    schedules_changed: tokio::sync::Notify,
    credentials: credentials::Credentials,
    sku_shops: shops::SkuShops,
    /// Whether this instance relays events to NATS (`Engine::attach_event_relay`).
    event_relay: std::sync::atomic::AtomicBool,
    /// Whether the last sample found this instance's clock off the database's by more
    /// than [`CLOCK_SKEW_WARNING_MILLISECONDS`] (one WARN line per crossing).
    clock_skewed: std::sync::atomic::AtomicBool,
    /// How far this instance's clock was last seen ahead of the database server's
    /// (0 until sampled, or when behind): [`Engine::held_back_now`] holds it back.
    clock_ahead_milliseconds: std::sync::atomic::AtomicI64,
    /// Woken when this process's sequencer numbered events, so the relay publishes
    /// them without waiting out its pause.
    events_numbered: tokio::sync::Notify,
    /// The display cache, once attached (`STOCKD_REDIS_URL`).
    display_cache: std::sync::OnceLock<Arc<cache::DisplayCache>>,
    /// The SKUs of duplicate requests, for `stockd_hot_sku_duplicate_requests_total`.
    duplicate_skus: duplicates::DuplicateTally,
    /// Where this process's live auditor's next page of changed orders starts, and
    /// the orders it found differing.
    live_audit_orders: std::sync::Mutex<LiveAuditOrders>,
    /// Differences the admin's last full audit here found (0 before any).
    full_audit_differences: std::sync::Mutex<i64>,
    /// When this process's live auditor last recounted its running sums.
    live_audit_recounted: std::sync::Mutex<Option<Timestamp>>,
    /// Where this process's next claim of due plain holds resumes.
    reservation_expiry_cursor: ExpiryCursorCell,
    /// Where this process's next claim of due unpaid orders resumes.
    order_expiry_cursor: ExpiryCursorCell,
    /// The open campaigns, as this process routes by them.
    campaigns: campaigns::CampaignRegistry,
    /// Lines outside campaigns this process found short (the sold-out answer from
    /// memory for a SKU).
    short_lines: sold_out::ShortLines,
    /// Whether keys memory would refuse hold an answer, asked in batches.
    key_probe: key_probe::KeyProbe,
    /// The requests of tickets handed out (answered 202), each waiting for its turn:
    /// a shutdown lets them run within its grace ([`Engine::finish_tickets`]).
    ticket_tasks: tokio_util::task::TaskTracker,
}

/// Recent order changes (younger than the settle age) a live-audit round reads, at
/// most: 1,600 a second for a minute. Past it the rest wait for the page of older
/// changes, a warning says so.
const LIVE_AUDIT_RECENT_ORDERS_MAX: i64 = 100_000;

/// How far an instance's clock may be off the database server's before a WARN line
/// says so (`stockd_clock_ahead_of_database_seconds` shows every sample). A second is
/// well inside what the clocks decide: the relay's 15 s lease, a schedule's minute, the
/// live audit's settle age.
pub const CLOCK_SKEW_WARNING_MILLISECONDS: u64 = 1_000;

/// Differing orders the live auditor checks again by id, at most: past it, the gauge
/// counts only these in later rounds (each round's own finds are all counted).
const LIVE_AUDIT_ORDERS_RECHECKED_MAX: usize = 100;

/// The live auditor's place in the orders (see [`Engine::live_audit_step`]).
#[derive(Debug, Default)]
struct LiveAuditOrders {
    /// Where the next page starts, as (`updated_at`, id after which): `None` before
    /// the first round, whose page starts at the first order ever changed.
    from: Option<(Timestamp, String)>,
    differing: Vec<String>,
}

/// Where an expiry worker's next claim resumes (`store::ExpiryCursor`); each step
/// reads it and leaves the one its claim answered.
#[derive(Debug, Default)]
pub(crate) struct ExpiryCursorCell(std::sync::Mutex<Option<ExpiryCursor>>);

impl ExpiryCursorCell {
    pub(crate) fn get(&self) -> Option<ExpiryCursor> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set(&self, cursor: Option<ExpiryCursor>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = cursor;
    }
}

/// What one expiry step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiryStep {
    pub released: Vec<ReservationId>,
    /// A full batch was released: more may be waiting, so run again without pausing.
    pub more_waiting: bool,
}

impl Engine {
    pub fn new(
        store: Store,
        clock: Arc<dyn Clock>,
        renderer: Arc<dyn ResponseRenderer>,
        config: EngineConfig,
    ) -> Engine {
        let audits = AuditSlots::new(config.audits_concurrent_max);
        let mut config = config;
        if config.combiner_shards == 0 {
            // Measured on two cores (docs/BENCHMARKS.md): one queue whose batches mix
            // SKUs beat four queues on both the hot and the spread load. More cores
            // may want more queues.
            config.combiner_shards = 1;
        }
        if config.combiner_batches_in_flight == 0 {
            // Measured on two cores (docs/BENCHMARKS.md): one batch at a time makes
            // the batches larger, and on PostgreSQL a batch that fits is one round
            // trip, so there is little to overlap; two in flight were 13 % slower.
            config.combiner_batches_in_flight = 1;
        }
        let combiner = Combiner::start(
            store.clone(),
            Arc::clone(&clock),
            Arc::clone(&renderer),
            &config,
        );
        let key_probe = key_probe::KeyProbe::start(store.clone());
        let room_bounds = campaigns::RoomBounds {
            in_flight_max: config.campaign_in_flight_max,
            places_max: config.campaign_waiting_room_max,
        };
        Engine {
            inner: Arc::new(Inner {
                store,
                clock,
                renderer,
                config,
                in_flight: InFlight::default(),
                audits,
                combiner,
                schedules_changed: tokio::sync::Notify::new(),
                payments: std::sync::OnceLock::new(),
                credentials: credentials::Credentials::default(),
                sku_shops: shops::SkuShops::default(),
                event_relay: std::sync::atomic::AtomicBool::new(false),
                clock_skewed: std::sync::atomic::AtomicBool::new(false),
                clock_ahead_milliseconds: std::sync::atomic::AtomicI64::new(0),
                events_numbered: tokio::sync::Notify::new(),
                display_cache: std::sync::OnceLock::new(),
                duplicate_skus: duplicates::DuplicateTally::default(),
                live_audit_orders: std::sync::Mutex::new(LiveAuditOrders::default()),
                full_audit_differences: std::sync::Mutex::new(0),
                live_audit_recounted: std::sync::Mutex::new(None),
                reservation_expiry_cursor: ExpiryCursorCell::default(),
                order_expiry_cursor: ExpiryCursorCell::default(),
                campaigns: campaigns::CampaignRegistry::new(room_bounds),
                short_lines: sold_out::ShortLines::default(),
                key_probe,
                ticket_tasks: tokio_util::task::TaskTracker::new(),
            }),
        }
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// At shutdown, once no request comes in: waits up to `grace` for the requests of
    /// the tickets handed out to run in their turn (their callers were answered 202
    /// and poll for the answer, which the store holds only once they ran). Answers
    /// whether all of them ran.
    pub async fn finish_tickets(&self, grace: std::time::Duration) -> bool {
        let tasks = &self.inner.ticket_tasks;
        tasks.close();
        tokio::time::timeout(grace, tasks.wait()).await.is_ok()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// The time by which this instance judges whether a hold has ended (the expiry
    /// sweeps, a confirm or a pay past the end), whether a shelf schedule is due,
    /// whether a campaign runs, and when the event relay's lease ends:
    /// its clock, held back by how far it was last seen ahead of the database
    /// server's. A hold's end is written by whichever instance took it; an instance
    /// whose clock runs ahead would otherwise release every instance's holds early,
    /// and sell their stock again, by its skew, or put a product on sale (or a flash
    /// sale's units) before its launch. A clock behind is not moved: a release or a schedule a little late is
    /// safe (a confirm past the end is still refused by the same rule). Only the
    /// judgement uses it; what a unit of work writes carries [`Engine::now`].
    pub fn held_back_now(&self) -> Timestamp {
        let ahead = self
            .inner
            .clock_ahead_milliseconds
            .load(std::sync::atomic::Ordering::Relaxed);
        self.now().plus_milliseconds(-ahead.max(0))
    }

    /// Keys this process is executing right now (exported as a gauge).
    pub fn requests_in_flight(&self) -> usize {
        self.inner.in_flight.len()
    }

    /// Reservations waiting in the combiner's queues (exported as a gauge).
    pub fn reservations_queued(&self) -> usize {
        self.inner.combiner.queued()
    }

    /// The registry of keys running in this process. Tests enter a key here to stand
    /// for an original request that has not finished.
    pub fn in_flight(&self) -> &InFlight {
        &self.inner.in_flight
    }

    /// Runs a mutating unit of work under its idempotency key: a retry of a request
    /// still running here waits for it, then replays its stored answer. `work` does
    /// its own retrying (see [`retry::with_retries`] and the combiner).
    async fn idempotent<Work, Attempt>(
        &self,
        operation: &'static str,
        claim: &IdempotencyClaim,
        work: Work,
    ) -> Result<Reply, EngineError>
    where
        Work: FnOnce() -> Attempt,
        Attempt: Future<Output = Result<Idempotent, EngineError>>,
    {
        let wait_limit = Duration::from_millis(self.inner.config.idempotency_wait_milliseconds);
        let mut rounds = 0;
        let guard = loop {
            match self.inner.in_flight.enter(claim.key.as_str()) {
                Entry::Owner(guard) => break guard,
                Entry::Busy(finished) => {
                    rounds += 1;
                    if rounds > IN_FLIGHT_ROUNDS_MAX
                        || !wait_for_owner(finished.clone(), wait_limit).await
                    {
                        return Err(EngineError::RequestInProgress);
                    }
                    let finished_answer = finished.shared_answer(&claim.fingerprint);
                    // The original finished. If it answered from memory, a copy of it
                    // hears the same; if it stored a response, that is the answer; if
                    // it failed without one, this request runs in its place. A rare
                    // branch: boxed, so every request's future does not carry it.
                    if let Some(shared) = finished_answer {
                        return Err(shared);
                    }
                    if let Some(first) = cold(self.first_answer(operation, claim)).await? {
                        return Ok(first);
                    }
                }
            }
        };
        let worked = work().await;
        if let Err(answer @ EngineError::Refused { code, .. }) = &worked
            && matches!(
                code,
                domain::ErrorCode::InsufficientStock | domain::ErrorCode::PurchaseLimitExceeded
            )
        {
            // Refused inside the key's guard without being stored: memory's answer.
            guard.share_answer(&claim.fingerprint, answer);
        }
        drop(guard);
        match worked? {
            Idempotent::Executed(response) => Ok(Reply {
                response,
                replayed: false,
                consistency_token: None,
            }),
            Idempotent::Replayed(response) => {
                metrics::counter!("stockd_idempotent_replays_total", "operation" => operation)
                    .increment(1);
                metrics::counter!("stockd_duplicate_requests_total", "operation" => operation)
                    .increment(1);
                Ok(Reply {
                    response,
                    replayed: true,
                    consistency_token: None,
                })
            }
            Idempotent::KeyReused => Err(EngineError::IdempotencyKeyReused),
            Idempotent::Forbidden(detail) => Err(EngineError::Forbidden(detail)),
            Idempotent::Undecided => Err(EngineError::Internal(
                "a request was left undecided outside a campaign's buckets".into(),
            )),
        }
    }

    /// A store unit of work with bounded retries, its errors logged and mapped.
    async fn retried<Output, Work, Attempt>(
        &self,
        operation: &'static str,
        work: Work,
    ) -> Result<Output, EngineError>
    where
        Work: Fn() -> Attempt,
        Attempt: Future<Output = Result<Output, StoreError>>,
    {
        self.retried_on(operation, &[], work).await
    }

    /// [`Engine::retried`] for a unit of work on these SKUs (named when it deadlocks).
    async fn retried_on<Output, Work, Attempt>(
        &self,
        operation: &'static str,
        skus: &[&str],
        work: Work,
    ) -> Result<Output, EngineError>
    where
        Work: Fn() -> Attempt,
        Attempt: Future<Output = Result<Output, StoreError>>,
    {
        with_retries_on(&self.inner.config, operation, skus, work)
            .await
            .map_err(|error| log_store_error(operation, error))
    }

    /// `PUT /v1/skus/{sku}`: creates a SKU (in the caller's shop, or the one named) or
    /// updates one the caller may touch.
    pub async fn save_sku(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        code: &SkuCode,
        changes: &SkuChanges,
    ) -> Result<Reply, EngineError> {
        let mut changes = changes.clone();
        let shop = match self.shop_of(code).await? {
            Some(existing) => existing,
            // An edit of what was read: nothing to edit, and nothing is created.
            None if changes.expected_version.is_some() => {
                return Err(EngineError::NotFound(format!(
                    "sku '{code}' does not exist: expected_version names an edit of a SKU that was read"
                )));
            }
            None => {
                refuse_stockds_own_sku_code(code)?;
                changes
                    .shop
                    .clone()
                    .or_else(|| principal.shop().cloned())
                    .unwrap_or_else(domain::ShopCode::default_shop)
            }
        };
        authorize(principal, Action::EditCatalog, Some(&shop)).map_err(forbidden)?;
        if changes.shop.is_none() {
            changes.shop = Some(shop);
        }
        let renderer = self.inner.renderer.as_ref();
        self.idempotent("save_sku", claim, || {
            self.retried("save_sku", || {
                self.inner
                    .store
                    .upsert_sku(claim, code, &changes, self.now(), renderer)
            })
        })
        .await
    }

    /// `POST /v1/skus/{sku}/stock-movements`.
    pub async fn record_movement(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        sku: SkuCode,
        warehouse: Option<WarehouseCode>,
        quantity: MovementQuantity,
    ) -> Result<Reply, EngineError> {
        let shop = self
            .scope_of_skus(principal, Action::MoveStock, &[&sku])
            .await?;
        if let Some(warehouse) = warehouse
            .as_ref()
            .filter(|warehouse| domain::campaign::is_bucket_warehouse(warehouse))
        {
            return Err(EngineError::InvalidArgument(format!(
                "warehouse '{warehouse}' is a campaign's: its stock moves only with the campaign"
            )));
        }
        let now = self.now();
        let movement = StockMovement {
            id: domain::MovementId::generate(now, rand::random()),
            shop,
            sku,
            warehouse: warehouse.unwrap_or_else(WarehouseCode::default_warehouse),
            quantity,
        };
        let renderer = self.inner.renderer.as_ref();
        let _received = self.stock_may_come_back();
        self.idempotent("record_movement", claim, || {
            self.retried("record_movement", || {
                self.inner
                    .store
                    .record_movement(claim, &movement, self.now(), renderer)
            })
        })
        .await
    }

    /// `POST /v1/reservations`: all lines or none, every SKU of the caller's shop. A
    /// line of a running campaign's SKU goes through the campaign's line and buckets.
    pub async fn reserve(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        hold: HoldRequest,
        user: Option<UserId>,
    ) -> Result<Held, EngineError> {
        let HoldRequest {
            lines,
            ttl,
            reference,
            campaign,
            respond_async,
        } = hold;
        check_lines(&lines).map_err(|error| EngineError::InvalidArgument(error.0))?;
        // The caller's shop first: another shop's caller learns nothing of a campaign.
        let skus: Vec<&SkuCode> = lines.iter().map(|line| &line.sku).collect();
        // SKUs of several shops are refused as the transaction would refuse them
        // (stored); a retry of a request answered meanwhile hears its answer, not a
        // refusal of a SKU created since.
        let shop = match self.scope_of_skus(principal, Action::Reserve, &skus).await {
            Ok(shop) => shop,
            Err(refusal) => {
                return cold(self.refusal_under_key("reserve", claim, refusal))
                    .await
                    .map(Held::Answered);
            }
        };
        let memory_may_refuse = sold_out::memory_may_refuse(claim, reference.order_ref.is_some());
        let checked = self
            .route_lines(&lines, memory_may_refuse)
            .and_then(|routed| {
                if let Some(campaign) = &campaign {
                    self.check_named_campaign(campaign, &lines)?;
                }
                Ok(routed)
            });
        let routed = match checked {
            Ok(routed) => routed,
            Err(refusal) => {
                return cold(self.first_answer_or("reserve", claim, refusal))
                    .await
                    .map(Held::Answered);
            }
        };
        let now = self.now();
        let ttl_seconds = ttl.map_or(
            self.inner.config.reservation_ttl_seconds_default,
            TtlSeconds::get,
        );
        let request = ReserveRequest {
            claim: claim.clone(),
            id: ReservationId::generate(now, rand::random()),
            lines,
            ttl_seconds,
            shop,
            user,
            reference,
            undecided_when_short: false,
        };
        let Some(routed) = routed else {
            return self
                .decide_reservation(request, None)
                .await
                .map(Held::Answered);
        };
        let shopper = request.user.clone();
        let engine = self.clone();
        let line = admission::LineRequest {
            principal,
            operation: "reserve",
            claim,
            routed: &routed,
            shopper: shopper.as_ref(),
            named_campaign: campaign.is_some(),
            respond_async,
        };
        // The hold lasts its ttl from when its batch is decided: time spent in line
        // is not taken out of it.
        self.through_line(line, move |routed| async move {
            engine.decide_reservation(request, routed).await
        })
        .await
    }

    /// Runs a reservation through the combiner under its key (a campaign's line through
    /// its buckets).
    async fn decide_reservation(
        &self,
        request: ReserveRequest,
        routed: Option<campaigns::Routed>,
    ) -> Result<Reply, EngineError> {
        let claim = &request.claim.clone();
        let memory_may_refuse =
            sold_out::memory_may_refuse(claim, request.reference.order_ref.is_some());
        let lines = request.lines.clone();
        let position = std::sync::Mutex::new(None);
        let submit = |request: ReserveRequest| {
            let position = &position;
            async move {
                match self.inner.combiner.submit(request).await {
                    Ok(answer) => {
                        *position.lock().unwrap_or_else(|p| p.into_inner()) = answer.position;
                        answer
                            .outcome
                            .map_err(|error| log_store_error("reserve", error))
                    }
                    Err(Refusal::QueueFull) => Err(EngineError::Overloaded(
                        "too many reservations are queued; retry with the same key".into(),
                    )),
                    Err(Refusal::Stopped) => {
                        Err(EngineError::Unavailable("stockd is shutting down".into()))
                    }
                }
            }
        };
        let mut reply = self
            .idempotent("reserve", claim, || async {
                let Some(routed) = &routed else {
                    return self
                        .unless_known_short(claim, &lines, memory_may_refuse, || submit(request))
                        .await;
                };
                // A running campaign's line goes to one of its buckets, and on to the
                // next while they are short.
                self.through_buckets(claim, routed, |warehouse, undecided_when_short| {
                    let mut attempt = request.clone();
                    attempt.lines[routed.line].warehouse = warehouse;
                    attempt.undecided_when_short = undecided_when_short;
                    submit(attempt)
                })
                .await
            })
            .await?;
        reply.consistency_token = position.into_inner().unwrap_or_else(|p| p.into_inner());
        self.count_duplicate_skus(&reply, lines.iter().map(|line| &line.sku));
        Ok(reply)
    }

    /// A replayed request on these SKUs counts for each in the hot-SKU tally.
    pub(crate) fn count_duplicate_skus<'a>(
        &self,
        reply: &Reply,
        skus: impl IntoIterator<Item = &'a SkuCode>,
    ) {
        if reply.replayed {
            self.inner
                .duplicate_skus
                .record(skus.into_iter().map(SkuCode::as_str));
        }
    }

    /// The most duplicated SKUs (at most `limit`), highest first, for `/metrics`.
    pub fn hot_duplicate_skus(&self, limit: usize) -> Vec<(String, u64)> {
        self.inner.duplicate_skus.top(limit)
    }

    /// The most duplicated SKUs as `/metrics` shows them to `shop`'s operator: only
    /// that shop's, since the labels name products and their traffic; all of them for
    /// the admin and the metrics token (`None`). A SKU whose shop cannot be read is
    /// left out.
    pub async fn hot_duplicate_skus_of(
        &self,
        shop: Option<&domain::ShopCode>,
        limit: usize,
    ) -> Vec<(String, u64)> {
        let top = self.hot_duplicate_skus(limit);
        let Some(shop) = shop else {
            return top;
        };
        let codes: Vec<SkuCode> = top
            .iter()
            .filter_map(|(sku, _)| SkuCode::parse(sku).ok())
            .collect();
        let Ok(shops) = self.shops_of(&codes.iter().collect::<Vec<_>>()).await else {
            return Vec::new();
        };
        top.into_iter()
            .filter(|(sku, _)| {
                SkuCode::parse(sku).ok().and_then(|code| shops.get(&code)) == Some(shop)
            })
            .collect()
    }

    /// `POST /v1/reservations/{id}/confirm` and `/release`. A reservation held by an
    /// order is moved only by that order's flow: refused here, nothing stored (who
    /// holds a reservation never changes).
    pub async fn change_reservation(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        id: &ReservationId,
        action: ReservationAction,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::Reserve, None).map_err(forbidden)?;
        let found = self
            .inner
            .store
            .reservation(id)
            .await
            .map_err(|error| log_store_error("get_reservation", error))?;
        if let Some(reservation) = &found {
            authorize(principal, Action::Reserve, reservation.shop.as_ref()).map_err(forbidden)?;
            if let Some(order) = &reservation.order_id {
                return Err(EngineError::Refused {
                    code: domain::ErrorCode::IllegalTransition,
                    detail: format!(
                        "reservation '{id}' is held by order '{order}': only that order's payment, cancel or expiry moves it"
                    ),
                });
            }
        }
        let operation = match action {
            ReservationAction::Confirm => "confirm",
            ReservationAction::Release => "release",
        };
        let renderer = self.inner.renderer.as_ref();
        let _released = (action == ReservationAction::Release).then(|| self.stock_may_come_back());
        self.idempotent(operation, claim, || {
            self.retried(operation, || {
                self.inner.store.change_reservation(
                    claim,
                    id,
                    action,
                    (self.now(), self.held_back_now()),
                    renderer,
                )
            })
        })
        .await
    }

    /// `GET /v1/skus/{sku}`, a display read.
    pub async fn sku(
        &self,
        principal: &Principal,
        code: &SkuCode,
        reader: &ReadHandle,
    ) -> Result<Displayed<Sku>, EngineError> {
        authorize(principal, Action::ViewStock, None).map_err(forbidden)?;
        let sku = self
            .inner
            .store
            .display_sku(reader, code, self.now())
            .await
            .map_err(|error| log_store_error("get_sku", error))?;
        let sku = counted_display(sku)
            .found()
            .ok_or_else(|| EngineError::NotFound(format!("sku '{code}' does not exist")))?;
        authorize(principal, Action::ViewStock, Some(&sku.value.shop)).map_err(forbidden)?;
        Ok(sku)
    }

    pub async fn reservation(
        &self,
        principal: &Principal,
        id: &ReservationId,
    ) -> Result<domain::Reservation, EngineError> {
        authorize(principal, Action::Reserve, None).map_err(forbidden)?;
        let reservation = self
            .inner
            .store
            .reservation(id)
            .await
            .map_err(|error| log_store_error("get_reservation", error))?
            .ok_or_else(|| EngineError::NotFound(format!("reservation '{id}' does not exist")))?;
        authorize(principal, Action::Reserve, reservation.shop.as_ref()).map_err(forbidden)?;
        Ok(reservation)
    }

    /// The ledger row a movement id names: what a caller was answered, looked up
    /// (seed 002 §十三.1). Read on the writer, within the caller's shop.
    pub async fn ledger_movement(
        &self,
        principal: &Principal,
        id: &domain::LedgerMovementId,
    ) -> Result<store::LedgerMovement, EngineError> {
        authorize(principal, Action::ViewStock, None).map_err(forbidden)?;
        let movement = self
            .inner
            .store
            .ledger_movement(id)
            .await
            .map_err(|error| log_store_error("get_stock_movement", error))?
            .ok_or_else(|| EngineError::NotFound(format!("movement '{id}' does not exist")))?;
        match &movement.shop {
            Some(shop) => authorize(principal, Action::ViewStock, Some(shop)).map_err(forbidden)?,
            // A row whose SKU is gone belongs to no shop a credential could name.
            None if *principal != Principal::Admin => {
                return Err(EngineError::Forbidden(
                    "this movement's SKU belongs to no shop; only the admin may read it".into(),
                ));
            }
            None => {}
        }
        Ok(movement)
    }

    /// The three-way check. At most `audits_concurrent_max` operators' audits run at
    /// once, and one of the admin's ([`AuditSlots`]); more are refused with
    /// `unavailable` rather than queued behind a full scan. An operator sees the
    /// differences of its own shop.
    pub async fn audit(&self, principal: &Principal) -> Result<AuditReport, EngineError> {
        authorize(principal, Action::Audit, None).map_err(forbidden)?;
        let _permit = self.inner.audits.take(principal)?;
        // An operator's audit keeps its own shop's differences only, counted before
        // the reported ones are cut.
        let report = self
            .inner
            .store
            .audit(self.now(), principal.shop())
            .await
            .map_err(|error| log_store_error("audit", error))?;
        if principal.shop().is_none() {
            *self
                .inner
                .full_audit_differences
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = report.differences_total;
            metrics::gauge!("stockd_audit_differences").set(report.differences_total as f64);
        }
        Ok(report)
    }

    /// The open holds and the expiry's backlog, judged as the expiry worker judges an
    /// end ([`Engine::held_back_now`]): on an instance whose clock runs ahead, a hold
    /// the worker rightly leaves alone is not counted as overdue.
    pub async fn gauges(&self) -> Result<ReservationGauges, EngineError> {
        self.inner
            .store
            .reservation_gauges(self.held_back_now())
            .await
            .map_err(|error| log_store_error("gauges", error))
    }

    /// Holds past their end and not released yet, by the expiry worker's judgement
    /// ([`Engine::held_back_now`]): the `stockd_expiry_backlog` gauge, which an alert
    /// watches.
    pub async fn expiry_backlog(&self) -> Result<i64, EngineError> {
        self.inner
            .store
            .expiry_backlog(self.held_back_now())
            .await
            .map_err(|error| log_store_error("expiry_backlog", error))
    }

    /// One step of the expiry worker: releases up to one batch of reservations whose
    /// hold has ended, by the injected clock held back as [`Engine::held_back_now`]
    /// says.
    pub async fn expire_step(&self) -> Result<ExpiryStep, EngineError> {
        let limit = self.inner.config.expiry_batch_size;
        let given_back = self.stock_may_come_back();
        let cursor = self.inner.reservation_expiry_cursor.get();
        let outcome = self
            .retried("expire", || {
                self.inner.store.expire_batch(
                    self.now(),
                    self.held_back_now(),
                    limit,
                    cursor.as_ref(),
                )
            })
            .await?;
        self.inner
            .reservation_expiry_cursor
            .set(outcome.resume_after.clone());
        metrics::counter!("stockd_reservations_expired_total")
            .increment(outcome.released.len() as u64);
        for (reservation, failure) in &outcome.stuck {
            tracing::error!(%reservation, %failure, "a due reservation could not be released; the others were");
            metrics::counter!("stockd_reservations_expiry_failed_total").increment(1);
        }
        if !outcome.deferred.is_empty() {
            tracing::warn!(
                holds = outcome.deferred.len(),
                "due holds wait for stock rows another transaction holds past the lock bound; a later step releases them"
            );
        }
        if outcome.released.is_empty() {
            given_back.nothing_given_back();
        }
        let claimed = outcome.released.len() + outcome.stuck.len() + outcome.deferred.len();
        let more_waiting = i64::try_from(claimed).unwrap_or(i64::MAX) >= limit;
        Ok(ExpiryStep {
            released: outcome.released,
            more_waiting,
        })
    }

    /// The writer's position after every commit finished so far: the
    /// `Stockd-Consistency-Token` of a write's answer. `None` when it cannot be read
    /// (the writer is unreachable): the answer then goes without a token, and a page
    /// that sends none is served by whoever is in the rotation.
    pub async fn consistency_token(&self) -> Option<ConsistencyToken> {
        match self.inner.store.consistency_token().await {
            Ok(token) => Some(token),
            Err(error) => {
                metrics::counter!("stockd_consistency_token_failures_total").increment(1);
                tracing::debug!(%error, "no consistency token for this answer");
                None
            }
        }
    }

    /// One step of the replica monitor: samples every replica's lag, moves replicas
    /// into or out of the read rotation and exports the figures per replica.
    pub async fn replica_monitor_step(&self) -> Vec<ReplicaHealth> {
        let health = self.inner.store.sample_replicas().await;
        for replica in &health {
            let name = replica.name.clone();
            metrics::gauge!("stockd_replica_lag_seconds", "replica" => name.clone())
                .set(replica.lag_seconds.unwrap_or(f64::NAN));
            metrics::gauge!("stockd_replica_lag_bytes", "replica" => name.clone())
                .set(replica.lag_bytes.map_or(f64::NAN, |bytes| bytes as f64));
            metrics::gauge!("stockd_replica_lag_seconds_peak", "replica" => name.clone())
                .set(replica.lag_seconds_peak);
            metrics::gauge!("stockd_replica_in_rotation", "replica" => name.clone())
                .set(if replica.in_rotation { 1.0 } else { 0.0 });
            if replica.rotation_changes > 0 {
                metrics::counter!("stockd_replica_rotation_changes_total", "replica" => name)
                    .increment(replica.rotation_changes);
            }
        }
        health
    }

    /// The pools' connections, waiters and acquire timeouts: the store's, and the
    /// combiner's own connections (PostgreSQL) with them, so the gauges count every
    /// connection this process holds to the database.
    pub fn pool_usage(&self) -> store::backend::PoolUsage {
        let mut usage = self.inner.store.pool_usage();
        if let Some(own) = self.inner.combiner.own_pool_usage() {
            // Its waits and timeouts are the store's already (one shared watch).
            usage.active += own.active;
            usage.idle += own.idle;
        }
        usage
    }

    /// The combiner's own pool, when it has one (PostgreSQL).
    pub fn combiner_pool_usage(&self) -> Option<store::backend::PoolUsage> {
        self.inner.combiner.own_pool_usage()
    }

    /// The database gauges that need no query: the pools' connections, waiters and
    /// acquire timeouts (read at every scrape).
    pub fn pool_gauges(&self) {
        let usage = self.pool_usage();
        metrics::gauge!("stockd_db_pool_connections", "state" => "active").set(usage.active as f64);
        metrics::gauge!("stockd_db_pool_connections", "state" => "idle").set(usage.idle as f64);
        metrics::gauge!("stockd_db_pool_waiting").set(usage.waiting as f64);
        metrics::counter!("stockd_db_pool_acquire_timeouts_total").absolute(usage.acquire_timeouts);
    }

    /// One step of the stock check: `stockd_stock_rows_negative`, the stock rows with
    /// a counter below zero (must stay 0). A scan of the stock table, so the worker
    /// runs it once a minute, not at every scrape.
    pub async fn negative_stock_step(&self) -> Result<i64, EngineError> {
        let rows = self
            .inner
            .store
            .negative_stock_rows()
            .await
            .map_err(|error| log_store_error("negative_stock_rows", error))?;
        metrics::gauge!("stockd_stock_rows_negative").set(rows as f64);
        if rows > 0 {
            tracing::error!(rows, "stock rows with a negative counter");
        }
        Ok(rows)
    }

    /// One round of the live auditor: every stock row's counters against the ledger
    /// (read from the checkpoint on) and its open holds, and a page of at most
    /// `live_audit_orders_per_round_max` orders against their reservation and
    /// payments (changes older than the settle age, from where the previous round's
    /// page ended; the first round starts at the oldest change, so the history is
    /// walked a page a round), every order changed within the settle age (at most
    /// `LIVE_AUDIT_RECENT_ORDERS_MAX`), and the orders earlier rounds found differing. Exports `stockd_audit_differences` and, when the round
    /// ran, `stockd_audit_last_success_timestamp_seconds`.
    pub async fn live_audit_step(&self) -> Result<store::LiveAuditRound, EngineError> {
        let config = &self.inner.config;
        let now = self.now();
        let settle_before = now.plus_milliseconds(-config.live_audit_settle_milliseconds);
        let orders = {
            let state = self
                .inner
                .live_audit_orders
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let (since, after) = state
                .from
                .clone()
                .unwrap_or((Timestamp::from_unix_milliseconds(0), String::new()));
            store::OrdersWindow {
                since,
                after,
                limit: config.live_audit_orders_per_round_max.max(1),
                recent_from: settle_before,
                recent_limit: LIVE_AUDIT_RECENT_ORDERS_MAX,
                recheck: state.differing.clone(),
            }
        };
        let recount = self
            .inner
            .live_audit_recounted
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_none_or(|recounted| {
                now.unix_milliseconds() - recounted.unix_milliseconds()
                    >= config.live_audit_recount_interval_milliseconds
            });
        let round = self
            .inner
            .store
            .live_audit_round(now, settle_before, &orders, recount)
            .await
            .map_err(|error| log_store_error("live_audit", error))?;
        if round.recounted {
            *self
                .inner
                .live_audit_recounted
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(now);
        }
        metrics::counter!("stockd_audit_running_sums_corrected_total")
            .increment(u64::try_from(round.running_sums_corrected).unwrap_or(0));
        if round.running_sums_corrected > 0 {
            // Not a difference in the stock: the running sums had missed ledger rows
            // (one committed later than the settle age allows) and now count them.
            tracing::warn!(
                corrected = round.running_sums_corrected,
                "the live audit's running sums differed from the ledger and were recounted"
            );
        }
        {
            let mut state = self
                .inner
                .live_audit_orders
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // After a full page of older changes, the next one follows it. Otherwise
            // the history is read up to this round's recent changes, and the next
            // page starts where they did: each order is read in a page once its
            // change is older than the settle age (any late commit is in by then), and
            // in every round's recent changes before.
            state.from = Some(
                round
                    .orders_page_ended_at
                    .clone()
                    .unwrap_or_else(|| (settle_before, String::new())),
            );
            // The orders found differing are checked again by id, so a difference
            // stays counted (and the alert firing) until it is gone, not until its
            // order leaves the window.
            state.differing = round
                .differing_orders
                .iter()
                .take(LIVE_AUDIT_ORDERS_RECHECKED_MAX)
                .cloned()
                .collect();
        }
        // The admin's full audit checks more than a round does (returns, campaigns,
        // order lines): what it found stays on the gauge until another full audit.
        let full_audit_differences = *self
            .inner
            .full_audit_differences
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        metrics::gauge!("stockd_audit_differences")
            .set(round.differences_total.max(full_audit_differences) as f64);
        metrics::gauge!("stockd_audit_last_success_timestamp_seconds")
            .set(now.unix_milliseconds() as f64 / 1_000.0);
        metrics::counter!("stockd_audit_ledger_rows_read_total")
            .increment(u64::try_from(round.ledger_rows_read).unwrap_or(0));
        if round.differences_total > 0 {
            tracing::error!(
                differences = round.differences_total,
                first = ?round.differences.first(),
                "the live audit found differences between ledger, counters, reservations and orders"
            );
        }
        Ok(round)
    }

    /// One sample of the database's sessions: `stockd_db_sessions_waiting_on_locks`,
    /// `stockd_db_long_transactions`, `stockd_db_stock_sequential_scans_total` and
    /// `stockd_clock_ahead_of_database_seconds`, each where the backend can tell.
    pub async fn database_activity_step(&self) -> Result<store::DatabaseActivity, EngineError> {
        let clock = &self.inner.clock;
        // The clock first, on its own: a gauge the database will not show this user
        // must not leave `held_back_now` unsampled.
        let ahead = self
            .inner
            .store
            .clock_ahead_of_database(&|| clock.now())
            .await
            .map_err(|error| log_store_error("database_clock", error))?;
        if let Some(ahead) = ahead {
            metrics::gauge!("stockd_clock_ahead_of_database_seconds").set(ahead as f64 / 1000.0);
            self.inner
                .clock_ahead_milliseconds
                .store(ahead, std::sync::atomic::Ordering::Relaxed);
            let skewed = ahead.unsigned_abs() > CLOCK_SKEW_WARNING_MILLISECONDS;
            if self
                .inner
                .clock_skewed
                .swap(skewed, std::sync::atomic::Ordering::Relaxed)
                != skewed
            {
                if skewed {
                    tracing::warn!(
                        ahead_milliseconds = ahead,
                        "this instance's clock is off the database server's: one ahead holds its \
                         judgement of hold ends, schedules, campaigns and the relay's lease back \
                         by the difference; one behind makes them late, and every instance \
                         writes the times of what it does by its own clock"
                    );
                } else {
                    tracing::info!(
                        ahead_milliseconds = ahead,
                        "this instance's clock agrees with the database server's again"
                    );
                }
            }
        }
        let mut activity = self
            .inner
            .store
            .database_activity(self.inner.config.long_transaction_milliseconds)
            .await
            .map_err(|error| log_store_error("database_activity", error))?;
        activity.clock_ahead_of_database_milliseconds = ahead;
        if let Some(waiting) = activity.sessions_waiting_on_locks {
            metrics::gauge!("stockd_db_sessions_waiting_on_locks").set(waiting as f64);
        }
        if let Some(long) = activity.long_transactions {
            metrics::gauge!("stockd_db_long_transactions").set(long as f64);
        }
        if let Some(scans) = activity.stock_sequential_scans {
            metrics::counter!("stockd_db_stock_sequential_scans_total")
                .absolute(u64::try_from(scans).unwrap_or(0));
        }
        if let Some(pages) = activity.stock_pages {
            metrics::gauge!("stockd_db_stock_pages").set(pages as f64);
        }
        Ok(activity)
    }

    /// One step of the idempotency purge: deletes one batch of records older than the
    /// retention. Returns how many were deleted.
    pub async fn purge_step(&self) -> Result<u64, EngineError> {
        let config = &self.inner.config;
        let created_before = self
            .now()
            .plus_seconds(-config.idempotency_retention_seconds);
        let purged = self
            .inner
            .store
            .purge_idempotency_records(created_before, config.idempotency_purge_batch_size)
            .await
            .map_err(|error| log_store_error("purge", error))?;
        metrics::counter!("stockd_idempotency_records_purged_total").increment(purged);
        Ok(purged)
    }
}

impl Engine {
    /// What a retry of this key gets, if it has a stored answer (the answer, or "key
    /// reused"), for a use case that looks it up inside [`Engine::idempotent`] (which
    /// counts the replay).
    pub(crate) async fn stored_outcome(
        &self,
        operation: &'static str,
        claim: &IdempotencyClaim,
    ) -> Result<Option<Idempotent>, EngineError> {
        let record = self
            .inner
            .store
            .idempotency_record(&claim.key)
            .await
            .map_err(|error| log_store_error(operation, error))?;
        Ok(record.map(|(fingerprint, response)| {
            if fingerprint == claim.fingerprint {
                Idempotent::Replayed(response)
            } else {
                Idempotent::KeyReused
            }
        }))
    }

    /// `refusal`, from a check that depends on the moment (which campaigns run, and
    /// their phase), unless the key already holds an answer: a retry of a request
    /// that passed the check when it first ran hears that first answer.
    ///
    /// A queued command's refusal is stored under its key like the state's: a command
    /// delivered again (its acknowledgement lost, its sender publishing it again) must
    /// hear its first answer (DESIGN.md, "three identical answers"), not a hold taken
    /// because the campaign started or ended in between.
    pub(crate) async fn first_answer_or(
        &self,
        operation: &'static str,
        claim: &IdempotencyClaim,
        refusal: EngineError,
    ) -> Result<Reply, EngineError> {
        // Not a `not_found` of this process's list of open campaigns: the list may lag
        // a campaign created on another instance by a second, and stored, that answer
        // would stand for good.
        let of_the_list = matches!(
            refusal,
            EngineError::NotFound(_)
                | EngineError::Refused {
                    code: domain::ErrorCode::NotFound,
                    ..
                }
        );
        if claim.key.is_queue_intake()
            && !of_the_list
            && let Some(rejection) = stored_rejection(&refusal, true)
        {
            return self.store_rejection(operation, claim, &rejection).await;
        }
        match self.first_answer(operation, claim).await? {
            Some(first) => Ok(first),
            None => Err(refusal),
        }
    }

    /// `refusal`, reached before the use case's own transaction, answered as that
    /// transaction would have: a refusal of the stored state (`not_found`, a failed
    /// precondition, `off_shelf`, …) is stored under the key, so a retry hears it again
    /// whatever changed since (README, "What a replay returns"), and a retry of a
    /// request whose answer was committed meanwhile hears that answer, not a refusal
    /// of the state the first request left behind (an emptied cart, a SKU created).
    /// The credential's refusal is answered as is; any other (a transient failure) is
    /// not stored but gives way to an answer committed meanwhile. A caller runs the
    /// request's own checks first: a malformed request stores nothing.
    pub(crate) async fn refusal_under_key(
        &self,
        operation: &'static str,
        claim: &IdempotencyClaim,
        refusal: EngineError,
    ) -> Result<Reply, EngineError> {
        match stored_rejection(&refusal, claim.key.is_queue_intake()) {
            Some(rejection) => self.store_rejection(operation, claim, &rejection).await,
            // The credential's refusal comes before the key is looked at, as for any
            // other call: it depends on who asks, and is answered whatever the key.
            None if matches!(
                refusal,
                EngineError::Forbidden(_) | EngineError::Unauthorized(_)
            ) =>
            {
                Err(refusal)
            }
            // A refusal that is not the state's (waiting room full, a transient
            // failure) is not stored; the answer committed meanwhile still wins.
            None => self.first_answer_or(operation, claim, refusal).await,
        }
    }

    /// Stores `rejection` under `claim`'s key (a key that already holds an answer
    /// keeps it, and that one is the answer).
    async fn store_rejection(
        &self,
        operation: &'static str,
        claim: &IdempotencyClaim,
        rejection: &domain::Rejection,
    ) -> Result<Reply, EngineError> {
        let response = self.inner.renderer.rejected(rejection);
        self.idempotent(operation, claim, || {
            self.retried(operation, || {
                self.inner
                    .store
                    .store_response(claim, &response, self.now())
            })
        })
        .await
    }

    /// The answer already stored under this key, if any. A use case looks it up before
    /// any check whose answer can change with time or state (a minute that passed, a
    /// catalog that changed): a retry gets the first result whatever happened since.
    pub(crate) async fn first_answer(
        &self,
        operation: &'static str,
        claim: &IdempotencyClaim,
    ) -> Result<Option<Reply>, EngineError> {
        match self.stored_outcome(operation, claim).await? {
            Some(Idempotent::Replayed(response)) => {
                metrics::counter!("stockd_idempotent_replays_total", "operation" => operation)
                    .increment(1);
                metrics::counter!("stockd_duplicate_requests_total", "operation" => operation)
                    .increment(1);
                Ok(Some(Reply {
                    response,
                    replayed: true,
                    consistency_token: None,
                }))
            }
            Some(_) => Err(EngineError::IdempotencyKeyReused),
            None => Ok(None),
        }
    }
}

/// `future` on the heap, for a branch the hot path rarely takes.
///
/// An async function's future is as large as the largest future it awaits inline, and
/// a store call's is kilobytes (every backend's statements in one enum). Every request
/// pays for that size whether or not it takes the branch: the future is moved as it
/// is built, once for each level that awaits it, and axum moves the handler's into a
/// box. A cold branch awaited through `cold` costs an allocation when it runs, and
/// nothing when it does not (`the_hot_paths_futures_stay_smaller_than_the_store_calls_they_box`).
pub(crate) fn cold<F: Future>(future: F) -> std::pin::Pin<Box<F>> {
    Box::pin(future)
}

/// The rejection a refusal stores under its request's key: a refusal of the stored
/// state, which a retry hears again whatever changed since. `queued` adds the
/// refusals that depend on the moment (a campaign not started yet), which a queued
/// command's redelivery must hear again too. Credentials' refusals and transient
/// failures are never stored.
fn stored_rejection(refusal: &EngineError, queued: bool) -> Option<domain::Rejection> {
    use domain::ErrorCode;
    match refusal {
        EngineError::NotFound(detail) => {
            Some(domain::Rejection::new(ErrorCode::NotFound, detail.clone()))
        }
        EngineError::Refused {
            code:
                code @ (ErrorCode::NotFound
                | ErrorCode::InsufficientStock
                | ErrorCode::OffShelf
                | ErrorCode::IllegalTransition
                | ErrorCode::VersionConflict
                | ErrorCode::PurchaseLimitExceeded
                | ErrorCode::FailedPrecondition),
            detail,
        } => Some(domain::Rejection::new(*code, detail.clone())),
        EngineError::Refused {
            code: code @ ErrorCode::CampaignNotStarted,
            detail,
        } if queued => Some(domain::Rejection::new(*code, detail.clone())),
        _ => None,
    }
}

/// A refusal of the trust model, as the engine reports it.
/// A new SKU may not take a code stockd counts a campaign's per-user purchases under
/// (`campaign-…`, `domain::campaign::tally_sku`): a SKU of that code would lend its own
/// limit to the campaign's shoppers. Taken, as an operator named `admin` is.
pub(crate) fn refuse_stockds_own_sku_code(code: &SkuCode) -> Result<(), EngineError> {
    if code
        .as_str()
        .starts_with(domain::campaign::BUCKET_WAREHOUSE_PREFIX)
    {
        return Err(EngineError::Refused {
            code: domain::ErrorCode::AlreadyExists,
            detail: format!(
                "sku codes starting with '{}' are stockd's own (a campaign's purchases are counted under them): '{code}' is taken",
                domain::campaign::BUCKET_WAREHOUSE_PREFIX
            ),
        });
    }
    Ok(())
}

pub(crate) fn forbidden(denied: domain::Denied) -> EngineError {
    EngineError::Forbidden(denied.0)
}

pub(crate) fn log_store_error(operation: &'static str, error: StoreError) -> EngineError {
    match &error {
        StoreError::Invariant(_) | StoreError::Database(_) => {
            tracing::error!(operation, %error, "store failure");
        }
        _ => tracing::warn!(operation, %error, "store refused"),
    }
    EngineError::from(error)
}

/// Counts a display read by who served it and why it did not go to a replica.
pub(crate) fn counted_display<T>(displayed: Displayed<T>) -> Displayed<T> {
    metrics::counter!(
        "stockd_display_reads_total",
        "served_by" => displayed.served_by.as_str(),
        "fallback" => displayed.fallback.map_or("none", domain::Fallback::as_str),
    )
    .increment(1);
    displayed
}

/// Who may start an audit now. Each audit scans the whole database, so at most
/// `audits_concurrent_max` run at once; the operators' audits (of every shop) take
/// turns in those slots, and the admin has one of its own: an operator calling
/// `GET /v1/audit` in a loop can hold up another shop's operator, never the admin.
struct AuditSlots {
    staff: Semaphore,
    admin: Semaphore,
}

impl AuditSlots {
    fn new(concurrent_max: usize) -> AuditSlots {
        AuditSlots {
            staff: Semaphore::new(concurrent_max.max(1)),
            admin: Semaphore::new(1),
        }
    }

    fn take(&self, principal: &Principal) -> Result<tokio::sync::SemaphorePermit<'_>, EngineError> {
        let slots = if principal.shop().is_some() {
            &self.staff
        } else {
            &self.admin
        };
        slots
            .try_acquire()
            .map_err(|_| EngineError::Unavailable("an audit is already running".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Found in review: one slot served every audit, so an operator of any shop
    /// calling `GET /v1/audit` in a loop refused the admin's audits with 503.
    #[test]
    fn operators_audits_take_turns_but_never_hold_up_the_admins() {
        let slots = super::AuditSlots::new(1);
        let operator = |shop: &str| domain::Principal::Operator {
            id: domain::OperatorId::parse("nora").unwrap(),
            shop: domain::ShopCode::parse(shop).unwrap(),
        };
        let north = slots.take(&operator("north")).expect("a free slot");
        assert!(matches!(
            slots.take(&operator("south")),
            Err(EngineError::Unavailable(_))
        ));
        let admin = slots
            .take(&domain::Principal::Admin)
            .expect("the admin's own slot");
        assert!(matches!(
            slots.take(&domain::Principal::Admin),
            Err(EngineError::Unavailable(_))
        ));
        drop((north, admin));
        assert!(slots.take(&operator("south")).is_ok());
    }

    use domain::{Reservation, Sku};
    use store::{MovementRecord, Rejection, StoreConfig};

    use super::*;

    struct PlainRenderer;

    impl ResponseRenderer for PlainRenderer {
        fn sku_saved(&self, _: &Sku, _: bool) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn movement_recorded(&self, _: &MovementRecord) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn reservation_created(&self, _: &Reservation) -> StoredResponse {
            StoredResponse {
                status: 201,
                body: String::new(),
            }
        }
        fn service_key_created(&self, _: &store::ServiceKey, _: Option<&str>) -> StoredResponse {
            StoredResponse {
                status: 201,
                body: String::new(),
            }
        }
        fn operator_revoked(
            &self,
            _: &domain::OperatorId,
            _: &domain::ShopCode,
            _: domain::Timestamp,
        ) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn service_key_revoked(&self, _: &store::ServiceKey) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn checked_out(&self, _: &store::Order, _: &[store::SkippedLine]) -> StoredResponse {
            StoredResponse {
                status: 201,
                body: String::new(),
            }
        }
        fn campaign_created(&self, _: &store::Campaign) -> StoredResponse {
            StoredResponse {
                status: 201,
                body: String::new(),
            }
        }
        fn campaign_ended_early(&self, _: &store::Campaign) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn schedule_cancelled(&self, _: &store::ScheduleRecord) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn order(&self, _: &store::Order, created: bool) -> StoredResponse {
            StoredResponse {
                status: if created { 201 } else { 200 },
                body: String::new(),
            }
        }
        fn product_saved(&self, _: &domain::Product, _: bool) -> StoredResponse {
            StoredResponse {
                status: 201,
                body: String::new(),
            }
        }
        fn shelf_results(&self, _: &[store::ShelfResult]) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn operator_created(
            &self,
            _: &domain::OperatorId,
            _: &domain::ShopCode,
            _: Option<&str>,
        ) -> StoredResponse {
            StoredResponse {
                status: 201,
                body: String::new(),
            }
        }
        fn cart(&self, _: &store::Cart) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn reservation_changed(&self, _: &Reservation) -> StoredResponse {
            StoredResponse {
                status: 200,
                body: String::new(),
            }
        }
        fn rejected(&self, _: &Rejection) -> StoredResponse {
            StoredResponse {
                status: 409,
                body: String::new(),
            }
        }
    }

    /// An engine on a scratch SQLite file; the retry tests never reach the database.
    async fn engine() -> (Engine, std::path::PathBuf) {
        let directory =
            std::env::temp_dir().join(format!("stockd-engine-{:016x}", rand::random::<u64>()));
        let store = Store::connect(&StoreConfig::new(format!(
            "sqlite://{}",
            directory.join("t.db").display()
        )))
        .await
        .unwrap();
        let engine = Engine::new(
            store,
            Arc::new(SystemClock),
            Arc::new(PlainRenderer),
            EngineConfig::default(),
        );
        (engine, directory)
    }

    #[tokio::test]
    async fn an_admin_token_no_bearer_header_can_carry_is_refused_at_configuration() {
        let (engine, directory) = engine().await;
        let too_long = "x".repeat(domain::limits::BEARER_TOKEN_LENGTH_MAX + 1);
        for token in [
            "",
            " leading",
            "trailing ",
            "caf\u{e9}",
            "bell\u{7}",
            too_long.as_str(),
        ] {
            assert!(
                engine
                    .configure_admin_token(&domain::Secret::new(token.to_owned()))
                    .is_err(),
                "{token:?}"
            );
        }
        let longest = "x".repeat(domain::limits::BEARER_TOKEN_LENGTH_MAX);
        for token in [longest.as_str(), "correct horse battery", "tab\there"] {
            assert!(
                engine
                    .configure_admin_token(&domain::Secret::new(token.to_owned()))
                    .is_ok(),
                "{token:?}: a header carries it"
            );
        }
        let _ = std::fs::remove_dir_all(directory);
    }

    /// The request path awaits its store calls through `cold` where they are rare
    /// branches: inline, one of them makes every request's future at least as large
    /// as the call's own (it holds it), and that future is moved several times as the
    /// request's is built. Each function is compared with the call it keeps boxed, so
    /// the check holds whatever size a compiler gives either.
    #[tokio::test]
    async fn the_hot_paths_futures_stay_smaller_than_the_store_calls_they_box() {
        let (engine, directory) = engine().await;
        let principal = Principal::Admin;
        let claim = IdempotencyClaim {
            key: store::ScopedKey::new(&principal, &domain::IdempotencyKey::parse("k-1").unwrap()),
            fingerprint: String::new(),
        };
        let hold = HoldRequest {
            lines: Vec::new(),
            ttl: None,
            reference: domain::OrderReference::default(),
            campaign: None,
            respond_async: false,
        };
        let sku = SkuCode::parse("TEA").unwrap();
        let skus: Vec<&SkuCode> = vec![&sku];
        let digest = credentials::digest("a token");
        let first_answer = std::mem::size_of_val(&engine.first_answer("reserve", &claim));
        let shops_of = std::mem::size_of_val(&engine.shops_of(&skus));
        let credential_lookup =
            std::mem::size_of_val(&engine.inner.store.principal_by_secret_hash("00"));

        let comparisons = [
            (
                "idempotent",
                std::mem::size_of_val(
                    &engine.idempotent("reserve", &claim, || async { Ok(Idempotent::KeyReused) }),
                ),
                "first_answer",
                first_answer,
            ),
            (
                "scope_of_skus",
                std::mem::size_of_val(&engine.scope_of_skus(&principal, Action::Reserve, &skus)),
                "shops_of",
                shops_of,
            ),
            (
                "authenticate_digest",
                std::mem::size_of_val(&engine.authenticate_digest(&digest, 7)),
                "principal_by_secret_hash",
                credential_lookup,
            ),
            (
                "reserve",
                std::mem::size_of_val(&engine.reserve(&principal, &claim, hold, None)),
                "first_answer or shops_of",
                first_answer.min(shops_of),
            ),
        ];
        let _ = std::fs::remove_dir_all(directory);

        for (function, size, boxed, boxed_size) in comparisons {
            assert!(
                size < boxed_size,
                "{function}'s future is {size} bytes, {boxed}'s {boxed_size}: await {boxed} through `cold`"
            );
        }
    }

    #[tokio::test]
    async fn conflicts_are_retried_up_to_the_attempt_limit_then_reported_as_retry_exhausted() {
        let (engine, directory) = engine().await;
        let attempts = AtomicU32::new(0);

        let result: Result<Idempotent, EngineError> = engine
            .retried("test", || async {
                attempts.fetch_add(1, Ordering::SeqCst);
                Err(StoreError::Retryable("deadlock detected".into()))
            })
            .await;

        assert_eq!(result, Err(EngineError::RetryExhausted));
        assert_eq!(
            attempts.load(Ordering::SeqCst),
            engine.config().retry_attempts_max
        );
        let _ = std::fs::remove_dir_all(directory);
    }

    #[tokio::test]
    async fn a_conflict_that_clears_is_retried_into_the_stored_answer() {
        let (engine, directory) = engine().await;
        let attempts = AtomicU32::new(0);

        let result = engine
            .retried("test", || async {
                if attempts.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(StoreError::Retryable("could not serialize access".into()))
                } else {
                    Ok(Idempotent::Executed(StoredResponse {
                        status: 201,
                        body: "done".into(),
                    }))
                }
            })
            .await;

        let stored = StoredResponse {
            status: 201,
            body: "done".into(),
        };
        assert_eq!(result, Ok(Idempotent::Executed(stored)));
        assert_eq!(attempts.load(Ordering::SeqCst), 3);
        let _ = std::fs::remove_dir_all(directory);
    }

    #[tokio::test]
    async fn lock_timeouts_and_outages_are_answered_at_once_without_retrying() {
        let (engine, directory) = engine().await;
        for (error, expected) in [
            (
                StoreError::LockTimeout("55P03".into()),
                EngineError::LockTimeout,
            ),
            (StoreError::KeyInFlight, EngineError::RequestInProgress),
            (
                StoreError::Unavailable("pool timed out".into()),
                EngineError::DatabaseUnavailable("pool timed out".into()),
            ),
        ] {
            let attempts = AtomicU32::new(0);
            let result: Result<Idempotent, EngineError> = engine
                .retried("test", || async {
                    attempts.fetch_add(1, Ordering::SeqCst);
                    Err(error.clone())
                })
                .await;
            assert_eq!(result, Err(expected));
            assert_eq!(attempts.load(Ordering::SeqCst), 1);
        }
        let _ = std::fs::remove_dir_all(directory);
    }
}

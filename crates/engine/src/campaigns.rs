//! Flash-sale campaigns in the engine: creating and reading them, routing a
//! reservation's line of a running campaign's SKU to one of its buckets (and on to the
//! next one when a bucket is short), and the sold-out answer from memory.
//!
//! The registry of campaigns is this process's copy of the open ones: loaded at start,
//! kept by every campaign this process creates, and read again by the campaign worker
//! every [`REGISTRY_REFRESH_MILLISECONDS`], so another instance's new campaign is routed
//! here within that bound. Routing only chooses which stock row a line asks for; the
//! database row stays the boundary: a bucket never gives more than it holds, a regular
//! row never gives a campaign's units.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use domain::{
    Action, CampaignCode, CampaignId, CampaignPhase, ErrorCode, Principal, ReservationLine,
    SkuCode, Timestamp, UserId, WarehouseCode, authorize,
};
use store::{Campaign, IdempotencyClaim, NewCampaign};

use crate::admission::{Tickets, WaitingRoom};
use crate::sold_out::{ShortFinding, is_fresh};
use crate::{Engine, EngineError, Reply, forbidden, log_store_error};

/// How often the campaign worker reads the open campaigns again (the bound within
/// which a campaign created on another instance is routed here).
pub const REGISTRY_REFRESH_MILLISECONDS: u64 = 1_000;

/// Campaigns ended per step of the campaign worker, by default
/// (`EngineConfig::campaigns_ended_per_step_max`).
pub const CAMPAIGNS_ENDED_PER_STEP_MAX: i64 = 100;

/// A campaign as a caller asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CampaignRequest {
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub quantity: i64,
    pub buckets: u32,
    pub per_user_limit: Option<i64>,
    pub starts_at: Timestamp,
    pub ends_at: Timestamp,
}

/// What this process knows of one open campaign: its terms, and what each bucket was
/// last found short for.
#[derive(Debug)]
pub struct CampaignRoute {
    pub id: CampaignId,
    pub code: CampaignCode,
    pub sku: SkuCode,
    pub warehouse: WarehouseCode,
    pub buckets: u32,
    pub starts_at: Timestamp,
    pub ends_at: Timestamp,
    pub per_user_limit: Option<i64>,
    /// The line in front of the campaign's database path, in this process.
    pub room: Arc<WaitingRoom>,
    short: Vec<ShortFinding>,
    /// The sold-out refusal's detail, written at the first such answer: most of a
    /// flash sale's answers are this one.
    sold_out_detail: OnceLock<String>,
    /// Shoppers this process found at the campaign's limit: when (milliseconds), and
    /// the fewest units they were refused (1 once they hold the whole limit). A
    /// request for as many is refused before it takes a place while that is fresh.
    at_limit: std::sync::Mutex<HashMap<UserId, (i64, i64)>>,
}

/// Shoppers at their limit remembered per campaign; past this the memory starts
/// again (forgetting only costs database answers).
pub const SHOPPERS_AT_LIMIT_REMEMBERED_MAX: usize = 100_000;

impl CampaignRoute {
    fn of(campaign: &Campaign, bounds: RoomBounds) -> CampaignRoute {
        CampaignRoute {
            id: campaign.id.clone(),
            code: campaign.code.clone(),
            sku: campaign.sku.clone(),
            warehouse: campaign.warehouse.clone(),
            buckets: campaign.buckets,
            starts_at: campaign.starts_at,
            ends_at: campaign.ends_at,
            per_user_limit: campaign.per_user_limit,
            room: WaitingRoom::new(bounds.in_flight_max, bounds.places_max),
            short: (0..campaign.buckets)
                .map(|_| ShortFinding::default())
                .collect(),
            sold_out_detail: OnceLock::new(),
            at_limit: std::sync::Mutex::default(),
        }
    }

    fn shoppers_at_limit(&self) -> std::sync::MutexGuard<'_, HashMap<UserId, (i64, i64)>> {
        self.at_limit
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether `shopper` was found unable to take `units` more within the last
    /// `recheck_milliseconds` (a finding in the future, after a clock step back, is
    /// not trusted).
    pub fn known_at_limit(
        &self,
        shopper: &UserId,
        units: i64,
        now: Timestamp,
        recheck_milliseconds: i64,
    ) -> bool {
        self.shoppers_at_limit()
            .get(shopper)
            .is_some_and(|(since, fewest)| {
                is_fresh(*since, now, recheck_milliseconds) && units >= *fewest
            })
    }

    /// Learns from a request's answer how many more units its shopper cannot take: none
    /// after a hold of the whole limit taken now (by a request that holds every line
    /// or none: a checkout may succeed without its campaign line); as many as it asked for after the
    /// database's `purchase_limit_exceeded` to a request with no other line (with
    /// other lines the refusal may be theirs). An answer from memory or a replay
    /// teaches nothing new (it would only stretch an old finding). The finding is
    /// dated `sent_at`, when the request went to the database.
    pub(crate) fn learn_from(
        &self,
        shopper: Option<&UserId>,
        routed: &Routed,
        answer: &Result<crate::Reply, EngineError>,
        sent_at: Timestamp,
    ) {
        let (Some(limit), Some(shopper), Ok(reply)) = (self.per_user_limit, shopper, answer) else {
            return;
        };
        if reply.replayed {
            return;
        }
        let response = &reply.response;
        // A checkout's success says nothing of its campaign line, which it may have
        // left out (the bucket found short in its transaction).
        let fewest = if response.status == 201 && routed.all_or_nothing && routed.units >= limit {
            1
        } else if response.status == 409
            && routed.alone
            && response
                .body
                .contains("\"code\":\"purchase_limit_exceeded\"")
        {
            routed.units
        } else {
            return;
        };
        let mut at_limit = self.shoppers_at_limit();
        if at_limit.len() >= SHOPPERS_AT_LIMIT_REMEMBERED_MAX {
            at_limit.clear();
        }
        at_limit.insert(shopper.clone(), (sent_at.unix_milliseconds(), fewest));
    }

    pub fn phase(&self, now: Timestamp) -> CampaignPhase {
        CampaignPhase::at(now, self.starts_at, self.ends_at)
    }

    /// Whether a request for `units` would find `bucket` short, by what this process
    /// found within the last `recheck_milliseconds`.
    fn known_short(
        &self,
        bucket: u32,
        units: i64,
        now: Timestamp,
        recheck_milliseconds: i64,
    ) -> bool {
        self.short[bucket as usize].refuses(units, now, recheck_milliseconds)
    }

    /// Whether a request for `units` would find every bucket short, by what this
    /// process found within the re-check bound.
    pub fn known_sold_out(&self, units: i64, now: Timestamp, recheck_milliseconds: i64) -> bool {
        (0..self.buckets).all(|bucket| self.known_short(bucket, units, now, recheck_milliseconds))
    }

    fn mark_short(&self, bucket: u32, units: i64, now: Timestamp) {
        self.short[bucket as usize].record(now, units);
    }

    fn mark_available(&self, bucket: u32) {
        self.short[bucket as usize].clear();
    }

    /// Why a request was refused from memory. `recheck_milliseconds` is the engine's
    /// setting, fixed when the engine is built, and a route lives in one engine's
    /// registry only, so the text written first is the text for every later answer.
    fn sold_out_detail(&self, recheck_milliseconds: i64) -> String {
        self.sold_out_detail
            .get_or_init(|| {
                format!(
                    "campaign '{}' is sold out for this request: this instance found every bucket short of it within the last {recheck_milliseconds} ms (a request takes its units from one bucket); not recorded under the key",
                    self.id
                )
            })
            .clone()
    }

    /// The buckets in the order a request tries them: from `start` on, round the ring.
    fn ring(&self, start: u32) -> impl Iterator<Item = u32> + '_ {
        (0..self.buckets).map(move |offset| (start + offset) % self.buckets)
    }
}

/// Campaign answers this process remembers, by key, so a retry it answers from memory
/// is still the first answer (a success whose answer was lost included).
pub const ANSWERS_REMEMBERED_MAX: usize = 100_000;

/// The bounds of each campaign's waiting room.
#[derive(Debug, Clone, Copy)]
pub struct RoomBounds {
    pub in_flight_max: usize,
    pub places_max: usize,
}

/// This process's copy of the open campaigns, by SKU, the answers it gave, and the
/// tickets of their waiting rooms.
#[derive(Debug)]
pub struct CampaignRegistry {
    bounds: RoomBounds,
    by_sku: RwLock<HashMap<SkuCode, Arc<CampaignRoute>>>,
    answered: std::sync::Mutex<RememberedAnswers>,
    pub(crate) tickets: Tickets,
    /// Keys of requests waiting in a line for their turn.
    pub(crate) waiting_keys: Arc<crate::admission::WaitingKeys>,
    /// `stockd_campaign_sold_out_from_memory_total`, registered at its first answer
    /// instead of looked up at each.
    sold_out_from_memory: OnceLock<metrics::Counter>,
    /// Where the campaign worker's next end step starts: after the last campaign of a
    /// full step.
    end_cursor: std::sync::Mutex<Option<CampaignId>>,
    /// Campaigns this process created ([`CampaignRegistry::add`]) so far: a refresh
    /// whose read began before one of them was added does not replace the copy.
    added: std::sync::atomic::AtomicU64,
}

/// The last [`ANSWERS_REMEMBERED_MAX`] campaign answers, oldest dropped first, each
/// with the fingerprint of the request it answered and when it was stored.
#[derive(Debug, Default)]
struct RememberedAnswers {
    by_key: HashMap<String, RememberedAnswer>,
    order: std::collections::VecDeque<String>,
}

#[derive(Debug, Clone)]
struct RememberedAnswer {
    fingerprint: String,
    response: store::StoredResponse,
    /// When the answer was stored under its key: the database purges the record once
    /// the retention has passed, and a key sent again then is a new request there.
    stored_at: Timestamp,
}

impl RememberedAnswers {
    fn remember(
        &mut self,
        claim: &IdempotencyClaim,
        response: &store::StoredResponse,
        stored_at: Timestamp,
    ) {
        let key = claim.key.as_str();
        let answer = RememberedAnswer {
            fingerprint: claim.fingerprint.clone(),
            response: response.clone(),
            stored_at,
        };
        if self.by_key.insert(key.to_owned(), answer).is_none() {
            self.order.push_back(key.to_owned());
            if self.order.len() > ANSWERS_REMEMBERED_MAX
                && let Some(oldest) = self.order.pop_front()
            {
                self.by_key.remove(&oldest);
            }
        }
    }
}

impl CampaignRegistry {
    pub fn new(bounds: RoomBounds) -> CampaignRegistry {
        CampaignRegistry {
            bounds,
            by_sku: RwLock::default(),
            answered: std::sync::Mutex::default(),
            tickets: Tickets::default(),
            waiting_keys: Arc::default(),
            sold_out_from_memory: OnceLock::new(),
            end_cursor: std::sync::Mutex::new(None),
            added: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How many campaigns this process has added so far: taken before a refresh reads
    /// the open campaigns, and handed to [`CampaignRegistry::replace`].
    fn added_so_far(&self) -> u64 {
        self.added.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn end_cursor(&self) -> Option<CampaignId> {
        self.end_cursor
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn set_end_cursor(&self, after: Option<CampaignId>) {
        *self
            .end_cursor
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = after;
    }

    pub fn route_of(&self, sku: &SkuCode) -> Option<Arc<CampaignRoute>> {
        self.by_sku
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(sku)
            .cloned()
    }

    /// Replaces the copy with `campaigns`, read when `added_before_read` campaigns had
    /// been added here, keeping what is known of the buckets of the ones that stay. A
    /// campaign added since that read began may be missing from it: the copy is then
    /// left as it is until the next refresh, rather than this process losing the
    /// campaign it just created (routing its SKU to regular stock meanwhile) and
    /// building it a second route and waiting room at the next refresh.
    fn replace(&self, campaigns: &[Campaign], added_before_read: u64) {
        let mut by_sku = self
            .by_sku
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.added_so_far() != added_before_read {
            return;
        }
        // One route per SKU. A campaign the worker ended stays open while a unit of it
        // is held, and a new one of the same SKU may be created meanwhile: the one not
        // ended yet is the one that sells, whichever id sorts later (ids begin with
        // their creating instance's clock).
        let mut chosen: HashMap<&SkuCode, &Campaign> = HashMap::with_capacity(campaigns.len());
        for campaign in campaigns {
            let rank = |campaign: &Campaign| (campaign.ended_at.is_none(), campaign.id.clone());
            chosen
                .entry(&campaign.sku)
                .and_modify(|current| {
                    if rank(campaign) > rank(current) {
                        *current = campaign;
                    }
                })
                .or_insert(campaign);
        }
        let mut fresh = HashMap::with_capacity(chosen.len());
        for campaign in chosen.into_values() {
            // Kept with what it learned while its times stand; a campaign ended early
            // (on any instance) is routed by its new end from this read on.
            let kept = by_sku
                .get(&campaign.sku)
                .filter(|route| {
                    route.id == campaign.id
                        && route.starts_at == campaign.starts_at
                        && route.ends_at == campaign.ends_at
                })
                .cloned();
            fresh.insert(
                campaign.sku.clone(),
                kept.unwrap_or_else(|| Arc::new(CampaignRoute::of(campaign, self.bounds))),
            );
        }
        *by_sku = fresh;
    }

    fn remember(
        &self,
        claim: &IdempotencyClaim,
        response: &store::StoredResponse,
        stored_at: Timestamp,
    ) {
        self.answered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remember(claim, response, stored_at);
    }

    /// The key's first answer when `claim` is the request it answered; `KeyReused`
    /// when the key answered another request (another body, another endpoint), as the
    /// database would say; nothing when this process does not remember the key, or
    /// when the database may have purged its record (stored a retention ago).
    pub(crate) fn remembered(
        &self,
        claim: &IdempotencyClaim,
        now: Timestamp,
        retention_seconds: i64,
    ) -> Option<store::Idempotent> {
        let purged_before = now.plus_seconds(-retention_seconds);
        self.answered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .by_key
            .get(claim.key.as_str())
            .filter(|answer| answer.stored_at > purged_before)
            .map(|answer| {
                if answer.fingerprint == claim.fingerprint {
                    store::Idempotent::Replayed(answer.response.clone())
                } else {
                    store::Idempotent::KeyReused
                }
            })
    }

    fn add(&self, campaign: &Campaign) {
        let mut by_sku = self
            .by_sku
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Counted under the copy's lock: a replace holding it either ran before this
        // add (which then lands) or sees the count moved and stands aside.
        self.added.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // A refresh that read the campaign first built its route already: that one
        // stays, with its waiting room and what it knows of the buckets.
        if by_sku
            .get(&campaign.sku)
            .is_some_and(|route| route.id == campaign.id)
        {
            return;
        }
        by_sku.insert(
            campaign.sku.clone(),
            Arc::new(CampaignRoute::of(campaign, self.bounds)),
        );
    }
}

/// Where a reservation's line goes: a bucket of a running campaign, or its own row.
#[derive(Clone)]
pub(crate) struct Routed {
    pub route: Arc<CampaignRoute>,
    /// The index of the line that draws from the campaign.
    pub line: usize,
    /// The units that line asks for.
    pub units: i64,
    /// Whether that line is the request's only one: then a refusal for stock can
    /// only be the bucket's.
    pub alone: bool,
    /// Whether a success holds every line (a reservation, an order): a checkout's
    /// success may have left this line out, found short in its transaction.
    pub all_or_nothing: bool,
    /// Whether memory may refuse the request (`sold_out::memory_may_refuse`).
    pub memory_may_refuse: bool,
    /// What memory made of the request before the campaign's line, when this process
    /// knew the campaign sold out ([`Engine::sold_out_verdict`]); `None` when it was
    /// not asked, or could not tell (the request then took a place in the line).
    pub verdict: Option<SoldOutVerdict>,
}

/// What memory makes of a request for a campaign this process knows sold out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SoldOutVerdict {
    /// Refused from memory, or answered with the key's remembered answer: no database
    /// round trip, no place in the line.
    FromMemory,
    /// The key holds an answer in the database: the first bucket's attempt replays it,
    /// one round trip, so it needs no place in the line either.
    Replay,
}

/// Whether a request's answer is a hold taken.
fn created(decided: &store::Idempotent) -> bool {
    matches!(
        decided,
        store::Idempotent::Executed(response) | store::Idempotent::Replayed(response)
            if response.status == 201
    )
}

/// The bucket a request starts at: spread by its key, so concurrent requests spread
/// over the buckets and a retry tries them in the same order.
pub(crate) fn first_bucket(claim: &IdempotencyClaim, buckets: u32) -> u32 {
    first_bucket_of_key(claim.key.as_str(), buckets)
}

/// [`first_bucket`] of a stored key (`store::ScopedKey::as_str`): public so a test can
/// choose keys that start where it needs them to.
pub fn first_bucket_of_key(scoped_key: &str, buckets: u32) -> u32 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    scoped_key.hash(&mut hasher);
    u32::try_from(hasher.finish() % u64::from(buckets.max(1))).unwrap_or(0)
}

impl Engine {
    /// `POST /v1/admin/campaigns`: carves the campaign's units out of the SKU's stock.
    pub async fn create_campaign(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        campaign: CampaignRequest,
    ) -> Result<Reply, EngineError> {
        // A caller that may create no campaign is told so, not whether the SKU exists.
        authorize(principal, Action::MoveStock, None).map_err(forbidden)?;
        domain::campaign::check_campaign(
            campaign.quantity,
            campaign.buckets,
            campaign.starts_at,
            campaign.ends_at,
        )
        .map_err(|error| EngineError::InvalidArgument(error.0))?;
        if domain::campaign::is_bucket_warehouse(&campaign.warehouse) {
            return Err(EngineError::InvalidArgument(format!(
                "warehouse '{}' is a campaign's bucket",
                campaign.warehouse
            )));
        }
        // A retry after the end gets its first answer, not a refusal of the clock.
        if let Some(first) = self.first_answer("create_campaign", claim).await? {
            return Ok(first);
        }
        let now = self.held_back_now();
        if campaign.ends_at <= now {
            return Err(EngineError::InvalidArgument(
                "ends_at must be in the future".into(),
            ));
        }
        if campaign.ends_at > now.plus_seconds(domain::limits::CAMPAIGN_HORIZON_SECONDS_MAX) {
            return Err(EngineError::InvalidArgument(format!(
                "ends_at must be within {} days: the campaign's units stay out of regular stock until its end",
                domain::limits::CAMPAIGN_HORIZON_SECONDS_MAX / 86_400
            )));
        }
        // After the request's own checks, so a malformed one stores nothing. Stored: a
        // retry after the SKU is created hears it again, not a campaign.
        let Some(shop) = self.shop_of(&campaign.sku).await? else {
            let refusal = EngineError::NotFound(format!("sku '{}' does not exist", campaign.sku));
            return self
                .refusal_under_key("create_campaign", claim, refusal)
                .await;
        };
        authorize(principal, Action::MoveStock, Some(&shop)).map_err(forbidden)?;
        let campaign = NewCampaign {
            id: CampaignId::generate(self.now(), rand::random()),
            shop,
            sku: campaign.sku,
            warehouse: campaign.warehouse,
            quantity: campaign.quantity,
            buckets: campaign.buckets,
            per_user_limit: campaign.per_user_limit,
            starts_at: campaign.starts_at,
            ends_at: campaign.ends_at,
            open_in_shop_max: self.inner.config.campaigns_open_per_shop_max,
        };
        let renderer = self.inner.renderer.as_ref();
        let reply = self
            .idempotent("create_campaign", claim, || {
                self.retried("create_campaign", || {
                    self.inner
                        .store
                        .create_campaign(claim, &campaign, self.now(), renderer)
                })
            })
            .await?;
        if let Ok(Some(created)) = self.inner.store.campaign(&campaign.id).await {
            self.inner.campaigns.add(&created);
        }
        Ok(reply)
    }

    /// `POST /v1/admin/campaigns/{id}/end`: ends a campaign now (a sale gone wrong, a
    /// mistyped quantity or date), then runs a campaign step, so what is left goes
    /// back to regular stock and this instance stops routing to it at once. Other
    /// instances stop at their next campaign step ([`REGISTRY_REFRESH_MILLISECONDS`]): until
    /// then a request there for the SKU may still take a unit left in a bucket, or,
    /// once the buckets are empty, hear `insufficient_stock`.
    pub async fn end_campaign_early(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        id: &CampaignId,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::MoveStock, None).map_err(forbidden)?;
        // Another shop's campaign is refused before its key is claimed: a 403 stores
        // nothing. A retry after the campaign closed gets its first answer.
        if let Some(first) = self.first_answer("end_campaign", claim).await? {
            return Ok(first);
        }
        let campaign = self
            .inner
            .store
            .campaign(id)
            .await
            .map_err(|error| log_store_error("end_campaign", error))?
            .ok_or_else(|| EngineError::NotFound(format!("campaign '{id}' does not exist")))?;
        authorize(principal, Action::MoveStock, Some(&campaign.shop)).map_err(forbidden)?;
        let renderer = self.inner.renderer.as_ref();
        let reply = self
            .idempotent("end_campaign", claim, || {
                self.retried("end_campaign", || {
                    self.inner.store.end_campaign_early(
                        claim,
                        id,
                        self.held_back_now(),
                        self.now(),
                        renderer,
                    )
                })
            })
            .await?;
        // The end is recorded whatever the step finds: a step that fails here (a stock
        // row held past the lock bound) is the worker's to finish.
        if let Err(error) = self.campaign_step().await {
            tracing::warn!(campaign = %id, %error, "a campaign ended early; the worker gives back what is left");
        }
        Ok(reply)
    }

    /// `GET /v1/admin/campaigns/{id}`: the campaign and where its units are.
    pub async fn campaign(
        &self,
        principal: &Principal,
        id: &CampaignId,
    ) -> Result<Campaign, EngineError> {
        authorize(principal, Action::ViewStock, None).map_err(forbidden)?;
        let campaign = self
            .inner
            .store
            .campaign(id)
            .await
            .map_err(|error| log_store_error("get_campaign", error))?
            .ok_or_else(|| EngineError::NotFound(format!("campaign '{id}' does not exist")))?;
        authorize(principal, Action::ViewStock, Some(&campaign.shop)).map_err(forbidden)?;
        Ok(campaign)
    }

    /// One step of the campaign worker: ends what is due (what is left goes back) and
    /// reads the open campaigns again. Answers the campaigns closed now, or the first
    /// error, once the open campaigns were read again: an end that fails (one
    /// campaign's, or the whole step's) must not keep campaigns created elsewhere
    /// from being routed here.
    pub async fn campaign_step(&self) -> Result<Vec<CampaignId>, EngineError> {
        let ended = self.end_due_campaigns().await;
        self.load_open_campaigns().await?;
        ended
    }

    /// Reads the open campaigns and routes by them; answers how many there are. At
    /// every campaign step, and once at start before the first request is answered: a
    /// reservation for a running campaign's SKU that found no route would go to the
    /// regular stock, past the campaign's line and limit, and a "sold out" from there
    /// would be stored under its key.
    pub async fn load_open_campaigns(&self) -> Result<usize, EngineError> {
        let added_before_read = self.inner.campaigns.added_so_far();
        let open = self
            .inner
            .store
            .open_campaigns()
            .await
            .map_err(|error| log_store_error("open_campaigns", error))?;
        self.inner.campaigns.replace(&open, added_before_read);
        Ok(open.len())
    }

    /// The ending half of [`Engine::campaign_step`]: what is left of a closed campaign
    /// goes back to regular stock.
    async fn end_due_campaigns(&self) -> Result<Vec<CampaignId>, EngineError> {
        let given_back = self.stock_may_come_back();
        let after = self.inner.campaigns.end_cursor();
        let step = self
            .inner
            .store
            .end_campaigns(
                (self.now(), self.held_back_now()),
                self.inner.config.campaigns_ended_per_step_max,
                after.as_ref(),
            )
            .await
            .map_err(|error| log_store_error("end_campaigns", error))?;
        // A full step goes on after its last campaign next time; a short one has seen
        // every campaign past its end and starts over.
        self.inner
            .campaigns
            .set_end_cursor(step.last.filter(|_| step.full));
        // Units moved back are stock that came back, closed or not (a campaign stays
        // open while a unit is held): what this process found short may sell again.
        if step.units_returned == 0 {
            given_back.nothing_given_back();
        }
        for (campaign, error) in &step.failed {
            metrics::counter!("stockd_campaign_end_failures_total").increment(1);
            tracing::warn!(%campaign, %error, "a campaign's end failed; it is tried again when the end step comes back to it");
        }
        match step.failed.first() {
            Some((campaign, error)) => Err(EngineError::Unavailable(format!(
                "the end of campaign '{campaign}' failed ({error}); {} other(s) failed with it",
                step.failed.len() - 1
            ))),
            None => Ok(step.closed),
        }
    }

    /// The campaign a request's lines draw from, if one of its SKUs has one running
    /// now for the line's warehouse. A line that names a bucket's warehouse itself is
    /// refused: buckets are reached only through their campaign.
    pub(crate) fn route_lines(
        &self,
        lines: &[ReservationLine],
        memory_may_refuse: bool,
    ) -> Result<Option<Routed>, EngineError> {
        // Whether a campaign runs is judged as a hold's end is: an instance whose clock
        // runs ahead starts none early.
        let now = self.held_back_now();
        let mut routed = None;
        for (index, line) in lines.iter().enumerate() {
            if domain::campaign::is_bucket_warehouse(&line.warehouse) {
                return Err(EngineError::InvalidArgument(format!(
                    "warehouse '{}' is a campaign's: name the SKU, and the campaign's stock is used while it runs",
                    line.warehouse
                )));
            }
            let Some(route) = self.inner.campaigns.route_of(&line.sku) else {
                continue;
            };
            if route.warehouse != line.warehouse || route.phase(now) != CampaignPhase::Running {
                continue;
            }
            if routed.is_some() {
                return Err(EngineError::Refused {
                    code: ErrorCode::FailedPrecondition,
                    detail: "a request draws from one campaign at most: send each campaign's SKU in a request of its own".into(),
                });
            }
            routed = Some(Routed {
                route,
                line: index,
                units: line.quantity.get(),
                alone: lines.len() == 1,
                all_or_nothing: true,
                memory_may_refuse,
                verdict: None,
            });
        }
        Ok(routed)
    }

    /// The check of a request that names its campaign: the campaign must be of one of
    /// its lines (SKU and warehouse), and running.
    pub(crate) fn check_named_campaign(
        &self,
        id: &CampaignId,
        lines: &[ReservationLine],
    ) -> Result<(), EngineError> {
        let route = lines
            .iter()
            .filter_map(|line| {
                self.inner
                    .campaigns
                    .route_of(&line.sku)
                    .filter(|route| route.warehouse == line.warehouse)
            })
            .find(|route| &route.id == id)
            .ok_or_else(|| {
                EngineError::NotFound(format!("campaign '{id}' is not open for these SKUs"))
            })?;
        match route.phase(self.held_back_now()) {
            CampaignPhase::Scheduled => Err(EngineError::Refused {
                code: ErrorCode::CampaignNotStarted,
                detail: format!("campaign '{id}' starts at {}", route.starts_at),
            }),
            CampaignPhase::Ended => Err(EngineError::Refused {
                code: ErrorCode::FailedPrecondition,
                detail: format!("campaign '{id}' ended at {}", route.ends_at),
            }),
            CampaignPhase::Running => Ok(()),
        }
    }

    /// Runs `attempt` with the routed line in each bucket in turn, from the request's
    /// own first bucket, those this process found short within the re-check bound
    /// last; a bucket that turns out short is marked and the next one tried. The last
    /// bucket decides for good, so a refusal stored under the key is the database's
    /// word on every bucket, never memory's on some (a unit released back into a
    /// bucket known short is found). When every one is known short, the request is
    /// refused from memory, or, when memory may not refuse it
    /// (`sold_out::memory_may_refuse`, or its key holds an answer), walks them all.
    pub(crate) async fn through_buckets<Attempt, Future>(
        &self,
        claim: &IdempotencyClaim,
        routed: &Routed,
        mut attempt: Attempt,
    ) -> Result<store::Idempotent, EngineError>
    where
        Attempt: FnMut(WarehouseCode, bool) -> Future,
        Future: std::future::Future<Output = Result<store::Idempotent, EngineError>>,
    {
        let route = &routed.route;
        let recheck = self.inner.config.sold_out_recheck_milliseconds;
        let now = self.now();
        let start = first_bucket(claim, route.buckets);
        let (fresh, known_short): (Vec<u32>, Vec<u32>) = route
            .ring(start)
            .partition(|bucket| !route.known_short(*bucket, routed.units, now, recheck));
        let refused_from_memory = fresh.is_empty()
            && match routed.verdict {
                Some(SoldOutVerdict::FromMemory) => true,
                Some(SoldOutVerdict::Replay) => false,
                None => {
                    self.sold_out_verdict(claim, routed).await == Some(SoldOutVerdict::FromMemory)
                }
            };
        let walk: Vec<u32> = if refused_from_memory {
            Vec::new()
        } else {
            fresh.into_iter().chain(known_short).collect()
        };
        let Some((&last, others)) = walk.split_last() else {
            // Sold out, as far as this process knows: a key it answered before gets
            // that answer again; any other is refused without the database (one it
            // sent there before was not: `memory_may_answer`).
            if let Some(answer) = self.remembered_answer(claim) {
                return Ok(answer);
            }
            self.inner
                .campaigns
                .sold_out_from_memory
                .get_or_init(|| metrics::counter!("stockd_campaign_sold_out_from_memory_total"))
                .increment(1);
            return Err(EngineError::Refused {
                code: ErrorCode::InsufficientStock,
                detail: route.sold_out_detail(recheck),
            });
        };
        self.note_sent(claim, routed.memory_may_refuse);
        // A finding is dated when its request was sent, not when the answer came: a
        // unit given back after the database decided and before the answer arrived is
        // then hidden for at most the re-check bound, however slow the round trip.
        for bucket in others {
            let asked_at = self.now();
            match attempt(route.code.bucket_warehouse(*bucket), true).await? {
                // Left undecided only when the bucket's own line was short
                // (`plan::undecided_when_short`).
                store::Idempotent::Undecided => {
                    route.mark_short(*bucket, routed.units, asked_at);
                }
                decided => {
                    if created(&decided) {
                        route.mark_available(*bucket);
                    }
                    self.remember_answer(claim, &decided);
                    return Ok(decided);
                }
            }
        }
        let asked_at = self.now();
        let decided = attempt(route.code.bucket_warehouse(last), false).await?;
        if created(&decided) {
            route.mark_available(last);
        } else if routed.alone
            && let store::Idempotent::Executed(response) = &decided
            && crate::sold_out::is_insufficient_stock(response)
        {
            // With no other line, a refusal for stock is the bucket's: it holds fewer
            // than the line asked for. (With other lines it may be theirs; a replayed
            // refusal may be old.)
            route.mark_short(last, routed.units, asked_at);
        }
        self.remember_answer(claim, &decided);
        Ok(decided)
    }

    /// What memory makes of a request for a campaign this process knows sold out,
    /// before the campaign's line: answered from memory (the key's remembered answer,
    /// or refused when memory may answer it and the key probe finds no answer under
    /// its key), or replayed from the database (the probe found one). `None` when
    /// memory may not answer it, or the probe could not tell (its queue full, its read
    /// failed): such a request may walk every bucket, so it takes a place in the line
    /// like any other.
    pub(crate) async fn sold_out_verdict(
        &self,
        claim: &IdempotencyClaim,
        routed: &Routed,
    ) -> Option<SoldOutVerdict> {
        if self.remembered_answer(claim).is_some() {
            return Some(SoldOutVerdict::FromMemory);
        }
        if !self.memory_may_answer(claim, routed.memory_may_refuse) {
            return None;
        }
        match crate::cold(self.inner.key_probe.holds_answer(claim.key.as_str())).await {
            Some(false) => Some(SoldOutVerdict::FromMemory),
            Some(true) => Some(SoldOutVerdict::Replay),
            None => None,
        }
    }

    /// Remembers an answer this process stored now. A replay is not remembered: when
    /// its record was stored is not known here, so neither is when the database purges
    /// it (the key probe asks the database instead).
    fn remember_answer(&self, claim: &IdempotencyClaim, decided: &store::Idempotent) {
        if let store::Idempotent::Executed(response) = decided {
            self.inner.campaigns.remember(claim, response, self.now());
        }
    }

    /// [`CampaignRegistry::remembered`] now, within the idempotency retention.
    pub(crate) fn remembered_answer(&self, claim: &IdempotencyClaim) -> Option<store::Idempotent> {
        self.inner.campaigns.remembered(
            claim,
            self.now(),
            self.inner.config.idempotency_retention_seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn campaign_of(sku: &str) -> Campaign {
        let now = Timestamp::from_unix_milliseconds(1_767_225_600_000);
        let id = CampaignId::generate(now, 7);
        Campaign {
            code: domain::CampaignCode::of(&id),
            id,
            shop: domain::ShopCode::default_shop(),
            sku: SkuCode::parse(sku).unwrap(),
            warehouse: domain::WarehouseCode::default_warehouse(),
            quantity: 10,
            buckets: 2,
            per_user_limit: None,
            starts_at: now,
            ends_at: now.plus_seconds(3600),
            created_at: now,
            ended_at: None,
            closed_at: None,
            left: 10,
            held: 0,
            returned: 0,
            bucket_counts: vec![(5, 0), (5, 0)],
        }
    }

    fn registry() -> CampaignRegistry {
        CampaignRegistry::new(RoomBounds {
            in_flight_max: 1,
            places_max: 1,
        })
    }

    #[test]
    fn a_refresh_read_before_a_campaign_was_created_here_does_not_drop_its_route() {
        let registry = registry();
        let created = campaign_of("TV");
        let sku = created.sku.clone();
        let added_before_read = registry.added_so_far();

        registry.add(&created);
        registry.replace(&[], added_before_read);

        let route = registry
            .route_of(&sku)
            .expect("the route this process created");
        assert_eq!(route.id, created.id);
        // A refresh that began after the add decides: the campaign is gone there.
        registry.replace(&[], registry.added_so_far());
        assert!(registry.route_of(&sku).is_none());
    }

    #[test]
    fn adding_a_campaign_a_refresh_routed_first_keeps_that_route() {
        let registry = registry();
        let created = campaign_of("TV");
        registry.replace(std::slice::from_ref(&created), registry.added_so_far());
        let routed = registry
            .route_of(&created.sku)
            .expect("routed by the refresh");

        registry.add(&created);

        let kept = registry.route_of(&created.sku).expect("still routed");
        assert!(Arc::ptr_eq(&routed, &kept), "one route, one waiting room");
    }
}

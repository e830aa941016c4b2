//! A campaign's waiting room (入口限流 / 请求排队): at most
//! `campaign_in_flight_max` of its requests run against the database at once; the next
//! ones wait in line, first come first served, up to `campaign_waiting_room_max`;
//! beyond that a request is refused at once with `rate_limited` (and `Retry-After`).
//!
//! A caller that asks not to hold its connection (`Prefer: respond-async`) and finds
//! the line non-empty gets a ticket instead: its place in the same line, and a URL to
//! poll. The request runs when its turn comes, once, under its own idempotency key, and
//! the ticket keeps the answer for `campaign_ticket_retention_seconds`.
//!
//! A shopper holds at most one place in a campaign's line at a time, and a request for
//! more than the campaign's per-user limit never takes one: both are checked before
//! the place is given. The room lives in this process; the database stays the boundary
//! for stock and limits, so instances never need to agree on a line.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use std::future::Future;

use domain::{CampaignId, CampaignPhase, ErrorCode, Principal, TicketId, Timestamp, UserId};
use tokio::sync::oneshot;

use crate::campaigns::{CampaignRoute, Routed, SoldOutVerdict};
use crate::{Engine, EngineError, Reply};

/// Why a request got no place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoPlace {
    /// The line is as long as it may get.
    Full,
    /// This shopper already holds a place in this campaign's line.
    ShopperAlreadyWaiting,
}

/// A line of requests in front of one campaign's database path.
#[derive(Debug)]
pub struct WaitingRoom {
    in_flight_max: usize,
    places_max: usize,
    state: Mutex<RoomState>,
}

#[derive(Debug, Default)]
struct RoomState {
    /// Requests running against the database now.
    in_flight: usize,
    /// Requests waiting for their turn, in order, each with its number.
    line: VecDeque<(u64, oneshot::Sender<()>)>,
    /// Numbers handed out so far; a place's number is its position in arrival order.
    issued: u64,
    /// Shoppers holding a place (waiting or running).
    shoppers: HashSet<UserId>,
}

fn lock(state: &Mutex<RoomState>) -> std::sync::MutexGuard<'_, RoomState> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A place in the line: its number, and (until its turn) the signal that the turn came.
/// Dropping it (the caller gave up) gives the place up; a turn handed to a place that
/// was given up passes on to the next one.
#[derive(Debug)]
pub struct Place {
    room: Arc<WaitingRoom>,
    number: u64,
    turn: Option<oneshot::Receiver<()>>,
    shopper: Option<UserId>,
    /// Whether the turn went on to a [`Turn`] (which then frees the slot).
    turned: bool,
}

/// A request's turn: it may run against the database until this is dropped.
#[derive(Debug)]
pub struct Turn {
    room: Arc<WaitingRoom>,
    shopper: Option<UserId>,
}

impl WaitingRoom {
    pub fn new(in_flight_max: usize, places_max: usize) -> Arc<WaitingRoom> {
        Arc::new(WaitingRoom {
            in_flight_max: in_flight_max.max(1),
            places_max,
            state: Mutex::new(RoomState::default()),
        })
    }

    /// Takes a place for a request of `shopper` (if the request names one).
    pub fn enter(self: &Arc<Self>, shopper: Option<&UserId>) -> Result<Place, NoPlace> {
        let mut state = lock(&self.state);
        if let Some(shopper) = shopper
            && state.shoppers.contains(shopper)
        {
            return Err(NoPlace::ShopperAlreadyWaiting);
        }
        let turn = if state.in_flight < self.in_flight_max && state.line.is_empty() {
            state.in_flight += 1;
            None
        } else if state.line.len() >= self.places_max {
            return Err(NoPlace::Full);
        } else {
            let (sender, receiver) = oneshot::channel();
            state.issued += 1;
            let number = state.issued;
            state.line.push_back((number, sender));
            Some((number, receiver))
        };
        if let Some(shopper) = shopper {
            state.shoppers.insert(shopper.clone());
        }
        let (number, turn) = match turn {
            Some((number, receiver)) => (number, Some(receiver)),
            None => {
                state.issued += 1;
                (state.issued, None)
            }
        };
        Ok(Place {
            room: Arc::clone(self),
            number,
            turn,
            shopper: shopper.cloned(),
            turned: false,
        })
    }

    /// Requests waiting for their turn now.
    pub fn waiting(&self) -> usize {
        lock(&self.state).line.len()
    }

    /// Places still waiting ahead of place `number` (those given up have left the line).
    fn places_ahead(&self, number: u64) -> u64 {
        let state = lock(&self.state);
        u64::try_from(state.line.partition_point(|(waiting, _)| *waiting < number))
            .unwrap_or(u64::MAX)
    }

    /// Hands a finished request's slot to the first place still waiting, or frees it.
    fn pass_turn(&self) {
        let mut state = lock(&self.state);
        while let Some((_, sender)) = state.line.pop_front() {
            if sender.send(()).is_ok() {
                return;
            }
        }
        state.in_flight = state.in_flight.saturating_sub(1);
    }

    fn leave(&self, shopper: Option<&UserId>) {
        if let Some(shopper) = shopper {
            lock(&self.state).shoppers.remove(shopper);
        }
    }
}

impl Place {
    /// How many places are ahead of this one (0: its turn came or comes next).
    pub fn position(&self) -> u64 {
        if self.turn.is_none() {
            return 0;
        }
        self.room.places_ahead(self.number)
    }

    /// Whether the request may run at once.
    pub fn is_turn(&self) -> bool {
        self.turn.is_none()
    }

    /// Waits for this place's turn.
    pub async fn turn(mut self) -> Turn {
        if let Some(turn) = self.turn.as_mut() {
            // The sender stays in the line until it is used or the room drops it; a
            // wait cancelled here leaves the receiver for `drop` to settle.
            let _ = turn.await;
        }
        self.turn = None;
        self.turned = true;
        Turn {
            room: Arc::clone(&self.room),
            shopper: self.shopper.take(),
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.turned {
            return;
        }
        if let Some(mut turn) = self.turn.take() {
            // Given up while waiting: if the turn was handed over meanwhile, pass it on;
            // otherwise the place leaves the line at once. Under the room's lock, so a
            // turn is either handed over before the close or finds the place gone. A
            // place given up that stayed in the line until its turn (counted apart)
            // let callers who time out and retry grow the line without bound.
            let handed_over = {
                let mut state = lock(&self.room.state);
                turn.close();
                let handed_over = turn.try_recv().is_ok();
                if !handed_over
                    && let Ok(index) = state
                        .line
                        .binary_search_by_key(&self.number, |(number, _)| *number)
                {
                    state.line.remove(index);
                }
                handed_over
            };
            if handed_over {
                self.room.pass_turn();
            }
        } else {
            // Given up at its turn, without running.
            self.room.pass_turn();
        }
        self.room.leave(self.shopper.as_ref());
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.room.leave(self.shopper.as_ref());
        self.room.pass_turn();
    }
}

/// Keys of requests holding a place in a campaign's line, waiting for their turn, each
/// with how many places it holds and the ticket it was given, if any. Bounded by the
/// lines' places: an entry lives as long as its place waits.
#[derive(Debug, Default)]
pub struct WaitingKeys {
    /// Places counted here, so the common case (no line) reads no map.
    places: std::sync::atomic::AtomicUsize,
    keys: Mutex<HashMap<String, WaitingEntry>>,
}

#[derive(Debug, Default)]
struct WaitingEntry {
    places: usize,
    /// The first waiting request's fingerprint: another request under the same key is
    /// not that request.
    fingerprint: String,
    ticket: Option<TicketId>,
}

/// A request found waiting under a key.
struct Waiting {
    fingerprint: String,
    ticket: Option<TicketId>,
}

impl WaitingKeys {
    fn enter(keys: &Arc<WaitingKeys>, key: &str, fingerprint: &str) -> WaitingKey {
        let mut held = keys
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = held.entry(key.to_owned()).or_insert_with(|| WaitingEntry {
            fingerprint: fingerprint.to_owned(),
            ..WaitingEntry::default()
        });
        entry.places += 1;
        keys.places
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        WaitingKey {
            keys: Arc::clone(keys),
            key: key.to_owned(),
        }
    }

    /// Whether a request under `key` waits in a line now.
    pub(crate) fn contains(&self, key: &str) -> bool {
        self.places.load(std::sync::atomic::Ordering::SeqCst) > 0
            && self
                .keys
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .contains_key(key)
    }

    /// A request under `key` waiting in a line now, with its fingerprint and its
    /// ticket if it was given one.
    fn waiting(&self, key: &str) -> Option<Waiting> {
        if self.places.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            return None;
        }
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(key)
            .map(|entry| Waiting {
                fingerprint: entry.fingerprint.clone(),
                ticket: entry.ticket.clone(),
            })
    }
}

/// A waiting request's key in [`WaitingKeys`], until its turn comes or it gives up.
#[derive(Debug)]
struct WaitingKey {
    keys: Arc<WaitingKeys>,
    key: String,
}

impl WaitingKey {
    /// Records the ticket the waiting request was given: the same request sent again
    /// while it waits hears this ticket.
    fn note_ticket(&self, ticket: &TicketId) {
        if let Some(entry) = self
            .keys
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get_mut(&self.key)
        {
            entry.ticket = Some(ticket.clone());
        }
    }
}

impl Drop for WaitingKey {
    fn drop(&mut self) {
        let mut held = self
            .keys
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(entry) = held.get_mut(&self.key) {
            entry.places -= 1;
            if entry.places == 0 {
                held.remove(&self.key);
            }
        }
        self.keys
            .places
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What a ticket says now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TicketState {
    /// Waiting for its turn, with this many places ahead.
    Waiting { position: u64 },
    /// Its request ran; this is its answer (kept until the retention passes).
    Answered(Result<Reply, EngineError>),
}

/// A ticket as its holder reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketView {
    pub id: TicketId,
    pub campaign: CampaignId,
    pub issued_at: Timestamp,
    pub state: TicketState,
}

#[derive(Debug)]
struct TicketEntry {
    owner: Principal,
    campaign: CampaignId,
    issued_at: Timestamp,
    room: Arc<WaitingRoom>,
    number: u64,
    answer: Option<(Result<Reply, EngineError>, Timestamp)>,
}

/// The tickets this process handed out: waiting ones, and answered ones until their
/// retention passes (or, beyond `answered_max`, oldest first).
#[derive(Debug, Default)]
pub struct Tickets {
    state: Mutex<TicketsState>,
}

#[derive(Debug, Default)]
struct TicketsState {
    by_id: HashMap<TicketId, TicketEntry>,
    /// Answered tickets, oldest answer first.
    answered: VecDeque<TicketId>,
}

impl Tickets {
    fn lock(&self) -> std::sync::MutexGuard<'_, TicketsState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn issue(
        &self,
        id: TicketId,
        owner: Principal,
        campaign: CampaignId,
        place: &Place,
        now: Timestamp,
    ) {
        self.lock().by_id.insert(
            id,
            TicketEntry {
                owner,
                campaign,
                issued_at: now,
                room: Arc::clone(&place.room),
                number: place.number,
                answer: None,
            },
        );
    }

    /// Keeps a ticket's answer; drops answered tickets past `retention_seconds` or
    /// beyond `answered_max`.
    pub fn answer(
        &self,
        id: &TicketId,
        reply: Result<Reply, EngineError>,
        now: Timestamp,
        retention_seconds: i64,
        answered_max: usize,
    ) {
        let mut state = self.lock();
        if let Some(entry) = state.by_id.get_mut(id) {
            entry.answer = Some((reply, now));
            state.answered.push_back(id.clone());
        }
        state.forget_answered_past(now, retention_seconds, answered_max);
    }

    /// Forgets a ticket whose request could not run (the process is stopping).
    pub fn forget(&self, id: &TicketId) {
        self.lock().by_id.remove(id);
    }

    /// The ticket, if it exists, `principal` holds it (anyone else: `None`, as if it
    /// did not exist) and, answered, its answer is at most `retention_seconds` old: the
    /// answers are also dropped here, not only when another ticket is answered, or the
    /// last ones of a campaign would be kept, and served, for ever.
    pub fn view(
        &self,
        id: &TicketId,
        principal: &Principal,
        now: Timestamp,
        retention_seconds: i64,
    ) -> Option<TicketView> {
        let mut state = self.lock();
        state.forget_answered_past(now, retention_seconds, usize::MAX);
        let entry = state
            .by_id
            .get(id)
            .filter(|entry| entry.owner == *principal)?;
        let ticket_state = match &entry.answer {
            Some((reply, _)) => TicketState::Answered(reply.clone()),
            None => TicketState::Waiting {
                position: entry.room.places_ahead(entry.number),
            },
        };
        Some(TicketView {
            id: id.clone(),
            campaign: entry.campaign.clone(),
            issued_at: entry.issued_at,
            state: ticket_state,
        })
    }

    /// Tickets held now (waiting or answered), for the gauge.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl TicketsState {
    /// Drops answered tickets, oldest answer first, past `retention_seconds` or beyond
    /// `answered_max`.
    fn forget_answered_past(
        &mut self,
        now: Timestamp,
        retention_seconds: i64,
        answered_max: usize,
    ) {
        while let Some(oldest) = self.answered.front().cloned() {
            let expired = self
                .by_id
                .get(&oldest)
                .and_then(|entry| entry.answer.as_ref())
                .is_none_or(|(_, at)| {
                    now.unix_milliseconds() - at.unix_milliseconds() > retention_seconds * 1_000
                });
            if !expired && self.answered.len() <= answered_max {
                break;
            }
            self.answered.pop_front();
            self.by_id.remove(&oldest);
        }
    }
}

/// A request on a running campaign: answered now, or waiting with a ticket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    Answered(Reply),
    Waiting(TicketView),
}

impl Held {
    /// The answer of a request that was not allowed to wait with a ticket.
    pub fn answered(self) -> Result<Reply, EngineError> {
        match self {
            Held::Answered(reply) => Ok(reply),
            Held::Waiting(ticket) => Err(EngineError::Internal(format!(
                "ticket '{}' handed to a caller that did not ask for one",
                ticket.id
            ))),
        }
    }
}

/// A request on a running campaign, as it comes to the campaign's line.
pub(crate) struct LineRequest<'a> {
    pub principal: &'a Principal,
    /// The use case, whose stored answers a refusal at the door looks up.
    pub operation: &'static str,
    pub claim: &'a store::IdempotencyClaim,
    pub routed: &'a Routed,
    pub shopper: Option<&'a UserId>,
    /// The request named the campaign (`campaign_id`): once the campaign ended, it is
    /// refused rather than decided from regular stock.
    pub named_campaign: bool,
    /// `Prefer: respond-async`: a ticket rather than a wait with the connection open.
    pub respond_async: bool,
}

impl Engine {
    /// Runs `decide` for a request on a running campaign once its turn in the
    /// campaign's line comes: at once while fewer than the in-flight bound run; after
    /// waiting in line otherwise (the connection held), or with a ticket when the
    /// caller asked for one (`respond_async`). Checked before a place is taken: a
    /// campaign this process knows sold out (answered from memory, no place), the
    /// per-user limit against the line's quantity, one place per shopper.
    pub(crate) async fn through_line<Decide, Decided>(
        &self,
        request: LineRequest<'_>,
        decide: Decide,
    ) -> Result<Held, EngineError>
    where
        Decide: FnOnce(Option<Routed>) -> Decided + Send + 'static,
        Decided: Future<Output = Result<Reply, EngineError>> + Send + 'static,
    {
        let LineRequest {
            principal,
            operation,
            claim,
            routed,
            shopper,
            named_campaign,
            respond_async,
        } = request;
        let route = &routed.route;
        let quantity = routed.units;
        let now = self.now();
        let recheck = self.inner.config.sold_out_recheck_milliseconds;
        if route.known_sold_out(quantity, now, recheck)
            && let Some(verdict) = self.sold_out_verdict(claim, routed).await
            // The key probe may have waited: a finding that expired or was cleared
            // meanwhile lets the buckets be walked, which takes a place like any walk.
            && (verdict == SoldOutVerdict::Replay
                || route.known_sold_out(quantity, self.now(), recheck))
        {
            // No place for a request the buckets cannot serve: `decide` answers it from
            // memory (or replays the key's first answer) without the database, or,
            // when the key probe finds the key answered elsewhere, asks the database
            // for that answer (one round trip). A request memory cannot judge takes a
            // place below: it may walk every bucket.
            let mut routed = routed.clone();
            routed.verdict = Some(verdict);
            return decide(Some(routed)).await.map(Held::Answered);
        }
        if let Some(limit) = route.per_user_limit {
            // Refusals a request's own shape decides. Its key may hold an answer from
            // before the campaign started (a hold from regular stock, bigger than the
            // limit or without a user): a retry hears that answer, not this refusal.
            let refusal = if shopper.is_none() {
                Some(EngineError::Refused {
                    code: ErrorCode::FailedPrecondition,
                    detail: format!(
                        "sku '{}' has a per-user limit in campaign '{}': the request must name its user_id",
                        route.sku, route.id
                    ),
                })
            } else if quantity > limit {
                Some(EngineError::Refused {
                    code: ErrorCode::PurchaseLimitExceeded,
                    detail: format!(
                        "campaign '{}' sells at most {limit} of sku '{}' per user; requested {quantity}",
                        route.id, route.sku
                    ),
                })
            } else {
                None
            };
            if let Some(refusal) = refusal {
                // The key probe first, as memory's other refusals ask it: a flood of
                // malformed requests costs its batched reads, not a read each. Not
                // for a queued command: its refusal is stored, for its redelivery.
                if !claim.key.is_queue_intake()
                    && crate::cold(self.inner.key_probe.holds_answer(claim.key.as_str())).await
                        == Some(false)
                {
                    return Err(refusal);
                }
                return crate::cold(self.first_answer_or(operation, claim, refusal))
                    .await
                    .map(Held::Answered);
            }
            // A key this process answered gets its answer again; any other request of
            // a shopper found at the limit is refused without a place.
            if let Some(shopper) = shopper
                && route.known_at_limit(shopper, quantity, now, recheck)
                && self.remembered_answer(claim).is_none()
                && self
                    .memory_may_refuse_now(claim, routed.memory_may_refuse)
                    .await
            {
                return Err(EngineError::Refused {
                    code: ErrorCode::PurchaseLimitExceeded,
                    detail: format!(
                        "user '{shopper}' holds or bought campaign '{}'s limit of {limit} (this instance found it within the last {recheck} ms; not recorded under the key)",
                        route.id
                    ),
                });
            }
        }
        // The same request sent again while it waits (its 202 was lost, or it was sent
        // twice) takes no second place: one client resending could otherwise fill
        // the line. It hears its ticket again, or that it is still in progress.
        if let Some(waiting) = self
            .inner
            .campaigns
            .waiting_keys
            .waiting(claim.key.as_str())
        {
            // Another request under the same key is not the waiting one's resend.
            if waiting.fingerprint != claim.fingerprint {
                return Err(EngineError::IdempotencyKeyReused);
            }
            let view = waiting.ticket.filter(|_| respond_async).and_then(|id| {
                self.inner.campaigns.tickets.view(
                    &id,
                    principal,
                    now,
                    self.inner.config.campaign_ticket_retention_seconds,
                )
            });
            return match view {
                Some(view) => Ok(Held::Waiting(view)),
                None => Err(EngineError::RequestInProgress),
            };
        }
        let entered = route.room.enter(shopper).map_err(|refusal| {
            metrics::counter!("stockd_campaign_admission_refused_total").increment(1);
            let detail = match refusal {
                NoPlace::Full => format!(
                    "campaign '{}' has {} requests waiting here; retry after the Retry-After seconds",
                    route.id,
                    route.room.waiting()
                ),
                NoPlace::ShopperAlreadyWaiting => format!(
                    "user '{}' already has a request waiting or running in campaign '{}'",
                    shopper.map(UserId::as_str).unwrap_or_default(),
                    route.id
                ),
            };
            EngineError::Refused {
                code: ErrorCode::RateLimited,
                detail,
            }
        });
        let place = match entered {
            Ok(place) => place,
            // A retry of a request that was answered (its 201 lost on the way) hears
            // that answer, not that the line is full: refused until the line empties,
            // its hold's time would run out unconfirmed. The key probe first, as for
            // memory's refusals: a crowd refused at a full line costs batched reads.
            Err(refusal)
                if crate::cold(self.inner.key_probe.holds_answer(claim.key.as_str())).await
                    == Some(false) =>
            {
                return Err(refusal);
            }
            // No answer, or none could be read (the probe could not tell either): the
            // line is full all the same, and nothing was done.
            Err(refusal) => {
                return match crate::cold(self.first_answer(operation, claim)).await {
                    Ok(Some(first)) => Ok(Held::Answered(first)),
                    Ok(None) | Err(_) => Err(refusal),
                };
            }
        };
        // While the request waits for its turn, a retry of its key is not refused from
        // memory: the waiting request could still hold a unit given back meanwhile and
        // store a 201 under the key memory said "sold out" to. At its turn the key
        // leaves the waiting set, and memory may answer the request itself as any.
        let waiting = (!place.is_turn()).then(|| {
            WaitingKeys::enter(
                &self.inner.campaigns.waiting_keys,
                claim.key.as_str(),
                &claim.fingerprint,
            )
        });
        if place.is_turn() || !respond_async {
            let turn = place.turn().await;
            drop(waiting);
            return self
                .decide_at_turn(turn, operation, claim, routed, named_campaign, decide)
                .await
                .map(Held::Answered);
        }
        let id = TicketId::generate(now, rand::random());
        let tickets = &self.inner.campaigns.tickets;
        tickets.issue(id.clone(), principal.clone(), route.id.clone(), &place, now);
        if let Some(waiting) = &waiting {
            waiting.note_ticket(&id);
        }
        metrics::counter!("stockd_campaign_tickets_issued_total").increment(1);
        let view = tickets
            .view(
                &id,
                principal,
                now,
                self.inner.config.campaign_ticket_retention_seconds,
            )
            .ok_or_else(|| EngineError::Internal(format!("ticket '{id}' vanished")))?;
        let engine = self.clone();
        let routed = routed.clone();
        let claim = claim.clone();
        self.inner.ticket_tasks.spawn(async move {
            let turn = place.turn().await;
            drop(waiting);
            // A ticket is answered exactly once, a panic included: unanswered, it
            // would say WAITING for ever and never leave the tickets' memory. What the
            // request committed stays under its key, for a retry to hear.
            let deciding = engine.decide_at_turn(
                turn,
                operation,
                &claim,
                &routed,
                named_campaign,
                decide,
            );
            let answer = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
                deciding,
            ))
            .await
            .unwrap_or_else(|_| {
                tracing::error!(ticket = %id, "a ticket's request panicked");
                Err(EngineError::Internal(
                    "the request failed unexpectedly; a retry with its Idempotency-Key hears what it did"
                        .to_owned(),
                ))
            });
            let config = &engine.inner.config;
            engine.inner.campaigns.tickets.answer(
                &id,
                answer,
                engine.now(),
                config.campaign_ticket_retention_seconds,
                config.campaign_tickets_answered_max,
            );
        });
        Ok(Held::Waiting(view))
    }

    /// Decides a request whose turn in the campaign's line came, by the campaign's
    /// phase now, not at its arrival: a request that waited past the campaign's end
    /// takes no campaign unit. It goes to regular stock as one arriving now would,
    /// or, when it named the campaign, is refused without storing the refusal (a
    /// retry hears the key's first answer, if any). The turn ends with the decision;
    /// what went through the campaign teaches its route about the shopper.
    ///
    /// The end is the one this process routes by now, not the one the request's
    /// route carried when it arrived: an end moved earlier (`POST …/end`, here or on
    /// another instance) replaces the route, and the requests waiting in the old
    /// route's line would otherwise still walk the campaign's buckets.
    async fn decide_at_turn<Decide, Decided>(
        &self,
        turn: Turn,
        operation: &'static str,
        claim: &store::IdempotencyClaim,
        routed: &Routed,
        named_campaign: bool,
        decide: Decide,
    ) -> Result<Reply, EngineError>
    where
        Decide: FnOnce(Option<Routed>) -> Decided,
        Decided: Future<Output = Result<Reply, EngineError>>,
    {
        let route = &routed.route;
        let now = self.held_back_now();
        let current = self
            .campaign_route(&route.sku)
            .filter(|current| current.id == route.id);
        let ends_at = current
            .as_ref()
            .map_or(route.ends_at, |current| current.ends_at.min(route.ends_at));
        let running = route.phase(now) == CampaignPhase::Running
            && current.is_some_and(|current| current.phase(now) == CampaignPhase::Running);
        if running {
            // A finding is dated when its request was sent, not answered: a hold
            // released while the request was in flight is not outlived by more than
            // the bound (as the buckets' findings are dated).
            let sent_at = self.now();
            let answer = decide(Some(routed.clone())).await;
            // The turn's shopper is the request's: it took the place.
            let shopper = turn.shopper.clone();
            drop(turn);
            route.learn_from(shopper.as_ref(), routed, &answer, sent_at);
            return answer;
        }
        let answer = if named_campaign {
            let refusal = EngineError::Refused {
                code: ErrorCode::FailedPrecondition,
                detail: format!(
                    "campaign '{}' ended at {} while the request waited its turn",
                    route.id, ends_at
                ),
            };
            crate::cold(self.first_answer_or(operation, claim, refusal)).await
        } else {
            decide(None).await
        };
        drop(turn);
        answer
    }

    /// The open campaign of `sku` as this process routes by it, with its waiting
    /// room (for tests that hold its line still).
    pub fn campaign_route(&self, sku: &domain::SkuCode) -> Option<Arc<CampaignRoute>> {
        self.inner.campaigns.route_of(sku)
    }

    /// The units of `sku` a shopper's reservation could take now, for the product view
    /// ([`domain::campaign::shopper_available`], by the campaigns this process routes).
    pub fn shopper_available(&self, sku: &domain::Sku) -> i64 {
        let running = self
            .campaign_route(&sku.code)
            .filter(|route| route.phase(self.held_back_now()) == CampaignPhase::Running);
        domain::campaign::shopper_available(
            sku.stock
                .iter()
                .map(|level| (&level.warehouse, level.available)),
            running
                .as_ref()
                .map(|route| (&route.code, &route.warehouse)),
        )
    }

    /// Whether a campaign this process routes on `sku` starts or ends within
    /// `horizon_milliseconds` after `from` (a time taken before the view was read). The
    /// product view changes at that moment with no event (nothing is written then), so
    /// no cached copy may outlive it.
    pub fn shopper_view_changes_within(
        &self,
        sku: &domain::SkuCode,
        from: Timestamp,
        horizon_milliseconds: i64,
    ) -> bool {
        let Some(route) = self.campaign_route(sku) else {
            return false;
        };
        let until = from.plus_milliseconds(horizon_milliseconds);
        [route.starts_at, route.ends_at]
            .into_iter()
            .any(|moment| moment > from && moment <= until)
    }

    /// The waiting room of the campaign open on `sku` in this process, if any.
    pub fn campaign_waiting_room(&self, sku: &domain::SkuCode) -> Option<Arc<WaitingRoom>> {
        self.campaign_route(sku)
            .map(|route| Arc::clone(&route.room))
    }

    /// `GET /v1/tickets/{id}`: a ticket of this caller's, waiting or answered.
    pub fn ticket(&self, principal: &Principal, id: &TicketId) -> Result<TicketView, EngineError> {
        self.inner
            .campaigns
            .tickets
            .view(
                id,
                principal,
                self.now(),
                self.inner.config.campaign_ticket_retention_seconds,
            )
            .ok_or_else(|| {
                EngineError::NotFound(format!(
                    "ticket '{id}' does not exist here (tickets live in the instance that issued them; retry the request with its Idempotency-Key)"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str) -> UserId {
        UserId::parse(name).expect("a valid user id")
    }

    #[tokio::test]
    async fn places_beyond_the_in_flight_bound_wait_and_are_served_in_order() {
        let room = WaitingRoom::new(1, 10);
        let first = room.enter(None).expect("a place");
        assert!(first.is_turn());
        let second = room.enter(None).expect("a place");
        let third = room.enter(None).expect("a place");
        assert_eq!((second.position(), third.position()), (0, 1));
        let running = first.turn().await;
        let (order_sender, mut order) = tokio::sync::mpsc::unbounded_channel();
        for (name, place) in [("third", third), ("second", second)] {
            let order_sender = order_sender.clone();
            tokio::spawn(async move {
                let turn = place.turn().await;
                order_sender.send(name).expect("the test listens");
                drop(turn);
            });
        }
        tokio::task::yield_now().await;
        drop(running);
        assert_eq!(order.recv().await, Some("second"));
        assert_eq!(order.recv().await, Some("third"));
        assert_eq!(room.waiting(), 0);
    }

    #[tokio::test]
    async fn a_full_line_refuses_and_a_place_given_up_passes_its_turn_on() {
        let room = WaitingRoom::new(1, 1);
        let running = room.enter(None).expect("a place").turn().await;
        let waiting = room.enter(None).expect("a place in line");
        assert_eq!(room.enter(None).map(|_| ()), Err(NoPlace::Full));
        drop(waiting);
        let next = room.enter(None).expect("the place given up is free again");
        drop(running);
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(5), next.turn())
                .await
                .is_ok(),
            "the freed slot reaches the next place"
        );
    }

    #[tokio::test]
    async fn places_given_up_leave_the_line_at_once_however_many_come_and_go() {
        let room = WaitingRoom::new(1, 1);
        let running = room.enter(None).expect("a place").turn().await;
        let alice = user("alice");
        for _ in 0..10_000 {
            let waiting = room.enter(Some(&alice)).expect("a place in line");
            drop(waiting);
            assert!(lock(&room.state).line.len() <= 1);
        }
        assert_eq!(room.waiting(), 0);
        let next = room.enter(None).expect("a place in line");
        let later = room.enter(None);
        assert_eq!(later.map(|_| ()), Err(NoPlace::Full));
        drop(running);
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(5), next.turn())
                .await
                .is_ok(),
            "the slot reaches the one place left in the line"
        );
    }

    #[tokio::test]
    async fn a_shopper_holds_one_place_at_a_time() {
        let room = WaitingRoom::new(4, 4);
        let alice = user("alice");
        let turn = room.enter(Some(&alice)).expect("a place").turn().await;
        assert_eq!(
            room.enter(Some(&alice)).map(|_| ()),
            Err(NoPlace::ShopperAlreadyWaiting)
        );
        assert!(room.enter(Some(&user("bob"))).is_ok());
        drop(turn);
        assert!(
            room.enter(Some(&alice)).is_ok(),
            "after her turn she may line up again"
        );
    }
}

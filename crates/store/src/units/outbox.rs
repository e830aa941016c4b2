//! The transactional outbox (DESIGN.md principle 12; migrations `*_outbox.sql`).
//!
//! Every state change appends its event here in its own transaction
//! ([`append_event`], and each backend's reservation writer for
//! `reservation.created`). Nothing is published from a request handler: afterwards
//! the sequencer ([`Units::sequence_events`]) numbers the rows it finds committed, in
//! the order it finds them, and the pull feed and the NATS relay read by that number.
//! Ids are assigned before a commit, so following them would skip a row whose
//! transaction commits late; positions are handed out by one sequencer at a time
//! (it locks its `outbox_relay` row), so what a reader can see of them is always a
//! prefix. Serves every backend.

use domain::{Aggregate, EventType, FeedCursor, ReservationLine, ShopCode, Timestamp, event_id};
use serde_json::{Value, json};

use super::Units;
use super::decode::{corrupt, expect_one_row};
use crate::backend::{Backend, Dialect, Finish, NewReservation};
use crate::error::StoreError;
use crate::sql::{Connection, Row, built_statement, statement};

/// The relay names `outbox_relay` holds a row for.
pub const SEQUENCER: &str = "sequencer";
pub const NATS_RELAY: &str = "nats";

/// Events per sequencer step, feed page and relay claim.
pub const EVENTS_PER_STEP_MAX: i64 = 1_000;

/// Where an event stands in its aggregate's numbering.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sequence {
    /// A number the aggregate's own row already counts under its lock (a reservation's
    /// one move out of `RESERVED` is 2, after its `reservation.created`; an order's
    /// event is its version after the change, 1 at creation).
    Known(i64),
    /// The next number of `outbox_sequence`'s counter, for aggregates without one of
    /// their own (stock, SKUs, payment attempts).
    Counted,
}

/// An event to append in the caller's transaction.
#[derive(Debug, Clone)]
pub(crate) struct NewEvent<'a> {
    pub(crate) event_type: EventType,
    pub(crate) aggregate_id: &'a str,
    pub(crate) shop: &'a str,
    pub(crate) sequence: Sequence,
    pub(crate) data: Value,
}

/// Appends one event in the caller's transaction.
pub(crate) async fn append_event<C: Dialect>(
    transaction: &mut C,
    event: NewEvent<'_>,
    now: Timestamp,
) -> Result<(), StoreError> {
    let aggregate = event.event_type.aggregate();
    let sequence = match event.sequence {
        Sequence::Known(sequence) => sequence,
        Sequence::Counted => {
            transaction
                .next_event_sequence(aggregate.as_str(), event.aggregate_id)
                .await?
        }
    };
    statement(
        "INSERT INTO outbox (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(aggregate.as_str())
    .bind(event.aggregate_id)
    .bind(sequence)
    .bind(event.event_type.as_str())
    .bind(event.shop)
    .bind(event.data.to_string())
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

/// Announces `sku.changed`: the `fields` of the SKU (or, with `product`, of its
/// product) a change set, for the display cache and the feed's readers.
pub(crate) async fn announce_sku_changed<C: Dialect>(
    transaction: &mut C,
    sku: &str,
    shop: &str,
    product: Option<&str>,
    fields: &[&str],
    now: Timestamp,
) -> Result<(), StoreError> {
    append_event(
        transaction,
        NewEvent {
            event_type: EventType::SkuChanged,
            aggregate_id: sku,
            shop,
            sequence: Sequence::Counted,
            data: json!({
                "sku": sku,
                "shop": shop,
                "product_id": product,
                "fields": fields,
            }),
        },
        now,
    )
    .await
}

/// The body of a `reservation.created` event, from the reservation's own rows.
fn reservation_created(
    id: &str,
    shop: &str,
    user: Option<&str>,
    order: Option<&str>,
    lines: &[ReservationLine],
) -> Value {
    json!({
        "reservation_id": id,
        "shop": shop,
        "user_id": user,
        "order_id": order,
        "lines": lines_json(lines),
    })
}

/// A reservation's lines as its events carry them.
pub(crate) fn lines_json(lines: &[ReservationLine]) -> Value {
    Value::Array(
        lines
            .iter()
            .map(|line| {
                json!({
                    "sku": line.sku.as_str(),
                    "warehouse": line.warehouse.as_str(),
                    "quantity": line.quantity.get(),
                })
            })
            .collect(),
    )
}

/// Appends the `reservation.created` event rows of new reservations with one
/// multi-row insert (the MySQL reservation writer; SQLite's and PostgreSQL's write
/// them from the parameters their reservation rows travel in). The rows carry no body: it is the
/// reservation's own rows, written in the same transaction and never changed, read
/// when the event is ([`Units::events_after`]). Building it here, under the hot row's
/// lock, cost the hot path a quarter.
pub(crate) async fn append_reservations_created<C: Connection>(
    connection: &mut C,
    reservations: &[NewReservation<'_>],
    now: Timestamp,
) -> Result<(), StoreError> {
    const COLUMNS: usize = 3;
    for chunk in reservations.chunks(200) {
        let mut text = String::from(
            "INSERT INTO outbox (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at) VALUES ",
        );
        for index in 0..chunk.len() {
            let base = index * COLUMNS;
            if index > 0 {
                text.push_str(", ");
            }
            text.push_str(&format!(
                "('reservation', ${}, 1, 'reservation.created', ${}, NULL, ${})",
                base + 1,
                base + 2,
                base + 3
            ));
        }
        let mut insert = built_statement(text);
        for reservation in chunk {
            insert = insert
                .bind(reservation.id.as_str())
                .bind(reservation.shop.as_str())
                .bind(now.unix_milliseconds());
        }
        insert.execute(&mut *connection).await?;
    }
    Ok(())
}

/// An event as the feed and the relay carry it.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedEvent {
    /// Its commit-ordered position (the feed's cursor).
    pub position: i64,
    pub id: String,
    pub event_type: EventType,
    pub aggregate: Aggregate,
    pub aggregate_id: String,
    pub sequence: i64,
    pub shop: String,
    pub occurred_at: Timestamp,
    pub data: Value,
}

impl PublishedEvent {
    /// The JSON body of the contract: `{id, type, aggregate, aggregate_id, sequence,
    /// occurred_at, data}`.
    pub fn body(&self) -> Value {
        json!({
            "id": self.id,
            "type": self.event_type.as_str(),
            "aggregate": self.aggregate.as_str(),
            "aggregate_id": self.aggregate_id,
            "sequence": self.sequence,
            "occurred_at": self.occurred_at,
            "data": self.data,
        })
    }
}

fn decode_event(row: &Row) -> Result<PublishedEvent, StoreError> {
    let aggregate: String = row.try_get("aggregate")?;
    let aggregate = Aggregate::parse(&aggregate).map_err(|error| corrupt("aggregate", error))?;
    let event_type: String = row.try_get("event_type")?;
    let event_type = EventType::parse(&event_type).map_err(|error| corrupt("event type", error))?;
    let aggregate_id: String = row.try_get("aggregate_id")?;
    let sequence: i64 = row.try_get("sequence")?;
    let payload: Option<String> = row.try_get("payload")?;
    let data = match payload {
        Some(payload) => {
            serde_json::from_str(&payload).map_err(|error| corrupt("event payload", error))?
        }
        // Filled from the reservation's rows by `with_reservation_bodies`.
        None if event_type == EventType::ReservationCreated => Value::Null,
        None => return Err(corrupt("event payload", "missing")),
    };
    Ok(PublishedEvent {
        position: row.try_get("position")?,
        id: event_id(aggregate, &aggregate_id, sequence),
        event_type,
        aggregate,
        aggregate_id,
        sequence,
        shop: row.try_get("shop")?,
        occurred_at: Timestamp::from_unix_milliseconds(row.try_get("occurred_at")?),
        data,
    })
}

/// Fills the bodies of `reservation.created` events from their reservations' rows
/// (two queries for the page, whatever its size).
async fn with_reservation_bodies<C: Connection>(
    connection: &mut C,
    events: &mut [PublishedEvent],
) -> Result<(), StoreError> {
    let ids: Vec<&str> = events
        .iter()
        .filter(|event| event.data.is_null())
        .map(|event| event.aggregate_id.as_str())
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    let placeholders: Vec<String> = (1..=ids.len()).map(|index| format!("${index}")).collect();
    let placeholders = placeholders.join(", ");
    let mut reservations = built_statement(format!(
        "SELECT id, shop, user_id, order_id FROM reservation WHERE id IN ({placeholders})"
    ));
    let mut lines = built_statement(format!(
        "SELECT reservation_id, sku, warehouse, quantity FROM reservation_line \
         WHERE reservation_id IN ({placeholders}) ORDER BY reservation_id, line_number"
    ));
    for id in &ids {
        reservations = reservations.bind(*id);
        lines = lines.bind(*id);
    }
    type ReservationRow = (String, Option<String>, Option<String>, Option<String>);
    let reservations: Vec<ReservationRow> = reservations.fetch_all_as(&mut *connection).await?;
    let line_rows = lines.fetch_all_rows(&mut *connection).await?;
    let mut lines_of: std::collections::HashMap<String, Vec<ReservationLine>> =
        std::collections::HashMap::new();
    for row in &line_rows {
        let reservation: String = row.try_get("reservation_id")?;
        lines_of
            .entry(reservation)
            .or_default()
            .push(super::reservations::decode_line(row)?);
    }
    let bodies: std::collections::HashMap<String, Value> = reservations
        .into_iter()
        .map(|(id, shop, user, order)| {
            let lines = lines_of.remove(&id).unwrap_or_default();
            let body = reservation_created(
                &id,
                shop.as_deref().unwrap_or(ShopCode::DEFAULT),
                user.as_deref(),
                order.as_deref(),
                &lines,
            );
            (id, body)
        })
        .collect();
    for event in events.iter_mut().filter(|event| event.data.is_null()) {
        event.data = bodies
            .get(&event.aggregate_id)
            .cloned()
            .ok_or_else(|| corrupt("reservation.created", "its reservation is missing"))?;
    }
    Ok(())
}

/// A sequencer step's transaction ([`Backend::sequence_waiting_events`]): reads the
/// sequencer's row (locked until the commit), numbers up to `limit` events after its
/// last position, advances it and commits.
pub(crate) async fn sequence_waiting_events<B: Backend>(
    backend: &B,
    limit: i64,
) -> Result<u64, StoreError> {
    let mut transaction = backend.begin_write().await?;
    let last: i64 = statement(<B::Connection as Dialect>::SELECT_SEQUENCER_FOR_UPDATE)
        .fetch_one_scalar(&mut *transaction)
        .await?;
    let numbered = transaction.number_waiting_events(last, limit).await?;
    if numbered == 0 {
        transaction.rollback().await?;
        return Ok(0);
    }
    let advanced = statement(
        "UPDATE outbox_relay SET through_position = $1 WHERE name = 'sequencer' AND through_position = $2",
    )
    .bind(last + i64::try_from(numbered).unwrap_or(i64::MAX))
    .bind(last)
    .execute(&mut *transaction)
    .await?;
    expect_one_row(advanced, "advancing the sequencer")?;
    transaction.commit().await?;
    Ok(numbered)
}

/// What waits in the outbox for a reader: rows not yet numbered or (with a relay)
/// not yet acknowledged, and how long the oldest has waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxBacklog {
    pub pending: i64,
    pub oldest_occurred_at: Option<Timestamp>,
}

/// The most rows not numbered yet that the backlog gauge counts: past it the gauge
/// reads this many plus what the relay has not sent (a count of its own would cost a
/// read of every row, every second).
pub const OUTBOX_BACKLOG_COUNTED_MAX: i64 = 100_000;

/// A relay's lease as read, with whether numbered events wait past its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayPeek {
    pub holder: Option<String>,
    pub lease_until: Timestamp,
    pub events_waiting: bool,
}

/// The sequencer's last position: the newest numbered event's.
const SEQUENCER_POSITION: &str =
    "SELECT through_position FROM outbox_relay WHERE name = 'sequencer'";

impl<B: Backend> Units<B> {
    /// One sequencer step: numbers up to `limit` committed rows that have no position
    /// yet, in write order, after the last position handed out. Answers how many it
    /// numbered. Concurrent sequencers wait for each other on their `outbox_relay` row.
    pub async fn sequence_events(&self, limit: i64) -> Result<u64, StoreError> {
        let limit = limit.clamp(1, EVENTS_PER_STEP_MAX);
        // A read first: an idle outbox costs no write transaction (SQLite's one
        // writer is shared with the hot path).
        let waiting: Option<i64> =
            statement("SELECT id FROM outbox WHERE position IS NULL ORDER BY id LIMIT 1")
                .fetch_optional_scalar(&mut *self.writer_read_connection().await?)
                .await?;
        if waiting.is_none() {
            return Ok(0);
        }
        self.backend.sequence_waiting_events(limit).await
    }

    /// Up to `limit` numbered events after `cursor`, in position order: all of them,
    /// or one shop's.
    pub async fn events_after(
        &self,
        cursor: FeedCursor,
        shop: Option<&ShopCode>,
        limit: i64,
    ) -> Result<Vec<PublishedEvent>, StoreError> {
        let limit = limit.clamp(1, EVENTS_PER_STEP_MAX);
        let mut connection = self.writer_read_connection().await?;
        let rows = match shop {
            None => statement(
                "SELECT position, aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at \
                 FROM outbox WHERE position > $1 ORDER BY position LIMIT $2",
            )
            .bind(cursor.position())
            .bind(limit),
            Some(shop) => statement(
                "SELECT position, aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at \
                 FROM outbox WHERE shop = $3 AND position > $1 ORDER BY position LIMIT $2",
            )
            .bind(cursor.position())
            .bind(limit)
            .bind(shop.as_str()),
        }
        .fetch_all_rows(&mut *connection)
        .await?;
        let mut events: Vec<PublishedEvent> =
            rows.iter().map(decode_event).collect::<Result<_, _>>()?;
        with_reservation_bodies(&mut *connection, &mut events).await?;
        Ok(events)
    }

    /// The last position handed out (0 before the first): where a reader that wants
    /// only what happens from now on starts.
    pub async fn latest_event_position(&self) -> Result<i64, StoreError> {
        statement(SEQUENCER_POSITION)
            .fetch_one_scalar(&mut *self.writer_read_connection().await?)
            .await
    }

    /// The position of the oldest numbered event still kept, or the next one to be
    /// handed out when none is: positions run without a gap, so a reader whose cursor
    /// is before this less one missed events that were pruned.
    pub async fn first_kept_event_position(&self) -> Result<i64, StoreError> {
        let mut connection = self.writer_read_connection().await?;
        let oldest: Option<i64> =
            statement("SELECT MIN(position) FROM outbox WHERE position IS NOT NULL")
                .fetch_one_scalar(&mut *connection)
                .await?;
        match oldest {
            Some(oldest) => Ok(oldest),
            None => {
                let latest: i64 = statement(SEQUENCER_POSITION)
                    .fetch_one_scalar(&mut *connection)
                    .await?;
                Ok(latest + 1)
            }
        }
    }

    /// The products these SKUs belong to (standalone SKUs have none).
    pub async fn products_of_skus(&self, skus: &[String]) -> Result<Vec<String>, StoreError> {
        if skus.is_empty() {
            return Ok(Vec::new());
        }
        let mut text = String::from(
            "SELECT DISTINCT product_id FROM sku WHERE product_id IS NOT NULL AND code IN (",
        );
        for index in 0..skus.len() {
            if index > 0 {
                text.push_str(", ");
            }
            text.push_str(&format!("${}", index + 1));
        }
        text.push(')');
        let mut query = built_statement(text);
        for sku in skus {
            query = query.bind(sku.as_str());
        }
        query
            .fetch_all_scalar(&mut *self.writer_read_connection().await?)
            .await
    }

    /// What a reader still has to take: the rows not numbered yet, and those after the
    /// position the NATS relay acknowledged when this instance relays (`relay`) or any
    /// instance held the relay's lease since `relay_seen_since` (as pruning counts it
    /// a reader): an instance without NATS still shows the relay's backlog, so a fleet
    /// whose relaying instances are all gone says so long before pruning, three days
    /// on, deletes what the relay never sent.
    pub async fn outbox_backlog(
        &self,
        relay: Option<&str>,
        relay_seen_since: Timestamp,
    ) -> Result<OutboxBacklog, StoreError> {
        // Each read is an index lookup or a bounded count: the gauge runs every second
        // on every instance, in the sequencer's loop, and its backlog is largest (NATS
        // down for an hour in a sale: millions of events) when it must not slow the
        // sequencer down. Counting the unsent rows themselves cost a scan of all of
        // them.
        let mut connection = self.writer_read_connection().await?;
        // The relay's first, then the sequencer's: the relay never passes the
        // sequencer, so the difference read in this order is never negative.
        let relay_through: Option<i64> = statement(
            "SELECT through_position FROM outbox_relay \
             WHERE name = $1 AND ($2 = 1 OR lease_until >= $3)",
        )
        .bind(relay.unwrap_or(NATS_RELAY))
        .bind(i64::from(relay.is_some()))
        .bind(relay_seen_since.unix_milliseconds())
        .fetch_optional_scalar(&mut *connection)
        .await?;
        let numbered_through: i64 = statement(SEQUENCER_POSITION)
            .fetch_one_scalar(&mut *connection)
            .await?;
        let waiting = statement(
            "SELECT COUNT(*) AS pending, MIN(occurred_at) AS oldest FROM \
             (SELECT occurred_at FROM outbox WHERE position IS NULL ORDER BY id LIMIT $1) AS waiting",
        )
        .bind(OUTBOX_BACKLOG_COUNTED_MAX)
        .fetch_one_row(&mut *connection)
        .await?;
        let unnumbered: i64 = waiting.try_get("pending")?;
        let mut oldest: Option<i64> = waiting.try_get("oldest")?;
        // Positions run without a gap and pruning keeps what the relay has not sent:
        // what it has not sent is the difference, and the first of it the oldest (an
        // event's time is its request's start, so a later one may be older by at most
        // a request's duration).
        let unsent = relay_through.map_or(0, |through| (numbered_through - through).max(0));
        if let Some(through) = relay_through.filter(|_| unsent > 0) {
            let first: Option<i64> =
                statement("SELECT occurred_at FROM outbox WHERE position = $1")
                    .bind(through + 1)
                    .fetch_optional_scalar(&mut *connection)
                    .await?;
            oldest = match (oldest, first) {
                (Some(waiting), Some(first)) => Some(waiting.min(first)),
                (waiting, first) => waiting.or(first),
            };
        }
        Ok(OutboxBacklog {
            pending: unnumbered + unsent,
            oldest_occurred_at: oldest.map(Timestamp::from_unix_milliseconds),
        })
    }

    /// Deletes up to `limit` events that occurred before `before` and that every
    /// reader took: numbered, and acknowledged by the NATS relay when this instance
    /// relays (`relay`), or when any instance held the relay's lease since `before`:
    /// an instance started without NATS beside ones with it must not delete what the
    /// relay has not sent yet.
    ///
    /// Only a prefix of the numbered events goes, the oldest positions first, up to
    /// the first one that is still young: an event's time is its request's start and
    /// positions follow commits, so a later position can be older, and deleting it
    /// before an earlier one would leave a hole in the middle of the feed that the
    /// stale-cursor check (everything before the oldest kept position is gone) could
    /// not see.
    pub async fn prune_events(
        &self,
        before: Timestamp,
        relay: Option<&str>,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let mut transaction = self.begin_write().await?;
        let through: Option<i64> = statement(
            "SELECT MIN(through_position) FROM outbox_relay WHERE name = $1 \
             OR (name = $2 AND ($3 = 1 OR lease_until >= $4))",
        )
        .bind(SEQUENCER)
        .bind(NATS_RELAY)
        .bind(i64::from(relay.is_some()))
        .bind(before.unix_milliseconds())
        .fetch_one_scalar(&mut *transaction)
        .await?;
        let first: Option<i64> =
            statement("SELECT MIN(position) FROM outbox WHERE position IS NOT NULL")
                .fetch_one_scalar(&mut *transaction)
                .await?;
        let (Some(through), Some(first)) = (through, first) else {
            transaction.rollback().await?;
            return Ok(0);
        };
        let last = through.min(first.saturating_add(limit.clamp(1, EVENTS_PER_STEP_MAX) - 1));
        let young: Option<i64> = statement(
            "SELECT MIN(position) FROM outbox WHERE position >= $1 AND position <= $2 \
             AND occurred_at >= $3",
        )
        .bind(first)
        .bind(last)
        .bind(before.unix_milliseconds())
        .fetch_one_scalar(&mut *transaction)
        .await?;
        let last = young.map_or(last, |young| young - 1);
        if last < first {
            transaction.rollback().await?;
            return Ok(0);
        }
        let deleted = statement("DELETE FROM outbox WHERE position >= $1 AND position <= $2")
            .bind(first)
            .bind(last)
            .execute(&mut *transaction)
            .await?;
        transaction.commit().await?;
        Ok(deleted)
    }

    /// The relay's lease and whether events wait for it, read without a write: a
    /// relay whose step has nothing to do need not renew a lease far from its end.
    pub async fn peek_relay(&self, relay: &str) -> Result<RelayPeek, StoreError> {
        let mut connection = self.writer_read_connection().await?;
        // The relay's row first, then the sequencer's: the relay never passes the
        // sequencer, so a read in this order never finds it ahead.
        let row = statement(
            "SELECT holder, lease_until, through_position FROM outbox_relay WHERE name = $1",
        )
        .bind(relay)
        .fetch_one_row(&mut *connection)
        .await?;
        let numbered_through: i64 = statement(SEQUENCER_POSITION)
            .fetch_one_scalar(&mut *connection)
            .await?;
        let through: i64 = row.try_get("through_position")?;
        Ok(RelayPeek {
            holder: row.try_get("holder")?,
            lease_until: Timestamp::from_unix_milliseconds(row.try_get("lease_until")?),
            events_waiting: numbered_through > through,
        })
    }

    /// Takes or renews the relay's lease for `holder` until `lease_until`; answers the
    /// position the relay acknowledged last, or `None` while another holder's lease
    /// runs.
    pub async fn claim_relay(
        &self,
        relay: &str,
        holder: &str,
        now: Timestamp,
        lease_until: Timestamp,
    ) -> Result<Option<i64>, StoreError> {
        let mut transaction = self.begin_write().await?;
        let claimed = statement(
            "UPDATE outbox_relay SET holder = $2, lease_until = $3 \
             WHERE name = $1 AND (holder = $2 OR holder IS NULL OR lease_until <= $4)",
        )
        .bind(relay)
        .bind(holder)
        .bind(lease_until.unix_milliseconds())
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        if claimed == 0 {
            transaction.rollback().await?;
            return Ok(None);
        }
        let through: i64 = statement("SELECT through_position FROM outbox_relay WHERE name = $1")
            .bind(relay)
            .fetch_one_scalar(&mut *transaction)
            .await?;
        transaction.commit().await?;
        Ok(Some(through))
    }

    /// Records that the relay's destination acknowledged every event through
    /// `position`, if `holder` still holds the lease. Answers whether it did: a relay
    /// whose lease was taken over leaves the record to its successor.
    pub async fn mark_relayed(
        &self,
        relay: &str,
        holder: &str,
        position: i64,
    ) -> Result<bool, StoreError> {
        let mut transaction = self.begin_write().await?;
        let marked = statement(
            "UPDATE outbox_relay SET through_position = $3 \
             WHERE name = $1 AND holder = $2 AND through_position < $3",
        )
        .bind(relay)
        .bind(holder)
        .bind(position)
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(marked == 1)
    }

    /// Gives the relay's lease up (a relay that stops cleanly, or stands aside), so
    /// another instance need not wait for it to run out. The lease ends `now`, not at
    /// time zero: pruning reads when a relay last held it ([`Units::prune_events`]), and
    /// a relay standing aside for a few seconds must not look retired.
    pub async fn release_relay(
        &self,
        relay: &str,
        holder: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        statement(
            "UPDATE outbox_relay SET holder = NULL, \
             lease_until = CASE WHEN lease_until > $3 THEN $3 ELSE lease_until END \
             WHERE name = $1 AND holder = $2",
        )
        .bind(relay)
        .bind(holder)
        .bind(now.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(())
    }
}

//! The outbox relay to NATS JetStream (issue 16), against a real `nats-server -js` of
//! each test's own: every event reaches stream `STOCKD_EVENTS` once, in position
//! order, with `Nats-Msg-Id` = its id; a relay dropped mid-publish loses nothing and
//! repeats only ids JetStream drops; two relays on one database take turns; with NATS
//! down events wait (and the gauges show them) while sales go on, and arrive in order
//! when it is back; events are pruned only after every reader took them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use acceptance::nats::TestNats;
use acceptance::{Backend, Call, TestApp, mirrored_tests, send_concurrently};
use bus::Outgoing;
use engine::relay::{EventRelay, RelayRead, RelayStep};
use serde_json::json;

mirrored_tests!(
    every_event_reaches_the_stream_once_in_commit_order,
    a_relay_dropped_mid_publish_loses_nothing_and_repeats_only_ids_jetstream_drops,
    two_relays_on_one_database_take_turns_and_publish_each_event_once,
    events_wait_while_nats_is_down_and_arrive_in_order_when_it_is_back,
    events_are_pruned_after_the_retention_only_once_the_relay_took_them,
    a_deleted_event_stream_is_created_again_and_the_events_go_on,
    a_relay_that_cannot_reach_nats_gives_its_lease_to_one_that_can,
    a_relay_that_cannot_read_its_events_gives_its_lease_up,
    a_relay_paused_past_its_lease_publishes_nothing_its_successor_took_over,
    a_relay_whose_lease_renewal_waited_half_the_lease_sends_nothing,
    an_instance_without_nats_shows_what_the_relay_has_not_sent,
    an_instance_whose_clock_runs_ahead_does_not_take_a_lease_that_has_not_ended,
    each_relayed_event_names_its_shop_in_a_header,
    an_event_the_stream_refuses_is_named_and_the_later_ones_wait_behind_it,
    an_idle_relay_writes_nothing_until_half_its_lease_has_passed,
);

// Reads a counter of the process-wide metrics recorder.
acceptance::mirrored_tests_alone!(events_pruned_before_any_relay_took_them_are_counted_as_skipped);

/// Relay steps until one publishes nothing; answers the steps' total.
/// A time to send until that no test reaches.
fn far_off() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(3600)
}

async fn relay_all(app: &TestApp, relay: &EventRelay) -> RelayStep {
    app.sequence_all_events().await;
    let mut total = RelayStep::default();
    for _ in 0..1_000 {
        let step = app.engine.relay_step(relay).await.expect("relay step");
        assert!(step.failure.is_none(), "{step:?}");
        total.published += step.published;
        total.duplicates += step.duplicates;
        if step.published == 0 {
            return total;
        }
    }
    panic!("the relay kept publishing");
}

/// The ids of the events on `STOCKD_EVENTS`, in the stream's order.
async fn stored_ids(nats: &TestNats) -> Vec<String> {
    nats.stream_messages("STOCKD_EVENTS")
        .await
        .into_iter()
        .map(|(_, id, _)| id)
        .collect()
}

async fn reserve_many(app: &TestApp, prefix: &str, count: usize) {
    let calls: Vec<Call> = (0..count)
        .map(|index| {
            Call::post("/v1/reservations")
                .key(format!("{prefix}-{index}"))
                .json(&json!({"lines": [{"sku": "TEA", "quantity": 1}]}))
        })
        .collect();
    for response in send_concurrently(app, calls).await {
        assert_eq!(response.status, 201, "{response:?}");
    }
}

/// The stream holds exactly the feed's events, in the feed's order, each once, on its
/// subject and with its id as `Nats-Msg-Id`.
async fn assert_stream_is_the_feed(nats: &TestNats, app: &TestApp) {
    let feed = app.all_events().await;
    let stream = nats.stream_messages("STOCKD_EVENTS").await;
    let ids: HashSet<&str> = stream.iter().map(|(_, id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), stream.len(), "each event once on the stream");
    assert_eq!(stream.len(), feed.len(), "every event, nothing else");
    for ((subject, id, body), event) in stream.iter().zip(&feed) {
        assert_eq!(body, event, "the stream's order is the feed's");
        assert_eq!(id, event["id"].as_str().unwrap());
        assert_eq!(
            subject,
            &format!("stockd.events.{}", event["type"].as_str().unwrap())
        );
        for field in [
            "id",
            "type",
            "aggregate",
            "aggregate_id",
            "sequence",
            "occurred_at",
            "data",
        ] {
            assert!(body.get(field).is_some(), "{field} in {body}");
        }
    }
}

async fn every_event_reaches_the_stream_once_in_commit_order(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "first", 25).await;
    let one = app.reserve("to-release", &[("TEA", 2)]).await.json()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(app.release(&one, "release").await.status, 200);

    let step = relay_all(&app, &relay).await;

    assert_eq!(step.published, 28, "receive, 26 reservations, one release");
    assert_eq!(step.duplicates, 0);
    assert_stream_is_the_feed(&nats, &app).await;
    let backlog = app.engine.outbox_gauges_step().await.unwrap();
    assert_eq!(backlog.pending, 0, "JetStream acknowledged everything");
}

async fn a_relay_dropped_mid_publish_loses_nothing_and_repeats_only_ids_jetstream_drops(
    backend: Backend,
) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "before", 20).await;
    app.sequence_all_events().await;
    // A relay published the first ten events and died before recording them.
    let bus = nats.bus().await;
    bus.ensure_event_stream().await.unwrap();
    let first_ten: Vec<Outgoing> = app.all_events().await[..10]
        .iter()
        .map(|event| Outgoing {
            subject: format!("stockd.events.{}", event["type"].as_str().unwrap()),
            message_id: event["id"].as_str().unwrap().to_owned(),
            body: serde_json::to_vec(event).unwrap().into(),
            ordering_key: format!("{}/{}", event["aggregate"], event["aggregate_id"]),
            shop: None,
        })
        .collect();
    assert_eq!(
        bus.publish_in_order(&first_ten, far_off())
            .await
            .acknowledged,
        10
    );
    // Another relay is dropped in the middle of a step (its task cancelled wherever
    // it happens to be), holding the lease.
    let dropped = Arc::new(EventRelay::new(nats.bus().await, "relay-dropped"));
    let task = {
        let engine = app.engine.clone();
        let dropped = Arc::clone(&dropped);
        tokio::spawn(async move { engine.relay_step(&dropped).await })
    };
    tokio::task::yield_now().await;
    task.abort();
    let _ = task.await;
    reserve_many(&app, "after", 5).await;

    // Its successor takes over once the lease ran out.
    let successor = EventRelay::new(nats.bus().await, "relay-successor");
    app.clock.advance_seconds(60);
    let step = relay_all(&app, &successor).await;

    assert!(step.duplicates >= 10, "the ten went out again: {step:?}");
    assert_stream_is_the_feed(&nats, &app).await;
}

async fn two_relays_on_one_database_take_turns_and_publish_each_event_once(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    let other = app.another_instance().await;
    app.stocked_sku("TEA", 200).await;
    let relays: Vec<(TestApp, Arc<EventRelay>)> = vec![
        (
            app.clone(),
            Arc::new(EventRelay::new(nats.bus().await, "relay-a")),
        ),
        (
            other.clone(),
            Arc::new(EventRelay::new(nats.bus().await, "relay-b")),
        ),
    ];
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = relays
        .iter()
        .map(|(instance, relay)| {
            let (instance, relay, done) = (instance.clone(), Arc::clone(relay), Arc::clone(&done));
            instance.engine.attach_event_relay();
            tokio::spawn(async move {
                let (mut waited, mut duplicates) = (0, 0);
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    instance.engine.sequence_step().await.unwrap();
                    let step = instance.engine.relay_step(&relay).await.unwrap();
                    if step.waiting_for_lease {
                        waited += 1;
                    }
                    duplicates += step.duplicates;
                    tokio::task::yield_now().await;
                }
                (waited, duplicates)
            })
        })
        .collect();
    reserve_many(&app, "raced", 60).await;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut steps = Vec::new();
    for task in tasks {
        steps.push(task.await.unwrap());
    }

    assert!(
        steps.iter().any(|(waited, _)| *waited > 0),
        "one relay waited for the other's lease: {steps:?}"
    );
    // Both stop cleanly (giving the lease up); one of them finishes what is left.
    for (instance, relay) in &relays {
        instance.engine.release_relay(relay).await.unwrap();
    }
    let last = relay_all(&relays[1].0, &relays[1].1).await;
    // The stream keeps one copy of an id whoever sent it twice (its duplicate window):
    // only JetStream's own count of repeats shows that no event went out twice.
    let sent_twice: usize = steps.iter().map(|(_, duplicates)| duplicates).sum();
    assert_eq!(sent_twice + last.duplicates, 0, "{steps:?} {last:?}");
    assert_stream_is_the_feed(&nats, &app).await;
}

async fn events_wait_while_nats_is_down_and_arrive_in_order_when_it_is_back(backend: Backend) {
    let mut nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    app.stocked_sku("TEA", 100).await;
    relay_all(&app, &relay).await;

    nats.stop();
    acceptance::wait_until("the relay saw NATS go", || !relay.bus().is_connected()).await;
    let went_down_at = engine::Clock::now(&app.clock);
    reserve_many(&app, "while-down", 10).await;
    app.sequence_all_events().await;
    let step = app.engine.relay_step(&relay).await.unwrap();
    assert_eq!(step.published, 0);
    assert!(step.failure.is_some(), "{step:?}");
    app.clock.advance_seconds(30);
    // Two more the sequencer has not numbered yet: they wait too.
    reserve_many(&app, "not-numbered-yet", 2).await;
    let backlog = app.engine.outbox_gauges_step().await.unwrap();
    assert_eq!(backlog.pending, 12, "the events wait in the outbox");
    assert_eq!(
        backlog.oldest_occurred_at,
        Some(went_down_at),
        "the oldest is the first the relay has not sent"
    );
    // Sales go on without NATS.
    assert_eq!(
        app.reserve("still-selling", &[("TEA", 1)]).await.status,
        201
    );

    nats.start_again().await;
    acceptance::wait_until("the relay reconnected", || relay.bus().is_connected()).await;
    let step = relay_all(&app, &relay).await;

    assert_eq!(step.published, 13);
    assert_stream_is_the_feed(&nats, &app).await;
    assert_eq!(app.engine.outbox_gauges_step().await.unwrap().pending, 0);
}

async fn events_are_pruned_after_the_retention_only_once_the_relay_took_them(backend: Backend) {
    let mut nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "published", 4).await;
    relay_all(&app, &relay).await;
    nats.stop();
    acceptance::wait_until("the relay saw NATS go", || !relay.bus().is_connected()).await;
    reserve_many(&app, "unpublished", 3).await;
    app.sequence_all_events().await;

    assert_eq!(
        app.engine.outbox_prune_step().await.unwrap(),
        0,
        "within the retention"
    );
    app.clock.advance_seconds(4 * 24 * 3600);
    let pruned = app.engine.outbox_prune_step().await.unwrap();

    assert_eq!(pruned, 5, "the receive and the four published reservations");
    let left = app.all_events().await;
    assert_eq!(left.len(), 3, "the unpublished ones wait: {left:?}");
    assert!(
        left.iter()
            .all(|event| event["type"] == "reservation.created")
    );
}

async fn a_deleted_event_stream_is_created_again_and_the_events_go_on(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "before", 2).await;
    assert_eq!(relay_all(&app, &relay).await.published, 3);
    nats.delete_stream("STOCKD_EVENTS").await;
    reserve_many(&app, "after", 2).await;
    app.sequence_all_events().await;

    // The first step finds the stream gone; a bounded number of steps later the
    // events are on a new one.
    let mut published = 0;
    for _ in 0..10 {
        let step = app.engine.relay_step(&relay).await.expect("relay step");
        if step.failure.is_some() {
            // Alone, the relay that failed claims the lease again once it stood aside.
            app.clock
                .advance_milliseconds(app.engine.config().relay_stand_aside_milliseconds);
        }
        published += step.published;
        if published == 2 {
            break;
        }
    }

    assert_eq!(published, 2);
    let stream = nats.stream_messages("STOCKD_EVENTS").await;
    assert_eq!(
        stream.len(),
        2,
        "the new stream holds the events since: {stream:?}"
    );
    assert_eq!(app.engine.outbox_gauges_step().await.unwrap().pending, 0);
}

async fn a_relay_that_cannot_reach_nats_gives_its_lease_to_one_that_can(backend: Backend) {
    let mut unreachable = TestNats::start().await;
    let reachable = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    let other = app.another_instance().await;
    app.engine.attach_event_relay();
    other.engine.attach_event_relay();
    let cut_off = EventRelay::new(unreachable.bus().await, "relay-cut-off");
    unreachable.stop();
    acceptance::wait_until("the relay saw its NATS go", || {
        !cut_off.bus().is_connected()
    })
    .await;
    let connected = EventRelay::new(reachable.bus().await, "relay-connected");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "sold", 3).await;
    app.sequence_all_events().await;

    let failed = app.engine.relay_step(&cut_off).await.unwrap();
    assert!(failed.failure.is_some(), "{failed:?}");
    let taken_over = relay_all(&other, &connected).await;

    assert_eq!(
        taken_over.published, 4,
        "the receive and three reservations"
    );
    assert_stream_is_the_feed(&reachable, &app).await;
    let aside = app.engine.relay_step(&cut_off).await.unwrap();
    assert!(aside.standing_aside, "{aside:?}");
    app.clock
        .advance_milliseconds(app.engine.config().relay_stand_aside_milliseconds);
    let later = app.engine.relay_step(&cut_off).await.unwrap();
    assert!(
        later.waiting_for_lease,
        "the instance that reaches NATS keeps the lease: {later:?}"
    );
}

/// An instance that cannot read the events it is to publish (here an event of a kind
/// this version does not know, as a newer version writes during a rolling upgrade)
/// gives the lease up instead of renewing it at every step while no event moves: the
/// other instance claims it at once.
async fn a_relay_that_cannot_read_its_events_gives_its_lease_up(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    let other = app.another_instance().await;
    app.engine.attach_event_relay();
    other.engine.attach_event_relay();
    let first = EventRelay::new(nats.bus().await, "relay-first");
    let second = EventRelay::new(nats.bus().await, "relay-second");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "sold", 2).await;
    app.sequence_all_events().await;
    let mut connection = app.database.raw_connection().await;
    let original = connection
        .texts("SELECT event_type FROM outbox WHERE position = 1")
        .await;
    let unknown = "UPDATE outbox SET event_type = 'stock.weighed' WHERE position = 1";
    connection.execute(unknown).await.unwrap();

    let failed = app.engine.relay_step(&first).await;
    let next = other.engine.relay_step(&second).await;

    // Each failed on the event itself, not on something else: the other instance took
    // the lease at once and met the same event.
    for step in [&failed, &next] {
        let error = format!("{:?}", step.as_ref().expect_err("the step fails"));
        assert!(error.contains("stock.weighed"), "{error}");
    }
    // Once the event reads again (the fleet upgraded), the events go on in order.
    let known = format!(
        "UPDATE outbox SET event_type = '{}' WHERE position = 1",
        original[0].as_deref().expect("an event type")
    );
    connection.execute(&known).await.unwrap();
    other
        .clock
        .advance_milliseconds(other.engine.config().relay_stand_aside_milliseconds);
    let relayed = relay_all(&other, &second).await;
    assert_eq!(relayed.published, 3, "the receive and two reservations");
    assert_stream_is_the_feed(&nats, &app).await;
}

/// Found in review: the relay's publish pipelines a batch, and JetStream stores each
/// message on its own, so a message refused (here too large for the stream an operator
/// configured) or lost with the connection let the next ones of the same aggregate be
/// stored before it: a consumer saw a reservation released before it was created. No
/// two messages of one aggregate are in flight at once now: after a failure, none of
/// its later ones is stored, while other aggregates' may be.
#[tokio::test]
async fn a_message_that_fails_keeps_the_later_ones_of_its_aggregate_off_the_stream() {
    let nats = TestNats::start().await;
    nats.create_event_stream_with_message_size_max(1024).await;
    let bus = nats.bus().await;
    let message = |id: &str, aggregate: &str, size: usize| Outgoing {
        subject: "stockd.events.reservation.created".to_owned(),
        message_id: id.to_owned(),
        body: vec![b'x'; size].into(),
        ordering_key: aggregate.to_owned(),
        shop: None,
    };

    let published = bus
        .publish_in_order(
            &[
                message("first", "reservation/A", 10),
                message("too-large", "reservation/B", 2048),
                message("after-it-elsewhere", "reservation/C", 10),
                message("after-it-same", "reservation/B", 10),
            ],
            far_off(),
        )
        .await;

    assert_eq!(published.acknowledged, 1, "{published:?}");
    assert!(
        matches!(published.failure, Some(bus::BusError::Refused(_))),
        "{published:?}"
    );
    let stored = stored_ids(&nats).await;
    assert!(
        !stored.iter().any(|id| id == "after-it-same"),
        "the same aggregate's later message waits for the failed one: {stored:?}"
    );
    assert_eq!(stored[0], "first", "{stored:?}");
}

/// Found in review: the lease was checked when a step began and when it recorded, not
/// when it published. A relay paused between its read and its publish (a stalled
/// database read, a stopped process) for longer than its lease published a batch its
/// successor had already published and recorded: past JetStream's duplicate window,
/// old events again after newer ones. The lease is renewed before publishing now.
async fn a_relay_paused_past_its_lease_publishes_nothing_its_successor_took_over(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "before", 3).await;
    app.sequence_all_events().await;
    let paused = EventRelay::new(nats.bus().await, "relay-paused");
    let RelayRead::Batch { through, events } = app.engine.relay_read(&paused).await.unwrap() else {
        panic!("the paused relay read a batch");
    };
    assert_eq!(events.len(), 4, "the receipt and three reservations");

    app.clock
        .advance_milliseconds(app.engine.config().relay_lease_milliseconds + 1);
    let successor = EventRelay::new(nats.bus().await, "relay-successor");
    assert_eq!(relay_all(&app, &successor).await.published, 4);
    let resumed = app
        .engine
        .relay_publish(&paused, through, &events)
        .await
        .unwrap();

    assert_eq!(resumed.published, 0, "{resumed:?}");
    assert_eq!(resumed.duplicates, 0, "nothing sent again: {resumed:?}");
    assert!(resumed.waiting_for_lease, "{resumed:?}");
    assert_stream_is_the_feed(&nats, &app).await;
}

/// Found in review: the relay sends for half its lease, but timed that half from when
/// the renewal came back: a renewal that waited (for a pooled connection, a
/// synchronous standby's commit, here the lease's row held by another session) moved
/// the sends past the lease the database recorded, where a successor may publish too.
/// The half now runs from before the renewal. (SQLite: no session waits for a row.)
async fn a_relay_whose_lease_renewal_waited_half_the_lease_sends_nothing(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let lease_milliseconds = 1_000;
    let config = engine::EngineConfig {
        relay_lease_milliseconds: lease_milliseconds,
        ..acceptance::test_engine_config()
    };
    let nats = TestNats::start().await;
    let app = TestApp::spawn_with_lock_timeout(backend, config, 10_000).await;
    app.engine.attach_event_relay();
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "waiting", 3).await;
    app.sequence_all_events().await;
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    let RelayRead::Batch { through, events } = app.engine.relay_read(&relay).await.unwrap() else {
        panic!("the relay read a batch");
    };
    let mut holder = app.database.raw_connection().await;
    holder.execute("BEGIN").await.unwrap();
    holder
        .execute("SELECT through_position FROM outbox_relay WHERE name = 'nats' FOR UPDATE")
        .await
        .unwrap();

    let (step, ()) = tokio::join!(app.engine.relay_publish(&relay, through, &events), async {
        app.database
            .wait_until_blocked_for(
                &mut holder,
                Duration::from_millis(lease_milliseconds as u64 / 2 + 100),
            )
            .await;
        holder.execute("ROLLBACK").await.unwrap();
    });

    let step = step.unwrap();
    assert_eq!(step.published, 0, "{step:?}");
    assert!(nats.stream_messages("STOCKD_EVENTS").await.is_empty());
    // The next step, not kept waiting, sends them.
    assert_eq!(relay_all(&app, &relay).await.published, 4);
    assert_stream_is_the_feed(&nats, &app).await;
}

/// Found in review: with no relay holding the lease within the retention (NATS
/// configured again after a long pause), events are pruned unpublished, and the relay
/// then went on after the gap without a word. It is counted and logged once, when the
/// batch after the gap is recorded. A relay that never published anything starts from
/// the oldest kept event without counting a gap: that is its first start.
async fn events_pruned_before_any_relay_took_them_are_counted_as_skipped(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "before-nats", 2).await;
    app.sequence_all_events().await;
    app.clock.advance_seconds(4 * 24 * 3600);
    assert_eq!(app.engine.outbox_prune_step().await.unwrap(), 3);
    reserve_many(&app, "first-relayed", 2).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    assert_eq!(relay_all(&app, &relay).await.published, 2);
    assert_eq!(
        skipped_counted(&app).await.as_deref(),
        Some("0"),
        "a first start counts no gap"
    );

    // NATS is switched off for longer than the retention: the instances running
    // meanwhile relay nothing, and prune what came.
    let without_nats = app.another_instance().await;
    reserve_many(&app, "while-stopped", 3).await;
    app.sequence_all_events().await;
    app.clock.advance_seconds(4 * 24 * 3600);
    assert_eq!(without_nats.engine.outbox_prune_step().await.unwrap(), 5);
    reserve_many(&app, "after", 2).await;

    assert_eq!(relay_all(&app, &relay).await.published, 2);
    assert_eq!(skipped_counted(&app).await.as_deref(), Some("3"));
}

/// Found in review: an instance without NATS counted only the events not numbered
/// yet, so once every relaying instance was gone the fleet's backlog gauges said 0 and
/// `StockdOutboxStalled` never fired, until pruning deleted the unsent events three
/// days on. While the relay is a reader (its lease held within the retention), every
/// instance counts what it has not sent.
async fn an_instance_without_nats_shows_what_the_relay_has_not_sent(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "relayed", 2).await;
    relay_all(&app, &relay).await;
    // The relaying instance is gone; one without NATS goes on selling.
    let without_nats = app.another_instance().await;
    reserve_many(&without_nats, "unsent", 3).await;
    without_nats.sequence_all_events().await;
    app.clock.advance_seconds(120);

    let backlog = without_nats.engine.outbox_gauges_step().await.unwrap();

    assert_eq!(backlog.pending, 3, "{backlog:?}");
    assert!(backlog.oldest_occurred_at.is_some(), "{backlog:?}");
    // Past the retention the relay is no reader any more: pruning goes on without
    // it, and the backlog is what the feed has not numbered.
    app.clock.advance_seconds(4 * 24 * 3600);
    assert_eq!(
        without_nats
            .engine
            .outbox_gauges_step()
            .await
            .unwrap()
            .pending,
        0
    );
}

/// `stockd_outbox_events_skipped_total`'s value on the metrics page, if present.
async fn skipped_counted(app: &TestApp) -> Option<String> {
    let metrics = app.send(Call::get("/metrics").admin()).await.body;
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("stockd_outbox_events_skipped_total "))
        .map(str::to_owned)
}

/// Found in review: a relay renewed its lease once and then sent its batch for as long
/// as the acknowledgements took (a slow NATS, a long chain of one aggregate's events),
/// past its lease: its successor published the same events and newer ones meanwhile,
/// and the old relay's late sends, past JetStream's duplicate window, were stored again
/// after them. Nothing is sent once the time to send has run out (checked right before
/// each send, after any wait for an acknowledgement), and that is no failure: the rest
/// goes out at the next step.
#[tokio::test]
async fn nothing_is_sent_once_the_time_to_send_has_run_out() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    bus.ensure_event_stream().await.unwrap();
    let message = |id: &str| Outgoing {
        subject: "stockd.events.reservation.created".to_owned(),
        message_id: id.to_owned(),
        body: b"{}".to_vec().into(),
        ordering_key: "reservation/A".to_owned(),
        shop: None,
    };

    let late = bus
        .publish_in_order(&[message("late")], tokio::time::Instant::now())
        .await;
    let in_time = bus.publish_in_order(&[message("in-time")], far_off()).await;

    assert_eq!(late.acknowledged, 0, "{late:?}");
    assert!(late.ran_out_of_time, "{late:?}");
    assert_eq!(
        late.failure, None,
        "not a failure: the rest goes out next step"
    );
    assert_eq!(in_time.acknowledged, 1, "{in_time:?}");
    let stored = stored_ids(&nats).await;
    assert_eq!(stored, ["in-time"]);
}

/// Found in review: the relay's lease was told by each instance's own clock, so an
/// instance whose clock ran ahead by more than the lease took it over from a holder
/// still publishing. It is told by the clock held back by how far the instance was
/// last seen ahead of the database server's.
async fn an_instance_whose_clock_runs_ahead_does_not_take_a_lease_that_has_not_ended(
    backend: Backend,
) {
    if backend == Backend::Sqlite {
        // One process holds the database: its clock is the only one.
        return;
    }
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.clock_at_the_databases();
    app.engine.attach_event_relay();
    app.stocked_sku("TEA", 100).await;
    app.sequence_all_events().await;
    let holder = EventRelay::new(nats.bus().await, "relay-holder");
    assert_eq!(relay_all(&app, &holder).await.published, 1);
    // Another instance, whose clock runs 20 s ahead of the database server's: by it,
    // the holder's 15 s lease has ended.
    let ahead = app.another_instance().await;
    ahead.engine.attach_event_relay();
    ahead.clock_runs_ahead_of_the_database(20).await;
    reserve_many(&app, "later", 1).await;
    app.sequence_all_events().await;

    let taker = EventRelay::new(nats.bus().await, "relay-ahead");
    let step = ahead.engine.relay_step(&taker).await.expect("relay step");

    assert!(step.waiting_for_lease, "{step:?}");
    assert_eq!(step.published, 0, "{step:?}");
}

/// Found in review: every shop's events go out on the same subjects with nothing naming
/// the shop, so a consumer could not keep its own shop's without reading each body's
/// data. Each carries the shop its feed filters by, as header `Stockd-Shop`.
async fn each_relayed_event_names_its_shop_in_a_header(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-shops");
    app.stocked_sku("TEA", 100).await;
    reserve_many(&app, "shop", 2).await;

    relay_all(&app, &relay).await;

    let stream = nats.stream_messages_with_headers("STOCKD_EVENTS").await;
    let feed = app.all_events().await;
    assert_eq!(stream.len(), feed.len());
    for (message, event) in stream.iter().zip(&feed) {
        let shop = event["data"]["shop"].as_str().unwrap_or_default();
        assert!(!shop.is_empty(), "{event}");
        assert_eq!(
            message.headers.get("Stockd-Shop").map(String::as_str),
            Some(shop),
            "{message:?}"
        );
    }
}

/// Found in review: an event the stream refused (larger than a `max_msg_size` an
/// operator set on `STOCKD_EVENTS`) was handled as NATS being down: the log said the
/// relay "could not publish", never which event, and the relay tried it again and again
/// while every later event waited. The step now names the refused event (logged at
/// ERROR with its id and position, counted in `stockd_outbox_publish_refused_total`),
/// and still skips nothing.
async fn an_event_the_stream_refuses_is_named_and_the_later_ones_wait_behind_it(backend: Backend) {
    let nats = TestNats::start().await;
    nats.create_event_stream_with_message_size_max(1024).await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-a");
    let skus: Vec<String> = (0..25).map(|index| format!("WIDE-{index:02}")).collect();
    for sku in &skus {
        app.stocked_sku(sku, 1).await;
    }
    let lines: Vec<(&str, i64)> = skus.iter().map(|sku| (sku.as_str(), 1)).collect();
    assert_eq!(app.reserve("wide", &lines).await.status, 201);
    app.stocked_sku("AFTER", 1).await;
    app.sequence_all_events().await;
    let events = app.all_events().await;
    let wide = events
        .iter()
        .position(|event| event["type"] == "reservation.created")
        .expect("the wide reservation's event");

    let mut published = 0;
    let refused = loop {
        let step = app.engine.relay_step(&relay).await.unwrap();
        published += step.published;
        if step.failure.is_some() {
            break step;
        }
        assert!(
            step.published > 0,
            "the relay stopped before the wide event: {step:?}"
        );
    };

    assert!(
        matches!(refused.failure, Some(bus::BusError::Refused(_))),
        "{refused:?}"
    );
    assert_eq!(
        refused.refused_event.as_deref(),
        events[wide]["id"].as_str(),
        "{refused:?}"
    );
    assert_eq!(
        published, wide,
        "every event before it recorded, none after"
    );
    let stored = stored_ids(&nats).await;
    let before: Vec<String> = events[..wide]
        .iter()
        .map(|event| event["id"].as_str().unwrap().to_owned())
        .collect();
    assert!(stored.starts_with(&before), "{stored:?}");
    assert!(
        !stored
            .iter()
            .any(|id| Some(id.as_str()) == events[wide]["id"].as_str()),
        "{stored:?}"
    );
    // Another aggregate's later event may have been stored meanwhile (pipelined);
    // the relay's position stays before the refused one, so it is tried again.
    app.clock
        .advance_milliseconds(app.engine.config().relay_stand_aside_milliseconds + 1);
    let again = app.engine.relay_step(&relay).await.unwrap();
    assert_eq!(again.published, 0, "{again:?}");
    assert_eq!(again.refused_event, refused.refused_event, "{again:?}");
}

/// Found in review: every relay step took or renewed the lease in a write
/// transaction, ten a second when idle (on SQLite, the hot path's one writer; on
/// PostgreSQL, a synchronous commit each). A step with nothing to publish now only
/// reads, until half the lease has passed.
async fn an_idle_relay_writes_nothing_until_half_its_lease_has_passed(backend: Backend) {
    let nats = TestNats::start().await;
    let app = TestApp::spawn(backend).await;
    app.engine.attach_event_relay();
    let relay = EventRelay::new(nats.bus().await, "relay-idle");
    app.stocked_sku("TEA", 5).await;
    assert!(relay_all(&app, &relay).await.published > 0);
    let mut connection = app.database.raw_connection().await;
    let mut lease_until = async || {
        connection
            .texts("SELECT CAST(lease_until AS CHAR(20)) FROM outbox_relay WHERE name = 'nats'")
            .await[0]
            .as_deref()
            .and_then(|text| text.trim().parse::<i64>().ok())
            .expect("the relay's lease")
    };
    let taken = lease_until().await;
    let half = app.engine.config().relay_lease_milliseconds / 2;

    app.clock.advance_milliseconds(half - 1);
    let idle = app.engine.relay_step(&relay).await.unwrap();
    let while_fresh = lease_until().await;
    app.clock.advance_milliseconds(2);
    app.engine.relay_step(&relay).await.unwrap();
    let past_half = lease_until().await;
    app.clock.advance_milliseconds(1_000);
    app.receive("TEA", 1).await;
    app.sequence_all_events().await;
    let publishing = app.engine.relay_step(&relay).await.unwrap();
    let after_publishing = lease_until().await;

    assert_eq!(idle, RelayStep::default(), "{idle:?}");
    assert_eq!(
        while_fresh, taken,
        "an idle step before half the lease wrote nothing"
    );
    assert_eq!(past_half, taken + half + 1, "renewed once half had passed");
    assert_eq!(publishing.published, 1, "{publishing:?}");
    assert_eq!(
        after_publishing,
        past_half + 1_000,
        "a step with events renews, half or not"
    );
}

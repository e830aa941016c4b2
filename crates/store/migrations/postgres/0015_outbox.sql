-- The transactional outbox (DESIGN.md principle 12, "Events and caches"). Every state
-- change inserts its event here in its own transaction; nothing is published from a
-- request handler.
--
-- `id` is the order rows were written in, assigned before the commit, so a reader
-- that follows it would skip a row whose transaction commits late. `position` is the
-- order rows became visible in: the sequencer (`store::units::outbox`) numbers the
-- rows it finds without one, one sequencer at a time (it locks its `outbox_relay`
-- row), so the positions a reader can see are always a prefix. The pull feed and the
-- NATS relay follow `position`, never `id`.
--
-- `sequence` numbers an aggregate's events 1, 2, 3…: a new reservation's or order's
-- first event is 1, a reservation's one move out of RESERVED is 2, an order's event
-- is its version after the change, and the other aggregates count in
-- `outbox_sequence`, whose row the change locks until it commits, so an aggregate's
-- events become visible in sequence order.
CREATE TABLE outbox (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate    TEXT   NOT NULL
        CHECK (aggregate IN ('reservation', 'order', 'payment', 'stock', 'sku')),
    aggregate_id TEXT   NOT NULL,
    sequence     BIGINT NOT NULL CHECK (sequence >= 1),
    event_type   TEXT   NOT NULL,
    shop         TEXT   NOT NULL,
    -- NULL for `reservation.created`: its body is the new reservation's own rows
    -- (shop, shopper, order, lines), which never change, read when the event is.
    payload      TEXT,
    occurred_at  BIGINT NOT NULL,
    position     BIGINT CHECK (position >= 1),
    CHECK (payload IS NOT NULL OR event_type = 'reservation.created'),
    UNIQUE (aggregate, aggregate_id, sequence)
);

-- The sequencer's work: rows not numbered yet, in write order.
CREATE INDEX outbox_unpositioned ON outbox (id) WHERE position IS NULL;
-- The feed and the relay: numbered rows in position order, all of them or one shop's.
CREATE UNIQUE INDEX outbox_position ON outbox (position) WHERE position IS NOT NULL;
CREATE INDEX outbox_shop_position ON outbox (shop, position) WHERE position IS NOT NULL;

CREATE TABLE outbox_sequence (
    aggregate     TEXT   NOT NULL,
    aggregate_id  TEXT   NOT NULL,
    last_sequence BIGINT NOT NULL CHECK (last_sequence >= 1),
    PRIMARY KEY (aggregate, aggregate_id)
);

-- `sequencer`: the last position handed out. `nats`: the last position JetStream
-- acknowledged, and the lease of the instance relaying (one at a time).
CREATE TABLE outbox_relay (
    name             TEXT   NOT NULL PRIMARY KEY CHECK (name IN ('sequencer', 'nats')),
    holder           TEXT,
    lease_until      BIGINT NOT NULL DEFAULT 0,
    through_position BIGINT NOT NULL DEFAULT 0 CHECK (through_position >= 0)
);
INSERT INTO outbox_relay (name) VALUES ('sequencer'), ('nats');

-- The one writer of reservation rows writes each new reservation's
-- `reservation.created` event row too, so every path that creates reservations (the
-- batch transaction, the whole-batch fast path, orders, checkouts, late successes)
-- announces them in the same statement. The signature is unchanged.
CREATE OR REPLACE FUNCTION stockd_insert_reservation_rows(p_now bigint, p_reservation_ids text[],
    p_reservation_expiries bigint[], p_reservation_keys text[], p_reservation_shops text[],
    p_reservation_users text[], p_line_reservations text[], p_line_numbers bigint[],
    p_line_skus text[], p_line_warehouses text[], p_line_quantities bigint[],
    p_line_keys text[], p_record_keys text[], p_record_fingerprints text[],
    p_record_statuses bigint[], p_record_bodies text[],
    p_reservation_orders text[] DEFAULT NULL, OUT records_stored bigint)
    LANGUAGE plpgsql
    AS $$
BEGIN
    INSERT INTO reservation
        (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at,
         order_id, shop, user_id)
    SELECT batch.id, 'RESERVED', NULL, batch.expires_at, batch.key, p_now, p_now,
        batch.order_id, batch.shop, batch.user_id
    FROM UNNEST(p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users,
        COALESCE(p_reservation_orders, '{}'::text[]))
        AS batch (id, expires_at, key, shop, user_id, order_id)
    WHERE batch.id IS NOT NULL;
    INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity)
    SELECT * FROM UNNEST(p_line_reservations, p_line_numbers, p_line_skus,
        p_line_warehouses, p_line_quantities);
    INSERT INTO stock_ledger
        (sku, warehouse, kind, available_delta, reserved_delta, reference,
         idempotency_key, created_at)
    SELECT batch.sku, batch.warehouse, 'reserve', -batch.quantity, batch.quantity,
        batch.reference, batch.key, p_now
    FROM UNNEST(p_line_skus, p_line_warehouses, p_line_quantities, p_line_reservations,
        p_line_keys) AS batch (sku, warehouse, quantity, reference, key);
    -- Its body is read from these rows when the event is (`store::units::outbox`):
    -- building JSON here, under the hot row's lock, cost the hot path a quarter.
    INSERT INTO outbox
        (aggregate, aggregate_id, sequence, event_type, shop, payload, occurred_at)
    SELECT 'reservation', batch.id, 1, 'reservation.created', batch.shop, NULL, p_now
    FROM UNNEST(p_reservation_ids, p_reservation_shops) WITH ORDINALITY
        AS batch (id, shop, ordinal)
    WHERE batch.id IS NOT NULL
    ORDER BY batch.ordinal;
    -- In key order (the caller sorts them): two batches inserting overlapping keys wait
    -- for each other instead of deadlocking.
    INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at)
    SELECT batch.key, batch.fingerprint, batch.status, batch.body, p_now
    FROM UNNEST(p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies)
        AS batch (key, fingerprint, status, body);
    GET DIAGNOSTICS records_stored = ROW_COUNT;
END
$$;

-- The transactional outbox: see the PostgreSQL migration 0015 for why rows carry both
-- `id` (write order) and `position` (the order the sequencer found them committed).
CREATE TABLE outbox (
    id           INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    aggregate    TEXT    NOT NULL
        CHECK (aggregate IN ('reservation', 'order', 'payment', 'stock', 'sku')),
    aggregate_id TEXT    NOT NULL,
    sequence     INTEGER NOT NULL CHECK (sequence >= 1),
    event_type   TEXT    NOT NULL,
    shop         TEXT    NOT NULL,
    payload      TEXT,
    occurred_at  INTEGER NOT NULL,
    position     INTEGER CHECK (position >= 1),
    CHECK (payload IS NOT NULL OR event_type = 'reservation.created'),
    UNIQUE (aggregate, aggregate_id, sequence)
) STRICT;

CREATE INDEX outbox_unpositioned ON outbox (id) WHERE position IS NULL;
CREATE UNIQUE INDEX outbox_position ON outbox (position) WHERE position IS NOT NULL;
CREATE INDEX outbox_shop_position ON outbox (shop, position) WHERE position IS NOT NULL;

CREATE TABLE outbox_sequence (
    aggregate     TEXT    NOT NULL,
    aggregate_id  TEXT    NOT NULL,
    last_sequence INTEGER NOT NULL CHECK (last_sequence >= 1),
    PRIMARY KEY (aggregate, aggregate_id)
) STRICT, WITHOUT ROWID;

CREATE TABLE outbox_relay (
    name             TEXT    NOT NULL PRIMARY KEY CHECK (name IN ('sequencer', 'nats')),
    holder           TEXT,
    lease_until      INTEGER NOT NULL DEFAULT 0,
    through_position INTEGER NOT NULL DEFAULT 0 CHECK (through_position >= 0)
) STRICT;
INSERT INTO outbox_relay (name) VALUES ('sequencer'), ('nats');

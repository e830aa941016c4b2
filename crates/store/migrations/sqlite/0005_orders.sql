-- Orders and payments (seed 000): an order owns a reservation; a payment attempt is
-- recorded before the gateway is called; webhooks are remembered by event id; refunds
-- and after-sale returns are rows that can be settled only once.

ALTER TABLE reservation ADD COLUMN order_id TEXT;

CREATE TABLE customer_order (
    id              TEXT    NOT NULL PRIMARY KEY,
    user_id         TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN ('PENDING_PAYMENT', 'PAYMENT_PROCESSING', 'PAID',
                        'PAYMENT_FAILED', 'CANCELLED', 'EXPIRED', 'REFUND_PENDING', 'REFUNDED')),
    amount_minor    INTEGER NOT NULL CHECK (amount_minor >= 0),
    currency        TEXT    NOT NULL,
    reservation_id  TEXT    NOT NULL REFERENCES reservation (id),
    expires_at      INTEGER NOT NULL,
    version         INTEGER NOT NULL CHECK (version >= 1),
    idempotency_key TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
) STRICT;

-- The order expiry worker's queue.
CREATE INDEX customer_order_open ON customer_order (expires_at) WHERE status = 'PENDING_PAYMENT';
CREATE INDEX customer_order_user ON customer_order (user_id, created_at);

CREATE TABLE order_line (
    order_id         TEXT    NOT NULL REFERENCES customer_order (id),
    line_number      INTEGER NOT NULL,
    sku              TEXT    NOT NULL,
    warehouse        TEXT    NOT NULL,
    quantity         INTEGER NOT NULL CHECK (quantity > 0),
    unit_price_minor INTEGER NOT NULL CHECK (unit_price_minor >= 0),
    PRIMARY KEY (order_id, sku, warehouse)
) STRICT;

CREATE TABLE order_history (
    id          INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    order_id    TEXT    NOT NULL,
    from_status TEXT,
    to_status   TEXT    NOT NULL,
    reason      TEXT    NOT NULL,
    created_at  INTEGER NOT NULL
) STRICT;

CREATE INDEX order_history_order ON order_history (order_id, id);

CREATE TRIGGER order_history_no_update BEFORE UPDATE ON order_history
BEGIN
    SELECT RAISE(ABORT, 'order_history is append-only');
END;

CREATE TRIGGER order_history_no_delete BEFORE DELETE ON order_history
BEGIN
    SELECT RAISE(ABORT, 'order_history is append-only');
END;

-- One payment attempt per order: its gateway key makes every call about it (first
-- try, retry, reconciliation) the same call, so an order is charged at most once.
CREATE TABLE payment_attempt (
    id                 TEXT    NOT NULL PRIMARY KEY,
    order_id           TEXT    NOT NULL UNIQUE REFERENCES customer_order (id),
    gateway_key        TEXT    NOT NULL UNIQUE,
    payment_method     TEXT    NOT NULL,
    status             TEXT    NOT NULL CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED')),
    gateway_payment_id TEXT    UNIQUE,
    failure_reason     TEXT,
    amount_minor       INTEGER NOT NULL,
    currency           TEXT    NOT NULL,
    reconcile_after    INTEGER NOT NULL,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL
) STRICT;

-- The reconciliation worker's queue: unresolved attempts by when to look again.
CREATE INDEX payment_attempt_unresolved ON payment_attempt (reconcile_after) WHERE status = 'PROCESSING';

CREATE TABLE webhook_event (
    event_id           TEXT    NOT NULL PRIMARY KEY,
    event_type         TEXT    NOT NULL,
    gateway_payment_id TEXT,
    outcome            TEXT    NOT NULL,
    received_at        INTEGER NOT NULL
) STRICT;

CREATE TABLE refund (
    id                TEXT    NOT NULL PRIMARY KEY,
    order_id          TEXT    NOT NULL UNIQUE REFERENCES customer_order (id),
    gateway_key       TEXT    NOT NULL UNIQUE,
    gateway_refund_id TEXT    UNIQUE,
    status            TEXT    NOT NULL CHECK (status IN ('PENDING', 'SUCCEEDED')),
    amount_minor      INTEGER NOT NULL,
    currency          TEXT    NOT NULL,
    reason            TEXT    NOT NULL,
    tries             INTEGER NOT NULL DEFAULT 0,
    next_try_at       INTEGER NOT NULL,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL
) STRICT;

CREATE INDEX refund_pending ON refund (next_try_at) WHERE status = 'PENDING';

-- An after-sale return puts an order's goods back in stock once: this row guards it.
CREATE TABLE order_return (
    order_id   TEXT    NOT NULL PRIMARY KEY REFERENCES customer_order (id),
    created_at INTEGER NOT NULL
) STRICT;

-- The ledger learns the `return` kind. SQLite cannot change a CHECK in place, so the
-- table is rebuilt with its rows, ids, index and append-only triggers.
DROP TRIGGER stock_ledger_no_update;
DROP TRIGGER stock_ledger_no_delete;
CREATE TABLE stock_ledger_new (
    id              INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    sku             TEXT    NOT NULL,
    warehouse       TEXT    NOT NULL,
    kind            TEXT    NOT NULL CHECK (kind IN ('receive', 'adjust', 'reserve', 'confirm', 'release', 'return')),
    available_delta INTEGER NOT NULL,
    reserved_delta  INTEGER NOT NULL,
    reference       TEXT    NOT NULL,
    idempotency_key TEXT,
    created_at      INTEGER NOT NULL
) STRICT;
INSERT INTO stock_ledger_new (id, sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at)
    SELECT id, sku, warehouse, kind, available_delta, reserved_delta, reference, idempotency_key, created_at FROM stock_ledger;
DROP TABLE stock_ledger;
ALTER TABLE stock_ledger_new RENAME TO stock_ledger;
CREATE INDEX stock_ledger_reference ON stock_ledger (reference, sku, warehouse);
CREATE TRIGGER stock_ledger_no_update BEFORE UPDATE ON stock_ledger
BEGIN
    SELECT RAISE(ABORT, 'stock_ledger is append-only');
END;
CREATE TRIGGER stock_ledger_no_delete BEFORE DELETE ON stock_ledger
BEGIN
    SELECT RAISE(ABORT, 'stock_ledger is append-only');
END;

-- Orders and payments (seed 000): an order owns a reservation; a payment attempt is
-- recorded before the gateway is called; webhooks are remembered by event id; refunds
-- and after-sale returns are rows that can be settled only once.

ALTER TABLE reservation ADD COLUMN order_id TEXT;

CREATE TABLE customer_order (
    id              TEXT   NOT NULL PRIMARY KEY,
    user_id         TEXT   NOT NULL,
    status          TEXT   NOT NULL CHECK (status IN ('PENDING_PAYMENT', 'PAYMENT_PROCESSING', 'PAID',
                        'PAYMENT_FAILED', 'CANCELLED', 'EXPIRED', 'REFUND_PENDING', 'REFUNDED')),
    amount_minor    BIGINT NOT NULL CHECK (amount_minor >= 0),
    currency        TEXT   NOT NULL,
    reservation_id  TEXT   NOT NULL REFERENCES reservation (id),
    expires_at      BIGINT NOT NULL,
    version         BIGINT NOT NULL CHECK (version >= 1),
    idempotency_key TEXT,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL
);

-- The order expiry worker's queue.
CREATE INDEX customer_order_open ON customer_order (expires_at) WHERE status = 'PENDING_PAYMENT';
CREATE INDEX customer_order_user ON customer_order (user_id, created_at);

CREATE TABLE order_line (
    order_id         TEXT   NOT NULL REFERENCES customer_order (id),
    line_number      BIGINT NOT NULL,
    sku              TEXT   NOT NULL,
    warehouse        TEXT   NOT NULL,
    quantity         BIGINT NOT NULL CHECK (quantity > 0),
    unit_price_minor BIGINT NOT NULL CHECK (unit_price_minor >= 0),
    PRIMARY KEY (order_id, sku, warehouse)
);

CREATE TABLE order_history (
    id          BIGSERIAL NOT NULL PRIMARY KEY,
    order_id    TEXT   NOT NULL,
    from_status TEXT,
    to_status   TEXT   NOT NULL,
    reason      TEXT   NOT NULL,
    created_at  BIGINT NOT NULL
);

CREATE INDEX order_history_order ON order_history (order_id, id);

CREATE FUNCTION order_history_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'order_history is append-only';
END;
$$;

CREATE TRIGGER order_history_append_only BEFORE UPDATE OR DELETE ON order_history
    FOR EACH ROW EXECUTE FUNCTION order_history_refuse_change();

-- One payment attempt per order: its gateway key makes every call about it (first
-- try, retry, reconciliation) the same call, so an order is charged at most once.
CREATE TABLE payment_attempt (
    id                 TEXT   NOT NULL PRIMARY KEY,
    order_id           TEXT   NOT NULL UNIQUE REFERENCES customer_order (id),
    gateway_key        TEXT   NOT NULL UNIQUE,
    payment_method     TEXT   NOT NULL,
    status             TEXT   NOT NULL CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED')),
    gateway_payment_id TEXT   UNIQUE,
    failure_reason     TEXT,
    amount_minor       BIGINT NOT NULL,
    currency           TEXT   NOT NULL,
    reconcile_after    BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL
);

-- The reconciliation worker's queue: unresolved attempts by when to look again.
CREATE INDEX payment_attempt_unresolved ON payment_attempt (reconcile_after) WHERE status = 'PROCESSING';

CREATE TABLE webhook_event (
    event_id           TEXT   NOT NULL PRIMARY KEY,
    event_type         TEXT   NOT NULL,
    gateway_payment_id TEXT,
    outcome            TEXT   NOT NULL,
    received_at        BIGINT NOT NULL
);

CREATE TABLE refund (
    id                TEXT   NOT NULL PRIMARY KEY,
    order_id          TEXT   NOT NULL UNIQUE REFERENCES customer_order (id),
    gateway_key       TEXT   NOT NULL UNIQUE,
    gateway_refund_id TEXT   UNIQUE,
    status            TEXT   NOT NULL CHECK (status IN ('PENDING', 'SUCCEEDED')),
    amount_minor      BIGINT NOT NULL,
    currency          TEXT   NOT NULL,
    reason            TEXT   NOT NULL,
    tries             BIGINT NOT NULL DEFAULT 0,
    next_try_at       BIGINT NOT NULL,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL
);

CREATE INDEX refund_pending ON refund (next_try_at) WHERE status = 'PENDING';

-- An after-sale return puts an order's goods back in stock once: this row guards it.
CREATE TABLE order_return (
    order_id   TEXT   NOT NULL PRIMARY KEY REFERENCES customer_order (id),
    created_at BIGINT NOT NULL
);

-- The ledger learns the `return` kind.
ALTER TABLE stock_ledger DROP CONSTRAINT stock_ledger_kind_check;
ALTER TABLE stock_ledger ADD CONSTRAINT stock_ledger_kind_check
    CHECK (kind IN ('receive', 'adjust', 'reserve', 'confirm', 'release', 'return'));

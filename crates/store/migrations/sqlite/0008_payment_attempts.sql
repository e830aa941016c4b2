-- Several payment attempts per order (issue 13, seed 000): after a decline the shopper
-- may try another card on the same order while its hold lasts. Each attempt has its
-- own number and gateway key; at most one runs at a time and at most one succeeds
-- (partial unique indexes), so an order is still charged at most once.
--
-- SQLite cannot drop the inline UNIQUE (order_id): the table is rebuilt.
CREATE TABLE payment_attempt_rebuilt (
    id                 TEXT    NOT NULL PRIMARY KEY,
    order_id           TEXT    NOT NULL REFERENCES customer_order (id),
    attempt_number     INTEGER NOT NULL CHECK (attempt_number >= 1),
    gateway_key        TEXT    NOT NULL UNIQUE,
    payment_method     TEXT    NOT NULL,
    status             TEXT    NOT NULL CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED')),
    gateway_payment_id TEXT    UNIQUE,
    failure_reason     TEXT,
    amount_minor       INTEGER NOT NULL,
    currency           TEXT    NOT NULL,
    reconcile_after    INTEGER NOT NULL,
    reconcile_tries    INTEGER NOT NULL DEFAULT 0,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    UNIQUE (order_id, attempt_number)
) STRICT;

INSERT INTO payment_attempt_rebuilt (id, order_id, attempt_number, gateway_key, payment_method, status,
    gateway_payment_id, failure_reason, amount_minor, currency, reconcile_after, reconcile_tries,
    created_at, updated_at)
SELECT id, order_id, 1, gateway_key, payment_method, status, gateway_payment_id, failure_reason,
    amount_minor, currency, reconcile_after, reconcile_tries, created_at, updated_at FROM payment_attempt;

DROP TABLE payment_attempt;
ALTER TABLE payment_attempt_rebuilt RENAME TO payment_attempt;

CREATE INDEX payment_attempt_unresolved ON payment_attempt (reconcile_after) WHERE status = 'PROCESSING';
CREATE UNIQUE INDEX payment_attempt_one_running ON payment_attempt (order_id) WHERE status = 'PROCESSING';
CREATE UNIQUE INDEX payment_attempt_one_success ON payment_attempt (order_id) WHERE status = 'SUCCEEDED';

-- A declined order keeps its hold until it expires: the order-expiry worker's queue.
CREATE INDEX customer_order_declined ON customer_order (expires_at) WHERE status = 'PAYMENT_FAILED';

-- Definitive gateway refusals (issue 13). A refund the gateway refuses (a 4xx other
-- than 409/429) is FAILED with the gateway's reason and left for a person, instead of
-- being sent again for ever. An attempt whose outcome stays unknown is asked about
-- less and less often: reconcile_tries counts the looks.
--
-- SQLite cannot change a CHECK constraint in place: the refund table is rebuilt.
CREATE TABLE refund_rebuilt (
    id                TEXT    NOT NULL PRIMARY KEY,
    order_id          TEXT    NOT NULL UNIQUE REFERENCES customer_order (id),
    gateway_key       TEXT    NOT NULL UNIQUE,
    gateway_refund_id TEXT    UNIQUE,
    status            TEXT    NOT NULL CHECK (status IN ('PENDING', 'SUCCEEDED', 'FAILED')),
    amount_minor      INTEGER NOT NULL,
    currency          TEXT    NOT NULL,
    reason            TEXT    NOT NULL,
    failure_reason    TEXT,
    tries             INTEGER NOT NULL DEFAULT 0,
    next_try_at       INTEGER NOT NULL,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL
) STRICT;

INSERT INTO refund_rebuilt (id, order_id, gateway_key, gateway_refund_id, status, amount_minor, currency,
    reason, failure_reason, tries, next_try_at, created_at, updated_at)
SELECT id, order_id, gateway_key, gateway_refund_id, status, amount_minor, currency,
    reason, NULL, tries, next_try_at, created_at, updated_at FROM refund;

DROP TABLE refund;
ALTER TABLE refund_rebuilt RENAME TO refund;
CREATE INDEX refund_pending ON refund (next_try_at) WHERE status = 'PENDING';

ALTER TABLE payment_attempt ADD COLUMN reconcile_tries INTEGER NOT NULL DEFAULT 0;

-- A refund belongs to the payment attempt whose money it returns (issue 13): an order
-- cancelled after payment refunds its succeeded attempt, and a second attempt charged
-- for an order paid already (a gateway completing what it should not) is refunded on
-- its own, so an order keeps at most one charge. One refund per attempt.
--
-- SQLite cannot drop the inline UNIQUE (order_id): the table is rebuilt.
CREATE TABLE refund_rebuilt (
    id                TEXT    NOT NULL PRIMARY KEY,
    order_id          TEXT    NOT NULL REFERENCES customer_order (id),
    attempt_id        TEXT    NOT NULL UNIQUE REFERENCES payment_attempt (id),
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

-- Every refund so far was of its order's succeeded attempt (one without fails the
-- migration on attempt_id's NOT NULL, as on PostgreSQL: hand-edited data to look at).
INSERT INTO refund_rebuilt (id, order_id, attempt_id, gateway_key, gateway_refund_id, status, amount_minor,
    currency, reason, failure_reason, tries, next_try_at, created_at, updated_at)
SELECT refund.id, refund.order_id, payment_attempt.id, refund.gateway_key, refund.gateway_refund_id, refund.status,
    refund.amount_minor, refund.currency, refund.reason, refund.failure_reason, refund.tries, refund.next_try_at,
    refund.created_at, refund.updated_at
FROM refund LEFT JOIN payment_attempt ON payment_attempt.order_id = refund.order_id AND payment_attempt.status = 'SUCCEEDED';

DROP TABLE refund;
ALTER TABLE refund_rebuilt RENAME TO refund;
CREATE INDEX refund_pending ON refund (next_try_at) WHERE status = 'PENDING';
CREATE INDEX refund_order ON refund (order_id);

-- A refund belongs to the payment attempt whose money it returns (issue 13): an order
-- cancelled after payment refunds its succeeded attempt, and a second attempt charged
-- for an order paid already (a gateway completing what it should not) is refunded on
-- its own, so an order keeps at most one charge. One refund per attempt.
ALTER TABLE refund ADD COLUMN attempt_id TEXT REFERENCES payment_attempt (id);
-- Every refund so far was of its order's succeeded attempt.
UPDATE refund SET attempt_id = (SELECT payment_attempt.id FROM payment_attempt
    WHERE payment_attempt.order_id = refund.order_id AND payment_attempt.status = 'SUCCEEDED');
ALTER TABLE refund ALTER COLUMN attempt_id SET NOT NULL;
ALTER TABLE refund DROP CONSTRAINT refund_order_id_key;
ALTER TABLE refund ADD CONSTRAINT refund_attempt_id_key UNIQUE (attempt_id);
CREATE INDEX refund_order ON refund (order_id);

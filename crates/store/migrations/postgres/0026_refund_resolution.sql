-- A refund the gateway refused (`FAILED`) is resolved by a person: sent again (a new
-- gateway key; the refused one's would replay the refusal) or recorded as refunded
-- outside stockd. Who decided, what, why and when stay with the refund.
ALTER TABLE refund ADD COLUMN resolution TEXT
    CHECK (resolution IN ('send_again', 'refunded_elsewhere'));
ALTER TABLE refund ADD COLUMN resolved_by TEXT;
ALTER TABLE refund ADD COLUMN resolution_remark TEXT;
ALTER TABLE refund ADD COLUMN resolved_at BIGINT;

-- A refund the gateway refused is resolved by a person: see the PostgreSQL migration
-- 0026.
ALTER TABLE refund ADD COLUMN resolution TEXT
    CHECK (resolution IN ('send_again', 'refunded_elsewhere'));
ALTER TABLE refund ADD COLUMN resolved_by TEXT;
ALTER TABLE refund ADD COLUMN resolution_remark TEXT;
ALTER TABLE refund ADD COLUMN resolved_at INTEGER;

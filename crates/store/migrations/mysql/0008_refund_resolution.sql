-- A refund the gateway refused is resolved by a person: see the PostgreSQL migration
-- 0026.
ALTER TABLE refund ADD COLUMN resolution VARCHAR(32)
    CHECK (resolution IN ('send_again', 'refunded_elsewhere'));
ALTER TABLE refund ADD COLUMN resolved_by VARCHAR(100);
ALTER TABLE refund ADD COLUMN resolution_remark VARCHAR(1000);
ALTER TABLE refund ADD COLUMN resolved_at BIGINT;

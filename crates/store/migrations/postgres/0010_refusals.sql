-- Definitive gateway refusals (issue 13). A refund the gateway refuses (a 4xx other
-- than 409/429) is FAILED with the gateway's reason and left for a person, instead of
-- being sent again for ever. An attempt whose outcome stays unknown is asked about
-- less and less often: reconcile_tries counts the looks.
ALTER TABLE refund DROP CONSTRAINT refund_status_check;
ALTER TABLE refund ADD CONSTRAINT refund_status_check
    CHECK (status IN ('PENDING', 'SUCCEEDED', 'FAILED'));
ALTER TABLE refund ADD COLUMN failure_reason TEXT;

ALTER TABLE payment_attempt ADD COLUMN reconcile_tries BIGINT NOT NULL DEFAULT 0;

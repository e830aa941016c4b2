-- The idempotency key of the pay request that started an attempt (issue 13): a retry
-- of that request, whatever became of its attempt meanwhile, learns the attempt's
-- outcome and never starts another (the first result wins).
ALTER TABLE payment_attempt ADD COLUMN request_key TEXT;
CREATE INDEX payment_attempt_request ON payment_attempt (order_id, request_key);

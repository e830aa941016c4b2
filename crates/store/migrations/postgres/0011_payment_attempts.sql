-- Several payment attempts per order (issue 13, seed 000): after a decline the shopper
-- may try another card on the same order while its hold lasts. Each attempt has its
-- own number and gateway key; at most one runs at a time and at most one succeeds
-- (partial unique indexes), so an order is still charged at most once.
ALTER TABLE payment_attempt DROP CONSTRAINT payment_attempt_order_id_key;
ALTER TABLE payment_attempt ADD COLUMN attempt_number BIGINT NOT NULL DEFAULT 1
    CHECK (attempt_number >= 1);
ALTER TABLE payment_attempt ALTER COLUMN attempt_number DROP DEFAULT;
ALTER TABLE payment_attempt ADD CONSTRAINT payment_attempt_order_number UNIQUE (order_id, attempt_number);
CREATE UNIQUE INDEX payment_attempt_one_running ON payment_attempt (order_id) WHERE status = 'PROCESSING';
CREATE UNIQUE INDEX payment_attempt_one_success ON payment_attempt (order_id) WHERE status = 'SUCCEEDED';

-- A declined order keeps its hold until it expires: the order-expiry worker's queue.
CREATE INDEX customer_order_declined ON customer_order (expires_at) WHERE status = 'PAYMENT_FAILED';

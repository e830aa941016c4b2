-- One request of the seeds' deduction on one hot row: insert the deduction record and
-- apply the conditional update, one transaction per request (seed 002 五.3).
\set sku 1
\set request random(1, 9000000000000000000)
BEGIN;
INSERT INTO inventory_deduction_record (request_id, order_id, sku_id, quantity, status, created_at, updated_at)
    VALUES (:request, :request, :sku, 1, 'SUCCESS', now(), now());
UPDATE inventory SET available_quantity = available_quantity - 1, version = version + 1, updated_at = now()
    WHERE sku_id = :sku AND available_quantity >= 1;
END;

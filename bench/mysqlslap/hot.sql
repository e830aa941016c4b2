BEGIN;
INSERT INTO inventory_deduction_record (request_id, order_id, sku_id, quantity, status, created_at, updated_at) VALUES (UUID(), UUID(), 1, 1, 'SUCCESS', NOW(), NOW());
UPDATE inventory SET available_quantity = available_quantity - 1, version = version + 1, updated_at = NOW() WHERE sku_id = 1 AND available_quantity >= 1;
COMMIT

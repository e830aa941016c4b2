-- A reservation's lines are distinct per (sku, warehouse) — the engine refuses a
-- request that repeats one — so the table's key can say so: the primary key becomes
-- (reservation_id, sku, warehouse), and the second unique index every reservation
-- paid an insertion into goes away.
ALTER TABLE reservation_line DROP CONSTRAINT reservation_line_pkey;
ALTER TABLE reservation_line DROP CONSTRAINT reservation_line_reservation_id_sku_warehouse_key;
ALTER TABLE reservation_line ADD PRIMARY KEY (reservation_id, sku, warehouse);

-- Idempotency records arrive in time order and are only ever purged by age, so a
-- BRIN index (a few bytes per block range, maintained almost for free) finds the old
-- ones as well as a b-tree would, without a b-tree insertion per request.
DROP INDEX idempotency_record_created;
CREATE INDEX idempotency_record_created ON idempotency_record USING brin (created_at);

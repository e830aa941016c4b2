-- Trust boundaries (issue 12): every call has a principal, everything has a shop.
--
-- Credentials (the admin token, operators, service keys) are stored as SHA-256 hashes
-- of their secrets; a revoked one keeps its row (revoked_at) so its id is never reused.
-- SKUs, reservations, orders and cart lines name the shop they belong to; a SKU's shop
-- never changes once set, so everything derived from it can be checked before a
-- transaction. Shoppers' open holds and purchases are tallied per (shop, user) so the
-- reserving transaction can enforce the limits with conditional writes.

CREATE TABLE credential (
    kind        TEXT   NOT NULL CHECK (kind IN ('admin', 'operator', 'service')),
    id          TEXT   NOT NULL,
    name        TEXT   NOT NULL,
    shop        TEXT,
    secret_hash TEXT   NOT NULL UNIQUE,
    created_at  BIGINT NOT NULL,
    revoked_at  BIGINT,
    PRIMARY KEY (kind, id),
    CHECK ((kind = 'admin') = (shop IS NULL))
);

INSERT INTO credential (kind, id, name, shop, secret_hash, created_at)
    SELECT 'operator', id, id, shop, token_hash, created_at FROM operator;
DROP TABLE operator;

ALTER TABLE sku ADD COLUMN shop TEXT NOT NULL DEFAULT 'default';
UPDATE sku SET shop = product.shop FROM product WHERE product.id = sku.product_id;
ALTER TABLE sku ADD COLUMN per_user_limit BIGINT
    CHECK (per_user_limit IS NULL OR per_user_limit > 0);

ALTER TABLE reservation ADD COLUMN shop TEXT;
ALTER TABLE reservation ADD COLUMN user_id TEXT;
UPDATE reservation SET shop = (SELECT sku.shop FROM reservation_line
    JOIN sku ON sku.code = reservation_line.sku
    WHERE reservation_line.reservation_id = reservation.id LIMIT 1);

ALTER TABLE customer_order ADD COLUMN shop TEXT NOT NULL DEFAULT 'default';
UPDATE customer_order SET shop = COALESCE((SELECT sku.shop FROM order_line
    JOIN sku ON sku.code = order_line.sku
    WHERE order_line.order_id = customer_order.id LIMIT 1), 'default');
CREATE INDEX customer_order_shop_user ON customer_order (shop, user_id, created_at);

ALTER TABLE cart_item ADD COLUMN shop TEXT NOT NULL DEFAULT 'default';
UPDATE cart_item SET shop = sku.shop FROM sku WHERE sku.code = cart_item.sku;

-- Open holds (RESERVED reservations) per shopper: at most the configured bound.
CREATE TABLE shopper_hold (
    shop       TEXT   NOT NULL,
    user_id    TEXT   NOT NULL,
    open_holds BIGINT NOT NULL CHECK (open_holds >= 0),
    PRIMARY KEY (shop, user_id)
);

-- Units of a SKU a shopper holds or bought (reserved or confirmed; a release gives
-- them back): at most the SKU's per_user_limit.
CREATE TABLE shopper_purchase (
    shop     TEXT   NOT NULL,
    user_id  TEXT   NOT NULL,
    sku      TEXT   NOT NULL,
    quantity BIGINT NOT NULL CHECK (quantity >= 0),
    PRIMARY KEY (shop, user_id, sku)
);

-- The batch functions of migrations 0006-0008 write each reservation's shop and
-- shopper now. Their bodies are unchanged otherwise, but for one more condition on the
-- whole-batch fast path: a SKU with a per-user limit is never taken there (the batch
-- transaction checks the limit, in Rust, against the locked tallies). A per-user limit
-- is set under the SKU's stock-row locks, like a sale-status change, so the check on
-- the locked rows sees the newest limit.
DROP FUNCTION stockd_reserve_whole_batch(
    TEXT[], BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[],
    TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[]);
DROP FUNCTION stockd_write_reservation_batch(
    BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[],
    TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[]);
DROP FUNCTION stockd_insert_reservation_rows(
    BIGINT, TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[],
    TEXT[], TEXT[], BIGINT[], TEXT[]);

CREATE FUNCTION stockd_insert_reservation_rows(
    p_now BIGINT,
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
    p_reservation_shops TEXT[], p_reservation_users TEXT[],
    p_line_reservations TEXT[], p_line_numbers BIGINT[], p_line_skus TEXT[],
    p_line_warehouses TEXT[], p_line_quantities BIGINT[], p_line_keys TEXT[],
    p_record_keys TEXT[], p_record_fingerprints TEXT[], p_record_statuses BIGINT[],
    p_record_bodies TEXT[],
    OUT records_stored BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO reservation
        (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at,
         shop, user_id)
    SELECT batch.id, 'RESERVED', NULL, batch.expires_at, batch.key, p_now, p_now,
        batch.shop, batch.user_id
    FROM UNNEST(p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users)
        AS batch (id, expires_at, key, shop, user_id);
    INSERT INTO reservation_line (reservation_id, line_number, sku, warehouse, quantity)
    SELECT * FROM UNNEST(p_line_reservations, p_line_numbers, p_line_skus,
        p_line_warehouses, p_line_quantities);
    INSERT INTO stock_ledger
        (sku, warehouse, kind, available_delta, reserved_delta, reference,
         idempotency_key, created_at)
    SELECT batch.sku, batch.warehouse, 'reserve', -batch.quantity, batch.quantity,
        batch.reference, batch.key, p_now
    FROM UNNEST(p_line_skus, p_line_warehouses, p_line_quantities, p_line_reservations,
        p_line_keys) AS batch (sku, warehouse, quantity, reference, key);
    -- In key order (the caller sorts them): two batches inserting overlapping keys wait
    -- for each other instead of deadlocking.
    INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at)
    SELECT batch.key, batch.fingerprint, batch.status, batch.body, p_now
    FROM UNNEST(p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies)
        AS batch (key, fingerprint, status, body);
    GET DIAGNOSTICS records_stored = ROW_COUNT;
END
$$;

CREATE FUNCTION stockd_write_reservation_batch(
    p_now BIGINT,
    p_total_skus TEXT[], p_total_warehouses TEXT[], p_total_quantities BIGINT[],
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
    p_reservation_shops TEXT[], p_reservation_users TEXT[],
    p_line_reservations TEXT[], p_line_numbers BIGINT[], p_line_skus TEXT[],
    p_line_warehouses TEXT[], p_line_quantities BIGINT[], p_line_keys TEXT[],
    p_record_keys TEXT[], p_record_fingerprints TEXT[], p_record_statuses BIGINT[],
    p_record_bodies TEXT[],
    OUT rows_taken BIGINT, OUT records_stored BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    rows_taken := stockd_take_stock(p_now, p_total_skus, p_total_warehouses,
        p_total_quantities);
    records_stored := stockd_insert_reservation_rows(p_now,
        p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users,
        p_line_reservations, p_line_numbers, p_line_skus, p_line_warehouses,
        p_line_quantities, p_line_keys,
        p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies);
END
$$;

-- As in migration 0006 (see there for the order of its steps), with the reservation's
-- shop and shopper, and SKUs with a per-user limit counted as not fitting.
CREATE FUNCTION stockd_reserve_whole_batch(
    p_sellable TEXT[],
    p_now BIGINT,
    p_total_skus TEXT[], p_total_warehouses TEXT[], p_total_quantities BIGINT[],
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
    p_reservation_shops TEXT[], p_reservation_users TEXT[],
    p_line_reservations TEXT[], p_line_numbers BIGINT[], p_line_skus TEXT[],
    p_line_warehouses TEXT[], p_line_quantities BIGINT[], p_line_keys TEXT[],
    p_record_keys TEXT[], p_record_fingerprints TEXT[], p_record_statuses BIGINT[],
    p_record_bodies TEXT[])
RETURNS TEXT
LANGUAGE plpgsql AS $$
DECLARE
    v_seen BOOLEAN;
    v_fitting BIGINT;
    v_rows_taken BIGINT;
    v_records_stored BIGINT;
    v_skus_total BIGINT;
    v_skus_sellable BIGINT;
BEGIN
    EXECUTE 'SELECT EXISTS (SELECT 1 FROM idempotency_record WHERE key = ANY ($1))'
        INTO v_seen USING p_record_keys;
    IF v_seen THEN
        RETURN 'replay';
    END IF;

    SELECT COUNT(*) INTO v_fitting
    FROM stock
    JOIN UNNEST(p_total_skus, p_total_warehouses, p_total_quantities)
        AS wanted (sku, warehouse, total)
        ON stock.sku = wanted.sku AND stock.warehouse = wanted.warehouse
    JOIN sku ON sku.code = stock.sku
    WHERE stock.available >= wanted.total AND sku.sale_status = ANY (p_sellable)
        AND sku.per_user_limit IS NULL;
    IF v_fitting < cardinality(p_total_skus) THEN
        RETURN 'does_not_fit';
    END IF;

    v_records_stored := stockd_insert_reservation_rows(p_now,
        p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users,
        p_line_reservations, p_line_numbers, p_line_skus, p_line_warehouses,
        p_line_quantities, p_line_keys,
        p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies);
    IF v_records_stored <> cardinality(p_record_keys) THEN
        RAISE EXCEPTION 'stored % of % idempotency records: a key was committed concurrently',
            v_records_stored, cardinality(p_record_keys) USING ERRCODE = 'SK001';
    END IF;

    SELECT COUNT(*) FILTER (WHERE locked.available >= locked.total) INTO v_fitting
    FROM (SELECT stock.available, wanted.total
          FROM stock
          JOIN UNNEST(p_total_skus, p_total_warehouses, p_total_quantities)
              AS wanted (sku, warehouse, total)
              ON stock.sku = wanted.sku AND stock.warehouse = wanted.warehouse
          ORDER BY stock.sku COLLATE "C", stock.warehouse COLLATE "C"
          FOR UPDATE OF stock) AS locked;
    IF v_fitting < cardinality(p_total_skus) THEN
        RAISE EXCEPTION 'the batch no longer fits its locked rows' USING ERRCODE = 'SK003';
    END IF;
    SELECT COUNT(DISTINCT sku.code),
        COUNT(DISTINCT sku.code) FILTER (WHERE sku.sale_status = ANY (p_sellable)
            AND sku.per_user_limit IS NULL)
    INTO v_skus_total, v_skus_sellable
    FROM sku WHERE sku.code = ANY (p_total_skus);
    IF v_skus_sellable < v_skus_total THEN
        RAISE EXCEPTION 'a SKU of the batch went off sale or got a per-user limit'
            USING ERRCODE = 'SK003';
    END IF;

    v_rows_taken := stockd_take_stock(p_now, p_total_skus, p_total_warehouses,
        p_total_quantities);
    IF v_rows_taken <> cardinality(p_total_skus) THEN
        RAISE EXCEPTION 'reserving batch totals changed % of % locked rows',
            v_rows_taken, cardinality(p_total_skus) USING ERRCODE = 'SK002';
    END IF;
    RETURN 'applied';
END
$$;

-- The settings of migrations 0007 and 0008, on the new signatures.
ALTER FUNCTION stockd_write_reservation_batch(
    BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], TEXT[],
    BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION stockd_reserve_whole_batch(
    TEXT[], BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[],
    TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION stockd_write_reservation_batch(
    BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], TEXT[],
    BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET enable_seqscan = off;
ALTER FUNCTION stockd_reserve_whole_batch(
    TEXT[], BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[],
    TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET enable_seqscan = off;

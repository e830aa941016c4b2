-- The whole-batch function's idempotency-key lookup as a cached statement.
--
-- Migration 0006 EXECUTEd the lookup, so it was parsed and planned at every call: a
-- generic plan cached while `idempotency_record` was small would have kept a
-- sequential scan as the table grew. Migration 0008 has since run the function with
-- `enable_seqscan = off`, so the generic plan is the primary-key lookup from the first
-- call, whatever the table's size or statistics, and the per-call parse and plan only
-- cost: about 2 % of the machine's CPU on the hot path, a twentieth of PostgreSQL's
-- (docs/BENCHMARKS.md, fourteenth session). The test
-- `consistency::the_whole_batch_key_lookup_reads_the_primary_key_of_a_table_analyzed_small`
-- holds the plan to the index.
--
-- The body is migration 0009's but for the lookup; CREATE OR REPLACE keeps the
-- signature, and repeats the settings it would otherwise reset.
CREATE OR REPLACE FUNCTION stockd_reserve_whole_batch(
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
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_seen BOOLEAN;
    v_fitting BIGINT;
    v_rows_taken BIGINT;
    v_records_stored BIGINT;
    v_skus_total BIGINT;
    v_skus_sellable BIGINT;
BEGIN
    SELECT EXISTS (SELECT 1 FROM idempotency_record WHERE key = ANY (p_record_keys))
        INTO v_seen;
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

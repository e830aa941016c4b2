-- Two measured savings on the reservation batch functions of migration 0006 (issue 6;
-- docs/BENCHMARKS.md, "Generic plans and plain record inserts").
--
-- 1. Generic plans. PL/pgSQL plans a statement with its parameter values for the
--    first five calls, then keeps doing so whenever those custom plans look cheaper
--    than a generic one — and here they always do, because a custom plan sees the
--    arrays' real lengths. Every call planned its statements again: about half a
--    millisecond of a batch that takes two. The planned statements read `stock` and
--    `sku` through their primary keys and insert from arrays; neither table grows
--    with requests, and a change of their statistics (ANALYZE) invalidates the cached
--    plans anyway. The one read of a table that does grow with requests, the
--    idempotency-key lookup, is EXECUTEd: planned at every call, whatever this says.
--
-- 2. Idempotency records inserted without ON CONFLICT. Both callers have looked the
--    keys up before they write, so a conflict means another process committed one of
--    them in between. A speculative insert (ON CONFLICT) cost about twice a plain one;
--    now that rare race raises unique_violation (23505) instead of coming up short,
--    which rolls the batch back just the same: the batch transaction retries it
--    (`StoreError::Retryable`), the whole-batch fast path hands it to the batch
--    transaction (formerly SK001, which no longer arises). A key held by another
--    process's open transaction still makes the insert wait for it, bounded by
--    `lock_timeout`, as before.

CREATE OR REPLACE FUNCTION stockd_insert_reservation_rows(
    p_now BIGINT,
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
    p_line_reservations TEXT[], p_line_numbers BIGINT[], p_line_skus TEXT[],
    p_line_warehouses TEXT[], p_line_quantities BIGINT[], p_line_keys TEXT[],
    p_record_keys TEXT[], p_record_fingerprints TEXT[], p_record_statuses BIGINT[],
    p_record_bodies TEXT[],
    OUT records_stored BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO reservation
        (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at)
    SELECT batch.id, 'RESERVED', NULL, batch.expires_at, batch.key, p_now, p_now
    FROM UNNEST(p_reservation_ids, p_reservation_expiries, p_reservation_keys)
        AS batch (id, expires_at, key);
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

-- The setting holds for everything a call runs, the nested functions included.
ALTER FUNCTION stockd_write_reservation_batch(
    BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[],
    TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION stockd_reserve_whole_batch(
    TEXT[], BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[],
    TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET plan_cache_mode = force_generic_plan;

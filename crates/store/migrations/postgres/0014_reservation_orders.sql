-- The one writer of reservation rows on PostgreSQL, `stockd_insert_reservation_rows`,
-- learns the order that holds a reservation (NULL for a reservation of its own), so
-- every path that creates reservations goes through it: the batch transaction and the
-- whole-batch fast path (as before), and now orders, checkouts and late successes
-- (`store::backends::postgres`, `Dialect::write_reservations`). A missing
-- `p_reservation_orders` (or a shorter one) leaves `order_id` NULL: UNNEST pads the
-- shorter arrays with NULLs.
DROP FUNCTION stockd_write_reservation_batch(bigint, text[], text[], bigint[], text[],
    bigint[], text[], text[], text[], text[], bigint[], text[], text[], bigint[], text[],
    text[], text[], bigint[], text[]);
DROP FUNCTION stockd_insert_reservation_rows(bigint, text[], bigint[], text[], text[],
    text[], text[], bigint[], text[], text[], bigint[], text[], text[], text[], bigint[],
    text[]);

CREATE FUNCTION stockd_insert_reservation_rows(p_now bigint, p_reservation_ids text[],
    p_reservation_expiries bigint[], p_reservation_keys text[], p_reservation_shops text[],
    p_reservation_users text[], p_line_reservations text[], p_line_numbers bigint[],
    p_line_skus text[], p_line_warehouses text[], p_line_quantities bigint[],
    p_line_keys text[], p_record_keys text[], p_record_fingerprints text[],
    p_record_statuses bigint[], p_record_bodies text[],
    p_reservation_orders text[] DEFAULT NULL, OUT records_stored bigint)
    LANGUAGE plpgsql
    AS $$
BEGIN
    INSERT INTO reservation
        (id, status, release_reason, expires_at, idempotency_key, created_at, updated_at,
         order_id, shop, user_id)
    SELECT batch.id, 'RESERVED', NULL, batch.expires_at, batch.key, p_now, p_now,
        batch.order_id, batch.shop, batch.user_id
    FROM UNNEST(p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users,
        COALESCE(p_reservation_orders, '{}'::text[]))
        AS batch (id, expires_at, key, shop, user_id, order_id)
    WHERE batch.id IS NOT NULL;
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

CREATE FUNCTION stockd_write_reservation_batch(p_now bigint, p_total_skus text[],
    p_total_warehouses text[], p_total_quantities bigint[], p_reservation_ids text[],
    p_reservation_expiries bigint[], p_reservation_keys text[], p_reservation_shops text[],
    p_reservation_users text[], p_line_reservations text[], p_line_numbers bigint[],
    p_line_skus text[], p_line_warehouses text[], p_line_quantities bigint[],
    p_line_keys text[], p_record_keys text[], p_record_fingerprints text[],
    p_record_statuses bigint[], p_record_bodies text[],
    p_reservation_orders text[] DEFAULT NULL,
    OUT rows_taken bigint, OUT records_stored bigint)
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    AS $$
BEGIN
    rows_taken := stockd_take_stock(p_now, p_total_skus, p_total_warehouses,
        p_total_quantities);
    records_stored := stockd_insert_reservation_rows(p_now,
        p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users,
        p_line_reservations, p_line_numbers, p_line_skus, p_line_warehouses,
        p_line_quantities, p_line_keys,
        p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies,
        p_reservation_orders);
END
$$;

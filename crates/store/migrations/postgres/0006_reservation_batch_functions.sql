-- The reservation batch on the server side (issue 6).
--
-- Two building blocks, each the only definition of what it writes:
-- `stockd_insert_reservation_rows` inserts a batch's reservations, their lines and
-- `reserve` ledger rows, and the idempotency records with their answers;
-- `stockd_take_stock` takes each stock row's total with one conditional update.
--
-- `stockd_write_reservation_batch` is the batch transaction's write: stockd calls it
-- after locking the rows and deciding every request.
--
-- `stockd_reserve_whole_batch` is the hot path's one round trip: called outside any
-- transaction, it writes and commits a batch in which every request fits (no key seen
-- before, every SKU on sale, every row holding at least the batch's total), or writes
-- nothing and says why, and stockd decides the batch request by request in its own
-- transaction. It decides nothing per request, so the arrival-order rules live in one
-- place (`store::plan`): when every row holds the batch total, every request fits in
-- what the requests before it left.

CREATE FUNCTION stockd_insert_reservation_rows(
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
    -- for each other instead of deadlocking. A key another process committed meanwhile
    -- is skipped, and the caller sees the count come up short.
    INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at)
    SELECT batch.key, batch.fingerprint, batch.status, batch.body, p_now
    FROM UNNEST(p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies)
        AS batch (key, fingerprint, status, body)
    ON CONFLICT (key) DO NOTHING;
    GET DIAGNOSTICS records_stored = ROW_COUNT;
END
$$;

-- The oversell boundary: a row gives up its total only while it holds that much.
-- Returns how many rows did; the caller compares with how many it asked.
CREATE FUNCTION stockd_take_stock(
    p_now BIGINT,
    p_total_skus TEXT[], p_total_warehouses TEXT[], p_total_quantities BIGINT[],
    OUT rows_taken BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE stock SET available = stock.available - batch.total,
        reserved = stock.reserved + batch.total, version = stock.version + 1,
        updated_at = p_now
    FROM UNNEST(p_total_skus, p_total_warehouses, p_total_quantities)
        AS batch (sku, warehouse, total)
    WHERE stock.sku = batch.sku AND stock.warehouse = batch.warehouse
        AND stock.available >= batch.total;
    GET DIAGNOSTICS rows_taken = ROW_COUNT;
END
$$;

CREATE FUNCTION stockd_write_reservation_batch(
    p_now BIGINT,
    p_total_skus TEXT[], p_total_warehouses TEXT[], p_total_quantities BIGINT[],
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
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
        p_line_reservations, p_line_numbers, p_line_skus, p_line_warehouses,
        p_line_quantities, p_line_keys,
        p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies);
END
$$;

-- Returns 'applied' (written and, outside a transaction, committed), 'replay' (a key
-- has a record: nothing written) or 'does_not_fit' (a row lacks stock, is missing, or
-- its SKU is not on sale: nothing written). Raises, rolling everything back:
-- SK001 when a key was committed by another process meanwhile, SK003 when the batch
-- no longer fits once its rows are locked (stock taken or a SKU taken off the shelf
-- meanwhile), SK002 when a locked row's conditional update did not match (an invariant
-- violation).
--
-- The hot row is locked last: the batch's inserts (four rows per request, most of its
-- cost) run before it, so batches of the same SKU insert in parallel and hold the row
-- only for the update and the commit. The check that the batch fits is made twice:
-- first from the statement's snapshot, so a batch that cannot fit writes nothing,
-- then on the locked rows, which is the one that counts.
CREATE FUNCTION stockd_reserve_whole_batch(
    p_sellable TEXT[],
    p_now BIGINT,
    p_total_skus TEXT[], p_total_warehouses TEXT[], p_total_quantities BIGINT[],
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
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
    -- Planned at every call (EXECUTE): a plan cached while the table was small keeps
    -- a sequential scan as it grows to millions of rows.
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
    WHERE stock.available >= wanted.total AND sku.sale_status = ANY (p_sellable);
    IF v_fitting < cardinality(p_total_skus) THEN
        RETURN 'does_not_fit';
    END IF;

    v_records_stored := stockd_insert_reservation_rows(p_now,
        p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_line_reservations, p_line_numbers, p_line_skus, p_line_warehouses,
        p_line_quantities, p_line_keys,
        p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies);
    IF v_records_stored <> cardinality(p_record_keys) THEN
        RAISE EXCEPTION 'stored % of % idempotency records: a key was committed concurrently',
            v_records_stored, cardinality(p_record_keys) USING ERRCODE = 'SK001';
    END IF;

    -- The rows, in byte order of (sku, warehouse) like every other writer, so batches
    -- of several rows cannot deadlock.
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
    -- A shelf change locks the stock rows before it changes a SKU, so with the rows
    -- locked this statement (a new snapshot) reads the newest status, and no change
    -- can land before the commit.
    SELECT COUNT(DISTINCT sku.code),
        COUNT(DISTINCT sku.code) FILTER (WHERE sku.sale_status = ANY (p_sellable))
    INTO v_skus_total, v_skus_sellable
    FROM sku WHERE sku.code = ANY (p_total_skus);
    IF v_skus_sellable < v_skus_total THEN
        RAISE EXCEPTION 'a SKU of the batch went off sale' USING ERRCODE = 'SK003';
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

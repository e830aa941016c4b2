-- The hot path's one round trip, with the writer's position in its answer.
--
-- Every answer of a batch carries `Stockd-Consistency-Token`: a WAL position at or
-- past the batch's commit. `stockd_reserve_whole_batch` (migration 0009) commits with
-- its statement, after it has returned, so it cannot read that position, and the
-- batch's answers waited for a second round trip (`SELECT pg_current_wal_lsn()`) after
-- the commit: about a tenth of the hot path's throughput at 64 clients and a seventh
-- of a single client's (docs/BENCHMARKS.md, twelfth session). A procedure called
-- outside a transaction block may commit in its body and go on: this one commits an
-- applied batch and then reads the position, which comes back with the answer.
--
-- A procedure that commits may carry no SET clause; the function it calls keeps its
-- plan settings. Anything but 'applied' wrote nothing and reads no position.
CREATE PROCEDURE stockd_reserve_whole_batch_committed(
    p_sellable TEXT[],
    p_now BIGINT,
    p_total_skus TEXT[], p_total_warehouses TEXT[], p_total_quantities BIGINT[],
    p_reservation_ids TEXT[], p_reservation_expiries BIGINT[], p_reservation_keys TEXT[],
    p_reservation_shops TEXT[], p_reservation_users TEXT[],
    p_line_reservations TEXT[], p_line_numbers BIGINT[], p_line_skus TEXT[],
    p_line_warehouses TEXT[], p_line_quantities BIGINT[], p_line_keys TEXT[],
    p_record_keys TEXT[], p_record_fingerprints TEXT[], p_record_statuses BIGINT[],
    p_record_bodies TEXT[],
    OUT p_answer TEXT, OUT p_position TEXT)
LANGUAGE plpgsql AS $$
BEGIN
    p_answer := stockd_reserve_whole_batch(p_sellable, p_now,
        p_total_skus, p_total_warehouses, p_total_quantities,
        p_reservation_ids, p_reservation_expiries, p_reservation_keys,
        p_reservation_shops, p_reservation_users,
        p_line_reservations, p_line_numbers, p_line_skus, p_line_warehouses,
        p_line_quantities, p_line_keys,
        p_record_keys, p_record_fingerprints, p_record_statuses, p_record_bodies);
    IF p_answer = 'applied' THEN
        COMMIT;
        p_position := pg_current_wal_lsn()::text;
    END IF;
END
$$;

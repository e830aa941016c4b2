-- The reservation batch functions read `stock` and `sku` through their primary keys,
-- whatever the tables' size or statistics (issue 6; docs/BENCHMARKS.md, "Fourth
-- session: another machine, plans that outlive a small catalog, a flat audit").
--
-- Migration 0007 made the functions keep generic plans. A generic plan is made once per
-- connection, from the statistics of that moment, and kept until the next ANALYZE of
-- the table. A shop that starts with a handful of SKUs gets sequential scans of `stock`
-- and `sku` (the cheapest way to read one page), and keeps them when it adds ten
-- thousand SKUs, until autovacuum analyzes the table: measured, the spread load ran at
-- 6,000 reservations/s instead of 10,700 on the same server until a manual ANALYZE.
-- With sequential scans disabled the plan is the primary-key lookup from the first
-- call, which costs the same on a one-row table and stays right as the table grows.
-- Nothing in these functions scans a table on purpose: every read is by key, every
-- insert is from arrays.

ALTER FUNCTION stockd_write_reservation_batch(
    BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[], TEXT[],
    TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET enable_seqscan = off;
ALTER FUNCTION stockd_reserve_whole_batch(
    TEXT[], BIGINT, TEXT[], TEXT[], BIGINT[], TEXT[], BIGINT[], TEXT[], TEXT[], BIGINT[],
    TEXT[], TEXT[], BIGINT[], TEXT[], TEXT[], TEXT[], BIGINT[], TEXT[])
    SET enable_seqscan = off;

-- The audit joins every reservation line to its ledger rows by (reference, sku,
-- warehouse). With only `reference` indexed, SQLite's planner preferred the
-- (sku, warehouse) index, which on a hot SKU matches every ledger row of that SKU:
-- the audit turned quadratic. One index on all three columns serves the audit; the
-- (sku, warehouse) index served no query and cost every reservation an index entry
-- on the hottest page of the table, so it goes.
DROP INDEX stock_ledger_reference;
DROP INDEX stock_ledger_stock;
CREATE INDEX stock_ledger_reference ON stock_ledger (reference, sku, warehouse);

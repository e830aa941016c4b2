-- The shelf log read by SKU: see the PostgreSQL migration 0027.
CREATE INDEX shelf_log_sku ON shelf_log (sku, id);

-- The shelf log read by SKU (`GET /v1/admin/shelf-log?sku=…`, and every operator's
-- view of one SKU's history) follows this index in id order instead of scanning the
-- whole log.
CREATE INDEX shelf_log_sku ON shelf_log (sku, id);

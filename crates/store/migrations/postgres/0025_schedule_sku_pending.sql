-- A SKU's pending schedules: read when it is deleted (they are cancelled with it) and
-- when the worker checks that none due earlier is still pending. Partial, as the
-- history of settled schedules only grows. MySQL has this index already: the one its
-- foreign key on `sku` made.
CREATE INDEX shelf_schedule_sku_pending ON shelf_schedule (sku) WHERE status = 'PENDING';

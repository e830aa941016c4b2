-- Daily schedules and cancelling a schedule: see the PostgreSQL migration 0023.
-- MariaDB keeps a column's CHECK with the column: redefining the column replaces it.
ALTER TABLE shelf_schedule MODIFY status VARCHAR(16) NOT NULL
    CHECK (status IN ('PENDING', 'APPLIED', 'SKIPPED', 'REFUSED', 'CANCELLED'));
ALTER TABLE shelf_schedule ADD COLUMN series_id VARCHAR(100);
UPDATE shelf_schedule SET series_id = id;
ALTER TABLE shelf_schedule MODIFY series_id VARCHAR(100) NOT NULL;
ALTER TABLE shelf_schedule ADD COLUMN recurrence VARCHAR(8) CHECK (recurrence IN ('daily'));
-- A series' pending occurrence (a cancel), a shop's pending count (the cap).
CREATE INDEX shelf_schedule_series ON shelf_schedule (series_id);
CREATE INDEX shelf_schedule_shop_pending ON shelf_schedule (shop, status);

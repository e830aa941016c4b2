-- Daily schedules and cancelling a schedule (seed 003 §1.2: fresh food off at 20:00
-- and back at 06:00, every day). A daily schedule's occurrence leaves the next one
-- pending when it settles; `series_id` is the first occurrence's id, shared by all of
-- them, so the id the operator was given still names the series. `CANCELLED` is a
-- pending schedule withdrawn before it came due.
ALTER TABLE shelf_schedule DROP CONSTRAINT shelf_schedule_status_check;
ALTER TABLE shelf_schedule ADD CONSTRAINT shelf_schedule_status_check
    CHECK (status IN ('PENDING', 'APPLIED', 'SKIPPED', 'REFUSED', 'CANCELLED'));
ALTER TABLE shelf_schedule ADD COLUMN series_id TEXT;
UPDATE shelf_schedule SET series_id = id;
ALTER TABLE shelf_schedule ALTER COLUMN series_id SET NOT NULL;
ALTER TABLE shelf_schedule ADD COLUMN recurrence TEXT CHECK (recurrence IN ('daily'));
-- A series' pending occurrence (a cancel), a shop's pending count (the cap).
CREATE INDEX shelf_schedule_series ON shelf_schedule (series_id);
CREATE INDEX shelf_schedule_shop_pending ON shelf_schedule (shop) WHERE status = 'PENDING';

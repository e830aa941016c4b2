-- Daily schedules and cancelling a schedule (seed 003 §1.2: fresh food off at 20:00
-- and back at 06:00, every day). A daily schedule's occurrence leaves the next one
-- pending when it settles; `series_id` is the first occurrence's id, shared by all of
-- them, so the id the operator was given still names the series. `CANCELLED` is a
-- pending schedule withdrawn before it came due.
--
-- SQLite cannot change a CHECK constraint in place: the table is rebuilt.
CREATE TABLE shelf_schedule_rebuilt (
    id          TEXT    NOT NULL PRIMARY KEY,
    sku         TEXT    NOT NULL REFERENCES sku (code),
    operation   TEXT    NOT NULL CHECK (operation IN ('on', 'off')),
    due_at      INTEGER NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('PENDING', 'APPLIED', 'SKIPPED', 'REFUSED', 'CANCELLED')),
    operator_id TEXT    NOT NULL,
    shop        TEXT,
    remark      TEXT    NOT NULL DEFAULT '',
    outcome     TEXT    NOT NULL DEFAULT '',
    created_at  INTEGER NOT NULL,
    applied_at  INTEGER,
    series_id   TEXT    NOT NULL,
    recurrence  TEXT    CHECK (recurrence IN ('daily'))
) STRICT;

INSERT INTO shelf_schedule_rebuilt (id, sku, operation, due_at, status, operator_id, shop, remark,
    outcome, created_at, applied_at, series_id, recurrence)
SELECT id, sku, operation, due_at, status, operator_id, shop, remark,
    outcome, created_at, applied_at, id, NULL FROM shelf_schedule;

DROP TABLE shelf_schedule;
ALTER TABLE shelf_schedule_rebuilt RENAME TO shelf_schedule;
-- The schedule worker's queue: only pending schedules, by due time.
CREATE INDEX shelf_schedule_due ON shelf_schedule (due_at) WHERE status = 'PENDING';
-- A series' pending occurrence (a cancel), a shop's pending count (the cap).
CREATE INDEX shelf_schedule_series ON shelf_schedule (series_id);
CREATE INDEX shelf_schedule_shop_pending ON shelf_schedule (shop) WHERE status = 'PENDING';

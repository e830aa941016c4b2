-- A reservation's lines are distinct per (sku, warehouse) — the engine refuses a
-- request that repeats one — so the table's key can say so: the primary key becomes
-- (reservation_id, sku, warehouse), and the second unique index every reservation
-- paid an insertion into goes away. SQLite cannot change a key in place: rebuild.
CREATE TABLE reservation_line_new (
    reservation_id TEXT    NOT NULL REFERENCES reservation (id),
    line_number    INTEGER NOT NULL CHECK (line_number >= 0),
    sku            TEXT    NOT NULL,
    warehouse      TEXT    NOT NULL,
    quantity       INTEGER NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (reservation_id, sku, warehouse)
) STRICT;
INSERT INTO reservation_line_new (reservation_id, line_number, sku, warehouse, quantity)
    SELECT reservation_id, line_number, sku, warehouse, quantity FROM reservation_line;
DROP TABLE reservation_line;
ALTER TABLE reservation_line_new RENAME TO reservation_line;

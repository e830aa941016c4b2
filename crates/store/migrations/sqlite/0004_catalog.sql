-- The catalog (seed 003): products (SPUs) owning SKUs, the shelf log, scheduled shelf
-- changes, operators bound to a shop, and carts. Stock stays in its own table.

CREATE TABLE product (
    id         TEXT    NOT NULL PRIMARY KEY,
    title      TEXT    NOT NULL,
    image_url  TEXT,
    category   TEXT    NOT NULL,
    supplier   TEXT    NOT NULL,
    shop       TEXT    NOT NULL,
    version    INTEGER NOT NULL DEFAULT 1 CHECK (version >= 1),
    deleted_at INTEGER,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
) STRICT;

CREATE INDEX product_shop_category ON product (shop, category);
CREATE INDEX product_shop_supplier ON product (shop, supplier);

ALTER TABLE sku ADD COLUMN product_id TEXT REFERENCES product (id);
ALTER TABLE sku ADD COLUMN spec TEXT NOT NULL DEFAULT '';
CREATE INDEX sku_product ON sku (product_id);

CREATE TABLE shelf_log (
    id            INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    product_id    TEXT,
    sku           TEXT    NOT NULL,
    operator_id   TEXT    NOT NULL,
    operator_type TEXT    NOT NULL CHECK (operator_type IN ('manual', 'scheduled', 'system')),
    from_status   TEXT    NOT NULL,
    to_status     TEXT    NOT NULL,
    operation     TEXT    NOT NULL,
    repeated      INTEGER NOT NULL CHECK (repeated IN (0, 1)),
    remark        TEXT    NOT NULL DEFAULT '',
    created_at    INTEGER NOT NULL
) STRICT;

CREATE INDEX shelf_log_product ON shelf_log (product_id, id);
CREATE INDEX shelf_log_created ON shelf_log (created_at, id);

CREATE TRIGGER shelf_log_no_update BEFORE UPDATE ON shelf_log
BEGIN
    SELECT RAISE(ABORT, 'shelf_log is append-only');
END;

CREATE TRIGGER shelf_log_no_delete BEFORE DELETE ON shelf_log
BEGIN
    SELECT RAISE(ABORT, 'shelf_log is append-only');
END;

CREATE TABLE shelf_schedule (
    id          TEXT    NOT NULL PRIMARY KEY,
    sku         TEXT    NOT NULL REFERENCES sku (code),
    operation   TEXT    NOT NULL CHECK (operation IN ('on', 'off')),
    due_at      INTEGER NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('PENDING', 'APPLIED', 'SKIPPED', 'REFUSED')),
    operator_id TEXT    NOT NULL,
    shop        TEXT,
    remark      TEXT    NOT NULL DEFAULT '',
    outcome     TEXT    NOT NULL DEFAULT '',
    created_at  INTEGER NOT NULL,
    applied_at  INTEGER
) STRICT;

-- The schedule worker's queue: only pending schedules, by due time.
CREATE INDEX shelf_schedule_due ON shelf_schedule (due_at) WHERE status = 'PENDING';

CREATE TABLE operator (
    id         TEXT    NOT NULL PRIMARY KEY,
    shop       TEXT    NOT NULL,
    token_hash TEXT    NOT NULL UNIQUE,
    created_at INTEGER NOT NULL
) STRICT;

CREATE TABLE cart_item (
    user_id    TEXT    NOT NULL,
    sku        TEXT    NOT NULL,
    quantity   INTEGER NOT NULL CHECK (quantity > 0),
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (user_id, sku)
) STRICT;

-- The live auditor's checkpoint: see the PostgreSQL migration 0016.
CREATE TABLE audit_progress (
    name              TEXT    NOT NULL PRIMARY KEY CHECK (name IN ('live')),
    through_ledger_id INTEGER NOT NULL CHECK (through_ledger_id >= 0),
    checked_at        INTEGER NOT NULL
) STRICT;
INSERT INTO audit_progress (name, through_ledger_id, checked_at) VALUES ('live', 0, 0);

CREATE TABLE audit_running_sum (
    sku           TEXT    NOT NULL,
    warehouse     TEXT    NOT NULL,
    available_sum INTEGER NOT NULL,
    reserved_sum  INTEGER NOT NULL,
    PRIMARY KEY (sku, warehouse)
) STRICT;

CREATE INDEX customer_order_updated ON customer_order (updated_at);

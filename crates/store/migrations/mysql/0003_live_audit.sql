-- The live auditor's checkpoint: see the PostgreSQL migration 0016.
CREATE TABLE audit_progress (
    name VARCHAR(16) NOT NULL PRIMARY KEY CHECK (name IN ('live')),
    through_ledger_id BIGINT NOT NULL CHECK (through_ledger_id >= 0),
    checked_at BIGINT NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
INSERT INTO audit_progress (name, through_ledger_id, checked_at) VALUES ('live', 0, 0);

CREATE TABLE audit_running_sum (
    sku VARCHAR(64) NOT NULL,
    warehouse VARCHAR(32) NOT NULL,
    available_sum BIGINT NOT NULL,
    reserved_sum BIGINT NOT NULL,
    PRIMARY KEY (sku, warehouse)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE INDEX customer_order_updated ON customer_order (updated_at);

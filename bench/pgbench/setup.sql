-- The seeds' own tables (seed 002 五.1 and 五.2), in a schema of their own, with
-- 10,000 SKUs of ample stock. Run before every baseline so each starts alike.
DROP SCHEMA IF EXISTS stockd_pgbench CASCADE;
CREATE SCHEMA stockd_pgbench;
SET search_path TO stockd_pgbench;

CREATE TABLE inventory (
    sku_id             BIGINT PRIMARY KEY,
    available_quantity BIGINT NOT NULL CHECK (available_quantity >= 0),
    locked_quantity    BIGINT NOT NULL DEFAULT 0,
    sold_quantity      BIGINT NOT NULL DEFAULT 0,
    version            BIGINT NOT NULL DEFAULT 0,
    updated_at         TIMESTAMP NOT NULL
);

CREATE TABLE inventory_deduction_record (
    request_id  VARCHAR(64) PRIMARY KEY,
    order_id    VARCHAR(64) NOT NULL,
    sku_id      BIGINT NOT NULL,
    quantity    BIGINT NOT NULL,
    status      VARCHAR(20) NOT NULL,
    result_code VARCHAR(40),
    created_at  TIMESTAMP NOT NULL,
    updated_at  TIMESTAMP NOT NULL
);

INSERT INTO inventory (sku_id, available_quantity, updated_at)
SELECT sku, 1000000000, now() FROM generate_series(1, 10000) AS sku;

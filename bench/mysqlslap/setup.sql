-- The seeds' own tables (seed 002 五.1 and 五.2) in a database of their own, with
-- 10,000 SKUs of ample stock; the MySQL/MariaDB twin of bench/pgbench/setup.sql. Run
-- before every baseline so each starts alike.
DROP DATABASE IF EXISTS stockd_slap;
CREATE DATABASE stockd_slap;
USE stockd_slap;

CREATE TABLE inventory (
    sku_id             BIGINT PRIMARY KEY,
    available_quantity BIGINT NOT NULL CHECK (available_quantity >= 0),
    locked_quantity    BIGINT NOT NULL DEFAULT 0,
    sold_quantity      BIGINT NOT NULL DEFAULT 0,
    version            BIGINT NOT NULL DEFAULT 0,
    updated_at         DATETIME NOT NULL
) ENGINE=InnoDB;

CREATE TABLE inventory_deduction_record (
    request_id  VARCHAR(64) PRIMARY KEY,
    order_id    VARCHAR(64) NOT NULL,
    sku_id      BIGINT NOT NULL,
    quantity    BIGINT NOT NULL,
    status      VARCHAR(20) NOT NULL,
    result_code VARCHAR(40),
    created_at  DATETIME NOT NULL,
    updated_at  DATETIME NOT NULL
) ENGINE=InnoDB;

CREATE TABLE digit (d BIGINT PRIMARY KEY);
INSERT INTO digit VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9);
INSERT INTO inventory (sku_id, available_quantity, updated_at)
SELECT 1 + ones.d + 10 * tens.d + 100 * hundreds.d + 1000 * thousands.d, 1000000000, NOW()
FROM digit ones, digit tens, digit hundreds, digit thousands;
DROP TABLE digit;

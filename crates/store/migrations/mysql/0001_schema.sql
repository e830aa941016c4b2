-- The whole schema for MySQL 8 and MariaDB >= 10.6, equal to what the SQLite and
-- PostgreSQL migrations up to their latest version build.
--
-- Every text column compares and sorts byte by byte (utf8mb4_bin): SKU codes that
-- differ only in case are different SKUs, as on the other backends, and rows sort in
-- the order the Rust code sorts them (the global lock order). Partial indexes do not
-- exist here: the "at most one" rules of payment attempts are unique indexes on
-- generated columns that hold the order id only in the status they constrain.
-- MariaDB enforces CHECK constraints (MySQL since 8.0.16).
--
-- DDL commits by itself on MySQL: a migration that fails half-way is not rolled back.

CREATE TABLE product (
    id VARCHAR(100) NOT NULL PRIMARY KEY,
    title VARCHAR(255) NOT NULL,
    image_url TEXT,
    category VARCHAR(64) NOT NULL,
    supplier VARCHAR(64) NOT NULL,
    shop VARCHAR(64) NOT NULL,
    version BIGINT NOT NULL DEFAULT 1 CHECK (version >= 1),
    deleted_at BIGINT,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    KEY product_shop_category (shop, category),
    KEY product_shop_supplier (shop, supplier)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE sku (
    code VARCHAR(64) NOT NULL PRIMARY KEY,
    title VARCHAR(255) NOT NULL DEFAULT '',
    price_minor BIGINT CHECK (price_minor IS NULL OR price_minor >= 0),
    currency VARCHAR(8),
    low_stock_threshold BIGINT NOT NULL DEFAULT 0 CHECK (low_stock_threshold >= 0),
    sale_status VARCHAR(32) NOT NULL DEFAULT 'ON_SHELF'
        CHECK (sale_status IN ('PENDING_REVIEW', 'ON_SHELF', 'OFF_SHELF', 'DELETED')),
    version BIGINT NOT NULL DEFAULT 1 CHECK (version >= 1),
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    product_id VARCHAR(100),
    spec VARCHAR(255) NOT NULL DEFAULT '',
    shop VARCHAR(64) NOT NULL DEFAULT 'default',
    per_user_limit BIGINT CHECK (per_user_limit IS NULL OR per_user_limit > 0),
    KEY sku_product (product_id),
    CONSTRAINT sku_product_id_fkey FOREIGN KEY (product_id) REFERENCES product (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE stock (
    sku VARCHAR(64) NOT NULL,
    warehouse VARCHAR(32) NOT NULL,
    available BIGINT NOT NULL CHECK (available >= 0),
    reserved BIGINT NOT NULL CHECK (reserved >= 0),
    version BIGINT NOT NULL CHECK (version >= 1),
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (sku, warehouse),
    CONSTRAINT stock_sku_fkey FOREIGN KEY (sku) REFERENCES sku (code)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE stock_ledger (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    sku VARCHAR(64) NOT NULL,
    warehouse VARCHAR(32) NOT NULL,
    kind VARCHAR(16) NOT NULL
        CHECK (kind IN ('receive', 'adjust', 'reserve', 'confirm', 'release', 'return')),
    available_delta BIGINT NOT NULL,
    reserved_delta BIGINT NOT NULL,
    reference VARCHAR(100) NOT NULL,
    idempotency_key VARCHAR(512),
    created_at BIGINT NOT NULL,
    KEY stock_ledger_reference (reference, sku, warehouse)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TRIGGER stock_ledger_no_update BEFORE UPDATE ON stock_ledger FOR EACH ROW
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'stock_ledger is append-only';
CREATE TRIGGER stock_ledger_no_delete BEFORE DELETE ON stock_ledger FOR EACH ROW
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'stock_ledger is append-only';

CREATE TABLE reservation (
    id VARCHAR(100) NOT NULL PRIMARY KEY,
    status VARCHAR(16) NOT NULL CHECK (status IN ('RESERVED', 'CONFIRMED', 'RELEASED')),
    release_reason VARCHAR(16) CHECK (release_reason IN ('requested', 'expired')),
    expires_at BIGINT NOT NULL,
    idempotency_key VARCHAR(512),
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    order_id VARCHAR(100),
    shop VARCHAR(64),
    user_id VARCHAR(255),
    CONSTRAINT reservation_released_has_reason CHECK ((status = 'RELEASED') = (release_reason IS NOT NULL)),
    KEY reservation_expiry (status, expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE reservation_line (
    reservation_id VARCHAR(100) NOT NULL,
    line_number BIGINT NOT NULL CHECK (line_number >= 0),
    sku VARCHAR(64) NOT NULL,
    warehouse VARCHAR(32) NOT NULL,
    quantity BIGINT NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (reservation_id, sku, warehouse),
    CONSTRAINT reservation_line_reservation_id_fkey FOREIGN KEY (reservation_id) REFERENCES reservation (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE idempotency_record (
    `key` VARCHAR(512) NOT NULL PRIMARY KEY,
    fingerprint VARCHAR(128) NOT NULL,
    status_code BIGINT NOT NULL,
    body MEDIUMTEXT NOT NULL,
    created_at BIGINT NOT NULL,
    KEY idempotency_record_created (created_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE shelf_log (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    product_id VARCHAR(100),
    sku VARCHAR(64) NOT NULL,
    operator_id VARCHAR(128) NOT NULL,
    operator_type VARCHAR(16) NOT NULL CHECK (operator_type IN ('manual', 'scheduled', 'system')),
    from_status VARCHAR(32) NOT NULL,
    to_status VARCHAR(32) NOT NULL,
    operation VARCHAR(32) NOT NULL,
    repeated BIGINT NOT NULL CHECK (repeated IN (0, 1)),
    remark VARCHAR(1000) NOT NULL DEFAULT '',
    created_at BIGINT NOT NULL,
    KEY shelf_log_created (created_at, id),
    KEY shelf_log_product (product_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TRIGGER shelf_log_no_update BEFORE UPDATE ON shelf_log FOR EACH ROW
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'shelf_log is append-only';
CREATE TRIGGER shelf_log_no_delete BEFORE DELETE ON shelf_log FOR EACH ROW
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'shelf_log is append-only';

CREATE TABLE shelf_schedule (
    id VARCHAR(100) NOT NULL PRIMARY KEY,
    sku VARCHAR(64) NOT NULL,
    operation VARCHAR(8) NOT NULL CHECK (operation IN ('on', 'off')),
    due_at BIGINT NOT NULL,
    status VARCHAR(16) NOT NULL CHECK (status IN ('PENDING', 'APPLIED', 'SKIPPED', 'REFUSED')),
    operator_id VARCHAR(128) NOT NULL,
    shop VARCHAR(64),
    remark VARCHAR(1000) NOT NULL DEFAULT '',
    outcome VARCHAR(1000) NOT NULL DEFAULT '',
    created_at BIGINT NOT NULL,
    applied_at BIGINT,
    KEY shelf_schedule_due (status, due_at),
    CONSTRAINT shelf_schedule_sku_fkey FOREIGN KEY (sku) REFERENCES sku (code)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- MySQL has no transaction-scoped advisory lock: a shelf batch locks its shop's row
-- here (created on first use) until its commit.
CREATE TABLE shelf_batch_lock (
    shop VARCHAR(64) NOT NULL PRIMARY KEY,
    batches BIGINT NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE cart_item (
    user_id VARCHAR(255) NOT NULL,
    sku VARCHAR(64) NOT NULL,
    quantity BIGINT NOT NULL CHECK (quantity > 0),
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    shop VARCHAR(64) NOT NULL DEFAULT 'default',
    PRIMARY KEY (user_id, sku)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE credential (
    kind VARCHAR(16) NOT NULL CHECK (kind IN ('admin', 'operator', 'service')),
    id VARCHAR(100) NOT NULL,
    name VARCHAR(255) NOT NULL,
    shop VARCHAR(64),
    secret_hash VARCHAR(128) NOT NULL,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT,
    PRIMARY KEY (kind, id),
    UNIQUE KEY credential_secret_hash_key (secret_hash),
    CONSTRAINT credential_admin_has_no_shop CHECK ((kind = 'admin') = (shop IS NULL))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE shopper_hold (
    shop VARCHAR(64) NOT NULL,
    user_id VARCHAR(255) NOT NULL,
    open_holds BIGINT NOT NULL CHECK (open_holds >= 0),
    PRIMARY KEY (shop, user_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE shopper_purchase (
    shop VARCHAR(64) NOT NULL,
    user_id VARCHAR(255) NOT NULL,
    sku VARCHAR(64) NOT NULL,
    quantity BIGINT NOT NULL CHECK (quantity >= 0),
    PRIMARY KEY (shop, user_id, sku)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE customer_order (
    id VARCHAR(100) NOT NULL PRIMARY KEY,
    user_id VARCHAR(255) NOT NULL,
    status VARCHAR(32) NOT NULL CHECK (status IN ('PENDING_PAYMENT', 'PAYMENT_PROCESSING', 'PAID',
        'PAYMENT_FAILED', 'CANCELLED', 'EXPIRED', 'REFUND_PENDING', 'REFUNDED')),
    amount_minor BIGINT NOT NULL CHECK (amount_minor >= 0),
    currency VARCHAR(8) NOT NULL,
    reservation_id VARCHAR(100) NOT NULL,
    expires_at BIGINT NOT NULL,
    version BIGINT NOT NULL CHECK (version >= 1),
    idempotency_key VARCHAR(512),
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    shop VARCHAR(64) NOT NULL DEFAULT 'default',
    KEY customer_order_holding (status, expires_at),
    KEY customer_order_shop_user (shop, user_id, created_at),
    KEY customer_order_user (user_id, created_at),
    CONSTRAINT customer_order_reservation_id_fkey FOREIGN KEY (reservation_id) REFERENCES reservation (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE order_line (
    order_id VARCHAR(100) NOT NULL,
    line_number BIGINT NOT NULL,
    sku VARCHAR(64) NOT NULL,
    warehouse VARCHAR(32) NOT NULL,
    quantity BIGINT NOT NULL CHECK (quantity > 0),
    unit_price_minor BIGINT NOT NULL CHECK (unit_price_minor >= 0),
    PRIMARY KEY (order_id, sku, warehouse),
    CONSTRAINT order_line_order_id_fkey FOREIGN KEY (order_id) REFERENCES customer_order (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE order_history (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    order_id VARCHAR(100) NOT NULL,
    from_status VARCHAR(32),
    to_status VARCHAR(32) NOT NULL,
    reason VARCHAR(1000) NOT NULL,
    created_at BIGINT NOT NULL,
    KEY order_history_order (order_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TRIGGER order_history_no_update BEFORE UPDATE ON order_history FOR EACH ROW
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'order_history is append-only';
CREATE TRIGGER order_history_no_delete BEFORE DELETE ON order_history FOR EACH ROW
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'order_history is append-only';

CREATE TABLE order_return (
    order_id VARCHAR(100) NOT NULL PRIMARY KEY,
    created_at BIGINT NOT NULL,
    CONSTRAINT order_return_order_id_fkey FOREIGN KEY (order_id) REFERENCES customer_order (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE payment_attempt (
    id VARCHAR(100) NOT NULL PRIMARY KEY,
    order_id VARCHAR(100) NOT NULL,
    gateway_key VARCHAR(255) NOT NULL,
    payment_method VARCHAR(255) NOT NULL,
    status VARCHAR(16) NOT NULL CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED')),
    gateway_payment_id VARCHAR(255),
    failure_reason VARCHAR(1000),
    amount_minor BIGINT NOT NULL,
    currency VARCHAR(8) NOT NULL,
    reconcile_after BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    reconcile_tries BIGINT NOT NULL DEFAULT 0,
    attempt_number BIGINT NOT NULL CHECK (attempt_number >= 1),
    request_key VARCHAR(512),
    -- The order's id while this attempt is PROCESSING (or SUCCEEDED), NULL otherwise:
    -- unique, so an order has at most one attempt running and one that succeeded.
    running_order VARCHAR(100) GENERATED ALWAYS AS (CASE WHEN status = 'PROCESSING' THEN order_id END) STORED,
    succeeded_order VARCHAR(100) GENERATED ALWAYS AS (CASE WHEN status = 'SUCCEEDED' THEN order_id END) STORED,
    UNIQUE KEY payment_attempt_gateway_key_key (gateway_key),
    UNIQUE KEY payment_attempt_gateway_payment_id_key (gateway_payment_id),
    UNIQUE KEY payment_attempt_order_number (order_id, attempt_number),
    UNIQUE KEY payment_attempt_one_running (running_order),
    UNIQUE KEY payment_attempt_one_success (succeeded_order),
    KEY payment_attempt_request (order_id, request_key),
    KEY payment_attempt_unresolved (status, reconcile_after),
    CONSTRAINT payment_attempt_order_id_fkey FOREIGN KEY (order_id) REFERENCES customer_order (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE refund (
    id VARCHAR(100) NOT NULL PRIMARY KEY,
    order_id VARCHAR(100) NOT NULL,
    gateway_key VARCHAR(255) NOT NULL,
    gateway_refund_id VARCHAR(255),
    status VARCHAR(16) NOT NULL CHECK (status IN ('PENDING', 'SUCCEEDED', 'FAILED')),
    amount_minor BIGINT NOT NULL,
    currency VARCHAR(8) NOT NULL,
    reason VARCHAR(1000) NOT NULL,
    tries BIGINT NOT NULL DEFAULT 0,
    next_try_at BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    failure_reason VARCHAR(1000),
    attempt_id VARCHAR(100) NOT NULL,
    UNIQUE KEY refund_attempt_id_key (attempt_id),
    UNIQUE KEY refund_gateway_key_key (gateway_key),
    UNIQUE KEY refund_gateway_refund_id_key (gateway_refund_id),
    KEY refund_order (order_id),
    KEY refund_pending (status, next_try_at),
    CONSTRAINT refund_attempt_id_fkey FOREIGN KEY (attempt_id) REFERENCES payment_attempt (id),
    CONSTRAINT refund_order_id_fkey FOREIGN KEY (order_id) REFERENCES customer_order (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE webhook_event (
    event_id VARCHAR(255) NOT NULL PRIMARY KEY,
    event_type VARCHAR(100) NOT NULL,
    gateway_payment_id VARCHAR(255),
    outcome VARCHAR(1000) NOT NULL,
    received_at BIGINT NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

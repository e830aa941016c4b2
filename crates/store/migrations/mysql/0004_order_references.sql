-- The shop's order number and the calling channel: see the PostgreSQL migration 0017.
-- A unique index allows many NULL order numbers here too.
CREATE TABLE order_reference (
    reservation_id VARCHAR(100) NOT NULL PRIMARY KEY,
    shop VARCHAR(64) NOT NULL,
    order_ref VARCHAR(64),
    source VARCHAR(32),
    created_at BIGINT NOT NULL,
    CHECK (order_ref IS NOT NULL OR source IS NOT NULL),
    UNIQUE KEY order_reference_shop_ref (shop, order_ref),
    CONSTRAINT order_reference_reservation FOREIGN KEY (reservation_id) REFERENCES reservation (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- Trust boundaries (issue 12): every call has a principal, everything has a shop.
--
-- Credentials (the admin token, operators, service keys) are stored as SHA-256 hashes
-- of their secrets; a revoked one keeps its row (revoked_at) so its id is never reused.
-- SKUs, reservations, orders and cart lines name the shop they belong to; a SKU's shop
-- never changes once set, so everything derived from it can be checked before a
-- transaction. Shoppers' open holds and purchases are tallied per (shop, user) so the
-- reserving transaction can enforce the limits with conditional writes.

CREATE TABLE credential (
    kind        TEXT    NOT NULL CHECK (kind IN ('admin', 'operator', 'service')),
    id          TEXT    NOT NULL,
    name        TEXT    NOT NULL,
    shop        TEXT,
    secret_hash TEXT    NOT NULL UNIQUE,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER,
    PRIMARY KEY (kind, id),
    CHECK ((kind = 'admin') = (shop IS NULL))
) STRICT;

INSERT INTO credential (kind, id, name, shop, secret_hash, created_at)
    SELECT 'operator', id, id, shop, token_hash, created_at FROM operator;
DROP TABLE operator;

ALTER TABLE sku ADD COLUMN shop TEXT NOT NULL DEFAULT 'default';
UPDATE sku SET shop = (SELECT product.shop FROM product WHERE product.id = sku.product_id)
    WHERE product_id IS NOT NULL;
ALTER TABLE sku ADD COLUMN per_user_limit INTEGER
    CHECK (per_user_limit IS NULL OR per_user_limit > 0);

ALTER TABLE reservation ADD COLUMN shop TEXT;
ALTER TABLE reservation ADD COLUMN user_id TEXT;
UPDATE reservation SET shop = (SELECT sku.shop FROM reservation_line
    JOIN sku ON sku.code = reservation_line.sku
    WHERE reservation_line.reservation_id = reservation.id LIMIT 1);

ALTER TABLE customer_order ADD COLUMN shop TEXT NOT NULL DEFAULT 'default';
UPDATE customer_order SET shop = COALESCE((SELECT sku.shop FROM order_line
    JOIN sku ON sku.code = order_line.sku
    WHERE order_line.order_id = customer_order.id LIMIT 1), 'default');
CREATE INDEX customer_order_shop_user ON customer_order (shop, user_id, created_at);

ALTER TABLE cart_item ADD COLUMN shop TEXT NOT NULL DEFAULT 'default';
UPDATE cart_item SET shop = COALESCE((SELECT sku.shop FROM sku WHERE sku.code = cart_item.sku),
    'default');

-- Open holds (RESERVED reservations) per shopper: at most the configured bound.
CREATE TABLE shopper_hold (
    shop       TEXT    NOT NULL,
    user_id    TEXT    NOT NULL,
    open_holds INTEGER NOT NULL CHECK (open_holds >= 0),
    PRIMARY KEY (shop, user_id)
) STRICT;

-- Units of a SKU a shopper holds or bought (reserved or confirmed; a release gives
-- them back): at most the SKU's per_user_limit.
CREATE TABLE shopper_purchase (
    shop     TEXT    NOT NULL,
    user_id  TEXT    NOT NULL,
    sku      TEXT    NOT NULL,
    quantity INTEGER NOT NULL CHECK (quantity >= 0),
    PRIMARY KEY (shop, user_id, sku)
) STRICT;

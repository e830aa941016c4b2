-- The shop's order number and the calling channel of a reservation or an order (seed
-- 002 §十三.1). One row per reservation that gave either; an order's is its
-- reservation's. An order number is used once per shop: a second request with another
-- Idempotency-Key is refused (`order_ref_reused`), and this index is the boundary two
-- racing requests meet at. Requests without either write nothing here.
CREATE TABLE order_reference (
    reservation_id TEXT   NOT NULL PRIMARY KEY REFERENCES reservation (id),
    shop           TEXT   NOT NULL,
    order_ref      TEXT,
    source         TEXT,
    created_at     BIGINT NOT NULL,
    CHECK (order_ref IS NOT NULL OR source IS NOT NULL)
);
CREATE UNIQUE INDEX order_reference_shop_ref ON order_reference (shop, order_ref);

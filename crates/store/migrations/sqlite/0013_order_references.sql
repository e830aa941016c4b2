-- The shop's order number and the calling channel: see the PostgreSQL migration 0017.
CREATE TABLE order_reference (
    reservation_id TEXT    NOT NULL PRIMARY KEY REFERENCES reservation (id),
    shop           TEXT    NOT NULL,
    order_ref      TEXT,
    source         TEXT,
    created_at     INTEGER NOT NULL,
    CHECK (order_ref IS NOT NULL OR source IS NOT NULL)
) STRICT;
CREATE UNIQUE INDEX order_reference_shop_ref ON order_reference (shop, order_ref);

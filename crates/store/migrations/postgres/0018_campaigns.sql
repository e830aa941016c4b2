-- Flash-sale campaigns (issue 19). A campaign carves `quantity` units of one SKU out of
-- its `warehouse`'s available stock into `buckets` stock rows of its own (warehouse
-- `campaign-<code>-<n>`), by ledgered movements referencing the campaign's id; at its
-- end what is left goes back, ledgered the same way. The buckets are ordinary stock
-- rows: reservations lock, take from and release to them, and the audit replays them.
-- One campaign per SKU at a time: `open_sku` is the SKU until the campaign ends, then
-- NULL (a unique index allows many NULLs; MySQL has no partial index to say it
-- otherwise). `closed_at`: nothing is left in the buckets after the end. `tally_sku`
-- (`campaign-<code>`) is what its shoppers' units are tallied under, its per-user limit
-- the bound the tally's conditional write checks (as a SKU's is for the SKU).
CREATE TABLE campaign (
    id             TEXT   NOT NULL PRIMARY KEY,
    code           TEXT   NOT NULL UNIQUE,
    tally_sku      TEXT   NOT NULL UNIQUE,
    shop           TEXT   NOT NULL,
    sku            TEXT   NOT NULL REFERENCES sku (code),
    warehouse      TEXT   NOT NULL,
    quantity       BIGINT NOT NULL CHECK (quantity > 0),
    buckets        BIGINT NOT NULL CHECK (buckets BETWEEN 1 AND 64),
    per_user_limit BIGINT CHECK (per_user_limit > 0),
    starts_at      BIGINT NOT NULL,
    ends_at        BIGINT NOT NULL,
    returned       BIGINT NOT NULL DEFAULT 0 CHECK (returned >= 0),
    ended_at       BIGINT,
    closed_at      BIGINT,
    open_sku       TEXT,
    created_at     BIGINT NOT NULL,
    CHECK (ends_at > starts_at)
);
CREATE UNIQUE INDEX campaign_open_sku ON campaign (open_sku);
CREATE INDEX campaign_unclosed ON campaign (ends_at) WHERE closed_at IS NULL;

-- Flash-sale campaigns: see the PostgreSQL migration 0018.
CREATE TABLE campaign (
    id             TEXT    NOT NULL PRIMARY KEY,
    code           TEXT    NOT NULL UNIQUE,
    tally_sku      TEXT    NOT NULL UNIQUE,
    shop           TEXT    NOT NULL,
    sku            TEXT    NOT NULL REFERENCES sku (code),
    warehouse      TEXT    NOT NULL,
    quantity       INTEGER NOT NULL CHECK (quantity > 0),
    buckets        INTEGER NOT NULL CHECK (buckets BETWEEN 1 AND 64),
    per_user_limit INTEGER CHECK (per_user_limit > 0),
    starts_at      INTEGER NOT NULL,
    ends_at        INTEGER NOT NULL,
    returned       INTEGER NOT NULL DEFAULT 0 CHECK (returned >= 0),
    ended_at       INTEGER,
    closed_at      INTEGER,
    open_sku       TEXT,
    created_at     INTEGER NOT NULL,
    CHECK (ends_at > starts_at)
) STRICT;
CREATE UNIQUE INDEX campaign_open_sku ON campaign (open_sku);
CREATE INDEX campaign_unclosed ON campaign (ends_at) WHERE closed_at IS NULL;

-- The reservation core: SKUs, stock counters per (sku, warehouse), reservations, the
-- append-only stock ledger and idempotency records. Instants are BIGINT milliseconds
-- since the Unix epoch (UTC) in both dialects, so they compare identically.

CREATE TABLE sku (
    code                TEXT    NOT NULL PRIMARY KEY,
    title               TEXT    NOT NULL DEFAULT '',
    price_minor         INTEGER CHECK (price_minor IS NULL OR price_minor >= 0),
    currency            TEXT,
    low_stock_threshold INTEGER NOT NULL DEFAULT 0 CHECK (low_stock_threshold >= 0),
    sale_status         TEXT    NOT NULL DEFAULT 'ON_SHELF'
        CHECK (sale_status IN ('PENDING_REVIEW', 'ON_SHELF', 'OFF_SHELF', 'DELETED')),
    version             INTEGER NOT NULL DEFAULT 1 CHECK (version >= 1),
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL
) STRICT;

CREATE TABLE stock (
    sku        TEXT    NOT NULL REFERENCES sku (code),
    warehouse  TEXT    NOT NULL,
    available  INTEGER NOT NULL CHECK (available >= 0),
    reserved   INTEGER NOT NULL CHECK (reserved >= 0),
    version    INTEGER NOT NULL CHECK (version >= 1),
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (sku, warehouse)
) STRICT;

CREATE TABLE reservation (
    id              TEXT    NOT NULL PRIMARY KEY,
    status          TEXT    NOT NULL CHECK (status IN ('RESERVED', 'CONFIRMED', 'RELEASED')),
    release_reason  TEXT    CHECK (release_reason IN ('requested', 'expired')),
    expires_at      INTEGER NOT NULL,
    idempotency_key TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    CHECK ((status = 'RELEASED') = (release_reason IS NOT NULL))
) STRICT;

-- The expiry worker's queue: only holds rows that can still expire.
CREATE INDEX reservation_expiry ON reservation (expires_at) WHERE status = 'RESERVED';

CREATE TABLE reservation_line (
    reservation_id TEXT    NOT NULL REFERENCES reservation (id),
    line_number    INTEGER NOT NULL CHECK (line_number >= 0),
    sku            TEXT    NOT NULL,
    warehouse      TEXT    NOT NULL,
    quantity       INTEGER NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (reservation_id, line_number),
    UNIQUE (reservation_id, sku, warehouse)
) STRICT;

CREATE TABLE stock_ledger (
    id              INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    sku             TEXT    NOT NULL,
    warehouse       TEXT    NOT NULL,
    kind            TEXT    NOT NULL CHECK (kind IN ('receive', 'adjust', 'reserve', 'confirm', 'release')),
    available_delta INTEGER NOT NULL,
    reserved_delta  INTEGER NOT NULL,
    reference       TEXT    NOT NULL,
    idempotency_key TEXT,
    created_at      INTEGER NOT NULL
) STRICT;

CREATE INDEX stock_ledger_reference ON stock_ledger (reference);
CREATE INDEX stock_ledger_stock ON stock_ledger (sku, warehouse);

-- The ledger is append-only: history is corrected by new rows, never by edits.
CREATE TRIGGER stock_ledger_no_update BEFORE UPDATE ON stock_ledger
BEGIN
    SELECT RAISE(ABORT, 'stock_ledger is append-only');
END;

CREATE TRIGGER stock_ledger_no_delete BEFORE DELETE ON stock_ledger
BEGIN
    SELECT RAISE(ABORT, 'stock_ledger is append-only');
END;

-- One row per Idempotency-Key. Written in the same transaction as the effect it
-- records; status_code 0 marks a claim that has not been given its response yet, which
-- no other transaction can ever observe (the claim and the response commit together).
CREATE TABLE idempotency_record (
    key         TEXT    NOT NULL PRIMARY KEY,
    fingerprint TEXT    NOT NULL,
    status_code INTEGER NOT NULL,
    body        TEXT    NOT NULL,
    created_at  INTEGER NOT NULL
) STRICT;

CREATE INDEX idempotency_record_created ON idempotency_record (created_at);

-- The live auditor (issue 17): it re-checks the counters against the ledger every
-- interval without replaying the whole ledger. `audit_running_sum` holds, per stock
-- row, what the ledger rows up to `audit_progress.through_ledger_id` add up to; each
-- round adds only the rows after it. Ledger ids are handed out before commit, so a
-- row may commit after a higher id: the checkpoint only advances over rows older
-- than the settle age (far longer than any stockd transaction), and the rows after
-- it are summed afresh each round.
CREATE TABLE audit_progress (
    name              TEXT   NOT NULL PRIMARY KEY CHECK (name IN ('live')),
    through_ledger_id BIGINT NOT NULL CHECK (through_ledger_id >= 0),
    checked_at        BIGINT NOT NULL
);
INSERT INTO audit_progress (name, through_ledger_id, checked_at) VALUES ('live', 0, 0);

CREATE TABLE audit_running_sum (
    sku           TEXT   NOT NULL,
    warehouse     TEXT   NOT NULL,
    available_sum BIGINT NOT NULL,
    reserved_sum  BIGINT NOT NULL,
    PRIMARY KEY (sku, warehouse)
);

-- Each round re-checks the orders that changed since the previous one.
CREATE INDEX customer_order_updated ON customer_order (updated_at);

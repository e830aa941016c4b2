-- The transactional outbox: see the PostgreSQL migration 0015 for why rows carry both
-- `id` (write order) and `position` (the order the sequencer found them committed).
-- No partial indexes here: `outbox_position` holds the unnumbered rows (NULL) too,
-- in `id` order (InnoDB appends the primary key), which is the sequencer's scan.
CREATE TABLE outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    aggregate VARCHAR(16) NOT NULL
        CHECK (aggregate IN ('reservation', 'order', 'payment', 'stock', 'sku')),
    aggregate_id VARCHAR(255) NOT NULL,
    sequence BIGINT NOT NULL CHECK (sequence >= 1),
    event_type VARCHAR(64) NOT NULL,
    shop VARCHAR(64) NOT NULL,
    payload TEXT,
    occurred_at BIGINT NOT NULL,
    position BIGINT CHECK (position >= 1),
    CHECK (payload IS NOT NULL OR event_type = 'reservation.created'),
    UNIQUE KEY outbox_aggregate_sequence (aggregate, aggregate_id, sequence),
    UNIQUE KEY outbox_position (position),
    KEY outbox_shop_position (shop, position)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE outbox_sequence (
    aggregate VARCHAR(16) NOT NULL,
    aggregate_id VARCHAR(255) NOT NULL,
    last_sequence BIGINT NOT NULL CHECK (last_sequence >= 1),
    PRIMARY KEY (aggregate, aggregate_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE outbox_relay (
    name VARCHAR(16) NOT NULL PRIMARY KEY CHECK (name IN ('sequencer', 'nats')),
    holder VARCHAR(255),
    lease_until BIGINT NOT NULL DEFAULT 0,
    through_position BIGINT NOT NULL DEFAULT 0 CHECK (through_position >= 0)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
INSERT INTO outbox_relay (name) VALUES ('sequencer'), ('nats');

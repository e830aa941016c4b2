-- `reservation.created` events leave the (aggregate, aggregate_id, sequence) index.
--
-- Every new reservation writes one such row, and the row is written twice: inserted
-- by the reservation's own statement, then given its position by the sequencer, whose
-- UPDATE makes a new row version with an entry in every index the version matches
-- (`position` is indexed, so it is never a heap-only update). The unique index on
-- three text-keyed columns was two of the seven index entries each reservation's event
-- cost, the two whose keys compare as text.
--
-- What it guarded stays guarded for these rows: the one writer of reservation rows
-- (`stockd_insert_reservation_rows`, migration 0015, and the SQLite and MySQL
-- equivalents) writes a reservation's `reservation.created` row in the statement that
-- inserts the reservation under its primary key, always with sequence 1, so a second
-- one would need a second reservation row with the same id. Every other event (a
-- reservation's move out of RESERVED is its sequence 2, orders, payments, stock, SKUs)
-- keeps the unique index. The audit reads events in (aggregate, aggregate_id,
-- sequence) order either way.
ALTER TABLE outbox DROP CONSTRAINT outbox_aggregate_aggregate_id_sequence_key;
CREATE UNIQUE INDEX outbox_aggregate_sequence ON outbox (aggregate, aggregate_id, sequence)
    WHERE event_type <> 'reservation.created';

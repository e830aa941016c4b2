-- The ledger's row triggers (0001) refuse UPDATE and DELETE, but TRUNCATE fires no row
-- trigger: a "reset the tables" script would empty the history the audit replays.
-- A statement trigger refuses it too. (MySQL fires no trigger on TRUNCATE at all: there,
-- only the application role's privileges can refuse it; docs/OPERATIONS.md.)
CREATE TRIGGER stock_ledger_no_truncate BEFORE TRUNCATE ON stock_ledger
    FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_refuse_change();

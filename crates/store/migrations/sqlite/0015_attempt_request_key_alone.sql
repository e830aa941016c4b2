-- A pay request's key names at most one payment: see the PostgreSQL migration 0022.
CREATE INDEX payment_attempt_request_key ON payment_attempt (request_key);

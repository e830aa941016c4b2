-- A pay request's key names at most one payment: a key that started an attempt of
-- one order (or with one payment method) is refused for another, even while the
-- first request has no stored answer yet (its gateway call timed out). The check
-- looks the key up across orders.
CREATE INDEX payment_attempt_request_key ON payment_attempt (request_key);

-- A row the broker refuses on its own (its exchange is missing, no queue takes it) is held back
-- with the broker's words and tried again later with a growing delay, so that it never stops the
-- rows behind it.
ALTER TABLE trailmark.outbox ADD COLUMN last_error TEXT;

-- The NOTIFY trigger tests each inserted row in its WHEN clause instead of keeping a transition
-- table: with a transition table Postgres stored a copy of every outbox row (bodies of ~2 KB) of
-- every step commit only to look at available_at. Rows a worker publishes itself (available
-- later) now cost nothing; Postgres folds identical notifications of one transaction into one.
DROP TRIGGER outbox_notify ON trailmark.outbox;

CREATE OR REPLACE FUNCTION trailmark.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('trailmark_outbox', '');
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_notify AFTER INSERT ON trailmark.outbox
    FOR EACH ROW WHEN (NEW.available_at <= now())
    EXECUTE FUNCTION trailmark.outbox_notify();

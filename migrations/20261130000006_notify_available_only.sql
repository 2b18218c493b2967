-- Wake relays only for rows they may publish now. Rows a worker publishes itself (eager publish)
-- are not available to the relay until their grace period ends; notifying for them made every
-- relay run an empty claim transaction per step. The poll picks those rows up if they are left.
DROP TRIGGER outbox_notify ON trailmark.outbox;

CREATE OR REPLACE FUNCTION trailmark.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE available_at <= now()) THEN
        PERFORM pg_notify('trailmark_outbox', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_notify AFTER INSERT ON trailmark.outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION trailmark.outbox_notify();

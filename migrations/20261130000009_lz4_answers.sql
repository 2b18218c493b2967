-- Model answers are stored twice per step (the journal entry word for word, and usually in the
-- step's checkpoint), and at ~2 KB they cross the TOAST threshold, so Postgres compresses them
-- on every write. lz4 does that at a fraction of pglz's CPU cost; existing rows keep pglz.
-- A Postgres built without lz4 keeps pglz (a notice, not a failed migration).
DO $$
BEGIN
    ALTER TABLE trailmark.journal ALTER COLUMN response SET COMPRESSION lz4;
    ALTER TABLE trailmark.steps ALTER COLUMN output SET COMPRESSION lz4;
    ALTER TABLE trailmark.runs ALTER COLUMN output SET COMPRESSION lz4;
    ALTER TABLE trailmark.outbox ALTER COLUMN body SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this Postgres has no lz4: answers stay pglz-compressed';
END $$;

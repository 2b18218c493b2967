-- Retention (docs/ARCHITECTURE.md, "Retention"): finished runs are removed after their
-- workflow's keep time, archived first when an archive directory is set.
--
-- `pruned_runs`: a tombstone per removed run, kept for `retention.tombstone_secs`, so that a
-- late start of the same run id (a redelivery, an upstream retry) starts nothing when it asks
-- for the same workflow and input, and is refused as a conflict when it asks for another.
CREATE TABLE trailmark.pruned_runs (
    run_id       TEXT PRIMARY KEY,
    workflow     TEXT NOT NULL,
    -- sha256 of the input's JSON text as Postgres stores it (jsonb), the same for every start
    -- whose input is the same JSON value.
    input_hash   TEXT NOT NULL,
    status       TEXT NOT NULL,
    finished_at  TIMESTAMPTZ,
    pruned_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The archive file written before the run was removed, if any.
    archived_to  TEXT
);
CREATE INDEX pruned_runs_pruned_at_idx ON trailmark.pruned_runs (pruned_at);

-- Every way a run is created inserts into `runs`; a tombstoned id is skipped there, in the
-- statement itself: a start racing the removal of its run waits for the removal's commit and
-- then sees its tombstone (a trigger's query takes a fresh snapshot), so it cannot slip in
-- between. The caller sees "not inserted", finds no run, and reads the tombstone.
CREATE FUNCTION trailmark.skip_pruned_run() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM trailmark.pruned_runs WHERE run_id = NEW.run_id) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER runs_skip_pruned BEFORE INSERT ON trailmark.runs
    FOR EACH ROW EXECUTE FUNCTION trailmark.skip_pruned_run();

-- Finished runs of a workflow by when they finished: what the pruner reads, oldest first, one
-- workflow (one keep time) at a time.
CREATE INDEX runs_finished_idx ON trailmark.runs (workflow, finished_at)
    WHERE status IN ('succeeded', 'failed', 'compensated', 'cancelled', 'shadowed');
-- The inbox and the audit trail are pruned by age.
CREATE INDEX inbox_processed_idx ON trailmark.inbox (processed_at);
CREATE INDEX audit_at_idx ON trailmark.audit (at);

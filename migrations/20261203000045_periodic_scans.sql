-- Periodic queries whose cost grew with the runs waiting, measured with scripts/periodic-plans
-- (docs/BENCHMARKS.md, "Periodic queries at 100 and 100,000 runs in flight"). Every index below
-- is on columns a step's claim and commit leave unchanged, so those two updates stay HOT
-- (20261130000010_hot_run_updates.sql): `status` and `handover` change only when a run starts
-- or stops waiting or stops for review, updates that change `status` and are never HOT anyway.

-- When the run last started waiting, set by the triggers below on that move only (never by a
-- step), so it can be indexed where `updated_at`, which every step changes, cannot.
ALTER TABLE trailmark.runs ADD COLUMN waiting_since TIMESTAMPTZ;
UPDATE trailmark.runs SET waiting_since = updated_at WHERE status = 'waiting';

CREATE FUNCTION trailmark.stamp_waiting_since() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.waiting_since := now();
    RETURN NEW;
END
$$;
-- `UPDATE OF status` with a WHEN: a statement that does not set `status` never looks at the
-- trigger, and one that does (the step commit) pays only the comparison.
CREATE TRIGGER runs_waiting_since BEFORE UPDATE OF status ON trailmark.runs
    FOR EACH ROW WHEN (NEW.status = 'waiting' AND OLD.status IS DISTINCT FROM 'waiting')
    EXECUTE FUNCTION trailmark.stamp_waiting_since();
CREATE TRIGGER runs_waiting_since_insert BEFORE INSERT ON trailmark.runs
    FOR EACH ROW WHEN (NEW.status = 'waiting')
    EXECUTE FUNCTION trailmark.stamp_waiting_since();

-- The supervisor's human-timeout scan (`store::runs::escalate_waiting`): runs waiting for a
-- person, by how long. Their note says so (`worker::ending`, `worker::step::doubt`); runs
-- waiting for an event, a time or their children have a `waits` row and a timeout of their own,
-- and are not in this index, so 100,000 sleepers cost the scan nothing.
CREATE INDEX runs_person_waits_idx ON trailmark.runs (waiting_since)
    WHERE status = 'waiting' AND (handover->>'waiting_for') IN ('decision', 'approval');

-- The open-waits gauge (`store::waits::open_counts`) counts from the index alone.
CREATE INDEX waits_open_kind_idx ON trailmark.waits (kind) WHERE resolved_at IS NULL;

-- The runs gauge (`store::runs::counts`, every 5 s) counts by status and workflow from the
-- index alone instead of reading every run row; `workflow` never changes, and the queries by
-- status use the leading column as before.
CREATE INDEX runs_status_workflow_idx ON trailmark.runs (status, workflow);
DROP INDEX trailmark.runs_status_idx;

-- The pruner's default keep time (`store::retention::due`, runs of every workflow without a keep
-- time of its own) reads the oldest finished runs by when they finished; `runs_finished_idx`
-- serves the per-workflow keep times. `finished_at` is set once, when the run ends.
CREATE INDEX runs_finished_at_idx ON trailmark.runs (finished_at)
    WHERE status IN ('succeeded', 'failed', 'compensated', 'cancelled', 'shadowed');

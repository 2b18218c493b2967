-- The per-step tables no longer check their run with a foreign key. Each check was a trigger
-- that locked the run's row (a WAL record and a lock per journal entry, effect and step), on the
-- hot path of every step. The write paths already guarantee the run exists: steps rows come from
-- the claim (which updates the run row), effects from an insert that selects the run by its
-- fence, journal entries, parked items and effect results from the claimed step or its fenced
-- commit. Runs are never deleted. Operator decisions (rare, off the hot path) keep theirs.
ALTER TABLE trailmark.steps DROP CONSTRAINT steps_run_id_fkey;
ALTER TABLE trailmark.journal DROP CONSTRAINT journal_run_id_fkey;
ALTER TABLE trailmark.effects DROP CONSTRAINT effects_run_id_fkey;
ALTER TABLE trailmark.parked DROP CONSTRAINT parked_run_id_fkey;

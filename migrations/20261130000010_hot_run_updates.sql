-- Let the two updates every step makes to its run row (claim, commit) be HOT updates: no index
-- entry is written when no indexed column changes. Before, `updated_at` (in runs_status_idx) and
-- `lease_expires_at` (runs_lease_idx) changed on every claim, so each step wrote five index
-- entries for its run. The supervisor's expired-lease scan now reads the running runs through
-- the status index (one scan per second over the runs in flight); the human-timeout scan reads
-- the waiting ones the same way. Free space is left on each page for the new row versions.
DROP INDEX trailmark.runs_lease_idx;
DROP INDEX trailmark.runs_status_idx;
CREATE INDEX runs_status_idx ON trailmark.runs (status);
ALTER TABLE trailmark.runs SET (fillfactor = 70);
-- A step row is written at claim and updated once with its checkpoint.
ALTER TABLE trailmark.steps SET (fillfactor = 70);

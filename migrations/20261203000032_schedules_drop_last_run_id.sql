-- A schedule's newest run is `<name>:<last_tick>`, so the run id kept beside the tick said
-- nothing the tick does not; one source of truth for "is the last tick's run still going".
ALTER TABLE trailmark.schedules DROP COLUMN last_run_id;

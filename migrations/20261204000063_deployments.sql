-- The workflow versions each live worker process carries (docs/OPERATIONS.md, "Workflow
-- versions"): written when a worker's presence connection opens, removed when it stops. A row
-- counts while the presence backend it names (`presence_pid`) is alive, so a killed process's
-- rows stop counting at once and are cleaned by the next worker that registers.
-- A worker that meets a step of a version it does not carry asks this table whether another
-- live worker does (then the step waits for it) or none does (then the run stops for review).
CREATE TABLE trailmark.deployments (
    worker_id    TEXT NOT NULL,
    workflow     TEXT NOT NULL,
    version      INT NOT NULL,
    presence_pid INT NOT NULL,
    since        TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow, version, worker_id)
);

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

-- Whether the presence backend `pid` of worker `worker_id` is alive: the pid alone could be a
-- reused one (another database, another program), so its database and its application name
-- (`trailmark presence <worker id>`, cut at 63 bytes as Postgres cuts it) must match too.
CREATE FUNCTION trailmark.presence_alive(pid INT, worker_id TEXT) RETURNS BOOLEAN
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM pg_stat_activity a
                    WHERE a.pid = presence_alive.pid AND a.datname = current_database()
                      AND a.application_name = left('trailmark presence ' || presence_alive.worker_id, 63))
$$;

-- Fan-out and fan-in: a step that ends by starting child runs and waiting for them
-- (docs/ARCHITECTURE.md, "Child runs").
--
-- The parent's step commit writes, in its one transaction, the `waits` row (kind `children`,
-- never due), one `fan_outs` row (the join's condition and its counters) and one `children` row
-- per child, and creates the first `max_in_flight` child runs with their first step messages.
-- A child's ending updates its `children` row and the counters, starts the next child not yet
-- started, and moves the parent on when the join holds, all under the parent's row lock.
ALTER TABLE trailmark.waits DROP CONSTRAINT waits_kind_check;
ALTER TABLE trailmark.waits ADD CONSTRAINT waits_kind_check
    CHECK (kind IN ('event', 'sleep', 'children'));

-- The run whose step started this one (NULL for a run started any other way).
ALTER TABLE trailmark.runs ADD COLUMN parent_run_id TEXT;
CREATE INDEX runs_parent_idx ON trailmark.runs (parent_run_id) WHERE parent_run_id IS NOT NULL;

CREATE TABLE trailmark.fan_outs (
    run_id         TEXT NOT NULL,
    -- The position of the parent's step that started the children.
    seq            INTEGER NOT NULL,
    total          INTEGER NOT NULL,
    -- The join: NULL waits for every child, N for the first N to succeed.
    first_n        INTEGER,
    -- How many children may fail before the parent stops in needs_review.
    max_failures   INTEGER NOT NULL,
    max_in_flight  INTEGER NOT NULL,
    started        INTEGER NOT NULL DEFAULT 0,
    succeeded      INTEGER NOT NULL DEFAULT 0,
    failed         INTEGER NOT NULL DEFAULT 0,
    -- When the join held and the parent went on (once), or when it stopped for review.
    joined_at      TIMESTAMPTZ,
    stopped_at     TIMESTAMPTZ,
    PRIMARY KEY (run_id, seq)
);

CREATE TABLE trailmark.children (
    parent_run_id  TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    idx            INTEGER NOT NULL,
    run_id         TEXT NOT NULL UNIQUE,
    workflow       TEXT NOT NULL,
    -- The version and first step its run starts with (found when the parent's step ended).
    workflow_version INTEGER NOT NULL,
    first_step     TEXT NOT NULL,
    input          JSONB NOT NULL,
    -- `pending` (recorded, not started: beyond max_in_flight), `running`, `succeeded`,
    -- `failed` (it stopped in needs_review or failed), `cancelled`, `skipped` (never started:
    -- the join held or the parent stopped first).
    state          TEXT NOT NULL CHECK (state IN ('pending', 'running', 'succeeded', 'failed',
                                                  'cancelled', 'skipped')),
    reason         TEXT,
    started_at     TIMESTAMPTZ,
    ended_at       TIMESTAMPTZ,
    PRIMARY KEY (parent_run_id, seq, idx)
);
-- The next children to start, in index order.
CREATE INDEX children_pending_idx ON trailmark.children (parent_run_id, seq, idx)
    WHERE state = 'pending';

-- Debounce of run starts (docs/WORKFLOWS.md, "Debounce of run starts"): a start of a workflow
-- that declares a debounce is recorded here instead of becoming a run at once, in the same
-- transaction as its inbox row. One row per start: the last start of a key's burst is
-- `pending` until `due_at`, when the timer loop makes it a run (`started`); each start it
-- replaced is `superseded` and keeps its row (with the burst's number, which leads to the
-- winner) for `retention.tombstone_secs` after it ended, so that a late duplicate of its id
-- starts nothing and `trailmark run show` names the start that replaced it.
CREATE SEQUENCE trailmark.debounce_bursts;

CREATE TABLE trailmark.debounced_starts (
    run_id       TEXT PRIMARY KEY,
    workflow     TEXT NOT NULL,
    -- The value of the workflow's debounce key read from the start's input.
    key_value    TEXT NOT NULL,
    -- The burst the start belongs to: every start of a key from the first after a run started
    -- (or the first ever) until the next run starts. Its one row that is not `superseded` is
    -- the burst's last start (pending, started, or refused when it could not be made a run).
    burst        BIGINT NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('pending', 'superseded', 'started', 'refused')),
    -- The run-start event, word for word, while the start is pending (cleared once it ended:
    -- a superseded start never runs, a started one is its run).
    event        JSONB,
    -- sha256 of the input's JSON text as Postgres stores it, as a tombstone's: a repeat of the
    -- start (same workflow and input) is told from a conflicting one.
    input_hash   TEXT NOT NULL,
    -- The starter's W3C trace context: the run's trace continues it.
    traceparent  TEXT,
    -- This start's number in its burst (1 for the first).
    nth          INT NOT NULL,
    first_at     TIMESTAMPTZ NOT NULL,
    arrived_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    due_at       TIMESTAMPTZ NOT NULL,
    -- When it was superseded, started or refused; what ages it out.
    ended_at     TIMESTAMPTZ,
    -- Why a start that came due was refused (its run id was taken meanwhile).
    note         TEXT
);

-- One pending start per key (the starts of a key are recorded one after the other under an
-- advisory lock of the key, `store::debounce::lock_key`; this index is the guard behind it).
CREATE UNIQUE INDEX debounced_starts_pending_key ON trailmark.debounced_starts (workflow, key_value)
    WHERE state = 'pending';
-- The timer loop's scan of due starts, and the pending gauge.
CREATE INDEX debounced_starts_due_idx ON trailmark.debounced_starts (due_at) WHERE state = 'pending';
-- A superseded start's winner.
CREATE INDEX debounced_starts_burst_idx ON trailmark.debounced_starts (burst);
-- Retention ages ended rows out.
CREATE INDEX debounced_starts_ended_idx ON trailmark.debounced_starts (ended_at)
    WHERE ended_at IS NOT NULL;

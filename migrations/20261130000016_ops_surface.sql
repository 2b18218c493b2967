-- The ops surface: who did what (audit), what a run says while it works (progress), and the
-- responses of mutating API requests kept under their Idempotency-Key.

-- Append-only: one row per mutation, written in the transaction of the change it records.
CREATE TABLE trailmark.audit (
    id             BIGSERIAL PRIMARY KEY,
    at             TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor          TEXT NOT NULL,
    role           TEXT NOT NULL,
    via            TEXT NOT NULL,            -- api, cli
    action         TEXT NOT NULL,            -- resume, undo, dlq.requeue, dlq.reveal, ...
    target         TEXT NOT NULL,            -- a run id, a dead letter's id, a reason
    reason         TEXT NOT NULL,
    request_id     TEXT,
    status_before  TEXT,
    status_after   TEXT,
    details        JSONB NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_target_idx ON trailmark.audit (target, id);

-- The last lines a run said about its work (ctx.progress, and the engine's own recovery lines);
-- older lines are pruned per run.
CREATE TABLE trailmark.progress (
    id      BIGSERIAL PRIMARY KEY,
    run_id  TEXT NOT NULL,
    seq     INTEGER NOT NULL,
    at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    line    TEXT NOT NULL
);
CREATE INDEX progress_run_idx ON trailmark.progress (run_id, id);

-- draft-ietf-httpapi-idempotency-key-header: the first response to a key, replayed for a
-- repeat with the same request; another request under the same key is refused.
CREATE TABLE trailmark.api_idempotency (
    key             TEXT PRIMARY KEY,
    request_hash    TEXT NOT NULL,
    done            BOOLEAN NOT NULL DEFAULT false,
    response_status INTEGER,
    response_body   BYTEA,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- A step waiting in a delay queue says when it runs again and why it failed.
ALTER TABLE trailmark.steps ADD COLUMN retry_at TIMESTAMPTZ, ADD COLUMN last_error TEXT;

-- The API lists runs newest first, a page at a time.
CREATE INDEX runs_created_idx ON trailmark.runs (created_at DESC, run_id);

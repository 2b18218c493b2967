-- Fork and replay: a run started from another run's checkpoint at a position, live or in shadow.

-- A shadow run records its outside writes instead of making them, and ends `shadowed`. The claim
-- returns the flag with the lease, so a step knows before its handler runs.
ALTER TABLE trailmark.runs ADD COLUMN shadow BOOLEAN NOT NULL DEFAULT false;

-- Lineage: which run a fork came from, at which position, who asked and why (whether it is a
-- shadow fork is the fork's own `runs.shadow`).
CREATE TABLE trailmark.forks (
    run_id         TEXT PRIMARY KEY,
    parent_run_id  TEXT NOT NULL,
    from_seq       INTEGER NOT NULL,
    from_step      TEXT NOT NULL,
    actor          TEXT NOT NULL,
    reason         TEXT NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX forks_parent_idx ON trailmark.forks (parent_run_id);

-- Journal entries a fork took over from its parent (positions before the fork): kept word for
-- word for the replay, but not paid by the fork, so its spending and budgets count its own calls.
ALTER TABLE trailmark.journal ADD COLUMN inherited_from TEXT;
-- The same for answers set aside by a resume after a fix: still not the fork's spending.
ALTER TABLE trailmark.journal_set_aside ADD COLUMN inherited_from TEXT;

-- What a shadow run would have done outside: each effect (key, tool, request) and each message
-- it would have sent (key, exchange and routing key, body). Written instead of the real thing.
CREATE TABLE trailmark.shadow_writes (
    run_id      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    kind        TEXT NOT NULL,          -- 'effect' or 'message'
    key         TEXT NOT NULL,
    target      TEXT NOT NULL,          -- the tool, or exchange/routing key
    request     JSONB NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, kind, key)
);

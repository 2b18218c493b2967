-- Sharing capacity between runs (docs/ARCHITECTURE.md, "Concurrency keys"): a workflow that
-- declares a key reads it from each run's input at start; at most a limit of runs of one key
-- (and of the whole workflow) hold a step at once across the fleet.

-- The run's key (NULL: its workflow declares none, or the run has no value for an optional
-- key) and its priority (0 lowest to 4 highest; 2 when the start names none).
ALTER TABLE trailmark.runs
    ADD COLUMN flow_key TEXT,
    ADD COLUMN priority SMALLINT NOT NULL DEFAULT 2 CHECK (priority BETWEEN 0 AND 4);

-- Limits set by operators at run time, over the workflow's declared defaults: `key` '' is
-- every key of the workflow (keys are at least one byte long, so '' names none); `total` only
-- on that row. NULL leaves a limit as declared.
CREATE TABLE trailmark.flow_limits (
    workflow     TEXT NOT NULL,
    key          TEXT NOT NULL,
    concurrency  INTEGER CHECK (concurrency > 0),
    total        INTEGER CHECK (total IS NULL OR total > 0 AND key = ''),
    rate         DOUBLE PRECISION CHECK (rate > 0),
    set_by       TEXT NOT NULL,
    set_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow, key)
);

-- One row per key in use (and one with key '' per workflow with a total limit): the row a
-- claim of that key locks, so that counting the key's slots and taking one are one step for
-- the whole fleet; with when the key was last served (round-robin across keys) and its token
-- bucket (a rate limit on step starts).
CREATE TABLE trailmark.flow_keys (
    workflow    TEXT NOT NULL,
    key         TEXT NOT NULL,
    served_at   TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    tokens      DOUBLE PRECISION,
    refilled_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow, key)
);

-- The runs holding a slot of their key. A slot is held while the run's lease is (a dead or
-- frozen worker's slot comes back when its lease ends, with nothing to release it), or, for a
-- run handed a slot by the dispatcher, until `reserved_until` while its step message travels.
-- Rows whose slot ended are removed by the next claim of the key.
CREATE TABLE trailmark.flow_slots (
    run_id          TEXT PRIMARY KEY,
    workflow        TEXT NOT NULL,
    key             TEXT NOT NULL,
    reserved_until  TIMESTAMPTZ,
    since           TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX flow_slots_key_idx ON trailmark.flow_slots (workflow, key);

-- Runs waiting, holding no lease, for a slot of their key (`slot`), of their workflow (`total`)
-- or for a token of the key's rate limit (`rate`, not before `not_before`); their step message
-- was consumed, and the dispatcher queues it again when it hands them a slot. They are served
-- in `rank_at` order: when the run started, moved earlier by `flow.aging_secs` per priority
-- level, so a higher level goes first and a lower one is passed only by higher ones that
-- started less than the levels between them times `flow.aging_secs` after it (aging).
CREATE TABLE trailmark.flow_waiters (
    run_id      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    workflow    TEXT NOT NULL,
    key         TEXT NOT NULL,
    priority    SMALLINT NOT NULL,
    reason      TEXT NOT NULL CHECK (reason IN ('slot', 'total', 'rate')),
    not_before  TIMESTAMPTZ NOT NULL DEFAULT now(),
    since       TIMESTAMPTZ NOT NULL DEFAULT now(),
    rank_at     TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX flow_waiters_rank_idx ON trailmark.flow_waiters (workflow, key, rank_at);

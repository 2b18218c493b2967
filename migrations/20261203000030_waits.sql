-- Runs that wait for an event or sleep until a time (docs/ARCHITECTURE.md, "Waits").
--
-- `waits`: one row per wait, written by the commit of the step that ended by waiting (in its
-- transaction) and closed in the transaction that moves the run on: an event, the timeout, the
-- wake-up, or an operator's decision. The timer loop reads the open rows by `due_at` through
-- `waits_due_idx`; an arriving event finds the open waits for its name and key through
-- `waits_match_idx`. Closed rows stay: they are the run's history of what it waited for.
CREATE TABLE trailmark.waits (
    run_id       TEXT NOT NULL,
    -- The position of the step that ended by waiting (the run stays there while it waits).
    seq          INTEGER NOT NULL,
    step         TEXT NOT NULL,
    kind         TEXT NOT NULL CHECK (kind IN ('event', 'sleep')),
    event_name   TEXT,
    match_key    TEXT,
    -- Where the run goes when the event comes or the sleep ends.
    next_step    TEXT NOT NULL,
    -- An event wait's timeout: the step to go to, or NULL to stop in needs_review.
    on_timeout   TEXT,
    since        TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The wake-up time of a sleep, the deadline of an event wait (database clock).
    due_at       TIMESTAMPTZ NOT NULL,
    resolved_at  TIMESTAMPTZ,
    -- `event`, `timeout`, `woke`, or `decision` (an operator moved the run on).
    resolution   TEXT,
    -- The event that resumed it.
    signal_id    TEXT,
    PRIMARY KEY (run_id, seq),
    CHECK ((kind = 'event') = (event_name IS NOT NULL AND match_key IS NOT NULL))
);
CREATE INDEX waits_due_idx ON trailmark.waits (due_at) WHERE resolved_at IS NULL;
CREATE INDEX waits_match_idx ON trailmark.waits (event_name, match_key)
    WHERE resolved_at IS NULL AND kind = 'event';

-- `signals`: events sent to runs (through the API, the CLI, AMQP or an embedding program),
-- one row per event id. An event no wait took is kept until `expires_at` for one to come,
-- then marked expired (and logged) and kept in sight until `forget_at`; an event that resumed
-- runs stays with them (the resumed step reads its payload).
CREATE TABLE trailmark.signals (
    signal_id     TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    match_key     TEXT NOT NULL,
    payload       JSONB NOT NULL,
    payload_hash  TEXT NOT NULL,
    -- `api`, `cli`, `amqp` or `embedded`.
    via           TEXT NOT NULL,
    received_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at    TIMESTAMPTZ NOT NULL,
    forget_at     TIMESTAMPTZ NOT NULL,
    consumed_at   TIMESTAMPTZ,
    -- How many runs it resumed.
    resumed       INTEGER NOT NULL DEFAULT 0,
    expired_at    TIMESTAMPTZ
);
-- A wait that comes looks for the oldest pending event of its name and key.
CREATE INDEX signals_pending_idx ON trailmark.signals (name, match_key, received_at)
    WHERE consumed_at IS NULL AND expired_at IS NULL;
-- The timer loop marks pending events that expired, and prunes the expired ones it may forget.
CREATE INDEX signals_expiry_idx ON trailmark.signals (expires_at)
    WHERE consumed_at IS NULL AND expired_at IS NULL;
CREATE INDEX signals_forget_idx ON trailmark.signals (forget_at) WHERE consumed_at IS NULL;

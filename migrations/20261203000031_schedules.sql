-- Schedules start runs on a cadence (a cron expression in a time zone, or a fixed interval). The
-- scheduler in every `serve` process takes due rows with FOR UPDATE SKIP LOCKED and, in the same
-- transaction, creates each tick's run (deterministic id `<name>:<tick>`) with its first step in the
-- outbox and moves `next_tick` on: a tick starts exactly one run whichever process fires it and
-- whatever dies. Additive: older builds run on with this table present.
CREATE TABLE trailmark.schedules (
    name           TEXT PRIMARY KEY,
    workflow       TEXT NOT NULL,
    input          JSONB NOT NULL,
    cron           TEXT,
    tz             TEXT,
    every_secs     BIGINT,
    overlap        TEXT NOT NULL,
    catch_up_secs  BIGINT NOT NULL,
    paused         BOOLEAN NOT NULL DEFAULT false,
    next_tick      TIMESTAMPTZ NOT NULL,
    buffered_tick  TIMESTAMPTZ,
    last_tick      TIMESTAMPTZ,
    last_run_id    TEXT,
    started        BIGINT NOT NULL DEFAULT 0,
    skipped        BIGINT NOT NULL DEFAULT 0,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK ((cron IS NULL) <> (every_secs IS NULL))
);
CREATE INDEX schedules_due_idx ON trailmark.schedules (next_tick) WHERE NOT paused;

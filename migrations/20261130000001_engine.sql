-- Trailmark's engine tables live in their own schema so they never collide with a host
-- application's tables in the same database.
CREATE SCHEMA IF NOT EXISTS trailmark;

-- One row per run: the durable head of the checkpoint. `fence` rises every time the lease changes
-- hands; every commit is guarded by `fence = <the committer's fence>`.
CREATE TABLE trailmark.runs (
    run_id            TEXT PRIMARY KEY,
    workflow          TEXT NOT NULL,
    workflow_version  INTEGER NOT NULL,
    status            TEXT NOT NULL,
    step              TEXT,                -- the step to run next (NULL once finished)
    step_seq          INTEGER NOT NULL DEFAULT 0,
    input             JSONB NOT NULL,
    output            JSONB,
    error             TEXT,
    lease_owner       TEXT,
    lease_expires_at  TIMESTAMPTZ,
    fence             BIGINT NOT NULL DEFAULT 0,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at       TIMESTAMPTZ
);
CREATE INDEX runs_status_idx ON trailmark.runs (status, updated_at);
-- The supervisor's scan: leased runs ordered by expiry.
CREATE INDEX runs_lease_idx ON trailmark.runs (lease_expires_at) WHERE lease_owner IS NOT NULL;

-- One row per executed step position (`seq`), created when a worker claims it, so attempts are
-- counted even when the worker dies before committing.
CREATE TABLE trailmark.steps (
    run_id       TEXT NOT NULL REFERENCES trailmark.runs (run_id),
    seq          INTEGER NOT NULL,
    step         TEXT NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    output       JSONB,
    started_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at  TIMESTAMPTZ,
    PRIMARY KEY (run_id, seq)
);

-- Every model or tool answer, word for word, committed the moment it arrives.
CREATE TABLE trailmark.journal (
    run_id        TEXT NOT NULL REFERENCES trailmark.runs (run_id),
    seq           INTEGER NOT NULL,
    call_no       INTEGER NOT NULL,
    kind          TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    response      JSONB NOT NULL,
    tokens        BIGINT NOT NULL DEFAULT 0,
    cost          DOUBLE PRECISION NOT NULL DEFAULT 0,
    latency_ms    BIGINT NOT NULL DEFAULT 0,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq, call_no)
);

-- Intent (key, request hash, fence) before an outside call, result after it.
CREATE TABLE trailmark.effects (
    idempotency_key  TEXT PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES trailmark.runs (run_id),
    seq              INTEGER NOT NULL,
    request_hash     TEXT NOT NULL,
    fence            BIGINT NOT NULL,
    result           JSONB,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at     TIMESTAMPTZ
);
CREATE INDEX effects_run_idx ON trailmark.effects (run_id, seq);

-- Processed message ids per consumer: a repeated delivery changes nothing.
CREATE TABLE trailmark.inbox (
    consumer      TEXT NOT NULL,
    message_id    UUID NOT NULL,
    processed_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Messages committed with the checkpoint, published by the relay.
CREATE TABLE trailmark.outbox (
    id            BIGSERIAL PRIMARY KEY,
    message_id    UUID NOT NULL UNIQUE,
    exchange      TEXT NOT NULL,
    routing_key   TEXT NOT NULL,
    headers       JSONB NOT NULL DEFAULT '{}'::jsonb,
    body          BYTEA NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at  TIMESTAMPTZ,
    attempts      INTEGER NOT NULL DEFAULT 0
);
-- The relay's claim query reads only unpublished rows, oldest first.
CREATE INDEX outbox_unpublished_idx ON trailmark.outbox (id) WHERE published_at IS NULL;
CREATE INDEX outbox_published_idx ON trailmark.outbox (published_at) WHERE published_at IS NOT NULL;

-- Wake relays as soon as a transaction with outbox rows commits (NOTIFY is delivered at commit).
-- Polling stays as the safety net, so a missed notification only costs latency.
CREATE FUNCTION trailmark.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('trailmark_outbox', '');
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_notify AFTER INSERT ON trailmark.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION trailmark.outbox_notify();

-- The ledger of the built-in `chain` workflow: a stand-in outside store that enforces the key.
CREATE TABLE trailmark.chain_ledger (
    reference   TEXT PRIMARY KEY,
    run_id      TEXT NOT NULL,
    step        INTEGER NOT NULL,
    payload     TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Operator decisions (docs/ARCHITECTURE.md, "Decisions"): durable rows with who, when, what and why, and the run's
-- status before and after. The undo plan of a compensating run lives on the run itself.
CREATE TABLE trailmark.decisions (
    id               BIGSERIAL PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES trailmark.runs (run_id),
    action           TEXT NOT NULL,
    actor            TEXT NOT NULL,
    reason           TEXT NOT NULL,
    step             TEXT,
    seq              INTEGER,
    status_before    TEXT NOT NULL,
    status_after     TEXT NOT NULL,
    version_before   INTEGER NOT NULL,
    version_after    INTEGER NOT NULL,
    details          JSONB NOT NULL DEFAULT '{}'::jsonb,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX decisions_run_idx ON trailmark.decisions (run_id, id);

-- {"scope": ..., "targets": [{"seq": 7, "step": "post"}, ...]} while (or after) undoing.
ALTER TABLE trailmark.runs ADD COLUMN undo JSONB;

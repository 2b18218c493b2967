-- Failure semantics (docs/ARCHITECTURE.md, "Failures"): the handover note of a run in needs_review, parked items,
-- and the tool name of each effect (for budgets, repeat detection and circuit breakers).
ALTER TABLE trailmark.runs ADD COLUMN handover JSONB;

ALTER TABLE trailmark.effects ADD COLUMN tool TEXT NOT NULL DEFAULT 'effect';
CREATE INDEX effects_repeat_idx ON trailmark.effects (run_id, tool, request_hash);

-- Items set aside with a reason (permanent error for that item); the run goes on without them.
CREATE TABLE trailmark.parked (
    run_id      TEXT NOT NULL REFERENCES trailmark.runs (run_id),
    item        TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    step        TEXT NOT NULL,
    reason      TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, item)
);

-- Undo of a run with child runs, in causal order (docs/ARCHITECTURE.md, "Child runs"): the
-- parent compensates its steps newer than a fan-out, then undoes that fan-out's children and
-- waits for them (a `waits` row of kind `children` at the parent's position), then compensates
-- the fan-out step and the steps older than it. The forward join's columns stay as they ended;
-- the undo join has its own, so that the record of how the children ran is kept.

-- The parent's position that waits for the undo of this fan-out's children (NULL: not started
-- by the undo in force; an undo decision clears it), how many children that undo covers, how
-- many are compensated and how many stopped (review, failure, cancel), and when the undo join
-- held (the parent went on) or stopped the parent for review.
ALTER TABLE trailmark.fan_outs
    ADD COLUMN undo_seq        INTEGER,
    ADD COLUMN undo_total      INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN undone          INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN undo_failed     INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN undo_joined_at  TIMESTAMPTZ,
    ADD COLUMN undo_stopped_at TIMESTAMPTZ;

-- A child's part in its parent's undo: `compensating` (started, not ended), `compensated`,
-- `failed` (stopped for review or failed), `cancelled`; NULL: not part of an undo in force.
ALTER TABLE trailmark.children
    ADD COLUMN undo_state  TEXT CHECK (undo_state IN ('compensating', 'compensated', 'failed',
                                                      'cancelled')),
    ADD COLUMN undo_reason TEXT;

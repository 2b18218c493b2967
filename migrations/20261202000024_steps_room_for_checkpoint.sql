-- A step row is inserted small (position, step, attempts) when its position is claimed and
-- updated once with its checkpoint and local writes: room on each page keeps that update HOT
-- (no new index entry), as for effects.
ALTER TABLE trailmark.steps SET (fillfactor = 70);

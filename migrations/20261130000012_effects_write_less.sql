-- Each effect row wrote three index entries. effects_run_idx (run_id, seq) repeated the leading
-- column of effects_repeat_idx (run_id, tool, request_hash), which serves every by-run read
-- (handover evidence, `run show`, the budget count, undo's check for a stopped step's writes).
DROP INDEX trailmark.effects_run_idx;
-- An effect row is written at its intent and updated once with its result: leave room on each
-- page so that update is a HOT update (no index entries at all).
ALTER TABLE trailmark.effects SET (fillfactor = 70);

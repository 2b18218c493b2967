-- Local writes (`ctx.local_write`): rows a step writes into a table of trailmark's own database
-- in its commit statement, so a row exists if and only if its step committed. The step row keeps
-- `[table, key, request hash]` of each of its writes (for `run show`, handover notes, undo
-- previews and fork diffs).
-- Additive: older builds run on this schema unchanged.
ALTER TABLE trailmark.steps ADD COLUMN local_writes JSONB;

-- A local write whose key already holds a row with other values aborts the whole commit
-- statement: the same key with another payload is an error, never a silent skip. Called from the
-- ON CONFLICT DO UPDATE clause only when the values differ (the existing row there is the newest
-- committed one, even when the statement's snapshot cannot see it). VOLATILE: never folded.
CREATE FUNCTION trailmark.refuse_local_write(tbl TEXT, key TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'local write to %: the row under key % already holds other values', tbl, key
        USING ERRCODE = 'TMF02';
END $$;

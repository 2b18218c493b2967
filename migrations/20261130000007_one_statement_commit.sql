-- The step commit is one statement (store::checkpoint). When its fenced update of the run
-- matches no row (a newer worker holds the lease, or the run moved on), this function aborts the
-- whole statement, so the inbox row written beside it is never kept without the checkpoint.
-- VOLATILE (the default) keeps the planner from evaluating it ahead of the CASE that guards it.
CREATE FUNCTION trailmark.refuse_commit(run TEXT, stale_fence BIGINT) RETURNS TEXT
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'run %: fence % is no longer current', run, stale_fence
        USING ERRCODE = 'TMF01';
END $$;

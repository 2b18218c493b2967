-- Fleet-wide request and token limits per model endpoint (docs/OPERATIONS.md, "Waiting for a
-- model's rate limit"): every model call that is not served from the journal first reserves its
-- place in the endpoint's last minute here, under the endpoint's lock, in one statement.
--
-- One row per HTTP request to an endpoint (`base_url model`). `at` is the time the row counts
-- from for a minute: while the call is in flight, the latest it can end (reserved +
-- model.timeout_ms + a minute's margin for journaling the answer), with `tokens` the call's
-- estimate; once the answer is journaled (in the journal's statement), when it was, with
-- `tokens` the answer's real usage; after a failed call, when it failed, still at the estimate.
-- A worker that dies mid-call leaves its row at the estimate until it ages out: counted too
-- long, never too short. Rows a minute past `at` count no more, and whoever reserves for the
-- endpoint deletes a bounded batch of them, so the table holds about a minute of calls.
CREATE TABLE trailmark.model_usage (
    id       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint TEXT NOT NULL,
    at       TIMESTAMPTZ NOT NULL,
    tokens   BIGINT NOT NULL,
    -- Who reserved it, for an operator looking at who fills the window.
    run_id   TEXT NOT NULL,
    seq      INTEGER NOT NULL
);
-- The window sum and the deletion of old rows: one endpoint's rows by time.
CREATE INDEX model_usage_window_idx ON trailmark.model_usage (endpoint, at) INCLUDE (tokens);

-- Admits a call of `p_estimate` tokens to `p_endpoint` when the last minute leaves room for it
-- under `p_rpm` requests and `p_tpm` tokens (0: no limit), and reserves it (`reserved`: the
-- row's id); else reserves nothing and says when enough usage will have left the window
-- (`wait_secs`). `requests` and `tokens`: the window's usage before this call.
--
-- The endpoint's advisory lock (class 0x746d, apart from the event pairs' 0x7477) serialises the
-- reservations of one endpoint across the fleet, and each statement after it reads with a
-- snapshot of its own (a VOLATILE function), so it sees every reservation committed before the
-- lock was granted. Held for the rest of the caller's statement only: one round trip.
CREATE FUNCTION trailmark.reserve_model_call(
    p_endpoint TEXT, p_rpm BIGINT, p_tpm BIGINT, p_estimate BIGINT, p_hold_secs FLOAT8,
    p_run_id TEXT, p_seq INTEGER,
    OUT reserved BIGINT, OUT requests BIGINT, OUT tokens BIGINT, OUT wait_secs FLOAT8)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    since TIMESTAMPTZ;
BEGIN
    PERFORM pg_advisory_xact_lock(29805, hashtext(p_endpoint));
    -- The lock may have been waited for: the window ends now, not at the statement's start.
    since := clock_timestamp() - interval '60 seconds';
    DELETE FROM trailmark.model_usage u WHERE u.id IN (
        SELECT o.id FROM trailmark.model_usage o
         WHERE o.endpoint = p_endpoint AND o.at <= since
         ORDER BY o.at LIMIT 100 FOR UPDATE SKIP LOCKED);
    SELECT count(*), COALESCE(sum(u.tokens), 0)::bigint INTO requests, tokens
      FROM trailmark.model_usage u WHERE u.endpoint = p_endpoint AND u.at > since;
    IF (p_rpm = 0 OR requests + 1 <= p_rpm) AND (p_tpm = 0 OR tokens + p_estimate <= p_tpm) THEN
        INSERT INTO trailmark.model_usage (endpoint, at, tokens, run_id, seq)
        VALUES (p_endpoint, clock_timestamp() + make_interval(secs => p_hold_secs), p_estimate,
                p_run_id, p_seq)
        RETURNING id INTO reserved;
        wait_secs := 0;
        RETURN;
    END IF;
    -- The oldest rows leave first: the first row whose leaving makes room is when the call fits.
    -- Some row always does (the caller refuses a call larger than the whole limit), since once
    -- every row has left only the call itself remains.
    SELECT EXTRACT(EPOCH FROM (w.at - since))::float8 INTO wait_secs
      FROM (SELECT u.at,
                   count(*) OVER o AS n,
                   sum(u.tokens) OVER o AS t
              FROM trailmark.model_usage u
             WHERE u.endpoint = p_endpoint AND u.at > since
            WINDOW o AS (ORDER BY u.at, u.id ROWS UNBOUNDED PRECEDING)) w
     WHERE (p_rpm = 0 OR requests - w.n + 1 <= p_rpm)
       AND (p_tpm = 0 OR tokens - w.t + p_estimate <= p_tpm)
     ORDER BY w.at LIMIT 1;
END
$$;

//! Where an unloaded trailmark step spends its time, read from the timestamps the engine already
//! writes (each is the start of the statement or transaction that wrote it): commit of the
//! previous step, its next message marked published (by the worker after an eager publish, or by
//! the relay), claim, journal entry, effect intent, ledger row, effect result, commit. Each
//! segment therefore also holds the commit (fsync) of the write that opens it.

use serde::Serialize;

use super::Result;
use super::env::BenchEnv;

/// Segment labels, in step order; the values come back in the same order.
pub const SEGMENTS: [&str; 7] = [
    "commit -> next message marked published (commit; eager publish + confirm, or relay pick-up)",
    "marked published -> next claim (delivery, inbox check; overlaps the mark's own commit)",
    "claim -> model answer journaled (claim commit, journal read, model call over HTTP)",
    "journal -> effect intent (journal commit, usage guard query)",
    "effect intent -> ledger row (intent commit)",
    "ledger row -> effect result (ledger commit)",
    "effect result -> step commit (result commit, commit statements)",
];

/// p50 of each segment over the steps of the runs starting with a prefix (ms).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Breakdown {
    /// One p50 per [`SEGMENTS`] entry.
    pub p50_ms: Vec<f64>,
}

const SQL: &str = "
WITH s AS (
    SELECT run_id, seq, started_at, finished_at,
           lag(finished_at) OVER (PARTITION BY run_id ORDER BY seq) AS prev_commit
      FROM trailmark.steps WHERE run_id LIKE $1),
o AS (
    SELECT convert_from(body, 'UTF8')::jsonb ->> 'run_id' AS run_id,
           (convert_from(body, 'UTF8')::jsonb ->> 'seq')::int AS seq, min(published_at) AS published_at
      FROM trailmark.outbox WHERE published_at IS NOT NULL GROUP BY 1, 2),
j AS (SELECT run_id, seq, min(created_at) AS at FROM trailmark.journal WHERE run_id LIKE $1 GROUP BY 1, 2),
e AS (SELECT run_id, seq, min(created_at) AS intent, max(completed_at) AS done
        FROM trailmark.effects WHERE run_id LIKE $1 GROUP BY 1, 2),
l AS (SELECT run_id, step AS seq, created_at AS at FROM trailmark.chain_ledger WHERE run_id LIKE $1),
t AS (
    SELECT ARRAY[o.published_at - s.prev_commit, s.started_at - o.published_at, j.at - s.started_at,
                 e.intent - j.at, l.at - e.intent, e.done - l.at, s.finished_at - e.done] AS parts
      FROM s JOIN o USING (run_id, seq) JOIN j USING (run_id, seq) JOIN e USING (run_id, seq)
      JOIN l USING (run_id, seq)
     WHERE s.prev_commit IS NOT NULL)
SELECT i::int, (percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM parts[i])) * 1000)::float8
  FROM t, generate_series(1, 7) AS i GROUP BY i ORDER BY i";

/// The breakdown of the steps of runs whose ids start with `prefix`.
pub async fn trailmark(env: &BenchEnv, prefix: &str) -> Result<Breakdown> {
    let rows: Vec<(i32, f64)> = sqlx::query_as(SQL)
        .bind(format!("{prefix}%"))
        .fetch_all(&env.pool)
        .await?;
    Ok(Breakdown {
        p50_ms: rows.into_iter().map(|(_, ms)| ms).collect(),
    })
}

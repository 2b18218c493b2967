//! Where an unloaded trailmark step spends its time, read from the timestamps the engine already
//! writes (each is the start of the statement that wrote it): commit of the previous step, claim,
//! effect intent, ledger row, commit. Each segment therefore
//! also holds the commit (fsync) of the write that opens it. A step the previous commit
//! pre-claimed has its claim time in that commit (`worker.preclaim`): its first segment is 0 and
//! the second holds the publish and the delivery.

use serde::Serialize;

use super::Result;
use super::env::BenchEnv;

/// Segment labels, in step order; the values come back in the same order.
pub const SEGMENTS: [&str; 4] = [
    "commit -> next claim (commit; eager publish + confirm, delivery; claim = inbox check + lease + attempt; 0 when pre-claimed)",
    "claim -> effect intent (claim commit, model call over HTTP, journal commit; pre-claimed: also the publish and the delivery)",
    "effect intent -> ledger row (intent commit)",
    "ledger row -> step commit (ledger commit, effect result commit)",
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
e AS (SELECT run_id, seq, min(created_at) AS intent FROM trailmark.effects WHERE run_id LIKE $1 GROUP BY 1, 2),
l AS (SELECT run_id, step AS seq, created_at AS at FROM trailmark.chain_ledger WHERE run_id LIKE $1),
t AS (
    SELECT ARRAY[s.started_at - s.prev_commit, e.intent - s.started_at, l.at - e.intent,
                 s.finished_at - l.at] AS parts
      FROM s JOIN e USING (run_id, seq) JOIN l USING (run_id, seq)
     WHERE s.prev_commit IS NOT NULL)
SELECT i::int, (percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM parts[i])) * 1000)::float8
  FROM t, generate_series(1, 4) AS i GROUP BY i ORDER BY i";

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

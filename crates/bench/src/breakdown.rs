//! Where an unloaded trailmark step spends its time, read from the timestamps the engine already
//! writes (each is the start of the statement that wrote it): commit of the previous step, claim,
//! journal entry or effect intent, ledger row, commit. Each segment therefore also holds the
//! commit (fsync) of the write that opens it. A step the previous commit pre-claimed has its
//! claim time in that commit (`worker.preclaim`): its first segment is 0 and the second holds
//! the publish and the delivery.

use serde::Serialize;

use super::Result;
use super::env::BenchEnv;

/// Segment labels of a step whose ledger row goes in with its commit (`ctx.local_write`), in
/// step order; the values come back in the same order.
pub const SEGMENTS: [&str; 3] = [
    "commit -> next claim (commit; eager publish + confirm, delivery; claim = inbox check + lease + attempt; 0 when pre-claimed)",
    "claim -> journal entry (claim commit, model call over HTTP; pre-claimed: also the publish and the delivery)",
    "journal entry -> step commit (journal round trip; ledger row, checkpoint and next message in one commit)",
];

/// Segment labels of a step whose ledger row is an outside write (`ctx.effect`).
pub const SEGMENTS_EFFECT: [&str; 4] = [
    "commit -> next claim (commit; eager publish + confirm, delivery; claim = inbox check + lease + attempt; 0 when pre-claimed)",
    "claim -> effect intent (claim commit, model call over HTTP, journal commit; pre-claimed: also the publish and the delivery)",
    "effect intent -> ledger row (intent commit)",
    "ledger row -> step commit (ledger commit, effect result commit)",
];

/// p50 of each segment over the steps of the runs starting with a prefix (ms).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Breakdown {
    /// One p50 per segment label.
    pub p50_ms: Vec<f64>,
}

/// The steps with the time their previous position committed.
const STEPS: &str = "s AS (
    SELECT run_id, seq, started_at, finished_at,
           lag(finished_at) OVER (PARTITION BY run_id ORDER BY seq) AS prev_commit
      FROM trailmark.steps WHERE run_id LIKE $1)";

/// The p50 of each segment in `parts` over the rows of `t`.
const PERCENTILES: &str = "
SELECT i::int, (percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM parts[i])) * 1000)::float8
  FROM t, generate_series(1, array_length(parts, 1)) AS i GROUP BY i ORDER BY i";

/// The breakdown of the local-write steps of runs whose ids start with `prefix`.
pub async fn local(env: &BenchEnv, prefix: &str) -> Result<Breakdown> {
    let sql = format!(
        "WITH {STEPS},
         j AS (SELECT run_id, seq, min(created_at) AS answer FROM trailmark.journal WHERE run_id LIKE $1 GROUP BY 1, 2),
         t AS (SELECT ARRAY[s.started_at - s.prev_commit, j.answer - s.started_at, s.finished_at - j.answer] AS parts
                 FROM s JOIN j USING (run_id, seq) WHERE s.prev_commit IS NOT NULL)
         {PERCENTILES}"
    );
    of(env, &sql, prefix).await
}

/// The breakdown of the effect steps of runs whose ids start with `prefix`.
pub async fn effect(env: &BenchEnv, prefix: &str) -> Result<Breakdown> {
    let sql = format!(
        "WITH {STEPS},
         e AS (SELECT run_id, seq, min(created_at) AS intent FROM trailmark.effects WHERE run_id LIKE $1 GROUP BY 1, 2),
         l AS (SELECT run_id, step AS seq, created_at AS at FROM trailmark.chain_ledger WHERE run_id LIKE $1),
         t AS (SELECT ARRAY[s.started_at - s.prev_commit, e.intent - s.started_at, l.at - e.intent,
                            s.finished_at - l.at] AS parts
                 FROM s JOIN e USING (run_id, seq) JOIN l USING (run_id, seq)
                WHERE s.prev_commit IS NOT NULL)
         {PERCENTILES}"
    );
    of(env, &sql, prefix).await
}

async fn of(env: &BenchEnv, sql: &str, prefix: &str) -> Result<Breakdown> {
    let rows: Vec<(i32, f64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(format!("{prefix}%"))
        .fetch_all(&env.pool)
        .await?;
    Ok(Breakdown {
        p50_ms: rows.into_iter().map(|(_, ms)| ms).collect(),
    })
}

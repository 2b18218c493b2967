//! Recorded model and tool answers, word for word.

use serde::Serialize;
use serde_json::Value;
use std::sync::LazyLock;

use sqlx::PgExecutor;

use super::{PgQuery, Result};
use crate::domain::RunId;

/// One recorded call.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JournalEntry {
    /// Step position.
    pub seq: i32,
    /// Call number inside the step execution (0-based).
    pub call_no: i32,
    /// `model` or `tool`.
    pub kind: String,
    /// SHA-256 of the request.
    pub request_hash: String,
    /// The answer.
    pub response: Value,
    /// Tokens used.
    pub tokens: i64,
    /// Cost in the configured currency.
    pub cost: f64,
    /// Latency of the original call.
    pub latency_ms: i64,
}

/// The recorded answer for call `call_no` of step `seq`, if any.
pub async fn get(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    seq: i32,
    call_no: i32,
) -> Result<Option<JournalEntry>> {
    Ok(sqlx::query_as(
        "SELECT seq, call_no, kind, request_hash, response, tokens, cost, latency_ms
           FROM trailmark.journal WHERE run_id = $1 AND seq = $2 AND call_no = $3",
    )
    .bind(run_id.as_str())
    .bind(seq)
    .bind(call_no)
    .fetch_optional(db)
    .await?)
}

/// The `INSERT` of journal entries bound by [`bind_entries`] from parameter `$first` on, for
/// `run_id` in parameter `$run`; `filter` may add a `WHERE` clause (the step commit's fence).
/// A second writer of the same call keeps the first answer.
pub(crate) fn insert_sql(run: usize, first: usize, filter: &str) -> String {
    let p: Vec<String> = (first..first + 8).map(|i| format!("${i}")).collect();
    format!(
        "INSERT INTO trailmark.journal (run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms)
         SELECT ${run}, s, c, k, h, r, t, x, l
           FROM UNNEST({}::int4[], {}::int4[], {}::text[], {}::text[], {}::jsonb[], {}::int8[], {}::float8[], {}::int8[])
             AS u(s, c, k, h, r, t, x, l) {filter}
         ON CONFLICT DO NOTHING",
        p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]
    )
}

/// Binds `entries` as the eight arrays [`insert_sql`] expects.
pub(crate) fn bind_entries<'q>(q: PgQuery<'q>, entries: &[JournalEntry]) -> PgQuery<'q> {
    let col = |f: fn(&JournalEntry) -> i64| entries.iter().map(f).collect::<Vec<_>>();
    q.bind(entries.iter().map(|e| e.seq).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.call_no).collect::<Vec<_>>())
        .bind(entries.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>())
        .bind(
            entries
                .iter()
                .map(|e| e.request_hash.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(entries.iter().map(|e| &e.response).collect::<Vec<_>>())
        .bind(col(|e| e.tokens))
        .bind(entries.iter().map(|e| e.cost).collect::<Vec<_>>())
        .bind(col(|e| e.latency_ms))
}

static INSERT: LazyLock<String> = LazyLock::new(|| insert_sql(1, 2, ""));

/// Records answers now, in a statement of their own (before another paid call, or when an
/// attempt ends without a step commit).
pub async fn insert(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    entries: &[JournalEntry],
) -> Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    bind_entries(sqlx::query(INSERT.as_str()).bind(run_id.as_str()), entries)
        .execute(db)
        .await?;
    Ok(())
}

/// Entries, tokens and cost of a run, for `run show`.
pub async fn totals(db: impl PgExecutor<'_>, run_id: &str) -> Result<(i64, i64, f64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), COALESCE(sum(tokens), 0)::bigint, COALESCE(sum(cost), 0)::float8
           FROM trailmark.journal WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(db)
    .await?)
}

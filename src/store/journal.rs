//! Recorded model and tool answers, word for word.

use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;
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

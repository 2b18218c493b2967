//! Recorded model and tool answers, word for word.

use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;
use crate::domain::{JournalEntry, RunId, Spent};

/// A journal row as read back.
#[derive(sqlx::FromRow)]
struct Row {
    seq: i32,
    call_no: i32,
    kind: String,
    request_hash: String,
    response: Value,
    tokens: i64,
    cost: f64,
    latency_ms: i64,
}

impl From<Row> for JournalEntry {
    fn from(r: Row) -> Self {
        Self {
            seq: r.seq,
            call_no: r.call_no,
            kind: r.kind,
            request_hash: r.request_hash,
            response: r.response,
            tokens: r.tokens,
            cost: r.cost,
            latency_ms: r.latency_ms,
        }
    }
}

/// The recorded answer for call `call_no` of step `seq`, if any.
pub async fn get(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    seq: i32,
    call_no: i32,
) -> Result<Option<JournalEntry>> {
    let row: Option<Row> = sqlx::query_as(
        "SELECT seq, call_no, kind, request_hash, response, tokens, cost, latency_ms
           FROM trailmark.journal WHERE run_id = $1 AND seq = $2 AND call_no = $3",
    )
    .bind(run_id.as_str())
    .bind(seq)
    .bind(call_no)
    .fetch_optional(db)
    .await?;
    Ok(row.map(JournalEntry::from))
}

/// Entries, tokens and cost of a run, for `run show` and the run's model budget: the answers
/// set aside by an operator count too (they were paid for); the answers a fork took over from
/// its parent do not (the parent paid for them).
pub async fn totals(db: impl PgExecutor<'_>, run_id: &str) -> Result<Spent> {
    let (entries, tokens, cost) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum(tokens), 0)::bigint, COALESCE(sum(cost), 0)::float8
           FROM (SELECT tokens, cost FROM trailmark.journal
                  WHERE run_id = $1 AND inherited_from IS NULL
                 UNION ALL
                 SELECT tokens, cost FROM trailmark.journal_set_aside
                  WHERE run_id = $1 AND inherited_from IS NULL) paid",
    )
    .bind(run_id)
    .fetch_one(db)
    .await?;
    Ok(Spent {
        entries,
        tokens,
        cost,
    })
}

/// Moves the journaled answers of step position `seq` aside, so that the step asks the model
/// again when it runs; they stay readable in `journal_set_aside`. Returns how many moved.
pub async fn set_aside(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<u64> {
    let moved = sqlx::query(
        "WITH moved AS (DELETE FROM trailmark.journal WHERE run_id = $1 AND seq = $2 RETURNING *)
         INSERT INTO trailmark.journal_set_aside (run_id, seq, call_no, kind, request_hash, response,
                                                  tokens, cost, latency_ms, created_at, set_aside_at,
                                                  inherited_from)
         SELECT run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms,
                created_at, now(), inherited_from FROM moved",
    )
    .bind(run_id)
    .bind(seq)
    .execute(db)
    .await?;
    Ok(moved.rows_affected())
}

/// A journal entry as a listing shows it: what was asked and what it cost, not the answer.
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Call {
    /// Step position.
    pub seq: i32,
    /// Call number inside the step.
    pub call_no: i32,
    /// `model` or `tool`.
    pub kind: String,
    /// The model that answered.
    pub model: Option<String>,
    /// SHA-256 of the request (the prompt's hash).
    pub request_hash: String,
    /// Tokens.
    pub tokens: i64,
    /// Cost.
    pub cost: f64,
    /// Latency of the original call.
    pub latency_ms: i64,
}

/// A run's calls after position `after`, in order, at most `limit`.
pub async fn page(
    db: impl PgExecutor<'_>,
    run_id: &str,
    after: i32,
    limit: i64,
) -> Result<Vec<Call>> {
    Ok(sqlx::query_as(
        "SELECT seq, call_no, kind, response->>'model' AS model, request_hash, tokens, cost, latency_ms
           FROM trailmark.journal WHERE run_id = $1 AND seq > $2 ORDER BY seq, call_no LIMIT $3",
    )
    .bind(run_id)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// A model answer as a comparison of two runs reads it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Answer {
    /// Position.
    pub seq: i32,
    /// Call number within the position.
    pub call_no: i32,
    /// Hash of the request.
    pub request_hash: String,
    /// The answer's text.
    pub content: Option<String>,
    /// Tokens.
    pub tokens: i64,
    /// Cost.
    pub cost: f64,
    /// Taken over by a fork (paid by another run).
    pub inherited: bool,
}

/// Every journaled answer of a run, in order.
pub async fn answers(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<Answer>> {
    Ok(sqlx::query_as(
        "SELECT seq, call_no, request_hash, response->>'content' AS content, tokens, cost,
                inherited_from IS NOT NULL AS inherited
           FROM trailmark.journal WHERE run_id = $1 ORDER BY seq, call_no",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

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

/// Entries, tokens and cost of a run, for `run show` and the run's model budget.
pub async fn totals(db: impl PgExecutor<'_>, run_id: &str) -> Result<Spent> {
    let (entries, tokens, cost) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum(tokens), 0)::bigint, COALESCE(sum(cost), 0)::float8
           FROM trailmark.journal WHERE run_id = $1",
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

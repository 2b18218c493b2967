//! Effect records: the intent (key, request hash, fence) before an outside call, the result after.

use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::{Error, Result};
use crate::domain::{Fence, IdempotencyKey, RunId};

/// One effect as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EffectRow {
    /// The key.
    pub idempotency_key: String,
    /// Step position that made it.
    pub seq: i32,
    /// SHA-256 of the request.
    pub request_hash: String,
    /// Fence of the worker that recorded the intent.
    pub fence: i64,
    /// The outside system's answer, once known.
    pub result: Option<Value>,
}

/// What is known about a key before calling out.
pub enum Known {
    /// Nothing: intent just recorded, call out.
    New,
    /// Intent recorded earlier but no result: the call may have happened.
    Unknown,
    /// The call finished earlier; here is its result.
    Done(Value),
}

/// Records the intent for `key` (only while `fence` is the run's current fence), or reports
/// what an earlier attempt left.
/// A key already used with a different request hash is a [`Error::Conflict`].
pub async fn begin(
    db: &sqlx::PgPool,
    key: &IdempotencyKey,
    tool: &str,
    run_id: &RunId,
    seq: i32,
    request_hash: &str,
    fence: Fence,
) -> Result<Known> {
    let inserted = sqlx::query(
        "INSERT INTO trailmark.effects (idempotency_key, run_id, seq, request_hash, fence, tool)
         SELECT $1, $2, $3, $4, $5, $6 FROM trailmark.runs WHERE run_id = $2 AND fence = $5
         ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(key.as_str())
    .bind(run_id.as_str())
    .bind(seq)
    .bind(request_hash)
    .bind(fence.0)
    .bind(tool)
    .execute(db)
    .await?
    .rows_affected()
        == 1;
    if inserted {
        return Ok(Known::New);
    }
    // Not inserted: either the key exists, or the run's fence moved on (the guard above).
    let row: Option<EffectRow> = sqlx::query_as(
        "SELECT idempotency_key, seq, request_hash, fence, result FROM trailmark.effects
          WHERE idempotency_key = $1",
    )
    .bind(key.as_str())
    .fetch_optional(db)
    .await?;
    let Some(row) = row else {
        return Err(Error::FencedOut {
            run_id: run_id.to_string(),
            fence: fence.0,
        });
    };
    if row.request_hash != request_hash {
        return Err(Error::Conflict {
            key: key.to_string(),
            stored: row.request_hash,
            new: request_hash.to_owned(),
        });
    }
    Ok(match row.result {
        Some(v) => Known::Done(v),
        None => Known::Unknown,
    })
}

/// Stores the result of the call made under `key`.
pub async fn complete(db: impl PgExecutor<'_>, key: &IdempotencyKey, result: &Value) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.effects SET result = $2, completed_at = now() WHERE idempotency_key = $1",
    )
    .bind(key.as_str())
    .bind(result)
    .execute(db)
    .await?;
    Ok(())
}

/// Counts (all, completed) effects of a run, for `run show`.
pub async fn totals(db: impl PgExecutor<'_>, run_id: &str) -> Result<(i64, i64)> {
    Ok(
        sqlx::query_as("SELECT count(*), count(result) FROM trailmark.effects WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(db)
            .await?,
    )
}

/// For a call not yet made under `key`: the run's tool calls so far, and how many of them were
/// `tool` with the same request hash (both excluding `key`, so a replay never counts twice).
pub async fn usage(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    key: &IdempotencyKey,
    tool: &str,
    request_hash: &str,
) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE tool = $3 AND request_hash = $4)
           FROM trailmark.effects WHERE run_id = $1 AND idempotency_key <> $2",
    )
    .bind(run_id.as_str())
    .bind(key.as_str())
    .bind(tool)
    .bind(request_hash)
    .fetch_one(db)
    .await?)
}

/// One effect of a run, for the handover note.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EffectSummary {
    /// The key.
    pub idempotency_key: String,
    /// The tool.
    pub tool: String,
    /// Position of the step that made it.
    pub seq: i32,
    /// Whether its result is known (false: the call may or may not have happened).
    pub completed: bool,
}

/// Every effect of a run, oldest first.
pub async fn list(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<EffectSummary>> {
    Ok(sqlx::query_as(
        "SELECT idempotency_key, tool, seq, result IS NOT NULL AS completed FROM trailmark.effects
          WHERE run_id = $1 ORDER BY created_at, idempotency_key",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

//! Effect records: the intent (key, request hash, fence) before an outside call, the result after.

use serde::Serialize;
use serde_json::Value;
use sqlx::{FromRow, PgExecutor};

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

/// What recording an intent found.
pub enum Begun {
    /// The key's state.
    Known(Known),
    /// A new call would exceed a limit; no intent was recorded.
    OverLimit(Usage),
}

/// The run's tool calls so far, excluding the key asked about (a replay never counts twice).
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// All calls of the run.
    pub calls: i64,
    /// Calls to the same tool with the same request hash.
    pub repeats: i64,
}

/// A call about to be made, as recorded before it is made.
pub struct Intent<'a> {
    /// The key.
    pub key: &'a IdempotencyKey,
    /// The tool's name.
    pub tool: &'a str,
    /// The run.
    pub run_id: &'a RunId,
    /// The step position.
    pub seq: i32,
    /// SHA-256 of the request.
    pub request_hash: &'a str,
    /// The caller's fence: no intent is recorded unless it is current.
    pub fence: Fence,
    /// The run's tool-call budget (0: none).
    pub max_calls: u64,
    /// Identical calls allowed before it counts as a loop (0: no limit).
    pub repeat_limit: u64,
}

#[derive(FromRow)]
struct BeginRow {
    inserted: bool,
    calls: i64,
    repeats: i64,
    stored_hash: Option<String>,
    result: Option<Value>,
}

const BEGIN: &str = "
    WITH usage AS (
        -- Counted only for a limit that is set: a long run would otherwise count all its effects
        -- on every call. The repeat count reads effects_repeat_idx.
        SELECT CASE WHEN $7 > 0 THEN (SELECT count(*) FROM trailmark.effects
                                       WHERE run_id = $2 AND idempotency_key <> $1) ELSE 0 END AS calls,
               CASE WHEN $8 > 0 THEN (SELECT count(*) FROM trailmark.effects
                                       WHERE run_id = $2 AND tool = $6 AND request_hash = $4
                                         AND idempotency_key <> $1) ELSE 0 END AS repeats
    ), existing AS (
        SELECT request_hash, result FROM trailmark.effects WHERE idempotency_key = $1
    ), ins AS (
        INSERT INTO trailmark.effects (idempotency_key, run_id, seq, request_hash, fence, tool)
        SELECT $1, $2, $3, $4, $5, $6 FROM trailmark.runs r, usage u
         WHERE r.run_id = $2 AND r.fence = $5 AND NOT EXISTS (SELECT 1 FROM existing)
           AND ($7 = 0 OR u.calls < $7) AND ($8 = 0 OR u.repeats < $8)
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM ins) AS inserted, u.calls, u.repeats,
           e.request_hash AS stored_hash, e.result
      FROM usage u LEFT JOIN existing e ON true";

/// Records the intent for `i.key` (only while `i.fence` is the run's current fence and within
/// the limits), or reports what an earlier attempt left, in one statement.
/// A key already used with a different request hash is a [`Error::Conflict`].
pub async fn begin(db: impl PgExecutor<'_>, i: &Intent<'_>) -> Result<Begun> {
    let row: BeginRow = sqlx::query_as(BEGIN)
        .bind(i.key.as_str())
        .bind(i.run_id.as_str())
        .bind(i.seq)
        .bind(i.request_hash)
        .bind(i.fence.0)
        .bind(i.tool)
        .bind(i.max_calls as i64)
        .bind(i.repeat_limit as i64)
        .fetch_one(db)
        .await?;
    if let Some(stored) = &row.stored_hash
        && stored != i.request_hash
    {
        return Err(Error::Conflict {
            key: i.key.to_string(),
            stored: stored.clone(),
            new: i.request_hash.to_owned(),
        });
    }
    let usage = Usage {
        calls: row.calls,
        repeats: row.repeats,
    };
    let over = |limit: u64, used: i64| limit > 0 && used as u64 >= limit;
    if over(i.max_calls, usage.calls) || over(i.repeat_limit, usage.repeats) {
        return Ok(Begun::OverLimit(usage));
    }
    if row.inserted {
        return Ok(Begun::Known(Known::New));
    }
    // Not inserted and no earlier intent: the run's fence moved on (the guard above).
    match (row.stored_hash, row.result) {
        (Some(_), Some(v)) => Ok(Begun::Known(Known::Done(v))),
        (Some(_), None) => Ok(Begun::Known(Known::Unknown)),
        (None, _) => Err(Error::FencedOut {
            run_id: i.run_id.to_string(),
            fence: i.fence.0,
        }),
    }
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

/// Effects recorded by forward steps that never finished (a step that stopped halfway), oldest
/// first: writes that no compensation will reverse, since undo compensates finished steps only.
/// A compensation that stopped halfway is left out: it is itself a reversal, keyed, and the next
/// undo runs it again under the same keys.
pub async fn of_unfinished_steps(
    db: impl PgExecutor<'_>,
    run_id: &str,
) -> Result<Vec<EffectSummary>> {
    Ok(sqlx::query_as(
        "SELECT e.idempotency_key, e.tool, e.seq, e.result IS NOT NULL AS completed
           FROM trailmark.effects e
           JOIN trailmark.steps s ON s.run_id = e.run_id AND s.seq = e.seq
          WHERE e.run_id = $1 AND s.finished_at IS NULL AND s.step NOT LIKE 'undo:%'
          ORDER BY e.created_at, e.idempotency_key",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

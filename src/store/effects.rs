//! Effect records: the intent (key, request hash, fence) before an outside call, the result after.

use serde::Serialize;
use serde_json::Value;
use sqlx::{FromRow, PgExecutor, PgPool};

use super::{Error, Result};
use crate::domain::{EffectIntent as Intent, EffectState, IntentOutcome, StepAddress, ToolUsage};

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

#[derive(FromRow)]
struct BeginRow {
    inserted: bool,
    calls: i64,
    repeats: i64,
    stored_hash: Option<String>,
    result: Option<Value>,
}

/// The intent statement for any number of calls ("items", numbered from 1 in binding order).
/// Usage is counted only for a limit that is set: a long run would otherwise count all its
/// effects on every call (the repeat count reads effects_repeat_idx). Calls of one batch count
/// each other no more than concurrent single statements would: each sees the effects committed
/// before it started.
const BEGIN: &str = "
    WITH req AS (
        SELECT * FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::text[], $5::int8[], $6::text[],
                             $7::int8[], $8::int8[])
          WITH ORDINALITY AS r(key, run_id, seq, hash, fence, tool, max_calls, repeat_limit, n)
    ), usage AS (
        SELECT r.n,
               CASE WHEN r.max_calls > 0 THEN (SELECT count(*) FROM trailmark.effects e
                                                WHERE e.run_id = r.run_id AND e.idempotency_key <> r.key) ELSE 0 END AS calls,
               CASE WHEN r.repeat_limit > 0 THEN (SELECT count(*) FROM trailmark.effects e
                                                   WHERE e.run_id = r.run_id AND e.tool = r.tool AND e.request_hash = r.hash
                                                     AND e.idempotency_key <> r.key) ELSE 0 END AS repeats
          FROM req r
    ), existing AS (
        SELECT r.n, e.request_hash, e.result FROM req r JOIN trailmark.effects e ON e.idempotency_key = r.key
    ), ins AS (
        INSERT INTO trailmark.effects (idempotency_key, run_id, seq, request_hash, fence, tool)
        SELECT r.key, r.run_id, r.seq, r.hash, r.fence, r.tool
          FROM req r JOIN usage u ON u.n = r.n JOIN trailmark.runs x ON x.run_id = r.run_id AND x.fence = r.fence AND x.step_seq = r.seq
         WHERE r.n NOT IN (SELECT n FROM existing)
           AND (r.max_calls = 0 OR u.calls < r.max_calls) AND (r.repeat_limit = 0 OR u.repeats < r.repeat_limit)
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING idempotency_key
    )
    SELECT r.key IN (SELECT idempotency_key FROM ins) AS inserted, u.calls, u.repeats,
           e.request_hash AS stored_hash, e.result
      FROM req r JOIN usage u ON u.n = r.n LEFT JOIN existing e ON e.n = r.n
     ORDER BY r.n";

/// Records the intent for `i.key` (only while `i.fence` and `i.seq` are where the run stands,
/// and within the limits), or reports what an earlier attempt left, in one statement.
/// A key already used with a different request hash is a [`Error::Conflict`].
pub async fn begin(db: impl PgExecutor<'_>, i: &Intent) -> Result<IntentOutcome> {
    let row = begin_batch(db, std::slice::from_ref(i)).await?.remove(0);
    begun(row, i)
}

/// Records several intents, each with the outcome [`begin`] would give it: in one statement,
/// unless two are for the same key (the statement could not tell which one went in) or the
/// statement fails; then one by one.
pub async fn begin_all<'a>(pool: &'a PgPool, intents: &'a [Intent]) -> Vec<Result<IntentOutcome>> {
    let batch = |intents: &'a [Intent]| async move {
        let rows = begin_batch(pool, intents).await?;
        Ok(rows
            .into_iter()
            .zip(intents)
            .map(|(r, i)| begun(r, i))
            .collect())
    };
    super::batch_or_each("intent", intents, batchable(intents), batch, |i| {
        begin(pool, i)
    })
    .await
}

/// Whether one statement can give each intent its own outcome: not when two share a key (it
/// could not tell which one went in), nor when two of one run are counted against a limit (they
/// would not count each other; one at a time, the second sees the first).
fn batchable(intents: &[Intent]) -> bool {
    let distinct = |key: fn(&Intent) -> &str| {
        let mut keys: Vec<&str> = intents.iter().map(key).collect();
        keys.sort_unstable();
        keys.dedup();
        keys.len() == intents.len()
    };
    let limited = intents
        .iter()
        .any(|i| i.max_calls > 0 || i.repeat_limit > 0);
    distinct(|i| i.key.as_str()) && (!limited || distinct(|i| i.run_id.as_str()))
}

async fn begin_batch(db: impl PgExecutor<'_>, intents: &[Intent]) -> Result<Vec<BeginRow>> {
    let text = |f: fn(&Intent) -> &str| intents.iter().map(f).collect::<Vec<_>>();
    let number = |f: fn(&Intent) -> u64| intents.iter().map(|i| f(i) as i64).collect::<Vec<_>>();
    Ok(sqlx::query_as(BEGIN)
        .bind(text(|i| i.key.as_str()))
        .bind(text(|i| i.run_id.as_str()))
        .bind(intents.iter().map(|i| i.seq).collect::<Vec<_>>())
        .bind(text(|i| i.request_hash.as_str()))
        .bind(intents.iter().map(|i| i.fence.0).collect::<Vec<_>>())
        .bind(text(|i| i.tool.as_str()))
        .bind(number(|i| i.max_calls))
        .bind(number(|i| i.repeat_limit))
        .fetch_all(db)
        .await?)
}

/// What one intent's row means.
fn begun(row: BeginRow, i: &Intent) -> Result<IntentOutcome> {
    if let Some(stored) = &row.stored_hash
        && stored != &i.request_hash
    {
        return Err(Error::Conflict {
            key: i.key.to_string(),
            stored: stored.clone(),
            new: i.request_hash.clone(),
        });
    }
    let usage = ToolUsage {
        calls: row.calls,
        repeats: row.repeats,
    };
    let over = |limit: u64, used: i64| limit > 0 && used as u64 >= limit;
    if over(i.max_calls, usage.calls) || over(i.repeat_limit, usage.repeats) {
        return Ok(IntentOutcome::OverLimit(usage));
    }
    if row.inserted {
        return Ok(IntentOutcome::Recorded(EffectState::New));
    }
    // Not inserted and no earlier intent: the run's fence moved on (the guard above).
    match (row.stored_hash, row.result) {
        (Some(_), Some(v)) => Ok(IntentOutcome::Recorded(EffectState::Done(v))),
        (Some(_), None) => Ok(IntentOutcome::Recorded(EffectState::Unknown)),
        (None, _) => Err(Error::FencedOut {
            run_id: i.run_id.to_string(),
            fence: i.fence.0,
        }),
    }
}

/// The request hash and result (if known) recorded under `key`, without recording anything: a
/// step whose call the breaker would refuse reads it instead of recording an intent.
pub async fn recorded(db: impl PgExecutor<'_>, key: &str) -> Result<Option<(String, Option<Value>)>> {
    Ok(sqlx::query_as(
        "SELECT request_hash, result FROM trailmark.effects WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_optional(db)
    .await?)
}

/// Removes the intent `run_id` recorded under `key` with `fence`, as long as it has no result:
/// for a call that was refused before it was made, so that no later attempt takes it for an
/// unknown outcome. `false`: nothing matched (a result came, or another worker owns the key).
pub async fn withdraw(db: impl PgExecutor<'_>, key: &str, run_id: &str, fence: i64) -> Result<bool> {
    let done = sqlx::query(
        "DELETE FROM trailmark.effects
          WHERE idempotency_key = $1 AND run_id = $2 AND fence = $3 AND result IS NULL",
    )
    .bind(key)
    .bind(run_id)
    .bind(fence)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Counts (all, completed) writes of a run, for `run show`: its effects and local writes (a
/// local write is always complete: it exists only with its step's commit).
pub async fn totals(db: impl PgExecutor<'_>, run_id: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT e.n + l.n, e.done + l.n
           FROM (SELECT count(*) AS n, count(result) AS done FROM trailmark.effects WHERE run_id = $1) AS e,
                (SELECT COALESCE(sum(jsonb_array_length(local_writes)), 0)::int8 AS n
                   FROM trailmark.steps WHERE run_id = $1 AND local_writes IS NOT NULL) AS l",
    )
    .bind(run_id)
    .fetch_one(db)
    .await?)
}

/// The tool name listings give a local write (`ctx.local_write`); its key there is
/// `table:key`.
pub const LOCAL_WRITE: &str = "local_write";

/// A run's local writes as effect rows: key `table:key`, tool [`LOCAL_WRITE`], its step's
/// position, its request hash, and when its step committed (`at`), for the listings below.
const LOCAL_WRITES: &str =
    "SELECT (w->>0) || ':' || (w->>1) AS idempotency_key, 'local_write' AS tool, s.seq,
            w->>2 AS request_hash, true AS completed, COALESCE(s.finished_at, s.started_at) AS at,
            s.finished_at IS NULL AS unfinished, s.step
       FROM trailmark.steps s CROSS JOIN LATERAL jsonb_array_elements(s.local_writes) AS w
      WHERE s.run_id = $1 AND s.local_writes IS NOT NULL";

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

/// Every effect and local write of a run, oldest first.
pub async fn list(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<EffectSummary>> {
    let sql = format!(
        "SELECT idempotency_key, tool, seq, completed FROM (
            SELECT idempotency_key, tool, seq, result IS NOT NULL AS completed, created_at AS at
              FROM trailmark.effects WHERE run_id = $1
            UNION ALL
            SELECT idempotency_key, tool, seq, completed, at FROM ({LOCAL_WRITES}) AS l
         ) AS written ORDER BY at, idempotency_key"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
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
    // A local write of an unfinished step comes from a human step that wrote before asking.
    let sql = format!(
        "SELECT idempotency_key, tool, seq, completed FROM (
            SELECT e.idempotency_key, e.tool, e.seq, e.result IS NOT NULL AS completed, e.created_at AS at
              FROM trailmark.effects e
              JOIN trailmark.steps s ON s.run_id = e.run_id AND s.seq = e.seq
             WHERE e.run_id = $1 AND s.finished_at IS NULL AND s.step NOT LIKE $2
            UNION ALL
            SELECT idempotency_key, tool, seq, completed, at FROM ({LOCAL_WRITES}) AS l
             WHERE unfinished AND step NOT LIKE $2
         ) AS written ORDER BY at, idempotency_key"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(StepAddress::UNDO_LIKE)
        .fetch_all(db)
        .await?)
}

/// An effect as a listing shows it, with its state: `done` (result recorded), `intent` (the
/// call is under way: its step holds the lease), or `unknown` (no result and nobody is making
/// the call: it may or may not have happened).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct EffectView {
    /// The key.
    pub idempotency_key: String,
    /// The tool.
    pub tool: String,
    /// Position of the step that made it.
    pub seq: i32,
    /// SHA-256 of the request.
    pub request_hash: String,
    /// `done`, `intent` or `unknown`.
    pub state: String,
}

/// A run's effects after position `after`, in order, at most `limit`.
pub async fn page(
    db: impl PgExecutor<'_>,
    run_id: &str,
    after: i32,
    limit: i64,
) -> Result<Vec<EffectView>> {
    let sql = format!(
        "SELECT idempotency_key, tool, seq, request_hash, state FROM (
            SELECT e.idempotency_key, e.tool, e.seq, e.request_hash,
                   CASE WHEN e.result IS NOT NULL THEN 'done'
                        WHEN r.lease_owner IS NOT NULL AND r.step_seq = e.seq
                             AND (r.lease_expires_at IS NULL OR r.lease_expires_at > now())
                             THEN 'intent'
                        ELSE 'unknown' END AS state,
                   e.created_at AS at
              FROM trailmark.effects e JOIN trailmark.runs r ON r.run_id = e.run_id
             WHERE e.run_id = $1 AND e.seq > $2
            UNION ALL
            SELECT idempotency_key, tool, seq, request_hash, 'done', at FROM ({LOCAL_WRITES}) AS l
             WHERE seq > $2
         ) AS written ORDER BY seq, at, idempotency_key LIMIT $3"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(after)
        .bind(limit)
        .fetch_all(db)
        .await?)
}

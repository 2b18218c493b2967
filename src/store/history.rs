//! The reads behind a run's replayable history (`trailmark run export ID --history`, see
//! `crate::replay`): the journal with its answers, the effects in the order their intents were
//! recorded, the waits with where each went on, the events that resumed them and the children
//! a step started. The run row, its positions and its fork record come from `runs`, `steps` and
//! `forks`. A caller that wants one consistent picture of a run in flight reads them all in one
//! `REPEATABLE READ` transaction ([`snapshot`]).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::Result;

/// Makes the transaction `tx` a read-only snapshot: every read after it sees the run as it was at
/// that moment, so a step committing meanwhile cannot leave a history half before, half after.
pub async fn snapshot(tx: &mut PgConnection) -> Result<()> {
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(tx)
        .await?;
    Ok(())
}

/// A journal entry with its answer word for word.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct JournalRow {
    /// Position.
    pub seq: i32,
    /// Call number within the position.
    pub call_no: i32,
    /// `model`, `patch`, ...
    pub kind: String,
    /// Hash of the request.
    pub request_hash: String,
    /// The answer (or the patch choice).
    pub response: Value,
}

/// Every journal entry of a run, by position and call number.
pub async fn journal(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<JournalRow>> {
    Ok(sqlx::query_as(
        "SELECT seq, call_no, kind, request_hash, response FROM trailmark.journal
          WHERE run_id = $1 ORDER BY seq, call_no",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// An outside write as recorded: its key, tool, request hash and result (once known).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EffectRow {
    /// The idempotency key.
    pub key: String,
    /// Position of the step that made it.
    pub seq: i32,
    /// The tool.
    pub tool: String,
    /// Hash of the request.
    pub request_hash: String,
    /// The result; `None` while the outcome is unknown.
    pub result: Option<Value>,
}

/// Every effect of a run, in the order their intents were recorded: a step records one intent at
/// a time, each in a transaction of its own, so within a position the intent's time is the
/// order of the calls (the key breaks a tie).
pub async fn effects(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<EffectRow>> {
    Ok(sqlx::query_as(
        "SELECT idempotency_key AS key, seq, tool, request_hash, result FROM trailmark.effects
          WHERE run_id = $1 ORDER BY seq, created_at, idempotency_key",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// What a step's run waited for after it, and where it was to go on.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WaitRow {
    /// The position of the step that ended by waiting.
    pub seq: i32,
    /// `event`, `sleep` or `children`.
    pub kind: String,
    /// The event waited for.
    pub event_name: Option<String>,
    /// Its match key.
    pub match_key: Option<String>,
    /// The step the run goes on with after the wait.
    pub next_step: String,
}

/// Every wait of a run, by position (unlike `waits::for_run`, which keeps a view's last 100).
pub async fn waits(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<WaitRow>> {
    Ok(sqlx::query_as(
        "SELECT seq, kind, event_name, match_key, next_step FROM trailmark.waits
          WHERE run_id = $1 ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// The event that resumed a run after the wait at `seq`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EventRow {
    /// The wait's position.
    pub seq: i32,
    /// The event's id.
    pub id: String,
    /// Its name.
    pub name: String,
    /// Its match key.
    pub key: String,
    /// Its payload.
    pub payload: Value,
    /// When trailmark received it.
    pub received_at: DateTime<Utc>,
}

/// The events that resumed the run, one per wait position, as `StepContext::event` reads them
/// (`waits::received_event`): a fork's positions before its fork point are its parent's, so
/// their events are read through the fork chain, the nearest run first.
pub async fn events(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<EventRow>> {
    Ok(sqlx::query_as(
        "WITH RECURSIVE owner(run_id, below, depth) AS (
            SELECT $1::text, 2147483647, 0
            UNION ALL
            SELECT f.parent_run_id, LEAST(o.below, f.from_seq), o.depth + 1 FROM owner o
              JOIN trailmark.forks f ON f.run_id = o.run_id
             WHERE o.depth < 64
         )
         SELECT DISTINCT ON (w.seq) w.seq, s.signal_id AS id, s.name, s.match_key AS key,
                s.payload, s.received_at
           FROM owner o
           JOIN trailmark.waits w ON w.run_id = o.run_id AND w.seq < o.below
                                 AND w.resolution = 'event'
           JOIN trailmark.signals s ON s.signal_id = w.signal_id
          ORDER BY w.seq, o.depth",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// A child run a step started, with its output once it succeeded.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ChildRow {
    /// The parent's position that started it.
    pub seq: i32,
    /// Its index in the fan-out.
    pub idx: i32,
    /// Its run id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// Its input.
    pub input: Value,
    /// `pending`, `running`, `succeeded`, `failed`, `cancelled` or `skipped`.
    pub state: String,
    /// Its output, once it succeeded.
    pub output: Option<Value>,
    /// Why it failed or was cancelled.
    pub reason: Option<String>,
}

/// Every child the run's steps started, by position and index (the state and output as
/// `children::page` reads them for the step after the fan-out).
pub async fn children(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<ChildRow>> {
    Ok(sqlx::query_as(
        "SELECT c.seq, c.idx, c.run_id, c.workflow, c.input, c.state,
                CASE WHEN c.state = 'succeeded' THEN r.output END AS output, c.reason
           FROM trailmark.children c LEFT JOIN trailmark.runs r ON r.run_id = c.run_id
          WHERE c.parent_run_id = $1 ORDER BY c.seq, c.idx",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

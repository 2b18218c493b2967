//! The `fan_outs` and `children` tables: the child runs a step started, their states, and the
//! join's counters (docs/ARCHITECTURE.md, "Child runs").
//!
//! Every statement that changes them runs in a transaction holding the parent's `runs` row
//! ([`lock_run`]), taken before any child's row: two children ending at once are serialised on
//! their parent, so the join is seen exactly once, and a decision on the parent (which locks it
//! first too) never deadlocks with a child's ending.

use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::domain::{
    ChildResult, ChildrenSummary, FanOut, RunId, RunStatus, StepAddress, Transition, UndoPlan,
    child_run_id,
};

/// Locks a run's row for the caller's transaction; `None`: no such run.
pub async fn lock_run(conn: &mut PgConnection, run_id: &str) -> Result<Option<(RunStatus, i32)>> {
    Ok(sqlx::query_as(
        "SELECT status, step_seq FROM trailmark.runs WHERE run_id = $1 FOR UPDATE",
    )
    .bind(run_id)
    .fetch_optional(conn)
    .await?)
}

/// A fan-out's join and counters, as the join reads them.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FanOutRow {
    /// The parent run.
    pub run_id: String,
    /// The position of the step that started the children.
    pub seq: i32,
    /// Children in the fan-out.
    pub total: i32,
    /// The join waits for the first N to succeed (`None`: all).
    pub first_n: Option<i32>,
    /// Failures allowed.
    pub max_failures: i32,
    /// Children running at once at most.
    pub max_in_flight: i32,
    /// Children started so far.
    pub started: i32,
    /// Children that succeeded.
    pub succeeded: i32,
    /// Children that failed (or were cancelled).
    pub failed: i32,
    /// Whether the join held already (the parent went on).
    pub joined: bool,
}

impl FanOutRow {
    /// Children started and not ended.
    pub fn in_flight(&self) -> i32 {
        self.started - self.succeeded - self.failed
    }
}

const FAN_OUT: &str = "SELECT run_id, seq, total, first_n, max_failures, max_in_flight, started,
        succeeded, failed, joined_at IS NOT NULL AS joined FROM trailmark.fan_outs";

/// The fan-out of the step at `seq` of `run_id`, if that step started children.
pub async fn fan_out(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<Option<FanOutRow>> {
    let sql = format!("{FAN_OUT} WHERE run_id = $1 AND seq = $2");
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(seq)
        .fetch_optional(db)
        .await?)
}

/// Records a fan-out and every child of it as `pending` (in the parent's commit transaction).
pub async fn record(conn: &mut PgConnection, parent: &RunId, seq: i32, fan: &FanOut) -> Result<()> {
    sqlx::query(
        "INSERT INTO trailmark.fan_outs (run_id, seq, total, first_n, max_failures, max_in_flight)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(parent.as_str())
    .bind(seq)
    .bind(fan.children.len() as i32)
    .bind(fan.first_n)
    .bind(fan.max_failures)
    .bind(fan.max_in_flight)
    .execute(&mut *conn)
    .await?;
    let mut ids = Vec::with_capacity(fan.children.len());
    for index in 0..fan.children.len() {
        let id = child_run_id(parent, seq, index)
            .map_err(|e| super::Error::unavailable("a child's run id was checked before", e))?;
        ids.push(id.to_string());
    }
    sqlx::query(
        "INSERT INTO trailmark.children (parent_run_id, seq, idx, run_id, workflow,
                                         workflow_version, first_step, input, state)
         SELECT $1, $2, c.idx - 1, c.run_id, c.workflow, c.version, c.first_step, c.input,
                'pending'
           FROM UNNEST($3::text[], $4::text[], $5::int4[], $6::text[], $7::jsonb[])
                WITH ORDINALITY AS c(run_id, workflow, version, first_step, input, idx)",
    )
    .bind(parent.as_str())
    .bind(seq)
    .bind(ids)
    .bind(fan.children.iter().map(|c| c.workflow.as_str()).collect::<Vec<_>>())
    .bind(fan.children.iter().map(|c| c.version).collect::<Vec<_>>())
    .bind(fan.children.iter().map(|c| c.first_step.as_str()).collect::<Vec<_>>())
    .bind(fan.children.iter().map(|c| &c.input).collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// A child to start now.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ToStart {
    /// Its index.
    pub idx: i32,
    /// Its run id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// That workflow's version.
    pub workflow_version: i32,
    /// Its first step.
    pub first_step: StepAddress,
    /// Its input.
    pub input: Value,
}

/// Marks up to `n` pending children of the fan-out as running, lowest index first, counts them
/// started, and returns them for the caller to create their runs in the same transaction.
pub async fn take_pending(
    conn: &mut PgConnection,
    (run_id, seq): (&str, i32),
    n: i32,
) -> Result<Vec<ToStart>> {
    if n <= 0 {
        return Ok(Vec::new());
    }
    let taken: Vec<ToStart> = sqlx::query_as(
        "UPDATE trailmark.children c SET state = 'running', started_at = now()
           FROM (SELECT idx FROM trailmark.children
                  WHERE parent_run_id = $1 AND seq = $2 AND state = 'pending'
                  ORDER BY idx LIMIT $3) p
          WHERE c.parent_run_id = $1 AND c.seq = $2 AND c.idx = p.idx
         RETURNING c.idx, c.run_id, c.workflow, c.workflow_version, c.first_step, c.input",
    )
    .bind(run_id)
    .bind(seq)
    .bind(n)
    .fetch_all(&mut *conn)
    .await?;
    sqlx::query("UPDATE trailmark.fan_outs SET started = started + $3 WHERE run_id = $1 AND seq = $2")
        .bind(run_id)
        .bind(seq)
        .bind(taken.len() as i32)
        .execute(conn)
        .await?;
    let mut taken = taken;
    taken.sort_by_key(|c| c.idx);
    Ok(taken)
}

/// Whether the fan-out at `seq` of `run_id` stopped its run for review (past its failure
/// threshold) and has not joined.
pub async fn stopped_at(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.fan_outs WHERE run_id = $1 AND seq = $2
                          AND stopped_at IS NOT NULL AND joined_at IS NULL)",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_one(db)
    .await?)
}

/// The parent of a child run and the position that started it.
pub async fn parent_of(db: impl PgExecutor<'_>, child: &str) -> Result<Option<(String, i32)>> {
    Ok(
        sqlx::query_as("SELECT parent_run_id, seq FROM trailmark.children WHERE run_id = $1")
            .bind(child)
            .fetch_optional(db)
            .await?,
    )
}

/// Records that a child ended (`succeeded`, `failed` or `cancelled`, with why) and counts it in
/// its fan-out; returns the fan-out as it now stands. A child that ended before (failed, then
/// resumed by a person and succeeded) is counted again under its new state, never twice.
pub async fn ended(
    conn: &mut PgConnection,
    child: &str,
    state: &str,
    reason: Option<&str>,
) -> Result<Option<FanOutRow>> {
    const ENDED: &str = "WITH was AS (
            SELECT state FROM trailmark.children WHERE run_id = $1 FOR UPDATE
         ), c AS (
            UPDATE trailmark.children c SET state = $2, reason = $3, ended_at = now()
              FROM was WHERE c.run_id = $1 AND was.state IN ('running', 'failed', 'cancelled')
            RETURNING c.parent_run_id, c.seq, was.state AS was
         ), f AS (
            UPDATE trailmark.fan_outs f
               SET succeeded = f.succeeded + ($2 = 'succeeded')::int - (c.was = 'succeeded')::int,
                   failed = f.failed + ($2 <> 'succeeded')::int - (c.was <> 'running')::int
              FROM c WHERE f.run_id = c.parent_run_id AND f.seq = c.seq
            RETURNING f.*
         )
         SELECT run_id, seq, total, first_n, max_failures, max_in_flight, started, succeeded,
                failed, joined_at IS NOT NULL AS joined FROM f";
    Ok(sqlx::query_as(ENDED)
        .bind(child)
        .bind(state)
        .bind(reason)
        .fetch_optional(conn)
        .await?)
}

/// Marks the fan-out's `join` done, once: `false` when it was before (the caller then moves
/// nothing). The join on the children's runs also skips the children never started (a
/// first-n fan-out that had enough).
pub async fn join_once(conn: &mut PgConnection, (run_id, seq): (&str, i32), join: Join) -> Result<bool> {
    let sql = format!(
        "UPDATE trailmark.fan_outs SET {0} = now() WHERE run_id = $1 AND seq = $2 AND {0} IS NULL",
        join.joined_column()
    );
    // Column names from `Join` only: nothing from outside is spliced in.
    let done = (sqlx::query(sqlx::AssertSqlSafe(sql)).bind(run_id).bind(seq))
        .execute(&mut *conn)
        .await?;
    if join == Join::Runs {
        sqlx::query(
            "UPDATE trailmark.children SET state = 'skipped'
              WHERE parent_run_id = $1 AND seq = $2 AND state = 'pending'",
        )
        .bind(run_id)
        .bind(seq)
        .execute(conn)
        .await?;
    }
    Ok(done.rows_affected() == 1)
}

/// Which of a fan-out's two joins a statement is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// The join on its children's runs.
    Runs,
    /// The join on their undo.
    Undo,
}

impl Join {
    /// The fan-out's column saying when this join was made.
    fn joined_column(self) -> &'static str {
        match self {
            Join::Runs => "joined_at",
            Join::Undo => "undo_joined_at",
        }
    }

    /// The fan-out's column saying when this join stopped its parent.
    fn stopped_column(self) -> &'static str {
        match self {
            Join::Runs => "stopped_at",
            Join::Undo => "undo_stopped_at",
        }
    }

    /// A child's columns of its state and reason in this join.
    fn state_columns(self) -> (&'static str, &'static str) {
        match self {
            Join::Runs => ("state", "reason"),
            Join::Undo => ("undo_state", "undo_reason"),
        }
    }
}

/// Marks the fan-out's `join` stopped (the parent stops for review).
pub async fn stopped(conn: &mut PgConnection, (run_id, seq): (&str, i32), join: Join) -> Result<()> {
    let sql = format!(
        "UPDATE trailmark.fan_outs SET {} = now() WHERE run_id = $1 AND seq = $2",
        join.stopped_column()
    );
    // Column names from `Join` only: nothing from outside is spliced in.
    (sqlx::query(sqlx::AssertSqlSafe(sql)).bind(run_id).bind(seq))
        .execute(conn)
        .await?;
    Ok(())
}

/// The children of a fan-out that failed (or were cancelled) in its `join`, lowest index
/// first, at most `limit`: index, run id, state and why.
pub async fn failed(
    db: impl PgExecutor<'_>,
    (run_id, seq): (&str, i32),
    limit: i64,
    join: Join,
) -> Result<Vec<(i32, String, String, Option<String>)>> {
    let (state, reason) = join.state_columns();
    let sql = format!(
        "SELECT idx, run_id, {state}, {reason} FROM trailmark.children
          WHERE parent_run_id = $1 AND seq = $2 AND {state} IN ('failed', 'cancelled')
          ORDER BY idx LIMIT $3"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(seq)
        .bind(limit)
        .fetch_all(db)
        .await?)
}

/// Puts the failed children of a fan-out back to `running` (a resume of the parent retries
/// them), uncounting their failures; returns their run ids.
pub async fn retry_failed(conn: &mut PgConnection, (run_id, seq): (&str, i32)) -> Result<Vec<String>> {
    let ids: Vec<String> = sqlx::query_scalar(
        "UPDATE trailmark.children SET state = 'running', reason = NULL, ended_at = NULL
          WHERE parent_run_id = $1 AND seq = $2 AND state = 'failed' RETURNING run_id",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_all(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE trailmark.fan_outs SET failed = failed - $3, stopped_at = NULL
          WHERE run_id = $1 AND seq = $2",
    )
    .bind(run_id)
    .bind(seq)
    .bind(ids.len() as i32)
    .execute(conn)
    .await?;
    Ok(ids)
}

/// How the children of a fan-out stand, by state.
pub async fn summary(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<Option<ChildrenSummary>> {
    let row: Option<(i32, i32, i32, i32, i32, i32)> = sqlx::query_as(
        "SELECT count(*)::int4,
                (count(*) FILTER (WHERE state = 'pending'))::int4,
                (count(*) FILTER (WHERE state = 'running'))::int4,
                (count(*) FILTER (WHERE state = 'succeeded'))::int4,
                (count(*) FILTER (WHERE state IN ('failed', 'cancelled')))::int4,
                (count(*) FILTER (WHERE state = 'skipped'))::int4
           FROM trailmark.children WHERE parent_run_id = $1 AND seq = $2
         HAVING count(*) > 0",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(total, pending, running, succeeded, failed, skipped)| ChildrenSummary {
        total,
        pending,
        running,
        succeeded,
        failed,
        skipped,
    }))
}

/// A child as [`page`] reads it.
#[derive(sqlx::FromRow)]
struct ChildRow {
    idx: i32,
    run_id: String,
    workflow: String,
    state: String,
    output: Option<Value>,
    reason: Option<String>,
}

/// One page of a fan-out's children from index `from`, with each child's output once it
/// succeeded (read from its run).
pub async fn page(
    db: impl PgExecutor<'_>,
    (run_id, seq): (&str, i32),
    from: i32,
    limit: i64,
) -> Result<Vec<ChildResult>> {
    let rows: Vec<ChildRow> = sqlx::query_as(
        "SELECT c.idx, c.run_id, c.workflow, c.state,
                CASE WHEN c.state = 'succeeded' THEN r.output END AS output, c.reason
           FROM trailmark.children c LEFT JOIN trailmark.runs r ON r.run_id = c.run_id
          WHERE c.parent_run_id = $1 AND c.seq = $2 AND c.idx >= $3
          ORDER BY c.idx LIMIT $4",
    )
    .bind(run_id)
    .bind(seq)
    .bind(from)
    .bind(limit)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|c| ChildResult::new(c.idx, c.run_id, c.workflow, c.state, c.output, c.reason))
        .collect())
}

/// Stops a parent that waits at `seq` for review at that step (fence + 1, no lease), closing
/// its wait; `false` when it no longer waits there.
pub async fn stop_parent(
    conn: &mut PgConnection,
    (run_id, seq): (&str, i32),
    status: Transition,
    error: &str,
    note: &Value,
) -> Result<bool> {
    let done = sqlx::query(
        "WITH closed AS (
            UPDATE trailmark.waits SET resolved_at = now(), resolution = 'children_failed'
             WHERE run_id = $1 AND seq = $2 AND resolved_at IS NULL RETURNING run_id
         )
         UPDATE trailmark.runs r
            SET status = $3, fence = r.fence + 1, lease_owner = NULL, lease_expires_at = NULL,
                lease_pid = NULL, error = $4, handover = $5, updated_at = now()
           FROM closed c
          WHERE r.run_id = c.run_id AND r.status = 'waiting' AND r.step_seq = $2",
    )
    .bind(run_id)
    .bind(seq)
    .bind(status.to)
    .bind(error)
    .bind(note)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Moves a child that stopped for review back to `running` at the step that stopped it (fence
/// plus one; its attempts there reset only when `reset_attempts`, for a parent resumed after a
/// fix); returns its
/// workflow, version, step and position to queue, or `None` when it is not stopped for review.
pub async fn reopen_child(
    conn: &mut PgConnection,
    child: &str,
    reset_attempts: bool,
) -> Result<Option<(String, i32, StepAddress, i32)>> {
    let found: Option<(String, i32, StepAddress, i32)> = sqlx::query_as(
        "UPDATE trailmark.runs SET status = 'running', fence = fence + 1, lease_owner = NULL,
                lease_expires_at = NULL, lease_pid = NULL, error = NULL, handover = NULL,
                updated_at = now()
          WHERE run_id = $1 AND status = 'needs_review' AND step IS NOT NULL
         RETURNING workflow, workflow_version, step, step_seq",
    )
    .bind(child)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some((_, _, _, seq)) = found.as_ref().filter(|_| reset_attempts) {
        super::steps::reset_attempts(conn, child, *seq).await?;
    }
    Ok(found)
}

/// Moves a child that its own children's join stopped for review (past their threshold) back
/// to `waiting` at that join (fence + 1, no lease, its note cleared), for a resume of its
/// parent that reaches it; returns the join's position, or `None` when it is not stopped so.
pub async fn rewait_child(conn: &mut PgConnection, child: &str) -> Result<Option<i32>> {
    Ok(sqlx::query_scalar(
        "UPDATE trailmark.runs r SET status = 'waiting', fence = r.fence + 1, lease_owner = NULL,
                lease_expires_at = NULL, lease_pid = NULL, error = NULL, handover = NULL,
                updated_at = now()
          WHERE r.run_id = $1 AND r.status = 'needs_review'
            AND EXISTS (SELECT 1 FROM trailmark.fan_outs f
                         WHERE f.run_id = r.run_id AND f.seq = r.step_seq
                           AND f.stopped_at IS NOT NULL AND f.joined_at IS NULL)
         RETURNING r.step_seq",
    )
    .bind(child)
    .fetch_optional(conn)
    .await?)
}

/// Cancels every run below `run_id` (its children, theirs, ...) that has not ended, in the
/// caller's transaction (which holds `run_id`'s row): fence + 1, no lease, open waits closed;
/// their `children` rows become `cancelled` (started) or `skipped` (never started). With `seq`,
/// only the children of the fan-out at that position (and theirs). Returns the runs cancelled
/// (id, workflow, version, step, position), for their events.
pub async fn cancel_below(
    conn: &mut PgConnection,
    (run_id, seq): (&str, Option<i32>),
    reason: &str,
) -> Result<Vec<(String, String, i32, Option<StepAddress>, i32)>> {
    let cancelled: Vec<(String, String, i32, Option<StepAddress>, i32)> = sqlx::query_as(
        "WITH RECURSIVE below(run_id, depth) AS (
            SELECT r.run_id, 1 FROM trailmark.runs r WHERE r.parent_run_id = $1
               AND ($3::int4 IS NULL OR EXISTS (SELECT 1 FROM trailmark.children c
                                                 WHERE c.run_id = r.run_id AND c.seq = $3))
            UNION ALL
            SELECT r.run_id, b.depth + 1 FROM below b
              JOIN trailmark.runs r ON r.parent_run_id = b.run_id WHERE b.depth < 32
         ), closed AS (
            UPDATE trailmark.waits w SET resolved_at = now(), resolution = 'decision'
              FROM below b WHERE w.run_id = b.run_id AND w.resolved_at IS NULL
         )
         UPDATE trailmark.runs r
            SET status = 'cancelled', fence = r.fence + 1, lease_owner = NULL,
                lease_expires_at = NULL, lease_pid = NULL, updated_at = now(),
                finished_at = now(), error = $2
           FROM below b
          WHERE r.run_id = b.run_id
            AND r.status IN ('running', 'waiting', 'needs_review', 'compensating')
         RETURNING r.run_id, r.workflow, r.workflow_version, r.step, r.step_seq",
    )
    .bind(run_id)
    .bind(reason)
    .bind(seq)
    .fetch_all(&mut *conn)
    .await?;
    sqlx::query(
        "WITH RECURSIVE fan(run_id, depth) AS (
            SELECT $1::text, 0
            UNION ALL
            SELECT c.run_id, f.depth + 1 FROM fan f
              JOIN trailmark.children c ON c.parent_run_id = f.run_id
             WHERE f.depth < 32 AND (f.depth > 0 OR $3::int4 IS NULL OR c.seq = $3)
         )
         UPDATE trailmark.children c
            SET state = CASE c.state WHEN 'pending' THEN 'skipped' ELSE 'cancelled' END,
                reason = $2, ended_at = now()
           FROM fan f
          WHERE c.parent_run_id = f.run_id AND c.state IN ('pending', 'running')
            AND (f.depth > 0 OR $3::int4 IS NULL OR c.seq = $3)",
    )
    .bind(run_id)
    .bind(reason)
    .bind(seq)
    .execute(conn)
    .await?;
    Ok(cancelled)
}

/// The started children of `run_id` (every fan-out of it) with their runs' statuses and the
/// position of the fan-out that started each, in the order an undo reaches them: newest
/// fan-out first, then by index.
pub async fn started(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<(String, RunStatus, i32)>> {
    Ok(sqlx::query_as(
        "SELECT c.run_id, r.status, c.seq FROM trailmark.children c
           JOIN trailmark.runs r ON r.run_id = c.run_id
          WHERE c.parent_run_id = $1
          ORDER BY c.seq DESC, c.idx",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// A run's place among runs started by steps: the run that started it, and the fan-outs its
/// own steps started, each with its children counted by state.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Family {
    /// The run whose step started this one (a child run).
    pub parent: Option<String>,
    /// The fan-outs of its steps, in position order.
    pub fan_outs: Vec<FanOutView>,
}

/// One fan-out as a run's views show it.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct FanOutView {
    /// The position of the step that started the children.
    pub seq: i32,
    /// `all`, or `first N`.
    pub join: String,
    /// Failures allowed before the run stops for review.
    pub max_failures: i32,
    /// Children running at once at most.
    pub max_in_flight: i32,
    /// When the join held and the run went on.
    pub joined_at: Option<chrono::DateTime<chrono::Utc>>,
    /// When the run stopped for review past the threshold (cleared by a resume).
    pub stopped_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The children by state.
    pub children: ChildrenSummary,
}

/// A fan-out as [`family`] reads it.
#[derive(sqlx::FromRow)]
struct FanOutCounts {
    seq: i32,
    join: String,
    max_failures: i32,
    max_in_flight: i32,
    joined_at: Option<chrono::DateTime<chrono::Utc>>,
    stopped_at: Option<chrono::DateTime<chrono::Utc>>,
    total: i32,
    pending: i32,
    running: i32,
    succeeded: i32,
    failed: i32,
    skipped: i32,
}

impl From<FanOutCounts> for FanOutView {
    fn from(f: FanOutCounts) -> Self {
        Self {
            seq: f.seq,
            join: f.join,
            max_failures: f.max_failures,
            max_in_flight: f.max_in_flight,
            joined_at: f.joined_at,
            stopped_at: f.stopped_at,
            children: ChildrenSummary {
                total: f.total,
                pending: f.pending,
                running: f.running,
                succeeded: f.succeeded,
                failed: f.failed,
                skipped: f.skipped,
            },
        }
    }
}

/// The family of `run_id` (see [`Family`]).
pub async fn family(db: &sqlx::PgPool, run_id: &str) -> Result<Family> {
    let parent: Option<Option<String>> =
        sqlx::query_scalar("SELECT parent_run_id FROM trailmark.runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(db)
            .await?;
    let fan_outs: Vec<FanOutCounts> = sqlx::query_as(
        "SELECT f.seq, COALESCE('first ' || f.first_n, 'all') AS join, f.max_failures,
                f.max_in_flight, f.joined_at, f.stopped_at, f.total,
                (count(*) FILTER (WHERE c.state = 'pending'))::int4 AS pending,
                (count(*) FILTER (WHERE c.state = 'running'))::int4 AS running,
                (count(*) FILTER (WHERE c.state = 'succeeded'))::int4 AS succeeded,
                (count(*) FILTER (WHERE c.state IN ('failed', 'cancelled')))::int4 AS failed,
                (count(*) FILTER (WHERE c.state = 'skipped'))::int4 AS skipped
           FROM trailmark.fan_outs f
           LEFT JOIN trailmark.children c ON c.parent_run_id = f.run_id AND c.seq = f.seq
          WHERE f.run_id = $1
          GROUP BY f.run_id, f.seq ORDER BY f.seq",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?;
    Ok(Family {
        parent: parent.flatten(),
        fan_outs: fan_outs.into_iter().map(FanOutView::from).collect(),
    })
}

/// Locks `run_id`'s row and, before it, the rows of the runs above it (its parent, theirs, ...),
/// top down, for the caller's transaction: the one lock order of a family, for a transaction
/// whose child ending may move the runs above (an undo join that stops a child for review
/// counts it in its own parent).
pub async fn lock_line(conn: &mut PgConnection, run_id: &str) -> Result<()> {
    sqlx::query(
        "WITH RECURSIVE up(run_id, depth) AS (
            SELECT $1::text, 0
            UNION ALL
            SELECT r.parent_run_id, u.depth + 1 FROM up u
              JOIN trailmark.runs r ON r.run_id = u.run_id
             WHERE r.parent_run_id IS NOT NULL AND u.depth < 32
         )
         SELECT r.run_id FROM trailmark.runs r JOIN up u ON u.run_id = r.run_id
          ORDER BY u.depth DESC FOR UPDATE OF r",
    )
    .bind(run_id)
    .fetch_all(conn)
    .await?;
    Ok(())
}

/// The positions of `run_id`'s fan-outs that started children, newest first: where an undo of
/// the run undoes children.
pub async fn fan_out_positions(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<i32>> {
    Ok(sqlx::query_scalar(
        "SELECT seq FROM trailmark.fan_outs WHERE run_id = $1 AND started > 0 ORDER BY seq DESC",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// Forgets every earlier undo of `run_id`'s fan-outs (an undo decided now starts each of them
/// afresh when the run reaches it).
pub async fn clear_undo(conn: &mut PgConnection, run_id: &str) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.fan_outs SET undo_seq = NULL, undo_total = 0, undone = 0, undo_failed = 0,
                undo_joined_at = NULL, undo_stopped_at = NULL
          WHERE run_id = $1 AND undo_seq IS NOT NULL",
    )
    .bind(run_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE trailmark.children SET undo_state = NULL, undo_reason = NULL
          WHERE parent_run_id = $1 AND undo_state IS NOT NULL",
    )
    .bind(run_id)
    .execute(conn)
    .await?;
    Ok(())
}

/// A fan-out's undo join and counters, as the undo join reads them.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct UndoRow {
    /// The parent run.
    pub run_id: String,
    /// The position of the step that started the children.
    pub seq: i32,
    /// The parent's position that waits for their undo (`None`: not started).
    pub undo_seq: Option<i32>,
    /// Children the undo covers.
    pub undo_total: i32,
    /// Children compensated.
    pub undone: i32,
    /// Children whose undo stopped (review, failure, cancel).
    pub undo_failed: i32,
    /// Whether the undo join held (the parent went on).
    pub joined: bool,
}

const UNDO_ROW: &str = "SELECT run_id, seq, undo_seq, undo_total, undone, undo_failed,
        undo_joined_at IS NOT NULL AS joined FROM trailmark.fan_outs";

/// The undo of the fan-out at `seq` of `run_id`, if that step started children.
pub async fn undo_of(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<Option<UndoRow>> {
    let sql = format!("{UNDO_ROW} WHERE run_id = $1 AND seq = $2");
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(seq)
        .fetch_optional(db)
        .await?)
}

/// A started child of a fan-out, as an undo reaching that fan-out finds it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ToUndo {
    /// Its run id.
    pub run_id: String,
    /// Its status.
    pub status: RunStatus,
    /// Its workflow.
    pub workflow: String,
    /// The version it runs on.
    pub workflow_version: i32,
    /// The plan the parent's undo decision installed on it.
    pub undo: Option<sqlx::types::Json<UndoPlan>>,
}

/// The started children of the fan-out at `seq` of `run_id`, their rows locked (after the
/// parent's, which the caller holds), lowest index first.
pub async fn to_undo(conn: &mut PgConnection, (run_id, seq): (&str, i32)) -> Result<Vec<ToUndo>> {
    Ok(sqlx::query_as(
        "SELECT r.run_id, r.status, r.workflow, r.workflow_version, r.undo
           FROM trailmark.children c JOIN trailmark.runs r ON r.run_id = c.run_id
          WHERE c.parent_run_id = $1 AND c.seq = $2 AND c.state NOT IN ('pending', 'skipped')
          ORDER BY c.idx FOR UPDATE OF r",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_all(conn)
    .await?)
}

/// Moves a child into its parent's undo: to `compensating` at `step`, at its next free
/// position, or straight to `compensated` when it has nothing to compensate (fence + 1, no
/// lease, its note cleared: the parent's undo decision keeps it). Returns that position.
pub async fn begin_undo(
    conn: &mut PgConnection,
    child: &str,
    status: Transition,
    step: Option<&StepAddress>,
) -> Result<i32> {
    Ok(sqlx::query_scalar(
        "UPDATE trailmark.runs
            SET status = $2, step = COALESCE($3, step),
                step_seq = (SELECT COALESCE(max(seq), -1) + 1 FROM trailmark.steps WHERE run_id = $1),
                fence = fence + 1, lease_owner = NULL, lease_expires_at = NULL, lease_pid = NULL,
                error = NULL, handover = NULL, updated_at = now(),
                finished_at = CASE WHEN $4 THEN now() END
          WHERE run_id = $1 RETURNING step_seq",
    )
    .bind(child)
    .bind(status.to)
    .bind(step)
    .bind(status.to.is_terminal())
    .fetch_one(conn)
    .await?)
}

/// A child's part in its parent's undo when it starts: `compensating`, `compensated`, or
/// `failed` with why.
#[derive(Debug, Clone)]
pub struct UndoPart {
    /// The child.
    pub run_id: String,
    /// Its undo state.
    pub state: &'static str,
    /// Why it failed.
    pub reason: Option<String>,
}

/// Records that the undo of the fan-out at `seq` of `run_id` started, its parent waiting at
/// `undo_seq`: each child's part, and the counters from them. Returns the undo as it stands.
pub async fn undo_started(
    conn: &mut PgConnection,
    (run_id, seq): (&str, i32),
    undo_seq: i32,
    parts: &[UndoPart],
) -> Result<UndoRow> {
    sqlx::query(
        "UPDATE trailmark.children c SET undo_state = p.state, undo_reason = p.reason
           FROM UNNEST($1::text[], $2::text[], $3::text[]) AS p(run_id, state, reason)
          WHERE c.run_id = p.run_id",
    )
    .bind(parts.iter().map(|p| p.run_id.as_str()).collect::<Vec<_>>())
    .bind(parts.iter().map(|p| p.state).collect::<Vec<_>>())
    .bind(parts.iter().map(|p| p.reason.as_deref()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    let count = |state: &str| parts.iter().filter(|p| p.state == state).count() as i32;
    let sql = format!(
        "WITH f AS (
            UPDATE trailmark.fan_outs SET undo_seq = $3, undo_total = $4, undone = $5,
                   undo_failed = $6, undo_joined_at = NULL, undo_stopped_at = NULL
             WHERE run_id = $1 AND seq = $2 RETURNING *
         ) {}",
        UNDO_ROW.replace("trailmark.fan_outs", "f")
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(seq)
        .bind(undo_seq)
        .bind(parts.len() as i32)
        .bind(count("compensated"))
        .bind(count("failed"))
        .fetch_one(conn)
        .await?)
}

/// The parent waits again at `undo_seq` for an undo of the fan-out at `seq` that started
/// before (it was stopped for review, and resumed): the counters stand as the children left
/// them. Returns the undo as it stands.
pub async fn undo_again(
    conn: &mut PgConnection,
    (run_id, seq): (&str, i32),
    undo_seq: i32,
) -> Result<Option<UndoRow>> {
    let sql = format!(
        "WITH f AS (
            UPDATE trailmark.fan_outs SET undo_seq = $3, undo_stopped_at = NULL
             WHERE run_id = $1 AND seq = $2 RETURNING *
         ) {}",
        UNDO_ROW.replace("trailmark.fan_outs", "f")
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(seq)
        .bind(undo_seq)
        .fetch_optional(conn)
        .await?)
}

/// Records how a child's part in its parent's undo ended (`compensated`, `failed` or
/// `cancelled`, with why) and counts it; returns the undo as it now stands, or `None` when the
/// child is in no undo of its parent. A child that stopped before (then resumed by a person and
/// compensated) is counted again under its new state, never twice.
pub async fn undo_ended(
    conn: &mut PgConnection,
    child: &str,
    state: &str,
    reason: Option<&str>,
) -> Result<Option<UndoRow>> {
    let sql = format!(
        "WITH was AS (
            SELECT undo_state FROM trailmark.children WHERE run_id = $1 FOR UPDATE
         ), c AS (
            UPDATE trailmark.children c SET undo_state = $2, undo_reason = $3
              FROM was WHERE c.run_id = $1
               AND was.undo_state IN ('compensating', 'failed', 'cancelled')
            RETURNING c.parent_run_id, c.seq, was.undo_state AS was
         ), f AS (
            UPDATE trailmark.fan_outs f
               SET undone = f.undone + ($2 = 'compensated')::int,
                   undo_failed = f.undo_failed + ($2 <> 'compensated')::int
                                 - (c.was <> 'compensating')::int
              FROM c WHERE f.run_id = c.parent_run_id AND f.seq = c.seq
            RETURNING f.*
         ) {}",
        UNDO_ROW.replace("trailmark.fan_outs", "f")
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(child)
        .bind(state)
        .bind(reason)
        .fetch_optional(conn)
        .await?)
}


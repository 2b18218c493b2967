//! The `runs` table: creation, lease claim and heartbeat, listing (the fenced advance is part
//! of the step commit, `checkpoint`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;
use crate::domain::{Fence, MessageId, RunId, RunStatus};

/// A run as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct RunRow {
    /// Run id.
    pub run_id: String,
    /// Workflow name.
    pub workflow: String,
    /// Workflow version.
    pub workflow_version: i32,
    /// Status name (see [`RunStatus`]).
    pub status: String,
    /// The step to run next.
    pub step: Option<String>,
    /// Position of the next step.
    pub step_seq: i32,
    /// Input given at start.
    pub input: Value,
    /// Final output.
    pub output: Option<Value>,
    /// Last error or handover reason.
    pub error: Option<String>,
    /// The handover note while the run needs review (or what a person must decide while waiting).
    pub handover: Option<Value>,
    /// The undo plan, once an undo was decided.
    pub undo: Option<Value>,
    /// Worker holding the lease.
    pub lease_owner: Option<String>,
    /// Backend pid of the holder's presence connection.
    pub lease_pid: Option<i32>,
    /// Lease expiry (database clock).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Current fencing token.
    pub fence: i64,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// Finished.
    pub finished_at: Option<DateTime<Utc>>,
}

impl RunRow {
    /// The parsed status; an unknown name (newer schema) counts as failed.
    pub fn status(&self) -> RunStatus {
        self.status.parse().unwrap_or(RunStatus::Failed)
    }
}

/// A new run; the first step is queued by the caller in the same transaction.
pub struct NewRun<'a> {
    /// Id.
    pub run_id: &'a RunId,
    /// Workflow name.
    pub workflow: &'a str,
    /// Workflow version.
    pub version: i32,
    /// First step.
    pub first_step: &'a str,
    /// Input.
    pub input: &'a Value,
}

/// Inserts the run unless it exists; returns whether it was created.
pub async fn insert(db: impl PgExecutor<'_>, run: &NewRun<'_>) -> Result<bool> {
    let done = sqlx::query(
        "INSERT INTO trailmark.runs (run_id, workflow, workflow_version, status, step, input)
         VALUES ($1, $2, $3, 'running', $4, $5) ON CONFLICT (run_id) DO NOTHING",
    )
    .bind(run.run_id.as_str())
    .bind(run.workflow)
    .bind(run.version)
    .bind(run.first_step)
    .bind(run.input)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Reads one run.
pub async fn get(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<RunRow>> {
    Ok(
        sqlx::query_as("SELECT * FROM trailmark.runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(db)
            .await?,
    )
}

/// Lists runs, newest first, optionally by status.
pub async fn list(
    db: impl PgExecutor<'_>,
    status: Option<RunStatus>,
    limit: i64,
) -> Result<Vec<RunRow>> {
    Ok(sqlx::query_as(
        "SELECT * FROM trailmark.runs WHERE ($1::text IS NULL OR status = $1)
         ORDER BY created_at DESC, run_id LIMIT $2",
    )
    .bind(status.map(RunStatus::as_str))
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// What a successful lease claim hands the worker.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The new fencing token.
    pub fence: Fence,
    /// Status at claim time (running or compensating).
    pub status: String,
    /// Run input.
    pub input: Value,
    /// Seconds since the run was created (database clock), for the run's hard timeout.
    pub age_secs: f64,
    /// The undo plan while compensating.
    pub undo: Option<Value>,
    /// Which attempt at this position this is (1-based, counted across crashes).
    pub attempt: i32,
    /// Journal entries already recorded at this position (a replay reads them back).
    pub journaled: i32,
}

/// A worker asking for a run's lease to execute one step delivery.
pub struct ClaimRequest<'a> {
    /// The run.
    pub run_id: &'a RunId,
    /// The position the delivery is for.
    pub seq: i32,
    /// The step name (for the attempt row).
    pub step: &'a str,
    /// Who asks (worker id and delivery).
    pub owner: &'a str,
    /// Lease length.
    pub lease_secs: f64,
    /// Backend pid of the asker's presence connection.
    pub presence_pid: Option<i32>,
    /// The inbox consumer and the delivery's message id: a processed message is never claimed.
    pub message: (&'a str, MessageId),
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimOutcome {
    /// The message was processed before: drop it.
    Duplicate,
    /// Not claimable: the run is not at that step, not executable, or leased by a live worker.
    Refused,
    /// The lease is ours.
    Claimed(Claim),
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    seen: bool,
    fence: Option<i64>,
    status: Option<String>,
    input: Option<Value>,
    age_secs: Option<f64>,
    undo: Option<Value>,
    attempts: Option<i32>,
    journaled: i32,
}

/// Checks the inbox, takes the lease of `run_id` at position `seq` if it is free, expired, or
/// already `owner`'s (a delivery retried in place after an infrastructure failure), raises the
/// fence and counts the attempt: one statement, committed before any outside call is made.
pub async fn claim(db: impl PgExecutor<'_>, r: &ClaimRequest<'_>) -> Result<ClaimOutcome> {
    // A lease is free when released, expired, ours, or held by a process whose presence
    // connection is gone (it died: kill -9 closes its sockets, so Postgres ends its backend).
    let row: ClaimRow = sqlx::query_as(
        "WITH seen AS (
            SELECT 1 FROM trailmark.inbox WHERE consumer = $7 AND message_id = $8
         ), claimed AS (
            UPDATE trailmark.runs
               SET lease_owner = $3, lease_expires_at = now() + make_interval(secs => $4),
                   lease_pid = $5, fence = fence + 1, updated_at = now()
             WHERE run_id = $1 AND step_seq = $2 AND status IN ('running', 'compensating')
               AND NOT EXISTS (SELECT 1 FROM seen)
               AND (lease_owner IS NULL OR lease_expires_at < now() OR lease_owner = $3
                    OR trailmark.process_gone(lease_pid))
            RETURNING fence, status, input, EXTRACT(EPOCH FROM now() - created_at)::float8 AS age_secs, undo
         ), attempt AS (
            INSERT INTO trailmark.steps (run_id, seq, step, attempts) SELECT $1, $2, $6, 1 FROM claimed
            ON CONFLICT (run_id, seq) DO UPDATE SET attempts = trailmark.steps.attempts + 1
            RETURNING attempts
         )
         SELECT EXISTS (SELECT 1 FROM seen) AS seen, c.fence, c.status, c.input, c.age_secs, c.undo,
                a.attempts,
                (SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND seq = $2)::int4 AS journaled
           FROM (SELECT 1) AS one LEFT JOIN claimed c ON true LEFT JOIN attempt a ON true",
    )
    .bind(r.run_id.as_str())
    .bind(r.seq)
    .bind(r.owner)
    .bind(r.lease_secs)
    .bind(r.presence_pid)
    .bind(r.step)
    .bind(r.message.0)
    .bind(r.message.1.0)
    .fetch_one(db)
    .await?;
    if row.seen {
        return Ok(ClaimOutcome::Duplicate);
    }
    let (Some(fence), Some(status), Some(input), Some(age_secs), Some(attempt)) =
        (row.fence, row.status, row.input, row.age_secs, row.attempts)
    else {
        return Ok(ClaimOutcome::Refused);
    };
    Ok(ClaimOutcome::Claimed(Claim {
        fence: Fence(fence),
        status,
        input,
        age_secs,
        undo: row.undo,
        attempt,
        journaled: row.journaled,
    }))
}

/// Extends a held lease and re-stamps the holder's presence pid (the presence connection may
/// have been re-opened since the claim, and a lease naming a gone backend is free to take);
/// `false` means the fence moved on (the caller must stop).
pub async fn heartbeat(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    fence: Fence,
    lease_secs: f64,
    presence_pid: Option<i32>,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE trailmark.runs SET lease_expires_at = now() + make_interval(secs => $3), lease_pid = $4
          WHERE run_id = $1 AND fence = $2 AND lease_owner IS NOT NULL",
    )
    .bind(run_id.as_str())
    .bind(fence.0)
    .bind(lease_secs)
    .bind(presence_pid)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Stores the undo plan its compensation steps read (targets, scope, writes left standing).
pub async fn set_undo_plan(db: impl PgExecutor<'_>, run_id: &str, plan: &Value) -> Result<()> {
    sqlx::query("UPDATE trailmark.runs SET undo = $2 WHERE run_id = $1")
        .bind(run_id)
        .bind(plan)
        .execute(db)
        .await?;
    Ok(())
}

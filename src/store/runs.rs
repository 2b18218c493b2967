//! The `runs` table: creation, lease claim and heartbeat, fenced advance, listing.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::{Error, Result};
use crate::domain::{Fence, RunId, RunStatus};

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
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Claim {
    /// The new fencing token, raw (see [`Claim::fence`]).
    #[sqlx(rename = "fence")]
    pub fence_raw: i64,
    /// Status at claim time (running or compensating).
    pub status: String,
    /// Run input.
    pub input: Value,
    /// Seconds since the run was created (database clock), for the run's hard timeout.
    pub age_secs: f64,
    /// The undo plan while compensating.
    pub undo: Option<Value>,
}

impl Claim {
    /// The new fencing token.
    pub fn fence(&self) -> Fence {
        Fence(self.fence_raw)
    }
}

/// Takes the lease of `run_id` at position `seq` if it is free, expired, or already `owner`'s
/// (a delivery retried in place after an infrastructure failure), raising the fence.
/// Returns `None` when the run is not at that step, not executable, or leased by a live worker.
pub async fn claim(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    seq: i32,
    owner: &str,
    lease_secs: f64,
    presence_pid: Option<i32>,
) -> Result<Option<Claim>> {
    // A lease is free when released, expired, ours, or held by a process whose presence
    // connection is gone (it died: kill -9 closes its sockets, so Postgres ends its backend).
    Ok(sqlx::query_as(
        "UPDATE trailmark.runs
            SET lease_owner = $3, lease_expires_at = now() + make_interval(secs => $4),
                lease_pid = $5, fence = fence + 1, updated_at = now()
          WHERE run_id = $1 AND step_seq = $2 AND status IN ('running', 'compensating')
            AND (lease_owner IS NULL OR lease_expires_at < now() OR lease_owner = $3
                 OR (lease_pid IS NOT NULL
                     AND NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = lease_pid)))
      RETURNING fence, status, input, EXTRACT(EPOCH FROM now() - created_at)::float8 AS age_secs, undo",
    )
    .bind(run_id.as_str())
    .bind(seq)
    .bind(owner)
    .bind(lease_secs)
    .bind(presence_pid)
    .fetch_optional(db)
    .await?)
}

/// Extends a held lease; `false` means the fence moved on (the caller must stop).
pub async fn heartbeat(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    fence: Fence,
    lease_secs: f64,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE trailmark.runs SET lease_expires_at = now() + make_interval(secs => $3)
          WHERE run_id = $1 AND fence = $2 AND lease_owner IS NOT NULL",
    )
    .bind(run_id.as_str())
    .bind(fence.0)
    .bind(lease_secs)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Where a committed step leaves the run.
pub struct Advance<'a> {
    /// Position just executed.
    pub seq: i32,
    /// Next step name, `None` when the run ends.
    pub next_step: Option<&'a str>,
    /// New status.
    pub status: RunStatus,
    /// Final output, when the run ends.
    pub output: Option<&'a Value>,
    /// Error text for review/failed states.
    pub error: Option<&'a str>,
    /// Handover note, when the run goes to a person.
    pub handover: Option<&'a Value>,
}

/// Moves the run past `seq` and releases the lease, only while `fence` is current.
pub async fn advance(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    fence: Fence,
    to: &Advance<'_>,
) -> Result<()> {
    let done = sqlx::query(
        "UPDATE trailmark.runs
            SET step_seq = step_seq + CASE WHEN $4 IN ('running', 'compensating', 'succeeded', 'compensated') THEN 1 ELSE 0 END,
                step = $3, status = $4, output = COALESCE($5, output), error = $6, handover = $8,
                lease_owner = NULL, lease_expires_at = NULL, updated_at = now(),
                finished_at = CASE WHEN $4 IN ('succeeded', 'compensated', 'failed', 'cancelled') THEN now() END
          WHERE run_id = $1 AND fence = $2 AND step_seq = $7",
    )
    .bind(run_id.as_str())
    .bind(fence.0)
    .bind(to.next_step)
    .bind(to.status.as_str())
    .bind(to.output)
    .bind(to.error)
    .bind(to.seq)
    .bind(to.handover)
    .execute(db)
    .await?;
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(Error::FencedOut {
            run_id: run_id.to_string(),
            fence: fence.0,
        })
    }
}

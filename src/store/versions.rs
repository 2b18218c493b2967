//! Which workflow versions the runs in flight are pinned to, and the fenced move of runs from
//! one version to another: what `trailmark workflow versions` counts and what `trailmark
//! workflow move` changes (docs/OPERATIONS.md, "Workflow versions").
//!
//! Every read here starts from the runs in flight, through the status index
//! (`runs_status_workflow_idx`, `(status, workflow)`), so its cost grows with the runs that have
//! not ended, never with the millions kept after they ended; the version and the creation time
//! are read from those rows. No index of its own: one on `workflow_version` would serve only
//! these operator commands and be written by every run start.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::domain::{RunStatus, StepAddress, UndoPlan};

/// The statuses of runs in flight, written into the statements: as a parameter of a generic
/// plan the planner cannot tell how few rows they hold (see `runs::counts_of`).
const IN_FLIGHT: &str = "('running', 'waiting', 'needs_review', 'compensating')";

/// The statuses in which a run holds no step message: the only ones a move touches.
const AT_REST: &str = "('needs_review', 'waiting')";

/// The runs in flight of one workflow version in one status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct InFlight {
    /// The workflow.
    pub workflow: String,
    /// The version its runs are pinned to.
    pub version: i32,
    /// Their status (one that has not ended).
    pub status: RunStatus,
    /// How many.
    pub runs: i64,
    /// When the oldest of them started.
    pub oldest: DateTime<Utc>,
}

/// The runs in flight by workflow, version and status, with the oldest start of each group:
/// what tells an operator whether a version can leave the code.
pub async fn in_flight(db: impl PgExecutor<'_>) -> Result<Vec<InFlight>> {
    let sql = format!(
        "SELECT workflow, workflow_version AS version, status, count(*) AS runs,
                min(created_at) AS oldest
           FROM trailmark.runs WHERE status IN {IN_FLIGHT}
          GROUP BY workflow, workflow_version, status
          ORDER BY workflow, workflow_version, status"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(db)
        .await?)
}

/// A run in flight of the version a move starts from, with what it waits for: what decides
/// whether it can move and which steps the target version must declare.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Candidate {
    /// The run.
    pub run_id: String,
    /// Its status (one that has not ended).
    pub status: RunStatus,
    /// The step it stopped at, waits at or runs.
    pub step: Option<StepAddress>,
    /// That step's position.
    pub step_seq: i32,
    /// When it started.
    pub created_at: DateTime<Utc>,
    /// Its undo plan, while it compensates.
    pub undo: Option<Json<UndoPlan>>,
    /// `event`, `sleep` or `children` while it waits for one (`None`: it waits for a person,
    /// or does not wait).
    pub wait_kind: Option<String>,
    /// Where it goes on when the event comes or the sleep ends.
    pub next_step: Option<StepAddress>,
    /// Where an event wait's timeout sends it.
    pub on_timeout: Option<StepAddress>,
}

/// What [`candidates`] and [`lock_at_rest`] read: the run and its open wait at its position.
const CANDIDATE: &str = "SELECT r.run_id, r.status, r.step, r.step_seq, r.created_at, r.undo,
        w.kind AS wait_kind, w.next_step, w.on_timeout
   FROM trailmark.runs r
   LEFT JOIN trailmark.waits w ON w.run_id = r.run_id AND w.seq = r.step_seq
                              AND w.resolved_at IS NULL
  WHERE r.workflow = $1 AND r.workflow_version = $2";

/// The runs in flight of `workflow` at `version`, by run id; only those of `only` when given
/// (read by primary key then).
pub async fn candidates(
    db: impl PgExecutor<'_>,
    (workflow, version): (&str, i32),
    only: Option<&[String]>,
) -> Result<Vec<Candidate>> {
    let which = match only {
        Some(_) => "AND r.run_id = ANY($3)",
        None => "",
    };
    let sql = format!("{CANDIDATE} AND r.status IN {IN_FLIGHT} {which} ORDER BY r.run_id");
    let query = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(workflow)
        .bind(version);
    let query = match only {
        Some(ids) => query.bind(ids),
        None => query,
    };
    Ok(query.fetch_all(db).await?)
}

/// Of `ids`, the runs still at `version` of `workflow` and at rest (stopped for review or
/// waiting: no step message in flight), their rows locked until the caller's transaction ends.
/// A run another transaction holds (a worker's wake-up, a decision) is skipped, not waited for,
/// so a move of many runs never deadlocks with the family lock order of decisions.
pub async fn lock_at_rest(
    conn: &mut PgConnection,
    (workflow, version): (&str, i32),
    ids: &[String],
) -> Result<Vec<Candidate>> {
    let sql = format!(
        "{CANDIDATE} AND r.status IN {AT_REST} AND r.run_id = ANY($3)
          ORDER BY r.run_id FOR UPDATE OF r SKIP LOCKED"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(workflow)
        .bind(version)
        .bind(ids)
        .fetch_all(conn)
        .await?)
}

/// Moves the runs of `ids` from version `from` to `to` of `workflow`, but only those still at
/// `from` and at rest: a run that started a step meanwhile keeps its version. The fence rises
/// as with every decision; the run's status, step and open wait stay as they are. Returns the
/// ids moved.
pub async fn set_version(
    db: impl PgExecutor<'_>,
    workflow: &str,
    (from, to): (i32, i32),
    ids: &[String],
) -> Result<Vec<String>> {
    let sql = format!(
        "UPDATE trailmark.runs SET workflow_version = $3, fence = fence + 1, updated_at = now()
          WHERE run_id = ANY($4) AND workflow = $1 AND workflow_version = $2
            AND status IN {AT_REST}
         RETURNING run_id"
    );
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(workflow)
        .bind(from)
        .bind(to)
        .bind(ids)
        .fetch_all(db)
        .await?)
}

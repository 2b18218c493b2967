//! Forks: runs started from another run's checkpoint at a position, and their lineage.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::domain::{RunStatus, StepAddress};

/// A fork as its lineage shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct ForkRow {
    /// The fork.
    pub run_id: String,
    /// The run it was forked from.
    pub parent_run_id: String,
    /// The first position the fork ran itself (positions before it were taken over).
    pub from_seq: i32,
    /// The step at that position.
    pub from_step: String,
    /// Whether the fork recorded its outside writes instead of making them.
    pub shadow: bool,
    /// Who forked it.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// When.
    pub created_at: DateTime<Utc>,
}

/// Where a run comes from and what was forked from it.
#[derive(Debug, Clone, Default, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Lineage {
    /// The fork record of this run, when it is a fork.
    pub parent: Option<ForkRow>,
    /// Forks of this run, oldest first.
    pub children: Vec<ForkRow>,
}

impl Lineage {
    /// Whether the run has neither parent nor children.
    pub fn is_empty(&self) -> bool {
        self.parent.is_none() && self.children.is_empty()
    }
}

/// The new run a fork creates, at `from_seq` on `from_step`.
pub struct NewFork<'a> {
    /// The fork's id.
    pub run_id: &'a str,
    /// The parent.
    pub parent_run_id: &'a str,
    /// Workflow name.
    pub workflow: &'a str,
    /// The deployed version the fork follows.
    pub version: i32,
    /// The first position it runs.
    pub from_seq: i32,
    /// The step at that position.
    pub from_step: &'a StepAddress,
    /// Its input (the parent's, or a new one).
    pub input: &'a Value,
    /// Shadow mode.
    pub shadow: bool,
    /// Who.
    pub actor: &'a str,
    /// Why.
    pub reason: &'a str,
    /// A run whose journaled answers from `from_seq` on are replayed instead of asked again.
    pub answers_from: Option<&'a str>,
}

/// Creates the fork: its run row, its lineage row, and the parent's steps, journal entries and
/// parked items before `from_seq`, in the caller's transaction. `false` when a run with that id exists.
pub async fn create(tx: &mut PgConnection, f: &NewFork<'_>) -> Result<bool> {
    let made = sqlx::query(
        "INSERT INTO trailmark.runs (run_id, workflow, workflow_version, status, step, step_seq,
                                     input, shadow)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (run_id) DO NOTHING",
    )
    .bind(f.run_id)
    .bind(f.workflow)
    .bind(f.version)
    .bind(RunStatus::Running)
    .bind(f.from_step)
    .bind(f.from_seq)
    .bind(f.input)
    .bind(f.shadow)
    .execute(&mut *tx)
    .await?;
    if made.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query(
        "INSERT INTO trailmark.forks (run_id, parent_run_id, from_seq, from_step, actor, reason)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(f.run_id)
    .bind(f.parent_run_id)
    .bind(f.from_seq)
    .bind(f.from_step)
    .bind(f.actor)
    .bind(f.reason)
    .execute(&mut *tx)
    .await?;
    // One statement takes over the parent's checkpoint before the fork point: its steps, its
    // journaled answers (each marked with the run that paid for it), its parked items; and, with
    // `answers_from`, that run's answers from the fork point on, for the fork to replay.
    sqlx::query(
        "WITH steps AS (
            INSERT INTO trailmark.steps (run_id, seq, step, attempts, output, started_at, finished_at)
            SELECT $1, seq, step, attempts, output, started_at, finished_at
              FROM trailmark.steps WHERE run_id = $2 AND seq < $3
         ), answers AS (
            INSERT INTO trailmark.journal (run_id, seq, call_no, kind, request_hash, response,
                                           tokens, cost, latency_ms, created_at, inherited_from)
            SELECT $1, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms,
                   created_at, run_id
              FROM trailmark.journal
             WHERE (run_id = $2 AND seq < $3) OR (run_id = $4 AND seq >= $3)
         )
         INSERT INTO trailmark.parked (run_id, item, seq, step, reason, created_at)
         SELECT $1, item, seq, step, reason, created_at
           FROM trailmark.parked WHERE run_id = $2 AND seq < $3",
    )
    .bind(f.run_id)
    .bind(f.parent_run_id)
    .bind(f.from_seq)
    .bind(f.answers_from)
    .execute(&mut *tx)
    .await?;
    Ok(true)
}

/// The run's lineage.
pub async fn lineage(db: &sqlx::PgPool, run_id: &str) -> Result<Lineage> {
    let parent = parent(db, run_id).await?;
    let children = sqlx::query_as(
        "SELECT f.*, r.shadow FROM trailmark.forks f JOIN trailmark.runs r USING (run_id)
          WHERE f.parent_run_id = $1 ORDER BY f.created_at, f.run_id",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?;
    Ok(Lineage { parent, children })
}

/// The fork record of a run, if it is a fork.
pub async fn parent(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<ForkRow>> {
    Ok(sqlx::query_as(
        "SELECT f.*, r.shadow FROM trailmark.forks f JOIN trailmark.runs r USING (run_id)
              WHERE f.run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(db)
    .await?)
}

/// What a fork at `from_seq` would take over from its parent.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Prefix {
    /// The step the parent ran at `from_seq` (`None`: the parent never reached it).
    pub step_at: Option<StepAddress>,
    /// The first position before `from_seq` without a checkpoint, if any.
    pub unfinished: Option<i32>,
    /// Positions the parent has.
    pub positions: i64,
    /// Journal entries before `from_seq`.
    pub answers: i64,
}

/// The parent's positions as a fork at `from_seq` sees them.
pub async fn prefix(db: impl PgExecutor<'_>, parent: &str, from_seq: i32) -> Result<Prefix> {
    Ok(sqlx::query_as(
        "SELECT (SELECT step FROM trailmark.steps WHERE run_id = $1 AND seq = $2) AS step_at,
                (SELECT min(seq) FROM trailmark.steps
                  WHERE run_id = $1 AND seq < $2 AND finished_at IS NULL) AS unfinished,
                (SELECT count(*) FROM trailmark.steps WHERE run_id = $1) AS positions,
                (SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND seq < $2) AS answers",
    )
    .bind(parent)
    .bind(from_seq)
    .fetch_one(db)
    .await?)
}

/// The first position at which the parent ran `step`.
pub async fn first_visit(db: impl PgExecutor<'_>, parent: &str, step: &str) -> Result<Option<i32>> {
    Ok(
        sqlx::query_scalar("SELECT min(seq) FROM trailmark.steps WHERE run_id = $1 AND step = $2")
            .bind(parent)
            .bind(step)
            .fetch_one(db)
            .await?,
    )
}

//! Operator decisions: who decided what about a run, when, why, and what it changed.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;

/// A decision to record.
pub struct NewDecision<'a> {
    /// The run.
    pub run_id: &'a str,
    /// `resume`, `resume_after_fix`, `undo`, `cancel`, `approve`, `reject`, `timeout`.
    pub action: &'a str,
    /// Who (from `--actor` or `operator.actor`).
    pub actor: &'a str,
    /// Why, in the operator's words.
    pub reason: &'a str,
    /// The step it concerns, if one.
    pub step: Option<&'a str>,
    /// Its position.
    pub seq: Option<i32>,
    /// Status before.
    pub status_before: &'a str,
    /// Status after.
    pub status_after: &'a str,
    /// Workflow version before.
    pub version_before: i32,
    /// Workflow version after (differs after a resume on newly deployed code).
    pub version_after: i32,
    /// Anything else worth keeping (the handover note answered, the undo scope).
    pub details: &'a Value,
}

/// A recorded decision.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct DecisionRow {
    /// Order.
    pub id: i64,
    /// What.
    pub action: String,
    /// Who.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// Which step.
    pub step: Option<String>,
    /// Which position.
    pub seq: Option<i32>,
    /// Status before.
    pub status_before: String,
    /// Status after.
    pub status_after: String,
    /// Version before.
    pub version_before: i32,
    /// Version after.
    pub version_after: i32,
    /// Details.
    pub details: Value,
    /// When.
    pub created_at: DateTime<Utc>,
}

/// Records a decision in the caller's transaction.
pub async fn insert(db: impl PgExecutor<'_>, d: &NewDecision<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO trailmark.decisions (run_id, action, actor, reason, step, seq, status_before, status_after,
                                          version_before, version_after, details)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(d.run_id)
    .bind(d.action)
    .bind(d.actor)
    .bind(d.reason)
    .bind(d.step)
    .bind(d.seq)
    .bind(d.status_before)
    .bind(d.status_after)
    .bind(d.version_before)
    .bind(d.version_after)
    .bind(d.details)
    .execute(db)
    .await?;
    Ok(())
}

/// A run's decisions, oldest first.
pub async fn list(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<DecisionRow>> {
    Ok(sqlx::query_as(
        "SELECT id, action, actor, reason, step, seq, status_before, status_after, version_before,
                version_after, details, created_at
           FROM trailmark.decisions WHERE run_id = $1 ORDER BY id",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// Whether a person approved running position `seq` of the run (a frozen step).
pub async fn approved(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.decisions WHERE run_id = $1 AND seq = $2 AND action = 'approve')",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_one(db)
    .await?)
}

/// The operator resume whose first attempt is `attempt` (more than one) of position `seq`: who
/// resumed it and why. A resume keeps the attempt count (the next claim is one more); one after a
/// fix starts it again at one, so it is never the answer, but as the latest resume it still hides
/// the plain resumes before it. `None` when that attempt follows a crash or a retry instead.
pub async fn resumed_into(
    db: impl PgExecutor<'_>,
    run_id: &str,
    seq: i32,
    attempt: i32,
) -> Result<Option<(String, String)>> {
    Ok(sqlx::query_as(
        "SELECT actor, reason FROM (
             SELECT actor, reason, action, details FROM trailmark.decisions
              WHERE run_id = $1 AND seq = $2 AND action IN ('resume', 'resume_after_fix')
              ORDER BY id DESC LIMIT 1) latest
          WHERE action = 'resume'
            AND COALESCE((details->>'attempts_before')::int, 0) + 1 = $3",
    )
    .bind(run_id)
    .bind(seq)
    .bind(attempt)
    .fetch_optional(db)
    .await?)
}

/// A decision as exported for evaluation: the situation a person saw (the checkpoint of the
/// step it concerned and the evidence the run gave), what they decided, who and why.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Exported {
    /// Order.
    pub id: i64,
    /// When.
    pub decided_at: DateTime<Utc>,
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// The step it concerned.
    pub step: Option<String>,
    /// Its position.
    pub seq: Option<i32>,
    /// That step's checkpoint (for a human step: its question and the answer).
    pub checkpoint: Option<Value>,
    /// What the run said: the handover note, the question, the undo plan.
    pub evidence: Value,
    /// What.
    pub decision: String,
    /// Who.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// Status before.
    pub status_before: String,
    /// Status after.
    pub status_after: String,
}

/// Decisions after the id `after`, oldest first, at most `limit`.
pub async fn export(db: impl PgExecutor<'_>, after: i64, limit: i64) -> Result<Vec<Exported>> {
    Ok(sqlx::query_as(
        "SELECT d.id, d.created_at AS decided_at, d.run_id, r.workflow, d.step, d.seq,
                s.output AS checkpoint, d.details AS evidence, d.action AS decision, d.actor,
                d.reason, d.status_before, d.status_after
           FROM trailmark.decisions d
           JOIN trailmark.runs r ON r.run_id = d.run_id
           LEFT JOIN trailmark.steps s ON s.run_id = d.run_id AND s.seq = d.seq
          WHERE d.id > $1 ORDER BY d.id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await?)
}

//! Step checkpoints: one row per position, with attempts counted at claim time.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;
use crate::domain::{RunId, StepAddress};

/// A step checkpoint as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct StepRow {
    /// Position.
    pub seq: i32,
    /// The step (a declared step, or a compensation).
    pub step: StepAddress,
    /// Claims so far (a crash mid-step still counts).
    pub attempts: i32,
    /// Output once committed.
    pub output: Option<Value>,
    /// First claim.
    pub started_at: DateTime<Utc>,
    /// Commit time.
    pub finished_at: Option<DateTime<Utc>>,
    /// While it waits in a delay queue: when it runs again.
    pub retry_at: Option<DateTime<Utc>>,
    /// The last temporary failure, when it was retried.
    pub last_error: Option<String>,
}

/// The newest committed output of the step named `step` before position `before`.
pub async fn latest_output(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    step: &str,
    before: i32,
) -> Result<Option<Value>> {
    Ok(sqlx::query_scalar(
        "SELECT output FROM trailmark.steps WHERE run_id = $1 AND step = $2 AND seq < $3
           AND finished_at IS NOT NULL ORDER BY seq DESC LIMIT 1",
    )
    .bind(run_id.as_str())
    .bind(step)
    .bind(before)
    .fetch_optional(db)
    .await?
    .flatten())
}

/// Every checkpoint of a run, in order.
pub async fn list(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<StepRow>> {
    Ok(sqlx::query_as(
        "SELECT seq, step, attempts, output, started_at, finished_at, retry_at, last_error FROM trailmark.steps
          WHERE run_id = $1 ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// The checkpointed output at position `seq`.
pub async fn output_at(db: impl PgExecutor<'_>, run_id: &RunId, seq: i32) -> Result<Option<Value>> {
    Ok(
        sqlx::query_scalar("SELECT output FROM trailmark.steps WHERE run_id = $1 AND seq = $2")
            .bind(run_id.as_str())
            .bind(seq)
            .fetch_optional(db)
            .await?
            .flatten(),
    )
}

/// The checkpointed outputs at positions `seqs`, in one statement.
pub async fn outputs_at(
    db: impl PgExecutor<'_>,
    run_id: &str,
    seqs: &[i32],
) -> Result<std::collections::HashMap<i32, Value>> {
    let rows: Vec<(i32, Option<Value>)> = sqlx::query_as(
        "SELECT seq, output FROM trailmark.steps WHERE run_id = $1 AND seq = ANY($2)",
    )
    .bind(run_id)
    .bind(seqs)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(seq, output)| (seq, output.unwrap_or_default()))
        .collect())
}

/// The run's own finished forward steps (not compensations, not the positions a fork took
/// over from its parent), newest first: what undo may reverse.
pub async fn finished_forward(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<(i32, String)>> {
    Ok(sqlx::query_as(
        "SELECT seq, step FROM trailmark.steps WHERE run_id = $1 AND finished_at IS NOT NULL
            AND step NOT LIKE $2
            -- A fork's positions before its fork point are its parent's work, not its own.
            AND seq >= COALESCE((SELECT from_seq FROM trailmark.forks WHERE run_id = $1), 0)
          ORDER BY seq DESC",
    )
    .bind(run_id)
    .bind(StepAddress::UNDO_LIKE)
    .fetch_all(db)
    .await?)
}

/// The first position after every step the run has claimed.
pub async fn next_position(db: impl PgExecutor<'_>, run_id: &str) -> Result<i32> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE(max(seq), -1) + 1 FROM trailmark.steps WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(db)
    .await?)
}

/// Claims so far of the step at position `seq` (0 before the first).
pub async fn attempts_at(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<i32> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE(max(attempts), 0) FROM trailmark.steps WHERE run_id = $1 AND seq = $2",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_one(db)
    .await?)
}

/// The window an interrupted attempt (`attempt`, at `seq`) is known to lie in, on the database's
/// clock: from the step's first claim when it was the first attempt (later attempts' claims are
/// not stored, so their window starts at its end), to now (the next attempt's takeover). Read
/// for traces only, on a takeover; `None` when the step has no row.
pub async fn interrupted_window(
    db: impl PgExecutor<'_>,
    run_id: &str,
    seq: i32,
    attempt: i32,
) -> Result<Option<(DateTime<Utc>, DateTime<Utc>)>> {
    Ok(sqlx::query_as(
        "SELECT CASE WHEN $3 = 1 THEN started_at ELSE now() END, now() FROM trailmark.steps
          WHERE run_id = $1 AND seq = $2",
    )
    .bind(run_id)
    .bind(seq)
    .bind(attempt)
    .fetch_optional(db)
    .await?)
}

/// Starts the attempt count of the step at `seq` again (a resume after a fix).
pub async fn reset_attempts(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<()> {
    sqlx::query("UPDATE trailmark.steps SET attempts = 0 WHERE run_id = $1 AND seq = $2")
        .bind(run_id)
        .bind(seq)
        .execute(db)
        .await?;
    Ok(())
}

/// Who answered a waiting step, how and why.
#[derive(Debug, Clone, Copy)]
pub struct Answer<'a> {
    /// `approved` or `rejected`.
    pub decision: &'a str,
    /// The person.
    pub actor: &'a str,
    /// Their reason.
    pub reason: &'a str,
}

/// Marks the waiting step at `seq` finished, with the person's answer in its output next to the
/// question it asked.
pub async fn close_waiting(
    db: impl PgExecutor<'_>,
    run_id: &str,
    seq: i32,
    answer: Answer<'_>,
) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.steps SET finished_at = now(),
                output = jsonb_build_object('question', output, 'decision', $3::text, 'actor', $4::text, 'reason', $5::text)
          WHERE run_id = $1 AND seq = $2",
    )
    .bind(run_id)
    .bind(seq)
    .bind(answer.decision)
    .bind(answer.actor)
    .bind(answer.reason)
    .execute(db)
    .await?;
    Ok(())
}

/// When the step at position `seq` was committed, if it was.
pub async fn finished_at(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
    seq: i32,
) -> Result<Option<DateTime<Utc>>> {
    Ok(
        sqlx::query_scalar(
            "SELECT finished_at FROM trailmark.steps WHERE run_id = $1 AND seq = $2",
        )
        .bind(run_id.as_str())
        .bind(seq)
        .fetch_optional(db)
        .await?
        .flatten(),
    )
}

/// The checkpoint at position `seq`, if the run has reached it.
pub async fn at(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<Option<StepRow>> {
    Ok(sqlx::query_as(
        "SELECT seq, step, attempts, output, started_at, finished_at, retry_at, last_error FROM trailmark.steps
          WHERE run_id = $1 AND seq = $2",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_optional(db)
    .await?)
}

/// A run's checkpoints after position `after`, in order, at most `limit`.
pub async fn page(
    db: impl PgExecutor<'_>,
    run_id: &str,
    after: i32,
    limit: i64,
) -> Result<Vec<StepRow>> {
    Ok(sqlx::query_as(
        "SELECT seq, step, attempts, output, started_at, finished_at, retry_at, last_error
           FROM trailmark.steps WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
    )
    .bind(run_id)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// How many positions the run has reached.
pub async fn count(db: impl PgExecutor<'_>, run_id: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM trailmark.steps WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(db)
            .await?,
    )
}

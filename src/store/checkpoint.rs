//! The step commit (DESIGN.md §4 step 5) as one statement: inbox row, fenced run advance,
//! checkpoint, parked items and outbox rows, all or nothing.
//!
//! One statement instead of a transaction of six: a step's cost is dominated by round trips, and
//! a single statement is atomic by itself. The one case that needs a rollback (the inbox row went
//! in but the fence check failed) is handled inside the statement by `trailmark.refuse_commit`,
//! which aborts it.

use std::sync::LazyLock;

use serde_json::Value;
use sqlx::PgExecutor;

use super::outbox::{self, OutgoingMessage};
use super::{Error, Result};
use crate::domain::{Fence, MessageId, RunId, RunStatus};

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

/// Everything one step commit writes.
pub struct StepCommit<'a> {
    /// The run.
    pub run_id: &'a RunId,
    /// The committer's fence.
    pub fence: Fence,
    /// The step name (for parked items).
    pub step: &'a str,
    /// The run's new head.
    pub to: Advance<'a>,
    /// The step row's new output: the checkpoint, or a waiting step's question.
    pub step_output: Option<&'a Value>,
    /// Whether the step is finished (a waiting step is not).
    pub finished: bool,
    /// The inbox consumer and the delivery's message id.
    pub inbox: (&'a str, MessageId),
    /// Items the step parked (id, reason).
    pub parked: &'a [(String, String)],
    /// Messages to queue.
    pub outbox: &'a [OutgoingMessage],
}

/// The commit statement; the parked-items part only when the step parked something, because
/// every data-changing part costs its executor set-up on each step even when it writes nothing.
fn commit_sql(with_parked: bool) -> String {
    let fenced = "WHERE EXISTS (SELECT 1 FROM adv)";
    let park = if with_parked {
        format!(
            ", park AS (
            INSERT INTO trailmark.parked (run_id, item, seq, step, reason)
            SELECT $1, i, $3, $13, r FROM UNNEST($14::text[], $15::text[]) AS p(i, r) {fenced}
            ON CONFLICT (run_id, item) DO NOTHING
        )"
        )
    } else {
        // Keeps the parameter numbering: $13 to $15 are bound either way.
        ", park AS (SELECT $13::text, $14::text[], $15::text[])".to_owned()
    };
    format!(
        "WITH fresh AS (
            INSERT INTO trailmark.inbox (consumer, message_id) VALUES ($11, $12)
            ON CONFLICT DO NOTHING RETURNING 1
        ), adv AS (
            UPDATE trailmark.runs
               SET step_seq = step_seq + CASE WHEN $5 IN ('running', 'compensating', 'succeeded', 'compensated') THEN 1 ELSE 0 END,
                   step = $4, status = $5, output = COALESCE($6, output), error = $7, handover = $8,
                   lease_owner = NULL, lease_expires_at = NULL, updated_at = now(),
                   finished_at = CASE WHEN $5 IN ('succeeded', 'compensated', 'failed', 'cancelled') THEN now() END
             WHERE run_id = $1 AND fence = $2 AND step_seq = $3 AND EXISTS (SELECT 1 FROM fresh)
            RETURNING 1
        ), checkpoint AS (
            UPDATE trailmark.steps SET output = $9, finished_at = CASE WHEN $10 THEN now() END
             WHERE run_id = $1 AND seq = $3 AND $9::jsonb IS NOT NULL AND EXISTS (SELECT 1 FROM adv)
        ){park}, queue AS ({queue})
        SELECT CASE WHEN EXISTS (SELECT 1 FROM adv) THEN 'committed'
                    WHEN EXISTS (SELECT 1 FROM fresh) THEN trailmark.refuse_commit($1, $2)
                    WHEN EXISTS (SELECT 1 FROM trailmark.runs WHERE run_id = $1 AND fence = $2) THEN 'duplicate'
                    ELSE 'fenced' END",
        queue = outbox::insert_sql(16, fenced),
    )
}

static COMMIT: LazyLock<String> = LazyLock::new(|| commit_sql(false));
static COMMIT_PARKED: LazyLock<String> = LazyLock::new(|| commit_sql(true));

/// Commits the step; `Ok(false)` means another delivery of the same message committed first,
/// [`Error::FencedOut`] that a newer worker holds the run (or it moved on). Nothing is written
/// in either case.
pub async fn commit(db: impl PgExecutor<'_>, c: &StepCommit<'_>) -> Result<bool> {
    let (items, reasons): (Vec<&str>, Vec<&str>) = c
        .parked
        .iter()
        .map(|(i, r)| (i.as_str(), r.as_str()))
        .unzip();
    let sql = if c.parked.is_empty() {
        &COMMIT
    } else {
        &COMMIT_PARKED
    };
    let q = sqlx::query(sql.as_str())
        .bind(c.run_id.as_str())
        .bind(c.fence.0)
        .bind(c.to.seq)
        .bind(c.to.next_step)
        .bind(c.to.status.as_str())
        .bind(c.to.output)
        .bind(c.to.error)
        .bind(c.to.handover)
        .bind(c.step_output)
        .bind(c.finished)
        .bind(c.inbox.0)
        .bind(c.inbox.1.0)
        .bind(c.step)
        .bind(items)
        .bind(reasons);
    let row = outbox::bind_rows(q, c.outbox)
        .fetch_one(db)
        .await
        .map_err(|e| refused(e, c))?;
    // A delivery whose fence is stale is reported as fenced out even when the same message was
    // also committed by the newer worker: that is what the operator needs to read in the log.
    match sqlx::Row::try_get::<String, _>(&row, 0)?.as_str() {
        "committed" => Ok(true),
        "duplicate" => Ok(false),
        _ => Err(fenced_out(c)),
    }
}

fn refused(e: sqlx::Error, c: &StepCommit<'_>) -> Error {
    let code = e.as_database_error().and_then(|d| d.code());
    if code.as_deref() == Some("TMF01") {
        return fenced_out(c);
    }
    e.into()
}

fn fenced_out(c: &StepCommit<'_>) -> Error {
    Error::FencedOut {
        run_id: c.run_id.to_string(),
        fence: c.fence.0,
    }
}

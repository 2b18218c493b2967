//! The step commit (DESIGN.md §4 step 5) as one statement: inbox row, fenced run advance,
//! checkpoint, parked items, outbox rows, and what the attempt learnt on the way (journaled
//! answers, effect results), all or nothing.
//!
//! One statement instead of a transaction of six: a step's cost is dominated by round trips, and
//! a single statement is atomic by itself. The one case that needs a rollback (the inbox row went
//! in but the fence check failed) is handled inside the statement by `trailmark.refuse_commit`,
//! which aborts it.

use std::sync::LazyLock;

use serde_json::Value;
use sqlx::PgExecutor;

use super::journal::{self, JournalEntry};
use super::outbox::{self, OutgoingMessage};
use super::{Error, Result};
use crate::domain::{Fence, IdempotencyKey, MessageId, RunId, RunStatus};

/// What an attempt learnt before its commit: written by whatever ends the attempt.
#[derive(Debug, Default, Clone)]
pub struct Pending {
    /// Model answers not yet journaled.
    pub journal: Vec<JournalEntry>,
    /// Results of calls to tools that enforce their key (idempotency key, result).
    pub results: Vec<(IdempotencyKey, Value)>,
}

impl Pending {
    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.journal.is_empty() && self.results.is_empty()
    }
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
    /// Answers and results the attempt has not written yet.
    pub pending: &'a Pending,
}

static COMMIT: LazyLock<String> = LazyLock::new(|| {
    let fenced = "WHERE EXISTS (SELECT 1 FROM adv)";
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
        ), park AS (
            INSERT INTO trailmark.parked (run_id, item, seq, step, reason)
            SELECT $1, i, $3, $13, r FROM UNNEST($14::text[], $15::text[]) AS p(i, r) {fenced}
            ON CONFLICT (run_id, item) DO NOTHING
        ), results AS (
            -- `= ANY` rather than a join with UNNEST: the planner then always takes the key's
            -- index, where a join estimate made it hash the whole table.
            UPDATE trailmark.effects
               SET result = ($17::jsonb[])[array_position($16::text[], idempotency_key)],
                   completed_at = now()
             WHERE idempotency_key = ANY($16::text[]) AND EXISTS (SELECT 1 FROM adv)
        ), queue AS ({queue}), answers AS ({answers})
        SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM fresh) THEN false
                    WHEN EXISTS (SELECT 1 FROM adv) THEN true
                    ELSE trailmark.refuse_commit($1, $2) END",
        queue = outbox::insert_sql(18, fenced),
        answers = journal::insert_sql(1, 24, fenced),
    )
});

/// Commits the step; `Ok(false)` means another delivery of the same message committed first,
/// [`Error::FencedOut`] that a newer worker holds the run (or it moved on). Nothing is written
/// in either case.
pub async fn commit(db: impl PgExecutor<'_>, c: &StepCommit<'_>) -> Result<bool> {
    let (items, reasons): (Vec<&str>, Vec<&str>) = c
        .parked
        .iter()
        .map(|(i, r)| (i.as_str(), r.as_str()))
        .unzip();
    let (keys, results): (Vec<&str>, Vec<&Value>) = c
        .pending
        .results
        .iter()
        .map(|(k, r)| (k.as_str(), r))
        .unzip();
    let q = sqlx::query(COMMIT.as_str())
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
        .bind(reasons)
        .bind(keys)
        .bind(results);
    let q = journal::bind_entries(outbox::bind_rows(q, c.outbox), &c.pending.journal);
    let row = q.fetch_one(db).await.map_err(|e| refused(e, c))?;
    Ok(sqlx::Row::try_get(&row, 0)?)
}

fn refused(e: sqlx::Error, c: &StepCommit<'_>) -> Error {
    let code = e.as_database_error().and_then(|d| d.code());
    if code.as_deref() == Some("TMF01") {
        return Error::FencedOut {
            run_id: c.run_id.to_string(),
            fence: c.fence.0,
        };
    }
    e.into()
}

/// Writes answers and results outside a step commit: before another paid call, or when an
/// attempt ends in a retry or a handover (so the note sees them).
pub async fn write_pending(pool: &sqlx::PgPool, run_id: &RunId, pending: &Pending) -> Result<()> {
    journal::insert(pool, run_id, &pending.journal).await?;
    for (key, result) in &pending.results {
        super::effects::complete(pool, key, result).await?;
    }
    Ok(())
}

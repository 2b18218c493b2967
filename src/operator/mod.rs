//! Operator decisions as durable state: resume, resume after a fix, undo, cancel,
//! approve, reject, and fork (a new run from another's checkpoint). Each is one transaction that checks the run's status, changes the run,
//! records who/when/what/why with the status before and after (a decision row and an audit
//! row), and queues the next step message through the outbox. None restarts a run from zero.
//! The move of runs at rest to another workflow version (`move_version`, beside the listing
//! of versions that tells which can go, `versions`) records a decision per run the same way.

mod fork;
mod human;
mod move_version;
mod resume;
mod undo;
mod versions;

use serde_json::{Value, json};
use sqlx::{PgConnection, Postgres, Transaction};

pub use fork::{ForkPlan, ForkPoint, ForkRequest, fork, plan as fork_plan};
pub use human::{approve, reject};
pub use move_version::{MoveAsk, MovePlan, RunMove, Verdict, move_runs, preview as move_preview};
pub use resume::{Resume, resume};
pub use undo::{Preview, PreviewChild, PreviewStep, UndoOptions, preview as undo_preview, undo};
pub use versions::{VersionState, versions};

use crate::domain::{Event, IllegalMove, RunId, RunStatus, StepAddress};
use crate::engine::Engine;
use crate::store::decisions::{self, NewDecision};
use crate::store::{self, audit, outbox, progress, runs};

/// Why a decision was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No such run.
    #[error("run {0} not found: list runs with `trailmark run list`")]
    NotFound(String),
    /// The decision does not fit the run's state.
    #[error("cannot {action} run {run_id}: {why}")]
    Refused {
        /// The run.
        run_id: String,
        /// The decision.
        action: &'static str,
        /// The run's status when it was refused.
        status: RunStatus,
        /// What is in the way and what to do instead.
        why: String,
    },
    /// A move of runs to another workflow version that cannot be made as asked (the target
    /// version is not carried here, or is the version they are on).
    #[error("cannot move runs of workflow {workflow}: {why}")]
    Version {
        /// The workflow.
        workflow: String,
        /// What is in the way and what to do instead.
        why: String,
    },
    /// The database failed; nothing was changed.
    #[error("the decision was not recorded")]
    Store(#[from] store::Error),
    /// The decision would move the run where the status table does not allow (a bug).
    #[error("the decision was not recorded")]
    IllegalMove(#[from] IllegalMove),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

/// Shorthand for operator results.
pub type Result<T> = std::result::Result<T, Error>;

/// Who decides, why, and through which face; recorded with the decision and in the audit trail.
#[derive(Debug, Clone)]
pub struct Decider {
    /// The person (or system) deciding.
    pub actor: String,
    /// Their reason, in their words.
    pub reason: String,
    /// Their role (`operator`, `admin` through the API; `cli` at the terminal).
    pub role: String,
    /// `api`, `cli`, or `embedded` (a program's own call through [`crate::Trailmark`]).
    pub via: &'static str,
    /// The HTTP request's id, for a decision made through the API.
    pub request_id: Option<String>,
}

impl Decider {
    /// A person at the terminal (`trailmark run ...`), who has the database's credentials.
    pub fn cli(actor: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            actor: actor.into(),
            reason: reason.into(),
            role: "cli".into(),
            via: "cli",
            request_id: None,
        }
    }

    /// The program that embeds the engine, deciding through [`crate::Trailmark`].
    pub fn embedded(actor: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            actor: actor.into(),
            reason: reason.into(),
            role: "embedder".into(),
            via: "embedded",
            request_id: None,
        }
    }

    /// The audit row of `action` on `target` by this decider, with no run status: the one
    /// place that copies who, why and the request id into an audit row (a caller that changes a
    /// run's status adds it).
    pub fn audit_entry<'a>(
        &'a self,
        action: &'a str,
        target: &'a str,
        details: &'a Value,
    ) -> audit::NewEntry<'a> {
        audit::NewEntry {
            actor: &self.actor,
            role: &self.role,
            via: self.via,
            action,
            target,
            reason: &self.reason,
            request_id: self.request_id.as_deref(),
            status_before: None,
            status_after: None,
            details,
        }
    }
}

/// Records an action that changes no run (a dead letter requeued, purged or revealed) in the
/// audit trail: who, why, on what, and what it did. The broker action cannot share a transaction
/// with Postgres, so the row is written after it, and says what was done.
pub async fn record_action(
    db: impl sqlx::PgExecutor<'_>,
    who: &Decider,
    action: &str,
    target: &str,
    details: &Value,
) -> Result<()> {
    audit::insert(db, &who.audit_entry(action, target, details)).await?;
    Ok(())
}

/// What a decision did, for the operator's terminal.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    /// The run.
    pub run_id: String,
    /// The decision.
    pub action: String,
    /// Status before.
    pub status_before: String,
    /// Status after.
    pub status_after: String,
    /// One line on what happens next.
    pub next: String,
}

/// Locks the run row for the decision's transaction.
async fn lock(tx: &mut PgConnection, run_id: &str) -> Result<runs::RunRow> {
    runs::lock(tx, run_id)
        .await?
        .ok_or_else(|| Error::NotFound(run_id.to_owned()))
}

fn refused(run: &runs::RunRow, action: &'static str, why: impl Into<String>) -> Error {
    Error::Refused {
        run_id: run.run_id.clone(),
        action,
        status: run.status,
        why: why.into(),
    }
}

/// Moves the run to `status` at (`step`, `seq`) on `version`, if the status table allows it,
/// voiding any lease (see [`runs::set_by_decision`]).
async fn set_run(
    tx: &mut PgConnection,
    run: &runs::RunRow,
    status: RunStatus,
    step: Option<&StepAddress>,
    seq: i32,
    version: i32,
) -> Result<()> {
    let to = runs::Decided {
        status: run.status.move_to(status)?,
        step,
        seq,
        version,
    };
    runs::set_by_decision(tx, &run.run_id, to).await?;
    Ok(())
}

/// Queues the message of `step` at `seq` for the run.
async fn enqueue(
    tx: &mut PgConnection,
    engine: &Engine,
    run: &runs::RunRow,
    step: &StepAddress,
    seq: i32,
    version: i32,
) -> Result<()> {
    let run_id = RunId::parse(&run.run_id).map_err(|e| refused(run, "queue", e.to_string()))?;
    let msg = engine
        .topology
        .step_message(&run_id, &run.workflow, version, step, seq);
    outbox::insert(tx, &[msg]).await?;
    Ok(())
}

/// What a decision does to the run, for [`record`].
struct Decided<'a> {
    /// The decision's name.
    action: &'static str,
    /// The run's status after it.
    after: RunStatus,
    /// The step it concerns, and its position.
    step: Option<(&'a StepAddress, i32)>,
    /// The workflow version the run follows after it.
    version_after: i32,
    /// What else to keep with it (the note answered, the undo plan).
    details: Value,
    /// One line on what happens next.
    next: String,
}

/// Records the decision (see [`record_in`]) and commits; returns the outcome.
async fn record(
    engine: &Engine,
    mut tx: Transaction<'_, Postgres>,
    run: &runs::RunRow,
    who: &Decider,
    decided: Decided<'_>,
) -> Result<Outcome> {
    let outcome = record_in(engine, &mut tx, run, who, decided).await?;
    tx.commit().await?;
    tracing::info!(run.id = %run.run_id, action = %outcome.action, actor = %who.actor, before = %run.status, after = %outcome.status_after, "operator decision recorded");
    Ok(outcome)
}

/// Records the decision in the caller's transaction: a decision row, an audit row, a progress
/// line, and the lifecycle event when the run ended or stopped for a person.
async fn record_in(
    engine: &Engine,
    tx: &mut PgConnection,
    run: &runs::RunRow,
    who: &Decider,
    decided: Decided<'_>,
) -> Result<Outcome> {
    let (after, step, version) = (decided.after, decided.step, decided.version_after);
    let outcome = record_quietly(tx, run, who, decided).await?;
    if let Ok(run_id) = RunId::parse(&run.run_id)
        && let Some(event) = Event::run(&run_id, (&run.workflow, version), after, step)
    {
        outbox::insert(&mut *tx, &[engine.topology.event_message(&event)]).await?;
    }
    Ok(outcome)
}

/// [`record_in`] without the lifecycle event: for a decision that does not move the run yet
/// (a child's part in its parent's undo, which starts when the parent reaches it).
async fn record_quietly(
    tx: &mut PgConnection,
    run: &runs::RunRow,
    who: &Decider,
    decided: Decided<'_>,
) -> Result<Outcome> {
    let Decided {
        action,
        after,
        step,
        version_after,
        details,
        next,
    } = decided;
    let d = NewDecision {
        run_id: &run.run_id,
        action,
        actor: &who.actor,
        reason: &who.reason,
        step: step.map(|(s, _)| s.as_str()),
        seq: step.map(|(_, q)| q),
        status_before: run.status.as_str(),
        status_after: after.as_str(),
        version_before: run.workflow_version,
        version_after,
        details: &details,
    };
    decisions::insert(&mut *tx, &d).await?;
    let entry = audit::NewEntry {
        status_before: Some(run.status.as_str()),
        status_after: Some(after.as_str()),
        ..who.audit_entry(action, &run.run_id, &details)
    };
    audit::insert(&mut *tx, &entry).await?;
    // Whoever watches the run sees the decision among its progress lines.
    let said = progress::NewLine {
        run_id: run.run_id.clone(),
        seq: step.map_or(run.step_seq, |(_, q)| q),
        at: chrono::Utc::now(),
        line: format!(
            "{} by {}: {} ({next})",
            action.replace('_', " "),
            who.actor,
            who.reason
        ),
    };
    progress::record(&mut *tx, &[said]).await?;
    Ok(Outcome {
        run_id: run.run_id.clone(),
        action: action.into(),
        status_before: run.status.as_str().into(),
        status_after: after.as_str().into(),
        next,
    })
}

/// Stops a run for good; an in-flight step is fenced out and commits nothing.
/// A run's running children (and theirs) are cancelled with it; a child cancelled alone counts
/// as failed in its parent's fan-out.
pub async fn cancel(engine: &Engine, run_id: &str, who: &Decider) -> Result<Outcome> {
    let mut tx = engine.pool.begin().await?;
    // A child's parent is locked before the child, as a child's ending locks them.
    let parent = store::children::parent_of(&mut *tx, run_id).await?;
    if let Some((parent, _)) = &parent {
        // And the runs above it: a cancel during an undo may stop the parent, and count it in
        // its own parent's undo.
        store::children::lock_line(&mut tx, parent).await?;
    }
    let run = lock(&mut tx, run_id).await?;
    if run.status.is_terminal() {
        return Err(refused(
            &run,
            "cancel",
            format!("it is already {}", run.status),
        ));
    }
    set_run(
        &mut tx,
        &run,
        RunStatus::Cancelled,
        run.step.as_ref(),
        run.step_seq,
        run.workflow_version,
    )
    .await?;
    let why = format!("cancelled by {}: {}", who.actor, who.reason);
    if parent.is_some() {
        crate::wait::children::count_end(&mut tx, &engine.topology, run_id, ("cancelled", Some(&why))).await?;
    }
    let below = crate::wait::children::cancel_below(&mut tx, &engine.topology, (run_id, None), &why).await?;
    let details = json!({ "handover": run.handover, "error": run.error, "children_cancelled": below });
    let children = match below {
        0 => String::new(),
        n => format!(" with {n} child run(s) that had not ended"),
    };
    let next = format!(
        "nothing: the run is cancelled{children}; `trailmark run undo` can still reverse its writes"
    );
    record(
        engine,
        tx,
        &run,
        who,
        Decided {
            action: "cancel",
            after: RunStatus::Cancelled,
            step: None,
            version_after: run.workflow_version,
            details,
            next,
        },
    )
    .await
}

//! The step transaction (DESIGN.md §4 step 5): inbox row, fenced run advance, checkpoint,
//! parked items and outbox rows (next step and outside messages), all or nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use super::STEP_CONSUMER;
use crate::domain::{Fence, MessageId, RunId, RunStatus, STEP_ROUTING_KEY, StepMessage};
use crate::engine::Engine;
use crate::store::outbox::OutgoingMessage;
use crate::store::{self, inbox, outbox, parked, runs, steps};
use crate::workflow::Parked;

/// How a step execution ends.
pub(super) enum Ending {
    /// Checkpoint the output and move to `next` (or end the run when `None`).
    Advance {
        /// The step's output.
        output: Value,
        /// The next step.
        next: Option<String>,
        /// The run's status while executing (running or compensating).
        status: RunStatus,
        /// Outside messages the step queued with `ctx.send`.
        sent: Vec<OutgoingMessage>,
        /// Items the step parked.
        parked: Vec<Parked>,
    },
    /// Wait for a person (a human step's question, or a frozen step's evidence).
    Wait {
        /// What the person must decide, with the evidence.
        note: Value,
    },
    /// Stop the run for a person; the step is not advanced.
    Review {
        /// One-line reason.
        error: String,
        /// The handover note.
        note: Value,
    },
}

/// Commits the step and returns the outbox messages it queued (for eager publishing);
/// `Ok(None)` means another delivery of the same message committed first.
pub(super) async fn commit(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    fence: Fence,
    ending: Ending,
) -> store::Result<Option<Vec<OutgoingMessage>>> {
    let grace = engine.settings.relay.eager_grace_ms;
    let mut queued = Vec::new();
    let fp = &engine.failpoints;
    let mut tx = engine.pool.begin().await?;
    // The fenced update goes first: it takes the run's row lock, so two committers of the same
    // run serialise here and the loser sees zero rows.
    match &ending {
        Ending::Advance {
            output,
            next,
            status,
            sent,
            parked: items,
        } => {
            let done = next.is_none();
            let to = runs::Advance {
                seq: msg.seq,
                next_step: next.as_deref(),
                status: match (done, status) {
                    (false, s) => *s,
                    (true, RunStatus::Compensating) => RunStatus::Compensated,
                    (true, _) => RunStatus::Succeeded,
                },
                output: if done { Some(output) } else { None },
                error: None,
                handover: None,
            };
            runs::advance(&mut *tx, &msg.run_id, fence, &to).await?;
            steps::finish(&mut *tx, &msg.run_id, msg.seq, output).await?;
            parked::insert(&mut tx, &msg.run_id, msg.seq, &msg.step, items).await?;
            fp.hit("step.after_checkpoint").map_err(infra)?;
            queued = sent.clone();
            if let Some(next) = next {
                queued.push(next_message(engine, msg, next));
            }
            for m in &mut queued {
                m.relay_after_ms = grace;
            }
            outbox::insert(&mut *tx, &queued).await?;
        }
        Ending::Wait { note } => {
            let to = runs::Advance {
                seq: msg.seq,
                next_step: Some(&msg.step),
                status: RunStatus::Waiting,
                output: None,
                error: None,
                handover: Some(note),
            };
            runs::advance(&mut *tx, &msg.run_id, fence, &to).await?;
            steps::set_question(&mut *tx, &msg.run_id, msg.seq, note).await?;
        }
        Ending::Review { error, note } => {
            let to = runs::Advance {
                seq: msg.seq,
                next_step: Some(&msg.step),
                status: RunStatus::NeedsReview,
                output: None,
                error: Some(error),
                handover: Some(note),
            };
            runs::advance(&mut *tx, &msg.run_id, fence, &to).await?;
        }
    }
    if !inbox::record(&mut *tx, STEP_CONSUMER, msg.message_id).await? {
        tx.rollback().await?;
        return Ok(None);
    }
    fp.hit("step.before_commit").map_err(infra)?;
    tx.commit().await?;
    fp.hit("step.after_commit").map_err(infra)?;
    // With eager publishing off, the relay publishes at once and there is nothing to hand back.
    Ok(Some(if grace > 0 { queued } else { Vec::new() }))
}

/// Gives the lease back without advancing (the step will be retried from a delay queue).
pub(super) async fn release(
    engine: &Arc<Engine>,
    run_id: &RunId,
    fence: Fence,
) -> store::Result<()> {
    sqlx::query(
        "UPDATE trailmark.runs SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
          WHERE run_id = $1 AND fence = $2",
    )
    .bind(run_id.as_str())
    .bind(fence.0)
    .execute(&engine.pool)
    .await?;
    Ok(())
}

/// The outbox row of a step message for `step` at position `seq` of a run.
pub fn step_message(
    engine: &Engine,
    run_id: &RunId,
    workflow: &str,
    version: i32,
    step: &str,
    seq: i32,
) -> OutgoingMessage {
    let msg = StepMessage {
        v: 1,
        message_id: MessageId::new(),
        run_id: run_id.clone(),
        workflow: workflow.to_owned(),
        version,
        step: step.to_owned(),
        seq,
    };
    let headers = BTreeMap::from([
        ("x-trailmark-run-id".to_owned(), run_id.to_string()),
        ("x-trailmark-step".to_owned(), step.to_owned()),
    ]);
    OutgoingMessage {
        message_id: msg.message_id,
        exchange: engine.topology.steps_exchange(),
        routing_key: STEP_ROUTING_KEY.to_owned(),
        headers,
        body: msg.encode(),
        relay_after_ms: 0,
    }
}

fn next_message(engine: &Engine, msg: &StepMessage, next: &str) -> OutgoingMessage {
    step_message(
        engine,
        &msg.run_id,
        &msg.workflow,
        msg.version,
        next,
        msg.seq + 1,
    )
}

fn infra(e: impl std::fmt::Display) -> store::Error {
    store::Error::Unavailable(e.to_string())
}

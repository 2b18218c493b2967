//! How a step execution ends, turned into the step commit (DESIGN.md §4 step 5, one statement in
//! `store::checkpoint`): inbox row, fenced run advance, checkpoint, parked items and outbox rows
//! (next step and outside messages), all or nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use super::STEP_CONSUMER;
use crate::domain::{
    Fence, IllegalMove, MessageId, RunId, RunStatus, STEP_ROUTING_KEY, StepAddress, StepMessage,
};
use crate::engine::Engine;
use crate::store;
use crate::store::checkpoint;
use crate::store::outbox::OutgoingMessage;
use crate::workflow::Parked;

/// How a step execution ends.
pub(super) enum Ending {
    /// Checkpoint the output and move to `next` (or end the run when `None`).
    Advance {
        /// The step's output.
        output: Value,
        /// The next step.
        next: Option<StepAddress>,
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
        /// Outside messages a human step queued before asking (the step does not run again).
        sent: Vec<OutgoingMessage>,
        /// Items it parked.
        parked: Vec<Parked>,
        /// The run's status while executing.
        status: RunStatus,
    },
    /// Stop the run for a person; the step is not advanced.
    Review {
        /// One-line reason.
        error: String,
        /// The handover note.
        note: Value,
        /// The run's status while executing.
        status: RunStatus,
    },
}

/// Commits the step and returns the outbox messages it queued (for eager publishing); `Ok(None)`
/// means another delivery of the same message committed first.
pub(super) async fn commit(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    fence: Fence,
    ending: Ending,
) -> store::Result<Option<Vec<OutgoingMessage>>> {
    let mut step = step_commit(engine, msg, fence, ending).map_err(infra)?;
    hold_for_eager_publish(engine, &mut step.outbox);
    // Copied only when the worker publishes them itself; the originals go into the commit.
    let eager = to_publish_eagerly(engine, &step.outbox);
    let fp = &engine.failpoints;
    fp.hit("step.before_commit").map_err(infra)?;
    if !engine.services.commit(step).await? {
        return Ok(None);
    }
    fp.hit("step.after_commit").map_err(infra)?;
    Ok(Some(eager))
}

/// What the step commit writes for `ending`.
fn step_commit(
    engine: &Engine,
    msg: &StepMessage,
    fence: Fence,
    ending: Ending,
) -> Result<checkpoint::StepCommit, IllegalMove> {
    let head = |status, handover| checkpoint::Advance {
        seq: msg.seq,
        next_step: Some(msg.step.clone()),
        status,
        output: None,
        error: None,
        handover,
    };
    let (to, step_output, finished, outbox, parked) = match ending {
        Ending::Advance {
            output,
            next,
            status,
            mut sent,
            parked,
        } => {
            let done = next.is_none();
            if let Some(next) = &next {
                sent.push(next_message(engine, msg, next));
            }
            let to = checkpoint::Advance {
                next_step: next,
                status: status.move_to(match (done, status) {
                    (false, s) => s,
                    (true, RunStatus::Compensating) => RunStatus::Compensated,
                    (true, _) => RunStatus::Succeeded,
                })?,
                output: done.then(|| output.clone()),
                ..head(status.move_to(status)?, None)
            };
            (to, Some(output), true, sent, parked_rows(&parked))
        }
        Ending::Wait {
            note,
            sent,
            parked,
            status,
        } => {
            let to = head(status.move_to(RunStatus::Waiting)?, Some(note.clone()));
            (to, Some(note), false, sent, parked_rows(&parked))
        }
        Ending::Review {
            error,
            note,
            status,
        } => {
            let to = checkpoint::Advance {
                error: Some(error),
                ..head(status.move_to(RunStatus::NeedsReview)?, Some(note))
            };
            (to, None, false, Vec::new(), Vec::new())
        }
    };
    Ok(checkpoint::StepCommit {
        run_id: msg.run_id.clone(),
        fence,
        step: msg.step.clone(),
        to,
        step_output,
        finished,
        inbox: (STEP_CONSUMER, msg.message_id),
        parked,
        outbox,
    })
}

/// Keeps the relay off rows this worker will publish itself after the commit (for
/// `relay.eager_grace_ms`, or until this process's presence connection is gone; 0 turns eager
/// publishing off and the relay publishes at once).
pub(super) fn hold_for_eager_publish(engine: &Engine, messages: &mut [OutgoingMessage]) {
    let holder = super::presence::pid(engine);
    for m in messages {
        m.relay_after_ms = engine.settings.relay.eager_grace_ms;
        m.holder_pid = holder;
    }
}

/// What the worker publishes itself once `messages` are committed: all of them, or none when
/// eager publishing is off.
pub(super) fn to_publish_eagerly(
    engine: &Engine,
    messages: &[OutgoingMessage],
) -> Vec<OutgoingMessage> {
    if engine.settings.relay.eager_grace_ms > 0 {
        messages.to_vec()
    } else {
        Vec::new()
    }
}

fn parked_rows(items: &[Parked]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|p| (p.item.clone(), p.reason.clone()))
        .collect()
}

/// Gives the lease back without advancing (the step will be retried from a delay queue).
pub(super) async fn release(
    engine: &Arc<Engine>,
    run_id: &RunId,
    fence: Fence,
) -> store::Result<()> {
    store::runs::release(&engine.pool, run_id, fence).await
}

/// The outbox row of a step message for `step` at position `seq` of a run.
pub fn step_message(
    engine: &Engine,
    run_id: &RunId,
    workflow: &str,
    version: i32,
    step: &StepAddress,
    seq: i32,
) -> OutgoingMessage {
    let msg = StepMessage {
        v: 1,
        message_id: MessageId::new(),
        run_id: run_id.clone(),
        workflow: workflow.to_owned(),
        version,
        step: step.clone(),
        seq,
    };
    let headers = BTreeMap::from([
        ("x-trailmark-run-id".to_owned(), run_id.to_string()),
        ("x-trailmark-step".to_owned(), step.to_string()),
    ]);
    OutgoingMessage {
        message_id: msg.message_id,
        exchange: engine.topology.steps_exchange(),
        routing_key: STEP_ROUTING_KEY.to_owned(),
        headers,
        body: msg.encode(),
        relay_after_ms: 0,
        holder_pid: None,
    }
}

fn next_message(engine: &Engine, msg: &StepMessage, next: &StepAddress) -> OutgoingMessage {
    step_message(
        engine,
        &msg.run_id,
        &msg.workflow,
        msg.version,
        next,
        msg.seq + 1,
    )
}

fn infra(e: impl std::error::Error + Send + Sync + 'static) -> store::Error {
    store::Error::unavailable("step commit interrupted", e)
}

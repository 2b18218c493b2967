//! Processing one step message: decode, dedup, claim, execute, commit.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use lapin::message::Delivery;
use tracing::Instrument;

use super::STEP_CONSUMER;
use super::commit::{self, Ending};
use super::lease::Heartbeat;
use super::outcome::{Disposition, dead};
use crate::domain::{RunStatus, StepMessage};
use crate::engine::{Engine, Stats};
use crate::store::{self, inbox, runs, steps};
use crate::workflow::{StepContext, StepDef, StepError, StepOutcome, Workflow};

/// Attempts at one step position before the run is handed to a person.
const MAX_ATTEMPTS: i32 = 5;

/// Processes a step delivery; `Err` means infrastructure failed and the delivery should be retried.
pub(super) async fn process(
    engine: &Arc<Engine>,
    delivery: &Delivery,
    owner: &str,
) -> store::Result<Disposition> {
    let msg = match StepMessage::decode(&delivery.data, engine.settings.worker.max_message_bytes) {
        Ok(m) => m,
        Err(e) => return Ok(dead(e.code(), e.to_string())),
    };
    let span = tracing::info_span!("step", run.id = %msg.run_id, workflow = %msg.workflow, step = %msg.step,
        seq = msg.seq, message.id = %msg.message_id, attempt = tracing::field::Empty, fence = tracing::field::Empty);
    process_message(engine, msg, owner).instrument(span).await
}

async fn process_message(
    engine: &Arc<Engine>,
    msg: StepMessage,
    owner: &str,
) -> store::Result<Disposition> {
    let Some(workflow) = engine.registry.get(&msg.workflow) else {
        return Ok(dead(
            "unknown_workflow",
            format!(
                "run {}: workflow {:?} is not registered in this worker (known: {}); deploy it, then requeue",
                msg.run_id,
                msg.workflow,
                engine.registry.names().join(", ")
            ),
        ));
    };
    if workflow.version != msg.version {
        return Ok(dead(
            "unknown_version",
            format!(
                "run {}: message is for {} v{}, this worker runs v{}; deploy that version, then requeue",
                msg.run_id, msg.workflow, msg.version, workflow.version
            ),
        ));
    }
    let Some(step) = workflow.find(&msg.step).cloned() else {
        return Ok(dead(
            "unknown_step",
            format!(
                "run {}: workflow {} v{} has no step {:?}",
                msg.run_id, msg.workflow, msg.version, msg.step
            ),
        ));
    };
    if inbox::seen(&engine.pool, STEP_CONSUMER, msg.message_id).await? {
        return Ok(Disposition::Duplicate);
    }
    let (ctx, claim_status) = match claim(engine, &msg, owner).await? {
        Claimed::Yes(ctx, status) => (ctx, status),
        Claimed::No(d) => return Ok(d),
    };
    let span = tracing::Span::current();
    span.record("attempt", ctx.attempt());
    span.record("fence", ctx.fence().0);
    Stats::bump(&engine.stats.handler_runs);
    let result = execute(engine, &step, ctx.clone()).await;
    finish(engine, &workflow, &msg, &ctx, claim_status, result).await
}

enum Claimed {
    Yes(StepContext, RunStatus),
    No(Disposition),
}

/// Takes the run's lease and counts the attempt, in one short transaction of its own so the
/// raised fence is durable before any outside call is made.
async fn claim(engine: &Arc<Engine>, msg: &StepMessage, owner: &str) -> store::Result<Claimed> {
    let lease = engine.settings.worker.lease_secs as f64;
    let mut tx = engine.pool.begin().await?;
    let Some(claim) = runs::claim(&mut *tx, &msg.run_id, msg.seq, owner, lease).await? else {
        tx.rollback().await?;
        return Ok(Claimed::No(why_not_claimed(engine, msg).await?));
    };
    let attempt = steps::begin_attempt(&mut *tx, &msg.run_id, msg.seq, &msg.step).await?;
    engine.failpoints.hit("step.after_claim").map_err(infra)?;
    tx.commit().await?;
    let status = claim.status.parse().unwrap_or(RunStatus::Running);
    let ctx = StepContext::new(
        engine.services.clone(),
        msg.run_id.clone(),
        &msg.workflow,
        &msg.step,
        msg.seq,
        attempt,
        claim.fence(),
        claim.input,
    );
    Ok(Claimed::Yes(ctx, status))
}

async fn why_not_claimed(engine: &Arc<Engine>, msg: &StepMessage) -> store::Result<Disposition> {
    let Some(run) = runs::get(&engine.pool, msg.run_id.as_str()).await? else {
        return Ok(dead(
            "unknown_run",
            format!("run {} does not exist in this database", msg.run_id),
        ));
    };
    let status = run.status();
    if !status.accepts_steps() {
        return Ok(Disposition::Stale(format!("run is {status}")));
    }
    if run.step_seq != msg.seq {
        return Ok(Disposition::Stale(format!(
            "run is at position {}, message is for {}",
            run.step_seq, msg.seq
        )));
    }
    // Another live worker holds the lease: wait in a delay queue rather than spin.
    Ok(Disposition::Delay(Duration::from_millis(
        engine.settings.worker.busy_retry_ms,
    )))
}

/// Runs the handler under a heartbeat; a lost lease or a panic becomes an error, never a crash.
async fn execute(
    engine: &Arc<Engine>,
    step: &StepDef,
    ctx: StepContext,
) -> Result<StepOutcome, StepError> {
    let heartbeat = Heartbeat::start(engine, ctx.run_id().clone(), ctx.fence());
    let run = AssertUnwindSafe((step.handler)(ctx)).catch_unwind();
    let result = tokio::select! {
        r = run => r.unwrap_or_else(|panic| Err(StepError::Unknown(format!("step handler panicked: {}", panic_text(&panic))))),
        _ = heartbeat.lost() => Err(StepError::FencedOut),
    };
    heartbeat.stop();
    result
}

async fn finish(
    engine: &Arc<Engine>,
    workflow: &Workflow,
    msg: &StepMessage,
    ctx: &StepContext,
    status: RunStatus,
    result: Result<StepOutcome, StepError>,
) -> store::Result<Disposition> {
    let ending = match result {
        Ok(outcome) => match workflow.resolve_next(&msg.step, &outcome.next) {
            Ok(next) => Ending::Advance {
                output: outcome.output,
                next,
                status,
                sent: ctx.take_outgoing(),
            },
            Err(e) => review(ctx, &e),
        },
        Err(StepError::FencedOut) => {
            return Ok(Disposition::Stale("fenced out while executing".into()));
        }
        Err(StepError::Infrastructure(e)) => return Err(store::Error::Unavailable(e)),
        Err(StepError::Temporary {
            reason,
            retry_after,
        }) if ctx.attempt() < MAX_ATTEMPTS => {
            let delay = retry_after.unwrap_or(Duration::from_secs(1 << ctx.attempt().min(8)));
            tracing::warn!(reason = %reason, delay_ms = delay.as_millis() as u64, "step failed temporarily; retrying later");
            commit::release(engine, &msg.run_id, ctx.fence()).await?;
            return Ok(Disposition::Delay(delay));
        }
        Err(e) => review(ctx, &e),
    };
    match commit::commit(engine, msg, ctx.fence(), ending).await {
        Ok(true) => {
            Stats::bump(&engine.stats.steps_committed);
            Ok(Disposition::Done)
        }
        Ok(false) => Ok(Disposition::Duplicate),
        Err(store::Error::FencedOut { .. }) => {
            Ok(Disposition::Stale("fenced out at commit".into()))
        }
        Err(e) => Err(e),
    }
}

fn review(ctx: &StepContext, e: &StepError) -> Ending {
    tracing::error!(error = %e, "step failed; run needs review");
    let note = format!(
        "run {} stopped at step {} (position {}, attempt {}): {e}",
        ctx.run_id(),
        ctx.step(),
        ctx.seq(),
        ctx.attempt()
    );
    Ending::Review { error: note }
}

fn infra(e: impl std::fmt::Display) -> store::Error {
    store::Error::Unavailable(e.to_string())
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic".into())
}

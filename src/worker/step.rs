//! Processing one step message: decode, dedup, claim, execute, commit.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use lapin::message::Delivery;

use super::STEP_CONSUMER;
use super::commit::{self, Ending};
use super::handover;
use super::lease::Heartbeat;
use super::outcome::{Disposition, dead};
use crate::domain::{RunStatus, StepAddress, StepMessage, UndoPlan};
use crate::engine::{Engine, Stats};
use crate::guard::Budget;
use crate::store::decisions;
use crate::store::{self, runs, steps};
use crate::workflow::{
    Next, Position, StepContext, StepDef, StepError, StepOutcome, UndoTarget, Workflow,
};

/// Processes a step delivery; `Err` means infrastructure failed and the delivery should be retried.
pub(super) async fn process(
    engine: &Arc<Engine>,
    delivery: &Delivery,
    owner: &str,
) -> store::Result<Disposition> {
    engine.failpoints.hit("worker.received").map_err(infra)?;
    let msg = match StepMessage::decode(&delivery.data, engine.settings.worker.max_message_bytes) {
        Ok(m) => m,
        Err(e) => return Ok(dead(e.code(), e.to_string())),
    };
    // The delivery's span (opened by `handle`) gets the step's ids, so every line logged while
    // processing and settling this delivery carries them.
    let span = tracing::Span::current();
    span.record("run.id", tracing::field::display(&msg.run_id));
    span.record("workflow", msg.workflow.as_str());
    span.record("step", msg.step.as_str());
    span.record("seq", msg.seq);
    process_message(engine, msg, owner).await
}

async fn process_message(
    engine: &Arc<Engine>,
    msg: StepMessage,
    owner: &str,
) -> store::Result<Disposition> {
    let (workflow, step) = match resolve(engine, &msg) {
        Ok(found) => found,
        Err(poison) => return Ok(poison),
    };
    let claimed = match claim(engine, &workflow, &msg, owner).await? {
        Claimed::Yes(c) => c,
        Claimed::No(d) => return Ok(d),
    };
    let ctx = &claimed.ctx;
    let span = tracing::Span::current();
    span.record("attempt", ctx.attempt());
    span.record("fence", ctx.fence().0);
    if let Some(stop) = refuse_before_running(engine, ctx, claimed.age_secs) {
        return finish(engine, &workflow, &msg, &claimed, Err(stop)).await;
    }
    if step.freeze_unless_clear
        && let Some(evidence) = doubt(engine, &msg).await?
    {
        tracing::warn!("items in doubt: step frozen until a person approves");
        return commit_ending(
            engine,
            &msg,
            ctx,
            Ending::Wait {
                note: evidence,
                sent: Vec::new(),
                parked: Vec::new(),
                status: claimed.status,
            },
        )
        .await;
    }
    Stats::bump(&engine.stats.handler_runs);
    let result = execute(engine, &step, ctx.clone()).await;
    finish(engine, &workflow, &msg, &claimed, result).await
}

/// Evidence of doubt before a frozen step: parked items and effects of unknown outcome, unless a
/// person already approved running this position.
async fn doubt(engine: &Engine, msg: &StepMessage) -> store::Result<Option<serde_json::Value>> {
    let run_id = msg.run_id.as_str();
    if decisions::approved(&engine.pool, run_id, msg.seq).await? {
        return Ok(None);
    }
    let evidence = handover::Evidence::gather(engine, msg).await?;
    if evidence.parked.is_empty() && evidence.unknown.is_empty() {
        return Ok(None);
    }
    Ok(Some(serde_json::json!({
        "waiting_for": "approval",
        "step": msg.step,
        "seq": msg.seq,
        "why": format!("step {} only runs when no item of the run is in doubt; approve to run it anyway, or reject", msg.step),
        "parked": evidence.parked,
        "effects_unknown": evidence.unknown,
    })))
}

fn resolve(engine: &Engine, msg: &StepMessage) -> Result<(Arc<Workflow>, StepDef), Disposition> {
    let Some(workflow) = engine.registry.get(&msg.workflow) else {
        return Err(dead(
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
        return Err(dead(
            "unknown_version",
            format!(
                "run {}: message is for {} v{}, this worker runs v{}; deploy that version, then requeue",
                msg.run_id, msg.workflow, msg.version, workflow.version
            ),
        ));
    }
    // A compensation runs the step's declared compensation.
    let found = workflow.find(msg.step.declared()).and_then(|def| {
        match (msg.step.is_undo(), &def.compensation) {
            (false, _) => Some(def.clone()),
            (true, Some(c)) => Some(StepDef {
                name: msg.step.to_string(),
                handler: c.handler.clone(),
                ..def.clone()
            }),
            (true, None) => None,
        }
    });
    let Some(step) = found else {
        return Err(dead(
            "unknown_step",
            format!(
                "run {}: workflow {} v{} has no step {:?}",
                msg.run_id, msg.workflow, msg.version, msg.step
            ),
        ));
    };
    Ok((workflow, step))
}

struct ClaimedStep {
    ctx: StepContext,
    status: RunStatus,
    age_secs: f64,
    plan: Option<UndoPlan>,
}

enum Claimed {
    Yes(ClaimedStep),
    No(Disposition),
}

/// Checks the inbox, takes the run's lease and counts the attempt, in one statement committed
/// on its own, so the raised fence is durable before any outside call is made.
async fn claim(
    engine: &Arc<Engine>,
    workflow: &Workflow,
    msg: &StepMessage,
    owner: &str,
) -> store::Result<Claimed> {
    let request = runs::ClaimRequest {
        run_id: msg.run_id.clone(),
        seq: msg.seq,
        step: msg.step.clone(),
        owner: owner.to_owned(),
        lease_secs: engine.settings.worker.lease_secs as f64,
        presence_pid: super::presence::pid(engine),
        message: (STEP_CONSUMER, msg.message_id),
    };
    let claim = match claim_or_recheck(engine, msg, &request).await? {
        Ok(claim) => claim,
        Err(disposition) => return Ok(Claimed::No(disposition)),
    };
    engine.failpoints.hit("step.after_claim").map_err(infra)?;
    let status = claim.status;
    let undo = undo_target(engine, msg, claim.undo.as_ref()).await?;
    let pos = Position {
        run_id: msg.run_id.clone(),
        workflow: msg.workflow.clone(),
        step: msg.step.clone(),
        seq: msg.seq,
        attempt: claim.attempt,
        journaled: claim.journaled,
        fence: claim.fence,
        budget: workflow
            .budget
            .unwrap_or_else(|| Budget::from_settings(&engine.settings.guards)),
        input: claim.input,
        undo,
    };
    let ctx = StepContext::new(engine.services.clone(), pos);
    Ok(Claimed::Yes(ClaimedStep {
        ctx,
        status,
        age_secs: claim.age_secs,
        plan: claim.undo,
    }))
}

/// For a compensation: the original step's checkpoint and the operator's scope.
async fn undo_target(
    engine: &Engine,
    msg: &StepMessage,
    plan: Option<&UndoPlan>,
) -> store::Result<Option<UndoTarget>> {
    let Some((step, seq)) = msg.step.undo_of() else {
        return Ok(None);
    };
    let output = steps::output_at(&engine.pool, &msg.run_id, seq)
        .await?
        .unwrap_or_default();
    let scope = plan
        .map(|p| p.scope.clone())
        .unwrap_or_else(|| serde_json::json!({}));
    Ok(Some(UndoTarget {
        step: step.to_owned(),
        seq,
        output,
        scope,
    }))
}

/// Pauses before re-trying a claim refused because another worker holds the lease. A message
/// redelivered from a worker that was just killed usually arrives before that worker's presence
/// backend has exited (milliseconds later), and a delay queue would hold it for a whole second.
const BUSY_RECHECKS_MS: [u64; 3] = [10, 40, 150];

/// Claims, re-checking a busy lease a few times within about 0.2 s before giving up on it.
async fn claim_or_recheck(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    request: &runs::ClaimRequest,
) -> store::Result<Result<runs::Claim, Disposition>> {
    let mut pauses = BUSY_RECHECKS_MS.iter();
    loop {
        let why = match engine.services.claim(request.clone()).await? {
            runs::ClaimOutcome::Claimed(claim) => return Ok(Ok(claim)),
            runs::ClaimOutcome::Duplicate => return Ok(Err(Disposition::Duplicate)),
            runs::ClaimOutcome::Refused(why) => why,
        };
        match (why, pauses.next()) {
            (runs::Refusal::Busy, Some(ms)) => tokio::time::sleep(Duration::from_millis(*ms)).await,
            (why, _) => return Ok(Err(not_claimed(engine, msg, why))),
        }
    }
}

/// What becomes of a delivery whose claim was refused.
fn not_claimed(engine: &Engine, msg: &StepMessage, why: runs::Refusal) -> Disposition {
    match why {
        runs::Refusal::UnknownRun => dead(
            "unknown_run",
            format!("run {} does not exist in this database", msg.run_id),
        ),
        runs::Refusal::Status(status) => Disposition::Stale(format!("run is {status}")),
        runs::Refusal::Position(seq) => Disposition::Stale(format!(
            "run is at position {seq}, message is for {}",
            msg.seq
        )),
        // Still busy after the re-checks: wait in a delay queue rather than spin.
        runs::Refusal::Busy => {
            Disposition::Delay(Duration::from_millis(engine.settings.worker.busy_retry_ms))
        }
    }
}

/// Guards checked before the handler runs: the attempt cap (so a step that kills its worker
/// every time still ends) and the run's hard timeout.
fn refuse_before_running(engine: &Engine, ctx: &StepContext, age_secs: f64) -> Option<StepError> {
    let max = engine.settings.worker.max_attempts;
    if ctx.attempt() > max {
        return Some(StepError::Guard(format!(
            "step {} was claimed {} times without finishing (worker.max_attempts = {max}); it may be crashing its worker or failing every time",
            ctx.step(),
            ctx.attempt() - 1
        )));
    }
    let limit = engine.settings.guards.run_timeout_secs;
    if limit > 0 && age_secs > limit as f64 {
        return Some(StepError::Guard(format!(
            "run timed out: it started {age_secs:.0} s ago, guards.run_timeout_secs is {limit}"
        )));
    }
    None
}

/// Runs the handler under a heartbeat and the step's soft timeout; a lost lease or a panic
/// becomes an error, never a crash.
async fn execute(
    engine: &Arc<Engine>,
    step: &StepDef,
    ctx: StepContext,
) -> Result<StepOutcome, StepError> {
    let heartbeat = Heartbeat::start(engine, ctx.run_id().clone(), ctx.fence());
    let timeout = Duration::from_secs(engine.settings.worker.step_timeout_secs);
    let run = AssertUnwindSafe((step.handler)(ctx)).catch_unwind();
    let result = tokio::select! {
        r = tokio::time::timeout(timeout, run) => match r {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(StepError::Unknown(format!("step handler panicked: {}", panic_text(&panic)))),
            Err(_) => Err(StepError::temporary(format!("step timed out after {} s (worker.step_timeout_secs)", timeout.as_secs()))),
        },
        _ = heartbeat.lost() => Err(StepError::FencedOut),
    };
    heartbeat.stop();
    result
}

async fn finish(
    engine: &Arc<Engine>,
    workflow: &Workflow,
    msg: &StepMessage,
    claimed: &ClaimedStep,
    result: Result<StepOutcome, StepError>,
) -> store::Result<Disposition> {
    let (ctx, status) = (&claimed.ctx, claimed.status);
    let max = engine.settings.worker.max_attempts;
    let failure = match result {
        Ok(StepOutcome {
            output,
            next: Next::Wait,
        }) => {
            let note = serde_json::json!({ "waiting_for": "decision", "step": msg.step, "seq": msg.seq, "question": output });
            let (sent, parked) = ctx.take_pending();
            let ending = Ending::Wait {
                note,
                sent,
                parked,
                status,
            };
            return commit_ending(engine, msg, ctx, ending).await;
        }
        Ok(outcome) => match next_step(workflow, msg, claimed, &outcome.next) {
            Ok(next) => {
                let (sent, parked) = ctx.take_pending();
                let ending = Ending::Advance {
                    output: outcome.output,
                    next,
                    status,
                    sent,
                    parked,
                };
                return commit_ending(engine, msg, ctx, ending).await;
            }
            Err(e) => e,
        },
        Err(StepError::FencedOut) => {
            return Ok(Disposition::Stale("fenced out while executing".into()));
        }
        Err(StepError::Infrastructure(e)) => {
            return Err(store::Error::Unavailable {
                what: e,
                source: None,
            });
        }
        Err(StepError::Temporary {
            reason,
            retry_after,
        }) if ctx.attempt() < max => {
            let base = engine.settings.worker.retry_base_ms;
            let delay = retry_after.unwrap_or(Duration::from_millis(
                base.saturating_mul(1 << (ctx.attempt() - 1).clamp(0, 16)),
            ));
            tracing::warn!(reason = %reason, delay_ms = delay.as_millis() as u64, "step failed temporarily; retrying later");
            commit::release(engine, &msg.run_id, ctx.fence()).await?;
            return Ok(Disposition::Delay(delay));
        }
        Err(StepError::Temporary { reason, .. }) => StepError::Guard(format!(
            "step {} failed temporarily {} times (worker.max_attempts); last error: {reason}",
            msg.step,
            ctx.attempt()
        )),
        Err(e) => e,
    };
    tracing::error!(error = %failure, class = failure.class(), "step failed; run needs review");
    let note = handover::note(engine, msg, ctx.attempt(), &failure).await?;
    let error = format!(
        "run {} stopped at step {} (position {}, attempt {}): {failure}",
        ctx.run_id(),
        ctx.step(),
        ctx.seq(),
        ctx.attempt()
    );
    let ending = Ending::Review {
        error,
        note,
        status,
    };
    commit_ending(engine, msg, ctx, ending).await
}

/// The step after this one: the next compensation while undoing, else the workflow's choice.
fn next_step(
    workflow: &Workflow,
    msg: &StepMessage,
    claimed: &ClaimedStep,
    next: &Next,
) -> Result<Option<StepAddress>, StepError> {
    if msg.step.is_undo() {
        return Ok(claimed.plan.as_ref().and_then(|p| p.after(&msg.step)));
    }
    workflow.resolve_next(&msg.step, next)
}

async fn commit_ending(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    ctx: &StepContext,
    ending: Ending,
) -> store::Result<Disposition> {
    match commit::commit(engine, msg, ctx.fence(), ending).await {
        Ok(Some(queued)) => {
            Stats::bump(&engine.stats.steps_committed);
            Ok(Disposition::Committed(queued))
        }
        Ok(None) => Ok(Disposition::Duplicate),
        Err(store::Error::FencedOut { .. }) => {
            Ok(Disposition::Stale("fenced out at commit".into()))
        }
        Err(e) => Err(e),
    }
}

fn infra(e: crate::failpoint::Injected) -> store::Error {
    store::Error::unavailable("step interrupted", e)
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic".into())
}

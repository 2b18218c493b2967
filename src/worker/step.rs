//! The path of one step message, top to bottom: resolve the step, claim the run's lease
//! (dedup, fence + 1, attempt), run the handler under a heartbeat, decide how it ended
//! (`ending.rs`, no I/O), then commit it in one statement or give the lease back. The statements
//! themselves belong to the step transaction (`step_tx.rs`).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use serde_json::Value;
use tracing::Instrument;

use super::STEP_CONSUMER;
use super::ending::{self, Claimed, Ending, Limits, Verdict};
use super::handover::{self, Evidence};
use super::lease::Heartbeat;
use super::outcome::{Disposition, dead};
use super::published;
use super::version_wait::{self, Waited};
use super::{preclaim, step_tx};
use crate::domain::{
    LocalWrite, MessageId, OutgoingMessage, RunStatus, ShadowWrite, StepMessage, Transition,
    UndoPlan,
};
use crate::engine::{Engine, Stats};
use crate::failpoint::Injected;
use crate::guard::Budget;
use crate::metrics;
use crate::store::checkpoint::{Committed, PreClaim, StepCommit};
use crate::store::{self, decisions, runs, shadow, steps};
use crate::trace::{Attempt, StepSpan};
use super::published::Eager;
use crate::flow::Concurrency;
use crate::flow::gate::{self, Gated};
use crate::workflow::{
    IDEMPOTENCY_KEY_HEADER, Position, Records, StepContext, StepDef, StepError, StepOutcome,
    UndoTarget, Workflow,
};

/// Processes a decoded step message to its disposition; `Err` means trailmark's own
/// infrastructure failed and the delivery is retried in place (it stays unacknowledged).
pub(super) async fn process(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    (owner, redelivered, waited): (&str, bool, Option<Waited>),
) -> store::Result<Disposition> {
    engine.failpoints.hit("worker.received").map_err(infra)?;
    // 1. The workflow and step it names, at the run's version, carried by this worker. A step
    //    of a version carried only elsewhere (or newer than any here) waits for a worker that
    //    carries it, for a bounded time, while its run waits for it.
    if let Some(elsewhere) = version_wait::elsewhere(engine, msg, waited).await? {
        return version_wait::process(engine, msg, elsewhere, waited).await;
    }
    let (workflow, step) = match resolve(engine, msg) {
        Ok(found) => found,
        Err(poison) => return Ok(poison),
    };
    // 2. Claim: inbox check, lease, fence + 1 and attempt, committed before anything runs (or
    //    made by the previous step's commit: a pre-claim).
    let concurrency = workflow.flow.concurrency.as_ref();
    let (claim, handed) = match claim(engine, msg, (owner, redelivered), concurrency).await? {
        (Ok(claim), handed) => (claim, handed),
        (Err(not_claimed), handed) => return Ok(with_handed(not_claimed, handed)),
    };
    engine.failpoints.hit("step.after_claim").map_err(infra)?;
    if claim.attempt > 1 {
        metrics::resumed("redelivery", 1);
        say_resuming(engine, msg, claim.attempt).await?;
    }
    if claim.took_over {
        metrics::lease_taken_over(1);
    }
    let started = std::time::Instant::now();
    let with_trace;
    let msg = match run_trace(engine, msg).await? {
        Some(trace) => {
            with_trace = StepMessage { trace: Some(trace), ..msg.clone() };
            &with_trace
        }
        None => msg,
    };
    let at = Attempt {
        run_id: msg.run_id.as_str(),
        step: msg.step.as_str(),
        seq: msg.seq,
        attempt: claim.attempt,
        fence: claim.fence.0,
    };
    trace_interrupted(engine, msg, &at, claim.took_over).await;
    let span = StepSpan::start(msg.trace.as_deref(), &at);
    // Every line of this attempt carries it and the fence it holds; a retried delivery gets a
    // span of its own for its next attempt.
    // `tokens` and `cost`: what this attempt paid the model, recorded once the handler is done,
    // so the commit line says it.
    let attempt = tracing::info_span!(
        "claimed",
        attempt = claim.attempt,
        fence = claim.fence.0,
        tokens = tracing::field::Empty,
        cost = tracing::field::Empty
    );
    let ended = run_claimed(engine, msg, &workflow, step.as_ref(), (&claim, &span))
        .instrument(attempt)
        .await;
    let outcome = ended.as_ref().map_or("infrastructure", |(o, _)| *o);
    span.end(outcome);
    // The step's declared name: a compensation's address carries a position, an unbounded label.
    let label = match msg.step.undo_of() {
        Some((step, _)) => format!("undo:{step}"),
        None => msg.step.to_string(),
    };
    metrics::step_finished(&msg.workflow, &label, outcome, started.elapsed());
    let disposition = with_handed(ended.map(|(_, disposition)| disposition)?, handed);
    if claim.preclaimed && matches!(disposition, Disposition::Stale(_)) {
        // Nothing checks a pre-claim before its step starts. Fenced out, it may have been taken
        // by a worker that has since given the lease back and left the step to this very
        // message (a temporary failure's delay-queue copy): dropping it would strand the run.
        // The claim statement decides instead (duplicate, run moved on, busy, or ours).
        tracing::info!("the step's pre-claim was no longer the run's; claiming the step");
        return Box::pin(process(engine, msg, (owner, redelivered, waited))).await;
    }
    Ok(disposition)
}

/// Steps 3 and 4 for a claimed step: guards and handler, then its ending; with the outcome's
/// name for the step-duration metric.
async fn run_claimed(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    workflow: &Workflow,
    step: Option<&StepDef>,
    (claim, span): (&runs::Claim, &StepSpan),
) -> store::Result<(&'static str, Disposition)> {
    let claimed = Claimed {
        attempt: claim.attempt,
        plan: claim.undo.as_ref(),
    };
    let limits = Limits {
        max_attempts: engine.settings.worker.max_attempts,
        retry_base_ms: engine.settings.worker.retry_base_ms,
        max_wait_secs: engine.settings.waits.max_secs,
    };
    // The lease is renewed until the step's ending is committed: a commit waiting for a
    // connection must not see its lease expire and the step taken over.
    let heartbeat = Heartbeat::start(engine, (msg.run_id.clone(), msg.seq), claim.fence);
    let look = SlotLook::start(engine, msg, claim);
    // 3. Run the handler, unless a guard or a doubt about the run's items stops it first.
    let run_timeout = engine.settings.guards.run_timeout_secs;
    let refused = ending::refuse_before_running(msg, claimed, limits, claim.age_secs, run_timeout)
        .or_else(|| ending::refuse_older_version(msg, workflow.version));
    // A compensation of a step that started children undoes them first (`undoing.rs`).
    let instead = match refused {
        None => super::undoing::before(engine, msg, claim.undo.as_ref()).await?,
        Some(_) => None,
    };
    let (verdict, answers_flushed) = match (refused, step, instead) {
        // A review commit is never relaxed: no flush to vouch for.
        (Some(stop), _, _) => (Verdict::Review(stop), false),
        // No handler ran: no model answer to flush.
        (None, _, Some(instead)) => (instead, true),
        (None, Some(step), None) => {
            let at = (claim, span, &heartbeat);
            run_step(engine, msg, (workflow, step), at, (claimed, limits)).await?
        }
        // resolve gives no step only for a run of an older version, refused above.
        (None, None, None) => (
            Verdict::Review(StepError::Unknown(format!(
                "workflow {} v{} has no step {}",
                msg.workflow, workflow.version, msg.step
            ))),
            false,
        ),
    };
    // 4. Commit the ending, give the lease back for a retry, or drop the void work.
    let mut outcome = verdict.outcome();
    let disposition = match verdict {
        Verdict::Commit(ending) => {
            match commit(engine, msg, (claim, look), ending, answers_flushed).await {
                // The row a local write brought was refused, and with it the whole commit: the
                // run stops at the step, which wrote nothing.
                Err(refused @ store::Error::LocalWrite { .. }) => {
                    outcome = "review";
                    review(engine, msg, claim, StepError::Conflict(refused.to_string())).await?
                }
                committed => committed?,
            }
        }
        Verdict::Review(failure) => review(engine, msg, claim, failure).await?,
        Verdict::Retry {
            delay,
            reason,
            counted,
            class,
        } => {
            let why = (reason.as_str(), class);
            retry_later(engine, msg, claim, (delay, counted), why, limits).await?;
            // A Delay disposition publishes nothing: the relay takes the handed runs' messages.
            hand_on(engine, msg, claim, (false, None)).await;
            Disposition::Delay(delay)
        }
        Verdict::Stale(why) => {
            // Said like a heartbeat that finds the lease gone: whichever notices first.
            tracing::warn!(
                why,
                "fenced out: a newer worker owns the run; this attempt's work is dropped"
            );
            Disposition::Stale(why.into())
        }
        Verdict::Infrastructure(what) => {
            return Err(store::Error::Unavailable { what, source: None });
        }
    };
    heartbeat.stop();
    Ok((outcome, disposition))
}

/// Gives the lease back for a retry after `delay` and says so in the run's progress. A wait on an
/// open breaker or a model's rate limit (`counted` false; `class` says which) gives the claim's
/// attempt back with it.
async fn retry_later(
    engine: &Engine,
    msg: &StepMessage,
    claim: &runs::Claim,
    (delay, counted): (Duration, bool),
    (reason, class): (&str, &'static str),
    limits: Limits,
) -> store::Result<()> {
    let line = if counted {
        metrics::step_retried("temporary");
        tracing::warn!(reason = %reason, delay_ms = delay.as_millis() as u64, "step failed temporarily; retrying later");
        format!(
            "step {} (position {}) failed temporarily, attempt {} of {}: {reason}; retrying in {:.0} s",
            msg.step,
            msg.seq,
            claim.attempt,
            limits.max_attempts,
            delay.as_secs_f64()
        )
    } else {
        metrics::step_retried(class);
        // Debug: every waiting step says this at each return; the breaker itself logs opening
        // and closing, and the rate limits count their refusals (`trailmark_model_throttled_total`).
        tracing::debug!(reason = %reason, class, delay_ms = delay.as_millis() as u64, "step waits without spending an attempt");
        format!(
            "step {} (position {}) {reason}; back in {:.0} s, {} of {} attempts used",
            msg.step,
            msg.seq,
            delay.as_secs_f64(),
            claim.attempt - 1,
            limits.max_attempts,
        )
    };
    engine.step_tx.progress(&msg.run_id, msg.seq, line);
    engine
        .step_tx
        .release((&msg.run_id, msg.seq), claim.fence, (delay, !counted), reason)
        .await
}

/// Stops the run at the step for a person: the handover note (with the run's effects), then the
/// review commit.
async fn review(
    engine: &Engine,
    msg: &StepMessage,
    claim: &runs::Claim,
    failure: StepError,
) -> store::Result<Disposition> {
    tracing::error!(error = %failure, class = failure.class(), "step failed; run needs review");
    let evidence = Evidence::gather(&engine.pool, msg).await?;
    let ending = Ending::Review {
        error: ending::review_line(msg, claim.attempt, &failure),
        class: failure.class(),
        note: handover::note(msg, claim.attempt, &failure, evidence),
    };
    // A run stopped for a person gives its slot up.
    commit(engine, msg, (claim, SlotLook::Known(false)), ending, false).await
}

/// The step's handler (or its freeze), the verdict on what it returned, and whether every model
/// answer the attempt journaled is flushed already (see `StepContext::answers_flushed`).
async fn run_step(
    engine: &Arc<Engine>,
    msg: &StepMessage,
    (workflow, step): (&Workflow, &StepDef),
    (claim, span, heartbeat): (&runs::Claim, &StepSpan, &Heartbeat),
    (claimed, limits): (Claimed<'_>, Limits),
) -> store::Result<(Verdict, bool)> {
    let mut answers_flushed = true;
    let verdict = if step.freeze_unless_clear
        && let Some(evidence) = doubt(engine, msg).await?
    {
        tracing::warn!("items in doubt: step frozen until a person approves");
        Verdict::Commit(Ending::Wait {
            note: evidence,
            sent: Vec::new(),
            parked: Vec::new(),
            writes: Vec::new(),
        })
    } else {
        let ctx = context(engine, workflow, msg, claim, span.clone()).await?;
        Stats::bump(&engine.stats.handler_runs);
        // A wait that would spend no attempt counts after all when the attempt did what must
        // count (see `StepContext::counted_wait`).
        let result = (execute(engine, step, ctx.clone(), heartbeat).await)
            .map_err(|e| ctx.counted_wait(e));
        let (tokens, cost) = ctx.paid();
        if tokens > 0 {
            let span = tracing::Span::current();
            span.record("tokens", tokens);
            span.record("cost", cost);
        }
        ctx.trace_totals();
        answers_flushed = ctx.answers_flushed();
        let mut pending = ctx.take_pending();
        if claim.shadow {
            // Never queued nor written; recorded only when the handler finished (a failed
            // attempt's messages and rows would not have left a live run either).
            let would_send = std::mem::take(&mut pending.sent);
            let would_write = std::mem::take(&mut pending.writes);
            if result.is_ok() {
                shadow_writes(engine, msg, would_send, would_write).await?;
            }
        }
        ending::decide((workflow, &engine.registry), msg, claimed, limits, result, pending)
    };
    Ok((verdict, answers_flushed))
}

/// The run's trace context for this delivery: its `traceparent` header; without one (a step
/// queued by an operator's resume or a wake-up) the one stored on the run, read only when
/// tracing is on. `None` when the header is there already or there is none.
async fn run_trace(engine: &Engine, msg: &StepMessage) -> store::Result<Option<String>> {
    if msg.trace.is_some() || !crate::trace::enabled() {
        return Ok(None);
    }
    runs::traceparent(&engine.pool, msg.run_id.as_str()).await
}

/// Records the span of the attempt before `at` when its worker died holding the lease (kill -9,
/// a lost host): its own span died unended with the process. Only when tracing is on and this
/// claim took a lease another owner held (a released lease, a retry in place or a lease the
/// supervisor voided follows an attempt that ended, or may still end, its own span). That
/// attempt held the fence just below this one (a takeover raises it by one). The one extra read
/// is made on takeovers only; a failure to make it costs the trace that span, not the step.
async fn trace_interrupted(engine: &Engine, msg: &StepMessage, at: &Attempt<'_>, took_over: bool) {
    if !took_over || at.attempt < 2 || !crate::trace::enabled() {
        return;
    }
    let before = Attempt { attempt: at.attempt - 1, fence: at.fence - 1, ..*at };
    match steps::interrupted_window(&engine.pool, at.run_id, at.seq, before.attempt).await {
        Ok(Some((start, end))) => {
            crate::trace::interrupted(msg.trace.as_deref(), &before, (start.into(), end.into()));
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(run.id = %msg.run_id, seq = msg.seq, error = %e, "the interrupted attempt's span is left out of the trace: its step row could not be read");
        }
    }
}

/// Tells the people waiting on the run that a step runs again, and from where.
async fn say_resuming(engine: &Engine, msg: &StepMessage, attempt: i32) -> store::Result<()> {
    let since = match msg.seq.checked_sub(1) {
        Some(prev) => steps::finished_at(&engine.pool, &msg.run_id, prev)
            .await?
            .map(|t| {
                format!(
                    "the checkpoint of position {prev} ({})",
                    t.format("%H:%M:%S")
                )
            })
            .unwrap_or_else(|| format!("the checkpoint of position {prev}")),
        None => "the start of the run".to_owned(),
    };
    let resumed = decisions::resumed_into(&engine.pool, msg.run_id.as_str(), msg.seq, attempt).await?;
    let why = match resumed {
        Some((actor, reason)) => format!("resumed by {actor} ({reason})"),
        None => "the previous attempt did not finish".to_owned(),
    };
    let line = format!(
        "step {} (position {}), attempt {attempt}: {why}; resuming from {since}",
        msg.step, msg.seq
    );
    engine.step_tx.progress(&msg.run_id, msg.seq, line);
    Ok(())
}

/// The workflow and the step definition the message names, or the dead letter for a message
/// this worker cannot execute. A compensation runs its step's declared compensation.
/// The run's own version when carried here, else the newest (for a run of an older version no
/// live worker carries, refused below). The step is `None` only for such a run whose step the
/// newest version lacks (a step of a newer version never gets here: `version_wait.rs`).
fn resolve(
    engine: &Engine,
    msg: &StepMessage,
) -> Result<(Arc<Workflow>, Option<StepDef>), Disposition> {
    let Some(workflow) = engine.registry.for_run(&msg.workflow, msg.version) else {
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
    let found = workflow.find(msg.step.declared()).map(|def| {
        let handler = match (msg.step.is_undo(), &def.compensation) {
            (false, _) => return def.clone(),
            (true, Some(c)) => c.handler.clone(),
            // In an undo's plan only for the children it started (`undoing.rs` moves on
            // without a handler); a plan never names it otherwise.
            (true, None) => no_compensation(),
        };
        StepDef {
            name: msg.step.to_string(),
            handler,
            ..def.clone()
        }
    });
    // A run of an older version is claimed and stopped for review with advice (its step may
    // be gone from this version): see `ending::refuse_before_running`.
    if msg.version < workflow.version {
        return Ok((workflow, found));
    }
    let Some(step) = found else {
        return Err(dead(
            "unknown_step",
            format!(
                "run {}: workflow {} v{} has no step {:?}",
                msg.run_id, msg.workflow, msg.version, msg.step
            ),
        ));
    };
    Ok((workflow, Some(step)))
}

/// The handler of a compensation the step does not declare: it stops the run for review,
/// saying so (a plan names such a step only for its children, and then no handler runs).
fn no_compensation() -> crate::workflow::Handler {
    Arc::new(|ctx: StepContext| {
        Box::pin(async move {
            Err(StepError::Unknown(format!(
                "{} has no compensation declared in this build; deploy the build that declares it, or undo the run with a build that has it",
                ctx.step()
            )))
        })
    })
}

/// Pauses before re-trying a claim refused because another worker holds the lease. A message
/// redelivered from a worker that was just killed usually arrives before that worker's presence
/// backend has exited (milliseconds later), and a delay queue would hold it for a whole second.
const BUSY_RECHECKS_MS: [u64; 3] = [10, 40, 150];

/// Claims the run for this delivery, re-checking a busy lease a few times within about 0.2 s;
/// `Err` is what becomes of a delivery that was not claimed. A first delivery for which the
/// previous step's commit claimed the position here starts on that claim (`preclaim.rs`).
async fn claim(
    engine: &Engine,
    msg: &StepMessage,
    (owner, redelivered): (&str, bool),
    concurrency: Option<&Concurrency>,
) -> store::Result<(Result<runs::Claim, Disposition>, Vec<Eager>)> {
    let lease = engine.settings.worker.lease();
    let at = (&msg.run_id, msg.seq);
    let unstarted_preclaim = match engine.step_tx.preclaims.take(msg.message_id, at, (lease, redelivered)) {
        preclaim::Taken::Claim(claim) => {
            Stats::bump(&engine.stats.preclaims_used);
            return Ok((Ok(claim), Vec::new()));
        }
        preclaim::Taken::Unstarted => true,
        preclaim::Taken::Nothing => false,
    };
    let request = runs::ClaimRequest {
        run_id: msg.run_id.clone(),
        seq: msg.seq,
        version: msg.version,
        step: msg.step.clone(),
        owner: owner.to_owned(),
        lease_secs: engine.settings.worker.lease_secs as f64,
        presence_pid: super::presence::pid(engine),
        message: (STEP_CONSUMER, msg.message_id),
        redelivered,
        unstarted_preclaim,
    };
    let mut pauses = BUSY_RECHECKS_MS.iter();
    let mut handed = Vec::new();
    loop {
        let (outcome, key) = match concurrency {
            Some(declared) => match gated(engine, msg, declared, &request, &mut handed).await? {
                Ok(claimed) => claimed,
                Err(waits) => return Ok((Err(waits), handed)),
            },
            None => (engine.step_tx.claim(request.clone()).await?, None),
        };
        let why = match outcome {
            runs::ClaimOutcome::Claimed(claim) => {
                return Ok((Ok(runs::Claim { flow: key, ..claim }), handed));
            }
            runs::ClaimOutcome::Duplicate => {
                let dup = Disposition::Duplicate("the step message was processed before");
                return Ok((Err(dup), handed));
            }
            runs::ClaimOutcome::Refused(why) => why,
        };
        match (why, pauses.next()) {
            (runs::Refusal::Busy, Some(ms)) => tokio::time::sleep(Duration::from_millis(*ms)).await,
            (runs::Refusal::UnknownRun, _) => {
                return Ok((Err(no_run(engine, &msg.run_id).await?), handed));
            }
            (why, _) => return Ok((Err(not_claimed(engine, msg, why)), handed)),
        }
    }
}

/// A keyed run's claim through its key's gate (`flow::gate`): the claim's outcome and the key
/// whose slot it holds, or the acknowledgement of a delivery whose run now waits for a slot.
/// A run without a key (an optional one it lacks) is claimed as any other.
async fn gated(
    engine: &Engine,
    msg: &StepMessage,
    declared: &Concurrency,
    request: &runs::ClaimRequest,
    handed: &mut Vec<Eager>,
) -> store::Result<Result<(runs::ClaimOutcome, Option<store::flow::Held>), Disposition>> {
    let publish = published::publishes_eagerly(engine).then(|| published::eager_hold(engine));
    let ask = gate::Ask {
        msg: msg.clone(),
        declared: declared.clone(),
        request: request.clone(),
        reserve_secs: engine.settings.worker.lease_secs as f64,
        aging_secs: engine.settings.flow.aging_secs as f64,
        publish,
    };
    let (answer, ran) = engine.step_tx.gate(ask).await?;
    handed.extend(published::to_publish_eagerly(engine, ran.messages, &ran.rows));
    let Some((gated, key)) = answer else {
        return Ok(Ok((engine.step_tx.claim(request.clone()).await?, None)));
    };
    match gated {
        Gated::Claimed(outcome) => Ok(Ok((outcome, Some(key)))),
        Gated::Waits(line) => {
            tracing::debug!(line = %line, "step waits for a slot of its key");
            engine.step_tx.lines.forget(&msg.workflow, &key.key);
            metrics::flow_waited(&msg.workflow);
            engine.step_tx.progress(&msg.run_id, msg.seq, line);
            Ok(Err(Disposition::Committed(Vec::new())))
        }
    }
}

/// Hands the slot a keyed step's end freed (the lease given up, not carried to the run's next
/// step) to the runs in line, best effort: the supervisor's loop hands what this leaves. Their
/// messages, for this worker to publish (`eager`), else for the relay at once. `waits`: whether
/// anyone waits, when already looked up.
async fn hand_on(
    engine: &Engine,
    msg: &StepMessage,
    claim: &runs::Claim,
    (eager, waits): (bool, Option<bool>),
) -> Vec<Eager> {
    let (Some(held), Some(declared)) = (&claim.flow, concurrency_of(engine, msg)) else {
        return Vec::new();
    };
    let waits = match waits {
        Some(waits) => waits,
        None => anyone_waits(engine, msg, claim).await,
    };
    if !waits {
        return Vec::new();
    }
    let key = held.key.as_str();
    let hold = |m: &mut [OutgoingMessage]| {
        if eager {
            published::hold_for_eager_publish(engine, m)
        }
    };
    let handed = match gate::hand_on(engine, &declared, (&msg.workflow, key), hold).await {
        Ok(handed) => handed,
        Err(e) => {
            tracing::warn!(error = %crate::error::Report(&e), key, "could not hand the freed slot on; the supervisor's loop will");
            return Vec::new();
        }
    };
    match eager {
        true => published::to_publish_eagerly(engine, handed.messages, &handed.rows),
        false => Vec::new(),
    }
}

/// Whether any run waits in the line of the key `claim` holds (any of the workflow's, under a
/// total): only then does a freed slot go through the locked hand-off. One index probe; a
/// failure counts as no (the supervisor's loop hands what this leaves).
async fn anyone_waits(engine: &Engine, msg: &StepMessage, claim: &runs::Claim) -> bool {
    let Some(held) = &claim.flow else {
        return false;
    };
    let key = held.key.as_str();
    if engine.step_tx.lines.empty(&msg.workflow, key, held.shared) {
        return false;
    }
    match store::flow::anyone_waits(&engine.pool, (&msg.workflow, key), held.shared).await {
        Ok(waits) => {
            engine.step_tx.lines.saw(&msg.workflow, key, held.shared, !waits);
            waits
        }
        Err(e) => {
            tracing::warn!(error = %crate::error::Report(&e), key, "could not see whether runs wait for the freed slot; the supervisor's loop will hand it");
            false
        }
    }
}

/// The concurrency limits `msg`'s workflow declares at the run's version (the newest when this
/// build does not carry it).
fn concurrency_of(engine: &Engine, msg: &StepMessage) -> Option<Concurrency> {
    let workflow = engine.registry.for_run(&msg.workflow, msg.version)?;
    workflow.flow.concurrency.clone()
}

/// Whether a keyed step's end keeps its slot for the run's next step (pre-claims it): unless a
/// rate applies or a run waits that should go first (one ranked ahead of it, or any under a
/// workflow total, whose keys take turns). So the runs holding slots go on to their end while
/// younger runs wait, instead of every step going round the line. Looked up while the handler
/// runs, so its round trip overlaps the step instead of adding to it (a quarter of a keyed
/// step's time in `bench --flow`); a run that starts waiting during the step is seen at the
/// run's next step's end.
enum SlotLook {
    /// Known without a look: no key (kept), or a rate (given up).
    Known(bool),
    /// The look at the key's line, under way.
    Looking(tokio::task::JoinHandle<store::Result<bool>>),
}

impl SlotLook {
    fn start(engine: &Arc<Engine>, msg: &StepMessage, claim: &runs::Claim) -> Self {
        let held = match &claim.flow {
            None => return Self::Known(true),
            Some(held) if held.paced => return Self::Known(false),
            Some(held) => held.clone(),
        };
        if engine.step_tx.lines.empty(&msg.workflow, &held.key, held.shared) {
            return Self::Known(true);
        }
        let (engine, workflow, run_id) = (engine.clone(), msg.workflow.clone(), msg.run_id.clone());
        Self::Looking(tokio::spawn(async move {
            let aging = engine.settings.flow.aging_secs as f64;
            let at = (workflow.as_str(), held.key.as_str());
            let look = (held.shared, aging);
            let (ahead, anyone) = store::flow::line_ahead(&engine.pool, at, run_id.as_str(), look).await?;
            engine.step_tx.lines.saw(at.0, at.1, held.shared, !anyone);
            Ok(!ahead)
        }))
    }

    async fn keeps(self) -> store::Result<bool> {
        match self {
            Self::Known(keeps) => Ok(keeps),
            Self::Looking(look) => look
                .await
                .map_err(|e| store::Error::unavailable("the look at the key's line stopped", e))?,
        }
    }
}

/// The disposition with the step messages of runs handed a slot on the way: published with
/// the step's own when it committed; else left to the relay (after `relay.eager_grace_ms`).
fn with_handed(disposition: Disposition, handed: Vec<Eager>) -> Disposition {
    match disposition {
        Disposition::Committed(mut own) => {
            own.extend(handed);
            Disposition::Committed(own)
        }
        other => other,
    }
}

/// What becomes of a delivery whose claim was refused.
fn not_claimed(engine: &Engine, msg: &StepMessage, why: runs::Refusal) -> Disposition {
    match why {
        runs::Refusal::UnknownRun => unknown_run(&msg.run_id),
        runs::Refusal::Status(status) => Disposition::Stale(format!("run is {status}")),
        runs::Refusal::Position(seq) => Disposition::Stale(format!(
            "run is at position {seq}, message is for {}",
            msg.seq
        )),
        runs::Refusal::Version(version) => Disposition::Stale(format!(
            "run was moved to {} v{version}, message is for v{}",
            msg.workflow, msg.version
        )),
        // Still busy after the re-checks: wait in a delay queue rather than spin.
        runs::Refusal::Busy => {
            Disposition::Delay(Duration::from_millis(engine.settings.worker.busy_retry_ms))
        }
    }
}

/// A step of a run that is not in the database: stale when the run finished and was removed
/// by retention (its tombstone stands), else dead-lettered as `unknown_run`.
pub(super) async fn no_run(engine: &Engine, run_id: &crate::domain::RunId) -> store::Result<Disposition> {
    Ok(
        match store::retention::gone(&engine.pool, run_id.as_str()).await? {
            Some(g) => Disposition::Stale(format!("run {}, then removed by retention", g.status)),
            None => unknown_run(run_id),
        },
    )
}

fn unknown_run(run_id: &crate::domain::RunId) -> Disposition {
    dead(
        "unknown_run",
        format!("run {run_id} does not exist in this database"),
    )
}

/// Evidence of doubt before a frozen step: parked items and effects of unknown outcome, unless a
/// person already approved running this position.
async fn doubt(engine: &Engine, msg: &StepMessage) -> store::Result<Option<Value>> {
    if decisions::approved(&engine.pool, msg.run_id.as_str(), msg.seq).await? {
        return Ok(None);
    }
    let evidence = Evidence::gather(&engine.pool, msg).await?;
    if evidence.parked.is_empty() && evidence.unknown.is_empty() {
        return Ok(None);
    }
    Ok(Some(serde_json::json!({
        // A wait for a person, as `decision` (`ending.rs`): indexed by `runs_person_waits_idx`.
        "waiting_for": "approval",
        "step": msg.step,
        "seq": msg.seq,
        "why": format!("step {} only runs when no item of the run is in doubt; approve to run it anyway, or reject", msg.step),
        "parked": evidence.parked,
        "effects_unknown": evidence.unknown,
    })))
}

/// The handler's view of the claimed step; for a compensation, with the step it undoes.
async fn context(
    engine: &Engine,
    workflow: &Workflow,
    msg: &StepMessage,
    claim: &runs::Claim,
    span: StepSpan,
) -> store::Result<StepContext> {
    let pos = Position {
        run_id: msg.run_id.clone(),
        workflow: msg.workflow.clone(),
        version: msg.version,
        step: msg.step.clone(),
        seq: msg.seq,
        attempt: claim.attempt,
        journaled: claim.journaled,
        fence: claim.fence,
        budget: workflow
            .budget
            .unwrap_or_else(|| Budget::from_settings(&engine.settings.guards)),
        input: claim.input.clone(),
        undo: undo_target(engine, msg, claim.undo.as_ref()).await?,
        shadow: claim.shadow,
        span,
    };
    Ok(StepContext::new(engine.tools.clone(), pos))
}

/// A shadow run's outside messages and local writes: recorded with their keys and bodies or
/// rows, never sent nor written. Recorded before the step commits; a replay records the same
/// keys again, which changes nothing.
async fn shadow_writes(
    engine: &Engine,
    msg: &StepMessage,
    sent: Vec<OutgoingMessage>,
    rows: Vec<LocalWrite>,
) -> store::Result<()> {
    // Named as a live run's listings name a local write, so a fork's diff pairs the two.
    let rows = rows.into_iter().map(|w| ShadowWrite {
        seq: msg.seq,
        kind: store::effects::LOCAL_WRITE.into(),
        key: w.label(),
        target: w.table.name().to_owned(),
        request: Value::Object(w.row),
    });
    let writes: Vec<ShadowWrite> = sent
        .into_iter()
        .map(|m| ShadowWrite {
            seq: msg.seq,
            kind: "message".into(),
            key: m
                .headers
                .get(IDEMPOTENCY_KEY_HEADER)
                .cloned()
                .unwrap_or_else(|| m.message_id.to_string()),
            target: format!("{}/{}", m.exchange, m.routing_key),
            request: serde_json::from_slice(&m.body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&m.body).into_owned())),
        })
        .chain(rows)
        .collect();
    shadow::record(&engine.pool, msg.run_id.as_str(), &writes).await
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

/// Runs the handler under the step's soft timeout until its lease is lost; a lost lease or a
/// panic becomes an error, never a crash.
async fn execute(
    engine: &Arc<Engine>,
    step: &StepDef,
    ctx: StepContext,
    heartbeat: &Heartbeat,
) -> Result<StepOutcome, StepError> {
    let timeout = Duration::from_secs(engine.settings.worker.step_timeout_secs);
    let run = AssertUnwindSafe((step.handler)(ctx)).catch_unwind();
    tokio::select! {
        r = tokio::time::timeout(timeout, run) => match r {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(StepError::Unknown(format!("step handler panicked: {}", panic_text(&panic)))),
            Err(_) => Err(StepError::temporary(format!("step timed out after {} s (worker.step_timeout_secs)", timeout.as_secs()))),
        },
        _ = heartbeat.lost() => Err(StepError::FencedOut),
    }
}

/// Commits `ending` in one statement and returns what to publish eagerly; a repeat of a
/// committed message is a duplicate, a stale fence makes the delivery stale. `answers_flushed`:
/// nothing the ending rests on is waiting for its flush (see `StepTx::commit`).
async fn commit(
    engine: &Engine,
    msg: &StepMessage,
    (claim, look): (&runs::Claim, SlotLook),
    ending: Ending,
    answers_flushed: bool,
) -> store::Result<Disposition> {
    let (fence, status) = (claim.fence, claim.status);
    // Only a step that checkpointed its output counts as done in the drill's call log: a stop
    // for review commits too, and the same position commits again once resumed.
    let checkpointed = matches!(ending, Ending::Advance { .. } | Ending::Pause { .. });
    let mut step = ending::to_commit(&engine.topology, msg, fence, status, claim.shadow, ending)
        .map_err(|e| store::Error::unavailable("the step's ending is not a legal move", e))?;
    let to = step.to.status;
    if to.to != to.from && CHILD_ENDS.contains(&to.to) {
        step.ends_child_of = claim.parent.clone();
    }
    published::hold_for_eager_publish(engine, &mut step.outbox);
    let eagerly = published::publishes_eagerly(engine);
    // Copied only when the worker publishes them itself; the originals go into the commit.
    let messages = if eagerly {
        step.outbox.clone()
    } else {
        Vec::new()
    };
    let keep_slot = look.keeps().await?;
    let next = preclaim(engine, claim, &mut step, (eagerly && !messages.is_empty(), keep_slot));
    let fp = &engine.failpoints;
    fp.hit("step.before_commit").map_err(infra)?;
    // A slot not carried to the run's next step is handed on after the commit, if anyone waits:
    // looked up beside the commit rather than after it.
    let freed = next.is_none() && claim.flow.is_some();
    let waits = async { if freed { Some(anyone_waits(engine, msg, claim).await) } else { None } };
    let (committed, waits) = tokio::join!(engine.step_tx.commit(step, (answers_flushed, claim.preclaimed)), waits);
    let eager = match committed {
        Ok(Committed::Done { preclaimed, rows }) => {
            let kept = match (next, preclaimed) {
                (Some((message, owner)), Some(counted)) => {
                    let next_claim = preclaim::next_claim(claim, counted);
                    let at = (msg.run_id.clone(), msg.seq + 1);
                    let lease = engine.settings.worker.lease();
                    (engine.step_tx.preclaims).keep(message, at, owner, next_claim, lease);
                    true
                }
                _ => false,
            };
            let mut eager = published::to_publish_eagerly(engine, messages, &rows);
            if !kept {
                eager.extend(hand_on(engine, msg, claim, (true, waits)).await);
            }
            eager
        }
        Ok(Committed::Duplicate) => {
            return Ok(Disposition::Duplicate(
                "another delivery committed the step first",
            ));
        }
        Err(store::Error::FencedOut { .. }) => {
            tracing::warn!("fenced out at commit: a newer worker owns the run; this attempt's work is dropped");
            return Ok(Disposition::Stale("fenced out at commit".into()));
        }
        Err(e) => return Err(e),
    };
    if let Some(seams) = fp.seams().filter(|_| checkpointed) {
        seams.log(format_args!(
            "commit {} {} {}",
            msg.run_id, msg.seq, fence.0
        ));
    }
    fp.hit("step.after_commit").map_err(infra)?;
    Stats::bump(&engine.stats.steps_committed);
    log_lifecycle(to);
    Ok(Disposition::Committed(eager))
}

/// The statuses in which a child run counts as ended for its parent's join: succeeded, or
/// failed (stopped for review, failed, cancelled); and, for its parent's undo, compensated.
const CHILD_ENDS: [RunStatus; 5] = [
    RunStatus::Succeeded,
    RunStatus::Compensated,
    RunStatus::NeedsReview,
    RunStatus::Failed,
    RunStatus::Cancelled,
];

/// Asks the commit to claim the run's next position for this worker when it may
/// (`step_tx::preclaimable`; not while an undo plan is in force); the next message's id and the
/// owner recorded, for [`preclaim::PreClaims::keep`].
fn preclaim(
    engine: &Engine,
    claim: &runs::Claim,
    step: &mut StepCommit,
    (eager, keep_slot): (bool, bool),
) -> Option<(MessageId, String)> {
    // A keyed run whose line is not empty gives its slot up: its next step goes through the
    // gate, in turn with the runs waiting.
    let wanted = engine.settings.worker.preclaim && claim.undo.is_none() && keep_slot;
    if !wanted || !step_tx::preclaimable(step, eager) {
        return None;
    }
    let message = step.outbox[0].message_id;
    let owner = preclaim::owner(&engine.worker_id, message);
    step.preclaim = Some(PreClaim {
        owner: owner.clone(),
        pid: super::presence::pid(engine),
    });
    Some((message, owner))
}

/// A committed step at INFO only when it changes where the run stands (it ended, or a person
/// must act); every step at DEBUG.
fn log_lifecycle(to: Transition) {
    match to.to {
        RunStatus::Running | RunStatus::Compensating => {
            tracing::debug!(status = %to.to, "step committed")
        }
        RunStatus::NeedsReview | RunStatus::Waiting => {
            tracing::info!(status = %to.to, "run stopped for a person")
        }
        status => tracing::info!(%status, "run ended"),
    }
}

fn infra(e: Injected) -> store::Error {
    store::Error::unavailable("the step was interrupted", e)
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic".into())
}

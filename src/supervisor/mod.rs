//! The supervisor: finds runs whose lease expired (their worker died or froze) and re-queues
//! their current step through the outbox with a new message id, raising the fence so the old
//! holder can never commit. Lease expiry is judged on the database clock only.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::{Event, RunId, RunStatus, StepAddress};
use crate::engine::Engine;
use crate::health::Loop;
use crate::store::{self, decisions, outbox, runs};

/// Scans every `supervisor.interval_ms` until `shutdown` fires.
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), store::Error> {
    let period = Duration::from_millis(engine.settings.supervisor.interval_ms);
    engine.health.runs(Loop::Supervisor);
    loop {
        engine.health.beat(Loop::Supervisor);
        match recover_expired(&engine).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(runs = n, "re-queued steps of runs whose lease expired"),
            Err(e) => {
                tracing::warn!(error = %crate::error::Report(&e), "supervisor scan failed; will try again")
            }
        }
        if let Err(e) = escalate_waiting(&engine).await {
            tracing::warn!(error = %crate::error::Report(&e), "supervisor scan of waiting runs failed; will try again");
        }
        fire_schedules(&engine).await;
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(period) => {}
        }
    }
}

/// Starts the runs of schedules' due ticks (see `schedule`).
async fn fire_schedules(engine: &Engine) {
    match crate::schedule::fire::fire_due(engine).await {
        Ok(f) if f.started + f.skipped > 0 => {
            tracing::info!(started = f.started, skipped = f.skipped, "schedules fired")
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(error = %crate::error::Report(&e), "schedule scan failed; will try again")
        }
    }
}

/// Most runs one scan handles; the next scan takes the rest.
const SCAN_LIMIT: i64 = 100;

/// One scan: voids the expired leases of up to `SCAN_LIMIT` runs and re-queues their current
/// steps through the outbox, in one transaction; returns how many.
pub async fn recover_expired(engine: &Engine) -> store::Result<usize> {
    let mut tx = engine.pool.begin().await?;
    let expired = runs::take_expired_leases(&mut *tx, SCAN_LIMIT).await?;
    let mut messages = Vec::with_capacity(expired.len());
    for run in &expired {
        let Ok(run_id) = RunId::parse(&run.run_id) else {
            continue;
        };
        tracing::warn!(run.id = %run_id, step = %run.step, seq = run.step_seq, "lease expired without progress; re-queueing the step");
        // The same trace as the step's first attempt: its retry shows beside it.
        let message = engine
            .topology
            .step_message(&run_id, &run.workflow, run.workflow_version, &run.step, run.step_seq)
            .traced(run.traceparent.as_deref());
        messages.push(message);
    }
    outbox::insert(&mut *tx, &messages).await?;
    tx.commit().await?;
    engine
        .stats
        .lease_recoveries
        .fetch_add(expired.len() as u64, std::sync::atomic::Ordering::Relaxed);
    crate::metrics::resumed("lease_expired", expired.len() as u64);
    crate::metrics::lease_taken_over(expired.len() as u64);
    Ok(expired.len())
}

/// Escalates runs that waited for a person longer than `supervisor.human_timeout_secs` to
/// needs_review, keeping what they wait for in the note and recording the escalation. A child
/// run is escalated in a transaction of its own that locks its parent's row first and counts
/// it failed in its parent's fan-out (else its parent would wait for it for ever).
pub async fn escalate_waiting(engine: &Engine) -> store::Result<usize> {
    let limit = engine.settings.supervisor.human_timeout_secs;
    if limit == 0 {
        return Ok(0);
    }
    let mut tx = engine.pool.begin().await?;
    let late = runs::escalate_waiting(&mut *tx, limit, SCAN_LIMIT).await?;
    for run in &late {
        escalated(engine, &mut tx, run).await?;
    }
    tx.commit().await?;
    let mut children = 0;
    for (child, parent) in runs::late_children(&engine.pool, limit, SCAN_LIMIT).await? {
        let mut tx = engine.pool.begin().await?;
        // The runs above the parent too: the parent's join may stop it, and count it in its own.
        store::children::lock_line(&mut tx, &parent).await?;
        let Some(run) = runs::escalate_child(&mut *tx, limit, &child).await? else {
            tx.rollback().await?;
            continue;
        };
        escalated(engine, &mut tx, &run).await?;
        let why = format!(
            "run {child} waited for a decision longer than supervisor.human_timeout_secs ({limit} s) and was escalated to needs_review"
        );
        crate::wait::children::count_end(&mut tx, &engine.topology, &child, ("failed", Some(&why))).await?;
        tx.commit().await?;
        children += 1;
    }
    Ok(late.len() + children)
}

/// Records the escalation of `run` (its decision and `run.needs_review` event) in the caller's
/// transaction.
async fn escalated(
    engine: &Engine,
    tx: &mut sqlx::PgConnection,
    run: &runs::Escalated,
) -> store::Result<()> {
    tracing::warn!(run.id = %run.run_id, "no decision in time; run escalated to needs_review");
    let d = decisions::NewDecision {
        run_id: &run.run_id,
        action: "timeout",
        actor: "supervisor",
        reason: "no decision within supervisor.human_timeout_secs",
        step: run.step.as_ref().map(StepAddress::as_str),
        seq: Some(run.step_seq),
        status_before: RunStatus::Waiting.as_str(),
        status_after: RunStatus::NeedsReview.as_str(),
        version_before: run.workflow_version,
        version_after: run.workflow_version,
        details: run.handover.as_ref().unwrap_or(&serde_json::Value::Null),
    };
    decisions::insert(&mut *tx, &d).await?;
    if let Ok(run_id) = RunId::parse(&run.run_id)
        && let Some(event) = Event::run(
            &run_id,
            (&run.workflow, run.workflow_version),
            RunStatus::NeedsReview,
            None,
        )
    {
        let event = event.with_error("human_timeout", d.reason);
        outbox::insert(&mut *tx, &[engine.topology.event_message(&event)]).await?;
    }
    Ok(())
}

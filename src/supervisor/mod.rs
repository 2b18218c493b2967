//! The supervisor: finds runs whose lease expired (their worker died or froze) and re-queues
//! their current step through the outbox with a new message id, raising the fence so the old
//! holder can never commit. Lease expiry is judged on the database clock only.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::{RunId, StepAddress};
use crate::engine::Engine;
use crate::store;
use crate::store::outbox;
use crate::worker::step_message;

/// Scans every `supervisor.interval_ms` until `shutdown` fires.
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), store::Error> {
    let period = Duration::from_millis(engine.settings.supervisor.interval_ms);
    loop {
        match recover_expired(&engine).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(runs = n, "re-queued steps of runs whose lease expired"),
            Err(e) => tracing::warn!(error = %e, "supervisor scan failed; will try again"),
        }
        if let Err(e) = escalate_waiting(&engine).await {
            tracing::warn!(error = %e, "supervisor scan of waiting runs failed; will try again");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(period) => {}
        }
    }
}

#[derive(sqlx::FromRow)]
struct Expired {
    run_id: String,
    workflow: String,
    workflow_version: i32,
    step: StepAddress,
    step_seq: i32,
}

/// One scan: re-queues the current step of up to 100 runs with expired leases; returns how many.
pub async fn recover_expired(engine: &Engine) -> store::Result<usize> {
    let mut tx = engine.pool.begin().await?;
    let expired: Vec<Expired> = sqlx::query_as(
        "UPDATE trailmark.runs r
            SET lease_owner = NULL, lease_expires_at = NULL, fence = r.fence + 1, updated_at = now()
           FROM (SELECT run_id FROM trailmark.runs
                  WHERE lease_owner IS NOT NULL AND lease_expires_at < now()
                    AND status IN ('running', 'compensating') AND step IS NOT NULL
                  ORDER BY lease_expires_at LIMIT 100 FOR UPDATE SKIP LOCKED) e
          WHERE r.run_id = e.run_id
      RETURNING r.run_id, r.workflow, r.workflow_version, r.step, r.step_seq",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut messages = Vec::with_capacity(expired.len());
    for run in &expired {
        let Ok(run_id) = RunId::parse(&run.run_id) else {
            continue;
        };
        tracing::warn!(run.id = %run_id, step = %run.step, seq = run.step_seq, "lease expired without progress; re-queueing the step");
        messages.push(step_message(
            engine,
            &run_id,
            &run.workflow,
            run.workflow_version,
            &run.step,
            run.step_seq,
        ));
    }
    outbox::insert(&mut *tx, &messages).await?;
    tx.commit().await?;
    engine
        .stats
        .lease_recoveries
        .fetch_add(expired.len() as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(expired.len())
}

#[derive(sqlx::FromRow)]
struct Late {
    run_id: String,
    handover: Option<serde_json::Value>,
    step_seq: i32,
    step: Option<StepAddress>,
    workflow_version: i32,
}

/// Escalates runs that waited for a person longer than `supervisor.human_timeout_secs` to
/// needs_review, keeping what they wait for in the note and recording the escalation.
pub async fn escalate_waiting(engine: &Engine) -> store::Result<usize> {
    let limit = engine.settings.supervisor.human_timeout_secs;
    if limit == 0 {
        return Ok(0);
    }
    let mut tx = engine.pool.begin().await?;
    let late: Vec<Late> = sqlx::query_as(
        "UPDATE trailmark.runs r SET status = 'needs_review', updated_at = now(),
                handover = jsonb_build_object('waiting_for', r.handover, 'error_class', 'human_timeout',
                    'error', format('no decision within %s s; approve or reject, or resume to ask again', $1::bigint))
           FROM (SELECT run_id FROM trailmark.runs WHERE status = 'waiting'
                  AND updated_at < now() - make_interval(secs => $1::float8) LIMIT 100 FOR UPDATE SKIP LOCKED) w
          WHERE r.run_id = w.run_id
      RETURNING r.run_id, r.handover, r.step_seq, r.step, r.workflow_version",
    )
    .bind(limit as i64)
    .fetch_all(&mut *tx)
    .await?;
    for run in &late {
        tracing::warn!(run.id = %run.run_id, "no decision in time; run escalated to needs_review");
        let d = crate::store::decisions::NewDecision {
            run_id: &run.run_id,
            action: "timeout",
            actor: "supervisor",
            reason: "no decision within supervisor.human_timeout_secs",
            step: run.step.as_ref().map(StepAddress::as_str),
            seq: Some(run.step_seq),
            status_before: "waiting",
            status_after: "needs_review",
            version_before: run.workflow_version,
            version_after: run.workflow_version,
            details: run.handover.as_ref().unwrap_or(&serde_json::Value::Null),
        };
        crate::store::decisions::insert(&mut *tx, &d).await?;
    }
    tx.commit().await?;
    Ok(late.len())
}

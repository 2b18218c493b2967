//! `run approve` and `run reject`: a person's answer to a human step, or to a step frozen
//! because an item of the run was in doubt.

use std::sync::Arc;

use serde_json::json;

use super::{Decided, Decider, Outcome, Result, enqueue, lock, record, refused, set_run};
use crate::domain::{RunStatus, StepAddress};
use crate::engine::Engine;
use crate::store::runs::RunRow;
use crate::store::{steps, waits};
use crate::workflow::{Next, StepDef, StepKind, Workflow};

/// What a decision about a waiting run works on: its locked row, workflow and waiting step.
type Waiting = (
    sqlx::Transaction<'static, sqlx::Postgres>,
    RunRow,
    Arc<Workflow>,
    StepDef,
);

/// Locks the run and checks that it waits at `step` of a deployed workflow.
async fn waiting_at(
    engine: &Engine,
    run_id: &str,
    step: &str,
    action: &'static str,
) -> Result<Waiting> {
    let mut tx = engine.pool.begin().await?;
    let run = lock(&mut tx, run_id).await?;
    if run.status != RunStatus::Waiting {
        return Err(refused(
            &run,
            action,
            format!("it is {}, not waiting for a decision", run.status),
        ));
    }
    if let Some(w) = waits::waiting_at(&mut tx, &run.run_id, run.step_seq).await? {
        let what = match (&w.event_name, &w.match_key) {
            (Some(name), Some(key)) => format!(
                "it waits for event {name} (key {key}) until {}, not for a decision: send it with `trailmark event send {name} --key {key}`, or cancel the run",
                w.due_at
            ),
            _ => format!(
                "it sleeps until {}, not waiting for a decision; it wakes by itself, or cancel the run",
                w.due_at
            ),
        };
        return Err(refused(&run, action, what));
    }
    if run.step.as_ref().map(StepAddress::as_str) != Some(step) {
        return Err(refused(
            &run,
            action,
            format!(
                "it waits at step {}, not {step}",
                run.step.as_ref().map_or("-", StepAddress::as_str)
            ),
        ));
    }
    let wf = engine.registry.for_run(&run.workflow, run.workflow_version).ok_or_else(|| {
        refused(
            &run,
            action,
            format!("workflow {} is not deployed in this build", run.workflow),
        )
    })?;
    let def = wf.find(step).cloned().ok_or_else(|| {
        refused(
            &run,
            action,
            format!("workflow {} has no step {step}", wf.name),
        )
    })?;
    Ok((tx, run, wf, def))
}

/// Marks the waiting step finished with the person's decision in its output.
async fn close_step(
    tx: &mut sqlx::PgConnection,
    run: &RunRow,
    decision: &str,
    who: &Decider,
) -> Result<()> {
    let answer = steps::Answer {
        decision,
        actor: &who.actor,
        reason: &who.reason,
    };
    steps::close_waiting(tx, &run.run_id, run.step_seq, answer).await?;
    Ok(())
}

/// Approves the step the run waits at: a human step completes and the run goes on; a frozen step
/// runs now, despite the doubt, on the person's responsibility.
pub async fn approve(engine: &Engine, run_id: &str, step: &str, who: &Decider) -> Result<Outcome> {
    let (mut tx, run, wf, def) = waiting_at(engine, run_id, step, "approve").await?;
    let (seq, version) = (run.step_seq, run.workflow_version);
    let here = StepAddress::step(step);
    let details = json!({ "waiting_for": run.handover });
    if def.kind != StepKind::Human {
        set_run(&mut tx, &run, RunStatus::Running, Some(&here), seq, version).await?;
        enqueue(&mut tx, engine, &run, &here, seq, version).await?;
        let next = format!("frozen step {step} runs now");
        return record(
            engine,
            tx,
            &run,
            who,
            Decided {
                action: "approve",
                after: RunStatus::Running,
                step: Some((&here, seq)),
                version_after: version,
                details,
                next,
            },
        )
        .await;
    }
    close_step(&mut tx, &run, "approved", who).await?;
    let next_step = wf
        .resolve_next(&here, &Next::Continue)
        .map_err(|e| refused(&run, "approve", e.to_string()))?;
    let (after, next) = match &next_step {
        Some(n) => {
            set_run(&mut tx, &run, RunStatus::Running, Some(n), seq + 1, version).await?;
            enqueue(&mut tx, engine, &run, n, seq + 1, version).await?;
            (
                RunStatus::Running,
                format!("the run continues with step {n}"),
            )
        }
        None => {
            let done = RunStatus::finished(run.shadow);
            set_run(&mut tx, &run, done, None, seq + 1, version).await?;
            (done, "the run is complete".to_owned())
        }
    };
    record(
        engine,
        tx,
        &run,
        who,
        Decided {
            action: "approve",
            after,
            step: Some((&here, seq)),
            version_after: version,
            details,
            next,
        },
    )
    .await
}

/// Rejects the step the run waits at: the run goes to the step's declared `on_reject` target,
/// or is cancelled when none is declared.
pub async fn reject(engine: &Engine, run_id: &str, step: &str, who: &Decider) -> Result<Outcome> {
    let (mut tx, run, _, def) = waiting_at(engine, run_id, step, "reject").await?;
    let (seq, version) = (run.step_seq, run.workflow_version);
    let here = StepAddress::step(step);
    let details = json!({ "waiting_for": run.handover });
    close_step(&mut tx, &run, "rejected", who).await?;
    let (after, next) = match &def.on_reject {
        Some(target) => {
            let target = StepAddress::step(target.as_str());
            set_run(
                &mut tx,
                &run,
                RunStatus::Running,
                Some(&target),
                seq + 1,
                version,
            )
            .await?;
            enqueue(&mut tx, engine, &run, &target, seq + 1, version).await?;
            (
                RunStatus::Running,
                format!("the run is diverted to step {target}"),
            )
        }
        None => {
            set_run(
                &mut tx,
                &run,
                RunStatus::Cancelled,
                Some(&here),
                seq,
                version,
            )
            .await?;
            (
                RunStatus::Cancelled,
                "the run is cancelled; `trailmark run undo` can reverse its writes".to_owned(),
            )
        }
    };
    record(
        engine,
        tx,
        &run,
        who,
        Decided {
            action: "reject",
            after,
            step: Some((&here, seq)),
            version_after: version,
            details,
            next,
        },
    )
    .await
}

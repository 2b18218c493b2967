//! `run resume` and `run resume --after-fix`: continue from the same checkpoint.

use serde_json::json;

use super::{Decided, Decider, Outcome, Result, enqueue, lock, record, refused, set_run};
use crate::domain::RunStatus;
use crate::engine::Engine;
use crate::store::steps;

/// Resumes a run in `needs_review` at the step that stopped it. Completed steps and journaled
/// model answers are not repeated. With `after_fix`, the failed step's attempt count is reset and
/// the run continues on the workflow version deployed now (recorded in the decision).
pub async fn resume(
    engine: &Engine,
    run_id: &str,
    who: &Decider,
    after_fix: bool,
) -> Result<Outcome> {
    let action = if after_fix {
        "resume_after_fix"
    } else {
        "resume"
    };
    let mut tx = engine.pool.begin().await?;
    let run = lock(&mut tx, run_id).await?;
    if run.status != RunStatus::NeedsReview {
        let hint = match run.status {
            RunStatus::Waiting => {
                "it waits for a person: use `trailmark run approve` or `run reject`"
            }
            s if s.is_terminal() => "it has ended; only `trailmark run undo` applies",
            _ => "it is not stopped; only runs in needs_review can be resumed",
        };
        return Err(refused(
            &run,
            action,
            format!("it is {} ({hint})", run.status),
        ));
    }
    let step = run
        .step
        .clone()
        .ok_or_else(|| refused(&run, action, "it has no step to resume at"))?;
    let attempts = steps::attempts_at(&mut *tx, &run.run_id, run.step_seq).await?;
    let max = engine.settings.worker.max_attempts;
    let mut version = run.workflow_version;
    if after_fix {
        let deployed = engine.registry.get(&run.workflow).ok_or_else(|| {
            refused(&run, action, format!("workflow {} is not deployed in this build; run the command from a build that has the fix", run.workflow))
        })?;
        version = deployed.version;
        steps::reset_attempts(&mut *tx, &run.run_id, run.step_seq).await?;
    } else if attempts >= max {
        return Err(refused(
            &run,
            action,
            format!(
                "step {step} already used all {max} attempts; fix the cause, deploy, then `trailmark run resume {} --after-fix`",
                run.run_id
            ),
        ));
    }
    let status = if step.is_undo() {
        RunStatus::Compensating
    } else {
        RunStatus::Running
    };
    set_run(&mut tx, &run, status, Some(&step), run.step_seq, version).await?;
    enqueue(&mut tx, engine, &run, &step, run.step_seq, version).await?;
    let details = json!({ "handover": run.handover, "error": run.error, "attempts_before": attempts, "attempts_reset": after_fix });
    crate::metrics::resumed("operator", 1);
    let next = format!(
        "step {step} (position {}) runs again on v{version}; finished steps are kept",
        run.step_seq
    );
    record(
        engine,
        tx,
        &run,
        who,
        Decided {
            action,
            after: status,
            step: Some((&step, run.step_seq)),
            version_after: version,
            details,
            next,
        },
    )
    .await
}

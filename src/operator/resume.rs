//! `run resume` and `run resume --after-fix`: continue from the same checkpoint.

use serde_json::json;

use super::{Decided, Decider, Outcome, Result, enqueue, lock, record, refused, set_run};
use crate::domain::RunStatus;
use crate::engine::Engine;
use crate::store::{self, journal, steps};

/// How a run in `needs_review` goes on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Resume {
    /// The same step from the same checkpoint, replaying the answers it already has: the cause
    /// was passing (an outage, a limit since raised).
    #[default]
    Again,
    /// The cause was fixed and deployed: the step's attempts start over, on the run's version if
    /// this build carries it, else the newest; the answers it already has are replayed (paid once).
    AfterFix,
    /// As [`Resume::AfterFix`], and the stopped step's journaled answers are set aside (kept in
    /// `journal_set_aside`, not replayed), so the step asks the model again: the fix was to the
    /// prompt or the model, and a replayed answer would bring the old failure back.
    AfterFixAskAgain,
}

impl Resume {
    /// From the two switches the CLI and the API offer; `None` for `ask_again` without
    /// `after_fix` (a plain resume replays the answers the step already has).
    pub fn from_flags(after_fix: bool, ask_again: bool) -> Option<Self> {
        match (after_fix, ask_again) {
            (false, false) => Some(Self::Again),
            (true, false) => Some(Self::AfterFix),
            (true, true) => Some(Self::AfterFixAskAgain),
            (false, true) => None,
        }
    }

    fn action(self) -> &'static str {
        match self {
            Self::Again => "resume",
            Self::AfterFix | Self::AfterFixAskAgain => "resume_after_fix",
        }
    }
}

/// Resumes a run in `needs_review` at the step that stopped it. Completed steps are not
/// repeated; see [`Resume`] for what happens to the stopped step.
pub async fn resume(engine: &Engine, run_id: &str, who: &Decider, how: Resume) -> Result<Outcome> {
    let action = how.action();
    let after_fix = how != Resume::Again;
    let mut tx = engine.pool.begin().await?;
    // A child's runs above first, top down (the one lock order of a family): the join a
    // resume reopens may stop it again at once, and count it in its parent.
    if let Some((parent, _)) = store::children::parent_of(&mut *tx, run_id).await? {
        store::children::lock_line(&mut tx, &parent).await?;
    }
    let run = lock(&mut tx, run_id).await?;
    if run.status != RunStatus::NeedsReview {
        let hint = match run.status {
            RunStatus::Waiting => {
                "it waits for a person (`trailmark run approve` or `run reject`), or for an event or a time (`trailmark run show` says which)"
            }
            RunStatus::Shadowed => {
                "a shadow run has ended and changed nothing outside; fork it again to try more"
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
    // Stopped past its children's failure threshold: the finished fan-out step does not run
    // again (its attempts stay as they are); its failed children do.
    let fan_out = store::children::stopped_at(&mut *tx, &run.run_id, run.step_seq).await?;
    let max = engine.settings.worker.max_attempts;
    let mut version = run.workflow_version;
    if after_fix {
        // The run's own version when this build carries it (the fix is in that version's
        // code), else the newest: moving a run to another version is otherwise
        // `trailmark workflow move`'s, an explicit and audited act.
        let deployed = engine.registry.for_run(&run.workflow, run.workflow_version).ok_or_else(|| {
            refused(&run, action, format!("workflow {} is not deployed in this build; run the command from a build that has the fix", run.workflow))
        })?;
        version = deployed.version;
        if !fan_out {
            steps::reset_attempts(&mut *tx, &run.run_id, run.step_seq).await?;
        }
    } else if attempts >= max && !fan_out {
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
    } else if fan_out {
        RunStatus::Waiting
    } else {
        RunStatus::Running
    };
    set_run(&mut tx, &run, status, Some(&step), run.step_seq, version).await?;
    if fan_out {
        // The fan-out step finished: it does not run again; its failed children do.
        let at = (run.run_id.as_str(), run.step_seq);
        let again = crate::wait::children::reopen(&mut tx, &engine.topology, at, after_fix).await?;
        let details = json!({ "handover": run.handover, "error": run.error, "children_run_again": again });
        let next = format!(
            "the run waits again for the children of step {step} (position {}); its {again} failed child run(s) run again from where they stopped",
            run.step_seq
        );
        let decided = Decided {
            action,
            after: status,
            step: Some((&step, run.step_seq)),
            version_after: version,
            details,
            next,
        };
        return record(engine, tx, &run, who, decided).await;
    }
    enqueue(&mut tx, engine, &run, &step, run.step_seq, version).await?;
    let set_aside = if how == Resume::AfterFixAskAgain {
        journal::set_aside(&mut *tx, &run.run_id, run.step_seq).await?
    } else {
        0
    };
    let details = json!({ "handover": run.handover, "error": run.error, "attempts_before": attempts,
        "attempts_reset": after_fix, "answers_set_aside": set_aside });
    crate::metrics::resumed("operator", 1);
    let answers = match how {
        Resume::AfterFixAskAgain => {
            let s = if set_aside == 1 { "" } else { "s" };
            format!("asking the model again ({set_aside} journaled answer{s} set aside)")
        }
        _ => "replaying its journaled answers".to_owned(),
    };
    let next = format!(
        "step {step} (position {}) runs again on v{version}, {answers}; finished steps are kept",
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

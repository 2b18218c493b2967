//! The recovery contract of a workflow, derived from its step declarations:
//! unit of progress, what must be idempotent, what is safe to redo, what needs a person, what
//! each compensation does, and warnings about risky orderings.

use serde::Serialize;

use super::{StepKind, Workflow};

/// One step's line in the contract.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct StepContract {
    /// Step name.
    pub step: String,
    /// Declared kind.
    pub kind: StepKind,
    /// What a crash inside this step costs and how it is recovered.
    pub on_crash: String,
    /// Key recipe, for writes and messages.
    pub key_recipe: Option<String>,
    /// What undo does for this step.
    pub compensation: String,
    /// Whether a person may be needed before or during this step.
    pub needs_person: Option<String>,
}

/// The whole contract.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Contract {
    /// Workflow name and version.
    pub workflow: String,
    /// The unit of progress.
    pub unit_of_progress: String,
    /// What the user sees while a run recovers.
    pub while_recovering: String,
    /// Per step.
    pub steps: Vec<StepContract>,
    /// Orderings that make undo incomplete.
    pub warnings: Vec<String>,
}

/// Derives the contract of `wf`.
pub fn derive(wf: &Workflow) -> Contract {
    let steps = wf.steps.iter().map(step_contract).collect();
    Contract {
        workflow: format!("{} v{}", wf.name, wf.version),
        unit_of_progress: "one step: its output, the next step's message and its outside messages commit together; a crash loses at most the step in flight".into(),
        while_recovering: "`trailmark run show RUN`: status running (or needs_review with a handover note), the step being retried and its attempt count".into(),
        steps,
        warnings: warnings(wf),
    }
}

fn step_contract(s: &super::StepDef) -> StepContract {
    let on_crash = match s.kind {
        StepKind::Read => "safe to redo: it is run again from its start",
        StepKind::Model => "redone, but journaled model answers are replayed, not paid again",
        StepKind::Write => {
            "redone; recorded effects are replayed, an effect of unknown outcome is sent again under the same key (the receiver must enforce it)"
        }
        StepKind::Message => {
            "redone; outside messages go out only with the step's commit (at least once, the key travels with the message)"
        }
        StepKind::Human => "waits again for the same decision; nothing is lost",
    };
    let compensation = match (&s.compensation, s.kind) {
        (Some(c), _) => format!("{} (keys undo:<original key>)", c.note),
        (None, StepKind::Read | StepKind::Model | StepKind::Human) => "nothing to undo".into(),
        (None, _) => "NONE DECLARED: undo cannot reverse this step".into(),
    };
    let needs_person = match (s.kind, s.freeze_unless_clear) {
        (StepKind::Human, _) => Some("always: the run waits for approve or reject".into()),
        (_, true) => Some("when any item of the run is in doubt (parked, or an effect of unknown outcome), the run waits with the evidence".into()),
        _ => None,
    };
    StepContract {
        step: s.name.clone(),
        kind: s.kind,
        on_crash: on_crash.into(),
        key_recipe: s.key_recipe.clone(),
        compensation,
        needs_person,
    }
}

fn warnings(wf: &Workflow) -> Vec<String> {
    let mut out = Vec::new();
    let is_write = |k: StepKind| matches!(k, StepKind::Write | StepKind::Message);
    for (i, s) in wf.steps.iter().enumerate() {
        if is_write(s.kind) && s.key_recipe.is_none() {
            out.push(format!(
                "step {} writes outside but declares no key recipe",
                s.name
            ));
        }
        let irreversible = is_write(s.kind) && s.compensation.is_none();
        if !irreversible {
            continue;
        }
        for later in &wf.steps[i + 1..] {
            if is_write(later.kind) && later.compensation.is_some() {
                out.push(format!(
                    "irreversible step {} runs before reversible step {}: an undo after {} cannot take {} back; move it later",
                    s.name, later.name, later.name, s.name
                ));
            }
        }
    }
    out
}

/// The contract as text for the terminal.
pub fn render(c: &Contract) -> String {
    let mut out = format!("recovery contract of {}\n", c.workflow);
    out += &format!("unit of progress: {}\n", c.unit_of_progress);
    out += &format!("while recovering: {}\n\n", c.while_recovering);
    for s in &c.steps {
        out += &format!("step {} ({:?})\n", s.step, s.kind);
        out += &format!("  on crash:     {}\n", s.on_crash);
        if let Some(k) = &s.key_recipe {
            out += &format!("  idempotent:   key {k}\n");
        }
        out += &format!("  undo:         {}\n", s.compensation);
        if let Some(p) = &s.needs_person {
            out += &format!("  needs person: {p}\n");
        }
    }
    if c.warnings.is_empty() {
        out += "\nno warnings\n";
    }
    for w in &c.warnings {
        out += &format!("\nWARNING: {w}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::StepOutcome;
    use serde_json::json;

    #[test]
    fn an_irreversible_message_before_a_reversible_write_is_warned_about() {
        let ok = |_ctx| async { Ok(StepOutcome::next(json!({}))) };
        let wf = Workflow::new("w", 1)
            .step("email", StepKind::Message, ok)
            .key_recipe("run_id:email")
            .step("post", StepKind::Write, ok)
            .key_recipe("run_id:post")
            .compensate("posts a reversal", ok);
        let c = derive(&wf);
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(c.warnings[0].contains("irreversible step email runs before reversible step post"));
        assert!(render(&c).contains("NONE DECLARED"));
    }
}

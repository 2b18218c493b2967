//! `trailmark run resume | undo | cancel | approve | reject` and `trailmark contract`.

use anyhow::{Context, bail};
use serde_json::Value;

use trailmark::config::Settings;
use trailmark::engine::Engine;
use trailmark::operator::{self, Decider, Outcome, UndoOptions};
use trailmark::workflow::{Registry, contract};

/// A decision as typed on the command line.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Resume at the failed step (optionally after a fix).
    Resume(operator::Resume),
    /// Undo, optionally scoped.
    Undo {
        /// Scope JSON.
        scope: Option<String>,
        /// Go ahead although the stopped step's writes stay.
        leave_partial: bool,
        /// Skip the confirmation.
        yes: bool,
    },
    /// Cancel.
    Cancel,
    /// Approve the waiting step.
    Approve {
        /// The step.
        step: String,
    },
    /// Reject the waiting step.
    Reject {
        /// The step.
        step: String,
    },
}

/// The actor when `--actor` is not given: `$USER`, else `operator`.
pub fn default_actor() -> String {
    std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "operator".into())
}

/// Refuses an empty `--reason`, or one the API and the console would refuse too (a reason is
/// printed whole by `run show`).
pub fn check_reason(reason: &str) -> anyhow::Result<()> {
    if reason.trim().is_empty() {
        bail!("--reason must say why (it is recorded with the decision)");
    }
    trailmark::api::input::check("--reason", reason, trailmark::api::input::Kind::Reason)?;
    Ok(())
}

/// Applies a decision and prints what it did.
pub async fn decide(
    settings: Settings,
    registry: Registry,
    run_id: &str,
    decision: Decision,
    who: Decider,
    as_json: bool,
) -> anyhow::Result<()> {
    check_reason(&who.reason)?;
    let engine = Engine::new(settings, registry).await?;
    let outcome = match decision {
        Decision::Resume(how) => operator::resume(&engine, run_id, &who, how).await?,
        Decision::Undo {
            scope,
            leave_partial,
            yes,
        } => {
            let scope: Value = match scope.as_deref() {
                Some(raw) => serde_json::from_str(raw)
                    .with_context(|| format!("--scope is not valid JSON: {raw}"))?,
                None => serde_json::json!({}),
            };
            let opts = UndoOptions {
                scope,
                leave_partial,
            };
            let preview = operator::undo_preview(&engine, run_id, opts.clone()).await?;
            let what = print_preview(&preview);
            super::confirm(
                &format!("undo run {run_id}: {what}, newest first"),
                "Check the run with `trailmark run show`, ",
                yes,
            )
            .await?;
            operator::undo(&engine, run_id, &who, opts).await?
        }
        Decision::Cancel => operator::cancel(&engine, run_id, &who).await?,
        Decision::Approve { step } => operator::approve(&engine, run_id, &step, &who).await?,
        Decision::Reject { step } => operator::reject(&engine, run_id, &step, &who).await?,
    };
    print_outcome(&outcome, as_json)
}

/// Most reversals printed per compensation before asking (the rest are counted).
const PREVIEW_LINES: usize = 20;

/// Prints on stderr what an undo would write, and returns it in a few words for the question.
fn print_preview(p: &operator::Preview) -> String {
    let mut listed = 0;
    for c in &p.compensations {
        if c.children_first > 0 {
            print_children(p, c.seq);
        }
        eprintln!("step {} (position {}): {}", c.step, c.seq, c.compensation);
        match (&c.reversals, &c.cannot_list) {
            (Some(reversals), _) => {
                listed += reversals.len();
                for r in reversals.iter().take(PREVIEW_LINES) {
                    eprintln!("  {}  {}", r.key, r.what);
                }
                if reversals.len() > PREVIEW_LINES {
                    eprintln!("  ... and {} more", reversals.len() - PREVIEW_LINES);
                }
            }
            (None, Some(why)) => eprintln!("  cannot list its reversals: {why}"),
            (None, None) => eprintln!(
                "  reverses {} recorded writes of its step (the workflow lists no reversals)",
                c.writes.len()
            ),
        }
    }
    for key in &p.left_standing {
        eprintln!("left standing (reverse by hand): {key}");
    }
    let children = match p.children.len() {
        0 => String::new(),
        n => format!(" and undo {n} child run(s)"),
    };
    format!(
        "run {} compensations ({listed} listed reversals) for scope {}{children}",
        p.compensations.len(),
        p.scope
    )
}

/// Prints the child runs the step at `at` started, where the undo reaches them: after the
/// compensations of newer steps, before that step's own.
fn print_children(p: &operator::Preview, at: i32) {
    let here: Vec<_> = p.children.iter().filter(|c| c.at == at).collect();
    eprintln!(
        "then the {} child run(s) started at position {at}, side by side; the run waits until every one is compensated:",
        here.len()
    );
    for c in here.iter().take(PREVIEW_LINES) {
        let below: usize = c.children.len();
        let nested = match below {
            0 => String::new(),
            n => format!(", and its own {n} child run(s) at their fan-out"),
        };
        eprintln!(
            "  child run {} ({}): {} compensation(s), newest first{nested}",
            c.run_id,
            c.status,
            c.compensations.len()
        );
    }
    if here.len() > PREVIEW_LINES {
        eprintln!("  ... and {} more child runs", here.len() - PREVIEW_LINES);
    }
}

fn print_outcome(o: &Outcome, as_json: bool) -> anyhow::Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(o)?);
    } else {
        println!(
            "{} {}: {} -> {}; next: {}",
            o.action, o.run_id, o.status_before, o.status_after, o.next
        );
    }
    Ok(())
}

/// `trailmark contract WORKFLOW [--json]`.
pub fn print_contract(registry: &Registry, workflow: &str, as_json: bool) -> anyhow::Result<()> {
    let wf = registry.get(workflow).with_context(|| {
        format!(
            "unknown workflow {workflow:?}: this build runs {}",
            registry.names().join(", ")
        )
    })?;
    let c = contract::derive(&wf);
    if as_json {
        println!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        println!("{}", contract::render(&c));
    }
    Ok(())
}

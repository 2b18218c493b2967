//! `trailmark workflow move`: runs in flight moved from one version of their workflow to
//! another, an explicit and audited act (a run never changes version by itself).
//!
//! The rule: only a run at rest moves, one that holds no step message: stopped for review, or
//! waiting for a person, an event, a time or its children. A run executing a step has a step
//! message in flight that carries its old version (the next step's message is built from the
//! message the worker holds, `worker::ending`), so moving it under its feet would run old code
//! on a moved run; it is listed as busy, to move again once it waits or stops. Whatever sends
//! a run at rest its next step message builds it from the run's row (`run resume`, `approve`,
//! `reject`, the wake-ups and joins of `wait`), so the moved version is the one that runs.
//!
//! A run also stays when the target version lacks a step it stands at or goes on with (its
//! step, a wait's next step and timeout step, an undo's compensations): it would stop there.
//! The move is fenced: each batch locks its runs (skipping any another transaction holds) and
//! changes only those still at the old version and at rest; each moved run gets a decision row
//! naming both versions, an audit row and a progress line, in the same transaction.

use std::collections::{HashMap, HashSet};

use serde::Serialize;
use serde_json::json;
use sqlx::PgConnection;

use super::{Decider, Error, Result};
use crate::domain::{RunStatus, StepAddress};
use crate::engine::Engine;
use crate::store::decisions::{self, NewDecision};
use crate::store::versions::{self as rows, Candidate};
use crate::store::{audit, deployments, progress, runs};
use crate::workflow::Workflow;

/// Runs moved per transaction: short transactions, few rows locked at once.
const BATCH: usize = 200;

/// The decision's name in the decisions and the audit trail.
pub const ACTION: &str = "move_version";

/// Which runs of which workflow version go to which version.
#[derive(Debug, Clone)]
pub struct MoveAsk {
    /// The workflow.
    pub workflow: String,
    /// The version its runs are on now.
    pub from: i32,
    /// The version they go to; this binary must carry it.
    pub to: i32,
    /// Only these runs (empty: every run in flight at `from`).
    pub runs: Vec<String>,
}

/// What becomes of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// It would move (a preview).
    Moves,
    /// It moved.
    Moved,
    /// It is executing a step: not moved.
    Busy,
    /// The target version lacks a step it needs: not moved.
    LacksStep,
    /// It changed between the preview and the move (or another decision holds it): not moved.
    Changed,
    /// A run named with `--run` that is not in flight at the old version.
    Skipped,
}

/// One run of a move, as the preview lists it and the move reports it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct RunMove {
    /// The run.
    pub run_id: String,
    /// Its status (`None` for a named run that does not exist).
    pub status: Option<RunStatus>,
    /// The step it stands at.
    pub step: Option<String>,
    /// That step's position.
    pub seq: Option<i32>,
    /// What it waits for, while waiting: `event`, `sleep`, `children`, or `a person`.
    pub waiting_for: Option<String>,
    /// What becomes of it.
    pub verdict: Verdict,
    /// Why, in words.
    pub why: String,
}

/// A move's runs and what becomes of each: the preview, or the move's report.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct MovePlan {
    /// The workflow.
    pub workflow: String,
    /// The version the runs are on.
    pub from: i32,
    /// The version they go to.
    pub to: i32,
    /// The live worker processes that carry the target version: with none, a moved run's next
    /// step waits for one.
    pub to_live_workers: i64,
    /// Whether anything was changed (`false`: a preview).
    pub applied: bool,
    /// Each run, by run id.
    pub runs: Vec<RunMove>,
}

impl MovePlan {
    /// How many runs have `verdict`.
    pub fn count(&self, verdict: Verdict) -> usize {
        self.runs.iter().filter(|r| r.verdict == verdict).count()
    }

    /// The ids of the runs with `verdict`: what a confirmed preview's move is limited to, so a
    /// run that came to rest while the operator read the list does not move unseen.
    pub fn ids(&self, verdict: Verdict) -> Vec<String> {
        let runs = self.runs.iter().filter(|r| r.verdict == verdict);
        runs.map(|r| r.run_id.clone()).collect()
    }
}

/// What a move of `ask` would do, changing nothing: each run in flight at the old version
/// (or each named run) with its step and position and whether it would move, and why not.
pub async fn preview(engine: &Engine, ask: &MoveAsk) -> Result<MovePlan> {
    let target = target(engine, ask)?;
    let only = (!ask.runs.is_empty()).then_some(ask.runs.as_slice());
    let found = rows::candidates(&engine.pool, (&ask.workflow, ask.from), only).await?;
    let mut listed: Vec<RunMove> = found.iter().map(|c| listed(c, &target, ask)).collect();
    for id in ask
        .runs
        .iter()
        .filter(|id| !found.iter().any(|c| &c.run_id == *id))
    {
        listed.push(skipped(engine, ask, id).await?);
    }
    listed.sort_by(|a, b| a.run_id.cmp(&b.run_id));
    listed.dedup_by(|a, b| a.run_id == b.run_id);
    let to_live_workers = deployments::live(&engine.pool)
        .await?
        .iter()
        .find(|c| c.workflow == ask.workflow && c.version == ask.to)
        .map_or(0, |c| c.workers);
    Ok(MovePlan {
        workflow: ask.workflow.clone(),
        from: ask.from,
        to: ask.to,
        to_live_workers,
        applied: false,
        runs: listed,
    })
}

/// Moves the runs of `ask` that the preview finds movable, in batches; returns the preview with
/// what became of each run. Every check is made again on the locked rows, so a run that started
/// a step since the preview is not touched.
pub async fn move_runs(engine: &Engine, ask: &MoveAsk, who: &Decider) -> Result<MovePlan> {
    let mut plan = preview(engine, ask).await?;
    let target = target(engine, ask)?;
    let movable: Vec<String> = plan
        .runs
        .iter()
        .filter(|r| r.verdict == Verdict::Moves)
        .map(|r| r.run_id.clone())
        .collect();
    // Where each run is listed: a move of many runs must not search the list per run.
    let at: HashMap<String, usize> = (plan.runs.iter().enumerate())
        .map(|(i, r)| (r.run_id.clone(), i))
        .collect();
    for batch in movable.chunks(BATCH) {
        let mut done = move_batch(engine, ask, &target, who, batch).await?;
        for id in batch {
            let r = &mut plan.runs[at[id]];
            *r = done.remove(id).unwrap_or_else(|| RunMove {
                verdict: Verdict::Changed,
                why: "it changed since it was listed (it went on with a step, or another decision holds it); look again with --preview".into(),
                ..r.clone()
            });
        }
    }
    plan.applied = true;
    Ok(plan)
}

/// The target version, carried by this binary, or why the move is refused.
fn target(engine: &Engine, ask: &MoveAsk) -> Result<std::sync::Arc<Workflow>> {
    let refuse = |why: String| Error::Version {
        workflow: ask.workflow.clone(),
        why,
    };
    let carried = engine.registry.versions(&ask.workflow);
    if carried.is_empty() {
        return Err(refuse(format!(
            "this binary does not carry workflow {} at all (it carries {}); run the move from a build that carries v{}",
            ask.workflow,
            engine.registry.names().join(", "),
            ask.to
        )));
    }
    if ask.from == ask.to {
        return Err(refuse(format!(
            "--from and --to are both v{}; name the version the runs go to",
            ask.to
        )));
    }
    engine.registry.version(&ask.workflow, ask.to).ok_or_else(|| {
        refuse(format!(
            "this binary does not carry v{} (it carries {}): a moved run's next step would run code this build cannot check against; run the move from a build that carries v{} (`trailmark workflow versions` says which versions each side carries)",
            ask.to,
            crate::workflow::versions_text(&carried),
            ask.to
        ))
    })
}

/// A run in flight as the preview lists it.
fn listed(c: &Candidate, target: &Workflow, ask: &MoveAsk) -> RunMove {
    let (verdict, why) = judge(c, target, ask);
    RunMove {
        run_id: c.run_id.clone(),
        status: Some(c.status),
        step: c.step.as_ref().map(|s| s.as_str().to_owned()),
        seq: Some(c.step_seq),
        waiting_for: waiting_for(c),
        verdict,
        why,
    }
}

/// Whether the run can move to the target version, and why (not).
fn judge(c: &Candidate, target: &Workflow, ask: &MoveAsk) -> (Verdict, String) {
    if !matches!(c.status, RunStatus::NeedsReview | RunStatus::Waiting) {
        return (
            Verdict::Busy,
            format!(
                "busy: it is {} a step, whose message carries v{}; moving it now would run v{} code on a run of v{}; move again once it waits or stops",
                if c.status == RunStatus::Compensating {
                    "compensating with"
                } else {
                    "executing"
                },
                ask.from,
                ask.from,
                ask.to
            ),
        );
    }
    let needed = needed(c);
    let lacking: Vec<&str> = needed
        .iter()
        .copied()
        .filter(|s| target.find(s).is_none())
        .collect();
    if !lacking.is_empty() {
        return (
            Verdict::LacksStep,
            format!(
                "v{} does not declare step {}, which the run {}: it would stop there; keep v{} for it, or settle it (`trailmark run cancel` or `run undo`)",
                ask.to,
                lacking.join(", "),
                if c.status == RunStatus::NeedsReview {
                    "stopped at"
                } else {
                    "waits at or goes on with"
                },
                ask.from
            ),
        );
    }
    let next = match c.status {
        RunStatus::NeedsReview => format!(
            "`trailmark run resume {}` then runs step {} on v{}",
            c.run_id,
            c.step.as_ref().map_or("-", StepAddress::as_str),
            ask.to
        ),
        _ => format!("when it goes on, its next step runs on v{}", ask.to),
    };
    (
        Verdict::Moves,
        format!("v{} declares {}; {next}", ask.to, needed.join(", ")),
    )
}

/// The declared steps the run stands at or goes on with: its own step, the step a wait goes on
/// with and the one its timeout sends it to, and while undoing every compensation of its plan.
fn needed(c: &Candidate) -> Vec<&str> {
    let mut steps: Vec<&str> = Vec::new();
    let addresses = [&c.step, &c.next_step, &c.on_timeout];
    for a in addresses.into_iter().flatten() {
        steps.push(a.declared());
    }
    if c.step.as_ref().is_some_and(StepAddress::is_undo)
        && let Some(plan) = &c.undo
    {
        steps.extend(plan.targets.iter().map(|t| t.step.as_str()));
    }
    let mut seen = std::collections::BTreeSet::new();
    steps.retain(|s| seen.insert(*s));
    steps
}

fn waiting_for(c: &Candidate) -> Option<String> {
    match (c.status, &c.wait_kind) {
        (RunStatus::Waiting, Some(kind)) => Some(kind.clone()),
        // Only a wait for a person (a human step, a frozen step) has no `waits` row.
        (RunStatus::Waiting, None) => Some("a person".into()),
        _ => None,
    }
}

/// A run named with `--run` that is not in flight at the old version, and why.
async fn skipped(engine: &Engine, ask: &MoveAsk, run_id: &str) -> Result<RunMove> {
    let run = runs::get(&engine.pool, run_id).await?;
    let why = match &run {
        None => format!("run {run_id} not found: list runs with `trailmark run list`"),
        Some(r) if r.workflow != ask.workflow => {
            format!(
                "it is a run of workflow {}, not {}",
                r.workflow, ask.workflow
            )
        }
        Some(r) if r.status.is_terminal() => format!(
            "it has ended ({}): no step of it runs again, on any version",
            r.status
        ),
        Some(r) => format!("it is on v{}, not v{}", r.workflow_version, ask.from),
    };
    Ok(RunMove {
        run_id: run_id.to_owned(),
        status: run.as_ref().map(|r| r.status),
        step: run
            .as_ref()
            .and_then(|r| r.step.as_ref().map(|s| s.as_str().to_owned())),
        seq: run.as_ref().map(|r| r.step_seq),
        waiting_for: None,
        verdict: Verdict::Skipped,
        why,
    })
}

/// Moves one batch in one transaction: locks the runs still at rest at the old version, judges
/// them again, moves those that still may, and records a decision for each. Returns what became
/// of the runs it locked, by run id (a run it could not lock is absent).
async fn move_batch(
    engine: &Engine,
    ask: &MoveAsk,
    target: &Workflow,
    who: &Decider,
    batch: &[String],
) -> Result<HashMap<String, RunMove>> {
    let mut tx = engine.pool.begin().await?;
    let locked = rows::lock_at_rest(&mut tx, (&ask.workflow, ask.from), batch).await?;
    let judged: Vec<(&Candidate, RunMove)> =
        locked.iter().map(|c| (c, listed(c, target, ask))).collect();
    let ids: Vec<String> = judged
        .iter()
        .filter(|(_, m)| m.verdict == Verdict::Moves)
        .map(|(c, _)| c.run_id.clone())
        .collect();
    let moved = rows::set_version(&mut *tx, &ask.workflow, (ask.from, ask.to), &ids).await?;
    let moved: HashSet<&str> = moved.iter().map(String::as_str).collect();
    let mut done = HashMap::with_capacity(judged.len());
    for (c, mut m) in judged {
        if moved.contains(c.run_id.as_str()) {
            record(&mut tx, c, ask, who, &m.why).await?;
            m.verdict = Verdict::Moved;
        } else if m.verdict == Verdict::Moves {
            // Locked and fit, yet not updated: cannot happen under the lock; reported changed.
            continue;
        }
        done.insert(c.run_id.clone(), m);
    }
    tx.commit().await?;
    tracing::info!(workflow = %ask.workflow, from = ask.from, to = ask.to, moved = moved.len(), actor = %who.actor, "runs moved to another workflow version");
    Ok(done)
}

/// The moved run's decision row (both versions), audit row and progress line.
async fn record(
    tx: &mut PgConnection,
    c: &Candidate,
    ask: &MoveAsk,
    who: &Decider,
    why: &str,
) -> Result<()> {
    let details = json!({ "workflow": ask.workflow, "from": ask.from, "to": ask.to,
        "waiting_for": waiting_for(c), "checked": needed(c) });
    let status = c.status.as_str();
    let d = NewDecision {
        run_id: &c.run_id,
        action: ACTION,
        actor: &who.actor,
        reason: &who.reason,
        step: c.step.as_ref().map(StepAddress::as_str),
        seq: Some(c.step_seq),
        status_before: status,
        status_after: status,
        version_before: ask.from,
        version_after: ask.to,
        details: &details,
    };
    decisions::insert(&mut *tx, &d).await?;
    let entry = audit::NewEntry {
        status_before: Some(status),
        status_after: Some(status),
        ..who.audit_entry(ACTION, &c.run_id, &details)
    };
    audit::insert(&mut *tx, &entry).await?;
    let said = progress::NewLine {
        run_id: c.run_id.clone(),
        seq: c.step_seq,
        at: chrono::Utc::now(),
        line: format!(
            "moved from v{} to v{} by {}: {} ({why})",
            ask.from, ask.to, who.actor, who.reason
        ),
    };
    progress::record(&mut *tx, &[said]).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PlannedUndo;
    use crate::workflow::{StepKind, StepOutcome};

    fn target() -> Workflow {
        let ok = |_ctx| async { Ok(StepOutcome::next(json!({}))) };
        Workflow::new("wf", 2)
            .step("a", StepKind::Read, ok)
            .step("b", StepKind::Read, ok)
    }

    fn ask() -> MoveAsk {
        MoveAsk {
            workflow: "wf".into(),
            from: 1,
            to: 2,
            runs: vec![],
        }
    }

    fn run(status: RunStatus, step: &str) -> Candidate {
        Candidate {
            run_id: "r1".into(),
            status,
            step: Some(StepAddress::step(step)),
            step_seq: 3,
            created_at: chrono::Utc::now(),
            undo: None,
            wait_kind: None,
            next_step: None,
            on_timeout: None,
        }
    }

    #[test]
    fn a_run_executing_a_step_is_busy_whatever_its_step() {
        for status in [RunStatus::Running, RunStatus::Compensating] {
            let (verdict, why) = judge(&run(status, "a"), &target(), &ask());
            assert_eq!(verdict, Verdict::Busy);
            assert!(why.contains("move again once it waits or stops"), "{why}");
        }
    }

    #[test]
    fn a_run_at_rest_moves_only_when_the_target_declares_every_step_it_needs() {
        let (verdict, why) = judge(&run(RunStatus::NeedsReview, "b"), &target(), &ask());
        assert_eq!(verdict, Verdict::Moves, "{why}");
        assert!(
            why.contains("`trailmark run resume r1` then runs step b on v2"),
            "{why}"
        );
        let (verdict, why) = judge(&run(RunStatus::NeedsReview, "gone"), &target(), &ask());
        assert_eq!(verdict, Verdict::LacksStep);
        assert!(why.starts_with("v2 does not declare step gone"), "{why}");
        let waiting = Candidate {
            wait_kind: Some("event".into()),
            next_step: Some(StepAddress::step("b")),
            on_timeout: Some(StepAddress::step("escalate")),
            ..run(RunStatus::Waiting, "a")
        };
        let (verdict, why) = judge(&waiting, &target(), &ask());
        assert_eq!(verdict, Verdict::LacksStep);
        assert!(why.contains("step escalate"), "{why}");
        assert_eq!(waiting_for(&waiting).as_deref(), Some("event"));
    }

    #[test]
    fn an_undo_needs_every_compensation_of_its_plan() {
        let plan = crate::domain::UndoPlan {
            scope: json!({}),
            targets: vec![
                PlannedUndo {
                    seq: 2,
                    step: "b".into(),
                    ..Default::default()
                },
                PlannedUndo {
                    seq: 1,
                    step: "old".into(),
                    ..Default::default()
                },
            ],
            left_standing: vec![],
        };
        let c = Candidate {
            step: Some(StepAddress::undo("b", 2)),
            undo: Some(sqlx::types::Json(plan)),
            ..run(RunStatus::NeedsReview, "b")
        };
        assert_eq!(needed(&c), vec!["b", "old"]);
        assert_eq!(judge(&c, &target(), &ask()).0, Verdict::LacksStep);
    }
}

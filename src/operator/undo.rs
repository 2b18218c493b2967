//! `run undo`: run the compensations of completed steps newest first, through the normal
//! message pipeline, each checkpointed, so an interrupted undo resumes where it stopped.

use std::sync::Arc;

use serde_json::{Value, json};

use std::future::Future;
use std::pin::Pin;

use sqlx::PgConnection;

use super::{
    Decided, Decider, Outcome, Result, enqueue, lock, record_in, record_quietly, refused, set_run,
};
use crate::domain::{PlannedUndo, RunId, RunStatus, UndoPlan};
use crate::engine::Engine;
use crate::store::{self, effects, runs, steps};
use crate::workflow::{Lister, PreviewContext, Reversal, StepError, Workflow};

/// What an undo covers.
#[derive(Debug, Clone)]
pub struct UndoOptions {
    /// Handed to every compensation, which reverses only the items it selects (e.g.
    /// `{"supplier": "S-07"}`); `{}` undoes everything.
    pub scope: Value,
    /// Go ahead although a step that stopped halfway recorded writes that no compensation
    /// reverses (they are listed in the decision and left to the operator).
    pub leave_partial: bool,
}

impl UndoOptions {
    /// Undo everything the finished steps did.
    pub fn everything() -> Self {
        Self::scoped(json!({}))
    }

    /// Undo only what `scope` selects.
    pub fn scoped(scope: Value) -> Self {
        Self {
            scope,
            leave_partial: false,
        }
    }
}

/// Starts undoing `run_id`. Refused while a step that stopped halfway has recorded writes,
/// unless `opts.leave_partial`: undo would silently leave them standing. The run's child runs
/// (and theirs) are undone with it in causal order: the run compensates its steps newer than a
/// fan-out first; on reaching the fan-out step it undoes that step's children (side by side,
/// each newest first) and waits until every one is compensated; then it compensates the fan-out
/// step and the older steps. Every child's plan is decided here, in the same transaction, and
/// started when its parent reaches it; refused while one of them still runs (cancel the run
/// first, which cancels them).
pub async fn undo(
    engine: &Engine,
    run_id: &str,
    who: &Decider,
    opts: UndoOptions,
) -> Result<Outcome> {
    let mut tx = engine.pool.begin().await?;
    let outcome = undo_in(engine, &mut tx, (run_id, None), who, opts).await?;
    tx.commit().await?;
    tracing::info!(run.id = %run_id, actor = %who.actor, after = %outcome.status_after, "undo decided");
    Ok(outcome)
}

/// [`undo`] in the caller's transaction, for a run and then, below it, each of its children:
/// the run itself starts compensating; a child (`under` its parent's fan-out at a position)
/// gets its plan, started when its parent's undo reaches that position.
fn undo_in<'a>(
    engine: &'a Engine,
    tx: &'a mut PgConnection,
    (run_id, under): (&'a str, Option<(&'a str, i32)>),
    who: &'a Decider,
    opts: UndoOptions,
) -> Pin<Box<dyn Future<Output = Result<Outcome>> + Send + 'a>> {
    Box::pin(async move {
        let run = lock(&mut *tx, run_id).await?;
        let plan = plan(engine, &mut *tx, &run, opts.clone()).await?;
        let children = undoable_children(&mut *tx, &run).await?;
        store::children::clear_undo(&mut *tx, run_id).await?;
        let mut outcome = match under {
            None => undo_run(engine, &mut *tx, &run, who, plan).await?,
            Some(at) => plan_child(&mut *tx, &run, who, plan, at).await?,
        };
        for (child, at) in &children {
            undo_in(engine, &mut *tx, (child, Some((run_id, *at))), who, opts.clone()).await?;
        }
        if !children.is_empty() {
            outcome.next = format!(
                "{}; its {} child run(s) are undone with it, each when its compensations reach the step that started it (before that step's own compensation), side by side, newest first within each",
                outcome.next,
                children.len()
            );
        }
        Ok(outcome)
    })
}

/// The child runs an undo of `run` undoes too, with the position of the fan-out that started
/// each, in the order the undo reaches them: every child that was started and is not undone
/// already. Refused while one of them has not ended.
async fn undoable_children(tx: &mut PgConnection, run: &runs::RunRow) -> Result<Vec<(String, i32)>> {
    let children = store::children::started(&mut *tx, &run.run_id).await?;
    if let Some((id, status, _)) = children.iter().find(|(_, s, _)| !s.is_terminal() && *s != RunStatus::NeedsReview) {
        return Err(refused(
            run,
            "undo",
            format!(
                "its child run {id} is {status}; cancel the run first (`trailmark run cancel {}` cancels its children too), then undo",
                run.run_id
            ),
        ));
    }
    Ok(children
        .into_iter()
        .filter(|(_, s, _)| *s != RunStatus::Compensated)
        .map(|(id, _, at)| (id, at))
        .collect())
}

/// Gives a locked child its part in its parent's undo: its plan, recorded as a decision, which
/// its parent's undo starts when it reaches the fan-out at `at` (`wait::children::undo_at`).
/// The child does not move yet.
async fn plan_child(
    tx: &mut PgConnection,
    run: &runs::RunRow,
    who: &Decider,
    plan: UndoPlan,
    (parent, at): (&str, i32),
) -> Result<Outcome> {
    let details = serde_json::to_value(&plan).expect("an undo plan serialises");
    runs::set_undo_plan(&mut *tx, &run.run_id, &plan).await?;
    let next = format!(
        "its {} compensation(s) start, newest first, each keyed undo:<original key>, when the undo of its parent run {parent} reaches position {at} (the step that started it)",
        plan.targets.len()
    );
    let decided = Decided {
        action: "undo",
        after: run.status,
        step: None,
        version_after: run.workflow_version,
        details,
        next,
    };
    record_quietly(tx, run, who, decided).await
}

/// Moves one locked run to compensating with its plan, and records the decision.
async fn undo_run(
    engine: &Engine,
    tx: &mut PgConnection,
    run: &runs::RunRow,
    who: &Decider,
    plan: UndoPlan,
) -> Result<Outcome> {
    let next_seq = steps::next_position(&mut *tx, &run.run_id).await?;
    let left_standing = &plan.left_standing;
    let left_note = match left_standing.len() {
        0 => String::new(),
        n => format!(
            "; {n} write(s) of the step that stopped are left standing: {}",
            left_standing.join(", ")
        ),
    };
    let details = serde_json::to_value(&plan).expect("an undo plan serialises");
    runs::set_undo_plan(&mut *tx, &run.run_id, &plan).await?;
    let Some(step) = plan.first() else {
        set_run(
            &mut *tx,
            run,
            RunStatus::Compensated,
            None,
            next_seq,
            run.workflow_version,
        )
        .await?;
        let next = format!("nothing to undo: no completed step declares a compensation{left_note}");
        let decided = Decided {
            action: "undo",
            after: RunStatus::Compensated,
            step: None,
            version_after: run.workflow_version,
            details,
            next,
        };
        return record_in(engine, tx, run, who, decided).await;
    };
    set_run(
        &mut *tx,
        run,
        RunStatus::Compensating,
        Some(&step),
        next_seq,
        run.workflow_version,
    )
    .await?;
    enqueue(&mut *tx, engine, run, &step, next_seq, run.workflow_version).await?;
    let next = format!(
        "{} compensations run newest first, each keyed undo:<original key>{left_note}",
        plan.targets.len()
    );
    let decided = Decided {
        action: "undo",
        after: RunStatus::Compensating,
        step: None,
        version_after: run.workflow_version,
        details,
        next,
    };
    record_in(engine, tx, run, who, decided).await
}

/// What an undo of the run would do: its plan, newest first, a step that started children
/// marked so (refused when the run may not be undone, or when a stopped step's writes would be
/// left standing without `leave_partial`).
async fn plan(
    engine: &Engine,
    tx: &mut sqlx::PgConnection,
    run: &runs::RunRow,
    opts: UndoOptions,
) -> Result<UndoPlan> {
    let wf = undoable(engine, run)?;
    let left = partial_writes(tx, run, opts.leave_partial).await?;
    // A step that started children is in the plan even without a compensation of its own:
    // the run undoes its children there.
    let fan_outs = store::children::fan_out_positions(&mut *tx, &run.run_id).await?;
    let targets: Vec<PlannedUndo> = steps::finished_forward(&mut *tx, &run.run_id)
        .await?
        .into_iter()
        .filter_map(|(seq, step)| {
            let declared = wf.find(&step).is_some_and(|d| d.compensation.is_some());
            let children = fan_outs.contains(&seq);
            (declared || children).then_some(PlannedUndo {
                seq,
                step,
                children,
                children_only: !declared,
            })
        })
        .collect();
    Ok(UndoPlan {
        scope: opts.scope,
        targets,
        left_standing: left,
    })
}

/// One compensation an undo would run, with the writes of its step and, where the workflow
/// lists them, exactly the reversals it would write.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PreviewStep {
    /// The step it undoes.
    pub step: String,
    /// That step's position.
    pub seq: i32,
    /// What the compensation does, as the workflow declares it.
    pub compensation: String,
    /// The keys of the step's writes (each reversal goes under `undo:<key>`).
    pub writes: Vec<String>,
    /// The reversals the compensation would write for this scope, when the workflow declares a
    /// lister (`Workflow::reversals`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reversals: Option<Vec<Reversal>>,
    /// Why the reversals could not be listed (the compensation would fail the same way, e.g.
    /// a scope that selects nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cannot_list: Option<String>,
    /// How many child runs the step started that are undone, and waited for until every one
    /// is compensated, before this compensation runs (listed in [`Preview::children`] with
    /// `at` this position).
    pub children_first: usize,
}

/// What `run undo` would do, without doing it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Preview {
    /// The run.
    pub run_id: String,
    /// Its status.
    pub status: RunStatus,
    /// The scope every compensation would be handed.
    pub scope: Value,
    /// The compensations, newest first.
    pub compensations: Vec<PreviewStep>,
    /// Writes of a stopped step no compensation reverses (only with `leave_partial`).
    pub left_standing: Vec<String>,
    /// The child runs undone with it, in the order the undo reaches them (the newest fan-out
    /// first); the children of one fan-out are undone side by side.
    pub children: Vec<PreviewChild>,
}

/// A child run an undo of its parent undoes too.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PreviewChild {
    /// The child run.
    pub run_id: String,
    /// Its status.
    pub status: RunStatus,
    /// The position of its parent's step that started it: it is undone after the parent's
    /// compensations of newer steps, before that step's own compensation.
    pub at: i32,
    /// The steps it would compensate, newest first (one that started children of its own
    /// marked `children`: they are undone there, listed in `children`).
    pub compensations: Vec<PlannedUndo>,
    /// Its own child runs, as its parent's are listed.
    pub children: Vec<PreviewChild>,
}

/// Previews an undo: the compensations it would run, newest first, the child runs undone at
/// each step that started them, the writes of each step and the reversals each would write;
/// nothing is changed or locked.
pub async fn preview(engine: &Engine, run_id: &str, opts: UndoOptions) -> Result<Preview> {
    let mut tx = engine.pool.begin().await?;
    let run = runs::get(&mut *tx, run_id)
        .await?
        .ok_or_else(|| super::Error::NotFound(run_id.to_owned()))?;
    let plan = plan(engine, &mut tx, &run, opts.clone()).await?;
    let children = preview_children(engine, &mut tx, &run, opts).await?;
    let wf = undoable(engine, &run)?;
    let written = effects::list(&mut *tx, run_id).await?;
    let seqs: Vec<i32> = plan.targets.iter().map(|t| t.seq).collect();
    let mut outputs = steps::outputs_at(&mut *tx, run_id, &seqs).await?;
    tx.rollback().await?;
    let mut compensations = Vec::with_capacity(plan.targets.len());
    for t in &plan.targets {
        let declared = wf.find(&t.step).and_then(|d| d.compensation.as_ref());
        let children_first = children.iter().filter(|c| c.at == t.seq).count();
        let output = outputs.remove(&t.seq).unwrap_or_default();
        let (reversals, cannot_list) = match declared.and_then(|c| c.reversals.clone()) {
            None => (None, None),
            Some(lister) => match list(engine, &run, t, output, &plan.scope, lister).await? {
                Ok(listed) => (Some(listed), None),
                Err(why) => (None, Some(why)),
            },
        };
        compensations.push(PreviewStep {
            step: t.step.clone(),
            seq: t.seq,
            compensation: declared.map_or_else(
                || "none declared: only the child runs it started are undone here".to_owned(),
                |c| c.note.clone(),
            ),
            writes: written
                .iter()
                .filter(|e| e.seq == t.seq)
                .map(|e| e.idempotency_key.clone())
                .collect(),
            reversals,
            cannot_list,
            children_first,
        });
    }
    Ok(Preview {
        run_id: run.run_id,
        status: run.status,
        scope: plan.scope,
        compensations,
        left_standing: plan.left_standing,
        children,
    })
}

/// The child runs an undo would undo with the run, in the order it reaches them, each with
/// the steps it would compensate and its own children.
fn preview_children<'a>(
    engine: &'a Engine,
    tx: &'a mut PgConnection,
    run: &'a runs::RunRow,
    opts: UndoOptions,
) -> Pin<Box<dyn Future<Output = Result<Vec<PreviewChild>>> + Send + 'a>> {
    Box::pin(async move {
        let mut listed = Vec::new();
        for (id, at) in undoable_children(&mut *tx, run).await? {
            let Some(child) = runs::get(&mut *tx, &id).await? else {
                continue;
            };
            let plan = plan(engine, &mut *tx, &child, opts.clone()).await?;
            let children = preview_children(engine, &mut *tx, &child, opts.clone()).await?;
            listed.push(PreviewChild {
                run_id: id,
                status: child.status,
                at,
                compensations: plan.targets,
                children,
            });
        }
        Ok(listed)
    })
}

/// Runs one declared lister; its refusal is returned as text, a store failure as an error.
async fn list(
    engine: &Engine,
    run: &runs::RunRow,
    target: &PlannedUndo,
    output: Value,
    scope: &Value,
    lister: Lister,
) -> Result<std::result::Result<Vec<Reversal>, String>> {
    let run_id = RunId::parse(&run.run_id).map_err(|e| refused(run, "undo", e.to_string()))?;
    let undone = crate::workflow::UndoTarget {
        step: target.step.clone(),
        seq: target.seq,
        output,
        scope: scope.clone(),
    };
    let ctx = PreviewContext::new(run_id, run.input.clone(), undone, engine.tools.clone());
    match lister(ctx).await {
        Ok(listed) => Ok(Ok(listed)),
        Err(StepError::Infrastructure(why)) => Err(store::Error::Unavailable {
            what: format!(
                "the reversals of run {} could not be listed: {why}",
                run.run_id
            ),
            source: None,
        }
        .into()),
        Err(other) => Ok(Err(other.to_string())),
    }
}

/// The run's workflow, when the run may be undone: stopped, and its compensations deployed.
fn undoable(engine: &Engine, run: &runs::RunRow) -> Result<Arc<Workflow>> {
    if run.shadow {
        return Err(refused(
            run,
            "undo",
            "it is a shadow run: its outside writes were recorded, never made, so there is nothing to reverse",
        ));
    }
    if run.status.accepts_steps() {
        return Err(refused(
            run,
            "undo",
            format!(
                "it is {}; cancel it first (`trailmark run cancel {}`) or wait until it stops",
                run.status, run.run_id
            ),
        ));
    }
    engine.registry.for_run(&run.workflow, run.workflow_version).ok_or_else(|| {
        refused(
            run,
            "undo",
            format!(
                "workflow {} is not deployed in this build, so its compensations are unknown",
                run.workflow
            ),
        )
    })
}

/// Keys of the writes recorded by a step that stopped halfway: no compensation reverses them, so
/// undo is refused unless the operator said to leave them (`leave`).
async fn partial_writes(
    tx: &mut sqlx::PgConnection,
    run: &runs::RunRow,
    leave: bool,
) -> Result<Vec<String>> {
    let partial = effects::of_unfinished_steps(&mut *tx, &run.run_id).await?;
    let keys: Vec<String> = partial.iter().map(|e| e.idempotency_key.clone()).collect();
    if keys.is_empty() || leave {
        return Ok(keys);
    }
    Err(refused(
        run,
        "undo",
        format!(
            "the step at position {} stopped after recording {} write(s) that no compensation reverses (undo compensates finished steps only): {}. {}; or undo with --leave-partial and reverse those writes by hand",
            partial[0].seq,
            keys.len(),
            keys.join(", "),
            finish_first(run)
        ),
    ))
}

/// How the operator can let the stopped step finish before undoing, for the run's status.
fn finish_first(run: &runs::RunRow) -> String {
    match run.status {
        RunStatus::NeedsReview => format!(
            "Finish it first (`trailmark run resume {}`, or with --after-fix), then undo",
            run.run_id
        ),
        RunStatus::Waiting => format!(
            "It waits for a decision: approve it first (`trailmark run approve {} --step ...`), then undo",
            run.run_id
        ),
        status => format!("The run is {status}, so that step cannot be finished any more"),
    }
}

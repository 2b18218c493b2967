//! Fork: a new run that takes over another run's checkpoint (step outputs and journaled model
//! answers) before a position and runs from there on the deployed workflow, live or in shadow.
//! The question it answers: what would this run have done from step 5 with the fixed prompt?

use std::str::FromStr;

use serde::Serialize;
use serde_json::{Value, json};

use super::{Decided, Decider, Error, Result, enqueue, lock, record};
use crate::domain::{RunId, RunStatus, StepAddress};
use crate::engine::Engine;
use crate::store::forks::{self, NewFork};
use crate::store::runs;
use crate::workflow::{StepKind, Workflow};

/// Where a fork starts: a position (the checkpoint sequence `run show` prints) or a step name
/// (its first visit; looping workflows visit one step many times, so a position is exact).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForkPoint {
    /// A position.
    Position(i32),
    /// The first position at which the parent ran this step.
    Step(String),
}

impl FromStr for ForkPoint {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s.parse::<i32>() {
            Ok(n) => ForkPoint::Position(n),
            Err(_) => ForkPoint::Step(s.to_owned()),
        })
    }
}

/// What to fork.
#[derive(Debug, Clone)]
pub struct ForkRequest {
    /// Where the fork starts.
    pub from: ForkPoint,
    /// The fork's id; `None` makes `<parent>-fork-<8 hex>`.
    pub run_id: Option<String>,
    /// A new input; `None` keeps the parent's.
    pub input: Option<Value>,
    /// Record outside writes instead of making them.
    pub shadow: bool,
    /// Replay the model answers this run journaled from the fork point on, instead of asking
    /// the model again (a step whose request differs from the journaled one stops for review,
    /// as any replay does).
    pub answers_from: Option<String>,
}

/// What a fork takes over and what it will do: shown before a live fork is confirmed, and
/// returned once it is made.
#[derive(Debug, Clone, Serialize)]
pub struct ForkPlan {
    /// The parent.
    pub parent: String,
    /// The fork's id.
    pub run_id: String,
    /// Workflow name.
    pub workflow: String,
    /// The deployed version the fork follows from `from_seq` on.
    pub version: i32,
    /// The first position the fork runs.
    pub from_seq: i32,
    /// The step at that position.
    pub from_step: String,
    /// Shadow or live.
    pub shadow: bool,
    /// Positions taken over from the parent (not run again).
    pub inherited_positions: i32,
    /// Journaled model answers taken over.
    pub inherited_answers: i64,
    /// Declared steps from the fork point on that write outside or send messages: in a live
    /// fork they write for real, under the fork's own keys (new writes).
    pub writing_steps: Vec<String>,
}

/// Checks a fork and says what it would do; changes nothing.
pub async fn plan(engine: &Engine, parent: &str, req: &ForkRequest) -> Result<ForkPlan> {
    let pool = &engine.pool;
    let run = runs::get(pool, parent)
        .await?
        .ok_or_else(|| Error::NotFound(parent.to_owned()))?;
    let refuse = |why: String| super::refused(&run, "fork", why);
    let workflow = engine.registry.get(&run.workflow).ok_or_else(|| {
        refuse(format!(
            "workflow {} is not deployed in this process; fork where it is registered",
            run.workflow
        ))
    })?;
    let from_seq = resolve(pool, &run, &workflow, &req.from).await?;
    let prefix = forks::prefix(pool, parent, from_seq).await?;
    let Some(step_at) = prefix.step_at.filter(|s| !s.is_undo()) else {
        return Err(refuse(format!(
            "it has no forward step at position {from_seq}; its positions are 0 to {} (`trailmark run show {parent}`)",
            prefix.positions - 1
        )));
    };
    if let Some(gap) = prefix.unfinished {
        return Err(refuse(format!(
            "position {gap} has no checkpoint, so a fork at {from_seq} would start from nothing; fork at {gap} or earlier"
        )));
    }
    check_parent(&run, from_seq, req.shadow)?;
    if workflow.find(step_at.declared()).is_none() {
        return Err(refuse(format!(
            "step {step_at} no longer exists in the deployed workflow {} v{}; fork at a step it declares",
            workflow.name, workflow.version
        )));
    }
    if let Some(input) = &req.input {
        workflow.check_input(input).map_err(|why| {
            refuse(format!(
                "workflow {} refuses the new input: {why}",
                workflow.name
            ))
        })?;
    }
    let run_id = match &req.run_id {
        Some(id) => id.clone(),
        None => format!(
            "{parent}-fork-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ),
    };
    RunId::parse(&run_id).map_err(|e| refuse(format!("the fork's id is not valid: {e}")))?;
    if let Some(source) = &req.answers_from
        && runs::get(pool, source).await?.is_none()
    {
        return Err(refuse(format!(
            "the run to replay answers from, {source}, does not exist"
        )));
    }
    Ok(ForkPlan {
        parent: parent.to_owned(),
        run_id,
        workflow: workflow.name.clone(),
        version: workflow.version,
        from_seq,
        from_step: step_at.to_string(),
        shadow: req.shadow,
        inherited_positions: from_seq,
        inherited_answers: prefix.answers,
        writing_steps: writing_steps(&workflow, step_at.declared()),
    })
}

/// What the parent's state allows: checked when the fork is planned and again on the locked
/// row, so a parent that changed in between is not forked on old facts.
fn check_parent(run: &runs::RunRow, from_seq: i32, shadow: bool) -> Result<()> {
    let refuse = |why: String| super::refused(run, "fork", why);
    if matches!(run.status, RunStatus::Compensating | RunStatus::Compensated) || run.undo.is_some()
    {
        return Err(refuse(format!(
            "it is {} and its undo reversed (or is reversing) the writes a fork would build on; fork a run that was not undone",
            run.status
        )));
    }
    if run.shadow && !shadow {
        return Err(refuse(
            "it is a shadow run, whose writes never happened; a live fork would build on them. Fork it with --shadow, or fork the live run it came from".into(),
        ));
    }
    if run.status == RunStatus::NeedsReview && from_seq >= run.step_seq {
        return Err(refuse(format!(
            "it stopped for review at position {}; fork from an earlier position, or decide the run first (`trailmark run show {}`)",
            run.step_seq, run.run_id
        )));
    }
    Ok(())
}

/// The position a fork point names in the parent.
async fn resolve(
    pool: &sqlx::PgPool,
    run: &runs::RunRow,
    workflow: &Workflow,
    from: &ForkPoint,
) -> Result<i32> {
    match from {
        ForkPoint::Position(n) if *n >= 0 => Ok(*n),
        ForkPoint::Position(n) => Err(super::refused(
            run,
            "fork",
            format!("position {n} is negative; positions start at 0"),
        )),
        ForkPoint::Step(name) => {
            if workflow.find(name).is_none() {
                let known: Vec<&str> = workflow.steps.iter().map(|s| s.name.as_str()).collect();
                return Err(super::refused(
                    run,
                    "fork",
                    format!(
                        "workflow {} has no step {name:?} (its steps: {}); give a step name or a position",
                        workflow.name,
                        known.join(", ")
                    ),
                ));
            }
            forks::first_visit(pool, &run.run_id, name)
                .await?
                .ok_or_else(|| {
                    super::refused(
                        run,
                        "fork",
                        format!("it never reached step {name}; fork at a step it ran"),
                    )
                })
        }
    }
}

/// Declared steps from `from` on (declaration order) that write outside or send messages.
fn writing_steps(workflow: &Workflow, from: &str) -> Vec<String> {
    workflow
        .steps
        .iter()
        .skip_while(|s| s.name != from)
        .filter(|s| matches!(s.kind, StepKind::Write | StepKind::Message))
        .map(|s| s.name.clone())
        .collect()
}

/// Makes the fork `plan` describes: the run, its lineage, the parent's checkpoint before the
/// fork point and the first step message, in one transaction; recorded as a decision on the
/// fork and in the audit trail.
pub async fn fork(
    engine: &Engine,
    parent: &str,
    req: &ForkRequest,
    who: &Decider,
) -> Result<ForkPlan> {
    let plan = plan(engine, parent, req).await?;
    let mut tx = engine.pool.begin().await?;
    let parent_run = lock(&mut tx, parent).await?;
    check_parent(&parent_run, plan.from_seq, plan.shadow)?;
    let from_step = StepAddress::from(plan.from_step.as_str());
    let input = req
        .input
        .clone()
        .unwrap_or_else(|| parent_run.input.clone());
    let new = NewFork {
        run_id: &plan.run_id,
        parent_run_id: parent,
        workflow: &plan.workflow,
        version: plan.version,
        from_seq: plan.from_seq,
        from_step: &from_step,
        input: &input,
        shadow: plan.shadow,
        actor: &who.actor,
        reason: &who.reason,
        answers_from: req.answers_from.as_deref(),
    };
    if !forks::create(&mut tx, &new).await? {
        return Err(super::refused(
            &parent_run,
            "fork",
            format!(
                "a run with id {} exists; give the fork another id",
                plan.run_id
            ),
        ));
    }
    let child = lock(&mut tx, &plan.run_id).await?;
    enqueue(
        &mut tx,
        engine,
        &child,
        &from_step,
        plan.from_seq,
        plan.version,
    )
    .await?;
    let details = json!({
        "parent": parent,
        "from_seq": plan.from_seq,
        "from_step": plan.from_step,
        "shadow": plan.shadow,
        "inherited_answers": plan.inherited_answers,
        "new_input": req.input.is_some(),
        "answers_from": req.answers_from,
    });
    let mode = if plan.shadow { "shadow" } else { "live" };
    let next = format!(
        "the {mode} fork runs from {} (position {}) on {} v{}",
        plan.from_step, plan.from_seq, plan.workflow, plan.version
    );
    let decided = Decided {
        action: "fork",
        after: RunStatus::Running,
        step: Some((&from_step, plan.from_seq)),
        version_after: plan.version,
        details,
        next,
    };
    record(engine, tx, &child, who, decided).await?;
    Ok(plan)
}

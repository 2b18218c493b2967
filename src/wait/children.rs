//! Runs that wait for child runs: the fan-out registered by the parent's step commit, each
//! child's ending counted in its fan-out, and the join that moves the parent on (or stops it
//! for review naming the failed children), all under the parent's row lock.
//!
//! A child that stops in `needs_review` counts as failed (with its error as the reason), whether
//! a step of it stopped it or its event wait timed out or the supervisor escalated it: a person
//! may resume it, and if it then succeeds it is counted again as succeeded, never twice. A join
//! that held on the first N cancels the fan-out's children that have not ended.
//! A resume of the parent after its threshold was crossed does not run the fan-out step again:
//! the parent waits again and only the failed children run again ([`reopen`]).

use std::fmt::Write;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;

use serde_json::json;
use sqlx::{PgConnection, PgPool};

use super::{How, go_on};
use crate::broker::Topology;
use crate::domain::{Event, FanOut, OutgoingMessage, RunId, RunStartEvent, RunStatus};
use crate::failpoint::Failpoints;
use crate::store::checkpoint::{self, Committed, StepCommit};
use crate::store::children::{self, FanOutRow, ToStart};
use crate::store::waits::{self, Waiting};
use crate::store::{self, outbox, progress, runs};
use crate::worker::run_start::{self, Created};

/// How many failed children a handover note names (the rest are counted).
const NOTE_NAMES: i64 = 50;

/// Registers the fan-out of the step at `seq` of `parent` in its commit's transaction and
/// starts its first `max_in_flight` children. A fan-out recorded there already is kept as it is
/// (its step cannot commit twice: a resume past the threshold reopens it without running the
/// step, [`reopen`]).
pub(super) async fn register(
    tx: &mut PgConnection,
    (topology, failpoints): (&Topology, &Failpoints),
    (parent, seq): (&RunId, i32),
    fan: &FanOut,
) -> store::Result<()> {
    if children::fan_out(&mut *tx, parent.as_str(), seq).await?.is_none() {
        children::record(tx, parent, seq, fan).await?;
    }
    let row = children::fan_out(&mut *tx, parent.as_str(), seq).await?;
    let row = row.ok_or_else(|| {
        store::Error::unavailable(
            format!("the fan-out of run {parent} at position {seq} vanished in its transaction"),
            sqlx::Error::RowNotFound,
        )
    })?;
    settle(tx, (topology, failpoints), row).await
}

/// Opens again the fan-out of a parent stopped past its failure threshold at `seq`, in the
/// transaction of the decision that resumes it (which moved it back to `waiting` there): its
/// wait is reopened, its failed children run again from where they stopped, and its pending
/// ones start; the fan-out step itself does not run again. Returns the children run again.
///
/// As for a run resumed alone, only a resume after a fix gives the failed children's steps their
/// attempts back; a plain resume counts on (a child that used them all stops again at once,
/// and a failure meant for one attempt does not come back).
pub(crate) async fn reopen(
    tx: &mut PgConnection,
    topology: &Topology,
    (parent, seq): (&str, i32),
    after_fix: bool,
) -> store::Result<usize> {
    waits::reopen(&mut *tx, parent, seq).await?;
    let again = children::retry_failed(&mut *tx, (parent, seq)).await?;
    for child in &again {
        resume_child(tx, topology, child, after_fix).await?;
    }
    if let Some(row) = children::fan_out(&mut *tx, parent, seq).await? {
        settle(tx, (topology, &Failpoints::default()), row).await?;
    }
    Ok(again.len())
}

/// Commits the step that ends a child run, and counts the child in its parent's fan-out, in one
/// transaction that locks the parent's row first.
pub(crate) async fn commit_end(
    pool: &PgPool,
    topology: &Topology,
    step: StepCommit,
) -> store::Result<Committed> {
    let parent = step.ends_child_of.clone().expect("a commit that ends a child");
    let mut tx = pool.begin().await?;
    // The runs above the parent too: an undo join this ending stops counts the parent in its
    // own parent.
    children::lock_line(&mut tx, &parent).await?;
    let (mut tx, committed) = match checkpoint::commit_first(pool, tx, &step).await {
        ControlFlow::Continue(went_in) => went_in,
        ControlFlow::Break(answer) => return answer,
    };
    let (state, reason) = match step.to.status.to {
        RunStatus::Succeeded => ("succeeded", None),
        RunStatus::Compensated => ("compensated", None),
        RunStatus::Cancelled => ("cancelled", step.to.error.as_deref()),
        _ => ("failed", step.to.error.as_deref()),
    };
    count_end(&mut tx, topology, step.run_id.as_str(), (state, reason)).await?;
    tx.commit().await?;
    Ok(committed)
}

/// Whether a due wait stops a child run for review: an event wait with no step to divert to
/// on timeout, of a run that a fan-out started.
pub(super) fn stops_a_child(w: &Waiting) -> bool {
    w.parent_run_id.is_some() && w.kind == "event" && w.on_timeout.is_none()
}

/// Stops a child run whose event wait timed out (no step to divert to) for review, and counts
/// it failed in its parent's fan-out, in one transaction that locks the parent's row first, as
/// [`commit_end`] does; `false` when it no longer waits there (an event came meanwhile).
pub(super) async fn timed_out(pool: &PgPool, topology: &Topology, due: &Waiting) -> store::Result<bool> {
    let Some(parent) = due.parent_run_id.as_deref() else {
        return Ok(false);
    };
    let mut tx = pool.begin().await?;
    // The runs above the parent too: the parent's join this stop settles may stop the parent,
    // and count it in its own parent.
    children::lock_line(&mut tx, parent).await?;
    // Locked only now: it may have moved on since the scan read it.
    let Some(waiting) = waits::waiting_at(&mut tx, &due.run_id, due.seq).await? else {
        tx.rollback().await?;
        return Ok(false);
    };
    let reason = super::where_to(waiting.clone(), How::Due).error;
    let moved = go_on(&mut tx, topology, vec![(waiting, How::Due)]).await?;
    if moved.is_empty() {
        tx.rollback().await?;
        return Ok(false);
    }
    let why = reason.as_deref().unwrap_or("timed out");
    count_end(&mut tx, topology, &due.run_id, ("failed", Some(why))).await?;
    tx.commit().await?;
    Ok(true)
}

/// Counts a child's ending (`succeeded`, `compensated`, `failed` or `cancelled`, with why) in
/// its fan-out and settles the join, in a transaction that locked the parent's row before the
/// child's: its own last commit ([`commit_end`]), a stop for review without a commit of its own
/// (its wait timed out, the supervisor escalated it, its own undo join stopped it), or an
/// operator's cancel. A child taking part in its parent's undo is counted in that undo's join
/// only (its forward state stays as it ran).
pub(crate) fn count_end<'a>(
    tx: &'a mut PgConnection,
    topology: &'a Topology,
    child: &'a str,
    (state, reason): (&'a str, Option<&'a str>),
) -> Pin<Box<dyn Future<Output = store::Result<()>> + Send + 'a>> {
    Box::pin(async move {
        if let Some(row) = children::undo_ended(tx, child, state, reason).await? {
            return settle_undo(tx, topology, row).await;
        }
        if state == "compensated" {
            // Undone on its own (not by its parent's undo): nothing of its fan-out to count.
            return Ok(());
        }
        if let Some(row) = children::ended(tx, child, state, reason).await? {
            settle(tx, (topology, &Failpoints::default()), row).await?;
        }
        Ok(())
    })
}

/// Where an undo that reached the fan-out at `fan_out` of `parent` stands, in the transaction
/// of the parent's commit that waits at `undo_seq` for its children (the parent's row locked
/// by it): started now, the first time ([`start_undo`]); after a resume of a parent whose
/// undo join stopped it, the same undo waited for again, its counters as the children left
/// them. Either way the join is settled at once (it may hold already).
pub(crate) async fn undo_at(
    tx: &mut PgConnection,
    topology: &Topology,
    (parent, undo_seq): (&str, i32),
    fan_out: i32,
) -> store::Result<()> {
    let Some(row) = children::undo_of(&mut *tx, parent, fan_out).await? else {
        return Ok(());
    };
    if row.undo_seq.is_none() {
        return start_undo(tx, topology, (parent, undo_seq), fan_out).await;
    }
    if let Some(row) = children::undo_again(&mut *tx, (parent, fan_out), undo_seq).await? {
        settle_undo(tx, topology, row).await?;
    }
    Ok(())
}

/// Starts the undo of the children of the fan-out at `fan_out`: each started child not undone
/// yet moves to `compensating` at the first compensation of the plan its parent's undo decision
/// installed (its message through the outbox), or to `compensated` when it has nothing to
/// compensate; one compensated already, or compensating on its own, takes part as it is. A
/// child found running again (resumed since the decision) or without a plan counts as failed.
async fn start_undo(
    tx: &mut PgConnection,
    topology: &Topology,
    (parent, undo_seq): (&str, i32),
    fan_out: i32,
) -> store::Result<()> {
    let found = children::to_undo(&mut *tx, (parent, fan_out)).await?;
    let mut parts = Vec::with_capacity(found.len());
    let mut messages = Vec::new();
    let mut lines = Vec::new();
    for child in found {
        let (state, reason) = match begin_child_undo(tx, topology, parent, &child).await? {
            Ok(Joined { state, message, line }) => {
                messages.extend(message);
                lines.extend(line);
                (state, None)
            }
            Err(why) => ("failed", Some(why)),
        };
        parts.push(children::UndoPart { run_id: child.run_id, state, reason });
    }
    outbox::insert(&mut *tx, &messages).await?;
    progress::record(&mut *tx, &lines).await?;
    let row = children::undo_started(&mut *tx, (parent, fan_out), undo_seq, &parts).await?;
    settle_undo(tx, topology, row).await
}

/// How a child takes part in its parent's undo.
struct Joined {
    /// `compensating` or `compensated`.
    state: &'static str,
    /// Its first compensation's message, or its `run.compensated` event.
    message: Option<OutgoingMessage>,
    /// What its progress says.
    line: Option<progress::NewLine>,
}

/// Moves one child into its parent's undo; one compensated already, or compensating on its own
/// (its ending counts here too), takes part as it is; `Err` says why it cannot take part.
async fn begin_child_undo(
    tx: &mut PgConnection,
    topology: &Topology,
    parent: &str,
    child: &children::ToUndo,
) -> store::Result<Result<Joined, String>> {
    let status = child.status;
    let as_it_is = |state| Ok(Ok(Joined { state, message: None, line: None }));
    match status {
        RunStatus::Compensated => return as_it_is("compensated"),
        RunStatus::Compensating => return as_it_is("compensating"),
        _ => {}
    }
    let Some(plan) = child.undo.as_ref().map(|p| &p.0) else {
        return Ok(Err(format!(
            "it has no undo plan (it was not undone with its parent); undo it: `trailmark run undo {}`",
            child.run_id
        )));
    };
    if !status.is_terminal() && status != RunStatus::NeedsReview {
        return Ok(Err(format!(
            "it is {status} (resumed after its parent's undo was decided); cancel it, then undo it: `trailmark run cancel {}`",
            child.run_id
        )));
    }
    let first = plan.first();
    let to = if first.is_some() { RunStatus::Compensating } else { RunStatus::Compensated };
    let moved = status
        .move_to(to)
        .map_err(|e| store::Error::unavailable("a child cannot be undone from its status", e))?;
    let seq = children::begin_undo(&mut *tx, &child.run_id, moved, first.as_ref()).await?;
    let state = if first.is_some() { "compensating" } else { "compensated" };
    let Ok(run_id) = RunId::parse(&child.run_id) else {
        return Ok(Ok(Joined { state, message: None, line: None }));
    };
    let message = match &first {
        Some(step) => {
            Some(topology.step_message(&run_id, &child.workflow, child.workflow_version, step, seq))
        }
        None => Event::run(&run_id, (&child.workflow, child.workflow_version), to, None)
            .map(|e| topology.event_message(&e)),
    };
    let line = progress::NewLine {
        run_id: child.run_id.clone(),
        seq,
        at: chrono::Utc::now(),
        line: format!(
            "undo started: its parent run {parent} reached its compensations of the step that started it; {} compensation(s), newest first",
            plan.targets.len()
        ),
    };
    Ok(Ok(Joined { state, message, line: Some(line) }))
}

/// Acts on an undo join: moves the parent on to its next compensation once every child is
/// compensated, or stops it for review once one stopped; only while it still waits there.
async fn settle_undo(tx: &mut PgConnection, topology: &Topology, f: children::UndoRow) -> store::Result<()> {
    let Some(at) = f.undo_seq.filter(|_| !f.joined) else {
        return Ok(());
    };
    let Some(waiting) = waits::waiting_at(&mut *tx, &f.run_id, at).await? else {
        return Ok(());
    };
    if f.undo_failed > 0 {
        return stop_undo(tx, topology, waiting, &f).await;
    }
    if f.undone >= f.undo_total && children::join_once(&mut *tx, (&f.run_id, f.seq), children::Join::Undo).await? {
        let line = format!(
            "children undone: the {} child run(s) of position {} are compensated",
            f.undo_total, f.seq
        );
        go_on(tx, topology, vec![(waiting, How::Undone(line))]).await?;
    }
    Ok(())
}

/// Stops a parent whose children's undo stopped for review at the position that waits for
/// them, its note naming those children; a parent that is itself a child is counted failed in
/// its own parent's undo, so that no run above waits for it for ever.
async fn stop_undo(
    tx: &mut PgConnection,
    topology: &Topology,
    w: Waiting,
    f: &children::UndoRow,
) -> store::Result<()> {
    let failed = children::failed(&mut *tx, (&f.run_id, f.seq), NOTE_NAMES, children::Join::Undo).await?;
    let why = format!(
        "the undo of {} of its {} child run(s) (started at position {}) stopped",
        f.undo_failed, f.undo_total, f.seq
    );
    let error = format!(
        "run {} waited at {} (position {}) for its child runs to be compensated: {why}",
        w.run_id, w.step, w.seq
    );
    let line = format!("children undo: {why}; stopped for review (stopped:{})", names(&failed));
    let note = json!({
        "error_class": "children_undo_failed",
        "error": error,
        "waiting_for": "children_undone", "step": w.step, "seq": w.seq, "fan_out": f.seq,
        "children": { "total": f.undo_total, "compensated": f.undone, "stopped": f.undo_failed,
                      "compensating": f.undo_total - f.undone - f.undo_failed },
        "failed": listed(&failed),
        "on_resume": format!(
            "bring each named child to compensated (fix its compensation, then `trailmark run resume CHILD --after-fix`; a cancelled one: `trailmark run undo CHILD`), then `trailmark run resume {}`: the run waits for its children again and goes on with {} once every one is compensated (compensations already done are not repeated)",
            w.run_id, w.step
        ),
    });
    let said = Stopped { class: "children_undo_failed", error, note, line };
    stop_for_review(tx, topology, &w, said, (&f.run_id, f.seq, children::Join::Undo)).await
}

/// The failed children a note names, as `(index, run id, state, why)`.
type Failed = Vec<(i32, String, String, Option<String>)>;

/// " idx=run" for each of `failed`, for a progress line.
fn names(failed: &Failed) -> String {
    let mut out = String::new();
    for (idx, id, _, _) in failed {
        let _ = write!(out, " {idx}={id}");
    }
    out
}

/// `failed` as the handover note lists them.
fn listed(failed: &Failed) -> Vec<serde_json::Value> {
    (failed.iter())
        .map(|(idx, id, state, reason)| {
            json!({ "index": idx, "run_id": id, "state": state, "reason": reason })
        })
        .collect()
}

/// What a join's stop of its parent says: its error class and error, its handover note and its
/// progress line.
struct Stopped {
    class: &'static str,
    error: String,
    note: serde_json::Value,
    line: String,
}

/// Stops the parent `w` for review (unless it stopped already), marks the fan-out's join at
/// (run, position) stopped, queues the run's event and progress line; a parent that is itself a
/// child is counted failed in its own parent's join, in the same transaction (which locked the
/// runs above first, top down), so that no run above waits for it for ever.
async fn stop_for_review(
    tx: &mut PgConnection,
    topology: &Topology,
    w: &Waiting,
    said: Stopped,
    (fan_out, seq, join): (&str, i32, children::Join),
) -> store::Result<()> {
    let status = RunStatus::Waiting
        .move_to(RunStatus::NeedsReview)
        .map_err(|e| store::Error::unavailable("a waiting run cannot stop for review", e))?;
    if !children::stop_parent(&mut *tx, (&w.run_id, w.seq), status, &said.error, &said.note).await? {
        return Ok(());
    }
    children::stopped(&mut *tx, (fan_out, seq), join).await?;
    if let Ok(run_id) = RunId::parse(&w.run_id)
        && let Some(event) = Event::run(
            &run_id,
            (&w.workflow, w.workflow_version),
            RunStatus::NeedsReview,
            Some((&w.step, w.seq)),
        )
    {
        let event = event.with_error(said.class, &said.error);
        outbox::insert(&mut *tx, &[topology.event_message(&event)]).await?;
    }
    let line = progress::NewLine { run_id: w.run_id.clone(), seq: w.seq, at: chrono::Utc::now(), line: said.line };
    progress::record(&mut *tx, &[line]).await?;
    if children::parent_of(&mut *tx, &w.run_id).await?.is_some() {
        count_end(tx, topology, &w.run_id, ("failed", Some(&said.error))).await?;
    }
    Ok(())
}

/// Cancels every run below `run_id` that has not ended (its children, theirs, ...), in the
/// transaction of the decision that cancels `run_id`, and queues their `run.cancelled` events.
/// With `seq`, only those of the fan-out at that position (its join took the first n).
pub(crate) async fn cancel_below(
    tx: &mut PgConnection,
    topology: &Topology,
    (run_id, seq): (&str, Option<i32>),
    reason: &str,
) -> store::Result<usize> {
    let cancelled = children::cancel_below(&mut *tx, (run_id, seq), reason).await?;
    let events: Vec<_> = cancelled
        .iter()
        .filter_map(|(id, workflow, version, step, seq)| {
            let id = RunId::parse(id).ok()?;
            let at = step.as_ref().map(|s| (s, *seq));
            Event::run(&id, (workflow, *version), RunStatus::Cancelled, at)
        })
        .map(|e| topology.event_message(&e))
        .collect();
    outbox::insert(&mut *tx, &events).await?;
    Ok(cancelled.len())
}

/// What the join says of a fan-out as it stands.
#[derive(Debug, PartialEq)]
enum Join {
    /// Not yet: start children while there is room.
    Wait,
    /// The condition holds: the parent goes on.
    GoOn,
    /// The parent stops for review, for this reason.
    Stop(String),
}

/// The join's verdict (no I/O).
fn join(f: &FanOutRow) -> Join {
    if f.failed > f.max_failures {
        return Join::Stop(format!(
            "{} of its {} children failed, more than the {} its failure threshold allows",
            f.failed, f.total, f.max_failures
        ));
    }
    match f.first_n {
        Some(n) if f.succeeded >= n => Join::GoOn,
        Some(n) if f.total - f.failed < n => Join::Stop(format!(
            "{} of its {} children failed, so the {n} it waits for can no longer succeed",
            f.failed, f.total
        )),
        Some(_) => Join::Wait,
        None if f.succeeded + f.failed >= f.total => Join::GoOn,
        None => Join::Wait,
    }
}

/// Acts on the join: starts children while there is room, moves the parent on once, or stops
/// it for review; only while the parent still waits at the fan-out's position.
async fn settle(
    tx: &mut PgConnection,
    (topology, failpoints): (&Topology, &Failpoints),
    f: FanOutRow,
) -> store::Result<()> {
    if f.joined {
        return Ok(());
    }
    let Some(waiting) = waits::waiting_at(&mut *tx, &f.run_id, f.seq).await? else {
        return Ok(());
    };
    match join(&f) {
        Join::Wait => {
            // Room for more, and more to start (none once every child has started).
            let room = (f.max_in_flight - f.in_flight()).min(f.total - f.started);
            let next = children::take_pending(&mut *tx, (&f.run_id, f.seq), room).await?;
            start(tx, (topology, failpoints), &f.run_id, next).await
        }
        Join::GoOn => {
            if children::join_once(&mut *tx, (&f.run_id, f.seq), children::Join::Runs).await? {
                let line = format!(
                    "children joined: {} succeeded, {} failed of {}",
                    f.succeeded, f.failed, f.total
                );
                go_on(tx, topology, vec![(waiting, How::Joined(line))]).await?;
                if let Some(n) = f.first_n {
                    // The rest are no longer needed: they stop now, before another effect.
                    let why = format!(
                        "cancelled: its parent run {} went on once the first {n} of its {} children succeeded (join at position {})",
                        f.run_id, f.total, f.seq
                    );
                    cancel_below(tx, topology, (&f.run_id, Some(f.seq)), &why).await?;
                }
            }
            Ok(())
        }
        Join::Stop(why) => stop(tx, topology, waiting, &f, &why).await,
    }
}

/// Creates the runs of children taken to start, each with its first step message, through the
/// one run-creation path.
async fn start(
    tx: &mut PgConnection,
    (topology, failpoints): (&Topology, &Failpoints),
    parent: &str,
    next: Vec<ToStart>,
) -> store::Result<()> {
    if next.is_empty() {
        return Ok(());
    }
    // Children continue the parent's trace: each child's run span is a child of the parent's
    // run span (not of the step that started the fan-out: children started later, when another
    // ends or a person resumes the parent, come long after that step's attempt ended).
    let trace = runs::traceparent(&mut *tx, parent).await?;
    for child in next {
        // A crash test kills the process here, halfway through starting a fan-out: its
        // transaction, and so every child it started, is gone with it.
        failpoints
            .hit("children.starting")
            .map_err(|e| store::Error::unavailable("a fan-out's children were being started", e))?;
        let run_id = RunId::parse(&child.run_id).map_err(|e| {
            store::Error::unavailable("a child's run id was checked when it was recorded", e)
        })?;
        let event = RunStartEvent {
            v: 1,
            run_id,
            workflow: child.workflow.clone(),
            input: child.input,
            priority: None,
            version: Some(child.workflow_version),
        };
        // A child run is not counted under a concurrency key: it runs in its parent's slot's
        // stead, and its parent waits for it (see docs/ARCHITECTURE.md, "Concurrency keys").
        let wf = (child.workflow.as_str(), child.workflow_version, None);
        let created =
            run_start::create(tx, (topology, Some(parent)), wf, &child.first_step, (&event, trace.as_deref()), |_| {})
                .await?;
        if let Created::Exists(run) = created {
            // Only a run started by hand under a child's id can be there (the fan-out's own
            // commit is atomic): it is the child, if it is the same start.
            let same = run.started_with(&child.workflow, &event.input);
            tracing::warn!(run.id = %event.run_id, same, "a child's run id was taken before its parent started it");
        }
    }
    Ok(())
}

/// Runs a failed child again from the step that stopped it (its attempts reset, as a resume
/// after a fix does), queueing that step's message; a child stopped by its own children's join
/// waits for them again, its failed ones run again, and so on down the family.
async fn resume_child(
    tx: &mut PgConnection,
    topology: &Topology,
    child: &str,
    after_fix: bool,
) -> store::Result<()> {
    if let Some(seq) = children::rewait_child(&mut *tx, child).await? {
        // A child stopped past its own children's threshold: as a resume of it alone would,
        // it waits again and its failed children run again (its fan-out step does not).
        Box::pin(reopen(tx, topology, (child, seq), after_fix)).await?;
        return Ok(());
    }
    let Some((workflow, version, step, seq)) =
        children::reopen_child(&mut *tx, child, after_fix).await?
    else {
        return Ok(());
    };
    let Ok(run_id) = RunId::parse(child) else {
        return Ok(());
    };
    let message = topology.step_message(&run_id, &workflow, version, &step, seq);
    outbox::insert(&mut *tx, &[message]).await?;
    Ok(())
}

/// Stops the parent for review at the fan-out's step, its note naming the failed children; a
/// parent that is itself a child is counted failed in its own parent's join, in the same
/// transaction (which locked the runs above first, top down).
async fn stop(
    tx: &mut PgConnection,
    topology: &Topology,
    w: Waiting,
    f: &FanOutRow,
    why: &str,
) -> store::Result<()> {
    let failed = children::failed(&mut *tx, (&f.run_id, f.seq), NOTE_NAMES, children::Join::Runs).await?;
    let error = format!("run {} waited at step {} (position {}) for its children: {why}", w.run_id, w.step, w.seq);
    let line = format!("children: {why}; stopped for review (failed:{})", names(&failed));
    let note = json!({
        "error_class": "children_failed",
        "error": error,
        "waiting_for": "children", "step": w.step, "seq": w.seq,
        "children": { "total": f.total, "succeeded": f.succeeded, "failed": f.failed,
                      "running": f.in_flight(), "max_failures": f.max_failures },
        "failed": listed(&failed),
        "on_resume": format!(
            "fix the cause, then `trailmark run resume {} --after-fix`: the run waits for its children again and only the failed ones run again, each from where it stopped (step {} does not run again); cancel or undo otherwise",
            w.run_id, w.step
        ),
    });
    let said = Stopped { class: "children_failed", error, note, line };
    stop_for_review(tx, topology, &w, said, (&f.run_id, f.seq, children::Join::Runs)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fan(total: i32, first_n: Option<i32>, max_failures: i32) -> FanOutRow {
        FanOutRow {
            run_id: "p".into(),
            seq: 1,
            total,
            first_n,
            max_failures,
            max_in_flight: 5,
            started: total,
            succeeded: 0,
            failed: 0,
            joined: false,
        }
    }

    #[test]
    fn the_join_holds_for_all_or_the_first_n_and_stops_past_the_threshold() {
        let mut all = fan(10, None, 1);
        assert_eq!(join(&all), Join::Wait);
        (all.succeeded, all.failed) = (9, 1);
        assert_eq!(join(&all), Join::GoOn, "one failure is allowed");
        (all.succeeded, all.failed) = (3, 2);
        assert!(matches!(join(&all), Join::Stop(why) if why.contains("2 of its 10")));
        let mut first = fan(10, Some(3), 8);
        first.succeeded = 3;
        assert_eq!(join(&first), Join::GoOn);
        (first.succeeded, first.failed) = (1, 8);
        assert!(matches!(join(&first), Join::Stop(why) if why.contains("can no longer")));
        assert_eq!(join(&fan(0, None, 0)), Join::GoOn, "no children: the join holds at once");
    }
}

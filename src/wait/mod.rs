//! Runs that wait: for an event (a supplier's reply, a webhook) or for a time (a sleep).
//!
//! A step ends by waiting ([`crate::workflow::StepOutcome::wait_for_event`], `sleep_for`); its
//! commit puts the run in `waiting` at that step, holding no lease and no message, and registers
//! the wait (a row of `waits`, [`commit`]) in the same transaction. Three things move a waiting
//! run on, each in one transaction that closes the wait, moves the run to its next step and
//! queues that step's message through the outbox ([`go_on`]):
//!
//! - an event sent to it ([`send`]: the API, the CLI, AMQP, an embedding program);
//! - its due time, found by the supervisor's timer loop ([`timers`]): a sleep's wake-up, an
//!   event wait's timeout;
//! - an operator's decision (cancel, undo), which closes the wait with the run.
//!
//! The lost-event race (an event arriving while its wait is being committed) cannot happen:
//! both transactions take the advisory lock of the event's (name, key) pair before they look
//! for each other (`store::waits::lock_pair`), so the second sees the first's commit; an event
//! that comes first is kept ([`send`]) and taken by the wait when it comes ([`commit`]).

pub(crate) mod children;
mod send;
pub mod timers;

use std::ops::ControlFlow;
use std::fmt::Write;

use serde_json::json;
use sqlx::{PgConnection, PgPool};

pub use send::{EventSent, SendError, Sender, send};

use crate::broker::Topology;
use crate::domain::{Event, RunId, RunStatus, StepAddress, WaitFor};
use crate::store::checkpoint::{self, Committed, StepCommit};
use crate::store::waits::{self, Move, Waiting};
use crate::store::{self, outbox, progress};

/// Commits a step that ends by waiting, and registers its wait, in one transaction. For an
/// event wait, the pair's lock is taken first, and an event that came before the wait is taken
/// at once: the run then goes on in this same transaction.
pub(crate) async fn commit(
    pool: &PgPool,
    (topology, failpoints): (&Topology, &crate::failpoint::Failpoints),
    step: StepCommit,
) -> store::Result<Committed> {
    let wait = step.wait.as_ref().expect("a commit that registers a wait");
    let mut tx = pool.begin().await?;
    if let Some((name, key)) = wait.event() {
        waits::lock_pair(&mut tx, name, key).await?;
    }
    if let WaitFor::UndoneChildren(_) | WaitFor::Children(_) = &wait.what {
        // The runs above first, then this one: settling the join (a fan-out's, or its undo's)
        // may stop this run for review and count it in its own parent (`children::undo_at`,
        // `children::register`).
        store::children::lock_line(&mut tx, step.run_id.as_str()).await?;
    }
    let (mut tx, committed) = match checkpoint::commit_first(pool, tx, &step).await {
        ControlFlow::Continue(went_in) => went_in,
        ControlFlow::Break(answer) => return answer,
    };
    let at = (step.run_id.as_str(), step.to.seq, &step.step);
    if let WaitFor::Children(fan) = &wait.what {
        // A resumed fan-out step reopens the wait it registered the first time.
        if !waits::reopen(&mut tx, at.0, at.1).await? {
            waits::insert(&mut tx, at, wait).await?;
        }
        let parent = (&step.run_id, at.1);
        children::register(&mut tx, (topology, failpoints), parent, fan).await?;
        tx.commit().await?;
        return Ok(committed);
    }
    if let WaitFor::UndoneChildren(fan_out) = &wait.what {
        // A resumed undo waits again where it stopped: the wait it registered is reopened.
        if !waits::reopen(&mut tx, at.0, at.1).await? {
            waits::insert(&mut tx, at, wait).await?;
        }
        children::undo_at(&mut tx, topology, (at.0, at.1), *fan_out).await?;
        tx.commit().await?;
        return Ok(committed);
    }
    waits::insert(&mut tx, at, wait).await?;
    if let Some((name, key)) = wait.event()
        && let Some(id) = waits::take_pending(&mut tx, name, key).await?
        && let Some(waiting) = waits::waiting_at(&mut tx, at.0, at.1).await?
    {
        tracing::info!(event.id = %id, event = name, key, "the event came before the wait: taken at once");
        go_on(&mut tx, topology, vec![(waiting, How::Event(id))]).await?;
    }
    tx.commit().await?;
    Ok(committed)
}

/// What moves a waiting run on.
#[derive(Debug, Clone)]
enum How {
    /// The event with this id.
    Event(String),
    /// Its due time: a sleep's wake-up, or an event wait's timeout.
    Due,
    /// Its children's join held (what the progress line says of them).
    Joined(String),
    /// Its children's undo join held: every one is compensated (what the progress line says).
    Undone(String),
}

/// Where one waiting run goes, and what it says about it.
struct Going {
    waiting: Waiting,
    resolution: &'static str,
    signal_id: Option<String>,
    status: RunStatus,
    step: StepAddress,
    error: Option<String>,
    line: String,
}

/// Moves waiting runs on in the caller's transaction: closes each wait, moves its run to its
/// next step (or, for an event wait that timed out with no step to divert to, stops it in
/// `needs_review`), and queues the step's message, the lifecycle event and a progress line.
/// Returns the runs moved (a run that no longer waits is left alone).
async fn go_on(
    tx: &mut PgConnection,
    topology: &Topology,
    runs: Vec<(Waiting, How)>,
) -> store::Result<Vec<String>> {
    let going: Vec<Going> = runs.into_iter().map(|(w, how)| where_to(w, how)).collect();
    let mut moves = Vec::with_capacity(going.len());
    for g in &going {
        let status = RunStatus::Waiting
            .move_to(g.status)
            .map_err(|e| store::Error::unavailable("a waiting run cannot move on", e))?;
        moves.push(Move {
            run_id: &g.waiting.run_id,
            seq: g.waiting.seq,
            resolution: g.resolution,
            signal_id: g.signal_id.as_deref(),
            status,
            step: &g.step,
            error: g.error.clone(),
            handover: g.error.as_ref().map(|e| review_note(&g.waiting, e)),
        });
    }
    let moved = waits::move_on(tx, &moves).await?;
    let going: Vec<Going> = going
        .into_iter()
        .filter(|g| moved.contains(&g.waiting.run_id))
        .collect();
    let mut messages = Vec::with_capacity(going.len() * 2);
    let mut lines = Vec::with_capacity(going.len());
    for g in &going {
        let Ok(run_id) = RunId::parse(&g.waiting.run_id) else {
            continue;
        };
        messages.extend(announce(topology, &run_id, g));
        lines.push(progress::NewLine {
            run_id: g.waiting.run_id.clone(),
            seq: g.waiting.seq + 1,
            at: chrono::Utc::now(),
            line: g.line.clone(),
        });
        // An event or a join is not due at a time: no lateness to measure.
        let timed = !matches!(g.resolution, "event" | "children");
        let late = timed.then_some(g.waiting.late_secs);
        crate::metrics::wait_ended(g.resolution, late);
    }
    outbox::insert(&mut *tx, &messages).await?;
    progress::record(tx, &lines).await?;
    Ok(going.into_iter().map(|g| g.waiting.run_id).collect())
}

/// The outbox rows of a run moved on: its next step's message and `run.resumed`, or its
/// `run.needs_review` event.
fn announce(topology: &Topology, run_id: &RunId, g: &Going) -> Vec<crate::domain::OutgoingMessage> {
    let w = &g.waiting;
    let at = (&g.step, w.seq + 1);
    match &g.error {
        Some(error) => Event::run(
            run_id,
            (&w.workflow, w.workflow_version),
            RunStatus::NeedsReview,
            Some(at),
        )
        .map(|e| topology.event_message(&e.with_error("wait_timeout", error)))
        .into_iter()
        .collect(),
        None => {
            let by = match &g.signal_id {
                Some(id) => format!("event {id}"),
                None if w.kind == "sleep" => "wake-up".to_owned(),
                None if w.kind == "children" => "children".to_owned(),
                None => "timeout".to_owned(),
            };
            let resumed =
                Event::resumed(run_id, (&w.workflow, w.workflow_version), g.status, at, &by);
            vec![
                topology.step_message(run_id, &w.workflow, w.workflow_version, &g.step, at.1),
                topology.event_message(&resumed),
            ]
        }
    }
}

/// Where a waiting run goes when `how` moves it on.
fn where_to(w: Waiting, how: How) -> Going {
    let time = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M:%S UTC").to_string();
    let event = || {
        format!(
            "event {} (key {})",
            w.event_name.as_deref().unwrap_or("-"),
            w.match_key.as_deref().unwrap_or("-")
        )
    };
    let mut line = String::new();
    let (resolution, signal_id, status, step, error) = match how {
        How::Event(id) => {
            let _ = write!(
                line,
                "{} {id} came after waiting since {}; going on with step {}",
                event(),
                time(w.since),
                w.next_step
            );
            ("event", Some(id), RunStatus::Running, w.next_step.clone(), None)
        }
        How::Joined(said) => {
            let _ = write!(line, "{said}; going on with step {}", w.next_step);
            ("children", None, RunStatus::Running, w.next_step.clone(), None)
        }
        How::Undone(said) => {
            let _ = write!(line, "{said}; going on with {}", w.next_step);
            ("children", None, RunStatus::Compensating, w.next_step.clone(), None)
        }
        How::Due if w.kind == "sleep" => {
            let _ = write!(
                line,
                "woke after sleeping until {}; going on with step {}",
                time(w.due_at),
                w.next_step
            );
            ("woke", None, RunStatus::Running, w.next_step.clone(), None)
        }
        How::Due => match &w.on_timeout {
            Some(target) => {
                let _ = write!(
                    line,
                    "no {} by {}: going on with step {target}",
                    event(),
                    time(w.due_at)
                );
                ("timeout", None, RunStatus::Running, target.clone(), None)
            }
            None => {
                let error = format!(
                    "run {} waited at step {} (position {}) for {} from {} until {}, and none came",
                    w.run_id,
                    w.step,
                    w.seq,
                    event(),
                    time(w.since),
                    time(w.due_at)
                );
                let _ = write!(line, "no {} by {}: stopped for review", event(), time(w.due_at));
                let next = w.next_step.clone();
                ("timeout", None, RunStatus::NeedsReview, next, Some(error))
            }
        },
    };
    Going {
        waiting: w,
        resolution,
        signal_id,
        status,
        step,
        error,
        line,
    }
}

/// The handover note of a run whose event did not come in time.
fn review_note(w: &Waiting, error: &str) -> serde_json::Value {
    json!({
        "error_class": "wait_timeout",
        "error": error,
        "waiting_for": { "event": w.event_name, "key": w.match_key, "since": w.since, "until": w.due_at },
        "step": w.step, "seq": w.seq,
        "on_resume": format!(
            "`trailmark run resume {}` goes on with step {} (position {}) without the event; a late event is kept for no one (`trailmark event list`); cancel or undo otherwise",
            w.run_id, w.next_step, w.seq + 1
        ),
    })
}

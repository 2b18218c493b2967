//! How a step ends, decided without I/O: from the message, what the claim found and what the
//! handler returned, [`decide`] chooses between committing the step, stopping the run for a
//! person, retrying later and dropping the work; [`to_commit`] turns an ending into the one
//! statement that commits it. The worker (`step.rs`) does the I/O around both.

use std::time::Duration;

use serde_json::{Value, json};

use super::STEP_CONSUMER;
use crate::broker::{DELAY_TIERS_MS, Topology};
use crate::domain::{
    ChildStart, Due, Event, FanOut, Fence, IllegalMove, LocalWrite, MAX_CHILDREN, NewWait,
    OutgoingMessage, RunStatus, StepAddress, StepMessage, UndoPlan, WaitFor, allowed_failures,
    child_run_id,
};
use crate::store::checkpoint::{Advance, StepCommit};
use crate::workflow::{
    Children, Next, OnTimeout, Parked, Pause, Pending, Registry, StepError, StepOutcome, Workflow,
};

/// What the claim found about the step, as far as its ending depends on it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Claimed<'a> {
    /// Which attempt at this position this is (1-based, counted across crashes).
    pub attempt: i32,
    /// The undo plan, while compensating.
    pub plan: Option<&'a UndoPlan>,
}

/// The limits an ending is decided under (`worker.max_attempts`, `worker.retry_base_ms`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Claims of one step before the run goes to needs_review.
    pub max_attempts: i32,
    /// First delay of a delayed retry; doubles per attempt.
    pub retry_base_ms: u64,
    /// Longest sleep or event timeout a step may ask for (`waits.max_secs`).
    pub max_wait_secs: u64,
}

/// What a step's commit writes, by how it ended.
#[derive(Debug)]
pub(super) enum Ending {
    /// Checkpoint the output and move to `next` (or end the run when `None`).
    Advance {
        /// The step's output.
        output: Value,
        /// The next step.
        next: Option<StepAddress>,
        /// Outside messages the step queued with `ctx.send`.
        sent: Vec<OutgoingMessage>,
        /// Items the step parked.
        parked: Vec<Parked>,
        /// Rows the step writes with its commit (`ctx.local_write`).
        writes: Vec<LocalWrite>,
    },
    /// Checkpoint the output and wait for an event or a time before the next step (the run
    /// stays at this step, in `waiting`, holding no lease).
    Pause {
        /// The step's output.
        output: Value,
        /// What the run waits for, and the step it goes on with.
        wait: NewWait,
        /// Outside messages the step queued with `ctx.send`.
        sent: Vec<OutgoingMessage>,
        /// Items the step parked.
        parked: Vec<Parked>,
        /// Rows the step writes with its commit (`ctx.local_write`).
        writes: Vec<LocalWrite>,
    },
    /// Wait for a person (a human step's question, or a frozen step's evidence).
    Wait {
        /// What the person must decide, with the evidence.
        note: Value,
        /// Outside messages a human step queued before asking (the step does not run again).
        sent: Vec<OutgoingMessage>,
        /// Items it parked.
        parked: Vec<Parked>,
        /// Rows a human step wrote before asking.
        writes: Vec<LocalWrite>,
    },
    /// Stop the run for a person; the step is not advanced.
    Review {
        /// One line: which run stopped where, and why.
        error: String,
        /// The error's class (`tool_auth`, `guard`, `unknown`, ...).
        class: &'static str,
        /// The handover note.
        note: Value,
    },
}

/// What the worker does with a step whose handler has returned.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Commit the step.
    Commit(Ending),
    /// Stop the run for a person: the worker writes the handover note (it reads the run's
    /// effects), then commits [`Ending::Review`].
    Review(StepError),
    /// Give the lease back and run the step again after `delay`, under the same keys.
    Retry {
        /// How long the message waits in a delay queue.
        delay: Duration,
        /// What failed.
        reason: String,
        /// Whether the attempt stays counted: `false` for a wait on an open circuit breaker or
        /// a model's rate limit, where no call was made, so its claim's attempt is given back
        /// with the lease.
        counted: bool,
        /// The class of the error that made the step wait ([`StepError::class`]).
        class: &'static str,
    },
    /// The work is void: a newer worker owns the run.
    Stale(&'static str),
    /// Trailmark's own database or broker failed: the delivery is retried as a whole.
    Infrastructure(String),
}

impl Verdict {
    /// The verdict's name, as the step-duration metric's `outcome` label.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Commit(Ending::Advance { .. }) => "committed",
            Self::Commit(Ending::Wait { .. } | Ending::Pause { .. }) => "waiting",
            Self::Commit(Ending::Review { .. }) | Self::Review(_) => "review",
            Self::Retry { counted: true, .. } => "retry",
            Self::Retry {
                counted: false,
                class: "throttled",
                ..
            } => "throttled_wait",
            Self::Retry { counted: false, .. } => "breaker_wait",
            Self::Stale(_) => "stale",
            Self::Infrastructure(_) => "infrastructure",
        }
    }
}

/// Guards checked before the handler runs: the attempt cap (so a step that kills its worker
/// every time still ends) and the run's hard timeout (`run_timeout_secs`, 0: none).
pub(super) fn refuse_before_running(
    msg: &StepMessage,
    claimed: Claimed<'_>,
    limits: Limits,
    age_secs: f64,
    run_timeout_secs: u64,
) -> Option<StepError> {
    let max = limits.max_attempts;
    if claimed.attempt > max {
        return Some(StepError::Guard(format!(
            "step {} was claimed {} times without finishing (worker.max_attempts = {max}); it may be crashing its worker or failing every time",
            msg.step,
            claimed.attempt - 1
        )));
    }
    if run_timeout_secs > 0 && age_secs > run_timeout_secs as f64 {
        return Some(StepError::Guard(format!(
            "run timed out: it started {age_secs:.0} s ago, guards.run_timeout_secs is {run_timeout_secs}"
        )));
    }
    None
}

/// A step of a run started on an older version of its workflow: the deployed version may not
/// fit the run's checkpoints (that is what a new version number says), so a person decides.
pub(super) fn refuse_older_version(msg: &StepMessage, deployed: i32) -> Option<StepError> {
    (msg.version < deployed).then(|| {
        StepError::Unknown(format!(
            "run {run} was started on {wf} v{old}, and no live worker carries v{old} (this one carries up to v{deployed}): check that the run's checkpoints fit v{deployed}, then `trailmark run resume {run} --after-fix` continues it on v{deployed} (or `trailmark run undo {run}`); to let runs of v{old} finish by themselves, deploy a build that registers v{old} beside v{deployed}",
            run = msg.run_id,
            wf = msg.workflow,
            old = msg.version,
        ))
    })
}

/// How the step ends, given what its handler returned and what it queued (`pending`: outside
/// messages, parked items and local writes, committed only with an ending that keeps the
/// step's work).
pub(super) fn decide(
    (workflow, registry): (&Workflow, &Registry),
    msg: &StepMessage,
    claimed: Claimed<'_>,
    limits: Limits,
    result: Result<StepOutcome, StepError>,
    pending: Pending,
) -> Verdict {
    let Pending {
        sent,
        parked,
        writes,
    } = pending;
    let failure = match result.and_then(StepOutcome::checked) {
        Ok(outcome) if outcome.next == Next::Wait && outcome.pause().is_some() => {
            StepError::Unknown(format!(
                "step {} asked a person and asked to wait for an event or a time at once; a step does one or the other: fix the workflow and resume after the fix",
                msg.step
            ))
        }
        Ok(StepOutcome {
            output,
            next: Next::Wait,
            ..
        }) => {
            // `decision` (and `approval`, `step::doubt`) mark a wait for a person: the supervisor's
            // human-timeout scan finds such runs through an index on this note kind
            // (`runs_person_waits_idx`, migrations/20261203000045_periodic_scans.sql).
            let note = json!({ "waiting_for": "decision", "step": msg.step, "seq": msg.seq, "question": output });
            return Verdict::Commit(Ending::Wait {
                note,
                sent,
                parked,
                writes,
            });
        }
        Ok(outcome) => match next_step(workflow, msg, claimed.plan, &outcome.next) {
            Ok(next) => match outcome.pause().cloned() {
                None => {
                    return Verdict::Commit(Ending::Advance {
                        output: outcome.output,
                        next,
                        sent,
                        parked,
                        writes,
                    });
                }
                Some(pause) => match wait_of((workflow, registry), msg, next, &pause, limits) {
                    Ok(wait) => {
                        return Verdict::Commit(Ending::Pause {
                            output: outcome.output,
                            wait,
                            sent,
                            parked,
                            writes,
                        });
                    }
                    Err(e) => e,
                },
            },
            Err(e) => e,
        },
        Err(StepError::FencedOut) => return Verdict::Stale("fenced out while executing"),
        Err(StepError::Infrastructure(e)) => return Verdict::Infrastructure(e),
        Err(StepError::Temporary {
            reason,
            retry_after,
        }) if claimed.attempt < limits.max_attempts => {
            let doubling = 1u64 << (claimed.attempt - 1).clamp(0, 16);
            let delay = retry_after.unwrap_or(Duration::from_millis(
                limits.retry_base_ms.saturating_mul(doubling),
            ));
            return Verdict::Retry {
                delay,
                reason,
                counted: true,
                class: "temporary",
            };
        }
        // Before the attempt cap: a wait on a breaker or a model's rate limit spends no attempt,
        // so it is not capped either (the run's timeout and a failing probe, which counts, still
        // end it; a rate limit's window always empties within a few minutes).
        Err(waiting) if let Some(wait) = waiting.uncounted_wait() => {
            return Verdict::Retry {
                delay: breaker_delay(wait),
                reason: waiting.to_string(),
                counted: false,
                class: waiting.class(),
            };
        }
        Err(StepError::Temporary { reason, .. }) => StepError::Guard(format!(
            "step {} failed temporarily {} times (worker.max_attempts); last error: {reason}",
            msg.step, claimed.attempt
        )),
        Err(e) => e,
    };
    Verdict::Review(failure)
}

/// How long a step waits for a breaker that lets a probe through after `wait` (or for a model's
/// rate limit with room after `wait`): the longest delay tier that ends by then (give or take a
/// second), so the step is back at the probe, not a tier later; a step back early is refused
/// again at no cost.
fn breaker_delay(wait: Duration) -> Duration {
    let by = wait.as_millis() as u64 + 1_000;
    let tier = DELAY_TIERS_MS
        .iter()
        .rev()
        .copied()
        .find(|t| *t <= by)
        .unwrap_or(DELAY_TIERS_MS[0]);
    Duration::from_millis(tier)
}

/// The wait a step's outcome asks for, checked: a step that waits must be followed by a step
/// (an event's timeout may divert to a declared one), its event's name and key must be ones an
/// event can carry, and its duration more than zero and at most `waits.max_secs`. Refused, the
/// run stops for review naming what to fix.
fn wait_of(
    (workflow, registry): (&Workflow, &Registry),
    msg: &StepMessage,
    next: Option<StepAddress>,
    pause: &Pause,
    limits: Limits,
) -> Result<NewWait, StepError> {
    let refuse = |why: String| {
        StepError::Unknown(format!(
            "step {} asked to wait, but {why}; fix the workflow and resume after the fix",
            msg.step
        ))
    };
    if msg.step.is_undo() {
        return Err(refuse("a compensation cannot wait".into()));
    }
    let Some(next_step) = next else {
        return Err(refuse(
            "the run would end after it: a step that waits must be followed by a step".into(),
        ));
    };
    let max = limits.max_wait_secs as f64;
    let span = |what: &str, secs: f64| {
        if secs > 0.0 && secs <= max {
            Ok(secs)
        } else {
            Err(refuse(format!(
                "its {what} is {secs} s: it must be more than 0 and at most {max} s (waits.max_secs)"
            )))
        }
    };
    let what = match pause {
        Pause::Event(wait) => {
            let key = wait.key.clone().unwrap_or_else(|| msg.run_id.to_string());
            crate::domain::check_name(&wait.name).map_err(|e| refuse(e.to_string()))?;
            crate::domain::check_key(&key).map_err(|e| refuse(e.to_string()))?;
            let on_timeout = match &wait.on_timeout {
                OnTimeout::Goto(step) => {
                    workflow.resolve_next(&msg.step, &Next::Goto(step.clone()))?
                }
                _ => None,
            };
            WaitFor::Event {
                name: wait.name.clone(),
                key,
                timeout_secs: span("timeout", wait.timeout.as_secs_f64())?,
                on_timeout,
            }
        }
        Pause::SleepFor(d) => WaitFor::Sleep(Due::In(span("sleep", d.as_secs_f64())?)),
        Pause::Children(children) => WaitFor::Children(fan_out(registry, msg, children)?),
        Pause::SleepUntil(at) => {
            let ahead = (*at - chrono::Utc::now()).num_milliseconds() as f64 / 1000.0;
            if ahead > max {
                span("sleep", ahead)?;
            }
            WaitFor::Sleep(Due::At(*at))
        }
    };
    Ok(NewWait { next_step, what })
}

/// The fan-out a step's outcome asks for, checked before anything is written: at most
/// [`MAX_CHILDREN`] children, each of a workflow registered here that accepts its input, ids
/// that fit, a join and a threshold within range. Refused, the step fails as a permanent error
/// naming the reason, and no child is started.
fn fan_out(registry: &Registry, msg: &StepMessage, c: &Children) -> Result<FanOut, StepError> {
    let total = c.children.len();
    let refuse = |why: String| {
        StepError::Unknown(format!(
            "step {} asked to start {total} child runs, but {why}; no child was started: fix the workflow and resume after the fix",
            msg.step
        ))
    };
    if let Some(why) = &c.unserializable {
        return Err(refuse(why.clone()));
    }
    if total > MAX_CHILDREN {
        return Err(refuse(format!("the most one step may start is {MAX_CHILDREN}")));
    }
    if total > 0 {
        child_run_id(&msg.run_id, msg.seq, total - 1).map_err(|e| {
            refuse(format!("the children's run ids (<run>:<position>:<index>) would not be valid: {e}"))
        })?;
    }
    let mut children = Vec::with_capacity(total);
    for (index, (name, input)) in c.children.iter().enumerate() {
        let found = registry
            .accepting(name, None, input)
            .map_err(|e| refuse(format!("child {index}: {e}")))?;
        let first_step = found
            .first_step()
            .ok_or_else(|| refuse(format!("child {index}: workflow {name} has no steps")))?;
        children.push(ChildStart {
            workflow: found.name.clone(),
            version: found.version,
            first_step,
            input: input.clone(),
        });
    }
    let max_failures = allowed_failures(c.threshold, total).map_err(refuse)?;
    let first_n = match c.first {
        Some(n) if n == 0 || n > total => {
            return Err(refuse(format!("it waits for the first {n}: it must be from 1 to {total}")));
        }
        n => n.map(|n| n as i32),
    };
    let max_in_flight = match c.max_in_flight {
        Some(0) => return Err(refuse("its max_in_flight is 0: it must be at least 1".into())),
        Some(n) => n.min(total.max(1)),
        None => total.max(1),
    };
    Ok(FanOut {
        children,
        first_n,
        max_failures,
        max_in_flight: max_in_flight as i32,
    })
}

/// The step after this one: the next compensation while undoing, else the workflow's choice.
fn next_step(
    workflow: &Workflow,
    msg: &StepMessage,
    plan: Option<&UndoPlan>,
    next: &Next,
) -> Result<Option<StepAddress>, StepError> {
    if msg.step.is_undo() {
        return Ok(plan.and_then(|p| p.after(&msg.step)));
    }
    workflow.resolve_next(&msg.step, next)
}

/// The one line a review ending records as the run's error.
pub(super) fn review_line(msg: &StepMessage, attempt: i32, failure: &StepError) -> String {
    format!(
        "run {} stopped at step {} (position {}, attempt {attempt}): {failure}",
        msg.run_id, msg.step, msg.seq
    )
}

/// The step commit that writes `ending` for the step of `msg`, executed under `fence` while the
/// run was `status`.
pub(super) fn to_commit(
    topology: &Topology,
    msg: &StepMessage,
    fence: Fence,
    status: RunStatus,
    shadow: bool,
    ending: Ending,
) -> Result<StepCommit, IllegalMove> {
    // A run that stops for a person stays at the step that stopped it.
    let stay = |to, handover| -> Result<Advance, IllegalMove> {
        Ok(Advance {
            seq: msg.seq,
            next_step: Some(msg.step.clone()),
            status: status.move_to(to)?,
            output: None,
            error: None,
            handover,
        })
    };
    let mut review_class = None;
    let mut wait = None;
    let (to, step_output, finished, outbox, parked, local_writes) = match ending {
        Ending::Advance {
            output,
            next,
            mut sent,
            parked,
            writes,
        } => {
            let ends = next.is_none();
            if let Some(next) = &next {
                let message = topology
                    .step_message(&msg.run_id, &msg.workflow, msg.version, next, msg.seq + 1)
                    .traced(msg.trace.as_deref());
                sent.push(message);
            }
            let to = match (ends, status) {
                (false, s) => s,
                (true, RunStatus::Compensating) => RunStatus::Compensated,
                // A shadow run changed nothing outside; its end (and its event) says so.
                (true, _) => RunStatus::finished(shadow),
            };
            let to = Advance {
                seq: msg.seq,
                next_step: next,
                status: status.move_to(to)?,
                output: ends.then(|| output.clone()),
                error: None,
                handover: None,
            };
            (to, Some(output), true, sent, parked_rows(&parked), writes)
        }
        Ending::Pause {
            output,
            wait: what,
            mut sent,
            parked,
            writes,
        } => {
            let note = what.note(&msg.step, msg.seq);
            let at = (&msg.step, msg.seq);
            let waiting =
                Event::waiting(&msg.run_id, (&msg.workflow, msg.version), at, note.clone());
            sent.push(topology.event_message(&waiting));
            let to = stay(RunStatus::Waiting, Some(note))?;
            wait = Some(what);
            (to, Some(output), true, sent, parked_rows(&parked), writes)
        }
        Ending::Wait {
            note,
            sent,
            parked,
            writes,
        } => {
            let to = stay(RunStatus::Waiting, Some(note.clone()))?;
            (to, Some(note), false, sent, parked_rows(&parked), writes)
        }
        Ending::Review { error, class, note } => {
            review_class = Some(class);
            let mut events = Vec::new();
            if class == "tool_auth" {
                let auth =
                    Event::tool_auth_failed(&msg.run_id, (&msg.workflow, msg.version), &error);
                events.push(topology.event_message(&auth));
            }
            let to = Advance {
                error: Some(error),
                ..stay(RunStatus::NeedsReview, Some(note))?
            };
            (to, None, false, events, Vec::new(), Vec::new())
        }
    };
    let mut outbox = outbox;
    let at = Some((&msg.step, msg.seq));
    if let Some(event) = Event::run(&msg.run_id, (&msg.workflow, msg.version), to.status.to, at) {
        let event = match (&to.error, review_class) {
            (Some(error), Some(class)) => event.with_error(class, error),
            _ => event,
        };
        outbox.push(topology.event_message(&event));
    }
    Ok(StepCommit {
        run_id: msg.run_id.clone(),
        fence,
        step: msg.step.clone(),
        to,
        step_output,
        finished,
        inbox: (STEP_CONSUMER, msg.message_id),
        parked,
        outbox,
        local_writes,
        preclaim: None,
        wait,
        ends_child_of: None,
    })
}

fn parked_rows(items: &[Parked]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|p| (p.item.clone(), p.reason.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{MessageId, RunId, PlannedUndo};
    use crate::workflow::StepKind;

    fn workflow() -> Workflow {
        let ok = |_ctx| async { Ok(StepOutcome::next(json!({}))) };
        Workflow::new("wf", 1)
            .step("a", StepKind::Read, ok)
            .step("b", StepKind::Write, ok)
    }

    fn message(step: StepAddress, seq: i32) -> StepMessage {
        StepMessage {
            v: 1,
            message_id: MessageId::new(),
            run_id: RunId::parse("r1").unwrap(),
            workflow: "wf".into(),
            version: 1,
            step,
            seq,
            trace: None,
        }
    }

    const LIMITS: Limits = Limits {
        max_attempts: 3,
        retry_base_ms: 1000,
        max_wait_secs: 86_400,
    };

    fn running(attempt: i32) -> Claimed<'static> {
        Claimed {
            attempt,
            plan: None,
        }
    }

    fn none() -> Pending {
        Pending::default()
    }

    static LEDGER: crate::domain::LocalTable =
        crate::domain::LocalTable::new("app.ledger", "reference", &["reference", "amount"]);

    #[test]
    fn a_step_that_continues_commits_and_queues_the_next_declared_step() {
        let msg = message(StepAddress::step("a"), 4);
        let out = Ok(StepOutcome::next(json!({"x": 1})));
        let row = LEDGER
            .row(json!({"reference": "r1:4", "amount": 5}))
            .unwrap();
        let pending = Pending {
            writes: vec![row.clone()],
            ..Pending::default()
        };
        let Verdict::Commit(ending) = decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, out, pending)
        else {
            panic!("not committed");
        };
        let topology = Topology::new("t", 5);
        let commit =
            to_commit(&topology, &msg, Fence(7), RunStatus::Running, false, ending).unwrap();
        assert_eq!(commit.to.next_step, Some(StepAddress::step("b")));
        assert_eq!(commit.to.status.to, RunStatus::Running);
        assert!(commit.to.status.advances() && commit.finished);
        assert_eq!(commit.outbox.len(), 1);
        let next = StepMessage::decode(&commit.outbox[0].body, 1 << 20).unwrap();
        assert_eq!((next.step.as_str(), next.seq), ("b", 5));
        assert_eq!(commit.step_output, Some(json!({"x": 1})));
        assert_eq!(
            commit.local_writes,
            [row],
            "the local write goes with the commit"
        );
        assert_eq!(
            commit.to.output, None,
            "the run's output is set only when it ends"
        );
    }

    #[test]
    fn the_last_step_ends_the_run_and_a_compensation_ends_the_undo() {
        let msg = message(StepAddress::step("b"), 1);
        let out = Ok(StepOutcome::next(json!("done")));
        let Verdict::Commit(ending) = decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, out, none())
        else {
            panic!("not committed");
        };
        let commit = to_commit(
            &Topology::new("t", 5),
            &msg,
            Fence(1),
            RunStatus::Running,
            false,
            ending,
        )
        .unwrap();
        assert_eq!(commit.to.status.to, RunStatus::Succeeded);
        assert_eq!(commit.to.output, Some(json!("done")));
        assert_eq!(commit.outbox.len(), 1, "the run.succeeded event");
        assert_eq!(commit.outbox[0].routing_key, "run.succeeded.wf");

        let plan = UndoPlan {
            scope: json!({}),
            targets: vec![
                PlannedUndo {
                    seq: 1,
                    step: "b".into(),
                    ..Default::default()
                },
                PlannedUndo {
                    seq: 0,
                    step: "a".into(),
                    ..Default::default()
                },
            ],
            left_standing: vec![],
        };
        let undoing = Claimed {
            attempt: 1,
            plan: Some(&plan),
        };
        let first = message(StepAddress::undo("b", 1), 2);
        let out = || Ok(StepOutcome::next(json!({})));
        let Verdict::Commit(Ending::Advance { next, .. }) =
            decide((&workflow(), &Registry::new()), &first, undoing, LIMITS, out(), none())
        else {
            panic!("not advanced");
        };
        assert_eq!(next, Some(StepAddress::undo("a", 0)), "newest first");
        let last = message(StepAddress::undo("a", 0), 3);
        let Verdict::Commit(ending) = decide((&workflow(), &Registry::new()), &last, undoing, LIMITS, out(), none())
        else {
            panic!("not committed");
        };
        let commit = to_commit(
            &Topology::new("t", 5),
            &last,
            Fence(1),
            RunStatus::Compensating,
            false,
            ending,
        )
        .unwrap();
        assert_eq!(commit.to.status.to, RunStatus::Compensated);
    }

    #[test]
    fn a_temporary_failure_is_retried_with_doubling_delays_then_handed_over() {
        let msg = message(StepAddress::step("a"), 0);
        let fail = || Err(StepError::temporary("429"));
        let delay =
            |attempt| match decide((&workflow(), &Registry::new()), &msg, running(attempt), LIMITS, fail(), none()) {
                Verdict::Retry { delay, .. } => Some(delay),
                _ => None,
            };
        assert_eq!(delay(1), Some(Duration::from_millis(1000)));
        assert_eq!(delay(2), Some(Duration::from_millis(2000)));
        assert_eq!(delay(3), None, "the last attempt goes to review");
        let Verdict::Review(StepError::Guard(why)) =
            decide((&workflow(), &Registry::new()), &msg, running(3), LIMITS, fail(), none())
        else {
            panic!("not reviewed");
        };
        assert!(
            why.contains("failed temporarily 3 times") && why.contains("429"),
            "{why}"
        );
        let asked = Err(StepError::Temporary {
            reason: "slow down".into(),
            retry_after: Some(Duration::from_secs(9)),
        });
        assert!(matches!(
            decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, asked, none()),
            Verdict::Retry { delay, .. } if delay == Duration::from_secs(9)
        ));
    }

    #[test]
    fn a_wait_on_an_open_breaker_is_retried_uncounted_even_at_the_attempt_cap() {
        let msg = message(StepAddress::step("a"), 0);
        let open = || Err(StepError::breaker_open("ledger", Duration::from_secs(29)));
        for attempt in [1, LIMITS.max_attempts] {
            let verdict = decide((&workflow(), &Registry::new()), &msg, running(attempt), LIMITS, open(), none());
            let Verdict::Retry {
                delay,
                reason,
                counted: false,
                class: "breaker_open",
            } = verdict
            else {
                panic!("not an uncounted retry at attempt {attempt}: {verdict:?}");
            };
            assert_eq!(delay, Duration::from_secs(30), "back at the probe");
            assert!(reason.contains("circuit breaker of ledger"), "{reason}");
        }
    }

    #[test]
    fn a_wait_for_a_models_rate_limit_is_retried_uncounted_even_at_the_attempt_cap() {
        let msg = message(StepAddress::step("a"), 0);
        let limit = "tokens-per-minute limit (950 of 1000 used, this call needs up to 84)";
        let full = || {
            let wait = Duration::from_secs(12);
            Err(StepError::throttled(limit.into(), "http://m/v1 m", wait))
        };
        for attempt in [1, LIMITS.max_attempts] {
            let verdict = decide((&workflow(), &Registry::new()), &msg, running(attempt), LIMITS, full(), none());
            assert_eq!(verdict.outcome(), "throttled_wait");
            let Verdict::Retry {
                delay,
                reason,
                counted: false,
                class: "throttled",
            } = verdict
            else {
                panic!("not an uncounted retry at attempt {attempt}: {verdict:?}");
            };
            assert_eq!(delay, Duration::from_secs(5), "back early, asks again at no cost");
            assert!(reason.starts_with(&format!("waits for the model's {limit} at http://m/v1 m")), "{reason}");
        }
    }

    #[test]
    fn a_breaker_wait_ends_by_the_probe_give_or_take_a_second() {
        let secs = |s: u64| breaker_delay(Duration::from_secs(s)).as_secs();
        assert_eq!(secs(0), 1, "the shortest tier");
        assert_eq!(secs(1), 1);
        assert_eq!(secs(4), 5);
        assert_eq!(secs(20), 5, "back early, refused again at no cost");
        assert_eq!(secs(29), 30);
        assert_eq!(secs(120), 30);
        assert_eq!(secs(86_400), 300, "the longest tier");
    }

    #[test]
    fn a_review_keeps_the_run_at_its_step_and_drops_what_the_step_queued() {
        let msg = message(StepAddress::step("b"), 3);
        let parked = vec![Parked {
            item: "inv-1".into(),
            reason: "unreadable".into(),
        }];
        let unknown = Err(StepError::Unknown("boom".into()));
        let writes = vec![
            LEDGER
                .row(json!({"reference": "r1:3", "amount": 5}))
                .unwrap(),
        ];
        let pending = Pending {
            parked,
            writes,
            ..Pending::default()
        };
        let verdict = decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, unknown, pending);
        let Verdict::Review(failure) = verdict else {
            panic!("not reviewed");
        };
        let error = review_line(&msg, 1, &failure);
        assert_eq!(
            error,
            "run r1 stopped at step b (position 3, attempt 1): boom"
        );
        let ending = Ending::Review {
            error,
            class: failure.class(),
            note: json!({}),
        };
        let commit = to_commit(
            &Topology::new("t", 5),
            &msg,
            Fence(2),
            RunStatus::Running,
            false,
            ending,
        )
        .unwrap();
        assert_eq!(commit.to.status.to, RunStatus::NeedsReview);
        assert!(!commit.to.status.advances());
        assert_eq!(commit.to.next_step, Some(StepAddress::step("b")));
        assert!(commit.parked.is_empty());
        assert!(
            commit.local_writes.is_empty(),
            "a review writes no local row"
        );
        let events: Vec<Event> = commit
            .outbox
            .iter()
            .map(|m| serde_json::from_slice(&m.body).unwrap())
            .collect();
        assert_eq!(
            events.len(),
            1,
            "only the review event, none of the step's messages"
        );
        assert_eq!(events[0].event, "run.needs_review");
    }

    #[test]
    fn a_goto_to_an_undeclared_step_is_handed_over_and_fencing_voids_the_work() {
        let msg = message(StepAddress::step("a"), 0);
        let out = Ok(StepOutcome::goto(json!({}), "nowhere"));
        assert!(matches!(
            decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, out, none()),
            Verdict::Review(StepError::Unknown(_))
        ));
        assert!(matches!(
            decide(
                (&workflow(), &Registry::new()),
                &msg,
                running(1),
                LIMITS,
                Err(StepError::FencedOut),
                none()
            ),
            Verdict::Stale(_)
        ));
    }

    #[test]
    fn a_step_that_waits_checkpoints_its_output_and_registers_its_wait_without_moving_on() {
        let msg = message(StepAddress::step("a"), 2);
        let wait = crate::workflow::EventWait::new("reply", Duration::from_secs(60));
        let out = Ok(StepOutcome::wait_for_event(json!({"asked": 1}), wait));
        let Verdict::Commit(ending) = decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, out, none())
        else {
            panic!("not committed");
        };
        let commit = to_commit(
            &Topology::new("t", 5),
            &msg,
            Fence(3),
            RunStatus::Running,
            false,
            ending,
        )
        .unwrap();
        assert_eq!(commit.to.status.to, RunStatus::Waiting);
        assert!(!commit.to.status.advances(), "the run stays at the step");
        assert_eq!(commit.to.next_step, Some(StepAddress::step("a")));
        assert!(commit.finished, "the step's work is done");
        assert_eq!(commit.step_output, Some(json!({"asked": 1})));
        let wait = commit.wait.expect("a wait to register");
        assert_eq!(wait.next_step, StepAddress::step("b"));
        assert_eq!(wait.event(), Some(("reply", "r1")), "the key is the run id");
        let events: Vec<Event> = commit
            .outbox
            .iter()
            .map(|m| serde_json::from_slice(&m.body).unwrap())
            .collect();
        assert_eq!(events.len(), 1, "run.waiting, and no step message");
        assert_eq!(events[0].event, "run.waiting");
    }

    #[test]
    fn a_wait_that_cannot_be_kept_stops_for_review_naming_what_to_fix() {
        let review = |seq, out: StepOutcome| {
            let msg = message(StepAddress::step(if seq == 1 { "b" } else { "a" }), seq);
            match decide((&workflow(), &Registry::new()), &msg, running(1), LIMITS, Ok(out), none()) {
                Verdict::Review(e) => e.to_string(),
                other => panic!("not reviewed: {other:?}"),
            }
        };
        let wait = |secs| crate::workflow::EventWait::new("reply", Duration::from_secs(secs));
        let zero = review(0, StepOutcome::wait_for_event(json!({}), wait(0)));
        assert!(zero.contains("its timeout is 0 s") && zero.contains("waits.max_secs"), "{zero}");
        let long = review(0, StepOutcome::sleep_for(json!({}), Duration::from_secs(90_000)));
        assert!(long.contains("its sleep is 90000 s"), "{long}");
        let named = crate::workflow::EventWait::new("bad name", Duration::from_secs(5));
        let named = review(0, StepOutcome::wait_for_event(json!({}), named));
        assert!(named.contains("event name"), "{named}");
        let last = review(1, StepOutcome::sleep_for(json!({}), Duration::from_secs(5)));
        assert!(last.contains("a step that waits must be followed by a step"), "{last}");
        let nowhere = wait(5).on_timeout_goto("nowhere");
        let nowhere = review(0, StepOutcome::wait_for_event(json!({}), nowhere));
        assert!(nowhere.contains("nowhere"), "{nowhere}");
        let both = review(0, StepOutcome::wait(json!({})).sleeping_for(Duration::from_secs(5)));
        assert!(both.contains("asked a person and asked to wait"), "{both}");
    }

    #[derive(serde::Deserialize)]
    struct Item {
        #[allow(dead_code)]
        n: u32,
    }
    impl crate::workflow::Input for Item {}

    #[test]
    fn a_fan_out_is_checked_against_the_registry_and_refused_whole_naming_the_child() {
        let mut registry = Registry::new();
        registry.register(workflow().input::<Item>());
        let msg = message(StepAddress::step("a"), 0);
        let decide_fan = |children: Children| {
            let out = Ok(StepOutcome::start_children(json!({}), children));
            decide((&workflow(), &registry), &msg, running(1), LIMITS, out, none())
        };
        let fan = Children::map("wf", [json!({"n": 1}), json!({"n": 2})]).max_in_flight(9);
        let Verdict::Commit(Ending::Pause { wait, .. }) = decide_fan(fan) else {
            panic!("not committed");
        };
        let WaitFor::Children(fan) = wait.what else {
            panic!("not a fan-out");
        };
        assert_eq!((fan.children.len(), fan.max_in_flight, fan.max_failures), (2, 2, 0));
        assert_eq!(fan.children[1].first_step, StepAddress::step("a"));
        let refused = |children: Children| match decide_fan(children) {
            Verdict::Review(e) => e.to_string(),
            other => panic!("not refused: {other:?}"),
        };
        let unknown = refused(Children::new().child("wf", json!({"n": 1})).child("nope", json!({})));
        assert!(unknown.contains("child 1: workflow \"nope\" is not registered"), "{unknown}");
        assert!(unknown.contains("no child was started"), "{unknown}");
        let bad = refused(Children::map("wf", [json!({"n": -1})]));
        assert!(bad.contains("child 0: workflow wf does not accept this input"), "{bad}");
    }

    #[test]
    fn the_attempt_cap_and_the_run_timeout_stop_a_step_before_it_runs() {
        let msg = message(StepAddress::step("a"), 0);
        assert!(refuse_before_running(&msg, running(3), LIMITS, 5.0, 0).is_none());
        assert!(refuse_before_running(&msg, running(4), LIMITS, 5.0, 0).is_some());
        assert!(refuse_before_running(&msg, running(1), LIMITS, 61.0, 60).is_some());
        assert!(refuse_before_running(&msg, running(1), LIMITS, 59.0, 60).is_none());
    }
}

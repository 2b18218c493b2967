//! What a run waits for after a step, as that step's commit registers it: an event (by name and
//! match key, with a timeout) or a time (a sleep). Decided without I/O by the worker
//! (`worker::ending`), written by the store in the commit's transaction.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::StepAddress;

/// A wait to register with a step's commit.
#[derive(Debug, Clone, PartialEq)]
pub struct NewWait {
    /// The step the run goes on with when the event comes or the sleep ends.
    pub next_step: StepAddress,
    /// What it waits for.
    pub what: WaitFor,
}

/// What a run waits for.
#[derive(Debug, Clone, PartialEq)]
pub enum WaitFor {
    /// An event of this name and match key, until the timeout.
    Event {
        /// The event's name.
        name: String,
        /// Its match key.
        key: String,
        /// Seconds from the commit (database clock) until the timeout.
        timeout_secs: f64,
        /// Where the run goes on timeout; `None`: it stops in `needs_review`.
        on_timeout: Option<StepAddress>,
    },
    /// A time.
    Sleep(Due),
    /// Child runs, started by the same commit, until the join's condition holds.
    Children(super::FanOut),
    /// The undo of the children of the fan-out at this position of the run (started by the same
    /// commit), until every one of them is compensated.
    UndoneChildren(i32),
}

/// When a sleep ends.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Due {
    /// This many seconds after the commit, on the database clock.
    In(f64),
    /// At this time (a time already past wakes the run at once).
    At(DateTime<Utc>),
}

impl NewWait {
    /// The seconds after the commit at which the wait is due, or the time at which it is.
    pub fn due(&self) -> Due {
        match &self.what {
            WaitFor::Event { timeout_secs, .. } => Due::In(*timeout_secs),
            WaitFor::Sleep(due) => *due,
            WaitFor::Children(_) | WaitFor::UndoneChildren(_) => Due::At(super::never()),
        }
    }

    /// The event's name and key, for an event wait.
    pub fn event(&self) -> Option<(&str, &str)> {
        match &self.what {
            WaitFor::Event { name, key, .. } => Some((name, key)),
            WaitFor::Sleep(_) | WaitFor::Children(_) | WaitFor::UndoneChildren(_) => None,
        }
    }

    /// What the run's handover note says while it waits, and `run.waiting` events carry.
    pub fn note(&self, step: &StepAddress, seq: i32) -> serde_json::Value {
        match &self.what {
            WaitFor::Event {
                name,
                key,
                timeout_secs,
                on_timeout,
            } => serde_json::json!({
                "waiting_for": "event", "event": name, "key": key, "timeout_secs": timeout_secs,
                "on_timeout": on_timeout.as_ref().map_or("needs_review", StepAddress::as_str),
                "step": step, "seq": seq, "next": self.next_step,
            }),
            WaitFor::Sleep(due) => serde_json::json!({
                "waiting_for": "time", "sleep": due, "step": step, "seq": seq,
                "next": self.next_step,
            }),
            WaitFor::Children(fan) => serde_json::json!({
                "waiting_for": "children", "children": fan.children.len(),
                "join": fan.first_n.map_or("all".to_owned(), |n| format!("first {n}")),
                "max_failures": fan.max_failures, "max_in_flight": fan.max_in_flight,
                "step": step, "seq": seq, "next": self.next_step,
            }),
            WaitFor::UndoneChildren(fan_out) => serde_json::json!({
                "waiting_for": "children_undone", "fan_out": fan_out,
                "step": step, "seq": seq, "next": self.next_step,
            }),
        }
    }
}

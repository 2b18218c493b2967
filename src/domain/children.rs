//! A fan-out as a step's commit registers it: the child runs to start (workflow and input
//! each), their deterministic ids, how many may run at once, and the join's condition (every
//! child or the first N to succeed, and how many may fail). Checked here without I/O; the
//! workflows and inputs are checked against the registry by the worker, before anything is
//! written.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::{IdError, RunId, StepAddress};

/// The most children one step may start: the parent's commit inserts every child row (and up
/// to `max_in_flight` runs) in one transaction, which stays well under a second up to here.
pub const MAX_CHILDREN: usize = 10_000;

/// A child run to start, its workflow found and its input accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildStart {
    /// Its workflow (registered in this process).
    pub workflow: String,
    /// That workflow's version here.
    pub version: i32,
    /// Its first step.
    pub first_step: StepAddress,
    /// Its input (accepted by that workflow).
    pub input: Value,
}

/// A checked fan-out, ready to commit.
#[derive(Debug, Clone, PartialEq)]
pub struct FanOut {
    /// The children, by index.
    pub children: Vec<ChildStart>,
    /// `None`: the join waits for every child; `Some(n)`: for the first `n` to succeed.
    pub first_n: Option<i32>,
    /// Children that may fail before the parent stops in `needs_review`.
    pub max_failures: i32,
    /// Children running at once at most; the others start as running ones end.
    pub max_in_flight: i32,
}

/// The run id of child `index` of the step at `seq` of `parent`: `<parent>:<seq>:<index>`, the
/// same on every attempt, so a repeated commit can never start a child twice.
pub fn child_run_id(parent: &RunId, seq: i32, index: usize) -> Result<RunId, IdError> {
    RunId::parse(&format!("{parent}:{seq}:{index}"))
}

/// The due time of a wait for children: never (the join moves the parent on, not the clock).
/// A finite time, so that the timer loop's arithmetic on due times stays defined.
pub fn never() -> DateTime<Utc> {
    DateTime::from_timestamp(253_402_214_400, 0).expect("9999-12-31 is a valid time")
}

/// How many failures a threshold allows among `total` children: a count as it is, a share
/// (0 to 1) rounded down.
pub fn allowed_failures(threshold: Threshold, total: usize) -> Result<i32, String> {
    match threshold {
        Threshold::Count(n) if n <= total => Ok(n as i32),
        Threshold::Count(n) => Err(format!(
            "its failure threshold is {n} children, more than the {total} it starts"
        )),
        Threshold::Share(s) if s.is_finite() && (0.0..=1.0).contains(&s) => {
            Ok((s * total as f64).floor() as i32)
        }
        Threshold::Share(s) => Err(format!(
            "its failure threshold is a share of {s}: it must be from 0 to 1"
        )),
    }
}

/// How many children may fail before the parent stops for review.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Threshold {
    /// This many children.
    Count(usize),
    /// This share of the children (0 to 1), rounded down.
    Share(f64),
}

/// One child as the step after a fan-out reads it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ChildResult {
    /// Its index in the fan-out (the order the step gave).
    pub index: i32,
    /// Its run id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// `pending`, `running`, `succeeded`, `failed`, `cancelled` or `skipped`.
    pub state: String,
    /// Its output, once it succeeded.
    pub output: Option<Value>,
    /// Why it failed or was cancelled.
    pub reason: Option<String>,
}

impl ChildResult {
    /// A child as stored.
    pub(crate) fn new(
        index: i32,
        run_id: String,
        workflow: String,
        state: String,
        output: Option<Value>,
        reason: Option<String>,
    ) -> Self {
        Self {
            index,
            run_id,
            workflow,
            state,
            output,
            reason,
        }
    }
}

/// How the children of a fan-out stand, counted by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct ChildrenSummary {
    /// Children in the fan-out.
    pub total: i32,
    /// Recorded, not started yet (beyond `max_in_flight`).
    pub pending: i32,
    /// Started and not ended.
    pub running: i32,
    /// Succeeded.
    pub succeeded: i32,
    /// Failed, stopped for review, or cancelled.
    pub failed: i32,
    /// Never started: the join held, or the parent stopped, first.
    pub skipped: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_id_is_its_parent_position_and_index_and_a_share_rounds_down() {
        let parent = RunId::parse("order-7").unwrap();
        assert_eq!(child_run_id(&parent, 2, 41).unwrap().as_str(), "order-7:2:41");
        let long = RunId::parse(&"p".repeat(198)).unwrap();
        assert!(child_run_id(&long, 0, 0).is_err(), "over 200 characters");
        assert_eq!(allowed_failures(Threshold::Share(0.1), 25), Ok(2));
        assert_eq!(allowed_failures(Threshold::Count(3), 3), Ok(3));
        assert!(allowed_failures(Threshold::Count(4), 3).is_err());
        assert!(allowed_failures(Threshold::Share(1.5), 3).is_err());
        assert!(allowed_failures(Threshold::Share(f64::NAN), 3).is_err());
    }
}

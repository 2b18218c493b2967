//! Lifecycle events: what other systems (a pager, a chat bot) may want to know as it happens —
//! a run ended or stopped for a person, a tool's circuit breaker opened or closed, a tool
//! refused its credentials. Published to the topic exchange `<prefix>.events` through the
//! outbox, in the transaction of the change they report, so an event exists if and only if the
//! change does.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{RunId, RunStatus, StepAddress};

/// The header that marks a message as a lifecycle event (events are published without
/// `mandatory`: an event nobody subscribed to is simply dropped by the broker).
pub const EVENT_HEADER: &str = "x-trailmark-event";

/// One lifecycle event, as its JSON body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Envelope version, 1.
    pub v: u64,
    /// What happened: `run.succeeded`, `run.failed`, `run.needs_review`, `run.cancelled`,
    /// `run.compensated`, `run.waiting`, `run.resumed`, `breaker.opened`, `breaker.closed`,
    /// `tool.auth_failed`.
    pub event: String,
    /// The run, for run and tool events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// Its workflow.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
    /// The workflow version the run is pinned to (after the change the event reports), so a
    /// subscriber tells runs of an old version from runs of the new one during a deploy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow_version: Option<i32>,
    /// The run's new status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<RunStatus>,
    /// The step it stopped at or ended with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<StepAddress>,
    /// That step's position.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<i32>,
    /// For a run stopped for review: the error class (`temporary`, `tool_auth`, `guard`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    /// And the error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// For breaker events: the tool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// For `run.waiting`: what the run waits for (an event by name and key, or a time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<serde_json::Value>,
    /// For `run.resumed`: what moved it on (`event <id>`, `timeout`, `wake-up`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_by: Option<String>,
    /// When it happened.
    pub at: DateTime<Utc>,
}

/// The run statuses that are events: a run ended, or stopped for a person to decide.
pub const EVENT_STATUSES: [RunStatus; 6] = [
    RunStatus::Succeeded,
    RunStatus::Shadowed,
    RunStatus::Failed,
    RunStatus::NeedsReview,
    RunStatus::Cancelled,
    RunStatus::Compensated,
];

impl Event {
    fn new(event: String) -> Self {
        Self {
            v: 1,
            event,
            run_id: None,
            workflow: None,
            workflow_version: None,
            status: None,
            step: None,
            seq: None,
            error_class: None,
            error: None,
            tool: None,
            waiting_for: None,
            resumed_by: None,
            at: Utc::now(),
        }
    }

    /// A run of `workflow` (name and version) stopped after step `at` to wait for an event or
    /// a time (`run.waiting`); `what` is the note that says what for.
    pub fn waiting(
        run_id: &RunId,
        workflow: (&str, i32),
        at: (&StepAddress, i32),
        what: serde_json::Value,
    ) -> Self {
        Self {
            run_id: Some(run_id.clone()),
            workflow: Some(workflow.0.to_owned()),
            workflow_version: Some(workflow.1),
            status: Some(RunStatus::Waiting),
            step: Some(at.0.clone()),
            seq: Some(at.1),
            waiting_for: Some(what),
            ..Self::new("run.waiting".into())
        }
    }

    /// A waiting run of `workflow` (name and version) went on to step `at` (`run.resumed`):
    /// `by` says what moved it (`event <id>`, `timeout`, `wake-up`).
    pub fn resumed(
        run_id: &RunId,
        workflow: (&str, i32),
        status: RunStatus,
        at: (&StepAddress, i32),
        by: &str,
    ) -> Self {
        Self {
            run_id: Some(run_id.clone()),
            workflow: Some(workflow.0.to_owned()),
            workflow_version: Some(workflow.1),
            status: Some(status),
            step: Some(at.0.clone()),
            seq: Some(at.1),
            resumed_by: Some(by.to_owned()),
            ..Self::new("run.resumed".into())
        }
    }

    /// A run of `workflow` (name and version) moved to `status`, if that is an event
    /// ([`EVENT_STATUSES`]).
    pub fn run(
        run_id: &RunId,
        workflow: (&str, i32),
        status: RunStatus,
        at: Option<(&StepAddress, i32)>,
    ) -> Option<Self> {
        EVENT_STATUSES.contains(&status).then(|| Self {
            run_id: Some(run_id.clone()),
            workflow: Some(workflow.0.to_owned()),
            workflow_version: Some(workflow.1),
            status: Some(status),
            step: at.map(|(s, _)| s.clone()),
            seq: at.map(|(_, q)| q),
            ..Self::new(format!("run.{status}"))
        })
    }

    /// Adds the error of a run stopped for review.
    pub fn with_error(mut self, class: &str, error: &str) -> Self {
        self.error_class = Some(class.to_owned());
        self.error = Some(error.to_owned());
        self
    }

    /// A tool refused its credentials in a run of `workflow` (name and version): stop and
    /// alert.
    pub fn tool_auth_failed(run_id: &RunId, workflow: (&str, i32), error: &str) -> Self {
        Self {
            run_id: Some(run_id.clone()),
            workflow: Some(workflow.0.to_owned()),
            workflow_version: Some(workflow.1),
            error_class: Some("tool_auth".into()),
            error: Some(error.to_owned()),
            ..Self::new("tool.auth_failed".into())
        }
    }

    /// A tool's circuit breaker opened (`true`) or closed.
    pub fn breaker(tool: &str, opened: bool) -> Self {
        let what = if opened { "opened" } else { "closed" };
        Self {
            tool: Some(tool.to_owned()),
            ..Self::new(format!("breaker.{what}"))
        }
    }

    /// The routing key subscribers bind on: `run.<status>.<workflow>`, `tool.auth_failed.<workflow>`,
    /// `breaker.<opened|closed>.<tool>`.
    pub fn routing_key(&self) -> String {
        let subject = self
            .workflow
            .as_deref()
            .or(self.tool.as_deref())
            .unwrap_or("-");
        format!("{}.{subject}", self.event)
    }

    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an event always serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ends_and_reviews_are_run_events_and_their_keys_name_the_workflow() {
        let run = RunId::parse("r1").unwrap();
        assert!(Event::run(&run, ("chain", 1), RunStatus::Running, None).is_none());
        assert!(Event::run(&run, ("chain", 1), RunStatus::Waiting, None).is_none());
        let e = Event::run(&run, ("chain", 3), RunStatus::NeedsReview, None).unwrap();
        assert_eq!(e.routing_key(), "run.needs_review.chain");
        assert_eq!(e.workflow_version, Some(3));
        assert!(
            String::from_utf8(e.encode())
                .unwrap()
                .contains(r#""workflow_version":3"#)
        );
        assert_eq!(
            Event::breaker("ledger", true).routing_key(),
            "breaker.opened.ledger"
        );
        let back: Event = serde_json::from_slice(&e.encode()).unwrap();
        assert_eq!(back, e);
        // An event published before events carried the version still reads.
        let old = br#"{"v":1,"event":"run.failed","run_id":"r1","workflow":"chain","at":"2026-12-01T02:11:22Z"}"#;
        let read: Event = serde_json::from_slice(old).unwrap();
        assert_eq!(read.workflow_version, None);
    }
}

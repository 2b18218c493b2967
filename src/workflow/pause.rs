//! How a step ends by waiting: for an event ([`EventWait`]) or for a time (a sleep), before the
//! run goes on with its next step; and what the next step reads of the event that came
//! ([`ReceivedEvent`], `StepContext::event`).
//!
//! While a run waits it holds no lease and no message: it is a row in `waits`, found by the
//! event that matches it or by the timer loop when it is due (`docs/WORKFLOWS.md`, "Waiting").

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::StepError;

/// An event a step's run waits for before its next step: its name, its match key (the run's id
/// unless set), how long to wait, and what the timeout does.
#[derive(Debug, Clone, PartialEq)]
pub struct EventWait {
    pub(crate) name: String,
    pub(crate) key: Option<String>,
    pub(crate) timeout: Duration,
    pub(crate) on_timeout: OnTimeout,
}

/// What an event wait's timeout does.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnTimeout {
    /// The run stops in `needs_review`, saying which event did not come; a resume goes on with
    /// the next step, without the event.
    Review,
    /// The run goes on with this declared step instead of the next one.
    Goto(String),
}

impl EventWait {
    /// Waits for the event `name` with the run's id as its key, for `timeout` at most (more
    /// than zero, at most `waits.max_secs`); on timeout the run stops in `needs_review`.
    pub fn new(name: impl Into<String>, timeout: Duration) -> Self {
        Self {
            name: name.into(),
            key: None,
            timeout,
            on_timeout: OnTimeout::Review,
        }
    }

    /// Takes the event sent with this match key instead of the run's id (a supplier's order
    /// number, a document id).
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// On timeout, goes on with the declared step `step` (without the event).
    pub fn on_timeout_goto(mut self, step: impl Into<String>) -> Self {
        self.on_timeout = OnTimeout::Goto(step.into());
        self
    }
}

/// What a step's run waits for before its next step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Pause {
    /// An event.
    Event(EventWait),
    /// A duration from the commit, on the database's clock.
    SleepFor(Duration),
    /// A time.
    SleepUntil(DateTime<Utc>),
    /// Child runs, started by the step's commit.
    Children(super::Children),
}

/// The event that resumed the run before this step, as `StepContext::event` hands it over.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ReceivedEvent {
    /// The event's id (the same id sent twice is one event).
    pub id: String,
    /// Its name.
    pub name: String,
    /// The match key it was sent with.
    pub key: String,
    /// What it carries.
    pub payload: Value,
    /// When trailmark received it (database clock).
    pub received_at: DateTime<Utc>,
}

impl ReceivedEvent {
    /// The event as stored.
    pub(crate) fn new(
        id: String,
        name: String,
        key: String,
        payload: Value,
        received_at: DateTime<Utc>,
    ) -> Self {
        Self {
            id,
            name,
            key,
            payload,
            received_at,
        }
    }

    /// The payload as the workflow's own type; one that does not read as `T` stops the run for
    /// review, naming the event and what did not fit.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, StepError> {
        serde_json::from_value(self.payload.clone()).map_err(|e| {
            StepError::Unknown(format!(
                "the payload of event {} ({}, key {}) does not read as {}: {e}; fix the sender or the workflow's types and resume after the fix",
                self.id,
                self.name,
                self.key,
                std::any::type_name::<T>()
            ))
        })
    }
}

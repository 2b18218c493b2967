//! The public API for writing workflows: named, versioned lists of steps with declared kinds.
//!
//! A handler receives a [`StepContext`] and returns a [`StepOutcome`]: its output (the checkpoint)
//! and which step comes next, so fixed pipelines and model-driven loops are written the same way.
//!
//! [`crate::prelude`] shows a whole workflow run by an embedded engine.

mod children;
mod context;
pub mod contract;
mod definition;
mod effect;
mod error;
mod host;
mod model_call;
mod model_limit;
mod pause;
mod patch;
mod reversal;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

pub(crate) use context::Pending;
pub(crate) use context::Position;
pub use children::{ChildResult, Children, ChildrenSummary};
pub use context::UndoTarget;
pub use context::{IDEMPOTENCY_KEY_HEADER, MAX_CHILDREN_PAGE, Parked, StepContext};
pub use definition::{Compensation, Input, StepDef, Workflow};
pub use effect::{Lookup, Tool};
pub use error::{ResultExt, StepError};
pub(crate) use pause::Pause;
pub use pause::{EventWait, OnTimeout, ReceivedEvent};
pub use patch::PATCH_KIND;
pub(crate) use model_call::REQUEST_DIFFERS;
pub(crate) use host::{BoxFuture, Models, RecordedEffect, Records, Tools};
pub use reversal::{ListFuture, Lister, PreviewContext, Reversal};

/// What a step does to the outside world; recovery rules follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StepKind {
    /// Reads only: safe to redo.
    Read,
    /// Calls a model: answers are journaled and replayed.
    Model,
    /// Writes to an outside store under idempotency keys; may declare a compensation.
    Write,
    /// Sends an outside message through the outbox.
    Message,
    /// Waits for a person's decision.
    Human,
}

/// Which step runs after this one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Next {
    /// The next step in declaration order; the run succeeds after the last one.
    Continue,
    /// A named step (agent loops choose at run time).
    Goto(String),
    /// End the run successfully now.
    Finish,
    /// Wait for a person (human steps): the output is what they must decide.
    Wait,
}

/// A handler's result: the checkpointed output and the next step. The output is any serde type
/// of the workflow's own (a `serde_json::Value` too), stored word for word as JSON.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// Stored word for word as the step's checkpoint.
    pub output: Value,
    /// Where the run goes next.
    pub next: Next,
    /// Why the output could not be made JSON (a map with non-string keys, a failing
    /// `Serialize`): the step then stops for review instead of committing something else.
    unserializable: Option<String>,
    /// What the run waits for before `next` runs (an event or a time), if anything.
    pause: Option<Pause>,
}

impl StepOutcome {
    fn new(output: impl Serialize, next: Next) -> Self {
        match serde_json::to_value(output) {
            Ok(output) => Self {
                output,
                next,
                unserializable: None,
                pause: None,
            },
            Err(e) => Self {
                output: Value::Null,
                next,
                unserializable: Some(e.to_string()),
                pause: None,
            },
        }
    }
    /// Output, then the next declared step.
    pub fn next(output: impl Serialize) -> Self {
        Self::new(output, Next::Continue)
    }
    /// Output, then the named step.
    pub fn goto(output: impl Serialize, step: impl Into<String>) -> Self {
        Self::new(output, Next::Goto(step.into()))
    }
    /// Output, and the run is done.
    pub fn finish(output: impl Serialize) -> Self {
        Self::new(output, Next::Finish)
    }
    /// A human step's question: the run waits in `waiting` until approved or rejected.
    pub fn wait(question: impl Serialize) -> Self {
        Self::new(question, Next::Wait)
    }

    /// Output, then the run waits for the event `wait` describes (holding no lease and no
    /// message) before the next declared step, which reads it with `StepContext::event`.
    pub fn wait_for_event(output: impl Serialize, wait: EventWait) -> Self {
        Self::next(output).waiting_for(wait)
    }
    /// Output, then the run sleeps for `duration` (more than zero, at most `waits.max_secs`;
    /// measured on the database's clock from the commit) before the next declared step.
    pub fn sleep_for(output: impl Serialize, duration: std::time::Duration) -> Self {
        Self::next(output).sleeping_for(duration)
    }
    /// Output, then the run sleeps until `time` (a time already past wakes it at once) before
    /// the next declared step.
    pub fn sleep_until(output: impl Serialize, time: chrono::DateTime<chrono::Utc>) -> Self {
        Self::next(output).sleeping_until(time)
    }
    /// This outcome, with the run waiting for the event `wait` describes before its next step
    /// (`StepOutcome::goto(out, "review").waiting_for(...)`).
    pub fn waiting_for(mut self, wait: EventWait) -> Self {
        self.pause = Some(Pause::Event(wait));
        self
    }
    /// This outcome, with the run sleeping for `duration` before its next step.
    pub fn sleeping_for(mut self, duration: std::time::Duration) -> Self {
        self.pause = Some(Pause::SleepFor(duration));
        self
    }
    /// This outcome, with the run sleeping until `time` before its next step.
    pub fn sleeping_until(mut self, time: chrono::DateTime<chrono::Utc>) -> Self {
        self.pause = Some(Pause::SleepUntil(time));
        self
    }
    /// Output, then the step's commit starts `children` and the run waits for them (holding no
    /// lease and no message) before the next declared step, which reads them with
    /// `StepContext::children`.
    pub fn start_children(output: impl Serialize, children: Children) -> Self {
        Self::next(output).with_children(children)
    }
    /// This outcome, with the run starting `children` and waiting for them before its next step.
    pub fn with_children(mut self, children: Children) -> Self {
        self.pause = Some(Pause::Children(children));
        self
    }
    /// What the run waits for before its next step, if anything.
    pub(crate) fn pause(&self) -> Option<&Pause> {
        self.pause.as_ref()
    }

    /// The outcome, or the step error its unserializable output is.
    pub(crate) fn checked(self) -> Result<Self, StepError> {
        match self.unserializable {
            None => Ok(self),
            Some(why) => Err(StepError::Unknown(format!(
                "the step's output cannot be stored as JSON: {why}; fix the output type and resume after the fix"
            ))),
        }
    }
}

/// The boxed future a handler returns.
pub type StepFuture = Pin<Box<dyn Future<Output = Result<StepOutcome, StepError>> + Send>>;

/// A step handler: any `Fn(StepContext) -> StepFuture`.
pub type Handler = Arc<dyn Fn(StepContext) -> StepFuture + Send + Sync>;

/// Why a run start cannot be served, in the same words from every face that starts runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartRefused {
    /// No workflow of that name is registered here.
    #[error("workflow {name:?} is not registered (known: {known})")]
    UnknownWorkflow {
        /// The name asked for.
        name: String,
        /// The registered names.
        known: String,
    },
    /// The start names a version of the workflow this binary does not carry.
    #[error(
        "workflow {workflow} v{version} is not deployed here (this binary carries {carried}); start without a version to take the newest, or deploy v{version} first"
    )]
    UnknownVersion {
        /// The workflow.
        workflow: String,
        /// The version asked for.
        version: i32,
        /// The versions carried here.
        carried: String,
    },
    /// The workflow's input check refused the input.
    #[error("workflow {workflow} does not accept this input: {why}")]
    BadInput {
        /// The workflow.
        workflow: String,
        /// What is wrong with the input.
        why: String,
    },
    /// The run-start event would not fit in one message.
    #[error(
        "the run-start event is {bytes} bytes, over the {limit}-byte message limit (worker.max_message_bytes); pass large inputs by reference (a URL or a key) instead"
    )]
    TooLarge {
        /// The event's size.
        bytes: usize,
        /// `worker.max_message_bytes`.
        limit: usize,
    },
}

impl StartRefused {
    /// The dead-letter reason a worker gives such a start.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownWorkflow { .. } => "unknown_workflow",
            Self::UnknownVersion { .. } => "unknown_version",
            Self::BadInput { .. } => "bad_input",
            Self::TooLarge { .. } => "oversized",
        }
    }
}

/// The workflows a process can execute: every version of each that this binary carries, so a
/// run stays on the version it started with while new runs start on the newest.
#[derive(Clone, Default)]
pub struct Registry {
    /// Per name, the carried versions, oldest first.
    workflows: HashMap<String, std::collections::BTreeMap<i32, Arc<Workflow>>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a workflow version beside the others of its name; a later registration of the
    /// same name and version replaces it.
    pub fn register(&mut self, workflow: Workflow) -> &mut Self {
        self.workflows
            .entry(workflow.name.clone())
            .or_default()
            .insert(workflow.version, Arc::new(workflow));
        self
    }

    /// The newest version of the workflow called `name`: the one new runs start on.
    pub fn get(&self, name: &str) -> Option<Arc<Workflow>> {
        self.workflows
            .get(name)?
            .last_key_value()
            .map(|(_, w)| w.clone())
    }

    /// Version `version` of the workflow called `name`, if this binary carries it: the code a
    /// run pinned to that version runs on.
    pub fn version(&self, name: &str, version: i32) -> Option<Arc<Workflow>> {
        self.workflows.get(name)?.get(&version).cloned()
    }

    /// The versions of `name` this binary carries, oldest first (empty for an unknown name).
    pub fn versions(&self, name: &str) -> Vec<i32> {
        self.workflows
            .get(name)
            .map(|v| v.keys().copied().collect())
            .unwrap_or_default()
    }

    /// The version a run of `name` follows: its own when carried here, else the newest (what
    /// an operator's `resume --after-fix` or fork moves it to).
    pub fn for_run(&self, name: &str, version: i32) -> Option<Arc<Workflow>> {
        self.version(name, version).or_else(|| self.get(name))
    }

    /// The workflow that serves runs of `workflow` started with `input`, on `version` or the
    /// newest, or why none does: the one check every face that starts runs makes (the worker,
    /// `trailmark run start`, the embedded handle), so all of them refuse the same starts with
    /// the same words.
    pub fn accepting(
        &self,
        workflow: &str,
        version: Option<i32>,
        input: &Value,
    ) -> Result<Arc<Workflow>, StartRefused> {
        let newest = self.get(workflow).ok_or_else(|| StartRefused::UnknownWorkflow {
            name: workflow.to_owned(),
            known: self.names().join(", "),
        })?;
        let found = match version {
            None => newest,
            Some(v) => self
                .version(workflow, v)
                .ok_or_else(|| StartRefused::UnknownVersion {
                    workflow: workflow.to_owned(),
                    version: v,
                    carried: versions_text(&self.versions(workflow)),
                })?,
        };
        found.check_input(input).map_err(|why| StartRefused::BadInput {
            workflow: found.name.clone(),
            why,
        })?;
        Ok(found)
    }

    /// Every registered workflow's name and version, as two matching lists (a name once per
    /// carried version): what a query filters by to touch only the runs this process can
    /// execute.
    pub fn deployed(&self) -> (Vec<String>, Vec<i32>) {
        self.workflows
            .iter()
            .flat_map(|(name, versions)| versions.keys().map(move |v| (name.clone(), *v)))
            .unzip()
    }

    /// Registered names, sorted, for error messages.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.workflows.keys().cloned().collect();
        names.sort();
        names
    }
}

/// Versions as an error message names them: `v1, v2`.
pub(crate) fn versions_text(versions: &[i32]) -> String {
    let named: Vec<String> = versions.iter().map(|v| format!("v{v}")).collect();
    named.join(", ")
}

/// The in-process retry policy of model and tool calls: exponential from 100 ms to 5 s with
/// jitter, at most `retries` times (`worker.call_retries`).
pub(crate) fn call_backoff(retries: usize) -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_secs(5))
        .with_max_times(retries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn carrying(versions: &[i32]) -> Registry {
        let mut r = Registry::new();
        for v in versions {
            r.register(Workflow::new("invoice", *v));
        }
        r
    }

    #[test]
    fn a_registry_keeps_every_version_and_starts_new_runs_on_the_newest() {
        let r = carrying(&[2, 1]);
        assert_eq!(r.versions("invoice"), [1, 2]);
        assert_eq!(r.get("invoice").map(|w| w.version), Some(2));
        assert_eq!(r.version("invoice", 1).map(|w| w.version), Some(1));
        assert!(r.version("invoice", 3).is_none());
        // A run on a version no longer carried goes to the newest only through for_run.
        assert_eq!(r.for_run("invoice", 7).map(|w| w.version), Some(2));
        let (names, versions) = r.deployed();
        assert_eq!((names.len(), versions.len()), (2, 2));
        let json = serde_json::json!({});
        assert_eq!(r.accepting("invoice", None, &json).unwrap().version, 2);
        assert_eq!(r.accepting("invoice", Some(1), &json).unwrap().version, 1);
    }

    #[test]
    fn a_start_naming_a_version_not_carried_is_refused_with_the_carried_ones() {
        let refused = carrying(&[1, 2])
            .accepting("invoice", Some(3), &serde_json::json!({}))
            .err()
            .expect("refused");
        assert_eq!(refused.reason(), "unknown_version");
        assert_eq!(
            refused.to_string(),
            "workflow invoice v3 is not deployed here (this binary carries v1, v2); start without a version to take the newest, or deploy v3 first"
        );
    }
}

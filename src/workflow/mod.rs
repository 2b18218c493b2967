//! The public API for writing workflows: named, versioned lists of steps with declared kinds.
//!
//! A handler receives a [`StepContext`] and returns a [`StepOutcome`]: its output (the checkpoint)
//! and which step comes next, so fixed pipelines and model-driven loops are written the same way.

mod context;
mod effect;
mod error;
mod model_call;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::Value;

pub use context::{Parked, StepContext};
pub(crate) use context::{Position, Services};
pub use effect::{Lookup, Tool};
pub use error::{ResultExt, StepError};

/// What a step does to the outside world; recovery rules follow from it (DESIGN.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
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
pub enum Next {
    /// The next step in declaration order; the run succeeds after the last one.
    Continue,
    /// A named step (agent loops choose at run time).
    Goto(String),
    /// End the run successfully now.
    Finish,
}

/// A handler's result: the checkpointed output and the next step.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// Stored word for word as the step's checkpoint.
    pub output: Value,
    /// Where the run goes next.
    pub next: Next,
}

impl StepOutcome {
    /// Output, then the next declared step.
    pub fn next(output: Value) -> Self {
        Self {
            output,
            next: Next::Continue,
        }
    }
    /// Output, then the named step.
    pub fn goto(output: Value, step: impl Into<String>) -> Self {
        Self {
            output,
            next: Next::Goto(step.into()),
        }
    }
    /// Output, and the run is done.
    pub fn finish(output: Value) -> Self {
        Self {
            output,
            next: Next::Finish,
        }
    }
}

/// The boxed future a handler returns.
pub type StepFuture = Pin<Box<dyn Future<Output = Result<StepOutcome, StepError>> + Send>>;

/// A step handler: any `Fn(StepContext) -> StepFuture`.
pub type Handler = Arc<dyn Fn(StepContext) -> StepFuture + Send + Sync>;

/// One declared step.
#[derive(Clone)]
pub struct StepDef {
    /// Name, unique within the workflow.
    pub name: String,
    /// Declared kind.
    pub kind: StepKind,
    /// The code.
    pub handler: Handler,
}

/// A named, versioned workflow.
#[derive(Clone)]
pub struct Workflow {
    /// Name used in run-start events.
    pub name: String,
    /// Version recorded on each run; a step message for an unknown version is dead-lettered.
    pub version: i32,
    /// Steps in declaration order; the first one starts every run.
    pub steps: Vec<StepDef>,
    /// Per-run budget; `None` uses the configured default.
    pub budget: Option<crate::guard::Budget>,
}

impl Workflow {
    /// An empty workflow.
    pub fn new(name: impl Into<String>, version: i32) -> Self {
        Self { name: name.into(), version, steps: Vec::new(), budget: None }
    }

    /// Sets this workflow's per-run budget (builder style).
    pub fn with_budget(mut self, budget: crate::guard::Budget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Adds a step (builder style).
    pub fn step<F, Fut>(mut self, name: &str, kind: StepKind, handler: F) -> Self
    where
        F: Fn(StepContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<StepOutcome, StepError>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |ctx| Box::pin(handler(ctx)));
        self.steps.push(StepDef {
            name: name.to_owned(),
            kind,
            handler,
        });
        self
    }

    /// The step called `name`.
    pub fn find(&self, name: &str) -> Option<&StepDef> {
        self.steps.iter().find(|s| s.name == name)
    }

    /// The first step's name.
    pub fn first_step(&self) -> Option<&str> {
        self.steps.first().map(|s| s.name.as_str())
    }

    /// Resolves `next` after `current` to a step name, or `None` when the run ends.
    pub fn resolve_next(&self, current: &str, next: &Next) -> Result<Option<String>, StepError> {
        match next {
            Next::Finish => Ok(None),
            Next::Continue => {
                let pos = self.steps.iter().position(|s| s.name == current);
                Ok(pos
                    .and_then(|p| self.steps.get(p + 1))
                    .map(|s| s.name.clone()))
            }
            Next::Goto(name) if self.find(name).is_some() => Ok(Some(name.clone())),
            Next::Goto(name) => Err(StepError::Unknown(format!(
                "step {current} chose next step {name:?}, which workflow {} v{} does not declare",
                self.name, self.version
            ))),
        }
    }
}

/// The workflows a process can execute.
#[derive(Clone, Default)]
pub struct Registry {
    workflows: HashMap<String, Arc<Workflow>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a workflow; a later registration of the same name replaces it.
    pub fn register(&mut self, workflow: Workflow) -> &mut Self {
        self.workflows
            .insert(workflow.name.clone(), Arc::new(workflow));
        self
    }

    /// The workflow called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Workflow>> {
        self.workflows.get(name).cloned()
    }

    /// Registered names, sorted, for error messages.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.workflows.keys().cloned().collect();
        names.sort();
        names
    }
}

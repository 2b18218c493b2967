//! The public API for writing workflows: named, versioned lists of steps with declared kinds.
//!
//! A handler receives a [`StepContext`] and returns a [`StepOutcome`]: its output (the checkpoint)
//! and which step comes next, so fixed pipelines and model-driven loops are written the same way.
//!
//! # Example
//!
//! A workflow whose first step asks the model (the answer is journaled: a replayed step does not
//! pay for it again) and whose second posts to an outside ledger under an idempotency key, run to
//! its end by an engine embedded in this program, on the local Postgres and RabbitMQ:
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//!
//! use serde_json::{Value, json};
//! use tokio_util::sync::CancellationToken;
//! use trailmark::domain::{IdempotencyKey, RunId, RunStartEvent, RunStatus};
//! use trailmark::engine::Engine;
//! use trailmark::failpoint::Failpoints;
//! use trailmark::model::{ChatMessage, ChatRequest};
//! use trailmark::workflow::{Registry, StepKind, StepOutcome, Workflow};
//! use trailmark::{broker, store};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> anyhow::Result<()> {
//! // The outside system: a ledger that keeps the first write under each key.
//! let ledger: Arc<Mutex<HashMap<String, Value>>> = Default::default();
//! let posts = ledger.clone();
//! let greet = Workflow::new("greet", 1)
//!     .step("ask", StepKind::Model, |ctx| async move {
//!         let question = ChatRequest::new(vec![ChatMessage::user("Say hello.")]);
//!         let answer = ctx.model(&question).await?;
//!         Ok(StepOutcome::next(json!({ "greeting": answer.content })))
//!     })
//!     .step("post", StepKind::Write, move |ctx| {
//!         let ledger = posts.clone();
//!         async move {
//!             let greeting = ctx.output_of("ask").await?.unwrap_or_default();
//!             let key = IdempotencyKey::for_step(ctx.run_id(), "post", "greeting");
//!             let entry = greeting.clone();
//!             ctx.effect(&key, &greeting, |key| async move {
//!                 let mut ledger = ledger.lock().unwrap();
//!                 ledger.entry(key.to_string()).or_insert(entry);
//!                 Ok(json!({ "posted": key.to_string() }))
//!             })
//!             .await?;
//!             Ok(StepOutcome::finish(json!({ "posted": true })))
//!         }
//!     });
//! let mut registry = Registry::new();
//! registry.register(greet);
//!
//! // Settings come from config/default.toml, a file and the environment (DATABASE_URL, ...).
//! let mut settings = trailmark::config::Settings::load()?;
//! # let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
//! # let server = std::env::var("TRAILMARK_TEST_PG")
//! #     .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
//! # settings.database.url = format!("{server}/tm_doc_{tag}");
//! # settings.database.max_connections = 4;
//! # settings.broker.prefix = format!("tmdoc-{tag}");
//! store::ensure_database(&settings.database).await?;
//! store::migrate(&store::connect(&settings.database).await?).await?;
//! broker::declare_topology(&settings.broker).await?;
//!
//! let engine = Engine::new(settings, registry, Failpoints::default()).await?;
//! let shutdown = CancellationToken::new();
//! let serving = tokio::spawn(trailmark::serve(engine.clone(), shutdown.clone()));
//!
//! // An upstream service starts a run by publishing an event (from any language).
//! let start = RunStartEvent::new(RunId::parse("greet-1")?, "greet", json!({}));
//! let event = engine.topology.run_start(&start);
//! broker::publish_once(&engine.settings.broker, "example", &event).await?;
//! let run = loop {
//!     match store::runs::get(&engine.pool, "greet-1").await? {
//!         Some(run) if run.status.is_terminal() => break run,
//!         _ => tokio::time::sleep(Duration::from_millis(50)).await,
//!     }
//! };
//! assert_eq!(run.status, RunStatus::Succeeded);
//! assert_eq!(ledger.lock().unwrap().len(), 1);
//!
//! shutdown.cancel();
//! serving.await??;
//! # engine.pool.close().await;
//! # let conn = broker::connect(&engine.settings.broker, "doc-cleanup").await?;
//! # engine.topology.delete(&conn.create_channel().await?).await?;
//! # store::drop_database(&engine.settings.database.url.parse()?).await?;
//! # Ok(())
//! # }
//! ```

mod context;
pub mod contract;
mod definition;
mod effect;
mod error;
mod host;
mod model_call;
mod reversal;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

pub(crate) use context::Pending;
pub(crate) use context::Position;
pub use context::UndoTarget;
pub use context::{IDEMPOTENCY_KEY_HEADER, Parked, StepContext};
pub use definition::{Compensation, Input, StepDef, Workflow};
pub use effect::{Lookup, Tool};
pub use error::{ResultExt, StepError};
pub(crate) use host::{BoxFuture, Models, Records, Tools};
pub use reversal::{ListFuture, Lister, PreviewContext, Reversal};

/// What a step does to the outside world; recovery rules follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
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
}

impl StepOutcome {
    fn new(output: impl Serialize, next: Next) -> Self {
        match serde_json::to_value(output) {
            Ok(output) => Self {
                output,
                next,
                unserializable: None,
            },
            Err(e) => Self {
                output: Value::Null,
                next,
                unserializable: Some(e.to_string()),
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

/// The in-process retry policy of model and tool calls: exponential from 100 ms to 5 s with
/// jitter, at most `retries` times (`worker.call_retries`).
pub(crate) fn call_backoff(retries: usize) -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_secs(5))
        .with_max_times(retries)
}

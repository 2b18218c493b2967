//! The names a workflow author needs, in one `use trailmark::prelude::*;`: defining a workflow
//! and its steps, what a step can do through its context, how it ends, waits or fails, the
//! keys and ids it works with, its typed input, and the one call that starts an engine in a
//! program.
//!
//! Everything here is also at the crate's root (`trailmark::Workflow`); nothing else is public
//! besides [`crate::config`], so a change inside the engine cannot break a workflow.
//!
//! # Example
//!
//! A workflow whose first step asks the model (the answer is journaled: a replayed step does not
//! pay for it again) and whose second posts to an outside ledger under an idempotency key, run to
//! its end by an engine embedded in this program, on the local Postgres and RabbitMQ
//! (`examples/hello-agent` is the same with a person's approval in between):
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//!
//! use serde_json::{Value, json};
//! use trailmark::prelude::*;
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
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
//!             let greeting: Value = ctx.output_as("ask").await?.unwrap_or_default();
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
//! let mut settings = Settings::load()?;
//! # let tag = format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos());
//! # let server = std::env::var("TRAILMARK_TEST_PG")
//! #     .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
//! # settings.database.url = format!("{server}/tm_doc_{tag}");
//! # settings.database.max_connections = 4;
//! # settings.broker.prefix = format!("tmdoc-{tag}");
//! settings.api.listen = String::new();
//! let engine = Trailmark::builder(settings, registry).migrate(true).start().await?;
//! engine.start_run("greet-1", "greet", &json!({})).await?;
//! let run = engine.wait_for("greet-1", Duration::from_secs(30)).await?;
//! assert_eq!(run.status, RunStatus::Succeeded);
//! assert_eq!(ledger.lock().unwrap().len(), 1);
//! # let settings = engine.settings().clone();
//! engine.shutdown().await?;
//! # let conn = trailmark::broker::connect(&settings.broker, "doc-cleanup").await?;
//! # let topology = trailmark::broker::Topology::from_settings(&settings.broker);
//! # topology.delete(&conn.create_channel().await?).await?;
//! # trailmark::store::drop_database(&settings.database.url.parse()?).await?;
//! # Ok(())
//! # }
//! ```

pub use tokio_util::sync::CancellationToken;

pub use crate::config::Settings;
pub use crate::domain::{IdError, IdempotencyKey, LocalTable, RunId, RunStatus, Threshold};
pub use crate::embedded::{RunView, Trailmark};
pub use crate::flow::{Concurrency, Debounce, KeyError, Priority, RuleError};
pub use crate::guard::Budget;
pub use crate::model::{ChatAnswer, ChatMessage, ChatRequest};
pub use crate::wait::EventSent;
pub use crate::workflow::{
    ChildResult, Children, ChildrenSummary, Compensation, EventWait, IDEMPOTENCY_KEY_HEADER, Input,
    Lookup, Next, OnTimeout, Parked, PreviewContext, ReceivedEvent, Registry, ResultExt, Reversal,
    StepContext, StepError, StepKind, StepOutcome, Tool, UndoTarget, Workflow,
};

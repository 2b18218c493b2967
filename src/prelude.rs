//! The names a workflow author needs, in one `use trailmark::prelude::*;`: defining a workflow
//! and its steps, what a step can do through its context, how it ends or fails, the keys and ids
//! it works with, its typed input, and the one call that starts an engine in a program.
//!
//! Everything here is also at the crate's root (`trailmark::Workflow`); nothing else is public
//! besides [`crate::config`], so a change inside the engine cannot break a workflow.

pub use tokio_util::sync::CancellationToken;

pub use crate::config::Settings;
pub use crate::domain::{IdError, IdempotencyKey, LocalTable, RunId, RunStatus};
pub use crate::embedded::{RunView, Trailmark};
pub use crate::guard::Budget;
pub use crate::model::{ChatAnswer, ChatMessage, ChatRequest};
pub use crate::workflow::{
    Compensation, IDEMPOTENCY_KEY_HEADER, Input, Lookup, Next, Parked, PreviewContext, Registry,
    ResultExt, Reversal, StepContext, StepError, StepKind, StepOutcome, Tool, UndoTarget, Workflow,
};

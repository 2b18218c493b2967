//! Reversal previews: what an undo's compensation of one step would write, listed before the
//! undo runs, so that the person deciding sees exactly the reversals (a scoped undo of one
//! supplier, say) and confirms those. A workflow declares a lister next to the compensation
//! ([`Workflow::reversals`](super::Workflow::reversals)); the lister and the compensation should
//! build their keys from the same code, so the preview cannot drift from what runs.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::StepError;
use super::context::UndoTarget;
use super::host::Tools;
use crate::domain::RunId;

/// One write an undo would make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reversal {
    /// Its idempotency key (`undo:<original key>` for a reversed write).
    pub key: String,
    /// What it does, for a person ("ledger: reverse ... -12.00 EUR").
    pub what: String,
}

/// What a reversal lister reads: the run, its input, the compensated step and the undo's scope,
/// and the run's checkpoints. Nothing it does writes anything.
#[derive(Clone)]
pub struct PreviewContext {
    run_id: RunId,
    input: Value,
    target: UndoTarget,
    tools: Arc<Tools>,
}

impl PreviewContext {
    pub(crate) fn new(run_id: RunId, input: Value, target: UndoTarget, tools: Arc<Tools>) -> Self {
        Self {
            run_id,
            input,
            target,
            tools,
        }
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        &self.run_id
    }

    /// The run's input.
    pub fn input(&self) -> &Value {
        &self.input
    }

    /// The step the compensation would undo, its output and the undo's scope.
    pub fn target(&self) -> &UndoTarget {
        &self.target
    }

    /// The latest checkpointed output of `step`, as a compensation would read it.
    pub async fn output_of(&self, step: &str) -> Result<Option<Value>, StepError> {
        self.tools
            .records
            .output_of(&self.run_id, step, i32::MAX)
            .await
    }
}

/// The future a lister returns.
pub type ListFuture = Pin<Box<dyn Future<Output = Result<Vec<Reversal>, StepError>> + Send>>;

/// A declared reversal lister.
pub type Lister = Arc<dyn Fn(PreviewContext) -> ListFuture + Send + Sync>;

//! `debounced`: one step that finishes with the run's input, in a workflow that debounces its
//! starts by the input's `key` over a [`WINDOW`], so that the CLI (`trailmark run start
//! debounced --input '{"key": "a"}'`), the tests and the drill drive debounce without code. Of
//! a burst of starts with one key, only the last becomes a run; its output is its own input
//! (`{"key": "a", "note": ...}`: anything besides `key` is kept as it is), so which start won
//! can be read from the run.

use std::time::Duration;

use trailmark::Debounce;
use trailmark::workflow::{StepContext, StepError, StepKind, StepOutcome, Workflow};

/// Workflow name.
pub const NAME: &str = "debounced";
/// Its one step.
pub const STEP: &str = "record";
/// The input field its starts are debounced by.
pub const KEY: &str = "key";
/// How long a start waits for a later one with its key: short, so a test or a person at the
/// terminal sees a burst end within seconds.
pub const WINDOW: Duration = Duration::from_secs(2);

/// The `debounced` workflow.
pub fn workflow() -> Workflow {
    let debounce = Debounce::new(KEY, WINDOW).expect("a window between 0 and an hour");
    Workflow::new(NAME, 1)
        .debounce(debounce)
        .step(STEP, StepKind::Read, record)
}

/// Finishes with the run's input: the start that won shows in the run's output.
async fn record(ctx: StepContext) -> Result<StepOutcome, StepError> {
    Ok(StepOutcome::finish(ctx.input().clone()))
}

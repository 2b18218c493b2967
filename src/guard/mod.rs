//! Guards that stop a run before it loops or spends without bound: budgets, repeated-action
//! detection and per-tool circuit breakers (the "unknown or growing" failures).

mod breaker;

pub use breaker::{Breakers, Decision};

use crate::config::GuardSettings;
use crate::domain::{RunId, Spent};
use serde::Serialize;

/// A guard's refusal: the run must stop for a person (the step error class `guard`). Its words
/// say what was exceeded and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Stop(pub String);

/// Per-run limits; 0 means unlimited. Replayed calls are not counted twice, because only calls
/// that reach the outside world leave a new journal entry or effect record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Budget {
    /// Effects (outside tool calls) per run.
    pub max_tool_calls: u64,
    /// Model tokens per run.
    pub max_model_tokens: u64,
    /// Model cost per run.
    pub max_cost: f64,
}

impl Budget {
    /// Whether model tokens or cost are capped (a run's spending need not be read otherwise).
    pub fn caps_models(&self) -> bool {
        self.max_model_tokens > 0 || self.max_cost > 0.0
    }

    /// The configured default budget.
    pub fn from_settings(g: &GuardSettings) -> Self {
        Self {
            max_tool_calls: g.max_tool_calls,
            max_model_tokens: g.max_model_tokens,
            max_cost: g.max_cost,
        }
    }
}

/// The error for an exhausted budget.
pub fn budget_exhausted(what: String) -> Stop {
    Stop(format!(
        "budget exhausted: {what}; the step was checkpointed as far as it got and nothing was truncated. Raise the budget and resume, or undo"
    ))
}

/// Refuses a new model call when the run has used its token or cost budget.
pub fn check_model_budget(spent: Spent, run_id: &RunId, budget: &Budget) -> Result<(), Stop> {
    let Spent { tokens, cost, .. } = spent;
    if budget.max_model_tokens > 0 && tokens as u64 >= budget.max_model_tokens {
        return Err(budget_exhausted(format!(
            "run {run_id} used {tokens} model tokens, its budget is {}",
            budget.max_model_tokens
        )));
    }
    if budget.max_cost > 0.0 && cost >= budget.max_cost {
        return Err(budget_exhausted(format!(
            "run {run_id} spent {cost:.4} on the model, its budget is {:.4}",
            budget.max_cost
        )));
    }
    Ok(())
}

/// The error for the `seen`-th identical request (same tool, same request) in one run: the
/// agent is repeating itself, and a person should look.
pub fn repeated_action(
    run_id: &RunId,
    tool: &str,
    seen: i64,
    request: &serde_json::Value,
) -> Stop {
    let shown: String = request.to_string().chars().take(300).collect();
    Stop(format!(
        "repeated action: tool {tool} was already called {seen} times in run {run_id} with the same request {shown}; the run looks stuck in a loop. Inspect the journal, then resume after a fix or undo"
    ))
}

//! The handover note written whenever a run enters `needs_review` (DESIGN.md §2): run, failed
//! step, exact error, what was already done, what the run would do next, evidence.

use serde_json::{Value, json};

use crate::domain::StepMessage;
use crate::engine::Engine;
use crate::store::{self, effects, parked};
use crate::workflow::StepError;

/// Builds the note from the checkpoint as it stands.
pub(super) async fn note(
    engine: &Engine,
    msg: &StepMessage,
    attempt: i32,
    error: &StepError,
) -> store::Result<Value> {
    let effects = effects::list(&engine.pool, msg.run_id.as_str()).await?;
    let parked = parked::list(&engine.pool, msg.run_id.as_str()).await?;
    let (done, unknown): (Vec<_>, Vec<_>) = effects.into_iter().partition(|e| e.completed);
    let keys = |list: Vec<effects::EffectSummary>| {
        list.into_iter()
            .map(|e| json!({"key": e.idempotency_key, "tool": e.tool, "seq": e.seq}))
            .collect::<Vec<_>>()
    };
    Ok(json!({
        "run_id": msg.run_id,
        "workflow": msg.workflow,
        "version": msg.version,
        "failed_step": msg.step,
        "seq": msg.seq,
        "attempt": attempt,
        "error_class": error.class(),
        "error": error.to_string(),
        "effects_committed": keys(done),
        "effects_unknown": keys(unknown),
        "parked": parked,
        "next": format!(
            "on resume, step {} (position {}) runs again: journaled model answers and recorded effects are replayed, not repeated",
            msg.step, msg.seq
        ),
        "written_at": chrono::Utc::now().to_rfc3339(),
    }))
}

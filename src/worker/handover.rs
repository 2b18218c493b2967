//! The handover note written whenever a run enters `needs_review`: run, failed
//! step, exact error, what was already done, what the run would do next, evidence.

use serde_json::{Value, json};

use sqlx::PgPool;

use crate::domain::StepMessage;
use crate::store::{self, effects, parked};
use crate::workflow::StepError;

/// What a person needs to see about a run's outside work: effects done and of unknown outcome
/// (key, tool, position), and parked items. Shared by the handover note and a frozen step's
/// evidence, so both read the same way.
pub(super) struct Evidence {
    /// Effects whose result is recorded.
    pub done: Vec<Value>,
    /// Effects whose call may or may not have happened.
    pub unknown: Vec<Value>,
    /// Items set aside.
    pub parked: Vec<parked::ParkedRow>,
}

impl Evidence {
    /// Reads the run's effects and parked items.
    pub async fn gather(pool: &PgPool, msg: &StepMessage) -> store::Result<Self> {
        let run_id = msg.run_id.as_str();
        let effects = effects::list(pool, run_id).await?;
        let parked = parked::list(pool, run_id).await?;
        let (done, unknown): (Vec<_>, Vec<_>) = effects.into_iter().partition(|e| e.completed);
        let keys = |list: Vec<effects::EffectSummary>| {
            list.into_iter()
                .map(|e| json!({"key": e.idempotency_key, "tool": e.tool, "seq": e.seq}))
                .collect()
        };
        Ok(Self {
            done: keys(done),
            unknown: keys(unknown),
            parked,
        })
    }
}

/// The note, from the run's evidence as it stands.
pub(super) fn note(
    msg: &StepMessage,
    attempt: i32,
    error: &StepError,
    evidence: Evidence,
) -> Value {
    json!({
        "run_id": msg.run_id,
        "workflow": msg.workflow,
        "version": msg.version,
        "failed_step": msg.step,
        "seq": msg.seq,
        "attempt": attempt,
        "error_class": error.class(),
        "error": error.to_string(),
        "effects_committed": evidence.done,
        "effects_unknown": evidence.unknown,
        "parked": evidence.parked,
        "next": format!(
            "on resume, step {} (position {}) runs again: journaled model answers and recorded effects are replayed, not repeated",
            msg.step, msg.seq
        ),
        "written_at": chrono::Utc::now().to_rfc3339(),
    })
}

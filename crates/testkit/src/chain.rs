//! `chain`: N steps, each one journaled model call and one keyed write into `chain_ledger`.
//!
//! Input: `{"steps": N, "step_delay_ms": D, "ledger": "effect" | "local"}` (defaults 10, 0 and
//! `effect`). The ledger's primary key on `reference = run_id:step` is what makes a repeated
//! write harmless; a reused reference with a different payload is reported as a conflict, never
//! skipped. With `"ledger": "effect"` each row is an outside write (`ctx.effect`: intent before,
//! result after, as for any other system's store); with `"local"` it is a local write
//! (`ctx.local_write`), inserted by the step's commit statement itself, as a workflow does with
//! a table of trailmark's own database.

use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::ledger as chain_ledger;
use trailmark::domain::{IdempotencyKey, RunId};
use trailmark::model::{ChatMessage, ChatRequest};
use trailmark::workflow::{
    Input, PreviewContext, Reversal, StepContext, StepError, StepKind, StepOutcome, Workflow,
};

/// Workflow name.
pub const NAME: &str = "chain";
/// The one step, repeated.
pub const STEP: &str = "link";

/// The input of a `chain` run: `{"steps": N, "step_delay_ms": D}`, both optional.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChainInput {
    /// Links in the chain (default 10).
    #[serde(default = "ten")]
    pub steps: i64,
    /// A pause inside each link, standing in for a slow model (default 0).
    #[serde(default)]
    pub step_delay_ms: u64,
    /// How each link writes its ledger row (default `effect`).
    #[serde(default)]
    pub ledger: Ledger,
}

/// How a `chain` link writes its ledger row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ledger {
    /// As an outside write: `ctx.effect`, its intent recorded before and its result after.
    #[default]
    Effect,
    /// As a local write: `ctx.local_write`, in the step's commit statement.
    Local,
}

fn ten() -> i64 {
    10
}

impl Input for ChainInput {
    fn check(&self) -> Result<(), String> {
        if !(1..=1_000_000).contains(&self.steps) {
            return Err(format!(
                "`steps` must be from 1 to 1000000, got {}",
                self.steps
            ));
        }
        if self.step_delay_ms > 3_600_000 {
            return Err(format!(
                "`step_delay_ms` must be at most 3600000 (an hour), got {}",
                self.step_delay_ms
            ));
        }
        Ok(())
    }
}

/// The `chain` workflow definition.
pub fn workflow() -> Workflow {
    Workflow::new(NAME, 1)
        .input::<ChainInput>()
        .step(STEP, StepKind::Write, link)
        .key_recipe("run_id:link:position")
        .compensate("posts a reversal row `undo:<reference>` per link", unlink)
        .reversals(unlink_preview)
}

/// The reversal `unlink` would write for the link at the compensated position.
async fn unlink_preview(p: PreviewContext) -> Result<Vec<Reversal>, StepError> {
    let seq = p.target().seq;
    let row = format!("undo:{}", reference(p.run_id(), seq));
    let key = match params(p.input())?.ledger {
        Ledger::Effect => link_key(p.run_id(), seq).undo_of().to_string(),
        Ledger::Local => format!("{}:{row}", chain_ledger::TABLE.name()),
    };
    Ok(vec![Reversal {
        key,
        what: format!("chain_ledger: reversal row {row}"),
    }])
}

/// Compensation of one link: a reversal row that points at the original (nothing is deleted).
async fn unlink(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let target = ctx
        .undo()
        .cloned()
        .ok_or_else(|| StepError::Unknown("unlink runs only as a compensation".into()))?;
    let original = link_key(ctx.run_id(), target.seq);
    let reversed = reference(ctx.run_id(), target.seq);
    let reference = format!("undo:{reversed}");
    let payload = format!("reversal of {reversed}");
    let result = if params(ctx.input())?.ledger == Ledger::Local {
        let row = json!({ "reference": reference, "run_id": ctx.run_id(), "step": target.seq, "payload": payload });
        ctx.local_write(&chain_ledger::TABLE, row)?;
        json!({ "reference": reference, "with_commit": true })
    } else {
        let write = json!({ "reference": reference, "payload": payload });
        let (pool, run_id) = (ctx.pool().clone(), ctx.run_id().clone());
        ctx.effect(&original.undo_of(), &write, |_key| async move {
            post(&pool, &run_id, target.seq, &reference, &payload).await
        })
        .await?
    };
    ctx.failpoint("chain.after_reversal")?;
    Ok(StepOutcome::next(
        json!({ "reversed": target.seq, "ledger": result }),
    ))
}

struct Params {
    steps: i32,
    delay: Duration,
    ledger: Ledger,
}

/// The run's input, checked when the run was started (a run started before inputs were checked
/// stops for review with the same message).
fn params(input: &Value) -> Result<Params, StepError> {
    let parsed: ChainInput = serde_json::from_value(input.clone())
        .map_err(|e| StepError::Unknown(format!("chain input: {e}")))?;
    parsed
        .check()
        .map_err(|e| StepError::Unknown(format!("chain input: {e}")))?;
    Ok(Params {
        steps: parsed.steps as i32,
        delay: Duration::from_millis(parsed.step_delay_ms),
        ledger: parsed.ledger,
    })
}

async fn link(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let p = params(ctx.input())?;
    let i = ctx.seq();
    if !p.delay.is_zero() {
        tokio::time::sleep(p.delay).await;
    }
    let request = ChatRequest {
        messages: vec![
            ChatMessage::system("You are one link of a chain. Answer briefly."),
            ChatMessage::user(format!("Link {i} of {} in run {}.", p.steps, ctx.run_id())),
        ],
        max_tokens: Some(64),
        temperature: Some(0.0),
    };
    let answer = ctx.model(&request).await?;
    let reference = reference(ctx.run_id(), i);
    let payload = trailmark::domain::request_hash(&json!(answer.content));
    // The checkpoint names the answer by its hash: the journal already holds it word for word,
    // and storing it twice would double the bytes a step writes.
    let output = json!({ "link": i, "answer_sha256": payload });
    if p.ledger == Ledger::Local {
        let row = json!({ "reference": reference, "run_id": ctx.run_id(), "step": i, "payload": payload });
        ctx.local_write(&chain_ledger::TABLE, row)?;
    } else {
        let key = link_key(ctx.run_id(), i);
        let write = json!({ "reference": reference, "payload": payload });
        let pool = ctx.pool().clone();
        let (run_id, step) = (ctx.run_id().clone(), i);
        ctx.effect(&key, &write, |_key| async move {
            post(&pool, &run_id, step, &reference, &payload).await
        })
        .await?;
    }
    ctx.failpoint("chain.after_write")?;
    if i + 1 >= p.steps {
        Ok(StepOutcome::finish(output))
    } else {
        Ok(StepOutcome::goto(output, STEP))
    }
}

/// The key of link `seq`'s ledger write (its compensation writes under `undo_of` this key).
fn link_key(run_id: &RunId, seq: i32) -> IdempotencyKey {
    IdempotencyKey::for_step(run_id, STEP, &seq.to_string())
}

/// The ledger reference of link `seq` (its reversal is `undo:<reference>`).
fn reference(run_id: &RunId, seq: i32) -> String {
    format!("{run_id}:{seq}")
}

/// Posts one ledger row; the same reference with the same payload is accepted as already done.
async fn post(
    pool: &PgPool,
    run_id: &RunId,
    step: i32,
    reference: &str,
    payload: &str,
) -> Result<Value, StepError> {
    let entry = chain_ledger::Entry {
        reference,
        run_id: run_id.as_str(),
        step,
        payload,
    };
    let inserted = chain_ledger::post(pool, entry)
        .await
        .map_err(|e| StepError::temporary(format!("chain ledger write {reference}: {e}")))?;
    if !inserted {
        let stored = chain_ledger::payload(pool, reference)
            .await
            .map_err(|e| StepError::temporary(format!("chain ledger read {reference}: {e}")))?
            .ok_or_else(|| {
                StepError::temporary(format!("chain ledger read {reference}: the row is gone"))
            })?;
        if stored != payload {
            return Err(StepError::Conflict(format!(
                "chain ledger reference {reference} already holds a different payload; the write was not repeated"
            )));
        }
    }
    Ok(json!({ "reference": reference, "created": inserted }))
}

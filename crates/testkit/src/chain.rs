//! `chain`: N steps, each one journaled model call and one keyed write into `chain_ledger`.
//!
//! Input: `{"steps": N, "step_delay_ms": D, "ledger": "effect" | "local"}` (defaults 10, 0 and
//! `effect`). The ledger's primary key on `reference = run_id:step` is what makes a repeated
//! write harmless; a reused reference with a different payload is reported as a conflict, never
//! skipped. With `"ledger": "effect"` each row is an outside write (`ctx.effect`: intent before,
//! result after, as for any other system's store); with `"local"` it is a local write
//! (`ctx.local_write`), inserted by the step's commit statement itself, as a workflow does with
//! a table of trailmark's own database.
//!
//! `"tenant": T` counts the run under the concurrency key T (see [`TENANT_SLOTS`]).
//!
//! Versions, for deploy tests and drills: [`workflow_v`] builds `chain` at any version, and a
//! link of version 2 or later says its version in its output (`"code": N`), so a test sees
//! which version's code ran each link. A process started with the failpoint `chain.patch`
//! armed (`error`) stands for a build that changed the link's prompt in place, guarded by
//! `ctx.patched("chain.prompt-2")`: each link's output then says which path it took
//! (`"patched": bool`). With `chain.new_prompt` armed the prompt changes unguarded: the
//! incompatible edit a replay check must catch.
//!
//! Two optional parts drive the engine's waits without code: `"sleep": {"at": P, "secs": S}`
//! (after link P the run sleeps S seconds) and `"wait": {"at": P, "event": NAME,
//! "timeout_secs": T}` (after link P the run waits for the event NAME sent with the run's id as
//! its key, at most T seconds, then stops in `needs_review`). The link after a wait puts the
//! event it received (id and payload) in its output.
//!
//! Fan-outs too: `"children": {"at": P, "count": N, "steps": K, "max_in_flight": M,
//! "fail_threshold": F, "fail": [indexes], "first": n}` (all but `at` and `count` optional):
//! after link P the run starts N child `chain` runs of K links (default 1), at most M at once,
//! and waits for them (all, or the first n to succeed; F failures allowed: an integer is a
//! count, a fraction a share). The children at the listed indexes are started with `"fail":
//! true`: their first link stops for review, until a process started with the failpoint
//! `chain.fixed=error` (standing for the deployed fix) runs it again. `"wait": {...}` (as a
//! run's) makes every child wait for an event keyed by its own run id; `"slow": [indexes]`
//! makes those children sleep `"slow_secs"` (default 3600) after their link 0; `"children":
//! {...}` (as a run's) makes every child start children of its own. The link after the fan-out
//! puts the children's counts in its output.

use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::ledger as chain_ledger;
use trailmark::Threshold;
use trailmark::domain::{IdempotencyKey, RunId};
use trailmark::model::{ChatMessage, ChatRequest};
use trailmark::workflow::{
    Children, EventWait, Input, PreviewContext, Reversal, StepContext, StepError, StepKind,
    StepOutcome, Workflow,
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
    /// After which link the run sleeps, and how long.
    #[serde(default)]
    pub sleep: Option<SleepAt>,
    /// After which link the run waits for an event, which one, and how long.
    #[serde(default)]
    pub wait: Option<WaitAt>,
    /// After which link the run starts child runs, and how it waits for them.
    #[serde(default)]
    pub children: Option<ChildrenAt>,
    /// The first link stops for review (until the fix: see the module's docs).
    #[serde(default)]
    pub fail: bool,
    /// The tenant the run is counted under: at most [`TENANT_SLOTS`] runs of one tenant hold a
    /// step at once (`trailmark limit set chain --concurrency N [--key TENANT]` changes it); a
    /// run without one is not limited.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// Runs of one tenant holding a step at once, as `chain` declares it.
pub const TENANT_SLOTS: u32 = 100;

/// `{"at": P, "count": N, ...}`: after link P, the run starts N child `chain` runs.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildrenAt {
    /// The link (position) after which the run starts them.
    pub at: i64,
    /// How many.
    pub count: usize,
    /// Links in each child (default 1).
    #[serde(default = "one")]
    pub steps: i64,
    /// Children running at once at most (default: all).
    #[serde(default)]
    pub max_in_flight: Option<usize>,
    /// Failures allowed: an integer is a count, a fraction a share (default 0).
    #[serde(default)]
    pub fail_threshold: Option<serde_json::Number>,
    /// The indexes of the children that fail.
    #[serde(default)]
    pub fail: Vec<usize>,
    /// The run goes on once this many children succeeded (default: it waits for all).
    #[serde(default)]
    pub first: Option<usize>,
    /// Every child waits so for an event (keyed by its own run id), as a run's `wait` does.
    #[serde(default)]
    pub wait: Option<WaitAt>,
    /// The indexes of the children that sleep `slow_secs` after their link 0.
    #[serde(default)]
    pub slow: Vec<usize>,
    /// How long the slow children sleep (default 3600).
    #[serde(default = "an_hour")]
    pub slow_secs: f64,
    /// Every child starts children of its own so (a family three levels deep).
    #[serde(default)]
    pub children: Option<Box<ChildrenAt>>,
}

fn an_hour() -> f64 {
    3600.0
}

impl ChildrenAt {
    /// As a run's input names it (what a child that fans out in turn is started with).
    fn input(&self) -> Value {
        let mut input = json!({
            "at": self.at, "count": self.count, "steps": self.steps,
            "fail": self.fail, "slow": self.slow, "slow_secs": self.slow_secs,
        });
        let optional = [
            ("max_in_flight", self.max_in_flight.map(|m| json!(m))),
            ("first", self.first.map(|n| json!(n))),
            (
                "fail_threshold",
                self.fail_threshold.clone().map(Value::Number),
            ),
            ("children", self.children.as_ref().map(|c| c.input())),
        ];
        for (field, value) in optional {
            if let Some(value) = value {
                input[field] = value;
            }
        }
        if let Some(w) = &self.wait {
            input["wait"] = json!({ "at": w.at, "event": w.event, "timeout_secs": w.timeout_secs });
        }
        input
    }

    /// The fan-out this asks for.
    fn children(&self) -> Children {
        let inputs = (0..self.count).map(|i| {
            let mut input = json!({ "steps": self.steps, "fail": self.fail.contains(&i) });
            if let Some(w) = &self.wait {
                input["wait"] =
                    json!({ "at": w.at, "event": w.event, "timeout_secs": w.timeout_secs });
            }
            if self.slow.contains(&i) {
                input["sleep"] = json!({ "at": 0, "secs": self.slow_secs });
            }
            if let Some(below) = &self.children {
                input["children"] = below.input();
            }
            input
        });
        let mut children = Children::map(NAME, inputs);
        if let Some(m) = self.max_in_flight {
            children = children.max_in_flight(m);
        }
        if let Some(n) = self.first {
            children = children.first(n);
        }
        match &self.fail_threshold {
            Some(f) if f.is_u64() => {
                children.fail_threshold(Threshold::Count(f.as_u64().unwrap_or(0) as usize))
            }
            Some(f) => children.fail_threshold(Threshold::Share(f.as_f64().unwrap_or(-1.0))),
            None => children,
        }
    }
}

fn one() -> i64 {
    1
}

/// `{"at": P, "secs": S}`: after link P, the run sleeps S seconds.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SleepAt {
    /// The link (position) after which the run sleeps.
    pub at: i64,
    /// How long, in seconds.
    pub secs: f64,
}

/// `{"at": P, "event": NAME, "timeout_secs": T}`: after link P, the run waits for the event
/// NAME with the run's id as its key; on timeout it stops in `needs_review`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitAt {
    /// The link (position) after which the run waits.
    pub at: i64,
    /// The event's name.
    pub event: String,
    /// How long it waits at most, in seconds.
    pub timeout_secs: f64,
}

/// The longest sleep or timeout `chain` accepts (the default `waits.max_secs`, 366 days).
const LONGEST_WAIT_SECS: f64 = 31_622_400.0;

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
        if let Some(sleep) = &self.sleep {
            self.pause_at("sleep.at", sleep.at)?;
            span("sleep.secs", sleep.secs)?;
        }
        if let Some(wait) = &self.wait {
            self.pause_at("wait.at", wait.at)?;
            span("wait.timeout_secs", wait.timeout_secs)?;
            trailmark::domain::check_name(&wait.event).map_err(|e| format!("`wait.event`: {e}"))?;
            if self.sleep.as_ref().is_some_and(|s| s.at == wait.at) {
                return Err(format!(
                    "`sleep.at` and `wait.at` are both {}: a link can sleep or wait, not both",
                    wait.at
                ));
            }
        }
        if let Some(c) = &self.children {
            self.pause_at("children.at", c.at)?;
            let paused = [
                self.sleep.as_ref().map(|s| s.at),
                self.wait.as_ref().map(|w| w.at),
            ];
            if paused.contains(&Some(c.at)) {
                return Err(format!(
                    "`children.at` is {}, where the run already sleeps or waits: a link does one",
                    c.at
                ));
            }
            if !(1..=1_000_000).contains(&c.steps) {
                return Err(format!(
                    "`children.steps` must be from 1 to 1000000, got {}",
                    c.steps
                ));
            }
            if let Some(i) = c.fail.iter().find(|i| **i >= c.count) {
                return Err(format!(
                    "`children.fail` names child {i}, but there are {} (0 to {})",
                    c.count,
                    c.count.saturating_sub(1)
                ));
            }
        }
        Ok(())
    }
}

impl ChainInput {
    /// A link after which the run pauses must have a link after it.
    fn pause_at(&self, field: &str, at: i64) -> Result<(), String> {
        if (0..self.steps - 1).contains(&at) {
            return Ok(());
        }
        Err(format!(
            "`{field}` must be a link with a link after it, from 0 to {} (steps - 2), got {at}",
            self.steps - 2
        ))
    }
}

/// A duration in seconds: more than 0, at most [`LONGEST_WAIT_SECS`].
fn span(field: &str, secs: f64) -> Result<(), String> {
    if secs > 0.0 && secs <= LONGEST_WAIT_SECS {
        return Ok(());
    }
    Err(format!(
        "`{field}` must be more than 0 and at most {LONGEST_WAIT_SECS} (366 days), got {secs}"
    ))
}

/// The `chain` workflow definition (version 1).
pub fn workflow() -> Workflow {
    workflow_v(1)
}

/// `chain` at `version`: the same steps; from version 2 on, each link's output carries
/// `"code": version`.
pub fn workflow_v(version: i32) -> Workflow {
    Workflow::new(NAME, version)
        .input::<ChainInput>()
        .concurrency(
            trailmark::Concurrency::per_key("tenant", TENANT_SLOTS)
                .expect("a valid key field and limit")
                .optional(),
        )
        .step(STEP, StepKind::Write, move |ctx| link(ctx, version))
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
    sleep: Option<SleepAt>,
    wait: Option<WaitAt>,
    children: Option<ChildrenAt>,
    fail: bool,
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
        sleep: parsed.sleep,
        wait: parsed.wait,
        children: parsed.children,
        fail: parsed.fail,
    })
}

/// The link's prompt: the original, or (with `chain.patch` or `chain.new_prompt` armed) the
/// changed one; `Some(taken)` when the change is guarded by a patch.
async fn prompt(ctx: &StepContext) -> Result<(&'static str, Option<bool>), StepError> {
    const OLD: &str = "You are one link of a chain. Answer briefly.";
    const NEW: &str = "You are one link of a chain. Answer in one word.";
    if ctx.failpoint("chain.patch").is_err() {
        let taken = ctx.patched("chain.prompt-2").await?;
        return Ok((if taken { NEW } else { OLD }, Some(taken)));
    }
    if ctx.failpoint("chain.new_prompt").is_err() {
        return Ok((NEW, None));
    }
    Ok((OLD, None))
}

async fn link(ctx: StepContext, version: i32) -> Result<StepOutcome, StepError> {
    let p = params(ctx.input())?;
    let i = ctx.seq();
    if !p.delay.is_zero() {
        tokio::time::sleep(p.delay).await;
    }
    let (system, patched) = prompt(&ctx).await?;
    let request = ChatRequest {
        messages: vec![
            ChatMessage::system(system),
            ChatMessage::user(format!("Link {i} of {} in run {}.", p.steps, ctx.run_id())),
        ],
        max_tokens: Some(64),
        temperature: Some(0.0),
    };
    // A failing child stops at its first link until the fix is deployed (the failpoint
    // `chain.fixed` armed with `error` in the process that runs it again).
    if p.fail && i == 0 && ctx.failpoint("chain.fixed").is_ok() {
        return Err(StepError::Unknown(format!(
            "chain run {} was started with `fail`: its first link stops for review",
            ctx.run_id()
        )));
    }
    let answer = ctx.model(&request).await?;
    let reference = reference(ctx.run_id(), i);
    let payload = trailmark::domain::request_hash(&json!(answer.content));
    // The checkpoint names the answer by its hash: the journal already holds it word for word,
    // and storing it twice would double the bytes a step writes.
    let mut output = json!({ "link": i, "answer_sha256": payload });
    if version >= 2 {
        output["code"] = json!(version);
    }
    if let Some(taken) = patched {
        output["patched"] = json!(taken);
    }
    if p.wait.as_ref().is_some_and(|w| w.at + 1 == i as i64) {
        // The link after the wait says what it received: the drill and the tests check it.
        let event = ctx.event().await?;
        output["event"] = json!(event.map(|e| json!({ "id": e.id, "payload": e.payload })));
    }
    if p.children.as_ref().is_some_and(|c| c.at + 1 == i as i64) {
        // The link after the fan-out says how its children ended.
        output["children"] = json!(ctx.children_summary().await?);
    }
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
        return Ok(StepOutcome::finish(output));
    }
    let next = StepOutcome::goto(output, STEP);
    let at = i as i64;
    Ok(match (&p.sleep, &p.wait) {
        (Some(sleep), _) if sleep.at == at => {
            next.sleeping_for(Duration::from_secs_f64(sleep.secs))
        }
        (_, Some(wait)) if wait.at == at => {
            let timeout = Duration::from_secs_f64(wait.timeout_secs);
            next.waiting_for(EventWait::new(wait.event.clone(), timeout))
        }
        _ => match &p.children {
            Some(c) if c.at == at => next.with_children(c.children()),
            _ => next,
        },
    })
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

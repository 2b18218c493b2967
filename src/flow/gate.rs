//! The gate a keyed run's step passes before its claim, and the hand-off of freed slots to the
//! runs waiting for one.
//!
//! A slot is a lease: a run holds one of its key while its lease is live, so a killed or frozen
//! worker's slot is free when its lease expires; nothing has to give it back (a dead presence
//! connection alone frees no slot: see `store::flow`). Counting a key's slots and taking one happen
//! in one transaction that holds the key's row locked, with the claim itself, so two workers
//! never both take the last slot. A run that finds no slot (or others already in line) is
//! recorded as waiting and its message acknowledged: it holds no lease and no message while it
//! waits. Whoever frees a slot (a step's end, or the supervisor's loop for slots freed by a
//! death, a raised limit or a rate's next token) hands it to the first in line: the slot is
//! reserved for that run for a lease and its step message queued again, in one transaction.

use sqlx::PgConnection;

use super::Concurrency;
use crate::broker::Topology;
use crate::domain::{OutgoingMessage, RunId, StepMessage};
use crate::engine::Engine;
use crate::store::flow::{self as rows, LimitRow, NewWaiter, Slots};
use crate::store::{self, outbox, runs};

/// The limits in force for one key: declared, unless an operator set them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Runs of the key holding a step at once.
    pub per_key: i64,
    /// Runs of the workflow holding a step at once.
    pub total: Option<i64>,
    /// Step starts of the key per second.
    pub rate: Option<f64>,
}

impl Limits {
    /// The declared limits with the rows set at run time over them (the key's own row first).
    pub fn of(declared: &Concurrency, set: &[LimitRow]) -> Self {
        let (own, every) = (set.iter().find(|r| !r.key.is_empty()), set.iter().find(|r| r.key.is_empty()));
        let pick = |f: fn(&LimitRow) -> Option<i32>| own.and_then(f).or_else(|| every.and_then(f));
        Self {
            per_key: pick(|r| r.concurrency).map_or(i64::from(declared.per_key), i64::from),
            total: every
                .and_then(|r| r.total)
                .map(i64::from)
                .or(declared.total.map(i64::from)),
            rate: own.and_then(|r| r.rate).or_else(|| every.and_then(|r| r.rate)),
        }
    }

    /// What a claim under these limits holds.
    fn held(&self, key: String) -> rows::Held {
        rows::Held {
            key,
            paced: self.rate.is_some(),
            shared: self.total.is_some(),
        }
    }

    /// Slots free for runs in line: within the key's limit and the workflow's.
    fn free(&self, s: &Slots) -> i64 {
        let key = self.per_key - s.live;
        match (self.total, s.total_live) {
            (Some(total), Some(live)) => key.min(total - live),
            _ => key,
        }
    }
}

/// What the gate made of a step delivery.
#[derive(Debug)]
pub enum Gated {
    /// The run has a slot (or its run has no key): the claim's outcome.
    Claimed(runs::ClaimOutcome),
    /// The run waits for a slot or a token; the line says which and why (for its progress).
    Waits(String),
}

/// Runs handed a slot in a transaction: their step messages, queued in it, under these outbox rows.
#[derive(Debug, Default)]
pub struct Handed {
    /// The messages.
    pub messages: Vec<OutgoingMessage>,
    /// Their outbox rows.
    pub rows: Vec<i64>,
}

/// Gates and claims one delivery of a step of a workflow that declares `declared`; `None` when
/// the run has no key (an optional one it lacks, or no such run): the caller claims as usual.
/// `hold` marks handed runs' messages for the caller's own publish.
pub async fn claim(
    engine: &Engine,
    msg: &StepMessage,
    declared: &Concurrency,
    request: &runs::ClaimRequest,
    hold: impl FnOnce(&mut [OutgoingMessage]),
) -> store::Result<Option<(Gated, Handed, rows::Held)>> {
    let mut tx = engine.pool.begin().await?;
    let Some(run) = rows::run_flow(&mut *tx, msg.run_id.as_str()).await? else {
        return Ok(None);
    };
    let Some(key) = run.flow_key else {
        return Ok(None);
    };
    let at = (msg.workflow.as_str(), key.as_str());
    let limits = Limits::of(declared, &rows::limits_for(&mut *tx, at.0, at.1).await?);
    let (slots, tokens) = lock(&mut tx, at, msg.run_id.as_str(), &limits).await?;
    tracing::debug!(key = at.1, seq = msg.seq, live = slots.live, own = slots.own, queued = slots.queued, "gate");
    let mut handed = Handed::default();
    if !slots.own {
        let waiter = NewWaiter {
            run_id: msg.run_id.as_str(),
            seq: msg.seq,
            at,
            priority: run.priority,
            reason: "slot",
            after_secs: 0.0,
            aging_secs: engine.settings.flow.aging_secs as f64,
        };
        let free = limits.free(&slots);
        let waits = if free <= 0 || slots.queued {
            // In line behind the others; slots free while others wait (a hand-off not made
            // yet) go to the line in its order, which may put this run first.
            let reason = if free > 0 || slots.live >= limits.per_key { "slot" } else { "total" };
            rows::wait(&mut tx, &NewWaiter { reason, ..waiter }).await?;
            let (ran, ids) = hand_in_tx(&mut tx, engine, (at, tokens), free, Some(&msg.run_id), hold).await?;
            handed = ran;
            (!ids.iter().any(|id| id == msg.run_id.as_str()))
                .then(|| waits_line(msg, &key, reason, &limits, &slots))
        } else {
            match take_token(&mut tx, at, &limits, tokens).await? {
                None => None,
                Some(after_secs) => {
                    rows::wait(&mut tx, &NewWaiter { reason: "rate", after_secs, ..waiter }).await?;
                    Some(rate_line(msg, &key, &limits, after_secs))
                }
            }
        };
        if let Some(line) = waits {
            tx.commit().await?;
            return Ok(Some((Gated::Waits(line), handed, limits.held(key))));
        }
    }
    // Held by the lease from now on: a slot reserved for this run stops being a reservation
    // (else it would stay live for a lease after the step ended).
    rows::hold(&mut tx, msg.run_id.as_str(), at).await?;
    let outcome = runs::claim(&mut *tx, request).await?;
    match &outcome {
        runs::ClaimOutcome::Claimed(_) => tx.commit().await?,
        // Nothing taken: the slots stay as they were (reserved for the run, or free), and so
        // do the runs handed one here.
        _ => {
            tx.rollback().await?;
            handed = Handed::default();
        }
    }
    Ok(Some((Gated::Claimed(outcome), handed, limits.held(key))))
}

/// Locks the key's row (after the workflow's, when a total applies: always in that order, so
/// two transactions never wait for each other) and counts its slots; with the key's tokens
/// (`None`: no rate applies).
async fn lock(
    tx: &mut PgConnection,
    (workflow, key): (&str, &str),
    run_id: &str,
    limits: &Limits,
) -> store::Result<(Slots, Option<f64>)> {
    if limits.total.is_some() {
        rows::lock_key(tx, workflow, "").await?;
    }
    let row = rows::lock_key(tx, workflow, key).await?;
    let slots = rows::slots(tx, (workflow, key), run_id, limits.total.is_some()).await?;
    // A bucket holds a second's tokens (one at least): a burst after a quiet spell starts at
    // most that many steps at once.
    let tokens = limits.rate.map(|rate| {
        let cap = rate.max(1.0);
        (row.tokens.unwrap_or(cap) + row.idle_secs * rate).min(cap)
    });
    Ok((slots, tokens))
}

/// Takes a token for a step start when a rate applies; `Some(secs)`: none left, the next comes
/// in that long.
async fn take_token(
    tx: &mut PgConnection,
    at: (&str, &str),
    limits: &Limits,
    tokens: Option<f64>,
) -> store::Result<Option<f64>> {
    let (Some(rate), Some(tokens)) = (limits.rate, tokens) else {
        return Ok(None);
    };
    if tokens >= 1.0 {
        rows::set_tokens(tx, at, tokens - 1.0).await?;
        return Ok(None);
    }
    rows::set_tokens(tx, at, tokens).await?;
    Ok(Some((1.0 - tokens) / rate))
}

/// Hands up to `free` slots of a locked key to its line (fewer when its rate has fewer
/// tokens), queueing the handed runs' step messages but `except`'s (the caller claims for it
/// now); with the ids of every run handed a slot.
async fn hand_in_tx(
    tx: &mut PgConnection,
    engine: &Engine,
    (at, tokens): ((&str, &str), Option<f64>),
    free: i64,
    except: Option<&RunId>,
    hold: impl FnOnce(&mut [OutgoingMessage]),
) -> store::Result<(Handed, Vec<String>)> {
    let n = match tokens {
        Some(t) => free.min(t.floor() as i64),
        None => free,
    };
    let reserve = engine.settings.worker.lease_secs as f64;
    let ready = rows::hand(tx, at, n, reserve).await?;
    if let Some(t) = tokens.filter(|_| !ready.is_empty()) {
        rows::set_tokens(tx, at, t - ready.len() as f64).await?;
    }
    let ids: Vec<String> = ready.iter().map(|r| r.run_id.clone()).collect();
    let mut messages: Vec<OutgoingMessage> = ready
        .into_iter()
        .filter(|r| except.is_none_or(|e| e.as_str() != r.run_id))
        .filter_map(|r| step_message(&engine.topology, &r))
        .collect();
    hold(&mut messages);
    let rows = outbox::insert(&mut *tx, &messages).await?;
    Ok((Handed { messages, rows }, ids))
}

/// The step message of a run handed a slot, carrying its trace.
fn step_message(topology: &Topology, r: &runs::ExpiredLease) -> Option<OutgoingMessage> {
    let run_id = RunId::parse(&r.run_id).ok()?;
    Some(
        topology
            .step_message(&run_id, &r.workflow, r.workflow_version, &r.step, r.step_seq)
            .traced(r.traceparent.as_deref()),
    )
}

/// Hands on what a keyed step's end freed: the key's free slots to its line, or, when the
/// workflow has a total limit, the workflow's round-robin across its keys.
pub async fn hand_on(
    engine: &Engine,
    declared: &Concurrency,
    at: (&str, &str),
    hold: impl FnMut(&mut [OutgoingMessage]),
) -> store::Result<Handed> {
    let set = rows::limits_for(&engine.pool, at.0, "").await?;
    if Limits::of(declared, &set).total.is_some() {
        hand_workflow(engine, declared, at.0, hold).await
    } else {
        hand_key(engine, declared, at, hold).await
    }
}

/// Hands the free slots of one key to its line, in a transaction of its own. A workflow with a
/// total limit is served round-robin across its keys instead ([`hand_workflow`]).
pub async fn hand_key(
    engine: &Engine,
    declared: &Concurrency,
    at: (&str, &str),
    hold: impl FnOnce(&mut [OutgoingMessage]),
) -> store::Result<Handed> {
    let mut tx = engine.pool.begin().await?;
    let limits = Limits::of(declared, &rows::limits_for(&mut *tx, at.0, at.1).await?);
    let (slots, tokens) = lock(&mut tx, at, "", &limits).await?;
    let (handed, ids) = hand_in_tx(&mut tx, engine, (at, tokens), limits.free(&slots), None, hold).await?;
    tx.commit().await?;
    tracing::debug!(key = at.1, live = slots.live, handed = ?ids, "hand on");
    if !ids.is_empty() {
        tracing::debug!(workflow = at.0, key = at.1, runs = ids.len(), "handed free slots to waiting runs");
    }
    Ok(handed)
}

/// Hands free slots of a workflow to its waiting runs: round-robin across its keys (the key
/// served least recently first, one run each per round), within each key's limit and the
/// workflow's total, so a key with thousands waiting delays one with a few by about one step
/// of each other key.
pub async fn hand_workflow(
    engine: &Engine,
    declared: &Concurrency,
    workflow: &str,
    mut hold: impl FnMut(&mut [OutgoingMessage]),
) -> store::Result<Handed> {
    let mut all = Handed::default();
    loop {
        let mut tx = engine.pool.begin().await?;
        let keys = rows::waiting_keys(&mut tx, workflow).await?;
        let mut round = 0;
        for key in &keys {
            let at = (workflow, key.as_str());
            let limits = Limits::of(declared, &rows::limits_for(&mut *tx, at.0, at.1).await?);
            let (slots, tokens) = lock(&mut tx, at, "", &limits).await?;
            let free = limits.free(&slots).min(if limits.total.is_some() { 1 } else { i64::MAX });
            let (handed, ids) = hand_in_tx(&mut tx, engine, (at, tokens), free, None, &mut hold).await?;
            round += ids.len();
            all.messages.extend(handed.messages);
            all.rows.extend(handed.rows);
        }
        tx.commit().await?;
        // Only a total limit serves one run per key per round: go round again while it hands.
        if round == 0 || keys.is_empty() {
            return Ok(all);
        }
    }
}

/// What a run waiting for a slot says in its progress.
fn waits_line(msg: &StepMessage, key: &str, reason: &str, limits: &Limits, s: &Slots) -> String {
    let held = match reason {
        "total" => format!(
            "all {} slots of workflow {} are in use",
            limits.total.unwrap_or_default(),
            msg.workflow
        ),
        _ if s.live >= limits.per_key => format!("{} of {} slots of key {key} are in use", s.live, limits.per_key),
        _ => format!("runs of key {key} are ahead of it in line"),
    };
    format!(
        "step {} (position {}) waits for a slot: {held}; it holds no lease and starts when one is handed to it",
        msg.step, msg.seq
    )
}

/// What a run waiting for a token of its key's rate says in its progress.
fn rate_line(msg: &StepMessage, key: &str, limits: &Limits, after: f64) -> String {
    format!(
        "step {} (position {}) waits for key {key}'s rate limit ({} step starts a second); next token in {:.1} s, holding no lease",
        msg.step,
        msg.seq,
        limits.rate.unwrap_or_default(),
        after
    )
}

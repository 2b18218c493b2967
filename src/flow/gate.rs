//! The gate a keyed run's step passes before its claim, and the hand-off of freed slots to the
//! runs waiting for one.
//!
//! A slot is a lease: a run holds one of its key while its lease is live, so a killed or frozen
//! worker's slot is free when its lease expires; nothing has to give it back (a dead presence
//! connection alone frees no slot: see `store::flow`). Counting a key's slots and taking one happen
//! in one transaction that holds the key's row locked, with the claim itself, so two workers
//! never both take the last slot; a process's deliveries of a key that arrive together share
//! that transaction and its commit. A run that finds no slot (or others already in line) is
//! recorded as waiting and its message acknowledged: it holds no lease and no message while it
//! waits. Whoever frees a slot (a step's end, or the supervisor's loop for slots freed by a
//! death, a raised limit or a rate's next token) hands it to the first in line: the slot is
//! reserved for that run for a lease and its step message queued again, in one transaction.

use sqlx::{PgConnection, PgPool};

use super::Concurrency;
use crate::broker::Topology;
use crate::domain::{EagerHold, OutgoingMessage, RunId, StepMessage};
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
    /// The run has a slot: the claim's outcome.
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

impl Handed {
    fn extend(&mut self, more: Handed) {
        self.messages.extend(more.messages);
        self.rows.extend(more.rows);
    }
}

/// One step delivery's ask of its key's gate, with what its batch needs to answer it.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The delivery.
    pub msg: StepMessage,
    /// The limits its workflow declares.
    pub declared: Concurrency,
    /// The claim to make once it has a slot.
    pub request: runs::ClaimRequest,
    /// How long a slot handed to a waiting run stays reserved for it (a lease).
    pub reserve_secs: f64,
    /// Seconds of waiting that lift a run one priority level (`flow.aging_secs`).
    pub aging_secs: f64,
    /// How the asking worker marks the messages of runs handed a slot on the way, which it
    /// publishes itself (`None`: the relay publishes them).
    pub publish: Option<EagerHold>,
}

/// The gate's answer to one ask: claimed under the key's slot, or waiting for one; `None` when
/// the run has no key (an optional one it lacks, or no such run): claim it as usual.
pub type Answer = Option<(Gated, rows::Held)>;

/// An answer with the messages of runs the batch handed a slot on the way (all of them go to
/// one asker of the batch, to publish).
pub type Reply = (Answer, Handed);

/// Gates and claims a batch of step deliveries of keyed workflows, as many at once as arrive
/// together: the deliveries of one key (of one workflow, when it has a total limit) share one
/// transaction, so a key's lock is taken and its slots counted once per batch and the batch
/// commits once; keys without a shared total go in transactions of their own, side by side.
/// Each ask gets the answer it would get alone. A transaction refused because of one of its
/// asks (a deadlock with a hand-off) runs its asks one by one.
pub async fn claim_all(pool: &PgPool, topology: &Topology, asks: &[Ask]) -> Vec<store::Result<Reply>> {
    let mut replies: Vec<Option<store::Result<Reply>>> = (0..asks.len()).map(|_| None).collect();
    let groups = match grouped(pool, asks).await {
        Ok(groups) => groups,
        Err(e) => return fail_all(asks.len(), &e),
    };
    for (i, _) in asks.iter().enumerate().filter(|(i, _)| !groups.iter().any(|g| g.asks.iter().any(|(j, _)| j == i))) {
        replies[i] = Some(Ok((None, Handed::default())));
    }
    let outcomes = futures_util::future::join_all(groups.iter().map(|g| group_tx(pool, topology, asks, g))).await;
    for (group, outcome) in groups.iter().zip(outcomes) {
        match outcome {
            Ok(answers) => {
                for (i, reply) in answers {
                    replies[i] = Some(Ok(reply));
                }
            }
            Err(e) if group.asks.len() > 1 && store::caused_by_one_item(&e) => {
                tracing::debug!(error = %crate::error::Report(&e), asks = group.asks.len(), "a gate's batch was refused; gating its asks one by one");
                for (i, run) in &group.asks {
                    let alone = Group { asks: vec![(*i, run.clone())], ..group.clone() };
                    let reply = group_tx(pool, topology, asks, &alone).await;
                    replies[*i] = Some(reply.map(|mut one| one.remove(0).1));
                }
            }
            Err(e) => {
                for (i, _) in &group.asks {
                    replies[*i] = Some(Err(unavailable(&e)));
                }
            }
        }
    }
    replies.into_iter().map(|r| r.expect("every ask answered")).collect()
}

/// The deliveries of one transaction of the gate: one key's, or one workflow's under a total.
#[derive(Debug, Clone)]
struct Group {
    workflow: String,
    /// The asks (by index) with their runs' keys and priorities.
    asks: Vec<(usize, Keyed)>,
    /// The limits set at run time for the workflow.
    set: Vec<LimitRow>,
}

/// A run's key and priority, as the gate reads them.
#[derive(Debug, Clone)]
struct Keyed {
    key: String,
    priority: i16,
}

/// Groups the asks whose runs have a key by the transaction that gates them.
async fn grouped(pool: &PgPool, asks: &[Ask]) -> store::Result<Vec<Group>> {
    let ids: Vec<&str> = asks.iter().map(|a| a.msg.run_id.as_str()).collect();
    let runs = rows::run_flows(pool, &ids).await?;
    let mut workflows: Vec<&str> = asks.iter().map(|a| a.msg.workflow.as_str()).collect();
    workflows.sort_unstable();
    workflows.dedup();
    let set = rows::limits_of(pool, &workflows).await?;
    let mut groups: Vec<Group> = Vec::new();
    for (i, ask) in asks.iter().enumerate() {
        let Some(run) = runs.iter().find(|r| r.run_id == ask.msg.run_id.as_str()) else {
            continue;
        };
        let Some(key) = run.flow_key.clone() else {
            continue;
        };
        let workflow = ask.msg.workflow.as_str();
        let set: Vec<LimitRow> = set.iter().filter(|r| r.workflow == workflow).cloned().collect();
        let total = Limits::of(&ask.declared, &set).total.is_some();
        let keyed = Keyed { key, priority: run.priority };
        let same = |g: &Group| g.workflow == workflow && (total || g.asks[0].1.key == keyed.key);
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => g.asks.push((i, keyed)),
            None => groups.push(Group { workflow: workflow.to_owned(), asks: vec![(i, keyed)], set }),
        }
    }
    Ok(groups)
}

/// Gates one group's asks in one transaction: the workflow's row first under a total, then
/// each key's in key order (so two transactions never wait for each other), each key's asks
/// decided against its slots counted once.
async fn group_tx(
    pool: &PgPool,
    topology: &Topology,
    asks: &[Ask],
    group: &Group,
) -> store::Result<Vec<(usize, Reply)>> {
    let mut tx = pool.begin().await?;
    let mut keys: Vec<&str> = group.asks.iter().map(|(_, k)| k.key.as_str()).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut total_left: Option<i64> = None;
    let mut decided = Vec::new();
    let mut handed = Handed::default();
    for key in keys {
        let of_key: Vec<&(usize, Keyed)> = group.asks.iter().filter(|(_, k)| k.key == key).collect();
        let first = &asks[of_key[0].0];
        let at = (group.workflow.as_str(), key);
        let set: Vec<LimitRow> = group.set.iter().filter(|r| r.key.is_empty() || r.key == key).cloned().collect();
        let limits = Limits::of(&first.declared, &set);
        let askers: Vec<&str> = of_key.iter().map(|(i, _)| asks[*i].msg.run_id.as_str()).collect();
        let (slots, tokens) = lock(&mut tx, at, &askers, &limits).await?;
        tracing::debug!(key, asks = askers.len(), live = slots.live, own = slots.own.len(), queued = slots.queued, "gate");
        let left = total_left.get_or_insert_with(|| limits.total.zip(slots.total_live).map_or(i64::MAX, |(t, l)| t - l));
        let key_asks = KeyAsks { at, limits: &limits, slots: &slots, asks, of_key: &of_key };
        let (mut these, ran) = decide(&mut tx, topology, &key_asks, tokens, left).await?;
        handed.extend(ran);
        decided.append(&mut these);
    }
    let answers = claim_decided(&mut tx, asks, group, decided).await?;
    tx.commit().await?;
    Ok(with_handed(answers, handed))
}

/// One key's asks, with its limits and slots as counted under its lock.
struct KeyAsks<'a> {
    at: (&'a str, &'a str),
    limits: &'a Limits,
    slots: &'a Slots,
    asks: &'a [Ask],
    of_key: &'a [&'a (usize, Keyed)],
}

/// What the gate decided for one ask before the claims.
enum Decision {
    /// It has (or takes) a slot: claim it.
    Claim { key: String, held: rows::Held },
    /// It waits, saying why.
    Waits { line: String, held: rows::Held },
}

/// Decides a key's asks: a run holding a slot already claims; others take the key's free slots
/// (and rate tokens), the higher priority first, unless runs are already in line; the rest wait.
/// Runs in line are handed the slots free behind them, in their order (their messages queued).
async fn decide(
    tx: &mut PgConnection,
    topology: &Topology,
    k: &KeyAsks<'_>,
    mut tokens: Option<f64>,
    total_left: &mut i64,
) -> store::Result<(Vec<(usize, Decision)>, Handed)> {
    let (limits, slots, at) = (k.limits, k.slots, k.at);
    let held = limits.held(at.1.to_owned());
    let mut order: Vec<&(usize, Keyed)> = k.of_key.to_vec();
    order.sort_by_key(|(_, run)| std::cmp::Reverse(run.priority));
    let mut free = limits.free(slots).min(*total_left);
    let mut decided = Vec::new();
    let mut waiting = Vec::new();
    // Runs that took a slot in this batch: another delivery of the same step in it claims on
    // that slot (the claim statement gives the lease to one of them), as it would had it come
    // after, instead of taking a second slot or waiting in line for one.
    let mut took: Vec<&str> = Vec::new();
    for (i, run) in order {
        let ask = &k.asks[*i];
        let run_id = ask.msg.run_id.as_str();
        let claim = || Decision::Claim { key: at.1.to_owned(), held: held.clone() };
        if slots.own.iter().any(|id| id == run_id) || took.contains(&run_id) {
            decided.push((*i, claim()));
            continue;
        }
        let waiter = NewWaiter {
            run_id,
            seq: ask.msg.seq,
            at,
            priority: run.priority,
            reason: "slot",
            after_secs: 0.0,
            aging_secs: ask.aging_secs,
        };
        if free <= 0 || slots.queued {
            // The slots this batch took count as the key's.
            let live = slots.live + took.len() as i64;
            let reason = if free > 0 || live >= limits.per_key { "slot" } else { "total" };
            waiting.push(NewWaiter { reason, ..waiter });
            let line = waits_line(&ask.msg, at.1, reason, limits, live);
            decided.push((*i, Decision::Waits { line, held: held.clone() }));
            continue;
        }
        if let (Some(rate), Some(t)) = (limits.rate, tokens.filter(|t| *t < 1.0)) {
            let after_secs = (1.0 - t) / rate;
            waiting.push(NewWaiter { reason: "rate", after_secs, ..waiter });
            let line = rate_line(&ask.msg, at.1, limits, after_secs);
            decided.push((*i, Decision::Waits { line, held: held.clone() }));
            continue;
        }
        tokens = tokens.map(|t| t - 1.0);
        free -= 1;
        took.push(run_id);
        *total_left -= 1;
        decided.push((*i, claim()));
    }
    rows::wait_all(tx, &waiting).await?;
    let mut handed = Handed::default();
    if waiting.iter().any(|w| w.reason != "rate") && free > 0 {
        // Slots free while runs wait (a hand-off not made yet) go to the line in its order,
        // which may put some of these asks first: their messages are queued like the others'.
        let first = &k.asks[k.of_key[0].0];
        let (ran, ids) = hand_in_tx(tx, topology, (at, tokens), (free, first.reserve_secs), |m| first.publish.iter().for_each(|hold| hold.apply(m))).await?;
        *total_left -= ids.len() as i64;
        handed = ran;
    } else if let Some(t) = tokens {
        rows::set_tokens(tx, at, t).await?;
    }
    Ok((decided, handed))
}

/// Claims the asks that have a slot in one statement, and holds their slots by their leases
/// (a reservation stops being one, else it would stay live for a lease after the step ended).
/// A claim that does not take the lease (a duplicate, a busy or moved run) holds no slot.
async fn claim_decided(
    tx: &mut PgConnection,
    asks: &[Ask],
    group: &Group,
    decided: Vec<(usize, Decision)>,
) -> store::Result<Vec<(usize, Answer)>> {
    let claims: Vec<runs::ClaimRequest> = decided
        .iter()
        .filter(|(_, d)| matches!(d, Decision::Claim { .. }))
        .map(|(i, _)| asks[*i].request.clone())
        .collect();
    let mut outcomes = runs::claim_in(&mut *tx, &claims).await?.into_iter();
    let mut answers = Vec::with_capacity(decided.len());
    let mut holding: Vec<(String, String)> = Vec::new();
    for (i, decision) in decided {
        let answer = match decision {
            Decision::Claim { key, held } => {
                let outcome = outcomes.next().expect("an outcome per claim");
                if matches!(outcome, runs::ClaimOutcome::Claimed(_)) {
                    holding.push((key, asks[i].msg.run_id.as_str().to_owned()));
                }
                Some((Gated::Claimed(outcome), held))
            }
            Decision::Waits { line, held } => Some((Gated::Waits(line), held)),
        };
        answers.push((i, answer));
    }
    holding.sort();
    for chunk in holding.chunk_by(|a, b| a.0 == b.0) {
        let ids: Vec<&str> = chunk.iter().map(|(_, id)| id.as_str()).collect();
        rows::hold(tx, &ids, (&group.workflow, &chunk[0].0)).await?;
    }
    Ok(answers)
}

/// The answers, the batch's hand-offs given to the first of them.
fn with_handed(answers: Vec<(usize, Answer)>, mut handed: Handed) -> Vec<(usize, Reply)> {
    answers
        .into_iter()
        .map(|(i, answer)| (i, (answer, std::mem::take(&mut handed))))
        .collect()
}

fn fail_all(n: usize, e: &store::Error) -> Vec<store::Result<Reply>> {
    (0..n).map(|_| Err(unavailable(e))).collect()
}

fn unavailable(e: &store::Error) -> store::Error {
    store::Error::Unavailable {
        what: format!("the gate of a concurrency key failed: {}", crate::error::Report(e)),
        source: None,
    }
}

/// Locks the key's row (after the workflow's, when a total applies: always in that order, so
/// two transactions never wait for each other) and counts its slots, naming those `askers`
/// hold; with the key's tokens (`None`: no rate applies).
async fn lock(
    tx: &mut PgConnection,
    (workflow, key): (&str, &str),
    askers: &[&str],
    limits: &Limits,
) -> store::Result<(Slots, Option<f64>)> {
    if limits.total.is_some() {
        rows::lock_key(tx, workflow, "").await?;
    }
    let row = rows::lock_key(tx, workflow, key).await?;
    let slots = rows::slots(tx, (workflow, key), askers, limits.total.is_some()).await?;
    // A bucket holds a second's tokens (one at least): a burst after a quiet spell starts at
    // most that many steps at once.
    let tokens = limits.rate.map(|rate| {
        let cap = rate.max(1.0);
        (row.tokens.unwrap_or(cap) + row.idle_secs * rate).min(cap)
    });
    Ok((slots, tokens))
}

/// Hands up to `free` slots of a locked key to its line (fewer when its rate has fewer
/// tokens), each reserved for `reserve_secs`, queueing the handed runs' step messages (marked
/// by `hold` for their publisher); with the ids of the runs handed a slot.
async fn hand_in_tx(
    tx: &mut PgConnection,
    topology: &Topology,
    (at, tokens): ((&str, &str), Option<f64>),
    (free, reserve_secs): (i64, f64),
    hold: impl FnOnce(&mut [OutgoingMessage]),
) -> store::Result<(Handed, Vec<String>)> {
    let n = match tokens {
        Some(t) => free.min(t.floor() as i64),
        None => free,
    };
    let ready = rows::hand(tx, at, n, reserve_secs).await?;
    if let Some(t) = tokens.filter(|_| !ready.is_empty()) {
        rows::set_tokens(tx, at, t - ready.len() as f64).await?;
    }
    let ids: Vec<String> = ready.iter().map(|r| r.run_id.clone()).collect();
    let mut messages: Vec<OutgoingMessage> = ready.into_iter().filter_map(|r| step_message(topology, &r)).collect();
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
    let (slots, tokens) = lock(&mut tx, at, &[], &limits).await?;
    let reserve = engine.settings.worker.lease_secs as f64;
    let (handed, ids) = hand_in_tx(&mut tx, &engine.topology, (at, tokens), (limits.free(&slots), reserve), hold).await?;
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
            let (slots, tokens) = lock(&mut tx, at, &[], &limits).await?;
            let free = limits.free(&slots).min(if limits.total.is_some() { 1 } else { i64::MAX });
            let reserve = engine.settings.worker.lease_secs as f64;
            let (handed, ids) = hand_in_tx(&mut tx, &engine.topology, (at, tokens), (free, reserve), &mut hold).await?;
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
fn waits_line(msg: &StepMessage, key: &str, reason: &str, limits: &Limits, live: i64) -> String {
    let held = match reason {
        "total" => format!(
            "all {} slots of workflow {} are in use",
            limits.total.unwrap_or_default(),
            msg.workflow
        ),
        _ if live >= limits.per_key => format!("{live} of {} slots of key {key} are in use", limits.per_key),
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

//! The step transaction's owner: the claim that takes a run's lease, the records a handler
//! writes while it runs (journal entries, effect intents and results), the commit that ends the
//! step, and the release that gives the lease back for a later retry. Each kind of statement
//! goes through its own group-commit queue (`batch.rs`), so the steps of a process that reach the
//! same statement at the same moment share one round trip and one commit.
//!
//! The workflow API reaches the records through the [`Records`] port only; this is the one
//! place where they meet the store.

use std::future::Future;
use std::sync::OnceLock;

use serde_json::Value;
use sqlx::PgPool;

use super::batch::Batcher;
use crate::broker::Topology;
use crate::flow::gate;
use crate::domain::{
    Admission, EffectIntent, Event, Fence, IdempotencyKey, IntentOutcome, JournalEntry, ModelAsk,
    RunId, ShadowWrite, Spent,
};
use crate::store::checkpoint::{self, Committed, StepCommit};
use crate::store::records::{self, Record};
use crate::store::runs::{self, ClaimOutcome, ClaimRequest};
use crate::store::{self, effects, journal, model_usage, outbox, progress, shadow, steps};
use crate::workflow::{BoxFuture, Records, StepError};

/// Claims, records, commits and releases of one process's steps.
pub(crate) struct StepTx {
    pool: PgPool,
    /// Names the exchange of the events this transaction publishes.
    topology: Topology,
    /// [`store::relaxed_pool`] of `pool`: journal entries and effect results, which the step's
    /// next synchronous commit makes durable.
    relaxed: PgPool,
    max_batch: usize,
    claims: OnceLock<Batcher<ClaimRequest, ClaimOutcome>>,
    /// Claims of keyed runs, through their keys' gate.
    gates: OnceLock<Batcher<gate::Ask, gate::Reply>>,
    records: OnceLock<Batcher<Record, bool>>,
    /// Effect intents go through the strict pool: an intent is durable before its call.
    intents: OnceLock<Batcher<EffectIntent, IntentOutcome>>,
    commits: OnceLock<Batcher<StepCommit, Committed>>,
    /// Commits that only move a running run to its next step, on the relaxed pool (see
    /// [`StepTx::commit`]).
    advances: OnceLock<Batcher<StepCommit, Committed>>,
    /// Next positions this process's commits claimed, waiting for their deliveries.
    pub preclaims: super::preclaim::PreClaims,
    /// Keys' lines this process found empty a moment ago (`flow::lines`).
    pub lines: crate::flow::lines::Lines,
    /// Progress lines, written in batches by a task of their own.
    progress: OnceLock<tokio::sync::mpsc::UnboundedSender<progress::NewLine>>,
    /// The process's failpoints, for the spots inside a commit's transaction (a fan-out's
    /// children being started).
    failpoints: crate::failpoint::Failpoints,
}

impl StepTx {
    /// The step transactions of a process working on `pool`, batching up to `max_batch`
    /// statements of a kind.
    pub fn new(
        pool: &PgPool,
        database: &crate::config::DatabaseSettings,
        topology: Topology,
        max_batch: usize,
    ) -> Self {
        Self {
            relaxed: store::relaxed_pool(pool, database),
            pool: pool.clone(),
            topology,
            max_batch,
            claims: OnceLock::new(),
            gates: OnceLock::new(),
            records: OnceLock::new(),
            intents: OnceLock::new(),
            commits: OnceLock::new(),
            advances: OnceLock::new(),
            preclaims: Default::default(),
            lines: Default::default(),
            progress: OnceLock::new(),
            failpoints: Default::default(),
        }
    }

    /// With the process's failpoints armed inside its commits' transactions.
    pub fn with_failpoints(mut self, failpoints: crate::failpoint::Failpoints) -> Self {
        self.failpoints = failpoints;
        self
    }

    /// The pool whose commits do not wait for their WAL flush.
    pub fn relaxed(&self) -> &PgPool {
        &self.relaxed
    }

    /// Checks the inbox, takes the run's lease and counts the attempt, in one statement with the
    /// other deliveries' claims of the moment, committed before any outside call is made.
    ///
    /// Synchronous, unlike the advance commit: a claim that a Postgres crash forgot would leave
    /// its worker holding a fence the run no longer has; the worker's next fenced write is then
    /// refused as if another worker held the run, and the delivery is dropped as stale while no
    /// one holds it (a run with no lease and no message; `tests/relaxed_crash.rs`). The lease a
    /// synchronous claim leaves is what brings a step back after its relaxed commit is lost.
    pub async fn claim(&self, request: ClaimRequest) -> store::Result<ClaimOutcome> {
        let batcher = self.batcher(&self.claims, &self.pool, |pool, batch| async move {
            runs::claim_all(&pool, &batch).await
        });
        batcher.call(request).await
    }

    /// Gates and claims a keyed run's delivery (`flow::gate`), with the other keyed deliveries of
    /// the moment: one transaction and one commit per key (per workflow under a total) instead
    /// of one per delivery, each holding the key's lock through its commit.
    pub async fn gate(&self, ask: gate::Ask) -> store::Result<gate::Reply> {
        let topology = self.topology.clone();
        let batcher = self.batcher(&self.gates, &self.pool, move |pool, batch| {
            let topology = topology.clone();
            async move { gate::claim_all(&pool, &topology, &batch).await }
        });
        batcher.call(ask).await
    }

    /// Commits a step (inbox row, fenced run advance, checkpoint, parked items, outbox rows),
    /// with the other steps' commits of the moment.
    ///
    /// A commit that only moves a running (or compensating) run on to its next step does not
    /// wait for its WAL flush when the step was claimed by a claim statement: every effect of
    /// the step was made durable by its intent before the call, and a Postgres crash that loses
    /// the commit leaves the run at the step under the lease of that synchronous claim, so the
    /// step runs again from its journal and keys once the lease expires (README, trade-offs;
    /// `tests/relaxed_crash.rs`). The other advances stay synchronous:
    /// - a step started on a pre-claim (`preclaimed`): its lease is the previous commit's idle
    ///   one, which never expires, so a lost commit after an acknowledged delivery would leave
    ///   the run with nothing to bring it back;
    /// - one whose ending may rest on a model answer not yet flushed (`answers_flushed` false:
    ///   asked again, the model may choose another next step);
    /// - one that sends messages of its own (`ctx.send`: published at once, they must never go
    ///   out on a commit that can be lost);
    /// - one that carries local writes (`ctx.local_write`): their rows are seen by other
    ///   readers at once, and a lost commit asked again could write other values.
    ///
    /// Commits that end a run or hand it to a person are seen by people and upstream services
    /// at once, and stay synchronous.
    pub async fn commit(
        &self,
        step: StepCommit,
        (answers_flushed, preclaimed): (bool, bool),
    ) -> store::Result<Committed> {
        if step.wait.is_some() {
            // Registered in the commit's own transaction, never batched (`crate::wait`).
            let with = (&self.topology, &self.failpoints);
            return crate::wait::commit(&self.pool, with, step).await;
        }
        if step.ends_child_of.is_some() {
            // Counted in its parent's fan-out in the commit's own transaction, never batched.
            return crate::wait::children::commit_end(&self.pool, &self.topology, step).await;
        }
        let relaxed = answers_flushed && !preclaimed && step.local_writes.is_empty();
        let (cell, pool) = if relaxed && only_advances(&step) {
            (&self.advances, &self.relaxed)
        } else {
            (&self.commits, &self.pool)
        };
        let batcher = self.batcher(cell, pool, |pool, batch| async move {
            checkpoint::commit_all(&pool, &batch).await
        });
        batcher.call(step).await
    }

    /// Gives the lease back without advancing (the step is retried from a delay queue after
    /// `delay`; `error` is why), and with it the claim's attempt when `give_back`.
    pub async fn release(
        &self,
        at: (&RunId, i32),
        fence: Fence,
        (delay, give_back): (std::time::Duration, bool),
        error: &str,
    ) -> store::Result<()> {
        let retry = (delay.as_secs_f64(), give_back);
        runs::release(&self.pool, at, fence, retry, error).await
    }

    async fn record(&self, record: Record) -> store::Result<bool> {
        let batcher = self.batcher(&self.records, &self.relaxed, |pool, batch| async move {
            records::write_all(&pool, &batch).await
        });
        batcher.call(record).await
    }

    async fn intend(&self, intent: EffectIntent) -> store::Result<IntentOutcome> {
        let batcher = self.batcher(&self.intents, &self.pool, |pool, batch| async move {
            effects::begin_all(&pool, &batch).await
        });
        batcher.call(intent).await
    }

    /// The batcher in `cell`, started on first use (inside the runtime that runs the steps).
    fn batcher<'a, Req, T, F, Fut>(
        &self,
        cell: &'a OnceLock<Batcher<Req, T>>,
        pool: &PgPool,
        run: F,
    ) -> &'a Batcher<Req, T>
    where
        Req: Send + 'static,
        T: Send + 'static,
        F: Fn(PgPool, Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<store::Result<T>>> + Send + 'static,
    {
        cell.get_or_init(|| {
            let pool = pool.clone();
            Batcher::start(self.max_batch, move |batch| run(pool.clone(), batch))
        })
    }
}

impl Records for StepTx {
    fn journaled<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
        call_no: i32,
    ) -> BoxFuture<'a, Result<Option<JournalEntry>, StepError>> {
        Box::pin(async move { Ok(journal::get(&self.pool, run, seq, call_no).await?) })
    }

    fn journal<'a>(
        &'a self,
        run: &'a RunId,
        entry: JournalEntry,
        reserved: Option<i64>,
    ) -> BoxFuture<'a, Result<bool, StepError>> {
        let record = Record::Journal(run.clone(), entry, reserved);
        Box::pin(async move { Ok(self.record(record).await?) })
    }

    // On the strict pool: a reservation a Postgres crash forgot would let the fleet call past
    // the limit. One statement, outside the group commit: reservations of one endpoint queue
    // for its lock one after another anyway.
    fn reserve_model<'a>(
        &'a self,
        ask: ModelAsk<'a>,
    ) -> BoxFuture<'a, Result<Admission, StepError>> {
        Box::pin(async move { Ok(model_usage::reserve(&self.pool, &ask).await?) })
    }

    fn model_call_failed(&self, reserved: i64) -> BoxFuture<'_, Result<(), StepError>> {
        Box::pin(async move { Ok(model_usage::failed(&self.relaxed, reserved).await?) })
    }

    fn shadow_write<'a>(
        &'a self,
        run: &'a RunId,
        write: ShadowWrite,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move { Ok(shadow::record(&self.pool, run.as_str(), &[write]).await?) })
    }

    fn spent<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Spent, StepError>> {
        Box::pin(async move { Ok(journal::totals(&self.pool, run.as_str()).await?) })
    }

    fn begin_effect(
        &self,
        intent: EffectIntent,
    ) -> BoxFuture<'_, Result<IntentOutcome, StepError>> {
        Box::pin(async move { Ok(self.intend(intent).await?) })
    }

    fn recorded_effect<'a>(
        &'a self,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<crate::workflow::RecordedEffect>, StepError>> {
        Box::pin(async move { Ok(effects::recorded(&self.pool, key.as_str()).await?) })
    }

    fn withdraw_effect<'a>(
        &'a self,
        key: &'a IdempotencyKey,
        run: &'a RunId,
        fence: Fence,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move {
            effects::withdraw(&self.pool, key.as_str(), run.as_str(), fence.0).await?;
            Ok(())
        })
    }

    fn finish_effect(
        &self,
        key: IdempotencyKey,
        result: Value,
    ) -> BoxFuture<'_, Result<(), StepError>> {
        Box::pin(async move {
            self.record(Record::EffectResult(key, result)).await?;
            Ok(())
        })
    }

    fn progress(&self, run: &RunId, seq: i32, line: String) {
        let lines = self.progress.get_or_init(|| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(write_progress(self.relaxed.clone(), rx));
            tx
        });
        let line = progress::NewLine {
            run_id: run.to_string(),
            seq,
            at: chrono::Utc::now(),
            line,
        };
        // Closed only when the process is stopping.
        let _ = lines.send(line);
    }

    fn breaker_changed<'a>(
        &'a self,
        tool: &'a str,
        opened: bool,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move {
            let event = self.topology.event_message(&Event::breaker(tool, opened));
            outbox::insert(&self.pool, &[event]).await?;
            Ok(())
        })
    }

    fn received_event<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
    ) -> BoxFuture<'a, Result<Option<crate::workflow::ReceivedEvent>, StepError>> {
        Box::pin(async move {
            let found = store::waits::received_event(&self.pool, run.as_str(), seq).await?;
            Ok(found.map(|(id, name, key, payload, at)| {
                crate::workflow::ReceivedEvent::new(id, name, key, payload, at)
            }))
        })
    }

    fn children_summary<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
    ) -> BoxFuture<'a, Result<Option<crate::domain::ChildrenSummary>, StepError>> {
        Box::pin(async move { Ok(store::children::summary(&self.pool, run.as_str(), seq).await?) })
    }

    fn children_page<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
        (from, limit): (i32, i64),
    ) -> BoxFuture<'a, Result<Vec<crate::domain::ChildResult>, StepError>> {
        Box::pin(async move {
            Ok(store::children::page(&self.pool, (run.as_str(), seq), from, limit).await?)
        })
    }

    fn output_of<'a>(
        &'a self,
        run: &'a RunId,
        step: &'a str,
        before: i32,
    ) -> BoxFuture<'a, Result<Option<Value>, StepError>> {
        Box::pin(async move { Ok(steps::latest_output(&self.pool, run, step, before).await?) })
    }
}

/// Whether a commit only moves a running or compensating run on to its next step: its one
/// outbox row is the next step's message (no `ctx.send` messages, no run event).
/// Whether a commit may claim the run's next position for its committer
/// (`checkpoint::PreClaim`): a running run moved on to its next step, whose one message this
/// worker publishes itself, so the delivery is likely to come back here soon.
pub(super) fn preclaimable(step: &StepCommit, eager: bool) -> bool {
    use crate::domain::RunStatus::Running;
    let status = step.to.status;
    eager && only_advances(step) && status.from == Running && status.to == Running
}

fn only_advances(step: &StepCommit) -> bool {
    use crate::domain::RunStatus::{Compensating, Running};
    let status = step.to.status;
    status.from == status.to
        && matches!(status.to, Running | Compensating)
        && step.to.next_step.is_some()
        && step.finished
        && step.outbox.len() == 1
}

/// Most progress lines in one statement.
const PROGRESS_BATCH: usize = 500;

/// Writes progress lines as they come, a batch per statement: whatever queued while the
/// previous batch was written.
async fn write_progress(
    pool: PgPool,
    mut lines: tokio::sync::mpsc::UnboundedReceiver<progress::NewLine>,
) {
    let mut batch = Vec::new();
    while lines.recv_many(&mut batch, PROGRESS_BATCH).await > 0 {
        let written = match pool.acquire().await {
            Ok(mut conn) => progress::record(&mut conn, &batch).await,
            Err(e) => Err(e.into()),
        };
        if let Err(e) = written {
            tracing::warn!(error = %crate::error::Report(&e), lines = batch.len(), "progress lines were not recorded");
        }
        batch.clear();
    }
}

/// How a store failure reaches a step handler: a stale fence voids the step's work, a reused
/// key is a conflict a person must look at, anything else is trailmark's own infrastructure
/// (the delivery is retried as a whole).
impl From<store::Error> for StepError {
    fn from(e: store::Error) -> Self {
        match e {
            store::Error::FencedOut { .. } => Self::FencedOut,
            store::Error::Conflict { .. } | store::Error::LocalWrite { .. } => {
                Self::Conflict(e.to_string())
            }
            e => Self::Infrastructure(crate::error::Report(&e).to_string()),
        }
    }
}

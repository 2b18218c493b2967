//! What a step handler can do: read earlier outputs, ask the model (journaled, see
//! `model_call.rs`), make keyed outside writes (effects, see `effect.rs`), queue outside
//! messages, and park items — each recorded so that a replayed step repeats nothing.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI32;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;
use sqlx::PgPool;

use super::StepError;
use crate::batch::Batcher;
use crate::config::Settings;
use crate::domain::{Fence, IdempotencyKey, MessageId, RunId, StepAddress};
use crate::failpoint::Failpoints;
use crate::guard::{Breakers, Budget};
use crate::model::ModelClient;
use crate::store;
use crate::store::outbox::OutgoingMessage;
use crate::store::records::{self, Record};
use crate::store::{checkpoint, effects, runs};

/// The header that carries an outside message's idempotency key (see [`StepContext::send`]), for
/// receivers to recognise a rare repeat.
pub const IDEMPOTENCY_KEY_HEADER: &str = "x-idempotency-key";

/// Shared by every step execution in a process.
pub(crate) struct Services {
    pub pool: PgPool,
    /// [`crate::store::relaxed_pool`] of `pool`: journal entries and effect results.
    pub relaxed: PgPool,
    pub model: Option<ModelClient>,
    pub fallback_model: Option<ModelClient>,
    pub failpoints: Failpoints,
    pub breakers: Breakers,
    pub settings: Settings,
    /// Size of the recorded stand-in answer when no model is configured.
    pub standin_answer_bytes: usize,
    /// Group commit of journal entries and effect results (relaxed pool).
    pub records: OnceLock<Batcher<Record, bool>>,
    /// Group commit of effect intents (strict pool: an intent is durable before its call).
    pub intents: OnceLock<Batcher<effects::Intent, effects::Begun>>,
    /// Group commit of the worker's lease claims.
    pub claims: OnceLock<Batcher<runs::ClaimRequest, runs::ClaimOutcome>>,
    /// Group commit of the worker's step commits.
    pub commits: OnceLock<Batcher<checkpoint::StepCommit, bool>>,
}

impl Services {
    /// Writes a journal entry or an effect result at once, in one statement with whatever other
    /// steps of this process are writing at the same moment.
    pub async fn record(&self, record: Record) -> store::Result<bool> {
        let batcher = self.batcher(&self.records, &self.relaxed, |pool, batch| async move {
            records::write_all(&pool, &batch).await
        });
        batcher.call(record).await
    }

    /// Records an effect intent, in one statement with the other steps' intents of the moment.
    pub async fn begin_effect(&self, intent: effects::Intent) -> store::Result<effects::Begun> {
        let batcher = self.batcher(&self.intents, &self.pool, |pool, batch| async move {
            effects::begin_all(&pool, &batch).await
        });
        batcher.call(intent).await
    }

    /// Claims a run's lease for a step delivery, with the other deliveries' claims of the moment.
    pub async fn claim(&self, request: runs::ClaimRequest) -> store::Result<runs::ClaimOutcome> {
        let batcher = self.batcher(&self.claims, &self.pool, |pool, batch| async move {
            runs::claim_all(&pool, &batch).await
        });
        batcher.call(request).await
    }

    /// Commits a step, with the other steps' commits of the moment.
    pub async fn commit(&self, step: checkpoint::StepCommit) -> store::Result<bool> {
        let batcher = self.batcher(&self.commits, &self.pool, |pool, batch| async move {
            checkpoint::commit_all(&pool, &batch).await
        });
        batcher.call(step).await
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
        Fut: std::future::Future<Output = Vec<store::Result<T>>> + Send + 'static,
    {
        cell.get_or_init(|| {
            let pool = pool.clone();
            Batcher::start(self.settings.worker.max_batch, move |batch| {
                run(pool.clone(), batch)
            })
        })
    }
}

/// An item set aside with a reason (permanent error for that item).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Parked {
    /// The item's stable id (e.g. an invoice number).
    pub item: String,
    /// Why it could not be processed.
    pub reason: String,
}

/// The step a compensation undoes, with its checkpointed output and the undo's scope.
#[derive(Debug, Clone)]
pub struct UndoTarget {
    /// The original step's name.
    pub step: String,
    /// Its position in the run.
    pub seq: i32,
    /// Its checkpointed output (what it did).
    pub output: Value,
    /// The operator's scope (`{}` for a full undo), e.g. `{"supplier": "S-07"}`.
    pub scope: Value,
}

/// Where a step execution is: who, which position, under which fence.
pub(crate) struct Position {
    pub run_id: RunId,
    pub workflow: String,
    pub step: StepAddress,
    pub seq: i32,
    pub attempt: i32,
    /// Journal entries recorded at this position before this attempt.
    pub journaled: i32,
    pub fence: Fence,
    pub input: Value,
    pub budget: Budget,
    pub undo: Option<UndoTarget>,
}

/// The handle a step handler works through. Cheap to clone.
#[derive(Clone)]
pub struct StepContext {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub pos: Position,
    pub calls: AtomicI32,
    pub outgoing: Mutex<Vec<OutgoingMessage>>,
    pub parked: Mutex<Vec<Parked>>,
    pub services: Arc<Services>,
}

impl StepContext {
    pub(crate) fn new(services: Arc<Services>, pos: Position) -> Self {
        let inner = Inner {
            pos,
            calls: AtomicI32::new(0),
            outgoing: Mutex::new(Vec::new()),
            parked: Mutex::new(Vec::new()),
            services,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        &self.inner.pos.run_id
    }
    /// The workflow name.
    pub fn workflow(&self) -> &str {
        &self.inner.pos.workflow
    }
    /// This step's address: its declared name, or `undo:<step>@<seq>` for a compensation.
    pub fn step(&self) -> &str {
        self.inner.pos.step.as_str()
    }
    /// This step's position in the run (0-based).
    pub fn seq(&self) -> i32 {
        self.inner.pos.seq
    }
    /// Which attempt at this position this is (1-based, counted across crashes).
    pub fn attempt(&self) -> i32 {
        self.inner.pos.attempt
    }
    /// The lease's fencing token; pass it to stores that refuse stale writers.
    pub fn fence(&self) -> Fence {
        self.inner.pos.fence
    }
    /// The run's input.
    pub fn input(&self) -> &Value {
        &self.inner.pos.input
    }
    /// For a compensation: the step being undone and the undo's scope.
    pub fn undo(&self) -> Option<&UndoTarget> {
        self.inner.pos.undo.as_ref()
    }
    /// Trailmark's database, for handlers of built-in workflows.
    pub fn pool(&self) -> &PgPool {
        &self.inner.services.pool
    }
    pub(super) fn services(&self) -> &Services {
        &self.inner.services
    }

    /// The newest checkpointed output of `step` earlier in this run.
    pub async fn output_of(&self, step: &str) -> Result<Option<Value>, StepError> {
        Ok(store::steps::latest_output(self.pool(), self.run_id(), step, self.seq()).await?)
    }

    /// Triggers the named failpoint (tests and drills; a no-op unless configured).
    pub fn failpoint(&self, name: &str) -> Result<(), StepError> {
        self.services()
            .failpoints
            .hit(name)
            .map_err(|e| StepError::Infrastructure(e.to_string()))
    }

    /// Sets one item aside with its reason (a permanent error for that item only); the step goes
    /// on with the others. Parked items are committed with the step and listed by `run show`.
    pub fn park(&self, item: impl Into<String>, reason: impl Into<String>) {
        let parked = Parked {
            item: item.into(),
            reason: reason.into(),
        };
        tracing::warn!(item = %parked.item, reason = %parked.reason, "item parked");
        self.inner.parked.lock().expect("parked lock").push(parked);
    }

    /// Queues an outside message (an email request, a notification) under an idempotency key.
    /// It is committed to the outbox with this step's checkpoint and published by the relay: sent
    /// if and only if the step commits. Delivery is at-least-once, so the key travels in the
    /// `x-idempotency-key` header for the receiver to recognise a rare repeat.
    pub fn send(&self, exchange: &str, routing_key: &str, key: &IdempotencyKey, body: Vec<u8>) {
        let headers = BTreeMap::from([
            (IDEMPOTENCY_KEY_HEADER.to_owned(), key.to_string()),
            ("x-trailmark-run-id".to_owned(), self.run_id().to_string()),
            ("x-trailmark-step".to_owned(), self.step().to_owned()),
        ]);
        let msg = OutgoingMessage {
            message_id: MessageId::new(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            headers,
            body,
            relay_after_ms: 0,
            holder_pid: None,
        };
        self.inner.outgoing.lock().expect("outgoing lock").push(msg);
    }

    /// What the step queued with [`StepContext::send`] and [`StepContext::park`], for its commit.
    pub(crate) fn take_pending(&self) -> (Vec<OutgoingMessage>, Vec<Parked>) {
        let sent = std::mem::take(&mut *self.inner.outgoing.lock().expect("outgoing lock"));
        let parked = std::mem::take(&mut *self.inner.parked.lock().expect("parked lock"));
        (sent, parked)
    }
}

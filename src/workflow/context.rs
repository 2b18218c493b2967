//! What a step handler can do: read earlier outputs, ask the model (journaled, see
//! `model_call.rs`), make keyed outside writes (effects, see `effect.rs`), write rows of
//! trailmark's own database with the step's commit (local writes), queue outside messages, and
//! park items — each recorded so that a replayed step repeats nothing.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI32;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::PgPool;

use super::StepError;
use super::host::Tools;
use crate::domain::{
    Fence, IdempotencyKey, LocalTable, LocalWrite, MessageId, OutgoingMessage, RunId, StepAddress,
};
use crate::guard::Budget;

/// The header that carries an outside message's idempotency key (see [`StepContext::send`]), for
/// receivers to recognise a rare repeat.
pub const IDEMPOTENCY_KEY_HEADER: &str = "x-idempotency-key";

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
    /// The workflow version the run is pinned to.
    pub version: i32,
    pub step: StepAddress,
    pub seq: i32,
    pub attempt: i32,
    /// Journal entries recorded at this position before this attempt.
    pub journaled: i32,
    pub fence: Fence,
    pub input: Value,
    pub budget: Budget,
    pub undo: Option<UndoTarget>,
    /// A shadow fork's step: outside writes are recorded, never made.
    pub shadow: bool,
    /// This attempt's span: model calls and outside writes are its children.
    pub span: crate::trace::StepSpan,
}

/// The most children [`StepContext::children`] reads at once.
pub const MAX_CHILDREN_PAGE: usize = 1000;

/// The handle a step handler works through. Cheap to clone.
#[derive(Clone)]
pub struct StepContext {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub pos: Position,
    pub calls: AtomicI32,
    /// Tokens and cost of the answers this attempt paid for (replays cost nothing).
    pub paid: Mutex<(i64, f64)>,
    /// Whether this attempt journaled a model answer that no synchronous commit of its own has
    /// flushed since (a new effect intent flushes it): the step's ending may rest on it.
    pub unflushed_answer: std::sync::atomic::AtomicBool,
    /// Whether this attempt made a call to an outside system (past its breaker): a step that
    /// did spends its attempt, even if another of its calls then met an open breaker.
    pub called_out: std::sync::atomic::AtomicBool,
    /// Whether a call of this attempt (a model request or a tool call) failed: a wait for a
    /// model's rate limit then spends the attempt (`StepContext::counted_wait`).
    pub call_failed: std::sync::atomic::AtomicBool,
    /// Model answers and outside-write results this attempt read back from the journal instead
    /// of asking or calling again (counted on the step's span).
    pub replayed: (AtomicI32, AtomicI32),
    pub outgoing: Mutex<Vec<OutgoingMessage>>,
    pub parked: Mutex<Vec<Parked>>,
    pub local_writes: Mutex<Vec<LocalWrite>>,
    pub tools: Arc<Tools>,
}

/// What a step queued for its commit: outside messages, parked items and local writes.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// Messages queued with [`StepContext::send`].
    pub sent: Vec<OutgoingMessage>,
    /// Items set aside with [`StepContext::park`].
    pub parked: Vec<Parked>,
    /// Rows staged with [`StepContext::local_write`].
    pub writes: Vec<LocalWrite>,
}

impl StepContext {
    pub(crate) fn new(tools: Arc<Tools>, pos: Position) -> Self {
        let inner = Inner {
            pos,
            calls: AtomicI32::new(0),
            paid: Mutex::new((0, 0.0)),
            unflushed_answer: std::sync::atomic::AtomicBool::new(false),
            called_out: std::sync::atomic::AtomicBool::new(false),
            call_failed: std::sync::atomic::AtomicBool::new(false),
            replayed: (AtomicI32::new(0), AtomicI32::new(0)),
            outgoing: Mutex::new(Vec::new()),
            parked: Mutex::new(Vec::new()),
            local_writes: Mutex::new(Vec::new()),
            tools,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Whether this attempt called an outside system past its breaker.
    pub(crate) fn called_out(&self) -> bool {
        self.inner
            .called_out
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A wait that spends no attempt, as a temporary failure that spends one when the attempt
    /// did something that must count, so that failures hidden behind such waits still reach
    /// `worker.max_attempts`:
    /// - an open breaker, after the attempt called out (another of its calls met the open
    ///   breaker): a step whose concurrent calls keep failing would never reach its cap;
    /// - a model's rate limit, after one of the attempt's calls failed. Not after a call that
    ///   was answered: its answer is journaled and replayed free, and a full window is the
    ///   normal state of a busy fleet, so a step of many model calls must not run out of
    ///   attempts while it waits for room between them.
    pub(crate) fn counted_wait(&self, e: StepError) -> StepError {
        use std::sync::atomic::Ordering::Relaxed;
        let counts = match &e {
            StepError::BreakerOpen { .. } => self.called_out(),
            StepError::Throttled { .. } => self.inner.call_failed.load(Relaxed),
            _ => false,
        };
        match e.uncounted_wait() {
            Some(wait) if counts => StepError::Temporary {
                reason: e.to_string(),
                retry_after: matches!(e, StepError::Throttled { .. }).then_some(wait),
            },
            _ => e,
        }
    }

    /// Notes that a call of this attempt failed (see [`Self::counted_wait`]).
    pub(crate) fn note_failed_call(&self) {
        (self.inner.call_failed).store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether every model answer this attempt journaled was flushed by a later synchronous
    /// commit of its own (a new effect intent): only then may its advance commit skip its own
    /// flush, since a lost answer asked again could choose another ending.
    pub(crate) fn answers_flushed(&self) -> bool {
        !self
            .inner
            .unflushed_answer
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        &self.inner.pos.run_id
    }
    /// The workflow name.
    pub fn workflow(&self) -> &str {
        &self.inner.pos.workflow
    }
    /// The workflow version the run started on and stays on.
    pub fn version(&self) -> i32 {
        self.inner.pos.version
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
    /// The lease's fencing token, for the project's own stand-in stores that refuse stale
    /// writers; a workflow's outside writes rest on their idempotency keys instead.
    #[cfg(feature = "testkit")]
    pub fn fence(&self) -> Fence {
        self.lease_fence()
    }

    /// The fence this attempt holds, for the engine's own fenced writes.
    pub(crate) fn lease_fence(&self) -> Fence {
        self.inner.pos.fence
    }

    /// What the journal holds for this position (earlier attempts' answers and choices), in
    /// call order: told to a step served by an endpoint. A first attempt reads nothing.
    pub(crate) async fn journaled_here(&self) -> Result<Vec<crate::domain::JournalEntry>, StepError> {
        let mut entries = Vec::new();
        for call_no in 0..self.inner.pos.journaled {
            let records = &self.tools().records;
            if let Some(entry) = records.journaled(self.run_id(), self.seq(), call_no).await? {
                entries.push(entry);
            }
        }
        Ok(entries)
    }
    /// The run's input as JSON.
    pub fn input(&self) -> &Value {
        &self.inner.pos.input
    }

    /// The run's input as the workflow's own type (declare it with [`Workflow::input`] so a
    /// start with another shape is refused before the run exists). An input that does not read
    /// as `T` stops the run for review, naming the type and what did not fit.
    ///
    /// [`Workflow::input`]: super::Workflow::input
    pub fn input_as<T: DeserializeOwned>(&self) -> Result<T, StepError> {
        self.read_as("the run's input", self.input().clone())
    }

    /// The newest checkpointed output of `step` earlier in this run, as the type that step
    /// returned; `None` when it has none.
    pub async fn output_as<T: DeserializeOwned>(&self, step: &str) -> Result<Option<T>, StepError> {
        match self.output_of(step).await? {
            Some(output) => self.read_as(&format!("the output of step {step}"), output).map(Some),
            None => Ok(None),
        }
    }

    fn read_as<T: DeserializeOwned>(&self, what: &str, value: Value) -> Result<T, StepError> {
        serde_json::from_value(value).map_err(|e| {
            StepError::Unknown(format!(
                "run {} step {} (position {}): {what} does not read as {}: {e}; fix the workflow's types and resume after the fix",
                self.run_id(),
                self.step(),
                self.seq(),
                std::any::type_name::<T>()
            ))
        })
    }
    /// The event that resumed the run before this step: the previous step ended by waiting for
    /// it ([`super::StepOutcome::wait_for_event`]). `None` when the previous step did not wait
    /// for an event, or its wait timed out. A replay of this step reads the same event.
    pub async fn event(&self) -> Result<Option<super::ReceivedEvent>, StepError> {
        let Some(before) = self.seq().checked_sub(1) else {
            return Ok(None);
        };
        (self.inner.tools.records)
            .received_event(self.run_id(), before)
            .await
    }
    /// How the children started by the previous step stand (it ended with
    /// [`super::StepOutcome::start_children`]); `None` when it started none.
    pub async fn children_summary(&self) -> Result<Option<super::ChildrenSummary>, StepError> {
        let Some(before) = self.seq().checked_sub(1) else {
            return Ok(None);
        };
        (self.inner.tools.records)
            .children_summary(self.run_id(), before)
            .await
    }
    /// Up to `limit` (at most [`MAX_CHILDREN_PAGE`]) children started by the previous step, from
    /// index `from`, each with its state and, once it succeeded, its output. Read from the
    /// database when asked, page by page, so a large fan-out never travels in one message.
    pub async fn children(
        &self,
        from: usize,
        limit: usize,
    ) -> Result<Vec<super::ChildResult>, StepError> {
        let Some(before) = self.seq().checked_sub(1) else {
            return Ok(Vec::new());
        };
        let page = (from.min(i32::MAX as usize) as i32, limit.min(MAX_CHILDREN_PAGE) as i64);
        (self.inner.tools.records)
            .children_page(self.run_id(), before, page)
            .await
    }
    /// For a compensation: the step being undone and the undo's scope.
    pub fn undo(&self) -> Option<&UndoTarget> {
        self.inner.pos.undo.as_ref()
    }
    /// Whether this run is a shadow fork: `effect` and `send` record what they would do and do
    /// nothing. A handler that writes outside by other means must ask this and refrain.
    pub fn is_shadow(&self) -> bool {
        self.inner.pos.shadow
    }
    /// Trailmark's database, for the project's own workflows and tests; a workflow writes its
    /// rows with the step's commit through [`StepContext::local_write`].
    #[cfg(feature = "testkit")]
    pub fn pool(&self) -> &PgPool {
        &self.inner.tools.pool
    }
    pub(super) fn tools(&self) -> &Tools {
        &self.inner.tools
    }

    /// The newest checkpointed output of `step` earlier in this run.
    pub async fn output_of(&self, step: &str) -> Result<Option<Value>, StepError> {
        self.tools()
            .records
            .output_of(self.run_id(), step, self.seq())
            .await
    }

    /// Triggers the named failpoint (tests and drills; a no-op unless configured).
    #[cfg(feature = "testkit")]
    pub fn failpoint(&self, name: &str) -> Result<(), StepError> {
        self.fire_failpoint(name)
    }

    /// The engine's own failpoints (after an answer, after a call): free unless configured.
    pub(super) fn fire_failpoint(&self, name: &str) -> Result<(), StepError> {
        self.tools()
            .failpoints
            .hit(name)
            .map_err(|e| StepError::Infrastructure(e.to_string()))
    }

    /// Fails this attempt when a drill switched `seam` on for this position (a no-op otherwise).
    pub(super) fn drill_seam(&self, seam: crate::seams::Seam) -> Result<(), StepError> {
        let Some(seams) = self.tools().failpoints.seams() else {
            return Ok(());
        };
        if !seams.fires(seam, self.run_id(), self.seq(), self.attempt()) {
            return Ok(());
        }
        let what = format!(
            "{} at run {} step {} (position {}), attempt {}",
            seam.marker(),
            self.run_id(),
            self.step(),
            self.seq(),
            self.attempt()
        );
        Err(match seam {
            crate::seams::Seam::Model500 => {
                StepError::temporary(format!("{what}: the model answered 500"))
            }
            crate::seams::Seam::LateTool => StepError::temporary(format!(
                "{what}: the tool answered after the client timeout"
            )),
            crate::seams::Seam::Review => {
                StepError::Unknown(format!("{what}: forced into review by the drill"))
            }
        })
    }

    /// Appends a line to the drill's call log, when a drill is logging.
    /// `line` is only built when a drill is logging: no clock read or formatting otherwise.
    pub(super) fn drill_log(&self, line: impl FnOnce() -> String) {
        if let Some(seams) = self.tools().failpoints.seams() {
            seams.log(format_args!("{}", line()));
        }
    }

    /// Says what the step is doing, for the people waiting on the run ("retrieving sources…"):
    /// kept with the run (its last lines, with the time) and shown by `trailmark run show`,
    /// `run watch` and the API. Cheap: written in batches off the step's path.
    pub fn progress(&self, line: impl Into<String>) {
        let tools = self.tools();
        tools
            .records
            .progress(self.run_id(), self.seq(), line.into());
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

    /// Writes `row` into `table`, a table of trailmark's own database, with this step's commit:
    /// in the same statement as the checkpoint, so the row exists if and only if the step
    /// committed, once. The table's key column is the idempotency key: a row already standing
    /// under the key with the same values is left as it is (a repeat), one with other values is
    /// a conflict that stops the run for review naming the key. Nothing is written before the
    /// handler returns, so the write has no result to read back; in a shadow run it is recorded,
    /// never made. For a store of another system, use [`StepContext::effect`].
    ///
    /// A row that does not fit the declaration (a missing or undeclared column, a null key) is
    /// refused at once with what is wrong.
    ///
    /// ```no_run
    /// # use serde_json::json;
    /// # use trailmark::domain::LocalTable;
    /// # use trailmark::workflow::{StepContext, StepError, StepOutcome};
    /// static INVOICES: LocalTable =
    ///     LocalTable::new("app.invoices", "invoice_no", &["invoice_no", "amount", "run_id"]);
    ///
    /// async fn book(ctx: StepContext) -> Result<StepOutcome, StepError> {
    ///     let row = json!({ "invoice_no": "INV-7", "amount": 120, "run_id": ctx.run_id() });
    ///     ctx.local_write(&INVOICES, row)?;
    ///     Ok(StepOutcome::finish(json!({ "booked": "INV-7" })))
    /// }
    /// ```
    pub fn local_write(&self, table: &'static LocalTable, row: Value) -> Result<(), StepError> {
        let write = table.row(row).map_err(|e| {
            StepError::Unknown(format!(
                "run {} step {} (position {}): {e}",
                self.run_id(),
                self.step(),
                self.seq()
            ))
        })?;
        let mut writes = self.inner.local_writes.lock().expect("local writes lock");
        writes.push(write);
        Ok(())
    }

    /// Tokens and cost of the model answers this attempt paid for.
    pub(crate) fn paid(&self) -> (i64, f64) {
        *self.inner.paid.lock().expect("paid lock")
    }

    /// This attempt's span (model calls and outside writes start children of it).
    pub(super) fn span(&self) -> &crate::trace::StepSpan {
        &self.inner.pos.span
    }

    /// Puts what the handler paid and what it read back from the journal on the step's span:
    /// a replayed answer or result makes no span of its own.
    pub(crate) fn trace_totals(&self) {
        let span = self.span();
        if !span.is_recording() {
            return;
        }
        use opentelemetry::KeyValue;
        let (tokens, cost) = self.paid();
        let answers = self.inner.replayed.0.load(std::sync::atomic::Ordering::Relaxed);
        let results = self.inner.replayed.1.load(std::sync::atomic::Ordering::Relaxed);
        span.set(KeyValue::new("trailmark.model.tokens", tokens));
        span.set(KeyValue::new("trailmark.model.cost", cost));
        span.set(KeyValue::new("trailmark.model.journaled_answers", i64::from(answers)));
        span.set(KeyValue::new("trailmark.effect.journaled_results", i64::from(results)));
    }

    /// Counts a model answer (`answer`) or an outside write's result read from the journal.
    pub(super) fn count_replayed(&self, answer: bool) {
        let counter = if answer { &self.inner.replayed.0 } else { &self.inner.replayed.1 };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// What the step queued for its commit with [`StepContext::send`], [`StepContext::park`]
    /// and [`StepContext::local_write`].
    pub(crate) fn take_pending(&self) -> Pending {
        Pending {
            sent: take(&self.inner.outgoing),
            parked: take(&self.inner.parked),
            writes: take(&self.inner.local_writes),
        }
    }
}

fn take<T>(queued: &Mutex<Vec<T>>) -> Vec<T> {
    std::mem::take(&mut *queued.lock().expect("pending lock"))
}

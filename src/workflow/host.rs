//! What a step context reaches outside its handler, as the engine hands it over: the records it
//! writes and reads (a port the worker's step transaction implements), the model, and the
//! process's failpoints and circuit breakers. The workflow API depends on this port only, never
//! on the store or the group-commit plumbing behind it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::Value;
use sqlx::PgPool;

use super::StepError;
use crate::domain::{
    Admission, EffectIntent, IdempotencyKey, IntentOutcome, JournalEntry, ModelAsk, RunId,
    ShadowWrite, Spent,
};
use crate::failpoint::Failpoints;
use crate::guard::Breakers;
use crate::model::ModelClient;

/// A boxed future, for the methods of [`Records`] (a trait object's methods cannot be `async`).
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What is recorded under an effect's key: its request hash, and its result once known.
pub(crate) type RecordedEffect = (String, Option<Value>);

/// The durable records of a step, each written the moment it is known.
pub(crate) trait Records: Send + Sync {
    /// The journaled answer of call `call_no` at position `seq`, if any.
    fn journaled<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
        call_no: i32,
    ) -> BoxFuture<'a, Result<Option<JournalEntry>, StepError>>;

    /// Journals an answer at once, and with it the real usage of the call's reservation at a
    /// limited endpoint (`reserved`); `false`: another worker journaled this call first.
    fn journal<'a>(
        &'a self,
        run: &'a RunId,
        entry: JournalEntry,
        reserved: Option<i64>,
    ) -> BoxFuture<'a, Result<bool, StepError>>;

    /// Reserves a model call's place in its endpoint's last minute, across the fleet, when the
    /// endpoint's limits leave room for it.
    fn reserve_model<'a>(
        &'a self,
        ask: ModelAsk<'a>,
    ) -> BoxFuture<'a, Result<Admission, StepError>>;

    /// The call reserved as `reserved` failed: it counts at its estimate from now.
    fn model_call_failed(&self, reserved: i64) -> BoxFuture<'_, Result<(), StepError>>;

    /// What the run has spent on models.
    fn spent<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Spent, StepError>>;

    /// Records an effect's intent (only under the current fence and within the run's limits),
    /// or reports what an earlier attempt left.
    fn begin_effect(&self, intent: EffectIntent)
    -> BoxFuture<'_, Result<IntentOutcome, StepError>>;

    /// The request hash and result (if known) of the effect recorded under `key`, if any;
    /// records nothing.
    fn recorded_effect<'a>(
        &'a self,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<RecordedEffect>, StepError>>;

    /// Removes the intent `run` recorded under `key` with `fence` while it has no result: its
    /// call was refused before it was made.
    fn withdraw_effect<'a>(
        &'a self,
        key: &'a IdempotencyKey,
        run: &'a RunId,
        fence: crate::domain::Fence,
    ) -> BoxFuture<'a, Result<(), StepError>>;

    /// Records an effect's result.
    fn finish_effect(
        &self,
        key: IdempotencyKey,
        result: Value,
    ) -> BoxFuture<'_, Result<(), StepError>>;

    /// Keeps a progress line of the run, said at position `seq`; written in batches off the
    /// step's path (a line lost to a crash is only a line).
    fn progress(&self, run: &RunId, seq: i32, line: String);

    /// Publishes, through the outbox, that `tool`'s circuit breaker opened (`true`) or closed.
    fn breaker_changed<'a>(
        &'a self,
        tool: &'a str,
        opened: bool,
    ) -> BoxFuture<'a, Result<(), StepError>>;

    /// Records what a shadow run would have written outside (an effect or a message), instead
    /// of writing it.
    fn shadow_write<'a>(
        &'a self,
        run: &'a RunId,
        write: ShadowWrite,
    ) -> BoxFuture<'a, Result<(), StepError>>;

    /// The event that resumed the run after the wait at position `seq`, if one did.
    fn received_event<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
    ) -> BoxFuture<'a, Result<Option<super::ReceivedEvent>, StepError>>;

    /// How the children started by the step at position `seq` stand, if it started any.
    fn children_summary<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
    ) -> BoxFuture<'a, Result<Option<crate::domain::ChildrenSummary>, StepError>>;

    /// Up to `limit` children started by the step at `seq`, from index `from`.
    fn children_page<'a>(
        &'a self,
        run: &'a RunId,
        seq: i32,
        page: (i32, i64),
    ) -> BoxFuture<'a, Result<Vec<crate::domain::ChildResult>, StepError>>;

    /// The newest committed output of `step` before position `before`.
    fn output_of<'a>(
        &'a self,
        run: &'a RunId,
        step: &'a str,
        before: i32,
    ) -> BoxFuture<'a, Result<Option<Value>, StepError>>;
}

/// Where model calls go: an OpenAI-compatible endpoint (with an optional fallback model), or
/// the offline answer when none is configured.
pub(crate) struct Models {
    /// The configured model, if any.
    pub primary: Option<ModelClient>,
    /// The model to ask when the primary keeps failing.
    pub fallback: Option<ModelClient>,
    /// Size of the offline answer recorded when no model is configured.
    pub offline_bytes: usize,
}

/// Everything a step context uses besides its position; one per process, shared by every step.
pub(crate) struct Tools {
    /// Trailmark's database, lent to built-in workflows' handlers (`StepContext::pool`).
    pub pool: PgPool,
    /// The step's records.
    pub records: Arc<dyn Records>,
    /// The model.
    pub models: Models,
    /// Failpoints (empty unless configured).
    pub failpoints: Failpoints,
    /// Circuit breakers per tool.
    pub breakers: Breakers,
    /// In-process retries of a temporary failure, per call (`worker.call_retries`).
    pub call_retries: usize,
    /// Identical tool requests per run before it counts as a loop (`guards.repeat_limit`).
    pub repeat_limit: u64,
    /// The model endpoints this process last found at their limits.
    pub full_endpoints: super::model_limit::FullEndpoints,
}

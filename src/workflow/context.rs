//! What a step handler can do: read earlier outputs, ask the model (journaled), and make keyed
//! outside writes (effects) — each recorded so that a replayed step repeats nothing.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use serde_json::Value;
use sqlx::PgPool;

use super::StepError;
use crate::domain::MessageId;
use crate::domain::{Fence, IdempotencyKey, RunId};
use crate::failpoint::Failpoints;
use crate::model::{self, ChatAnswer, ChatRequest, ModelClient};
use crate::store::outbox::OutgoingMessage;
use crate::store::{self, effects, journal};

/// Shared by every step execution in a process.
pub(crate) struct Services {
    pub pool: PgPool,
    pub model: Option<ModelClient>,
    pub failpoints: Failpoints,
    /// Size of the recorded stand-in answer when no model is configured.
    pub standin_answer_bytes: usize,
}

/// The handle a step handler works through. Cheap to clone.
#[derive(Clone)]
pub struct StepContext {
    inner: Arc<Inner>,
}

struct Inner {
    run_id: RunId,
    workflow: String,
    step: String,
    seq: i32,
    attempt: i32,
    fence: Fence,
    input: Value,
    calls: AtomicI32,
    outgoing: Mutex<Vec<OutgoingMessage>>,
    services: Arc<Services>,
}

/// The in-process retry policy for temporary model failures (then the step is retried later).
const MODEL_RETRIES: usize = 3;

impl StepContext {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        services: Arc<Services>,
        run_id: RunId,
        workflow: &str,
        step: &str,
        seq: i32,
        attempt: i32,
        fence: Fence,
        input: Value,
    ) -> Self {
        let inner = Inner {
            run_id,
            workflow: workflow.to_owned(),
            step: step.to_owned(),
            seq,
            attempt,
            fence,
            input,
            calls: AtomicI32::new(0),
            outgoing: Mutex::new(Vec::new()),
            services,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        &self.inner.run_id
    }
    /// The workflow name.
    pub fn workflow(&self) -> &str {
        &self.inner.workflow
    }
    /// This step's name.
    pub fn step(&self) -> &str {
        &self.inner.step
    }
    /// This step's position in the run (0-based).
    pub fn seq(&self) -> i32 {
        self.inner.seq
    }
    /// Which attempt at this position this is (1-based, counted across crashes).
    pub fn attempt(&self) -> i32 {
        self.inner.attempt
    }
    /// The lease's fencing token; pass it to stores that refuse stale writers.
    pub fn fence(&self) -> Fence {
        self.inner.fence
    }
    /// The run's input.
    pub fn input(&self) -> &Value {
        &self.inner.input
    }
    /// Trailmark's database, for handlers of built-in workflows.
    pub fn pool(&self) -> &PgPool {
        &self.inner.services.pool
    }

    /// The newest checkpointed output of `step` earlier in this run.
    pub async fn output_of(&self, step: &str) -> Result<Option<Value>, StepError> {
        Ok(store::steps::latest_output(self.pool(), self.run_id(), step, self.seq()).await?)
    }

    /// Queues an outside message (an email request, a notification) under an idempotency key.
    /// It is committed to the outbox with this step's checkpoint and published by the relay: sent
    /// if and only if the step commits. Delivery is at-least-once, so the key travels in the
    /// `x-idempotency-key` header for the receiver to recognise a rare repeat.
    pub fn send(&self, exchange: &str, routing_key: &str, key: &IdempotencyKey, body: Vec<u8>) {
        let headers = BTreeMap::from([
            ("x-idempotency-key".to_owned(), key.to_string()),
            ("x-trailmark-run-id".to_owned(), self.run_id().to_string()),
            ("x-trailmark-step".to_owned(), self.step().to_owned()),
        ]);
        let msg = OutgoingMessage {
            message_id: MessageId::new(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            headers,
            body,
        };
        self.inner.outgoing.lock().expect("outgoing lock").push(msg);
    }

    /// The messages queued with [`StepContext::send`], for the step's commit.
    pub(crate) fn take_outgoing(&self) -> Vec<OutgoingMessage> {
        std::mem::take(&mut *self.inner.outgoing.lock().expect("outgoing lock"))
    }

    /// Triggers the named failpoint (tests and drills; a no-op unless configured).
    pub fn failpoint(&self, name: &str) -> Result<(), StepError> {
        self.inner
            .services
            .failpoints
            .hit(name)
            .map_err(|e| StepError::Infrastructure(e.to_string()))
    }

    /// Asks the model, or returns the journaled answer when this call was made before.
    #[tracing::instrument(skip_all, fields(call_no))]
    pub async fn model(&self, request: &ChatRequest) -> Result<ChatAnswer, StepError> {
        let call_no = self.inner.calls.fetch_add(1, Ordering::SeqCst);
        tracing::Span::current().record("call_no", call_no);
        let request_json = serde_json::to_value(request).expect("chat request serialises");
        let hash = store::hash_json(&request_json);
        if let Some(entry) = journal::get(self.pool(), self.run_id(), self.seq(), call_no).await? {
            return replayed(entry, &hash, self);
        }
        let answer = self.call_model(request).await?;
        let entry = journal::JournalEntry {
            seq: self.seq(),
            call_no,
            kind: "model".into(),
            request_hash: hash,
            response: serde_json::to_value(&answer).expect("answer serialises"),
            tokens: (answer.prompt_tokens + answer.completion_tokens) as i64,
            cost: answer.cost,
            latency_ms: answer.latency_ms as i64,
        };
        // Committed on its own, right now: a crash later in the step keeps the paid answer.
        journal::insert(self.pool(), self.run_id(), &entry).await?;
        Ok(answer)
    }

    async fn call_model(&self, request: &ChatRequest) -> Result<ChatAnswer, StepError> {
        let services = &self.inner.services;
        let Some(client) = services.model.as_ref() else {
            let started = Instant::now();
            let content = crate::standin::model_server::standin_answer(
                request,
                services.standin_answer_bytes,
            );
            return Ok(ChatAnswer {
                completion_tokens: content.len().div_ceil(4) as u64,
                content,
                model: "stand-in".into(),
                prompt_tokens: 0,
                cost: 0.0,
                latency_ms: started.elapsed().as_millis() as u64,
            });
        };
        let policy = ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(5))
            .with_max_times(MODEL_RETRIES);
        (|| client.chat(request))
            .retry(policy)
            .when(model::Error::is_temporary)
            // Honour the server's Retry-After when it is longer than our own backoff.
            .adjust(|e, delay| match e {
                model::Error::RateLimited { retry_after: Some(asked) } => delay.map(|d| d.max(*asked)),
                _ => delay,
            })
            .notify(|e, delay| tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "model call failed, retrying"))
            .await
            .map_err(classify_model_error)
    }

    /// Makes an outside call under an idempotency key, at most once in effect:
    /// the intent is recorded (with this step's fence) before the call and the result after.
    /// A replay returns the recorded result; a key reused with another request is a conflict.
    #[tracing::instrument(skip_all, fields(key = %key))]
    pub async fn effect<F, Fut>(
        &self,
        key: &IdempotencyKey,
        request: &Value,
        call: F,
    ) -> Result<Value, StepError>
    where
        F: FnOnce(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Value, StepError>>,
    {
        let hash = store::hash_json(request);
        let known = effects::begin(
            self.pool(),
            key,
            self.run_id(),
            self.seq(),
            &hash,
            self.fence(),
        )
        .await?;
        match known {
            effects::Known::Done(result) => return Ok(result),
            // The call may have happened before a crash: call again under the same key and let the
            // receiving store's unique key make the repeat harmless.
            effects::Known::Unknown => tracing::info!(
                "effect outcome unknown after a restart; calling again under the same key"
            ),
            effects::Known::New => {}
        }
        let started = Instant::now();
        let result = call(key.clone()).await?;
        // A crash here is the "unknown outcome" case: the call happened, its result is not known.
        self.failpoint("effect.after_call")?;
        effects::complete(self.pool(), key, &result).await?;
        tracing::debug!(
            latency_ms = started.elapsed().as_millis() as u64,
            "effect done"
        );
        Ok(result)
    }
}

fn replayed(
    entry: journal::JournalEntry,
    hash: &str,
    ctx: &StepContext,
) -> Result<ChatAnswer, StepError> {
    if entry.request_hash != hash {
        return Err(StepError::Unknown(format!(
            "run {} step {} (seq {}) model call {}: the request differs from the journaled one; the step is not deterministic, so its recorded answer cannot be reused",
            ctx.run_id(),
            ctx.step(),
            ctx.seq(),
            entry.call_no
        )));
    }
    serde_json::from_value(entry.response).map_err(|e| {
        StepError::Unknown(format!(
            "journal entry {} of run {} is unreadable: {e}",
            entry.call_no,
            ctx.run_id()
        ))
    })
}

fn classify_model_error(e: model::Error) -> StepError {
    match e {
        model::Error::Auth { .. } => StepError::Auth(e.to_string()),
        model::Error::RateLimited { retry_after } => StepError::Temporary {
            reason: e.to_string(),
            retry_after,
        },
        e if e.is_temporary() => StepError::temporary(e.to_string()),
        e => StepError::Unknown(e.to_string()),
    }
}

//! `ctx.model()`: every answer journaled word for word the moment it arrives; a replayed step
//! reads the journal instead of paying again.

use std::sync::atomic::Ordering;

use backon::Retryable;
use opentelemetry::KeyValue;

use super::{StepContext, StepError};
use crate::domain::{JournalEntry, request_hash};
use crate::guard;
use crate::model::{self, ChatAnswer, ChatRequest, ModelClient};

impl StepContext {
    /// Asks the model, or returns the journaled answer when this call was made before.
    /// Temporary failures (429 honouring `Retry-After`, 5xx, timeouts, malformed bodies) are
    /// retried in-process; then the fallback model is tried if configured. Auth errors stop the
    /// run at once; a body still malformed after the retries goes to review.
    #[tracing::instrument(skip_all, fields(call_no))]
    pub async fn model(&self, request: &ChatRequest) -> Result<ChatAnswer, StepError> {
        let call_no = self.inner.calls.fetch_add(1, Ordering::SeqCst);
        tracing::Span::current().record("call_no", call_no);
        if call_no == 0 {
            self.drill_seam(crate::seams::Seam::Review)?;
        }
        let request_json = serde_json::to_value(request).expect("chat request serialises");
        let hash = request_hash(&request_json);
        let records = &self.tools().records;
        // The claim counted this position's entries, so a first attempt skips the read.
        if call_no < self.inner.pos.journaled
            && let Some(entry) = records
                .journaled(self.run_id(), self.seq(), call_no)
                .await?
        {
            self.count_replayed(true);
            return replayed(entry, &hash, self);
        }
        let budget = &self.inner.pos.budget;
        // Read what the run spent only when there is a limit to hold it against: an extra
        // statement on every model call otherwise.
        if budget.caps_models() {
            let spent = records.spent(self.run_id()).await?;
            guard::check_model_budget(spent, self.run_id(), budget)?;
        }
        self.drill_seam(crate::seams::Seam::Model500)?;
        let (answer, reserved) = self.traced_call(request, call_no).await?;
        self.drill_log(|| format!("model {} {} {call_no}", self.run_id(), self.seq()));
        // A crash here loses a paid answer before it is journaled: the replay asks again.
        self.fire_failpoint("model.after_answer")?;
        let entry = JournalEntry {
            seq: self.seq(),
            call_no,
            kind: "model".into(),
            request_hash: hash,
            response: serde_json::to_value(&answer).expect("answer serialises"),
            tokens: (answer.prompt_tokens + answer.completion_tokens) as i64,
            cost: answer.cost,
            latency_ms: answer.latency_ms as i64,
        };
        // Committed now, not with the step commit (in one statement with other steps' records):
        // a crash later in the step keeps the paid answer. The commit does not wait for its WAL
        // flush; the effect intent or step commit that follows does, and flushes this entry with it.
        // The answer's real usage replaces its reservation's estimate in the same statement.
        let journaled = records.journal(self.run_id(), entry.clone(), reserved).await?;
        // Ours or another worker's, the entry may not be flushed yet.
        self.inner
            .unflushed_answer
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if !journaled {
            // Another worker journaled this call first (it held the run before us): the step
            // goes on with the recorded answer, so the journal stays the one truth.
            let stored = records
                .journaled(self.run_id(), self.seq(), call_no)
                .await?
                .ok_or_else(|| {
                    StepError::Infrastructure(format!(
                        "run {} step {} call {call_no}: journal entry vanished after a conflict",
                        self.run_id(),
                        self.step()
                    ))
                })?;
            return replayed(stored, &entry.request_hash, self);
        }
        // Kill spot of tests/relaxed_crash.rs: a Postgres crash now can lose the unflushed entry.
        self.fire_failpoint("journal.after_commit")?;
        {
            let mut paid = self.inner.paid.lock().expect("paid lock");
            paid.0 += entry.tokens;
            paid.1 += entry.cost;
        }
        tracing::debug!(tokens = entry.tokens, cost = entry.cost, latency_ms = entry.latency_ms, model = %answer.model, prompt_hash = %entry.request_hash, "model answered");
        crate::metrics::model_answered(
            &answer.model,
            answer.prompt_tokens,
            answer.completion_tokens,
            answer.cost,
        );
        Ok(answer)
    }

    /// The call under a `chat <model>` span (child of the step attempt's) with the
    /// OpenTelemetry GenAI attributes: models asked and answering, tokens in and out; and the
    /// cost, which GenAI has no attribute for, as `trailmark.gen_ai.cost`. With the answer, the
    /// reservation it was asked under at a limited endpoint.
    async fn traced_call(
        &self,
        request: &ChatRequest,
        call_no: i32,
    ) -> Result<(ChatAnswer, Option<i64>), StepError> {
        let requested = (self.tools().models.primary.as_ref()).map_or("offline", |c| c.model());
        let span = self.span().child(
            || format!("chat {requested}"),
            vec![
                KeyValue::new("gen_ai.operation.name", "chat"),
                KeyValue::new("gen_ai.request.model", requested.to_owned()),
                KeyValue::new("trailmark.model.call", i64::from(call_no)),
            ],
        );
        let answer = self.call_model(request).await;
        let attributes = || match &answer {
            Ok((a, _)) => vec![
                KeyValue::new("gen_ai.response.model", a.model.clone()),
                KeyValue::new("gen_ai.usage.input_tokens", a.prompt_tokens as i64),
                KeyValue::new("gen_ai.usage.output_tokens", a.completion_tokens as i64),
                KeyValue::new("trailmark.gen_ai.cost", a.cost),
            ],
            Err(e) => vec![KeyValue::new("error.type", e.class())],
        };
        span.end(attributes, answer.as_ref().err().map(ToString::to_string));
        answer
    }

    async fn call_model(&self, request: &ChatRequest) -> Result<(ChatAnswer, Option<i64>), StepError> {
        let tools = self.tools();
        let models = &tools.models;
        let Some(primary) = models.primary.as_ref() else {
            return Ok((model::offline::chat(request, models.offline_bytes), None));
        };
        let retries = tools.call_retries;
        let asked = match self.ask(primary, request, retries).await {
            Err(Failure::Model(e)) if e.is_temporary() && models.fallback.is_some() => {
                let fallback = models.fallback.as_ref().expect("checked above");
                tracing::warn!(error = %e, fallback = fallback.model(), "primary model failed; asking the fallback model");
                self.ask(fallback, request, retries).await
            }
            other => other,
        };
        asked.map_err(|failure| match failure {
            Failure::Model(e) => classify(e),
            Failure::Step(e) => e,
        })
    }

    /// Asks `client`, retrying temporary failures in-process; every request first reserves its
    /// place at the endpoint when it has limits (`model_limit.rs`), since the provider counts
    /// each one. With the answer, the reservation it was asked under.
    async fn ask(
        &self,
        client: &ModelClient,
        request: &ChatRequest,
        retries: usize,
    ) -> Result<(ChatAnswer, Option<i64>), Failure> {
        let policy = super::call_backoff(retries);
        let once = || async {
            let reserved = (self.reserve_call(client, request).await).map_err(Failure::Step)?;
            match client.chat(request).await {
                Ok(answer) => Ok((answer, reserved)),
                Err(e) => {
                    self.note_failed_call();
                    self.reserved_call_failed(reserved).await;
                    Err(Failure::Model(e))
                }
            }
        };
        once.retry(policy)
            .when(|f| matches!(f, Failure::Model(e) if e.is_temporary()))
            // Honour the server's Retry-After when it asks for longer than our own backoff.
            .adjust(|f, delay| match f {
                Failure::Model(model::Error::RateLimited { retry_after: Some(asked) }) => {
                    delay.map(|d| d.max(*asked))
                }
                _ => delay,
            })
            .notify(|f, delay| {
                if let Failure::Model(e) = f {
                    tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "model call failed; retrying");
                }
            })
            .await
    }
}

/// Why a model request gave no answer: the model failed (retried when temporary, then maybe
/// asked of the fallback model), or the step cannot go on (an endpoint's rate limit has no room,
/// trailmark's own database failed), which no retry here would change.
enum Failure {
    Model(model::Error),
    Step(StepError),
}

/// What a replayed model call whose request changed says, word for word: `trailmark
/// replay-check` (`crate::replay`) tells this refusal from other handler errors by it.
pub(crate) const REQUEST_DIFFERS: &str = "the request differs from the journaled one";

fn replayed(entry: JournalEntry, hash: &str, ctx: &StepContext) -> Result<ChatAnswer, StepError> {
    if entry.kind == super::PATCH_KIND {
        // An earlier attempt ran on a build with a `ctx.patched` point here; this build lacks it.
        return Err(StepError::Unknown(format!(
            "run {run} step {} (seq {}) call {}: an earlier attempt ran on a build with a `ctx.patched` point here, and this build has none: finish the deploy of the patched build on every worker, then `trailmark run resume {run} --after-fix` (not --ask-again, which would set aside answers already paid for)",
            ctx.step(),
            ctx.seq(),
            entry.call_no,
            run = ctx.run_id(),
        )));
    }
    if entry.request_hash != hash {
        return Err(StepError::Unknown(format!(
            "run {run} step {} (seq {}) model call {}: {REQUEST_DIFFERS}, so its recorded answer cannot be reused; if the prompt was changed on purpose (a fix), `trailmark run resume {run} --after-fix --ask-again` asks the model again, else make the step build its request from its input and checkpoint only",
            ctx.step(),
            ctx.seq(),
            entry.call_no,
            run = ctx.run_id(),
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

fn classify(e: model::Error) -> StepError {
    match e {
        model::Error::Auth { .. } | model::Error::Config(_) => StepError::Auth(e.to_string()),
        model::Error::RateLimited { retry_after } => StepError::Temporary {
            reason: e.to_string(),
            retry_after,
        },
        // Still malformed after the retries: not a passing fault, a person should look.
        model::Error::Malformed(_) => StepError::Unknown(e.to_string()),
        e if e.is_temporary() => StepError::temporary(e.to_string()),
        e => StepError::Unknown(e.to_string()),
    }
}

//! `ctx.effect()`: an outside call under an idempotency key. The intent (key,
//! request hash, fence) is recorded before the call and the result right after it; a replay
//! returns the recorded result; a key reused with another request is a conflict. Guards run
//! before a new call: the tool's circuit breaker, and (in the intent's statement) the run's
//! tool-call budget and repeated-action detection.

use std::future::Future;
use std::time::Instant;

use backon::Retryable;
use opentelemetry::KeyValue;
use serde_json::Value;

use super::{StepContext, StepError};
use crate::domain::{EffectIntent, EffectState, IdempotencyKey, IntentOutcome, request_hash};
use crate::guard::{self, Decision};

/// An outside tool as recovery sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tool {
    /// Name for budgets, breakers, repeat detection and logs.
    pub name: String,
    /// Whether the receiver dedups by key, so that calling again after a crash is harmless.
    pub idempotent: bool,
}

impl Tool {
    /// A tool whose receiver enforces the idempotency key (a ledger with a unique reference).
    pub fn idempotent(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            idempotent: true,
        }
    }
    /// A tool that might act twice if called twice; needs a lookup after an unknown outcome.
    pub fn not_idempotent(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            idempotent: false,
        }
    }
}

/// What a non-idempotent tool reports about a key whose outcome is unknown after a crash.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The call happened; here is its result.
    Done(Value),
    /// The call did not happen; it is safe to call.
    NotDone,
    /// The tool cannot tell: a person must decide.
    CannotTell,
}

impl StepContext {
    /// Makes one outside call under `key` to a receiver that enforces the key.
    /// A temporary failure is retried later as a whole step, under the same key; use
    /// [`StepContext::tool_effect`] for in-process retries, tool names and lookups.
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
        let mut once = Some(call);
        let call = move |k| {
            (once
                .take()
                .expect("an effect without retries is called once"))(k)
        };
        let no_lookup = |_key: IdempotencyKey| async { Ok(Lookup::CannotTell) };
        // Named after the step, so each receiver gets its own breaker and repeat count.
        let base = self.inner.pos.step.declared();
        let tool = Tool::idempotent(&format!("{}.{base}", self.workflow()));
        self.run_effect(&tool, key, request, 0, call, no_lookup)
            .await
    }

    /// Makes an outside call to `tool` under `key`, at most once in effect where the receiver
    /// enforces the key. After a crash with the outcome unknown: an idempotent tool is called again
    /// with the same key; otherwise `lookup(key)` decides, and if it cannot tell the run stops in
    /// `needs_review` with the key in the note. Temporary failures are retried in-process under
    /// the same key (`worker.call_retries`), then surface as a temporary step error.
    ///
    /// ```no_run
    /// # use serde_json::json;
    /// # use trailmark::domain::IdempotencyKey;
    /// # use trailmark::workflow::{Lookup, StepContext, StepError, StepOutcome, Tool};
    /// # async fn send_mail(key: &str, to: &str) -> Result<String, StepError> { Ok(key.into()) }
    /// # async fn sent_mail(key: &str) -> Option<String> { None }
    /// async fn notify(ctx: StepContext) -> Result<StepOutcome, StepError> {
    ///     // A mail server cannot refuse a repeat, so after a crash the lookup decides.
    ///     let mail = Tool::not_idempotent("mail");
    ///     let key = IdempotencyKey::for_step(ctx.run_id(), "notify", "finance");
    ///     let request = json!({ "to": "finance@example.com" });
    ///     let sent = ctx
    ///         .tool_effect(
    ///             &mail,
    ///             &key,
    ///             &request,
    ///             |key| async move { Ok(json!(send_mail(key.as_str(), "finance").await?)) },
    ///             |key| async move {
    ///                 Ok(match sent_mail(key.as_str()).await {
    ///                     Some(id) => Lookup::Done(json!(id)),
    ///                     None => Lookup::NotDone,
    ///                 })
    ///             },
    ///         )
    ///         .await?;
    ///     Ok(StepOutcome::finish(json!({ "mail": sent })))
    /// }
    /// ```
    pub async fn tool_effect<F, Fut, L, LFut>(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        request: &Value,
        call: F,
        lookup: L,
    ) -> Result<Value, StepError>
    where
        F: FnMut(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Value, StepError>>,
        L: FnOnce(IdempotencyKey) -> LFut,
        LFut: Future<Output = Result<Lookup, StepError>>,
    {
        let retries = self.tools().call_retries;
        self.run_effect(tool, key, request, retries, call, lookup)
            .await
    }

    #[tracing::instrument(skip_all, fields(tool = %tool.name, key = %key))]
    async fn run_effect<F, Fut, L, LFut>(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        request: &Value,
        retries: usize,
        call: F,
        lookup: L,
    ) -> Result<Value, StepError>
    where
        F: FnMut(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Value, StepError>>,
        L: FnOnce(IdempotencyKey) -> LFut,
        LFut: Future<Output = Result<Lookup, StepError>>,
    {
        // A shadow run never calls, and never touches the effects table either: a key its
        // inherited outputs carry may be another run's, whose record must stay as it is.
        if self.is_shadow() {
            return self.shadow_effect(tool, key, request).await;
        }
        let hash = request_hash(request);
        self.refuse_before_intent(tool, key, &hash).await?;
        let known = self.record_intent(tool, key, &hash, request).await?;
        if let EffectState::Done(result) = known {
            // Served from the record: no call, so no span; counted on the step's span.
            self.count_replayed(false);
            return Ok(result);
        }
        let span = self.span().child(
            || format!("effect {}", tool.name),
            vec![
                KeyValue::new("trailmark.effect.tool", tool.name.clone()),
                KeyValue::new("trailmark.effect.key", key.to_string()),
            ],
        );
        let made = self.make_effect(tool, key, known, retries, call, lookup).await;
        let outcome = match &made {
            Ok((_, outcome)) => *outcome,
            Err(e) => e.class(),
        };
        let error = made.as_ref().err().map(ToString::to_string);
        span.end(|| vec![KeyValue::new("trailmark.effect.outcome", outcome)], error);
        made.map(|(result, _)| result)
    }

    /// The call of [`Self::run_effect`] once its intent is recorded and not done before: after
    /// an unknown outcome the tool's lookup decides first. With the result, what happened:
    /// `called`, `called_again` (after an unknown outcome) or `found` (by the lookup).
    async fn make_effect<F, Fut, L, LFut>(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        known: EffectState,
        retries: usize,
        call: F,
        lookup: L,
    ) -> Result<(Value, &'static str), StepError>
    where
        F: FnMut(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Value, StepError>>,
        L: FnOnce(IdempotencyKey) -> LFut,
        LFut: Future<Output = Result<Lookup, StepError>>,
    {
        let mut outcome = "called";
        let recorded_now = matches!(known, EffectState::New);
        match known {
            EffectState::Done(result) => return Ok((result, "recorded")),
            EffectState::New => {}
            EffectState::Unknown if tool.idempotent => {
                outcome = "called_again";
                tracing::info!(
                    "effect outcome unknown after a restart; calling again under the same key"
                );
            }
            EffectState::Unknown => match lookup(key.clone()).await? {
                Lookup::Done(result) => {
                    self.tools()
                        .records
                        .finish_effect(key.clone(), result.clone())
                        .await?;
                    return Ok((result, "found"));
                }
                Lookup::NotDone => tracing::info!("lookup says the call did not happen; calling"),
                Lookup::CannotTell => {
                    return Err(StepError::Unknown(format!(
                        "outcome of {} call {key} is unknown after a crash and its lookup cannot tell; check the {} system for key {key}, then resume (if absent) or resume after marking it done",
                        tool.name, tool.name
                    )));
                }
            },
        }
        self.drill_log(|| {
            format!(
                "call {} {} {key} {} {}",
                self.run_id(),
                self.seq(),
                self.lease_fence().0,
                unix_nanos()
            )
        });
        let result = match self.call_with_retries(tool, key, retries, call).await {
            Err(open @ StepError::BreakerOpen { .. }) if recorded_now => {
                return Err(self.withdraw_intent(key, open).await);
            }
            other => other?,
        };
        // A crash here is the "unknown outcome" case: the call happened, its result is not known.
        self.fire_failpoint("effect.after_call")?;
        self.drill_seam(crate::seams::Seam::LateTool)?;
        // Recorded at once, not with the step commit: a step that dies later keeps what it has
        // done, and its replay (and the handover note) knows this call happened. Only a crash of
        // Postgres before the step's next synchronous commit could lose it (relaxed_pool); the
        // replay then calls again under the same key.
        self.tools()
            .records
            .finish_effect(key.clone(), result.clone())
            .await?;
        // Kill spot of tests/relaxed_crash.rs: a Postgres crash now can lose the unflushed result.
        self.fire_failpoint("effect_result.after_commit")?;
        Ok((result, outcome))
    }

    /// The breaker refused, before any call, a call whose intent this attempt recorded: it was
    /// never made, so its intent goes, and the next attempt starts afresh. A withdrawal that
    /// fails (logged; the step still waits) or a crash before it leaves the intent, which then reads as an unknown outcome
    /// (its lookup decides): the one narrow window left.
    async fn withdraw_intent(&self, key: &IdempotencyKey, open: StepError) -> StepError {
        let withdrawn = self
            .tools()
            .records
            .withdraw_effect(key, self.run_id(), self.lease_fence())
            .await;
        if let Err(e) = withdrawn {
            tracing::warn!(error = %e, "the intent of a call the breaker refused was not withdrawn");
        }
        open
    }

    /// In a shadow run: records the call it would make (key, tool, request) in `shadow_writes`
    /// and answers `{"shadow": true}`, so the run goes on. No call is made, so none counts
    /// against the tool budget; a replayed step records the same key again, which keeps its
    /// latest request.
    async fn shadow_effect(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        request: &Value,
    ) -> Result<Value, StepError> {
        let write = crate::domain::ShadowWrite {
            seq: self.seq(),
            kind: "effect".into(),
            key: key.to_string(),
            target: tool.name.clone(),
            request: request.clone(),
        };
        self.tools()
            .records
            .shadow_write(self.run_id(), write)
            .await?;
        tracing::debug!("shadow run: the call was recorded, not made");
        Ok(serde_json::json!({ "shadow": true }))
    }

    /// An open breaker's refusal, before anything is recorded. A refused call is never made, so
    /// it must leave no intent: a later attempt would take an intent without a result for an
    /// unknown outcome, and a non-idempotent tool's lookup that cannot tell would send the run to
    /// review for a call that never happened. Goes on when the breaker would let the call
    /// through (its probe is free: taken by the call itself), or when `key` holds what the
    /// intent statement must answer: a recorded result (the step replays, no call, no wait) or
    /// another request (the conflict).
    ///
    /// The breaker may still refuse after this peek: it opens meanwhile, or another step takes
    /// the probe this one saw free (every step back at a half-open breaker sees it free). The
    /// check before the call refuses then, and the intent just recorded is withdrawn
    /// ([`Self::withdraw_intent`]); peeking alone would leave that window wide open.
    ///
    /// An intent without a result from an earlier attempt (it died after recording it: the
    /// outcome is really unknown) waits too, uncounted, and its lookup is not asked: the lookup
    /// is a call to the same outside system, which its breaker says is down. Once the breaker
    /// lets the step through, the lookup decides as after any crash.
    async fn refuse_before_intent(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        hash: &str,
    ) -> Result<(), StepError> {
        let Decision::Refuse(wait) = self.tools().breakers.peek(&tool.name, Instant::now()) else {
            return Ok(());
        };
        match self.tools().records.recorded_effect(key).await? {
            Some((stored, result)) if result.is_some() || stored != hash => Ok(()),
            _ => Err(StepError::breaker_open(&tool.name, wait)),
        }
    }

    /// Records the intent, enforcing the run's tool-call budget and repeated-action detection for
    /// a call not made under `key` before.
    async fn record_intent(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        hash: &str,
        request: &Value,
    ) -> Result<EffectState, StepError> {
        // The budget caps the run's own work. A compensation reverses that work, and a run that
        // was stopped by its budget is exactly one an operator may want undone, so reversals are
        // not counted against it (repeated-action detection still applies).
        let max_calls = match self.undo() {
            Some(_) => 0,
            None => self.inner.pos.budget.max_tool_calls,
        };
        let repeat_limit = self.tools().repeat_limit;
        let intent = EffectIntent {
            key: key.clone(),
            tool: tool.name.clone(),
            run_id: self.run_id().clone(),
            seq: self.seq(),
            request_hash: hash.to_owned(),
            fence: self.lease_fence(),
            max_calls,
            repeat_limit,
        };
        let used = match self.tools().records.begin_effect(intent).await? {
            IntentOutcome::Recorded(known) => {
                if matches!(known, EffectState::New) {
                    // Inserted and committed synchronously: every answer before it is durable.
                    self.inner
                        .unflushed_answer
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                }
                return Ok(known);
            }
            IntentOutcome::OverLimit(used) => used,
        };
        if max_calls > 0 && used.calls as u64 >= max_calls {
            return Err(guard::budget_exhausted(format!(
                "run {} made {} tool calls, its budget is {}",
                self.run_id(),
                used.calls,
                max_calls
            ))
            .into());
        }
        Err(guard::repeated_action(self.run_id(), &tool.name, used.repeats, request).into())
    }

    async fn call_with_retries<F, Fut>(
        &self,
        tool: &Tool,
        key: &IdempotencyKey,
        retries: usize,
        call: F,
    ) -> Result<Value, StepError>
    where
        F: FnMut(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Value, StepError>>,
    {
        let breakers = &self.tools().breakers;
        let policy = super::call_backoff(retries);
        let call = std::sync::Mutex::new(call);
        // The last real call's failure in this loop: a breaker it opened must not hide it.
        let failed = std::sync::Mutex::new(None::<String>);
        let attempt = || async {
            if let Decision::Refuse(wait) = breakers.check(&tool.name, Instant::now()) {
                return Err(refused(&tool.name, wait, failed.lock().expect("failure lock").take()));
            }
            (self.inner.called_out).store(true, std::sync::atomic::Ordering::Relaxed);
            let started = Instant::now();
            let pending = (call.lock().expect("effect call lock"))(key.clone());
            let result = pending.await;
            let ok = !matches!(result, Err(StepError::Temporary { .. }));
            if let Some(opened) = breakers.record(&tool.name, ok, Instant::now()) {
                crate::metrics::breaker(&tool.name, opened);
                // An alert for other systems; the call's own outcome does not depend on it.
                if let Err(e) = self
                    .tools()
                    .records
                    .breaker_changed(&tool.name, opened)
                    .await
                {
                    tracing::warn!(error = %e, tool = %tool.name, opened, "the breaker event was not recorded");
                }
            }
            tracing::debug!(
                latency_ms = started.elapsed().as_millis() as u64,
                ok = result.is_ok(),
                "tool called"
            );
            match result {
                Err(StepError::Temporary { reason, retry_after }) => {
                    self.note_failed_call();
                    *failed.lock().expect("failure lock") = Some(reason.clone());
                    Err(after_failure(&tool.name, reason, retry_after, breakers))
                }
                other => other,
            }
        };
        attempt
            .retry(policy)
            .when(|e| matches!(e, StepError::Temporary { retry_after: None, .. }))
            .notify(|e, delay| tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "tool call failed; retrying under the same key"))
            .await
    }
}

/// A real call's temporary failure, counted as such. When the breaker is open after it (this
/// failure opened it, or a probe failed), the error names the tool and the step is retried when
/// the breaker lets the next probe through: an in-process retry would only be refused.
fn after_failure(
    tool: &str,
    reason: String,
    retry_after: Option<std::time::Duration>,
    breakers: &guard::Breakers,
) -> StepError {
    match breakers.refusing(tool, Instant::now()) {
        None => StepError::Temporary {
            reason,
            retry_after,
        },
        Some(wait) => StepError::Temporary {
            reason: format!("{reason}; the circuit breaker for {tool} is open"),
            retry_after: Some(retry_after.map_or(wait, |asked| asked.max(wait))),
        },
    }
}

/// What an open breaker's refusal of `tool` means to the step. Before any call, a wait that
/// spends no attempt; after a real call failed in the same loop (it may be the one that opened
/// the breaker), that failure, which counts, retried when the breaker lets a probe through.
fn refused(tool: &str, wait: std::time::Duration, failed: Option<String>) -> StepError {
    match failed {
        None => StepError::breaker_open(tool, wait),
        Some(reason) => StepError::Temporary {
            reason: format!("{reason}; the circuit breaker for {tool} is open"),
            retry_after: Some(wait),
        },
    }
}

/// Wall-clock nanoseconds, for the drill's call log (one host, one clock).
fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

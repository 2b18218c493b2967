//! One attempt of a remote step: the signed call to the endpoint, the callbacks served while it
//! is open, and what its answer (or its lack of one) makes of the step.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::mpsc;

use super::attempts::{Callback, HUB};
use super::wire::{self, StepCall, WireError};
use super::{Endpoint, ops};
use crate::workflow::{Handler, StepContext, StepError, StepOutcome};

/// The endpoint's answer as it came: status, `retry-after`, body; or why none came.
type Answer = Result<(u16, Option<Duration>, Vec<u8>), reqwest::Error>;

/// What happens next during an attempt.
pub(super) enum Event {
    /// The endpoint calls back.
    Callback(Callback),
    /// The endpoint answered the step call (or the call failed).
    Answered(Answer),
}

/// An open attempt: its callbacks and its pending call.
pub(super) struct Exchange {
    callbacks: mpsc::Receiver<Callback>,
    call: tokio::task::JoinHandle<Answer>,
    /// The last error an op met: what the step ends with if the endpoint reports it.
    pub last_error: Option<StepError>,
    /// Why a callback was refused by its op (a body that does not fit, an op out of turn): the
    /// attempt is then void, whatever the endpoint answers.
    pub voided: Option<String>,
    /// The endpoint, run, step and attempt, for messages.
    pub who: String,
}

impl Drop for Exchange {
    // A step dropped at its timeout stops its call too.
    fn drop(&mut self) {
        self.call.abort();
    }
}

impl Exchange {
    /// Waits for the next callback or for the answer.
    pub async fn next(&mut self) -> Event {
        tokio::select! {
            biased;
            Some(cb) = self.callbacks.recv() => Event::Callback(cb),
            done = &mut self.call => Event::Answered(match done {
                Ok(answer) => answer,
                Err(e) => Ok((599, None, format!("the call's task ended: {e}").into_bytes())),
            }),
        }
    }
}

/// The handler of every step (and compensation) of a remote workflow.
pub(super) fn handler(endpoint: Arc<Endpoint>) -> Handler {
    Arc::new(move |ctx| {
        let endpoint = endpoint.clone();
        Box::pin(async move { attempt(&endpoint, ctx).await })
    })
}

#[tracing::instrument(skip_all, fields(endpoint = %endpoint.name, run.id = %ctx.run_id(), step = %ctx.step(), seq = ctx.seq()))]
async fn attempt(endpoint: &Endpoint, ctx: StepContext) -> Result<StepOutcome, StepError> {
    let who = format!(
        "step endpoint {} for run {} step {} (position {}, attempt {})",
        endpoint.name,
        ctx.run_id(),
        ctx.step(),
        ctx.seq(),
        ctx.attempt()
    );
    let base = HUB.base().ok_or_else(|| {
        StepError::Infrastructure(format!(
            "{who}: this process does not listen for callbacks; run it as `trailmark serve` or `worker` with remote.endpoints set"
        ))
    })?;
    let (open, callbacks) = HUB.open(ctx.lease_fence().0, endpoint.secret.clone());
    // The token is in the callbacks' path as well as their bearer header: the path is signed,
    // so a callback signed for one attempt cannot be replayed into another.
    let url = format!("{base}/attempts/{}", open.token);
    let body = call_body(endpoint, &ctx, &url, &open.token).await?;
    let request = endpoint
        .signed_post("step", body)
        .timeout(endpoint.deadline);
    let call = tokio::spawn(async move {
        let response = request.send().await?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        Ok((status, retry_after, response.bytes().await?.to_vec()))
    });
    let mut ex = Exchange {
        callbacks,
        call,
        last_error: None,
        voided: None,
        who,
    };
    loop {
        match ex.next().await {
            Event::Callback(cb) => ops::serve(endpoint, &ctx, &mut ex, cb).await?,
            Event::Answered(answer) => {
                let refused = HUB.refusal(&open.token).or_else(|| ex.voided.take());
                // Callbacks after the answer find no attempt: the step's result is fixed now.
                drop(open);
                if let Some(why) = refused {
                    return Err(StepError::temporary(format!(
                        "{}: a callback of the attempt was refused ({why}), so its work is incomplete: the attempt is void and the step is retried",
                        ex.who
                    )));
                }
                return conclude(&ex, answer);
            }
        }
    }
}

async fn call_body(
    endpoint: &Endpoint,
    ctx: &StepContext,
    base: &str,
    token: &str,
) -> Result<Vec<u8>, StepError> {
    let journal = ctx
        .journaled_here()
        .await?
        .into_iter()
        .map(|e| json!({ "call": e.call_no, "kind": e.kind, "request_hash": e.request_hash, "response": e.response }))
        .collect();
    let undo = ctx.undo().map(
        |u| json!({ "step": u.step, "position": u.seq, "output": u.output, "scope": u.scope }),
    );
    let call = StepCall {
        protocol: wire::PROTOCOL,
        run_id: ctx.run_id().as_str(),
        workflow: ctx.workflow(),
        version: ctx.version(),
        step: ctx.step(),
        position: ctx.seq(),
        attempt: ctx.attempt(),
        fence: ctx.lease_fence().0,
        input: ctx.input(),
        journal,
        undo,
        callback: wire::Callback { url: base, token },
        deadline_ms: endpoint.deadline.as_millis() as u64,
    };
    Ok(serde_json::to_vec(&call).expect("a step call serialises"))
}

/// The step's result from the endpoint's answer; see "What the worker makes of an answer" in
/// docs/STEP_PROTOCOL.md.
fn conclude(ex: &Exchange, answer: Answer) -> Result<StepOutcome, StepError> {
    let who = &ex.who;
    // A fenced-out op voids the attempt whatever the endpoint then answered.
    if let Some(StepError::FencedOut) = ex.last_error {
        return Err(StepError::FencedOut);
    }
    let (status, retry_after, body) = match answer {
        Ok(answered) => answered,
        Err(e) if e.is_timeout() => {
            return Err(StepError::temporary(format!(
                "{who}: no answer within the step's deadline; the attempt is void (its token is revoked) and the step is retried"
            )));
        }
        Err(e) => {
            return Err(StepError::temporary(format!(
                "{who}: the call failed ({}); every write of the attempt went through callbacks, so the retry repeats nothing",
                crate::error::Report(&e)
            )));
        }
    };
    let begins = || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    match status {
        200..=299 => match wire::answer(&body) {
            Ok(Ok(outcome)) => Ok(outcome),
            Ok(Err(reported)) => Err(reported_error(ex, reported)),
            Err(why) => Err(StepError::Unknown(format!(
                "{who} answered a body that is {why}; it begins {:?}. Fix the step's code or its SDK, then resume after the fix",
                begins()
            ))),
        },
        429 | 500..=599 => Err(StepError::Temporary {
            reason: format!("{who} answered HTTP {status}: {}", begins()),
            retry_after,
        }),
        _ => Err(StepError::Auth(format!(
            "{who} refused the call with HTTP {status}: {}. Check the endpoint's secret (TRAILMARK_REMOTE_SECRET_*), that it speaks {} and serves this workflow, version and step; then resume after the fix",
            begins(),
            wire::PROTOCOL
        ))),
    }
}

/// The error the endpoint reported; the one an op met, when the endpoint passes it on as it was
/// told (class and message), so that its kind (an open breaker's wait, a conflict's key) is kept.
fn reported_error(ex: &Exchange, reported: WireError) -> StepError {
    match &ex.last_error {
        Some(met) => {
            let told = WireError::of(met);
            if told.class == reported.class && told.message == reported.message {
                return met.clone();
            }
            reported.into_step_error(&ex.who)
        }
        None => reported.into_step_error(&ex.who),
    }
}

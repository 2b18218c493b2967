//! The callbacks an endpoint makes while its step runs, each done through the attempt's own
//! [`StepContext`]: the same journal, keys, fences and guards as a step compiled into the worker.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::Endpoint;
use super::attempts::{Callback, Reply};
use super::call::{Event, Exchange};
use super::wire::WireError;
use crate::domain::IdempotencyKey;
use crate::model::ChatRequest;
use crate::workflow::{StepContext, StepError};

/// The longest progress line, parked item or reason kept (text from another service).
const MAX_LINE: usize = 500;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Model {
    request: ChatRequest,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EffectBegin {
    key: String,
    request: Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EffectEnd {
    key: String,
    // A result of `null` is a result: present, unlike a missing one.
    #[serde(default, deserialize_with = "present")]
    result: Option<Value>,
    #[serde(default)]
    error: Option<WireError>,
}

/// A field that is there, whatever its value (`null` too).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LocalWrite {
    table: String,
    row: Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Progress {
    line: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Park {
    item: String,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Patched {
    change: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Output {
    step: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Nothing {}

/// What an op made: its answer, or the error it met (told to the endpoint, which raises it).
type Made = Result<Value, StepError>;

/// Parses the callback's body as its op's and runs `op` on it; `Err`: the body does not fit.
async fn with<T, F, Fut>(cb: &Callback, op: F) -> Result<Made, Reply>
where
    T: DeserializeOwned,
    F: FnOnce(T) -> Fut,
    Fut: std::future::Future<Output = Made>,
{
    let body = serde_json::from_value(cb.body.clone()).map_err(|e| {
        Reply::Refused(
            400,
            "bad_request",
            format!("the body of callback {} does not fit: {e}", cb.op),
        )
    })?;
    Ok(op(body).await)
}

/// Serves one callback; `Err` ends the attempt with that error at once (an effect left open
/// when the endpoint's answer came).
pub(super) async fn serve(
    endpoint: &Endpoint,
    ctx: &StepContext,
    ex: &mut Exchange,
    cb: Callback,
) -> Result<(), StepError> {
    if cb.op == "effect/begin" {
        return effect(ctx, ex, cb).await;
    }
    let done = match cb.op.as_str() {
        "model" => {
            with(&cb, |m: Model| async move {
                Ok(json!({ "answer": ctx.model(&m.request).await? }))
            })
            .await
        }
        "local-write" => {
            with(&cb, |w: LocalWrite| async move {
                let table = endpoint.table(&w.table)?;
                ctx.local_write(table, w.row)?;
                Ok(json!({}))
            })
            .await
        }
        "progress" => {
            with(&cb, |p: Progress| async move {
                ctx.progress(p.line.chars().take(MAX_LINE).collect::<String>());
                Ok(json!({}))
            })
            .await
        }
        "park" => {
            with(&cb, |p: Park| async move {
                let cut = |text: String| text.chars().take(MAX_LINE).collect::<String>();
                ctx.park(cut(p.item), cut(p.reason));
                Ok(json!({}))
            })
            .await
        }
        "patched" => {
            with(&cb, |p: Patched| async move {
                Ok(json!({ "patched": ctx.patched(&p.change).await? }))
            })
            .await
        }
        "output" => {
            with(&cb, |o: Output| async move {
                Ok(json!({ "output": ctx.output_of(&o.step).await? }))
            })
            .await
        }
        "event" => {
            with(&cb, |_: Nothing| async move {
                let event = ctx.event().await?.map(
                    |e| json!({ "id": e.id, "name": e.name, "key": e.key, "payload": e.payload }),
                );
                Ok(json!({ "event": event }))
            })
            .await
        }
        "children" => {
            with(&cb, |_: Nothing| async move {
                Ok(json!({ "summary": ctx.children_summary().await? }))
            })
            .await
        }
        "effect/end" => Err(Reply::Refused(
            409,
            "no_effect_open",
            "effect/end came with no effect open: send effect/begin first".into(),
        )),
        other => Err(Reply::Refused(
            400,
            "unknown_op",
            format!("there is no callback {other:?} in trailmark-step/1"),
        )),
    };
    answer(ex, cb.reply, done);
    Ok(())
}

/// Answers a callback with what its op made, and keeps the error it met for the step's end.
fn answer(ex: &mut Exchange, reply: oneshot::Sender<Reply>, done: Result<Made, Reply>) {
    let reply_with = match done {
        Err(refused) => {
            if let Reply::Refused(_, code, message) = &refused {
                ex.voided
                    .get_or_insert_with(|| format!("{code}: {message}"));
            }
            refused
        }
        Ok(Ok(value)) => Reply::Done(value),
        Ok(Err(StepError::FencedOut)) => {
            ex.last_error = Some(StepError::FencedOut);
            Reply::Refused(
                409,
                "fenced_out",
                "a newer attempt owns the run: this attempt's work is void; end it".into(),
            )
        }
        Ok(Err(e)) => {
            let told = json!({ "error": WireError::of(&e) });
            ex.last_error = Some(e);
            Reply::Done(told)
        }
    };
    // An endpoint that hung up has ended the attempt: nothing to tell it.
    let _ = reply.send(reply_with);
}

/// `effect/begin` to `effect/end`: the intent is recorded (fenced, keyed, guarded) before the
/// endpoint is told to call; the result is recorded before `effect/end` is answered. Between
/// the two, only that key's `effect/end` is accepted.
async fn effect(ctx: &StepContext, ex: &mut Exchange, cb: Callback) -> Result<(), StepError> {
    let begin: EffectBegin = match serde_json::from_value(cb.body.clone()) {
        Ok(b) => b,
        Err(e) => {
            let why = format!("the body of callback effect/begin does not fit: {e}");
            answer(ex, cb.reply, Err(Reply::Refused(400, "bad_request", why)));
            return Ok(());
        }
    };
    let key = match IdempotencyKey::parse(&begin.key) {
        Ok(k) => k,
        Err(e) => {
            answer(
                ex,
                cb.reply,
                Err(Reply::Refused(400, "bad_request", e.to_string())),
            );
            return Ok(());
        }
    };
    let mut began = Some(cb.reply);
    let mut ended = None;
    let mut interrupted = false;
    let made = {
        let (began, ended, interrupted, ex) = (&mut began, &mut ended, &mut interrupted, &mut *ex);
        let key_text = begin.key.clone();
        ctx.effect(&key, &begin.request, move |_key| async move {
            if let Some(b) = began.take() {
                let _ = b.send(Reply::Done(json!({ "state": "call" })));
            }
            await_end(ex, &key_text, ended, interrupted).await
        })
        .await
    };
    if let Some(b) = began.take() {
        // Done before, or refused before any call: effect/begin itself is answered.
        let told = made
            .as_ref()
            .map(|r| json!({ "state": "done", "result": r }));
        answer(ex, b, Ok(told.map_err(Clone::clone)));
    } else if let Some(end) = ended.take() {
        let told = made.as_ref().map(|r| json!({ "result": r }));
        answer(ex, end, Ok(told.map_err(Clone::clone)));
    }
    match made {
        Err(e) if interrupted => Err(e),
        Err(e) => {
            ex.last_error = Some(e);
            Ok(())
        }
        Ok(_) => Ok(()),
    }
}

/// Waits for `effect/end` of `key`: its result or error is the call's.
async fn await_end(
    ex: &mut Exchange,
    key: &str,
    ended: &mut Option<oneshot::Sender<Reply>>,
    interrupted: &mut bool,
) -> Result<Value, StepError> {
    let who = ex.who.clone();
    let cb = match ex.next().await {
        Event::Callback(cb) => cb,
        Event::Answered(_) => {
            *interrupted = true;
            return Err(StepError::temporary(format!(
                "{who}: the call ended with effect {key} open, its outcome unknown; the step is retried and the effect made again under the same key"
            )));
        }
    };
    let end: Result<EffectEnd, _> = serde_json::from_value(cb.body.clone());
    match end {
        Ok(end) if cb.op == "effect/end" && end.key == key => {
            *ended = Some(cb.reply);
            match (end.result, end.error) {
                (Some(result), None) => Ok(result),
                (None, Some(error)) => Err(error.into_step_error(&who)),
                _ => Err(StepError::Unknown(format!(
                    "{who}: effect/end of {key} must hold a result or an error, not both or neither; fix the endpoint"
                ))),
            }
        }
        _ => {
            let body = cb.body.to_string();
            let why = format!(
                "effect {key} is open: only its effect/end may follow, got {} ({})",
                cb.op,
                body.chars().take(200).collect::<String>()
            );
            ex.voided
                .get_or_insert_with(|| format!("effect_open: {why}"));
            let _ = cb
                .reply
                .send(Reply::Refused(409, "effect_open", why.clone()));
            Err(StepError::Unknown(format!(
                "{who}: {why}; fix the endpoint"
            )))
        }
    }
}

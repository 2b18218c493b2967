//! The callback listener: where an endpoint's callbacks reach the attempt that called it. It
//! checks, in this order, the attempt's token (in the path, so the signature covers it, and in
//! the bearer header), the body's signature, the fence and the call number, then hands the
//! callback to the step and answers with what the step made of it. A refusal of a callback of a
//! known attempt voids that attempt.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::Error;
use super::attempts::{Callback, HUB, Refusal, Reply};
use super::signing;
use crate::config::RemoteSettings;

/// The largest callback body accepted (a model request with its conversation, a write's row).
const BODY_LIMIT: usize = 4 * 1024 * 1024;

/// Starts the callback listener on `remote.callback_listen` (once per process) and returns the
/// URL the endpoints are told to call back on.
pub async fn listen(settings: &RemoteSettings) -> Result<String, Error> {
    if let Some(base) = HUB.base() {
        return Ok(base.to_owned());
    }
    let addr = settings.callback_listen.clone();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| Error::Listen {
            addr: addr.clone(),
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| Error::Listen {
        addr: addr.clone(),
        source,
    })?;
    let base = match settings.callback_url.trim_end_matches('/') {
        "" => format!("http://{bound}/callbacks/v1"),
        url => format!("{url}/callbacks/v1"),
    };
    let router = Router::new()
        .route("/callbacks/v1/attempts/{token}/{*op}", post(callback))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "the step protocol's callback listener stopped; remote steps will fail until the process restarts");
        }
    });
    tracing::info!(listen = %bound, callback_url = %base, "listening for step-protocol callbacks");
    HUB.set_base(base.clone());
    Ok(HUB.base().unwrap_or(&base).to_owned())
}

fn refuse(status: StatusCode, code: &str, message: String) -> Response {
    let body = json!({ "error": { "code": code, "message": message } });
    (status, axum::Json(body)).into_response()
}

/// The callbacks' URL path: the attempt's token, then the op (`model`, `effect/begin`, ...).
#[derive(serde::Deserialize)]
struct Route {
    token: String,
    op: String,
}

async fn callback(Path(route): Path<Route>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let Route { token, op } = route;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let bearer = header("authorization").and_then(|v| v.strip_prefix("Bearer "));
    let secret = match HUB.secret(&token) {
        Ok(secret) if bearer == Some(token.as_str()) => secret,
        _ => {
            tracing::warn!(op = %op, code = "unknown_attempt", "a step-protocol callback was refused");
            return refuse(
                StatusCode::UNAUTHORIZED,
                "unknown_attempt",
                "no open attempt has this token: the attempt has ended (answered, timed out, its worker restarted) or the token is not one trailmark made; end the attempt".into(),
            );
        }
    };
    // From here the token is an open attempt's: a refusal voids that attempt.
    let refused = |status: StatusCode, code: &'static str, message: String| {
        tracing::warn!(op = %op, code, "a step-protocol callback was refused; its attempt is void");
        HUB.refuse(&token, format!("{code}: {message}"));
        refuse(status, code, message)
    };
    let signed = (header(signing::TIMESTAMP), header(signing::SIGNATURE));
    if let Err(e) = signing::verify(&secret, signed, "POST", uri.path(), &body, signing::now()) {
        return refused(StatusCode::UNAUTHORIZED, "bad_signature", e.to_string());
    }
    let (fence, call, body) = match envelope(&body) {
        Ok(parts) => parts,
        Err(why) => return refused(StatusCode::BAD_REQUEST, "bad_request", why),
    };
    let to_step = match HUB.admit(&token, fence, call) {
        Ok(to_step) => to_step,
        Err(refusal) => {
            let (status, code, message) = admission_refused(refusal);
            tracing::warn!(op = %op, code, "a step-protocol callback was refused; its attempt is void");
            return refuse(status, code, message);
        }
    };
    let (reply, answer) = oneshot::channel();
    let over = || {
        refuse(
            StatusCode::GONE,
            "attempt_over",
            "the attempt ended while this callback waited; its work is void".into(),
        )
    };
    if to_step.send(Callback { op, body, reply }).await.is_err() {
        return over();
    }
    match answer.await {
        Ok(Reply::Done(body)) => (StatusCode::OK, axum::Json(body)).into_response(),
        Ok(Reply::Refused(status, code, message)) => refuse(
            StatusCode::from_u16(status).unwrap_or(StatusCode::CONFLICT),
            code,
            message,
        ),
        Err(_) => over(),
    }
}

/// What a callback the hub did not admit is answered.
fn admission_refused(refusal: Refusal) -> (StatusCode, &'static str, String) {
    match refusal {
        Refusal::UnknownAttempt => (
            StatusCode::UNAUTHORIZED,
            "unknown_attempt",
            "the attempt has ended; end it".into(),
        ),
        Refusal::FencedOut { sent, attempt } => (
            StatusCode::CONFLICT,
            "fenced_out",
            format!(
                "fence {sent} is not this attempt's ({attempt}): a stale attempt writes nothing; end it"
            ),
        ),
        Refusal::OutOfOrder { sent, expected } => (
            StatusCode::CONFLICT,
            "out_of_order",
            format!(
                "callback number {sent} is not the next one ({expected}): a repeated or reordered callback is refused, and the attempt is void"
            ),
        ),
    }
}

/// The body's `fence` and `call`, and the rest of it.
fn envelope(body: &[u8]) -> Result<(i64, u64, Value), String> {
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let object = value
        .as_object_mut()
        .ok_or("the body must be a JSON object")?;
    let fence = object
        .remove("fence")
        .and_then(|f| f.as_i64())
        .ok_or("the body has no integer `fence`")?;
    let call = object
        .remove("call")
        .and_then(|c| c.as_u64())
        .ok_or("the body has no positive integer `call`")?;
    Ok((fence, call, value))
}

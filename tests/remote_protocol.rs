//! The step protocol from the endpoint's side, with an endpoint written here (in Rust, playing
//! another language): forged, tampered, stale and replayed callbacks are refused; an endpoint
//! that hangs, answers 500, answers garbage or drops the connection is a classified failure,
//! never a lost or doubled step. The Python SDK and its `chain` are tested in
//! tests/remote_python.rs.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::TestEnv;
use serde_json::{Value, json};
use trailmark::domain::RunStatus;
use trailmark::failpoint::Failpoints;
use trailmark::remote::signing;

const SECRET: &str = "a test secret of at least thirty-two bytes";

/// What the endpoint does with one attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Sends forged, tampered, stale and replayed callbacks, then good ones, then finishes.
    Forge,
    /// Never answers.
    Hang,
    /// Answers 500.
    Status500,
    /// Answers 404.
    Status404,
    /// Answers 200 with a body that is not JSON.
    Garbage,
    /// Drops the connection without answering.
    Drop,
    /// Reports a temporary error.
    Temporary,
    /// Reports an unknown error.
    Unknown,
    /// Begins an effect and answers without ending it.
    EffectOpen,
    /// Makes the effect (begin, end) and finishes.
    Finish,
}

#[derive(Default)]
struct Endpoint {
    modes: Mutex<VecDeque<Mode>>,
    /// Each attempt's (attempt, token, signature valid), in arrival order.
    calls: Mutex<Vec<(i64, String, bool)>>,
    /// What the forged callbacks were answered: (what, status, code).
    refusals: Mutex<Vec<(String, u16, String)>>,
}

fn app(ep: Arc<Endpoint>) -> Router {
    Router::new()
        .route("/ep/manifest", get(manifest))
        .route("/ep/step", post(step))
        .with_state(ep)
}

async fn manifest() -> axum::Json<Value> {
    axum::Json(json!({
        "protocol": "trailmark-step/1",
        "workflows": [{ "name": "rt", "version": 1,
            "steps": [{ "name": "s", "kind": "write", "key_recipe": "run_id:s" }] }]
    }))
}

async fn step(
    State(ep): State<Arc<Endpoint>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let signed = signing::verify(
        SECRET.as_bytes(),
        (h(signing::TIMESTAMP), h(signing::SIGNATURE)),
        "POST",
        uri.path(),
        &body,
        signing::now(),
    )
    .is_ok();
    let call: Value = serde_json::from_slice(&body).unwrap();
    let token = call["callback"]["token"].as_str().unwrap().to_owned();
    ep.calls
        .lock()
        .unwrap()
        .push((call["attempt"].as_i64().unwrap(), token, signed));
    let mode = ep.modes.lock().unwrap().pop_front().unwrap_or(Mode::Finish);
    let cb = Callbacks::of(&call);
    match mode {
        Mode::Forge => {
            forge(&ep, &cb).await;
            finish(&cb, 3).await
        }
        Mode::Hang => std::future::pending().await,
        Mode::Status500 => (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        Mode::Status404 => (StatusCode::NOT_FOUND, "no workflow rt here").into_response(),
        Mode::Garbage => (StatusCode::OK, "<html>oops</html>").into_response(),
        Mode::Drop => panic!("the endpoint drops the connection (a panicking handler)"),
        Mode::Temporary => error("temporary", "search API 503"),
        Mode::Unknown => error("unknown", "the invoice total is negative"),
        Mode::EffectOpen => {
            let began = cb
                .post(
                    "effect/begin",
                    1,
                    json!({"key": cb.key(), "request": {"n": 1}}),
                )
                .await;
            assert_eq!(began.1["state"], "call", "{began:?}");
            axum::Json(json!({"output": {}, "next": "finish"})).into_response()
        }
        Mode::Finish => finish(&cb, 1).await,
    }
}

fn error(class: &str, message: &str) -> Response {
    axum::Json(json!({"error": {"class": class, "message": message}})).into_response()
}

/// The effect under the run's key, then the end of the run.
async fn finish(cb: &Callbacks, first_call: u64) -> Response {
    let began = cb
        .post(
            "effect/begin",
            first_call,
            json!({"key": cb.key(), "request": {"n": 1}}),
        )
        .await;
    let result = match began.1["state"].as_str() {
        Some("done") => began.1["result"].clone(),
        _ => {
            let ended = cb
                .post(
                    "effect/end",
                    first_call + 1,
                    json!({"key": cb.key(), "result": {"made": true}}),
                )
                .await;
            ended.1["result"].clone()
        }
    };
    axum::Json(json!({"output": {"effect": result}, "next": "finish"})).into_response()
}

/// One attempt's callback address, token and fence.
struct Callbacks {
    url: String,
    token: String,
    fence: i64,
    run_id: String,
}

impl Callbacks {
    fn of(call: &Value) -> Self {
        Self {
            url: call["callback"]["url"].as_str().unwrap().to_owned(),
            token: call["callback"]["token"].as_str().unwrap().to_owned(),
            fence: call["fence"].as_i64().unwrap(),
            run_id: call["run_id"].as_str().unwrap().to_owned(),
        }
    }

    fn key(&self) -> String {
        format!("{}:s:0", self.run_id)
    }

    async fn post(&self, op: &str, call: u64, body: Value) -> (u16, Value) {
        let mut body = body;
        body["fence"] = json!(self.fence);
        body["call"] = json!(call);
        let bytes = serde_json::to_vec(&body).unwrap();
        self.send(op, &self.token, &bytes, &bytes).await
    }

    /// Sends `sent`, signed as if it were `signed`, with `token`.
    async fn send(&self, op: &str, token: &str, signed: &[u8], sent: &[u8]) -> (u16, Value) {
        let url = format!("{}/{op}", self.url);
        let path = url::Url::parse(&url).unwrap().path().to_owned();
        let ts = signing::now();
        let response = reqwest::Client::new()
            .post(&url)
            .header("authorization", format!("Bearer {token}"))
            .header(signing::TIMESTAMP, ts.to_string())
            .header(
                signing::SIGNATURE,
                signing::sign(SECRET.as_bytes(), ts, "POST", &path, signed),
            )
            .body(sent.to_vec())
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

/// The forged, tampered, stale and replayed callbacks, each answered before the good ones.
async fn forge(ep: &Endpoint, cb: &Callbacks) {
    let progress = |fence: i64, call: u64, line: &str| {
        serde_json::to_vec(&json!({"fence": fence, "call": call, "line": line})).unwrap()
    };
    let good = progress(cb.fence, 1, "hello");
    let cases = [
        (
            "forged token",
            cb.send("progress", "0f0f0f", &good, &good).await,
        ),
        (
            "tampered body",
            cb.send("progress", &cb.token, &good, &progress(cb.fence, 1, "bye"))
                .await,
        ),
        (
            "old fence",
            cb.send(
                "progress",
                &cb.token,
                &progress(cb.fence - 1, 1, "x"),
                &progress(cb.fence - 1, 1, "x"),
            )
            .await,
        ),
        (
            "first call",
            cb.send("progress", &cb.token, &good, &good).await,
        ),
        (
            "replayed call",
            cb.send("progress", &cb.token, &good, &good).await,
        ),
        (
            "model",
            cb.post(
                "model",
                2,
                json!({"request": {"messages": [{"role": "user", "content": "hi"}]}}),
            )
            .await,
        ),
    ];
    let mut seen = ep.refusals.lock().unwrap();
    for (what, (status, body)) in cases {
        let code = body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        seen.push((what.to_owned(), status, code));
    }
}

struct Setup {
    env: TestEnv,
    ep: Arc<Endpoint>,
    _running: common::Running,
}

/// A test environment whose worker serves workflow `rt` from the endpoint above, which takes
/// its attempts in `modes` (then finishes).
async fn setup(modes: &[Mode], step_timeout_secs: u64) -> Setup {
    let ep = Arc::new(Endpoint::default());
    ep.modes.lock().unwrap().extend(modes.iter().copied());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(axum::serve(listener, app(ep.clone())).into_future());
    // SAFETY: nextest runs each test in a process of its own, and nothing reads the environment
    // while this is set (before the engine exists).
    unsafe { std::env::set_var("TRAILMARK_REMOTE_SECRET_RT", SECRET) };
    let env = TestEnv::with(|s| {
        s.remote.endpoints = vec![format!("rt=http://127.0.0.1:{port}/ep")];
        s.worker.step_timeout_secs = step_timeout_secs;
        s.worker.retry_base_ms = 200;
    })
    .await;
    let mut registry = trailmark_reference::registry();
    trailmark::remote::register(&env.settings, &mut registry, true)
        .await
        .expect("the endpoint's manifest");
    let running = env.spawn_all(env.engine_with(registry, Failpoints::default()));
    Setup {
        env,
        ep,
        _running: running,
    }
}

impl Setup {
    async fn run(&self, id: &str, status: RunStatus) -> trailmark::store::runs::RunRow {
        self.env.start_run("rt", id, json!({})).await;
        self.env
            .wait_status(id, status, Duration::from_secs(60))
            .await
    }

    async fn effects_made(&self, id: &str) -> i64 {
        self.env
            .scalar(
                "SELECT count(*) FROM trailmark.effects WHERE run_id = $1",
                id,
            )
            .await
    }
}

#[tokio::test]
async fn forged_tampered_stale_and_replayed_callbacks_are_refused() {
    let s = setup(&[Mode::Forge], 30).await;
    let run = s.run("rp-forge", RunStatus::Succeeded).await;
    assert_eq!(run.output.unwrap()["effect"], json!({"made": true}));
    let seen = s.ep.refusals.lock().unwrap().clone();
    let expect = [
        ("forged token", 401, "unknown_attempt"),
        ("tampered body", 401, "bad_signature"),
        ("old fence", 409, "fenced_out"),
        ("first call", 200, ""),
        ("replayed call", 409, "out_of_order"),
        ("model", 200, ""),
    ];
    let got: Vec<(&str, u16, &str)> = seen
        .iter()
        .map(|(w, s, c)| (w.as_str(), *s, c.as_str()))
        .collect();
    assert_eq!(got, expect);
    // The worker signed its call, and the attempt's token dies with the attempt.
    let (_, token, signed) = s.ep.calls.lock().unwrap()[0].clone();
    assert!(signed, "the worker's step call carries a valid signature");
    // The listener runs already: this returns the base of the URL the worker gave the endpoint.
    let base = trailmark::remote::listen(&s.env.settings.remote)
        .await
        .unwrap();
    let late = Callbacks {
        url: format!("{base}/attempts/{token}"),
        token: token.clone(),
        fence: 0,
        run_id: "rp-forge".into(),
    };
    let body = serde_json::to_vec(&json!({"fence": 0, "call": 4, "line": "late"})).unwrap();
    let (status, answer) = late.send("progress", &token, &body, &body).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (401, Some("unknown_attempt"))
    );
    // The refused callbacks voided the first attempt although its endpoint answered an outcome:
    // its work was incomplete. The second attempt found the effect recorded.
    assert_eq!(s.env.attempts("rp-forge", 0).await, 2);
    assert_eq!(s.effects_made("rp-forge").await, 1);
    let answers = s
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND kind = 'model'",
            "rp-forge",
        )
        .await;
    assert_eq!(answers, 1, "the model answer is journaled once");
}

#[tokio::test]
async fn a_hanging_endpoint_is_cut_at_the_step_timeout_and_the_step_retried() {
    let s = setup(&[Mode::Hang], 2).await;
    s.run("rp-hang", RunStatus::Succeeded).await;
    let calls = s.ep.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_ne!(calls[0].1, calls[1].1, "each attempt has its own token");
    assert_eq!(s.env.attempts("rp-hang", 0).await, 2);
    assert_eq!(s.effects_made("rp-hang").await, 1);
}

#[tokio::test]
async fn an_endpoint_answering_500_or_dropping_the_connection_is_retried() {
    let s = setup(&[Mode::Status500, Mode::Drop, Mode::Temporary], 30).await;
    s.run("rp-flaky", RunStatus::Succeeded).await;
    assert_eq!(s.env.attempts("rp-flaky", 0).await, 4);
    assert_eq!(s.effects_made("rp-flaky").await, 1);
}

#[tokio::test]
async fn an_effect_left_open_is_made_again_under_the_same_key() {
    let s = setup(&[Mode::EffectOpen], 30).await;
    let run = s.run("rp-open", RunStatus::Succeeded).await;
    assert_eq!(run.output.unwrap()["effect"], json!({"made": true}));
    assert_eq!(s.env.attempts("rp-open", 0).await, 2);
    assert_eq!(s.effects_made("rp-open").await, 1);
}

#[tokio::test]
async fn garbage_a_refusal_or_an_unknown_error_stops_the_run_for_review() {
    let cases = [
        (Mode::Garbage, "a body that is not JSON"),
        (Mode::Status404, "refused the call with HTTP 404"),
        (Mode::Unknown, "the invoice total is negative"),
    ];
    for (i, (mode, says)) in cases.into_iter().enumerate() {
        let s = setup(&[mode], 30).await;
        let id = format!("rp-review-{i}");
        let run = s.run(&id, RunStatus::NeedsReview).await;
        let error = run.error.unwrap_or_default();
        assert!(error.contains(says), "{mode:?}: {error}");
        assert!(
            error.contains(&format!("run {id} step s")),
            "{mode:?} names run and step: {error}"
        );
        assert_eq!(s.effects_made(&id).await, 0);
    }
}

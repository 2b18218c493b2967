//! A deterministic OpenAI-compatible model server, so tests, the demo and benchmarks can
//! exercise real HTTP calls (and scripted failures) without a real model or its bill.
//!
//! Answers depend only on the request, so a replayed step can be checked word for word.

use std::collections::VecDeque;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use trailmark::model::{ChatMessage, ChatRequest, estimate_tokens};

/// How long [`ModelServer::shutdown`] waits for in-flight calls (e.g. scripted delays).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A custom answer source, so reference scenarios can make the stand-in say something specific.
pub type Responder = Arc<dyn Fn(&ChatRequest) -> Option<String> + Send + Sync>;

/// How the stand-in behaves; `Default` gives a plain server on any free port.
#[derive(Clone)]
pub struct ModelServerOptions {
    /// Size the deterministic answer is padded to, so benchmarks control payload size.
    pub answer_bytes: usize,
    /// Outcomes for the first calls, consumed in order; later calls answer normally.
    pub script: Vec<Scripted>,
    /// Port to bind on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// When it returns `Some(text)`, that text is the answer instead of the deterministic one.
    pub responder: Option<Responder>,
    /// Requests answered per sliding minute before it answers 429, as a provider does (0: no
    /// limit).
    pub requests_per_minute: u64,
    /// Tokens (prompt and answer) answered per sliding minute before it answers 429 (0: no
    /// limit).
    pub tokens_per_minute: u64,
}

impl Default for ModelServerOptions {
    fn default() -> Self {
        Self {
            answer_bytes: 64,
            script: Vec::new(),
            port: 0,
            responder: None,
            requests_per_minute: 0,
            tokens_per_minute: 0,
        }
    }
}

impl std::fmt::Debug for ModelServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelServerOptions")
            .field("answer_bytes", &self.answer_bytes)
            .field("script", &self.script)
            .field("port", &self.port)
            .field("responder", &self.responder.as_ref().map(|_| "<fn>"))
            .field("requests_per_minute", &self.requests_per_minute)
            .field("tokens_per_minute", &self.tokens_per_minute)
            .finish()
    }
}

/// One scripted outcome, so a test can make the model fail in a chosen way at a chosen call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scripted {
    /// Answer with this HTTP status and an OpenAI-style error body.
    Status(u16),
    /// Answer 429 with a `Retry-After` header of this many seconds.
    RateLimited {
        /// Value of the `Retry-After` header.
        retry_after_secs: u64,
    },
    /// Answer normally, but only after this delay (to trip client timeouts).
    Delay(Duration),
    /// Answer 200 with a JSON body that is not a chat completion.
    Malformed,
}

/// What the stand-in answered within a minute: requests and tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Requests answered.
    pub requests: u64,
    /// Their tokens, prompt and answer.
    pub tokens: u64,
}

/// The limits a provider enforces per sliding minute, and what the stand-in answered under them.
struct Window {
    requests_per_minute: u64,
    tokens_per_minute: u64,
    /// Answers of the last minute: when, and their tokens.
    answered: VecDeque<(Instant, u64)>,
    /// The most answered within any 60 s: the test's measure of the limit kept.
    busiest: Usage,
}

impl Window {
    /// Counts an answer of `tokens` now if the last minute leaves room for it; else how long
    /// until it would (the `Retry-After` of the 429).
    fn admit(&mut self, tokens: u64) -> Result<(), Duration> {
        let now = Instant::now();
        while self
            .answered
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= MINUTE)
        {
            self.answered.pop_front();
        }
        let requests = self.answered.len() as u64;
        let used: u64 = self.answered.iter().map(|(_, t)| t).sum();
        if self.fits(requests, used, tokens) {
            self.answered.push_back((now, tokens));
            self.busiest.requests = self.busiest.requests.max(requests + 1);
            self.busiest.tokens = self.busiest.tokens.max(used + tokens);
            return Ok(());
        }
        // The oldest answers leave first: the first whose leaving makes room is the wait.
        let (mut left, mut freed) = (0, 0);
        for (at, t) in &self.answered {
            left += 1;
            freed += t;
            if self.fits(requests - left, used - freed, tokens) {
                return Err(MINUTE.saturating_sub(now.duration_since(*at)));
            }
        }
        Err(MINUTE)
    }

    fn fits(&self, requests: u64, used: u64, tokens: u64) -> bool {
        (self.requests_per_minute == 0 || requests < self.requests_per_minute)
            && (self.tokens_per_minute == 0 || used + tokens <= self.tokens_per_minute)
    }
}

/// The window of a provider's per-minute limits.
const MINUTE: Duration = Duration::from_secs(60);

/// State shared by the handlers and the [`ModelServer`] handle.
struct Shared {
    calls: AtomicU64,
    answered: AtomicU64,
    /// 429s answered for a limit per minute (scripted ones not counted).
    rate_limited: AtomicU64,
    script: Mutex<VecDeque<Scripted>>,
    answer_bytes: usize,
    responder: Option<Responder>,
    window: Mutex<Window>,
}

impl Shared {
    fn new(opts: ModelServerOptions) -> Arc<Self> {
        Arc::new(Self {
            calls: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            script: Mutex::new(opts.script.into()),
            answer_bytes: opts.answer_bytes,
            responder: opts.responder,
            window: Mutex::new(Window {
                requests_per_minute: opts.requests_per_minute,
                tokens_per_minute: opts.tokens_per_minute,
                answered: VecDeque::new(),
                busiest: Usage::default(),
            }),
        })
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        // Every update leaves the window whole, so a poisoned lock is still usable.
        self.window.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn next_scripted(&self) -> Option<Scripted> {
        // A panicking handler cannot leave the queue half-updated, so a poisoned lock is still usable.
        self.script
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }
}

/// A running stand-in server; dropping it stops accepting, [`shutdown`](Self::shutdown) also waits.
pub struct ModelServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl ModelServer {
    /// Binds 127.0.0.1 and serves in the background, so a test owns its own model.
    pub async fn start(opts: ModelServerOptions) -> std::io::Result<ModelServer> {
        let listener = TcpListener::bind(("127.0.0.1", opts.port)).await?;
        let addr = listener.local_addr()?;
        let shared = Shared::new(opts);
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let task = tokio::spawn(serve(listener, shared.clone(), shutdown));
        Ok(ModelServer {
            addr,
            shared,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The value for `model.base_url`, e.g. `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        base_url(self.addr)
    }

    /// Every request to `/chat/completions`, scripted failures included, to count attempts.
    pub fn calls(&self) -> u64 {
        self.shared.calls.load(Ordering::SeqCst)
    }

    /// Successful answers only, to check that a paid answer was asked for once.
    pub fn answered(&self) -> u64 {
        self.shared.answered.load(Ordering::SeqCst)
    }

    /// The 429s it answered because a limit per minute was reached (scripted 429s not
    /// counted), to check that a fleet kept under the limit.
    pub fn rate_limited(&self) -> u64 {
        self.shared.rate_limited.load(Ordering::SeqCst)
    }

    /// The most it answered within any 60 s, requests and tokens, to check that usage in
    /// every minute stayed under the limits.
    pub fn busiest_minute(&self) -> Usage {
        self.shared.window().busiest
    }

    /// Stops the server and waits briefly for in-flight calls, so ports are freed between tests.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let Some(task) = self.task.take() else { return };
        let abort = task.abort_handle();
        // A scripted delay longer than the grace period must not hang the test that ends here.
        if tokio::time::timeout(SHUTDOWN_GRACE, task).await.is_err() {
            abort.abort();
        }
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Runs the stand-in in the foreground for `trailmark model-server`, until Ctrl-C.
pub async fn serve_forever(opts: ModelServerOptions) -> std::io::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", opts.port)).await?;
    let url = base_url(listener.local_addr()?);
    // Scripts and tests wait for this exact line to learn the port.
    let mut out = std::io::stdout().lock();
    writeln!(out, "model server listening on {url}")?;
    out.flush()?;
    drop(out);
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            // Without a signal handler the only way out is being killed, which is fine here.
            std::future::pending::<()>().await;
        }
    };
    serve(listener, Shared::new(opts), ctrl_c).await
}

/// The deterministic answer the engine itself records when no model is configured
/// ([`trailmark::model::offline::answer`]), so both stand-ins say the same thing.
pub fn standin_answer(req: &ChatRequest, answer_bytes: usize) -> String {
    trailmark::model::offline::answer(req, answer_bytes)
}

async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/stats", get(stats))
        .with_state(shared);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

fn base_url(addr: SocketAddr) -> String {
    format!("http://{addr}/v1")
}

/// The request body as the server reads it; the model name is echoed back.
#[derive(Deserialize)]
struct WireRequest {
    #[serde(default)]
    model: String,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
}

// The body is taken raw so that undecodable requests are still counted as calls.
async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let call = shared.calls.fetch_add(1, Ordering::SeqCst) + 1;
    match shared.next_scripted() {
        Some(Scripted::Status(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            error_response(status, &format!("scripted failure: HTTP {code}"))
        }
        Some(Scripted::RateLimited { retry_after_secs }) => {
            let headers = [(header::RETRY_AFTER, retry_after_secs.to_string())];
            let body = error_body("scripted rate limit");
            (StatusCode::TOO_MANY_REQUESTS, headers, Json(body)).into_response()
        }
        Some(Scripted::Malformed) => Json(json!({"object": "not.a.completion"})).into_response(),
        Some(Scripted::Delay(delay)) => {
            tokio::time::sleep(delay).await;
            answer(&shared, call, &body)
        }
        None => answer(&shared, call, &body),
    }
}

fn answer(shared: &Shared, call: u64, body: &[u8]) -> Response {
    let wire: WireRequest = match serde_json::from_slice(body) {
        Ok(wire) => wire,
        Err(e) => {
            return error_response(StatusCode::BAD_REQUEST, &format!("not a chat request: {e}"));
        }
    };
    let req = ChatRequest {
        messages: wire.messages,
        max_tokens: wire.max_tokens,
        temperature: wire.temperature,
    };
    let custom = shared.responder.as_ref().and_then(|respond| respond(&req));
    let content = custom.unwrap_or_else(|| standin_answer(&req, shared.answer_bytes));
    let (prompt, completion) = (req.estimated_prompt_tokens(), estimate_tokens(&content));
    if let Err(wait) = shared.window().admit(prompt + completion) {
        shared.rate_limited.fetch_add(1, Ordering::SeqCst);
        let secs = (wait.as_secs_f64().ceil() as u64).max(1);
        let headers = [(header::RETRY_AFTER, secs.to_string())];
        let body = error_body("rate limit reached for requests or tokens per minute");
        return (StatusCode::TOO_MANY_REQUESTS, headers, Json(body)).into_response();
    }
    let model = if wire.model.is_empty() {
        "stand-in".to_string()
    } else {
        wire.model
    };
    shared.answered.fetch_add(1, Ordering::SeqCst);
    Json(json!({
        "id": format!("chatcmpl-standin-{call}"),
        "object": "chat.completion",
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop",
        }],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }))
    .into_response()
}

async fn stats(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({
        "calls": shared.calls.load(Ordering::SeqCst),
        "answered": shared.answered.load(Ordering::SeqCst),
        "rate_limited": shared.rate_limited.load(Ordering::SeqCst),
        "busiest_minute": shared.window().busiest,
    }))
}

fn error_body(message: &str) -> Value {
    json!({"error": {"message": message, "type": "standin"}})
}

fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(error_body(message))).into_response()
}

#[cfg(test)]
#[path = "model_server_tests.rs"]
mod tests;

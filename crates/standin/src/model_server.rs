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
use std::time::Duration;

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
}

impl Default for ModelServerOptions {
    fn default() -> Self {
        Self {
            answer_bytes: 64,
            script: Vec::new(),
            port: 0,
            responder: None,
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

/// State shared by the handlers and the [`ModelServer`] handle.
struct Shared {
    calls: AtomicU64,
    answered: AtomicU64,
    script: Mutex<VecDeque<Scripted>>,
    answer_bytes: usize,
    responder: Option<Responder>,
}

impl Shared {
    fn new(opts: ModelServerOptions) -> Arc<Self> {
        Arc::new(Self {
            calls: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            script: Mutex::new(opts.script.into()),
            answer_bytes: opts.answer_bytes,
            responder: opts.responder,
        })
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

//! The ops API served by an in-process trailmark, with one token per role, for the API tests
//! (`api.rs`) and the OpenAPI tests (`openapi.rs`).

#![allow(dead_code)]

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::Value;
use trailmark::api::{Role, new_token};
use trailmark::config::Settings;
use trailmark::workflow::{Registry, StepError, StepKind, Workflow};

use crate::common::{self, TestEnv, closed_port};

/// Bound on every wait.
pub const WAIT: Duration = Duration::from_secs(60);

/// An in-process trailmark serving its API on a port of its own, with one token per role.
pub struct Api {
    // Fields drop in this order: the components stop before the environment is torn down (a
    // worker still running would declare the deleted queues again).
    pub _running: common::Running,
    pub env: TestEnv,
    pub base: String,
    pub http: reqwest::Client,
    pub viewer: String,
    pub operator: String,
    pub admin: String,
}

impl Api {
    /// With the registry's workflows and the test settings.
    pub async fn start(registry: Registry) -> Self {
        Self::start_with(registry, |_| {}).await
    }

    /// With the registry's workflows, and settings changed by `tweak`.
    pub async fn start_with(registry: Registry, tweak: impl FnOnce(&mut Settings)) -> Self {
        let (viewer, v) = new_token("vera", Role::Viewer);
        let (operator, o) = new_token("otto", Role::Operator);
        let (admin, a) = new_token("ada", Role::Admin);
        let port = closed_port();
        let env = TestEnv::with(|s| {
            s.api.listen = format!("127.0.0.1:{port}");
            s.api.tokens = vec![v, o, a];
            s.worker.retry_base_ms = 100;
            tweak(s);
        })
        .await;
        let engine = env.engine_with(registry, Default::default());
        let running = env.spawn_all(engine);
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        env.wait_until("the API to answer", WAIT, || async {
            http.get(format!("{base}/livez")).send().await.is_ok()
        })
        .await;
        Self {
            env,
            base,
            http,
            viewer,
            operator,
            admin,
            _running: running,
        }
    }

    /// The token of `role`.
    pub fn token(&self, role: Role) -> &str {
        match role {
            Role::Viewer => &self.viewer,
            Role::Operator => &self.operator,
            Role::Admin => &self.admin,
        }
    }

    /// A JSON request as a client sends it: the answer's status and JSON (or text).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        key: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request sent");
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    /// Rows in the audit trail.
    pub async fn audit_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM trailmark.audit")
            .fetch_one(&self.env.pool)
            .await
            .unwrap()
    }
}

impl Api {
    /// A request that announces a body of `length` bytes and sends none of it: the answer of a
    /// server that refuses from the header alone. Written on a bare socket because an HTTP
    /// client still writing a body the server refused can lose the answer to a broken pipe.
    pub async fn announced_body(&self, path: &str, length: usize) -> (StatusCode, Value) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let host = self.base.trim_start_matches("http://");
        let mut socket = tokio::net::TcpStream::connect(host)
            .await
            .expect("connected");
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {}\r\n\
             content-type: application/json\r\ncontent-length: {length}\r\n\
             connection: close\r\n\r\n",
            self.admin
        );
        socket.write_all(head.as_bytes()).await.expect("head sent");
        let mut answer = Vec::new();
        tokio::time::timeout(WAIT, socket.read_to_end(&mut answer))
            .await
            .expect("the server answered and closed within the wait")
            .expect("answer read");
        let answer = String::from_utf8_lossy(&answer);
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("a status line: {head}"));
        assert!(
            !head
                .to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "a refusal is short enough to come with its length: {head}"
        );
        let value = serde_json::from_str(body).unwrap_or(Value::String(body.to_string()));
        (StatusCode::from_u16(status).expect("a status"), value)
    }
}

impl Api {
    /// A raw request: any body bytes, any content type, extra headers.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
        headers: &[(&str, reqwest::header::HeaderValue)],
    ) -> (StatusCode, reqwest::header::HeaderMap, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .body(body);
        if !headers.iter().any(|(name, _)| *name == "authorization") {
            req = req.bearer_auth(&self.admin);
        }
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        for (name, value) in headers {
            req = req.header(*name, value.clone());
        }
        let resp = req.send().await.expect("request sent");
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap_or_default();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, headers, value)
    }
}

/// The test workflows and `extra`.
pub fn registry_with(extra: Workflow) -> Registry {
    let mut r = trailmark_testkit::registry();
    r.register(extra);
    r
}

/// A workflow that stops for review: its one step fails with an error nobody understands.
pub fn fragile() -> Workflow {
    Workflow::new("fragile", 1).step("break", StepKind::Read, |_ctx| async {
        Err(StepError::Unknown(
            "the supplier API answered nonsense".into(),
        ))
    })
}

//! The HTTP side of model calls: one POST, one classified outcome, no retries.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap};
use serde::{Deserialize, Serialize};
use url::Url;

use super::error::scrub;
use super::{ChatAnswer, ChatMessage, ChatRequest, Error, ModelSettings, Result};

/// How much of a server's error text is kept in [`Error::Rejected`].
const DETAIL_CHARS: usize = 300;

/// Calls one OpenAI-compatible endpoint; cheap to clone, so each worker task can hold one.
#[derive(Clone)]
pub struct ModelClient {
    http: reqwest::Client,
    conf: Arc<Conf>,
    model: Arc<str>,
}

/// The parts of the settings every clone shares.
struct Conf {
    endpoint: Url,
    /// The endpoint as errors and logs may show it: no userinfo, no query.
    shown: String,
    api_key: String,
    /// Everything that must never appear in an error message.
    secrets: Vec<String>,
    fallback_model: String,
    price_prompt: f64,
    price_completion: f64,
    limits: Limits,
    timeout: Duration,
}

/// An endpoint's fleet-wide limits per minute, from the settings (0: no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// `model.requests_per_minute`.
    pub requests_per_minute: u64,
    /// `model.tokens_per_minute`.
    pub tokens_per_minute: u64,
}

impl Limits {
    /// Whether any limit is set, so that unlimited endpoints cost no statement per call.
    pub fn any(&self) -> bool {
        self.requests_per_minute > 0 || self.tokens_per_minute > 0
    }
}

/// The body sent to `/chat/completions`.
#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: &'a [ChatMessage],
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
}

#[derive(Deserialize)]
struct WireAnswer {
    #[serde(default)]
    model: String,
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: WireMessage,
}

#[derive(Deserialize)]
struct WireMessage {
    content: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

impl ModelClient {
    /// Checks the settings once, up front, so a bad config fails at startup and not mid-run.
    pub fn new(settings: &ModelSettings) -> Result<Self> {
        let endpoint = endpoint_url(&settings.base_url)?;
        check_settings(settings, &endpoint)?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(settings.timeout_ms))
            // A redirect would resend the key to wherever it points; make the config say where.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Error::Config(format!("cannot build the HTTP client: {}", describe(e))))?;
        let password = endpoint.password().unwrap_or_default().to_string();
        let conf = Conf {
            shown: crate::redact::url(endpoint.as_str()),
            endpoint,
            api_key: settings.api_key.clone(),
            secrets: vec![settings.api_key.clone(), password],
            fallback_model: settings.fallback_model.trim().to_string(),
            price_prompt: settings.cost_per_1k_prompt_tokens,
            price_completion: settings.cost_per_1k_completion_tokens,
            limits: Limits {
                requests_per_minute: settings.requests_per_minute,
                tokens_per_minute: settings.tokens_per_minute,
            },
            timeout: Duration::from_millis(settings.timeout_ms),
        };
        Ok(Self {
            http,
            conf: Arc::new(conf),
            model: settings.model.trim().into(),
        })
    }

    /// The model this client asks, for logs and journal entries.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The endpoint as limits count it and metrics label it: the URL without credentials, and
    /// the model (the fallback model is another endpoint at the same URL).
    pub fn endpoint(&self) -> String {
        format!("{} {}", self.conf.shown, self.model)
    }

    /// The fleet-wide limits of this endpoint.
    pub fn limits(&self) -> Limits {
        self.conf.limits
    }

    /// The whole-call timeout, the longest one request can last.
    pub fn timeout(&self) -> Duration {
        self.conf.timeout
    }

    /// A client for the configured fallback model, so the caller can switch after retries run out.
    pub fn fallback(&self) -> Option<Self> {
        let name = self.conf.fallback_model.as_str();
        if name.is_empty() || name == &*self.model {
            return None;
        }
        Some(Self {
            model: name.into(),
            ..self.clone()
        })
    }

    /// Asks the model once and classifies any failure; the caller decides about retries.
    #[tracing::instrument(skip_all, fields(model = %self.model))]
    pub async fn chat(&self, req: &ChatRequest) -> Result<ChatAnswer> {
        let started = Instant::now();
        let (status, headers, body) = self.post(req).await?;
        let latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        if !status.is_success() {
            return Err(self.status_error(status, &headers, &body));
        }
        let answer = self.parse_answer(req, &body, latency_ms)?;
        tracing::debug!(
            model.prompt_tokens = answer.prompt_tokens,
            model.completion_tokens = answer.completion_tokens,
            model.latency_ms = answer.latency_ms,
            "model answered"
        );
        Ok(answer)
    }

    async fn post(&self, req: &ChatRequest) -> Result<(StatusCode, HeaderMap, Vec<u8>)> {
        let wire = WireRequest {
            model: &self.model,
            messages: &req.messages,
            max_tokens: req.max_tokens,
            temperature: req.temperature,
        };
        let mut call = self.http.post(self.conf.endpoint.clone()).json(&wire);
        if !self.conf.api_key.is_empty() {
            call = call.bearer_auth(&self.conf.api_key);
        }
        let resp = call.send().await.map_err(|e| self.transport_error(e))?;
        let (status, headers) = (resp.status(), resp.headers().clone());
        let body = resp.bytes().await.map_err(|e| self.transport_error(e))?;
        Ok((status, headers, body.to_vec()))
    }

    fn transport_error(&self, e: reqwest::Error) -> Error {
        if e.is_timeout() {
            return Error::Timeout;
        }
        let cause = scrub(&describe(e), &self.secrets(), DETAIL_CHARS);
        Error::Connect(format!("{}: {cause}", self.conf.shown))
    }

    fn status_error(&self, status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Error {
        let code = status.as_u16();
        match code {
            429 => Error::RateLimited {
                retry_after: retry_after(headers),
            },
            401 | 403 => Error::Auth { status: code },
            500..=599 => Error::Unavailable { status: code },
            _ if status.is_redirection() => Error::Rejected {
                status: code,
                detail: format!(
                    "{} redirects elsewhere; set model.base_url to the final address",
                    self.conf.shown
                ),
            },
            _ => Error::Rejected {
                status: code,
                detail: self.detail(body),
            },
        }
    }

    /// Pulls the human-readable part out of an error body, whatever shape the server uses.
    fn detail(&self, body: &[u8]) -> String {
        let text = match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(json) => error_text(&json).unwrap_or_else(|| json.to_string()),
            Err(_) => String::from_utf8_lossy(body).trim().to_string(),
        };
        if text.is_empty() {
            return "the response body gave no reason".to_string();
        }
        scrub(&text, &self.secrets(), DETAIL_CHARS)
    }

    fn parse_answer(&self, req: &ChatRequest, body: &[u8], latency_ms: u64) -> Result<ChatAnswer> {
        let wire: WireAnswer = serde_json::from_slice(body)
            .map_err(|e| Error::Malformed(scrub(&e.to_string(), &self.secrets(), DETAIL_CHARS)))?;
        let first = wire.choices.into_iter().next();
        let Some(content) = first.and_then(|c| c.message.content) else {
            return Err(Error::Malformed(
                "the answer has no choice with message content".into(),
            ));
        };
        // Budgets must keep counting even against servers that report no usage.
        let (prompt_tokens, completion_tokens) = match wire.usage {
            Some(u) => (u.prompt_tokens, u.completion_tokens),
            None => (
                req.estimated_prompt_tokens(),
                super::estimate_tokens(&content),
            ),
        };
        let cost = prompt_tokens as f64 / 1000.0 * self.conf.price_prompt
            + completion_tokens as f64 / 1000.0 * self.conf.price_completion;
        let model = if wire.model.is_empty() {
            self.model.to_string()
        } else {
            wire.model
        };
        Ok(ChatAnswer {
            content,
            model,
            prompt_tokens,
            completion_tokens,
            cost,
            latency_ms,
        })
    }

    fn secrets(&self) -> Vec<&str> {
        self.conf.secrets.iter().map(String::as_str).collect()
    }
}

// Hand-written so a client inside a derived-Debug struct never prints the key.
impl std::fmt::Debug for ModelClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelClient")
            .field("endpoint", &self.conf.shown)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

fn endpoint_url(base_url: &str) -> Result<Url> {
    let base = base_url.trim().trim_end_matches('/');
    if base.is_empty() {
        return Err(Error::Config(
            "model.base_url is empty, so no model is configured".into(),
        ));
    }
    let endpoint = format!("{base}/chat/completions");
    let url = Url::parse(&endpoint).map_err(|e| {
        let shown = crate::redact::url(base);
        Error::Config(format!("model.base_url {shown:?} is not a valid URL ({e})"))
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Error::Config(format!(
            "model.base_url must start with http:// or https://, not {}:",
            url.scheme()
        )));
    }
    Ok(url)
}

fn check_settings(settings: &ModelSettings, endpoint: &Url) -> Result<()> {
    if settings.model.trim().is_empty() {
        return Err(Error::Config(
            "model.model is empty; name the model to ask".into(),
        ));
    }
    if settings.timeout_ms == 0 {
        return Err(Error::Config(
            "model.timeout_ms is 0; give the call a time limit in milliseconds".into(),
        ));
    }
    let has_userinfo = !endpoint.username().is_empty() || endpoint.password().is_some();
    if has_userinfo && !settings.api_key.is_empty() {
        return Err(Error::Config(
            "model.base_url carries a user name or password and model.api_key is set too; use one of them".into(),
        ));
    }
    let bearer = format!("Bearer {}", settings.api_key);
    if header::HeaderValue::from_str(&bearer).is_err() {
        return Err(Error::Config(
            "model.api_key contains characters not allowed in an HTTP header".into(),
        ));
    }
    Ok(())
}

/// Reads `Retry-After` as seconds or as an HTTP date.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let raw = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = raw.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = chrono::DateTime::parse_from_rfc2822(raw).ok()?;
    let wait = when.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(wait.to_std().unwrap_or(Duration::ZERO))
}

/// Finds the message in the usual error shapes: `{"error":{"message":..}}`, `{"error":".."}`, `{"message":..}`.
fn error_text(json: &serde_json::Value) -> Option<String> {
    let candidates = [
        json.pointer("/error/message"),
        json.get("error"),
        json.get("message"),
    ];
    candidates
        .into_iter()
        .flatten()
        .find_map(|v| v.as_str().map(str::to_string))
}

/// The cause chain of a transport error, without the URL (it may carry a password).
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, "12".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(12)));
        let soon = chrono::Utc::now() + chrono::Duration::seconds(30);
        headers.insert(header::RETRY_AFTER, soon.to_rfc2822().parse().unwrap());
        let wait = retry_after(&headers).unwrap();
        assert!(
            wait > Duration::from_secs(25) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        headers.insert(header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&headers), None);
    }
}

//! Model calls: a small client for any OpenAI-compatible `/chat/completions` endpoint.
//!
//! The client makes exactly one HTTP call per [`ModelClient::chat`] and never retries: the
//! engine decides what to do with a failure from [`Error::is_temporary`], and
//! journals every answer it gets, so a hidden retry here would be a hidden cost.

mod client;
mod error;
pub mod offline;

pub use client::{Limits, ModelClient};
pub use error::{Error, Result};

use serde::{Deserialize, Serialize};

/// Where the model lives and what it costs; read from the `[model]` config section.
#[derive(Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelSettings {
    /// Base URL of the API, e.g. `https://api.example.com/v1`; empty means no model is configured.
    pub base_url: String,
    /// Model name sent with every request.
    pub model: String,
    /// Bearer API key; empty sends no `Authorization` header. Never logged or shown.
    pub api_key: String,
    /// Whole-call timeout (connect, send, read the answer) in milliseconds.
    pub timeout_ms: u64,
    /// Model the caller may switch to when the main one keeps failing; empty means none.
    pub fallback_model: String,
    /// Price of 1,000 prompt tokens, used to compute [`ChatAnswer::cost`].
    pub cost_per_1k_prompt_tokens: f64,
    /// Price of 1,000 completion tokens, used to compute [`ChatAnswer::cost`].
    pub cost_per_1k_completion_tokens: f64,
    /// Requests the whole fleet may send the endpoint per minute (0: no limit), so it stays
    /// under the provider's limit instead of being refused; the fallback model has the same.
    pub requests_per_minute: u64,
    /// Tokens (prompt and answer) the whole fleet may use at the endpoint per minute (0: no
    /// limit), counted from the journaled usage; the fallback model has the same.
    pub tokens_per_minute: u64,
}

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            base_url: String::new(),
            model: String::new(),
            api_key: String::new(),
            timeout_ms: 30_000,
            fallback_model: String::new(),
            cost_per_1k_prompt_tokens: 0.0,
            cost_per_1k_completion_tokens: 0.0,
            requests_per_minute: 0,
            tokens_per_minute: 0,
        }
    }
}

impl ModelSettings {
    /// Tells the engine whether to call a real model or fall back to the stand-in answer.
    pub fn is_configured(&self) -> bool {
        !self.base_url.trim().is_empty()
    }
}

// Hand-written so that settings can be logged or shown in a panic without leaking secrets.
impl std::fmt::Debug for ModelSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = if self.api_key.is_empty() {
            ""
        } else {
            "<redacted>"
        };
        f.debug_struct("ModelSettings")
            .field("base_url", &crate::redact::url(&self.base_url))
            .field("model", &self.model)
            .field("api_key", &key)
            .field("timeout_ms", &self.timeout_ms)
            .field("fallback_model", &self.fallback_model)
            .field("cost_per_1k_prompt_tokens", &self.cost_per_1k_prompt_tokens)
            .field(
                "cost_per_1k_completion_tokens",
                &self.cost_per_1k_completion_tokens,
            )
            .field("requests_per_minute", &self.requests_per_minute)
            .field("tokens_per_minute", &self.tokens_per_minute)
            .finish()
    }
}

/// One message of a conversation, in the wire shape the API expects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// Builds the instruction message that opens a conversation.
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: "system".into(),
            content: content.into(),
        }
    }

    /// Builds a message carrying the step's input.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }

    /// Builds a message replaying an earlier model answer into the conversation.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: "assistant".into(),
            content: content.into(),
        }
    }
}

/// What a step asks the model; the model name comes from the client's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Upper bound on answer length; `None` leaves it to the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sampling temperature; `None` leaves it to the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
}

impl ChatRequest {
    /// Builds a request with server defaults for length and temperature.
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            max_tokens: None,
            temperature: None,
        }
    }

    /// Approximate prompt size, for budgets when the server reports no usage.
    pub fn estimated_prompt_tokens(&self) -> u64 {
        let chars: usize = self
            .messages
            .iter()
            .map(|m| m.content.chars().count())
            .sum();
        tokens_for_chars(chars)
    }

    /// What the call may use, reserved against an endpoint's tokens-per-minute limit until its
    /// answer says what it did use: the prompt estimate plus `max_tokens`, the bound of the
    /// answer (providers estimate a request against such a limit the same way when it arrives:
    /// the prompt's size plus `max_tokens`). Without `max_tokens` nothing bounds the answer, and
    /// the reservation holds the prompt only until the answer arrives.
    pub fn estimated_tokens(&self) -> u64 {
        self.estimated_prompt_tokens() + u64::from(self.max_tokens.unwrap_or(0))
    }
}

/// One model answer with what it cost; this is what the engine journals word for word.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatAnswer {
    /// The assistant's text.
    pub content: String,
    /// The model that answered, as reported by the server.
    pub model: String,
    /// Prompt tokens, as reported by the server (estimated if it reports none).
    pub prompt_tokens: u64,
    /// Completion tokens, as reported by the server (estimated if it reports none).
    pub completion_tokens: u64,
    /// Price of this call from the settings' per-1k prices.
    pub cost: f64,
    /// Wall-clock time of the HTTP call, from sending to having the whole body.
    pub latency_ms: u64,
}

/// Rough token count (one token per four characters, rounded up) for budgets and the stand-in.
pub fn estimate_tokens(text: &str) -> u64 {
    tokens_for_chars(text.chars().count())
}

fn tokens_for_chars(chars: usize) -> u64 {
    (chars as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_default_to_unconfigured_with_thirty_second_timeout() {
        let s = ModelSettings::default();
        assert!(!s.is_configured());
        assert_eq!(s.timeout_ms, 30_000);
        let s: ModelSettings = serde_json::from_str(r#"{"base_url":"http://x/v1"}"#).unwrap();
        assert!(s.is_configured());
        assert_eq!(s.timeout_ms, 30_000);
    }

    #[test]
    fn settings_debug_hides_key_and_url_password() {
        let s = ModelSettings {
            base_url: "https://bob:hunter2@api.example.com/v1".into(),
            api_key: "sk-secret-123".into(),
            ..ModelSettings::default()
        };
        let shown = format!("{s:?}");
        assert!(!shown.contains("sk-secret-123"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("api.example.com"), "{shown}");
    }

    #[test]
    fn request_omits_unset_options_on_the_wire() {
        let req = ChatRequest::new(vec![ChatMessage::user("hi")]);
        let json = serde_json::to_value(&req).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"messages":[{"role":"user","content":"hi"}]})
        );
    }

    #[test]
    fn tokens_round_up_per_four_chars() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        let mut req = ChatRequest::new(vec![ChatMessage::system("abc"), ChatMessage::user("de")]);
        assert_eq!(req.estimated_prompt_tokens(), 2);
        assert_eq!(req.estimated_tokens(), 2, "no max_tokens: the prompt only");
        req.max_tokens = Some(64);
        assert_eq!(req.estimated_tokens(), 66, "the prompt and the longest answer");
    }
}

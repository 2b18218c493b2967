//! Model call failures, split by how the caller reacts, and the redaction they rely on.

use std::time::Duration;

/// Result of a model call.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a model call failed; the variant tells the caller whether to retry, stop or ask a person.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The endpoint said 429; wait (at least `retry_after` if it said how long) and retry.
    #[error(
        "model endpoint is rate limiting this client (HTTP 429){}; wait and retry, or lower the request rate",
        retry_hint(.retry_after)
    )]
    RateLimited {
        /// The server's `Retry-After`, if it sent a usable one.
        retry_after: Option<Duration>,
    },
    /// The endpoint answered 5xx: a fault on its side that usually passes.
    #[error(
        "model endpoint is unavailable (HTTP {status}); this is usually brief, retry with backoff"
    )]
    Unavailable {
        /// The HTTP status received.
        status: u16,
    },
    /// No complete answer arrived within `timeout_ms`.
    #[error(
        "model call timed out before a complete answer arrived; retry, or raise model.timeout_ms if answers are long"
    )]
    Timeout,
    /// The endpoint could not be reached or dropped the connection.
    #[error(
        "cannot reach the model endpoint ({0}); check that it is running and that model.base_url is right, then retry"
    )]
    Connect(String),
    /// 401/403: the key is missing, wrong or lacks permission; retrying cannot help.
    #[error(
        "model endpoint refused the credentials (HTTP {status}); fix model.api_key or its permissions in the config, then resume the run"
    )]
    Auth {
        /// The HTTP status received.
        status: u16,
    },
    /// Any other non-success status: the request itself is wrong for this endpoint.
    #[error(
        "model endpoint rejected the request (HTTP {status}): {detail}; check model.model, model.base_url and max_tokens, then resume the run"
    )]
    Rejected {
        /// The HTTP status received.
        status: u16,
        /// The server's explanation, shortened, with secrets removed.
        detail: String,
    },
    /// A success status whose body is not a chat completion.
    #[error(
        "model endpoint answered with something that is not a chat completion ({0}); retry, and check that model.base_url points at an OpenAI-compatible API"
    )]
    Malformed(String),
    /// The settings cannot be used to build a client; raised by [`ModelClient::new`](super::ModelClient::new).
    #[error("model settings are not usable: {0}; fix the [model] section of the config")]
    Config(String),
}

impl Error {
    /// Tells the caller whether the same request may succeed later (retry with backoff) or
    /// needs a person (stop, `needs_review`).
    pub fn is_temporary(&self) -> bool {
        match self {
            Error::RateLimited { .. }
            | Error::Unavailable { .. }
            | Error::Timeout
            | Error::Connect(_)
            | Error::Malformed(_) => true,
            Error::Auth { .. } | Error::Rejected { .. } | Error::Config(_) => false,
        }
    }
}

fn retry_hint(retry_after: &Option<Duration>) -> String {
    match retry_after {
        Some(d) => format!(", it asks to wait {} s", d.as_secs_f64()),
        None => String::new(),
    }
}

/// Removes every secret the client knows from text that came from elsewhere, and shortens it.
pub(crate) fn scrub(text: &str, secrets: &[&str], max_chars: usize) -> String {
    let mut out = crate::redact::text(text, secrets);
    if out.chars().count() > max_chars {
        out = out.chars().take(max_chars).collect::<String>() + "…";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_auth_rejected_and_config_are_permanent() {
        let temporary = [
            Error::RateLimited { retry_after: None },
            Error::Unavailable { status: 503 },
            Error::Timeout,
            Error::Connect("reset".into()),
            Error::Malformed("no choices".into()),
        ];
        assert!(temporary.iter().all(Error::is_temporary));
        let permanent = [
            Error::Auth { status: 401 },
            Error::Rejected {
                status: 400,
                detail: "bad".into(),
            },
            Error::Config("bad url".into()),
        ];
        assert!(!permanent.iter().any(Error::is_temporary));
    }

    #[test]
    fn rate_limit_message_says_how_long_to_wait() {
        let e = Error::RateLimited {
            retry_after: Some(Duration::from_secs(7)),
        };
        assert!(e.to_string().contains("wait 7 s"), "{e}");
        let e = Error::RateLimited { retry_after: None };
        assert!(e.to_string().contains("(HTTP 429); wait"), "{e}");
    }

    #[test]
    fn redacted_url_keeps_host_and_drops_credentials() {
        let shown = crate::redact::url("https://bob:hunter2@api.example.com/v1?key=abc");
        assert_eq!(shown, "https://bob:***@api.example.com/v1?key=***");
        assert!(!crate::redact::url("bob:pw@@ bad").contains("pw"));
    }

    #[test]
    fn scrub_removes_secrets_and_shortens() {
        assert_eq!(
            scrub("key sk-1 echoed", &["sk-1", ""], 100),
            "key *** echoed"
        );
        assert_eq!(scrub("abcdef", &[], 3), "abc…");
    }
}

//! Step errors, classified where they happen (see "Failures" in docs/ARCHITECTURE.md).

use std::time::Duration;

/// How a step failed; the class decides what the engine does next.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// Timeout, 429, 5xx, reset: retried with backoff under the same keys.
    #[error("temporary failure: {reason}")]
    Temporary {
        /// What failed.
        reason: String,
        /// A delay the remote side asked for.
        retry_after: Option<Duration>,
    },
    /// A tool's circuit breaker refused the call, so none was made: the step waits, holding no
    /// lease, until the breaker lets a probe through, and the wait spends no attempt.
    #[error(
        "waiting for the circuit breaker of {tool}: no call is made while it is open, the step tries again at {} (not counted as an attempt)",
        .until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )]
    BreakerOpen {
        /// The tool whose breaker is open.
        tool: String,
        /// How long until the breaker lets a probe through.
        wait: Duration,
        /// When that is.
        until: chrono::DateTime<chrono::Utc>,
    },
    /// A model endpoint's fleet-wide limit per minute has no room for the call, so none was
    /// made: the step waits, holding no lease, until enough of the last minute's usage has left
    /// the window, and the wait spends no attempt (as for an open breaker).
    #[error(
        "waits for the model's {limit} at {endpoint}: no call is made until enough of the last minute's use has aged out, the step tries again at {} (not counted as an attempt)",
        .until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )]
    Throttled {
        /// Which limit, with the window's usage: `tokens-per-minute limit (N of M used, ...)`.
        limit: String,
        /// The endpoint (`URL model`).
        endpoint: String,
        /// How long until the call fits.
        wait: Duration,
        /// When that is.
        until: chrono::DateTime<chrono::Utc>,
    },
    /// Credentials or configuration: stop at once, no retries.
    #[error("tool auth/config failure: {0}")]
    Auth(String),
    /// An idempotency key reused with a different request.
    #[error("{0}")]
    Conflict(String),
    /// A guard stopped the run: budget exhausted, repeated action, run timeout.
    #[error("{0}")]
    Guard(String),
    /// Anything not understood: stop and hand over.
    #[error("{0}")]
    Unknown(String),
    /// A newer worker owns the run; this execution's work is void.
    #[error("fenced out: a newer worker owns this run")]
    FencedOut,
    /// Trailmark's own database or broker failed; the delivery is retried as a whole.
    #[error("infrastructure failure: {0}")]
    Infrastructure(String),
}

impl StepError {
    /// The class name shown in handover notes and logs.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Temporary { .. } => "temporary",
            Self::BreakerOpen { .. } => "breaker_open",
            Self::Throttled { .. } => "throttled",
            Self::Auth(_) => "tool_auth",
            Self::Conflict(_) => "conflict",
            Self::Guard(_) => "guard",
            Self::Unknown(_) => "unknown",
            Self::FencedOut => "fenced_out",
            Self::Infrastructure(_) => "infrastructure",
        }
    }

    /// A temporary error with no requested delay.
    pub fn temporary(reason: impl Into<String>) -> Self {
        Self::Temporary {
            reason: reason.into(),
            retry_after: None,
        }
    }

    /// The refusal of `tool`'s open breaker, which lets a probe through after `wait`.
    pub fn breaker_open(tool: &str, wait: Duration) -> Self {
        let until = chrono::Utc::now() + chrono::Duration::from_std(wait).unwrap_or_default();
        Self::BreakerOpen {
            tool: tool.to_owned(),
            wait,
            until,
        }
    }

    /// The refusal of a model endpoint's `limit` (which, and how full), with room after `wait`.
    pub fn throttled(limit: String, endpoint: &str, wait: Duration) -> Self {
        let until = chrono::Utc::now() + chrono::Duration::from_std(wait).unwrap_or_default();
        Self::Throttled {
            limit,
            endpoint: endpoint.to_owned(),
            wait,
            until,
        }
    }

    /// For a wait that spends no attempt (an open breaker, a model's rate limit: no call was
    /// made), how long until the step may go on.
    pub fn uncounted_wait(&self) -> Option<Duration> {
        match self {
            Self::BreakerOpen { wait, .. } | Self::Throttled { wait, .. } => Some(*wait),
            _ => None,
        }
    }
}

impl From<crate::guard::Stop> for StepError {
    fn from(stop: crate::guard::Stop) -> Self {
        Self::Guard(stop.0)
    }
}

/// Classify an error at the call site: `call().await.retryable()?` or `.fatal()?`.
pub trait ResultExt<T> {
    /// The failure is temporary: retry.
    fn retryable(self) -> Result<T, StepError>;
    /// The failure is not understood: stop the run and hand over.
    fn fatal(self) -> Result<T, StepError>;
}

impl<T, E: std::fmt::Display> ResultExt<T> for Result<T, E> {
    fn retryable(self) -> Result<T, StepError> {
        self.map_err(|e| StepError::temporary(e.to_string()))
    }
    fn fatal(self) -> Result<T, StepError> {
        self.map_err(|e| StepError::Unknown(e.to_string()))
    }
}

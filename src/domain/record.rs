//! What a step records about the outside world the moment it knows it: model answers (journal
//! entries) and outside calls (effects, an intent before the call and a result after it).

use serde::Serialize;
use serde_json::Value;

use super::{Fence, IdempotencyKey, RunId};

/// One recorded model call, kept word for word so that a replayed step pays for nothing twice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JournalEntry {
    /// Step position.
    pub seq: i32,
    /// Call number inside the step execution (0-based).
    pub call_no: i32,
    /// `model` or `tool`.
    pub kind: String,
    /// SHA-256 of the request ([`request_hash`]).
    pub request_hash: String,
    /// The answer.
    pub response: Value,
    /// Tokens used.
    pub tokens: i64,
    /// Cost in the configured currency.
    pub cost: f64,
    /// Latency of the original call.
    pub latency_ms: i64,
}

/// An outside call about to be made, as recorded before it is made.
#[derive(Debug, Clone)]
pub struct EffectIntent {
    /// The key the receiving system enforces.
    pub key: IdempotencyKey,
    /// The tool's name.
    pub tool: String,
    /// The run.
    pub run_id: RunId,
    /// The step position.
    pub seq: i32,
    /// SHA-256 of the request ([`request_hash`]).
    pub request_hash: String,
    /// The caller's fence: no intent is recorded unless it is current.
    pub fence: Fence,
    /// The run's tool-call budget (0: none).
    pub max_calls: u64,
    /// Identical calls allowed before it counts as a loop (0: no limit).
    pub repeat_limit: u64,
}

/// What is known about a key before calling out.
#[derive(Debug, Clone, PartialEq)]
pub enum EffectState {
    /// Nothing: the intent was just recorded; call out.
    New,
    /// An intent was recorded earlier but no result: the call may have happened.
    Unknown,
    /// The call finished earlier; here is its result.
    Done(Value),
}

/// What recording an intent found.
#[derive(Debug, Clone, PartialEq)]
pub enum IntentOutcome {
    /// The key's state.
    Recorded(EffectState),
    /// A new call would exceed a limit; no intent was recorded.
    OverLimit(ToolUsage),
}

/// The run's tool calls so far, excluding the key asked about (a replay never counts twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolUsage {
    /// All calls of the run.
    pub calls: i64,
    /// Calls to the same tool with the same request hash.
    pub repeats: i64,
}

/// An outside write a shadow run would have made: recorded instead of made.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ShadowWrite {
    /// The position that would have made it.
    pub seq: i32,
    /// `effect` or `message`.
    pub kind: String,
    /// Its idempotency key.
    pub key: String,
    /// The tool, or `exchange/routing key` of a message.
    pub target: String,
    /// The request (an effect's request, a message's body).
    pub request: Value,
}

/// What a run has spent on models so far, for its budget.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spent {
    /// Journal entries.
    pub entries: i64,
    /// Tokens.
    pub tokens: i64,
    /// Cost.
    pub cost: f64,
}

/// SHA-256 of a JSON value, hex: the request hash of journal entries and effects, which tells a
/// replayed call from a different one under the same key.
pub fn request_hash(value: &Value) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(value.to_string().as_bytes()))
}

/// A model call about to be made to an endpoint with limits per minute, as it asks for room.
#[derive(Debug, Clone)]
pub struct ModelAsk<'a> {
    /// The endpoint (`base_url model`, without credentials).
    pub endpoint: &'a str,
    /// Requests per minute allowed (0: no limit).
    pub requests_per_minute: u64,
    /// Tokens per minute allowed (0: no limit).
    pub tokens_per_minute: u64,
    /// The call's estimated tokens (an upper bound of the prompt's and the answer's).
    pub estimate: u64,
    /// The longest the call can last, answer journaled: an unanswered reservation counts until
    /// a minute after that.
    pub hold: std::time::Duration,
    /// The run and position making the call, kept with the reservation for operators.
    pub run_id: &'a str,
    /// See `run_id`.
    pub seq: i32,
}

/// Whether the window had room for the call.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Reserved: the reservation's id, to record the call's real usage under.
    Reserved {
        /// The reservation.
        id: i64,
        /// The window's usage before this call: requests, tokens.
        used: (u64, u64),
    },
    /// No room: nothing is reserved.
    Full {
        /// The window's usage: requests, tokens.
        used: (u64, u64),
        /// How long until enough usage has left the window for the call to fit.
        wait: std::time::Duration,
    },
}

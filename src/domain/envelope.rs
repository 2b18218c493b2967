//! The two message bodies trailmark exchanges: the run-start event (published by upstream
//! services, in any language) and the step message (published by the relay).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{MessageId, RunId, StepAddress};

/// Routing key of run-start events on the `<prefix>.runs` exchange.
pub const RUN_START_ROUTING_KEY: &str = "run.start";
/// Routing key of step messages on the `<prefix>.steps` exchange.
pub const STEP_ROUTING_KEY: &str = "step";

/// Why a body could not be turned into a message; becomes the DLQ reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The body is larger than the configured limit.
    #[error("oversized: body is {size} bytes, limit is {limit}")]
    Oversized {
        /// Body size in bytes.
        size: usize,
        /// Configured limit.
        limit: usize,
    },
    /// Not JSON of the expected shape.
    #[error("undecodable: {0}")]
    Undecodable(String),
    /// A `v` this build does not understand.
    #[error("unsupported envelope version {0}: this build reads version 1")]
    UnsupportedVersion(u64),
}

impl DecodeError {
    /// A short machine-readable reason, used for `dlq requeue --reason`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Oversized { .. } => "oversized",
            Self::Undecodable(_) => "undecodable",
            Self::UnsupportedVersion(_) => "unsupported_version",
        }
    }
}

/// Event that starts a run; `run_id` makes it idempotent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunStartEvent {
    /// Envelope version, always 1 for now.
    pub v: u64,
    /// Caller-chosen run id.
    pub run_id: RunId,
    /// Registered workflow name.
    pub workflow: String,
    /// Workflow input; `{}` when absent.
    #[serde(default = "empty_object")]
    pub input: Value,
    /// Where the run stands among runs waiting for a slot of its key (0 to 4; 2 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<crate::flow::Priority>,
    /// The workflow version the run starts on (pinned for its whole life); the newest the
    /// receiving worker carries when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i32>,
}

/// One step to execute: which run, which step, at which position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepMessage {
    /// Envelope version, always 1 for now.
    pub v: u64,
    /// Dedup key of this message.
    pub message_id: MessageId,
    /// The run.
    pub run_id: RunId,
    /// Workflow name.
    pub workflow: String,
    /// Workflow version the run follows.
    pub version: i32,
    /// The step to run (a declared step, or a compensation).
    pub step: StepAddress,
    /// Position in the run (0-based); a message whose seq is behind the run is stale.
    pub seq: i32,
    /// The run's trace context, from the delivery's `traceparent` header (not in the body): the
    /// next step's message carries it on.
    #[serde(skip)]
    pub trace: Option<String>,
}

/// A message to publish once the surrounding transaction commits.
#[derive(Debug, Clone)]
pub struct OutgoingMessage {
    /// Becomes the AMQP `message_id` and the consumer's dedup key.
    pub message_id: MessageId,
    /// Target exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// String headers.
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub body: Vec<u8>,
    /// How long the relay leaves the row alone, because its committer publishes it itself.
    pub relay_after_ms: i64,
    /// The committer's presence backend pid: once that backend is gone, the relay takes the row
    /// without waiting for `relay_after_ms`.
    pub holder_pid: Option<i32>,
}

impl OutgoingMessage {
    /// The message with the run's trace context as its `traceparent` header (unchanged
    /// without one).
    pub fn traced(mut self, traceparent: Option<&str>) -> Self {
        if let Some(tp) = traceparent {
            self.headers
                .insert(crate::trace::TRACEPARENT.to_owned(), tp.to_owned());
        }
        self
    }
}

/// How a committer that publishes its messages itself marks their outbox rows: the relay
/// leaves a row alone for `relay_after_ms`, or until the `holder_pid` backend is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EagerHold {
    /// How long the relay leaves the rows alone.
    pub relay_after_ms: i64,
    /// The committer's presence backend pid.
    pub holder_pid: Option<i32>,
}

impl EagerHold {
    /// Marks `messages` as held by their committer.
    pub fn apply(&self, messages: &mut [OutgoingMessage]) {
        for m in messages {
            m.relay_after_ms = self.relay_after_ms;
            m.holder_pid = self.holder_pid;
        }
    }
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

pub(super) fn decode<T: serde::de::DeserializeOwned>(
    body: &[u8],
    limit: usize,
) -> Result<T, DecodeError> {
    if body.len() > limit {
        return Err(DecodeError::Oversized {
            size: body.len(),
            limit,
        });
    }
    // Read the version first, so a future envelope is reported as such rather than as garbage.
    let raw: Value =
        serde_json::from_slice(body).map_err(|e| DecodeError::Undecodable(e.to_string()))?;
    match raw.get("v").and_then(Value::as_u64) {
        Some(1) => {}
        Some(v) => return Err(DecodeError::UnsupportedVersion(v)),
        None => return Err(DecodeError::Undecodable("missing numeric field `v`".into())),
    }
    serde_json::from_value(raw).map_err(|e| DecodeError::Undecodable(e.to_string()))
}

impl RunStartEvent {
    /// Builds a version-1 event.
    pub fn new(run_id: RunId, workflow: impl Into<String>, input: Value) -> Self {
        Self {
            v: 1,
            run_id,
            workflow: workflow.into(),
            input,
            priority: None,
            version: None,
        }
    }
    /// Parses a body, refusing oversized, malformed and future-version events.
    pub fn decode(body: &[u8], limit: usize) -> Result<Self, DecodeError> {
        decode(body, limit)
    }
    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a run-start event always serialises")
    }
}

impl StepMessage {
    /// Parses a body, refusing oversized, malformed and future-version messages.
    pub fn decode(body: &[u8], limit: usize) -> Result<Self, DecodeError> {
        decode(body, limit)
    }
    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a step message always serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_start_event_decodes_and_defaults_input() {
        let e =
            RunStartEvent::decode(br#"{"v":1,"run_id":"r1","workflow":"chain"}"#, 1024).unwrap();
        assert_eq!(e.run_id.as_str(), "r1");
        assert_eq!(e.input, serde_json::json!({}));
    }

    #[test]
    fn bad_bodies_get_distinct_reasons() {
        let big = vec![b' '; 2048];
        assert_eq!(
            RunStartEvent::decode(&big, 1024).unwrap_err().code(),
            "oversized"
        );
        assert_eq!(
            RunStartEvent::decode(b"{nope", 1024).unwrap_err().code(),
            "undecodable"
        );
        let v2 = br#"{"v":2,"run_id":"r1","workflow":"chain"}"#;
        assert_eq!(
            RunStartEvent::decode(v2, 1024).unwrap_err().code(),
            "unsupported_version"
        );
        let bad_id = br#"{"v":1,"run_id":"has space","workflow":"chain"}"#;
        assert_eq!(
            RunStartEvent::decode(bad_id, 1024).unwrap_err().code(),
            "undecodable"
        );
    }
}

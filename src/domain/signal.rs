//! Events sent to runs from outside: a supplier's reply, a webhook, a signed document. Users
//! call them "events"; the code calls them signals (an [`InboundEvent`]) so that they are never
//! confused with the lifecycle [`super::Event`]s the engine publishes.
//!
//! Every face that takes one (the API, the CLI, AMQP, an embedding program) builds it through
//! [`InboundEvent::new`] or [`InboundEvent::decode`], so each refuses the same events with the
//! same words, naming the field.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::DecodeError;

/// Routing key of events sent to runs on the `<prefix>.runs` exchange (beside `run.start`).
pub const EVENT_SEND_ROUTING_KEY: &str = "run.event";

/// Longest event name, match key or event id, in characters.
pub const MAX_EVENT_FIELD_CHARS: usize = 200;

/// An event sent to the runs that wait for it, checked where it entered.
#[derive(Debug, Clone, PartialEq)]
pub struct InboundEvent {
    /// Its id: the same id twice is one event.
    pub id: String,
    /// What happened (`supplier.reply`): a wait names the events it takes.
    pub name: String,
    /// Which waits it is for (a wait's key defaults to its run's id).
    pub key: String,
    /// What the resumed step reads.
    pub payload: Value,
}

/// Why an event was refused where it entered; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadEvent {
    /// A field is missing, empty, too long or holds characters it may not.
    #[error("event {field}: {why}")]
    Field {
        /// `name`, `key`, `id` or `payload`.
        field: &'static str,
        /// What is wrong and what it must be.
        why: String,
    },
    /// The event would not fit in one message.
    #[error(
        "the event is {bytes} bytes, over the {limit}-byte message limit (worker.max_message_bytes); pass a large payload by reference (a URL or a key) instead"
    )]
    TooLarge {
        /// Its size as a message.
        bytes: usize,
        /// `worker.max_message_bytes`.
        limit: usize,
    },
}

impl BadEvent {
    /// The field refused (`size` for an event over the limit), for an API's error body.
    pub fn field(&self) -> &'static str {
        match self {
            Self::Field { field, .. } => field,
            Self::TooLarge { .. } => "payload",
        }
    }
}

/// The body of an event sent over AMQP (to `<prefix>.runs` with routing key `run.event`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    v: u64,
    name: String,
    key: String,
    id: String,
    #[serde(default = "empty_object")]
    payload: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// Checks an id-like field: 1-200 characters from `A-Z a-z 0-9 . _ : -`.
fn id_like(field: &'static str, value: &str, example: &str) -> Result<(), BadEvent> {
    let ok = !value.is_empty()
        && value.chars().count() <= MAX_EVENT_FIELD_CHARS
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'));
    if ok {
        return Ok(());
    }
    Err(BadEvent::Field {
        field,
        why: format!(
            "{:?} is not one: use 1-{MAX_EVENT_FIELD_CHARS} characters from A-Z a-z 0-9 . _ : - (e.g. {example})",
            shown(value)
        ),
    })
}

/// Checks a match key: 1-200 characters, none of them a control character.
pub fn check_key(key: &str) -> Result<(), BadEvent> {
    let why = if key.is_empty() {
        "is empty: give the key the waits use (a run's id by default)".to_owned()
    } else if key.chars().count() > MAX_EVENT_FIELD_CHARS {
        format!(
            "is {} characters long; the longest is {MAX_EVENT_FIELD_CHARS}",
            key.chars().count()
        )
    } else if key.chars().any(char::is_control) {
        format!("{:?} holds a control character", shown(key))
    } else {
        return Ok(());
    };
    Err(BadEvent::Field { field: "key", why })
}

/// Checks an event name: 1-200 characters from `A-Z a-z 0-9 . _ : -`.
pub fn check_name(name: &str) -> Result<(), BadEvent> {
    id_like("name", name, "supplier.reply")
}

/// Whether a string or key anywhere in `value` holds a NUL character (Postgres stores none).
fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}

/// The first 60 characters of a refused value, for a message that must stay short.
fn shown(value: &str) -> String {
    value.chars().take(60).collect()
}

impl InboundEvent {
    /// An event checked field by field, and as a whole against `limit` bytes (the message it
    /// would be); without an id it gets a fresh one.
    pub fn new(
        name: &str,
        key: &str,
        id: Option<&str>,
        payload: Value,
        limit: usize,
    ) -> Result<Self, BadEvent> {
        check_name(name)?;
        check_key(key)?;
        let id = match id {
            Some(id) => {
                id_like("id", id, "evt-2026-10-13-0042")?;
                id.to_owned()
            }
            None => uuid::Uuid::new_v4().to_string(),
        };
        if holds_nul(&payload) {
            return Err(BadEvent::Field {
                field: "payload",
                why: "holds a NUL character (\\u0000), which cannot be stored: send the text without it".into(),
            });
        }
        let event = Self {
            id,
            name: name.to_owned(),
            key: key.to_owned(),
            payload,
        };
        let bytes = event.encode().len();
        if bytes > limit {
            return Err(BadEvent::TooLarge { bytes, limit });
        }
        Ok(event)
    }

    /// Reads an AMQP body: a body that is not an event message at all is a [`DecodeError`]
    /// (oversized, undecodable, a future version); one whose fields are wrong is a [`BadEvent`].
    pub fn decode(body: &[u8], limit: usize) -> Result<Result<Self, BadEvent>, DecodeError> {
        let e: Envelope = super::envelope::decode(body, limit)?;
        Ok(Self::new(&e.name, &e.key, Some(&e.id), e.payload, limit))
    }

    /// The AMQP body: `{"v": 1, "name": ..., "key": ..., "id": ..., "payload": ...}`.
    pub fn encode(&self) -> Vec<u8> {
        let e = Envelope {
            v: 1,
            name: self.name.clone(),
            key: self.key.clone(),
            id: self.id.clone(),
            payload: self.payload.clone(),
        };
        serde_json::to_vec(&e).expect("an event always serialises")
    }

    /// The hash its payload is compared by (the same id with another payload is a conflict).
    pub fn payload_hash(&self) -> String {
        super::request_hash(&self.payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_bad_field_is_refused_by_name() {
        let refused = |name: &str, key: &str, id: Option<&str>| {
            InboundEvent::new(name, key, id, json!({}), 1 << 20)
                .unwrap_err()
                .field()
        };
        assert_eq!(refused("", "k", None), "name");
        assert_eq!(refused("has space", "k", None), "name");
        assert_eq!(refused(&"n".repeat(201), "k", None), "name");
        assert_eq!(refused("n", "", None), "key");
        assert_eq!(refused("n", &"k".repeat(201), None), "key");
        assert_eq!(refused("n", "a\nb", None), "key");
        assert_eq!(refused("n", "k", Some("")), "id");
        assert_eq!(refused("n", "k", Some("x y")), "id");
        let nul = InboundEvent::new("n", "k", None, json!({"a": ["b\u{0}"]}), 1 << 20);
        assert_eq!(nul.unwrap_err().field(), "payload");
        let ok = InboundEvent::new("supplier.reply", "S-07 / order 42", None, json!({}), 1 << 20);
        assert!(ok.is_ok_and(|e| !e.id.is_empty()), "keys may hold spaces");
    }

    #[test]
    fn an_event_over_the_message_limit_is_refused_and_bodies_round_trip() {
        let big = json!({ "text": "x".repeat(2_000) });
        let e = InboundEvent::new("n", "k", Some("i"), big, 1_024).unwrap_err();
        assert!(matches!(e, BadEvent::TooLarge { limit: 1_024, .. }), "{e}");
        let sent = InboundEvent::new("n", "k", Some("i"), json!({"a": 1}), 1_024).unwrap();
        let read = InboundEvent::decode(&sent.encode(), 1_024).unwrap().unwrap();
        assert_eq!(read, sent);
        let no_payload = br#"{"v":1,"name":"n","key":"k","id":"i"}"#;
        let read = InboundEvent::decode(no_payload, 1_024).unwrap().unwrap();
        assert_eq!(read.payload, json!({}));
        assert!(InboundEvent::decode(b"{nope", 1_024).is_err());
        let bad = br#"{"v":1,"name":"","key":"k","id":"i"}"#;
        assert_eq!(
            InboundEvent::decode(bad, 1_024).unwrap().unwrap_err().field(),
            "name"
        );
    }
}

//! Reading one dead letter: why it died, where it came from, and what goes back on requeue.
//!
//! Two kinds of dead letters share the DLQ. The worker publishes poison messages itself with
//! `x-trailmark-*` headers (reason, detail, queue, time, deliveries). RabbitMQ dead-letters a
//! message that hit the quorum queue's delivery limit (a consumer that died on it every time) and
//! describes it in `x-death`, most recent death first, and `x-first-death-*`.

use std::collections::BTreeMap;

use lapin::types::{AMQPValue, FieldTable};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::broker::header_str;
use crate::worker::dead_letter_headers as dl;

/// Header counting how often a message was put back by `dlq requeue`.
pub const REQUEUED: &str = "x-trailmark-requeued";
/// Reason RabbitMQ gives for a message that reached the delivery limit.
pub const DELIVERY_LIMIT: &str = "delivery_limit";

/// Who put a message into the DLQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetteredBy {
    /// A worker refused it (undecodable, unknown workflow, ...) and said why in headers.
    Worker,
    /// RabbitMQ moved it (delivery limit reached, rejected, expired); see `x-death`.
    Broker,
    /// Neither set of headers is present (published to the DLQ by hand?).
    Unknown,
}

/// What `dlq list` shows of one dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// The AMQP `message_id`; for a message without one, `sha256-` and the start of the body's hash.
    pub id: String,
    /// Short reason code: `undecodable`, `oversized`, `unknown_workflow`, `delivery_limit`, ...
    pub reason: String,
    /// Human-readable detail, when the worker gave one.
    pub detail: Option<String>,
    /// The work queue the message was taken from (where requeue sends it).
    pub queue: Option<String>,
    /// When it was dead-lettered (RFC 3339).
    pub failed_at: Option<String>,
    /// How often it had been delivered. For the delivery limit this is the configured limit
    /// plus one, the delivery that crossed it.
    pub deliveries: Option<u64>,
    /// How often it was requeued from the DLQ before.
    pub requeued: u64,
    /// Body size in bytes.
    pub body_bytes: usize,
    /// The exchange it was first published to, when known.
    pub exchange: Option<String>,
    /// Its original routing key, when known.
    pub routing_key: Option<String>,
    /// Who dead-lettered it.
    pub by: DeadLetteredBy,
}

impl DeadLetter {
    /// Reads a dead letter from its properties and body. `routing_key` is the key it arrived in
    /// the DLQ with (the original one when the broker moved it); `delivery_limit` is the work
    /// queues' configured limit.
    pub fn read(
        message_id: Option<&str>,
        headers: Option<&FieldTable>,
        routing_key: &str,
        body: &[u8],
        delivery_limit: u32,
    ) -> Self {
        let id = message_id
            .filter(|m| !m.is_empty())
            .map(str::to_owned)
            .unwrap_or_else(|| body_id(body));
        let requeued = header_str(headers, REQUEUED)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let mut letter = Self {
            id,
            reason: "unknown".into(),
            detail: None,
            queue: None,
            failed_at: None,
            deliveries: None,
            requeued,
            body_bytes: body.len(),
            exchange: None,
            routing_key: None,
            by: DeadLetteredBy::Unknown,
        };
        // A reason is what operators group and select letters by, so an empty one (a header
        // someone set blank) counts as none and the letter reads as `unknown`.
        let reason_in = |table: Option<&FieldTable>, key: &str| {
            header_str(table, key).filter(|r| !r.trim().is_empty())
        };
        if let Some(reason) = reason_in(headers, dl::REASON) {
            letter.by = DeadLetteredBy::Worker;
            letter.reason = reason;
            letter.detail = header_str(headers, dl::DETAIL);
            letter.queue = header_str(headers, dl::QUEUE);
            letter.failed_at = header_str(headers, dl::FAILED_AT);
            letter.deliveries = header_str(headers, dl::DELIVERIES).and_then(|n| n.parse().ok());
            letter.exchange = header_str(headers, dl::EXCHANGE);
            letter.routing_key = header_str(headers, dl::ROUTING_KEY);
        } else if let Some(death) = latest_death(headers) {
            letter.by = DeadLetteredBy::Broker;
            letter.read_death(death, routing_key);
        } else if let Some(reason) = reason_in(headers, "x-first-death-reason") {
            letter.by = DeadLetteredBy::Broker;
            letter.reason = reason;
            letter.queue = header_str(headers, "x-first-death-queue");
            letter.exchange = header_str(headers, "x-first-death-exchange");
            letter.routing_key = Some(routing_key.to_owned()).filter(|k| !k.is_empty());
        }
        if letter.by == DeadLetteredBy::Broker && letter.reason == DELIVERY_LIMIT {
            letter.deliveries = Some(u64::from(delivery_limit) + 1);
            letter.detail = Some(format!(
                "delivered {} times without an ack (the consumer died or gave up each time); \
                 quorum-queue delivery limit is {delivery_limit}",
                u64::from(delivery_limit) + 1
            ));
        }
        letter
    }

    fn read_death(&mut self, death: &FieldTable, routing_key: &str) {
        let field = |k: &str| header_str(Some(death), k);
        self.reason = field("reason")
            .filter(|r| !r.trim().is_empty())
            .unwrap_or_else(|| "unknown".into());
        self.queue = field("queue");
        self.exchange = field("exchange");
        self.routing_key = match death.inner().get("routing-keys") {
            Some(AMQPValue::FieldArray(keys)) => keys.as_slice().first().map(text),
            _ => Some(routing_key.to_owned()).filter(|k| !k.is_empty()),
        };
        self.failed_at = match death.inner().get("time") {
            Some(AMQPValue::Timestamp(t)) => rfc3339(*t),
            _ => None,
        };
    }
}

/// The most recent entry of `x-death` (RabbitMQ keeps the array newest first).
fn latest_death(headers: Option<&FieldTable>) -> Option<&FieldTable> {
    match headers?.inner().get("x-death")? {
        AMQPValue::FieldArray(deaths) => match deaths.as_slice().first()? {
            AMQPValue::FieldTable(t) => Some(t),
            _ => None,
        },
        _ => None,
    }
}

/// A stable handle for a message that has no `message_id`.
fn body_id(body: &[u8]) -> String {
    let digest = Sha256::digest(body);
    format!("sha256-{}", &hex::encode(digest)[..16])
}

fn rfc3339(secs: u64) -> Option<String> {
    chrono::DateTime::from_timestamp(i64::try_from(secs).ok()?, 0).map(|t| t.to_rfc3339())
}

fn text(v: &AMQPValue) -> String {
    match value_json(v) {
        Value::String(s) => s,
        other => other.to_string(),
    }
}

/// Whether requeue drops `key`: everything that describes the death rather than the message.
fn is_death_header(key: &str) -> bool {
    [
        dl::REASON,
        dl::DETAIL,
        dl::QUEUE,
        dl::FAILED_AT,
        dl::DELIVERIES,
        dl::EXCHANGE,
        dl::ROUTING_KEY,
        REQUEUED,
        "x-death",
        "x-delivery-count",
    ]
    .contains(&key)
        || key.starts_with("x-first-death-")
        || key.starts_with("x-last-death-")
}

/// The headers a requeued message carries: the original ones, without the dead-letter headers,
/// `x-death` and the DLQ's own delivery count, plus `x-trailmark-requeued: N`.
pub fn requeue_headers(headers: Option<&FieldTable>, requeued_before: u64) -> FieldTable {
    let mut kept: BTreeMap<_, _> = headers
        .map(|h| {
            h.inner()
                .iter()
                .filter(|(k, _)| !is_death_header(k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    kept.insert(
        REQUEUED.into(),
        AMQPValue::LongLongInt(i64::try_from(requeued_before + 1).unwrap_or(i64::MAX)),
    );
    FieldTable::from(kept)
}

/// Every header as JSON (`x-death` becomes a list of objects; byte strings become text).
pub fn headers_json(headers: Option<&FieldTable>) -> BTreeMap<String, Value> {
    headers
        .map(|h| {
            h.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), value_json(v)))
                .collect()
        })
        .unwrap_or_default()
}

fn value_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Float(n) => json!(n),
        AMQPValue::Double(n) => json!(n),
        AMQPValue::Timestamp(t) => rfc3339(*t).map(Value::String).unwrap_or(json!(t)),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_json).collect()),
        AMQPValue::FieldTable(t) => Value::Object(headers_json(Some(t)).into_iter().collect()),
        AMQPValue::ByteArray(b) => json!(hex::encode(b.as_slice())),
        AMQPValue::Void => Value::Null,
        other => json!(format!("{other:?}")),
    }
}

/// How a body is shown: as text when it is UTF-8 JSON, otherwise as a size and a hex prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BodyView {
    /// The body, word for word.
    Json {
        /// The body as text.
        text: String,
    },
    /// Not UTF-8 JSON.
    Binary {
        /// Size in bytes.
        bytes: usize,
        /// The first bytes in hex.
        head_hex: String,
        /// Whether the body is longer than `head_hex`.
        truncated: bool,
    },
}

/// Bytes shown of a body that is not JSON.
const HEX_HEAD: usize = 64;

impl BodyView {
    /// Decides how to show `body`.
    pub fn of(body: &[u8]) -> Self {
        match std::str::from_utf8(body) {
            Ok(text) if serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok() => Self::Json {
                text: text.to_owned(),
            },
            _ => Self::Binary {
                bytes: body.len(),
                head_hex: hex::encode(&body[..body.len().min(HEX_HEAD)]),
                truncated: body.len() > HEX_HEAD,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::FieldArray;

    use super::*;

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(v.into())
    }

    #[test]
    fn worker_dead_letter_is_read_from_its_headers() {
        let h = table(&[
            (dl::REASON, s("unknown_workflow")),
            (dl::DETAIL, s("workflow \"nope\" is not registered")),
            (dl::QUEUE, s("tm.runs.start")),
            (dl::FAILED_AT, s("2026-11-30T10:00:00+00:00")),
            (dl::DELIVERIES, s("1")),
            (REQUEUED, AMQPValue::LongLongInt(2)),
        ]);
        let l = DeadLetter::read(Some("m-1"), Some(&h), "", b"{}", 20);
        assert_eq!(l.by, DeadLetteredBy::Worker);
        assert_eq!(
            (l.id.as_str(), l.reason.as_str()),
            ("m-1", "unknown_workflow")
        );
        assert_eq!(l.queue.as_deref(), Some("tm.runs.start"));
        assert_eq!((l.deliveries, l.requeued, l.body_bytes), (Some(1), 2, 2));
    }

    #[test]
    fn a_blank_reason_reads_as_unknown() {
        // Found by tests/fuzz.rs: a blank reason header left the letter without a reason to
        // group or select it by.
        for key in [dl::REASON, "x-first-death-reason"] {
            let h = table(&[(key, s(" "))]);
            let l = DeadLetter::read(Some("m-2"), Some(&h), "", b"{}", 20);
            assert_eq!(l.reason, "unknown", "{key}");
        }
        let death = table(&[("reason", s(""))]);
        let deaths = FieldArray::from(vec![AMQPValue::FieldTable(death)]);
        let h = table(&[("x-death", AMQPValue::FieldArray(deaths))]);
        let l = DeadLetter::read(None, Some(&h), "tm.steps", b"{}", 20);
        assert_eq!(l.reason, "unknown");
    }

    #[test]
    fn broker_dead_letter_uses_the_latest_death() {
        let latest = table(&[
            ("reason", s("delivery_limit")),
            ("queue", s("tm.steps")),
            ("exchange", s("tm.steps")),
            (
                "routing-keys",
                AMQPValue::FieldArray(FieldArray::from(vec![s("step")])),
            ),
            ("time", AMQPValue::Timestamp(1_700_000_000)),
        ]);
        let older = table(&[("reason", s("expired")), ("queue", s("tm.delay.1000ms"))]);
        let deaths = FieldArray::from(vec![
            AMQPValue::FieldTable(latest),
            AMQPValue::FieldTable(older),
        ]);
        let h = table(&[
            ("x-death", AMQPValue::FieldArray(deaths)),
            ("x-first-death-reason", s("expired")),
        ]);
        let l = DeadLetter::read(Some("m-2"), Some(&h), "step", b"x", 3);
        assert_eq!(l.by, DeadLetteredBy::Broker);
        assert_eq!(l.reason, DELIVERY_LIMIT);
        assert_eq!(l.queue.as_deref(), Some("tm.steps"));
        assert_eq!(l.routing_key.as_deref(), Some("step"));
        assert_eq!(l.deliveries, Some(4));
        assert!(l.failed_at.unwrap().starts_with("2023-11-14"));
    }

    #[test]
    fn a_message_without_id_gets_a_stable_one_from_its_body() {
        let a = DeadLetter::read(None, None, "", b"abc", 20);
        let b = DeadLetter::read(Some(""), None, "", b"abc", 20);
        assert_eq!(a.id, b.id);
        assert!(a.id.starts_with("sha256-"), "{}", a.id);
        assert_eq!(a.by, DeadLetteredBy::Unknown);
    }

    #[test]
    fn requeue_keeps_the_message_headers_and_drops_the_death() {
        let h = table(&[
            ("x-trailmark-run-id", s("r1")),
            (dl::REASON, s("undecodable")),
            (dl::QUEUE, s("tm.steps")),
            ("x-death", AMQPValue::FieldArray(FieldArray::default())),
            ("x-first-death-queue", s("tm.steps")),
            ("x-delivery-count", AMQPValue::LongLongInt(4)),
            (REQUEUED, s("1")),
        ]);
        let out = requeue_headers(Some(&h), 1);
        let keys: Vec<_> = out.inner().keys().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["x-trailmark-requeued", "x-trailmark-run-id"]);
        assert_eq!(header_str(Some(&out), REQUEUED).as_deref(), Some("2"));
    }

    #[test]
    fn bodies_show_as_text_only_when_json() {
        assert_eq!(
            BodyView::of(br#"{"v":1}"#),
            BodyView::Json {
                text: r#"{"v":1}"#.into()
            }
        );
        match BodyView::of(&[0xff; 100]) {
            BodyView::Binary {
                bytes,
                head_hex,
                truncated,
            } => {
                assert_eq!((bytes, head_hex.len(), truncated), (100, 128, true));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            BodyView::of(b"{not json"),
            BodyView::Binary { .. }
        ));
    }
}

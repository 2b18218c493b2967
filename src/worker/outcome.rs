//! What happens to a delivery once it has been processed: ack, delay, or dead-letter.
//! Every path that moves a message elsewhere waits for the publisher confirm before the ack.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;

use super::published::PublishedRows;
use super::version_wait::{SINCE, WAITS, Waited};
use crate::broker::{Outgoing, Publisher, header_str, headers_to_map, map_to_headers};
use crate::engine::{Engine, Stats};

/// Header names trailmark adds to dead letters.
pub mod dead_letter_headers {
    /// Short reason code (`undecodable`, `oversized`, `unknown_workflow`, ...).
    pub const REASON: &str = "x-trailmark-reason";
    /// Human-readable detail.
    pub const DETAIL: &str = "x-trailmark-detail";
    /// Queue the message was taken from.
    pub const QUEUE: &str = "x-trailmark-queue";
    /// When it was dead-lettered (RFC 3339).
    pub const FAILED_AT: &str = "x-trailmark-failed-at";
    /// How many times it had been delivered.
    pub const DELIVERIES: &str = "x-trailmark-deliveries";
    /// The exchange it was delivered from (empty: the default exchange, e.g. after a requeue).
    pub const EXCHANGE: &str = "x-trailmark-exchange";
    /// The routing key it was delivered with.
    pub const ROUTING_KEY: &str = "x-trailmark-routing-key";
    /// `run_conflict`: the hash of the input the run was started with.
    pub const STORED_INPUT_HASH: &str = "x-trailmark-stored-input-hash";
    /// `run_conflict`: the hash of this event's input.
    pub const EVENT_INPUT_HASH: &str = "x-trailmark-event-input-hash";
    /// `message_id_reuse`: the hash of the body first processed under this message id.
    pub const STORED_BODY_HASH: &str = "x-trailmark-stored-body-hash";
    /// `message_id_reuse`: the hash of this body.
    pub const BODY_HASH: &str = "x-trailmark-body-hash";
    /// `event_conflict`: the hash of the payload first received under this event id.
    pub const STORED_PAYLOAD_HASH: &str = "x-trailmark-stored-payload-hash";
    /// `event_conflict`: the hash of this event's payload.
    pub const PAYLOAD_HASH: &str = "x-trailmark-payload-hash";
}

/// The result of processing one delivery.
#[derive(Debug)]
pub enum Disposition {
    /// Work committed with these outbox messages: publish them now (the relay is the safety net
    /// if this fails or we die first), then acknowledge.
    Committed(Vec<super::published::Eager>),
    /// Already processed: acknowledge, count and log (at DEBUG) why.
    Duplicate(&'static str),
    /// The run moved on, is not executable, or we were fenced out: acknowledge, count and log
    /// (at DEBUG) why.
    Stale(String),
    /// Try again after `delay` (run busy, or a step retry): park in a delay queue, then ack.
    Delay(Duration),
    /// A step of a workflow version this worker does not carry, whose run waits at its
    /// position: park it in a delay queue with how long it has waited (with no delay, publish
    /// it straight back to the steps queue, toward a worker that carries it), then ack
    /// (`version_wait.rs`).
    WaitForVersion {
        /// How long this wait lasts.
        delay: Duration,
        /// The wait so far, this one included, carried in the message's headers.
        waited: Waited,
    },
    /// Poison: publish to the DLQ with this reason, then ack.
    DeadLetter {
        /// Short code.
        reason: &'static str,
        /// Detail for the operator.
        detail: String,
        /// Evidence for the operator, added to the letter's headers (e.g. both hashes of a
        /// conflict).
        evidence: BTreeMap<String, String>,
    },
}

/// Applies `disposition` to `delivery`. If a publish fails, the delivery is left unacknowledged
/// and the broker redelivers it when the channel closes: nothing is lost.
pub(super) async fn settle(
    engine: &Arc<Engine>,
    publisher: &Publisher,
    published: &PublishedRows,
    delivery: &Delivery,
    disposition: Disposition,
) {
    let moved = match &disposition {
        Disposition::Committed(messages) => {
            // The ack does not wait for the confirms: the committed outbox rows stand behind
            // these messages whatever happens to this process now (the relay publishes what
            // is not confirmed), so the delivery's slot is freed one confirm earlier.
            tokio::join!(
                publish_committed(publisher, published, messages),
                acknowledge(engine, delivery)
            );
            return;
        }
        Disposition::Duplicate(why) => {
            Stats::bump(&engine.stats.duplicates);
            crate::metrics::duplicate_dropped(why);
            tracing::debug!(why, "duplicate delivery dropped");
            Ok(())
        }
        Disposition::Stale(why) => {
            Stats::bump(&engine.stats.stale);
            crate::metrics::stale_dropped();
            tracing::debug!(why = %why, "stale delivery dropped");
            Ok(())
        }
        Disposition::Delay(delay) => {
            Stats::bump(&engine.stats.delayed);
            tracing::debug!(
                delay_ms = delay.as_millis() as u64,
                "the message waits in the delay queue (its run is busy, or its step is retried later)"
            );
            publisher.publish(&delayed(engine, delivery, *delay)).await
        }
        Disposition::WaitForVersion { delay, waited } => {
            Stats::bump(&engine.stats.delayed);
            let mut message = match delay.is_zero() {
                true => straight_back(engine, delivery),
                false => delayed(engine, delivery, *delay),
            };
            let text = |s: String| AMQPValue::LongString(s.into());
            message
                .headers
                .insert(SINCE.into(), text(waited.since.to_rfc3339()));
            message
                .headers
                .insert(WAITS.into(), text(waited.times.to_string()));
            publisher.publish(&message).await
        }
        Disposition::DeadLetter {
            reason,
            detail,
            evidence,
        } => {
            Stats::bump(&engine.stats.dead_lettered);
            crate::metrics::dead_lettered(reason);
            tracing::warn!(reason, detail = %detail, "message dead-lettered");
            let letter = dead_letter(engine, delivery, reason, detail, evidence);
            publisher.publish(&letter).await
        }
    };
    if let Err(e) = moved {
        tracing::warn!(error = %crate::error::Report(&e), "could not move the message; leaving it unacknowledged for redelivery");
        return;
    }
    acknowledge(engine, delivery).await;
}

/// Acknowledges a delivery whose work is committed (or moved elsewhere).
async fn acknowledge(engine: &Engine, delivery: &Delivery) {
    // A crash here leaves this delivery unacknowledged with its work committed: its
    // redelivery must be dropped as a duplicate.
    if engine.failpoints.hit("step.before_ack").is_err() {
        return;
    }
    if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
        // The work is committed; the redelivery this causes is dropped by the inbox.
        tracing::warn!(error = %crate::error::Report(&e), "ack failed after commit; the redelivery will be dropped as a duplicate");
    }
}

/// Publishes just-committed outbox rows and queues the confirmed ones for forgetting. A failure
/// here costs only latency: the rows become available to the relay after `relay.eager_grace_ms`.
async fn publish_committed(
    publisher: &Publisher,
    published: &PublishedRows,
    messages: &[super::published::Eager],
) {
    if messages.is_empty() {
        return;
    }
    let outgoing: Vec<Outgoing> = messages
        .iter()
        .map(|e| crate::relay::to_outgoing(&e.message))
        .collect();
    let results = publisher.publish_all(&outgoing).await;
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        tracing::warn!(error = %crate::error::Report(e), "eager publish failed; the relay will publish after the grace period");
    }
    published.forget(
        messages
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|(e, _)| e.row),
    );
}

/// The delivery's AMQP `message_id`, empty when the publisher set none.
pub(super) fn message_id(delivery: &Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.to_string())
        .unwrap_or_default()
}

/// The delivery published again at once where it came from (a step or a start hopping toward a
/// worker that carries its version): a step to the steps queue (from the steps exchange or a
/// delay queue), a start to the start queue (from the runs exchange, or from a DLQ requeue by
/// its queue's name).
fn straight_back(engine: &Engine, delivery: &Delivery) -> Outgoing {
    let start = delivery.routing_key.as_str() == crate::domain::RUN_START_ROUTING_KEY
        || delivery.routing_key.as_str() == engine.topology.run_start_queue();
    let (exchange, routing_key) = if start {
        (String::new(), engine.topology.run_start_queue())
    } else {
        (
            engine.topology.steps_exchange(),
            crate::domain::STEP_ROUTING_KEY.into(),
        )
    };
    Outgoing {
        message_id: message_id(delivery),
        exchange,
        routing_key,
        headers: delivery.properties.headers().clone().unwrap_or_default(),
        body: delivery.data.clone(),
    }
}

fn delayed(engine: &Engine, delivery: &Delivery, delay: Duration) -> Outgoing {
    Outgoing {
        message_id: message_id(delivery),
        exchange: String::new(),
        routing_key: engine.topology.delay_queue(delay.as_millis() as u64),
        headers: delivery.properties.headers().clone().unwrap_or_default(),
        body: delivery.data.clone(),
    }
}

/// Earlier deliveries of this message, as a quorum queue counts them (`x-delivery-count`).
pub(super) fn earlier_deliveries(delivery: &Delivery) -> u64 {
    let headers = delivery.properties.headers().as_ref();
    header_str(headers, "x-delivery-count")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn dead_letter(
    engine: &Engine,
    delivery: &Delivery,
    reason: &str,
    detail: &str,
    evidence: &BTreeMap<String, String>,
) -> Outgoing {
    let headers = delivery.properties.headers().as_ref();
    let mut map: BTreeMap<String, String> = headers_to_map(headers);
    // A wait for a newer version describes this trip, not the message: a requeued letter
    // starts its wait again (the detail says how long it waited).
    map.remove(SINCE);
    map.remove(WAITS);
    map.extend(evidence.iter().map(|(k, v)| (k.clone(), v.clone())));
    // This delivery adds one to the earlier ones.
    let earlier = earlier_deliveries(delivery);
    // A requeued message comes through the default exchange, keyed by its queue's name.
    let key = delivery.routing_key.as_str();
    let queue = if key == crate::domain::RUN_START_ROUTING_KEY
        || key == engine.topology.run_start_queue()
    {
        engine.topology.run_start_queue()
    } else {
        engine.topology.steps_queue()
    };
    map.insert(dead_letter_headers::REASON.into(), reason.into());
    map.insert(
        dead_letter_headers::DETAIL.into(),
        detail.chars().take(1000).collect(),
    );
    map.insert(dead_letter_headers::QUEUE.into(), queue);
    map.insert(
        dead_letter_headers::EXCHANGE.into(),
        delivery.exchange.to_string(),
    );
    map.insert(dead_letter_headers::ROUTING_KEY.into(), key.to_owned());
    map.insert(
        dead_letter_headers::FAILED_AT.into(),
        chrono::Utc::now().to_rfc3339(),
    );
    map.insert(
        dead_letter_headers::DELIVERIES.into(),
        (earlier + 1).to_string(),
    );
    let mut id = message_id(delivery);
    if id.is_empty() {
        // The DLQ tooling needs a handle on every message.
        id = uuid::Uuid::new_v4().to_string();
    }
    Outgoing {
        message_id: id,
        exchange: engine.topology.dlx(),
        routing_key: String::new(),
        headers: map_to_headers(&map),
        body: delivery.data.clone(),
    }
}

/// Shorthand used by processors.
pub(super) fn dead(reason: &'static str, detail: impl Into<String>) -> Disposition {
    Disposition::DeadLetter {
        reason,
        detail: detail.into(),
        evidence: BTreeMap::new(),
    }
}

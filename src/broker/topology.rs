//! Exchange and queue names and their idempotent declaration.
//!
//! Every work queue is a quorum queue with an explicit delivery limit and at-least-once
//! dead-lettering (which needs `x-overflow=reject-publish`), so a message that keeps killing its
//! consumer ends in the DLQ instead of looping. The same arguments work on RabbitMQ 3.10 and 4.x.
//!
//! Every quorum queue (the DLQ too) is declared with `x-quorum-initial-group-size` from
//! `broker.quorum_group_size` (default 3): how many nodes get a replica when the queue is created.
//! RabbitMQ caps it at the nodes the cluster has, so a single node accepts 3 as well; stating it
//! keeps a bigger cluster from putting a replica on every node, and keeps the size out of the
//! broker's own configuration.
//!
//! What is declared is also data ([`Topology::exchanges`], [`Topology::queues`],
//! [`Topology::bindings`], [`Topology::definitions`]): `deploy/rabbitmq/definitions.json` is
//! checked against it (`tests/definitions.rs`), so the file and the code cannot drift apart.
//!
//! Existing queues: RabbitMQ refuses a redeclare with other arguments (PRECONDITION_FAILED) and
//! changes no argument in place. The group size only matters when a queue is created (its
//! membership is fixed then and changed later with `rabbitmq-queues add_member` or `grow`), so a
//! queue that differs from the configuration in its group size alone (one declared by an earlier
//! trailmark without it, or under another `broker.quorum_group_size`) is used as it is, with a
//! warning that names it ([`KeptGroupSize`]): refusing it would break `migrate` and every worker
//! start of an existing installation for a setting that cannot change a thing there. Any other
//! difference (type, delivery limit, dead-lettering, TTL) changes what trailmark promises about
//! its messages, so it stays an error that names the queue and what to do.

use std::collections::BTreeMap;
use std::fmt;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind};
use serde_json::{Value, json};

use super::{Error, Outgoing};
use crate::config::BrokerSettings;
use crate::domain::{
    EVENT_HEADER, EVENT_SEND_ROUTING_KEY, Event, InboundEvent, MessageId, OutgoingMessage,
    RUN_START_ROUTING_KEY, RunId, RunStartEvent, STEP_ROUTING_KEY, StepAddress, StepMessage,
};

/// Replicas of a new quorum queue when nothing else is configured: a queue on three nodes keeps
/// its majority while one node is down or restarted for an upgrade.
pub const DEFAULT_QUORUM_GROUP_SIZE: u32 = 3;

/// The queue argument that sets how many replicas a new quorum queue gets.
pub const QUORUM_GROUP_SIZE_ARG: &str = "x-quorum-initial-group-size";

/// Delay tiers for step retries, in milliseconds. A per-message TTL only expires at the head of a
/// queue, so each delay gets its own queue with one queue-wide TTL.
pub const DELAY_TIERS_MS: [u64; 4] = [1_000, 5_000, 30_000, 300_000];

/// The names of everything trailmark declares, derived from one prefix.
#[derive(Debug, Clone)]
pub struct Topology {
    prefix: String,
    delivery_limit: u32,
    quorum_group_size: u32,
}

/// An exchange as trailmark declares it (durable, not internal, no arguments): what
/// [`Topology::declare`] declares and what the definitions file must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeSpec {
    /// Its name.
    pub name: String,
    /// Its type as RabbitMQ names it: `topic`, `direct` or `fanout`.
    pub kind: &'static str,
}

/// A queue as trailmark declares it (durable, with exactly these arguments): what
/// [`Topology::declare`] declares and what the definitions file must hold.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSpec {
    /// Its name.
    pub name: String,
    /// Its arguments, with the AMQP types the declaration sends.
    pub arguments: FieldTable,
}

/// A binding as trailmark declares it (no arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingSpec {
    /// The exchange it routes from.
    pub exchange: String,
    /// The queue it routes to.
    pub queue: String,
    /// The routing key it matches.
    pub routing_key: String,
}

/// A queue found with another initial group size than `broker.quorum_group_size` and used as
/// it is, since the size only applies when a queue is created (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptGroupSize {
    /// The queue.
    pub queue: String,
    /// The size it was declared with; `None` when it was declared without one (by a trailmark
    /// that did not set it).
    pub declared: Option<i64>,
    /// The configured size it does not have.
    pub configured: u32,
}

impl fmt::Display for KeptGroupSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.declared {
            None => write!(
                f,
                "{} (declared without {QUORUM_GROUP_SIZE_ARG}, by an earlier trailmark)",
                self.queue
            ),
            Some(n) => write!(
                f,
                "{} (declared with {QUORUM_GROUP_SIZE_ARG} {n})",
                self.queue
            ),
        }
    }
}

impl QueueSpec {
    /// The arguments as a definitions file writes them (JSON strings and numbers).
    pub fn arguments_json(&self) -> Value {
        let map = self
            .arguments
            .inner()
            .iter()
            .map(|(key, value)| (key.as_str().to_owned(), json_of(value)))
            .collect();
        Value::Object(map)
    }
}

/// One argument value in JSON. Only strings and whole numbers are declared; anything else is
/// shown by its debug form, which no definitions file matches, so a test would say so.
fn json_of(value: &AMQPValue) -> Value {
    match value {
        AMQPValue::LongString(s) => Value::from(s.to_string()),
        AMQPValue::ShortString(s) => Value::from(s.as_str()),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::LongUInt(n) => Value::from(*n),
        AMQPValue::Boolean(b) => Value::from(*b),
        other => Value::from(format!("{other:?}")),
    }
}

impl Topology {
    /// Names under `prefix`, with the work queues' delivery limit and the default initial
    /// quorum group size ([`DEFAULT_QUORUM_GROUP_SIZE`]).
    pub fn new(prefix: &str, delivery_limit: u32) -> Self {
        Self {
            prefix: prefix.to_owned(),
            delivery_limit,
            quorum_group_size: DEFAULT_QUORUM_GROUP_SIZE,
        }
    }
    /// The topology `settings` describe: prefix, delivery limit and initial quorum group size.
    pub fn from_settings(settings: &BrokerSettings) -> Self {
        Self::new(&settings.prefix, settings.delivery_limit)
            .with_quorum_group_size(settings.quorum_group_size)
    }
    /// The same names with another initial quorum group size (replicas of a new quorum queue).
    pub fn with_quorum_group_size(mut self, size: u32) -> Self {
        self.quorum_group_size = size;
        self
    }
    /// Exchange that upstream services publish run-start events to.
    pub fn runs_exchange(&self) -> String {
        format!("{}.runs", self.prefix)
    }
    /// `event` as upstream services publish it: to the runs exchange with the run-start key,
    /// under a fresh time-ordered message id (see [`crate::domain::MessageId::new`]).
    pub fn run_start(&self, event: &RunStartEvent) -> Outgoing {
        Outgoing {
            message_id: crate::domain::MessageId::new().to_string(),
            exchange: self.runs_exchange(),
            routing_key: RUN_START_ROUTING_KEY.into(),
            headers: Default::default(),
            body: event.encode(),
        }
    }
    /// Queue of run-start events.
    pub fn run_start_queue(&self) -> String {
        format!("{}.runs.start", self.prefix)
    }
    /// `event` as upstream services send it to waiting runs: to the runs exchange with the
    /// `run.event` key, the event's id as the message id.
    pub fn send_event(&self, event: &InboundEvent) -> Outgoing {
        Outgoing {
            message_id: event.id.clone(),
            exchange: self.runs_exchange(),
            routing_key: EVENT_SEND_ROUTING_KEY.into(),
            headers: Default::default(),
            body: event.encode(),
        }
    }
    /// Queue of events sent to waiting runs.
    pub fn run_event_queue(&self) -> String {
        format!("{}.runs.event", self.prefix)
    }
    /// Exchange of step messages.
    pub fn steps_exchange(&self) -> String {
        format!("{}.steps", self.prefix)
    }
    /// The outbox row that queues `step` at position `seq` of a run, with a fresh message id
    /// (a retried delivery keeps its own id; a new message is a new decision to run the step).
    pub fn step_message(
        &self,
        run_id: &RunId,
        workflow: &str,
        version: i32,
        step: &StepAddress,
        seq: i32,
    ) -> OutgoingMessage {
        let msg = StepMessage {
            v: 1,
            message_id: MessageId::new(),
            run_id: run_id.clone(),
            workflow: workflow.to_owned(),
            version,
            step: step.clone(),
            seq,
            trace: None,
        };
        let headers = BTreeMap::from([
            ("x-trailmark-run-id".to_owned(), run_id.to_string()),
            ("x-trailmark-step".to_owned(), step.to_string()),
        ]);
        OutgoingMessage {
            message_id: msg.message_id,
            exchange: self.steps_exchange(),
            routing_key: STEP_ROUTING_KEY.to_owned(),
            headers,
            body: msg.encode(),
            relay_after_ms: 0,
            holder_pid: None,
        }
    }
    /// Work queue of step messages.
    pub fn steps_queue(&self) -> String {
        format!("{}.steps", self.prefix)
    }
    /// Dead-letter exchange.
    pub fn dlx(&self) -> String {
        format!("{}.dlx", self.prefix)
    }
    /// Dead-letter queue.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.prefix)
    }
    /// Topic exchange of lifecycle events (see [`Event::routing_key`]).
    pub fn events_exchange(&self) -> String {
        format!("{}.events", self.prefix)
    }
    /// The outbox row that publishes `event` (without `mandatory`: an event nobody subscribed to
    /// is dropped by the broker, never retried forever).
    pub fn event_message(&self, event: &Event) -> OutgoingMessage {
        let headers = BTreeMap::from([(EVENT_HEADER.to_owned(), event.event.clone())]);
        OutgoingMessage {
            message_id: MessageId::new(),
            exchange: self.events_exchange(),
            routing_key: event.routing_key(),
            headers,
            body: event.encode(),
            relay_after_ms: 0,
            holder_pid: None,
        }
    }
    /// The delay queue for at least `ms` milliseconds (the smallest tier that covers it).
    pub fn delay_queue(&self, ms: u64) -> String {
        let tier = DELAY_TIERS_MS
            .iter()
            .copied()
            .find(|t| *t >= ms)
            .unwrap_or(DELAY_TIERS_MS[3]);
        format!("{}.delay.{tier}ms", self.prefix)
    }

    /// A quorum queue with the configured initial group size, plus `extra` arguments.
    fn quorum_args(&self, extra: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        args.insert(
            QUORUM_GROUP_SIZE_ARG.into(),
            AMQPValue::LongInt(self.quorum_group_size as i32),
        );
        for (key, value) in extra {
            args.insert(key.into(), value);
        }
        args
    }

    /// A quorum queue that dead-letters at least once to `exchange` (which needs
    /// `x-overflow=reject-publish`), plus `extra` arguments.
    fn dead_lettering_args(&self, exchange: String, extra: Vec<(&str, AMQPValue)>) -> FieldTable {
        let text = |s: &str| AMQPValue::LongString(s.into());
        let mut all = vec![
            ("x-dead-letter-exchange", text(&exchange)),
            ("x-dead-letter-strategy", text("at-least-once")),
            ("x-overflow", text("reject-publish")),
        ];
        all.extend(extra);
        self.quorum_args(all)
    }

    fn work_queue_args(&self) -> FieldTable {
        let limit = AMQPValue::LongInt(self.delivery_limit as i32);
        self.dead_lettering_args(self.dlx(), vec![("x-delivery-limit", limit)])
    }

    fn delay_queue_args(&self, ttl_ms: u64) -> FieldTable {
        let extra = vec![
            ("x-message-ttl", AMQPValue::LongLongInt(ttl_ms as i64)),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString(STEP_ROUTING_KEY.into()),
            ),
        ];
        self.dead_lettering_args(self.steps_exchange(), extra)
    }

    /// Every exchange [`Topology::declare`] declares.
    pub fn exchanges(&self) -> Vec<ExchangeSpec> {
        let spec = |name: String, kind| ExchangeSpec { name, kind };
        vec![
            spec(self.runs_exchange(), "topic"),
            spec(self.steps_exchange(), "direct"),
            spec(self.dlx(), "fanout"),
            spec(self.events_exchange(), "topic"),
        ]
    }

    /// Every queue [`Topology::declare`] declares, with its arguments. The delay queues have no
    /// binding: a message is published to one through the default exchange, waits out its TTL
    /// and is dead-lettered back to the steps exchange.
    pub fn queues(&self) -> Vec<QueueSpec> {
        let spec = |name: String, arguments| QueueSpec { name, arguments };
        let mut queues = vec![
            // The DLQ is the end of the line: replicated, but it dead-letters nowhere.
            spec(self.dlq(), self.quorum_args(Vec::new())),
            spec(self.run_start_queue(), self.work_queue_args()),
            spec(self.run_event_queue(), self.work_queue_args()),
            spec(self.steps_queue(), self.work_queue_args()),
        ];
        queues.extend(
            DELAY_TIERS_MS
                .iter()
                .map(|tier| spec(self.delay_queue(*tier), self.delay_queue_args(*tier))),
        );
        queues
    }

    /// Every binding [`Topology::declare`] declares.
    pub fn bindings(&self) -> Vec<BindingSpec> {
        let spec = |exchange: String, queue: String, key: &str| BindingSpec {
            exchange,
            queue,
            routing_key: key.to_owned(),
        };
        vec![
            spec(self.dlx(), self.dlq(), ""),
            spec(
                self.runs_exchange(),
                self.run_start_queue(),
                RUN_START_ROUTING_KEY,
            ),
            spec(
                self.runs_exchange(),
                self.run_event_queue(),
                EVENT_SEND_ROUTING_KEY,
            ),
            spec(self.steps_exchange(), self.steps_queue(), STEP_ROUTING_KEY),
        ]
    }

    /// The definitions document (for `rabbitmqctl import_definitions` or the management API)
    /// that creates in `vhost` exactly what [`Topology::declare`] declares, arguments included.
    /// `deploy/rabbitmq/definitions.json` is this document for the default settings and `/`.
    /// It sets no policy: the arguments are declared, not set by policy (see the file's README).
    pub fn definitions(&self, vhost: &str) -> Value {
        let exchanges: Vec<Value> = self
            .exchanges()
            .into_iter()
            .map(|x| {
                json!({
                    "name": x.name, "vhost": vhost, "type": x.kind, "durable": true,
                    "auto_delete": false, "internal": false, "arguments": {},
                })
            })
            .collect();
        let queues: Vec<Value> = self
            .queues()
            .into_iter()
            .map(|q| {
                json!({
                    "name": q.name, "vhost": vhost, "durable": true, "auto_delete": false,
                    "arguments": q.arguments_json(),
                })
            })
            .collect();
        let bindings: Vec<Value> = self
            .bindings()
            .into_iter()
            .map(|b| {
                json!({
                    "source": b.exchange, "vhost": vhost, "destination": b.queue,
                    "destination_type": "queue", "routing_key": b.routing_key, "arguments": {},
                })
            })
            .collect();
        json!({
            // Named so that a node loading the file at boot creates it: such a node seeds no
            // default vhost (nor user) of its own.
            "vhosts": [{ "name": vhost }],
            "policies": [],
            "exchanges": exchanges,
            "queues": queues,
            "bindings": bindings,
        })
    }

    /// Declares everything, on a channel of its own on `conn` (a refused declaration closes its
    /// channel, and the group-size retry needs another); safe to call from every process at every
    /// start. Returns the queues kept with another initial group size than configured, each also
    /// logged as a warning; any other difference from an existing object is
    /// [`Error::Misconfigured`], naming it.
    pub async fn declare(&self, conn: &Connection) -> super::Result<Vec<KeptGroupSize>> {
        let mut ch = conn.create_channel().await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        for x in self.exchanges() {
            let kind = match x.kind {
                "topic" => ExchangeKind::Topic,
                "direct" => ExchangeKind::Direct,
                "fanout" => ExchangeKind::Fanout,
                other => ExchangeKind::Custom(other.to_owned()),
            };
            ch.exchange_declare(x.name.as_str().into(), kind, durable, FieldTable::default())
                .await
                .map_err(|e| refused("exchange", &x.name, e))?;
        }
        let mut kept = Vec::new();
        for q in self.queues() {
            kept.extend(self.declare_queue(conn, &mut ch, &q).await?);
        }
        if !kept.is_empty() {
            // One line, not one per queue: it comes back at every process start, and on a single
            // node there is nothing to do about it.
            let queues: Vec<String> = kept.iter().map(ToString::to_string).collect();
            tracing::warn!(
                "quorum queues kept with the replicas they were created with, not the configured \
                 {QUORUM_GROUP_SIZE_ARG} {} (broker.quorum_group_size applies only when a queue is \
                 created): {}. On a cluster, see a queue's replicas with `rabbitmq-queues \
                 quorum_status --vhost VHOST QUEUE` and add some with `rabbitmq-queues grow NODE \
                 all`; or drain and delete a queue and run `trailmark migrate` to create it anew",
                self.quorum_group_size,
                queues.join(", ")
            );
        }
        for b in self.bindings() {
            ch.queue_bind(
                b.queue.as_str().into(),
                b.exchange.as_str().into(),
                b.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        }
        let _ = ch.close(200, "declared".into()).await;
        Ok(kept)
    }

    /// Declares one queue; when the broker refuses it only because the queue exists with another
    /// initial group size, declares it again (on a new channel) with the size it has, which
    /// checks every other argument, and reports it as kept.
    async fn declare_queue(
        &self,
        conn: &Connection,
        ch: &mut Channel,
        q: &QueueSpec,
    ) -> super::Result<Option<KeptGroupSize>> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let refusal = match ch
            .queue_declare(q.name.as_str().into(), durable, q.arguments.clone())
            .await
        {
            Ok(_) => return Ok(None),
            Err(e) => e,
        };
        let Some(declared) = precondition_failed(&refusal).and_then(|t| existing_group_size(&t))
        else {
            return Err(refused("queue", &q.name, refusal));
        };
        // The refusal closed the channel.
        *ch = conn.create_channel().await?;
        let mut arguments: BTreeMap<ShortString, AMQPValue> = q.arguments.inner().clone();
        match declared {
            None => arguments.remove(QUORUM_GROUP_SIZE_ARG),
            Some(n) => arguments.insert(QUORUM_GROUP_SIZE_ARG.into(), AMQPValue::LongLongInt(n)),
        };
        ch.queue_declare(q.name.as_str().into(), durable, arguments.into())
            .await
            .map_err(|e| refused("queue", &q.name, e))?;
        Ok(Some(KeptGroupSize {
            queue: q.name.clone(),
            declared,
            configured: self.quorum_group_size,
        }))
    }

    /// Deletes everything under the prefix (tests and `trailmark` teardown only).
    pub async fn delete(&self, ch: &Channel) -> lapin::Result<()> {
        for q in self.queues() {
            ch.queue_delete(q.name.into(), QueueDeleteOptions::default())
                .await?;
        }
        for x in self.exchanges() {
            ch.exchange_delete(x.name.into(), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// The broker's words when `e` is its PRECONDITION_FAILED refusal (406) of a declaration.
fn precondition_failed(e: &lapin::Error) -> Option<String> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406 => {
            Some(amqp.get_message().to_string())
        }
        _ => None,
    }
}

/// The group size an existing queue has, when the broker's refusal `text` names the initial
/// group size as the (first) argument that differs: `Some(None)` for a queue declared without
/// one. RabbitMQ 3.10 words it "inequivalent arg 'x-quorum-initial-group-size' for queue 'q' in
/// vhost '/': received the value '3' of type 'signedint' but current is none", or "... received
/// '5' but current is '3'" when both have one; anything else is not a group-size difference.
fn existing_group_size(text: &str) -> Option<Option<i64>> {
    let (_, rest) = text.split_once(&format!("inequivalent arg '{QUORUM_GROUP_SIZE_ARG}'"))?;
    let (_, current) = rest.rsplit_once("but current is ")?;
    if current.trim() == "none" {
        return Some(None);
    }
    let value = current.split('\'').nth(1)?;
    value.parse().ok().map(Some)
}

/// A declaration the broker refused: an object that exists with other arguments or another type
/// is for a person to fix (with what to do); anything else is a connection failure, retried.
fn refused(kind: &str, name: &str, e: lapin::Error) -> Error {
    if precondition_failed(&e).is_none() {
        return Error::Connection(e);
    }
    let fix = match kind {
        "queue" => format!(
            "set the setting back to the queue's value, or drain the queue, delete it \
             (`rabbitmqctl delete_queue -p VHOST {name}`) and run `trailmark migrate` again"
        ),
        _ => format!(
            "delete the {kind} (management UI or `rabbitmqadmin delete {kind} name={name}`) and \
             run `trailmark migrate` again"
        ),
    };
    Error::Misconfigured {
        what: format!(
            "{kind} {name} exists with other arguments than trailmark declares, and RabbitMQ \
             changes none in place: {fix}"
        ),
        source: Some(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_existing_group_size_is_read_from_the_brokers_refusal() {
        let none = "PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'trailmark.steps' in vhost '/': received the value '3' of type 'signedint' but current is none";
        assert_eq!(existing_group_size(none), Some(None));
        let three = "PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'trailmark.steps' in vhost '/': received '5' but current is '3'";
        assert_eq!(existing_group_size(three), Some(Some(3)));
        let typed = "PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'trailmark.steps' in vhost '/': received the value '3' of type 'signedint' but current is the value '5' of type 'long'";
        assert_eq!(existing_group_size(typed), Some(Some(5)));
        let other = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'trailmark.steps' in vhost '/': received the value '20' of type 'signedint' but current is the value '5' of type 'signedint'";
        assert_eq!(existing_group_size(other), None);
    }

    #[test]
    fn every_quorum_queue_has_the_configured_group_size() {
        let topology = Topology::new("t", 7).with_quorum_group_size(5);
        for q in topology.queues() {
            let args = q.arguments_json();
            assert_eq!(args["x-queue-type"], "quorum", "{}", q.name);
            assert_eq!(args[QUORUM_GROUP_SIZE_ARG], 5, "{}", q.name);
        }
    }
}

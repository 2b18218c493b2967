//! Exchange and queue names and their idempotent declaration.
//!
//! Every work queue is a quorum queue with an explicit delivery limit and at-least-once
//! dead-lettering (which needs `x-overflow=reject-publish`), so a message that keeps killing its
//! consumer ends in the DLQ instead of looping. The same arguments work on RabbitMQ 3.10 and 4.x.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use super::Outgoing;
use std::collections::BTreeMap;

use crate::domain::{
    EVENT_HEADER, Event, MessageId, OutgoingMessage, RUN_START_ROUTING_KEY, RunId, RunStartEvent,
    STEP_ROUTING_KEY, StepAddress, StepMessage,
};

/// Delay tiers for step retries, in milliseconds. A per-message TTL only expires at the head of a
/// queue, so each delay gets its own queue with one queue-wide TTL.
pub const DELAY_TIERS_MS: [u64; 4] = [1_000, 5_000, 30_000, 300_000];

/// The names of everything trailmark declares, derived from one prefix.
#[derive(Debug, Clone)]
pub struct Topology {
    prefix: String,
    delivery_limit: u32,
}

impl Topology {
    /// Names under `prefix`, with the work queues' delivery limit.
    pub fn new(prefix: &str, delivery_limit: u32) -> Self {
        Self {
            prefix: prefix.to_owned(),
            delivery_limit,
        }
    }
    /// Exchange that upstream services publish run-start events to.
    pub fn runs_exchange(&self) -> String {
        format!("{}.runs", self.prefix)
    }
    /// `event` as upstream services publish it: to the runs exchange with the run-start key.
    pub fn run_start(&self, event: &RunStartEvent) -> Outgoing {
        Outgoing {
            message_id: uuid::Uuid::new_v4().to_string(),
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

    /// A quorum queue that dead-letters at least once to `exchange` (which needs
    /// `x-overflow=reject-publish`), plus `extra` arguments.
    fn quorum_args(exchange: String, extra: Vec<(&str, AMQPValue)>) -> FieldTable {
        let text = |s: &str| AMQPValue::LongString(s.into());
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert("x-dead-letter-exchange".into(), text(&exchange));
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
        for (key, value) in extra {
            args.insert(key.into(), value);
        }
        args
    }

    fn work_queue_args(&self) -> FieldTable {
        let limit = AMQPValue::LongInt(self.delivery_limit as i32);
        Self::quorum_args(self.dlx(), vec![("x-delivery-limit", limit)])
    }

    fn delay_queue_args(&self, ttl_ms: u64) -> FieldTable {
        let extra = vec![
            ("x-message-ttl", AMQPValue::LongLongInt(ttl_ms as i64)),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString(STEP_ROUTING_KEY.into()),
            ),
        ];
        Self::quorum_args(self.steps_exchange(), extra)
    }

    /// Declares everything; safe to call from every process at every start.
    pub async fn declare(&self, ch: &Channel) -> lapin::Result<()> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.exchange_declare(
            self.runs_exchange().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await?;
        ch.exchange_declare(
            self.steps_exchange().into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await?;
        ch.exchange_declare(
            self.dlx().into(),
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await?;
        ch.exchange_declare(
            self.events_exchange().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await?;

        let q = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let mut dlq_args = FieldTable::default();
        dlq_args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        ch.queue_declare(self.dlq().into(), q, dlq_args).await?;
        ch.queue_bind(
            self.dlq().into(),
            self.dlx().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;

        ch.queue_declare(self.run_start_queue().into(), q, self.work_queue_args())
            .await?;
        ch.queue_bind(
            self.run_start_queue().into(),
            self.runs_exchange().into(),
            RUN_START_ROUTING_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        ch.queue_declare(self.steps_queue().into(), q, self.work_queue_args())
            .await?;
        ch.queue_bind(
            self.steps_queue().into(),
            self.steps_exchange().into(),
            STEP_ROUTING_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        for tier in DELAY_TIERS_MS {
            ch.queue_declare(
                self.delay_queue(tier).into(),
                q,
                self.delay_queue_args(tier),
            )
            .await?;
        }
        Ok(())
    }

    /// Deletes everything under the prefix (tests and `trailmark` teardown only).
    pub async fn delete(&self, ch: &Channel) -> lapin::Result<()> {
        let mut queues = vec![self.run_start_queue(), self.steps_queue(), self.dlq()];
        queues.extend(DELAY_TIERS_MS.iter().map(|t| self.delay_queue(*t)));
        for q in queues {
            ch.queue_delete(q.into(), QueueDeleteOptions::default())
                .await?;
        }
        for x in [
            self.runs_exchange(),
            self.steps_exchange(),
            self.dlx(),
            self.events_exchange(),
        ] {
            ch.exchange_delete(x.into(), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

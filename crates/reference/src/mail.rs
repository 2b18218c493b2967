//! Outside mail: the workflow's notes leave through trailmark's outbox to an exchange of their
//! own; the mail sender consumes them and hands each to the mail sink, a stand-in for the
//! suppliers' inboxes. Delivery is at-least-once, so the sink records each note under its
//! idempotency key and only counts a repeated key as one more delivery, never as a second note.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::Result;
use trailmark::broker::{self, header_str};
use trailmark::config::BrokerSettings;

/// A note as sent: what the recipient reads, plus the claim it makes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mail {
    /// `debit_note` or `summary`.
    pub kind: String,
    /// The run that sent it.
    pub run_id: String,
    /// The claim the note makes (also in its text).
    pub claim: String,
    /// Address.
    pub recipient: String,
    /// Subject line.
    pub subject: String,
    /// Text.
    pub body: String,
}

/// The exchange notes are published to, under the broker prefix.
pub fn exchange(prefix: &str) -> String {
    format!("{prefix}.reference.mail")
}

/// The mail sender's queue.
pub fn queue(prefix: &str) -> String {
    format!("{prefix}.reference.mail")
}

/// Declares the mail exchange and queue (idempotent); must exist before a run sends notes.
pub async fn declare(ch: &Channel, prefix: &str) -> lapin::Result<()> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        exchange(prefix).into(),
        ExchangeKind::Fanout,
        durable,
        FieldTable::default(),
    )
    .await?;
    let q = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue(prefix).into(), q, FieldTable::default())
        .await?;
    ch.queue_bind(
        queue(prefix).into(),
        exchange(prefix).into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Deletes the mail exchange and queue (tests clean up with this).
pub async fn delete(ch: &Channel, prefix: &str) -> lapin::Result<()> {
    ch.queue_delete(queue(prefix).into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(exchange(prefix).into(), ExchangeDeleteOptions::default())
        .await?;
    Ok(())
}

/// The sink: records `mail` under `key`; `false` when the key was seen before (only counted).
pub async fn deliver(pool: &PgPool, key: &str, mail: &Mail) -> Result<bool> {
    let first: bool = sqlx::query_scalar(
        "INSERT INTO reference.mail_messages (key, run_id, kind, claim, recipient, subject, body)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (key) DO UPDATE SET deliveries = mail_messages.deliveries + 1, last_at = now()
         RETURNING deliveries = 1",
    )
    .bind(key)
    .bind(&mail.run_id)
    .bind(&mail.kind)
    .bind(&mail.claim)
    .bind(&mail.recipient)
    .bind(&mail.subject)
    .bind(&mail.body)
    .fetch_one(pool)
    .await?;
    Ok(first)
}

/// What the sink holds for a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SinkCounts {
    /// Debit notes recorded.
    pub notes: i64,
    /// Debit notes recorded more than once for the same claim: what a supplier would see twice.
    pub duplicate_notes: i64,
    /// Deliveries of an already recorded key, ignored by the sink.
    pub repeats_ignored: i64,
    /// Summaries recorded.
    pub summaries: i64,
    /// Withdrawal notes recorded (an undo takes a debit note back).
    pub withdrawals: i64,
}

/// Counts a run's notes at the sink.
pub async fn counts(pool: &PgPool, run_id: &str) -> Result<SinkCounts> {
    let (notes, duplicate_notes, repeats_ignored, summaries, withdrawals): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE kind = 'debit_note'),
                count(*) FILTER (WHERE kind = 'debit_note') - count(DISTINCT claim) FILTER (WHERE kind = 'debit_note'),
                COALESCE(sum(deliveries - 1), 0)::bigint,
                count(*) FILTER (WHERE kind = 'summary'),
                count(*) FILTER (WHERE kind = 'withdrawal')
           FROM reference.mail_messages WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await?;
    Ok(SinkCounts {
        notes,
        duplicate_notes,
        repeats_ignored,
        summaries,
        withdrawals,
    })
}

/// Why the mail sender stopped.
#[derive(Debug, thiserror::Error)]
pub enum SenderError {
    /// RabbitMQ went away.
    #[error("the mail sender lost the broker")]
    Broker(#[from] broker::Error),
}

/// The mail sender: consumes notes and hands each to the sink, acknowledging only after the
/// sink has recorded it. Runs until `shutdown`.
pub async fn run_sender(
    settings: BrokerSettings,
    sink: PgPool,
    shutdown: CancellationToken,
) -> std::result::Result<(), SenderError> {
    let conn = broker::connect(&settings, "reference-mail-sender").await?;
    let ch = conn.create_channel().await.map_err(broker::Error::from)?;
    declare(&ch, &settings.prefix)
        .await
        .map_err(broker::Error::from)?;
    ch.basic_qos(32, BasicQosOptions::default())
        .await
        .map_err(broker::Error::from)?;
    let mut consumer = ch
        .basic_consume(
            queue(&settings.prefix).into(),
            "reference-mail-sender".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(broker::Error::from)?;
    loop {
        let next = tokio::select! {
            next = consumer.next() => next,
            _ = shutdown.cancelled() => break,
        };
        let Some(delivery) = next else { break };
        let delivery = delivery.map_err(broker::Error::from)?;
        handle(&sink, &delivery).await;
    }
    let _ = conn.close(200, "mail sender done".into()).await;
    Ok(())
}

async fn handle(sink: &PgPool, delivery: &lapin::message::Delivery) {
    let key = header_str(
        delivery.properties.headers().as_ref(),
        trailmark::workflow::IDEMPOTENCY_KEY_HEADER,
    );
    let mail: Option<Mail> = serde_json::from_slice(&delivery.data).ok();
    let (Some(key), Some(mail)) = (key, mail) else {
        // A note without a key or a readable body cannot be recognised as a repeat: drop it loudly.
        tracing::warn!(
            "mail sender dropped a message without an idempotency key or a readable body"
        );
        let _ = delivery
            .acker
            .nack(BasicNackOptions {
                requeue: false,
                ..Default::default()
            })
            .await;
        return;
    };
    match deliver(sink, &key, &mail).await {
        Ok(first) => {
            if !first {
                tracing::info!(key = %key, claim = %mail.claim, "repeated note ignored by the sink");
            }
            let _ = delivery.acker.ack(BasicAckOptions::default()).await;
        }
        Err(e) => {
            tracing::warn!(key = %key, error = %e, "mail sink unavailable; the note goes back to the queue");
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await;
        }
    }
}

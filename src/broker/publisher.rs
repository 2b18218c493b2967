//! Publishing with publisher confirms: a message counts as sent only after the broker's ack.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use super::{Error, Result};
use crate::domain::EVENT_HEADER;

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// AMQP `message_id`: the consumer's dedup key.
    pub message_id: String,
    /// Target exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Header table.
    pub headers: FieldTable,
    /// Body.
    pub body: Vec<u8>,
}

/// A confirm-mode channel.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    confirm_timeout: Duration,
}

impl Publisher {
    /// Opens a channel on `conn` and switches it to confirm mode.
    pub async fn open(conn: &Connection, confirm_timeout: Duration) -> Result<Self> {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel,
            confirm_timeout,
        })
    }

    /// The underlying channel (for declarations on the same connection).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publishes one message and waits for its confirm.
    pub async fn publish(&self, msg: &Outgoing) -> Result<()> {
        self.publish_all(std::slice::from_ref(msg))
            .await
            .pop()
            .expect("one result per message")
    }

    /// Publishes every message, then waits for all confirms (pipelined); one result per message,
    /// in order. `mandatory` is set (except on lifecycle events), so an unroutable message is
    /// reported, never silently dropped.
    pub async fn publish_all(&self, msgs: &[Outgoing]) -> Vec<Result<()>> {
        let mut pending = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let sent = self
                .channel
                .basic_publish(
                    msg.exchange.as_str().into(),
                    msg.routing_key.as_str().into(),
                    BasicPublishOptions {
                        // A step or start message that no queue takes is an error to report;
                        // a lifecycle event nobody subscribed to is not.
                        mandatory: !msg.headers.inner().contains_key(EVENT_HEADER),
                        ..Default::default()
                    },
                    &msg.body,
                    properties(msg),
                )
                .await;
            pending.push(sent);
        }
        let mut results = Vec::with_capacity(msgs.len());
        for (msg, sent) in msgs.iter().zip(pending) {
            let outcome = match sent {
                Err(e) => Err(Error::Connection(e)),
                Ok(confirm) => match tokio::time::timeout(self.confirm_timeout, confirm).await {
                    Err(_) => Err(Error::ConfirmTimeout(self.confirm_timeout)),
                    Ok(Err(e)) => Err(Error::Connection(e)),
                    Ok(Ok(c)) => check(msg, c),
                },
            };
            results.push(outcome);
        }
        results
    }
}

fn properties(msg: &Outgoing) -> BasicProperties {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    BasicProperties::default()
        .with_message_id(msg.message_id.as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(now)
        .with_headers(msg.headers.clone())
}

fn check(msg: &Outgoing, confirmation: Confirmation) -> Result<()> {
    let refused = |why: String| Error::Refused {
        message_id: msg.message_id.clone(),
        exchange: msg.exchange.clone(),
        routing_key: msg.routing_key.clone(),
        why,
    };
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(ret)) => {
            Err(refused(format!("returned unroutable: {}", ret.reply_text)))
        }
        Confirmation::Nack(_) => Err(refused("nacked (queue full or rejecting publishes)".into())),
        Confirmation::NotRequested => Err(refused("channel is not in confirm mode".into())),
    }
}

//! Publishing with publisher confirms: a message counts as sent only after the broker's ack.

use std::sync::{Arc, Mutex};
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

/// A confirm-mode channel that heals: the broker closes a channel for one bad publish (a
/// missing exchange), and every later publish on it would fail; the next publish opens a new one
/// on the same connection instead.
#[derive(Clone)]
pub struct Publisher {
    conn: Arc<Connection>,
    channel: Arc<Mutex<Channel>>,
    // One reopening at a time: concurrent publishers that find the channel closed wait for it.
    reopening: Arc<tokio::sync::Mutex<()>>,
    confirm_timeout: Duration,
}

async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

impl Publisher {
    /// Opens a channel on `conn` and switches it to confirm mode.
    pub async fn open(conn: &Arc<Connection>, confirm_timeout: Duration) -> Result<Self> {
        let channel = confirm_channel(conn).await?;
        Ok(Self {
            conn: conn.clone(),
            channel: Arc::new(Mutex::new(channel)),
            reopening: Arc::default(),
            confirm_timeout,
        })
    }

    /// The underlying channel (for declarations on the same connection).
    pub fn channel(&self) -> Channel {
        self.channel.lock().expect("channel lock").clone()
    }

    /// Whether the connection under the publisher is up (a closed channel is reopened; a
    /// closed connection is not).
    pub fn connected(&self) -> bool {
        self.conn.status().connected()
    }

    /// The channel, reopened first if the broker closed it.
    async fn live_channel(&self) -> Result<Channel> {
        let current = self.channel();
        if current.status().connected() {
            return Ok(current);
        }
        let _one = self.reopening.lock().await;
        let current = self.channel();
        if current.status().connected() {
            return Ok(current);
        }
        let fresh = confirm_channel(&self.conn).await?;
        tracing::info!("publisher channel reopened (the broker had closed the previous one)");
        *self.channel.lock().expect("channel lock") = fresh.clone();
        Ok(fresh)
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
        let channel = match self.live_channel().await {
            Ok(c) => c,
            Err(e) => {
                let why = crate::error::Report(&e).to_string();
                return msgs
                    .iter()
                    .map(|_| {
                        Err(Error::Unavailable {
                            what: format!("the publisher could not reopen its channel: {why}"),
                            source: None,
                        })
                    })
                    .collect();
            }
        };
        let mut pending = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let sent = channel
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

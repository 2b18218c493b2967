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
    // Publishes nacked in a row, with no ack between them (see `NACKS_BEFORE_REOPEN`).
    nacks: Arc<std::sync::atomic::AtomicU32>,
}

/// A channel whose publishes are all nacked this many times in a row is closed and reopened: a
/// channel opened while a quorum queue elected its leader was seen nacked on every publish for
/// over ten minutes on RabbitMQ 3.10, and a fresh channel cured it. Nacked messages are never
/// counted as published (the outbox keeps them), so reopening costs nothing but the channel.
const NACKS_BEFORE_REOPEN: u32 = 20;

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
            nacks: Arc::default(),
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
                    Ok(Ok(c)) => {
                        self.count_nack(&channel, matches!(c, Confirmation::Nack(_)))
                            .await;
                        check(msg, c)
                    }
                },
            };
            results.push(outcome);
        }
        results
    }

    /// Counts nacks in a row; closes the channel (the next publish opens a fresh one) once there
    /// were [`NACKS_BEFORE_REOPEN`] of them.
    async fn count_nack(&self, channel: &Channel, nacked: bool) {
        use std::sync::atomic::Ordering;
        if !nacked {
            self.nacks.store(0, Ordering::Relaxed);
            return;
        }
        if self.nacks.fetch_add(1, Ordering::Relaxed) + 1 >= NACKS_BEFORE_REOPEN {
            self.nacks.store(0, Ordering::Relaxed);
            tracing::warn!(
                nacks = NACKS_BEFORE_REOPEN,
                "every publish on this channel was nacked; reopening it (a channel opened during a quorum queue's leader election can stay that way)"
            );
            let _ = channel
                .close(200, "reopening after repeated nacks".into())
                .await;
        }
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
        Confirmation::Nack(_) => Err(Error::Nacked {
            message_id: msg.message_id.clone(),
            exchange: msg.exchange.clone(),
            routing_key: msg.routing_key.clone(),
        }),
        Confirmation::NotRequested => Err(refused("channel is not in confirm mode".into())),
    }
}

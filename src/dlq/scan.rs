//! One pass over the DLQ on a channel of its own.
//!
//! Messages are taken with `basic.get` and manual ack. Whatever the caller acks is gone; every
//! other message stays unacknowledged until [`Scan::finish`] closes the channel, which hands it
//! back to the queue untouched. Holding them meanwhile is what keeps the pass from seeing a message
//! twice, and the depth at the start bounds it, so messages dead-lettered while it runs (perhaps
//! the very ones it requeued) wait for the next pass instead of making this one endless.
//!
//! A quorum queue takes the messages of a closed channel back asynchronously, a moment after the
//! close. A pass started right then (`dlq purge ID` shows the message first, then purges it; a
//! script runs `dlq list` and then `dlq requeue ID`) would find them missing, so `finish` waits,
//! bounded, until they are visible again.

use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use super::{Error, Progress, Result};

/// How often (in messages) long passes report progress.
pub(super) const PROGRESS_EVERY: u32 = 500;
/// The longest `finish` waits for returned messages to be visible again.
const SETTLE_WITHIN: Duration = Duration::from_secs(10);

/// An open pass over one queue.
pub(super) struct Scan<'a> {
    conn: &'a Connection,
    channel: Channel,
    queue: String,
    depth: u32,
    taken: u32,
    acked: u32,
    progress: Progress<'a>,
}

impl<'a> Scan<'a> {
    /// Opens a channel and reads the queue's depth; a missing queue is [`Error::QueueMissing`].
    pub async fn open(conn: &'a Connection, queue: &str, progress: Progress<'a>) -> Result<Self> {
        let channel = conn.create_channel().await?;
        let depth = depth(&channel, queue).await?;
        Ok(Self {
            conn,
            channel,
            queue: queue.to_owned(),
            depth,
            taken: 0,
            acked: 0,
            progress,
        })
    }

    /// Messages in the queue when the pass began.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Messages of the starting depth this pass did not get to see: another client (a
    /// concurrent `dlq` command) was holding them.
    pub fn unseen(&self) -> u32 {
        self.depth.saturating_sub(self.taken)
    }

    /// The next message, or `None` once the queue is empty or the starting depth is used up.
    pub async fn next(&mut self) -> Result<Option<Delivery>> {
        if self.taken >= self.depth {
            return Ok(None);
        }
        let got = self
            .channel
            .basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?;
        let Some(got) = got else {
            return Ok(None);
        };
        self.taken += 1;
        if self.taken.is_multiple_of(PROGRESS_EVERY) {
            (self.progress)(self.taken, self.depth);
        }
        Ok(Some(got.delivery))
    }

    /// Removes a message taken in this pass from the queue for good.
    pub async fn ack(&mut self, delivery: &Delivery) -> Result<()> {
        delivery.acker.ack(BasicAckOptions::default()).await?;
        self.acked += 1;
        Ok(())
    }

    /// Ends the pass: every message taken and not acked goes back to the queue, and is visible
    /// there again when this returns (or after a bounded wait, if others are taking messages too).
    pub async fn finish(self) {
        let held = self.taken - self.acked;
        let ready = match held {
            0 => None,
            _ => depth(&self.channel, &self.queue).await.ok(),
        };
        // A failed close still ends the channel, and the broker returns the messages either way.
        let _ = self.channel.close(200, "dlq pass done".into()).await;
        if let Some(ready) = ready {
            settle(self.conn, &self.queue, ready + held).await;
        }
    }
}

/// Polls (bounded) until `queue` holds at least `expected` ready messages.
async fn settle(conn: &Connection, queue: &str, expected: u32) {
    let Ok(channel) = conn.create_channel().await else {
        return;
    };
    let deadline = Instant::now() + SETTLE_WITHIN;
    while Instant::now() < deadline {
        match depth(&channel, queue).await {
            Ok(now) if now < expected => tokio::time::sleep(Duration::from_millis(20)).await,
            _ => break,
        }
    }
    let _ = channel.close(200, "dlq settled".into()).await;
}

/// The number of ready messages in `queue`, without creating it.
pub(super) async fn depth(channel: &Channel, queue: &str) -> Result<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        durable: true,
        ..Default::default()
    };
    match channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => Ok(q.message_count()),
        Err(e) if is_not_found(&e) => Err(Error::QueueMissing {
            queue: queue.to_owned(),
        }),
        Err(e) => Err(e.into()),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404)
}

//! The dead-letter queue, for operators: list, show, requeue and purge.
//!
//! Every pass takes messages from `<prefix>.dlq` with `basic.get` on a channel of its own, acks
//! only the messages it handled, and closes the channel so that all others return untouched
//! (see `scan.rs`). A requeued message is published with confirms to the default exchange, routed
//! straight to the work queue it died in, with its body, `message_id` and original headers; only
//! then is its DLQ copy acked. It goes through the normal pipeline again, so the consumer's inbox
//! still turns a second copy into a no-op. A crash between the confirm and the ack leaves it in
//! both places, which is safe for the same reason. Listings page through the letters in the order
//! they died, not the queue's (`page.rs`).

mod letter;
mod ops;
mod page;
mod scan;

use std::time::Duration;

use lapin::Connection;

pub use letter::{BodyView, DELIVERY_LIMIT, DeadLetter, DeadLetteredBy, REQUEUED, headers_json};
pub use ops::{Count, Failure, Listing, Purged, Requeued, Shown};
pub use page::{Cursor, NotACursor, Page};

use crate::broker::{self, Topology};
use crate::config::BrokerSettings;

/// DLQ errors, by what the operator does about them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// RabbitMQ is unreachable, or the connection failed mid-pass (messages taken and not yet
    /// handled go back to the DLQ by themselves).
    #[error("the dead-letter pass stopped")]
    Broker(#[source] broker::Error),
    /// No message with this id is in the DLQ.
    #[error(
        "no dead letter with id {id} in {queue}{}; list them with `trailmark dlq list` (the id is the first column)",
        unseen_note(*.unseen)
    )]
    NotFound {
        /// The id asked for.
        id: String,
        /// The DLQ searched.
        queue: String,
        /// Messages another client was holding, which could not be looked at.
        unseen: u32,
    },
    /// The message says nothing about the queue it came from, so requeue cannot send it back.
    #[error(
        "dead letter {id} names no source queue (no x-trailmark-queue or x-death header); inspect it with `trailmark dlq show {id}` and publish a fixed copy yourself, then purge it"
    )]
    NoSourceQueue {
        /// The message.
        id: String,
    },
    /// The queue does not exist under this prefix.
    #[error(
        "queue {queue} does not exist; check TRAILMARK__BROKER__PREFIX, or declare the topology with `trailmark migrate`"
    )]
    QueueMissing {
        /// The queue looked for.
        queue: String,
    },
}

fn unseen_note(unseen: u32) -> String {
    match unseen {
        0 => String::new(),
        n => format!(
            " ({n} other messages were held by another client, such as a concurrent `dlq` command, and could not be checked: try again when it is done)"
        ),
    }
}

impl From<lapin::Error> for Error {
    fn from(e: lapin::Error) -> Self {
        Self::Broker(broker::Error::Connection(e))
    }
}

impl From<broker::Error> for Error {
    fn from(e: broker::Error) -> Self {
        Self::Broker(e)
    }
}

/// Shorthand for DLQ results.
pub type Result<T> = std::result::Result<T, Error>;

/// Called every few hundred messages of a long pass with (messages taken, depth at the start).
pub type Progress<'a> = &'a (dyn Fn(u32, u32) + Send + Sync);

/// A progress callback that says nothing.
pub fn quiet(_taken: u32, _depth: u32) {}

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Every copy carrying this id.
    Id(String),
    /// Every copy carrying one of these ids.
    Ids(Vec<String>),
    /// Every message.
    All,
    /// Every message with this reason code.
    Reason(String),
}

impl Selection {
    /// Whether `letter` is selected.
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        match self {
            Self::Id(id) => letter.id == *id,
            Self::Ids(ids) => ids.contains(&letter.id),
            Self::All => true,
            Self::Reason(r) => letter.reason == *r,
        }
    }

    /// How the audit trail names what was selected: ids, `reason:<code>` or `all`.
    pub fn target(&self) -> String {
        match self {
            Self::Id(id) => id.clone(),
            Self::Ids(ids) => ids.join(","),
            Self::Reason(code) => format!("reason:{code}"),
            Self::All => "all".into(),
        }
    }
}

/// A connection to one installation's DLQ.
pub struct Dlq {
    conn: std::sync::Arc<Connection>,
    topology: Topology,
    delivery_limit: u32,
    confirm_timeout: Duration,
}

impl Dlq {
    /// Connects to RabbitMQ for the installation named by `settings.prefix`.
    pub async fn connect(settings: &BrokerSettings) -> Result<Self> {
        let conn = broker::connect(settings, "dlq").await?;
        Ok(Self {
            conn,
            topology: Topology::new(&settings.prefix, settings.delivery_limit),
            delivery_limit: settings.delivery_limit,
            confirm_timeout: Duration::from_millis(settings.confirm_timeout_ms),
        })
    }

    /// The DLQ's name.
    pub fn queue(&self) -> String {
        self.topology.dlq()
    }

    /// Messages ready in the DLQ now (not counting any another pass is holding).
    pub async fn depth(&self) -> Result<u32> {
        let channel = self.conn.create_channel().await?;
        let depth = scan::depth(&channel, &self.queue()).await;
        let _ = channel.close(200, "depth read".into()).await;
        depth
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.conn.close(200, "dlq done".into()).await;
    }
}

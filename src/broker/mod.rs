//! RabbitMQ: connection, topology (declared idempotently), and a publisher that waits for
//! confirms. No home-made recovery beyond "connect again": callers loop on [`connect`].

mod headers;
mod publisher;
mod topology;

use std::time::Duration;

use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

pub use headers::{header_str, headers_to_map, map_to_headers};
pub use publisher::{Outgoing, Publisher};
pub use topology::Topology;

use crate::config::BrokerSettings;
use crate::error::{Cause, Reaction};
use crate::redact;

/// Broker errors, by how the caller reacts to them ([`Error::reaction`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Could not connect: the broker is down or unreachable. Retry later.
    #[error("{what}")]
    Unavailable {
        /// What failed (with the redacted URL) and what to do.
        what: String,
        /// Why.
        #[source]
        source: Option<Cause>,
    },
    /// The broker refuses what no retry can fix (a malformed URL, wrong credentials, a missing
    /// vhost, no permission): a person must fix the configuration.
    #[error("{what}")]
    Misconfigured {
        /// What is wrong and how to fix it.
        what: String,
        /// Why.
        #[source]
        source: Option<Cause>,
    },
    /// The connection or channel failed: reconnect and try again.
    #[error("the broker connection failed")]
    Connection(#[from] lapin::Error),
    /// The broker refused a publish (nack) or returned it as unroutable.
    #[error(
        "broker refused message {message_id} to exchange {exchange:?} key {routing_key:?}: {why}"
    )]
    Refused {
        /// The message.
        message_id: String,
        /// Target exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
        /// Nack, or the return reply text.
        why: String,
    },
    /// No confirm arrived in time; the message may or may not be stored.
    #[error("no publisher confirm within {0:?}; the message will be published again")]
    ConfirmTimeout(Duration),
}

impl Error {
    /// How a caller reacts to this error.
    pub fn reaction(&self) -> Reaction {
        match self {
            Self::Misconfigured { .. } => Reaction::Fix,
            Self::Refused { .. } => Reaction::Refused,
            Self::Unavailable { .. } | Self::Connection(_) | Self::ConfirmTimeout(_) => {
                Reaction::Retry
            }
        }
    }
}

/// Shorthand for broker results.
pub type Result<T> = std::result::Result<T, Error>;

/// Opens a connection, naming it after the process so it is recognisable in the broker's UI.
/// The AMQP heartbeat is `broker.heartbeat_secs` unless the URL sets one: a frozen process (a
/// long GC-like pause, SIGSTOP) stops heartbeating, so the broker closes its connection and hands
/// its unacknowledged messages to live consumers instead of leaving them with a sleeper.
pub async fn connect(settings: &BrokerSettings, name: &str) -> Result<Connection> {
    let url = redact::url(&settings.url);
    let mut uri: AMQPUri = settings
        .url
        .parse()
        .map_err(|e: String| Error::Misconfigured {
            what: format!("AMQP_URL {url} is not a valid AMQP URL"),
            source: Some(e.into()),
        })?;
    if uri.query.heartbeat.is_none() && settings.heartbeat_secs > 0 {
        uri.query.heartbeat = Some(settings.heartbeat_secs);
    }
    let props =
        ConnectionProperties::default().with_connection_name(format!("trailmark-{name}").into());
    Connection::connect_uri(uri, props)
        .await
        .map_err(|e| Error::Unavailable {
            what: format!(
                "cannot connect to RabbitMQ at {url} (is it running? Start it with `rabbitmq-server -detached`, or set AMQP_URL)"
            ),
            source: Some(e.into()),
        })
}

/// Connects, publishes one message with a confirm, and disconnects: for the CLI and the demo,
/// which publish once per invocation.
pub async fn publish_once(settings: &BrokerSettings, name: &str, msg: &Outgoing) -> Result<()> {
    let conn = connect(settings, name).await?;
    let publisher =
        Publisher::open(&conn, Duration::from_millis(settings.confirm_timeout_ms)).await?;
    let published = publisher.publish(msg).await;
    let _ = conn.close(200, "done".into()).await;
    published
}

/// Declares the exchanges and queues of `settings.broker.prefix` (idempotent; every worker also
/// declares them at start). An existing queue declared with other arguments is refused by the
/// broker; it must be deleted first.
pub async fn declare_topology(settings: &BrokerSettings) -> Result<()> {
    let conn = connect(settings, "migrate").await?;
    let channel = conn.create_channel().await?;
    let declared = Topology::new(&settings.prefix, settings.delivery_limit)
        .declare(&channel)
        .await;
    let _ = conn.close(200, "done".into()).await;
    Ok(declared?)
}

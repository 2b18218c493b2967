//! RabbitMQ: connection, topology (declared idempotently), and a publisher that waits for
//! confirms. No home-made recovery beyond "connect again": callers loop on [`connect`].

mod headers;
mod publisher;
mod topology;

use std::sync::Arc;
use std::time::Duration;

use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

pub use headers::{header_str, headers_to_map, map_to_headers};
pub use publisher::{Outgoing, Publisher};
pub use topology::{
    BindingSpec, DEFAULT_QUORUM_GROUP_SIZE, ExchangeSpec, KeptGroupSize, QUORUM_GROUP_SIZE_ARG,
    QueueSpec, Topology,
};

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
pub async fn connect(settings: &BrokerSettings, name: &str) -> Result<Arc<Connection>> {
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
    let (user, vhost) = (uri.authority.userinfo.username.clone(), uri.vhost.clone());
    // Shared: a publisher reopens its channel on it when the broker closed the old one.
    Connection::connect_uri(uri, props)
        .await
        .map(Arc::new)
        .map_err(|e| refused_connection(&url, &user, &vhost, e))
}

/// Why a connection to RabbitMQ failed, with the advice that fits the cause: a broker that is not
/// reachable is worth waiting for; a refused login or a missing vhost is not.
fn refused_connection(url: &str, user: &str, vhost: &str, e: lapin::Error) -> Error {
    let amqp = match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            Some((amqp.get_id(), amqp.get_message().to_string()))
        }
        _ => None,
    };
    let fix = match amqp {
        Some((403, _)) => Some(format!(
            "RabbitMQ at {url} refused the login of user {user:?}: fix the user or password in AMQP_URL"
        )),
        Some((530, text)) if text.contains("not found") => Some(format!(
            "vhost {vhost:?} does not exist on RabbitMQ at {url}: create it (`rabbitmqctl add_vhost {vhost}`), or fix the vhost in AMQP_URL"
        )),
        Some((530, _)) => Some(format!(
            "user {user:?} may not use vhost {vhost:?} on RabbitMQ at {url}: grant it (`rabbitmqctl set_permissions -p {vhost} {user} '.*' '.*' '.*'`), or fix AMQP_URL"
        )),
        _ => None,
    };
    match fix {
        Some(what) => Error::Misconfigured {
            what,
            source: Some(e.into()),
        },
        None => Error::Unavailable {
            what: format!(
                "cannot connect to RabbitMQ at {url} (is it running? Start it with `rabbitmq-server -detached`, or fix the host and port in AMQP_URL)"
            ),
            source: Some(e.into()),
        },
    }
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
/// declares them at start). An existing queue with other arguments is refused
/// ([`Error::Misconfigured`], naming it), except for its initial group size: such a queue is
/// used as it is and returned (see [`Topology::declare`]).
pub async fn declare_topology(settings: &BrokerSettings) -> Result<Vec<KeptGroupSize>> {
    let conn = connect(settings, "migrate").await?;
    let declared = Topology::from_settings(settings).declare(&conn).await;
    let _ = conn.close(200, "done".into()).await;
    declared
}

/// What a queue holds and who reads it, as the broker tells a passive declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueState {
    /// Messages ready for delivery (not counting those delivered and not yet acknowledged).
    pub messages: u32,
    /// Consumers attached.
    pub consumers: u32,
}

/// The state of `queue`, or `None` when it does not exist.
pub async fn queue_state(settings: &BrokerSettings, queue: &str) -> Result<Option<QueueState>> {
    use lapin::options::QueueDeclareOptions;
    let conn = connect(settings, "inspect").await?;
    let channel = conn.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, Default::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
    match declared {
        Ok(q) => Ok(Some(QueueState {
            messages: q.message_count(),
            consumers: q.consumer_count(),
        })),
        // A passive declare of a missing queue is refused with NOT_FOUND (and closes the channel).
        Err(e) if e.to_string().contains("NOT_FOUND") => Ok(None),
        Err(e) => Err(e.into()),
    }
}

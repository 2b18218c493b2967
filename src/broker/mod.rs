//! RabbitMQ: connection, topology (declared idempotently), and a publisher that waits for
//! confirms. No home-made recovery beyond "connect again": callers loop on [`connect`].

mod headers;
mod publisher;
mod topology;

use std::sync::Arc;
use std::time::Duration;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

pub use headers::{header_str, headers_to_map, map_to_headers};
pub use publisher::{Outgoing, Publisher};
pub use topology::{
    BindingSpec, DEFAULT_QUORUM_GROUP_SIZE, DELAY_TIERS_MS, ExchangeSpec, KeptGroupSize, QUORUM_GROUP_SIZE_ARG,
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
        /// The return's reply text (unroutable), or why confirms are off.
        why: String,
    },
    /// The broker nacked the message: it could not take it now (a quorum queue over its limit
    /// or without a leader, a channel in a bad state). Not the message's fault: publish it again
    /// soon, on a fresh channel if nacks go on.
    #[error(
        "broker nacked message {message_id} to exchange {exchange:?} key {routing_key:?} (queue full, or not accepting publishes now); it will be published again"
    )]
    Nacked {
        /// The message.
        message_id: String,
        /// Target exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
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
            Self::Unavailable { .. }
            | Self::Connection(_)
            | Self::ConfirmTimeout(_)
            | Self::Nacked { .. } => {
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
    let addresses = settings.addresses();
    // Each connect starts at the next address, so a process's connections spread over the nodes
    // and a reconnect after a node is lost tries another one first; each process starts at its
    // own (by pid), or a fleet started alike would put every first connection on one node.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let start =
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + std::process::id() as usize;
    let mut last = None;
    for i in 0..addresses.len() {
        let address = addresses[(start + i) % addresses.len()];
        match connect_to(settings, address, name).await {
            Ok(conn) => return Ok(conn),
            // A refused login, a missing vhost or a certificate problem is the same on every
            // node: say it now.
            Err(e @ Error::Misconfigured { .. }) => return Err(e),
            Err(e) => {
                if addresses.len() > 1 {
                    tracing::warn!(address = %redact::url(address), error = %crate::error::Report(&e), "broker address did not answer; trying the next");
                }
                last = Some(e);
            }
        }
    }
    Err(last.expect("at least one broker address"))
}

async fn connect_to(
    settings: &BrokerSettings,
    address: &str,
    name: &str,
) -> Result<Arc<Connection>> {
    let url = redact::url(address);
    let mut uri: AMQPUri = address.parse().map_err(|e: String| Error::Misconfigured {
        what: format!("AMQP_URL {url} is not a valid AMQP URL"),
        source: Some(e.into()),
    })?;
    if uri.query.heartbeat.is_none() && settings.heartbeat_secs > 0 {
        uri.query.heartbeat = Some(settings.heartbeat_secs);
    }
    let props =
        ConnectionProperties::default().with_connection_name(format!("trailmark-{name}").into());
    let (user, vhost) = (uri.authority.userinfo.username.clone(), uri.vhost.clone());
    let host = uri.authority.host.clone();
    let tls = tls_config(settings)?;
    let runtime = lapin::runtime::default_runtime()?;
    // Shared: a publisher reopens its channel on it when the broker closed the old one.
    Connection::connect_uri_with_config(uri, props, tls, runtime)
        .await
        .map(Arc::new)
        .map_err(|e| match tls_refused(settings, &url, &host, &e) {
            Some(what) => Error::Misconfigured {
                what,
                source: Some(e.into()),
            },
            None => refused_connection(&url, &user, &vhost, e),
        })
}

/// The CA and client certificate of an `amqps://` connection, read from the files the settings
/// name at every connection, so that renewed files are used from the next reconnect on. The
/// files were checked when the settings loaded; one that went away since is named here.
fn tls_config(settings: &BrokerSettings) -> Result<OwnedTLSConfig> {
    use crate::config::tls::{Pem, read_pem};
    let read = |setting: &str, path: &str, kind| {
        read_pem(setting, path, kind).map_err(|e| Error::Misconfigured {
            what: e.to_string(),
            source: None,
        })
    };
    let mut config = OwnedTLSConfig::default();
    if !settings.ca_file.is_empty() {
        let pem = read("broker.ca_file", &settings.ca_file, Pem::Certificates)?;
        // Checked as PEM certificates above, so it is text.
        config.cert_chain = Some(String::from_utf8_lossy(&pem).into_owned());
    }
    if !settings.client_cert_file.is_empty() {
        config.identity = Some(OwnedIdentity::PKCS8 {
            pem: read(
                "broker.client_cert_file",
                &settings.client_cert_file,
                Pem::Certificates,
            )?,
            key: read(
                "broker.client_key_file",
                &settings.client_key_file,
                Pem::PrivateKey,
            )?,
        });
    }
    Ok(config)
}

/// What a failed TLS handshake with RabbitMQ means, with the setting that fixes it; `None` when
/// TLS is not what failed.
fn tls_refused(
    settings: &BrokerSettings,
    url: &str,
    host: &str,
    e: &lapin::Error,
) -> Option<String> {
    use crate::config::tls::{Refusal, it_names, refusal};
    let lapin::ErrorKind::IOError(io) = e.kind() else {
        return None;
    };
    Some(match refusal(io.as_ref())? {
        Refusal::UnknownIssuer if settings.ca_file.is_empty() => format!(
            "the certificate of RabbitMQ at {url} is not signed by a CA this machine trusts: set broker.ca_file (TRAILMARK__BROKER__CA_FILE) to the CA that signed it"
        ),
        Refusal::UnknownIssuer => format!(
            "the certificate of RabbitMQ at {url} is not signed by broker.ca_file ({}) nor by a CA this machine trusts: set broker.ca_file to the CA that signed the broker's certificate",
            settings.ca_file
        ),
        Refusal::WrongName { presented } => format!(
            "the certificate of RabbitMQ at {url} does not name the host {host:?}{}: connect to a name the certificate holds in AMQP_URL, or give the broker a certificate for {host:?}",
            it_names(&presented)
        ),
        alert @ Refusal::ServerAlert(_) if alert.about_client_certificate() => {
            if settings.client_cert_file.is_empty() {
                format!(
                    "RabbitMQ at {url} ended the TLS handshake {alert}: it wants a client certificate; set broker.client_cert_file and broker.client_key_file"
                )
            } else {
                format!(
                    "RabbitMQ at {url} ended the TLS handshake {alert}: it does not accept broker.client_cert_file ({}); give it a certificate signed by a CA in the broker's ssl_options.cacertfile",
                    settings.client_cert_file
                )
            }
        }
        alert @ Refusal::ServerAlert(_) => {
            format!("RabbitMQ at {url} ended the TLS handshake {alert}: check its ssl_options")
        }
        other => format!(
            "the certificate of RabbitMQ at {url} {other}: the broker needs a valid certificate"
        ),
    })
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

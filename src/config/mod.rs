//! Typed settings: the compiled-in `config/default.toml`, then an optional file, then the
//! environment (`TRAILMARK__SECTION__KEY`, `DATABASE_URL`, `AMQP_URL`). A key this build does
//! not know and a value outside its range are refused (`check.rs`), never ignored; so is a TLS
//! file (`tls.rs`) that cannot be read or holds no certificate.

mod check;
pub mod tls;
pub mod tokens;

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::model::ModelSettings;

const DEFAULTS: &str = include_str!("../../config/default.toml");

/// Why settings could not be loaded; shown to the operator as is.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct Error(String);

impl Error {
    /// An error saying which setting is wrong and what to do about it.
    pub(crate) fn new(what: impl Into<String>) -> Self {
        Self(what.into())
    }
}

/// All of trailmark's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// Postgres.
    pub database: DatabaseSettings,
    /// RabbitMQ.
    pub broker: BrokerSettings,
    /// Step consumers.
    pub worker: WorkerSettings,
    /// Outbox relay.
    pub relay: RelaySettings,
    /// Lease and stuck-run supervisor.
    pub supervisor: SupervisorSettings,
    /// Runs waiting for events or sleeping: timers, limits, how long events are kept.
    pub waits: WaitSettings,
    /// How long finished runs, tombstones, inbox ids and audit rows are kept; archival.
    pub retention: RetentionSettings,
    /// How a long-running process starts and stops.
    pub process: ProcessSettings,
    /// The HTTP API, health endpoints and metrics.
    pub api: ApiSettings,
    /// Timeouts, budgets, loop detection, circuit breakers.
    pub guards: GuardSettings,
    /// The OpenAI-compatible model endpoint.
    #[serde(default)]
    pub model: ModelSettings,
    /// Traces exported with OTLP (off by default).
    #[serde(default)]
    pub tracing: TracingSettings,
    /// Concurrency keys: how waiting runs are handed slots.
    #[serde(default)]
    pub flow: FlowSettings,
    /// Steps served by endpoints in other languages (`docs/STEP_PROTOCOL.md`).
    #[serde(default)]
    pub remote: RemoteSettings,
}

/// Where the steps of workflows written in other languages are served, and where their
/// callbacks reach this process (`docs/STEP_PROTOCOL.md`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RemoteSettings {
    /// `name=url` each; the secret of endpoint `name` comes from the environment variable
    /// `TRAILMARK_REMOTE_SECRET_<NAME>` (never from a file that is printed or committed).
    pub endpoints: Vec<String>,
    /// Where this process listens for callbacks while a remote step runs (port 0: a free port).
    pub callback_listen: String,
    /// The URL endpoints call back on; empty: `http://` and the bound address.
    pub callback_url: String,
    /// How long a starting worker waits for each endpoint's manifest before refusing to start.
    pub manifest_wait_secs: u64,
    /// Tables of trailmark's database that remote workflows may write with their commit.
    pub local_tables: Vec<String>,
}

impl Default for RemoteSettings {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            callback_listen: "127.0.0.1:0".into(),
            callback_url: String::new(),
            manifest_wait_secs: 30,
            local_tables: Vec::new(),
        }
    }
}

/// How runs waiting for a slot of their concurrency key are served (`docs/OPERATIONS.md`,
/// "Concurrency keys").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct FlowSettings {
    /// How often the supervisor hands free slots to waiting runs when no step's end did (a slot
    /// freed by a dead worker, a limit raised, a rate's next token), in milliseconds.
    pub poll_ms: u64,
    /// Seconds of waiting that lift a run one priority level, so the lowest is served in the end.
    pub aging_secs: u64,
}

impl Default for FlowSettings {
    fn default() -> Self {
        Self {
            poll_ms: 250,
            aging_secs: 60,
        }
    }
}

/// Where a process sends its spans (one trace per run, see `trace`): off unless an endpoint is
/// set here or in `OTEL_EXPORTER_OTLP_ENDPOINT`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TracingSettings {
    /// Base URL of an OTLP/HTTP receiver (`http://collector:4318`); spans go to `/v1/traces`
    /// under it, protobuf-encoded. Empty: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) if set, else no tracing at all.
    #[serde(default)]
    pub otlp_endpoint: String,
    /// Most milliseconds a finished span waits before it is sent (0: the exporter's default,
    /// 5 s, or `OTEL_BSP_SCHEDULE_DELAY`).
    #[serde(default)]
    pub export_interval_ms: u64,
}

/// Where the checkpoints live.
#[derive(Clone, Serialize, Deserialize)]
pub struct DatabaseSettings {
    /// Postgres URL; may contain a password, so never log it unredacted (trailmark prints it through its redaction).
    pub url: String,
    /// A primary and its standbys (`host` or `host:port`), for a highly available Postgres:
    /// trailmark connects only to the one that takes writes and follows a failover. Empty: the
    /// URL's host. The driver cannot take libpq's multi-host URL, hence a list of its own.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Journal entries, effect results and advance commits do not wait for their WAL flush (a
    /// later synchronous commit makes them durable); off for a Postgres that can fail
    /// over (always off with `hosts`), where that next commit may land on a standby that never
    /// received them.
    #[serde(default = "yes")]
    pub relaxed_commits: bool,
    /// Pool size per process.
    pub max_connections: u32,
    /// How long to wait for a connection before reporting the database as down.
    pub connect_timeout_ms: u64,
}

/// Where the step messages travel.
#[derive(Clone, Serialize, Deserialize)]
pub struct BrokerSettings {
    /// AMQP URL; may contain a password, so never log it unredacted.
    pub url: String,
    /// Several AMQP URLs, one per node of a cluster, tried in turn on every connect and
    /// reconnect (each process starts at another one, so connections spread); when set, `url`
    /// is not used.
    pub urls: Vec<String>,
    /// Prefix of every exchange and queue name.
    pub prefix: String,
    /// Quorum-queue delivery limit before a message is dead-lettered.
    pub delivery_limit: u32,
    /// Replicas of each quorum queue trailmark creates (`x-quorum-initial-group-size`), so a
    /// cluster keeps its queues when a node is lost; RabbitMQ caps it at the nodes it has.
    pub quorum_group_size: u32,
    /// How long to wait for a publisher confirm before treating the publish as failed.
    pub confirm_timeout_ms: u64,
    /// AMQP heartbeat in seconds (unless the URL sets one); 0 leaves it to the server.
    pub heartbeat_secs: u16,
    /// With `amqps://`: a PEM file of the CA(s) that signed the broker's certificate, trusted
    /// besides the system's (empty: the system's only). The AMQP URL has no place for it.
    pub ca_file: String,
    /// With `amqps://`, for a broker that asks for client certificates: this client's
    /// certificate (PEM), with `client_key_file`; empty: none is sent.
    pub client_cert_file: String,
    /// The unencrypted PEM private key of `client_cert_file`.
    pub client_key_file: String,
}

fn yes() -> bool {
    true
}

impl BrokerSettings {
    /// The addresses to connect to: `urls` when set, else `url`.
    pub fn addresses(&self) -> Vec<&str> {
        if self.urls.is_empty() {
            vec![self.url.as_str()]
        } else {
            self.urls.iter().map(String::as_str).collect()
        }
    }
}

/// How a worker process consumes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSettings {
    /// Deliveries in flight at once (also the channel prefetch).
    pub concurrency: u16,
    /// Most claims, effect intents, records or step commits run as one statement (group commit;
    /// 1 = none).
    pub max_batch: usize,
    /// Lease length in seconds, measured on the database clock.
    pub lease_secs: u64,
    /// Heartbeat period in seconds; must be well under `lease_secs`.
    pub heartbeat_secs: u64,
    /// Delay before a message for a busy run is tried again.
    pub busy_retry_ms: u64,
    /// How long a step of a workflow version newer than the worker's waits for a worker that
    /// runs it before it is dead-lettered as `version_not_deployed`.
    pub newer_version_wait_secs: u64,
    /// Largest body accepted; larger ones are dead-lettered unread.
    pub max_message_bytes: usize,
    /// In-process retries of a temporary failure, per call, under the same key.
    pub call_retries: usize,
    /// Claims of one step before the run goes to needs_review (a crash loop ends too).
    pub max_attempts: i32,
    /// First delay of a delayed step retry; doubles per attempt.
    pub retry_base_ms: u64,
    /// Soft timeout of one step execution.
    pub step_timeout_secs: u64,
    /// A step commit that moves a running run on claims the next position for its worker, so
    /// the next step starts without a claim statement (`checkpoint::PreClaim`).
    pub preclaim: bool,
}

/// Limits that stop a run before it loops or spends without bound.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GuardSettings {
    /// Hard timeout of a run in seconds (0 = none).
    pub run_timeout_secs: u64,
    /// Default per-run budget of tool calls (0 = unlimited).
    pub max_tool_calls: u64,
    /// Default per-run budget of model tokens (0 = unlimited).
    pub max_model_tokens: u64,
    /// Default per-run budget of cost (0 = unlimited).
    pub max_cost: f64,
    /// Identical tool requests per run before it counts as a loop.
    pub repeat_limit: u64,
    /// Consecutive failures that open a tool's circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker refuses calls before one probe.
    pub breaker_open_secs: u64,
}

/// How the relay drains the outbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RelaySettings {
    /// How long the relay leaves rows alone that their committing worker publishes itself
    /// (0: workers do not publish; the relay does everything).
    pub eager_grace_ms: i64,
    /// Rows claimed and published per transaction.
    pub batch_size: i64,
    /// Poll period when no NOTIFY arrives.
    pub poll_interval_ms: u64,
    /// How long published rows are kept before pruning.
    pub retention_secs: u64,
}

/// How often the supervisor looks for expired leases.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SupervisorSettings {
    /// Scan period.
    pub interval_ms: u64,
    /// How long a run may wait for a person before it is escalated to needs_review (0 = forever).
    pub human_timeout_secs: u64,
}

/// Runs that wait for an event or sleep until a time (`docs/WORKFLOWS.md`, "Waiting").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WaitSettings {
    /// How often the supervisor's timer loop looks for waits that are due (wake-ups and event
    /// timeouts): a run wakes within about this long after its time.
    pub poll_ms: u64,
    /// Longest sleep or event timeout a step may ask for, in seconds.
    pub max_secs: u64,
    /// How long an event that no wait took is kept for one to come, in seconds.
    pub event_keep_secs: u64,
    /// How long an event that expired without a wait taking it stays in sight (and its id
    /// refuses a repeat), in seconds, before it is removed.
    pub event_retention_secs: u64,
}

/// What is removed, and when (`docs/OPERATIONS.md`, "Retention"). Every keep time is in seconds;
/// 0 keeps for ever.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RetentionSettings {
    /// How long a finished run (succeeded, failed, compensated, cancelled, shadowed) is kept
    /// after it finished, for workflows without a keep time of their own. 0: for ever.
    pub keep_secs: u64,
    /// Keep times of single workflows, by name (`chain = 86400`); 0 keeps that one for ever.
    #[serde(default)]
    pub workflows: std::collections::BTreeMap<String, u64>,
    /// A directory each run is exported to (the `trailmark run export` format) before it is
    /// removed; empty: runs are removed without an archive.
    pub archive_dir: String,
    /// How long a removed run's tombstone keeps a late start of its id from starting it again.
    pub tombstone_secs: u64,
    /// How long a processed message id is kept in the inbox (the dedup window).
    pub inbox_secs: u64,
    /// How long audit rows are kept.
    pub audit_secs: u64,
    /// How often the pruner looks for what to remove.
    pub interval_secs: u64,
    /// Most runs (or rows, for the inbox and the audit trail) one transaction removes.
    pub batch: u64,
    /// The share of its time (percent) a pruner spends in its batches: after a batch that took
    /// t it rests t x (100 - duty) / duty, so that removing a long history beside live steps
    /// takes a bounded share of the machine whatever its speed (100: no rest).
    pub duty_percent: u64,
}

/// How a long-running process (`serve`, `worker`, `relay`, `supervisor`, `api`) starts and stops.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessSettings {
    /// How long a process waits at start for Postgres and RabbitMQ to become reachable before it
    /// gives up (exit code 2). A refusal no retry can fix ends it at once.
    pub startup_timeout_secs: u64,
    /// After SIGTERM, how long `/readyz` answers 503 before consumption stops, so that a load
    /// balancer or orchestrator sees the process leave before it does.
    pub drain_delay_ms: u64,
}

/// The HTTP surface every long-running process serves: `/livez`, `/readyz`, `/metrics`, and the
/// ops API under `/api/v1`.
#[derive(Clone, Serialize, Deserialize)]
pub struct ApiSettings {
    /// Address to listen on; empty serves nothing. Port 0 picks a free port (tests).
    pub listen: String,
    /// Who may call the API: `name:role:sha256-of-token` each (roles `viewer`, `operator`,
    /// `admin`); `trailmark token new` makes one. From the environment: comma-separated.
    pub tokens: Vec<String>,
    /// Largest request body accepted.
    pub body_limit_bytes: usize,
    /// Longest a request may take.
    pub request_timeout_secs: u64,
    /// How long the response to an `Idempotency-Key` is kept for a repeat.
    pub idempotency_retention_secs: u64,
    /// How long a console login lasts.
    pub console_session_secs: u64,
}

impl fmt::Debug for ApiSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiSettings")
            .field("listen", &self.listen)
            .field("tokens", &self.tokens.len())
            .field("body_limit_bytes", &self.body_limit_bytes)
            .field("request_timeout_secs", &self.request_timeout_secs)
            .field(
                "idempotency_retention_secs",
                &self.idempotency_retention_secs,
            )
            .field("console_session_secs", &self.console_session_secs)
            .finish()
    }
}

// Hand-written so that settings can be logged or shown in a panic without leaking passwords.
impl fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &crate::redact::url(&self.url))
            .field("hosts", &self.hosts)
            .field("relaxed_commits", &self.relaxed_commits)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .finish()
    }
}

impl fmt::Debug for BrokerSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerSettings")
            .field("url", &crate::redact::url(&self.url))
            .field(
                "urls",
                &self
                    .urls
                    .iter()
                    .map(|u| crate::redact::url(u))
                    .collect::<Vec<_>>(),
            )
            .field("prefix", &self.prefix)
            .field("delivery_limit", &self.delivery_limit)
            .field("quorum_group_size", &self.quorum_group_size)
            .field("confirm_timeout_ms", &self.confirm_timeout_ms)
            .field("heartbeat_secs", &self.heartbeat_secs)
            .field("ca_file", &self.ca_file)
            .field("client_cert_file", &self.client_cert_file)
            .field("client_key_file", &self.client_key_file)
            .finish()
    }
}

impl Settings {
    /// Defaults, then the file named by `TRAILMARK_CONFIG` if set, then the environment.
    pub fn load() -> Result<Self, Error> {
        let file = std::env::var("TRAILMARK_CONFIG").ok();
        Self::load_from(file.as_deref())
    }

    /// Like [`Settings::load`], with an explicit extra file.
    pub fn load_from(file: Option<&str>) -> Result<Self, Error> {
        use config::{Config, Environment, File, FileFormat};
        let mut builder = Config::builder().add_source(File::from_str(DEFAULTS, FileFormat::Toml));
        if let Some(path) = file {
            builder = builder.add_source(File::with_name(path).required(true));
        }
        builder = builder.add_source(
            Environment::with_prefix("TRAILMARK")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("api.tokens")
                .with_list_parse_key("broker.urls")
                .with_list_parse_key("database.hosts")
                .with_list_parse_key("remote.endpoints")
                .with_list_parse_key("remote.local_tables"),
        );
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let built = builder
            .set_override_option("database.url", env("DATABASE_URL"))
            .and_then(|b| b.set_override_option("broker.url", env("AMQP_URL")))
            .and_then(|b| b.build())
            .map_err(|e| Error(e.to_string()))?;
        check::known_keys(&built, file)?;
        let settings: Settings = built
            .try_deserialize()
            .map_err(|e| Error(check::explain(&e.to_string())))?;
        check::ranges(&settings)?;
        check::tls(&settings)?;
        Ok(settings)
    }

    /// The compiled-in defaults alone.
    fn defaults() -> Self {
        use config::{Config, File, FileFormat};
        Config::builder()
            .add_source(File::from_str(DEFAULTS, FileFormat::Toml))
            .build()
            .and_then(Config::try_deserialize)
            .expect("the compiled-in defaults load")
    }
}

impl WorkerSettings {
    /// The lease as a duration.
    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_secs)
    }
    /// The heartbeat period as a duration.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_secs(self.heartbeat_secs)
    }
}

/// A `database.hosts` entry, `host:port`, as its parts (`[::1]:5432` too); the config check refuses a port that is not a
/// number, so one that does not parse here is left to the URL's.
pub(crate) fn split_host(spec: &str) -> (&str, Option<u16>) {
    let spec = spec.trim();
    match spec.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && port.chars().all(|c| c.is_ascii_digit()) => {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            (host, port.parse().ok())
        }
        _ => (spec, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_defaults_load_and_point_at_localhost() {
        let s = Settings::load_from(None).expect("defaults load");
        assert!(s.database.url.contains("127.0.0.1"));
        assert_eq!(s.broker.prefix, "trailmark");
    }

    #[test]
    fn settings_never_show_a_password_when_printed() {
        let mut s = Settings::defaults();
        s.database.url = "postgres://u:Db5ecret@h/db?sslpassword=Ssl5ecret".into();
        s.broker.url = "amqp://u:Mq5ecret@h/%2f".into();
        let shown = format!("{s:?}");
        for secret in ["Db5ecret", "Ssl5ecret", "Mq5ecret"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }
}

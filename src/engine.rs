//! The shared state of a trailmark process: settings, database pool, workflows, topology names,
//! counters. Every long-running component takes an `Arc<Engine>` and a shutdown token.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;

use crate::broker::Topology;
use crate::config::Settings;
use crate::failpoint::Failpoints;
use crate::guard::Breakers;
use crate::model::ModelClient;
use crate::worker::StepTx;
use crate::workflow::{Models, Registry, Tools};

/// Why an engine could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database is unreachable or misconfigured.
    #[error("the engine cannot open its database")]
    Store(#[from] crate::store::Error),
    /// The model settings are unusable.
    #[error("the [model] settings are unusable")]
    Model(#[source] crate::model::Error),
}

/// Counters a process keeps about its own work (exported as metrics, read by tests).
#[derive(Debug, Default)]
pub struct Stats {
    /// Step handler executions started.
    pub handler_runs: AtomicU64,
    /// Steps committed.
    pub steps_committed: AtomicU64,
    /// Deliveries dropped as already processed.
    pub duplicates: AtomicU64,
    /// Deliveries dropped as stale (run moved on, cancelled, fenced out).
    pub stale: AtomicU64,
    /// Deliveries sent to a delay queue because the run was busy or a step will be retried.
    pub delayed: AtomicU64,
    /// Deliveries published to the DLQ by this process.
    pub dead_lettered: AtomicU64,
    /// Runs created from run-start events.
    pub runs_started: AtomicU64,
    /// Outbox rows published by this process's relay.
    pub relayed: AtomicU64,
    /// Runs whose expired lease the supervisor re-queued.
    pub lease_recoveries: AtomicU64,
    /// Steps started on a claim their previous step's commit made (no claim statement).
    pub preclaims_used: AtomicU64,
}

impl Stats {
    /// Adds one to a counter.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Everything a worker, relay or supervisor needs.
pub struct Engine {
    /// Effective settings.
    pub settings: Settings,
    /// Trailmark's database.
    pub pool: PgPool,
    /// Executable workflows.
    pub registry: Registry,
    /// Exchange and queue names.
    pub topology: Topology,
    /// Failpoints (empty unless configured).
    pub failpoints: Failpoints,
    /// Counters.
    pub stats: Stats,
    /// Identifies this process in leases and connection names.
    pub worker_id: String,
    /// Backend pid of this process's presence connection (0: none yet); stored with every lease
    /// so that other workers can tell at once when this process has died.
    pub presence_pid: std::sync::atomic::AtomicI32,
    /// The leases this process's executing steps hold, renewed together on the presence
    /// connection.
    pub(crate) leases: crate::worker::lease::Leases,
    /// What `/livez` and `/readyz` answer.
    pub health: crate::health::Health,
    /// The step transaction: claims, records, commits and releases with their group commit.
    pub(crate) step_tx: Arc<StepTx>,
    /// What step contexts use besides their position (records, model, breakers).
    pub(crate) tools: Arc<Tools>,
}

impl Engine {
    /// Connects to Postgres (RabbitMQ is connected by each component, so it can reconnect).
    pub async fn new(settings: Settings, registry: Registry) -> Result<Arc<Self>, Error> {
        Self::with_failpoints(settings, registry, Failpoints::default()).await
    }

    /// Like [`Engine::new`], with failpoints and drill seams armed (crash tests and drills).
    pub async fn with_failpoints(
        settings: Settings,
        registry: Registry,
        failpoints: Failpoints,
    ) -> Result<Arc<Self>, Error> {
        let pool = crate::store::connect(&settings.database).await?;
        Self::with_pool(settings, registry, failpoints, pool)
    }

    /// Like [`Engine::new`], with an existing pool.
    pub fn with_pool(
        settings: Settings,
        registry: Registry,
        failpoints: Failpoints,
        pool: PgPool,
    ) -> Result<Arc<Self>, Error> {
        let model = if settings.model.is_configured() {
            Some(ModelClient::new(&settings.model).map_err(Error::Model)?)
        } else {
            None
        };
        let fallback = match (&model, settings.model.fallback_model.is_empty()) {
            (Some(client), false) => client.fallback(),
            _ => None,
        };
        let guards = &settings.guards;
        let topology = Topology::from_settings(&settings.broker);
        let step_tx = Arc::new(
            StepTx::new(
                &pool,
                &settings.database,
                topology.clone(),
                settings.worker.max_batch,
            )
            .with_failpoints(failpoints.clone()),
        );
        let tools = Arc::new(Tools {
            pool: pool.clone(),
            records: step_tx.clone(),
            models: Models {
                primary: model,
                fallback,
                offline_bytes: crate::model::offline::ANSWER_BYTES,
            },
            failpoints: failpoints.clone(),
            breakers: Breakers::new(
                guards.breaker_failures,
                Duration::from_secs(guards.breaker_open_secs),
            ),
            call_retries: settings.worker.call_retries,
            repeat_limit: guards.repeat_limit,
            full_endpoints: Default::default(),
        });
        let worker_id = new_worker_id();
        Ok(Arc::new(Self {
            settings,
            pool,
            registry,
            topology,
            failpoints,
            stats: Stats::default(),
            worker_id,
            presence_pid: Default::default(),
            leases: Default::default(),
            health: Default::default(),
            step_tx,
            tools,
        }))
    }
}

/// `<host>-<pid>-<tag>`: unique per process start, and it names the machine and the process an
/// operator would look for. Lease owners are `<worker id>/<delivery>`.
fn new_worker_id() -> String {
    format!(
        "{}-{}-{}",
        hostname(),
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// The OS pid of the process holding a lease, read from its owner (see [`Engine::worker_id`]):
/// what tooling needs to tell which process to look at, freeze or kill.
pub fn lease_owner_pid(owner: &str) -> Option<u32> {
    let worker = owner.split('/').next()?;
    // From the right: the host name may itself contain '-', the tag never does.
    worker.rsplit('-').nth(1)?.parse().ok()
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_owner_names_the_pid_of_the_process_that_made_it() {
        let owner = format!("{}/{}", new_worker_id(), uuid::Uuid::new_v4().simple());
        assert_eq!(lease_owner_pid(&owner), Some(std::process::id()));
        assert_eq!(lease_owner_pid("db-01-eu-4242-0a1b2c3d/ff00"), Some(4242));
        assert_eq!(lease_owner_pid("not an owner"), None);
    }
}

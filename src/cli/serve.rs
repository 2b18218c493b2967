//! `trailmark serve | worker | relay | supervisor`: long-running processes with graceful shutdown.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::engine::Engine;
use crate::failpoint::Failpoints;
use crate::workflow::Registry;
use crate::{relay, supervisor, worker};

/// Which components this process runs.
#[derive(Debug, Clone, Copy)]
pub struct Components {
    /// Consume step and run-start messages.
    pub worker: bool,
    /// Publish outbox rows.
    pub relay: bool,
    /// Recover expired leases.
    pub supervisor: bool,
}

impl Components {
    /// Everything in one process.
    pub const ALL: Self = Self {
        worker: true,
        relay: true,
        supervisor: true,
    };
}

/// Runs the chosen components until SIGTERM or Ctrl-C, then stops consuming, lets in-flight
/// steps finish (or abandons them uncommitted) and returns.
pub async fn serve(
    settings: Settings,
    registry: Registry,
    components: Components,
) -> anyhow::Result<()> {
    let failpoints =
        Failpoints::from_env().map_err(|e| anyhow::anyhow!("TRAILMARK_FAILPOINTS: {e}"))?;
    let engine = Engine::new(settings, registry, failpoints).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(wait_for_signal(shutdown.clone()));
    run_components(engine, components, shutdown).await
}

/// Runs components on an existing engine (tests embed this).
pub async fn run_components(
    engine: Arc<Engine>,
    c: Components,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    if c.worker {
        tasks.spawn(worker::run(engine.clone(), shutdown.clone()).map_err_into());
    }
    if c.relay {
        tasks.spawn(relay::run(engine.clone(), shutdown.clone()).map_err_into());
    }
    if c.supervisor {
        tasks.spawn(supervisor::run(engine.clone(), shutdown.clone()).map_err_into());
    }
    tracing::info!(worker = c.worker, relay = c.relay, supervisor = c.supervisor, id = %engine.worker_id, "trailmark started");
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    tracing::info!("trailmark stopped");
    Ok(())
}

trait MapErrInto<T> {
    fn map_err_into(self) -> impl Future<Output = anyhow::Result<T>> + Send;
}

impl<T, E, F> MapErrInto<T> for F
where
    F: Future<Output = Result<T, E>> + Send,
    E: Into<anyhow::Error>,
{
    async fn map_err_into(self) -> anyhow::Result<T> {
        self.await.map_err(Into::into)
    }
}

async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C: shutting down"),
    }
    shutdown.cancel();
}

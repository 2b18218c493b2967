//! A trailmark process: the long-running components it runs on one engine, and how they stop.
//! `trailmark::serve` is what `trailmark serve` runs; embedders call it with their own
//! registry and shutdown signal.

use std::future::Future;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::{relay, supervisor, worker};

/// Which components a process runs.
#[derive(Debug, Clone, Copy)]
pub struct Components {
    /// Consume step and run-start messages.
    pub worker: bool,
    /// Publish outbox rows.
    pub relay: bool,
    /// Recover expired leases and escalate late decisions.
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

/// Why a process stopped before it was asked to.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The worker gave up (it reconnects by itself; this is a bug or a fatal refusal).
    #[error("the worker stopped")]
    Worker(#[source] crate::broker::Error),
    /// The relay gave up.
    #[error("the relay stopped")]
    Relay(#[source] crate::relay::Error),
    /// The supervisor gave up.
    #[error("the supervisor stopped")]
    Supervisor(#[source] crate::store::Error),
    /// A component panicked.
    #[error("a component panicked: {0}")]
    Panicked(String),
}

/// Runs worker, relay and supervisor on `engine` until `shutdown` fires, then lets in-flight
/// steps finish (or abandons them uncommitted after one lease) and returns.
pub async fn serve(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), Error> {
    run(engine, Components::ALL, shutdown).await
}

/// Runs the chosen components on `engine` until `shutdown` fires.
pub async fn run(
    engine: Arc<Engine>,
    c: Components,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let mut tasks = tokio::task::JoinSet::new();
    if c.worker {
        let w = worker::run(engine.clone(), shutdown.clone());
        tasks.spawn(map_err(w, Error::Worker));
    }
    if c.relay {
        let r = relay::run(engine.clone(), shutdown.clone());
        tasks.spawn(map_err(r, Error::Relay));
    }
    if c.supervisor {
        let s = supervisor::run(engine.clone(), shutdown.clone());
        tasks.spawn(map_err(s, Error::Supervisor));
    }
    tracing::info!(worker = c.worker, relay = c.relay, supervisor = c.supervisor, id = %engine.worker_id, "trailmark started");
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| Error::Panicked(e.to_string()))??;
    }
    tracing::info!("trailmark stopped");
    Ok(())
}

async fn map_err<E>(
    component: impl Future<Output = Result<(), E>>,
    wrap: fn(E) -> Error,
) -> Result<(), Error> {
    component.await.map_err(wrap)
}

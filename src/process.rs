//! A trailmark process: the long-running components it runs on one engine, and how they stop.
//! `trailmark::serve` is what `trailmark serve` runs; embedders call it with their own
//! registry and shutdown signal.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::{relay, supervisor, worker};

/// Which components a process runs.
#[derive(Debug, Clone, Copy)]
pub struct Components {
    /// Consume step messages, run-start events and events for waiting runs.
    pub worker: bool,
    /// Publish outbox rows.
    pub relay: bool,
    /// Recover expired leases, escalate late decisions, and move on waiting runs that are due.
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
    /// The HTTP surface could not start (`api.listen` taken, `api.tokens` malformed).
    #[error("the API did not start")]
    Api(#[source] crate::config::Error),
    /// The step protocol's callback listener could not start (`remote.callback_listen` taken).
    #[cfg(feature = "ops-http")]
    #[error("the step protocol's callback listener did not start")]
    Remote(#[source] crate::remote::Error),
    /// The worker gave up (it reconnects by itself; this is a bug or a fatal refusal).
    #[error("the worker stopped")]
    Worker(#[source] crate::broker::Error),
    /// The relay gave up.
    #[error("the relay stopped")]
    Relay(#[source] crate::relay::Error),
    /// The supervisor gave up.
    #[error("the supervisor stopped")]
    Supervisor(#[source] crate::store::Error),
    /// The HTTP server failed.
    #[error("the API stopped")]
    Http(#[source] std::io::Error),
    /// A component panicked.
    #[error("a component panicked: {0}")]
    Panicked(String),
}

/// Runs worker, relay and supervisor on `engine`, and the HTTP surface on `api.listen`, until
/// `shutdown` fires; then drains (see [`run`]) and returns.
pub async fn serve(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), Error> {
    run(engine, Components::ALL, shutdown).await
}

/// Runs the chosen components on `engine`, and the HTTP surface on `api.listen` (unless it is
/// empty), until `shutdown` fires. Then `/readyz` answers 503 for `process.drain_delay_ms`
/// before the components stop taking work, so that an orchestrator sees the process leave
/// before it does; in-flight steps finish (or are abandoned uncommitted after one lease), and
/// the HTTP surface stops last.
pub async fn run(
    engine: Arc<Engine>,
    c: Components,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    crate::metrics::install();
    let http = start_http(&engine).await?;
    #[cfg(feature = "ops-http")]
    if c.worker && !engine.settings.remote.endpoints.is_empty() {
        crate::remote::listen(&engine.settings.remote)
            .await
            .map_err(Error::Remote)?;
    }
    let work = CancellationToken::new();
    tokio::spawn(drain(engine.clone(), shutdown, work.clone()));
    let mut tasks = tokio::task::JoinSet::new();
    if c.worker {
        let w = worker::run(engine.clone(), work.clone());
        tasks.spawn(map_err(w, Error::Worker));
    }
    if c.relay {
        let r = relay::run(engine.clone(), work.clone());
        tasks.spawn(map_err(r, Error::Relay));
    }
    if c.supervisor {
        let s = supervisor::run(engine.clone(), work.clone());
        tasks.spawn(map_err(s, Error::Supervisor));
        let t = crate::wait::timers::run(engine.clone(), work.clone());
        tasks.spawn(map_err(t, Error::Supervisor));
        let p = crate::retention::run(engine.clone(), work.clone());
        tasks.spawn(map_err(p, Error::Supervisor));
        let f = crate::flow::dispatch::run(engine.clone(), work.clone());
        tasks.spawn(map_err(f, Error::Supervisor));
    }
    tracing::info!(worker = c.worker, relay = c.relay, supervisor = c.supervisor, id = %engine.worker_id, "trailmark started");
    let mut ended = Ok(());
    while let Some(done) = tasks.join_next().await {
        let result = done
            .map_err(|e| Error::Panicked(e.to_string()))
            .and_then(|r| r);
        if let Err(e) = result {
            ended = Err(e);
            work.cancel();
        }
    }
    // Only the HTTP surface left (a process that serves nothing else waits for the signal).
    work.cancelled().await;
    if let Some(http) = http {
        http.stop().await?;
    }
    tracing::info!("trailmark stopped");
    ended
}

/// The HTTP surface while it serves: its stop token, the server task and the gauges' refresher.
struct Http {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    gauges: tokio::task::JoinHandle<()>,
}

impl Http {
    async fn stop(self) -> Result<(), Error> {
        self.stop.cancel();
        let _ = self.gauges.await;
        self.task
            .await
            .map_err(|e| Error::Panicked(e.to_string()))?
            .map_err(Error::Http)
    }
}

/// Serves the ops API and console on `api.listen` (unless it is empty).
#[cfg(feature = "ops-http")]
async fn start_http(engine: &Arc<Engine>) -> Result<Option<Http>, Error> {
    let Some(listener) = crate::api::bind(&engine.settings.api)
        .await
        .map_err(Error::Api)?
    else {
        return Ok(None);
    };
    let router = crate::api::router(engine.clone()).map_err(Error::Api)?;
    let stop = CancellationToken::new();
    let task = tokio::spawn(crate::api::serve(router, listener, stop.clone()));
    let gauges = tokio::spawn(crate::metrics::refresh_gauges(
        engine.pool.clone(),
        stop.clone(),
    ));
    Ok(Some(Http { stop, task, gauges }))
}

/// Built without `ops-http`: no HTTP surface, whatever `api.listen` says.
#[cfg(not(feature = "ops-http"))]
async fn start_http(_engine: &Arc<Engine>) -> Result<Option<Http>, Error> {
    Ok(None)
}

/// On `shutdown`: not ready any more, then after `process.drain_delay_ms` the work stops.
async fn drain(engine: Arc<Engine>, shutdown: CancellationToken, work: CancellationToken) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        // The components stopped by themselves (an error): nothing to drain.
        _ = work.cancelled() => return,
    }
    engine.health.start_draining();
    let delay = Duration::from_millis(engine.settings.process.drain_delay_ms);
    if !delay.is_zero() {
        tracing::info!(
            delay_ms = delay.as_millis() as u64,
            "draining: /readyz answers 503 before the work stops"
        );
        tokio::time::sleep(delay).await;
    }
    work.cancel();
}

async fn map_err<E>(
    component: impl Future<Output = Result<(), E>>,
    wrap: fn(E) -> Error,
) -> Result<(), Error> {
    component.await.map_err(wrap)
}

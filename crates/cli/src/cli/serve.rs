//! `trailmark serve | worker | relay | supervisor`: long-running processes that stop gracefully
//! on SIGTERM or Ctrl-C.

use tokio_util::sync::CancellationToken;

use trailmark::config::Settings;
use trailmark::engine::Engine;
use trailmark::error::Reaction;
use trailmark::failpoint::Failpoints;
use trailmark::process::{self, Components};
use trailmark::workflow::Registry;

/// Runs the chosen components until SIGTERM or Ctrl-C, then stops consuming, lets in-flight
/// steps finish (or abandons them uncommitted) and returns.
pub async fn serve(
    settings: Settings,
    registry: Registry,
    components: Components,
) -> anyhow::Result<()> {
    let failpoints =
        Failpoints::from_env().map_err(|e| anyhow::anyhow!("TRAILMARK_FAILPOINTS: {e}"))?;
    // The handler is installed first, before the startup checks (which wait up to
    // process.startup_timeout_secs for a server). As PID 1 of a container the process gets no
    // default action for SIGTERM: until a handler exists the signal is simply dropped, and
    // `podman stop` or a pod deletion during startup would wait for the runtime's SIGKILL.
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| anyhow::anyhow!("installing the SIGTERM handler: {e}"))?;
    let shutdown = CancellationToken::new();
    tokio::spawn(wait_for_signal(term, shutdown.clone()));
    let start = async {
        loop {
            trailmark::startup::check(&settings).await?;
            match Engine::new(settings.clone(), registry.clone(), failpoints.clone()).await {
                Ok(engine) => return anyhow::Ok(engine),
                // The server went away between the check and the pool (a restart at that very
                // moment, found by the drills): check again, which waits for it.
                Err(e) if trailmark::error::reaction(&e) == Reaction::Retry => {
                    tracing::warn!(error = %trailmark::error::Report(&e), "a server went away while the process started; waiting for it again");
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let engine = tokio::select! {
        engine = start => engine?,
        // Asked to stop before it started: nothing is in flight, so there is nothing to drain.
        () = shutdown.cancelled() => {
            tracing::info!("stopped before startup finished");
            return Ok(());
        }
    };
    Ok(process::run(engine, components, shutdown).await?)
}

async fn wait_for_signal(mut term: tokio::signal::unix::Signal, shutdown: CancellationToken) {
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C: shutting down"),
    }
    shutdown.cancel();
}

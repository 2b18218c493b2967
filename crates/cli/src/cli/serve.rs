//! `trailmark serve | worker | relay | supervisor`: long-running processes that stop gracefully
//! on SIGTERM or Ctrl-C.

use tokio_util::sync::CancellationToken;

use trailmark::config::Settings;
use trailmark::engine::Engine;
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
    trailmark::startup::check(&settings).await?;
    let engine = Engine::new(settings, registry, failpoints).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(wait_for_signal(shutdown.clone()));
    Ok(process::run(engine, components, shutdown).await?)
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

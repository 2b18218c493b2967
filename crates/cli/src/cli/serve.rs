//! `trailmark serve | worker | relay | supervisor`: long-running processes that stop gracefully
//! on SIGTERM or Ctrl-C.

use trailmark::config::Settings;
use trailmark::failpoint::Failpoints;
use trailmark::process::Components;
use trailmark::workflow::Registry;
use trailmark::{Error, Trailmark};

/// Runs the chosen components until SIGTERM or Ctrl-C, then stops consuming, lets in-flight
/// steps finish (or abandons them uncommitted) and returns.
pub async fn serve(
    settings: Settings,
    registry: Registry,
    components: Components,
) -> anyhow::Result<()> {
    let failpoints =
        Failpoints::from_env().map_err(|e| anyhow::anyhow!("TRAILMARK_FAILPOINTS: {e}"))?;
    // Kept until the process ends: dropping it sends the spans still queued.
    let _exporting = trailmark::trace::init(&settings.tracing)?;
    let started = Trailmark::builder(settings, registry)
        .components(components)
        .failpoints(failpoints)
        .until_signal()
        .start()
        .await;
    match started {
        Ok(engine) => Ok(engine.serve().await?),
        // Asked to stop before it started: nothing is in flight, so there is nothing to drain.
        Err(Error::Cancelled) => {
            tracing::info!("stopped before startup finished");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Adds the workflows of the step endpoints in `remote.endpoints`. A long-running process waits
/// for each endpoint's manifest and refuses to start without it; any other command reads each
/// once, and without an endpoint goes on, saying which workflows it lacks.
pub async fn add_remote(
    settings: &Settings,
    registry: &mut Registry,
    command: &crate::Command,
) -> anyhow::Result<()> {
    if settings.remote.endpoints.is_empty() {
        return Ok(());
    }
    use crate::Command;
    let long_running = matches!(
        command,
        Command::Serve | Command::Worker | Command::Relay | Command::Supervisor | Command::Api
    );
    match trailmark::remote::register(settings, registry, long_running).await {
        Ok(_) => Ok(()),
        Err(e) if long_running => Err(e.into()),
        Err(e) => {
            eprintln!("warning: {e}; going on without that endpoint's workflows");
            Ok(())
        }
    }
}

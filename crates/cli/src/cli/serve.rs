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

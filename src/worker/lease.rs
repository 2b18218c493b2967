//! The heartbeat that keeps a run's lease while its step executes.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::domain::{Fence, RunId};
use crate::engine::Engine;
use crate::store::runs;

/// Extends the lease every `worker.heartbeat_secs`; signals when the fence has moved on.
pub(super) struct Heartbeat {
    lost: CancellationToken,
    task: JoinHandle<()>,
}

impl Heartbeat {
    /// Starts beating for the lease held under `fence` at position `seq`.
    pub fn start(engine: &Arc<Engine>, (run_id, seq): (RunId, i32), fence: Fence) -> Self {
        let lost = CancellationToken::new();
        let (engine, signal) = (engine.clone(), lost.clone());
        let task = tokio::spawn(async move {
            let period = engine.settings.worker.heartbeat();
            let lease = engine.settings.worker.lease_secs as f64;
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            loop {
                ticker.tick().await;
                match runs::heartbeat(
                    &engine.pool,
                    (&run_id, seq),
                    fence,
                    lease,
                    super::presence::pid(&engine),
                )
                .await
                {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(run.id = %run_id, fence = fence.0, "lease lost: a newer worker owns the run; cancelling the step");
                        signal.cancel();
                        return;
                    }
                    // The database may come back before the lease runs out; the commit's fence
                    // check is what finally decides.
                    Err(e) => {
                        tracing::warn!(run.id = %run_id, error = %crate::error::Report(&e), "heartbeat failed; will try again")
                    }
                }
            }
        });
        Self { lost, task }
    }

    /// Resolves when the lease has been lost.
    pub async fn lost(&self) {
        self.lost.cancelled().await
    }

    /// Stops beating (the commit releases the lease).
    pub fn stop(self) {
        self.task.abort();
    }
}

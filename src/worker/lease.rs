//! The heartbeat that keeps a run's lease while its step executes.
//!
//! A process renews the leases of all its executing steps together: one statement every
//! `worker.heartbeat_secs`, sent on the presence connection (`presence.rs`) and through the pool
//! only while that connection is down. A beat per step through the pool, as it once was, waited
//! behind the steps themselves when they held every pooled connection (a burst of runs, a
//! server near `max_connections`): leases expired under live workers, the supervisor re-queued
//! their steps, and each takeover spent one of the step's `worker.max_attempts` (runs stopped
//! for review "claimed 5 times without finishing" in the scale-out drill).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sqlx::PgExecutor;
use tokio_util::sync::CancellationToken;

use crate::domain::{Fence, RunId};
use crate::engine::Engine;
use crate::store::{self, runs};

/// A lease a step holds: its run, position and the fence its claim took.
type Key = (RunId, i32, Fence);

/// The leases this process's executing steps hold, each with the signal its step stops on
/// when the renewal finds the fence moved on.
#[derive(Default)]
pub(crate) struct Leases {
    held: Mutex<HashMap<Key, CancellationToken>>,
}

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, CancellationToken>> {
        self.held.lock().expect("leases lock")
    }

    /// Renews every lease held, for `lease_secs` from now under the presence backend
    /// `presence_pid`, in one statement; signals the steps whose fence has moved on.
    pub async fn renew(
        &self,
        db: impl PgExecutor<'_>,
        lease_secs: f64,
        presence_pid: Option<i32>,
    ) -> store::Result<()> {
        let keys: Vec<Key> = self.lock().keys().cloned().collect();
        if keys.is_empty() {
            return Ok(());
        }
        let lost = runs::heartbeat_all(db, &keys, lease_secs, presence_pid).await?;
        let mut held = self.lock();
        for key in &lost {
            // Gone already when the step ended between the snapshot and the statement. Told
            // by the step that stops on it (a step whose commit moved the run on while this
            // statement ran is not lost, and its commit's fence check is what decides).
            if let Some(signal) = held.remove(key) {
                tracing::debug!(run.id = %key.0, seq = key.1, fence = key.2.0, "lease not renewed: the fence or position moved on");
                signal.cancel();
            }
        }
        Ok(())
    }
}

/// One step's place among the leases its process renews; dropping it stops the renewal.
pub(super) struct Heartbeat {
    engine: Arc<Engine>,
    key: Key,
    lost: CancellationToken,
}

impl Heartbeat {
    /// Starts renewing the lease held under `fence` at position `seq`.
    pub fn start(engine: &Arc<Engine>, (run_id, seq): (RunId, i32), fence: Fence) -> Self {
        let (key, lost) = ((run_id, seq, fence), CancellationToken::new());
        engine.leases.lock().insert(key.clone(), lost.clone());
        Self {
            engine: engine.clone(),
            key,
            lost,
        }
    }

    /// Resolves when the lease has been lost.
    pub async fn lost(&self) {
        self.lost.cancelled().await
    }

    /// Stops renewing (the commit releases the lease).
    pub fn stop(self) {}
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.engine.leases.lock().remove(&self.key);
    }
}

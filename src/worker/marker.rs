//! Marks eagerly published outbox rows as published, in batches, off the step's path.
//!
//! A step's ack no longer waits for its mark: the mark only keeps the relay from publishing the
//! row again after `relay.eager_grace_ms`, and a repeat is dropped by the consumer's inbox. While
//! one batch is being written the next one gathers, so under load one statement marks many rows.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::engine::Engine;
use crate::store::outbox;

/// Most ids in one marking statement.
const MAX_BATCH: usize = 1000;

/// Hands confirmed message ids to the marking task.
#[derive(Clone)]
pub(super) struct Marker {
    ids: mpsc::UnboundedSender<uuid::Uuid>,
}

impl Marker {
    /// Starts the marking task; it ends once every `Marker` clone is dropped and the rest marked.
    pub fn start(engine: Arc<Engine>) -> (Self, JoinHandle<()>) {
        let (ids, rx) = mpsc::unbounded_channel();
        (Self { ids }, tokio::spawn(mark_batches(engine, rx)))
    }

    /// Queues confirmed rows for marking.
    pub fn mark(&self, ids: impl IntoIterator<Item = uuid::Uuid>) {
        for id in ids {
            // Closed only after shutdown; an unmarked row is published once more by the relay.
            let _ = self.ids.send(id);
        }
    }
}

async fn mark_batches(engine: Arc<Engine>, mut rx: mpsc::UnboundedReceiver<uuid::Uuid>) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        if let Err(e) = outbox::mark_published_ids(&engine.pool, &batch).await {
            // Unmarked rows are published again by the relay: a duplicate the inbox drops.
            tracing::warn!(error = %e, rows = batch.len(), "could not mark eagerly published rows");
        }
        batch.clear();
    }
}

//! Eager publishing: a worker publishes the messages it has just committed itself, so the next
//! step does not wait for the relay, and then removes those outbox rows, in batches, off the
//! step's path.
//!
//! A step's ack does not wait for this: removing the row only keeps the relay from publishing it
//! again after `relay.eager_grace_ms`, and such a repeat is dropped by the consumer's inbox. Ids
//! gather for [`GATHER`] (far below the grace) and while the previous batch is being written, so
//! under load one statement handles many rows instead of one statement per step.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::domain::{EagerHold, OutgoingMessage};
use crate::engine::Engine;
use crate::store::outbox;

/// Most ids in one statement.
const MAX_BATCH: usize = 1000;

/// How long the first id of a batch waits for others.
const GATHER: Duration = Duration::from_millis(50);

/// A committed message the worker publishes itself, with its outbox row (removed once the
/// broker confirms it).
#[derive(Debug, Clone)]
pub struct Eager {
    /// The message.
    pub message: OutgoingMessage,
    /// Its outbox row id.
    pub row: i64,
}

/// Hands the row ids of confirmed messages to the removing task.
#[derive(Clone)]
pub(super) struct PublishedRows {
    ids: mpsc::UnboundedSender<i64>,
}

impl PublishedRows {
    /// Starts the task; it ends once every `PublishedRows` clone is dropped and the last ids are handled.
    pub fn start(engine: Arc<Engine>) -> (Self, JoinHandle<()>) {
        let (ids, rx) = mpsc::unbounded_channel();
        (Self { ids }, tokio::spawn(mark_batches(engine, rx)))
    }

    /// Queues confirmed rows (by row id) for removal.
    pub fn forget(&self, ids: impl IntoIterator<Item = i64>) {
        for id in ids {
            // Closed only after shutdown; an unmarked row is published once more by the relay.
            let _ = self.ids.send(id);
        }
    }
}

async fn mark_batches(engine: Arc<Engine>, mut rx: mpsc::UnboundedReceiver<i64>) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        gather(&mut rx, &mut batch).await;
        if let Err(e) = outbox::forget_published(engine.step_tx.relaxed(), &batch).await {
            // Unmarked rows are published again by the relay: a duplicate the inbox drops.
            tracing::warn!(error = %crate::error::Report(&e), rows = batch.len(), "could not remove eagerly published outbox rows");
        } else {
            // Kill spot of tests/relaxed_crash.rs (an injected error has nothing to fail here).
            let _ = engine.failpoints.hit("outbox.after_forget");
        }
        batch.clear();
    }
}

/// Adds the ids that arrive within [`GATHER`]; returns early when the batch is full or the
/// channel closed (shutdown: the last batch is written at once).
async fn gather(rx: &mut mpsc::UnboundedReceiver<i64>, batch: &mut Vec<i64>) {
    let deadline = tokio::time::Instant::now() + GATHER;
    while batch.len() < MAX_BATCH {
        let more = rx.recv_many(batch, MAX_BATCH - batch.len());
        match tokio::time::timeout_at(deadline, more).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Keeps the relay off rows this worker will publish itself after the commit (for
/// `relay.eager_grace_ms`, or until this process's presence connection is gone; 0 turns eager
/// publishing off and the relay publishes at once).
pub(super) fn hold_for_eager_publish(engine: &Engine, messages: &mut [OutgoingMessage]) {
    eager_hold(engine).apply(messages)
}

/// How this worker marks the rows it publishes itself (see [`hold_for_eager_publish`]).
pub(super) fn eager_hold(engine: &Engine) -> EagerHold {
    EagerHold {
        relay_after_ms: engine.settings.relay.eager_grace_ms,
        holder_pid: super::presence::pid(engine),
    }
}

/// Whether the worker publishes the messages it commits itself (`relay.eager_grace_ms` > 0);
/// else the relay publishes them at once.
pub(super) fn publishes_eagerly(engine: &Engine) -> bool {
    engine.settings.relay.eager_grace_ms > 0
}

/// What the worker publishes itself once `messages` are committed in outbox rows `rows` (in
/// order): all of them, or none when eager publishing is off.
pub(super) fn to_publish_eagerly(
    engine: &Engine,
    messages: Vec<OutgoingMessage>,
    rows: &[i64],
) -> Vec<Eager> {
    if !publishes_eagerly(engine) {
        return Vec::new();
    }
    messages
        .into_iter()
        .zip(rows)
        .map(|(message, row)| Eager { message, row: *row })
        .collect()
}

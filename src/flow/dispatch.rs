//! The supervisor's hand-off loop: every `flow.poll_ms` it hands free slots to runs waiting for
//! one, for the slots no step's end handed on: a killed or frozen worker's (free once its lease
//! expires), a reservation that lapsed, a
//! limit an operator raised, a rate's next token. Any number of supervisors may run it: each
//! hand-off holds the key's row locked.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::gate;
use crate::engine::Engine;
use crate::health::Loop;
use crate::store::{self, flow};

/// Runs until `shutdown` fires.
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), store::Error> {
    let poll = Duration::from_millis(engine.settings.flow.poll_ms);
    engine.health.runs(Loop::Flow);
    loop {
        engine.health.beat(Loop::Flow);
        if let Err(e) = hand_all(&engine).await {
            tracing::warn!(error = %crate::error::Report(&e), "hand-off of free slots to waiting runs failed; will try again");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// One pass over the workflows with runs waiting (those this process runs: it needs their
/// declared limits); returns how many runs were handed a slot. Their step messages go through
/// the outbox and the relay.
pub async fn hand_all(engine: &Engine) -> store::Result<usize> {
    let mut handed = 0;
    for workflow in flow::waiting_workflows(&engine.pool).await? {
        let Some(declared) = engine
            .registry
            .get(&workflow)
            .and_then(|w| w.flow.concurrency.clone())
        else {
            continue;
        };
        handed += gate::hand_workflow(engine, &declared, &workflow, |_| {}).await?.messages.len();
    }
    if handed > 0 {
        tracing::debug!(runs = handed, "handed free slots to waiting runs");
    }
    Ok(handed)
}

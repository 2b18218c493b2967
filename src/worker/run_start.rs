//! Processing a run-start event: the run and its first step message in one transaction.

use std::sync::Arc;

use lapin::message::Delivery;

use super::RUN_START_CONSUMER;
use super::outcome::{Disposition, dead};
use crate::domain::{MessageId, RunStartEvent};
use crate::engine::{Engine, Stats};
use crate::store::{self, inbox, outbox, runs};

/// Creates the run unless it exists; `Err` means infrastructure failed and the delivery is retried.
pub(super) async fn process(
    engine: &Arc<Engine>,
    delivery: &Delivery,
) -> store::Result<Disposition> {
    let event =
        match RunStartEvent::decode(&delivery.data, engine.settings.worker.max_message_bytes) {
            Ok(e) => e,
            Err(e) => return Ok(dead(e.code(), e.to_string())),
        };
    let span = tracing::Span::current();
    span.record("run.id", tracing::field::display(&event.run_id));
    span.record("workflow", event.workflow.as_str());
    start(engine, delivery, event).await
}

async fn start(
    engine: &Arc<Engine>,
    delivery: &Delivery,
    event: RunStartEvent,
) -> store::Result<Disposition> {
    let Some(workflow) = engine.registry.get(&event.workflow) else {
        return Ok(dead(
            "unknown_workflow",
            format!(
                "run {}: workflow {:?} is not registered (known: {}); fix the publisher or deploy the workflow, then requeue",
                event.run_id,
                event.workflow,
                engine.registry.names().join(", ")
            ),
        ));
    };
    let Some(first) = workflow.first_step() else {
        return Ok(dead(
            "unknown_step",
            format!("workflow {} has no steps", workflow.name),
        ));
    };
    // Upstream services may omit message_id; the run id alone still makes the start idempotent.
    let message_id = uuid::Uuid::parse_str(&super::outcome::message_id(delivery))
        .ok()
        .map(MessageId);
    let mut tx = engine.pool.begin().await?;
    if let Some(id) = message_id
        && !inbox::record(&mut *tx, RUN_START_CONSUMER, id).await?
    {
        tx.rollback().await?;
        return Ok(Disposition::Duplicate);
    }
    let new = runs::NewRun {
        run_id: &event.run_id,
        workflow: &workflow.name,
        version: workflow.version,
        first_step: &first,
        input: &event.input,
    };
    if !runs::insert(&mut *tx, &new).await? {
        tx.commit().await?;
        tracing::info!("run already exists; start event ignored");
        return Ok(Disposition::Duplicate);
    }
    let mut first_message =
        engine
            .topology
            .step_message(&event.run_id, &workflow.name, workflow.version, &first, 0);
    super::published::hold_for_eager_publish(engine, std::slice::from_mut(&mut first_message));
    outbox::insert(&mut *tx, std::slice::from_ref(&first_message)).await?;
    tx.commit().await?;
    Stats::bump(&engine.stats.runs_started);
    tracing::info!("run started");
    let eager = super::published::to_publish_eagerly(engine, std::slice::from_ref(&first_message));
    Ok(Disposition::Committed(eager))
}

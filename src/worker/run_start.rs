//! Processing a run-start event: the run and its first step message in one transaction.
//!
//! The same key with another payload is an error here too, as for outside writes: a second start
//! of a run id with another workflow or input is dead-lettered as `run_conflict`, and an event
//! that reuses a processed message id with another body as `message_id_reuse`; only a true
//! repeat is dropped as a duplicate. An input the workflow does not accept is dead-lettered as
//! `bad_input` before any run exists, so no run waits in review for an input no decision can fix.

use std::collections::BTreeMap;
use std::sync::Arc;

use lapin::message::Delivery;
use sha2::{Digest, Sha256};

use super::RUN_START_CONSUMER;
use super::outcome::{Disposition, dead, dead_letter_headers as h};
use crate::domain::{MessageId, OutgoingMessage, RunStartEvent, StepAddress, request_hash};
use crate::engine::{Engine, Stats};
use crate::flow::debounce::{self, Held};
use crate::store::inbox::{self, Recorded};
use crate::broker::header_str;
use crate::broker::{Outgoing, Topology};
use crate::store::{self, outbox, retention, runs};
use crate::workflow::{Registry, StartRefused, Workflow};

/// The run-start message for `event` and its workflow, when a worker here would start the run:
/// the workflow is registered and accepts the input ([`Registry::accepting`]), and the message
/// fits `limit` bytes (checked first). `trailmark run start` and the embedded handle ask this
/// before they publish; the API starts the run with the workflow it hands back.
pub fn start_message(
    registry: &Registry,
    topology: &Topology,
    limit: usize,
    event: &RunStartEvent,
) -> Result<(Outgoing, Arc<Workflow>), StartRefused> {
    // Size first, as a worker meets it: an oversized event is refused before it is decoded.
    let message = topology.run_start(event);
    let bytes = message.body.len();
    if bytes > limit {
        return Err(StartRefused::TooLarge { bytes, limit });
    }
    let workflow = registry.accepting(&event.workflow, event.version, &event.input)?;
    Ok((message, workflow))
}

/// Creates the run unless it exists; `Err` means infrastructure failed and the delivery is retried.
pub(super) async fn process(
    engine: &Arc<Engine>,
    delivery: &Delivery,
    event: &RunStartEvent,
) -> store::Result<Disposition> {
    let workflow = match engine.registry.accepting(&event.workflow, event.version, &event.input) {
        Ok(workflow) => workflow,
        Err(StartRefused::UnknownVersion { version, .. })
            if let Some(hop) = super::version_wait::start_elsewhere(engine, event, version, delivery).await? =>
        {
            return Ok(hop);
        }
        Err(refused) => {
            let next = match refused {
                StartRefused::UnknownWorkflow { .. } | StartRefused::UnknownVersion { .. } => {
                    "fix the publisher or deploy the workflow, then requeue"
                }
                _ => "fix the publisher and start the run again",
            };
            let why = format!("run {}: {refused}; {next}", event.run_id);
            return Ok(dead(refused.reason(), why));
        }
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
    if let Some(id) = message_id {
        let body_hash = hex::encode(Sha256::digest(&delivery.data));
        match inbox::record(&mut tx, RUN_START_CONSUMER, id, &body_hash).await? {
            Recorded::New => {}
            Recorded::Repeat => {
                tx.rollback().await?;
                return Ok(Disposition::Duplicate(
                    "the run-start event was processed before",
                ));
            }
            Recorded::Reused(first) => {
                tx.rollback().await?;
                return Ok(reused(event, id, first, body_hash));
            }
        }
    }
    // The publisher's trace context, if it sent one: the run's trace continues it.
    let caller = header_str(delivery.properties.headers().as_ref(), crate::trace::TRACEPARENT);
    let created = match &workflow.flow.debounce {
        // Held under its key instead (`flow::debounce`), unless its run id already stands for
        // a run, which is judged below as for any start.
        Some(debounce) => {
            let rules = (workflow.as_ref(), debounce);
            match debounce::hold(&mut tx, &engine.topology, rules, (event, caller.as_deref())).await? {
                Held::Run(created) => created,
                held => return settle_held(tx, event, held, engine).await,
            }
        }
        None => create(&mut tx, (&engine.topology, None), (&workflow.name, workflow.version, Some(&workflow.flow)), &first, (event, caller.as_deref()), |messages| {
            super::published::hold_for_eager_publish(engine, messages)
        })
        .await?,
    };
    let (first_message, rows) = match created {
        Created::New { message, rows } => (message, rows),
        Created::Exists(existing) => {
            tx.rollback().await?;
            return Ok(
                if existing.started_with(&event.workflow, &event.input) {
                    Disposition::Duplicate(
                        "the run exists, started with the same workflow and input",
                    )
                } else {
                    conflict(event, &existing)
                },
            );
        }
        Created::Pruned(gone) => {
            tx.rollback().await?;
            return Ok(pruned(event, &gone));
        }
        // Removed between the insert and the read: the redelivery starts it.
        Created::Vanished => {
            tx.rollback().await?;
            return Ok(Disposition::Delay(std::time::Duration::from_millis(
                engine.settings.worker.busy_retry_ms,
            )));
        }
    };
    tx.commit().await?;
    Stats::bump(&engine.stats.runs_started);
    tracing::info!("run started");
    let eager = super::published::to_publish_eagerly(engine, vec![first_message], &rows);
    Ok(Disposition::Committed(eager))
}

/// A debounced start's disposition: recorded (committed, nothing to publish), a repeat of a
/// recorded start (dropped), another input under a recorded start's id (`run_conflict`), a key
/// missing from the input (`bad_input`), or a race with another start (tried again).
async fn settle_held(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    event: &RunStartEvent,
    held: Held,
    engine: &Engine,
) -> store::Result<Disposition> {
    if let Held::Pending { .. } = held {
        tx.commit().await?;
        return Ok(Disposition::Committed(Vec::new()));
    }
    tx.rollback().await?;
    Ok(match held {
        Held::Known(entry) if entry.same => {
            Disposition::Duplicate("the start was recorded before as a debounced start")
        }
        Held::Known(entry) => {
            let new = request_hash(&event.input);
            tracing::warn!(event_input = %new, "a start of a debounced start's id with another workflow or input; dead-lettered as run_conflict");
            Disposition::DeadLetter {
                reason: "run_conflict",
                detail: format!(
                    "{}. This event asks for workflow {} with input {new}, not what that start asked; start the new work under another run id",
                    debounce::describe(&entry),
                    event.workflow
                ),
                evidence: BTreeMap::from([(h::EVENT_INPUT_HASH.to_owned(), new)]),
            }
        }
        Held::Refused(refused) => dead(
            refused.reason(),
            format!("run {}: {refused}; fix the publisher and start the run again", event.run_id),
        ),
        Held::Busy | Held::Pending { .. } | Held::Run(_) => Disposition::Delay(
            std::time::Duration::from_millis(engine.settings.worker.busy_retry_ms),
        ),
    })
}

/// What [`create`] found.
pub(crate) enum Created {
    /// The run was created; its first step message is in the outbox under these row ids.
    New {
        /// The first step's message.
        message: OutgoingMessage,
        /// Its outbox row ids.
        rows: Vec<i64>,
    },
    /// A run has the id already (which workflow and input it has is the caller's to judge).
    Exists(Box<runs::RunRow>),
    /// A run had the id at the insert and was gone at the read (removed meanwhile).
    Vanished,
    /// A run had the id, finished, and was removed by retention: its tombstone, compared with
    /// this start.
    Pruned(retention::Tombstone),
}

/// Creates the run of `event` with its first step queued in the outbox, in `tx`, unless a run
/// has its id. One path for every start: the run-start consumer, schedules' ticks and
/// backfills, the API, and child runs (whose `parent` is the run whose step starts them).
/// `hold` may mark the first message for the caller's own publish. `caller` is the starter's
/// `traceparent` (see `trace`): the run's trace continues it, or a new one begins. `rules`: the
/// workflow's flow rules, which name the run's concurrency key (the start was accepted, so a
/// required key is there).
pub(crate) async fn create(
    tx: &mut sqlx::PgConnection,
    (topology, parent): (&Topology, Option<&str>),
    (workflow, version, rules): (&str, i32, Option<&crate::flow::Rules>),
    first: &StepAddress,
    (event, caller): (&RunStartEvent, Option<&str>),
    hold: impl FnOnce(&mut [OutgoingMessage]),
) -> store::Result<Created> {
    let trace = crate::trace::run_started(caller, event.run_id.as_str(), workflow);
    let flow_key = rules.and_then(|r| r.key_of(&event.input).ok().flatten());
    let new = runs::NewRun {
        run_id: &event.run_id,
        workflow,
        version,
        first_step: first,
        input: &event.input,
        parent,
        traceparent: trace.as_deref(),
        flow_key: flow_key.as_deref(),
        priority: event.priority.unwrap_or_default().level(),
    };
    if !runs::insert(&mut *tx, &new).await? {
        let id = event.run_id.as_str();
        if let Some(run) = runs::get(&mut *tx, id).await? {
            return Ok(Created::Exists(Box::new(run)));
        }
        let tombstone = retention::tombstone(&mut *tx, id, &event.workflow, &event.input).await?;
        return Ok(tombstone.map_or(Created::Vanished, Created::Pruned));
    }
    let mut message = topology
        .step_message(&event.run_id, workflow, version, first, 0)
        .traced(trace.as_deref());
    hold(std::slice::from_mut(&mut message));
    let rows = outbox::insert(&mut *tx, std::slice::from_ref(&message)).await?;
    Ok(Created::New { message, rows })
}

/// A second start of a run with another workflow or input: dead-lettered with both input hashes.
fn conflict(event: &RunStartEvent, run: &runs::RunRow) -> Disposition {
    let (stored, new) = (request_hash(&run.input), request_hash(&event.input));
    tracing::warn!(stored_input = %stored, event_input = %new, "a second start of the run with another workflow or input; dead-lettered as run_conflict");
    Disposition::DeadLetter {
        reason: "run_conflict",
        detail: format!(
            "run {} exists with workflow {} and input {stored}; this event asks for workflow {} with input {new}. Start the new work under another run id; the run was not changed",
            event.run_id, run.workflow, event.workflow
        ),
        evidence: BTreeMap::from([
            (h::STORED_INPUT_HASH.to_owned(), stored),
            (h::EVENT_INPUT_HASH.to_owned(), new),
        ]),
    }
}

/// A start of a run that finished and was removed: a repeat is dropped, another workflow or
/// input is a conflict, as if the run were still there.
fn pruned(event: &RunStartEvent, gone: &retention::Tombstone) -> Disposition {
    if gone.same {
        return Disposition::Duplicate(
            "the run ran with the same workflow and input and was removed by retention (its tombstone stands)",
        );
    }
    let new = request_hash(&event.input);
    tracing::warn!(event_input = %new, "a start of a removed run's id with another workflow or input; dead-lettered as run_conflict");
    Disposition::DeadLetter {
        reason: "run_conflict",
        detail: format!(
            "run {} ran workflow {} (it ended {} and was removed by retention at {}); this event asks for workflow {} with input {new}, not what it ran. Start the new work under another run id",
            event.run_id, gone.workflow, gone.status, gone.pruned_at, event.workflow
        ),
        evidence: BTreeMap::from([(h::EVENT_INPUT_HASH.to_owned(), new)]),
    }
}

/// An event whose message id was processed before with another body.
fn reused(event: &RunStartEvent, id: MessageId, first: String, body: String) -> Disposition {
    tracing::warn!(first_body = %first, body = %body, "a processed message id reused with another body; dead-lettered as message_id_reuse");
    Disposition::DeadLetter {
        reason: "message_id_reuse",
        detail: format!(
            "message id {id} was processed before with another body (sha256 {first}); this body (sha256 {body}, run {}) was not processed. Publish it again with a fresh message id",
            event.run_id
        ),
        evidence: BTreeMap::from([
            (h::STORED_BODY_HASH.to_owned(), first),
            (h::BODY_HASH.to_owned(), body),
        ]),
    }
}

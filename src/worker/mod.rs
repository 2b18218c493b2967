//! Step consumers: delivery -> dedup -> lease -> handler -> one commit -> ack.
//!
//! [`run`] owns the broker session and reconnects by itself; each delivery is handled by its own
//! task, bounded by `worker.concurrency`. A delivery is acknowledged only after the transaction
//! that records its effects has committed, so a crash anywhere means a redelivery that the inbox
//! turns into a no-op.

mod batch;
mod ending;
mod handover;
mod inbound;
pub(crate) mod lease;
mod outcome;
mod preclaim;
mod presence;
mod published;
pub(crate) mod run_start;
mod step;
mod step_tx;
mod sweep;
mod undoing;
mod version_wait;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::broker::{self, Publisher};
use crate::domain::{BadEvent, InboundEvent, RunStartEvent, StepMessage};
use crate::engine::Engine;
use crate::health::Loop;
use published::PublishedRows;

pub use inbound::{BAD_EVENT, EVENT_CONFLICT};
pub use outcome::{Disposition, dead_letter_headers};
pub use published::Eager;
pub use run_start::start_message;
pub(crate) use step_tx::StepTx;

/// How often an idle worker's loop comes round anyway.
const IDLE_BEAT: Duration = Duration::from_secs(5);

/// Consumer name in the inbox for step messages.
pub const STEP_CONSUMER: &str = "steps";
/// Consumer name in the inbox for run-start events.
pub const RUN_START_CONSUMER: &str = "run-start";

/// Which queue a delivery came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A step message.
    Step,
    /// A run-start event.
    Start,
    /// An event sent to waiting runs.
    Event,
}

/// Consumes until `shutdown` fires, reconnecting after broker failures. Returns after in-flight
/// steps have finished (or were abandoned uncommitted when the lease ran out).
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), broker::Error> {
    let tracker = TaskTracker::new();
    // Presence has a token of its own: it must outlive the steps still finishing after shutdown.
    let presence_stop = CancellationToken::new();
    let presence = tokio::spawn(presence::hold(engine.clone(), presence_stop.clone()));
    let (frozen_tx, frozen) = watch::channel(false);
    let sweep = tokio::spawn(sweep::run(engine.clone(), frozen_tx, shutdown.clone()));
    let (published, forgetting) = PublishedRows::start(engine.clone());
    let mut backoff = Duration::from_millis(200);
    engine.health.runs(Loop::Worker);
    while !shutdown.is_cancelled() {
        engine.health.beat(Loop::Worker);
        match session(&engine, &shutdown, &tracker, &published, frozen.clone()).await {
            Ok(()) => break,
            Err(e) => {
                let problem = crate::error::Report(&e).to_string();
                engine.health.set_broker_problem(Some(problem));
                tracing::warn!(error = %crate::error::Report(&e), retry_in_ms = backoff.as_millis() as u64, "worker lost the broker; reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    tracker.close();
    // In-flight steps get one lease period to finish; after that their leases are void anyway.
    let grace = engine.settings.worker.lease();
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            in_flight = tracker.len(),
            "shutdown: abandoning unfinished steps uncommitted"
        );
    }
    // Published rows are forgotten before the presence connection, which goes last: in-flight
    // leases stay ours until their steps end. Abandoned steps still hold the sender, so the
    // forgetting gets a short while (a row left behind is published once more by a relay).
    drop(published);
    let _ = tokio::time::timeout(Duration::from_secs(5), forgetting).await;
    let _ = sweep.await;
    presence_stop.cancel();
    let _ = presence.await;
    Ok(())
}

async fn session(
    engine: &Arc<Engine>,
    shutdown: &CancellationToken,
    tracker: &TaskTracker,
    published: &PublishedRows,
    mut frozen: watch::Receiver<bool>,
) -> Result<(), broker::Error> {
    let settings = &engine.settings;
    let conn = broker::connect(&settings.broker, &format!("worker-{}", engine.worker_id)).await?;
    let publisher = Publisher::open(
        &conn,
        Duration::from_millis(settings.broker.confirm_timeout_ms),
    )
    .await?;
    engine.topology.declare(&conn).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(settings.worker.concurrency, BasicQosOptions::default())
        .await?;
    let tag = |kind: &str| format!("{kind}-{}", engine.worker_id);
    let steps = channel
        .basic_consume(
            engine.topology.steps_queue().into(),
            tag("steps").into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let starts = channel
        .basic_consume(
            engine.topology.run_start_queue().into(),
            tag("starts").into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let events = channel
        .basic_consume(
            engine.topology.run_event_queue().into(),
            tag("events").into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    tracing::info!(worker = %engine.worker_id, "worker consuming");
    engine.health.set_consuming(true);
    let mut deliveries = Deliveries::new();
    deliveries.push(steps.map(|d| (Kind::Step, d)).boxed());
    deliveries.push(starts.map(|d| (Kind::Start, d)).boxed());
    deliveries.push(events.map(|d| (Kind::Event, d)).boxed());
    let mut first = First::default();
    frozen.mark_changed();
    let mut watching = true;
    let permits = Arc::new(Semaphore::new(settings.worker.concurrency as usize));
    let outcome = loop {
        engine.health.beat(Loop::Worker);
        let next = tokio::select! {
            next = deliveries.next() => next,
            _ = shutdown.cancelled() => break Ok(()),
            changed = frozen.changed(), if watching => {
                watching = changed.is_ok();
                let want = *frozen.borrow_and_update();
                if let Err(e) = first.set(engine, &channel, &mut deliveries, want).await {
                    break Err(e);
                }
                continue;
            }
            // An idle worker still comes round, so /livez tells idle from stuck.
            _ = tokio::time::sleep(IDLE_BEAT) => continue,
        };
        let Some((kind, delivery)) = next else {
            break Err(broker::Error::Unavailable {
                what: "the consumer stream ended (connection closed)".into(),
                source: None,
            });
        };
        // An error ends the session through the same exit as a closed stream, so readiness
        // drops before the reconnect loop takes over.
        let delivery = match delivery {
            Ok(d) => d,
            Err(e) => break Err(e.into()),
        };
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let (engine, publisher, stop) = (engine.clone(), publisher.clone(), shutdown.clone());
        let published = published.clone();
        tracker.spawn(async move {
            handle(&engine, &publisher, &published, delivery, kind, &stop).await;
            drop(permit);
        });
    };
    engine.health.set_consuming(false);
    // Stop taking new deliveries; unacked prefetched ones return to the queue when we close.
    for t in [tag("steps"), tag("starts"), tag("events")]
        .into_iter()
        .chain(first.tags.drain(..))
    {
        let _ = channel
            .basic_cancel(t.into(), BasicCancelOptions::default())
            .await;
    }
    if outcome.is_ok() {
        tracker.close();
        let grace = engine.settings.worker.lease();
        let _ = tokio::time::timeout(grace, tracker.wait()).await;
        release_preclaims(engine).await;
        let _ = conn.close(200, "shutdown".into()).await;
    }
    outcome
}

/// Every consumer's deliveries, with what their queue carries.
type Deliveries = futures_util::stream::SelectAll<
    futures_util::stream::BoxStream<'static, (Kind, Result<Delivery, lapin::Error>)>,
>;

/// The work queues consumed a second time at a higher priority while another worker is frozen
/// (`sweep.rs`): RabbitMQ then hands step messages and run starts to these consumers first, and
/// to a frozen worker's (priority 0, or an older such consumer's) only when every live one is
/// full.
#[derive(Default)]
struct First {
    /// The consumers' tags while they consume.
    tags: Vec<String>,
    /// Times they were made so far, for fresh tags each time.
    made: u32,
}

/// The priority of the consumers made while a worker is frozen (the others have 0): the
/// seconds since 2026, so that consumers made later come first. A worker that froze while its
/// own such consumers were up (another worker had frozen just before) keeps them, and the live
/// workers' newer ones must outrank them.
fn first_priority() -> i32 {
    const SINCE_2026: i64 = 1_767_225_600;
    let secs = chrono::Utc::now().timestamp() - SINCE_2026;
    secs.clamp(1, i64::from(i32::MAX)) as i32
}

impl First {
    /// Starts or cancels the consumers as `want` says.
    async fn set(
        &mut self,
        engine: &Engine,
        channel: &lapin::Channel,
        deliveries: &mut Deliveries,
        want: bool,
    ) -> Result<(), broker::Error> {
        if want && self.tags.is_empty() {
            self.made += 1;
            let priority = first_priority();
            let queues = [
                (Kind::Step, engine.topology.steps_queue()),
                (Kind::Start, engine.topology.run_start_queue()),
            ];
            for (kind, queue) in queues {
                let name = if kind == Kind::Step { "steps" } else { "starts" };
                let tag = format!("{name}-first-{}-{}", engine.worker_id, self.made);
                let mut args = FieldTable::default();
                args.insert("x-priority".into(), AMQPValue::LongInt(priority));
                let consumer = channel
                    .basic_consume(
                        queue.into(),
                        tag.clone().into(),
                        BasicConsumeOptions::default(),
                        args,
                    )
                    .await?;
                deliveries.push(consumer.map(move |d| (kind, d)).boxed());
                self.tags.push(tag);
            }
            tracing::info!("another worker is frozen: this worker now takes messages first");
        } else if !want && !self.tags.is_empty() {
            // Their streams end once what they were handed is read; those deliveries stay ours.
            for tag in std::mem::take(&mut self.tags) {
                channel
                    .basic_cancel(tag.into(), BasicCancelOptions::default())
                    .await?;
            }
            tracing::info!("no worker is frozen any more: messages are shared evenly again");
        }
        Ok(())
    }
}

/// Gives back the pre-claims no delivery took, while this worker still holds their prefetched
/// messages (they return to the queue when the channel closes): the next worker's claim then
/// counts its attempt as the first. A pre-claim left behind costs only that count (one attempt
/// more than ran), as after a crash.
async fn release_preclaims(engine: &Engine) {
    let held = engine.step_tx.preclaims.drain();
    match crate::store::runs::release_preclaims(&engine.pool, &held).await {
        Ok(n) => tracing::debug!(released = n, "shutdown: unused pre-claims given back"),
        Err(e) => {
            tracing::warn!(error = %crate::error::Report(&e), pre_claims = held.len(), "shutdown: could not give back unused pre-claims; their next claims count one attempt more")
        }
    }
}

/// What a delivery carries, decoded once (its retries in place reuse it).
enum Work {
    /// A step to execute.
    Step(StepMessage),
    /// A run to start.
    Start(RunStartEvent),
    /// An event for waiting runs (or why its fields were refused).
    Event(Result<InboundEvent, BadEvent>),
}

/// Processes one delivery inside a span that carries its ids, recorded once when it is decoded
/// (a field recorded again would be printed again on every line).
async fn handle(
    engine: &Arc<Engine>,
    publisher: &Publisher,
    published: &PublishedRows,
    delivery: Delivery,
    kind: Kind,
    shutdown: &CancellationToken,
) {
    use tracing::field::Empty;
    let id = outcome::message_id(&delivery);
    let span = tracing::info_span!("delivery", message.id = %id, run.id = Empty, workflow = Empty, step = Empty,
        seq = Empty);
    async {
        let limit = engine.settings.worker.max_message_bytes;
        let body = &delivery.data;
        let decoded = match kind {
            Kind::Step => StepMessage::decode(body, limit).map(Work::Step),
            Kind::Start => RunStartEvent::decode(body, limit).map(Work::Start),
            Kind::Event => InboundEvent::decode(body, limit).map(Work::Event),
        };
        match decoded {
            Ok(work) => {
                record_ids(&work);
                handle_work(engine, publisher, published, &delivery, work, shutdown).await
            }
            // Not a message at all: poison, with its reason.
            Err(e) => {
                let poison = outcome::dead(e.code(), e.to_string());
                outcome::settle(engine, publisher, published, &delivery, poison).await
            }
        }
    }
    .instrument(span)
    .await
}

/// Puts the message's ids on the delivery's span, so every line about it carries them.
fn record_ids(work: &Work) {
    let span = tracing::Span::current();
    match work {
        Work::Step(msg) => {
            span.record("run.id", tracing::field::display(&msg.run_id));
            span.record("workflow", msg.workflow.as_str());
            span.record("step", msg.step.as_str());
            span.record("seq", msg.seq);
        }
        Work::Start(event) => {
            span.record("run.id", tracing::field::display(&event.run_id));
            span.record("workflow", event.workflow.as_str());
        }
        Work::Event(_) => {}
    }
}

/// Whether RabbitMQ delivered this message before: the redelivered flag, or a quorum queue's
/// count of earlier deliveries.
fn delivered_before(delivery: &Delivery) -> bool {
    delivery.redelivered || outcome::earlier_deliveries(delivery) > 0
}

/// Processes one decoded delivery to its disposition, retrying infrastructure failures in place
/// (the message stays unacknowledged, so nothing is lost if we die meanwhile).
async fn handle_work(
    engine: &Arc<Engine>,
    publisher: &Publisher,
    published: &PublishedRows,
    delivery: &Delivery,
    mut work: Work,
    shutdown: &CancellationToken,
) {
    if let Work::Step(msg) = &mut work {
        msg.trace = broker::header_str(delivery.properties.headers().as_ref(), crate::trace::TRACEPARENT);
    }
    let mut backoff = Duration::from_millis(100);
    // A delivery whose step this process pre-claimed goes on under the owner the pre-claim
    // recorded, so that a retry in place finds the lease its own.
    let owner = match &work {
        Work::Step(msg) => engine.step_tx.preclaims.owner(msg.message_id),
        Work::Start(_) | Work::Event(_) => None,
    }
    .unwrap_or_else(|| format!("{}/{}", engine.worker_id, uuid::Uuid::new_v4().simple()));
    let redelivered = delivered_before(delivery);
    let waited = version_wait::Waited::read(delivery.properties.headers().as_ref());
    loop {
        let result = match &work {
            Work::Step(msg) => step::process(engine, msg, (&owner, redelivered, waited)).await,
            Work::Start(event) => run_start::process(engine, delivery, event).await,
            Work::Event(event) => inbound::process(engine, event).await,
        };
        match result {
            Ok(disposition) => {
                outcome::settle(engine, publisher, published, delivery, disposition).await;
                return;
            }
            Err(e) => {
                // A closed channel means the broker will redeliver elsewhere: stop here.
                if shutdown.is_cancelled() || !delivery.acker.usable() {
                    tracing::warn!(error = %crate::error::Report(&e), "delivery abandoned unacknowledged; the broker will redeliver it");
                    return;
                }
                tracing::warn!(error = %crate::error::Report(&e), retry_in_ms = backoff.as_millis() as u64, "delivery failed on infrastructure; retrying it");
                crate::metrics::step_retried("infrastructure");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

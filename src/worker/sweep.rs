//! A frozen worker must not hold other runs hostage. A process stopped with its connections open
//! (SIGSTOP, a frozen VM, a stalled host, a cut without a reset) keeps its broker connection,
//! so RabbitMQ goes on handing it step messages, round-robin with the live workers, until its
//! prefetch is full or the AMQP heartbeat times out: within a few steps every run's next
//! message sits unread in the frozen process, whoever committed the step before.
//!
//! Every live worker looks, once a second, for worker processes whose presence connection has
//! missed a beat (silent for two `worker.heartbeat_secs`, at most a lease; `store::stranded`).
//! While there is one:
//! - this worker consumes the step queue a second time at a higher consumer priority
//!   (`mod.rs`), so RabbitMQ hands new step messages to live workers first and to the frozen
//!   one only when every live one is full;
//! - runs that have not moved for a lease, with no lease working on them, get a copy of their
//!   step message through the outbox. The original stays where it is; whichever of the two is
//!   claimed first runs the step, and the other is dropped (stale, or a duplicate) when it
//!   comes. A copy needs no more than the promises every message already has: the claim raises
//!   the fence, so a woken worker's late writes are refused.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::domain::RunId;
use crate::engine::Engine;
use crate::store::{self, outbox, stranded};

/// How often a worker looks for frozen workers.
const EVERY: Duration = Duration::from_secs(1);

/// Most runs one look re-queues; the next look takes the rest.
const LIMIT: i64 = 500;

/// Looks every second until `shutdown`, saying on `frozen` whether another worker is frozen.
pub(super) async fn run(
    engine: Arc<Engine>,
    frozen: watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let mut known: BTreeMap<i32, String> = BTreeMap::new();
    loop {
        match look(&engine, &mut known).await {
            Ok(any) => {
                frozen.send_if_modified(|was| std::mem::replace(was, any) != any);
            }
            Err(e) => {
                tracing::debug!(error = %crate::error::Report(&e), "looking for frozen workers failed; will look again")
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
    }
}

/// One look: says which workers froze or came back, re-queues what they may hold; returns
/// whether one is frozen.
async fn look(engine: &Engine, known: &mut BTreeMap<i32, String>) -> store::Result<bool> {
    let w = &engine.settings.worker;
    let lease = w.lease_secs as f64;
    let own = super::presence::pid(engine);
    let silent = stranded::silent_workers(&engine.pool, silence(w), own).await?;
    for w in &silent {
        if !known.contains_key(&w.pid) {
            tracing::warn!(worker = %w.name, presence_pid = w.pid, silent_secs = w.silent_secs as u64,
                "a worker process shows no life while its connections stay open (frozen, or cut off); new step messages go to live workers first, and runs it may hold are re-queued once they have not moved for a lease");
        }
    }
    known.retain(|pid, name| {
        let back = !silent.iter().any(|w| w.pid == *pid);
        if back {
            tracing::info!(worker = %name, presence_pid = pid, "the worker process shows life again, or is gone");
        }
        !back
    });
    known.extend(silent.iter().map(|w| (w.pid, w.name.clone())));
    if silent.is_empty() {
        return Ok(false);
    }
    let n = requeue(engine, lease).await?;
    if n > 0 {
        tracing::warn!(
            runs = n,
            "re-queued the steps of runs that did not move for a lease while a worker is frozen"
        );
        crate::metrics::resumed("worker_frozen", n as u64);
    }
    Ok(true)
}

/// How long a presence connection may be silent before its worker counts as frozen: two beats
/// (one missed), and never more than a lease. Shorter than a lease, so that this worker takes
/// messages first before the frozen worker's leases expire and the supervisor re-queues their
/// steps (else those could go to the frozen worker too, and wait another lease).
fn silence(w: &crate::config::WorkerSettings) -> f64 {
    (2 * w.heartbeat_secs).min(w.lease_secs) as f64
}

/// Queues a copy of the step message of every stranded run this worker runs the version of,
/// in the transaction that marks them; returns how many.
async fn requeue(engine: &Engine, lease: f64) -> store::Result<usize> {
    let mut tx = engine.pool.begin().await?;
    let deployed = engine.registry.deployed();
    let stranded = stranded::take_stranded(&mut *tx, lease, LIMIT, &deployed).await?;
    let messages: Vec<_> = stranded
        .iter()
        .filter_map(|run| {
            let run_id = RunId::parse(&run.run_id).ok()?;
            tracing::debug!(run.id = %run_id, step = %run.step, seq = run.step_seq, "run did not move for a lease while a worker is frozen; re-queueing its step");
            // The run's trace, as the supervisor's re-queue carries it.
            Some(
                engine
                    .topology
                    .step_message(
                        &run_id,
                        &run.workflow,
                        run.workflow_version,
                        &run.step,
                        run.step_seq,
                    )
                    .traced(run.traceparent.as_deref()),
            )
        })
        .collect();
    outbox::insert(&mut *tx, &messages).await?;
    tx.commit().await?;
    Ok(messages.len())
}

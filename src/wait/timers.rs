//! The timer loop: every `waits.poll_ms` it moves on the runs whose wait is due (a sleep's
//! wake-up, an event wait's timeout), in batches, each in one transaction with their outbox
//! rows; it makes runs of the debounced starts that came due (`flow::debounce`); and now and then it marks events no wait took as expired (logging each) and removes
//! those past their time in sight.
//!
//! No broker message waits for a wake-up: a due time is a column of an indexed row, read by
//! the loop, so a run may sleep for months and thousands of sleepers cost nothing but their
//! rows. Due times are read on the database's clock; the loop runs in the supervisor's process
//! (any number of them: `FOR UPDATE SKIP LOCKED`, so none moves one run on twice).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{How, children, go_on};
use crate::engine::Engine;
use crate::health::Loop;
use crate::store::{self, waits};

/// Most due waits one transaction moves on; a full batch is followed by the next at once.
pub const BATCH: i64 = 500;

/// How often expired events are marked and old ones removed.
const HOUSEKEEPING: Duration = Duration::from_secs(5);

/// Runs until `shutdown` fires.
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), store::Error> {
    let poll = Duration::from_millis(engine.settings.waits.poll_ms);
    engine.health.runs(Loop::Timers);
    let mut kept_at = Instant::now() - HOUSEKEEPING;
    loop {
        engine.health.beat(Loop::Timers);
        let full = match wake_due(&engine).await {
            Ok(n) => n as i64 == BATCH,
            Err(e) => {
                tracing::warn!(error = %crate::error::Report(&e), "timer scan of waiting runs failed; will try again");
                false
            }
        };
        // Debounced starts whose burst ended become runs on the same clock (`flow::debounce`).
        if let Err(e) = crate::flow::debounce::start_due(&engine).await {
            tracing::warn!(error = %crate::error::Report(&e), "scan of due debounced starts failed; will try again");
        }
        if kept_at.elapsed() >= HOUSEKEEPING {
            kept_at = Instant::now();
            if let Err(e) = housekeeping(&engine).await {
                tracing::warn!(error = %crate::error::Report(&e), "timer housekeeping of events failed; will try again");
            }
        }
        if full && !shutdown.is_cancelled() {
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// One scan: moves on up to [`BATCH`] runs whose wait is due, in one transaction; returns how
/// many.
pub async fn wake_due(engine: &Engine) -> store::Result<usize> {
    let mut tx = engine.pool.begin().await?;
    let due = waits::due(&mut tx, BATCH).await?;
    if due.is_empty() {
        tx.rollback().await?;
        return Ok(0);
    }
    // A child run that stops for review here is counted in its parent's fan-out, which takes
    // the parent's row before the child's (as a child's own ending does): each such child goes
    // in a transaction of its own, after this batch lets go of its row.
    let (children, batch): (Vec<_>, Vec<_>) = due.into_iter().partition(children::stops_a_child);
    let runs = batch.into_iter().map(|w| (w, How::Due)).collect();
    let moved = go_on(&mut tx, &engine.topology, runs).await?;
    engine
        .failpoints
        .hit("timers.before_commit")
        .map_err(|e| store::Error::unavailable("the timer scan was interrupted", e))?;
    tx.commit().await?;
    let mut stopped = 0;
    for child in &children {
        if children::timed_out(&engine.pool, &engine.topology, child).await? {
            stopped += 1;
        }
    }
    tracing::debug!(runs = moved.len() + stopped, "due waits moved on");
    Ok(moved.len() + stopped)
}

/// Marks events no wait took in time as expired (each logged, never dropped silently), removes
/// those past `waits.event_retention_secs`, and, as a guard, closes (with a warning) waits whose
/// run was moved on without closing them.
async fn housekeeping(engine: &Engine) -> store::Result<()> {
    let expired = waits::expire(&engine.pool, BATCH).await?;
    for e in &expired {
        tracing::warn!(event.id = %e.signal_id, event = %e.name, key = %e.match_key, received_at = %e.received_at,
            "an event expired without a run waiting for it (waits.event_keep_secs); it stays listed by `trailmark event list --state expired`");
    }
    crate::metrics::events_expired(expired.len() as u64);
    let removed = waits::prune(&engine.pool, BATCH).await?;
    if removed > 0 {
        tracing::info!(
            events = removed,
            "expired events removed after waits.event_retention_secs"
        );
    }
    let orphans = waits::close_orphans(&engine.pool, BATCH).await?;
    if !orphans.is_empty() {
        tracing::warn!(waits = orphans.len(), first = ?orphans.first(),
            "closed open waits whose run no longer waits there; whatever moved the run on should have closed them: report this with the run ids (`trailmark run show`) so the path that left them is fixed");
    }
    Ok(())
}

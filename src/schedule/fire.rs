//! The scheduler's scan: due schedules, locked, each tick's run created, the next tick set, in
//! one transaction.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::{Error, Overlap, Spec};
use crate::domain::{RunId, RunStartEvent, RunStatus};
use crate::engine::Engine;
use crate::store::{runs, schedules};
use crate::worker::run_start::{self, Created};

/// Most schedules one scan takes; the next scan takes the rest.
const SCAN_LIMIT: i64 = 100;
/// Most ticks of one schedule one scan looks at (a schedule far behind catches up over scans).
const TICKS_PER_SCAN: usize = 1_000;

/// What one scan did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Fired {
    /// Runs started.
    pub started: u32,
    /// Ticks that started nothing.
    pub skipped: u32,
}

/// Fires every due tick of up to [`SCAN_LIMIT`] schedules, in one transaction.
pub async fn fire_due(engine: &Engine) -> Result<Fired, Error> {
    let mut tx = engine.pool.begin().await?;
    let mut fired = Fired::default();
    let due = schedules::due(&mut *tx, SCAN_LIMIT).await?;
    if due.is_empty() {
        return Ok(fired);
    }
    let now = schedules::now(&mut *tx).await?;
    for row in due {
        let spec = match Spec::from_row(&row) {
            Ok(spec) => spec,
            Err(e) => {
                tracing::warn!(schedule = %row.name, error = %e, "schedule cannot be read; it fires nothing until it is recreated");
                continue;
            }
        };
        if engine.registry.get(&spec.workflow).is_none() {
            // Left due for a process that runs the workflow (a rolling upgrade).
            tracing::warn!(schedule = %row.name, workflow = %spec.workflow, "schedule's workflow is not deployed in this process; another process may fire it");
            continue;
        }
        let one = fire_one(engine, &mut tx, &spec, &row, now).await?;
        fired.started += one.started;
        fired.skipped += one.skipped;
    }
    // A crash here loses the whole scan: another scheduler fires the same ticks.
    engine
        .failpoints
        .hit("schedule.before_commit")
        .map_err(|e| Error::Store(crate::store::Error::unavailable("the scheduler was interrupted", e)))?;
    tx.commit().await?;
    Ok(fired)
}

/// One schedule's due ticks, under the overlap policy and the catch-up window.
async fn fire_one(
    engine: &Engine,
    tx: &mut PgConnection,
    spec: &Spec,
    row: &schedules::ScheduleRow,
    now: DateTime<Utc>,
) -> Result<Fired, Error> {
    let mut fired = Fired::default();
    let mut last: Option<(DateTime<Utc>, RunId)> = None;
    let mut busy = match &row.last_run_id {
        Some(id) => unfinished(tx, id).await?,
        None => false,
    };
    let mut buffered = row.buffered_tick;
    if let Some(tick) = buffered.filter(|_| !busy) {
        start(engine, tx, spec, tick).await?;
        (buffered, busy, last) = (None, true, Some((tick, spec.run_of(tick))));
        fired.started += 1;
    }
    let oldest = now - chrono::Duration::from_std(spec.catch_up).unwrap_or_default();
    let mut next = Some(row.next_tick);
    let mut looked = 0;
    while let Some(tick) = next.filter(|t| *t <= now && looked < TICKS_PER_SCAN) {
        looked += 1;
        next = spec.cadence.next_after(tick);
        let runs_now = tick >= oldest
            && match spec.overlap {
                Overlap::Allow => true,
                _ if !busy => true,
                Overlap::BufferOne if buffered.is_none() => {
                    buffered = Some(tick);
                    false
                }
                _ => false,
            };
        if runs_now {
            start(engine, tx, spec, tick).await?;
            (busy, last) = (true, Some((tick, spec.run_of(tick))));
            fired.started += 1;
        } else if buffered != Some(tick) {
            fired.skipped += 1;
        }
    }
    // A cron expression with no further tick (a year field in the past) parks the schedule far
    // ahead rather than firing again.
    let next_tick = next.unwrap_or(DateTime::<Utc>::MAX_UTC);
    schedules::advance(
        &mut *tx,
        &schedules::Advanced {
            name: &spec.name,
            next_tick,
            buffered_tick: buffered,
            last: last.as_ref().map(|(t, id)| (*t, id.as_str())),
            started: fired.started.into(),
            skipped: fired.skipped.into(),
        },
    )
    .await?;
    Ok(fired)
}

/// Whether the run has not ended (a run waiting for a person or in review has not).
async fn unfinished(tx: &mut PgConnection, run_id: &str) -> Result<bool, Error> {
    Ok(runs::get(&mut *tx, run_id)
        .await?
        .is_some_and(|r| !r.status.is_terminal() && r.status != RunStatus::Shadowed))
}

/// Creates the tick's run (nothing when it exists: a backfill or a trigger made it already).
pub(super) async fn start(
    engine: &Engine,
    tx: &mut PgConnection,
    spec: &Spec,
    tick: DateTime<Utc>,
) -> Result<bool, Error> {
    create(engine, tx, spec, spec.run_of(tick)).await
}

/// Creates a run of the schedule under `run_id`; `false` when it exists.
pub(super) async fn create(
    engine: &Engine,
    tx: &mut PgConnection,
    spec: &Spec,
    run_id: RunId,
) -> Result<bool, Error> {
    let workflow = engine
        .registry
        .accepting(&spec.workflow, &spec.input)
        .map_err(|refused| super::invalid("workflow", refused.to_string()))?;
    let Some(first) = workflow.first_step() else {
        return Err(super::invalid("workflow", "it has no steps"));
    };
    let event = RunStartEvent::new(run_id, spec.workflow.clone(), spec.input.clone());
    let created = run_start::create(tx, &engine.topology, &workflow, &first, &event, |_| {}).await?;
    Ok(matches!(created, Created::New { .. }))
}

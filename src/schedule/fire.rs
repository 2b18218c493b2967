//! The scheduler's scan: due schedules, locked, each tick's run created, the next tick set, in
//! one transaction.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use std::sync::Arc;

use super::{Error, Overlap, Spec};
use crate::domain::{RunId, RunStartEvent, RunStatus, StepAddress};
use crate::engine::Engine;
use crate::store::{runs, schedules};
use crate::worker::run_start::{self, Created};
use crate::workflow::Workflow;

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
        // A schedule this process cannot start (unreadable, its workflow not deployed here or
        // refusing its input) is left due and the others fire: one bad schedule must not
        // roll back every schedule's scan.
        let starter = Spec::from_row(&row).and_then(|spec| Starter::of(engine, spec));
        let starter = match starter {
            Ok(starter) => starter,
            Err(e) => {
                tracing::warn!(schedule = %row.name, error = %e, "schedule cannot start a run in this process; it is left due (another process may run its workflow)");
                continue;
            }
        };
        let one = fire_one(engine, &mut tx, &starter, &row, now).await?;
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
    starter: &Starter,
    row: &schedules::ScheduleRow,
    now: DateTime<Utc>,
) -> Result<Fired, Error> {
    let spec = &starter.spec;
    let mut fired = Fired::default();
    let mut last = None;
    let mut busy = match row.last_tick {
        Some(tick) => unfinished(tx, &spec.run_of(tick)).await?,
        None => false,
    };
    let mut buffered = row.buffered_tick;
    let start = async |tx: &mut PgConnection, tick: DateTime<Utc>, fired: &mut Fired| {
        // A run a backfill or an earlier scan made already is not counted again.
        if starter.start(engine, tx, spec.run_of(tick)).await? {
            fired.started += 1;
        }
        Ok::<_, Error>(Some(tick))
    };
    if let Some(tick) = buffered.filter(|_| !busy) {
        last = start(tx, tick, &mut fired).await?;
        (buffered, busy) = (None, true);
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
            last = start(tx, tick, &mut fired).await?;
            busy = true;
        } else if buffered != Some(tick) {
            fired.skipped += 1;
        }
    }
    // Held behind a busy run with no tick due: nothing changed, nothing to write.
    if looked == 0 && buffered == row.buffered_tick {
        return Ok(fired);
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
            last_tick: last,
            started: fired.started.into(),
            skipped: fired.skipped.into(),
        },
    )
    .await?;
    Ok(fired)
}

/// Whether the run has not ended (a run waiting for a person or in review has not).
async fn unfinished(tx: &mut PgConnection, run_id: &RunId) -> Result<bool, Error> {
    Ok(runs::standing(&mut *tx, run_id)
        .await?
        .is_some_and(|(status, _, _)| !status.is_terminal() && status != RunStatus::Shadowed))
}

/// What starts a schedule's runs: its workflow, accepting its input, and the first step,
/// checked once per schedule rather than per tick.
pub(super) struct Starter {
    spec: Spec,
    workflow: Arc<Workflow>,
    first: StepAddress,
}

impl Starter {
    /// The schedule's starter, or why this process cannot start its runs.
    pub(super) fn of(engine: &Engine, spec: Spec) -> Result<Self, Error> {
        let workflow = engine
            .registry
            .accepting(&spec.workflow, None, &spec.input)
            .map_err(|refused| super::invalid("workflow", refused.to_string()))?;
        let first = workflow
            .first_step()
            .ok_or_else(|| super::invalid("workflow", "it has no steps"))?;
        Ok(Self {
            spec,
            workflow,
            first,
        })
    }

    /// The schedule.
    pub(super) fn spec(&self) -> &Spec {
        &self.spec
    }

    /// Creates a run of the schedule under `run_id` (through the one run-creation path);
    /// `false` when it exists (a backfill, a trigger or an earlier scan made it).
    pub(super) async fn start(
        &self,
        engine: &Engine,
        tx: &mut PgConnection,
        run_id: RunId,
    ) -> Result<bool, Error> {
        let event = RunStartEvent::new(run_id, self.spec.workflow.clone(), self.spec.input.clone());
        let created =
            run_start::create(tx, (&engine.topology, None), (&self.workflow.name, self.workflow.version, Some(&self.workflow.flow)), &self.first, (&event, None), |_| {})
                .await?;
        Ok(matches!(created, Created::New { .. }))
    }
}

//! Debounce of run starts: of the starts of a workflow with one key that come within its window
//! of each other (a burst), only the last becomes a run, with its own run id and input.
//!
//! A start of a debounced workflow (a run-start event, `POST /api/v1/runs`) is recorded in
//! `trailmark.debounced_starts` in the transaction that would have created its run (with its
//! inbox row, its audit row): the first of a burst as its key's pending start, due a window
//! later; each later one supersedes the pending start and is due a window after it came
//! (trailing), but never later than [`HOLD_WINDOWS`] windows after the burst's first start, so
//! that a key started more often than its window still runs. A crash loses nothing (the row is
//! committed with the start or not at all); a redelivered start finds its row and changes
//! nothing.
//!
//! The timer loop ([`start_due`], `waits.poll_ms`) makes due starts runs through the one
//! run-creation path, in small batches locked `SKIP LOCKED`, each batch one transaction that
//! creates the runs and marks their starts `started`: two processes never take the same start,
//! and a process killed mid-batch leaves its starts pending for the next scan. A start of a key
//! whose pending start is overdue (the loop has not come round yet) starts that one first, in
//! the same transaction, before it opens a new burst.
//!
//! A superseded start keeps its row (with its burst, which names the winner) for
//! `retention.tombstone_secs` after it was superseded: a later start of its id starts nothing (a
//! repeat is a duplicate, other input a `run_conflict`), and `trailmark run show` and the API say
//! "superseded by <winner> (debounced)". Schedules' ticks and child runs are not debounced: they
//! start at once.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use sqlx::PgConnection;

use super::Debounce;
use crate::broker::Topology;
use crate::domain::RunStartEvent;
use crate::engine::Engine;
use crate::store::debounce::{self as sql, DebouncedStart, Ended, NewStart, Pending};
use crate::store::{self, retention, runs};
use crate::worker::run_start::{self, Created};
use crate::workflow::{StartRefused, Workflow};

/// The longest a burst is held, in windows from its first start: a key started without pause
/// still runs at least once every this many windows.
pub const HOLD_WINDOWS: u32 = 10;

/// Most due starts one transaction of the timer loop makes runs.
pub const BATCH: i64 = 100;

/// Most batches one round of the timer loop takes; the next round takes the rest.
const BATCHES_PER_ROUND: usize = 10;

impl Debounce {
    /// The longest a burst is held from its first start ([`HOLD_WINDOWS`] windows).
    pub fn max_hold(&self) -> Duration {
        self.window * HOLD_WINDOWS
    }
}

/// What recording a start of a debounced workflow found.
pub(crate) enum Held {
    /// The start is its key's pending start now (`replaced`: the pending start it superseded).
    Pending {
        /// The start as recorded.
        entry: DebouncedStart,
        /// The start it superseded, if any.
        replaced: Option<String>,
    },
    /// Its run id was recorded before as a debounced start (compared with this one: `same`).
    Known(DebouncedStart),
    /// A run has (or had) its id: what the one run-creation path would have found.
    Run(Created),
    /// Its key's value is missing or unfit: refused, nothing recorded.
    Refused(StartRefused),
    /// A start of its run id (with another key) was recorded meanwhile: roll back and try
    /// again.
    Busy,
}

/// Records `event` (a start of `workflow`, which declares `debounce`) in `tx`, or finds why it
/// needs no record: its run exists, its tombstone does, or it was recorded before.
pub(crate) async fn hold(
    tx: &mut PgConnection,
    topology: &Topology,
    (workflow, debounce): (&Workflow, &Debounce),
    (event, caller): (&RunStartEvent, Option<&str>),
) -> store::Result<Held> {
    let key = match debounce.key.value_in(&event.input) {
        Ok(key) => key,
        Err(e) => {
            return Ok(Held::Refused(StartRefused::BadInput {
                workflow: workflow.name.clone(),
                why: e.to_string(),
            }));
        }
    };
    let body = serde_json::to_value(event).map_err(|e| {
        store::Error::unavailable("the run-start event could not be stored as JSON", e)
    })?;
    let new = NewStart {
        run_id: event.run_id.as_str(),
        workflow: &workflow.name,
        key_value: &key,
        event: &body,
        input: &event.input,
        traceparent: caller,
        window_secs: debounce.window.as_secs_f64(),
        cap_secs: debounce.max_hold().as_secs_f64(),
    };
    // Starts of one key are recorded one after the other, in the order they take this lock.
    sql::lock_key(tx, &workflow.name, &key).await?;
    let pending = sql::lock_pending(tx, &workflow.name, &key).await?;
    if let Some(known) = known(tx, event).await? {
        return Ok(known);
    }
    record(tx, topology, workflow, &new, pending).await
}

/// Records `new` as its key's pending start, superseding `pending` (or, when that one is
/// overdue, making it a run first and opening a new burst).
async fn record(
    tx: &mut PgConnection,
    topology: &Topology,
    workflow: &Workflow,
    new: &NewStart<'_>,
    pending: Option<Pending>,
) -> store::Result<Held> {
    let after = match pending {
        Some(p) if p.overdue => {
            start(tx, topology, workflow, &p).await?;
            None
        }
        Some(p) => {
            sql::end(tx, &p.run_id, Ended::Superseded, None).await?;
            Some(p)
        }
        None => None,
    };
    let Some(entry) = sql::insert(tx, new, after.as_ref()).await? else {
        return Ok(Held::Busy);
    };
    let outcome = if after.is_some() {
        "superseded"
    } else {
        "held"
    };
    crate::metrics::debounced(outcome, 1);
    tracing::info!(run.id = %new.run_id, workflow = %workflow.name, key = %new.key_value,
        due_at = %entry.due_at, replaced = ?after.as_ref().map(|p| &p.run_id),
        "run start held (debounced): it becomes a run when it is due, unless a later start with its key replaces it");
    let replaced = after.map(|p| p.run_id);
    Ok(Held::Pending { entry, replaced })
}

/// What a start's run id already stands for: a run, a removed run's tombstone, or a debounced
/// start recorded before.
async fn known(tx: &mut PgConnection, event: &RunStartEvent) -> store::Result<Option<Held>> {
    let id = event.run_id.as_str();
    if let Some(run) = runs::get(&mut *tx, id).await? {
        return Ok(Some(Held::Run(Created::Exists(Box::new(run)))));
    }
    if let Some(gone) = retention::tombstone(&mut *tx, id, &event.workflow, &event.input).await? {
        return Ok(Some(Held::Run(Created::Pruned(gone))));
    }
    let asked = Some((event.workflow.as_str(), &event.input));
    Ok(sql::find(&mut *tx, id, asked).await?.map(Held::Known))
}

/// Makes the due start `p` a run through the one run-creation path, in `tx`, and marks it
/// started; a start whose run id was taken meanwhile by another run is marked refused, with why.
async fn start(
    tx: &mut PgConnection,
    topology: &Topology,
    workflow: &Workflow,
    p: &Pending,
) -> store::Result<Ended> {
    let (how, note) = match (
        serde_json::from_value::<RunStartEvent>(p.event.clone()),
        workflow.first_step(),
    ) {
        (Ok(event), Some(first)) => {
            let names = (workflow.name.as_str(), workflow.version, Some(&workflow.flow));
            let created = run_start::create(
                tx,
                (topology, None),
                names,
                &first,
                (&event, p.traceparent.as_deref()),
                |_| {},
            )
            .await?;
            judged(&event, created)
        }
        (Err(e), _) => (
            Ended::Refused,
            Some(format!(
                "its stored start cannot be read by this build ({e}); start the work again"
            )),
        ),
        (_, None) => (
            Ended::Refused,
            Some(format!("workflow {} has no steps", workflow.name)),
        ),
    };
    sql::end(tx, &p.run_id, how, note.as_deref()).await?;
    match &note {
        None => {
            tracing::info!(run.id = %p.run_id, workflow = %p.workflow, key = %p.key_value, starts = p.nth, "debounced start became a run")
        }
        Some(why) => {
            tracing::warn!(run.id = %p.run_id, workflow = %p.workflow, key = %p.key_value, why = %why, "debounced start came due and was refused")
        }
    }
    crate::metrics::debounced(
        if how == Ended::Started {
            "started"
        } else {
            "refused"
        },
        1,
    );
    Ok(how)
}

/// Whether what the run-creation path found makes the start started (its run exists as it
/// asked) or refused (its id was taken by another run meanwhile), and why.
fn judged(event: &RunStartEvent, created: Created) -> (Ended, Option<String>) {
    let taken = |workflow: &str| {
        Some(format!(
            "run id {} was taken meanwhile by a run of workflow {workflow} with other input; start the work again under another run id",
            event.run_id
        ))
    };
    match created {
        Created::New { .. } => (Ended::Started, None),
        Created::Exists(run) if run.started_with(&event.workflow, &event.input) => {
            (Ended::Started, None)
        }
        Created::Exists(run) => (Ended::Refused, taken(&run.workflow)),
        Created::Pruned(gone) if gone.same => (Ended::Started, None),
        Created::Pruned(gone) => (Ended::Refused, taken(&gone.workflow)),
        Created::Vanished => (
            Ended::Refused,
            Some(format!(
                "a run {} existed and was removed while this start came due; start it again",
                event.run_id
            )),
        ),
    }
}

/// One round of the timer loop: makes runs of the due starts of the workflows registered here,
/// in batches of up to [`BATCH`], each one transaction; returns how many it started.
pub async fn start_due(engine: &Engine) -> store::Result<usize> {
    let names = engine.registry.names();
    let mut started = 0;
    for _ in 0..BATCHES_PER_ROUND {
        let (n, taken) = start_batch(engine, &names).await?;
        started += n;
        if taken < BATCH as usize {
            break;
        }
    }
    Ok(started)
}

/// One batch in one transaction: (runs started, due starts taken).
async fn start_batch(engine: &Engine, names: &[String]) -> store::Result<(usize, usize)> {
    let mut tx = engine.pool.begin().await?;
    let due = sql::due(&mut tx, names, BATCH).await?;
    if due.is_empty() {
        tx.rollback().await?;
        return Ok((0, 0));
    }
    let mut started = 0;
    for p in &due {
        // Registered here: `due` reads only this process's workflows.
        let Some(workflow) = engine.registry.get(&p.workflow) else {
            continue;
        };
        if start(&mut tx, &engine.topology, &workflow, p).await? == Ended::Started {
            started += 1;
        }
    }
    // A crash here loses the batch: its starts stay pending and the next scan takes them.
    engine
        .failpoints
        .hit("debounce.before_commit")
        .map_err(|e| store::Error::unavailable("the debounce scan was interrupted", e))?;
    tx.commit().await?;
    Ok((started, due.len()))
}

/// The recorded debounced start of `run_id` (for `run show` and the API, when no run has it).
pub async fn find(db: &sqlx::PgPool, run_id: &str) -> store::Result<Option<DebouncedStart>> {
    sql::find(db, run_id, None).await
}

/// A recorded start in words: where it stands and what to do.
pub fn describe(e: &DebouncedStart) -> String {
    let of = format!(
        "a debounced start of workflow {} (key {})",
        e.workflow, e.key_value
    );
    match e.state.as_str() {
        "pending" => format!(
            "run {} is {of}, pending until {}: it becomes a run then, unless a later start with this key replaces it (start {} of its burst, the first at {})",
            e.run_id, e.due_at, e.nth, e.first_at
        ),
        "superseded" => match (&e.superseded_by, e.winner_state.as_deref()) {
            (Some(winner), Some("pending")) => format!(
                "run {} was not started: superseded by {winner} (debounced), {of}; {winner} is pending until {}",
                e.run_id,
                e.winner_due_at.map_or("-".into(), |t| t.to_string())
            ),
            (Some(winner), Some("started")) => format!(
                "run {} was not started: superseded by {winner} (debounced), {of}; follow it with `trailmark run show {winner}`",
                e.run_id
            ),
            (Some(winner), _) => format!(
                "run {} was not started: superseded by {winner} (debounced), {of}; {winner} was refused when it came due (`trailmark run show {winner}` says why)",
                e.run_id
            ),
            (None, _) => format!(
                "run {} was not started: superseded by a later start (debounced), {of}, whose record has aged out",
                e.run_id
            ),
        },
        "refused" => format!(
            "run {} was not started: {of} came due at {} and was refused: {}",
            e.run_id,
            e.due_at,
            e.note.as_deref().unwrap_or("no reason recorded")
        ),
        _ => format!(
            "run {} was started from {of} at {}",
            e.run_id,
            e.ended_at.map_or("-".into(), |t| t.to_string())
        ),
    }
}

/// Workflows seen with pending starts, so that one with none any more reads 0.
static SEEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Refreshes the gauge of pending debounced starts by workflow.
pub async fn refresh_gauge(pool: &sqlx::PgPool) -> store::Result<()> {
    let counts = sql::pending_counts(pool).await?;
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    seen.extend(counts.iter().map(|(w, _)| w.clone()));
    for workflow in seen.iter() {
        let n = counts
            .iter()
            .find(|(w, _)| w == workflow)
            .map_or(0, |(_, n)| *n);
        crate::metrics::debounced_pending(workflow, n);
    }
    Ok(())
}

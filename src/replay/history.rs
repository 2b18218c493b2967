//! The history format (`trailmark.history/1`): one run as a replay needs it, self-contained,
//! and its reading from the database. Documented in `docs/OPERATIONS.md`, "Replay check before
//! a deploy"; a change that old files cannot be read with gets a new format number.
//!
//! Where a position went on is worked out here, once, from the engine's own records (the wait a
//! step's commit registered, the next position, how the run ended), so a replay compares with
//! it without knowing the tables.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;

use super::{ExportError, ReplayError};
use crate::domain::RunStatus;
use crate::store::{self, forks, history as sql, runs, steps};

/// The format name and version every history file carries.
pub const FORMAT: &str = "trailmark.history/1";

/// The format of the archive's run document, which a replay cannot read (it lacks the children's
/// outputs and, for a fork, its parent's events): named in the error that refuses it.
const RUN_DOCUMENT: &str = "trailmark.run.v1";

/// One run's recorded history: what it was started with, what each position did, and everything
/// a step read back from trailmark while it ran (answers, write results, events, children).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct History {
    /// Always [`FORMAT`].
    pub format: String,
    /// When it was exported (for people; the replay does not read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exported_at: Option<DateTime<Utc>>,
    /// The run.
    pub run: RunRecord,
    /// Every position the run reached, in order.
    pub positions: Vec<PositionRecord>,
    /// Every journal entry (model answers, patch choices), by position and call number.
    #[serde(default)]
    pub journal: Vec<JournalRecord>,
    /// Every outside write, in the order the run made them.
    #[serde(default)]
    pub effects: Vec<EffectRecord>,
    /// The events that resumed the run, by the position that waited for them.
    #[serde(default)]
    pub events: Vec<EventRecord>,
    /// The child runs its steps started, by position and index.
    #[serde(default)]
    pub children: Vec<ChildRecord>,
}

/// The run as it stood when exported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Its id.
    pub id: String,
    /// Its workflow.
    pub workflow: String,
    /// The workflow version it is pinned to: the code a replay must run.
    pub version: i32,
    /// Its input.
    pub input: Value,
    /// Its status (`succeeded`, `needs_review`, ...).
    pub status: String,
    /// A shadow fork: its outside writes were recorded, never made.
    #[serde(default)]
    pub shadow: bool,
    /// For a fork: the run and the first position it ran itself (earlier ones were taken over).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkRecord>,
}

/// Where a fork comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkRecord {
    /// The parent run.
    pub run: String,
    /// The first position the fork ran itself.
    pub from_seq: i32,
}

/// One position: the step that ran there, how it stands and where the run went on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PositionRecord {
    /// The position (0-based).
    pub seq: i32,
    /// The step's address (a declared step, or `undo:<step>@<seq>` for a compensation).
    pub step: String,
    /// Whether a step commit finished it, or how it stands without one.
    pub status: PositionStatus,
    /// Claims of this position (a crash mid-step counts).
    pub attempts: i32,
    /// The checkpointed output, once done.
    #[serde(default)]
    pub output: Option<Value>,
    /// Where the run went on after it; `None` when the history cannot say (the position is not
    /// done, or the run was undone or cancelled right after it).
    #[serde(default)]
    pub then: Option<Then>,
    /// What the run waited for after it (registered by the same commit).
    #[serde(default)]
    pub pause: Option<PauseRecord>,
    /// The last error of a retried or stopped attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How a position stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionStatus {
    /// A step commit finished it: its output and its next step are recorded.
    Done,
    /// The run is at this position and running it (or about to retry it).
    Running,
    /// Its last attempt stopped without a commit (review, failure, cancel, an undo after it).
    Stopped,
}

/// Where a run went on after a position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    /// With this step.
    Step(String),
    /// Nowhere: the run ended (succeeded) there.
    Finish,
}

/// What a run waited for after a position, before its next step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PauseRecord {
    /// An event of this name and match key.
    Event {
        /// The event's name.
        name: String,
        /// Its match key.
        key: String,
    },
    /// A time (a sleep's length is not part of the path).
    Sleep,
    /// Child runs (listed in [`History::children`]).
    Children {
        /// How many.
        count: usize,
    },
}

/// A journal entry, its answer word for word.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalRecord {
    /// Position.
    pub seq: i32,
    /// Call number within the position.
    pub call_no: i32,
    /// `model`, `patch`, ...
    pub kind: String,
    /// Hash of the request.
    pub request_hash: String,
    /// The answer.
    pub response: Value,
}

/// An outside write as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectRecord {
    /// The idempotency key.
    pub key: String,
    /// Position of the step that made it.
    pub seq: i32,
    /// The tool.
    pub tool: String,
    /// Hash of the request.
    pub request_hash: String,
    /// The result; `None` while the outcome is unknown (the run stopped between call and record).
    #[serde(default)]
    pub result: Option<Value>,
}

/// The event that resumed the run after the wait at `seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    /// The position that waited.
    pub seq: i32,
    /// The event's id.
    pub id: String,
    /// Its name.
    pub name: String,
    /// Its match key.
    pub key: String,
    /// Its payload.
    pub payload: Value,
    /// When trailmark received it.
    pub received_at: DateTime<Utc>,
}

/// A child run started by the step at `seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildRecord {
    /// The parent's position.
    pub seq: i32,
    /// Its index in the fan-out.
    pub index: i32,
    /// Its run id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// Its input.
    pub input: Value,
    /// How it stood when exported.
    pub state: String,
    /// Its output, once it succeeded.
    #[serde(default)]
    pub output: Option<Value>,
    /// Why it failed or was cancelled.
    #[serde(default)]
    pub reason: Option<String>,
}

impl History {
    /// Reads a history file's text, refusing another format with what to export instead.
    pub fn parse(text: &str) -> Result<Self, ReplayError> {
        let value: Value = serde_json::from_str(text).map_err(ReplayError::Unreadable)?;
        let format = value.get("format").and_then(Value::as_str);
        if format != Some(FORMAT) {
            return Err(ReplayError::Format {
                found: format.map(str::to_owned),
                hint: if format == Some(RUN_DOCUMENT) {
                    " (the archive's run document, which lacks what a replay reads)"
                } else {
                    ""
                },
            });
        }
        serde_json::from_value(value).map_err(ReplayError::Unreadable)
    }
}

/// The run `run_id`'s history, read from the database in one snapshot.
pub async fn export(pool: &PgPool, run_id: &str) -> Result<History, ExportError> {
    read(pool, run_id)
        .await
        .map_err(|source| ExportError::Store {
            run_id: run_id.to_owned(),
            source,
        })?
        .ok_or_else(|| ExportError::NotFound {
            run_id: run_id.to_owned(),
        })
}

/// [`export`]'s reads; `None` when no run has that id.
async fn read(pool: &PgPool, run_id: &str) -> store::Result<Option<History>> {
    let mut tx = pool.begin().await?;
    sql::snapshot(&mut tx).await?;
    let Some(run) = runs::get(&mut *tx, run_id).await? else {
        return Ok(None);
    };
    let fork = forks::parent(&mut *tx, run_id).await?;
    let rows = steps::list(&mut *tx, run_id).await?;
    let waits = sql::waits(&mut *tx, run_id).await?;
    let journal = sql::journal(&mut *tx, run_id).await?;
    let effects = sql::effects(&mut *tx, run_id).await?;
    let events = sql::events(&mut *tx, run_id).await?;
    let children = sql::children(&mut *tx, run_id).await?;
    tx.commit().await?;
    let positions = positions(&run, &rows, &waits, &children);
    Ok(Some(History {
        format: FORMAT.to_owned(),
        exported_at: Some(Utc::now()),
        run: RunRecord {
            id: run.run_id.clone(),
            workflow: run.workflow.clone(),
            version: run.workflow_version,
            input: run.input.clone(),
            status: run.status.as_str().to_owned(),
            shadow: run.shadow,
            forked_from: fork.map(|f| ForkRecord {
                run: f.parent_run_id,
                from_seq: f.from_seq,
            }),
        },
        positions,
        journal: journal.into_iter().map(JournalRecord::from).collect(),
        effects: effects.into_iter().map(EffectRecord::from).collect(),
        events: events.into_iter().map(EventRecord::from).collect(),
        children: children.into_iter().map(ChildRecord::from).collect(),
    }))
}

/// Each step row as a position record, with where the run went on after it.
fn positions(
    run: &runs::RunRow,
    rows: &[steps::StepRow],
    waits: &[sql::WaitRow],
    children: &[sql::ChildRow],
) -> Vec<PositionRecord> {
    let waits: HashMap<i32, &sql::WaitRow> = waits.iter().map(|w| (w.seq, w)).collect();
    let by_seq: HashMap<i32, &steps::StepRow> = rows.iter().map(|r| (r.seq, r)).collect();
    rows.iter()
        .map(|row| {
            let wait = waits.get(&row.seq).copied();
            let done = row.finished_at.is_some();
            PositionRecord {
                seq: row.seq,
                step: row.step.as_str().to_owned(),
                status: status_of(run, row),
                attempts: row.attempts,
                output: row.output.clone().filter(|_| done),
                then: done
                    .then(|| then_of(run, row.seq, by_seq.get(&(row.seq + 1)).copied(), wait))
                    .flatten(),
                pause: wait.map(|w| pause_of(w, children)),
                error: error_of(run, row),
            }
        })
        .collect()
}

/// The last error of a position: its retried attempt's, or the run's when it stopped there.
fn error_of(run: &runs::RunRow, row: &steps::StepRow) -> Option<String> {
    let stopped_here = row.finished_at.is_none() && run.step_seq == row.seq;
    (row.last_error.clone()).or_else(|| run.error.clone().filter(|_| stopped_here))
}

fn status_of(run: &runs::RunRow, row: &steps::StepRow) -> PositionStatus {
    let executing = matches!(run.status, RunStatus::Running | RunStatus::Compensating);
    match (
        row.finished_at.is_some(),
        executing && run.step_seq == row.seq,
    ) {
        (true, _) => PositionStatus::Done,
        (false, true) => PositionStatus::Running,
        (false, false) => PositionStatus::Stopped,
    }
}

/// Where the run went on after the done position `seq`: the step its wait leads to, else the
/// step at the next position, else the end when the run succeeded there, else the step the run
/// stands at next. `None` when an undo or a cancel followed, which says nothing of the path.
fn then_of(
    run: &runs::RunRow,
    seq: i32,
    next: Option<&steps::StepRow>,
    wait: Option<&sql::WaitRow>,
) -> Option<Then> {
    if let Some(w) = wait {
        return Some(Then::Step(w.next_step.clone()));
    }
    if let Some(next) = next {
        return (!next.step.is_undo()).then(|| Then::Step(next.step.as_str().to_owned()));
    }
    if matches!(run.status, RunStatus::Succeeded | RunStatus::Shadowed) {
        return Some(Then::Finish);
    }
    let standing = run.step.as_ref().filter(|s| !s.is_undo());
    match standing {
        Some(step) if run.step_seq == seq + 1 => Some(Then::Step(step.as_str().to_owned())),
        _ => None,
    }
}

fn pause_of(wait: &sql::WaitRow, children: &[sql::ChildRow]) -> PauseRecord {
    match wait.kind.as_str() {
        "event" => PauseRecord::Event {
            name: wait.event_name.clone().unwrap_or_default(),
            key: wait.match_key.clone().unwrap_or_default(),
        },
        "children" => PauseRecord::Children {
            count: children.iter().filter(|c| c.seq == wait.seq).count(),
        },
        _ => PauseRecord::Sleep,
    }
}

impl From<sql::JournalRow> for JournalRecord {
    fn from(r: sql::JournalRow) -> Self {
        Self {
            seq: r.seq,
            call_no: r.call_no,
            kind: r.kind,
            request_hash: r.request_hash,
            response: r.response,
        }
    }
}

impl From<sql::EffectRow> for EffectRecord {
    fn from(r: sql::EffectRow) -> Self {
        Self {
            key: r.key,
            seq: r.seq,
            tool: r.tool,
            request_hash: r.request_hash,
            result: r.result,
        }
    }
}

impl From<sql::EventRow> for EventRecord {
    fn from(r: sql::EventRow) -> Self {
        Self {
            seq: r.seq,
            id: r.id,
            name: r.name,
            key: r.key,
            payload: r.payload,
            received_at: r.received_at,
        }
    }
}

impl From<sql::ChildRow> for ChildRecord {
    fn from(r: sql::ChildRow) -> Self {
        Self {
            seq: r.seq,
            index: r.idx,
            run_id: r.run_id,
            workflow: r.workflow,
            input: r.input,
            state: r.state,
            output: r.output,
            reason: r.reason,
        }
    }
}

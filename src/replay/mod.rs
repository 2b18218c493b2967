//! The replay check (`trailmark replay-check`): recorded run histories replayed against the
//! workflows of the binary at hand, to learn before a deploy whether a change would take a run
//! in flight down another path or make its outside calls in another order.
//!
//! A history ([`History`], format `trailmark.history/1`) is read from the database with
//! [`export`] (`trailmark run export ID --history`). [`check`] runs, for each position the run
//! reached, the handler of the workflow version the run is pinned to, with a step context whose
//! records serve everything from the history and record nothing: model answers and patch
//! choices from the journal, outside writes from their records (compared in order: key and
//! request), events and children as the run received them, earlier outputs as checkpointed.
//! Nothing is ever called: a call the recorded run did not make is refused after it is noted,
//! and trailmark's database handed to the steps points nowhere. The handler's ending is then
//! compared with where the run went on.
//!
//! What a position that was not finished (its run stopped for review there, failed, or was
//! killed mid-step) is checked against: the calls its attempts recorded, in order, as far as
//! they go; past them the history ends, and the handler's ending is not compared (the recorded
//! run has none). Compensations and a fork's taken-over positions are not replayed, and a step
//! that reads a live system by its own means (not through `ctx.effect`) cannot be checked past
//! that read: each is listed as a note, not a difference.

mod history;
mod position;
mod records;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use history::{
    ChildRecord, EffectRecord, EventRecord, FORMAT, ForkRecord, History, JournalRecord,
    PauseRecord, PositionRecord, PositionStatus, RunRecord, Then,
};

use crate::domain::RunId;
use crate::failpoint::Failpoints;
use crate::workflow::{Registry, versions_text};

/// Why a history could not be replayed at all (a history that replays with differences is a
/// [`Report`], not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The text is not JSON of the history's shape.
    #[error("not a readable history: {0}; export one with `trailmark run export ID --history`")]
    Unreadable(#[source] serde_json::Error),
    /// The document is of another format.
    #[error(
        "{}{hint}, not a history ({FORMAT}); export one with `trailmark run export ID --history`",
        shown(.found)
    )]
    Format {
        /// The format it names (`None`: it names none).
        found: Option<String>,
        /// What that format is, when known.
        hint: &'static str,
    },
    /// The stand-in for trailmark's database (a socket of the replay's own) could not be made.
    #[error(
        "the replay check could not make its stand-in database socket under {dir}: {0}; set TMPDIR to a writable directory",
        dir = std::env::temp_dir().display()
    )]
    Socket(#[source] std::io::Error),
    /// The history does not hold together (edited by hand, or two files joined).
    #[error("the history of run {run_id} is inconsistent: {what}; export it again")]
    Inconsistent {
        /// The run it names.
        run_id: String,
        /// What is wrong.
        what: String,
    },
}

/// A document's format, as an error names it.
fn shown(format: &Option<String>) -> String {
    match format {
        Some(f) => format!("a {f:?} document"),
        None => "a document without a \"format\"".into(),
    }
}

/// Why a run's history could not be exported.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// No run has that id here.
    #[error("run {run_id} does not exist in this database; check the id with `trailmark run list`")]
    NotFound {
        /// The id asked for.
        run_id: String,
    },
    /// Reading it failed.
    #[error("the history of run {run_id} could not be read")]
    Store {
        /// The run.
        run_id: String,
        /// Why.
        #[source]
        source: crate::store::Error,
    },
}

/// What differs, in the words a report uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DifferenceKind {
    /// The binary does not carry the workflow version the run is pinned to.
    Version,
    /// The workflow version does not declare the step the run ran.
    Step,
    /// A model call (or patch choice): another request, one more, or one fewer.
    ModelCall,
    /// An outside write: another key or request, one more, or one fewer.
    Effect,
    /// Another next step, or the end instead of a next step (or the reverse).
    Next,
    /// A wait for an event, a sleep or child runs where the run had none, or another one.
    Pause,
    /// Other child runs.
    Children,
    /// The handler failed where the recorded run went on.
    Failed,
    /// The handler did not end.
    TimedOut,
}

impl std::fmt::Display for DifferenceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Version => "workflow version",
            Self::Step => "step",
            Self::ModelCall => "model call",
            Self::Effect => "outside call",
            Self::Next => "next step",
            Self::Pause => "wait",
            Self::Children => "child runs",
            Self::Failed => "handler",
            Self::TimedOut => "handler",
        })
    }
}

/// One way the replay left the recorded run's path: which run, which step at which position,
/// what the run did and what the code here does instead.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Difference {
    /// The run.
    pub run_id: String,
    /// The position (`None`: the run as a whole).
    pub seq: Option<i32>,
    /// The step at that position.
    pub step: Option<String>,
    /// What differs.
    pub kind: DifferenceKind,
    /// What the recorded run did.
    pub expected: String,
    /// What the code here does.
    pub found: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.step, self.seq) {
            (Some(step), Some(seq)) => {
                write!(f, "run {} step {step} (position {seq})", self.run_id)?
            }
            _ => write!(f, "run {}", self.run_id)?,
        }
        write!(
            f,
            ": {}: recorded {}; replayed {}",
            self.kind, self.expected, self.found
        )
    }
}

/// Why a position was not checked, or not all the way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum NoteKind {
    /// A compensation: the check follows the run's forward path.
    Compensation,
    /// A fork's position taken over from its parent: never run by the fork.
    TakenOver,
    /// The handler reached a live system by its own means; nothing after that was checked.
    LiveSystem,
    /// The run did not finish the position: checked as far as its record goes.
    Unfinished,
    /// Where the run went on is not recorded (an undo or a cancel followed).
    NextUnknown,
    /// The step asked a person, who chose the next step.
    PersonDecides,
}

/// A position the check could not see all of, with why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Note {
    /// The position.
    pub seq: i32,
    /// Its step.
    pub step: String,
    /// Why.
    pub kind: NoteKind,
    /// In words.
    pub what: String,
}

/// What the replay of one history found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// The version it is pinned to.
    pub version: i32,
    /// Positions in the history.
    pub positions: usize,
    /// Positions whose handler ran.
    pub replayed: usize,
    /// What was not checked, or not all the way.
    pub notes: Vec<Note>,
    /// Where the code here leaves the recorded path; empty: the history replays.
    pub differences: Vec<Difference>,
}

impl Report {
    /// Whether the history replays on the code here without a difference.
    pub fn is_ok(&self) -> bool {
        self.differences.is_empty()
    }
}

/// How long one handler may run in a replay: nothing in it waits on the outside, so a handler
/// still running after this waits for something the replay will never give.
const HANDLER_LIMIT: Duration = Duration::from_secs(60);

/// Replays `history` on the workflows of `registry` (see the module docs).
pub async fn check(registry: &Registry, history: &History) -> Result<Report, ReplayError> {
    check_with(registry, history, Failpoints::default()).await
}

/// [`check`] with failpoints armed in the replayed steps' context, as a process started with
/// `TRAILMARK_FAILPOINTS` arms them (the project's tests stand for a changed build so).
pub async fn check_with(
    registry: &Registry,
    history: &History,
    failpoints: Failpoints,
) -> Result<Report, ReplayError> {
    let run_id = consistent(history)?;
    let mut report = Report {
        run_id: history.run.id.clone(),
        workflow: history.run.workflow.clone(),
        version: history.run.version,
        positions: history.positions.len(),
        replayed: 0,
        notes: Vec::new(),
        differences: Vec::new(),
    };
    let run = &history.run;
    let Some(workflow) = registry.version(&run.workflow, run.version) else {
        report.differences.push(not_carried(registry, history));
        return Ok(report);
    };
    let nowhere = Nowhere::open().map_err(ReplayError::Socket)?;
    let replay = position::Replay {
        run_id,
        history,
        workflow,
        recorded: Arc::new(records::Recorded::index(history)),
        pool: nowhere.pool.clone(),
        reached: nowhere.reached.clone(),
        failpoints,
    };
    for p in &history.positions {
        let found = replay.position(p).await;
        report.replayed += usize::from(found.replayed);
        report.notes.extend(found.notes);
        report.differences.extend(found.differences);
    }
    Ok(report)
}

/// The run `run_id`'s history, read from trailmark's database in one snapshot.
pub async fn export(pool: &PgPool, run_id: &str) -> Result<History, ExportError> {
    history::export(pool, run_id).await
}

/// The run id, once the history holds together: one record per position, in order.
fn consistent(history: &History) -> Result<RunId, ReplayError> {
    let inconsistent = |what: String| ReplayError::Inconsistent {
        run_id: history.run.id.clone(),
        what,
    };
    let run_id = RunId::parse(&history.run.id)
        .map_err(|e| inconsistent(format!("its run id is not one trailmark makes: {e}")))?;
    let seqs: Vec<i32> = history.positions.iter().map(|p| p.seq).collect();
    if let Some(pair) = seqs.windows(2).find(|w| w[0] >= w[1]) {
        return Err(inconsistent(format!(
            "position {} follows position {}: positions must be listed once each, in order",
            pair[1], pair[0]
        )));
    }
    Ok(run_id)
}

/// The difference of a run pinned to a version this binary does not carry.
fn not_carried(registry: &Registry, history: &History) -> Difference {
    let run = &history.run;
    let carried = registry.versions(&run.workflow);
    let found = if carried.is_empty() {
        format!(
            "this binary carries no workflow {} (it carries {})",
            run.workflow,
            registry.names().join(", ")
        )
    } else {
        format!(
            "this binary carries {} {} only: keep v{} in it while runs of v{} are in flight",
            run.workflow,
            versions_text(&carried),
            run.version,
            run.version
        )
    };
    Difference {
        run_id: run.id.clone(),
        seq: None,
        step: None,
        kind: DifferenceKind::Version,
        expected: format!("a run of {} v{}", run.workflow, run.version),
        found,
    }
}

/// Trailmark's database as the replayed steps get it: a pool on a Unix socket of the replay's
/// own, which counts every connection and drops it. A step that reads or writes the database by
/// its own means so fails at once instead of touching a real one, and the count tells such a
/// failure (a live read the replay cannot check past) from an error the step's code made up,
/// which is a difference. Built-in workflows use the pool only inside effect calls, which a
/// replay never makes.
pub(crate) struct Nowhere {
    /// The pool handed to the steps.
    pub pool: PgPool,
    /// Connections the steps tried so far.
    pub reached: Arc<AtomicUsize>,
    dir: PathBuf,
    accept: tokio::task::JoinHandle<()>,
}

impl Nowhere {
    /// A socket in a fresh directory under the system's temporary one, and the pool on it.
    fn open() -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "trailmark-replay-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir(&dir)?;
        let listener = tokio::net::UnixListener::bind(dir.join(".s.PGSQL.5432"))?;
        let reached = Arc::new(AtomicUsize::new(0));
        let counter = reached.clone();
        let accept = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        let options = PgConnectOptions::new_without_pgpass()
            .socket(&dir)
            .port(5432)
            .database("trailmark_replay_check");
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(options);
        Ok(Self {
            pool,
            reached,
            dir,
            accept,
        })
    }
}

impl Drop for Nowhere {
    fn drop(&mut self) {
        self.accept.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

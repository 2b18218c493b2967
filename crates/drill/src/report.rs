//! What a drill found, in the spirit of Jepsen's reports: counts first, then each invariant
//! with its verdict, then the seed that replays it. Printed as text or as JSON (`--json`).

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// The whole report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The workflow drilled.
    pub workflow: String,
    /// The seed; the same seed replays the same plan.
    pub seed: u64,
    /// The workers' lease (s): what a stopped worker may hold a run back for.
    pub lease_secs: u64,
    /// How to run this drill again.
    pub replay: String,
    /// Wall time of the drill, setup included (s).
    pub wall_secs: f64,
    /// Runs and where they ended.
    pub runs: Runs,
    /// Outside writes.
    pub effects: Effects,
    /// Model calls paid for.
    pub model_calls: ModelCalls,
    /// The dead-letter queue at the end.
    pub dead_letters: DeadLetters,
    /// Each fault: how often, and how long until the next step committed.
    pub faults: Vec<FaultFigures>,
    /// Self-kills at named seams, by seam.
    pub seam_kills: BTreeMap<String, u32>,
    /// The engine seams switched on around `ctx.model` and `ctx.effect`.
    pub engine_seams: EngineSeams,
    /// Writes checked against the fences.
    pub fencing: Fencing,
    /// Every invariant with its verdict.
    pub invariants: Vec<Invariant>,
    /// Processes that exited without the drill's doing (restarted at once), with their status.
    pub exits: Vec<String>,
    /// Steps committed by each process (`worker-<slot>.<restart>`): how the work was spread.
    pub commits_by_process: BTreeMap<String, i64>,
    /// Events sent to waiting runs, when the runs wait for one.
    pub events: Option<super::events::EventFigures>,
    /// The fan-outs the runs' steps made (child runs), when they make any.
    pub fan_outs: Option<trailmark::inspect::FanOuts>,
    /// The concurrency keys, when the runs were spread over them (`--tenants`).
    pub keys: Option<super::keys::KeyFigures>,
    /// The runs per workflow version, when the workers carried two builds
    /// (`--mixed-versions`).
    pub versions: Option<super::check::Versions>,
    /// The Python step endpoint's kills and restarts, in a drill of `pychain`.
    pub python: Option<super::python::PythonFigures>,
}

/// Where the drill's runs ended.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Runs {
    /// Runs the drill started (a run started twice counts once).
    pub started: i64,
    /// Finished every step.
    pub succeeded: i64,
    /// Stopped for a person, each with a handover note.
    pub in_review: i64,
    /// Why some of them stopped (the runs' error lines).
    pub review_examples: Vec<String>,
    /// In review without a handover note.
    pub in_review_without_note: i64,
    /// Failed, cancelled or compensated.
    pub other_terminal: i64,
    /// Neither terminal nor in review when the drill gave up waiting, or never created.
    pub lost: i64,
    /// Some of the lost ones, with where they stood.
    pub lost_examples: Vec<String>,
    /// Steps a run took in the fault-free control run.
    pub steps_per_run: i64,
}

/// Outside writes, counted through the workflow's idempotency keys.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Effects {
    /// The control run's keys times the runs that succeeded.
    pub expected: i64,
    /// Distinct keys recorded done for the runs that succeeded.
    pub keys: i64,
    /// Rows the receiving system holds for those runs, when the drill knows how to count them.
    pub applied: Option<i64>,
    /// Rows beyond one per key at the receiver (a write done twice).
    pub duplicated: Option<i64>,
    /// Calls made again under a key already called (absorbed by a receiver that enforces keys).
    pub calls_repeated: i64,
}

/// Model calls.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelCalls {
    /// Answers paid for.
    pub paid: i64,
    /// Distinct calls (run, position, call number).
    pub distinct: i64,
    /// Answers paid for twice (a crash between the answer and its journal entry).
    pub repeated: i64,
}

/// The DLQ at the end.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DeadLetters {
    /// Poison messages published.
    pub poison_sent: u32,
    /// Of those, found in the DLQ with a reason.
    pub poison_found: u32,
    /// Poison messages not in the DLQ (or there without a reason).
    pub poison_missing: Vec<String>,
    /// Letters that were not poison: healthy messages that should never be there.
    pub unexpected: Vec<String>,
    /// Letters by reason code.
    pub by_reason: BTreeMap<String, u32>,
    /// Conflicting events found as `event_conflict` (expected), each id once.
    pub event_conflicts: u32,
}

/// One kind of fault.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultFigures {
    /// Its name.
    pub fault: String,
    /// How often it was injected.
    pub injected: u32,
    /// From the fault to the next committed step: p50 (ms).
    pub recovery_p50_ms: Option<f64>,
    /// The same, worst case (ms).
    pub recovery_max_ms: Option<f64>,
    /// Faults after which no step committed at all (the runs had all settled, or stalled).
    pub without_progress: u32,
    /// The longest time without a committed step in the window after any of them (from the
    /// fault, gaps between commits, up to the window's end or the last commit): steps already
    /// in hand commit within milliseconds whatever broke, so this is what shows a stall.
    pub stall_max_ms: Option<f64>,
    /// The longest one run waited for its next commit within the window of any of them (for
    /// a pause, while the worker was stopped; else the stall window after the fault): what a
    /// fault held back while other runs moved.
    pub run_wait_max_ms: Option<f64>,
    /// The run that waited that long.
    pub run_waited_longest: Option<String>,
}

/// The engine seams.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineSeams {
    /// Positions where the model answered 500 on attempt 1.
    pub model_500: i64,
    /// Positions where the tool answered after the client timeout on attempt 1.
    pub late_tool: i64,
    /// Runs forced into review and resumed by the drill after an approve.
    pub reviews_resumed: i64,
    /// Run ids started twice.
    pub started_twice: i64,
    /// Step messages republished with the same id.
    pub duplicated_deliveries: u64,
}

/// Writes checked against the fences, from the processes' call logs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Fencing {
    /// Step commits logged.
    pub commits: i64,
    /// Positions committed twice.
    pub double_commits: Vec<String>,
    /// Positions committed under a fence older than an earlier position's commit: a stale
    /// holder's commit accepted.
    pub stale_commits: Vec<String>,
    /// Outside calls logged after a call of the same run under a newer fence. Informational:
    /// the line is written after the intent is accepted, so a worker frozen between the two (a
    /// pause) logs late a call it made in time.
    pub stale_calls: Vec<String>,
}

/// One promise and whether the drill saw it kept.
#[derive(Debug, Clone, Serialize)]
pub struct Invariant {
    /// What is promised.
    pub name: String,
    /// Kept?
    pub ok: bool,
    /// The numbers behind the verdict.
    pub detail: String,
}

impl Report {
    /// Whether every invariant held.
    pub fn ok(&self) -> bool {
        self.invariants.iter().all(|i| i.ok)
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}"))
}

fn opt(v: Option<i64>) -> String {
    v.map_or("not counted".into(), |v| v.to_string())
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.runs;
        writeln!(
            f,
            "drill of `{}`, seed {}, {:.0} s",
            self.workflow, self.seed, self.wall_secs
        )?;
        writeln!(
            f,
            "runs       started {}  succeeded {}  in review {} ({} without a note)  failed/cancelled {}  lost {}",
            r.started, r.succeeded, r.in_review, r.in_review_without_note, r.other_terminal, r.lost
        )?;
        for why in &r.review_examples {
            writeln!(f, "  review   {why}")?;
        }
        let e = &self.effects;
        writeln!(
            f,
            "effects    expected {}  keys {}  applied {}  duplicated {}  calls repeated under a key {}",
            e.expected,
            e.keys,
            opt(e.applied),
            opt(e.duplicated),
            e.calls_repeated
        )?;
        let m = &self.model_calls;
        writeln!(
            f,
            "model      paid {}  distinct {}  repeated {}",
            m.paid, m.distinct, m.repeated
        )?;
        let d = &self.dead_letters;
        let reasons: Vec<String> = d
            .by_reason
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(
            f,
            "dlq        poison sent {}  found {}  missing {}  unexpected {}  ({})",
            d.poison_sent,
            d.poison_found,
            d.poison_missing.len(),
            d.unexpected.len(),
            reasons.join(", ")
        )?;
        if let Some(ev) = &self.events {
            writeln!(
                f,
                "events     {} runs sent {}  early {}  twice {}  conflicting {}  consumed once {}  conflicts refused {}  publishes retried {}",
                ev.runs,
                ev.name,
                ev.early,
                ev.twice,
                ev.conflicting,
                ev.consumed_once,
                ev.conflicts_refused,
                ev.publish_retries
            )?;
        }
        if let Some(k) = &self.keys {
            writeln!(
                f,
                "keys       {} tenants of {}, limit {}  most running in one key {}  waits seen {} (up to {} at once)  samples {} ({} unread)",
                k.tenants,
                k.field,
                k.limit,
                k.running_max,
                k.waits_seen,
                k.waiting_max,
                k.samples,
                k.samples_unread
            )?;
        }
        if let Some(py) = &self.python {
            writeln!(
                f,
                "python     killed from outside {}  killed at its spot {} {}  restarted {} (listening again within {:.0} ms at most)  exits on its own {}",
                py.killed,
                py.spot,
                py.spot_kills,
                py.restarts,
                py.restart_max_ms,
                py.unexpected_exits.len()
            )?;
        }
        let s = &self.engine_seams;
        writeln!(
            f,
            "seams      model 500 {}  late tool {}  reviews resumed {}  started twice {}  deliveries duplicated {}",
            s.model_500, s.late_tool, s.reviews_resumed, s.started_twice, s.duplicated_deliveries
        )?;
        let kills: Vec<String> = self
            .seam_kills
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(
            f,
            "seam kills {}",
            if kills.is_empty() {
                "none".into()
            } else {
                kills.join(", ")
            }
        )?;
        let w = self
            .faults
            .iter()
            .map(|x| x.fault.len())
            .max()
            .unwrap_or(0)
            .max(10);
        writeln!(
            f,
            "{:<w$} injected  recovery p50 ms  max ms  no progress  longest stall ms  longest run wait ms",
            "fault"
        )?;
        for x in &self.faults {
            writeln!(
                f,
                "{:<w$} {:>8}  {:>15}  {:>6}  {:>11}  {:>16}  {:>19}",
                x.fault,
                x.injected,
                ms(x.recovery_p50_ms),
                ms(x.recovery_max_ms),
                x.without_progress,
                ms(x.stall_max_ms),
                ms(x.run_wait_max_ms)
            )?;
        }
        writeln!(
            f,
            "fencing    commits logged {}  positions committed twice {}  stale commits {}  calls logged after a newer fence's {}",
            self.fencing.commits,
            self.fencing.double_commits.len(),
            self.fencing.stale_commits.len(),
            self.fencing.stale_calls.len()
        )?;
        let spread: Vec<String> = self
            .commits_by_process
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(f, "commits    {}", spread.join(", "))?;
        for e in &self.exits {
            writeln!(f, "exit       {e}")?;
        }
        for i in &self.invariants {
            writeln!(
                f,
                "{} {}: {}",
                if i.ok { "ok  " } else { "FAIL" },
                i.name,
                i.detail
            )?;
        }
        write!(f, "replay: {}", self.replay)
    }
}

//! One recorded position replayed: its handler run on the history's records, then what it did
//! compared with what the recorded run did there.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::history::{History, PauseRecord, PositionRecord, PositionStatus, Then};
use super::records::{Log, Recorded, ReplayRecords, Stop, calls, short};
use super::{Difference, DifferenceKind, HANDLER_LIMIT, Note, NoteKind};
use crate::domain::{Fence, RunId, StepAddress};
use crate::failpoint::Failpoints;
use crate::guard::{Breakers, Budget};
use crate::trace::StepSpan;
use crate::workflow::{
    Models, Next, Pause, Position, REQUEST_DIFFERS, StepContext, StepError, StepOutcome, Tools,
    Workflow,
};

/// A history's replay: what every position shares.
pub(super) struct Replay<'a> {
    pub run_id: RunId,
    pub history: &'a History,
    pub workflow: Arc<Workflow>,
    pub recorded: Arc<Recorded>,
    pub pool: PgPool,
    /// Connections the steps tried to trailmark's database so far (see `Nowhere`).
    pub reached: Arc<std::sync::atomic::AtomicUsize>,
    pub failpoints: Failpoints,
}

/// What one position's replay found.
#[derive(Default)]
pub(super) struct Found {
    pub replayed: bool,
    pub notes: Vec<Note>,
    pub differences: Vec<Difference>,
}

/// How a replayed handler ended.
enum Ended {
    Outcome(StepOutcome),
    Failed(StepError),
    Panicked(String),
    TimedOut,
}

impl Replay<'_> {
    /// Replays position `p`, or says why it is not replayed.
    pub async fn position(&self, p: &PositionRecord) -> Found {
        let address = StepAddress::from(p.step.as_str());
        let mut found = Found::default();
        if let Some((kind, what)) = self.not_replayed(p, &address) {
            found.notes.push(note(p, kind, what));
            return found;
        }
        let Some(def) = self.workflow.find(address.as_str()) else {
            found.differences.push(self.undeclared(p));
            return found;
        };
        let done = p.status == PositionStatus::Done;
        let records = Arc::new(ReplayRecords::new(
            self.recorded.clone(),
            p.seq,
            &p.step,
            done,
        ));
        let ctx = self.context(p, address.clone(), records.clone());
        let before = self.reached.load(std::sync::atomic::Ordering::SeqCst);
        let ended = run(def.handler.clone(), ctx).await;
        let went_live = self.reached.load(std::sync::atomic::Ordering::SeqCst) > before;
        found.replayed = true;
        Judge {
            replay: self,
            p,
            address: &address,
            records: &records,
            log: records.take_log(),
            found,
            went_live,
        }
        .ended(ended)
    }

    /// Why `p` is not replayed, if it is not: a compensation, or a fork's taken-over position.
    fn not_replayed(
        &self,
        p: &PositionRecord,
        address: &StepAddress,
    ) -> Option<(NoteKind, String)> {
        if address.is_undo() {
            let what = "a compensation: the check follows the run's forward path".to_owned();
            return Some((NoteKind::Compensation, what));
        }
        let fork = self.history.run.forked_from.as_ref()?;
        (p.seq < fork.from_seq).then(|| {
            let what = format!(
                "taken over from run {} by the fork, never run here",
                fork.run
            );
            (NoteKind::TakenOver, what)
        })
    }

    fn undeclared(&self, p: &PositionRecord) -> Difference {
        let wf = &self.workflow;
        let declared: Vec<&str> = wf.steps.iter().map(|s| s.name.as_str()).collect();
        Difference {
            run_id: self.history.run.id.clone(),
            seq: Some(p.seq),
            step: Some(p.step.clone()),
            kind: DifferenceKind::Step,
            expected: format!("step {} of {} v{}", p.step, wf.name, wf.version),
            found: format!(
                "{} v{} declares no step {} (its steps: {})",
                wf.name,
                wf.version,
                p.step,
                declared.join(", ")
            ),
        }
    }

    /// The context a live worker would hand the step at `p`, its records the history's.
    fn context(
        &self,
        p: &PositionRecord,
        step: StepAddress,
        records: Arc<ReplayRecords>,
    ) -> StepContext {
        let tools = Tools {
            pool: self.pool.clone(),
            records,
            // No model: a call the journal cannot answer is refused before one would be asked.
            models: Models {
                primary: None,
                fallback: None,
                offline_bytes: crate::model::offline::ANSWER_BYTES,
            },
            failpoints: self.failpoints.clone(),
            breakers: Breakers::new(5, Duration::from_secs(1)),
            call_retries: 0,
            repeat_limit: 0,
            full_endpoints: Default::default(),
        };
        let run = &self.history.run;
        let pos = Position {
            run_id: self.run_id.clone(),
            workflow: run.workflow.clone(),
            version: run.version,
            step,
            seq: p.seq,
            // The last recorded attempt's number: the path the replay follows is its.
            attempt: p.attempts.max(1),
            journaled: self.recorded.journaled(p.seq),
            fence: Fence(0),
            input: run.input.clone(),
            // No budget: a replay spends nothing, and the recorded run's guards already held.
            budget: Budget::default(),
            undo: None,
            shadow: run.shadow,
            span: StepSpan::default(),
        };
        StepContext::new(Arc::new(tools), pos)
    }
}

/// Runs `handler` in a task of its own, so that a panic is a finding and not the check's end.
async fn run(handler: crate::workflow::Handler, ctx: StepContext) -> Ended {
    let task = tokio::spawn(async move { handler(ctx).await });
    let abort = task.abort_handle();
    match tokio::time::timeout(HANDLER_LIMIT, task).await {
        Err(_) => {
            abort.abort();
            Ended::TimedOut
        }
        Ok(Err(join)) => Ended::Panicked(join.to_string()),
        Ok(Ok(Ok(outcome))) => match outcome.checked() {
            Ok(outcome) => Ended::Outcome(outcome),
            Err(e) => Ended::Failed(e),
        },
        Ok(Ok(Err(e))) => Ended::Failed(e),
    }
}

fn note(p: &PositionRecord, kind: NoteKind, what: String) -> Note {
    Note {
        seq: p.seq,
        step: p.step.clone(),
        kind,
        what,
    }
}

/// The comparison of one replayed position with its record.
struct Judge<'a> {
    replay: &'a Replay<'a>,
    p: &'a PositionRecord,
    address: &'a StepAddress,
    records: &'a ReplayRecords,
    log: Log,
    found: Found,
    /// Whether the handler tried trailmark's database by its own means.
    went_live: bool,
}

impl Judge<'_> {
    fn ended(mut self, ended: Ended) -> Found {
        self.found.differences.append(&mut self.log.differences);
        match self.log.stop.take() {
            // Noted when the call was refused; what the handler did next says nothing more.
            Some(Stop::Difference) => return self.found,
            Some(Stop::EndOfHistory(beyond)) => {
                let what = format!(
                    "the run did not finish this position; checked as far as its record goes ({beyond})"
                );
                self.note(NoteKind::Unfinished, what);
                return self.found;
            }
            None => {}
        }
        match ended {
            Ended::TimedOut => self.differ(
                DifferenceKind::TimedOut,
                self.recorded_ending(),
                format!("still running after {} s", HANDLER_LIMIT.as_secs()),
            ),
            Ended::Panicked(why) => self.differ(
                DifferenceKind::Failed,
                self.recorded_ending(),
                format!("a panic: {why}"),
            ),
            Ended::Failed(e) => self.failed(e),
            Ended::Outcome(outcome) => self.outcome(outcome),
        }
        self.found
    }

    fn done(&self) -> bool {
        self.p.status == PositionStatus::Done
    }

    fn note(&mut self, kind: NoteKind, what: String) {
        self.found.notes.push(note(self.p, kind, what));
    }

    fn differ(&mut self, kind: DifferenceKind, expected: String, found: String) {
        let d = self.records.difference(kind, expected, found);
        self.found.differences.push(d);
    }

    /// What the recorded run did at the end of this position, in words.
    fn recorded_ending(&self) -> String {
        match (&self.p.status, &self.p.error) {
            (PositionStatus::Done, _) => format!("a commit, then {}", then_words(&self.p.then)),
            (_, Some(error)) => format!("no commit (last error: {error})"),
            _ => "no commit".into(),
        }
    }

    fn failed(&mut self, e: StepError) {
        if self.went_live && live(&e) {
            let what = format!(
                "the handler reached a live system by its own means (not through ctx.effect or ctx.model), so nothing after that was checked: {e}"
            );
            return self.note(NoteKind::LiveSystem, what);
        }
        if let StepError::Unknown(why) = &e
            && why.contains(REQUEST_DIFFERS)
        {
            return self.request_differs();
        }
        self.missing_calls();
        if self.done() {
            return self.differ(
                DifferenceKind::Failed,
                self.recorded_ending(),
                format!("an error: {e}"),
            );
        }
        let what =
            format!("the run did not finish this position; the replay stopped too, with: {e}");
        self.note(NoteKind::Unfinished, what);
    }

    /// A model call whose request is not the journaled one (the call the journal served last).
    fn request_differs(&mut self) {
        let call = self.log.last_served.unwrap_or(0);
        let entry = self.replay.recorded.journal_at(self.p.seq);
        let hash = (entry.iter())
            .find(|e| e.call_no == call)
            .map_or("?", |e| short(&e.request_hash))
            .to_owned();
        self.differ(
            DifferenceKind::ModelCall,
            format!("call {call} with the journaled request ({hash})"),
            format!("call {call} with another request (a changed prompt, model or parameters)"),
        );
    }

    fn outcome(&mut self, outcome: StepOutcome) {
        self.missing_calls();
        if !self.done() {
            let what = "the run did not finish this position; the replay's ending is not compared"
                .to_owned();
            return self.note(NoteKind::Unfinished, what);
        }
        self.compare_next(&outcome);
        self.compare_pause(&outcome);
    }

    /// Calls the recorded run made here that the replay did not.
    fn missing_calls(&mut self) {
        let entries = self.replay.recorded.journal_at(self.p.seq);
        if let Some(first) = entries
            .iter()
            .find(|e| !self.log.served.contains(&e.call_no))
        {
            let served = &self.log.served;
            let asked = entries
                .iter()
                .filter(|e| served.contains(&e.call_no))
                .count();
            self.differ(
                DifferenceKind::ModelCall,
                format!("{} here", calls(entries.len(), "journaled call")),
                format!(
                    "{asked} asked for; the first not asked: {} call {} (request {})",
                    first.kind,
                    first.call_no,
                    short(&first.request_hash)
                ),
            );
        }
        let effects = self.replay.recorded.effects_at(self.p.seq);
        if let Some(first) = effects.get(self.log.effects) {
            self.differ(
                DifferenceKind::Effect,
                format!("{} here", calls(effects.len(), "outside call")),
                format!(
                    "{} made; the first not made: key {} (tool {}, request {})",
                    self.log.effects,
                    first.key,
                    first.tool,
                    short(&first.request_hash)
                ),
            );
        }
    }

    fn compare_next(&mut self, outcome: &StepOutcome) {
        if outcome.next == Next::Wait {
            let what = "the step asks a person, whose decision chose where the run went on".into();
            return self.note(NoteKind::PersonDecides, what);
        }
        let resolved = match self
            .replay
            .workflow
            .resolve_next(self.address, &outcome.next)
        {
            Ok(resolved) => resolved,
            Err(e) => {
                return self.differ(
                    DifferenceKind::Next,
                    then_words(&self.p.then),
                    e.to_string(),
                );
            }
        };
        let Some(then) = &self.p.then else {
            let what = "where the run went on is not recorded (an undo or a cancel followed)";
            return self.note(NoteKind::NextUnknown, what.into());
        };
        let same = match (then, &resolved) {
            (Then::Finish, None) => true,
            (Then::Step(step), Some(next)) => next.as_str() == step,
            _ => false,
        };
        if !same {
            let found = match resolved {
                Some(next) => format!("the step goes on with step {next}"),
                None => "the step ends the run".into(),
            };
            self.differ(DifferenceKind::Next, then_words(&self.p.then), found);
        }
    }

    fn compare_pause(&mut self, outcome: &StepOutcome) {
        let run_id = self.replay.run_id.as_str();
        let replayed = outcome.pause().map(|p| pause_record(p, run_id));
        if replayed != self.p.pause {
            let (expected, found) = (pause_words(&self.p.pause), pause_words(&replayed));
            return self.differ(DifferenceKind::Pause, expected, found);
        }
        if let Some(Pause::Children(children)) = outcome.pause() {
            self.compare_children(&children.children);
        }
    }

    /// The children started, by index, against those the recorded run started.
    fn compare_children(&mut self, started: &[(String, serde_json::Value)]) {
        let recorded = self.replay.recorded.children_at(self.p.seq);
        let differs = recorded
            .iter()
            .zip(started)
            .find(|(r, (workflow, input))| &r.workflow != workflow || &r.input != input);
        if let Some((r, (workflow, input))) = differs {
            self.differ(
                DifferenceKind::Children,
                format!("child {} of {} with input {}", r.index, r.workflow, r.input),
                format!("child {} of {workflow} with input {input}", r.index),
            );
        }
    }
}

/// Whether a handler's error may have come from something live it reached by its own means (it
/// also tried the database: see `Judge::went_live`): in a replay nothing served fails
/// temporarily, so a temporary or infrastructure error, or a wait for a breaker or a rate
/// limit, did not come from the history. Without such a try, the error is the code's own, and
/// a difference.
fn live(e: &StepError) -> bool {
    matches!(
        e,
        StepError::Temporary { .. } | StepError::Infrastructure(_)
    ) || e.uncounted_wait().is_some()
}

/// A replayed pause as a history records one.
fn pause_record(pause: &Pause, run_id: &str) -> PauseRecord {
    match pause {
        Pause::Event(wait) => PauseRecord::Event {
            name: wait.name.clone(),
            key: wait.key.clone().unwrap_or_else(|| run_id.to_owned()),
        },
        Pause::SleepFor(_) | Pause::SleepUntil(_) => PauseRecord::Sleep,
        Pause::Children(c) => PauseRecord::Children {
            count: c.children.len(),
        },
    }
}

fn then_words(then: &Option<Then>) -> String {
    match then {
        Some(Then::Step(step)) => format!("the run went on with step {step}"),
        Some(Then::Finish) => "the run ended there".into(),
        None => "(not recorded)".into(),
    }
}

fn pause_words(pause: &Option<PauseRecord>) -> String {
    match pause {
        None => "no wait".into(),
        Some(PauseRecord::Event { name, key }) => format!("a wait for event {name} (key {key})"),
        Some(PauseRecord::Sleep) => "a sleep".into(),
        Some(PauseRecord::Children { count }) => format!("a wait for {count} child runs"),
    }
}

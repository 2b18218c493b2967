//! The records a replayed step reads and writes through: everything is served from the
//! history, nothing is recorded, and every call is compared with the recorded run's as it is
//! made. A call the recorded run did not make is never made: the handler gets an error instead
//! (after the difference is noted), so no outside system and no model is ever reached.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::history::{ChildRecord, EffectRecord, EventRecord, History, PositionStatus};
use super::{Difference, DifferenceKind};
use crate::domain::{
    Admission, ChildResult, ChildrenSummary, EffectIntent, EffectState, Fence, IdempotencyKey,
    IntentOutcome, JournalEntry, ModelAsk, RunId, ShadowWrite, Spent,
};
use crate::workflow::{BoxFuture, PATCH_KIND, ReceivedEvent, RecordedEffect, Records, StepError};

/// The history indexed for the replay of its positions; shared by all of them.
pub(super) struct Recorded {
    run_id: String,
    journal: HashMap<(i32, i32), JournalEntry>,
    effects: HashMap<i32, Vec<EffectRecord>>,
    events: HashMap<i32, EventRecord>,
    children: HashMap<i32, Vec<ChildRecord>>,
    /// Done positions' outputs, by position: what `output_of` reads.
    outputs: Vec<(i32, String, Option<Value>)>,
}

impl Recorded {
    /// Indexes `history`.
    pub fn index(history: &History) -> Self {
        let journal = (history.journal.iter())
            .map(|j| ((j.seq, j.call_no), entry_of(j)))
            .collect();
        let mut effects: HashMap<i32, Vec<EffectRecord>> = HashMap::new();
        for e in &history.effects {
            effects.entry(e.seq).or_default().push(e.clone());
        }
        let mut children: HashMap<i32, Vec<ChildRecord>> = HashMap::new();
        for c in &history.children {
            children.entry(c.seq).or_default().push(c.clone());
        }
        for list in children.values_mut() {
            list.sort_by_key(|c| c.index);
        }
        let outputs = (history.positions.iter())
            .filter(|p| p.status == PositionStatus::Done)
            .map(|p| (p.seq, p.step.clone(), p.output.clone()))
            .collect();
        Self {
            run_id: history.run.id.clone(),
            journal,
            effects,
            events: history.events.iter().map(|e| (e.seq, e.clone())).collect(),
            children,
            outputs,
        }
    }

    /// How many calls were journaled at `seq` (one past the highest call number): what a live
    /// claim hands a step as the entries recorded before its attempt.
    pub fn journaled(&self, seq: i32) -> i32 {
        (self.journal.keys())
            .filter(|(s, _)| *s == seq)
            .map(|(_, call_no)| call_no + 1)
            .max()
            .unwrap_or(0)
    }

    /// The journal entries at `seq`, by call number.
    pub fn journal_at(&self, seq: i32) -> Vec<&JournalEntry> {
        let mut at: Vec<&JournalEntry> = self.journal.values().filter(|e| e.seq == seq).collect();
        at.sort_by_key(|e| e.call_no);
        at
    }

    /// The outside writes made at `seq`, in order.
    pub fn effects_at(&self, seq: i32) -> &[EffectRecord] {
        self.effects.get(&seq).map_or(&[], Vec::as_slice)
    }

    /// The children started at `seq`, by index.
    pub fn children_at(&self, seq: i32) -> &[ChildRecord] {
        self.children.get(&seq).map_or(&[], Vec::as_slice)
    }
}

fn entry_of(j: &super::history::JournalRecord) -> JournalEntry {
    JournalEntry {
        seq: j.seq,
        call_no: j.call_no,
        kind: j.kind.clone(),
        request_hash: j.request_hash.clone(),
        response: j.response.clone(),
        tokens: 0,
        cost: 0.0,
        latency_ms: 0,
    }
}

/// Why the replay refused a call of the handler.
#[derive(Debug, Clone)]
pub(super) enum Stop {
    /// It differed from the recorded run's (the difference is noted).
    Difference,
    /// The position is not done and the history ends here: the recorded run never got further.
    EndOfHistory(String),
}

/// What a replayed position did through its records.
#[derive(Debug, Default)]
pub(super) struct Log {
    /// Journal entries served, by call number.
    pub served: BTreeSet<i32>,
    /// The entry served last: the call a refused request was compared with.
    pub last_served: Option<i32>,
    /// Call numbers where a patch point met no entry at a done position (the old path).
    pub old_paths: BTreeSet<i32>,
    /// Outside calls asked for (recorded or not).
    pub effects: usize,
    /// Differences seen while the handler ran.
    pub differences: Vec<Difference>,
    /// The first call refused, if any.
    pub stop: Option<Stop>,
}

/// The [`Records`] of one replayed position.
pub(super) struct ReplayRecords {
    recorded: Arc<Recorded>,
    seq: i32,
    step: String,
    done: bool,
    log: Mutex<Log>,
}

/// The kind of a journal entry served where a patch point met no entry at a done position: not
/// a patch, so `ctx.patched` answers the old path, as the recorded run took it.
const NO_PATCH: &str = "replay:no-patch";

impl ReplayRecords {
    /// The records of position `seq` (running `step`); `done`: a step commit finished it.
    pub fn new(recorded: Arc<Recorded>, seq: i32, step: &str, done: bool) -> Self {
        Self {
            recorded,
            seq,
            step: step.to_owned(),
            done,
            log: Mutex::new(Log::default()),
        }
    }

    /// What the handler did through these records.
    pub fn take_log(&self) -> Log {
        std::mem::take(&mut *self.log.lock().expect("replay log lock"))
    }

    /// A difference at this position.
    pub fn difference(&self, kind: DifferenceKind, expected: String, found: String) -> Difference {
        Difference {
            run_id: self.recorded.run_id.clone(),
            seq: Some(self.seq),
            step: Some(self.step.clone()),
            kind,
            expected,
            found,
        }
    }

    /// Refuses the call: notes `difference` (when the position is done, so the recorded run
    /// shows what it did instead), or the end of the history (`beyond` says what lay past it).
    fn refuse(&self, difference: Difference, beyond: String) -> StepError {
        let mut log = self.log.lock().expect("replay log lock");
        let why = if self.done {
            let why = difference.to_string();
            log.differences.push(difference);
            log.stop.get_or_insert(Stop::Difference);
            why
        } else {
            log.stop.get_or_insert(Stop::EndOfHistory(beyond.clone()));
            beyond
        };
        StepError::Unknown(format!("replay check: {why}"))
    }

    /// The recorded call `index` at this position compared with `intent`: its result to hand
    /// back, or the error that stops the handler.
    fn compare_effect(&self, index: usize, intent: &EffectIntent) -> Result<Value, StepError> {
        let made = format!(
            "a call under key {} (tool {}, request {})",
            intent.key,
            intent.tool,
            short(&intent.request_hash)
        );
        let recorded = self.recorded.effects_at(self.seq);
        let Some(r) = recorded.get(index) else {
            let expected = format!("{} here", calls(recorded.len(), "outside call"));
            let d = self.difference(
                DifferenceKind::Effect,
                expected,
                format!("one more: {made}"),
            );
            return Err(self.refuse(d, format!("outside call {index} ({made}) lies past it")));
        };
        let wanted = format!(
            "a call under key {} (tool {}, request {})",
            r.key,
            r.tool,
            short(&r.request_hash)
        );
        if r.key != intent.key.as_str() || r.request_hash != intent.request_hash {
            // The recorded run made this call otherwise: a difference whether or not it finished
            // the position. Its result is handed back so the handler goes on and its later calls
            // are compared too.
            let d = self.difference(DifferenceKind::Effect, wanted, made);
            let mut log = self.log.lock().expect("replay log lock");
            log.differences.push(d.clone());
            return r.result.clone().ok_or_else(|| {
                log.stop.get_or_insert(Stop::Difference);
                StepError::Unknown(format!("replay check: {d}"))
            });
        }
        r.result.clone().ok_or_else(|| {
            let d = self.difference(
                DifferenceKind::Effect,
                format!("{wanted} with its result recorded"),
                "a recorded intent whose outcome is unknown".into(),
            );
            self.refuse(d, format!("the outcome of {wanted} is unknown"))
        })
    }
}

/// `n` calls of a kind, in words: `1 outside call`, `3 outside calls`.
pub(super) fn calls(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// The first 12 characters of a hash: enough to tell two apart in a message.
pub(super) fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

impl Records for ReplayRecords {
    fn journaled<'a>(
        &'a self,
        _run: &'a RunId,
        seq: i32,
        call_no: i32,
    ) -> BoxFuture<'a, Result<Option<JournalEntry>, StepError>> {
        Box::pin(async move {
            let mut log = self.log.lock().expect("replay log lock");
            if let Some(entry) = self.recorded.journal.get(&(seq, call_no)) {
                log.served.insert(call_no);
                log.last_served = Some(call_no);
                return Ok(Some(entry.clone()));
            }
            Ok(log.old_paths.contains(&call_no).then(|| JournalEntry {
                seq,
                call_no,
                kind: NO_PATCH.into(),
                request_hash: String::new(),
                response: Value::Bool(false),
                tokens: 0,
                cost: 0.0,
                latency_ms: 0,
            }))
        })
    }

    fn journal<'a>(
        &'a self,
        _run: &'a RunId,
        entry: JournalEntry,
        _reserved: Option<i64>,
    ) -> BoxFuture<'a, Result<bool, StepError>> {
        Box::pin(async move {
            let n = entry.call_no;
            if entry.kind == PATCH_KIND && self.done {
                // The recorded run finished this position without choosing here: it ran the
                // code from before the patch. Answered as if another attempt chose first, with
                // an entry that is no patch (see `journaled`), so the handler takes the old path.
                let mut log = self.log.lock().expect("replay log lock");
                log.old_paths.insert(n);
                return Ok(false);
            }
            let recorded = self.recorded.journaled(self.seq);
            let d = self.difference(
                DifferenceKind::ModelCall,
                format!("{} here", calls(recorded as usize, "journaled call")),
                format!(
                    "one more: {} call {n} (request {})",
                    entry.kind,
                    short(&entry.request_hash)
                ),
            );
            Err(self.refuse(d, format!("{} call {n} lies past it", entry.kind)))
        })
    }

    fn reserve_model<'a>(
        &'a self,
        _ask: ModelAsk<'a>,
    ) -> BoxFuture<'a, Result<Admission, StepError>> {
        // No model is configured in a replay, so no call reserves room.
        Box::pin(async {
            Err(StepError::Unknown(
                "replay check: no model is asked in a replay".into(),
            ))
        })
    }

    fn model_call_failed(&self, _reserved: i64) -> BoxFuture<'_, Result<(), StepError>> {
        Box::pin(async { Ok(()) })
    }

    fn spent<'a>(&'a self, _run: &'a RunId) -> BoxFuture<'a, Result<Spent, StepError>> {
        Box::pin(async { Ok(Spent::default()) })
    }

    fn begin_effect(
        &self,
        intent: EffectIntent,
    ) -> BoxFuture<'_, Result<IntentOutcome, StepError>> {
        Box::pin(async move {
            let index = {
                let mut log = self.log.lock().expect("replay log lock");
                log.effects += 1;
                log.effects - 1
            };
            let result = self.compare_effect(index, &intent)?;
            // Done: the handler reads the result and makes no call.
            Ok(IntentOutcome::Recorded(EffectState::Done(result)))
        })
    }

    fn recorded_effect<'a>(
        &'a self,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<RecordedEffect>, StepError>> {
        Box::pin(async move {
            let found = (self.recorded.effects.values().flatten())
                .find(|e| e.key == key.as_str())
                .map(|e| (e.request_hash.clone(), e.result.clone()));
            Ok(found)
        })
    }

    fn withdraw_effect<'a>(
        &'a self,
        _key: &'a IdempotencyKey,
        _run: &'a RunId,
        _fence: Fence,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async { Ok(()) })
    }

    fn finish_effect(
        &self,
        _key: IdempotencyKey,
        _result: Value,
    ) -> BoxFuture<'_, Result<(), StepError>> {
        // Never reached: no call is made in a replay, so there is no result to record.
        Box::pin(async { Ok(()) })
    }

    fn progress(&self, _run: &RunId, _seq: i32, _line: String) {}

    fn breaker_changed<'a>(
        &'a self,
        _tool: &'a str,
        _opened: bool,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async { Ok(()) })
    }

    fn shadow_write<'a>(
        &'a self,
        _run: &'a RunId,
        _write: ShadowWrite,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        // A shadow run's would-be writes are not part of a history (docs: what it cannot see).
        Box::pin(async { Ok(()) })
    }

    fn received_event<'a>(
        &'a self,
        _run: &'a RunId,
        seq: i32,
    ) -> BoxFuture<'a, Result<Option<ReceivedEvent>, StepError>> {
        Box::pin(async move {
            Ok(self.recorded.events.get(&seq).map(|e| {
                ReceivedEvent::new(
                    e.id.clone(),
                    e.name.clone(),
                    e.key.clone(),
                    e.payload.clone(),
                    e.received_at,
                )
            }))
        })
    }

    fn children_summary<'a>(
        &'a self,
        _run: &'a RunId,
        seq: i32,
    ) -> BoxFuture<'a, Result<Option<ChildrenSummary>, StepError>> {
        Box::pin(async move { Ok(summary(self.recorded.children_at(seq))) })
    }

    fn children_page<'a>(
        &'a self,
        _run: &'a RunId,
        seq: i32,
        (from, limit): (i32, i64),
    ) -> BoxFuture<'a, Result<Vec<ChildResult>, StepError>> {
        Box::pin(async move {
            let page = (self.recorded.children_at(seq).iter())
                .filter(|c| c.index >= from)
                .take(usize::try_from(limit).unwrap_or(0))
                .map(|c| {
                    ChildResult::new(
                        c.index,
                        c.run_id.clone(),
                        c.workflow.clone(),
                        c.state.clone(),
                        c.output.clone(),
                        c.reason.clone(),
                    )
                })
                .collect();
            Ok(page)
        })
    }

    fn output_of<'a>(
        &'a self,
        _run: &'a RunId,
        step: &'a str,
        before: i32,
    ) -> BoxFuture<'a, Result<Option<Value>, StepError>> {
        Box::pin(async move {
            let newest = (self.recorded.outputs.iter())
                .filter(|(seq, name, _)| *seq < before && name == step)
                .max_by_key(|(seq, _, _)| *seq);
            Ok(newest.and_then(|(_, _, output)| output.clone()))
        })
    }
}

/// The children counted by state, as `store::children::summary` counts them.
fn summary(children: &[ChildRecord]) -> Option<ChildrenSummary> {
    if children.is_empty() {
        return None;
    }
    let count = |states: &[&str]| {
        children
            .iter()
            .filter(|c| states.contains(&c.state.as_str()))
            .count() as i32
    };
    Some(ChildrenSummary {
        total: children.len() as i32,
        pending: count(&["pending"]),
        running: count(&["running"]),
        succeeded: count(&["succeeded"]),
        failed: count(&["failed", "cancelled"]),
        skipped: count(&["skipped"]),
    })
}

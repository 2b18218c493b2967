//! `ctx.patched("change-id")`: one version's code changed in place, without a new version
//! number. A run that reaches the patch point after the change takes the new path; a run whose
//! earlier attempt already passed that point on the old code keeps the old path, so its
//! journaled answers still fit. The choice is journaled (kind `patch`) the first time it is
//! made, before the new path does anything, so every later attempt, a replay after a kill -9,
//! a fork or `trailmark replay-check` takes it again.
//!
//! The point is placed by the step's journal: calls are numbered in the order the step makes
//! them. At call number `n`, a journaled patch entry is the choice made before; another entry
//! (a model answer) means an earlier attempt ran the old code past this point; no entry means
//! no attempt got here yet, and the new path is taken and recorded.

use std::sync::atomic::Ordering;

use serde_json::{Value, json};

use super::{StepContext, StepError};
use crate::domain::{JournalEntry, request_hash};

/// The journal entry kind of a patch choice.
pub const PATCH_KIND: &str = "patch";

impl StepContext {
    /// Whether this attempt takes the new path of the change `change` (see the module docs):
    /// `true` for a run that reaches this point after the change was deployed, `false` for one
    /// whose earlier attempt passed it on the code from before. Call it where the old and new
    /// code part, and keep the old path until no run in flight can need it.
    pub async fn patched(&self, change: &str) -> Result<bool, StepError> {
        let call_no = self.inner.calls.load(Ordering::SeqCst);
        let hash = request_hash(&json!({ "patch": change }));
        let records = &self.tools().records;
        if call_no < self.inner.pos.journaled
            && let Some(entry) = records
                .journaled(self.run_id(), self.seq(), call_no)
                .await?
        {
            return self.chosen_before(change, &hash, call_no, &entry);
        }
        let entry = JournalEntry {
            seq: self.seq(),
            call_no,
            kind: PATCH_KIND.into(),
            request_hash: hash.clone(),
            response: Value::Bool(true),
            tokens: 0,
            cost: 0.0,
            latency_ms: 0,
        };
        if records.journal(self.run_id(), entry, None).await? {
            self.inner.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.unflushed_answer.store(true, Ordering::Relaxed);
            return Ok(true);
        }
        // Another worker journaled this point first (it held the run before us).
        let stored = records
            .journaled(self.run_id(), self.seq(), call_no)
            .await?
            .ok_or_else(|| {
                StepError::Infrastructure(format!(
                    "run {} step {} patch {change:?}: journal entry {call_no} vanished after a conflict",
                    self.run_id(),
                    self.step()
                ))
            })?;
        self.chosen_before(change, &hash, call_no, &stored)
    }

    /// The path an earlier attempt took at this point, as its journal entry `entry` shows.
    fn chosen_before(
        &self,
        change: &str,
        hash: &str,
        call_no: i32,
        entry: &JournalEntry,
    ) -> Result<bool, StepError> {
        if entry.kind != PATCH_KIND {
            // The old code made another call here: it passed this point before the change.
            return Ok(false);
        }
        if entry.request_hash != hash {
            return Err(StepError::Unknown(format!(
                "run {run} step {} (position {}): call {call_no} was journaled as another patch than {change:?}; the step's patches were reordered or renamed while runs were in flight. Restore their order, then `trailmark run resume {run} --after-fix`",
                self.step(),
                self.seq(),
                run = self.run_id(),
            )));
        }
        self.inner.calls.fetch_add(1, Ordering::SeqCst);
        Ok(entry.response.as_bool().unwrap_or(false))
    }
}

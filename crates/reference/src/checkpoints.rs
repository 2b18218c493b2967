//! What each step of `reconcile` checkpoints. Later steps read these, never the outside systems
//! again, so a resumed run works from the invoices, model answers and stock numbers it already
//! used, even when the outside world has changed since.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::invoices::Scan;
use super::logic::{Item, Matched, Mismatch};
use super::stock::Received;
use trailmark::workflow::{StepContext, StepError};

/// Step 1: the invoices as read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fetched {
    /// The night's id.
    pub night: String,
    /// Invoices read in this step.
    pub invoices: usize,
    /// The scans.
    pub scans: Vec<Scan>,
}

/// One model answer, word for word.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Answer {
    /// The invoice it reads.
    pub invoice_no: String,
    /// The model's text.
    pub answer: String,
}

/// Step 2: every model answer and the line items read from them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Extracted {
    /// The answers, in invoice order.
    pub answers: Vec<Answer>,
    /// The line items.
    pub items: Vec<Item>,
}

/// Step 3: line items paired with their purchase-order lines.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MatchedLines {
    /// The pairs.
    pub matched: Vec<Matched>,
}

/// Step 4: the stock numbers used, as read once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StockRead {
    /// Received quantities per purchase-order line.
    pub stock: Vec<Received>,
}

/// One line that bills too much, with the received quantity it was compared with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Difference {
    /// The line.
    #[serde(flatten)]
    pub matched: Matched,
    /// Units received (from step 4's checkpoint).
    pub received_qty: i32,
}

/// Step 5: the comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Compared {
    /// Lines compared.
    pub lines_compared: usize,
    /// Lines billed above what was received or agreed.
    pub differences: Vec<Difference>,
}

/// Step 6: the adjustments to post.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Flagged {
    /// One per over-billed quantity or price.
    pub mismatches: Vec<Mismatch>,
    /// Sum claimed, in cents.
    pub total_cents: i64,
}

/// How one keyed write ended in this execution of its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteOutcome {
    /// Written now.
    Written,
    /// Called again after an unknown outcome; the store already held the key.
    AlreadyThere,
    /// Known from trailmark's effect record; the store was not asked.
    Recorded,
}

/// One keyed write of steps 7 and 8.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Write {
    /// The key.
    pub key: String,
    /// Amount (ledger) or units (stock).
    pub value: i64,
    /// The received quantity the write rests on.
    pub received_qty: i32,
    /// How it ended.
    pub outcome: WriteOutcome,
}

/// Steps 7 and 8: the keyed writes and how each ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Writes {
    /// Every write, in order.
    pub writes: Vec<Write>,
    /// Written in this execution.
    pub written: usize,
    /// Known from an earlier execution (recorded or already in the store).
    pub skipped: usize,
}

impl Writes {
    /// Tallies the writes.
    pub fn new(writes: Vec<Write>) -> Self {
        let written = writes
            .iter()
            .filter(|w| w.outcome == WriteOutcome::Written)
            .count();
        Self {
            skipped: writes.len() - written,
            written,
            writes,
        }
    }
}

/// One note queued in step 9 or 10.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Note {
    /// Its idempotency key.
    pub key: String,
    /// The claim it makes.
    pub claim: String,
    /// To whom.
    pub recipient: String,
    /// Lines it covers.
    pub lines: usize,
    /// Amount claimed, in cents.
    pub total_cents: i64,
}

/// Steps 9 and 10: the notes queued with the checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Notes {
    /// The notes.
    pub notes: Vec<Note>,
}

/// The checkpoint of an earlier step, typed.
pub async fn prior<T: DeserializeOwned>(ctx: &StepContext, step: &str) -> Result<T, StepError> {
    let raw = ctx.output_of(step).await?.ok_or_else(|| {
        StepError::Unknown(format!(
            "run {} step {}: no checkpoint of step {step}; the run's history is incomplete, inspect it with `trailmark run show {}`",
            ctx.run_id(),
            ctx.step(),
            ctx.run_id()
        ))
    })?;
    serde_json::from_value(raw).map_err(|e| {
        StepError::Unknown(format!(
            "run {} step {}: the checkpoint of step {step} is unreadable ({e}); was it written by another workflow version?",
            ctx.run_id(),
            ctx.step()
        ))
    })
}

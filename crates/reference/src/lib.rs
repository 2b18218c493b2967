//! The reference scenario: the nightly invoice reconciliation `reconcile` and the
//! stand-in outside systems it talks to. The outside systems keep their state in their own
//! Postgres database (`<trailmark database>_outside`), never in trailmark's tables, so every figure
//! the demo prints is measured where a real auditor would look.
//!
//! | module | what it is |
//! |---|---|
//! | [`night`] | which night and how big: date, seed, sizes, the run id and the run's input |
//! | [`generate`] | the night's invoices, purchase orders and receipts, from seed and date |
//! | [`outside`] | the outside database: its name, connection and schema |
//! | [`invoices`] | the invoice source; every read is counted durably |
//! | [`orders`] | purchase orders and received stock as the distributor's systems hold them |
//! | [`extract`] | the extraction prompt, and the stand-in model's deterministic answers |
//! | [`ledger`] | ledger entries under a unique reference; conflicts; fencing tokens |
//! | [`stock`] | keyed stock adjustments on the received-stock records |
//! | [`mail`] | the mail sender (a consumer) and the mail sink that records notes by key |
//! | [`logic`] | matching, comparing and flagging: pure functions both versions share |
//! | [`checkpoints`] | what each step checkpoints, typed |
//! | [`undo`] | the compensations: reversal entries, released stock, withdrawal notes |
//! | [`workflow`] | the ten steps of `reconcile`, with declared kinds |
//! | [`naive`] | the first version from the story: no checkpoint, plain inserts |
//! | [`race`] | two workers posting the same entries: check-then-post versus the unique key |
//! | [`figures`] | what the demo prints, measured from the stores |
//! | [`demo`] | `trailmark demo`: real processes, a real kill, the figures |

pub mod checkpoints;
pub mod demo;
pub mod extract;
pub mod figures;
pub mod generate;
pub mod invoices;
pub mod ledger;
pub mod logic;
pub mod mail;
pub mod naive;
pub mod night;
pub mod orders;
pub mod outside;
pub mod race;
pub mod stock;
pub mod undo;
pub mod workflow;

use trailmark::workflow::StepError;

/// Errors of the outside systems, split by what the caller does about them.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A key was reused for a different write; nothing was written.
    #[error(
        "{store}: key {key} already holds {stored}, the new write asks for {new}; nothing was written. The key recipe or the input changed: compare the run's checkpoints with the stored record, fix, then resume"
    )]
    Conflict {
        /// Which store refused.
        store: &'static str,
        /// The reused key.
        key: String,
        /// What the key already holds.
        stored: String,
        /// What the new write asked for.
        new: String,
    },
    /// A writer with an older fencing token than one already seen for the run.
    #[error(
        "{store}: run {run_id} write refused: fencing token {fence} is older than {current}, a newer worker owns the run"
    )]
    FencedOut {
        /// Which store refused.
        store: &'static str,
        /// The run.
        run_id: String,
        /// The stale token.
        fence: i64,
        /// The highest token the store has seen for the run.
        current: i64,
    },
    /// Something the store needs is missing or malformed (unseeded night, bad input).
    #[error("{0}")]
    Invalid(String),
    /// The outside database failed or is unreachable; nothing was decided.
    #[error("outside database: {0}")]
    Database(#[from] sqlx::Error),
    /// Trailmark's own database failed while reading a run's checkpoints.
    #[error("reading the run's checkpoints failed")]
    Trailmark(#[from] trailmark::store::Error),
}

/// Shorthand for outside-system results.
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for StepError {
    fn from(e: Error) -> Self {
        match e {
            Error::Conflict { .. } => StepError::Conflict(e.to_string()),
            Error::FencedOut { .. } => StepError::FencedOut,
            Error::Invalid(_) => StepError::Unknown(e.to_string()),
            Error::Database(_) => StepError::temporary(e.to_string()),
            Error::Trailmark(e) => e.into(),
        }
    }
}

/// The stock binary's workflows: the engine's built-ins and `reconcile`.
pub fn registry() -> trailmark::workflow::Registry {
    let mut r = trailmark_testkit::registry();
    r.register(workflow::workflow());
    r
}

/// [`registry`] with the `chain` versions `TRAILMARK_CHAIN_VERSIONS` names (`1,2`: a process
/// standing for a build that carries both), or why its value is wrong.
pub fn registry_from_env() -> std::result::Result<trailmark::workflow::Registry, String> {
    let versions = trailmark_testkit::chain_versions_from_env()?;
    let mut r = trailmark_testkit::registry_with(&versions);
    r.register(workflow::workflow());
    Ok(r)
}

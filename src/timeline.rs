//! The run timeline: everything about one run that an operator needs to decide (resume,
//! compensate or kill), read in one place, so the CLI and any other face only render it.

use serde::Serialize;
use sqlx::PgPool;

use crate::store::{self, decisions, effects, journal, parked, progress, runs, steps};

/// A run as an operator reads it: the run row, its steps with attempts and timings, journal
/// and effect totals, parked items and decisions.
#[derive(Debug, Serialize)]
pub struct Timeline {
    /// The run row.
    #[serde(flatten)]
    pub run: runs::RunRow,
    /// Committed steps.
    pub steps_done: usize,
    /// Claims across all positions (more than `steps_done` means retries or crashes).
    pub attempts: i64,
    /// Journal entries, tokens, cost.
    pub journal: JournalTotals,
    /// Effects recorded and completed.
    pub effects: EffectTotals,
    /// Items set aside with their reasons.
    pub parked: Vec<parked::ParkedRow>,
    /// Operator decisions, oldest first (the timeline's human part).
    pub decisions: Vec<decisions::DecisionRow>,
    /// Every checkpoint.
    pub steps: Vec<steps::StepRow>,
    /// The last lines the run said about its work, oldest first.
    pub progress: Vec<progress::Line>,
}

/// Journal totals of a run.
#[derive(Debug, Serialize)]
pub struct JournalTotals {
    /// Entries.
    pub entries: i64,
    /// Tokens.
    pub tokens: i64,
    /// Cost.
    pub cost: f64,
}

/// Effect totals of a run.
#[derive(Debug, Serialize)]
pub struct EffectTotals {
    /// Intents recorded.
    pub recorded: i64,
    /// With a known result.
    pub completed: i64,
}

/// The timeline of `run_id`, if the run exists.
pub async fn load(pool: &PgPool, run_id: &str) -> store::Result<Option<Timeline>> {
    let Some(run) = runs::get(pool, run_id).await? else {
        return Ok(None);
    };
    let steps = steps::list(pool, run_id).await?;
    let spent = journal::totals(pool, run_id).await?;
    let (recorded, completed) = effects::totals(pool, run_id).await?;
    Ok(Some(Timeline {
        steps_done: steps.iter().filter(|s| s.finished_at.is_some()).count(),
        attempts: steps.iter().map(|s| s.attempts as i64).sum(),
        journal: JournalTotals {
            entries: spent.entries,
            tokens: spent.tokens,
            cost: spent.cost,
        },
        effects: EffectTotals {
            recorded,
            completed,
        },
        parked: parked::list(pool, run_id).await?,
        decisions: decisions::list(pool, run_id).await?,
        progress: progress::list(pool, run_id, 0).await?,
        run,
        steps,
    }))
}

//! The run timeline: everything about one run that an operator needs to decide (resume,
//! compensate or kill), read in one place, so the CLI, the API and the console only render it.
//! [`load`] reads every step (the CLI prints them all); [`overview`] reads one page of steps, so
//! a run of 10,000 steps is never read whole for a page or an API call.

use serde::Serialize;
use sqlx::PgPool;

use crate::domain::ShadowWrite;
use crate::store::{
    self, children, decisions, effects, forks, journal, parked, progress, runs, shadow, steps, waits,
};

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
    /// Every checkpoint.
    pub steps: Vec<steps::StepRow>,
    /// Effects, parked items, decisions, progress lines, lineage.
    #[serde(flatten)]
    pub around: Around,
    /// What a shadow run would have written outside, in order (empty for a live run).
    pub shadow_writes: Vec<ShadowWrite>,
}

/// What every view of a run shows around its steps.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Around {
    /// Effects recorded and completed.
    pub effects: EffectTotals,
    /// Items set aside with their reasons.
    pub parked: Vec<parked::ParkedRow>,
    /// Operator decisions, oldest first (the timeline's human part).
    pub decisions: Vec<decisions::DecisionRow>,
    /// The last lines the run said about its work, oldest first.
    pub progress: Vec<progress::Line>,
    /// The run it was forked from, and its forks.
    pub lineage: forks::Lineage,
    /// What it waited for and waits for now (events and sleeps), oldest first, each with the
    /// event that ended it; the last one is open (`resolved_at` empty) while it waits.
    pub waits: Vec<waits::WaitRow>,
    /// The run that started it, and the child runs its steps started.
    pub family: children::Family,
    /// Whether it waits for a slot or a token of its concurrency key, why and behind how many.
    pub flow_wait: Option<store::flow::Waiting>,
}

async fn around(pool: &PgPool, run_id: &str) -> store::Result<Around> {
    let (recorded, completed) = effects::totals(pool, run_id).await?;
    Ok(Around {
        effects: EffectTotals {
            recorded,
            completed,
        },
        parked: parked::list(pool, run_id).await?,
        decisions: decisions::list(pool, run_id).await?,
        progress: progress::list(pool, run_id, 0).await?,
        lineage: forks::lineage(pool, run_id).await?,
        waits: waits::for_run(pool, run_id).await?,
        family: children::family(pool, run_id).await?,
        flow_wait: store::flow::waiting(pool, run_id).await?,
    })
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
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
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
    Ok(Some(Timeline {
        steps_done: steps.iter().filter(|s| s.finished_at.is_some()).count(),
        attempts: steps.iter().map(|s| s.attempts as i64).sum(),
        journal: JournalTotals {
            entries: spent.entries,
            tokens: spent.tokens,
            cost: spent.cost,
        },
        around: around(pool, run_id).await?,
        shadow_writes: shadow::list(pool, run_id).await?,
        run,
        steps,
    }))
}

/// What a run's model calls cost, as an overview shows it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Spending {
    /// Model calls paid for (answers set aside included).
    pub model_calls: i64,
    /// Tokens.
    pub tokens: i64,
    /// Cost.
    pub cost: f64,
}

/// One run with one page of its steps: what the API's run and the console's run page show.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Overview {
    /// The run row (status, step, handover note, error, lease).
    pub run: runs::RunRow,
    /// Positions the run has reached.
    pub steps_total: i64,
    /// The page of steps asked for, in order.
    pub steps: Vec<steps::StepRow>,
    /// What its model calls cost.
    pub spent: Spending,
    /// Effects, parked items, decisions, progress lines, lineage.
    #[serde(flatten)]
    pub around: Around,
}

/// The run with `page` steps after position `after`, or its newest `page` steps when `after` is
/// `None`; `None` when the run does not exist.
pub async fn overview(
    pool: &PgPool,
    run_id: &str,
    after: Option<i32>,
    page: i64,
) -> store::Result<Option<Overview>> {
    let Some(run) = runs::get(pool, run_id).await? else {
        return Ok(None);
    };
    let steps_total = steps::count(pool, run_id).await?;
    let after = after.unwrap_or((steps_total - page).max(0) as i32 - 1);
    let spent = journal::totals(pool, run_id).await?;
    Ok(Some(Overview {
        steps_total,
        steps: steps::page(pool, run_id, after, page).await?,
        spent: Spending {
            model_calls: spent.entries,
            tokens: spent.tokens,
            cost: spent.cost,
        },
        around: around(pool, run_id).await?,
        run,
    }))
}

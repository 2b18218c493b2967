//! The figures the demo prints, each measured where it lives: invoice reads at the invoice
//! source, model calls at the model server, rows and keys in the ledger, notes at the mail sink,
//! attempts in trailmark's checkpoints. Nothing here is computed from what should have happened.

use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;

use super::checkpoints::{
    Compared, Extracted, Fetched, Flagged, MatchedLines, Notes, StockRead, WriteOutcome, Writes,
};
use super::night::Night;
use super::workflow::{self as reconcile, STEPS};
use super::{Result, invoices, ledger, mail, stock};
use trailmark::store::{runs, steps};
use trailmark::workflow::StepKind;

/// Everything the demo reports about one run.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    /// Which implementation ran the night: `trailmark` (checkpoints, keyed writes) or `naive`
    /// (the first version of the story: neither).
    pub variant: String,
    /// The run.
    pub run_id: String,
    /// Run status (`succeeded`, `needs_review`, ...; `finished` for the naive version).
    pub status: String,
    /// The error a stopped run reports.
    pub error: Option<String>,
    /// Invoices read from the source, across every attempt.
    pub invoices_read: i64,
    /// Model calls the model server answered, across every attempt.
    pub model_calls: i64,
    /// Step executions that had to be started again after a crash.
    pub restarts: i64,
    /// Ledger rows of the run.
    pub ledger_rows: i64,
    /// Distinct ledger references of the run.
    pub distinct_keys: i64,
    /// Stock adjustments of the run.
    pub stock_adjustments: i64,
    /// Debit notes recorded at the mail sink.
    pub debit_notes_sent: i64,
    /// Debit notes recorded twice for the same claim.
    pub duplicates: i64,
    /// Repeated deliveries the sink recognised by key and ignored.
    pub repeats_ignored: i64,
    /// Summaries recorded at the sink.
    pub summaries_sent: i64,
    /// Per-step lines (trailmark version only).
    pub steps: Vec<StepFigure>,
}

/// One step as the checkpoints tell it.
#[derive(Debug, Clone, Serialize)]
pub struct StepFigure {
    /// Position, 1-based.
    pub number: i32,
    /// Step name.
    pub step: String,
    /// Declared kind.
    pub kind: StepKind,
    /// Claims (more than one: it was interrupted and resumed).
    pub attempts: i32,
    /// From first claim to commit, in milliseconds; `None` while unfinished.
    pub ms: Option<i64>,
    /// What the checkpoint says the step did.
    pub did: String,
}

/// Measures a `reconcile` run; `model_calls` comes from the model server's own count.
pub async fn measure(
    pool: &PgPool,
    outside: &PgPool,
    night: &Night,
    run_id: &str,
    model_calls: i64,
) -> Result<Figures> {
    let run = runs::get(pool, run_id).await?;
    let rows = steps::list(pool, run_id).await?;
    let restarts = rows.iter().map(|s| i64::from(s.attempts.max(1) - 1)).sum();
    let mut figures = outside_figures(outside, night, run_id).await?;
    figures.variant = "trailmark".into();
    figures.status = run
        .as_ref()
        .map_or_else(|| "not started".into(), |r| r.status.to_string());
    figures.error = run.and_then(|r| r.error);
    figures.model_calls = model_calls;
    figures.restarts = restarts;
    figures.steps = rows
        .iter()
        .map(|s| {
            let base = s.step.declared();
            let kind = STEPS
                .iter()
                .find(|(name, _)| *name == base)
                .map_or(StepKind::Read, |(_, k)| *k);
            StepFigure {
                number: s.seq + 1,
                step: s.step.to_string(),
                kind,
                attempts: s.attempts,
                ms: s.finished_at.map(|f| (f - s.started_at).num_milliseconds()),
                did: s
                    .output
                    .as_ref()
                    .map_or_else(|| "unfinished".into(), |o| describe(s.step.as_str(), o)),
            }
        })
        .collect();
    Ok(figures)
}

/// The figures held by the outside systems, for either version.
pub async fn outside_figures(outside: &PgPool, night: &Night, run_id: &str) -> Result<Figures> {
    let (ledger_rows, distinct_keys) = ledger::counts(outside, run_id).await?;
    let sink = mail::counts(outside, run_id).await?;
    Ok(Figures {
        variant: String::new(),
        run_id: run_id.to_owned(),
        status: String::new(),
        error: None,
        invoices_read: invoices::reads(outside, night, run_id).await?,
        model_calls: 0,
        restarts: 0,
        ledger_rows,
        distinct_keys,
        stock_adjustments: stock::counts(outside, run_id).await?.0,
        debit_notes_sent: sink.notes,
        duplicates: sink.duplicate_notes,
        repeats_ignored: sink.repeats_ignored,
        summaries_sent: sink.summaries,
        steps: Vec::new(),
    })
}

/// One line about what a step's checkpoint records (a compensation reads like its step).
fn describe(step: &str, output: &Value) -> String {
    if let Some((original, _)) = trailmark::domain::StepAddress::from(step).undo_of() {
        return format!("undo: {}", describe(original, output));
    }
    fn read<T: serde::de::DeserializeOwned>(v: &Value) -> Option<T> {
        serde_json::from_value(v.clone()).ok()
    }
    let line = match step {
        reconcile::FETCH => {
            read::<Fetched>(output).map(|o| format!("{} invoices read", o.invoices))
        }
        reconcile::EXTRACT => read::<Extracted>(output).map(|o| {
            format!(
                "{} model answers, {} line items",
                o.answers.len(),
                o.items.len()
            )
        }),
        reconcile::MATCH => read::<MatchedLines>(output)
            .map(|o| format!("{} lines matched to orders", o.matched.len())),
        reconcile::READ_STOCK => {
            read::<StockRead>(output).map(|o| format!("{} stock numbers read", o.stock.len()))
        }
        reconcile::COMPARE => read::<Compared>(output).map(|o| {
            format!(
                "{} lines compared, {} bill too much",
                o.lines_compared,
                o.differences.len()
            )
        }),
        reconcile::FLAG => read::<Flagged>(output).map(|o| {
            format!(
                "{} adjustments, {}",
                o.mismatches.len(),
                ledger::cents(o.total_cents)
            )
        }),
        reconcile::POST | reconcile::UPDATE_STOCK => {
            read::<Writes>(output).map(|o| writes_line(&o))
        }
        reconcile::SEND_NOTES | reconcile::SEND_SUMMARY => {
            read::<Notes>(output).map(|o| format!("{} queued with the checkpoint", o.notes.len()))
        }
        _ => None,
    };
    line.unwrap_or_else(|| "checkpointed".into())
}

fn writes_line(w: &Writes) -> String {
    let recorded = w
        .writes
        .iter()
        .filter(|x| x.outcome == WriteOutcome::Recorded)
        .count();
    let there = w
        .writes
        .iter()
        .filter(|x| x.outcome == WriteOutcome::AlreadyThere)
        .count();
    let mut line = format!("{} written", w.written);
    if recorded > 0 {
        line.push_str(&format!(", {recorded} skipped (done before the crash)"));
    }
    if there > 0 {
        line.push_str(&format!(", {there} already held by the store's key"));
    }
    line
}

/// The three closing lines, exactly as the story states them.
pub fn closing_lines(f: &Figures) -> [String; 3] {
    [
        format!(
            "invoices read: {}, model calls: {}, restarts: {}",
            f.invoices_read, f.model_calls, f.restarts
        ),
        format!(
            "ledger rows: {}, distinct keys: {}",
            f.ledger_rows, f.distinct_keys
        ),
        format!(
            "debit notes sent: {}, duplicates: {}",
            f.debit_notes_sent, f.duplicates
        ),
    ]
}

/// The short table: one row per step (when there are steps), then the closing lines.
pub fn render(f: &Figures) -> String {
    let mut out = format!("{} run {}: {}\n", f.variant, f.run_id, f.status);
    if let Some(e) = &f.error {
        out.push_str(&format!("error: {e}\n"));
    }
    if !f.steps.is_empty() {
        out.push_str(&format!(
            "{:>3}  {:<30} {:<8} {:>8} {:>8}  {}\n",
            "#", "step", "kind", "attempts", "ms", "what the checkpoint says"
        ));
        for s in &f.steps {
            let kind = serde_json::to_value(s.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let ms = s.ms.map_or_else(|| "-".into(), |m| m.to_string());
            out.push_str(&format!(
                "{:>3}  {:<30} {:<8} {:>8} {:>8}  {}\n",
                s.number, s.step, kind, s.attempts, ms, s.did
            ));
        }
    }
    out.push_str(&format!(
        "stock adjustments: {}, summaries sent: {}, repeated deliveries ignored by key: {}\n\n",
        f.stock_adjustments, f.summaries_sent, f.repeats_ignored
    ));
    for line in closing_lines(f) {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Remembers how many calls the model server answered during one demo invocation, so a later
/// invocation (with a fresh model server) can report the run's total.
pub async fn record_model_calls(
    outside: &PgPool,
    run_id: &str,
    invocation: uuid::Uuid,
    calls: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO reference.model_calls (run_id, invocation, calls) VALUES ($1, $2, $3)
         ON CONFLICT (run_id, invocation) DO UPDATE SET calls = EXCLUDED.calls",
    )
    .bind(run_id)
    .bind(invocation)
    .bind(calls)
    .execute(outside)
    .await?;
    Ok(())
}

/// Model calls answered for a run across all recorded demo invocations.
pub async fn model_calls(outside: &PgPool, run_id: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE(sum(calls), 0)::bigint FROM reference.model_calls WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(outside)
    .await?)
}

//! `trailmark run watch ID` (and `run start --follow`): the run as it moves — its step and
//! attempt, each progress line, each status change — until it ends or stops for a person.

use std::time::Duration;

use anyhow::bail;
use sqlx::PgPool;
use trailmark::domain::RunStatus;
use trailmark::store::{progress, runs, steps};

/// How often the run is looked at.
const POLL: Duration = Duration::from_millis(300);

/// What was printed last, so that only changes are printed.
#[derive(Default)]
struct Seen {
    status: Option<RunStatus>,
    position: Option<(i32, i32)>,
    progress: i64,
}

/// Follows `run_id` until it ends: `Ok` when it succeeded (or its undo or shadow run completed), an error
/// (exit 1) when it failed, was cancelled or stopped for review. A run that does not exist yet
/// is waited for at most `appear_secs`.
pub async fn watch(pool: &PgPool, run_id: &str, appear_secs: u64) -> anyhow::Result<()> {
    let mut seen = Seen::default();
    let appear_by = std::time::Instant::now() + Duration::from_secs(appear_secs);
    loop {
        let Some(run) = runs::get(pool, run_id).await? else {
            if std::time::Instant::now() >= appear_by {
                bail!(
                    "run {run_id} did not appear within {appear_secs} s: is a worker consuming run starts? (`trailmark run show {run_id}` says)"
                );
            }
            tokio::time::sleep(POLL).await;
            continue;
        };
        show_changes(pool, &run, &mut seen).await?;
        match run.status {
            RunStatus::Succeeded | RunStatus::Compensated | RunStatus::Shadowed => return Ok(()),
            RunStatus::Failed | RunStatus::Cancelled | RunStatus::NeedsReview => {
                let why = run.error.as_deref().unwrap_or("no error recorded");
                bail!("run {run_id} is {}: {why}", run.status);
            }
            _ => tokio::time::sleep(POLL).await,
        }
    }
}

async fn show_changes(pool: &PgPool, run: &runs::RunRow, seen: &mut Seen) -> anyhow::Result<()> {
    let now = chrono::Utc::now().format("%H:%M:%S");
    for line in progress::list(pool, &run.run_id, seen.progress).await? {
        println!("{}  {}", line.at.format("%H:%M:%S"), line.line);
        seen.progress = line.id;
    }
    if let Some(step) = &run.step
        && run.status.accepts_steps()
    {
        let attempts = steps::at(pool, &run.run_id, run.step_seq)
            .await?
            .map_or(0, |s| s.attempts);
        if seen.position != Some((run.step_seq, attempts)) && attempts > 0 {
            println!(
                "{now}  step {step} (position {}), attempt {attempts}",
                run.step_seq
            );
            seen.position = Some((run.step_seq, attempts));
        }
    }
    if seen.status != Some(run.status) {
        println!(
            "{now}  run {} is {} ({} steps done)",
            run.run_id, run.status, run.step_seq
        );
        seen.status = Some(run.status);
    }
    Ok(())
}

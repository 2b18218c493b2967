//! `trailmark demo --naive`: the naive version as a real process, killed at the same entry of
//! step 7, then started again (it can only start from step 1), and the damage measured.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::postgres::PgConnectOptions;

use super::children::{Proc, describe};
use super::progress::Ticker;
use super::{ModelServerProc, Stage, say};
use crate::figures::{self, Figures};
use crate::night::Night;
use crate::{invoices, naive, outside};
use trailmark::config::Settings;
use trailmark::failpoint::Failpoints;
use trailmark::model::ModelClient;

/// How long one naive pass may take.
const PASS_WITHIN: Duration = Duration::from_secs(600);

/// Runs the naive story and measures it.
pub async fn run(
    settings: &Settings,
    night: &Night,
    crash_at: Option<u32>,
) -> anyhow::Result<Figures> {
    if let Some(k) = crash_at
        && (k == 0 || k > night.mismatches)
    {
        bail!(
            "--crash-at-entry {k}: step 7 posts entries 1 to {} on this night; pick one of those or --no-crash",
            night.mismatches
        );
    }
    let run_id = night.naive_run_id();
    let stage = Stage::prepare(settings, night, run_id.as_str()).await?;
    naive::reset(&stage.outside, night).await?;
    say(&format!(
        "naive run {run_id}: no checkpoints, plain inserts; earlier naive results of this night cleared"
    ));
    let model = ModelServerProc::start(&stage).await?;
    let restarts = passes(&stage, &model, night, crash_at).await;
    let calls = model.calls().await;
    model.stop().await;
    let restarts = restarts?;
    let mut f = figures::outside_figures(&stage.outside, night, run_id.as_str()).await?;
    let (rows, distinct) = naive::ledger_counts(&stage.outside, night).await?;
    f.variant = "naive".into();
    f.status = "finished".into();
    f.model_calls = calls?;
    f.restarts = restarts;
    f.ledger_rows = rows;
    f.distinct_keys = distinct;
    f.stock_adjustments = naive::stock_count(&stage.outside, night).await?;
    Ok(f)
}

/// Pass 1 (set to die at `crash_at`), then pass 2 from step 1; returns the restarts.
async fn passes(
    stage: &Stage,
    model: &ModelServerProc,
    night: &Night,
    crash_at: Option<u32>,
) -> anyhow::Result<i64> {
    let mut restarts = 0;
    for pass in 1..=2 {
        let mut env = stage.child_env(&model.base_url);
        let failpoint = crash_at
            .filter(|_| pass == 1)
            .map(|k| format!("{}=kill@{k}", naive::POST_FAILPOINT));
        if let Some(fp) = &failpoint {
            env.push(("TRAILMARK_FAILPOINTS".into(), fp.clone()));
        }
        let (date, n, m, seed) = (
            night.date.to_string(),
            night.invoices.to_string(),
            night.mismatches.to_string(),
            night.seed.to_string(),
        );
        let args = [
            "demo",
            "naive-worker",
            "--night",
            &date,
            "--invoices",
            &n,
            "--mismatches",
            &m,
            "--seed",
            &seed,
        ];
        let mut proc = Proc::spawn(&format!("naive-{pass}"), &args, &env, &stage.logs, false)?;
        say(&format!(
            "naive pass {pass} started{}",
            failpoint.map_or_else(String::new, |fp| format!(" (TRAILMARK_FAILPOINTS={fp})"))
        ));
        let status = watch(stage, model, night, &mut proc).await?;
        if status.success() {
            return Ok(restarts);
        }
        if pass == 1 && crash_at.is_some() {
            let (rows, _) = naive::ledger_counts(&stage.outside, night).await?;
            say(&format!(
                "naive pass 1 was {} with {rows} ledger rows; with no checkpoint it starts again from step 1",
                describe(status)
            ));
            restarts += 1;
            continue;
        }
        bail!(
            "naive pass {pass} ended with {}; see {}",
            describe(status),
            proc.log().display()
        );
    }
    bail!("the naive version did not finish in two passes")
}

async fn watch(
    stage: &Stage,
    model: &ModelServerProc,
    night: &Night,
    proc: &mut Proc,
) -> anyhow::Result<std::process::ExitStatus> {
    let mut ticker = Ticker::new();
    let deadline = Instant::now() + PASS_WITHIN;
    let reader = night.naive_run_id();
    loop {
        if let Some(status) = proc.exited()? {
            return Ok(status);
        }
        let reads = invoices::reads(&stage.outside, night, reader.as_str()).await?;
        let (rows, _) = naive::ledger_counts(&stage.outside, night).await?;
        let calls = model.calls().await?;
        ticker.offer(
            proc.name(),
            &format!("invoices read {reads} · model calls {calls} · ledger rows {rows}"),
        );
        if Instant::now() > deadline {
            bail!(
                "{} did not finish within {PASS_WITHIN:?}; see {}",
                proc.name(),
                proc.log().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One naive pass in this process (`trailmark demo naive-worker`, started by the demo).
pub async fn pass(settings: &Settings, night: &Night) -> anyhow::Result<()> {
    let failpoints =
        Failpoints::from_env().map_err(|e| anyhow::anyhow!("TRAILMARK_FAILPOINTS: {e}"))?;
    let model = ModelClient::new(&settings.model)
        .context("the naive worker needs model.base_url (the demo passes its model server)")?;
    let trailmark: PgConnectOptions = trailmark::store::parse_url(&settings.database.url)?;
    let outside = outside::prepare(&outside::options_for(&trailmark)?).await?;
    naive::run_pass(&outside, &model, night, &failpoints).await?;
    Ok(())
}

//! The reference story with real processes: migrate, start the model server, start a
//! worker that SIGKILLs itself when entry K of step 7 is about to be posted, publish the
//! run-start, wait for the worker to die, start a fresh one, wait for the run to finish, measure.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::PgPool;

use super::children::{Proc, describe};
use super::progress::Ticker;
use super::{MailSender, ModelServerProc, Stage, say};
use crate::checkpoints::Notes;
use crate::figures::{self, Figures};
use crate::night::Night;
use crate::workflow::{self as reconcile, STEPS};
use crate::{invoices, ledger, mail};
use trailmark::broker::{self, Topology};
use trailmark::config::Settings;
use trailmark::domain::{RunId, RunStartEvent, RunStatus};
use trailmark::store::{self, runs, steps};

/// How long a run may take before the demo gives up (and says where to look).
const RUN_WITHIN: Duration = Duration::from_secs(600);
/// How long the notes may take from the outbox to the sink after the run has finished.
const MAIL_WITHIN: Duration = Duration::from_secs(60);

/// What to show.
#[derive(Debug, Clone)]
pub struct Options {
    /// The night.
    pub night: Night,
    /// Kill the first worker when this entry of step 7 is about to be posted; `None`: no crash.
    pub crash_at: Option<u32>,
}

/// The figures, and whether the run had already finished before this invocation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    /// Measured figures.
    #[serde(flatten)]
    pub figures: Figures,
    /// True when nothing was run this time.
    pub already_finished: bool,
}

/// Runs the story (or reports the finished run) and returns the measured figures.
pub async fn run(settings: &Settings, opts: &Options) -> anyhow::Result<Outcome> {
    let night = &opts.night;
    if let Some(k) = opts.crash_at
        && (k == 0 || k > night.mismatches)
    {
        bail!(
            "--crash-at-entry {k}: step 7 posts entries 1 to {} on this night; pick one of those or --no-crash",
            night.mismatches
        );
    }
    let run_id = night.run_id();
    let pool = migrate(settings).await?;
    refuse_other_workers(settings).await?;
    let stage = Stage::prepare(settings, night, run_id.as_str()).await?;
    let existing = runs::get(&pool, run_id.as_str()).await?;
    if let Some(run) = &existing {
        match run.status {
            RunStatus::Succeeded => {
                let when = run.finished_at.map(|t| t.to_rfc3339()).unwrap_or_default();
                say(&format!(
                    "run {run_id} already finished at {when}; nothing is repeated. Its figures, measured again:"
                ));
                return Ok(Outcome {
                    figures: measure(&pool, &stage, night, &run_id).await?,
                    already_finished: true,
                });
            }
            s if s.accepts_steps() => say(&format!(
                "run {run_id} is unfinished (at step {}); a fresh worker resumes it, without a crash this time",
                run.step_seq + 1
            )),
            s => bail!(
                "run {run_id} is {s}: {}. A person decides what happens next; inspect it with `trailmark run show {run_id}`",
                run.error.as_deref().unwrap_or("no error recorded")
            ),
        }
    }
    let crash = if existing.is_none() {
        opts.crash_at
    } else {
        None
    };
    let model = ModelServerProc::start(&stage).await?;
    let sender = MailSender::start(&stage);
    let driven = drive(&pool, &stage, &model, night, existing.is_none(), crash).await;
    // Counted and stopped whatever happened, so a later invocation can report the run's total.
    let calls = model.calls().await;
    model.stop().await;
    sender.stop().await;
    let invocation = uuid::Uuid::new_v4();
    figures::record_model_calls(&stage.outside, run_id.as_str(), invocation, calls?).await?;
    driven?;
    Ok(Outcome {
        figures: measure(&pool, &stage, night, &run_id).await?,
        already_finished: false,
    })
}

/// The demo crashes its own worker and counts what it did: a worker it did not start, consuming
/// the same queues, would take the run's steps without the stand-in model and mail sender and
/// stop the run for review. So it refuses to start beside one.
async fn refuse_other_workers(settings: &Settings) -> anyhow::Result<()> {
    let topology = Topology::from_settings(&settings.broker);
    for queue in [topology.run_start_queue(), topology.steps_queue()] {
        let Some(state) = broker::queue_state(&settings.broker, &queue).await? else {
            continue;
        };
        if state.consumers > 0 {
            bail!(
                "{} other consumer(s) take messages from {queue} (a `trailmark serve` left running under prefix {:?}?); \
                 the demo runs its own workers and would share its steps with them. Stop them, or give the demo a \
                 database and prefix of its own: DATABASE_URL=postgres://.../trailmark_demo TRAILMARK__BROKER__PREFIX=demo trailmark demo",
                state.consumers,
                settings.broker.prefix
            );
        }
    }
    Ok(())
}

async fn migrate(settings: &Settings) -> anyhow::Result<PgPool> {
    store::ensure_database(&settings.database).await?;
    let pool = store::connect(&settings.database).await?;
    store::migrate(&pool).await?;
    broker::declare_topology(&settings.broker).await?;
    let conn = broker::connect(&settings.broker, "demo-setup").await?;
    let ch = conn.create_channel().await.map_err(broker::Error::from)?;
    mail::declare(&ch, &settings.broker.prefix)
        .await
        .map_err(broker::Error::from)
        .context("declaring the mail exchange and queue")?;
    let _ = conn.close(200, "done".into()).await;
    say(&format!(
        "trailmark's database migrated, broker topology declared under prefix {:?}",
        settings.broker.prefix
    ));
    Ok(pool)
}

async fn measure(
    pool: &PgPool,
    stage: &Stage,
    night: &Night,
    run_id: &RunId,
) -> anyhow::Result<Figures> {
    let calls = figures::model_calls(&stage.outside, run_id.as_str()).await?;
    Ok(figures::measure(pool, &stage.outside, night, run_id.as_str(), calls).await?)
}

/// Worker 1 (maybe set to die), the run-start, the watch, worker 2 after a death, the mail.
async fn drive(
    pool: &PgPool,
    stage: &Stage,
    model: &ModelServerProc,
    night: &Night,
    fresh: bool,
    crash: Option<u32>,
) -> anyhow::Result<()> {
    let run_id = night.run_id();
    let failpoint = crash.map(|k| format!("reconcile.post_entry=kill@{k}"));
    let mut worker = spawn_worker(stage, model, 1, failpoint.as_deref())?;
    if fresh {
        publish_start(&stage.settings, night).await?;
        say(&format!(
            "run-start published for {run_id}: {} invoices, {} expected mismatches",
            night.invoices, night.mismatches
        ));
    }
    let mut ticker = Ticker::new();
    let mut number = 1;
    let status = loop {
        match watch(pool, stage, model, night, &mut worker, &mut ticker).await? {
            Watched::RunEnded(status) => break status,
            Watched::WorkerEnded(how) if number == 1 && crash.is_some() => {
                let run = runs::get(pool, run_id.as_str())
                    .await?
                    .context("the run vanished")?;
                let (rows, _) = ledger::counts(&stage.outside, run_id.as_str()).await?;
                let step = STEPS.get(run.step_seq as usize).map_or("?", |s| s.0);
                say(&format!(
                    "worker 1 was {how} in step {}/10 {step} with {rows} ledger rows committed; starting worker 2, which takes over when the dead worker's lease runs out",
                    run.step_seq + 1
                ));
                number += 1;
                worker = spawn_worker(stage, model, number, None)?;
            }
            Watched::WorkerEnded(how) => bail!(
                "worker {number} was {how} unexpectedly; see {}",
                worker.log().display()
            ),
        }
    };
    if status == RunStatus::Succeeded {
        wait_for_mail(pool, stage, &run_id).await?;
    }
    worker.stop().await;
    Ok(())
}

fn spawn_worker(
    stage: &Stage,
    model: &ModelServerProc,
    number: u32,
    failpoint: Option<&str>,
) -> anyhow::Result<Proc> {
    let mut env = stage.child_env(&model.base_url);
    if let Some(fp) = failpoint {
        env.push(("TRAILMARK_FAILPOINTS".into(), fp.to_owned()));
    }
    let proc = Proc::spawn(
        &format!("worker-{number}"),
        &["serve"],
        &env,
        &stage.logs,
        false,
    )?;
    let note = failpoint.map_or_else(String::new, |fp| {
        format!(" (TRAILMARK_FAILPOINTS={fp}: it will SIGKILL itself)")
    });
    say(&format!("worker {number} started: `trailmark serve`{note}"));
    Ok(proc)
}

async fn publish_start(settings: &Settings, night: &Night) -> anyhow::Result<()> {
    let topology = Topology::new(&settings.broker.prefix, settings.broker.delivery_limit);
    let input = night.input(&mail::exchange(&settings.broker.prefix));
    let event = RunStartEvent::new(night.run_id(), reconcile::NAME, input);
    broker::publish_once(&settings.broker, "demo", &topology.run_start(&event))
        .await
        .context("publishing the run-start event")?;
    Ok(())
}

enum Watched {
    RunEnded(RunStatus),
    WorkerEnded(String),
}

/// Polls until the run stops executing or the worker process ends, printing progress.
async fn watch(
    pool: &PgPool,
    stage: &Stage,
    model: &ModelServerProc,
    night: &Night,
    worker: &mut Proc,
    ticker: &mut Ticker,
) -> anyhow::Result<Watched> {
    let run_id = night.run_id();
    let deadline = Instant::now() + RUN_WITHIN;
    loop {
        if let Some(status) = worker.exited()? {
            return Ok(Watched::WorkerEnded(describe(status)));
        }
        if let Some(run) = runs::get(pool, run_id.as_str()).await? {
            let status = run.status;
            let (rows, _) = ledger::counts(&stage.outside, run_id.as_str()).await?;
            let reads = invoices::reads(&stage.outside, night, run_id.as_str()).await?;
            let calls = model.calls().await?;
            let head = match run.step.as_ref() {
                Some(step) if !status.is_terminal() => {
                    format!("step {:>2}/10 {step:<30}", run.step_seq + 1)
                }
                _ => format!("run {status:<36}"),
            };
            ticker.offer(
                &head,
                &format!("invoices read {reads} · model calls {calls} · ledger rows {rows}"),
            );
            if !status.accepts_steps() {
                return Ok(Watched::RunEnded(status));
            }
        }
        if Instant::now() > deadline {
            bail!(
                "run {run_id} did not finish within {RUN_WITHIN:?}; see {} and `trailmark run show {run_id}`",
                worker.log().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the sink holds every note the run's checkpoints say were queued.
async fn wait_for_mail(pool: &PgPool, stage: &Stage, run_id: &RunId) -> anyhow::Result<()> {
    let queued: usize = steps::list(pool, run_id.as_str())
        .await?
        .iter()
        .filter(|s| s.step == reconcile::SEND_NOTES || s.step == reconcile::SEND_SUMMARY)
        .filter_map(|s| {
            s.output
                .clone()
                .and_then(|o| serde_json::from_value::<Notes>(o).ok())
        })
        .map(|n| n.notes.len())
        .sum();
    let deadline = Instant::now() + MAIL_WITHIN;
    loop {
        let sink = mail::counts(&stage.outside, run_id.as_str()).await?;
        if (sink.notes + sink.summaries) as usize >= queued {
            say(&format!(
                "mail sink holds {} debit notes and {} summary",
                sink.notes, sink.summaries
            ));
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the mail sink holds {} of {queued} notes after {MAIL_WITHIN:?}; is the relay publishing? (`trailmark run show {run_id}`)",
                sink.notes + sink.summaries
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

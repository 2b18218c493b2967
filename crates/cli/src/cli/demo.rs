//! `trailmark demo [--naive] | demo race`: the reference scenario end to end on this machine's
//! Postgres and RabbitMQ (DATABASE_URL, AMQP_URL and TRAILMARK__BROKER__PREFIX are honoured).
//! Progress goes to stderr; the table and the closing lines (or `--json`) to stdout. The demo's
//! child processes are stopped when it ends, fails or is interrupted.

use std::future::Future;

use anyhow::bail;
use clap::{Args, Subcommand};

use trailmark::config::Settings;
use trailmark_reference::demo::{naive_story, story};
use trailmark_reference::figures::{self, Figures};
use trailmark_reference::night::{self, Night};
use trailmark_reference::{extract, outside, race};
use trailmark_standin::model_server::{ModelServerOptions, serve_forever};

/// `trailmark demo` options.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DemoArgs {
    /// `race`, or nothing for the story.
    #[command(subcommand)]
    pub command: Option<DemoCommand>,
    /// Which night.
    #[command(flatten)]
    pub night: NightArgs,
    /// Kill the first worker when this entry of step 7 is about to be posted (24: 23 committed).
    #[arg(long, default_value_t = 24)]
    pub crash_at_entry: u32,
    /// Let the worker live: the run finishes without a crash.
    #[arg(long)]
    pub no_crash: bool,
    /// Run the naive version (no checkpoints, plain inserts) under the same crash instead.
    #[arg(long)]
    pub naive: bool,
    /// Print the figures as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The night to reconcile.
#[derive(Debug, Clone, Args)]
pub struct NightArgs {
    /// The night (YYYY-MM-DD); default the story's night, 2026-10-13, so that the figures are
    /// the ones the README shows. The run is `run-<night>-ldh`.
    #[arg(long)]
    pub night: Option<String>,
    /// Invoices that night.
    #[arg(long, default_value_t = night::DEFAULT_INVOICES)]
    pub invoices: u32,
    /// Invoice lines that bill too much that night (one ledger adjustment each).
    #[arg(long, default_value_t = night::DEFAULT_MISMATCHES)]
    pub mismatches: u32,
    /// Seed of the generated paperwork.
    #[arg(long, default_value_t = night::DEFAULT_SEED, hide = true)]
    pub seed: u64,
}

impl NightArgs {
    fn night(&self) -> anyhow::Result<Night> {
        let date = match &self.night {
            Some(raw) => night::parse_date(raw)?,
            None => night::parse_date(night::STORY_NIGHT)?,
        };
        let night = Night {
            date,
            invoices: self.invoices,
            mismatches: self.mismatches,
            seed: self.seed,
        };
        Ok(night.validated()?)
    }
}

/// `trailmark demo` subcommands.
#[derive(Debug, Subcommand)]
pub enum DemoCommand {
    /// Two workers post the same entries at once: check-then-post versus the ledger's unique key.
    Race {
        /// Tries per variant.
        #[arg(long, default_value_t = 15)]
        tries: u32,
        /// Entries both workers post per try.
        #[arg(long, default_value_t = 40)]
        entries: u32,
        /// Pause between check and insert, in milliseconds.
        #[arg(long, default_value_t = 2)]
        pause_ms: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The stand-in model server with line-item extraction answers (the demo starts it).
    #[command(hide = true)]
    ModelServer {
        /// Port on 127.0.0.1 (0 picks a free one).
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
    /// One pass of the naive version (`demo --naive` starts it).
    #[command(hide = true)]
    NaiveWorker {
        /// Which night.
        #[command(flatten)]
        night: NightArgs,
    },
}

/// Runs the chosen demo.
pub async fn run(settings: &Settings, args: DemoArgs) -> anyhow::Result<()> {
    match args.command {
        Some(DemoCommand::ModelServer { port }) => {
            let opts = ModelServerOptions {
                port,
                responder: Some(extract::responder()),
                ..Default::default()
            };
            Ok(serve_forever(opts).await?)
        }
        Some(DemoCommand::NaiveWorker { night }) => {
            naive_story::pass(settings, &night.night()?).await
        }
        Some(DemoCommand::Race {
            tries,
            entries,
            pause_ms,
            json,
        }) => interruptible(race_demo(settings, tries, entries, pause_ms, json)).await,
        None => {
            let crash_at = (!args.no_crash).then_some(args.crash_at_entry);
            let night = args.night.night()?;
            if args.naive {
                let figures = interruptible(naive_story::run(settings, &night, crash_at)).await?;
                print(&figures, args.json, &figures)
            } else {
                let outcome =
                    interruptible(story::run(settings, &story::Options { night, crash_at }))
                        .await?;
                print(&outcome.figures, args.json, &outcome)?;
                match outcome.figures.status.as_str() {
                    "succeeded" => Ok(()),
                    status => bail!(
                        "run {} ended {status}; inspect it with `trailmark run show {}`",
                        outcome.figures.run_id,
                        outcome.figures.run_id
                    ),
                }
            }
        }
    }
}

fn print(figures: &Figures, json: bool, as_json: &impl serde::Serialize) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(as_json)?);
    } else {
        print!("{}", figures::render(figures));
    }
    Ok(())
}

async fn race_demo(
    settings: &Settings,
    tries: u32,
    entries: u32,
    pause_ms: u64,
    json: bool,
) -> anyhow::Result<()> {
    if tries == 0 || entries == 0 {
        bail!("--tries and --entries must be at least 1");
    }
    let trailmark: sqlx::postgres::PgConnectOptions =
        trailmark::store::parse_url(&settings.database.url)?;
    let pool = outside::prepare(&outside::options_for(&trailmark)?).await?;
    trailmark_reference::demo::say(&format!(
        "two workers post the same {entries} entries, {tries} tries per variant, {pause_ms} ms between check and insert"
    ));
    let report = race::run(
        &pool,
        tries,
        entries,
        std::time::Duration::from_millis(pause_ms),
    )
    .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for line in report.lines() {
            println!("{line}");
        }
    }
    Ok(())
}

/// Runs `work` until it ends or Ctrl-C / SIGTERM arrives; dropping it kills the demo's children.
async fn interruptible<T>(work: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        done = work => done,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; the demo's processes were stopped. Run the same command again to resume the run"),
        _ = term.recv() => bail!("terminated; the demo's processes were stopped. Run the same command again to resume the run"),
    }
}

//! `trailmark run ...`: the subcommands that start, inspect and decide about runs.

use clap::Subcommand;

use super::decide::{self, Decision};
use trailmark::config::Settings;
use trailmark::operator::{Decider, Resume};
use trailmark::workflow::Registry;

/// The `run` subcommands.
#[derive(Debug, Subcommand)]
pub enum RunCommand {
    /// Publish a run-start event, exactly as an upstream service would.
    Start(super::run::StartArgs),
    /// Show a run: status, steps with attempts and timings, journal and effect counts.
    Show {
        /// Run id.
        run_id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the run's whole record as JSON (`trailmark.run.v1`, the archive's format): the
    /// run, its steps, journal, outside writes, decisions, waits and events received; with
    /// --history, its replayable history instead (`trailmark.history/1`, what `replay-check`
    /// reads).
    Export {
        /// Run id.
        run_id: String,
        /// The run's history for `trailmark replay-check`: each position with where the run
        /// went on, the journal, the outside writes in order, events and children received.
        #[arg(long)]
        history: bool,
        /// Write the document to this file instead of stdout.
        #[arg(long, value_name = "FILE")]
        output: Option<std::path::PathBuf>,
    },
    /// Follow a run: its step and attempt, its progress lines and status changes, until it
    /// ends (exit 0 when it succeeded, 1 when it failed, was cancelled or needs review).
    Watch {
        /// Run id.
        run_id: String,
        /// How long to wait for a run that does not exist yet.
        #[arg(long, default_value_t = 60)]
        wait_secs: u64,
    },
    /// List runs, newest first.
    List {
        /// Only runs with this status.
        #[arg(long)]
        status: Option<String>,
        /// Only the child runs of this run.
        #[arg(long)]
        parent: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// At most this many runs.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Resume a run in needs_review at the step that stopped it.
    Resume {
        /// Run id.
        run_id: String,
        /// Reset the failed step's attempts and continue on the run's version if this build
        /// carries it, else on the newest it carries.
        #[arg(long)]
        after_fix: bool,
        /// With --after-fix: set the stopped step's journaled model answers aside (kept, not
        /// replayed) so it asks the model again; for a fix to the prompt or the model.
        #[arg(long, requires = "after_fix")]
        ask_again: bool,
        /// Who decides and why.
        #[command(flatten)]
        who: Who,
    },
    /// Undo a run: compensations of completed steps, newest first (asks unless --yes).
    Undo {
        /// Run id.
        run_id: String,
        /// Only the items this JSON selects, e.g. '{"supplier":"S-07"}'.
        #[arg(long)]
        scope: Option<String>,
        /// Undo although the step that stopped recorded writes no compensation reverses
        /// (listed in the decision; reverse them by hand).
        #[arg(long)]
        leave_partial: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        /// Who decides and why.
        #[command(flatten)]
        who: Who,
    },
    /// Start a new run from this run's checkpoint at a position: the positions before it are
    /// taken over (outputs and journaled answers), the rest runs on the deployed workflow, live
    /// (asks first when it writes outside, unless --yes) or in shadow.
    Fork(super::fork::ForkArgs),
    /// Compare two runs position by position: outputs, model answers, outside writes.
    Diff {
        /// The first run (A).
        a: String,
        /// The second run (B), often a fork of A.
        b: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a run; a step in flight commits nothing.
    Cancel {
        /// Run id.
        run_id: String,
        /// Who decides and why.
        #[command(flatten)]
        who: Who,
    },
    /// Approve the step a waiting run stopped at.
    Approve {
        /// Run id.
        run_id: String,
        /// The step it waits at.
        #[arg(long)]
        step: String,
        /// Who decides and why.
        #[command(flatten)]
        who: Who,
    },
    /// Reject the step a waiting run stopped at.
    Reject {
        /// Run id.
        run_id: String,
        /// The step it waits at.
        #[arg(long)]
        step: String,
        /// Who decides and why.
        #[command(flatten)]
        who: Who,
    },
}

/// Who decides and why (recorded with every decision).
#[derive(Debug, clap::Args)]
pub struct Who {
    /// Why, in your words.
    #[arg(long)]
    pub reason: String,
    /// Who decides (default: $USER).
    #[arg(long, env = "TRAILMARK_ACTOR")]
    pub actor: Option<String>,
    /// Print the outcome as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs one `run` subcommand.
pub async fn dispatch(
    settings: Settings,
    registry: Registry,
    command: RunCommand,
) -> anyhow::Result<()> {
    match command {
        RunCommand::Start(args) => super::run::start(&settings, &registry, args).await,
        RunCommand::Show { run_id, json } => super::run::show(&settings, &run_id, json).await,
        RunCommand::Export {
            run_id,
            history: true,
            output,
        } => super::replay::export(&settings, &run_id, output.as_deref()).await,
        RunCommand::Export { run_id, output, .. } => {
            super::prune::export(&settings, &run_id, output.as_deref()).await
        }
        RunCommand::Watch { run_id, wait_secs } => {
            let pool = trailmark::store::connect(&settings.database).await?;
            // Said at once, not after the wait: a mistyped id should not look like a quiet run.
            if trailmark::store::runs::get(&pool, &run_id).await?.is_none() {
                let missing = super::run::not_found(&settings, &run_id).await;
                eprintln!("{missing}; waiting up to {wait_secs} s for it to appear (--wait-secs)");
            }
            super::watch::watch(&pool, &run_id, wait_secs).await
        }
        RunCommand::Resume {
            run_id,
            after_fix,
            ask_again,
            who,
        } => {
            // clap refuses --ask-again without --after-fix.
            let how = Resume::from_flags(after_fix, ask_again).expect("clap checked the flags");
            decide(settings, registry, &run_id, Decision::Resume(how), who).await
        }
        RunCommand::Undo {
            run_id,
            scope,
            leave_partial,
            yes,
            who,
        } => {
            decide(
                settings,
                registry,
                &run_id,
                Decision::Undo {
                    scope,
                    leave_partial,
                    yes,
                },
                who,
            )
            .await
        }
        RunCommand::Fork(args) => super::fork::fork(settings, registry, args).await,
        RunCommand::Diff { a, b, json } => super::fork::diff(&settings, &a, &b, json).await,
        RunCommand::Cancel { run_id, who } => {
            decide(settings, registry, &run_id, Decision::Cancel, who).await
        }
        RunCommand::Approve { run_id, step, who } => {
            decide(settings, registry, &run_id, Decision::Approve { step }, who).await
        }
        RunCommand::Reject { run_id, step, who } => {
            decide(settings, registry, &run_id, Decision::Reject { step }, who).await
        }
        RunCommand::List {
            status,
            parent,
            json,
            limit,
        } => {
            let filter = (status.as_deref(), parent.as_deref());
            super::run::list(&settings, filter, json, limit).await
        }
    }
}

async fn decide(
    settings: Settings,
    registry: Registry,
    run_id: &str,
    decision: Decision,
    who: Who,
) -> anyhow::Result<()> {
    let decider = Decider::cli(who.actor.unwrap_or_else(decide::default_actor), who.reason);
    decide::decide(settings, registry, run_id, decision, decider, who.json).await
}

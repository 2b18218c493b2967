//! The `trailmark` binary: the command-line definition and dispatch, nothing else.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trailmark::cli::decide::Decision;
use trailmark::cli::{self, serve::Components};
use trailmark::config::Settings;

/// Crash-proof multi-step agent runs over RabbitMQ and a Postgres outbox.
#[derive(Debug, Parser)]
#[command(name = "trailmark", version, about)]
struct Cli {
    /// Extra settings file (TOML), layered over the compiled-in defaults.
    #[arg(long, global = true, env = "TRAILMARK_CONFIG")]
    config: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create the database if missing, apply migrations, declare the broker topology (idempotent).
    Migrate,
    /// Run worker, relay and supervisor in one process.
    Serve,
    /// Run only the step consumer.
    Worker,
    /// Run only the outbox relay.
    Relay,
    /// Run only the lease supervisor.
    Supervisor,
    /// Start, inspect and list runs.
    Run {
        #[command(subcommand)]
        command: RunCommand,
    },
    /// The reference scenario end to end: a worker killed in step 7, a fresh one resumes, figures.
    Demo(cli::demo::DemoArgs),
    /// Print a workflow's recovery contract, derived from its step declarations.
    Contract {
        /// Workflow name.
        workflow: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Inspect, requeue and purge dead letters (poison messages and crash loops).
    Dlq {
        #[command(subcommand)]
        command: cli::dlq::DlqCommand,
    },
    /// Measure throughput, latency, CPU, memory and recovery against the bare-loop baseline B3.
    Bench(cli::bench::BenchArgs),
    /// Run the stand-in OpenAI-compatible model server (for drills and demos).
    ModelServer {
        /// Port on 127.0.0.1 (0 picks a free one).
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Size of each answer in bytes.
        #[arg(long, default_value_t = 64)]
        answer_bytes: usize,
    },
}

impl Command {
    fn is_long_running(&self) -> bool {
        matches!(
            self,
            Self::Serve | Self::Worker | Self::Relay | Self::Supervisor | Self::ModelServer { .. }
        )
    }
}

#[derive(Debug, Subcommand)]
enum RunCommand {
    /// Publish a run-start event, exactly as an upstream service would.
    Start {
        /// Workflow name (e.g. chain).
        workflow: String,
        /// Caller-chosen run id; starting the same id twice starts one run.
        #[arg(long)]
        run_id: String,
        /// Workflow input as JSON.
        #[arg(long)]
        input: Option<String>,
    },
    /// Show a run: status, steps with attempts and timings, journal and effect counts.
    Show {
        /// Run id.
        run_id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List runs, newest first.
    List {
        /// Only runs with this status.
        #[arg(long)]
        status: Option<String>,
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
        /// Reset the failed step's attempts and continue on the workflow version deployed now.
        #[arg(long)]
        after_fix: bool,
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
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        who: Who,
    },
    /// Cancel a run; a step in flight commits nothing.
    Cancel {
        /// Run id.
        run_id: String,
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
        #[command(flatten)]
        who: Who,
    },
}

/// Who decides and why (recorded with every decision).
#[derive(Debug, clap::Args)]
struct Who {
    /// Why, in your words.
    #[arg(long)]
    reason: String,
    /// Who decides (default: $USER).
    #[arg(long, env = "TRAILMARK_ACTOR")]
    actor: Option<String>,
    /// Print the outcome as JSON.
    #[arg(long)]
    json: bool,
}

async fn decide(settings: Settings, registry: trailmark::workflow::Registry, run_id: &str, decision: Decision, who: Who) -> anyhow::Result<()> {
    let decider = trailmark::operator::Decider { actor: who.actor.unwrap_or_else(cli::decide::default_actor), reason: who.reason };
    cli::decide::decide(settings, registry, run_id, decision, decider, who.json).await
}

#[tokio::main]
async fn main() -> ExitCode {
    trailmark::telemetry::init();
    let cli = Cli::parse();
    if !cli.command.is_long_running() {
        // `trailmark run list | head` should end quietly, like any Unix tool, not panic.
        // SAFETY: restoring the default disposition of SIGPIPE before any thread writes.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match dispatch(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(if cli::is_unavailable(&e) { 2 } else { 1 })
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    if let Command::ModelServer { port, answer_bytes } = cli.command {
        let opts = trailmark::standin::model_server::ModelServerOptions {
            port,
            answer_bytes,
            ..Default::default()
        };
        return Ok(trailmark::standin::model_server::serve_forever(opts).await?);
    }
    let settings = Settings::load_from(cli.config.as_deref())?;
    let registry = trailmark::builtin::registry();
    let only = |worker, relay, supervisor| Components {
        worker,
        relay,
        supervisor,
    };
    match cli.command {
        Command::Migrate => cli::migrate::migrate(&settings).await,
        Command::Serve => cli::serve::serve(settings, registry, Components::ALL).await,
        Command::Worker => cli::serve::serve(settings, registry, only(true, false, false)).await,
        Command::Relay => cli::serve::serve(settings, registry, only(false, true, false)).await,
        Command::Supervisor => {
            cli::serve::serve(settings, registry, only(false, false, true)).await
        }
        Command::Run { command } => match command {
            RunCommand::Start {
                workflow,
                run_id,
                input,
            } => cli::run::start(&settings, &registry, &workflow, &run_id, input.as_deref()).await,
            RunCommand::Show { run_id, json } => cli::run::show(&settings, &run_id, json).await,
            RunCommand::Resume { run_id, after_fix, who } => decide(settings, registry, &run_id, Decision::Resume { after_fix }, who).await,
            RunCommand::Undo { run_id, scope, yes, who } => decide(settings, registry, &run_id, Decision::Undo { scope, yes }, who).await,
            RunCommand::Cancel { run_id, who } => decide(settings, registry, &run_id, Decision::Cancel, who).await,
            RunCommand::Approve { run_id, step, who } => decide(settings, registry, &run_id, Decision::Approve { step }, who).await,
            RunCommand::Reject { run_id, step, who } => decide(settings, registry, &run_id, Decision::Reject { step }, who).await,
            RunCommand::List {
                status,
                json,
                limit,
            } => cli::run::list(&settings, status.as_deref(), json, limit).await,
        },
        Command::Demo(args) => cli::demo::run(&settings, args).await,
        Command::Contract { workflow, json } => cli::decide::print_contract(&registry, &workflow, json),
        Command::Dlq { command } => cli::dlq::run(&settings, command).await,
        Command::Bench(args) => cli::bench::run(&settings, args).await,
        Command::ModelServer { .. } => unreachable!("handled above"),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }
}

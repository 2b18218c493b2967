//! The `trailmark` binary: the command-line definition and dispatch, nothing else.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trailmark::config::Settings;

mod cli;
use trailmark::process::Components;

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
    /// Serve only the HTTP surface: the ops API under /api/v1, /livez, /readyz and /metrics.
    Api,
    /// Make API tokens.
    Token {
        #[command(subcommand)]
        command: cli::admin::TokenCommand,
    },
    /// Who did what, when and why (decisions from the CLI and the API, dead-letter actions).
    Audit {
        /// Only entries about this target (a run id, a dead letter's id).
        #[arg(long)]
        target: Option<String>,
        /// At most this many, newest first.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Start, inspect and list runs.
    Run {
        #[command(subcommand)]
        command: cli::runs::RunCommand,
    },
    /// Send events to waiting runs, and list the events kept for waits to come.
    Event {
        #[command(subcommand)]
        command: cli::event::EventCommand,
    },
    /// The reference scenario end to end: a worker killed in step 7, a fresh one resumes, figures.
    Demo(cli::demo::DemoArgs),
    /// Workflow versions: which ones runs in flight still need (`versions`), and the audited
    /// move of runs from one version to another (`move`).
    Workflow {
        #[command(subcommand)]
        command: cli::workflow::WorkflowCommand,
    },
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
    /// Remove finished runs past their keep time (archived first when retention.archive_dir
    /// is set), and aged tombstones, inbox ids and audit rows: what the background pruner does.
    Prune(cli::prune::PruneArgs),
    /// Replay recorded run histories (`run export ID --history`) against the workflows of this
    /// binary, before deploying it: exit 1, naming run, step and difference, when a run would
    /// take another path or call outside systems otherwise. Needs no database or broker.
    ReplayCheck(cli::replay::ReplayArgs),
    /// Concurrency and rate limits of keyed workflows, set at run time; the busiest keys.
    Limit {
        #[command(subcommand)]
        command: cli::limit::LimitCommand,
    },
    /// Start runs on a cadence: create, list, show, pause, resume, trigger, backfill, delete.
    Schedule {
        #[command(subcommand)]
        command: cli::schedule::ScheduleCommand,
    },
    /// Measure throughput, latency, CPU, memory and recovery against the bare-loop baseline B3.
    Bench(cli::bench::BenchArgs),
    /// Drill a workflow: start runs on worker processes the drill owns, inject seeded faults,
    /// and report whether every promise held (exit 1 when one broke).
    Drill(Box<cli::drill::DrillArgs>),
    /// Run the stand-in OpenAI-compatible model server (for drills and demos).
    ModelServer {
        /// Port on 127.0.0.1 (0 picks a free one).
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Size of each answer in bytes.
        #[arg(long, default_value_t = 64)]
        answer_bytes: usize,
        /// Answer 429 past this many requests per sliding minute, as a provider does (0: none).
        #[arg(long, default_value_t = 0)]
        requests_per_minute: u64,
        /// Answer 429 past this many tokens per sliding minute (0: none).
        #[arg(long, default_value_t = 0)]
        tokens_per_minute: u64,
    },
}

impl Command {
    fn is_long_running(&self) -> bool {
        matches!(
            self,
            Self::Serve
                | Self::Worker
                | Self::Relay
                | Self::Supervisor
                | Self::Api
                | Self::ModelServer { .. }
        )
    }
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
    let code = match dispatch(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!: it panics when stderr is gone, and the exit code must still say why.
            let shown: &(dyn std::error::Error + 'static) = e.as_ref();
            let _ = writeln!(
                std::io::stderr(),
                "error: {}",
                trailmark::error::Report(shown)
            );
            ExitCode::from(cli::exit_code(&e))
        }
    };
    trailmark::telemetry::flush(std::time::Duration::from_secs(1));
    code
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    if let Command::ModelServer {
        port,
        answer_bytes,
        requests_per_minute,
        tokens_per_minute,
    } = cli.command
    {
        let opts = trailmark_standin::model_server::ModelServerOptions {
            port,
            answer_bytes,
            requests_per_minute,
            tokens_per_minute,
            ..Default::default()
        };
        return Ok(trailmark_standin::model_server::serve_forever(opts).await?);
    }
    if let Command::Token { command } = cli.command {
        return cli::admin::token(command);
    }
    if let Command::ReplayCheck(args) = cli.command {
        return cli::replay::check(args).await;
    }
    let settings = Settings::load_from(cli.config.as_deref())?;
    let mut registry = trailmark_reference::registry_from_env().map_err(anyhow::Error::msg)?;
    cli::serve::add_remote(&settings, &mut registry, &cli.command).await?;
    let only = |worker, relay, supervisor| Components {
        worker,
        relay,
        supervisor,
    };
    let none = only(false, false, false);
    match cli.command {
        Command::Migrate => cli::migrate::migrate(&settings).await,
        Command::Serve => cli::serve::serve(settings, registry, Components::ALL).await,
        Command::Worker => cli::serve::serve(settings, registry, only(true, false, false)).await,
        Command::Relay => cli::serve::serve(settings, registry, only(false, true, false)).await,
        Command::Supervisor => {
            cli::serve::serve(settings, registry, only(false, false, true)).await
        }
        Command::Api => cli::serve::serve(settings, registry, none).await,
        Command::Audit {
            target,
            limit,
            json,
        } => cli::admin::audit(&settings, target.as_deref(), limit, json).await,
        Command::Run { command } => cli::runs::dispatch(settings, registry, command).await,
        Command::Event { command } => cli::event::dispatch(settings, registry, command).await,
        Command::Demo(args) => cli::demo::run(&settings, args).await,
        Command::Workflow { command } => cli::workflow::run(settings, registry, command).await,
        Command::Contract { workflow, json } => {
            cli::decide::print_contract(&registry, &workflow, json)
        }
        Command::Dlq { command } => cli::dlq::run(&settings, command).await,
        Command::Schedule { command } => cli::schedule::run(settings, registry, command).await,
        Command::Prune(args) => cli::prune::prune(settings, registry, args).await,
        Command::Limit { command } => cli::limit::run(settings, registry, command).await,
        Command::Bench(args) => cli::bench::run(&settings, args).await,
        Command::Drill(args) => cli::drill::run(&settings, registry, *args).await,
        Command::ModelServer { .. } | Command::Token { .. } | Command::ReplayCheck(_) => {
            unreachable!("handled above")
        }
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

//! `trailmark bench`: the benchmark (see the `trailmark_bench` crate); prints a table, or JSON
//! with `--json`. Also the hidden `--b3-worker` role the bench starts its baseline processes with
//! (`--b3-local-answers` for the in-process variant).

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use trailmark::config::Settings;
use trailmark_bench::{self as bench, Config, ModelMode, baseline, peer::Peer};

/// The peers `--peer` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PeerName {
    /// DBOS-Rust, in the `trailmark-peer-dbos` binary next to `trailmark`.
    Dbos,
}

/// Sizes and phases; anything not given comes from the default (or `--quick`) configuration.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Runs per repetition, all started at once [default: 1000; --quick: 20].
    #[arg(long)]
    pub runs: Option<usize>,
    /// Steps per run [default: 10; --quick: 4].
    #[arg(long)]
    pub steps: Option<i32>,
    /// Measured repetitions per system [default: 5; --quick: 1].
    #[arg(long)]
    pub reps: Option<usize>,
    /// Warm-up runs before each repetition [default: 100; --quick: 4].
    #[arg(long)]
    pub warmup_runs: Option<usize>,
    /// Runs started one at a time per repetition, for the unloaded latencies [default: 20; --quick: 3].
    #[arg(long)]
    pub unloaded_runs: Option<usize>,
    /// Processes per system (trailmark `serve`, B3 worker) [default: 1].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Bytes per model answer, served by the stand-in model server over HTTP [default: 2048].
    #[arg(long)]
    pub answer_bytes: Option<usize>,
    /// Use the engine's in-process stand-in answer (64 bytes, no HTTP) instead.
    #[arg(long, conflicts_with = "answer_bytes")]
    pub builtin_model: bool,
    /// Skip the recovery scenarios.
    #[arg(long)]
    pub no_recovery: bool,
    /// Workers' lease in the recovery scenarios, seconds [default: worker.lease_secs; --quick: 3].
    #[arg(long)]
    pub lease_secs: Option<u64>,
    /// Also run the scale phase (trailmark only; long: 100k runs on 2 cores take the better part of an hour).
    #[arg(long)]
    pub scale: bool,
    /// Worker counts of the scale phase [default: 1,2,4].
    #[arg(long, value_delimiter = ',')]
    pub scale_workers: Option<Vec<usize>>,
    /// Run counts of the scale phase [default: 1000,10000,100000].
    #[arg(long, value_delimiter = ',')]
    pub scale_runs: Option<Vec<usize>>,
    /// Postgres pool of each process the bench starts [default: database.max_connections; --quick: 4].
    #[arg(long)]
    pub pool: Option<u32>,
    /// Also measure a peer doing the same work: `dbos` (DBOS-Rust; build it first with
    /// `cargo build --release -p trailmark-peer-dbos`).
    #[arg(long, value_enum)]
    pub peer: Option<PeerName>,
    /// A smoke configuration: tiny sizes, one repetition, a 3 s lease.
    #[arg(long)]
    pub quick: bool,
    /// Instead of the comparison: the step throughput of a load (--runs, --steps, --reps
    /// [default: 1000, 10, 5], --workers) alone and beside --waiting runs that wait or sleep,
    /// then the wake-up lag of --sleepers runs due in the same minute.
    #[arg(long)]
    pub waits: bool,
    /// With --waits: runs waiting for an event or sleeping beside the load [default: 100000].
    #[arg(long, requires = "waits")]
    pub waiting: Option<usize>,
    /// With --waits: runs sleeping 90 s, started at once, whose wake-ups are measured
    /// [default: 10000].
    #[arg(long, requires = "waits")]
    pub sleepers: Option<usize>,
    /// Instead of the comparison: one run that starts --runs child runs of --steps links
    /// [default: 1000, 3] and waits for them, against as many independent runs started at
    /// once, --reps times [default: 3] on --workers processes.
    #[arg(long, conflicts_with = "waits")]
    pub children: bool,
    /// Instead of the comparison: the cost of a concurrency key (--runs `chain` runs of --steps
    /// links [default: 500, 5] without and with a tenant, --reps times [default: 3]) and the
    /// fairness of a full line (a big tenant's --runs runs, then a small tenant's 20, under a
    /// total limit of 4 slots), on --workers processes.
    #[arg(long, conflicts_with_all = ["waits", "children"])]
    pub flow: bool,
    /// Instead of the comparison: step throughput and latency of the default load (--reps
    /// [default: 3]) in an empty database and beside --history-steps finished steps, then
    /// beside `trailmark prune` removing them at its default pace; retention on in both.
    #[arg(long, conflicts_with_all = ["waits", "children", "flow", "peer", "scale"])]
    pub growth: bool,
    /// With --growth: finished steps (with their journal, effects and inbox rows) put in the
    /// history database [default: 10000000; --quick: 4000].
    #[arg(long, requires = "growth")]
    pub history_steps: Option<u64>,
    /// Instead of the comparison: steps in Python against steps in Rust. `chain` and
    /// `pychain` (the same chain, its steps served by the Python SDK's example, started by the
    /// bench) on the same --workers serve processes, one after the other, --reps times
    /// [default: 3]: the default bench's repetition (--runs [default: 500] x --steps,
    /// --warmup-runs, --unloaded-runs) with every ledger row an outside write; steps/s, step
    /// latency (claim to commit) p50 and p95, and Python / Rust. The model is the engine's
    /// in-process stand-in unless --answer-bytes is given.
    #[arg(long, conflicts_with_all = ["waits", "children", "flow", "growth", "peer", "scale"])]
    pub remote: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Run one B3 baseline process (the bench starts these itself).
    #[arg(long, hide = true)]
    pub b3_worker: bool,
    /// With --b3-worker: make the answers in-process (--answer-bytes of them) even when a model
    /// server is configured (the bench's "B3 in-process" column).
    #[arg(long, hide = true, requires = "b3_worker")]
    pub b3_local_answers: bool,
    /// With --b3-worker: the records B3 keeps beside its one statement: bare, journal (every
    /// answer journaled on arrival) or fenced (journal, attempts and fencing), the bench's price
    /// list.
    #[arg(long, hide = true, requires = "b3_worker", default_value = "bare", value_parser = baseline::Promises::parse)]
    pub b3_promises: baseline::Promises,
}

/// Runs the bench (or, with `--b3-worker`, one baseline process) and prints the report.
pub async fn run(settings: &Settings, args: BenchArgs) -> anyhow::Result<()> {
    if args.b3_worker {
        return b3_worker(settings, &args).await;
    }
    if args.waits {
        return waits(settings, &args).await;
    }
    if args.children {
        return children(settings, &args).await;
    }
    if args.flow {
        return flow(settings, &args).await;
    }
    if args.growth {
        return growth(settings, &args).await;
    }
    if args.remote {
        return remote(settings, &args).await;
    }
    let cfg = config(&args)?;
    let report = bench::run(settings, &cfg).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", bench::report::render(&report));
    }
    match &report.scale_failure {
        // After the report: what was measured before the failure is not lost.
        Some(e) => anyhow::bail!(
            "the scale phase stopped early ({e}); the report above has what it measured before"
        ),
        None => Ok(()),
    }
}

/// The configuration the arguments ask for.
pub fn config(args: &BenchArgs) -> anyhow::Result<Config> {
    let mut cfg = if args.quick {
        Config::quick()
    } else {
        Config::default()
    };
    let set = |slot: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *slot = v;
        }
    };
    set(&mut cfg.runs, args.runs);
    set(&mut cfg.reps, args.reps);
    set(&mut cfg.warmup_runs, args.warmup_runs);
    set(&mut cfg.unloaded_runs, args.unloaded_runs);
    set(&mut cfg.workers, args.workers);
    cfg.steps = args.steps.unwrap_or(cfg.steps);
    if args.builtin_model {
        cfg.model = ModelMode::Builtin;
    } else if let Some(answer_bytes) = args.answer_bytes {
        cfg.model = ModelMode::Http { answer_bytes };
    }
    cfg.recovery = !args.no_recovery;
    cfg.lease_secs = args.lease_secs.or(cfg.lease_secs);
    cfg.pool = args.pool.or(cfg.pool);
    cfg.scale = args.scale;
    cfg.scale_workers = args.scale_workers.clone().unwrap_or(cfg.scale_workers);
    cfg.scale_runs = args.scale_runs.clone().unwrap_or(cfg.scale_runs);
    cfg.peer = args.peer.map(|PeerName::Dbos| Peer::Dbos);
    if cfg.runs == 0 || cfg.steps < 2 || cfg.reps == 0 || cfg.workers == 0 {
        anyhow::bail!(
            "--runs, --reps and --workers must be at least 1 and --steps at least 2 (step gaps need two steps)"
        );
    }
    if cfg.pool == Some(0) {
        anyhow::bail!("--pool must be at least 1 (connections per process)");
    }
    if cfg.scale_workers.contains(&0) || cfg.scale_runs.contains(&0) {
        anyhow::bail!("--scale-workers and --scale-runs take positive numbers, e.g. 1,2,4");
    }
    Ok(cfg)
}

/// `--waits`: the load alone and beside waiting runs, then the sleepers' wake-up lag.
async fn waits(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    let mut cfg = bench::waits::WaitsConfig::default();
    cfg.waiting = args.waiting.unwrap_or(cfg.waiting);
    cfg.sleepers = args.sleepers.unwrap_or(cfg.sleepers);
    shape(
        args,
        (
            &mut cfg.runs,
            &mut cfg.steps,
            &mut cfg.reps,
            &mut cfg.workers,
        ),
    )?;
    print_report(args, &bench::waits::run(settings, &cfg).await?)
}

/// `--runs`, `--steps`, `--reps` and `--workers` over a phase's defaults, each at least 1.
fn shape(
    args: &BenchArgs,
    (runs, steps, reps, workers): (&mut usize, &mut i32, &mut usize, &mut usize),
) -> anyhow::Result<()> {
    *runs = args.runs.unwrap_or(*runs);
    *steps = args.steps.unwrap_or(*steps);
    *reps = args.reps.unwrap_or(*reps);
    *workers = args.workers.unwrap_or(*workers);
    anyhow::ensure!(
        *runs > 0 && *steps > 0 && *reps > 0 && *workers > 0,
        "--runs, --steps, --reps and --workers must be at least 1"
    );
    Ok(())
}

/// A phase's report, as JSON with `--json`, else as its table.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    args: &BenchArgs,
    report: &R,
) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}

/// `--children`: a fan-out against as many independent runs.
async fn children(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    let mut cfg = bench::children::ChildrenConfig::default();
    shape(
        args,
        (
            &mut cfg.children,
            &mut cfg.steps,
            &mut cfg.reps,
            &mut cfg.workers,
        ),
    )?;
    anyhow::ensure!(
        cfg.children <= trailmark::domain::MAX_CHILDREN,
        "--runs must be from 1 to {}",
        trailmark::domain::MAX_CHILDREN
    );
    print_report(args, &bench::children::run(settings, &cfg).await?)
}

/// `--flow`: a concurrency key's cost and the fairness of a full line.
async fn flow(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    let mut cfg = bench::flow::FlowConfig::default();
    shape(
        args,
        (
            &mut cfg.runs,
            &mut cfg.steps,
            &mut cfg.reps,
            &mut cfg.workers,
        ),
    )?;
    print_report(args, &bench::flow::run(settings, &cfg).await?)
}

/// `--growth`: the load in an empty database, beside a long history, and beside its pruning.
async fn growth(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    let mut cfg = if args.quick {
        bench::growth::GrowthConfig::quick()
    } else {
        bench::growth::GrowthConfig::default()
    };
    let reps = args.reps.unwrap_or(cfg.load.reps);
    cfg.load = Config {
        reps,
        recovery: false,
        ..config(args)?
    };
    cfg.history_steps = args.history_steps.unwrap_or(cfg.history_steps);
    anyhow::ensure!(cfg.history_steps > 0, "--history-steps must be at least 1");
    print_report(args, &bench::growth::run(settings, &cfg).await?)
}

/// `--remote`: `chain` and `pychain` on one fleet, side by side.
async fn remote(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    let mut cfg = if args.quick {
        bench::remote::RemoteConfig::quick()
    } else {
        bench::remote::RemoteConfig::default()
    };
    // Its own defaults for what it sets differently from the comparison; the flags over them.
    let own = cfg.load.clone();
    let model = match args.answer_bytes {
        Some(answer_bytes) => ModelMode::Http { answer_bytes },
        None => own.model,
    };
    cfg.load = Config {
        runs: args.runs.unwrap_or(own.runs),
        reps: args.reps.unwrap_or(own.reps),
        recovery: false,
        model,
        ..config(args)?
    };
    print_report(args, &bench::remote::run(settings, &cfg).await?)
}

async fn b3_worker(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    let answers = if !args.b3_local_answers && settings.model.is_configured() {
        let client = trailmark::model::ModelClient::new(&settings.model)
            .context("B3 worker: model client")?;
        baseline::Answers::Http(client)
    } else {
        baseline::Answers::Local(args.answer_bytes.unwrap_or(bench::BUILTIN_ANSWER_BYTES))
    };
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            term.recv().await;
        }
        stop.cancel();
    });
    Ok(baseline::serve(settings.clone(), answers, args.b3_promises, shutdown).await?)
}

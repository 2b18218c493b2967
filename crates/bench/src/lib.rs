//! `trailmark bench`: throughput, latency, CPU, memory and recovery of the `chain` workflow on
//! real `trailmark` processes, against B3 (a bare loop with the same step semantics, in
//! [`baseline`]; measured twice, with its model answers over HTTP and made in-process) and, opt-in,
//! a DBOS-Rust peer doing the same work ([`peer`]), in one run on the local servers, in a database
//! and broker prefix of its own.
//!
//! | file | part |
//! |---|---|
//! | `env.rs` | the bench database and prefix, child processes |
//! | `systems.rs` | trailmark, B3 and the peer behind one interface |
//! | `load.rs` | one repetition: warm-up, loaded phase, unloaded phase |
//! | `baseline.rs` | B3 itself |
//! | `breakdown.rs` | where an unloaded trailmark step spends its time |
//! | `measure.rs` | /proc CPU and peak RSS, the fsync probe, summaries |
//! | `peer.rs` | the opt-in DBOS peer: its binary and the contract with it |
//! | `recovery.rs` | kill -9 at 50% progress |
//! | `scale.rs` | 1, 2, 4 workers x 1k, 10k, 100k runs (opt-in) |
//! | `report.rs` | the table, the JSON, the targets |
//! | `window.rs` | a measured window: wall time and CPU by who used it |
//! | `waits.rs` | `--waits`: throughput beside 100k waiting runs, wake-up lag of sleepers |
//! | `children.rs` | `--children`: a fan-out of 1,000 children against 1,000 independent runs |
//! | `flow.rs` | `--flow`: what a concurrency key costs, and the fairness of a full line |
//! | `growth.rs` | `--growth`: steps beside ten million finished ones, and beside pruning them |
//! | `python.rs` | the Python step endpoint (`pychain`) as the bench and the drill run it |
//! | `remote.rs` | `--remote`: steps in Python against steps in Rust, on one fleet |

pub mod baseline;
pub mod breakdown;
pub mod children;
pub mod env;
pub mod flow;
pub mod growth;
pub mod load;
pub mod measure;
pub mod peer;
pub mod python;
pub mod recovery;
pub mod remote;
pub mod report;
pub mod scale;
pub mod systems;
pub mod waits;
pub mod window;

use std::time::Duration;

use env::{BenchEnv, Proc};
use load::RepFigures;
use peer::Peer;
use report::{Report, Setup, Workload};
use systems::System;

use trailmark::config::Settings;

/// Why the bench could not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Postgres failed or is unreachable.
    #[error("the bench lost the database")]
    Store(#[from] trailmark::store::Error),
    /// RabbitMQ failed or is unreachable.
    #[error("the bench lost the broker")]
    Broker(#[from] trailmark::broker::Error),
    /// A measured system misbehaved: a run stopped, progress stalled, a child died.
    #[error("{0}")]
    Failed(String),
    /// Local I/O: /proc, log files, the fsync probe, starting children.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

impl From<lapin::Error> for Error {
    fn from(e: lapin::Error) -> Self {
        Self::Broker(e.into())
    }
}

/// Shorthand for bench results.
pub type Result<T> = std::result::Result<T, Error>;

/// Size of the engine's in-process stand-in answer (`Services::standin_answer_bytes`).
pub const BUILTIN_ANSWER_BYTES: usize = 64;

/// Where model answers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelMode {
    /// The stand-in model server (`trailmark model-server`) over HTTP, answers of this size.
    Http {
        /// Bytes per answer.
        answer_bytes: usize,
    },
    /// The engine's in-process stand-in answer (no model configured), 64 bytes.
    Builtin,
}

/// What to run; [`Config::default`] is the configuration, [`Config::quick`] a smoke run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Runs per repetition, all started at once.
    pub runs: usize,
    /// Steps per run.
    pub steps: i32,
    /// Measured repetitions per system.
    pub reps: usize,
    /// Warm-up runs before each repetition.
    pub warmup_runs: usize,
    /// Runs started one at a time per repetition.
    pub unloaded_runs: usize,
    /// Processes per system.
    pub workers: usize,
    /// Where model answers come from.
    pub model: ModelMode,
    /// Run the recovery scenarios.
    pub recovery: bool,
    /// Lease of the workers in the recovery scenarios (None: the configured lease).
    pub lease_secs: Option<u64>,
    /// Run the scale phase.
    pub scale: bool,
    /// Worker counts of the scale phase.
    pub scale_workers: Vec<usize>,
    /// Run counts of the scale phase.
    pub scale_runs: Vec<usize>,
    /// Writes timed by the fsync probe.
    pub fsync_samples: usize,
    /// Postgres pool of each process the bench starts (None: `database.max_connections`).
    /// A smoke run beside other work (the test suite) must leave the server connections to
    /// spare: a refused connection stalls a worker and skews what is measured.
    pub pool: Option<u32>,
    /// An opt-in peer measured beside trailmark and B3 (`--peer dbos`).
    pub peer: Option<Peer>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            runs: 1000,
            steps: 10,
            reps: 5,
            warmup_runs: 100,
            unloaded_runs: 20,
            workers: 1,
            model: ModelMode::Http { answer_bytes: 2048 },
            recovery: true,
            lease_secs: None,
            scale: false,
            scale_workers: vec![1, 2, 4],
            scale_runs: vec![1_000, 10_000, 100_000],
            fsync_samples: 200,
            pool: None,
            peer: None,
        }
    }
}

impl Config {
    /// Tiny sizes and a 3-second lease: every figure, in well under a minute.
    pub fn quick() -> Self {
        Self {
            runs: 20,
            steps: 4,
            reps: 1,
            warmup_runs: 4,
            unloaded_runs: 3,
            lease_secs: Some(3),
            scale_workers: vec![1, 2],
            scale_runs: vec![20],
            fsync_samples: 20,
            pool: Some(4),
            ..Self::default()
        }
    }

    /// The systems every repetition measures, in the order of odd repetitions: the price list's
    /// B3 variants always, B3 in-process only when B3's answers come over HTTP (with the
    /// built-in model they are in-process already), the peer only when asked for.
    pub fn systems(&self) -> Vec<System> {
        let mut systems = vec![
            System::Trailmark,
            System::TrailmarkEffect,
            System::B3,
            System::B3Journal,
            System::B3Fenced,
        ];
        if matches!(self.model, ModelMode::Http { .. }) {
            systems.push(System::B3Local);
        }
        if self.peer == Some(Peer::Dbos) {
            systems.push(System::Dbos);
        }
        systems
    }

    /// Bytes per model answer.
    pub fn answer_bytes(&self) -> usize {
        match self.model {
            ModelMode::Http { answer_bytes } => answer_bytes,
            ModelMode::Builtin => BUILTIN_ANSWER_BYTES,
        }
    }
}

/// One progress line on stderr.
pub(crate) fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

/// Says so up front when the server cannot hold the processes the bench will start at once:
/// a worker refused its connections retries its deliveries and leaves the work to the others,
/// which would skew every figure (and, in the recovery phase, who holds the leases).
async fn warn_if_short_of_connections(env: &BenchEnv, cfg: &Config) -> Result<()> {
    let processes = if cfg.recovery {
        cfg.workers.max(recovery::PROCESSES)
    } else {
        cfg.workers
    };
    let each = trailmark::store::connections_per_process(env.child_pool);
    let need = processes as i64 * i64::from(each);
    let budget = env.connection_budget().await?;
    if need > budget.free {
        progress(&format!(
            "warning: {budget}; up to {processes} processes of {each} connections each may need \
             {need} but {} are free; lower --pool or raise max_connections",
            budget.free.max(0)
        ));
    }
    Ok(())
}

/// Runs the whole bench in a fresh database and broker prefix, removed at the end (also on
/// Ctrl-C); `base` supplies the servers' URLs and the processes' settings.
pub async fn run(base: &Settings, cfg: &Config) -> Result<Report> {
    if cfg.peer == Some(Peer::Dbos) {
        // Before anything is created: a missing peer binary is a build step, not a bench failure.
        let exe =
            std::env::current_exe().map_err(|e| Error::io("finding the current executable", e))?;
        peer::dbos_binary(&exe)?;
    }
    let mut env = BenchEnv::create(base, cfg.pool).await?;
    progress(&format!(
        "database {}, broker prefix {} (both removed at the end); child logs in {}",
        env.db_name,
        env.prefix,
        env.log_dir.display()
    ));
    let outcome = tokio::select! {
        r = measure_all(&mut env, cfg) => r,
        _ = tokio::signal::ctrl_c() => Err(Error::Failed("interrupted (Ctrl-C); the children were killed".into())),
    };
    for left in env.teardown().await {
        progress(&format!("could not remove {left}; remove it by hand"));
    }
    outcome
}

async fn measure_all(env: &mut BenchEnv, cfg: &Config) -> Result<Report> {
    let (postgres, durability, data_dir) = server_info(env).await?;
    warn_if_short_of_connections(env, cfg).await?;
    let background_cores_before = window::background_cores(window::BACKGROUND_SPAN).await?;
    let fsync = measure::probe_fsync(data_dir.as_deref(), cfg.fsync_samples)?;
    progress(&format!(
        "fsync latency: p50 {:.3} ms, p99 {:.3} ms ({})",
        fsync.p50_ms, fsync.p99_ms, fsync.dir
    ));
    let model = start_model(env, cfg).await?;
    let systems = cfg.systems();
    let mut reps: Vec<(System, Vec<RepFigures>)> =
        systems.iter().map(|s| (*s, Vec::new())).collect();
    for rep in 1..=cfg.reps {
        // Alternate the order, so a drift in the machine's load does not favour one side.
        let mut order = systems.clone();
        if rep % 2 == 0 {
            order.reverse();
        }
        for system in order {
            let figures = load::repetition(env, system, cfg, rep, model.as_ref()).await?;
            if let Some((_, all)) = reps.iter_mut().find(|(s, _)| *s == system) {
                all.push(figures);
            }
        }
    }
    let recovery = if cfg.recovery {
        recovery::run(env, cfg).await?
    } else {
        Vec::new()
    };
    let scale = if cfg.scale {
        scale::run(env, cfg, model.as_ref()).await
    } else {
        (Vec::new(), None)
    };
    drop(model);
    let background_cores_after = window::background_cores(window::BACKGROUND_SPAN).await?;
    let setup = Setup {
        database: env.db_name.clone(),
        broker_prefix: env.prefix.clone(),
        log_dir: env.log_dir.display().to_string(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        postgres,
        durability,
        background_cores_before,
        background_cores_after,
    };
    Ok(build(setup, fsync, env, cfg, &reps, recovery, scale))
}

fn build(
    setup: Setup,
    fsync: measure::FsyncProbe,
    env: &BenchEnv,
    cfg: &Config,
    reps: &[(System, Vec<RepFigures>)],
    recovery: Vec<recovery::Recovery>,
    (scale, scale_failure): (Vec<scale::ScalePoint>, Option<Error>),
) -> Report {
    let model = match cfg.model {
        ModelMode::Http { .. } => {
            "journaled; from the stand-in model server over HTTP (trailmark, B3 and DBOS alike; \
             B3 in-process makes the same answer in-process, no HTTP)"
        }
        ModelMode::Builtin => {
            "journaled; the engine's in-process stand-in answer (B3 and DBOS compute the same answer)"
        }
    };
    let peer = cfg.peer.map(|_| {
        format!(
            "DBOS-Rust (crate dbos 0.5), `trailmark-peer-dbos` processes: runs enqueued onto a DBOS \
             queue with a per-process concurrency of {} (polled every {} ms), each step one DBOS \
             step for the model answer (its recorded output) and one for the ledger insert; \
             DBOS's pool {} + {} for the ledger per process",
            env.settings.worker.concurrency,
            peer::POLL_MS,
            env.child_pool,
            (env.child_pool / 2).max(1)
        )
    });
    let workload = Workload {
        runs: cfg.runs,
        steps: cfg.steps,
        reps: cfg.reps,
        warmup_runs: cfg.warmup_runs,
        unloaded_runs: cfg.unloaded_runs,
        workers: cfg.workers,
        concurrency: env.settings.worker.concurrency,
        pool: env.child_pool,
        model: model.into(),
        answer_bytes: cfg.answer_bytes(),
        peer,
    };
    let mut left_out = vec!["recovery and scale of B3, its variants and DBOS (they are the throughput and latency baselines only)".to_owned()];
    if cfg.peer.is_none() {
        left_out.push(
            "a DBOS-Rust peer (opt-in: --peer dbos, after `cargo build --release -p trailmark-peer-dbos`)"
                .into(),
        );
    }
    if !matches!(cfg.model, ModelMode::Http { .. }) {
        left_out
            .push("B3 in-process (with --builtin-model every answer is in-process already)".into());
    }
    if !cfg.recovery {
        left_out.push("recovery (run without --no-recovery)".into());
    }
    if !cfg.scale {
        left_out.push(
            "scale: 1, 2, 4 workers x 1k, 10k, 100k runs (opt-in: --scale; long on 2 cores)".into(),
        );
    }
    let figures = report::figures(reps);
    Report {
        setup,
        fsync,
        workload,
        price_list: report::price_list(&figures),
        figures,
        breakdown: report::breakdown(report::of(reps, System::Trailmark), &breakdown::SEGMENTS),
        breakdown_effect: report::breakdown(
            report::of(reps, System::TrailmarkEffect),
            &breakdown::SEGMENTS_EFFECT,
        ),
        ledger: report::ledger(reps, cfg.runs, cfg.steps),
        recovery_target: report::recovery_target(&recovery),
        recovery,
        scale,
        scale_failure: scale_failure.map(|e| e.to_string()),
        left_out,
    }
}

/// Postgres' version, its durability settings, and its data directory if we may see it.
async fn server_info(env: &BenchEnv) -> Result<(String, String, Option<String>)> {
    let (version, fsync, sync_commit, method): (String, String, String, String) = sqlx::query_as(
        "SELECT split_part(version(), ' on ', 1), current_setting('fsync'), current_setting('synchronous_commit'), current_setting('wal_sync_method')",
    )
    .fetch_one(&env.pool)
    .await?;
    // Reading data_directory needs pg_read_all_settings; without it the probe uses the temp dir.
    let data_dir: Option<String> = sqlx::query_scalar("SELECT current_setting('data_directory')")
        .fetch_one(&env.pool)
        .await
        .ok();
    let durability =
        format!("fsync={fsync}, synchronous_commit={sync_commit}, wal_sync_method={method}");
    Ok((version, durability, data_dir))
}

/// Starts the stand-in model server for [`ModelMode::Http`] and points every later child at it.
async fn start_model(env: &mut BenchEnv, cfg: &Config) -> Result<Option<Proc>> {
    let ModelMode::Http { answer_bytes } = cfg.model else {
        return Ok(None);
    };
    let bytes = answer_bytes.to_string();
    let proc = env.spawn(
        "model-server",
        &["model-server", "--port", "0", "--answer-bytes", &bytes],
    )?;
    let log = env.log_dir.join("model-server.log");
    let marker = "model server listening on ";
    for _ in 0..500 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(url) = text.lines().find_map(|l| l.strip_prefix(marker)) {
            env.set_child_env("TRAILMARK__MODEL__BASE_URL", url.trim());
            return Ok(Some(proc));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(Error::Failed(format!(
        "the stand-in model server did not start within 10 s; see {}",
        log.display()
    )))
}

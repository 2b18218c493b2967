//! `trailmark bench --waits`: what runs that wait cost the others, and how late sleepers wake.
//!
//! 1. In one of two environments (database and prefix), `--waiting` runs are put to wait
//!    through the engine itself: each does one step, then half wait for an event that never
//!    comes, half sleep for 30 days.
//! 2. The step throughput of `chain` runs (`--runs` runs of `--steps` steps, all started at
//!    once) in the empty environment and beside the waiting runs, in turn, `--reps` times each
//!    (each on `serve` processes started for it).
//! 3. `--sleepers` runs that each sleep 90 s after their first step, started at once so that
//!    their due times fall within about a minute; once all woke, the lag from each due time to
//!    the timer loop's wake-up and to the start of the woken step, p50 and p99.
//!
//! Everything runs on `trailmark serve` processes in databases and broker prefixes of their own.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use super::env::{BenchEnv, Proc};
use super::load::ids;
use super::systems::System;
use super::window::{BACKGROUND_SPAN, background_cores, measured};
use super::{Error, Result, progress};
use trailmark::config::Settings;
use trailmark::domain::{RunId, RunStartEvent};
use trailmark::store::waits;

/// What to run.
#[derive(Debug, Clone)]
pub struct WaitsConfig {
    /// Runs put to wait beside the load (default 100,000).
    pub waiting: usize,
    /// Sleepers due in the same minute (default 10,000).
    pub sleepers: usize,
    /// Runs of the load, all started at once (default 1,000).
    pub runs: usize,
    /// Steps per run of the load (default 10).
    pub steps: i32,
    /// Measured repetitions of the load, without and with the waiting runs (default 5).
    pub reps: usize,
    /// `trailmark serve` processes (default 1).
    pub workers: usize,
}

impl Default for WaitsConfig {
    fn default() -> Self {
        Self {
            waiting: 100_000,
            sleepers: 10_000,
            runs: 1_000,
            steps: 10,
            reps: 5,
            workers: 1,
        }
    }
}

/// What the waits bench measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WaitsReport {
    /// Runs waiting or sleeping beside the load.
    pub waiting: usize,
    /// How long putting them to wait took (s).
    pub seed_secs: f64,
    /// Runs and steps of the load.
    pub load_runs: usize,
    /// Steps per load run.
    pub load_steps: i32,
    /// Steps per second of each repetition with no run waiting.
    pub alone_steps_per_s: Vec<f64>,
    /// Steps per second of each repetition beside the waiting runs.
    pub beside_steps_per_s: Vec<f64>,
    /// Median beside / median alone.
    pub ratio: f64,
    /// The sleepers' wake-up lags.
    pub sleepers: waits::SleepLags,
    /// Cores of this machine.
    pub cores: usize,
    /// Cores other work kept busy before the bench.
    pub background_cores: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() { 0.0 } else { s[s.len() / 2] }
}

/// Runs the waits bench on the servers of `base`, in two environments of its own (one empty,
/// one with the waiting runs), removed after.
pub async fn run(base: &Settings, cfg: &WaitsConfig) -> Result<WaitsReport> {
    let background = background_cores(BACKGROUND_SPAN).await?;
    let mut alone = BenchEnv::create(base, None).await?;
    let mut beside = match BenchEnv::create(base, None).await {
        Ok(env) => env,
        Err(e) => {
            alone.teardown().await;
            return Err(e);
        }
    };
    let result = phases(&mut alone, &mut beside, cfg, background).await;
    for env in [alone, beside] {
        let left = env.teardown().await;
        if !left.is_empty() {
            tracing::warn!(left = ?left, "the waits bench could not remove everything it created");
        }
    }
    result
}

/// `trailmark serve` processes on `env`, consuming.
async fn serve(env: &mut BenchEnv, cfg: &WaitsConfig, tag: &str) -> Result<Vec<Proc>> {
    let pool = env.pool_for(cfg.workers).await?;
    env.set_child_pool(pool);
    let system = System::Trailmark;
    let mut procs = system.spawn(env, cfg.workers, tag, super::BUILTIN_ANSWER_BYTES)?;
    system
        .wait_ready(env, &mut procs, Duration::from_secs(60))
        .await?;
    Ok(procs)
}

async fn stop(procs: &mut [Proc]) {
    for p in procs {
        p.stop(Duration::from_secs(10)).await;
    }
}

/// The load on `env`, on processes started for it and stopped after: steps per second.
async fn load_on(env: &mut BenchEnv, cfg: &WaitsConfig, tag: &str) -> Result<f64> {
    let mut procs = serve(env, cfg, tag).await?;
    let rate = load(env, cfg, tag, &mut procs).await;
    stop(&mut procs).await;
    rate
}

/// The waiting runs put in `beside`, then the load on each environment in turn (which goes
/// first alternates, so a machine that grows busier or quieter weighs on both alike), then the
/// sleepers beside the waiting runs.
async fn phases(
    alone: &mut BenchEnv,
    beside: &mut BenchEnv,
    cfg: &WaitsConfig,
    background: f64,
) -> Result<WaitsReport> {
    let mut report = WaitsReport {
        waiting: cfg.waiting,
        load_runs: cfg.runs,
        load_steps: cfg.steps,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        background_cores: background,
        ..WaitsReport::default()
    };
    let mut procs = serve(beside, cfg, "seed").await?;
    let started = Instant::now();
    let seeded = put_to_wait(beside, cfg.waiting, &mut procs).await;
    stop(&mut procs).await;
    seeded?;
    report.seed_secs = started.elapsed().as_secs_f64();
    // Putting 100,000 runs to wait wrote as many rows into several tables at once; autovacuum
    // would work through them during the first measurements beside them. Both databases are
    // vacuumed and analysed now instead, as they would be long before that many runs had come
    // to wait one by one.
    for env in [&*alone, &*beside] {
        sqlx::raw_sql("VACUUM ANALYZE").execute(&env.pool).await?;
    }
    for rep in 0..cfg.reps {
        let (a, b) = (format!("a{rep}"), format!("b{rep}"));
        if rep % 2 == 0 {
            report
                .alone_steps_per_s
                .push(load_on(alone, cfg, &a).await?);
            report
                .beside_steps_per_s
                .push(load_on(beside, cfg, &b).await?);
        } else {
            report
                .beside_steps_per_s
                .push(load_on(beside, cfg, &b).await?);
            report
                .alone_steps_per_s
                .push(load_on(alone, cfg, &a).await?);
        }
    }
    report.ratio = median(&report.beside_steps_per_s) / median(&report.alone_steps_per_s);
    let mut procs = serve(beside, cfg, "sleepers").await?;
    let lags = sleepers(beside, cfg.sleepers, &mut procs).await;
    stop(&mut procs).await;
    report.sleepers = lags?;
    Ok(report)
}

/// One repetition of the load: steps per second.
async fn load(env: &BenchEnv, cfg: &WaitsConfig, tag: &str, procs: &mut [Proc]) -> Result<f64> {
    let label = format!("load {tag}");
    let w = measured(
        env,
        System::Trailmark,
        &ids(&format!("l{tag}"), cfg.runs),
        cfg.steps,
        &label,
        procs,
        None,
    )
    .await?;
    let rate = (cfg.runs as f64 * cfg.steps as f64) / w.secs;
    progress(&format!("{label}: {rate:.0} steps/s"));
    Ok(rate)
}

/// Start events of `chain` runs `ids` with `input`.
async fn start(env: &BenchEnv, ids: &[String], input: &Value) -> Result<()> {
    let topology = env.topology();
    let msgs = ids
        .iter()
        .map(|id| {
            let run_id =
                RunId::parse(id).map_err(|e| Error::Failed(format!("run id {id}: {e}")))?;
            let event = RunStartEvent::new(run_id, trailmark_testkit::chain::NAME, input.clone());
            Ok(topology.run_start(&event))
        })
        .collect::<Result<Vec<_>>>()?;
    env.publish(&msgs).await
}

/// Puts `n` runs to wait through the engine: each does one step, then half wait for an event
/// no one sends (timeout a day), half sleep 30 days.
async fn put_to_wait(env: &BenchEnv, n: usize, procs: &mut [Proc]) -> Result<()> {
    let (events, sleeps) = (ids("we", n / 2), ids("ws", n - n / 2));
    let wait = json!({"steps": 2, "ledger": "local",
        "wait": {"at": 0, "event": "bench.never", "timeout_secs": 86_400}});
    let sleep = json!({"steps": 2, "ledger": "local", "sleep": {"at": 0, "secs": 2_592_000}});
    for chunk in events.chunks(10_000) {
        start(env, chunk, &wait).await?;
    }
    for chunk in sleeps.chunks(10_000) {
        start(env, chunk, &sleep).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(3_600);
    let mut said = Instant::now();
    loop {
        let open: i64 = waits::open_counts(&env.pool)
            .await?
            .iter()
            .map(|(_, c)| c)
            .sum();
        if open as usize >= n {
            progress(&format!("{n} runs wait"));
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "only {open} of {n} runs waited after an hour; logs in {}",
                env.log_dir.display()
            )));
        }
        if said.elapsed() > Duration::from_secs(5) {
            said = Instant::now();
            progress(&format!("putting runs to wait: {open}/{n}"));
            for p in procs.iter_mut() {
                p.check_alive()?;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `n` runs sleeping 90 s after their first step, started at once; their lags once all woke.
async fn sleepers(env: &BenchEnv, n: usize, procs: &mut [Proc]) -> Result<waits::SleepLags> {
    if n == 0 {
        return Ok(waits::SleepLags::default());
    }
    let sleep = json!({"steps": 2, "ledger": "local", "sleep": {"at": 0, "secs": 90}});
    start(env, &ids("z", n), &sleep).await?;
    // Not `wait_all`: a sleeping run is a run at rest to it, and stopped.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut said = Instant::now();
    loop {
        let p = trailmark::inspect::progress(&env.pool, "z-").await?;
        if p.succeeded >= n as i64 {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "only {} of {n} sleepers finished within 10 minutes; logs in {}",
                p.succeeded,
                env.log_dir.display()
            )));
        }
        if said.elapsed() > Duration::from_secs(5) {
            said = Instant::now();
            progress(&format!("sleepers: {}/{n} done", p.succeeded));
            for proc in procs.iter_mut() {
                proc.check_alive()?;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let lags = waits::sleep_lags(&env.pool, "z-").await?;
    progress(&format!(
        "{} sleepers due over {:.0} s: woken p50 {:.0} ms p99 {:.0} ms; step started p50 {:.0} ms p99 {:.0} ms",
        lags.sleeps,
        lags.due_spread_secs,
        lags.woken_p50 * 1e3,
        lags.woken_p99 * 1e3,
        lags.started_p50 * 1e3,
        lags.started_p99 * 1e3
    ));
    Ok(lags)
}

impl std::fmt::Display for WaitsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rates = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(
            f,
            "machine            {} cores, {:.2} busy with other work before the bench",
            self.cores, self.background_cores
        )?;
        writeln!(
            f,
            "load               {} chain runs x {} steps, started at once",
            self.load_runs, self.load_steps
        )?;
        writeln!(
            f,
            "alone              {} steps/s",
            rates(&self.alone_steps_per_s)
        )?;
        writeln!(
            f,
            "beside {:>7} waiting runs (put to wait in {:.0} s): {} steps/s",
            self.waiting,
            self.seed_secs,
            rates(&self.beside_steps_per_s)
        )?;
        writeln!(
            f,
            "ratio              {:.3} (median beside / median alone; target >= 0.90)",
            self.ratio
        )?;
        let s = &self.sleepers;
        writeln!(
            f,
            "sleepers           {} due over {:.0} s: woken p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; woken step started p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; early {}",
            s.sleeps,
            s.due_spread_secs,
            s.woken_p50 * 1e3,
            s.woken_p99 * 1e3,
            s.woken_max * 1e3,
            s.started_p50 * 1e3,
            s.started_p99 * 1e3,
            s.started_max * 1e3,
            s.early
        )
    }
}

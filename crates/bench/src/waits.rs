//! `trailmark bench --waits`: what runs that wait cost the others, and how late sleepers wake.
//!
//! Three environments (database and broker prefix each):
//! - **empty**: nothing but the load;
//! - **finished**: `--waiting` runs that did one step and ended, the load beside them;
//! - **waiting**: `--waiting` runs that did one step and then wait (half for an event no one
//!   sends, half sleeping 30 days), the load beside them.
//!
//! The runs are put there through the engine itself, then every database is vacuumed and
//! analysed. The load (`--runs` `chain` runs of `--steps` steps, all started at once, on
//! `--workers` `serve` processes started for it and stopped after) runs `--reps` times in each
//! environment, in rotating order, so that a machine that grows busier or quieter weighs on all
//! alike. Waiting against finished is what waiting itself costs the others; waiting against
//! empty adds what 100,000 more runs' rows cost, whatever their state. Last, `--sleepers` runs
//! that each sleep 90 s after their first step, started at once in the waiting environment, so
//! that their due times fall within a minute: the lag from each due time to the timer loop's
//! wake-up and to the claim of the woken step, p50 and p99.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::env::{BenchEnv, Proc, stop_all, with_envs};
use super::load::ids;
use super::measure::Spread;
use super::systems::System;
use super::window::{BACKGROUND_SPAN, background_cores, measured};
use super::{Error, Result, progress};
use trailmark::config::Settings;
use trailmark::inspect;
use trailmark::store::waits;

/// What to run.
#[derive(Debug, Clone)]
pub struct WaitsConfig {
    /// Runs put to wait (and runs finished, for the control) beside the load (default 100,000).
    pub waiting: usize,
    /// Sleepers due in the same minute (default 10,000).
    pub sleepers: usize,
    /// Runs of the load, all started at once (default 1,000).
    pub runs: usize,
    /// Steps per run of the load (default 10).
    pub steps: i32,
    /// Measured repetitions of the load in each environment (default 5).
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
    /// Runs waiting or sleeping beside the load (and finished, in the control).
    pub waiting: usize,
    /// How long putting them to wait took (s).
    pub seed_secs: f64,
    /// Runs of the load.
    pub load_runs: usize,
    /// Steps per load run.
    pub load_steps: i32,
    /// Steps per second of each repetition in the empty database.
    pub empty_steps_per_s: Vec<f64>,
    /// Steps per second of each repetition beside the finished runs.
    pub finished_steps_per_s: Vec<f64>,
    /// Steps per second of each repetition beside the waiting runs.
    pub waiting_steps_per_s: Vec<f64>,
    /// Median beside the waiting runs / median beside the finished ones: what waiting costs.
    pub ratio_vs_finished: f64,
    /// Median beside the waiting runs / median in the empty database.
    pub ratio_vs_empty: f64,
    /// The sleepers' wake-up lags.
    pub sleepers: inspect::SleepLags,
    /// Cores of this machine.
    pub cores: usize,
    /// Cores other work kept busy before the bench.
    pub background_cores: f64,
}

/// The three environments, in the order of [`WaitsReport`]'s columns.
const SIDES: [&str; 3] = ["empty", "finished", "waiting"];

/// Runs the waits bench on the servers of `base`, in environments of its own, removed after.
pub async fn run(base: &Settings, cfg: &WaitsConfig) -> Result<WaitsReport> {
    let background = background_cores(BACKGROUND_SPAN).await?;
    with_envs(base, SIDES.len(), None, async |envs| {
        phases(envs, cfg, background).await
    })
    .await
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

/// `f` on processes started for it on `env` and stopped after, whatever it returned.
async fn on_processes<T>(
    env: &mut BenchEnv,
    cfg: &WaitsConfig,
    tag: &str,
    f: impl AsyncFnOnce(&BenchEnv, &mut [Proc]) -> Result<T>,
) -> Result<T> {
    let mut procs = serve(env, cfg, tag).await?;
    let done = f(env, &mut procs).await;
    stop_all(&mut procs).await;
    done
}

/// The runs put in place, the load in each environment in turn, then the sleepers.
async fn phases(envs: &mut [BenchEnv], cfg: &WaitsConfig, background: f64) -> Result<WaitsReport> {
    let mut report = WaitsReport {
        waiting: cfg.waiting,
        load_runs: cfg.runs,
        load_steps: cfg.steps,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        background_cores: background,
        ..WaitsReport::default()
    };
    let n = cfg.waiting;
    on_processes(&mut envs[1], cfg, "finish", async |env, procs| {
        finished(env, n, procs).await
    })
    .await?;
    let started = Instant::now();
    on_processes(&mut envs[2], cfg, "seed", async |env, procs| {
        put_to_wait(env, n, procs).await
    })
    .await?;
    report.seed_secs = started.elapsed().as_secs_f64();
    // Putting 100,000 runs in place wrote as many rows into several tables at once; autovacuum
    // would work through them during the first measurements beside them. Every database is
    // vacuumed and analysed now instead, as it would be long before that many runs had come to
    // rest one by one.
    for env in envs.iter() {
        sqlx::raw_sql("VACUUM ANALYZE").execute(&env.pool).await?;
    }
    let mut rates: [Vec<f64>; 3] = Default::default();
    for rep in 0..cfg.reps {
        for k in 0..SIDES.len() {
            let side = (rep + k) % SIDES.len();
            let tag = format!("{}{rep}", &SIDES[side][..1]);
            let rate = on_processes(&mut envs[side], cfg, &tag, async |env, procs| {
                load(env, cfg, &tag, procs).await
            })
            .await?;
            rates[side].push(rate);
        }
    }
    let [empty, finished_rates, waiting_rates] = rates;
    let median = |v: &[f64]| Spread::of(v).median;
    report.ratio_vs_empty = median(&waiting_rates) / median(&empty);
    report.ratio_vs_finished = median(&waiting_rates) / median(&finished_rates);
    report.empty_steps_per_s = empty;
    report.finished_steps_per_s = finished_rates;
    report.waiting_steps_per_s = waiting_rates;
    let sleepers = cfg.sleepers;
    report.sleepers = on_processes(&mut envs[2], cfg, "sleepers", async |env, procs| {
        wake_lags(env, sleepers, procs).await
    })
    .await?;
    Ok(report)
}

/// One repetition of the load: steps per second.
async fn load(env: &BenchEnv, cfg: &WaitsConfig, tag: &str, procs: &mut [Proc]) -> Result<f64> {
    let label = format!("load {tag}");
    let ids = ids(&format!("l{tag}"), cfg.runs);
    let w = measured(env, System::Trailmark, &ids, cfg.steps, &label, procs, None).await?;
    let rate = (cfg.runs as f64 * cfg.steps as f64) / w.secs;
    progress(&format!("{label}: {rate:.0} steps/s"));
    Ok(rate)
}

/// Waits (at most an hour) until `done` says `n` runs are in place, saying how far it is.
async fn until_in_place<F, Fut>(
    env: &BenchEnv,
    n: usize,
    what: &str,
    procs: &mut [Proc],
    done: F,
) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<usize>>,
{
    let deadline = Instant::now() + Duration::from_secs(3_600);
    let mut said = Instant::now();
    loop {
        let have = done().await?;
        if have >= n {
            progress(&format!("{n} runs {what}"));
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "only {have} of {n} runs {what} after an hour; logs in {}",
                env.log_dir.display()
            )));
        }
        if said.elapsed() > Duration::from_secs(5) {
            said = Instant::now();
            progress(&format!("{have}/{n} runs {what}"));
            for p in procs.iter_mut() {
                p.check_alive()?;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `n` runs that do one step and end: the control of the waiting runs.
async fn finished(env: &BenchEnv, n: usize, procs: &mut [Proc]) -> Result<()> {
    env.start_chain(&ids("f", n), &json!({"steps": 1, "ledger": "local"}))
        .await?;
    until_in_place(env, n, "finished", procs, || async {
        let p = trailmark::inspect::progress(&env.pool, "f-").await?;
        Ok(p.succeeded as usize)
    })
    .await
}

/// `n` runs that do one step, then half wait for an event no one sends (timeout a day), half
/// sleep 30 days.
async fn put_to_wait(env: &BenchEnv, n: usize, procs: &mut [Proc]) -> Result<()> {
    let wait = json!({"steps": 2, "ledger": "local",
        "wait": {"at": 0, "event": "bench.never", "timeout_secs": 86_400}});
    let sleep = json!({"steps": 2, "ledger": "local", "sleep": {"at": 0, "secs": 2_592_000}});
    env.start_chain(&ids("we", n / 2), &wait).await?;
    env.start_chain(&ids("ws", n - n / 2), &sleep).await?;
    until_in_place(env, n, "wait", procs, || async {
        let open = waits::open_counts(&env.pool).await?;
        Ok(open.iter().map(|(_, c)| *c as usize).sum())
    })
    .await
}

/// `n` runs sleeping 90 s after their first step, started at once; their lags once all woke.
async fn wake_lags(env: &BenchEnv, n: usize, procs: &mut [Proc]) -> Result<inspect::SleepLags> {
    if n == 0 {
        return Ok(inspect::SleepLags::default());
    }
    let sleep = json!({"steps": 2, "ledger": "local", "sleep": {"at": 0, "secs": 90}});
    env.start_chain(&ids("z", n), &sleep).await?;
    // Not `load::wait_all`: to it a sleeping run is one that stopped.
    until_in_place(env, n, "slept and finished", procs, || async {
        let p = trailmark::inspect::progress(&env.pool, "z-").await?;
        Ok(p.succeeded as usize)
    })
    .await?;
    let lags = inspect::sleep_lags(&env.pool, "z-").await?;
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
            "machine      {} cores, {:.2} busy with other work before the bench",
            self.cores, self.background_cores
        )?;
        writeln!(
            f,
            "load         {} chain runs x {} steps, started at once; {} runs beside it ({:.0} s to put them to wait)",
            self.load_runs, self.load_steps, self.waiting, self.seed_secs
        )?;
        writeln!(f, "empty        {} steps/s", rates(&self.empty_steps_per_s))?;
        writeln!(
            f,
            "finished     {} steps/s",
            rates(&self.finished_steps_per_s)
        )?;
        writeln!(
            f,
            "waiting      {} steps/s",
            rates(&self.waiting_steps_per_s)
        )?;
        writeln!(
            f,
            "ratio        waiting/finished {:.3} (what waiting costs; target >= 0.90), waiting/empty {:.3}",
            self.ratio_vs_finished, self.ratio_vs_empty
        )?;
        let s = &self.sleepers;
        writeln!(
            f,
            "sleepers     {} due over {:.0} s: woken p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; woken step started p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; early {}",
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

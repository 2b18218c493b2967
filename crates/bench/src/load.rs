//! One repetition for one system: fresh tables and processes, a warm-up, the loaded phase (all
//! runs started at once; throughput, loaded step gaps, CPU) and the unloaded phase (runs started
//! one at a time; run latency and unloaded step gaps), then peak RSS before the processes stop.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::postgres::PgListener;

use super::breakdown::{self, Breakdown};
use super::env::{BenchEnv, Proc};
use super::systems::System;
use super::window::measured;
use super::{Config, Error, Result, measure, progress};

/// Every figure of one repetition of one system.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RepFigures {
    /// Committed steps per second in the loaded phase.
    pub steps_per_s: f64,
    /// Commit-to-commit gap between consecutive steps of a run, loaded, p50 (ms).
    pub gap_p50_ms: f64,
    /// The same, p99 (ms).
    pub gap_p99_ms: f64,
    /// Commit-to-commit step gap with one run at a time, p50 (ms).
    pub idle_gap_p50_ms: f64,
    /// The same, p99 (ms).
    pub idle_gap_p99_ms: f64,
    /// Run latency with one run at a time, publish of the start to the final commit, p50 (ms).
    pub run_p50_ms: f64,
    /// The same, p99 (ms).
    pub run_p99_ms: f64,
    /// Whole-machine busy CPU per step in the loaded phase, minus the stand-in model server (ms).
    pub cpu_ms_per_step: f64,
    /// CPU of the system's own processes per step (ms).
    pub proc_cpu_ms_per_step: f64,
    /// CPU of the Postgres backends serving them, per step (ms).
    pub pg_cpu_ms_per_step: f64,
    /// CPU of the RabbitMQ node per step (ms).
    pub broker_cpu_ms_per_step: f64,
    /// WAL written per step in the loaded phase, whole cluster (KiB).
    pub wal_kib_per_step: f64,
    /// Peak RSS summed over the system's processes (MiB).
    pub peak_rss_mib: f64,
    /// Where an unloaded step's time goes (trailmark only).
    pub breakdown: Option<Breakdown>,
    /// Ledger rows the loaded phase's runs left (one per step when each write happened once).
    pub ledger_rows: i64,
    /// Distinct references among them.
    pub ledger_distinct: i64,
}

/// Runs one repetition of `system`.
pub async fn repetition(
    env: &BenchEnv,
    system: System,
    cfg: &Config,
    rep: usize,
    model: Option<&Proc>,
) -> Result<RepFigures> {
    system.reset(env).await?;
    let mut procs = system.spawn(env, cfg.workers, &format!("rep{rep}"), cfg.answer_bytes())?;
    // The DBOS peer runs DBOS's migrations at launch and waits for its queue poller to come
    // down to its floor (about 10 s), which takes longer than a consumer's connect.
    system
        .wait_ready(env, &mut procs, Duration::from_secs(90))
        .await?;
    let label = format!("{} rep {rep}/{}", system.name(), cfg.reps);
    let figures = measure_on(env, system, cfg, rep, &label, model, &mut procs).await;
    for p in &mut procs {
        p.stop(Duration::from_secs(10)).await;
    }
    let figures = figures?;
    progress(&format!(
        "{label}: {:.0} steps/s, {:.3} ms CPU/step, run p50 {:.1} ms",
        figures.steps_per_s, figures.cpu_ms_per_step, figures.run_p50_ms
    ));
    Ok(figures)
}

/// One repetition's figures on processes already running, leaving the tables as they are: a
/// warm-up, the unloaded runs, then the loaded phase. Run ids carry `rep`, so that it must differ
/// between repetitions in one database.
pub async fn measure_on(
    env: &BenchEnv,
    system: System,
    cfg: &Config,
    rep: usize,
    label: &str,
    model: Option<&Proc>,
    procs: &mut [Proc],
) -> Result<RepFigures> {
    let warm = ids(&format!("w{rep}"), cfg.warmup_runs);
    drive(
        env,
        system,
        &warm,
        cfg.steps,
        &format!("{label} warm-up"),
        procs,
    )
    .await?;
    // Unloaded first: a burst leaves checkpoint I/O and vacuum work behind that would slow it.
    let mut figures = unloaded_figures(env, system, cfg, rep).await?;
    let loaded = ids(&format!("l{rep}"), cfg.runs);
    let w = measured(
        env,
        system,
        &loaded,
        cfg.steps,
        &format!("{label} loaded"),
        procs,
        model,
    )
    .await?;
    let steps = (cfg.runs * cfg.steps as usize) as f64;
    (figures.gap_p50_ms, figures.gap_p99_ms) = system.step_gaps(env, &format!("l{rep}-")).await?;
    (figures.ledger_rows, figures.ledger_distinct) =
        system.ledger(env, &format!("l{rep}-")).await?;
    figures.steps_per_s = steps / w.secs;
    figures.cpu_ms_per_step = w.machine_ms / steps;
    figures.proc_cpu_ms_per_step = w.procs_ms / steps;
    figures.pg_cpu_ms_per_step = w.postgres_ms / steps;
    figures.broker_cpu_ms_per_step = w.broker_ms / steps;
    figures.wal_kib_per_step = w.wal_bytes / 1024.0 / steps;
    figures.peak_rss_mib = peak_rss_mib(procs)?;
    Ok(figures)
}

/// The unloaded figures: run latency, step gaps and (for trailmark) the step's breakdown.
async fn unloaded_figures(
    env: &BenchEnv,
    system: System,
    cfg: &Config,
    rep: usize,
) -> Result<RepFigures> {
    let mut runs = unloaded(env, system, cfg, rep).await?;
    runs.sort_by(f64::total_cmp);
    let prefix = format!("u{rep}-");
    let (idle_gap_p50_ms, idle_gap_p99_ms) = system.step_gaps(env, &prefix).await?;
    let breakdown = match system {
        System::Trailmark => Some(breakdown::local(env, &prefix).await?),
        System::TrailmarkEffect | System::PyChain => Some(breakdown::effect(env, &prefix).await?),
        _ => None,
    };
    Ok(RepFigures {
        idle_gap_p50_ms,
        idle_gap_p99_ms,
        run_p50_ms: measure::percentile(&runs, 0.5),
        run_p99_ms: measure::percentile(&runs, 0.99),
        breakdown,
        ..RepFigures::default()
    })
}

/// Run ids `<prefix>-0 .. <prefix>-(n-1)`.
pub fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Peak RSS summed over processes, in MiB.
pub fn peak_rss_mib(procs: &[Proc]) -> Result<f64> {
    let mut kib = 0;
    for p in procs {
        kib += p.peak_rss_kib()?;
    }
    Ok(kib as f64 / 1024.0)
}

/// Starts the runs and waits until every one has finished (see [`wait_all`]).
pub async fn drive(
    env: &BenchEnv,
    system: System,
    ids: &[String],
    steps: i32,
    label: &str,
    procs: &mut [Proc],
) -> Result<Duration> {
    if ids.is_empty() {
        return Ok(Duration::ZERO);
    }
    let started = Instant::now();
    system.start_runs(env, ids, steps).await?;
    wait_all(env, system, ids, steps, label, procs).await?;
    Ok(started.elapsed())
}

/// Waits until the runs `ids` names have finished, printing progress on stderr; fails if a run
/// stops unfinished, a process dies, or no step commits for a long time. Progress is read by
/// id, so the poll costs the same however many other runs the tables hold.
pub async fn wait_all(
    env: &BenchEnv,
    system: System,
    ids: &[String],
    steps: i32,
    label: &str,
    procs: &mut [Proc],
) -> Result<()> {
    let runs = ids.len();
    let total = runs as i64 * steps as i64;
    let poll = Duration::from_millis((runs as u64 / 40).clamp(25, 500));
    let started = Instant::now();
    let (mut last_steps, mut last_change, mut last_print) = (-1, Instant::now(), Instant::now());
    loop {
        let p = system.progress_of(env, ids).await?;
        if p.runs_done >= runs as i64 {
            return Ok(());
        }
        if let Some(stopped) = p.stopped {
            return Err(Error::Failed(format!(
                "{label}: run {stopped}; logs in {}",
                env.log_dir.display()
            )));
        }
        if p.steps_done != last_steps {
            (last_steps, last_change) = (p.steps_done, Instant::now());
        } else if last_change.elapsed() > STALL {
            return Err(Error::Failed(format!(
                "{label}: no step committed for {STALL:?} ({}/{total} steps); logs in {}",
                p.steps_done,
                env.log_dir.display()
            )));
        }
        if last_print.elapsed() > Duration::from_secs(2) {
            last_print = Instant::now();
            let rate = p.steps_done as f64 / started.elapsed().as_secs_f64();
            progress(&format!(
                "{label}: {}/{total} steps ({rate:.0}/s)",
                p.steps_done
            ));
            for proc in procs.iter_mut() {
                proc.check_alive()?;
            }
        }
        tokio::time::sleep(poll).await;
    }
}

/// How long without a single committed step before the bench gives up (longer than a lease).
const STALL: Duration = Duration::from_secs(120);

/// Runs started one at a time; each latency is from publishing the start event to the NOTIFY
/// sent by the run's final commit.
async fn unloaded(env: &BenchEnv, system: System, cfg: &Config, rep: usize) -> Result<Vec<f64>> {
    system.watch_done(env, true).await?;
    let mut listener = PgListener::connect_with(&env.pool).await?;
    listener.listen(system.done_channel()).await?;
    let mut latencies = Vec::with_capacity(cfg.unloaded_runs);
    for id in ids(&format!("u{rep}"), cfg.unloaded_runs) {
        let started = Instant::now();
        system
            .start_runs(env, std::slice::from_ref(&id), cfg.steps)
            .await?;
        loop {
            let note = tokio::time::timeout(Duration::from_secs(60), listener.recv())
                .await
                .map_err(|_| {
                    Error::Failed(format!(
                        "{} unloaded run {id} did not finish within 60 s; logs in {}",
                        system.name(),
                        env.log_dir.display()
                    ))
                })??;
            if note.payload() == id {
                break;
            }
        }
        latencies.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    system.watch_done(env, false).await?;
    Ok(latencies)
}

//! Scale (opt-in, `--scale`): trailmark alone with 1, 2, 4 `serve` processes and 1k, 10k, 100k
//! runs started at once, to see whether the cost per step stays flat as the tables and the
//! worker count grow. One repetition per point, after the main comparison's warm-ups.

use std::time::Duration;

use serde::Serialize;

use super::env::{BenchEnv, Proc};
use super::load::{ids, peak_rss_mib};
use super::systems::System;
use super::window::measured;
use super::{Config, Error, Result, progress};

/// One point of the scale phase.
#[derive(Debug, Clone, Serialize)]
pub struct ScalePoint {
    /// `trailmark serve` processes.
    pub workers: usize,
    /// Runs started at once.
    pub runs: usize,
    /// Steps per run.
    pub steps: i32,
    /// Wall time of the point (s).
    pub secs: f64,
    /// Committed steps per second.
    pub steps_per_s: f64,
    /// Whole-machine CPU per step minus the stand-in model server (ms).
    pub cpu_ms_per_step: f64,
    /// CPU of the trailmark processes per step (ms).
    pub proc_cpu_ms_per_step: f64,
    /// CPU of their Postgres backends per step (ms).
    pub pg_cpu_ms_per_step: f64,
    /// CPU of the RabbitMQ node per step (ms).
    pub broker_cpu_ms_per_step: f64,
    /// Peak RSS summed over the trailmark processes (MiB).
    pub peak_rss_mib: f64,
    /// Postgres pool size of each process (kept within the server's connection limit).
    pub pool_per_process: u32,
}

/// Every configured (runs, workers) point, and why the phase stopped early if it did: a long
/// phase keeps what it measured before a failure, so the report can still show it.
pub async fn run(
    env: &mut BenchEnv,
    cfg: &Config,
    model: Option<&Proc>,
) -> (Vec<ScalePoint>, Option<Error>) {
    let mut points = Vec::new();
    let failure = all_points(env, cfg, model, &mut points).await.err();
    env.set_child_pool(env.child_pool);
    (points, failure)
}

async fn all_points(
    env: &mut BenchEnv,
    cfg: &Config,
    model: Option<&Proc>,
    points: &mut Vec<ScalePoint>,
) -> Result<()> {
    for &runs in &cfg.scale_runs {
        for &workers in &cfg.scale_workers {
            points.push(point(env, cfg, model, runs, workers).await?);
        }
    }
    Ok(())
}

async fn point(
    env: &mut BenchEnv,
    cfg: &Config,
    model: Option<&Proc>,
    runs: usize,
    workers: usize,
) -> Result<ScalePoint> {
    let system = System::Trailmark;
    let pool = env.pool_for(workers).await?;
    env.set_child_pool(pool);
    system.reset(env).await?;
    let tag = format!("scale-{runs}x{workers}");
    let mut procs = system.spawn(env, workers, &tag, cfg.answer_bytes())?;
    env.wait_consumers(
        &env.topology().steps_queue(),
        workers as u32,
        Duration::from_secs(30),
    )
    .await?;
    let label = format!("scale {runs} runs, {workers} workers");
    let w = measured(
        env,
        system,
        &ids(&format!("s{runs}x{workers}"), runs),
        cfg.steps,
        &label,
        &mut procs,
        model,
    )
    .await?;
    let steps = (runs * cfg.steps as usize) as f64;
    let peak = peak_rss_mib(&procs)?;
    for p in &mut procs {
        p.stop(Duration::from_secs(10)).await;
    }
    let point = ScalePoint {
        workers,
        runs,
        steps: cfg.steps,
        secs: w.secs,
        steps_per_s: steps / w.secs,
        cpu_ms_per_step: w.machine_ms / steps,
        proc_cpu_ms_per_step: w.procs_ms / steps,
        pg_cpu_ms_per_step: w.postgres_ms / steps,
        broker_cpu_ms_per_step: w.broker_ms / steps,
        peak_rss_mib: peak,
        pool_per_process: pool,
    };
    progress(&format!(
        "{label}: {:.0} steps/s, {:.3} ms CPU/step",
        point.steps_per_s, point.cpu_ms_per_step
    ));
    Ok(point)
}

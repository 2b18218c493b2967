//! `trailmark bench --children`: one run whose step starts `--runs` child `chain` runs of
//! `--steps` links and waits for them all, against as many independent `chain` runs of the
//! same length started at once as `trailmark run start` starts one (a run-start event each),
//! on the same `--workers` `serve` processes, `--reps` times in turn.
//!
//! The fan-out's time is from the commit of the parent's step that started the children to the
//! join that moved it on; the independent runs' is from the first one's creation to the last
//! one's end; both on the database clock.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::env::{BenchEnv, Proc};
use super::load::ids;
use super::systems::System;
use super::window::{BACKGROUND_SPAN, background_cores};
use super::{Error, Result, progress};
use trailmark::config::Settings;
use trailmark::inspect;

/// What to run.
#[derive(Debug, Clone)]
pub struct ChildrenConfig {
    /// Children of the fan-out, and independent runs (default 1,000).
    pub children: usize,
    /// Links of each (default 3).
    pub steps: i32,
    /// Repetitions of each, in turn (default 3).
    pub reps: usize,
    /// `trailmark serve` processes (default 1).
    pub workers: usize,
}

impl Default for ChildrenConfig {
    fn default() -> Self {
        Self {
            children: 1_000,
            steps: 3,
            reps: 3,
            workers: 1,
        }
    }
}

/// What the children bench measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChildrenReport {
    /// Children per fan-out, and independent runs per repetition.
    pub children: usize,
    /// Links of each.
    pub steps: i32,
    /// `serve` processes.
    pub workers: usize,
    /// Seconds from the fan-out step's commit to the join, per repetition.
    pub fan_out_secs: Vec<f64>,
    /// Seconds from the first independent run's creation to the last one's end.
    pub independent_secs: Vec<f64>,
    /// Cores of this machine.
    pub cores: usize,
    /// Cores other work kept busy before the bench.
    pub background_cores: f64,
}

/// Runs the children bench on the servers of `base`, in an environment of its own, removed
/// after.
pub async fn run(base: &Settings, cfg: &ChildrenConfig) -> Result<ChildrenReport> {
    let mut report = ChildrenReport {
        children: cfg.children,
        steps: cfg.steps,
        workers: cfg.workers,
        ..ChildrenReport::default()
    };
    let (cores, background) = with_servers(base, cfg.workers, "children", async |env, procs| {
        reps(env, cfg, procs, &mut report).await
    })
    .await?;
    (report.cores, report.background_cores) = (cores, background);
    Ok(report)
}

/// Runs `work` against `workers` `trailmark serve` processes in a bench environment of its own
/// (removed after, whatever `work` did); the machine's cores and the cores other work kept busy
/// before it started.
pub async fn with_servers(
    base: &Settings,
    workers: usize,
    label: &str,
    work: impl AsyncFnOnce(&BenchEnv, &mut [Proc]) -> Result<()>,
) -> Result<(usize, f64)> {
    let background = background_cores(BACKGROUND_SPAN).await?;
    let mut env = BenchEnv::create(base, None).await?;
    let done = serve(&mut env, workers, label, work).await;
    let left = env.teardown().await;
    if !left.is_empty() {
        tracing::warn!(left = ?left, "the {label} bench could not remove everything it created");
    }
    done?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok((cores, background))
}

async fn serve(
    env: &mut BenchEnv,
    workers: usize,
    label: &str,
    work: impl AsyncFnOnce(&BenchEnv, &mut [Proc]) -> Result<()>,
) -> Result<()> {
    let pool = env.pool_for(workers).await?;
    env.set_child_pool(pool);
    let system = System::Trailmark;
    let mut procs = system.spawn(env, workers, label, super::BUILTIN_ANSWER_BYTES)?;
    system
        .wait_ready(env, &mut procs, Duration::from_secs(60))
        .await?;
    let done = work(env, &mut procs).await;
    for p in &mut procs {
        p.stop(Duration::from_secs(10)).await;
    }
    done
}

async fn reps(
    env: &BenchEnv,
    cfg: &ChildrenConfig,
    procs: &mut [Proc],
    report: &mut ChildrenReport,
) -> Result<()> {
    let n = cfg.children;
    let said = |what: &str, secs: f64, unit: &str| {
        progress(&format!(
            "{what}: {n} {unit} in {secs:.2} s ({:.0} {unit}/s)",
            n as f64 / secs
        ));
        secs
    };
    for rep in 0..cfg.reps {
        let secs = fan_out(env, cfg, &format!("f{rep}"), procs).await?;
        report
            .fan_out_secs
            .push(said(&format!("fan-out {rep}"), secs, "children"));
        let secs = independent(env, cfg, &format!("i{rep}"), procs).await?;
        report
            .independent_secs
            .push(said(&format!("independent {rep}"), secs, "runs"));
    }
    Ok(())
}

/// One parent whose first link starts the children; seconds to its join.
async fn fan_out(
    env: &BenchEnv,
    cfg: &ChildrenConfig,
    id: &str,
    procs: &mut [Proc],
) -> Result<f64> {
    let input =
        json!({"steps": 2, "children": {"at": 0, "count": cfg.children, "steps": cfg.steps}});
    env.start_chain(&[id.to_owned()], &input).await?;
    let label = format!("fan-out {id}");
    until(env, &label, procs, async || {
        inspect::fan_out_span(&env.pool, id, 0)
            .await
            .map_err(Error::from)
    })
    .await
}

/// As many independent runs, started at once; seconds from the first's creation to the last's
/// end.
async fn independent(
    env: &BenchEnv,
    cfg: &ChildrenConfig,
    tag: &str,
    procs: &mut [Proc],
) -> Result<f64> {
    let ids = ids(tag, cfg.children);
    env.start_chain(&ids, &json!({"steps": cfg.steps})).await?;
    let prefix = format!("{tag}-");
    let n = cfg.children as i64;
    until(env, tag, procs, async || {
        let (done, span) = inspect::runs_span(&env.pool, &prefix).await?;
        Ok(span.filter(|_| done >= n))
    })
    .await
}

/// Polls `probe` until it gives the figure (at most ten minutes), checking the processes live.
pub async fn until(
    env: &BenchEnv,
    label: &str,
    procs: &mut [Proc],
    probe: impl AsyncFn() -> Result<Option<f64>>,
) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Some(secs) = probe().await? {
            return Ok(secs);
        }
        for p in procs.iter_mut() {
            p.check_alive()?;
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "{label}: not done within 10 minutes; logs in {}",
                env.log_dir.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl std::fmt::Display for ChildrenReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let each = |v: &[f64]| {
            v.iter()
                .map(|s| format!("{s:.2} s ({:.0}/s)", self.children as f64 / s))
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(
            f,
            "machine      {} cores, {:.2} busy with other work before the bench; {} serve process(es)",
            self.cores, self.background_cores, self.workers
        )?;
        writeln!(
            f,
            "fan-out      {} children x {} links, step commit to join: {}",
            self.children,
            self.steps,
            each(&self.fan_out_secs)
        )?;
        writeln!(
            f,
            "independent  {} runs x {} links, first created to last ended: {}",
            self.children,
            self.steps,
            each(&self.independent_secs)
        )
    }
}

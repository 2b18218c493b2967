//! `trailmark bench --flow`: what a concurrency key costs and how fairly a full line is served.
//!
//! Cost: `--runs` `chain` runs of `--steps` links without a tenant (no gate) against as many
//! with one (a run's first step claims a slot of its key in the claim's transaction, each
//! step's end asks whether a run waits that should go first, the run's end hands its slot on),
//! the key's limit set to `--runs` so that it does not bind, `--reps` times in turn; steps per
//! second from the first run's creation to the last one's end.
//!
//! Fairness: the workflow's total limit set below what the fleet could run (`TOTAL` slots), a
//! big tenant starts `--runs` runs, then a small one `SMALL` runs; each step's wait (from the
//! end of the run's previous step, or its creation, to its claim) per tenant, p50 and p99.

use serde::Serialize;
use serde_json::json;

use super::children::{until, with_servers};
use super::env::{BenchEnv, Proc};
use super::load::ids;
use super::{Result, progress};
use trailmark::config::Settings;
use trailmark::inspect;
use trailmark::store::flow::{self, LimitChange};

/// Slots of the whole workflow in the fairness phase.
pub const TOTAL: i32 = 4;
/// Runs of the small tenant in the fairness phase.
pub const SMALL: usize = 20;

/// What to run.
#[derive(Debug, Clone)]
pub struct FlowConfig {
    /// Runs per repetition, and the big tenant's runs (default 500).
    pub runs: usize,
    /// Links of each (default 5).
    pub steps: i32,
    /// Repetitions of the cost phase (default 3).
    pub reps: usize,
    /// `trailmark serve` processes (default 1).
    pub workers: usize,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            runs: 500,
            steps: 5,
            reps: 3,
            workers: 1,
        }
    }
}

/// One tenant's step waits in the fairness phase, milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Waits {
    /// Steps measured.
    pub steps: usize,
    /// Median wait.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

/// What the flow bench measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FlowReport {
    /// Runs per repetition.
    pub runs: usize,
    /// Links of each.
    pub steps: i32,
    /// `serve` processes.
    pub workers: usize,
    /// Steps per second without a key, per repetition.
    pub unkeyed_steps_per_sec: Vec<f64>,
    /// Steps per second with a key, per repetition.
    pub keyed_steps_per_sec: Vec<f64>,
    /// The big tenant's step waits.
    pub big: Waits,
    /// The small tenant's.
    pub small: Waits,
    /// Cores of this machine.
    pub cores: usize,
    /// Cores other work kept busy before the bench.
    pub background_cores: f64,
}

/// Runs the flow bench on the servers of `base`, in an environment of its own, removed after.
pub async fn run(base: &Settings, cfg: &FlowConfig) -> Result<FlowReport> {
    let mut report = FlowReport {
        runs: cfg.runs,
        steps: cfg.steps,
        workers: cfg.workers,
        ..FlowReport::default()
    };
    let (cores, background) = with_servers(base, cfg.workers, "flow", async |env, procs| {
        phases(env, cfg, procs, &mut report).await
    })
    .await?;
    (report.cores, report.background_cores) = (cores, background);
    Ok(report)
}

async fn phases(
    env: &BenchEnv,
    cfg: &FlowConfig,
    procs: &mut [Proc],
    report: &mut FlowReport,
) -> Result<()> {
    let steps = (cfg.runs as f64) * f64::from(cfg.steps);
    // A limit that does not bind: what the gate itself costs, not the waiting it imposes.
    let roomy = LimitChange {
        concurrency: Some(i32::try_from(cfg.runs).unwrap_or(i32::MAX)),
        total: None,
        rate: None,
    };
    flow::set_limit(&env.pool, ("chain", ""), &roomy, "bench").await?;
    for rep in 0..cfg.reps {
        let plain = json!({"steps": cfg.steps});
        let secs = batch(env, &format!("u{rep}"), cfg.runs, &plain, procs).await?;
        progress(&format!("unkeyed {rep}: {:.0} steps/s", steps / secs));
        report.unkeyed_steps_per_sec.push(steps / secs);
        let keyed = json!({"steps": cfg.steps, "tenant": format!("t{rep}")});
        let secs = batch(env, &format!("k{rep}"), cfg.runs, &keyed, procs).await?;
        progress(&format!("keyed {rep}: {:.0} steps/s", steps / secs));
        report.keyed_steps_per_sec.push(steps / secs);
    }
    fairness(env, cfg, procs, report).await
}

/// Starts `n` runs with `input`; seconds from the first's creation to the last's end.
async fn batch(
    env: &BenchEnv,
    tag: &str,
    n: usize,
    input: &serde_json::Value,
    procs: &mut [Proc],
) -> Result<f64> {
    env.start_chain(&ids(tag, n), input).await?;
    let prefix = format!("{tag}-");
    until(env, tag, procs, async || {
        let (done, span) = inspect::runs_span(&env.pool, &prefix).await?;
        Ok(span.filter(|_| done >= n as i64))
    })
    .await
}

async fn fairness(
    env: &BenchEnv,
    cfg: &FlowConfig,
    procs: &mut [Proc],
    report: &mut FlowReport,
) -> Result<()> {
    let every = LimitChange {
        concurrency: Some(TOTAL),
        total: Some(TOTAL),
        rate: None,
    };
    flow::set_limit(&env.pool, ("chain", ""), &every, "bench").await?;
    env.start_chain(
        &ids("fb", cfg.runs),
        &json!({"steps": cfg.steps, "tenant": "big"}),
    )
    .await?;
    // The small tenant comes once the big one fills the line.
    until(env, "the big tenant's line", procs, async || {
        let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.flow_waiters")
            .fetch_one(&env.pool)
            .await
            .map_err(trailmark::store::Error::from)?;
        Ok((waiting >= TOTAL as i64).then_some(0.0))
    })
    .await?;
    env.start_chain(
        &ids("fs", SMALL),
        &json!({"steps": cfg.steps, "tenant": "small"}),
    )
    .await?;
    let total = (cfg.runs + SMALL) as i64;
    until(env, "the fairness runs", procs, async || {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM trailmark.runs WHERE status = 'succeeded' AND flow_key IN ('big', 'small')",
        )
        .fetch_one(&env.pool)
        .await
        .map_err(trailmark::store::Error::from)?;
        Ok((done >= total).then_some(0.0))
    })
    .await?;
    report.big = waits(env, "big").await?;
    report.small = waits(env, "small").await?;
    progress(&format!(
        "fairness: small tenant's step waits p50 {:.0} ms, p99 {:.0} ms; big tenant's p50 {:.0} ms, p99 {:.0} ms",
        report.small.p50_ms, report.small.p99_ms, report.big.p50_ms, report.big.p99_ms
    ));
    Ok(())
}

/// A tenant's step waits: each step's claim after the end of the run's previous step (or the
/// run's creation), on the database clock.
async fn waits(env: &BenchEnv, tenant: &str) -> Result<Waits> {
    let (steps, p50, p99): (i64, Option<f64>, Option<f64>) = sqlx::query_as(
        "WITH w AS (
             SELECT EXTRACT(EPOCH FROM s.started_at - COALESCE(
                        lag(s.finished_at) OVER (PARTITION BY s.run_id ORDER BY s.seq), r.created_at)) * 1000 AS ms
               FROM trailmark.steps s JOIN trailmark.runs r USING (run_id)
              WHERE r.flow_key = $1
         )
         SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY ms),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)
           FROM w",
    )
    .bind(tenant)
    .fetch_one(&env.pool)
    .await
    .map_err(trailmark::store::Error::from)?;
    Ok(Waits {
        steps: steps as usize,
        p50_ms: p50.unwrap_or_default(),
        p99_ms: p99.unwrap_or_default(),
    })
}

impl std::fmt::Display for FlowReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let each = |v: &[f64]| {
            v.iter()
                .map(|s| format!("{s:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let median = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or_default()
        };
        let (u, k) = (
            median(&self.unkeyed_steps_per_sec),
            median(&self.keyed_steps_per_sec),
        );
        writeln!(
            f,
            "machine      {} cores, {:.2} busy with other work before the bench; {} serve process(es)",
            self.cores, self.background_cores, self.workers
        )?;
        writeln!(
            f,
            "unkeyed      {} runs x {} links: {} steps/s",
            self.runs,
            self.steps,
            each(&self.unkeyed_steps_per_sec)
        )?;
        writeln!(
            f,
            "keyed        {} runs x {} links: {} steps/s",
            self.runs,
            self.steps,
            each(&self.keyed_steps_per_sec)
        )?;
        writeln!(
            f,
            "cost         median keyed / unkeyed = {:.2}",
            if u > 0.0 { k / u } else { 0.0 }
        )?;
        writeln!(
            f,
            "fairness     total limit {TOTAL}: big tenant ({} runs) step waits p50 {:.0} ms, p99 {:.0} ms; small ({SMALL} runs, started after) p50 {:.0} ms, p99 {:.0} ms",
            self.runs, self.big.p50_ms, self.big.p99_ms, self.small.p50_ms, self.small.p99_ms
        )
    }
}

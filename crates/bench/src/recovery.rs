//! Recovery: `kill -9` of a worker process at 50% progress, then the time from the kill to the
//! next committed step (any run) and to the first commit of every run the killed worker held a
//! lease on when it died ("stranded" runs: they wait until another worker sees the process gone
//! through its presence connection, or at worst for the lease to expire). Two scenarios: a second
//! worker is alive, or the only worker is restarted at once. Timestamps come from the database
//! (same host clock); the ledger is checked afterwards: one row per step, no duplicates.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::env::{BenchEnv, Proc};
use super::load::{ids, wait_all};
use super::systems::System;
use super::{Config, Error, Result, progress};
use trailmark::engine::lease_owner_pid;
use trailmark::inspect;

/// The figures of one recovery scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// What was killed and what was left.
    pub scenario: String,
    /// Runs x steps of `chain`.
    pub runs: usize,
    /// Steps per run.
    pub steps: i32,
    /// The workers' lease (the upper bound of a stranded run's wait).
    pub lease_secs: u64,
    /// Steps committed when the kill happened.
    pub killed_at_steps: i64,
    /// Kill to the next step commit of any run (ms).
    pub next_commit_ms: f64,
    /// Runs whose lease the killed worker held.
    pub stranded_runs: usize,
    /// Kill to the first stranded run's next commit (ms).
    pub stranded_first_ms: f64,
    /// Kill to the last stranded run's next commit (ms); includes its wait behind a queued backlog.
    pub stranded_all_ms: f64,
    /// Ledger rows and distinct references after all runs finished (both should be runs x steps).
    pub ledger_rows: i64,
    /// Distinct ledger references.
    pub ledger_distinct: i64,
}

/// Processes a scenario runs at once: two workers (one killed), a relay and a supervisor.
pub const PROCESSES: usize = 4;

/// Fewest runs a scenario starts. With group commit a worker moves dozens of steps per batch,
/// so a handful of runs (`--quick`) could all finish between reaching 50% and the kill, leaving
/// nothing to recover.
const MIN_RUNS: usize = 200;

/// Both scenarios, one after the other.
pub async fn run(env: &mut BenchEnv, cfg: &Config) -> Result<Vec<Recovery>> {
    let lease = cfg.lease_secs.unwrap_or(env.settings.worker.lease_secs);
    if let Some(l) = cfg.lease_secs {
        env.set_child_env("TRAILMARK__WORKER__LEASE_SECS", &l.to_string());
        env.set_child_env(
            "TRAILMARK__WORKER__HEARTBEAT_SECS",
            &(l / 3).max(1).to_string(),
        );
    }
    let mut both = Vec::new();
    let mut outcome = Ok(());
    for second_alive in [true, false] {
        match scenario(env, cfg, lease, second_alive).await {
            Ok(r) => both.push(r),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    env.remove_child_env("TRAILMARK__WORKER__LEASE_SECS");
    env.remove_child_env("TRAILMARK__WORKER__HEARTBEAT_SECS");
    outcome.map(|()| both)
}

async fn scenario(
    env: &BenchEnv,
    cfg: &Config,
    lease_secs: u64,
    second_alive: bool,
) -> Result<Recovery> {
    let system = System::Trailmark;
    system.reset(env).await?;
    let tag = if second_alive { "rec2" } else { "rec1" };
    let n = if second_alive { 2 } else { 1 };
    let mut procs: Vec<Proc> = (0..n)
        .map(|i| env.spawn(&format!("{tag}-worker-{i}"), &["worker"]))
        .collect::<Result<_>>()?;
    procs.push(env.spawn(&format!("{tag}-relay"), &["relay"])?);
    procs.push(env.spawn(&format!("{tag}-supervisor"), &["supervisor"])?);
    env.wait_consumers(
        &env.topology().steps_queue(),
        n as u32,
        Duration::from_secs(30),
    )
    .await?;
    let prefix = format!("{tag}-");
    let runs = cfg.runs.max(MIN_RUNS);
    system.start_runs(env, &ids(tag, runs), cfg.steps).await?;
    let total = runs as i64 * cfg.steps as i64;
    let label = format!(
        "recovery ({})",
        if second_alive {
            "second worker alive"
        } else {
            "worker restarted"
        }
    );
    let killed_at_steps = wait_half(env, &prefix, total, &label).await?;
    let (index, stranded) =
        freeze_holding_leases(env, &mut procs[..n], &prefix, runs, &label).await?;
    let mut victim = procs.remove(index);
    let pid = victim.pid();
    // The other worker runs again before the kill, as it would in production; the victim stays
    // frozen, so the runs it holds commit nothing before this instant, taken before the signal.
    for p in &procs[..n - 1] {
        p.thaw();
    }
    let killed_at = Utc::now();
    victim.kill9();
    if !second_alive {
        procs.push(env.spawn(&format!("{tag}-worker-restarted"), &["worker"])?);
    }
    progress(&format!(
        "{label}: killed worker pid {pid} at {killed_at_steps}/{total} steps; it held {} leases",
        stranded.len()
    ));
    wait_all(env, system, &ids(tag, runs), cfg.steps, &label, &mut procs).await?;
    let next_commit_ms = first_commit_after(env, &prefix, killed_at).await?;
    let resumed = resumed_after(env, &stranded, killed_at).await?;
    let (ledger_rows, ledger_distinct) = ledger(env, &prefix).await?;
    for p in &mut procs {
        p.stop(Duration::from_secs(10)).await;
    }
    let scenario = if second_alive {
        "kill -9 of one of two workers at 50% progress"
    } else {
        "kill -9 of the only worker at 50% progress, a new one started at once"
    };
    Ok(Recovery {
        scenario: scenario.into(),
        runs,
        steps: cfg.steps,
        lease_secs,
        killed_at_steps,
        next_commit_ms,
        stranded_runs: stranded.len(),
        stranded_first_ms: resumed.first().copied().unwrap_or(0.0),
        stranded_all_ms: resumed.last().copied().unwrap_or(0.0),
        ledger_rows,
        ledger_distinct,
    })
}

async fn wait_half(env: &BenchEnv, prefix: &str, total: i64, label: &str) -> Result<i64> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let p = System::Trailmark.progress(env, prefix).await?;
        if p.steps_done * 2 >= total {
            return Ok(p.steps_done);
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "{label}: 50% progress not reached in 10 minutes ({}/{total})",
                p.steps_done
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Freezes every worker at a moment when one of them holds leases, and returns the one holding
/// the most (the victim) with the runs it holds; all are left frozen, for the caller to thaw
/// the others.
///
/// Read under SIGSTOP rather than just before the kill: a live worker takes a dead process's
/// leases within milliseconds (its presence connection is gone), so a query after the kill
/// finds few of them, and on a loaded machine a running victim could finish every lease it holds
/// (or the whole load) between a query and the kill, leaving no recovery to measure. The victim
/// is chosen by what it holds, not in advance: on a busy CI machine one worker can end up with
/// all the work (a slow start, or its connections refused), and killing the idle one would
/// measure nothing.
async fn freeze_holding_leases(
    env: &BenchEnv,
    workers: &mut [Proc],
    prefix: &str,
    runs: usize,
    label: &str,
) -> Result<(usize, Vec<String>)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for w in workers.iter_mut() {
            w.check_alive()?;
            w.freeze();
        }
        let leases = leases(env, prefix).await?;
        let (index, most) = workers
            .iter()
            .map(|w| held_by(&leases, w.pid()))
            .enumerate()
            .max_by_key(|(_, runs)| runs.len())
            .unwrap_or_default();
        if !most.is_empty() {
            return Ok((index, most));
        }
        for w in workers.iter() {
            w.thaw();
        }
        if System::Trailmark.progress(env, prefix).await?.runs_done >= runs as i64 {
            return Err(Error::Failed(format!(
                "{label}: every run finished before a worker was seen holding a lease; \
                 start more runs (--runs) so that work remains at 50%"
            )));
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "{label}: no worker held a lease for 60 s while runs remained; see the workers' \
                 logs in {} (refused database connections, an open circuit breaker?)",
                env.log_dir.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every lease on the scenario's runs, as (run, owner): one read for all workers, while they
/// are frozen.
async fn leases(env: &BenchEnv, prefix: &str) -> Result<Vec<(String, String)>> {
    Ok(inspect::lease_owners(&env.pool, prefix)
        .await?
        .into_iter()
        .map(|l| (l.run_id, l.owner))
        .collect())
}

/// The runs among `leases` that the process `pid` holds.
fn held_by(leases: &[(String, String)], pid: u32) -> Vec<String> {
    leases
        .iter()
        .filter(|(_, owner)| lease_owner_pid(owner) == Some(pid))
        .map(|(run, _)| run.clone())
        .collect()
}

/// Milliseconds from `from` to `to`.
fn ms_between(from: DateTime<Utc>, to: DateTime<Utc>) -> f64 {
    (to - from).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
}

async fn first_commit_after(env: &BenchEnv, prefix: &str, at: DateTime<Utc>) -> Result<f64> {
    let next = inspect::first_commit_after(&env.pool, Some(prefix), at).await?;
    next.map(|t| ms_between(at, t)).ok_or_else(|| {
        Error::Failed(format!(
            "recovery: no step of the runs {prefix}* committed after the kill; \
             see the workers' logs"
        ))
    })
}

/// For each stranded run, kill to its first commit after the kill (ms), sorted.
async fn resumed_after(env: &BenchEnv, runs: &[String], at: DateTime<Utc>) -> Result<Vec<f64>> {
    let mut ms: Vec<f64> = inspect::first_commit_of_each_after(&env.pool, runs, at)
        .await?
        .into_iter()
        .map(|c| ms_between(at, c.at))
        .collect();
    ms.sort_by(f64::total_cmp);
    Ok(ms)
}

async fn ledger(env: &BenchEnv, prefix: &str) -> Result<(i64, i64)> {
    let c = trailmark_testkit::ledger::ledger_counts(&env.pool, prefix).await?;
    Ok((c.rows, c.distinct))
}

//! `trailmark bench --remote`: steps in Python against steps in Rust, in one run.
//!
//! One environment, one Python step endpoint (`pychain`, [`super::python`]) and `--workers`
//! `trailmark serve` processes that carry both `chain` (compiled in) and `pychain` (from the
//! endpoint's manifest). Each repetition measures both on that same fleet, one after the other
//! (the order alternates, so a drift of the machine's load favours neither): the default
//! bench's repetition ([`measure_on`]: a warm-up, runs one at a time, then `--runs` runs of
//! `--steps` links started at once), every link's ledger row an outside write (`ctx.effect` in
//! Rust, `ctx.effect` through the `effect/begin` and `effect/end` callbacks in Python).
//!
//! Step latency is from a step's claim to its commit, read from the engine's own timestamps
//! ([`inspect::step_times`], as the breakdown reads them); a step the previous commit
//! pre-claimed (`worker.preclaim`) has its claim in that commit, so for most steps it is the
//! commit-to-commit time. Where an unloaded step's time goes comes from the same timestamps
//! ([`breakdown::effect`]).

use serde::Serialize;

use super::breakdown::{SEGMENTS_EFFECT, SEGMENTS_REMOTE};
use super::env::{BenchEnv, Proc, stop_all, with_envs};
use super::load::{RepFigures, measure_on};
use super::measure::{Spread, percentile};
use super::python::PythonEndpoint;
use super::report::{self, LedgerCheck, Segment, num};
use super::systems::System;
use super::window::{BACKGROUND_SPAN, background_cores};
use super::{Config, ModelMode, Result, progress, start_model};
use trailmark::config::Settings;
use trailmark::inspect;

/// The two sides, Rust first (the ratios are Python / Rust).
pub const SIDES: [System; 2] = [System::TrailmarkEffect, System::PyChain];

/// What to run: the default bench's repetition with 500 runs (the one Python process is
/// saturated long before), three times, with the engine's in-process stand-in model (a model
/// over HTTP costs both sides the same, and only adds noise).
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// Runs, links, repetitions, warm-up and unloaded runs, processes, pool.
    pub load: Config,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            load: Config {
                runs: 500,
                reps: 3,
                recovery: false,
                model: ModelMode::Builtin,
                ..Config::default()
            },
        }
    }
}

impl RemoteConfig {
    /// A smoke run: tiny sizes, every figure.
    pub fn quick() -> Self {
        Self {
            load: Config {
                recovery: false,
                model: ModelMode::Builtin,
                ..Config::quick()
            },
        }
    }
}

/// Claim-to-commit step latencies of one repetition (ms).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct StepLatency {
    /// Loaded (every run started at once): p50.
    pub p50_ms: f64,
    /// Loaded: p95.
    pub p95_ms: f64,
    /// One run at a time: p50.
    pub idle_p50_ms: f64,
    /// One run at a time: p95.
    pub idle_p95_ms: f64,
}

/// One side's figures over the repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// Its name in the report.
    pub name: &'static str,
    /// Steps per second, loaded.
    pub steps_per_s: Spread,
    /// Step latency (claim to commit), loaded, p50 (ms).
    pub step_p50_ms: Spread,
    /// The same, p95 (ms).
    pub step_p95_ms: Spread,
    /// Step latency with one run at a time, p50 (ms).
    pub idle_step_p50_ms: Spread,
    /// The same, p95 (ms).
    pub idle_step_p95_ms: Spread,
    /// Run latency with one run at a time, p50 (ms).
    pub run_p50_ms: Spread,
    /// Busy CPU of the whole machine per step, loaded (ms): the Python process is in it.
    pub cpu_ms_per_step: Spread,
    /// CPU of the `serve` processes per step (ms).
    pub serve_cpu_ms_per_step: Spread,
    /// CPU of the Python endpoint per step over the whole repetition (warm-up, runs one at a
    /// time, loaded), ms; none for the Rust side.
    pub endpoint_cpu_ms_per_step: Option<Spread>,
    /// Where an unloaded step's time goes (p50 of each segment).
    pub segments: Vec<Segment>,
}

/// One figure's medians set side by side.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// The figure.
    pub figure: &'static str,
    /// Python's median over Rust's.
    pub python_over_rust: f64,
}

/// What the remote bench measured.
#[derive(Debug, Clone, Serialize)]
pub struct RemoteReport {
    /// The bench's database (dropped at the end).
    pub database: String,
    /// Cores of this machine.
    pub cores: usize,
    /// Cores other work kept busy before the bench.
    pub background_cores_before: f64,
    /// The same, after.
    pub background_cores_after: f64,
    /// The load each side ran, per repetition.
    pub load: String,
    /// Rust, then Python.
    pub sides: Vec<Side>,
    /// Python / Rust of each figure's median.
    pub ratios: Vec<Ratio>,
    /// Each loaded phase's ledger: one row per link.
    pub ledger: Vec<LedgerCheck>,
}

/// Runs the remote bench on the servers of `base`, in an environment of its own, removed after.
pub async fn run(base: &Settings, cfg: &RemoteConfig) -> Result<RemoteReport> {
    let before = background_cores(BACKGROUND_SPAN).await?;
    let (database, reps) = with_envs(base, 1, cfg.load.pool, async |envs| {
        let env = &mut envs[0];
        Ok((env.db_name.clone(), on_fleet(env, &cfg.load).await?))
    })
    .await?;
    let after = background_cores(BACKGROUND_SPAN).await?;
    let mut report = build(cfg, &reps, (before, after));
    report.database = database;
    Ok(report)
}

/// One repetition of one side: the default bench's figures, the step latencies, and the Python
/// endpoint's CPU per step (0 for the Rust side).
type Rep = (RepFigures, StepLatency, f64);

/// Every repetition of both sides.
type Measured = Vec<(System, Vec<Rep>)>;

/// Starts the endpoint and the fleet that carries both workflows, measures, stops them.
async fn on_fleet(env: &mut BenchEnv, cfg: &Config) -> Result<Measured> {
    let mut python = PythonEndpoint::start(&env.settings.database.url, Vec::new()).await?;
    python.give_to(env);
    // The endpoint's own ledger pool counts as one more process's connections.
    let pool = env.pool_for(cfg.workers + 1).await?;
    env.set_child_pool(pool);
    let model = start_model(env, cfg).await?;
    let fleet = System::PyChain;
    let mut procs = fleet.spawn(env, cfg.workers, "remote", cfg.answer_bytes())?;
    let ready = fleet
        .wait_ready(env, &mut procs, std::time::Duration::from_secs(90))
        .await;
    let measured = match ready {
        Ok(()) => repetitions(env, cfg, (&mut procs, &python), model.as_ref()).await,
        Err(e) => Err(e),
    };
    stop_all(&mut procs).await;
    python.stop();
    measured
}

/// `cfg.reps` repetitions of both sides, in alternating order.
async fn repetitions(
    env: &BenchEnv,
    cfg: &Config,
    (procs, python): (&mut [Proc], &PythonEndpoint),
    model: Option<&Proc>,
) -> Result<Measured> {
    let mut all: Measured = SIDES.iter().map(|s| (*s, Vec::new())).collect();
    for rep in 1..=cfg.reps {
        let mut order = SIDES;
        if rep % 2 == 0 {
            order.reverse();
        }
        for system in order {
            let side = SIDES.iter().position(|s| *s == system).unwrap_or(0);
            // Run ids carry the repetition: each side's repetitions get numbers of their own.
            let n = rep + side * cfg.reps;
            let label = format!("{} rep {rep}/{}", side_name(system), cfg.reps);
            let endpoint_before = endpoint_cpu_ms(python)?;
            let figures = measure_on(env, system, cfg, n, &label, model, procs).await?;
            let endpoint = endpoint_cpu_ms(python)? - endpoint_before;
            let latency = step_latency(env, n).await?;
            progress(&format!(
                "{label}: {:.0} steps/s, step p50 {:.1} ms, p95 {:.1} ms loaded; p50 {:.1} ms one run at a time",
                figures.steps_per_s, latency.p50_ms, latency.p95_ms, latency.idle_p50_ms
            ));
            let steps = (cfg.warmup_runs + cfg.unloaded_runs + cfg.runs) * cfg.steps as usize;
            let endpoint_per_step = match system {
                System::PyChain => endpoint / steps.max(1) as f64,
                _ => 0.0,
            };
            all[side].1.push((figures, latency, endpoint_per_step));
        }
    }
    Ok(all)
}

/// CPU the Python endpoint has used so far (ms).
fn endpoint_cpu_ms(python: &PythonEndpoint) -> Result<f64> {
    let pid = python
        .pid()
        .ok_or_else(|| super::Error::Failed("the Python endpoint is not running".into()))?;
    super::measure::process_cpu_ms(pid)
}

/// Claim-to-commit latencies of repetition `n`'s loaded (`l<n>-`) and unloaded (`u<n>-`) runs.
async fn step_latency(env: &BenchEnv, n: usize) -> Result<StepLatency> {
    let (p50_ms, p95_ms) = claim_to_commit(env, &format!("l{n}-")).await?;
    let (idle_p50_ms, idle_p95_ms) = claim_to_commit(env, &format!("u{n}-")).await?;
    Ok(StepLatency {
        p50_ms,
        p95_ms,
        idle_p50_ms,
        idle_p95_ms,
    })
}

/// p50 and p95 of claim to commit over the committed steps of the runs starting with `prefix`.
async fn claim_to_commit(env: &BenchEnv, prefix: &str) -> Result<(f64, f64)> {
    let mut ms: Vec<f64> = inspect::step_times(&env.pool, prefix)
        .await?
        .iter()
        .filter_map(|s| s.committed.map(|c| c - s.claimed))
        .map(|d| d.num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0)
        .collect();
    ms.sort_by(f64::total_cmp);
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.95)))
}

/// The report from the repetitions.
fn build(cfg: &RemoteConfig, all: &Measured, (before, after): (f64, f64)) -> RemoteReport {
    let c = &cfg.load;
    let sides: Vec<Side> = all.iter().map(|(s, reps)| side(*s, reps)).collect();
    let figures: Vec<(System, Vec<RepFigures>)> = all
        .iter()
        .map(|(s, reps)| (*s, reps.iter().map(|(f, _, _)| f.clone()).collect()))
        .collect();
    RemoteReport {
        database: String::new(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        background_cores_before: before,
        background_cores_after: after,
        load: format!(
            "{} runs x {} links at once (ledger rows as outside writes), after {} warm-up runs and {} runs one at a time; {} repetitions on {} serve process(es); model: {}",
            c.runs,
            c.steps,
            c.warmup_runs,
            c.unloaded_runs,
            c.reps,
            c.workers,
            match c.model {
                ModelMode::Builtin => "the engine's in-process stand-in".to_owned(),
                ModelMode::Http { answer_bytes } =>
                    format!("the stand-in model server over HTTP, {answer_bytes} bytes"),
            }
        ),
        ratios: ratios(&sides),
        sides,
        ledger: report::ledger(&figures, c.runs, c.steps),
    }
}

/// One side's spreads over its repetitions.
fn side(system: System, reps: &[Rep]) -> Side {
    let spread = |pick: fn(&Rep) -> f64| Spread::of(&reps.iter().map(pick).collect::<Vec<_>>());
    let figures: Vec<RepFigures> = reps.iter().map(|(f, _, _)| f.clone()).collect();
    let labels: &[&'static str] = match system {
        System::PyChain => &SEGMENTS_REMOTE,
        _ => &SEGMENTS_EFFECT,
    };
    Side {
        name: side_name(system),
        steps_per_s: spread(|(f, _, _)| f.steps_per_s),
        step_p50_ms: spread(|(_, l, _)| l.p50_ms),
        step_p95_ms: spread(|(_, l, _)| l.p95_ms),
        idle_step_p50_ms: spread(|(_, l, _)| l.idle_p50_ms),
        idle_step_p95_ms: spread(|(_, l, _)| l.idle_p95_ms),
        run_p50_ms: spread(|(f, _, _)| f.run_p50_ms),
        cpu_ms_per_step: spread(|(f, _, _)| f.cpu_ms_per_step),
        serve_cpu_ms_per_step: spread(|(f, _, _)| f.proc_cpu_ms_per_step),
        endpoint_cpu_ms_per_step: (system == System::PyChain).then(|| spread(|(_, _, e)| *e)),
        segments: report::breakdown(&figures, labels),
    }
}

/// A side's name in the report.
fn side_name(system: System) -> &'static str {
    match system {
        System::PyChain => "pychain (Python)",
        _ => "chain (Rust)",
    }
}

/// Where a row's spread is in a side.
type Pick = fn(&Side) -> &Spread;

/// The rows of the table: a label and where its spread is.
const ROWS: [(&str, Pick); 8] = [
    ("steps/s, loaded", |s| &s.steps_per_s),
    ("step p50, loaded (ms)", |s| &s.step_p50_ms),
    ("step p95, loaded (ms)", |s| &s.step_p95_ms),
    ("step p50, one run at a time (ms)", |s| &s.idle_step_p50_ms),
    ("step p95, one run at a time (ms)", |s| &s.idle_step_p95_ms),
    ("run p50, one run at a time (ms)", |s| &s.run_p50_ms),
    ("CPU/step, whole machine (ms)", |s| &s.cpu_ms_per_step),
    ("CPU/step, serve processes (ms)", |s| {
        &s.serve_cpu_ms_per_step
    }),
];

/// Python / Rust of every row's median.
fn ratios(sides: &[Side]) -> Vec<Ratio> {
    let [rust, python] = sides else {
        return Vec::new();
    };
    ROWS.iter()
        .map(|(figure, pick)| Ratio {
            figure,
            python_over_rust: if pick(rust).median > 0.0 {
                pick(python).median / pick(rust).median
            } else {
                0.0
            },
        })
        .collect()
}

impl std::fmt::Display for RemoteReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "machine      {} cores, {:.2} busy with other work before the bench, {:.2} after",
            self.cores, self.background_cores_before, self.background_cores_after
        )?;
        writeln!(f, "load         {}", self.load)?;
        self.table(f)?;
        for s in &self.sides {
            if let Some(cpu) = &s.endpoint_cpu_ms_per_step {
                writeln!(
                    f,
                    "{:<36}{} ms per step over each repetition (in the whole machine's figure above)",
                    "CPU/step, the Python endpoint",
                    num(cpu.median)
                )?;
            }
        }
        let bad: Vec<&LedgerCheck> = self
            .ledger
            .iter()
            .filter(|l| l.rows != l.expected || l.distinct != l.rows)
            .collect();
        match bad.as_slice() {
            [] => writeln!(
                f,
                "\nledger       every loaded phase left one row per link ({} phases)",
                self.ledger.len()
            )?,
            bad => {
                for l in bad {
                    writeln!(
                        f,
                        "\nledger       {} rep {}: {} rows, {} distinct, {} expected",
                        l.system, l.rep, l.rows, l.distinct, l.expected
                    )?;
                }
            }
        }
        self.segments(f)
    }
}

impl RemoteReport {
    /// Each row: both sides' median [min–max], then Python / Rust.
    fn table(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cell = |s: &Spread| format!("{} [{}–{}]", num(s.median), num(s.min), num(s.max));
        write!(f, "\n{:<36}", "figure")?;
        for s in &self.sides {
            write!(f, "{:<26}", s.name)?;
        }
        writeln!(f, "Python / Rust")?;
        for ((label, pick), ratio) in ROWS.iter().zip(&self.ratios) {
            write!(f, "{label:<36}")?;
            for s in &self.sides {
                write!(f, "{:<26}", cell(pick(s)))?;
            }
            writeln!(f, "{:.2}", ratio.python_over_rust)?;
        }
        Ok(())
    }

    /// Where an unloaded step's time goes, side by side.
    fn segments(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for s in &self.sides {
            writeln!(f, "\nwhere an unloaded step of {} goes (p50 ms):", s.name)?;
            for seg in &s.segments {
                writeln!(f, "  {:>8}  {}", num(seg.p50_ms.median), seg.label)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(name: &'static str, steps_per_s: f64, p50: f64) -> Side {
        let one = |v: f64| Spread::of(&[v]);
        Side {
            name,
            steps_per_s: one(steps_per_s),
            step_p50_ms: one(p50),
            step_p95_ms: one(2.0 * p50),
            idle_step_p50_ms: one(p50),
            idle_step_p95_ms: one(p50),
            run_p50_ms: one(10.0 * p50),
            cpu_ms_per_step: one(1.0),
            serve_cpu_ms_per_step: one(0.0),
            endpoint_cpu_ms_per_step: None,
            segments: Vec::new(),
        }
    }

    #[test]
    fn each_ratio_is_pythons_median_over_rusts_and_a_zero_gives_zero() {
        let sides = [
            side("chain (Rust)", 800.0, 4.0),
            side("pychain (Python)", 200.0, 12.0),
        ];
        let r = ratios(&sides);
        assert_eq!(r.len(), ROWS.len());
        assert_eq!(r[0].figure, "steps/s, loaded");
        assert_eq!(r[0].python_over_rust, 0.25);
        assert_eq!(r[1].python_over_rust, 3.0);
        // No CPU measured on the Rust side: no ratio, rather than an infinite one.
        assert_eq!(r[7].python_over_rust, 0.0);
        assert!(ratios(&sides[..1]).is_empty());
    }
}

//! `trailmark bench --growth`: whether a step costs more with ten million finished steps behind
//! it, and what pruning them costs the steps beside it.
//!
//! Two environments (database and broker prefix each), both with retention on (finished runs
//! kept [`KEEP_DAYS`] days, the background pruner running):
//! - **empty**: nothing but the load;
//! - **history**: `--history-steps` finished steps already there. [`TEMPLATE_RUNS`] `chain` runs
//!   with their ledger as outside writes go through the engine first, so their rows (runs, steps,
//!   journal with the stand-in model's answers, effects, ledger, inbox) are the rows real runs
//!   leave; then they are copied in bulk, each copy under new run ids, keys and message ids and
//!   finished up to six days earlier, and the database is vacuumed and analysed.
//!
//! The load (the default bench's: `chain` runs with local ledger rows, a warm-up, runs one at a
//! time, then runs all started at once) runs `--reps` times in each, alternating which goes
//! first; then again in the history while `trailmark prune --older-than 1d` removes the history
//! at its default pace (`retention.duty_percent`) beside it; these repetitions run last, so a
//! drift of the machine's speed over the run is not separated from pruning's effect. Table
//! sizes are read before the load, WAL per step over each loaded phase. The figures a user relies on: history/empty for throughput and unloaded latency
//! (target within 10%), pruning/history for the loaded step p99 (target below 1.1).

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;
use sqlx::Connection;

use super::env::{BenchEnv, Proc, stop_all, with_envs};
use super::load::{RepFigures, ids, measure_on};
use super::measure::Spread;
use super::report::num;
use super::systems::System;
use super::window::{BACKGROUND_SPAN, background_cores};
use super::{Config, Error, Result, progress, start_model};
use trailmark::config::Settings;

/// Template runs put through the engine before the bulk copy.
pub const TEMPLATE_RUNS: usize = 100;
/// Keep time of finished runs in both environments (retention on, nothing of the history due).
pub const KEEP_DAYS: u64 = 7;
/// How far back the copies' times spread: inside the keep time, five sixths past `--older-than 1d`.
const SPREAD_DAYS: f64 = 6.0;
/// Copies inserted per statement (each a transaction): progress is printed between them.
const COPIES_PER_CHUNK: u64 = 500;

/// What to run.
#[derive(Debug, Clone)]
pub struct GrowthConfig {
    /// Finished steps put in the history database (default 10,000,000).
    pub history_steps: u64,
    /// Runs put through the engine as the template of the history.
    pub template_runs: usize,
    /// The load measured in each environment (the default bench's, three repetitions).
    pub load: Config,
}

impl Default for GrowthConfig {
    fn default() -> Self {
        Self {
            history_steps: 10_000_000,
            template_runs: TEMPLATE_RUNS,
            load: Config {
                reps: 3,
                recovery: false,
                ..Config::default()
            },
        }
    }
}

impl GrowthConfig {
    /// A smoke run: a small history and load, every figure.
    pub fn quick() -> Self {
        Self {
            history_steps: 4_000,
            template_runs: 10,
            load: Config {
                recovery: false,
                ..Config::quick()
            },
        }
    }
}

/// One table's size.
#[derive(Debug, Clone, Serialize)]
pub struct TableSize {
    /// Table name (schema `trailmark`).
    pub table: String,
    /// Rows, as counted by the last ANALYZE.
    pub rows: i64,
    /// Heap, indexes and TOAST (MiB).
    pub mib: f64,
}

/// The figures of one environment, over its repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// `empty`, `history` or `history, pruning`.
    pub name: &'static str,
    /// Steps per second, loaded.
    pub steps_per_s: Spread,
    /// Step-to-step p50 with one run at a time (ms).
    pub idle_gap_p50_ms: Spread,
    /// The same, p99 (ms).
    pub idle_gap_p99_ms: Spread,
    /// Step-to-step p99, loaded (ms).
    pub gap_p99_ms: Spread,
    /// Run p50 with one run at a time (ms).
    pub run_p50_ms: Spread,
    /// CPU per step, whole machine (ms).
    pub cpu_ms_per_step: Spread,
    /// WAL per step, whole cluster (KiB).
    pub wal_kib_per_step: Spread,
    /// The database before the load (MiB).
    pub database_mib: f64,
    /// The tables a run leaves rows in, before the load.
    pub tables: Vec<TableSize>,
}

/// What pruning did beside the load.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Pruning {
    /// Runs removed, from the start of `trailmark prune` to the end of the last repetition.
    pub runs_removed: i64,
    /// Steps with them (each history run has `--steps` steps).
    pub steps_removed: i64,
    /// Over this long (s).
    pub secs: f64,
    /// Runs removed that had finished less than a day before (`--older-than 1d`: must be 0).
    pub younger_removed: i64,
    /// Whether `trailmark prune` was still removing at the end of every repetition (if not, the
    /// later repetitions ran beside less pruning than the figure claims).
    pub throughout: bool,
}

/// What the growth bench measured.
#[derive(Debug, Clone, Serialize)]
pub struct GrowthReport {
    /// The bench's databases, empty side first (dropped at the end).
    pub databases: Vec<String>,
    /// Cores of this machine.
    pub cores: usize,
    /// Cores other work kept busy before the bench.
    pub background_cores_before: f64,
    /// The same, after.
    pub background_cores_after: f64,
    /// Runs put through the engine as the history's template.
    pub template_runs: usize,
    /// Finished runs in the history.
    pub history_runs: u64,
    /// Finished steps in the history.
    pub history_steps: u64,
    /// How long the bulk copy and the vacuum took (s).
    pub history_load_secs: f64,
    /// The load in each environment.
    pub load: String,
    /// Empty, history, history while pruning.
    pub sides: Vec<Side>,
    /// History / empty, steps per second (target 0.9 to 1.1).
    pub steps_per_s_ratio: f64,
    /// History / empty, unloaded step p50.
    pub idle_gap_p50_ratio: f64,
    /// History / empty, unloaded step p99.
    pub idle_gap_p99_ratio: f64,
    /// Pruning / history, loaded step p99 (target below 1.1).
    pub pruning_gap_p99_ratio: f64,
    /// Pruning / history, unloaded step p99.
    pub pruning_idle_gap_p99_ratio: f64,
    /// What pruning removed beside the load.
    pub pruning: Pruning,
}

/// Runs the growth bench on the servers of `base`, in two environments of its own, removed after.
pub async fn run(base: &Settings, cfg: &GrowthConfig) -> Result<GrowthReport> {
    let before = background_cores(BACKGROUND_SPAN).await?;
    with_envs(base, 2, cfg.load.pool, async |envs| {
        let keep = (KEEP_DAYS * 86_400).to_string();
        for env in envs.iter_mut() {
            env.set_child_env("TRAILMARK__RETENTION__KEEP_SECS", &keep);
        }
        phases(envs, cfg, before).await
    })
    .await
}

async fn phases(envs: &mut [BenchEnv], cfg: &GrowthConfig, before: f64) -> Result<GrowthReport> {
    let mut models = Vec::with_capacity(envs.len());
    for env in envs.iter_mut() {
        models.push(start_model(env, &cfg.load).await?);
    }
    let started = Instant::now();
    let (history_runs, history_steps) = put_history(&envs[1], cfg).await?;
    for env in envs.iter() {
        sqlx::raw_sql("VACUUM ANALYZE").execute(&env.pool).await?;
    }
    let history_load_secs = started.elapsed().as_secs_f64();
    let sizes = [sizes(&envs[0]).await?, sizes(&envs[1]).await?];
    let mut reps: [Vec<RepFigures>; 3] = Default::default();
    for rep in 1..=cfg.load.reps {
        let order = if rep % 2 == 1 { [0, 1] } else { [1, 0] };
        for side in order {
            let figures =
                on_serve(&envs[side], cfg, rep, SIDES[side], models[side].as_ref()).await?;
            reps[side].push(figures);
        }
    }
    let (pruning, figures) = beside_pruning(&envs[1], cfg, models[1].as_ref()).await?;
    reps[2] = figures;
    drop(models);
    let [empty, history, pruned] = &reps;
    let median = |r: &[RepFigures], pick: fn(&RepFigures) -> f64| {
        Spread::of(&r.iter().map(pick).collect::<Vec<_>>()).median
    };
    let ratio = |a: &[RepFigures], b: &[RepFigures], pick: fn(&RepFigures) -> f64| {
        let below = median(b, pick);
        if below > 0.0 {
            median(a, pick) / below
        } else {
            0.0
        }
    };
    let [empty_sizes, history_sizes] = sizes;
    Ok(GrowthReport {
        databases: envs.iter().map(|e| e.db_name.clone()).collect(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        background_cores_before: before,
        background_cores_after: background_cores(BACKGROUND_SPAN).await?,
        template_runs: cfg.template_runs,
        history_runs,
        history_steps,
        history_load_secs,
        load: format!(
            "{} chain runs x {} steps started at once, {} one at a time, after {} warm-up runs, on {} serve process(es); {}-byte answers from the stand-in model server",
            cfg.load.runs,
            cfg.load.steps,
            cfg.load.unloaded_runs,
            cfg.load.warmup_runs,
            cfg.load.workers,
            cfg.load.answer_bytes()
        ),
        steps_per_s_ratio: ratio(history, empty, |f| f.steps_per_s),
        idle_gap_p50_ratio: ratio(history, empty, |f| f.idle_gap_p50_ms),
        idle_gap_p99_ratio: ratio(history, empty, |f| f.idle_gap_p99_ms),
        pruning_gap_p99_ratio: ratio(pruned, history, |f| f.gap_p99_ms),
        pruning_idle_gap_p99_ratio: ratio(pruned, history, |f| f.idle_gap_p99_ms),
        sides: vec![
            side(SIDES[0], empty, empty_sizes.clone()),
            side(SIDES[1], history, history_sizes.clone()),
            side(SIDES[2], pruned, history_sizes),
        ],
        pruning,
    })
}

/// The environments' names, in the order of the report's sides.
const SIDES: [&str; 3] = ["empty", "history", "history, pruning"];

fn side(
    name: &'static str,
    reps: &[RepFigures],
    (database_mib, tables): (f64, Vec<TableSize>),
) -> Side {
    let spread =
        |pick: fn(&RepFigures) -> f64| Spread::of(&reps.iter().map(pick).collect::<Vec<_>>());
    Side {
        name,
        steps_per_s: spread(|f| f.steps_per_s),
        idle_gap_p50_ms: spread(|f| f.idle_gap_p50_ms),
        idle_gap_p99_ms: spread(|f| f.idle_gap_p99_ms),
        gap_p99_ms: spread(|f| f.gap_p99_ms),
        run_p50_ms: spread(|f| f.run_p50_ms),
        cpu_ms_per_step: spread(|f| f.cpu_ms_per_step),
        wal_kib_per_step: spread(|f| f.wal_kib_per_step),
        database_mib,
        tables,
    }
}

/// `serve` processes on `env`, ready; stopped by the caller.
async fn serve(env: &BenchEnv, cfg: &GrowthConfig, tag: &str) -> Result<Vec<Proc>> {
    let system = System::Trailmark;
    let mut procs = system.spawn(env, cfg.load.workers, tag, cfg.load.answer_bytes())?;
    system
        .wait_ready(env, &mut procs, Duration::from_secs(60))
        .await?;
    Ok(procs)
}

/// One repetition of the load on `env`, on processes started for it.
async fn on_serve(
    env: &BenchEnv,
    cfg: &GrowthConfig,
    rep: usize,
    side: &str,
    model: Option<&Proc>,
) -> Result<RepFigures> {
    let mut procs = serve(env, cfg, &format!("rep{rep}")).await?;
    let label = format!("{side} rep {}/{}", (rep - 1) % 100 + 1, cfg.load.reps);
    let figures = measure_on(
        env,
        System::Trailmark,
        &cfg.load,
        rep,
        &label,
        model,
        &mut procs,
    )
    .await;
    stop_all(&mut procs).await;
    let figures = figures?;
    progress(&format!(
        "{label}: {:.0} steps/s, unloaded step p50 {:.2} ms p99 {:.2} ms, loaded step p99 {:.0} ms, {:.2} KiB WAL/step",
        figures.steps_per_s,
        figures.idle_gap_p50_ms,
        figures.idle_gap_p99_ms,
        figures.gap_p99_ms,
        figures.wal_kib_per_step
    ));
    Ok(figures)
}

/// The load's repetitions in the history while `trailmark prune --older-than 1d` removes the
/// history's older five sixths beside it at its default pace (`retention.duty_percent`).
async fn beside_pruning(
    env: &BenchEnv,
    cfg: &GrowthConfig,
    model: Option<&Proc>,
) -> Result<(Pruning, Vec<RepFigures>)> {
    let removed = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.pruned_runs")
            .fetch_one(&env.pool)
            .await?;
        Ok::<_, Error>(n)
    };
    let from = removed().await?;
    let started = Instant::now();
    let mut pruner = env.spawn("prune", &["prune", "--older-than", "1d"])?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while removed().await? == 0 {
        if pruner.exited().is_some() || Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "trailmark prune removed nothing within 2 minutes; see {}",
                env.log_dir.join("prune.log").display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut figures = Vec::with_capacity(cfg.load.reps);
    let mut throughout = true;
    for rep in 1..=cfg.load.reps {
        // Run ids of their own: the history's earlier repetitions' runs are still there.
        let f = on_serve(env, cfg, 100 + rep, SIDES[2], model).await;
        throughout &= pruner.exited().is_none();
        figures.push(f?);
    }
    let secs = started.elapsed().as_secs_f64();
    pruner.stop(Duration::from_secs(10)).await;
    let runs_removed = removed().await? - from;
    let younger_removed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.pruned_runs WHERE finished_at > now() - interval '1 day'",
    )
    .fetch_one(&env.pool)
    .await?;
    progress(&format!(
        "pruning beside the load: {runs_removed} runs removed in {secs:.1} s{}",
        if throughout {
            ""
        } else {
            " (it ran out of due runs before the last repetition ended)"
        }
    ));
    Ok((
        Pruning {
            runs_removed,
            steps_removed: runs_removed * i64::from(cfg.load.steps),
            younger_removed,
            secs,
            throughout,
        },
        figures,
    ))
}

/// The history: template runs through the engine, then copied in bulk until `history_steps`.
/// Returns the finished runs and steps put there.
async fn put_history(env: &BenchEnv, cfg: &GrowthConfig) -> Result<(u64, u64)> {
    let template = ids("tpl", cfg.template_runs);
    let mut procs = serve(env, cfg, "template").await?;
    let input = json!({ "steps": cfg.load.steps, "ledger": "effect" });
    let driven = async {
        env.start_chain(&template, &input).await?;
        super::load::wait_all(
            env,
            System::TrailmarkEffect,
            &template,
            cfg.load.steps,
            "history template",
            &mut procs,
        )
        .await
    }
    .await;
    stop_all(&mut procs).await;
    driven?;
    let per_copy = (cfg.template_runs as u64) * u64::try_from(cfg.load.steps).unwrap_or(1);
    let copies = cfg.history_steps.div_ceil(per_copy.max(1));
    copy_template(env, copies).await?;
    Ok((copies * cfg.template_runs as u64, copies * per_copy))
}

/// Copies the template runs' rows `copies` times, in chunks of [`COPIES_PER_CHUNK`], on one
/// connection that skips triggers (foreign keys, notifications: bulk rows, not engine traffic)
/// and does not wait for each chunk's WAL flush.
async fn copy_template(env: &BenchEnv, copies: u64) -> Result<()> {
    // A connection of its own, closed at the end: the session settings below (triggers off,
    // commits not waiting for their flush; the first needs a superuser) must not go back to the
    // pool, whatever happens.
    let mut conn = sqlx::PgConnection::connect_with(&env.pool.connect_options()).await?;
    sqlx::raw_sql(
        "SET session_replication_role = replica; SET synchronous_commit = off;
         CREATE SCHEMA growth_tpl;",
    )
    .execute(&mut conn)
    .await?;
    let tables = per_run_tables(&mut conn).await?;
    let mut statements = Vec::with_capacity(tables.len());
    for table in &tables {
        // The inbox has no run id: every row in it is the template's (the database is new).
        let filter = if table == "inbox" {
            ""
        } else {
            " WHERE run_id LIKE 'tpl-%'"
        };
        let snapshot =
            format!("CREATE TABLE growth_tpl.{table} AS SELECT * FROM trailmark.{table}{filter}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(snapshot))
            .execute(&mut conn)
            .await?;
        statements.push(copy_statement(&mut conn, table).await?);
    }
    let span_secs = SPREAD_DAYS * 86_400.0;
    let started = Instant::now();
    let mut lo = 1;
    while lo <= copies {
        let hi = (lo + COPIES_PER_CHUNK - 1).min(copies);
        for statement in &statements {
            sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                .bind(lo as i64)
                .bind(hi as i64)
                .bind(span_secs / copies as f64)
                .execute(&mut conn)
                .await?;
        }
        progress(&format!(
            "history: {hi}/{copies} copies of the template in {:.0} s",
            started.elapsed().as_secs_f64()
        ));
        lo = hi + 1;
    }
    sqlx::raw_sql("DROP SCHEMA growth_tpl CASCADE")
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(())
}

/// The engine's tables that hold rows of a run (a `run_id` column), and the inbox.
async fn per_run_tables(conn: &mut sqlx::PgConnection) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT c.table_name::text FROM information_schema.columns c
           JOIN information_schema.tables t USING (table_schema, table_name)
          WHERE c.table_schema = 'trailmark' AND t.table_type = 'BASE TABLE'
            AND (c.column_name = 'run_id' AND c.table_name <> 'pruned_runs' OR c.table_name = 'inbox')
          GROUP BY c.table_name ORDER BY c.table_name",
    )
    .fetch_all(conn)
    .await?)
}

/// `INSERT ... SELECT` of copies `$1..=$2` of `table`'s template rows: text naming a template
/// run (ids, keys, references) names the copy's run, UUIDs (message ids) are new, times move
/// `$3` seconds back per copy, serial and generated columns are left to their defaults.
async fn copy_statement(conn: &mut sqlx::PgConnection, table: &str) -> Result<String> {
    let columns: Vec<(String, String, Option<String>, String, String)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text, column_default::text, is_generated::text, is_identity::text
           FROM information_schema.columns WHERE table_schema = 'trailmark' AND table_name = $1
          ORDER BY ordinal_position",
    )
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    let (mut names, mut values) = (Vec::new(), Vec::new());
    for (name, kind, default, generated, identity) in columns {
        let serial = default
            .as_deref()
            .is_some_and(|d| d.starts_with("nextval("));
        if serial || generated == "ALWAYS" || identity == "YES" {
            continue;
        }
        let value = match kind.as_str() {
            "text" => format!("replace(t.{name}, 'tpl-', 'h' || k || '-')"),
            "uuid" => format!("md5(t.{name}::text || k)::uuid"),
            "timestamp with time zone" => format!("t.{name} - make_interval(secs => $3 * k)"),
            _ => format!("t.{name}"),
        };
        names.push(name);
        values.push(value);
    }
    Ok(format!(
        "INSERT INTO trailmark.{table} ({}) SELECT {} FROM growth_tpl.{table} t CROSS JOIN generate_series($1::int8, $2::int8) k",
        names.join(", "),
        values.join(", ")
    ))
}

/// The database's size and the per-run tables' sizes.
async fn sizes(env: &BenchEnv) -> Result<(f64, Vec<TableSize>)> {
    const MIB: f64 = 1024.0 * 1024.0;
    let database: i64 = sqlx::query_scalar("SELECT pg_database_size(current_database())")
        .fetch_one(&env.pool)
        .await?;
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT c.relname::text, greatest(c.reltuples, 0)::int8, pg_total_relation_size(c.oid)
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = 'trailmark' AND c.relkind = 'r'
            AND c.relname IN ('runs', 'steps', 'journal', 'effects', 'inbox', 'chain_ledger', 'pruned_runs')
          ORDER BY c.relname",
    )
    .fetch_all(&env.pool)
    .await?;
    Ok((
        database as f64 / MIB,
        rows.into_iter()
            .map(|(table, rows, bytes)| TableSize {
                table,
                rows,
                mib: bytes as f64 / MIB,
            })
            .collect(),
    ))
}

impl std::fmt::Display for GrowthReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "machine      {} cores, {:.2} busy with other work before the bench, {:.2} after",
            self.cores, self.background_cores_before, self.background_cores_after
        )?;
        writeln!(
            f,
            "history      {} finished runs, {} steps, copied from {} template runs in {:.0} s (with the vacuum); retention on, kept {KEEP_DAYS} days",
            self.history_runs, self.history_steps, self.template_runs, self.history_load_secs
        )?;
        writeln!(f, "load         {}", self.load)?;
        let cell = |s: &Spread| format!("{} [{}–{}]", num(s.median), num(s.min), num(s.max));
        writeln!(
            f,
            "\n{:<20}{:<22}{:<22}{:<22}{:<22}{:<22}{:<22}{:<22}database (MiB)",
            "",
            "steps/s",
            "step p50 unloaded",
            "step p99 unloaded",
            "step p99 loaded",
            "run p50 unloaded",
            "CPU/step (ms)",
            "WAL/step (KiB)",
        )?;
        for s in &self.sides {
            writeln!(
                f,
                "{:<20}{:<22}{:<22}{:<22}{:<22}{:<22}{:<22}{:<22}{:.0}",
                s.name,
                cell(&s.steps_per_s),
                cell(&s.idle_gap_p50_ms),
                cell(&s.idle_gap_p99_ms),
                cell(&s.gap_p99_ms),
                cell(&s.run_p50_ms),
                cell(&s.cpu_ms_per_step),
                cell(&s.wal_kib_per_step),
                s.database_mib
            )?;
        }
        writeln!(
            f,
            "\nhistory/empty: steps/s {:.3}, unloaded step p50 {:.3}, p99 {:.3} (target: each within 0.9..1.1)",
            self.steps_per_s_ratio, self.idle_gap_p50_ratio, self.idle_gap_p99_ratio
        )?;
        let p = &self.pruning;
        writeln!(
            f,
            "pruning/history: loaded step p99 {:.3} (target < 1.1), unloaded step p99 {:.3}; {} runs ({} steps) removed beside the load in {:.1} s ({:.0} steps/s){}",
            self.pruning_gap_p99_ratio,
            self.pruning_idle_gap_p99_ratio,
            p.runs_removed,
            p.steps_removed,
            p.secs,
            if p.secs > 0.0 {
                p.steps_removed as f64 / p.secs
            } else {
                0.0
            },
            if p.throughout {
                ""
            } else {
                "; pruning ran out before the last repetition ended"
            }
        )?;
        if p.younger_removed > 0 {
            writeln!(
                f,
                "BROKEN: {} removed runs had finished less than a day before (--older-than 1d)",
                p.younger_removed
            )?;
        }
        writeln!(f, "\ntables before the load (rows, MiB)")?;
        for (s, name) in self.sides.iter().zip(SIDES).take(2) {
            let parts: Vec<String> = s
                .tables
                .iter()
                .map(|t| format!("{} {} / {:.0}", t.table, t.rows, t.mib))
                .collect();
            writeln!(f, "  {name:<10}{}", parts.join(", "))?;
        }
        Ok(())
    }
}

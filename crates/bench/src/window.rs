//! A measured window: wall time, and CPU split by who used it — the whole machine
//! (`/proc/stat`), the measured processes, the Postgres backends serving them, the RabbitMQ node
//! — so that a busy machine shows up as unattributed time instead of skewing every figure.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::env::{BenchEnv, Proc};
use super::load::drive;
use super::systems::System;
use super::{Result, measure};

/// Wall time and CPU spent while a workload ran.
#[derive(Debug, Clone, Copy, Default)]
pub struct Window {
    /// Seconds from the first start message to the last run seen finished.
    pub secs: f64,
    /// Whole-machine busy CPU (ms), minus the stand-in model server.
    pub machine_ms: f64,
    /// CPU of the measured processes (ms).
    pub procs_ms: f64,
    /// CPU of the Postgres backends connected to the bench database by the measured processes.
    pub postgres_ms: f64,
    /// CPU of the local RabbitMQ node (shared with anything else using it).
    pub broker_ms: f64,
    /// WAL written by the whole Postgres cluster (bytes).
    pub wal_bytes: f64,
}

struct Sample {
    machine: f64,
    procs: f64,
    excluded: f64,
    postgres: HashMap<i32, f64>,
    broker: f64,
    wal: f64,
}

async fn sample(env: &BenchEnv, procs: &[Proc], excluded: Option<&Proc>) -> Result<Sample> {
    // The bench's own connections carry its application_name and are not counted.
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name <> $1",
    )
    .bind(super::env::APPLICATION_NAME)
    .fetch_all(&env.pool)
    .await?;
    let wal: f64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8")
            .fetch_one(&env.pool)
            .await?;
    // A backend may end between the query and the read; it simply is not counted.
    let postgres = pids
        .into_iter()
        .filter_map(|p| Some((p, measure::process_cpu_ms(p as u32).ok()?)))
        .collect();
    let mut own = 0.0;
    for p in procs {
        own += p.cpu_ms()?;
    }
    let broker = measure::broker_pid()
        .and_then(|p| measure::process_cpu_ms(p).ok())
        .unwrap_or(0.0);
    Ok(Sample {
        machine: measure::machine_busy_ms()?,
        procs: own,
        excluded: excluded.map(Proc::cpu_ms).transpose()?.unwrap_or(0.0),
        postgres,
        broker,
        wal,
    })
}

/// [`drive`] with CPU read around it; `excluded` (the stand-in model server) is subtracted from
/// the machine's figure.
pub async fn measured(
    env: &BenchEnv,
    system: System,
    ids: &[String],
    steps: i32,
    label: &str,
    procs: &mut [Proc],
    excluded: Option<&Proc>,
) -> Result<Window> {
    let before = sample(env, procs, excluded).await?;
    let started = Instant::now();
    drive(env, system, ids, steps, label, procs).await?;
    let secs = started.elapsed().as_secs_f64();
    let after = sample(env, procs, excluded).await?;
    // Backends opened during the window count from zero.
    let postgres = after
        .postgres
        .iter()
        .map(|(pid, ms)| ms - before.postgres.get(pid).copied().unwrap_or(0.0))
        .sum();
    Ok(Window {
        secs,
        machine_ms: (after.machine - before.machine) - (after.excluded - before.excluded),
        procs_ms: after.procs - before.procs,
        postgres_ms: postgres,
        broker_ms: after.broker - before.broker,
        wal_bytes: after.wal - before.wal,
    })
}

/// How long to sample the machine's background load before and after the bench.
pub const BACKGROUND_SPAN: Duration = Duration::from_secs(2);

/// How many cores other work keeps busy while the bench itself is idle, averaged over `span`.
pub async fn background_cores(span: Duration) -> Result<f64> {
    let before = measure::machine_busy_ms()?;
    tokio::time::sleep(span).await;
    Ok((measure::machine_busy_ms()? - before) / span.as_secs_f64() / 1000.0)
}

//! Faults the drill injects from outside the processes it owns: RabbitMQ closing their
//! connections or restarting, Postgres ending their backends or stopping at once, poison
//! messages, and the time until the next step commits after each.

use std::process::Command;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::schedule::{Hook, Rng};
use super::{Error, Result};
use trailmark::broker::{self, Outgoing, Publisher, Topology};
use trailmark::config::BrokerSettings;
use trailmark::domain::{RUN_START_ROUTING_KEY, STEP_ROUTING_KEY};
use trailmark::inspect;
use trailmark_bench::env::BenchEnv;

/// How a broker fault is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerFault {
    /// The broker closes every connection of the drill's vhost (others are untouched).
    Close,
    /// The whole broker application stops and starts again (`rabbitmqctl stop_app; start_app`):
    /// every queue goes down and recovers from disk. Disturbs every user of the broker.
    Restart,
}

/// How a Postgres fault is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostgresFault {
    /// The server ends every backend of the drill's database.
    Terminate,
    /// The server stops at once (`-m immediate`, no checkpoint: crash recovery at start) and
    /// starts again. Disturbs every user of the server.
    Restart,
}

/// Runs a command of the servers' tools; a failure names the command and what it printed.
pub(crate) fn tool(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::Failed(format!("cannot run {program} {}: {e}", args.join(" "))))?;
    if !out.status.success() {
        return Err(Error::Failed(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A vhost of the drill's own, so that closing its connections touches nobody else.
pub fn create_vhost(vhost: &str, user: &str) -> Result<()> {
    tool("rabbitmqctl", &["-q", "add_vhost", vhost])?;
    tool(
        "rabbitmqctl",
        &["-q", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
    )?;
    Ok(())
}

/// Removes the drill's vhost and everything in it.
pub fn delete_vhost(vhost: &str) -> Result<()> {
    tool("rabbitmqctl", &["-q", "delete_vhost", vhost]).map(drop)
}

/// Injects one broker fault.
pub async fn broker(how: BrokerFault, vhost: &str) -> Result<()> {
    let vhost = vhost.to_owned();
    tokio::task::spawn_blocking(move || match how {
        BrokerFault::Close => tool(
            "rabbitmqctl",
            &[
                "-q",
                "close_all_connections",
                "--vhost",
                &vhost,
                "trailmark drill: broker fault",
            ],
        )
        .map(drop),
        BrokerFault::Restart => {
            tool("rabbitmqctl", &["-q", "stop_app"])?;
            tool("rabbitmqctl", &["-q", "start_app"]).map(drop)
        }
    })
    .await
    .map_err(|e| Error::Failed(format!("broker fault task: {e}")))?
}

/// Injects one Postgres fault on the drill's database `db`.
pub async fn postgres(how: PostgresFault, pool: &PgPool, db: &str) -> Result<()> {
    match how {
        PostgresFault::Terminate => {
            // The drill's own pool is spared (its application_name), so it can go on reading.
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> $2",
            )
            .bind(db)
            .bind(trailmark_bench::env::APPLICATION_NAME)
            .execute(pool)
            .await
            .map_err(trailmark::store::Error::from)?;
            Ok(())
        }
        PostgresFault::Restart => tokio::task::spawn_blocking(|| {
            let version = std::fs::read_dir("/etc/postgresql")
                .ok()
                .and_then(|mut d| d.next())
                .and_then(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .ok_or_else(|| {
                    Error::Failed(
                        "no cluster under /etc/postgresql: the postgres restart fault needs the server on this machine".into(),
                    )
                })?;
            let ctl = |action: &str, extra: &[&str]| {
                let mut args = vec!["--skip-systemctl-redirect", &version, "main", action];
                args.extend(extra);
                tool("pg_ctlcluster", &args)
            };
            ctl("stop", &["-m", "immediate"])?;
            ctl("start", &[]).map(drop)
        })
        .await
        .map_err(|e| Error::Failed(format!("postgres fault task: {e}")))?,
    }
}

/// Publishes `n` malformed messages beside the healthy ones, on a connection of their own (the
/// broker faults close the drill's); returns their message ids.
pub async fn poison(
    settings: &BrokerSettings,
    topology: &Topology,
    n: u32,
    first: u32,
    rng: &mut Rng,
) -> Result<Vec<String>> {
    let msgs: Vec<Outgoing> = (first..first + n)
        .map(|i| one_poison(topology, i, rng))
        .collect();
    let conn = broker::connect(settings, "drill-poison").await?;
    let publisher = Publisher::open(&conn, Duration::from_secs(30)).await?;
    let results = publisher.publish_all(&msgs).await;
    let _ = conn.close(200, "drill poison sent".into()).await;
    let mut ids = Vec::new();
    for (m, r) in msgs.iter().zip(results) {
        r?;
        ids.push(m.message_id.clone());
    }
    Ok(ids)
}

/// One malformed message: not JSON, JSON of another shape, a step of a workflow nobody runs,
/// an empty body, or a run start with an id no run may have.
fn one_poison(topology: &Topology, i: u32, rng: &mut Rng) -> Outgoing {
    let id = uuid::Uuid::from_u64_pair(rng.next_u64(), rng.next_u64()).to_string();
    let (exchange, key, body): (String, &str, Vec<u8>) = match i % 5 {
        0 => (topology.steps_exchange(), STEP_ROUTING_KEY, b"\xff\xfenot json at all".to_vec()),
        1 => (topology.steps_exchange(), STEP_ROUTING_KEY, br#"{"v":1,"surprise":true}"#.to_vec()),
        2 => (
            topology.steps_exchange(),
            STEP_ROUTING_KEY,
            format!(
                r#"{{"v":1,"message_id":"{id}","run_id":"drill-poison-{i}","workflow":"no-such-workflow","version":1,"step":"x","seq":0}}"#
            )
            .into_bytes(),
        ),
        3 => (topology.steps_exchange(), STEP_ROUTING_KEY, Vec::new()),
        _ => (
            topology.runs_exchange(),
            RUN_START_ROUTING_KEY,
            br#"{"run_id":"has spaces and / slashes","workflow":"chain","input":{}}"#.to_vec(),
        ),
    };
    Outgoing {
        message_id: id,
        exchange,
        routing_key: key.into(),
        headers: Default::default(),
        body,
    }
}

/// Runs a hook's command with `sh -c`, telling it the drill's step queue, broker prefix and
/// database (`DRILL_STEPS_QUEUE`, `DRILL_PREFIX`, `DRILL_DATABASE`); fails when it fails.
pub async fn hook(hook: &Hook, env: &BenchEnv) -> Result<()> {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(&hook.command)
        .env("DRILL_STEPS_QUEUE", env.topology().steps_queue())
        .env("DRILL_PREFIX", &env.prefix)
        .env("DRILL_DATABASE", &env.db_name);
    // What it says goes to the drill's stderr: stdout carries the report (JSON with --json).
    cmd.stdout(std::io::stderr()).stderr(std::io::stderr());
    let name = hook.name.clone();
    tokio::task::spawn_blocking(move || {
        let out = cmd
            .output()
            .map_err(|e| Error::Failed(format!("cannot run hook {name}: {e}")))?;
        if !out.status.success() {
            return Err(Error::Failed(format!(
                "hook {name} failed ({}): {}; the drill stops here (its processes are stopped, its database removed unless --keep)",
                out.status,
                "its output is above"
            )));
        }
        Ok(())
    })
    .await
    .map_err(|e| Error::Failed(format!("hook task: {e}")))?
}

/// How long after a fault the drill looks for stalls.
pub const STALL_WINDOW_SECS: f64 = 20.0;

/// The longest time without a committed step from `since` through the next
/// [`STALL_WINDOW_SECS`] (the last gap ends at the window's end only while runs were still
/// moving then, i.e. a commit came after it).
pub async fn longest_stall(pool: &PgPool, since: DateTime<Utc>) -> Result<Option<f64>> {
    let end = since + chrono::Duration::milliseconds((STALL_WINDOW_SECS * 1000.0) as i64);
    let times = inspect::commit_times_between(pool, since, end).await?;
    let later = inspect::first_commit_after(pool, None, end)
        .await?
        .is_some();
    let mut marks = vec![since];
    marks.extend(times);
    if later {
        marks.push(end);
    }
    let ms = |a: DateTime<Utc>, b: DateTime<Utc>| {
        (b - a).num_microseconds().unwrap_or(0) as f64 / 1000.0
    };
    Ok(marks
        .windows(2)
        .map(|w| ms(w[0], w[1]))
        .max_by(f64::total_cmp))
}

/// The time from `since` to the first step committed after it (`None`: none was).
pub async fn next_commit(pool: &PgPool, since: DateTime<Utc>) -> Result<Option<f64>> {
    let next = inspect::first_commit_after(pool, None, since).await?;
    Ok(next.map(|at| (at - since).num_microseconds().unwrap_or(0) as f64 / 1000.0))
}

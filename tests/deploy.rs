//! The files under `deploy/` against the binary and its defaults: every command they start exists,
//! a worker is given time to finish its steps in flight before it is killed, every long-running
//! process is probed on the endpoints it serves (on a port of its own under systemd), and a
//! process opens no more Postgres connections than the README tells operators to plan for.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::{Connection, PgConnection};
use trailmark::config::Settings;
use trailmark::store::connections_per_process;

const UNITS: [&str; 5] = [
    "deploy/systemd/trailmark-api.service",
    "deploy/systemd/trailmark-worker.service",
    "deploy/systemd/trailmark-relay.service",
    "deploy/systemd/trailmark-supervisor.service",
    "deploy/systemd/trailmark-migrate.service",
];
const MANIFEST: &str = "deploy/kubernetes/trailmark.yaml";

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The value after `key` on each line that has it, trimmed of quotes and spaces.
fn values<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix(key))
        .map(|v| v.trim().trim_matches(['"', '[', ']', ' ']))
        .collect()
}

/// Subcommands the deploy files run: `ExecStart=... trailmark X` and `args: ["X"]`.
fn subcommands() -> Vec<String> {
    let mut found: Vec<String> = UNITS
        .iter()
        .flat_map(|u| {
            values(&read(u), "ExecStart=")
                .into_iter()
                .map(|cmd| cmd.rsplit(' ').next().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    found.extend(
        values(&read(MANIFEST), "args:")
            .into_iter()
            .map(str::to_owned),
    );
    found
}

#[test]
fn every_command_the_deploy_files_start_exists() {
    let found = subcommands();
    assert_eq!(found.len(), 10, "5 units and 5 containers: {found:?}");
    for sub in found {
        let out = Command::new(common::trailmark_bin())
            .args([sub.as_str(), "--help"])
            .output()
            .expect("run trailmark");
        assert!(
            out.status.success(),
            "deploy/ starts `trailmark {sub}`, which the binary refuses: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_stopping_worker_gets_a_lease_period_and_more_before_it_is_killed() {
    let defaults = Settings::load_from(None).expect("defaults load");
    // Shutdown first answers 503 on /readyz for the drain delay, then gives steps in flight one
    // lease period, then 5 s to forget published rows.
    let drain = defaults.process.drain_delay_ms.div_ceil(1000);
    let needed = drain + defaults.worker.lease_secs + 5;
    let unit = read("deploy/systemd/trailmark-worker.service");
    let manifest = read(MANIFEST);
    let worker = manifest
        .split("\n---\n")
        .find(|doc| doc.contains("name: trailmark-worker\n"))
        .expect("the worker Deployment");
    let stop: Vec<u64> = values(&unit, "TimeoutStopSec=")
        .into_iter()
        .chain(values(worker, "terminationGracePeriodSeconds:"))
        .map(|v| v.parse().expect("a number of seconds"))
        .collect();
    assert_eq!(stop.len(), 2, "{stop:?}");
    for secs in stop {
        assert!(
            secs > needed,
            "a worker is killed {secs} s after SIGTERM, before its in-flight steps had their {needed} s"
        );
    }
}

/// The Kubernetes documents that run a long-lived process (not the migration Job).
fn long_running_documents() -> Vec<String> {
    read(MANIFEST)
        .split("\n---\n")
        .filter(|doc| doc.contains("kind: Deployment"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_long_running_container_is_probed_where_it_listens() {
    let docs = long_running_documents();
    assert_eq!(
        docs.len(),
        4,
        "worker, relay, supervisor and api Deployments"
    );
    for doc in docs {
        let name = values(&doc, "name:")
            .into_iter()
            .next()
            .unwrap_or_default()
            .to_owned();
        // Probes reach the pod's IP, so the process must listen beyond loopback, on the port
        // the probes name.
        assert!(
            doc.contains("name: TRAILMARK__API__LISTEN\n              value: \"0.0.0.0:8080\""),
            "{name}: api.listen must be 0.0.0.0:8080 for the kubelet to reach it"
        );
        assert!(doc.contains("containerPort: 8080"), "{name}: no http port");
        for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
            let at = doc
                .find(&format!("{probe}:"))
                .unwrap_or_else(|| panic!("{name}: no {probe}"));
            assert!(
                doc[at..]
                    .lines()
                    .nth(1)
                    .is_some_and(|l| l.contains(&format!("path: {path}"))),
                "{name}: {probe} does not ask {path}"
            );
        }
    }
}

#[test]
fn systemd_units_on_one_host_listen_on_ports_of_their_own() {
    let mut ports: Vec<&str> = Vec::new();
    let units: Vec<String> = UNITS.iter().map(|u| read(u)).collect();
    for (unit, text) in UNITS.iter().zip(&units) {
        if text.contains("Type=oneshot") {
            continue;
        }
        let listen = values(text, "Environment=TRAILMARK__API__LISTEN=");
        assert_eq!(listen.len(), 1, "{unit} sets no api.listen of its own");
        let port = listen[0].rsplit(':').next().unwrap_or_default();
        assert!(
            !ports.contains(&port),
            "{unit} listens on {port}, like another unit"
        );
        ports.push(port);
    }
    assert_eq!(ports.len(), 4, "{ports:?}");
}

/// A `serve` process under load opens no more Postgres connections than
/// `store::connections_per_process` counts: the figure the README gives operators for sizing
/// `max_connections`, and the one `trailmark bench --scale` sizes its processes' pools with.
/// Readiness probes arrive throughout, several at a time, as from a kubelet and scrapers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_process_opens_no_more_connections_than_documented() {
    const POOL: u32 = 4;
    const RUNS: i64 = 40;
    let env = common::TestEnv::new().await;
    // Its own connection, opened before the process: only the process's backends start later.
    let mut sampler = PgConnection::connect(&env.settings.database.url)
        .await
        .expect("connect");
    let since: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut sampler)
        .await
        .unwrap();
    let port = common::closed_port();
    let _serve = env.spawn_process_with(
        None,
        &[
            ("TRAILMARK__DATABASE__MAX_CONNECTIONS", POOL.to_string()),
            ("TRAILMARK__API__LISTEN", format!("127.0.0.1:{port}")),
        ],
    );
    let http = reqwest::Client::new();
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    for i in 0..RUNS {
        env.start_run("chain", &format!("r-conn-{i}"), json!({"steps": 5}))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut most, mut answered) = (0, 0);
    loop {
        let (open, done): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND backend_start > $1),
                    (SELECT count(*) FROM trailmark.runs WHERE status = 'succeeded')",
        )
        .bind(since)
        .fetch_one(&mut sampler)
        .await
        .unwrap();
        most = most.max(open);
        if done == RUNS {
            break;
        }
        let probes = (0..4).map(|_| http.get(&readyz).send());
        answered += futures_util::future::join_all(probes)
            .await
            .iter()
            .filter(|r| r.as_ref().is_ok_and(|r| r.status().is_success()))
            .count();
        assert!(Instant::now() < deadline, "{done} of {RUNS} runs succeeded");
        // A sampling period, not a wait for an event: the loop ends when the runs are done.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let counted = connections_per_process(POOL);
    assert!(
        most <= i64::from(counted),
        "a process with a pool of {POOL} opened {most} connections; connections_per_process says {counted}"
    );
    assert!(
        answered > 0,
        "no readiness probe was answered ready during the load"
    );
    // Presence, listener and at least one pool connection: the sampler saw the process.
    assert!(most >= 3, "only {most} connections seen");
}

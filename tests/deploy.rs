//! The files under `deploy/` against the binary and its defaults: every command they start exists,
//! and a worker is given time to finish its steps in flight before it is killed.

use std::path::Path;
use std::process::Command;

use trailmark::config::Settings;

const UNITS: [&str; 4] = [
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
    assert_eq!(found.len(), 8, "4 units and 4 containers: {found:?}");
    for sub in found {
        let out = Command::new(env!("CARGO_BIN_EXE_trailmark"))
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
    let lease = Settings::load_from(None)
        .expect("defaults load")
        .worker
        .lease_secs;
    // Shutdown gives steps in flight one lease period, then 5 s to forget published rows.
    let needed = lease + 5;
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

//! Servers restarted under a running workflow. These stop shared servers, so they run in their
//! own serial pass (see scripts/test), never beside other tests.

mod common;

use std::process::Command;
use std::time::Duration;

use common::TestEnv;
use serde_json::json;
use trailmark::domain::RunStatus;

const WAIT: Duration = Duration::from_secs(180);

fn run(cmd: &str, args: &[&str]) {
    let status = Command::new(cmd)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(status.success(), "{cmd} {args:?} failed: {status}");
}

fn pg_version() -> String {
    let entries = std::fs::read_dir("/etc/postgresql").expect("/etc/postgresql");
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .expect("a cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_mid_run_completes_with_nothing_lost() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    env.start_run(
        "chain",
        "r-broker",
        json!({"steps": 300, "step_delay_ms": 10}),
    )
    .await;
    env.wait_until("30 steps committed", WAIT, || async {
        env.steps_done("r-broker").await >= 30
    })
    .await;
    assert!(
        env.steps_done("r-broker").await < 250,
        "the run is nearly done before the restart; the test proves nothing"
    );
    tokio::task::spawn_blocking(|| {
        run("rabbitmqctl", &["stop_app"]);
        run("rabbitmqctl", &["start_app"]);
        run("rabbitmqctl", &["await_startup"]);
    })
    .await
    .unwrap();
    env.wait_status("r-broker", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(env.chain_ledger("r-broker").await, (300, 300));
    assert_eq!(env.steps_done("r-broker").await, 300);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_run_completes_with_nothing_lost() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    env.start_run("chain", "r-pg", json!({"steps": 300, "step_delay_ms": 10}))
        .await;
    env.wait_until("30 steps committed", WAIT, || async {
        env.steps_done("r-pg").await >= 30
    })
    .await;
    assert!(
        env.steps_done("r-pg").await < 250,
        "the run is nearly done before the restart; the test proves nothing"
    );
    tokio::task::spawn_blocking(|| {
        run(
            "pg_ctlcluster",
            &[
                "--skip-systemctl-redirect",
                &pg_version(),
                "main",
                "restart",
            ],
        );
    })
    .await
    .unwrap();
    env.wait_status("r-pg", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger("r-pg").await, (300, 300));
    assert_eq!(env.steps_done("r-pg").await, 300);
    running.stop().await;
}

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

/// What `/readyz` answers: its status and its reasons.
async fn readyz(http: &reqwest::Client, url: &str) -> (u16, String) {
    match http.get(url).send().await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_turns_503_while_the_broker_or_postgres_is_down_and_back_after() {
    let port = common::closed_port();
    let env = TestEnv::with(|s| s.api.listen = format!("127.0.0.1:{port}")).await;
    let running = env.spawn_all(env.engine());
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/readyz");
    let ready = |want: u16, reason: &'static str| {
        let (http, url) = (&http, &url);
        async move {
            let found = common::eventually(&format!("/readyz {want}"), WAIT, || async move {
                let (status, body) = readyz(http, url).await;
                (status == want && body.contains(reason)).then_some(body)
            })
            .await;
            found.unwrap_or_else(|| panic!("/readyz never answered {want} with {reason:?}"))
        }
    };
    ready(200, "\"ok\":true").await;

    tokio::task::spawn_blocking(|| run("rabbitmqctl", &["stop_app"]))
        .await
        .unwrap();
    ready(503, "the worker is not consuming").await;
    tokio::task::spawn_blocking(|| {
        run("rabbitmqctl", &["start_app"]);
        run("rabbitmqctl", &["await_startup"]);
    })
    .await
    .unwrap();
    ready(200, "\"ok\":true").await;

    let version = pg_version();
    let stop_version = version.clone();
    tokio::task::spawn_blocking(move || {
        run(
            "pg_ctlcluster",
            &[
                "--skip-systemctl-redirect",
                &stop_version,
                "main",
                "stop",
                "-m",
                "fast",
            ],
        )
    })
    .await
    .unwrap();
    ready(503, "Postgres").await;
    tokio::task::spawn_blocking(move || {
        run(
            "pg_ctlcluster",
            &["--skip-systemctl-redirect", &version, "main", "start"],
        )
    })
    .await
    .unwrap();
    ready(200, "\"ok\":true").await;
    running.stop().await;
}

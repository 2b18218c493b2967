//! The operator's view: the binary against the real servers, exactly as documented.

mod common;

use std::time::Duration;

use common::{TestEnv, text};
use trailmark::domain::RunStatus;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_quickstart_migrates_twice_starts_twice_and_shows_a_succeeded_run() {
    let env = TestEnv::new().await;
    for _ in 0..2 {
        let out = env.command(&["migrate"]).output().unwrap();
        assert!(out.status.success(), "migrate: {:?}", text(&out));
    }
    let _serve = env.spawn_process(None);
    for _ in 0..2 {
        let out = env
            .command(&[
                "run",
                "start",
                "chain",
                "--run-id",
                "r1",
                "--input",
                r#"{"steps":50}"#,
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "run start: {:?}", text(&out));
    }
    env.wait_status("r1", RunStatus::Succeeded, Duration::from_secs(60))
        .await;
    let out = env
        .command(&["run", "show", "r1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("run show --json prints JSON");
    assert_eq!(report["status"], "succeeded");
    assert_eq!(report["steps_done"], 50);
    assert_eq!(report["journal"]["entries"], 50);
    assert_eq!(report["effects"]["completed"], 50);
    let out = env
        .command(&["run", "list", "--status", "succeeded", "--json"])
        .output()
        .unwrap();
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        runs.as_array().map(Vec::len),
        Some(1),
        "the same run id started twice is one run"
    );
    // The table: an ended run is at no position, and each cell sits under its header.
    let out = env.command(&["run", "list"]).output().unwrap();
    let (table, _) = text(&out);
    let (header, row) = (table.lines().next().unwrap(), table.lines().nth(1).unwrap());
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cells[..4], ["r1", "chain", "succeeded", "-"], "{table}");
    for (name, cell) in [("status", "succeeded"), ("updated", cells[4])] {
        assert_eq!(header.find(name), row.find(cell), "{name} column\n{table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_servers_give_one_clear_line_without_the_password_and_exit_2() {
    let env = TestEnv::new().await;
    let out = env
        .command(&["run", "list"])
        .env("DATABASE_URL", "postgres://postgres:hunter2@127.0.0.1:1/x")
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot connect to Postgres") && err.contains("pg_ctlcluster"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "password leaked: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line expected: {err}");

    let out = env
        .command(&["run", "start", "chain", "--run-id", "r2"])
        .env("AMQP_URL", "amqp://guest:hunter2@127.0.0.1:1/%2f")
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot connect to RabbitMQ") && err.contains("rabbitmq-server -detached"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "password leaked: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_what_to_do() {
    let env = TestEnv::new().await;
    let long = "x".repeat(3_000);
    let cases: [(&[&str], &str); 7] = [
        (
            &["run", "start", "nope", "--run-id", "r3"],
            "workflow \"nope\" is not registered",
        ),
        (
            &["run", "start", "chain", "--run-id", "has space"],
            "invalid run id",
        ),
        (
            &["run", "start", "chain", "--run-id", "r3", "--input", "{bad"],
            "--input is not valid JSON",
        ),
        (&["run", "show", "missing"], "run missing not found"),
        (
            &["run", "watch", "missing", "--wait-secs", "0"],
            "run missing not found: list runs with `trailmark run list`",
        ),
        (
            &["run", "cancel", "missing", "--reason", &long],
            "--reason is 3000 characters long; at most 2000",
        ),
        (
            &["bench", "--quick", "--pool", "0"],
            "--pool must be at least 1",
        ),
    ];
    common::assert_each_refused(&env, &cases);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_serve_gracefully_with_exit_0_and_the_run_finishes_later() {
    let env = TestEnv::new().await;
    let mut serve = env.spawn_process(None);
    env.start_run(
        "chain",
        "r-term",
        serde_json::json!({"steps": 30, "step_delay_ms": 100}),
    )
    .await;
    env.wait_until("a few steps done", Duration::from_secs(60), || async {
        env.steps_done("r-term").await >= 3
    })
    .await;
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(serve.pid() as i32, libc::SIGTERM) };
    let status = tokio::task::spawn_blocking(move || serve.wait())
        .await
        .unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "serve should exit 0 on SIGTERM: {status:?}"
    );
    let run = trailmark::store::runs::get(&env.pool, "r-term")
        .await
        .unwrap()
        .unwrap();
    // Including the next position's lease, if the last commit pre-claimed it: a stopping
    // worker gives back the pre-claims no delivery took.
    assert!(
        run.lease_owner.is_none(),
        "the in-flight step finished and released its lease: {:?} until {:?}",
        run.lease_owner,
        run.lease_expires_at
    );
    let _again = env.spawn_process(None);
    env.wait_status("r-term", RunStatus::Succeeded, Duration::from_secs(60))
        .await;
    assert_eq!(env.chain_ledger("r-term").await, (30, 30));
    let repeated = env
        .scalar(
            "SELECT count(*) FROM trailmark.steps WHERE run_id = $1 AND attempts > 1",
            "r-term",
        )
        .await;
    assert_eq!(repeated, 0, "a graceful stop repeats nothing");
}

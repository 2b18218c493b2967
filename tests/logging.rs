//! Logging can never stall or kill a worker: `trailmark serve` logs into a pipe whose reader is
//! killed mid-run, the run still finishes and SIGTERM still ends the process cleanly.

mod common;

use std::fs::OpenOptions;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{ChildGuard, TestEnv};
use serde_json::json;
use trailmark::domain::RunStatus;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_log_pipe_stalls_no_run_and_sigterm_still_exits_0() {
    let env = TestEnv::new().await;
    let fifo = std::env::temp_dir().join(format!("{}-log", env.prefix));
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success(), "mkfifo {}", fifo.display());
    // The reader opens the pipe first, so that the writer's open does not block.
    let mut reader = ChildGuard(Some(
        Command::new("cat")
            .arg(&fifo)
            .stdout(Stdio::null())
            .spawn()
            .expect("cat the pipe"),
    ));
    let pipe = OpenOptions::new()
        .write(true)
        .open(&fifo)
        .expect("open the pipe");
    let mut serve = ChildGuard(Some(
        env.command(&["serve"])
            // Every step logs (DEBUG), so the worker writes to the pipe all along.
            .env("RUST_LOG", "debug,lapin=warn,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(pipe)
            .spawn()
            .expect("spawn trailmark serve"),
    ));
    env.start_run("chain", "r-log", json!({"steps": 100, "step_delay_ms": 50}))
        .await;
    env.wait_until("the run to pass step 10", WAIT, || async {
        let run = trailmark::store::runs::get(&env.pool, "r-log")
            .await
            .unwrap();
        run.is_some_and(|r| r.step_seq >= 10)
    })
    .await;
    reader.kill9();

    let run = env.wait_status("r-log", RunStatus::Succeeded, WAIT).await;
    assert_eq!(run.step_seq, 100);
    assert_eq!(env.chain_ledger("r-log").await, (100, 100));
    serve.signal(libc::SIGTERM);
    // Drain time: one lease for steps in flight, and a little more.
    let drain = Duration::from_secs(env.settings.worker.lease_secs + 5);
    let status = common::wait_exit(&mut serve, drain)
        .await
        .unwrap_or_else(|| panic!("serve ignored SIGTERM for {drain:?} with its log pipe closed"));
    assert_eq!(status.code(), Some(0), "{status}");
    let _ = std::fs::remove_file(&fifo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_delivery_logs_each_field_once_in_plain_text_and_steps_only_at_debug() {
    let env = TestEnv::new().await;
    let serve = |filter: &str, failpoints: &str| {
        env.command(&["serve"])
            .env("RUST_LOG", filter)
            .env("TRAILMARK_FAILPOINTS", failpoints)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn trailmark serve")
    };
    // The first commit fails as if Postgres went away: the delivery is retried in place, in the
    // same span, which used to print its ids once more per retry.
    let child = serve("debug,lapin=off,sqlx=warn", "step.before_commit=error@1");
    env.start_run("chain", "r-fields", json!({"steps": 2}))
        .await;
    env.wait_status("r-fields", RunStatus::Succeeded, WAIT)
        .await;
    let lines = stop_and_read(child);
    assert!(
        lines.iter().any(|l| l.contains("retrying it")),
        "the failpoint never made the delivery retry: {lines:#?}"
    );
    for line in &lines {
        assert!(
            line.matches("run.id=").count() <= 1,
            "a field repeated: {line}"
        );
        assert!(
            line.matches("attempt=").count() <= 1,
            "a field repeated: {line}"
        );
        assert!(!line.contains('\u{1b}'), "colour codes on a pipe: {line}");
    }

    // At INFO, the run's lifecycle shows and the per-step lines do not.
    let child = serve("info", "");
    env.start_run("chain", "r-quiet", json!({"steps": 3})).await;
    env.wait_status("r-quiet", RunStatus::Succeeded, WAIT).await;
    let lines = stop_and_read(child);
    let has = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(has("run started"), 1, "{lines:#?}");
    assert_eq!(has("run ended"), 1, "{lines:#?}");
    assert_eq!(
        has("model answered") + has("tool called") + has("step committed"),
        0,
        "{lines:#?}"
    );
}

/// SIGTERM, then every line the process wrote to stderr.
fn stop_and_read(child: std::process::Child) -> Vec<String> {
    // SAFETY: signalling our own child, which we reap below.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = child.wait_with_output().expect("serve output");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

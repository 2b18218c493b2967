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

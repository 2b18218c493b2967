//! Helpers for the DLQ tests: reading the DLQ and queue depths, running the binary, building
//! messages.

#![allow(dead_code)]

use std::process::{Output, Stdio};
use std::time::Duration;

use trailmark::broker::{self, Outgoing};
use trailmark::dlq::{DeadLetter, Dlq, quiet};
use trailmark::domain::{MessageId, RunId, StepMessage};

use crate::common::TestEnv;

/// Bound on every wait.
pub const WAIT: Duration = Duration::from_secs(120);

/// Every dead letter in the environment's DLQ (nothing is removed).
pub async fn dead_letters(env: &TestEnv) -> Vec<DeadLetter> {
    let dlq = Dlq::connect(&env.settings.broker).await.expect("dlq");
    let listing = dlq
        .list(&trailmark::dlq::Page::all(), &quiet)
        .await
        .expect("list");
    dlq.close().await;
    listing.letters
}

/// Ready messages in `queue`.
pub async fn depth(env: &TestEnv, queue: &str) -> u32 {
    let conn = broker::connect(&env.settings.broker, "test-depth")
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        durable: true,
        ..Default::default()
    };
    let q = ch
        .queue_declare(queue.into(), passive, Default::default())
        .await
        .expect("queue exists");
    let _ = conn.close(200, "done".into()).await;
    q.message_count()
}

/// Waits (bounded) until the DLQ holds exactly `n` messages.
pub async fn wait_dlq_depth(env: &TestEnv, n: u32) {
    let dlq = env.topology().dlq();
    env.wait_until(&format!("{n} messages in the DLQ"), WAIT, || async {
        depth(env, &dlq).await == n
    })
    .await;
}

/// Runs the binary with no terminal on stdin; returns (exit code, stdout, stderr).
pub async fn cli(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let mut cmd = env.command(args);
    cmd.stdin(Stdio::null());
    let out: Output = tokio::task::spawn_blocking(move || cmd.output().expect("run trailmark"))
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A message with no headers.
pub fn message(exchange: String, routing_key: &str, id: &str, body: Vec<u8>) -> Outgoing {
    Outgoing {
        message_id: id.to_owned(),
        exchange,
        routing_key: routing_key.into(),
        headers: Default::default(),
        body,
    }
}

/// A step message body for `run_id` at position 0, envelope version `v`.
pub fn step_body(run_id: &str, workflow: &str, v: u64) -> Vec<u8> {
    let msg = StepMessage {
        v,
        message_id: MessageId::new(),
        run_id: RunId::parse(run_id).unwrap(),
        workflow: workflow.into(),
        version: 1,
        step: "link".into(),
        seq: 0,
        trace: None,
    };
    msg.encode()
}

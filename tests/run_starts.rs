//! The same key with another payload is an error for the events that start runs, as for outside
//! writes; an input the workflow refuses never becomes a run; `run start` checks all of it before
//! it publishes, and `run show` explains a run that does not exist yet.

mod common;
mod dlq_support;

use std::io::Write;
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{TestEnv, text};
use dlq_support::{dead_letters, wait_dlq_depth};
use serde_json::json;
use trailmark::broker::Outgoing;
use trailmark::dlq::{Dlq, quiet};
use trailmark::domain::{RunId, RunStartEvent, RunStatus, request_hash};
use trailmark::engine::Engine;

const WAIT: Duration = Duration::from_secs(60);

/// A run-start event with a message id of the caller's choosing.
fn start(env: &TestEnv, message_id: &str, run_id: &str, input: serde_json::Value) -> Outgoing {
    let event = RunStartEvent::new(RunId::parse(run_id).unwrap(), "chain", input);
    Outgoing {
        message_id: message_id.to_owned(),
        ..env.topology().run_start(&event)
    }
}

/// The headers of the one dead letter with `reason`.
async fn letter_headers(env: &TestEnv, reason: &str) -> serde_json::Value {
    let letters = dead_letters(env).await;
    let found: Vec<_> = letters.iter().filter(|l| l.reason == reason).collect();
    assert_eq!(found.len(), 1, "one {reason} letter expected: {letters:?}");
    let dlq = Dlq::connect(&env.settings.broker).await.unwrap();
    let shown = dlq.show(&found[0].id, &quiet).await.unwrap();
    dlq.close().await;
    serde_json::to_value(&shown.headers).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_start_with_another_input_is_dead_lettered_as_run_conflict() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let _running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-c", json!({"steps": 1})).await;
    env.wait_status("r-c", RunStatus::Succeeded, WAIT).await;

    env.start_run("chain", "r-c", json!({"steps": 2})).await;
    wait_dlq_depth(&env, 1).await;
    let headers = letter_headers(&env, "run_conflict").await;
    assert_eq!(
        headers["x-trailmark-stored-input-hash"],
        json!(request_hash(&json!({"steps": 1})))
    );
    assert_eq!(
        headers["x-trailmark-event-input-hash"],
        json!(request_hash(&json!({"steps": 2})))
    );
    let run = trailmark::store::runs::get(&env.pool, "r-c")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(run.input, json!({"steps": 1}), "the first input stays");
    assert_eq!(env.chain_ledger("r-c").await, (1, 1));

    // A true repeat (same workflow and input, a new message id) is a duplicate, not a letter.
    let repeat = env.topology().run_start(&RunStartEvent::new(
        RunId::parse("r-c").unwrap(),
        "chain",
        json!({"steps": 1}),
    ));
    assert_dropped_as_duplicate(&env, &engine, &repeat).await;
}

/// Publishes `message` and waits until the worker drops it as a duplicate; the DLQ keeps its
/// one letter.
async fn assert_dropped_as_duplicate(env: &TestEnv, engine: &Engine, message: &Outgoing) {
    let before = engine.stats.duplicates.load(Ordering::Relaxed);
    env.publish(message).await;
    env.wait_until("the repeat dropped as a duplicate", WAIT, || async {
        engine.stats.duplicates.load(Ordering::Relaxed) > before
    })
    .await;
    assert_eq!(dead_letters(env).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_reused_with_another_body_is_dead_lettered_as_message_id_reuse() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let _running = env.spawn_all(engine.clone());
    let id = uuid::Uuid::new_v4().to_string();
    let first = start(&env, &id, "r-first", json!({"steps": 1}));
    env.publish(&first).await;
    env.wait_status("r-first", RunStatus::Succeeded, WAIT).await;

    let other = start(&env, &id, "r-second", json!({"steps": 1}));
    env.publish(&other).await;
    wait_dlq_depth(&env, 1).await;
    let headers = letter_headers(&env, "message_id_reuse").await;
    use sha2::Digest;
    let hash = |body: &[u8]| hex::encode(sha2::Sha256::digest(body));
    assert_eq!(
        headers["x-trailmark-stored-body-hash"],
        json!(hash(&first.body))
    );
    assert_eq!(headers["x-trailmark-body-hash"], json!(hash(&other.body)));
    assert!(
        trailmark::store::runs::get(&env.pool, "r-second")
            .await
            .unwrap()
            .is_none(),
        "the reused id's body was not processed"
    );

    // The same id with the same body is a redelivery: dropped, no letter.
    assert_dropped_as_duplicate(&env, &engine, &first).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_the_workflow_refuses_is_dead_lettered_as_bad_input_and_no_run_exists() {
    let env = TestEnv::new().await;
    let _running = env.spawn_all(env.engine());
    env.start_run("chain", "r-typo", json!({"stpes": 3})).await;
    env.start_run("chain", "r-list", json!([1, 2])).await;
    env.start_run("chain", "r-text", json!({"steps": "five"}))
        .await;
    wait_dlq_depth(&env, 3).await;
    let letters = dead_letters(&env).await;
    assert!(
        letters.iter().all(|l| l.reason == "bad_input"),
        "{letters:?}"
    );
    let details: Vec<String> = letters.iter().filter_map(|l| l.detail.clone()).collect();
    assert!(
        details.iter().any(|d| d.contains("unknown field `stpes`")),
        "{details:?}"
    );
    assert!(
        details.iter().any(|d| d.contains("must be a JSON object")),
        "{details:?}"
    );
    for run in ["r-typo", "r-list", "r-text"] {
        let found = trailmark::store::runs::get(&env.pool, run).await.unwrap();
        assert!(found.is_none(), "run {run} exists: {found:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_start_checks_input_size_and_existing_runs_before_publishing() {
    let env = TestEnv::new().await;
    let start_queue = env.topology().run_start_queue();
    let refused: [(&[&str], &str); 3] = [
        (
            &[
                "run",
                "start",
                "chain",
                "--run-id",
                "r1",
                "--input",
                r#"{"stpes":3}"#,
            ],
            "unknown field `stpes`, expected one of `steps`, `step_delay_ms`, `ledger`",
        ),
        (
            &[
                "run", "start", "chain", "--run-id", "r1", "--input", "[1,2]",
            ],
            "must be a JSON object",
        ),
        (
            &[
                "run",
                "start",
                "chain",
                "--run-id",
                "r1",
                "--input",
                r#"{"steps":"five"}"#,
            ],
            "does not accept this input",
        ),
    ];
    common::assert_each_refused(&env, &refused);
    // An input over the message limit, from a file.
    let big = std::env::temp_dir().join(format!("{}-big.json", env.prefix));
    let filler = "x".repeat(env.settings.worker.max_message_bytes);
    std::fs::write(
        &big,
        json!({"steps": 1, "step_delay_ms": 0, "note": filler}).to_string(),
    )
    .unwrap();
    let at_big = format!("@{}", big.display());
    let out = env
        .command(&[
            "run", "start", "chain", "--run-id", "r1", "--input", &at_big,
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&big);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("message limit (worker.max_message_bytes)"),
        "{err}"
    );
    assert_eq!(
        dlq_support::depth(&env, &start_queue).await,
        0,
        "nothing was published"
    );

    // From standard input; no worker yet, so run show explains where the start waits.
    let mut child = env
        .command(&["run", "start", "chain", "--run-id", "r1", "--input", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(br#"{"steps": 2}"#)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let out = env.command(&["run", "show", "r1"]).output().unwrap();
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("1 start event(s) wait in")
            && err.contains(&format!("no worker is consuming {start_queue}"))
            && err.contains("trailmark serve"),
        "{err}"
    );

    // With a worker, --wait returns once the run exists; then another input is refused.
    let _running = env.spawn_all(env.engine());
    env.wait_status("r1", RunStatus::Succeeded, WAIT).await;
    let out = env
        .command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            "r2",
            "--input",
            r#"{"steps":1}"#,
            "--wait",
        ])
        .output()
        .unwrap();
    let (stdout, err) = text(&out);
    assert!(out.status.success(), "{err}");
    assert!(stdout.contains("run r2 exists"), "{stdout}");
    let out = env
        .command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            "r1",
            "--input",
            r#"{"steps":3}"#,
        ])
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("exists with workflow chain and another input"),
        "{err}"
    );
    let out = env
        .command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            "r1",
            "--input",
            r#"{"steps":2}"#,
        ])
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    assert!(
        stdout.contains("already exists with this workflow and input"),
        "{stdout}"
    );
}

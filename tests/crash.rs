//! Real process crashes: `kill -9` from outside, and a failpoint that makes the process SIGKILL
//! itself at a named spot. A new process must finish the run without repeating finished work.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::TestEnv;
use serde_json::json;
use trailmark::domain::RunStatus;

const WAIT: Duration = Duration::from_secs(120);

/// (sum of attempts, positions attempted more than once)
async fn attempts(env: &TestEnv, run_id: &str) -> (i64, i64) {
    sqlx::query_as("SELECT COALESCE(sum(attempts), 0)::bigint, count(*) FILTER (WHERE attempts > 1) FROM trailmark.steps WHERE run_id = $1")
        .bind(run_id)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_run_then_a_new_process_finishes_with_each_write_once() {
    let env = TestEnv::new().await;
    let mut first = env.spawn_process(None);
    env.start_run(
        "chain",
        "r-kill9",
        json!({"steps": 200, "step_delay_ms": 5}),
    )
    .await;
    env.wait_until("60 steps committed", WAIT, || async {
        env.steps_done("r-kill9").await >= 60
    })
    .await;
    first.kill9();
    let done_at_kill = env.steps_done("r-kill9").await;
    assert!(
        done_at_kill < 200,
        "the run finished before the kill; the test proves nothing"
    );
    let _second = env.spawn_process(None);
    env.wait_status("r-kill9", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger("r-kill9").await, (200, 200));
    let (total, repeated) = attempts(&env, "r-kill9").await;
    // Only the one step in flight at the kill may have run twice; checkpointed steps never.
    assert!(
        total <= 201 && repeated <= 1,
        "attempts {total}, positions repeated {repeated}"
    );
}

/// Kills the process at `failpoint` on its 100th hit (inside step 100 = seq 99), restarts, and
/// returns the ledger's answer to the interrupted step's write as recorded in its effect.
async fn kill_inside_step_100_and_resume(
    env: &TestEnv,
    run_id: &str,
    failpoint: &str,
) -> serde_json::Value {
    let mut first = env.spawn_process(Some(&format!("{failpoint}=kill@100")));
    env.start_run("chain", run_id, json!({"steps": 150})).await;
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "the worker should have died by SIGKILL: {status:?}"
    );
    assert_eq!(env.steps_done(run_id).await, 99);
    assert_eq!(
        env.chain_ledger(run_id).await,
        (100, 100),
        "the write of step 100 reached the ledger"
    );
    let _second = env.spawn_process(None);
    env.wait_status(run_id, RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger(run_id).await, (150, 150));
    let seq99 = env
        .scalar(
            "SELECT attempts::bigint FROM trailmark.steps WHERE run_id = $1 AND seq = 99",
            run_id,
        )
        .await;
    assert_eq!(seq99, 2, "the interrupted step ran again");
    assert_eq!(
        attempts(env, run_id).await,
        (151, 1),
        "no other step ran twice"
    );
    sqlx::query_scalar("SELECT result FROM trailmark.effects WHERE idempotency_key = $1")
        .bind(format!("{run_id}:link:99"))
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_recorded_write_the_resumed_step_reuses_the_recorded_result() {
    let env = TestEnv::new().await;
    let result = kill_inside_step_100_and_resume(&env, "r-after-write", "chain.after_write").await;
    // The effect's result was recorded before the kill: the ledger was not called again.
    assert_eq!(result["created"], json!(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_a_write_and_its_record_the_ledger_key_absorbs_the_repeat() {
    let env = TestEnv::new().await;
    let result = kill_inside_step_100_and_resume(&env, "r-unknown", "effect.after_call").await;
    // Outcome unknown after the kill: the write was sent again under the same key, and the
    // ledger's unique reference turned it into a no-op.
    assert_eq!(result["created"], json!(false));
}

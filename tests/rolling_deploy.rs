//! Runs that outlive a deploy, with real processes: a run stays on the workflow version it
//! started with while processes of other versions come and go (graceful stops, a rolling
//! deploy under load), and `ctx.patched` keeps a run that passed a change point on the old
//! path, also across a kill -9. The processes stand for builds through the kit's
//! `TRAILMARK_CHAIN_VERSIONS` (which `chain` versions a process carries; a link of v2 says
//! `"code": 2` in its output) and the failpoint `chain.patch` (a build whose link prompt changed
//! behind `ctx.patched`).

mod common;
mod dlq_support;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::{ChildGuard, TestEnv};
use serde_json::{Value, json};
use trailmark::domain::{RunId, RunStartEvent, RunStatus};
use trailmark_testkit::CHAIN_VERSIONS;

const WAIT: Duration = Duration::from_secs(180);

/// `trailmark serve` carrying the `chain` versions `versions` (`"1,2"`), with `failpoints`.
fn build(env: &TestEnv, versions: &str, failpoints: Option<&str>) -> ChildGuard {
    env.spawn_process_with(failpoints, &[(CHAIN_VERSIONS, versions.to_owned())])
}

/// Publishes a `chain` start, on `version` when given.
async fn start(env: &TestEnv, run_id: &str, version: Option<i32>, input: Value) {
    let event = RunStartEvent {
        version,
        ..RunStartEvent::new(RunId::parse(run_id).unwrap(), "chain", input)
    };
    env.publish(&env.topology().run_start(&event)).await;
}

/// Live worker processes that carry `chain` at `version`.
async fn carriers(env: &TestEnv, version: i32) -> i64 {
    let live = trailmark::store::deployments::live(&env.pool)
        .await
        .unwrap();
    live.iter()
        .find(|c| c.workflow == "chain" && c.version == version)
        .map_or(0, |c| c.workers)
}

/// Waits until `n` live processes carry `chain` v`version`.
async fn wait_carriers(env: &TestEnv, version: i32, n: i64) {
    env.wait_until(
        &format!("{n} processes carrying chain v{version}"),
        WAIT,
        || async { carriers(env, version).await == n },
    )
    .await;
}

/// Stops a process with SIGTERM and checks that it exited cleanly.
fn stop_gracefully(process: &mut ChildGuard) {
    process.signal(libc::SIGTERM);
    let status = process.wait();
    assert!(
        status.success(),
        "SIGTERM did not stop it cleanly: {status:?}"
    );
}

/// Runs whose id starts with `prefix` and whose status is `status`.
async fn count(env: &TestEnv, prefix: &str, status: Option<RunStatus>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.runs WHERE starts_with(run_id, $1)
            AND ($2::text IS NULL OR status = $2)",
    )
    .bind(prefix)
    .bind(status.map(|s| s.to_string()))
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// The outputs of the run's committed links, in order.
async fn outputs(env: &TestEnv, run_id: &str) -> Vec<Value> {
    sqlx::query_scalar(
        "SELECT output FROM trailmark.steps WHERE run_id = $1 AND finished_at IS NOT NULL
          ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// The run's version, and the `"code"` each committed link's output names (None: v1 code).
async fn code_per_link(env: &TestEnv, run_id: &str) -> (i32, Vec<Option<i64>>) {
    let version: i32 =
        sqlx::query_scalar("SELECT workflow_version FROM trailmark.runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    let outputs = outputs(env, run_id).await;
    (
        version,
        outputs.iter().map(|o| o["code"].as_i64()).collect(),
    )
}

/// Every run of `ids` succeeded on version `version`'s code with `links` links, each written once.
async fn assert_finished_on(env: &TestEnv, ids: &[String], version: i32, links: usize) {
    let code = (version >= 2).then_some(i64::from(version));
    for id in ids {
        env.wait_status(id, RunStatus::Succeeded, WAIT).await;
        assert_eq!(
            code_per_link(env, id).await,
            (version, vec![code; links]),
            "run {id}: its version, and the version of the code that ran each link"
        );
        assert_eq!(
            env.chain_ledger(id).await,
            (links as i64, links as i64),
            "run {id}"
        );
    }
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_v1_runs_finish_on_v1_code_when_the_v1_process_stops_beside_a_v2_one_and_new_runs_start_on_v2()
 {
    let env = TestEnv::new().await;
    let mut old = build(&env, "1", None);
    let old_runs = ids("old", 50);
    for id in &old_runs {
        start(&env, id, None, json!({"steps": 4, "step_delay_ms": 1000})).await;
    }
    env.wait_until("the 50 runs started on v1", WAIT, || async {
        count(&env, "old-", None).await == 50
    })
    .await;
    let _new = build(&env, "1,2", None);
    wait_carriers(&env, 2, 1).await;
    let under_way = 50 - count(&env, "old-", Some(RunStatus::Succeeded)).await;
    assert!(
        under_way > 0,
        "the runs ended before the deploy; the test proves nothing"
    );
    stop_gracefully(&mut old);

    let new_runs = ids("new", 10);
    for id in &new_runs {
        start(&env, id, None, json!({"steps": 2})).await;
    }
    assert_finished_on(&env, &old_runs, 1, 4).await;
    assert_finished_on(&env, &new_runs, 2, 2).await;
    assert_eq!(count(&env, "", Some(RunStatus::NeedsReview)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_of_processes_of_two_versions_under_load_loses_and_stalls_nothing() {
    let env = TestEnv::new().await;
    // B carries both versions and takes every start: half the runs are pinned to each.
    let mut b = build(&env, "1,2", None);
    let (v1, v2) = (ids("v1", 20), ids("v2", 20));
    // The v1 runs are the longer ones: some must still be under way when C, which lacks v1,
    // joins, so that C meets v1 steps and sends them to A.
    for (id_1, id_2) in v1.iter().zip(&v2) {
        start(
            &env,
            id_1,
            Some(1),
            json!({"steps": 10, "step_delay_ms": 800}),
        )
        .await;
        start(
            &env,
            id_2,
            Some(2),
            json!({"steps": 6, "step_delay_ms": 300}),
        )
        .await;
    }
    env.wait_until("the 40 runs started", WAIT, || async {
        count(&env, "v", None).await == 40
    })
    .await;
    // A, an old build, joins: v2 steps it meets wait for B.
    let mut a = build(&env, "1", None);
    wait_carriers(&env, 1, 2).await;
    env.wait_until("80 links done", WAIT, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM trailmark.steps WHERE finished_at IS NOT NULL",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap()
            >= 80
    })
    .await;
    // B is replaced by C, a build that dropped v1: for a while only A (v1) is up and the v2
    // steps wait for C; then the v1 steps C meets wait for A.
    stop_gracefully(&mut b);
    let left = 40 - count(&env, "v", Some(RunStatus::Succeeded)).await;
    assert!(
        left > 0,
        "the runs ended before B stopped; the test proves nothing"
    );
    let _c = build(&env, "2", None);
    wait_carriers(&env, 2, 1).await;
    let v1_left = 20 - count(&env, "v1-", Some(RunStatus::Succeeded)).await;
    assert!(
        v1_left > 0,
        "the v1 runs ended before C joined; the test proves less"
    );
    assert_finished_on(&env, &v1, 1, 10).await;
    stop_gracefully(&mut a);

    assert_finished_on(&env, &v2, 2, 6).await;
    assert_eq!(count(&env, "", Some(RunStatus::NeedsReview)).await, 0);
    assert_eq!(
        dlq_support::dead_letters(&env).await.len(),
        0,
        "a step went to the DLQ"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_a_version_no_live_process_carries_stops_for_review_saying_what_to_do() {
    let env = TestEnv::new().await;
    let mut old = build(&env, "1", Some("chain.after_write=kill@1"));
    start(&env, "orphan", None, json!({"steps": 2})).await;
    assert_eq!(old.wait().signal(), Some(libc::SIGKILL));
    // The only build left carries v2 alone: nobody will run the v1 step, so a person decides.
    let _new = build(&env, "2", None);
    let run = env
        .wait_status("orphan", RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    assert!(
        error.contains("started on chain v1") && error.contains("--after-fix"),
        "{error}"
    );
    assert_eq!(env.chain_ledger("orphan").await, (1, 1));
}

/// Journal entry kinds of position `seq`, in call order.
async fn kinds(env: &TestEnv, run_id: &str, seq: i32) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT kind FROM trailmark.journal WHERE run_id = $1 AND seq = $2 ORDER BY call_no",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// Which path each committed link of the run took (`"patched"` in its output).
async fn paths(env: &TestEnv, run_id: &str) -> Vec<Option<bool>> {
    let outputs = outputs(env, run_id).await;
    outputs.iter().map(|o| o["patched"].as_bool()).collect()
}

/// Starts a two-link run on the old build, which kills itself after link 0's write: the link
/// passed the change point (its model answer is journaled) but is not committed.
async fn crash_past_the_change(env: &TestEnv, run_id: &str) {
    let mut old = build(env, "1", Some("chain.after_write=kill@1"));
    start(env, run_id, None, json!({"steps": 2})).await;
    let status = old.wait();
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the old build was not killed"
    );
    assert_eq!(kinds(env, run_id, 0).await, ["model"]);
    assert_eq!(env.steps_done(run_id).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patched_keeps_the_old_path_for_a_run_past_the_change_and_takes_the_new_one_for_the_others_across_kill_9()
 {
    let env = TestEnv::new().await;
    crash_past_the_change(&env, "past").await;
    // The patched build retries link 0 on the old path, takes the new one at link 1, and is
    // killed after link 1's write: its choice was journaled before the new path acted.
    let mut patched = build(
        &env,
        "1",
        Some("chain.patch=error;chain.after_write=kill@2"),
    );
    let status = patched.wait();
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the patched build was not killed"
    );
    assert_eq!(kinds(&env, "past", 1).await, ["patch", "model"]);
    let _patched = build(&env, "1", Some("chain.patch=error"));
    env.wait_status("past", RunStatus::Succeeded, WAIT).await;
    assert_eq!(paths(&env, "past").await, [Some(false), Some(true)]);
    assert_eq!(kinds(&env, "past", 0).await, ["model"]);
    assert_eq!(kinds(&env, "past", 1).await, ["patch", "model"]);
    assert_eq!(env.chain_ledger("past").await, (2, 2));
    assert_eq!(
        (env.attempts("past", 0).await, env.attempts("past", 1).await),
        (2, 2)
    );

    start(&env, "fresh", None, json!({"steps": 3})).await;
    env.wait_status("fresh", RunStatus::Succeeded, WAIT).await;
    assert_eq!(paths(&env, "fresh").await, [Some(true); 3]);
    for seq in 0..3 {
        assert_eq!(kinds(&env, "fresh", seq).await, ["patch", "model"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_change_without_patched_stops_a_run_past_it_for_review() {
    let env = TestEnv::new().await;
    crash_past_the_change(&env, "unguarded").await;
    let _edited = build(&env, "1", Some("chain.new_prompt=error"));
    let run = env
        .wait_status("unguarded", RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    assert!(error.contains("differs from the journaled one"), "{error}");
    assert_eq!(env.chain_ledger("unguarded").await, (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_start_on_a_named_version_pins_the_run_and_refuses_one_this_build_lacks() {
    let env = TestEnv::new().await;
    let _new = build(&env, "1,2", None);
    let start = |version: &str, run_id: &str| {
        let mut cmd = env.command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            run_id,
            "--input",
            r#"{"steps": 2}"#,
            "--version",
            version,
            "--wait",
        ]);
        cmd.env(CHAIN_VERSIONS, "1,2");
        cmd.output().unwrap()
    };
    let out = start("1", "named-v1");
    assert!(out.status.success(), "{:?}", common::text(&out));
    assert_finished_on(&env, &["named-v1".to_owned()], 1, 2).await;
    let out = start("3", "named-v3");
    let (_, err) = common::text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("workflow chain v3 is not deployed here (this binary carries v1, v2)"),
        "{err}"
    );
    assert_eq!(count(&env, "named-v3", None).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_naming_a_version_only_some_processes_carry_all_become_runs_on_it() {
    let env = TestEnv::new().await;
    let _old = build(&env, "1", None);
    let _new = build(&env, "1,2", None);
    wait_carriers(&env, 1, 2).await;
    wait_carriers(&env, 2, 1).await;
    // Both consume the start queue: a start the old build takes is sent on to the new one.
    let named = ids("named", 20);
    for id in &named {
        start(&env, id, Some(2), json!({"steps": 2})).await;
    }
    assert_finished_on(&env, &named, 2, 2).await;
    assert_eq!(
        dlq_support::dead_letters(&env).await.len(),
        0,
        "a start went to the DLQ"
    );
}

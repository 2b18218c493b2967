//! Fan-out and fan-in (issue 34): a step that ends by starting child runs and waiting for
//! them. A parent killed while it starts 200 children starts each exactly once; a map keeps at
//! most `max_in_flight` children running; past the failure threshold the parent stops for
//! review naming the failed children, and a resume after the fix retries only those; a fan-out
//! the engine cannot keep is refused before any child starts.

mod common;

use std::time::{Duration, Instant};

use common::{ChildGuard, TestEnv, wait_exit};
use serde_json::{Value, json};
use trailmark::domain::RunStatus;
use trailmark::failpoint::Failpoints;
use trailmark::operator::{Decider, Resume};

const WAIT: Duration = Duration::from_secs(120);

/// A `chain` parent of 2 links whose link 0 starts `children` (the `children` input of chain).
fn parent(children: Value) -> Value {
    json!({"steps": 2, "children": children})
}

/// Child runs of a parent, by status.
async fn children_by_status(env: &TestEnv, parent: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT status, count(*) FROM trailmark.runs WHERE parent_run_id = $1
          GROUP BY status ORDER BY status",
    )
    .bind(parent)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// (rows, distinct references) in `chain_ledger` over every child of a parent.
async fn children_ledger(env: &TestEnv, parent: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(DISTINCT l.reference) FROM trailmark.chain_ledger l
           JOIN trailmark.runs r ON r.run_id = l.run_id WHERE r.parent_run_id = $1",
    )
    .bind(parent)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// Each child's run id and fence (raised by every claim and decision), by index.
async fn fences(env: &TestEnv, parent: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT c.run_id, r.fence FROM trailmark.children c JOIN trailmark.runs r USING (run_id)
          WHERE c.parent_run_id = $1 ORDER BY c.idx",
    )
    .bind(parent)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// How the parent's waits ended, in order.
async fn resolutions(env: &TestEnv, run_id: &str) -> Vec<Option<String>> {
    sqlx::query_scalar("SELECT resolution FROM trailmark.waits WHERE run_id = $1 ORDER BY seq")
        .bind(run_id)
        .fetch_all(&env.pool)
        .await
        .unwrap()
}

/// Kills a serve process (if still alive) and waits for it to be gone.
async fn kill(mut process: ChildGuard) {
    if wait_exit(&mut process, Duration::from_millis(1))
        .await
        .is_none()
    {
        process.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_killed_while_starting_200_children_and_a_child_killed_mid_step_start_each_once() {
    let env = TestEnv::new().await;
    // Killed at the 100th child of its commit's transaction: none of the 200 may survive it.
    let mut first = env.spawn_process(Some("children.starting=kill@100"));
    let input = parent(json!({"at": 0, "count": 200, "steps": 2}));
    env.start_run("chain", "fan", input).await;
    let status = wait_exit(&mut first, WAIT).await.expect("killed mid-start");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    assert_eq!(
        children_by_status(&env, "fan").await,
        [],
        "a fan-out killed halfway through starting its children started none"
    );
    // The next process starts them all at once, then dies after a child's write, before its
    // commit (the parent's link is the first write of this process).
    let mut second = env.spawn_process(Some("chain.after_write=kill@40"));
    let status = wait_exit(&mut second, WAIT).await.expect("killed mid-step");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let started: i64 = env
        .scalar(
            "SELECT count(*) FROM trailmark.runs WHERE parent_run_id = $1",
            "fan",
        )
        .await;
    assert_eq!(started, 200, "the commit started every child at once");
    let third = env.spawn_process(None);
    env.wait_status("fan", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        children_by_status(&env, "fan").await,
        [("succeeded".into(), 200)]
    );
    assert_eq!(
        children_ledger(&env, "fan").await,
        (400, 400),
        "each child's two ledger rows, once each, the killed child's included"
    );
    assert_eq!(
        resolutions(&env, "fan").await,
        [Some("children".into())],
        "the parent was joined once"
    );
    assert_eq!(
        env.attempts("fan", 1).await,
        1,
        "the step after the join ran once"
    );
    assert_eq!(env.chain_ledger("fan").await, (2, 2));
    let last: Value = sqlx::query_scalar("SELECT output FROM trailmark.runs WHERE run_id = 'fan'")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(last["children"]["succeeded"], 200, "{last}");
    kill(third).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_map_over_100_items_keeps_at_most_5_children_running_and_finishes_them_all() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let input = parent(json!({"at": 0, "count": 100, "steps": 2, "max_in_flight": 5}));
    env.start_run("chain", "map", input).await;
    let (mut most, mut samples) = (0, 0);
    let deadline = Instant::now() + WAIT;
    loop {
        let (in_flight, status): (i64, Option<String>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM trailmark.runs WHERE parent_run_id = 'map'
                        AND status NOT IN ('succeeded', 'failed', 'cancelled', 'compensated')),
                    (SELECT status FROM trailmark.runs WHERE run_id = 'map')",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert!(in_flight <= 5, "{in_flight} children running at once");
        most = most.max(in_flight);
        samples += 1;
        if status.as_deref() == Some("succeeded") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the map did not finish: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        children_by_status(&env, "map").await,
        [("succeeded".into(), 100)]
    );
    assert_eq!(children_ledger(&env, "map").await, (200, 200));
    assert_eq!(most, 5, "the map ran 5 at once ({samples} samples)");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_threshold_the_parent_stops_naming_the_failed_children_and_a_resume_retries_only_them()
 {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let input = parent(json!({"at": 0, "count": 10, "fail": [2, 5, 7], "fail_threshold": 1}));
    env.start_run("chain", "thr", input).await;
    let stopped = env.wait_status("thr", RunStatus::NeedsReview, WAIT).await;
    assert_eq!(stopped.step_seq, 0, "stopped at the fan-out's step");
    let (shown, _) = common::text(&env.command(&["run", "show", "thr"]).output().unwrap());
    assert!(
        shown.contains("stopped for review") && shown.contains("thr:0:"),
        "{shown}"
    );
    let note = stopped.handover.expect("a handover note");
    let failed: Vec<String> = note["failed"]
        .as_array()
        .expect("the failed children")
        .iter()
        .map(|c| c["run_id"].as_str().unwrap().to_owned())
        .collect();
    let expected = ["thr:0:2", "thr:0:5", "thr:0:7"];
    assert!(failed.len() >= 2, "{note}");
    assert!(
        failed.iter().all(|f| expected.contains(&f.as_str())),
        "{note}"
    );
    assert!(
        note["failed"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("`fail`"),
        "{note}"
    );
    // Every child ends: the seven succeed, the three stop for review.
    env.wait_until("every child to end", WAIT, || async {
        children_by_status(&env, "thr").await
            == [("needs_review".into(), 3), ("succeeded".into(), 7)]
    })
    .await;
    running.stop().await;
    let fences_before = fences(&env, "thr").await;
    // The fix is deployed (a process that runs the failing link through), then the parent is
    // resumed: only the three failed children run again.
    let fixed = Failpoints::parse("chain.fixed=error").unwrap();
    let engine = env.engine_with(trailmark_reference::registry(), fixed);
    let running = env.spawn_all(engine.clone());
    let who = Decider::cli("tester", "fix deployed");
    trailmark::operator::resume(&engine, "thr", &who, Resume::AfterFix)
        .await
        .expect("resumed");
    env.wait_status("thr", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        children_by_status(&env, "thr").await,
        [("succeeded".into(), 10)]
    );
    let fences_after = fences(&env, "thr").await;
    for ((child, before), (_, after)) in fences_before.iter().zip(&fences_after) {
        let retried = expected.contains(&child.as_str());
        assert_eq!(
            after != before,
            retried,
            "child {child}: fence {before} -> {after}"
        );
        assert_eq!(env.chain_ledger(child).await, (1, 1), "child {child}");
    }
    assert_eq!(
        resolutions(&env, "thr").await,
        [Some("children".into())],
        "stopped once, then joined once"
    );
    let (ran_before_resume,): (bool,) = sqlx::query_as(
        "SELECT s.finished_at < d.created_at FROM trailmark.steps s
           JOIN trailmark.decisions d ON d.run_id = s.run_id AND d.action = 'resume_after_fix'
          WHERE s.run_id = 'thr' AND s.seq = 0",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        ran_before_resume,
        "the fan-out step did not run again after the resume"
    );
    assert_eq!(env.chain_ledger("thr").await, (2, 2));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_the_engine_cannot_keep_is_refused_before_any_child_starts() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let cases = [
        (
            "too-many",
            json!({"at": 0, "count": 10_001}),
            "the most one step may start is 10000",
        ),
        (
            "threshold",
            json!({"at": 0, "count": 3, "fail_threshold": 4}),
            "failure threshold is 4",
        ),
        (
            "share",
            json!({"at": 0, "count": 3, "fail_threshold": 1.5}),
            "share of 1.5",
        ),
        (
            "first",
            json!({"at": 0, "count": 3, "first": 4}),
            "the first 4",
        ),
        (
            "in-flight",
            json!({"at": 0, "count": 3, "max_in_flight": 0}),
            "max_in_flight is 0",
        ),
    ];
    for (id, children, _) in &cases {
        env.start_run("chain", id, parent(children.clone())).await;
    }
    for (id, _, why) in &cases {
        let run = env.wait_status(id, RunStatus::NeedsReview, WAIT).await;
        let error = run.error.unwrap_or_default();
        assert!(
            error.contains(why) && error.contains("no child was started"),
            "{id}: {error}"
        );
        assert_eq!(children_by_status(&env, id).await, [], "{id}");
    }
    // A parent id too long for its children's ids is refused the same way.
    let long = "p".repeat(197);
    env.start_run("chain", &long, parent(json!({"at": 0, "count": 2})))
        .await;
    let run = env.wait_status(&long, RunStatus::NeedsReview, WAIT).await;
    assert!(
        run.error.unwrap_or_default().contains("run ids"),
        "too long"
    );
    running.stop().await;
}

/// The children rows of a parent by state.
async fn children_by_state(env: &TestEnv, parent: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT state, count(*) FROM trailmark.children WHERE parent_run_id = $1
          GROUP BY state ORDER BY state",
    )
    .bind(parent)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_parent_cancels_its_running_children_and_starts_no_more() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    let children = json!({"at": 0, "count": 6, "steps": 50, "max_in_flight": 3});
    env.start_run("chain", "cx", parent(children)).await;
    env.wait_until("three children to run", WAIT, || async {
        children_by_status(&env, "cx").await == [("running".into(), 3)]
    })
    .await;
    let who = Decider::cli("tester", "wrong batch");
    let outcome = trailmark::operator::cancel(&engine, "cx", &who)
        .await
        .unwrap();
    assert!(outcome.next.contains("3 child run(s)"), "{}", outcome.next);
    assert_eq!(
        children_by_status(&env, "cx").await,
        [("cancelled".into(), 3)]
    );
    assert_eq!(
        children_by_state(&env, "cx").await,
        [("cancelled".into(), 3), ("skipped".into(), 3)],
        "the three never started stay unstarted"
    );
    // A child's step in flight when the cancel came commits nothing: every child stays where
    // the cancel left it, and no fourth child starts.
    let steps: i64 = env
        .scalar(
            "SELECT count(*) FROM trailmark.steps s JOIN trailmark.runs r USING (run_id)
              WHERE r.parent_run_id = $1 AND s.finished_at IS NOT NULL",
            "cx",
        )
        .await;
    running.stop().await;
    let after: i64 = env
        .scalar(
            "SELECT count(*) FROM trailmark.steps s JOIN trailmark.runs r USING (run_id)
              WHERE r.parent_run_id = $1 AND s.finished_at IS NOT NULL",
            "cx",
        )
        .await;
    assert_eq!(after, steps, "no child step committed after the cancel");
    assert_eq!(
        children_by_status(&env, "cx").await,
        [("cancelled".into(), 3)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undoing_a_parent_undoes_its_children_and_the_ledger_nets_to_zero() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run(
        "chain",
        "ux",
        parent(json!({"at": 0, "count": 5, "steps": 2})),
    )
    .await;
    env.wait_status("ux", RunStatus::Succeeded, WAIT).await;
    // The tree, both ways: the parent counts its children and says how to list them; each
    // child names its parent.
    let (shown, err) = common::text(&env.command(&["run", "show", "ux"]).output().unwrap());
    assert!(
        shown.contains("children of position 0 (joined") && shown.contains("5 in all, 5 succeeded"),
        "{shown}{err}"
    );
    assert!(shown.contains("trailmark run list --parent ux"), "{shown}");
    let (listed, _) = common::text(
        &env.command(&["run", "list", "--parent", "ux"])
            .output()
            .unwrap(),
    );
    assert_eq!(listed.matches("ux:0:").count(), 5, "{listed}");
    let (child, _) = common::text(&env.command(&["run", "show", "ux:0:3"]).output().unwrap());
    assert!(child.contains("child of run ux"), "{child}");
    let opts = trailmark::operator::UndoOptions::everything();
    let preview = trailmark::operator::undo_preview(&engine, "ux", opts.clone())
        .await
        .unwrap();
    assert_eq!(preview.compensations.len(), 2, "the parent's two links");
    assert_eq!(preview.children.len(), 5, "{preview:?}");
    assert!(preview.children.iter().all(|c| c.compensations.len() == 2));
    let who = Decider::cli("tester", "the batch was wrong");
    let outcome = trailmark::operator::undo(&engine, "ux", &who, opts)
        .await
        .unwrap();
    assert!(outcome.next.contains("5 child run(s)"), "{}", outcome.next);
    env.wait_status("ux", RunStatus::Compensated, WAIT).await;
    env.wait_until("every child to be compensated", WAIT, || async {
        children_by_status(&env, "ux").await == [("compensated".into(), 5)]
    })
    .await;
    let (written, reversed): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE reference NOT LIKE 'undo:%'),
                count(*) FILTER (WHERE reference LIKE 'undo:%'
                                   AND substr(reference, 6) IN (SELECT reference FROM trailmark.chain_ledger))
           FROM trailmark.chain_ledger WHERE run_id = 'ux' OR run_id LIKE 'ux:%'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((written, reversed), (12, 12), "each write reversed once");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_cancelled_alone_counts_as_failed_and_stops_its_parent_past_the_threshold() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run(
        "chain",
        "c1",
        parent(json!({"at": 0, "count": 3, "steps": 50})),
    )
    .await;
    env.wait_until("the children to run", WAIT, || async {
        children_by_status(&env, "c1").await == [("running".into(), 3)]
    })
    .await;
    let who = Decider::cli("tester", "not needed");
    trailmark::operator::cancel(&engine, "c1:0:1", &who)
        .await
        .unwrap();
    let stopped = env.wait_status("c1", RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["failed"][0]["run_id"], "c1:0:1", "{note}");
    assert_eq!(note["failed"][0]["state"], "cancelled", "{note}");
    assert!(
        note["failed"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("cancelled by tester")
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_resume_of_a_parent_runs_its_failed_children_again_counting_their_attempts_on() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let input = parent(json!({"at": 0, "count": 3, "fail": [1], "fail_threshold": 0}));
    env.start_run("chain", "plain", input).await;
    env.wait_status("plain", RunStatus::NeedsReview, WAIT).await;
    let attempts = |child: &'static str| {
        let pool = env.pool.clone();
        async move {
            let (n,): (i32,) =
                sqlx::query_as("SELECT max(attempts) FROM trailmark.steps WHERE run_id = $1")
                    .bind(child)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            n
        }
    };
    env.wait_status("plain:0:1", RunStatus::NeedsReview, WAIT)
        .await;
    assert_eq!(attempts("plain:0:1").await, 1);
    // No fix deployed: the child fails again, on its second attempt, not on a first one again
    // (a failure meant for one attempt, like a drill's forced review, must not come back).
    let engine = env.engine();
    let who = Decider::cli("tester", "try again");
    trailmark::operator::resume(&engine, "plain", &who, Resume::Again)
        .await
        .expect("resumed");
    env.wait_until("the child's second attempt", WAIT, || async {
        attempts("plain:0:1").await == 2
    })
    .await;
    env.wait_status("plain", RunStatus::NeedsReview, WAIT).await;
    env.wait_status("plain:0:1", RunStatus::NeedsReview, WAIT)
        .await;
    assert_eq!(attempts("plain:0:1").await, 2, "counted on, never reset");
    running.stop().await;
}

/// Sends the event `name` keyed `key` through the CLI.
fn send_event(env: &TestEnv, name: &str, key: &str) {
    let out = env
        .command(&["event", "send", name, "--key", key])
        .output()
        .unwrap();
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "event send: {stdout}{stderr}");
}

/// Whether `run_id` has an open wait at position `seq`.
async fn waits_at(env: &TestEnv, run_id: &str, seq: i32) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.waits WHERE run_id = $1 AND seq = $2
                          AND resolved_at IS NULL)",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_whose_event_wait_times_out_count_as_failed_and_a_resume_retries_only_them() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    // Every child waits after its link 0 for `reply` (no step to go to on timeout); only child
    // 1's reply comes.
    let wait = json!({"at": 0, "event": "reply", "timeout_secs": 4});
    let children = json!({"at": 0, "count": 3, "steps": 2, "wait": wait});
    env.start_run("chain", "tw", parent(children)).await;
    env.wait_until("child 1 to wait", WAIT, || async {
        waits_at(&env, "tw:0:1", 0).await
    })
    .await;
    send_event(&env, "reply", "tw:0:1");
    let stopped = env.wait_status("tw", RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["error_class"], "children_failed", "{note}");
    let failed = note["failed"].as_array().expect("the failed children");
    assert!(!failed.is_empty(), "{note}");
    for child in failed {
        assert!(
            ["tw:0:0", "tw:0:2"].contains(&child["run_id"].as_str().unwrap()),
            "{note}"
        );
        let reason = child["reason"].as_str().unwrap();
        assert!(
            reason.contains("event reply") && reason.contains("none came"),
            "{note}"
        );
    }
    env.wait_until("every child to end", WAIT, || async {
        children_by_status(&env, "tw").await
            == [("needs_review".into(), 2), ("succeeded".into(), 1)]
    })
    .await;
    assert_eq!(
        children_by_state(&env, "tw").await,
        [("failed".into(), 2), ("succeeded".into(), 1)],
        "both timed-out children are counted in the fan-out"
    );
    let fences_before = fences(&env, "tw").await;
    let who = Decider::cli("tester", "the supplier is back");
    trailmark::operator::resume(&engine, "tw", &who, Resume::AfterFix)
        .await
        .expect("resumed");
    env.wait_status("tw", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        children_by_status(&env, "tw").await,
        [("succeeded".into(), 3)]
    );
    for ((child, before), (_, after)) in fences_before.iter().zip(&fences(&env, "tw").await) {
        let retried = child != "tw:0:1";
        assert_eq!(
            after != before,
            retried,
            "child {child}: fence {before} -> {after}"
        );
        assert_eq!(env.chain_ledger(child).await, (2, 2), "child {child}");
    }
    assert_eq!(resolutions(&env, "tw").await, [Some("children".into())]);
    running.stop().await;
}

/// A parent that starts two `ask` children, each waiting for a person's approval.
fn asking() -> trailmark::workflow::Registry {
    use trailmark::workflow::{Children, Registry, StepKind, StepOutcome, Workflow};
    let parent = Workflow::new("asks", 1)
        .step("fan", StepKind::Read, |_ctx| async move {
            let children = Children::map("ask", [json!({}), json!({})]);
            Ok(StepOutcome::start_children(json!({}), children))
        })
        .step("after", StepKind::Read, |_ctx| async move {
            Ok(StepOutcome::finish(json!({})))
        });
    let child = Workflow::new("ask", 1)
        .step("sign_off", StepKind::Human, |_ctx| async move {
            Ok(StepOutcome::wait(json!({ "question": "ship it?" })))
        })
        .step("done", StepKind::Read, |_ctx| async move {
            Ok(StepOutcome::finish(json!({})))
        });
    let mut registry = Registry::new();
    registry.register(parent);
    registry.register(child);
    registry
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_escalated_past_the_human_timeout_count_as_failed_in_their_parent() {
    let env = TestEnv::with(|s| s.supervisor.human_timeout_secs = 1).await;
    let engine = env.engine_with(asking(), Failpoints::default());
    let running = env.spawn_all(engine.clone());
    env.start_run("asks", "ask", json!({})).await;
    let stopped = env.wait_status("ask", RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["error_class"], "children_failed", "{note}");
    let reason = note["failed"][0]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("supervisor.human_timeout_secs"), "{note}");
    env.wait_until("both children to be escalated", WAIT, || async {
        children_by_status(&env, "ask").await == [("needs_review".into(), 2)]
            && children_by_state(&env, "ask").await == [("failed".into(), 2)]
    })
    .await;
    let timeouts: i64 = env
        .scalar(
            "SELECT count(*) FROM trailmark.decisions WHERE action = 'timeout'
                AND run_id LIKE $1 || ':%'",
            "ask",
        )
        .await;
    assert_eq!(timeouts, 2, "each child's escalation recorded once");
    running.stop().await;
}

/// Ledger rows a run wrote after it ended (its `finished_at`).
async fn ledger_after_end(env: &TestEnv, run_id: &str) -> i64 {
    env.scalar(
        "SELECT count(*) FROM trailmark.chain_ledger l JOIN trailmark.runs r USING (run_id)
          WHERE l.run_id = $1 AND l.created_at > r.finished_at",
        run_id,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_on_the_first_2_of_6_cancels_the_children_still_running() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    // Children 2 to 5 sleep an hour after link 0; every child then waits for `go` after link 1.
    let wait = json!({"at": 1, "event": "go", "timeout_secs": 3600});
    let children = json!({"at": 0, "count": 6, "steps": 3, "first": 2, "wait": wait,
                          "slow": [2, 3, 4, 5]});
    env.start_run("chain", "f2", parent(children)).await;
    env.wait_until(
        "the fast children to wait, the slow ones to sleep",
        WAIT,
        || async {
            let mut all = true;
            for i in 0..6 {
                all &= waits_at(&env, &format!("f2:0:{i}"), i32::from(i < 2)).await;
            }
            all
        },
    )
    .await;
    send_event(&env, "go", "f2:0:0");
    send_event(&env, "go", "f2:0:1");
    let parent_run = env.wait_status("f2", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        children_by_status(&env, "f2").await,
        [("cancelled".into(), 4), ("succeeded".into(), 2)]
    );
    assert_eq!(
        children_by_state(&env, "f2").await,
        [("cancelled".into(), 4), ("succeeded".into(), 2)]
    );
    for i in 2..6 {
        let child = format!("f2:0:{i}");
        let run = trailmark::store::runs::get(&env.pool, &child)
            .await
            .unwrap()
            .unwrap();
        let error = run.error.unwrap_or_default();
        assert!(
            error.contains("parent run f2") && error.contains("first 2"),
            "{child}: {error}"
        );
        assert!(
            !waits_at(&env, &child, 0).await,
            "{child}: its sleep is closed"
        );
        assert_eq!(
            env.chain_ledger(&child).await,
            (1, 1),
            "{child}: link 0 only"
        );
        assert_eq!(ledger_after_end(&env, &child).await, 0, "{child}");
        assert!(
            run.finished_at <= parent_run.finished_at,
            "{child}: cancelled by the join"
        );
    }
    running.stop().await;
}

/// A `chain` parent of 4 links whose link 1 starts `count` children of 2 links each: two links
/// before its fan-out (0, and 1 which starts them) and two after the join (2, 3).
fn family(count: usize) -> Value {
    json!({"steps": 4, "children": {"at": 1, "count": count, "steps": 2}})
}

/// When the family's reversals were written (`chain_ledger.created_at`, one insert each):
/// the latest of the parent's reversals of the links after the join, the earliest and latest of
/// the children's, and the earliest of the parent's reversals of the fan-out link and before.
async fn reversal_times(env: &TestEnv, parent: &str) -> [Option<chrono::DateTime<chrono::Utc>>; 4] {
    let (after_join, first_child, last_child, before): (_, _, _, _) = sqlx::query_as(
        "SELECT max(created_at) FILTER (WHERE run_id = $1 AND step >= 2),
                min(created_at) FILTER (WHERE run_id <> $1),
                max(created_at) FILTER (WHERE run_id <> $1),
                min(created_at) FILTER (WHERE run_id = $1 AND step <= 1)
           FROM trailmark.chain_ledger
          WHERE (run_id = $1 OR run_id LIKE $1 || ':%') AND reference LIKE 'undo:%'",
    )
    .bind(parent)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    [after_join, first_child, last_child, before]
}

/// (forward rows, reversal rows that reverse one of them, distinct reversals) over a family.
async fn family_ledger(env: &TestEnv, parent: &str) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE reference NOT LIKE 'undo:%'),
                count(*) FILTER (WHERE reference LIKE 'undo:%'
                                   AND substr(reference, 6) IN (SELECT reference FROM trailmark.chain_ledger)),
                count(DISTINCT reference) FILTER (WHERE reference LIKE 'undo:%')
           FROM trailmark.chain_ledger WHERE run_id = $1 OR run_id LIKE $1 || ':%'",
    )
    .bind(parent)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// Asserts the causal order of a family's undo: the parent's reversals of its links after the
/// join, then every child's, then the parent's of the fan-out link and the one before it.
async fn assert_causal_order(env: &TestEnv, parent: &str) {
    let [after_join, first_child, last_child, before] = reversal_times(env, parent).await;
    let (after_join, first_child) = (after_join.unwrap(), first_child.unwrap());
    let (last_child, before) = (last_child.unwrap(), before.unwrap());
    assert!(
        after_join < first_child,
        "the parent's links after the join are reversed before any child's: {after_join} vs {first_child}"
    );
    assert!(
        last_child < before,
        "every child is reversed before the parent's fan-out link and older: {last_child} vs {before}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undoing_a_parent_compensates_its_family_in_causal_order_and_the_ledger_nets_to_zero() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "fam", family(20)).await;
    env.wait_status("fam", RunStatus::Succeeded, WAIT).await;
    let opts = trailmark::operator::UndoOptions::everything();
    let preview = trailmark::operator::undo_preview(&engine, "fam", opts.clone())
        .await
        .unwrap();
    let order: Vec<(i32, usize)> = preview
        .compensations
        .iter()
        .map(|c| (c.seq, c.children_first))
        .collect();
    assert_eq!(
        order,
        [(3, 0), (2, 0), (1, 20), (0, 0)],
        "the 20 children are listed at the fan-out link, before its own compensation"
    );
    assert!(
        preview
            .children
            .iter()
            .all(|c| c.at == 1 && c.compensations.len() == 2)
    );
    let who = Decider::cli("tester", "the batch was wrong");
    let outcome = trailmark::operator::undo(&engine, "fam", &who, opts)
        .await
        .unwrap();
    assert!(outcome.next.contains("20 child run(s)"), "{}", outcome.next);
    env.wait_status("fam", RunStatus::Compensated, WAIT).await;
    assert_eq!(
        children_by_status(&env, "fam").await,
        [("compensated".into(), 20)]
    );
    assert_eq!(
        family_ledger(&env, "fam").await,
        (44, 44, 44),
        "each of the 4 + 20 x 2 writes reversed exactly once"
    );
    assert_causal_order(&env, "fam").await;
    // The parent waited for its children's undo once, at the compensation of its fan-out link.
    let waited: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT step, resolution FROM trailmark.waits WHERE run_id = 'fam' ORDER BY seq",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        waited,
        [
            ("link".into(), Some("children".into())),
            ("undo:link@1".into(), Some("children".into()))
        ]
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_undo_killed_in_the_middle_of_the_children_resumes_each_reversal_once() {
    let env = TestEnv::new().await;
    let first = env.spawn_process(None);
    env.start_run("chain", "famk", family(20)).await;
    env.wait_status("famk", RunStatus::Succeeded, WAIT).await;
    kill(first).await;
    // The parent's 2 reversals after the join, then the 10th child reversal kills its worker
    // after the write, before its commit.
    let mut undoer = env.spawn_process(Some("chain.after_reversal=kill@12"));
    let out = env
        .command(&[
            "run", "undo", "famk", "--reason", "drill", "--actor", "ops", "--yes",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = wait_exit(&mut undoer, WAIT).await.expect("killed mid-undo");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let stood: String =
        sqlx::query_scalar("SELECT status FROM trailmark.runs WHERE run_id = 'famk'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        stood, "waiting",
        "killed while the parent waits for its children's undo"
    );
    let second = env.spawn_process(None);
    env.wait_status("famk", RunStatus::Compensated, WAIT).await;
    assert_eq!(
        children_by_status(&env, "famk").await,
        [("compensated".into(), 20)]
    );
    assert_eq!(
        family_ledger(&env, "famk").await,
        (44, 44, 44),
        "each reversal exactly once"
    );
    assert_causal_order(&env, "famk").await;
    let started_twice: i64 = env
        .scalar(
            "SELECT count(*) FROM trailmark.runs r WHERE r.parent_run_id = $1
                AND (SELECT count(*) FROM trailmark.steps s WHERE s.run_id = r.run_id
                      AND s.step LIKE 'undo:%') <> 2",
            "famk",
        )
        .await;
    assert_eq!(
        started_twice, 0,
        "each child's undo was started once: two compensations each"
    );
    kill(second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_cancelled_mid_undo_stops_its_parent_for_review_naming_it_and_a_resume_finishes() {
    let env = TestEnv::new().await;
    let first = env.spawn_process(None);
    env.start_run("chain", "famc", family(5)).await;
    env.wait_status("famc", RunStatus::Succeeded, WAIT).await;
    kill(first).await;
    // Killed at the first child reversal: the parent waits, its 5 children are compensating.
    let mut undoer = env.spawn_process(Some("chain.after_reversal=kill@3"));
    let engine = env.engine();
    let who = Decider::cli("tester", "wrong batch");
    trailmark::operator::undo(
        &engine,
        "famc",
        &who,
        trailmark::operator::UndoOptions::everything(),
    )
    .await
    .unwrap();
    wait_exit(&mut undoer, WAIT).await.expect("killed mid-undo");
    assert_eq!(
        children_by_status(&env, "famc").await,
        [("compensating".into(), 5)]
    );
    let cancel = Decider::cli("tester", "leave this one");
    trailmark::operator::cancel(&engine, "famc:1:2", &cancel)
        .await
        .unwrap();
    let stopped = env.wait_status("famc", RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["error_class"], "children_undo_failed", "{note}");
    assert_eq!(note["failed"][0]["run_id"], "famc:1:2", "{note}");
    assert_eq!(note["failed"][0]["state"], "cancelled", "{note}");
    assert!(
        stopped
            .error
            .as_deref()
            .unwrap_or("")
            .contains("compensated"),
        "{:?}",
        stopped.error
    );
    // The other children finish their undo; the parent stays stopped, not stranded waiting.
    let running = env.spawn_all(engine.clone());
    env.wait_until("the other children to be compensated", WAIT, || async {
        children_by_status(&env, "famc").await
            == [("cancelled".into(), 1), ("compensated".into(), 4)]
    })
    .await;
    // The way on that the note names: undo the cancelled child, then resume the parent.
    trailmark::operator::undo(
        &engine,
        "famc:1:2",
        &cancel,
        trailmark::operator::UndoOptions::everything(),
    )
    .await
    .unwrap();
    env.wait_status("famc:1:2", RunStatus::Compensated, WAIT)
        .await;
    assert_eq!(
        env.wait_status("famc", RunStatus::NeedsReview, WAIT)
            .await
            .status,
        RunStatus::NeedsReview
    );
    trailmark::operator::resume(&engine, "famc", &who, Resume::Again)
        .await
        .unwrap();
    env.wait_status("famc", RunStatus::Compensated, WAIT).await;
    assert_eq!(
        family_ledger(&env, "famc").await,
        (14, 14, 14),
        "each reversal exactly once"
    );
    assert_causal_order(&env, "famc").await;
    running.stop().await;
}

/// The time to undo a parent of 4 links with 100 children of 2 links each, from the decision
/// to the last run compensated (printed; the figure in docs/ARCHITECTURE.md, section 8b, comes
/// from it). Ignored: a timing, not a check; run it with `--ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn a_family_undo_of_100_children_timed() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "m", family(100)).await;
    env.wait_status("m", RunStatus::Succeeded, WAIT).await;
    let who = Decider::cli("tester", "timed");
    let started = Instant::now();
    let opts = trailmark::operator::UndoOptions::everything();
    trailmark::operator::undo(&engine, "m", &who, opts)
        .await
        .unwrap();
    env.wait_until("the family to be compensated", WAIT, || async {
        let left: i64 = env
            .scalar(
                "SELECT count(*) FROM trailmark.runs
                  WHERE (run_id = $1 OR parent_run_id = $1) AND status <> 'compensated'",
                "m",
            )
            .await;
        left == 0
    })
    .await;
    let took = started.elapsed();
    assert_eq!(family_ledger(&env, "m").await, (204, 204, 204));
    eprintln!(
        "family undo, 1 parent + 100 children: {:.3} s",
        took.as_secs_f64()
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_family_is_undone_in_causal_order_at_every_level() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    // 3 children of 3 links, each starting 2 grandchildren of 2 links after its link 1.
    let grandchildren = json!({"at": 1, "count": 2, "steps": 2});
    let input = json!({"steps": 4, "children": {"at": 1, "count": 3, "steps": 3, "children": grandchildren}});
    env.start_run("chain", "nest", input).await;
    env.wait_status("nest", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE $1 || ':%'",
            "nest"
        )
        .await,
        9,
        "3 children and 6 grandchildren"
    );
    let opts = trailmark::operator::UndoOptions::everything();
    let preview = trailmark::operator::undo_preview(&engine, "nest", opts.clone())
        .await
        .unwrap();
    let child = &preview.children[0];
    assert_eq!((child.at, child.children.len()), (1, 2), "{child:?}");
    assert!(child.compensations.iter().any(|t| t.seq == 1 && t.children));
    let who = Decider::cli("tester", "wrong batch");
    trailmark::operator::undo(&engine, "nest", &who, opts)
        .await
        .unwrap();
    env.wait_status("nest", RunStatus::Compensated, WAIT).await;
    let left: i64 = env
        .scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE $1 || ':%' AND status <> 'compensated'",
            "nest",
        )
        .await;
    assert_eq!(left, 0, "every run below is compensated");
    assert_eq!(
        family_ledger(&env, "nest").await,
        (25, 25, 25),
        "4 + 3 x 3 + 6 x 2 writes, each reversed once"
    );
    assert_causal_order(&env, "nest").await;
    for i in 0..3 {
        assert_causal_order(&env, &format!("nest:1:{i}")).await;
    }
    running.stop().await;
}

/// A grandparent of 2 links whose link 0 starts 2 children of 2 links (failures allowed:
/// `allowed`), each starting 3 grandchildren of 2 links of which 0 and 1 fail: past the
/// children's threshold of 1, each child stops for review.
fn failing_grandchildren(allowed: u64) -> Value {
    let grandchildren =
        json!({"at": 0, "count": 3, "steps": 2, "fail": [0, 1], "fail_threshold": 1});
    parent(
        json!({"at": 0, "count": 2, "steps": 2, "fail_threshold": allowed, "children": grandchildren}),
    )
}

/// A parent's children rows by state, and its fan-out's (succeeded, failed) counters.
async fn joined_as(env: &TestEnv, parent: &str) -> (Vec<(String, i64)>, (i32, i32)) {
    let counters =
        sqlx::query_as("SELECT succeeded, failed FROM trailmark.fan_outs WHERE run_id = $1")
            .bind(parent)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    (children_by_state(env, parent).await, counters)
}

/// The run ids a stopped run's note names as failed.
fn named(note: &Value) -> Vec<String> {
    let failed = note["failed"].as_array().expect("the failed children");
    failed
        .iter()
        .map(|c| c["run_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_stopped_by_its_own_children_counts_as_failed_in_its_parent_and_a_resume_reaches_them()
 {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    // Two failures allowed: the grandparent goes on past its two stopped children.
    env.start_run("chain", "on", failing_grandchildren(2)).await;
    // None allowed: the grandparent stops for review naming a stopped child.
    env.start_run("chain", "ng", failing_grandchildren(0)).await;
    env.wait_status("on", RunStatus::Succeeded, WAIT).await;
    let failed = || ("failed".to_owned(), 2);
    assert_eq!(joined_as(&env, "on").await, (vec![failed()], (0, 2)));
    let stopped = env.wait_status("ng", RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["error_class"], "children_failed", "{note}");
    assert!(
        named(&note)
            .iter()
            .all(|c| ["ng:0:0", "ng:0:1"].contains(&c.as_str())),
        "{note}"
    );
    env.wait_until("every grandchild to end", WAIT, || async {
        let below: Vec<(String, i64)> = sqlx::query_as(
            "SELECT status, count(*) FROM trailmark.runs WHERE run_id LIKE 'ng:0:_:0:%'
              GROUP BY status ORDER BY status",
        )
        .fetch_all(&env.pool)
        .await
        .unwrap();
        below == [("needs_review".into(), 4), ("succeeded".into(), 2)]
    })
    .await;
    for middle in ["ng:0:0", "ng:0:1"] {
        let run = env.wait_status(middle, RunStatus::NeedsReview, WAIT).await;
        let note = run.handover.expect("a handover note");
        assert_eq!(
            named(&note),
            [format!("{middle}:0:0"), format!("{middle}:0:1")],
            "{note}"
        );
    }
    // Each stopped child counted once, as failed.
    assert_eq!(joined_as(&env, "ng").await, (vec![failed()], (0, 2)));
    running.stop().await;
    // The fix is deployed. A child resumed alone runs its failed children again; once it
    // succeeds its parent counts it so (and stays stopped until resumed itself).
    let fixed = Failpoints::parse("chain.fixed=error").unwrap();
    let engine = env.engine_with(trailmark_reference::registry(), fixed);
    let running = env.spawn_all(engine.clone());
    let who = Decider::cli("tester", "fix deployed");
    trailmark::operator::resume(&engine, "ng:0:0", &who, Resume::AfterFix)
        .await
        .expect("the child resumed");
    env.wait_status("ng:0:0", RunStatus::Succeeded, WAIT).await;
    let one_each = vec![("failed".to_owned(), 1), ("succeeded".to_owned(), 1)];
    assert_eq!(joined_as(&env, "ng").await, (one_each, (1, 1)));
    assert_eq!(
        env.wait_status("ng", RunStatus::NeedsReview, WAIT)
            .await
            .status,
        RunStatus::NeedsReview
    );
    // The grandparent's resume reaches the grandchildren: its stopped child waits again and
    // that child's failed children run again.
    trailmark::operator::resume(&engine, "ng", &who, Resume::AfterFix)
        .await
        .expect("the grandparent resumed");
    env.wait_status("ng", RunStatus::Succeeded, WAIT).await;
    let all: i64 = env
        .scalar("SELECT count(*) FROM trailmark.runs WHERE run_id LIKE $1 || ':%' AND status = 'succeeded'", "ng")
        .await;
    assert_eq!(all, 8, "2 children and 6 grandchildren succeeded");
    assert_eq!(
        joined_as(&env, "ng").await,
        (vec![("succeeded".to_owned(), 2)], (2, 0))
    );
    for run in ["ng", "ng:0:0", "ng:0:1"] {
        assert_eq!(env.chain_ledger(run).await, (2, 2), "run {run}");
        assert_eq!(
            resolutions(&env, run).await,
            [Some("children".into())],
            "run {run}: stopped, then joined once"
        );
        assert_eq!(
            env.attempts(run, 0).await,
            1,
            "run {run}: the fan-out step ran once"
        );
    }
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_stopped_by_its_own_childrens_undo_counts_as_failed_in_its_parents_undo() {
    let env = TestEnv::new().await;
    let first = env.spawn_process(None);
    let grandchildren = json!({"at": 1, "count": 2, "steps": 2});
    let input = json!({"steps": 4, "children": {"at": 1, "count": 2, "steps": 3, "children": grandchildren}});
    env.start_run("chain", "nu", input).await;
    env.wait_status("nu", RunStatus::Succeeded, WAIT).await;
    kill(first).await;
    // Killed at the first grandchild's reversal (2 of the parent's links, then 1 of each
    // child's come before): that grandchild is compensating, its parent waits for it.
    let mut undoer = env.spawn_process(Some("chain.after_reversal=kill@5"));
    let engine = env.engine();
    let who = Decider::cli("tester", "wrong batch");
    let opts = trailmark::operator::UndoOptions::everything();
    trailmark::operator::undo(&engine, "nu", &who, opts)
        .await
        .unwrap();
    wait_exit(&mut undoer, WAIT).await.expect("killed mid-undo");
    let (grandchild, middle): (String, String) = sqlx::query_as(
        "SELECT c.run_id, c.parent_run_id FROM trailmark.children c
           JOIN trailmark.runs r ON r.run_id = c.run_id
           JOIN trailmark.fan_outs f ON f.run_id = c.parent_run_id AND f.seq = c.seq
          WHERE c.run_id LIKE 'nu:1:_:1:%' AND r.status = 'compensating' AND f.undo_seq IS NOT NULL
          ORDER BY c.run_id LIMIT 1",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let cancel = Decider::cli("tester", "leave this one");
    trailmark::operator::cancel(&engine, &grandchild, &cancel)
        .await
        .unwrap();
    // The child stops for review naming its cancelled child, and the parent's undo counts it
    // failed at once: the parent stops naming it, it does not wait for ever.
    let stopped = env.wait_status(&middle, RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["error_class"], "children_undo_failed", "{note}");
    assert_eq!(named(&note), [grandchild.as_str()], "{note}");
    let stopped = env.wait_status("nu", RunStatus::NeedsReview, WAIT).await;
    let note = stopped.handover.expect("a handover note");
    assert_eq!(note["error_class"], "children_undo_failed", "{note}");
    assert_eq!(named(&note), [middle.as_str()], "{note}");
    // Everything else finishes its undo; the stopped ones stay stopped, counted once.
    let running = env.spawn_all(engine.clone());
    env.wait_until("the rest of the family to be compensated", WAIT, || async {
        let left: i64 = env
            .scalar(
                "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE $1 || ':%'
                  AND status NOT IN ('compensated', 'needs_review', 'cancelled')",
                "nu",
            )
            .await;
        left == 0
    })
    .await;
    let undo: (i32, i32) =
        sqlx::query_as("SELECT undone, undo_failed FROM trailmark.fan_outs WHERE run_id = 'nu'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        undo,
        (1, 1),
        "one child compensated, one stopped, each counted once"
    );
    assert_eq!(
        env.wait_status("nu", RunStatus::NeedsReview, WAIT)
            .await
            .status,
        RunStatus::NeedsReview
    );
    running.stop().await;
}

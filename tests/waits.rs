//! Runs that wait for an event or sleep (issue 33): an event sent before its wait is taken by
//! it, an event sent twice resumes once, the same id with another payload is refused, a timeout
//! fires within about a second of its deadline (database clock) and takes its declared branch,
//! a sleep wakes once and no earlier than its time, and every face refuses bad events naming
//! the field. The kill -9 cases are at the end: real processes, killed by failpoints or from
//! outside.

mod api_support;
mod common;
mod dlq_support;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::{TestEnv, text};
use serde_json::{Value, json};
use trailmark::domain::{InboundEvent, RunStatus};
use trailmark::failpoint::Failpoints;
use trailmark::workflow::{EventWait, StepKind, StepOutcome, Workflow};

const WAIT: Duration = Duration::from_secs(90);

/// A chain of 3 links that waits after link 1 for the event `go` (key: the run's id).
fn chain_waiting(timeout_secs: u64) -> Value {
    json!({"steps": 3, "wait": {"at": 1, "event": "go", "timeout_secs": timeout_secs}})
}

/// `trailmark event send` with `args`; (exit code, stdout, stderr).
fn send(env: &TestEnv, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["event", "send"];
    all.extend_from_slice(args);
    let out = env.command(&all).output().unwrap();
    let (stdout, stderr) = text(&out);
    (out.status.code(), stdout, stderr)
}

/// Waits until `run_id` waits (status `waiting` with an open wait).
async fn wait_waiting(env: &TestEnv, run_id: &str) {
    env.wait_until(&format!("run {run_id} to wait"), WAIT, || async {
        open_waits(env, run_id).await == 1
    })
    .await;
}

async fn open_waits(env: &TestEnv, run_id: &str) -> i64 {
    env.scalar(
        "SELECT count(*) FROM trailmark.waits w JOIN trailmark.runs r USING (run_id)
          WHERE run_id = $1 AND w.resolved_at IS NULL AND r.status = 'waiting'",
        run_id,
    )
    .await
}

/// (resolution, event id) of each wait of the run, in order.
async fn waits_of(env: &TestEnv, run_id: &str) -> Vec<(Option<String>, Option<String>)> {
    sqlx::query_as(
        "SELECT resolution, signal_id FROM trailmark.waits WHERE run_id = $1 ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// (state, runs resumed) of an event.
async fn event_state(env: &TestEnv, id: &str) -> (String, i32) {
    let row = trailmark::store::waits::signal(&env.pool, id)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("event {id} was not recorded"));
    (row.state().to_owned(), row.resumed)
}

/// The output of the step at `seq` of a run.
async fn output_at(env: &TestEnv, run_id: &str, seq: i32) -> Value {
    sqlx::query_scalar("SELECT output FROM trailmark.steps WHERE run_id = $1 AND seq = $2")
        .bind(run_id)
        .bind(seq)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_sent_before_the_run_reaches_its_wait_is_consumed_by_it() {
    let env = TestEnv::new().await;
    // Sent before the run even exists: kept for the wait to come.
    let (code, out, err) = send(
        &env,
        &[
            "go",
            "--key",
            "r-early",
            "--id",
            "e-early",
            "--payload",
            r#"{"price": 41.5}"#,
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("kept until"), "{out}");
    assert_eq!(event_state(&env, "e-early").await, ("pending".into(), 0));
    let _running = env.spawn_all(env.engine());
    env.start_run("chain", "r-early", chain_waiting(60)).await;
    env.wait_status("r-early", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        output_at(&env, "r-early", 2).await["event"],
        json!({"id": "e-early", "payload": {"price": 41.5}}),
        "the step after the wait reads the event"
    );
    assert_eq!(
        waits_of(&env, "r-early").await,
        [(Some("event".into()), Some("e-early".into()))]
    );
    assert_eq!(event_state(&env, "e-early").await, ("consumed".into(), 1));
    assert_eq!(env.chain_ledger("r-early").await, (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_sent_twice_resumes_once_and_its_id_with_another_payload_is_a_conflict() {
    let env = TestEnv::new().await;
    let _running = env.spawn_all(env.engine());
    env.start_run("chain", "r-twice", chain_waiting(60)).await;
    wait_waiting(&env, "r-twice").await;
    let args = [
        "go",
        "--key",
        "r-twice",
        "--id",
        "e-1",
        "--payload",
        r#"{"n": 1}"#,
    ];
    let (code, out, err) = send(&env, &args);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("resumed 1 run(s): r-twice"), "{out}");
    let (code, out, err) = send(&env, &args);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("was received before"), "{out}");
    let (code, _, err) = send(
        &env,
        &[
            "go",
            "--key",
            "r-twice",
            "--id",
            "e-1",
            "--payload",
            r#"{"n": 2}"#,
        ],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("event id e-1 was received at") && err.contains("send it under another id"),
        "{err}"
    );
    env.wait_status("r-twice", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.attempts("r-twice", 2).await, 1, "resumed once");
    assert_eq!(event_state(&env, "e-1").await, ("consumed".into(), 1));
    assert_eq!(
        output_at(&env, "r-twice", 2).await["event"]["payload"],
        json!({"n": 1})
    );
    let audited = env
        .scalar(
            "SELECT count(*) FROM trailmark.audit WHERE action = 'event.send' AND target = $1",
            "e-1",
        )
        .await;
    assert_eq!(audited, 1, "only the event that was recorded is audited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_events_are_refused_where_they_enter_naming_the_field_and_nothing_is_recorded() {
    let env = TestEnv::with(|s| s.worker.max_message_bytes = 2048).await;
    let long = "k".repeat(201);
    let big = format!("{{\"text\": \"{}\"}}", "x".repeat(3000));
    for (args, field) in [
        (vec!["", "--key", "k"], "event name"),
        (vec!["has space", "--key", "k"], "event name"),
        (vec!["go", "--key", ""], "event key"),
        (vec!["go", "--key", &long], "event key"),
        (vec!["go", "--key", "k", "--id", "a b"], "event id"),
        (
            vec!["go", "--key", "k", "--payload", "{not json"],
            "--payload is not valid JSON",
        ),
        (
            vec!["go", "--key", "k", "--payload", &big],
            "over the 2048-byte message limit",
        ),
    ] {
        let (code, _, err) = send(&env, &args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(field), "{args:?}: {err}");
    }
    let recorded = env
        .scalar("SELECT count(*) FROM trailmark.signals WHERE $1 = $1", "")
        .await;
    assert_eq!(recorded, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_over_amqp_resume_their_run_and_bad_ones_are_dead_lettered_with_their_reason() {
    let env = TestEnv::new().await;
    let _running = env.spawn_all(env.engine());
    env.start_run("chain", "r-amqp", chain_waiting(60)).await;
    wait_waiting(&env, "r-amqp").await;
    let topology = env.topology();
    let event = |id: &str, payload: Value| {
        InboundEvent::new("go", "r-amqp", Some(id), payload, 1 << 20).unwrap()
    };
    let first = topology.send_event(&event("e-amqp", json!({"a": 1})));
    let conflicting = topology.send_event(&event("e-amqp", json!({"a": 2})));
    let mut bad = topology.send_event(&event("e-bad", json!({})));
    bad.body = br#"{"v":1,"name":"","key":"r-amqp","id":"e-bad"}"#.to_vec();
    env.publish_all(&[first.clone(), first]).await;
    env.wait_status("r-amqp", RunStatus::Succeeded, WAIT).await;
    env.publish_all(&[conflicting, bad]).await;
    dlq_support::wait_dlq_depth(&env, 2).await;
    let letters = dlq_support::dead_letters(&env).await;
    let reasons: Vec<(&str, &str)> = letters
        .iter()
        .map(|l| (l.reason.as_str(), l.detail.as_deref().unwrap_or("")))
        .collect();
    assert!(
        reasons
            .iter()
            .any(|(r, d)| *r == "event_conflict" && d.contains("e-amqp")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|(r, d)| *r == "bad_event" && d.contains("event name")),
        "{reasons:?}"
    );
    assert_eq!(event_state(&env, "e-amqp").await, ("consumed".into(), 1));
    assert_eq!(env.attempts("r-amqp", 2).await, 1);
    assert!(
        trailmark::store::waits::signal(&env.pool, "e-bad")
            .await
            .unwrap()
            .is_none()
    );
}

/// `ask` waits 2 s for `reply`, then goes to `chase` on timeout; `got` follows an event.
fn branching() -> Workflow {
    Workflow::new("branching", 1)
        .step("ask", StepKind::Message, |_ctx| async {
            let wait = EventWait::new("reply", Duration::from_secs(2)).on_timeout_goto("chase");
            Ok(StepOutcome::wait_for_event(json!({"asked": true}), wait))
        })
        .step("got", StepKind::Read, |ctx| async move {
            let event = ctx.event().await?.expect("got follows an event");
            Ok(StepOutcome::finish(json!({"event": event.id})))
        })
        .step("chase", StepKind::Read, |ctx| async move {
            assert!(ctx.event().await?.is_none(), "no event after a timeout");
            Ok(StepOutcome::finish(json!({"chased": true})))
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_fires_within_a_second_of_its_deadline_and_takes_the_declared_branch() {
    let env = TestEnv::new().await;
    let mut registry = trailmark_reference::registry();
    registry.register(branching());
    let _running = env.spawn_all(env.engine_with(registry, Failpoints::default()));
    env.start_run("branching", "r-late", json!({})).await;
    let run = env.wait_status("r-late", RunStatus::Succeeded, WAIT).await;
    assert_eq!(run.output, Some(json!({"chased": true})));
    let late: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM resolved_at - due_at)::float8 FROM trailmark.waits WHERE run_id = $1",
    )
    .bind("r-late")
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        (0.0..1.0).contains(&late),
        "the timeout fired {late} s after its deadline"
    );
    assert_eq!(
        waits_of(&env, "r-late").await,
        [(Some("timeout".into()), None)]
    );

    // The same workflow with its event in time goes to `got`.
    env.start_run("branching", "r-prompt", json!({})).await;
    wait_waiting(&env, "r-prompt").await;
    let (code, _, err) = send(&env, &["reply", "--key", "r-prompt", "--id", "e-prompt"]);
    assert_eq!(code, Some(0), "{err}");
    let run = env
        .wait_status("r-prompt", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(run.output, Some(json!({"event": "e-prompt"})));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_without_a_branch_stops_for_review_naming_the_event_and_a_resume_goes_on_without_it()
{
    let env = TestEnv::new().await;
    let engine = env.engine();
    let _running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-review", chain_waiting(1)).await;
    let run = env
        .wait_status("r-review", RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    assert!(
        error.contains("for event go (key r-review)") && error.contains("none came"),
        "{error}"
    );
    assert_eq!(run.step_seq, 2, "it stops at the step after the wait");
    assert_eq!(run.handover.unwrap()["error_class"], "wait_timeout");
    // A late event is kept for no one; the resume goes on without it.
    let (code, out, _) = send(&env, &["go", "--key", "r-review", "--id", "e-late"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("kept until"), "{out}");
    let who = trailmark::operator::Decider::cli("test", "the supplier never answered");
    trailmark::operator::resume(
        &engine,
        "r-review",
        &who,
        trailmark::operator::Resume::Again,
    )
    .await
    .unwrap();
    env.wait_status("r-review", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(output_at(&env, "r-review", 2).await["event"], Value::Null);
    assert_eq!(event_state(&env, "e-late").await, ("pending".into(), 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_run_cannot_be_approved_and_a_cancel_closes_its_wait() {
    let env = TestEnv::with(|s| s.supervisor.human_timeout_secs = 1).await;
    let engine = env.engine();
    let _running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-stop", chain_waiting(3600)).await;
    wait_waiting(&env, "r-stop").await;
    let who = trailmark::operator::Decider::cli("test", "looked");
    let refused = trailmark::operator::approve(&engine, "r-stop", "link", &who)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("it waits for event go (key r-stop)")
            && refused.contains("trailmark event send go --key r-stop"),
        "{refused}"
    );
    // Past the human timeout, a run waiting for an event is not escalated: its wait has its own.
    env.wait_until("the human timeout to pass", WAIT, || async {
        env.scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id = $1 AND updated_at < now() - interval '1.5 s'",
            "r-stop",
        )
        .await
            == 1
    })
    .await;
    let escalated = trailmark::supervisor::escalate_waiting(&engine)
        .await
        .unwrap();
    assert_eq!(escalated, 0);
    assert_eq!(open_waits(&env, "r-stop").await, 1);
    trailmark::operator::cancel(&engine, "r-stop", &who)
        .await
        .unwrap();
    assert_eq!(
        waits_of(&env, "r-stop").await,
        [(Some("decision".into()), None)]
    );
    let (code, out, _) = send(&env, &["go", "--key", "r-stop", "--id", "e-after"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("kept until"),
        "a cancelled run takes no event: {out}"
    );
    let run = trailmark::store::runs::get(&env.pool, "r-stop")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(run.status, RunStatus::Cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_run_holds_no_lease_and_wakes_once_no_earlier_than_its_time() {
    let env = TestEnv::new().await;
    let _running = env.spawn_all(env.engine());
    env.start_run(
        "chain",
        "r-sleep",
        json!({"steps": 3, "sleep": {"at": 1, "secs": 2}}),
    )
    .await;
    wait_waiting(&env, "r-sleep").await;
    let run = trailmark::store::runs::get(&env.pool, "r-sleep")
        .await
        .unwrap()
        .unwrap();
    assert!(run.lease_owner.is_none(), "a sleeping run holds no lease");
    env.wait_status("r-sleep", RunStatus::Succeeded, WAIT).await;
    assert_woke_once_on_time(&env, "r-sleep").await;
    let late: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM resolved_at - due_at)::float8 FROM trailmark.waits WHERE run_id = $1",
    )
    .bind("r-sleep")
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(late < 1.0, "woken {late} s after its time");
}

/// The run's one sleep woke once, within a second of its time, and the step after it started
/// no earlier than that time and ran once.
async fn assert_woke_once_on_time(env: &TestEnv, run_id: &str) {
    let (late, early): (f64, f64) = sqlx::query_as(
        "SELECT EXTRACT(EPOCH FROM w.resolved_at - w.due_at)::float8,
                EXTRACT(EPOCH FROM s.started_at - w.due_at)::float8
           FROM trailmark.waits w JOIN trailmark.steps s ON s.run_id = w.run_id AND s.seq = w.seq + 1
          WHERE w.run_id = $1",
    )
    .bind(run_id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(late >= 0.0, "woken {late} s before its time");
    assert!(
        early >= 0.0,
        "the next step started {early} s before the wake-up time"
    );
    assert_eq!(waits_of(env, run_id).await, [(Some("woke".into()), None)]);
    assert_eq!(env.attempts(run_id, 2).await, 1, "woken once");
    assert_eq!(env.chain_ledger(run_id).await, (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_the_waits_commit_and_the_events_arrival_the_run_resumes_once() {
    let env = TestEnv::new().await;
    // Commit 2 is link 1's: the one that registers the wait.
    let mut first = env.spawn_process(Some("step.after_commit=kill@2"));
    env.start_run("chain", "r-k1", chain_waiting(600)).await;
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert_eq!(open_waits(&env, "r-k1").await, 1, "the wait was committed");
    // No process is up: the event is recorded and moves the run on by itself.
    let (code, out, err) = send(&env, &["go", "--key", "r-k1", "--id", "e-k1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("resumed 1 run(s)"), "{out}");
    let _second = env.spawn_process(None);
    env.wait_status("r-k1", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.attempts("r-k1", 2).await, 1);
    assert_eq!(event_state(&env, "e-k1").await, ("consumed".into(), 1));
    assert_eq!(output_at(&env, "r-k1", 2).await["event"]["id"], "e-k1");
    assert_eq!(env.chain_ledger("r-k1").await, (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_the_events_arrival_and_the_resumed_steps_commit_it_resumes_once() {
    let env = TestEnv::new().await;
    // Commit 3 would be link 2's, the step the event resumed: the process dies just before it.
    let mut first = env.spawn_process(Some("step.before_commit=kill@3"));
    env.start_run("chain", "r-k2", chain_waiting(600)).await;
    wait_waiting(&env, "r-k2").await;
    let (code, _, err) = send(&env, &["go", "--key", "r-k2", "--id", "e-k2"]);
    assert_eq!(code, Some(0), "{err}");
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert_eq!(env.steps_done("r-k2").await, 2, "link 2 did not commit");
    let _second = env.spawn_process(None);
    env.wait_status("r-k2", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        env.attempts("r-k2", 2).await,
        2,
        "the interrupted step ran again"
    );
    assert_eq!(output_at(&env, "r-k2", 2).await["event"]["id"], "e-k2");
    assert_eq!(
        waits_of(&env, "r-k2").await,
        [(Some("event".into()), Some("e-k2".into()))]
    );
    assert_eq!(event_state(&env, "e-k2").await, ("consumed".into(), 1));
    assert_eq!(env.chain_ledger("r-k2").await, (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amqp_event_committed_by_a_worker_killed_before_its_ack_resumes_the_run_once() {
    let env = TestEnv::new().await;
    let mut first = env.spawn_process(Some("event.after_commit=kill@1"));
    env.start_run("chain", "r-k3", chain_waiting(600)).await;
    wait_waiting(&env, "r-k3").await;
    let event = InboundEvent::new("go", "r-k3", Some("e-k3"), json!({}), 1 << 20).unwrap();
    env.publish(&env.topology().send_event(&event)).await;
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    let _second = env.spawn_process(None);
    env.wait_status("r-k3", RunStatus::Succeeded, WAIT).await;
    // The redelivered event found its id recorded: a duplicate, nothing more.
    assert_eq!(env.attempts("r-k3", 2).await, 1);
    assert_eq!(event_state(&env, "e-k3").await, ("consumed".into(), 1));
    assert_eq!(waits_of(&env, "r-k3").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_of_every_process_during_a_5_s_sleep_changes_nothing() {
    let env = TestEnv::new().await;
    let mut first = env.spawn_process(None);
    env.start_run(
        "chain",
        "r-k4",
        json!({"steps": 3, "sleep": {"at": 1, "secs": 5}}),
    )
    .await;
    wait_waiting(&env, "r-k4").await;
    first.kill9();
    // Nothing runs while the time passes (database clock).
    env.wait_until("the wake-up time to pass", WAIT, || async {
        env.scalar(
            "SELECT count(*) FROM trailmark.waits WHERE run_id = $1 AND due_at < now()",
            "r-k4",
        )
        .await
            == 1
    })
    .await;
    assert_eq!(
        open_waits(&env, "r-k4").await,
        1,
        "no one woke it meanwhile"
    );
    let _second = env.spawn_process(None);
    env.wait_status("r-k4", RunStatus::Succeeded, WAIT).await;
    assert_woke_once_on_time(&env, "r-k4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_show_and_the_api_say_what_a_run_waits_for_and_the_event_it_received() {
    use reqwest::{Method, StatusCode};
    use trailmark::api::Role;
    let api = api_support::Api::start(trailmark_reference::registry()).await;
    let env = &api.env;
    env.start_run("chain", "r-view", chain_waiting(600)).await;
    wait_waiting(env, "r-view").await;
    let show = |env: &TestEnv| {
        let out = env.command(&["run", "show", "r-view"]).output().unwrap();
        text(&out).0
    };
    let shown = show(env);
    assert!(
        shown.contains("event go (key r-view)") && shown.contains("WAITING NOW"),
        "{shown}"
    );
    let viewer = Some(api.token(Role::Viewer));
    let (status, run) = api
        .call(Method::GET, "/api/v1/runs/r-view", viewer, None, None)
        .await;
    assert_eq!(status, StatusCode::OK, "{run}");
    assert_eq!(run["waits"][0]["event_name"], "go", "{run}");
    assert_eq!(run["waits"][0]["resolved_at"], Value::Null, "{run}");
    assert!(run["waits"][0]["until"].is_string(), "{run}");
    let body = json!({"name": "go", "key": "r-view", "id": "e-view", "payload": {"ok": true}});
    let operator = Some(api.token(Role::Operator));
    let (status, sent) = api
        .call(Method::POST, "/api/v1/events", operator, Some(body), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{sent}");
    assert_eq!(
        (&sent["outcome"], &sent["resumed"]),
        (&json!("resumed"), &json!(["r-view"]))
    );
    env.wait_status("r-view", RunStatus::Succeeded, WAIT).await;
    let (_, run) = api
        .call(Method::GET, "/api/v1/runs/r-view", viewer, None, None)
        .await;
    let wait = &run["waits"][0];
    assert_eq!(
        (&wait["resolution"], &wait["event_id"], &wait["payload"]),
        (&json!("event"), &json!("e-view"), &json!({"ok": true})),
        "{run}"
    );
    let shown = show(env);
    assert!(
        shown.contains(r#"event e-view received"#) && shown.contains(r#"{"ok":true}"#),
        "{shown}"
    );
    let (status, listed) = api
        .call(
            Method::GET,
            "/api/v1/events?state=consumed",
            viewer,
            None,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert_eq!(listed["events"][0]["signal_id"], "e-view", "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_sent_while_their_waits_are_being_committed_are_never_lost() {
    // Each run's event is sent while its first link is running (a 40 ms link), at a moment
    // spread over the link's end: many land while the wait is being committed. An event that
    // slipped between the wait's look for kept events and its commit would sit unconsumed
    // while its run waits, and the run would stop for review when its 15 s timeout fires.
    let env = TestEnv::new().await;
    let engine = env.engine();
    let _running = env.spawn_all(engine.clone());
    let input = json!({"steps": 2, "step_delay_ms": 40,
        "wait": {"at": 0, "event": "go", "timeout_secs": 15}});
    let runs: Vec<String> = (0..60).map(|i| format!("r-race-{i}")).collect();
    let mut senders = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        env.start_run("chain", run, input.clone()).await;
        let (engine, pool, run) = (engine.clone(), env.pool.clone(), run.clone());
        senders.push(tokio::spawn(async move {
            let claimed = common::eventually("the first link to start", WAIT, || async {
                let n: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM trailmark.steps WHERE run_id = $1")
                        .bind(&run)
                        .fetch_one(&pool)
                        .await
                        .ok()?;
                (n > 0).then_some(())
            })
            .await;
            assert!(claimed.is_some(), "{run} never started");
            // The moment of sending is the fault injected: 25 to 65 ms into the 40 ms link.
            tokio::time::sleep(Duration::from_millis(25 + (i as u64 * 7) % 40)).await;
            let event =
                InboundEvent::new("go", &run, Some(&format!("{run}.ev")), json!({}), 1 << 20)
                    .unwrap();
            let who = trailmark::operator::Decider::cli("test", "race");
            trailmark::wait::send(&engine, event, trailmark::wait::Sender::Audited(&who))
                .await
                .unwrap()
        }));
    }
    let mut kept = 0;
    for s in senders {
        kept += usize::from(s.await.unwrap().outcome == "kept");
    }
    for run in &runs {
        env.wait_status(run, RunStatus::Succeeded, WAIT).await;
        assert_eq!(
            event_state(&env, &format!("{run}.ev")).await,
            ("consumed".into(), 1)
        );
    }
    eprintln!(
        "{kept} of {} events came before their wait and were kept for it",
        runs.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_from_the_step_after_a_wait_reads_the_event_its_parent_received() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let _running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-parent", chain_waiting(600)).await;
    wait_waiting(&env, "r-parent").await;
    let (code, _, err) = send(
        &env,
        &[
            "go",
            "--key",
            "r-parent",
            "--id",
            "e-parent",
            "--payload",
            r#"{"v": 7}"#,
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    env.wait_status("r-parent", RunStatus::Succeeded, WAIT)
        .await;
    let req = trailmark::operator::ForkRequest {
        from: trailmark::operator::ForkPoint::Position(2),
        run_id: Some("r-forked".into()),
        input: None,
        shadow: true,
        answers_from: None,
    };
    let who = trailmark::operator::Decider::cli("test", "replay the step after the wait");
    trailmark::operator::fork(&engine, "r-parent", &req, &who)
        .await
        .unwrap();
    env.wait_status("r-forked", RunStatus::Shadowed, WAIT).await;
    assert_eq!(
        output_at(&env, "r-forked", 2).await["event"],
        json!({"id": "e-parent", "payload": {"v": 7}}),
        "the fork's step read the event its parent received"
    );
}

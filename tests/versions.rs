//! Retiring a workflow version against the real servers: `trailmark workflow versions` counts
//! the runs in flight per version and says which version can go; `trailmark workflow move`
//! previews without changing anything, moves only runs at rest (stopped for review or
//! waiting), never a run executing a step, records a decision naming both versions, and the
//! moved run goes on with the new version's code; lifecycle events carry the version. The ops
//! API offers the same listing and move.

mod api_support;
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{TestEnv, text};
use serde_json::{Value, json};
use trailmark::broker::{Outgoing, map_to_headers};
use trailmark::domain::{
    Event, InboundEvent, MessageId, RunId, RunStartEvent, RunStatus, STEP_ROUTING_KEY, StepMessage,
};
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::operator::{self, Decider, MoveAsk, Resume, Verdict};
use trailmark::store::{audit, decisions, runs};
use trailmark::workflow::{EventWait, Registry, StepError, StepKind, StepOutcome, Workflow};

const WAIT: Duration = Duration::from_secs(90);

fn who(reason: &str) -> Decider {
    Decider::cli("maria.ops", reason)
}

/// Switches the test holds a step's handler with: `entered` once it runs, and it returns once
/// `release` is set (polled inside the handler, so the run stays `running` meanwhile).
#[derive(Clone, Default)]
struct Hold {
    entered: Arc<AtomicBool>,
    release: Arc<AtomicBool>,
}

/// `pinned` at `version`: step `a` routes by the input (`"route": "legacy" | "event"`, or
/// `"hold": true` to wait for the test), then `b`. In v1, `b` fails (the bug v2 fixes) and the
/// extra step `legacy` fails too; v2 has no `legacy`, and its `b` succeeds saying `"code": 2`.
fn pinned(version: i32, hold: Hold) -> Workflow {
    let a = move |ctx: trailmark::workflow::StepContext| {
        let hold = hold.clone();
        async move {
            let input = ctx.input().clone();
            if input["hold"] == true {
                hold.entered.store(true, Ordering::SeqCst);
                while !hold.release.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Ok(match input["route"].as_str() {
                Some("legacy") => StepOutcome::goto(json!({}), "legacy"),
                Some("event") => StepOutcome::wait_for_event(
                    json!({}),
                    EventWait::new("go", Duration::from_secs(3600)),
                ),
                _ => StepOutcome::next(json!({})),
            })
        }
    };
    let wf = Workflow::new("pinned", version).step("a", StepKind::Read, a);
    if version == 1 {
        wf.step("b", StepKind::Read, |_ctx| async {
            Err(StepError::Unknown(
                "v1's step b cannot read this answer".into(),
            ))
        })
        .step("legacy", StepKind::Read, |_ctx| async {
            Err(StepError::Unknown("v1's legacy step stopped".into()))
        })
    } else {
        wf.step("b", StepKind::Read, move |_ctx| async move {
            Ok(StepOutcome::finish(json!({ "code": version })))
        })
    }
}

/// A registry with `pinned` v1 and v2 beside `base`.
fn with_pinned(mut base: Registry, hold: &Hold) -> Registry {
    base.register(pinned(1, hold.clone()))
        .register(pinned(2, hold.clone()));
    base
}

/// Starts a `pinned` run on version 1 (the registry's newest is 2).
async fn start_v1(env: &TestEnv, run_id: &str, input: Value) {
    let event = RunStartEvent {
        version: Some(1),
        ..RunStartEvent::new(RunId::parse(run_id).unwrap(), "pinned", input)
    };
    env.publish(&env.topology().run_start(&event)).await;
}

/// A queue bound to every run event of the environment, to read them back.
async fn events_queue(env: &TestEnv) -> (Arc<lapin::Connection>, lapin::Channel, String) {
    let conn = trailmark::broker::connect(&env.settings.broker, "test-events")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("{}.test-events", env.prefix);
    let opts = lapin::options::QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), opts, Default::default())
        .await
        .unwrap();
    let exchange = env.topology().events_exchange();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "run.#".into(),
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    (conn, ch, queue)
}

/// Reads events from `queue` until one is `run.<status>` of `run_id` (bounded), and returns it.
async fn event_of(ch: &lapin::Channel, queue: &str, run_id: &str, status: &str) -> Event {
    let what = format!("event run.{status} of {run_id}");
    let wanted = format!("run.{status}");
    common::eventually(&what, WAIT, || async {
        let got = ch
            .basic_get(queue.into(), Default::default())
            .await
            .unwrap()?;
        let event: Event = serde_json::from_slice(&got.delivery.data).unwrap();
        let ours = event.run_id.as_ref().map(RunId::as_str) == Some(run_id);
        (ours && event.event == wanted).then_some(event)
    })
    .await
    .unwrap_or_else(|| panic!("no {what}"))
}

async fn version_of(env: &TestEnv, run_id: &str) -> i32 {
    runs::get(&env.pool, run_id)
        .await
        .unwrap()
        .unwrap()
        .workflow_version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_takes_only_runs_at_rest_and_the_moved_ones_go_on_with_the_new_code() {
    let env = TestEnv::new().await;
    let hold = Hold::default();
    let registry = with_pinned(Registry::new(), &hold);
    let engine = Engine::with_pool(
        env.settings.clone(),
        registry,
        Failpoints::default(),
        env.pool.clone(),
    )
    .unwrap();
    let (_conn, ch, queue) = events_queue(&env).await;
    let running = env.spawn_all(engine.clone());
    start_v1(&env, "r-review", json!({})).await;
    start_v1(&env, "r-legacy", json!({"route": "legacy"})).await;
    start_v1(&env, "r-event", json!({"route": "event"})).await;
    start_v1(&env, "r-busy", json!({"hold": true})).await;
    env.wait_status("r-review", RunStatus::NeedsReview, WAIT)
        .await;
    env.wait_status("r-legacy", RunStatus::NeedsReview, WAIT)
        .await;
    env.wait_status("r-event", RunStatus::Waiting, WAIT).await;
    env.wait_until("r-busy's step a to run", WAIT, || async {
        hold.entered.load(Ordering::SeqCst)
    })
    .await;
    let stopped = event_of(&ch, &queue, "r-review", "needs_review").await;
    assert_eq!(stopped.workflow_version, Some(1), "{stopped:?}");

    let ask = MoveAsk {
        workflow: "pinned".into(),
        from: 1,
        to: 2,
        runs: vec![],
    };
    let preview = operator::move_preview(&engine, &ask).await.unwrap();
    let verdicts: Vec<(&str, Verdict, Option<&str>, Option<i32>)> = preview
        .runs
        .iter()
        .map(|r| (r.run_id.as_str(), r.verdict, r.step.as_deref(), r.seq))
        .collect();
    assert_eq!(
        verdicts,
        vec![
            ("r-busy", Verdict::Busy, Some("a"), Some(0)),
            ("r-event", Verdict::Moves, Some("a"), Some(0)),
            ("r-legacy", Verdict::LacksStep, Some("legacy"), Some(1)),
            ("r-review", Verdict::Moves, Some("b"), Some(1)),
        ]
    );
    let legacy = &preview.runs[2].why;
    assert!(
        legacy.contains("v2 does not declare step legacy"),
        "{legacy}"
    );
    assert_eq!(preview.runs[1].waiting_for.as_deref(), Some("event"));
    assert!(!preview.applied);
    for id in ["r-busy", "r-event", "r-legacy", "r-review"] {
        assert_eq!(version_of(&env, id).await, 1, "the preview moved {id}");
        assert!(decisions::list(&env.pool, id).await.unwrap().is_empty());
    }

    let moved = operator::move_runs(&engine, &ask, &who("v1's step b is fixed in v2"))
        .await
        .unwrap();
    assert!(moved.applied);
    assert_eq!(
        (moved.count(Verdict::Moved), moved.count(Verdict::Busy)),
        (2, 1)
    );
    assert_eq!(moved.count(Verdict::LacksStep), 1);
    let versions = [
        version_of(&env, "r-review").await,
        version_of(&env, "r-event").await,
        version_of(&env, "r-legacy").await,
        version_of(&env, "r-busy").await,
    ];
    assert_eq!(versions, [2, 2, 1, 1], "review, event, legacy, busy");
    let d = decisions::list(&env.pool, "r-review").await.unwrap();
    assert_eq!(d.len(), 1);
    let row = (
        d[0].action.as_str(),
        d[0].version_before,
        d[0].version_after,
    );
    assert_eq!(row, ("move_version", 1, 2));
    assert_eq!(
        (d[0].status_before.as_str(), d[0].status_after.as_str()),
        ("needs_review", "needs_review")
    );
    assert_eq!(d[0].actor, "maria.ops");
    let trail = audit::list(&env.pool, Some("r-review"), None, 10)
        .await
        .unwrap();
    assert_eq!(trail.len(), 1);
    assert_eq!(trail[0].action, "move_version");
    assert_eq!(
        (
            trail[0].details["from"].clone(),
            trail[0].details["to"].clone()
        ),
        (json!(1), json!(2))
    );
    assert!(
        decisions::list(&env.pool, "r-busy")
            .await
            .unwrap()
            .is_empty()
    );

    // The moved run resumed runs v2's step b, which succeeds; its event says v2.
    operator::resume(&engine, "r-review", &who("go on on v2"), Resume::Again)
        .await
        .unwrap();
    env.wait_status("r-review", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(output_at(&env, "r-review", 1).await, json!({"code": 2}));
    let done = event_of(&ch, &queue, "r-review", "succeeded").await;
    assert_eq!(done.workflow_version, Some(2), "{done:?}");
    // The moved waiting run's wake-up sends its next step on v2 as well.
    let go = InboundEvent::new("go", "r-event", None, json!({}), 1 << 20).unwrap();
    let sender = who("the supplier answered");
    trailmark::wait::send(&engine, go, trailmark::wait::Sender::Audited(&sender))
        .await
        .unwrap();
    env.wait_status("r-event", RunStatus::Succeeded, WAIT).await;
    assert_eq!(output_at(&env, "r-event", 1).await, json!({"code": 2}));
    // The busy run was left alone: it goes on with v1's code, which stops at b.
    hold.release.store(true, Ordering::SeqCst);
    let busy = env
        .wait_status("r-busy", RunStatus::NeedsReview, WAIT)
        .await;
    assert_eq!(busy.workflow_version, 1);
    assert!(
        busy.error.unwrap_or_default().contains("v1's step b"),
        "v1's code ran"
    );
    running.stop().await;
}

/// The output a run's step at `seq` checkpointed.
async fn output_at(env: &TestEnv, run_id: &str, seq: i32) -> Value {
    sqlx::query_scalar("SELECT output FROM trailmark.steps WHERE run_id = $1 AND seq = $2")
        .bind(run_id)
        .bind(seq)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

/// A raw `chain` step message of `version` for `run_id` at position 0.
fn chain_step(env: &TestEnv, run_id: &RunId, version: i32) -> Outgoing {
    let msg = StepMessage {
        v: 1,
        message_id: MessageId::new(),
        run_id: run_id.clone(),
        workflow: "chain".into(),
        version,
        step: "link".into(),
        seq: 0,
        trace: None,
    };
    Outgoing {
        message_id: msg.message_id.to_string(),
        exchange: env.topology().steps_exchange(),
        routing_key: STEP_ROUTING_KEY.into(),
        headers: map_to_headers(&Default::default()),
        body: msg.encode(),
    }
}

/// `trailmark ARGS`; (exit code, stdout, stderr).
fn cli(env: &TestEnv, args: &[&str]) -> (Option<i32>, String, String) {
    let out = env.command(args).output().unwrap();
    let (stdout, stderr) = text(&out);
    (out.status.code(), stdout, stderr)
}

/// The `workflow versions --json` entry of `workflow` at `version`.
fn entry<'a>(all: &'a Value, workflow: &str, version: i64) -> &'a Value {
    all.as_array()
        .unwrap()
        .iter()
        .find(|v| v["workflow"] == workflow && v["version"] == version)
        .unwrap_or_else(|| panic!("{workflow} v{version} not listed: {all}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_versions_previews_and_moves_a_stopped_run_which_resume_continues() {
    let env = TestEnv::new().await;
    // The worker carries chain v1 (as the binary does) and pinned v1 and v2.
    let registry = with_pinned(trailmark_reference::registry(), &Hold::default());
    let engine = Engine::with_pool(
        env.settings.clone(),
        registry,
        Failpoints::default(),
        env.pool.clone(),
    )
    .unwrap();
    let running = env.spawn_all(engine.clone());
    // A run of chain v0, a version no worker carries any more: its step stops it for review.
    let old = env.insert_chain_run_at("r-old", 0).await;
    env.publish(&chain_step(&env, &old, 0)).await;
    env.wait_status("r-old", RunStatus::NeedsReview, WAIT).await;
    // And one that executes a step: its lease is held by a live worker for an hour.
    env.insert_chain_run_at("r-busy", 0).await;
    sqlx::query(
        "UPDATE trailmark.runs SET lease_owner = 'worker-elsewhere', lease_pid = pg_backend_pid(),
                lease_expires_at = now() + interval '1 hour' WHERE run_id = 'r-busy'",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    env.wait_until("the worker to record what it carries", WAIT, || async {
        trailmark::store::deployments::live(&env.pool)
            .await
            .unwrap()
            .iter()
            .any(|c| c.workflow == "pinned")
    })
    .await;

    let (code, out, err) = cli(&env, &["workflow", "versions", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let all: Value = serde_json::from_str(&out).unwrap();
    let v0 = entry(&all, "chain", 0);
    assert_eq!(
        (
            v0["in_flight"]["needs_review"].clone(),
            v0["in_flight"]["running"].clone()
        ),
        (json!(1), json!(1))
    );
    assert_eq!(
        (v0["carried_here"].clone(), v0["live_workers"].clone()),
        (json!(false), json!(0))
    );
    assert_eq!(v0["removable"], false);
    let said = v0["verdict"].as_str().unwrap();
    assert!(
        said.starts_with("2 runs in flight and no live worker carries it"),
        "{said}"
    );
    assert!(
        said.contains("workflow move chain --from 0 --to 1"),
        "{said}"
    );
    let v1 = entry(&all, "chain", 1);
    assert_eq!(
        (v1["carried_here"].clone(), v1["live_workers"].clone()),
        (json!(true), json!(1))
    );
    let old_pinned = entry(&all, "pinned", 1);
    assert_eq!(
        (
            old_pinned["carried_here"].clone(),
            old_pinned["live_workers"].clone()
        ),
        (json!(false), json!(1))
    );
    assert_eq!(old_pinned["removable"], true);
    assert_eq!(
        old_pinned["verdict"],
        "no runs in flight: can be removed from the code"
    );
    assert_eq!(entry(&all, "pinned", 2)["removable"], false, "the newest");
    let (code, table, _) = cli(&env, &["workflow", "versions"]);
    assert_eq!(code, Some(0));
    let line = table
        .lines()
        .find(|l| l.contains("pinned") && l.contains("v1"))
        .unwrap();
    assert!(
        line.contains("no runs in flight: can be removed from the code"),
        "{table}"
    );

    let reason = "v0 retired; link is unchanged in v1";
    let args = [
        "workflow", "move", "chain", "--from", "0", "--to", "1", "--reason", reason,
    ];
    let (code, out, err) = cli(&env, &[&args[..], &["--preview"]].concat());
    assert_eq!(code, Some(0), "{err}");
    let row = |name: &str| {
        out.lines()
            .find(|l| l.contains(name))
            .unwrap_or_default()
            .to_owned()
    };
    let old_row = row("r-old");
    for cell in [
        "needs_review",
        " link ",
        " 0 ",
        "would move",
        "v1 declares link",
    ] {
        assert!(
            old_row.contains(cell),
            "{cell:?} missing from {old_row:?}:\n{out}"
        );
    }
    assert!(
        row("r-busy").contains("busy: it is executing a step"),
        "{out}"
    );
    assert!(out.contains("preview: nothing was changed"), "{out}");
    assert_eq!(version_of(&env, "r-old").await, 0, "the preview moved it");
    assert!(
        decisions::list(&env.pool, "r-old")
            .await
            .unwrap()
            .is_empty()
    );

    common::assert_each_refused(
        &env,
        &[
            (
                &[&args[..], &["--run", "r-busy", "--yes"]].concat(),
                "no run of chain moved from v0 to v1: 1 busy",
            ),
            (
                &[
                    "workflow", "move", "chain", "--from", "0", "--to", "5", "--reason", reason,
                    "--yes",
                ],
                "this binary does not carry v5 (it carries v1)",
            ),
            (&args[..], "without confirmation: stdin is not a terminal"),
        ],
    );
    assert_eq!(version_of(&env, "r-busy").await, 0);

    let (code, out, err) = cli(&env, &[&args[..], &["--yes", "--actor", "olga"]].concat());
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("chain v0 -> v1: 1 moved, 1 busy"), "{out}");
    assert_eq!(
        (
            version_of(&env, "r-old").await,
            version_of(&env, "r-busy").await
        ),
        (1, 0)
    );
    let d = decisions::list(&env.pool, "r-old").await.unwrap();
    let row = (
        d[0].action.as_str(),
        d[0].actor.as_str(),
        d[0].version_before,
        d[0].version_after,
    );
    assert_eq!(row, ("move_version", "olga", 0, 1));
    assert_eq!(d[0].reason, reason);

    // A plain resume continues it on v1: a step message of v0 would stop it for review again.
    let (code, _, err) = cli(&env, &["run", "resume", "r-old", "--reason", "go on on v1"]);
    assert_eq!(code, Some(0), "{err}");
    env.wait_status("r-old", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger("r-old").await, (1, 1));
    let (_, shown, _) = cli(&env, &["run", "show", "r-old"]);
    assert!(shown.contains("workflow chain v1"), "{shown}");
    assert!(
        shown.contains("move_version step link by olga: needs_review -> needs_review (v0 -> v1)"),
        "{shown}"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_lists_versions_and_moves_a_stopped_run_once_per_idempotency_key() {
    use reqwest::{Method, StatusCode};
    use trailmark::api::Role;
    let registry = with_pinned(trailmark_testkit::registry(), &Hold::default());
    let api = api_support::Api::start(registry).await;
    let env = &api.env;
    let old = env.insert_chain_run_at("r-old", 0).await;
    env.publish(&chain_step(env, &old, 0)).await;
    env.wait_status("r-old", RunStatus::NeedsReview, WAIT).await;

    let viewer = Some(api.token(Role::Viewer));
    let (status, listed) = api
        .call(
            Method::GET,
            "/api/v1/workflows/versions",
            viewer,
            None,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    let v0 = entry(&listed["versions"], "chain", 0);
    assert_eq!(v0["in_flight"]["needs_review"], 1, "{listed}");

    let path = "/api/v1/workflows/chain/move";
    let op = Some(api.token(Role::Operator));
    let ask = |extra: Value| {
        let mut body = json!({"reason": "v0 retired", "from": 0, "to": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        Some(body)
    };
    let (status, preview) = api
        .call(Method::POST, path, op, ask(json!({"preview": true})), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{preview}");
    assert_eq!(
        (
            preview["applied"].clone(),
            preview["runs"][0]["verdict"].clone()
        ),
        (json!(false), json!("moves"))
    );
    assert_eq!(version_of(env, "r-old").await, 0, "the preview moved it");
    let refusals = [
        (viewer, ask(json!({})), Some("k-1"), StatusCode::FORBIDDEN),
        (op, ask(json!({"to": 5})), Some("k-2"), StatusCode::CONFLICT),
        (op, ask(json!({})), None, StatusCode::PRECONDITION_REQUIRED),
    ];
    for (token, body, key, want) in refusals {
        let (status, said) = api.call(Method::POST, path, token, body, key).await;
        assert_eq!(status, want, "{said}");
        if want == StatusCode::CONFLICT {
            assert_eq!(said["field"], "to", "{said}");
            assert!(
                said["message"]
                    .as_str()
                    .unwrap()
                    .contains("does not carry v5"),
                "{said}"
            );
        }
    }
    assert_eq!(version_of(env, "r-old").await, 0, "a refused move moved it");

    for _ in 0..2 {
        let (status, done) = api
            .call(Method::POST, path, op, ask(json!({})), Some("k-3"))
            .await;
        assert_eq!(status, StatusCode::OK, "{done}");
        assert_eq!(done["runs"][0]["verdict"], "moved", "{done}");
    }
    assert_eq!(version_of(env, "r-old").await, 1);
    let d = decisions::list(&env.pool, "r-old").await.unwrap();
    assert_eq!(d.len(), 1, "the repeat under the same key moved it again");
    assert_eq!(
        (d[0].actor.as_str(), d[0].version_before, d[0].version_after),
        ("otto", 0, 1)
    );
    let trail = audit::list(&env.pool, Some("r-old"), None, 10)
        .await
        .unwrap();
    assert_eq!((trail.len(), trail[0].via.as_str()), (1, "api"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_message_of_the_version_a_run_was_moved_from_claims_nothing() {
    let env = TestEnv::new().await;
    // A run at position 0 on v2, as a move from v1 leaves it; a copy of its v1 message arrives.
    let run_id = env.insert_chain_run_at("r-moved", 2).await;
    let request = |version| runs::ClaimRequest {
        version,
        run_id: run_id.clone(),
        seq: 0,
        step: "link".into(),
        owner: "w-test".into(),
        lease_secs: 30.0,
        presence_pid: None,
        message: ("steps", MessageId::new()),
        redelivered: false,
        unstarted_preclaim: false,
    };
    let old = runs::claim(&env.pool, &request(1)).await.unwrap();
    assert!(
        matches!(old, runs::ClaimOutcome::Refused(runs::Refusal::Version(2))),
        "{old:?}"
    );
    let run = runs::get(&env.pool, "r-moved").await.unwrap().unwrap();
    assert_eq!(
        (run.fence, run.lease_owner),
        (0, None),
        "the old copy touched the run"
    );
    assert_eq!(env.attempts("r-moved", 0).await, 0);
    let current = runs::claim(&env.pool, &request(2)).await.unwrap();
    assert!(
        matches!(current, runs::ClaimOutcome::Claimed(_)),
        "{current:?}"
    );
}

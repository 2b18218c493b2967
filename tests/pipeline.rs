//! The step pipeline against the real servers: one transaction, dedup, relay repeats, fencing,
//! idempotent run start.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::TestEnv;
use serde_json::json;
use trailmark::broker::{Outgoing, map_to_headers};
use trailmark::domain::{
    IdempotencyKey, MessageId, RunId, RunStatus, STEP_ROUTING_KEY, StepMessage,
};
use trailmark::failpoint::{Action, Failpoints};
use trailmark::store::{self, effects, runs};

const WAIT: Duration = Duration::from_secs(60);

/// Creates a one-step `chain` run directly in the store (no start event, no step message).
async fn insert_chain_run(env: &TestEnv, id: &str) -> RunId {
    let run_id = RunId::parse(id).unwrap();
    let input = json!({"steps": 1});
    let new = runs::NewRun {
        run_id: &run_id,
        workflow: "chain",
        version: 1,
        first_step: "link",
        input: &input,
    };
    assert!(
        runs::insert(&env.pool, &new).await.unwrap(),
        "run {id} already existed"
    );
    run_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_run_succeeds_with_one_ledger_row_per_step() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-basic", json!({"steps": 25}))
        .await;
    let run = env.wait_status("r-basic", RunStatus::Succeeded, WAIT).await;
    assert_eq!(run.step_seq, 25);
    assert_eq!(env.chain_ledger("r-basic").await, (25, 25));
    assert_eq!(env.steps_done("r-basic").await, 25);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            "r-basic"
        )
        .await,
        25
    );
    assert_eq!(engine.stats.handler_runs.load(Ordering::Relaxed), 25);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_run_id_started_twice_creates_one_run() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-twice", json!({"steps": 3})).await;
    env.start_run("chain", "r-twice", json!({"steps": 3})).await;
    env.wait_status("r-twice", RunStatus::Succeeded, WAIT).await;
    // Both events were consumed: one created the run, the other was recognised.
    env.wait_until("second start event consumed", WAIT, || async {
        engine.stats.runs_started.load(Ordering::Relaxed)
            + engine.stats.duplicates.load(Ordering::Relaxed)
            >= 2
    })
    .await;
    assert_eq!(engine.stats.runs_started.load(Ordering::Relaxed), 1);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id = $1",
            "r-twice"
        )
        .await,
        1
    );
    assert_eq!(env.chain_ledger("r-twice").await, (3, 3));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_between_checkpoint_and_outbox_leaves_neither_then_completes() {
    let env = TestEnv::new().await;
    let failpoints = Failpoints::default();
    failpoints.set("step.after_checkpoint", Action::Error, None);
    let engine = env.engine_with(trailmark::builtin::registry(), failpoints.clone());
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-atomic", json!({"steps": 2}))
        .await;
    // The first step keeps failing inside its commit: wait until it has been tried twice.
    env.wait_until("two failed commits", WAIT, || async {
        env.scalar(
            "SELECT COALESCE(max(attempts), 0)::bigint FROM trailmark.steps WHERE run_id = $1",
            "r-atomic",
        )
        .await
            >= 2
    })
    .await;
    let outbox_for_second_step = env
        .scalar("SELECT count(*) FROM trailmark.outbox WHERE headers->>'x-trailmark-run-id' = $1 AND body::text LIKE '%\"seq\":1%'", "r-atomic")
        .await;
    let checkpoints = env
        .scalar(
            "SELECT count(output) FROM trailmark.steps WHERE run_id = $1",
            "r-atomic",
        )
        .await;
    let run = runs::get(&env.pool, "r-atomic").await.unwrap().unwrap();
    assert_eq!(
        (checkpoints, outbox_for_second_step, run.step_seq),
        (0, 0, 0),
        "a failed commit left state behind"
    );
    failpoints.set("step.after_checkpoint", Action::Error, Some(u64::MAX));
    env.wait_status("r-atomic", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(env.steps_done("r-atomic").await, 2);
    assert_eq!(
        env.chain_ledger("r-atomic").await,
        (2, 2),
        "the retried step's keyed write was not repeated"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_step_message_delivered_twice_changes_nothing() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let run_id = insert_chain_run(&env, "r-dup").await;
    let msg = StepMessage {
        v: 1,
        message_id: MessageId::new(),
        run_id: run_id.clone(),
        workflow: "chain".into(),
        version: 1,
        step: "link".into(),
        seq: 0,
    };
    let out = Outgoing {
        message_id: msg.message_id.to_string(),
        exchange: env.topology().steps_exchange(),
        routing_key: STEP_ROUTING_KEY.into(),
        headers: map_to_headers(&Default::default()),
        body: msg.encode(),
    };
    env.publish_all(&[out.clone(), out]).await;
    let running = env.spawn_all(engine.clone());
    env.wait_status("r-dup", RunStatus::Succeeded, WAIT).await;
    env.wait_until("second delivery dropped", WAIT, || async {
        engine.stats.duplicates.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.steps WHERE run_id = $1",
            "r-dup"
        )
        .await,
        1
    );
    assert_eq!(env.chain_ledger("r-dup").await, (1, 1));
    assert_eq!(engine.stats.handler_runs.load(Ordering::Relaxed), 1);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_crash_between_confirm_and_mark_publishes_twice_consumes_once() {
    let env = TestEnv::new().await;
    let failpoints = Failpoints::default();
    // The first batch is confirmed by the broker, then the relay fails before marking it.
    failpoints.set("relay.after_confirm", Action::Error, Some(1));
    // Relay only (no eager publishing by the worker), so every message passes the failpoint.
    let mut settings = env.settings.clone();
    settings.relay.eager_grace_ms = 0;
    let engine = trailmark::engine::Engine::with_pool(
        settings,
        trailmark::builtin::registry(),
        failpoints,
        env.pool.clone(),
    )
    .unwrap();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-relay", json!({"steps": 3})).await;
    env.wait_status("r-relay", RunStatus::Succeeded, WAIT).await;
    env.wait_until("the repeated message dropped", WAIT, || async {
        engine.stats.duplicates.load(Ordering::Relaxed) + engine.stats.stale.load(Ordering::Relaxed)
            >= 1
    })
    .await;
    assert_eq!(env.chain_ledger("r-relay").await, (3, 3));
    assert_eq!(
        env.scalar(
            "SELECT sum(attempts)::bigint FROM trailmark.steps WHERE run_id = $1",
            "r-relay"
        )
        .await,
        3
    );
    assert_eq!(engine.stats.handler_runs.load(Ordering::Relaxed), 3);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_with_an_older_fence_is_refused_and_changes_nothing() {
    let env = TestEnv::new().await;
    let run_id = insert_chain_run(&env, "r-fence").await;
    // Worker A claims with a lease that expires at once; worker B takes over.
    let a = runs::claim(&env.pool, &run_id, 0, "worker-a", 0.0, None)
        .await
        .unwrap()
        .expect("A claims");
    let b = runs::claim(&env.pool, &run_id, 0, "worker-b", 30.0, None)
        .await
        .unwrap()
        .expect("B claims after expiry");
    assert!(b.fence() > a.fence());
    let to = runs::Advance {
        seq: 0,
        next_step: Some("link"),
        status: RunStatus::Running,
        output: None,
        error: None,
        handover: None,
    };
    let stale = runs::advance(&env.pool, &run_id, a.fence(), &to).await;
    assert!(
        matches!(stale, Err(store::Error::FencedOut { .. })),
        "{stale:?}"
    );
    assert_eq!(
        runs::get(&env.pool, "r-fence")
            .await
            .unwrap()
            .unwrap()
            .step_seq,
        0,
        "stale commit moved the run"
    );
    let key = IdempotencyKey::parse("r-fence:link:0").unwrap();
    let fenced = effects::begin(&env.pool, &key, "ledger", &run_id, 0, "h", a.fence()).await;
    assert!(matches!(fenced, Err(store::Error::FencedOut { .. })));
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.effects WHERE run_id = $1",
            "r-fence"
        )
        .await,
        0
    );
    assert!(
        !runs::heartbeat(&env.pool, &run_id, a.fence(), 30.0)
            .await
            .unwrap(),
        "stale heartbeat accepted"
    );
    runs::advance(&env.pool, &run_id, b.fence(), &to)
        .await
        .expect("current fence commits");
    assert_eq!(
        runs::get(&env.pool, "r-fence")
            .await
            .unwrap()
            .unwrap()
            .step_seq,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_key_with_a_different_request_is_a_conflict() {
    let env = TestEnv::new().await;
    let run_id = insert_chain_run(&env, "r-key").await;
    let claim = runs::claim(&env.pool, &run_id, 0, "w", 30.0, None)
        .await
        .unwrap()
        .unwrap();
    let key = IdempotencyKey::parse("r-key:post:inv-1").unwrap();
    let first = effects::begin(
        &env.pool,
        &key,
        "ledger",
        &run_id,
        0,
        "hash-a",
        claim.fence(),
    )
    .await
    .unwrap();
    assert!(matches!(first, effects::Known::New));
    let again = effects::begin(
        &env.pool,
        &key,
        "ledger",
        &run_id,
        0,
        "hash-a",
        claim.fence(),
    )
    .await
    .unwrap();
    assert!(
        matches!(again, effects::Known::Unknown),
        "same key, same request: outcome unknown, call again"
    );
    match effects::begin(
        &env.pool,
        &key,
        "ledger",
        &run_id,
        0,
        "hash-b",
        claim.fence(),
    )
    .await
    {
        Err(e @ store::Error::Conflict { .. }) => {
            assert!(e.to_string().contains("r-key:post:inv-1"), "{e}")
        }
        other => panic!("expected a conflict, got {:?}", other.map(|_| ())),
    }
}

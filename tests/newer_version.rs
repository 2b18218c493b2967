//! A step message of a workflow version newer than the deployed one (`chain` runs v1 here): it
//! is stale once its run ended or moved on, whatever its version, and it waits for a worker of
//! its version only for `worker.newer_version_wait_secs`, then goes to the DLQ saying what to do.

mod common;
mod dlq_support;

use std::sync::atomic::Ordering;

use common::TestEnv;
use dlq_support::{WAIT, dead_letters, depth, wait_dlq_depth};
use serde_json::json;
use trailmark::broker::{Outgoing, map_to_headers};
use trailmark::domain::{MessageId, RunId, RunStatus, STEP_ROUTING_KEY, StepMessage};
use trailmark::store::runs;

/// A raw `chain` step message of version 2 for `run_id` at position `seq`.
fn v2_step(env: &TestEnv, run_id: &RunId, seq: i32) -> (MessageId, Outgoing) {
    let msg = StepMessage {
        v: 1,
        message_id: MessageId::new(),
        run_id: run_id.clone(),
        workflow: "chain".into(),
        version: 2,
        step: "link".into(),
        seq,
        trace: None,
    };
    let out = Outgoing {
        message_id: msg.message_id.to_string(),
        exchange: env.topology().steps_exchange(),
        routing_key: STEP_ROUTING_KEY.into(),
        headers: map_to_headers(&Default::default()),
        body: msg.encode(),
    };
    (msg.message_id, out)
}

/// Ready messages in every queue trailmark declares (work, delay and dead-letter queues).
async fn queued(env: &TestEnv) -> u32 {
    let mut n = 0;
    for q in env.topology().queues() {
        n += depth(env, &q.name).await;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_version_step_of_a_finished_run_is_dropped_as_stale_not_delayed() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-ended", json!({"steps": 2})).await;
    let before = env.wait_status("r-ended", RunStatus::Succeeded, WAIT).await;
    let stale = engine.stats.stale.load(Ordering::Relaxed);
    let delayed = engine.stats.delayed.load(Ordering::Relaxed);

    let run_id = RunId::parse("r-ended").unwrap();
    let (_, message) = v2_step(&env, &run_id, 0);
    env.publish(&message).await;
    env.wait_until("the v2 step dropped as stale", WAIT, || async {
        engine.stats.stale.load(Ordering::Relaxed) == stale + 1
    })
    .await;
    // Dropped at its first delivery: it never went to a delay queue, nor to the DLQ.
    assert_eq!(
        engine.stats.delayed.load(Ordering::Relaxed),
        delayed,
        "the message waited for a worker of v2"
    );
    assert_eq!(engine.stats.dead_lettered.load(Ordering::Relaxed), 0);
    env.wait_until("no message left in any queue", WAIT, || async {
        queued(&env).await == 0
    })
    .await;
    let after = runs::get(&env.pool, "r-ended").await.unwrap().unwrap();
    assert_eq!(
        (after.status, after.step_seq, after.fence, after.updated_at),
        (
            before.status,
            before.step_seq,
            before.fence,
            before.updated_at
        ),
        "the run was touched"
    );
    assert_eq!(env.chain_ledger("r-ended").await, (2, 2));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_version_step_its_run_waits_for_ends_in_the_dlq_after_the_wait_setting() {
    let env = TestEnv::with(|s| s.worker.newer_version_wait_secs = 3).await;
    let engine = env.engine();
    // A run of chain v2 waiting at position 0: no worker here runs v2.
    let run_id = env.insert_chain_run_at("r-v2", 2).await;
    let (id, message) = v2_step(&env, &run_id, 0);
    let running = env.spawn_all(engine.clone());
    env.publish(&message).await;
    wait_dlq_depth(&env, 1).await;

    let letters = dead_letters(&env).await;
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.id, id.to_string());
    assert_eq!(letter.reason, "version_not_deployed");
    let detail = letter.detail.as_deref().unwrap_or_default();
    for words in [
        "run r-v2 step link (position 0) is of chain v2",
        "carry up to v1 without it",
        "worker.newer_version_wait_secs = 3",
        "deploy v2 of chain (or move the run: `trailmark workflow move`)",
        &format!("then `trailmark dlq requeue {id}`"),
    ] {
        assert!(detail.contains(words), "{words:?} not in {detail:?}");
    }
    // It waited (at least twice, 1 s each, within 3 s), then stopped circling.
    assert!(engine.stats.delayed.load(Ordering::Relaxed) >= 2);
    assert_eq!(engine.stats.dead_lettered.load(Ordering::Relaxed), 1);
    assert_eq!(queued(&env).await, 1, "only the dead letter is left");
    let run = runs::get(&env.pool, "r-v2").await.unwrap().unwrap();
    assert_eq!(
        (run.status, run.step_seq, run.fence, run.lease_owner),
        (RunStatus::Running, 0, 0, None),
        "the run was claimed by a worker that does not run its version"
    );
    assert_eq!(env.attempts("r-v2", 0).await, 0);
    running.stop().await;
}

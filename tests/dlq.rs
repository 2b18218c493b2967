//! Poison messages against the real servers: what reaches the DLQ and why while good work keeps
//! flowing, a requeued message that runs once, and a message that kills its worker every time.

mod common;
mod dlq_support;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use common::{ChildGuard, TestEnv};
use dlq_support::{WAIT, cli, dead_letters, depth, message, step_body, wait_dlq_depth};
use serde_json::{Value, json};
use trailmark::broker::Outgoing;
use trailmark::dlq::DeadLetteredBy;
use trailmark::domain::{RUN_START_ROUTING_KEY, RunId, RunStartEvent, RunStatus, STEP_ROUTING_KEY};
use trailmark::failpoint::Failpoints;
use trailmark::workflow::{StepKind, StepOutcome, Workflow};

/// Poison message `i` (kind `i % 4`), alternating between the run-start and steps exchanges.
/// Returns the message and the reason and queue it must be dead-lettered with.
fn poison(env: &TestEnv, i: usize) -> (Outgoing, &'static str, String) {
    let t = env.topology();
    let to_steps = (i / 4) % 2 == 1;
    let run_id = format!("p-{i:03}");
    let (reason, body) = match i % 4 {
        0 => ("undecodable", format!("{{not json {i}").into_bytes()),
        1 if to_steps => ("unknown_workflow", step_body(&run_id, "no-such-flow", 1)),
        1 => (
            "unknown_workflow",
            json!({"v": 1, "run_id": run_id, "workflow": "no-such-flow"})
                .to_string()
                .into_bytes(),
        ),
        2 if to_steps => ("unsupported_version", step_body(&run_id, "chain", 2)),
        2 => (
            "unsupported_version",
            json!({"v": 2, "run_id": run_id, "workflow": "chain"})
                .to_string()
                .into_bytes(),
        ),
        _ => {
            let pad = "x".repeat(5000);
            let body =
                json!({"v": 1, "run_id": run_id, "workflow": "chain", "input": {"pad": pad}});
            ("oversized", body.to_string().into_bytes())
        }
    };
    let id = uuid::Uuid::new_v4().to_string();
    let (msg, queue) = match to_steps {
        true => (
            message(t.steps_exchange(), STEP_ROUTING_KEY, &id, body),
            t.steps_queue(),
        ),
        false => (
            message(t.runs_exchange(), RUN_START_ROUTING_KEY, &id, body),
            t.run_start_queue(),
        ),
    };
    (msg, reason, queue)
}

/// 1,000 run-start events for one-step `chain` runs with a poison message after every tenth,
/// and what each poison message must be dead-lettered with: id -> (reason, source queue).
fn good_and_poison(env: &TestEnv) -> (Vec<Outgoing>, BTreeMap<String, (String, String)>) {
    let runs_exchange = env.topology().runs_exchange();
    let mut batch = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..1000 {
        let run_id = RunId::parse(&format!("good-{i:04}")).unwrap();
        let event = RunStartEvent::new(run_id, "chain", json!({"steps": 1}));
        let id = uuid::Uuid::new_v4().to_string();
        batch.push(message(
            runs_exchange.clone(),
            RUN_START_ROUTING_KEY,
            &id,
            event.encode(),
        ));
        if i % 10 == 9 {
            let (msg, reason, queue) = poison(env, i / 10);
            expected.insert(msg.message_id.clone(), (reason.to_owned(), queue));
            batch.push(msg);
        }
    }
    (batch, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_poison_messages_of_four_kinds_reach_the_dlq_and_a_thousand_good_runs_succeed() {
    let env = TestEnv::with(|s| {
        s.worker.max_message_bytes = 4096;
        s.worker.concurrency = 32;
    })
    .await;
    let t = env.topology();
    let (batch, expected) = good_and_poison(&env);
    env.publish_all(&batch).await;
    let started = Instant::now();
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.wait_until("1000 runs succeeded", WAIT, || async {
        env.scalar(
            "SELECT count(*) FROM trailmark.runs WHERE status = 'succeeded' AND run_id LIKE $1",
            "good-%",
        )
        .await
            == 1000
    })
    .await;
    wait_dlq_depth(&env, 100).await;
    eprintln!("1,100 messages processed in {:?}", started.elapsed());
    running.stop().await;

    assert_eq!(engine.stats.dead_lettered.load(Ordering::Relaxed), 100);
    let all_runs = env
        .scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE $1",
            "%",
        )
        .await;
    assert_eq!(all_runs, 1000, "a poison message created a run");
    let ledger = env
        .scalar(
            "SELECT count(*) FROM trailmark.chain_ledger WHERE run_id LIKE $1",
            "good-%",
        )
        .await;
    assert_eq!(ledger, 1000, "one ledger row per good run");
    let letters = dead_letters(&env).await;
    let found: BTreeMap<String, (String, String)> = letters
        .iter()
        .map(|l| {
            (
                l.id.clone(),
                (l.reason.clone(), l.queue.clone().unwrap_or_default()),
            )
        })
        .collect();
    assert_eq!(letters.len(), 100);
    assert_eq!(
        found, expected,
        "each poison message with its reason and source queue"
    );
    for l in &letters {
        assert_eq!(
            (l.by, l.deliveries, l.requeued),
            (DeadLetteredBy::Worker, Some(1), 0),
            "{l:?}"
        );
        assert!(l.failed_at.is_some() && l.detail.is_some(), "{l:?}");
        if l.reason == "oversized" {
            assert!(l.body_bytes > 4096, "{l:?}");
        }
    }
    let mut by_reason = BTreeMap::new();
    for l in &letters {
        *by_reason.entry(l.reason.as_str()).or_insert(0) += 1;
    }
    let counts = BTreeMap::from([
        ("oversized", 25),
        ("undecodable", 25),
        ("unknown_workflow", 25),
        ("unsupported_version", 25),
    ]);
    assert_eq!(by_reason, counts);

    let (code, out, err) = cli(&env, &["dlq", "list", "--json", "--limit", "10"]).await;
    assert_eq!(code, 0, "{err}");
    let listing: Value = serde_json::from_str(&out).expect("list --json is JSON");
    assert_eq!(listing["depth"], 100);
    assert_eq!(listing["letters"].as_array().unwrap().len(), 10);
    assert_eq!(depth(&env, &t.dlq()).await, 100, "listing removed nothing");
}

/// A one-step workflow that counts its executions.
fn greet(executions: Arc<AtomicU64>) -> Workflow {
    Workflow::new("greet", 1).step("hello", StepKind::Write, move |_ctx| {
        let executions = executions.clone();
        async move {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(StepOutcome::finish(json!({"greeted": true})))
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeued_start_for_a_newly_deployed_workflow_runs_once_and_repeats_change_nothing() {
    let env = TestEnv::new().await;
    let event = RunStartEvent::new(RunId::parse("r-greet").unwrap(), "greet", json!({}));
    let runs_exchange = env.topology().runs_exchange();
    let (m1, m2) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let start = |id: &str| {
        message(
            runs_exchange.clone(),
            RUN_START_ROUTING_KEY,
            id,
            event.encode(),
        )
    };
    // Two copies of one message and an upstream retry with a new id: all for a workflow this
    // worker does not have.
    let old = env.spawn_all(env.engine());
    env.publish_all(&[start(&m1), start(&m1), start(&m2)]).await;
    wait_dlq_depth(&env, 3).await;
    old.stop().await;
    let mut ids: Vec<_> = dead_letters(&env)
        .await
        .into_iter()
        .map(|l| (l.id, l.reason))
        .collect();
    ids.sort();
    let mut want = vec![m1.clone(), m1.clone(), m2.clone()];
    want.sort();
    let want: Vec<_> = want
        .into_iter()
        .map(|id| (id, "unknown_workflow".to_owned()))
        .collect();
    assert_eq!(ids, want);

    let executions = Arc::new(AtomicU64::new(0));
    let mut registry = trailmark_testkit::registry();
    registry.register(greet(executions.clone()));
    let engine = env.engine_with(registry, Failpoints::default());
    let new = env.spawn_all(engine.clone());
    let (code, out, err) = cli(&env, &["dlq", "requeue", &m1]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("requeued 2 of 3"), "{out}");
    env.wait_status("r-greet", RunStatus::Succeeded, WAIT).await;
    let consumed = || async {
        engine.stats.runs_started.load(Ordering::Relaxed)
            + engine.stats.duplicates.load(Ordering::Relaxed)
    };
    env.wait_until("both copies consumed", WAIT, || async {
        consumed().await == 2
    })
    .await;
    assert_eq!(engine.stats.runs_started.load(Ordering::Relaxed), 1);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(
        depth(&env, &env.topology().dlq()).await,
        1,
        "only the retry is left"
    );

    let (code, _, err) = cli(&env, &["dlq", "requeue", &m1]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!("no dead letter with id {m1}")) && err.contains("trailmark dlq list"),
        "{err}"
    );
    let (code, out, err) = cli(&env, &["dlq", "requeue", &m2]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("requeued 1 of 1"), "{out}");
    env.wait_until("the retry consumed", WAIT, || async {
        consumed().await == 3
    })
    .await;
    assert_eq!(
        engine.stats.runs_started.load(Ordering::Relaxed),
        1,
        "a second run"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1, "a second execution");
    let runs = env
        .scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id = $1",
            "r-greet",
        )
        .await;
    assert_eq!(runs, 1);
    assert_eq!(depth(&env, &env.topology().dlq()).await, 0);
    new.stop().await;
}

/// Waits (bounded) for a child that is expected to kill itself.
async fn wait_exit(mut child: ChildGuard) -> std::process::ExitStatus {
    common::wait_exit(&mut child, WAIT)
        .await
        .expect("the worker did not die on the poison message")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_that_kills_the_worker_every_time_reaches_the_dlq_through_the_delivery_limit() {
    const LIMIT: u32 = 3;
    let env = TestEnv::with(|s| s.broker.delivery_limit = LIMIT).await;
    let t = env.topology();
    env.insert_chain_run("r-crashy").await;
    let id = uuid::Uuid::new_v4().to_string();
    let body = step_body("r-crashy", "chain", 1);
    env.publish(&message(t.steps_exchange(), STEP_ROUTING_KEY, &id, body))
        .await;

    let mut kills = 0;
    while depth(&env, &t.dlq()).await == 0 {
        assert!(
            kills <= LIMIT + 2,
            "still not dead-lettered after {kills} crashes"
        );
        let child = env.spawn_process(Some("worker.received=kill"));
        let status = wait_exit(child).await;
        assert_eq!(status.signal(), Some(9), "{status:?}");
        kills += 1;
        // The broker returns the message when the connection drops; wait until it is settled
        // in the work queue or in the DLQ before deciding whether to crash again.
        env.wait_until("the message back in a queue", WAIT, || async {
            depth(&env, &t.steps_queue()).await + depth(&env, &t.dlq()).await == 1
        })
        .await;
    }
    assert_eq!(
        kills,
        LIMIT + 1,
        "delivered once more than the limit, then dead-lettered"
    );
    let letters = dead_letters(&env).await;
    assert_eq!(letters.len(), 1);
    let l = &letters[0];
    assert_eq!(l.id, id, "the original message id");
    assert_eq!(
        (l.by, l.reason.as_str()),
        (DeadLetteredBy::Broker, "delivery_limit")
    );
    assert_eq!(l.queue.as_deref(), Some(t.steps_queue().as_str()));
    assert_eq!(l.deliveries, Some(u64::from(LIMIT) + 1));
    assert_eq!(
        (l.exchange.as_deref(), l.routing_key.as_deref()),
        (Some(t.steps_exchange().as_str()), Some(STEP_ROUTING_KEY))
    );
    let (code, out, err) = cli(&env, &["dlq", "show", &id, "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let shown: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["reason"], "delivery_limit");
    assert_eq!(shown["headers"]["x-first-death-reason"], "delivery_limit");
    assert!(
        shown["body"]["text"].as_str().unwrap().contains("r-crashy"),
        "{shown}"
    );

    // Fixed (no failpoint): requeue sends it back to the steps queue and the run completes.
    let running = env.spawn_all(env.engine());
    let (code, out, err) = cli(&env, &["dlq", "requeue", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("1 to {}", t.steps_queue())), "{out}");
    env.wait_status("r-crashy", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(env.chain_ledger("r-crashy").await, (1, 1));
    assert_eq!(depth(&env, &t.dlq()).await, 0);
    running.stop().await;
}

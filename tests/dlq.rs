//! Poison messages and the dead-letter queue against the real servers: what reaches the DLQ and
//! why, that good work keeps flowing, that requeue goes through the normal pipeline (so a repeat
//! changes nothing), and that the operator commands refuse what they should.

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{ChildGuard, TestEnv};
use serde_json::{Value, json};
use trailmark::broker::{self, Outgoing};
use trailmark::dlq::{DeadLetter, DeadLetteredBy, Dlq, Selection, quiet};
use trailmark::domain::{
    MessageId, RUN_START_ROUTING_KEY, RunId, RunStartEvent, RunStatus, STEP_ROUTING_KEY,
    StepMessage,
};
use trailmark::failpoint::Failpoints;
use trailmark::store::runs;
use trailmark::workflow::{StepKind, StepOutcome, Workflow};

const WAIT: Duration = Duration::from_secs(120);

/// Every dead letter in the environment's DLQ (nothing is removed).
async fn dead_letters(env: &TestEnv) -> Vec<DeadLetter> {
    let dlq = Dlq::connect(&env.settings.broker).await.expect("dlq");
    let listing = dlq.list(100_000, &quiet).await.expect("list");
    dlq.close().await;
    listing.letters
}

/// Ready messages in `queue`.
async fn depth(env: &TestEnv, queue: &str) -> u32 {
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

async fn wait_dlq_depth(env: &TestEnv, n: u32) {
    let dlq = env.topology().dlq();
    env.wait_until(&format!("{n} messages in the DLQ"), WAIT, || async {
        depth(env, &dlq).await == n
    })
    .await;
}

/// Runs the binary with no terminal on stdin; returns (exit code, stdout, stderr).
async fn cli(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
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

fn message(exchange: String, routing_key: &str, id: &str, body: Vec<u8>) -> Outgoing {
    Outgoing {
        message_id: id.to_owned(),
        exchange,
        routing_key: routing_key.into(),
        headers: Default::default(),
        body,
    }
}

fn step_body(run_id: &str, workflow: &str, v: u64) -> Vec<u8> {
    let msg = StepMessage {
        v,
        message_id: MessageId::new(),
        run_id: RunId::parse(run_id).unwrap(),
        workflow: workflow.into(),
        version: 1,
        step: "link".into(),
        seq: 0,
    };
    msg.encode()
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_poison_messages_of_four_kinds_reach_the_dlq_and_a_thousand_good_runs_succeed() {
    let env = TestEnv::with(|s| {
        s.worker.max_message_bytes = 4096;
        s.worker.concurrency = 32;
    })
    .await;
    let t = env.topology();
    let mut batch = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..1000 {
        let event = RunStartEvent::new(
            RunId::parse(&format!("good-{i:04}")).unwrap(),
            "chain",
            json!({"steps": 1}),
        );
        let id = uuid::Uuid::new_v4().to_string();
        batch.push(message(
            t.runs_exchange(),
            RUN_START_ROUTING_KEY,
            &id,
            event.encode(),
        ));
        if i % 10 == 9 {
            let (msg, reason, queue) = poison(&env, i / 10);
            expected.insert(msg.message_id.clone(), (reason.to_owned(), queue));
            batch.push(msg);
        }
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_by_reason_sends_each_back_to_its_queue_and_a_still_broken_one_returns() {
    let env = TestEnv::new().await;
    let t = env.topology();
    let v2 = |run: &str| json!({"v": 2, "run_id": run, "workflow": "chain"}).to_string();
    let msgs = [
        message(
            t.runs_exchange(),
            RUN_START_ROUTING_KEY,
            "a-1",
            v2("r-a").into_bytes(),
        ),
        message(
            t.steps_exchange(),
            STEP_ROUTING_KEY,
            "a-2",
            step_body("r-b", "chain", 2),
        ),
        message(
            t.steps_exchange(),
            STEP_ROUTING_KEY,
            "a-3",
            b"\xff\xfe".to_vec(),
        ),
    ];
    env.publish_all(&msgs).await;
    let running = env.spawn_all(env.engine());
    wait_dlq_depth(&env, 3).await;

    let (code, out, err) = cli(&env, &["dlq", "requeue", "--reason", "unsupported_version"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("requeued 2 of 3"), "{out}");
    assert!(
        out.contains(&format!("1 to {}", t.run_start_queue())),
        "{out}"
    );
    assert!(out.contains(&format!("1 to {}", t.steps_queue())), "{out}");
    // Still version 2: the worker dead-letters both again, from the queue they were sent to.
    env.wait_until("both back in the DLQ as requeued once", WAIT, || async {
        dead_letters(&env)
            .await
            .iter()
            .filter(|l| l.requeued == 1)
            .count()
            == 2
    })
    .await;
    let letters = dead_letters(&env).await;
    let seen: BTreeMap<_, _> = letters
        .iter()
        .map(|l| {
            (
                l.id.as_str(),
                (l.reason.as_str(), l.queue.clone().unwrap(), l.requeued),
            )
        })
        .collect();
    let want = BTreeMap::from([
        ("a-1", ("unsupported_version", t.run_start_queue(), 1)),
        ("a-2", ("unsupported_version", t.steps_queue(), 1)),
        ("a-3", ("undecodable", t.steps_queue(), 0)),
    ]);
    assert_eq!(seen, want);
    let (code, out, _) = cli(&env, &["dlq", "requeue", "--reason", "nothing_like_this"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("requeued 0 of 3") && out.contains("no dead letter has reason"),
        "{out}"
    );
    running.stop().await;
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
    let mut registry = trailmark::builtin::registry();
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
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.0.as_mut().unwrap().try_wait().expect("try_wait") {
            child.0 = None;
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the worker did not die on the poison message"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_that_kills_the_worker_every_time_reaches_the_dlq_through_the_delivery_limit() {
    const LIMIT: u32 = 3;
    let env = TestEnv::with(|s| s.broker.delivery_limit = LIMIT).await;
    let t = env.topology();
    let run_id = RunId::parse("r-crashy").unwrap();
    let input = json!({"steps": 1});
    let new = runs::NewRun {
        run_id: &run_id,
        workflow: "chain",
        version: 1,
        first_step: "link",
        input: &input,
    };
    assert!(runs::insert(&env.pool, &new).await.unwrap());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_refuses_without_a_terminal_purges_with_yes_and_unknown_ids_are_named() {
    let env = TestEnv::new().await;
    let t = env.topology();
    let garbage: Vec<_> = (0..3)
        .map(|i| {
            message(
                t.steps_exchange(),
                STEP_ROUTING_KEY,
                &format!("g-{i}"),
                vec![0x80, i],
            )
        })
        .collect();
    env.publish_all(&garbage).await;
    let running = env.spawn_all(env.engine());
    wait_dlq_depth(&env, 3).await;
    running.stop().await;

    let (code, out, err) = cli(&env, &["dlq", "show", "g-1"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("reason      undecodable") && out.contains("2 bytes, not UTF-8 JSON"),
        "{out}"
    );
    assert!(out.contains("hex: 8001"), "{out}");

    let (code, _, err) = cli(&env, &["dlq", "purge", "--all"]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("refusing to purge all 3 dead letters") && err.contains("--yes"),
        "{err}"
    );
    assert_eq!(depth(&env, &t.dlq()).await, 3, "refused, yet purged");

    let (code, out, err) = cli(&env, &["dlq", "purge", "g-1", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("purged 1 dead letters"), "{out}");
    let mut left: Vec<_> = dead_letters(&env).await.into_iter().map(|l| l.id).collect();
    left.sort();
    assert_eq!(left, ["g-0", "g-2"], "only g-1 was removed");

    let (code, out, err) = cli(&env, &["dlq", "purge", "--all", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("purged 2 dead letters"), "{out}");
    assert_eq!(depth(&env, &t.dlq()).await, 0);

    let (code, _, err) = cli(&env, &["dlq", "show", "nope"]).await;
    assert_eq!(code, 1);
    let expected = format!(
        "no dead letter with id nope in {}; list them with `trailmark dlq list`",
        t.dlq()
    );
    assert!(err.contains(&expected), "{err}");
    let (code, out, _) = cli(&env, &["dlq", "list"]).await;
    assert_eq!(
        (code, out.trim()),
        (0, format!("{} is empty", t.dlq()).as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_passes_each_see_every_message() {
    let env = TestEnv::new().await;
    let t = env.topology();
    let headers = broker::map_to_headers(&BTreeMap::from([
        ("x-trailmark-reason".to_owned(), "undecodable".to_owned()),
        ("x-trailmark-queue".to_owned(), t.steps_queue()),
    ]));
    let letters: Vec<_> = (0..300)
        .map(|i| Outgoing {
            headers: headers.clone(),
            ..message(t.dlx(), "", &format!("d-{i:03}"), b"{".to_vec())
        })
        .collect();
    env.publish_all(&letters).await;
    wait_dlq_depth(&env, 300).await;
    // A quorum queue takes a closed channel's messages back a moment after the close; every
    // pass must still see all of them, and a purge right after a show must find its message.
    let dlq = Dlq::connect(&env.settings.broker).await.unwrap();
    for pass in 0..4 {
        let listing = dlq.list(10_000, &quiet).await.unwrap();
        assert_eq!(
            (listing.depth, listing.letters.len()),
            (300, 300),
            "pass {pass}"
        );
    }
    for (n, id) in ["d-299", "d-000"].into_iter().enumerate() {
        let shown = dlq.show(id, &quiet).await.unwrap();
        assert_eq!(shown.letter.reason, "undecodable");
        let purged = dlq.purge(&Selection::Id(id.into()), &quiet).await.unwrap();
        assert_eq!(
            (purged.purged, purged.left, purged.unseen),
            (1, 299 - n as u32, 0),
            "{id}"
        );
        let again = dlq.purge(&Selection::Id(id.into()), &quiet).await;
        assert!(
            matches!(again, Err(trailmark::dlq::Error::NotFound { .. })),
            "{id}: {again:?}"
        );
    }
    assert_eq!(dlq.depth().await.unwrap(), 298);
    dlq.close().await;
}

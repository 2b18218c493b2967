//! The step pipeline against the real servers: one transaction, dedup, relay repeats, fencing,
//! idempotent run start.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::TestEnv;
use serde_json::json;
use trailmark::broker::{Outgoing, map_to_headers};
use trailmark::domain::{
    EffectIntent, EffectState, Fence, IdempotencyKey, IntentOutcome, MessageId, RunId, RunStatus,
    STEP_ROUTING_KEY,
};
use trailmark::engine::Engine;
use trailmark::failpoint::{Action, Failpoints};
use trailmark::process::Components;
use trailmark::store::{self, checkpoint, effects, runs};

const WAIT: Duration = Duration::from_secs(60);

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
    // With one worker every next step's delivery came back to the worker whose commit claimed
    // it: all but the first step started without a claim statement, each once.
    assert_eq!(engine.stats.preclaims_used.load(Ordering::Relaxed), 24);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.steps WHERE run_id = $1 AND attempts = 1",
            "r-basic"
        )
        .await,
        25
    );
    // The worker published every next-step message itself and removed its outbox row, so the
    // relay (which keeps the rows it publishes, marked) had nothing to do.
    env.wait_until("eagerly published rows removed", WAIT, || async {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.outbox")
            .fetch_one(&env.pool)
            .await
            .expect("count outbox rows");
        left == 0
    })
    .await;
    assert_eq!(engine.stats.relayed.load(Ordering::Relaxed), 0);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_relaxed_pool_commits_without_waiting_for_fsync() {
    let env = TestEnv::new().await;
    let show = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, String>("SHOW synchronous_commit")
            .fetch_one(&pool)
            .await
            .expect("show synchronous_commit")
    };
    assert_eq!(
        show(store::relaxed_pool(&env.pool, &env.settings.database)).await,
        "off"
    );
    assert_eq!(show(env.pool.clone()).await, "on");
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
async fn step_commit_failing_at_its_outbox_row_leaves_no_checkpoint_nor_inbox_row_then_completes() {
    let env = TestEnv::new().await;
    // Postgres itself refuses the next step's outbox row: the last write of the step commit.
    sqlx::raw_sql(
        r#"CREATE FUNCTION trailmark.test_refuse_second_step() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               IF convert_from(NEW.body, 'UTF8')::jsonb ->> 'seq' = '1' THEN
                   RAISE EXCEPTION 'test: outbox row refused';
               END IF;
               RETURN NEW;
           END $$;
           CREATE TRIGGER test_refuse_second_step BEFORE INSERT ON trailmark.outbox
               FOR EACH ROW EXECUTE FUNCTION trailmark.test_refuse_second_step();"#,
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let running = env.spawn_all(env.engine());
    env.start_run("chain", "r-atomic", json!({"steps": 2}))
        .await;
    // The failed commit is retried in place, each time after a new claim.
    env.wait_until("two failed commits", WAIT, || async {
        env.scalar(
            "SELECT COALESCE(max(attempts), 0)::bigint FROM trailmark.steps WHERE run_id = $1",
            "r-atomic",
        )
        .await
            >= 2
    })
    .await;
    let checkpoints = env
        .scalar(
            "SELECT count(output) FROM trailmark.steps WHERE run_id = $1",
            "r-atomic",
        )
        .await;
    let inbox: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trailmark.inbox WHERE consumer = 'steps'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    let run = runs::get(&env.pool, "r-atomic").await.unwrap().unwrap();
    assert_eq!(
        (checkpoints, inbox, run.step_seq),
        (0, 0, 0),
        "a failed commit left its checkpoint, its inbox row or the run's advance behind"
    );
    sqlx::raw_sql("DROP TRIGGER test_refuse_second_step ON trailmark.outbox")
        .execute(&env.pool)
        .await
        .unwrap();
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
    let run_id = env.insert_chain_run("r-dup").await;
    let msg = TestEnv::chain_first_step(&run_id, MessageId::new());
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
        trailmark_testkit::registry(),
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

/// Claims run `run_id` at position 0 for `owner`, as a delivery of a fresh message would.
async fn claim(env: &TestEnv, run_id: &RunId, owner: &str, lease_secs: f64) -> runs::Claim {
    let request = runs::ClaimRequest {
        version: 1,
        run_id: run_id.clone(),
        seq: 0,
        step: "link".into(),
        owner: owner.into(),
        lease_secs,
        presence_pid: None,
        message: ("steps", MessageId::new()),
        redelivered: false,
        unstarted_preclaim: false,
    };
    match runs::claim(&env.pool, &request).await.unwrap() {
        runs::ClaimOutcome::Claimed(c) => c,
        other => panic!("{owner} could not claim {run_id}: {other:?}"),
    }
}

/// Records the intent of a `ledger` call under `key` with request hash `hash`.
async fn intent(
    env: &TestEnv,
    run_id: &RunId,
    key: &IdempotencyKey,
    hash: &str,
    fence: Fence,
) -> store::Result<IntentOutcome> {
    let intent = EffectIntent {
        key: key.clone(),
        tool: "ledger".into(),
        run_id: run_id.clone(),
        seq: 0,
        request_hash: hash.into(),
        fence,
        max_calls: 0,
        repeat_limit: 0,
    };
    effects::begin(&env.pool, &intent).await
}

/// The step commit of position 0 that moves the run to position 1, from message `message`,
/// parking one item and queueing one message.
async fn commit_first_step(
    env: &TestEnv,
    run_id: &RunId,
    fence: Fence,
    message: MessageId,
) -> store::Result<bool> {
    let step = checkpoint::StepCommit {
        inbox: ("steps", message),
        ..common::first_step_commit(env, run_id, fence, &["inv-1"], 1)
    };
    let committed = checkpoint::commit(&env.pool, &step).await?;
    Ok(committed != checkpoint::Committed::Duplicate)
}

/// Outbox and parked rows in the store.
async fn written_by_commits(env: &TestEnv) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM trailmark.outbox), (SELECT count(*) FROM trailmark.parked)",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_with_an_older_fence_is_refused_and_changes_nothing() {
    let env = TestEnv::new().await;
    let run_id = env.insert_chain_run("r-fence").await;
    // Worker A claims with a lease that expires at once; worker B takes over.
    let a = claim(&env, &run_id, "worker-a", 0.0).await;
    let b = claim(&env, &run_id, "worker-b", 30.0).await;
    assert!(b.fence > a.fence);
    assert_eq!(
        (a.attempt, b.attempt),
        (1, 2),
        "each claim counts an attempt"
    );
    let message = MessageId::new();
    let stale = commit_first_step(&env, &run_id, a.fence, message).await;
    assert!(
        matches!(stale, Err(store::Error::FencedOut { .. })),
        "{stale:?}"
    );
    let run = runs::get(&env.pool, "r-fence").await.unwrap().unwrap();
    assert_eq!(run.step_seq, 0, "stale commit moved the run");
    // The inbox row is written in the same statement: it must not survive the refusal, or the
    // current worker's delivery of the same message would be dropped as a duplicate.
    let inbox = env
        .scalar(
            "SELECT count(*) FROM trailmark.inbox WHERE message_id::text = $1",
            &message.to_string(),
        )
        .await;
    assert_eq!(inbox, 0, "a refused commit left its inbox row");
    assert_eq!(
        written_by_commits(&env).await,
        (0, 0),
        "a refused commit left outbox or parked rows"
    );
    let key = IdempotencyKey::parse("r-fence:link:0").unwrap();
    let fenced = intent(&env, &run_id, &key, "h", a.fence).await;
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
        !runs::heartbeat(&env.pool, (&run_id, 0), a.fence, 30.0, None)
            .await
            .unwrap(),
        "stale heartbeat accepted"
    );
    assert!(
        commit_first_step(&env, &run_id, b.fence, message)
            .await
            .expect("current fence commits"),
        "the current worker's commit was taken for a duplicate"
    );
    let run = runs::get(&env.pool, "r-fence").await.unwrap().unwrap();
    assert_eq!(run.step_seq, 1);
    assert!(
        !commit_first_step(&env, &run_id, b.fence, message)
            .await
            .expect("a repeated commit is not an error"),
        "the same message committed twice"
    );
    assert_eq!(
        written_by_commits(&env).await,
        (1, 1),
        "a repeated commit wrote outbox or parked rows again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_key_with_a_different_request_is_a_conflict() {
    let env = TestEnv::new().await;
    let run_id = env.insert_chain_run("r-key").await;
    let claim = claim(&env, &run_id, "w", 30.0).await;
    let key = IdempotencyKey::parse("r-key:post:inv-1").unwrap();
    let first = intent(&env, &run_id, &key, "hash-a", claim.fence).await;
    assert!(matches!(
        first,
        Ok(IntentOutcome::Recorded(EffectState::New))
    ));
    let again = intent(&env, &run_id, &key, "hash-a", claim.fence).await;
    assert!(
        matches!(again, Ok(IntentOutcome::Recorded(EffectState::Unknown))),
        "same key, same request: outcome unknown, call again"
    );
    match intent(&env, &run_id, &key, "hash-b", claim.fence).await {
        Err(e @ store::Error::Conflict { .. }) => {
            assert!(e.to_string().contains("r-key:post:inv-1"), "{e}")
        }
        other => panic!("expected a conflict, got {:?}", other.map(|_| ())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_with_no_message_left_is_requeued_by_the_supervisor() {
    let env = TestEnv::new().await;
    let run_id = env.insert_chain_run("r-orphan").await;
    // A worker took the lease and vanished with its message (no step message is queued), and it
    // had no presence connection: only the lease's expiry tells that it is gone.
    let ghost = claim(&env, &run_id, "ghost", 0.0).await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.wait_status("r-orphan", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(engine.stats.lease_recoveries.load(Ordering::Relaxed), 1);
    let attempts = env.attempts("r-orphan", 0).await;
    assert_eq!(attempts, 2, "the ghost's claim and the re-queued step");
    let run = runs::get(&env.pool, "r-orphan").await.unwrap().unwrap();
    assert!(
        run.fence > ghost.fence.0 + 1,
        "the ghost's fence was not retired"
    );
    assert_eq!(env.chain_ledger("r-orphan").await, (1, 1));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_longer_than_its_lease_keeps_it_by_heartbeat_and_runs_once() {
    let env = TestEnv::new().await;
    let lease = env.settings.worker.lease_secs;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    // Twice the lease: without heartbeats the supervisor would re-queue the step meanwhile.
    let delay_ms = lease * 2 * 1000;
    env.start_run(
        "chain",
        "r-long",
        json!({"steps": 1, "step_delay_ms": delay_ms}),
    )
    .await;
    env.wait_status("r-long", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        env.attempts("r-long", 0).await,
        1,
        "the step was taken from its live worker"
    );
    assert_eq!(engine.stats.lease_recoveries.load(Ordering::Relaxed), 0);
    assert_eq!(engine.stats.handler_runs.load(Ordering::Relaxed), 1);
    running.stop().await;
}

/// The presence backend pid stored with the run's lease (`None` while there is no run or lease).
async fn lease_pid(env: &TestEnv, run_id: &str) -> Option<i32> {
    sqlx::query_scalar::<_, Option<i32>>("SELECT lease_pid FROM trailmark.runs WHERE run_id = $1")
        .bind(run_id)
        .fetch_optional(&env.pool)
        .await
        .expect("read lease")
        .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_worker_keeps_its_lease_after_its_presence_connection_is_reopened() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    // Long enough for the lost presence connection to be noticed (pinged every 5 s) and re-opened
    // while the step still runs.
    env.start_run(
        "chain",
        "r-presence",
        json!({"steps": 1, "step_delay_ms": 15_000}),
    )
    .await;
    env.wait_until("the step holds its lease", WAIT, || async {
        lease_pid(&env, "r-presence").await.is_some()
    })
    .await;
    let old_pid = lease_pid(&env, "r-presence").await.unwrap();
    // What a Postgres failover or an idle-connection killer does to the presence connection.
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(old_pid)
        .execute(&env.pool)
        .await
        .unwrap();
    env.wait_until("presence connection re-opened", WAIT, || async {
        let now = engine.presence_pid.load(Ordering::SeqCst);
        now != 0 && now != old_pid
    })
    .await;
    let new_pid = engine.presence_pid.load(Ordering::SeqCst);
    env.wait_until("a heartbeat names the new connection", WAIT, || async {
        lease_pid(&env, "r-presence").await == Some(new_pid)
    })
    .await;
    // Another worker with a fresh delivery of the same step must not get the run.
    let run_id = RunId::parse("r-presence").unwrap();
    let request = runs::ClaimRequest {
        version: 1,
        run_id: run_id.clone(),
        seq: 0,
        step: "link".into(),
        owner: "another-worker/1".into(),
        lease_secs: 30.0,
        presence_pid: None,
        message: ("steps", MessageId::new()),
        redelivered: false,
        unstarted_preclaim: false,
    };
    let outcome = runs::claim(&env.pool, &request).await.unwrap();
    assert!(
        matches!(outcome, runs::ClaimOutcome::Refused(runs::Refusal::Busy)),
        "a live worker's lease was taken: {outcome:?}"
    );
    env.wait_status("r-presence", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(env.chain_ledger("r-presence").await, (1, 1));
    assert_eq!(engine.stats.handler_runs.load(Ordering::Relaxed), 1);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_this_build_does_not_know_is_an_error_not_a_guess() {
    let env = TestEnv::new().await;
    env.insert_chain_run("r-future").await;
    // As a newer trailmark might write it.
    sqlx::query("UPDATE trailmark.runs SET status = 'paused' WHERE run_id = 'r-future'")
        .execute(&env.pool)
        .await
        .unwrap();
    let read = runs::get(&env.pool, "r-future").await;
    let e = read.expect_err("an unknown status was read as a known one");
    let shown = trailmark::error::Report(&e).to_string();
    assert!(shown.contains("unknown run status \"paused\""), "{shown}");
}

/// Sends one note to `exchange`, then goes on to a second step.
fn notifier(exchange: String) -> trailmark::workflow::Workflow {
    use trailmark::workflow::{StepKind, StepOutcome, Workflow};
    Workflow::new("notify", 1)
        .step("send", StepKind::Message, move |ctx| {
            let exchange = exchange.clone();
            async move {
                let key = IdempotencyKey::for_step(ctx.run_id(), "send", "note");
                ctx.send(&exchange, "note", &key, b"{\"note\":1}".to_vec());
                Ok(StepOutcome::next(json!({ "sent": true })))
            }
        })
        .step("after", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::finish(json!({ "done": true })))
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_to_a_missing_exchange_is_held_back_without_stopping_the_rest_then_sent() {
    let env = TestEnv::with(|s| s.relay.eager_grace_ms = 100).await;
    let exchange = format!("{}.mail-not-declared-yet", env.prefix);
    let mut registry = trailmark::workflow::Registry::new();
    registry.register(notifier(exchange.clone()));
    let engine = env.engine_with(registry, Failpoints::default());
    let running = env.spawn_all(engine);
    let ids = ["r-mail-1", "r-mail-2", "r-mail-3"];
    for id in ids {
        env.start_run("notify", id, json!({})).await;
    }
    // Each run's next step was published beside its note: the broker closing the channel over
    // the note must not take the step with it, nor stop the runs behind.
    for id in ids {
        env.wait_status(id, RunStatus::Succeeded, WAIT).await;
    }
    env.wait_until(
        "the notes held back with the broker's words",
        WAIT,
        || async {
            let held: Vec<String> = sqlx::query_scalar(
                "SELECT last_error FROM trailmark.outbox
              WHERE published_at IS NULL AND exchange = $1 AND last_error IS NOT NULL",
            )
            .bind(&exchange)
            .fetch_all(&env.pool)
            .await
            .unwrap();
            held.len() == 3 && held.iter().all(|e| e.contains("no exchange"))
        },
    )
    .await;

    // Once the exchange exists, each note is sent, once.
    let conn = trailmark::broker::connect(&env.settings.broker, "test-mail")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("{}.mail-inbox", env.prefix);
    ch.exchange_declare(
        exchange.as_str().into(),
        lapin::ExchangeKind::Direct,
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        queue.as_str().into(),
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "note".into(),
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    env.wait_until("the held-back notes published", WAIT, || async {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trailmark.outbox WHERE published_at IS NULL")
                .fetch_one(&env.pool)
                .await
                .unwrap();
        left == 0
    })
    .await;
    let mut keys = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.as_str().into(), Default::default())
        .await
        .unwrap()
    {
        let headers = m.delivery.properties.headers().clone().unwrap_or_default();
        let key = headers
            .inner()
            .get("x-idempotency-key")
            .map(|v| format!("{v:?}"));
        keys.push(key.unwrap_or_default());
    }
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 3, "one note per run: {keys:?}");
    running.stop().await;
    let _ = ch
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    let _ = ch
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
}

/// A quorum queue `<prefix>.<name>` bound to the steps exchange under the routing key `full`,
/// which holds one message and nacks every publish beyond it; with a connection, a confirming
/// publisher and a channel on it.
async fn full_queue(
    env: &TestEnv,
    name: &str,
) -> (
    std::sync::Arc<lapin::Connection>,
    trailmark::broker::Publisher,
    lapin::Channel,
    String,
) {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let conn = trailmark::broker::connect(&env.settings.broker, &format!("test-{name}"))
        .await
        .unwrap();
    let publisher = trailmark::broker::Publisher::open(&conn, Duration::from_secs(10))
        .await
        .unwrap();
    let full = format!("{}.{name}", env.prefix);
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(full.as_str().into(), durable, args)
        .await
        .unwrap();
    ch.queue_bind(
        full.as_str().into(),
        env.topology().steps_exchange().into(),
        "full".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    (conn, publisher, ch, full)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_nacked_again_and_again_reopens_its_channel_and_never_counts_a_nack_as_sent() {
    use lapin::options::QueueDeleteOptions;
    use lapin::types::FieldTable;
    let env = TestEnv::new().await;
    let (conn, publisher, ch, full) = full_queue(&env, "full").await;
    let msg = |i: usize, key: &str| Outgoing {
        message_id: format!("nack-{i}"),
        exchange: env.topology().steps_exchange(),
        routing_key: key.into(),
        headers: FieldTable::default(),
        body: b"{}".to_vec(),
    };
    let first = publisher.channel();
    // A quorum queue applies its limit once it is over it: fill it until the first nack.
    let mut accepted = 0;
    while publisher
        .publish(&msg(100 + accepted, "full"))
        .await
        .is_ok()
    {
        accepted += 1;
        assert!(accepted < 10, "the full queue kept taking messages");
    }
    // That nack was the first in a row; 19 more make 20.
    for i in 0..19 {
        let r = publisher.publish(&msg(i, "full")).await;
        assert!(r.is_err(), "a nacked publish is an error: {r:?}");
    }
    assert!(
        !first.status().connected(),
        "the channel was closed after 20 nacks in a row"
    );
    // The next publish opens a fresh channel and goes through (to the step queue).
    publisher
        .publish(&msg(20, trailmark::domain::STEP_ROUTING_KEY))
        .await
        .expect("a fresh channel publishes");
    let _ = ch
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_the_broker_nacks_is_tried_again_at_once_never_held_back() {
    use lapin::options::QueueDeleteOptions;
    use lapin::types::FieldTable;
    let env = TestEnv::new().await;
    let engine = env.engine();
    let (conn, publisher, ch, full) = full_queue(&env, "full-relay").await;
    let filler = |i: usize| Outgoing {
        message_id: format!("filler-{i}"),
        exchange: env.topology().steps_exchange(),
        routing_key: "full".into(),
        headers: FieldTable::default(),
        body: b"{}".to_vec(),
    };
    let mut accepted = 0;
    while publisher.publish(&filler(accepted)).await.is_ok() {
        accepted += 1;
        assert!(accepted < 10, "the full queue kept taking messages");
    }
    // The row a worker committed for that queue.
    let message_id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO trailmark.outbox (message_id, exchange, routing_key, headers, body)
         VALUES ($1, $2, 'full', '{}'::jsonb, '{}'::bytea)",
    )
    .bind(message_id)
    .bind(env.topology().steps_exchange())
    .execute(&env.pool)
    .await
    .unwrap();

    // Nacked: the batch fails as when the broker is gone (the relay reconnects), and the row
    // stays due, with no error of its own that would hold it back for minutes.
    let nacked = trailmark::relay::drain_batch(&engine, &publisher).await;
    assert!(nacked.is_err(), "a nacked row fails its batch: {nacked:?}");
    let (published, due, last_error): (bool, bool, Option<String>) = sqlx::query_as(
        "SELECT published_at IS NOT NULL, available_at <= now(), last_error
           FROM trailmark.outbox WHERE message_id = $1",
    )
    .bind(message_id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(!published, "a nacked row is never counted as published");
    assert!(due && last_error.is_none(), "not held back: {last_error:?}");

    // Once the queue has room, the next batch publishes it.
    ch.queue_purge(full.as_str().into(), Default::default())
        .await
        .unwrap();
    let publisher = trailmark::broker::Publisher::open(&conn, Duration::from_secs(10))
        .await
        .unwrap();
    let sent = trailmark::relay::drain_batch(&engine, &publisher)
        .await
        .expect("published once the queue has room");
    assert_eq!(sent, 1);
    let got = ch
        .basic_get(full.as_str().into(), Default::default())
        .await
        .unwrap()
        .expect("the row's message is in the queue");
    assert_eq!(
        got.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string()),
        Some(message_id.to_string())
    );
    let _ = ch
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_steps_hold_every_pooled_connection_keeps_its_leases() {
    // Steps blocked with every pooled connection of their worker (here: on a lock; in the field:
    // a slow server, a burst of runs) must not lose their leases to the supervisor: the leases
    // are renewed on the worker's presence connection, which the steps cannot hold.
    let env = TestEnv::new().await;
    let mut settings = env.settings.clone();
    settings.database.max_connections = 2;
    settings.worker.concurrency = 4;
    let pool = store::connect(&settings.database)
        .await
        .expect("worker pool");
    let reg = trailmark_reference::registry();
    let worker = Engine::with_pool(settings, reg, Failpoints::default(), pool).expect("engine");
    let only = |worker, relay, supervisor| Components {
        worker,
        relay,
        supervisor,
    };
    let rest = env.engine();
    let relay_supervisor = env.spawn(rest.clone(), only(false, true, true));
    let mut lock = env.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE trailmark.chain_ledger IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let running = env.spawn(worker.clone(), only(true, false, false));
    let runs = ["r-pool-0", "r-pool-1", "r-pool-2", "r-pool-3"];
    for id in runs {
        env.start_run("chain", id, json!({"steps": 1})).await;
    }
    env.wait_until(
        "both pooled connections wait on the ledger",
        WAIT,
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&env.pool)
            .await
            .unwrap()
                == 2
        },
    )
    .await;
    // The scenario itself: held for three leases, each of which a starved heartbeat would lose.
    tokio::time::sleep(Duration::from_secs(3 * env.settings.worker.lease_secs)).await;
    lock.rollback().await.unwrap();
    for id in runs {
        env.wait_status(id, RunStatus::Succeeded, WAIT).await;
        assert_eq!(env.attempts(id, 0).await, 1, "{id}'s step was taken over");
        assert_eq!(env.chain_ledger(id).await, (1, 1), "{id}'s ledger");
    }
    assert_eq!(rest.stats.lease_recoveries.load(Ordering::Relaxed), 0);
    running.stop().await;
    relay_supervisor.stop().await;
}

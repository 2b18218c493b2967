//! Real process crashes: `kill -9` from outside, and a failpoint that makes the process SIGKILL
//! itself at a named spot. A new process must finish the run without repeating finished work.

mod common;
mod dlq_support;

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
    assert_eq!(
        env.attempts(run_id, 99).await,
        2,
        "the interrupted step ran again"
    );
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
async fn killed_after_a_commit_before_publishing_the_relay_delivers_the_next_step_at_once() {
    let env = TestEnv::new().await;
    // A grace far beyond the test's patience: the relay may take the unpublished row only
    // because its committer's presence connection is gone, not because the grace ran out.
    let grace = [("TRAILMARK__RELAY__EAGER_GRACE_MS", "3600000".to_owned())];
    // Step 50 commits, then its worker dies before it publishes step 51 and acks step 50.
    let mut first = env.spawn_process_with(Some("step.after_commit=kill@50"), &grace);
    env.start_run("chain", "r-unpublished", json!({"steps": 100}))
        .await;
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert_eq!(env.steps_done("r-unpublished").await, 50);
    let _second = env.spawn_process_with(None, &grace);
    env.wait_status("r-unpublished", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(env.chain_ledger("r-unpublished").await, (100, 100));
    // Step 51 was pre-claimed by step 50's commit for the worker that died, which never got
    // its message: the claim that took that idle lease from a dead holder, finding no trace of
    // the step under its fence (no effect, no journal entry), counted no second attempt. No
    // step ran twice: every write is the first under its key.
    assert_eq!(
        attempts(&env, "r-unpublished").await,
        (100, 0),
        "(claims, positions claimed twice)"
    );
    assert_eq!(env.attempts("r-unpublished", 50).await, 1);
    let repeated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.effects
          WHERE run_id = 'r-unpublished' AND (result->>'created')::boolean IS NOT TRUE",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        repeated, 0,
        "writes that found their ledger row already there"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_frozen_past_its_lease_cannot_write_when_it_wakes() {
    let env = TestEnv::new().await;
    let (frozen, lines) = serve_logged(&env);

    env.start_run(
        "chain",
        "r-frozen",
        json!({"steps": 3, "step_delay_ms": 2500}),
    )
    .await;
    // Inside the step: its heartbeat (every second here) has stamped the lease with an expiry
    // (a pre-claim's idle lease has none until then).
    env.wait_until("the first worker inside step 2", WAIT, || async {
        let run = trailmark::store::runs::get(&env.pool, "r-frozen")
            .await
            .unwrap();
        run.is_some_and(|r| {
            r.step_seq == 1 && r.lease_owner.is_some() && r.lease_expires_at.is_some()
        })
    })
    .await;
    frozen.signal(libc::SIGSTOP);
    let _second = env.spawn_process(None);
    env.wait_status("r-frozen", RunStatus::Succeeded, WAIT)
        .await;
    frozen.signal(libc::SIGCONT);

    // The woken worker must notice it was fenced out, by heartbeat, effect or commit.
    let deadline = std::time::Instant::now() + WAIT;
    let refusal = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.contains("lease lost") || l.contains("fenced out") => break l,
            Ok(_) => continue,
            Err(e) => panic!("the woken worker never reported being fenced out: {e}"),
        }
    };
    assert!(refusal.contains("r-frozen"), "{refusal}");
    assert_eq!(env.chain_ledger("r-frozen").await, (3, 3));
    let seq1 = env.attempts("r-frozen", 1).await;
    assert_eq!(seq1, 2, "the second worker re-ran the frozen step");
    let run = trailmark::store::runs::get(&env.pool, "r-frozen")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (run.status, run.step_seq),
        (RunStatus::Succeeded, 3),
        "the stale worker changed the run"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_lease_is_taken_over_at_once_by_a_live_worker() {
    let mut env = TestEnv::new().await;
    // A long lease: recovery must not wait for it to expire.
    env.settings.worker.lease_secs = 60;
    env.settings.worker.heartbeat_secs = 5;
    // Every lease a claim statement takes: a step started on a pre-claim holds an idle lease
    // (no expiry) until its first heartbeat, which any claim takes whether its holder lives or
    // not (tests/group_commit.rs); this test is about the lease a living worker keeps.
    env.settings.worker.preclaim = false;
    let mut workers = [env.spawn_process(None), env.spawn_process(None)];
    env.start_run(
        "chain",
        "r-takeover",
        json!({"steps": 40, "step_delay_ms": 300}),
    )
    .await;
    // Both frozen while the holder is read: a loaded machine could otherwise let the holder
    // commit its step between the read and the kill, and no takeover would happen.
    // Each look freezes both workers, so the lease read is the one they hold while frozen.
    let found = common::eventually("ten steps done and one in flight", WAIT, || async {
        workers.iter().for_each(|w| w.signal(libc::SIGSTOP));
        let run = trailmark::store::runs::get(&env.pool, "r-takeover")
            .await
            .unwrap();
        match run {
            Some(r) if r.step_seq >= 10 && r.lease_owner.is_some() => Some(r),
            _ => {
                workers.iter().for_each(|w| w.signal(libc::SIGCONT));
                None
            }
        }
    })
    .await;
    let run =
        found.unwrap_or_else(|| panic!("ten steps done and one in flight: not within {WAIT:?}"));
    let holder = trailmark::engine::lease_owner_pid(run.lease_owner.as_deref().unwrap())
        .expect("a lease owner names its process");
    let victim = workers
        .iter_mut()
        .find(|w| w.pid() == holder)
        .expect("the lease holder is one of ours");
    victim.kill9();
    workers.iter().for_each(|w| {
        if w.0.is_some() {
            w.signal(libc::SIGCONT)
        }
    });
    let expiry = run.lease_expires_at.unwrap();
    env.wait_status("r-takeover", RunStatus::Succeeded, WAIT)
        .await;
    let taken_over: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT finished_at FROM trailmark.steps WHERE run_id = 'r-takeover' AND seq = $1",
    )
    .bind(run.step_seq)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        taken_over < expiry - chrono::Duration::seconds(30),
        "step {} finished at {taken_over}, its dead holder's lease ran to {expiry}",
        run.step_seq
    );
    // The step the victim held when it died ran again: a takeover happened, not a commit just
    // before the kill.
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM trailmark.steps WHERE run_id = 'r-takeover' AND seq = $1",
    )
    .bind(run.step_seq)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2, "step {} was not taken over", run.step_seq);
    assert_eq!(env.chain_ledger("r-takeover").await, (40, 40));
}

/// `trailmark serve` with its WARN and INFO lines read on a thread, one per message.
fn serve_logged(env: &TestEnv) -> (common::ChildGuard, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    let mut cmd = env.command(&["serve"]);
    cmd.env("RUST_LOG", "warn,trailmark=info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = common::ChildGuard(Some(cmd.spawn().unwrap()));
    let stderr = child.0.as_mut().unwrap().stderr.take().unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .for_each(|l| drop(lines_tx.send(l)))
    });
    (child, lines)
}

/// Whether the process is stopped (SIGSTOP), from its state in /proc.
fn stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    stat.rsplit_once(") ")
        .is_some_and(|(_, rest)| rest.starts_with('T'))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_holds_no_run_past_about_a_lease_and_its_late_writes_are_refused() {
    // RabbitMQ must not be what frees the frozen worker's messages: its heartbeat would close
    // the connection only after about twenty minutes.
    let env = TestEnv::with(|s| s.broker.heartbeat_secs = 600).await;
    let (runs, steps, delay_ms) = (12, 8, 1500u64);
    let mut workers = [serve_logged(&env), serve_logged(&env)];
    let ids: Vec<String> = (0..runs).map(|i| format!("r-frozen-{i}")).collect();
    for id in &ids {
        env.start_run(
            "chain",
            id,
            json!({"steps": steps, "step_delay_ms": delay_ms}),
        )
        .await;
    }
    // Both frozen while the leases are read; the holder of a lease its heartbeat has stamped
    // (a step under way) stays frozen, the other goes on.
    let held = common::eventually("a step under way with its lease stamped", WAIT, || async {
        workers.iter().for_each(|(w, _)| w.signal(libc::SIGSTOP));
        let rows: Vec<(String, i32, String)> = sqlx::query_as(
            "SELECT run_id, step_seq, lease_owner FROM trailmark.runs
              WHERE lease_expires_at IS NOT NULL AND step_seq >= 1 ORDER BY run_id LIMIT 1",
        )
        .fetch_all(&env.pool)
        .await
        .unwrap();
        let found = rows.into_iter().next();
        if found.is_none() {
            workers.iter().for_each(|(w, _)| w.signal(libc::SIGCONT));
        }
        found
    })
    .await
    .expect("a step under way");
    let (held_run, held_seq, owner) = held;
    let holder = trailmark::engine::lease_owner_pid(&owner).expect("an owner names its process");
    let frozen = workers
        .iter()
        .position(|(w, _)| w.pid() == holder)
        .expect("the holder is one of ours");
    // Every run the frozen worker holds a lease of (stamped, or idle on a pre-claim).
    let owners: Vec<(String, String)> = sqlx::query_as(
        "SELECT run_id, lease_owner FROM trailmark.runs WHERE lease_owner IS NOT NULL",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let frozen_held: Vec<String> = owners
        .into_iter()
        .filter(|(_, o)| trailmark::engine::lease_owner_pid(o) == Some(holder))
        .map(|(run, _)| run)
        .collect();
    workers[1 - frozen].0.signal(libc::SIGCONT);

    // Every run finishes while the frozen worker is still stopped: within the work left and a
    // few leases (its lease must expire; the runs whose next message it took must be noticed).
    let lease = Duration::from_secs(env.settings.worker.lease_secs);
    let bound = Duration::from_millis(steps as u64 * delay_ms) + lease * 10;
    let started = std::time::Instant::now();
    env.wait_until("every run succeeded", bound, || async {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id = ANY($1) AND status = 'succeeded'",
        )
        .bind(&ids)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        done == runs as i64
    })
    .await;
    let pid = workers[frozen].0.pid();
    assert!(
        stopped(pid),
        "the frozen worker {pid} was woken before the runs ended ({:?} after the freeze)",
        started.elapsed()
    );
    let before: Vec<(String, i64, i32, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT run_id, fence, step_seq, updated_at FROM trailmark.runs WHERE run_id = ANY($1) ORDER BY run_id",
    )
    .bind(&ids)
    .fetch_all(&env.pool)
    .await
    .unwrap();

    // Woken, it finds its step's lease gone: whatever it tries to write is refused.
    workers[frozen].0.signal(libc::SIGCONT);
    let deadline = std::time::Instant::now() + WAIT;
    let refusal = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match workers[frozen].1.recv_timeout(left) {
            Ok(l) if l.contains("lease lost") || l.contains("fenced out") => break l,
            Ok(_) => continue,
            Err(e) => panic!("the woken worker never reported being fenced out: {e}"),
        }
    };
    assert!(
        frozen_held
            .iter()
            .any(|run| refusal.contains(&format!("run.id={run} "))),
        "{refusal} names none of {frozen_held:?}"
    );
    assert_eq!(
        env.attempts(&held_run, held_seq).await,
        2,
        "the frozen worker's step was taken over once"
    );
    // It stops, handing back what it still held; the other drops those messages as stale.
    workers[frozen].0.signal(libc::SIGTERM);
    assert!(
        common::wait_exit(&mut workers[frozen].0, WAIT)
            .await
            .is_some(),
        "the woken worker did not stop on SIGTERM"
    );
    let t = env.topology();
    for queue in [t.steps_queue(), t.run_start_queue()] {
        env.wait_until(&format!("{queue} empty"), WAIT, || async {
            dlq_support::depth(&env, &queue).await == 0
        })
        .await;
    }
    for id in &ids {
        assert_eq!(env.chain_ledger(id).await, (steps, steps), "ledger of {id}");
        assert_eq!(env.steps_done(id).await, steps, "positions of {id}");
    }
    let after: Vec<(String, i64, i32, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT run_id, fence, step_seq, updated_at FROM trailmark.runs WHERE run_id = ANY($1) ORDER BY run_id",
    )
    .bind(&ids)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(before, after, "the woken worker changed a finished run");
}

/// The frozen-worker sweep takes only runs a worker here can execute: a run of a workflow not
/// deployed here, or of a newer version, is neither re-queued nor marked, so no sweeper skips it
/// for a lease (a worker that can run it takes it on its next round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stranded_sweep_takes_and_marks_only_runs_of_workflows_deployed_here() {
    use trailmark::store::{runs, stranded};
    let env = TestEnv::new().await;
    let first: trailmark::domain::StepAddress = "a".into();
    for (run, workflow, version) in [
        ("r-here", "chain", 1),
        ("r-newer", "chain", 2),
        ("r-other", "elsewhere", 1),
    ] {
        let run_id = trailmark::domain::RunId::parse(run).unwrap();
        let new = runs::NewRun {
            run_id: &run_id,
            workflow,
            version,
            first_step: &first,
            input: &json!({}),
            parent: None,
            traceparent: None,
            flow_key: None,
            priority: 2,
        };
        assert!(runs::insert(&env.pool, &new).await.unwrap());
    }
    sqlx::query("UPDATE trailmark.runs SET updated_at = now() - interval '1 hour'")
        .execute(&env.pool)
        .await
        .unwrap();
    let deployed = (vec!["chain".to_owned()], vec![1]);
    let taken = stranded::take_stranded(&env.pool, 60.0, 10, &deployed)
        .await
        .unwrap();
    let taken: Vec<&str> = taken.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(taken, ["r-here"]);
    let marked: Vec<String> = sqlx::query_scalar(
        "SELECT run_id FROM trailmark.runs WHERE updated_at > now() - interval '1 minute' ORDER BY run_id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(marked, ["r-here"], "only the run taken is marked");
}

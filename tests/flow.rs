//! Concurrency keys against the real servers: a tenant's limit holds across processes and a
//! kill -9, frees no slot late and strands no run; a raised limit applies within seconds; the
//! line is served by priority with aging; a key's rate holds; bad limits and keys are refused.

mod common;

use std::time::{Duration, Instant};

use common::{TestEnv, assert_each_refused, text};
use serde_json::json;
use trailmark::domain::RunStatus;
use trailmark::store::flow;

/// Runs of `key` holding a step now, as the runs table shows them: a live lease (a living
/// holder, not expired). Independent of the slot rows the gate keeps.
async fn running(env: &TestEnv, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.runs
          WHERE workflow = 'chain' AND flow_key = $1 AND lease_owner IS NOT NULL
            AND (lease_expires_at IS NULL OR lease_expires_at > now())
            AND NOT trailmark.process_gone(lease_pid)",
    )
    .bind(key)
    .fetch_one(&env.pool)
    .await
    .expect("count running")
}

async fn succeeded(env: &TestEnv, prefix: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE $1 || '%' AND status = 'succeeded'",
    )
    .bind(prefix)
    .fetch_one(&env.pool)
    .await
    .expect("count succeeded")
}

fn limit(env: &TestEnv, args: &[&str]) {
    let mut all = vec!["limit", "set", "chain"];
    all.extend_from_slice(args);
    let out = env.command(&all).output().expect("run trailmark limit set");
    let (said, err) = text(&out);
    assert!(out.status.success(), "limit set {args:?}: {err}");
    assert!(said.contains("chain key"), "{said}");
}

async fn start(env: &TestEnv, ids: impl Iterator<Item = String>, input: serde_json::Value) {
    let topology = env.topology();
    let events: Vec<_> = ids
        .map(|id| {
            let event = trailmark::domain::RunStartEvent::new(
                trailmark::domain::RunId::parse(&id).unwrap(),
                "chain",
                input.clone(),
            );
            topology.run_start(&event)
        })
        .collect();
    env.publish_all(&events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_limit_holds_across_two_processes_and_a_kill_and_strands_nothing() {
    let env = TestEnv::new().await;
    limit(&env, &["--concurrency", "2", "--key", "a"]);
    let mut first = env.spawn_process(None);
    let _second = env.spawn_process(None);
    let a = json!({"tenant": "a", "steps": 4, "step_delay_ms": 60});
    start(&env, (0..40).map(|i| format!("fa-{i:02}")), a).await;
    start(
        &env,
        (0..4).map(|i| format!("fb-{i}")),
        json!({"tenant": "b", "steps": 4, "step_delay_ms": 60}),
    )
    .await;
    let (mut most, mut killed_at, mut back_to_two) = (0, None::<Instant>, None::<Duration>);
    let mut after_kill = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    while succeeded(&env, "fa-").await < 40 {
        assert!(Instant::now() < deadline, "a's runs did not all finish");
        let now = running(&env, "a").await;
        most = most.max(now);
        assert!(
            now <= 2,
            "tenant a had {now} runs holding a step at once; its limit is 2"
        );
        let done = succeeded(&env, "fa-").await;
        if killed_at.is_none() && done >= 5 {
            first.kill9();
            killed_at = Some(Instant::now());
        }
        if let (Some(at), None) = (killed_at, back_to_two) {
            after_kill.push((at.elapsed().as_millis(), now));
            if now == 2 {
                back_to_two = Some(at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(most, 2, "the limit was reached");
    let back = back_to_two.expect("a's running count came back to 2 after the kill");
    // A slot is a lease: free when the killed process's lease (3 s in tests) ends; the
    // supervisor's loop then hands it on.
    assert!(
        back < Duration::from_secs(3 + 2),
        "a's slots came back after {back:?} (ms after the kill, running): {after_kill:?}"
    );
    assert_eq!(succeeded(&env, "fb-").await, 4);
    // b's runs, started after a's 40, finished before a's fifth did.
    let (b_last, a_fifth): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT max(finished_at) FROM trailmark.runs WHERE run_id LIKE 'fb-%'),
                (SELECT finished_at FROM trailmark.runs WHERE run_id LIKE 'fa-%' ORDER BY finished_at OFFSET 4 LIMIT 1)",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        b_last < a_fifth,
        "b's last run ended {b_last}, a's fifth {a_fifth}"
    );
    // Nothing written twice, nothing left waiting.
    let (rows, refs): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((rows, refs), (44 * 4, 44 * 4));
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.flow_waiters")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(waiting, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_raised_at_run_time_applies_within_seconds() {
    let env = TestEnv::new().await;
    limit(&env, &["--concurrency", "2", "--key", "c"]);
    let _serve = env.spawn_process(None);
    start(
        &env,
        (0..30).map(|i| format!("fc-{i:02}")),
        json!({"tenant": "c", "steps": 6, "step_delay_ms": 150}),
    )
    .await;
    env.wait_until(
        "tenant c to use its 2 slots with runs in line",
        Duration::from_secs(30),
        || async {
            let waiting: i64 =
                sqlx::query_scalar("SELECT count(*) FROM trailmark.flow_waiters WHERE key = 'c'")
                    .fetch_one(&env.pool)
                    .await
                    .unwrap();
            running(&env, "c").await == 2 && waiting > 0
        },
    )
    .await;
    // A waiter read here may get its slot before `run show` reads it (a holder finishes in
    // between), so the check takes the next waiter until one is shown while still waiting.
    let shown = std::sync::Mutex::new(String::new());
    env.wait_until(
        "`run show` of a run in line to say it waits for a slot",
        Duration::from_secs(30),
        || async {
            let waiter: Option<String> = sqlx::query_scalar(
                "SELECT run_id FROM trailmark.flow_waiters WHERE key = 'c' ORDER BY random() LIMIT 1",
            )
            .fetch_optional(&env.pool)
            .await
            .unwrap();
            let Some(waiter) = waiter else { return false };
            let out = env.command(&["run", "show", &waiter]).output().unwrap();
            let (said, _) = text(&out);
            let waits = said.contains("waits for a slot of key c (");
            *shown.lock().unwrap() = said;
            waits
        },
    )
    .await;
    let said = shown.into_inner().unwrap();
    assert!(said.contains("concurrency key c  priority 2"), "{said}");
    limit(&env, &["--concurrency", "5", "--key", "c"]);
    let raised = Instant::now();
    let mut most = 0;
    while most < 5 {
        assert!(
            raised.elapsed() < Duration::from_secs(5),
            "the raised limit was not used within 5 s (at most {most} running)"
        );
        let now = running(&env, "c").await;
        assert!(now <= 5, "{now} runs of c held a step; the limit is 5");
        most = most.max(now);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.wait_until(
        "every run of c to succeed",
        Duration::from_secs(120),
        || async { succeeded(&env, "fc-").await == 30 },
    )
    .await;
}

#[tokio::test]
async fn the_line_is_served_by_priority_and_a_long_wait_lifts_a_low_one() {
    let env = TestEnv::new().await;
    // Five runs waiting for a slot of key p, started a minute apart (the oldest first), with
    // priorities 0, 0, 4, 2, 4. Aging: a level per 60 s.
    let plan = [
        ("old-low", 0, 300),
        ("low", 0, 100),
        ("high", 4, 90),
        ("normal", 2, 60),
        ("new-high", 4, 0),
    ];
    for (id, priority, age_secs) in plan {
        env.insert_chain_run(id).await;
        sqlx::query("UPDATE trailmark.runs SET flow_key = 'p', priority = $2, created_at = now() - make_interval(secs => $3) WHERE run_id = $1")
            .bind(id)
            .bind(priority as i16)
            .bind(age_secs as f64)
            .execute(&env.pool)
            .await
            .unwrap();
        let mut tx = env.pool.begin().await.unwrap();
        let waiter = flow::NewWaiter {
            run_id: id,
            seq: 0,
            at: ("chain", "p"),
            priority: priority as i16,
            reason: "slot",
            after_secs: 0.0,
            aging_secs: 60.0,
        };
        flow::wait_all(&mut tx, &[waiter]).await.unwrap();
        tx.commit().await.unwrap();
    }
    let mut order = Vec::new();
    for _ in plan {
        let mut tx = env.pool.begin().await.unwrap();
        let handed = flow::hand(&mut tx, ("chain", "p"), 1, 30.0).await.unwrap();
        tx.commit().await.unwrap();
        order.extend(handed.into_iter().map(|r| r.run_id));
    }
    // Ranks (start time moved 60 s earlier per level): high -330, new-high -240, normal -180,
    // old-low -300... so old-low, which waited 300 s, goes before new-high and normal.
    assert_eq!(order, ["high", "old-low", "new-high", "normal", "low"]);
    let slots: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.flow_slots WHERE reserved_until > now()",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(slots, 5, "each handed run has a slot reserved for it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_rate_spaces_its_step_starts() {
    let env = TestEnv::new().await;
    limit(&env, &["--rate", "4", "--key", "r"]);
    let _serve = env.spawn_process(None);
    start(
        &env,
        (0..16).map(|i| format!("fr-{i:02}")),
        json!({"tenant": "r", "steps": 1}),
    )
    .await;
    env.wait_until(
        "every run of r to succeed",
        Duration::from_secs(60),
        || async { succeeded(&env, "fr-").await == 16 },
    )
    .await;
    let starts: Vec<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT started_at FROM trailmark.steps WHERE run_id LIKE 'fr-%' ORDER BY started_at",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(starts.len(), 16);
    // A bucket of 4 tokens a second, full at first: start k (from 0) is at least (k - 4) / 4 s
    // after the first (a tenth of a second allowed for clocks).
    for (k, at) in starts.iter().enumerate().skip(4) {
        let after = (*at - starts[0]).num_milliseconds();
        let least = (k as i64 - 4) * 250 - 100;
        assert!(
            after >= least,
            "step start {k} came {after} ms after the first; the rate allows it at {least} ms"
        );
    }
}

#[tokio::test]
async fn bad_limits_keys_and_priorities_are_refused_naming_the_field() {
    let env = TestEnv::new().await;
    assert_each_refused(
        &env,
        &[
            (
                &["limit", "set", "chain", "--concurrency", "0"],
                "concurrency: 0 is not a limit",
            ),
            (
                &["limit", "set", "chain", "--rate", "1000000"],
                "rate: 1000000 step starts a second cannot be met",
            ),
            (
                &["limit", "set", "chain", "--key", "a", "--total", "3"],
                "total: a total limit is the whole workflow's",
            ),
            (&["limit", "set", "chain"], "nothing to change"),
            (
                &["limit", "set", "nosuch", "--concurrency", "2"],
                "no workflow nosuch is deployed here",
            ),
            (
                &[
                    "run",
                    "start",
                    "chain",
                    "--run-id",
                    "bad-key",
                    "--input",
                    r#"{"tenant": ""}"#,
                ],
                "the input's field tenant is 0 bytes",
            ),
        ],
    );
    let long = format!(r#"{{"tenant": "{}"}}"#, "t".repeat(129));
    assert_each_refused(
        &env,
        &[(
            &[
                "run", "start", "chain", "--run-id", "long-key", "--input", &long,
            ],
            "the input's field tenant is 129 bytes; a key must be 1 to 128 bytes",
        )],
    );
    let out = env
        .command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            "bad-priority",
            "--priority",
            "9",
        ])
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("priority 9 is outside its levels"), "{err}");
    let listed = env.command(&["limit", "list", "--json"]).output().unwrap();
    let (said, _) = text(&listed);
    let listed: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(listed["limits"][0]["workflow"], "chain", "{listed}");
    assert_eq!(
        listed["limits"].as_array().unwrap().len(),
        1,
        "nothing was set: {listed}"
    );
    let _ = RunStatus::Running;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_of_deliveries_takes_only_the_free_slots_the_highest_priority_first() {
    use trailmark::domain::{MessageId, RunId};
    use trailmark::flow::{Concurrency, gate};
    use trailmark::store::runs;
    let env = TestEnv::new().await;
    let ids = ["held", "b-1", "b-2", "b-3", "b-4", "urgent"];
    for id in ids {
        env.insert_chain_run(id).await;
        sqlx::query("UPDATE trailmark.runs SET flow_key = 'b', priority = $2 WHERE run_id = $1")
            .bind(id)
            .bind(if id == "urgent" { 4_i16 } else { 2 })
            .execute(&env.pool)
            .await
            .unwrap();
    }
    // A slot of b was handed to `held` (reserved for it): the key has 1 of its 3 in use.
    sqlx::query(
        "INSERT INTO trailmark.flow_slots (run_id, workflow, key, reserved_until)
         VALUES ('held', 'chain', 'b', now() + interval '30 seconds')",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let declared = Concurrency::per_key("tenant", 3).unwrap();
    // b-1's step delivered twice (a redelivery beside the first), in the same batch.
    let deliveries = ["held", "b-1", "b-2", "b-3", "b-4", "urgent", "b-1"];
    let asks: Vec<gate::Ask> = deliveries
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let run_id = RunId::parse(id).unwrap();
            let message_id = MessageId::new();
            gate::Ask {
                msg: TestEnv::chain_first_step(&run_id, message_id),
                declared: declared.clone(),
                request: runs::ClaimRequest {
                    version: 1,
                    run_id,
                    seq: 0,
                    step: "link".into(),
                    owner: format!("w-test/{id}/{n}"),
                    lease_secs: 30.0,
                    presence_pid: None,
                    message: ("steps", message_id),
                    redelivered: false,
                    unstarted_preclaim: false,
                },
                reserve_secs: 30.0,
                aging_secs: 60.0,
                publish: None,
            }
        })
        .collect();
    let replies = gate::claim_all(&env.pool, &env.topology(), &asks).await;
    let (mut claimed, mut busy, mut waiting) = (Vec::new(), Vec::new(), Vec::new());
    for (id, reply) in deliveries.iter().zip(replies) {
        match reply.unwrap().0 {
            Some((gate::Gated::Claimed(runs::ClaimOutcome::Claimed(_)), held)) => {
                assert_eq!(held.key, "b");
                claimed.push(*id);
            }
            Some((gate::Gated::Claimed(runs::ClaimOutcome::Refused(runs::Refusal::Busy)), _)) => {
                busy.push(*id);
            }
            Some((gate::Gated::Waits(line), _)) => {
                assert!(
                    line.contains("3 of 3 slots of key b are in use"),
                    "{id}: {line}"
                );
                waiting.push(*id);
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    // The reserved run claims on its own slot; the two free ones go to the urgent run, then
    // the first of the rest; the others wait in line, holding nothing. b-1's second delivery
    // claims on the slot its first took and finds the lease taken: no second slot, no wait.
    claimed.sort_unstable();
    assert_eq!(claimed, ["b-1", "held", "urgent"]);
    assert_eq!(busy, ["b-1"]);
    assert_eq!(waiting, ["b-2", "b-3", "b-4"]);
    let held: Vec<(String, bool)> = sqlx::query_as(
        "SELECT run_id, reserved_until IS NULL FROM trailmark.flow_slots ORDER BY run_id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let held_by_lease = |id: &str| (id.to_owned(), true);
    assert_eq!(
        held,
        [
            held_by_lease("b-1"),
            held_by_lease("held"),
            held_by_lease("urgent")
        ]
    );
    let line: Vec<String> =
        sqlx::query_scalar("SELECT run_id FROM trailmark.flow_waiters ORDER BY run_id")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(line, ["b-2", "b-3", "b-4"]);
}

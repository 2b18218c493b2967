//! Group commit against the real Postgres: claims, step commits and records (journal entries,
//! effect results) of several deliveries in one statement give each the outcome it would get
//! alone.

mod common;

use common::{TestEnv, first_step_commit};
use serde_json::json;
use trailmark::domain::{
    EffectIntent, EffectState, Fence, IdempotencyKey, IntentOutcome, JournalEntry, MessageId, RunId,
};
use trailmark::store::records::{self, Record};
use trailmark::store::{self, checkpoint, effects, runs};

fn request(run_id: &RunId, owner: &str, message: MessageId) -> runs::ClaimRequest {
    runs::ClaimRequest {
        version: 1,
        run_id: run_id.clone(),
        seq: 0,
        step: "link".into(),
        owner: owner.into(),
        lease_secs: 30.0,
        presence_pid: None,
        message: ("steps", message),
        redelivered: false,
        unstarted_preclaim: false,
    }
}

async fn claim(env: &TestEnv, run_id: &RunId, owner: &str, lease_secs: f64) -> Fence {
    let r = runs::ClaimRequest {
        version: 1,
        lease_secs,
        ..request(run_id, owner, MessageId::new())
    };
    match runs::claim(&env.pool, &r).await.unwrap() {
        runs::ClaimOutcome::Claimed(c) => c.fence,
        other => panic!("{owner} could not claim {run_id}: {other:?}"),
    }
}

/// Each commit's outcome as "the step went in" (`true`) or "committed before" (`false`).
fn committed(outcomes: Vec<store::Result<checkpoint::Committed>>) -> Vec<store::Result<bool>> {
    let went_in = |c: checkpoint::Committed| c != checkpoint::Committed::Duplicate;
    outcomes.into_iter().map(|o| o.map(went_in)).collect()
}

/// Sorted rows of `sql` (one text column).
async fn texts(env: &TestEnv, sql: &'static str) -> Vec<String> {
    let mut rows: Vec<String> = sqlx::query_scalar(sql).fetch_all(&env.pool).await.unwrap();
    rows.sort();
    rows
}

fn queued_ids(steps: &[&checkpoint::StepCommit]) -> Vec<String> {
    let mut ids: Vec<String> = steps
        .iter()
        .flat_map(|s| s.outbox.iter().map(|m| m.message_id.to_string()))
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_with_a_stale_step_commits_the_others_and_writes_nothing_for_it() {
    let env = TestEnv::new().await;
    let (a, b, c) = (
        env.insert_chain_run("r-a").await,
        env.insert_chain_run("r-b").await,
        env.insert_chain_run("r-c").await,
    );
    let fence_a = claim(&env, &a, "w-a", 30.0).await;
    // Worker 1 claims r-b with a lease that expires at once; worker 2 takes it over.
    let stale_b = claim(&env, &b, "w-b1", 0.0).await;
    let current_b = claim(&env, &b, "w-b2", 30.0).await;
    let fence_c = claim(&env, &c, "w-c", 30.0).await;
    let step_a = first_step_commit(&env, &a, fence_a, &["inv-a"], 1);
    let step_b_stale = first_step_commit(&env, &b, stale_b, &["inv-b"], 1);
    let step_c = first_step_commit(&env, &c, fence_c, &["inv-c1", "inv-c2"], 2);
    let group = [step_a.clone(), step_b_stale, step_c.clone()];

    let outcomes = committed(checkpoint::commit_all(&env.pool, &group).await);
    assert!(matches!(outcomes[0], Ok(true)), "{:?}", outcomes[0]);
    assert!(
        matches!(&outcomes[1], Err(store::Error::FencedOut { run_id, .. }) if run_id == "r-b"),
        "{:?}",
        outcomes[1]
    );
    assert!(matches!(outcomes[2], Ok(true)), "{:?}", outcomes[2]);
    let seqs = texts(&env, "SELECT run_id || '@' || step_seq FROM trailmark.runs").await;
    assert_eq!(seqs, ["r-a@1", "r-b@0", "r-c@1"]);
    // Each committed step's own rows, nothing of the refused one.
    assert_eq!(
        texts(&env, "SELECT message_id::text FROM trailmark.outbox").await,
        queued_ids(&[&step_a, &step_c])
    );
    assert_eq!(
        texts(&env, "SELECT run_id || '/' || item FROM trailmark.parked").await,
        ["r-a/inv-a", "r-c/inv-c1", "r-c/inv-c2"]
    );
    assert_eq!(
        texts(
            &env,
            "SELECT run_id || ':' || (output->>'link') FROM trailmark.steps WHERE output IS NOT NULL"
        )
        .await,
        ["r-a:r-a", "r-c:r-c"]
    );
    assert_eq!(
        texts(&env, "SELECT message_id::text FROM trailmark.inbox").await,
        {
            let mut ids = vec![step_a.inbox.1.to_string(), step_c.inbox.1.to_string()];
            ids.sort();
            ids
        },
        "the refused step's inbox row would drop the current worker's delivery as a duplicate"
    );

    // The same two messages again (redeliveries) with the current worker's step of r-b.
    let step_b = first_step_commit(&env, &b, current_b, &["inv-b"], 1);
    let again = [step_a.clone(), step_b.clone(), step_c.clone()];
    let outcomes = committed(checkpoint::commit_all(&env.pool, &again).await);
    assert!(
        matches!(
            (&outcomes[0], &outcomes[1], &outcomes[2]),
            (Ok(false), Ok(true), Ok(false))
        ),
        "{outcomes:?}"
    );
    assert_eq!(
        texts(&env, "SELECT message_id::text FROM trailmark.outbox").await,
        queued_ids(&[&step_a, &step_b, &step_c]),
        "a repeated commit queued its messages again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_in_one_group_take_each_run_once_and_drop_processed_messages() {
    let env = TestEnv::new().await;
    let (x, y, z) = (
        env.insert_chain_run("r-x").await,
        env.insert_chain_run("r-y").await,
        env.insert_chain_run("r-z").await,
    );
    let processed = MessageId::new();
    sqlx::query("INSERT INTO trailmark.inbox (consumer, message_id) VALUES ('steps', $1)")
        .bind(processed.0)
        .execute(&env.pool)
        .await
        .unwrap();
    // Two deliveries of r-x's step (a redelivery next to the original), one of r-y's, and one
    // of r-z's that was processed already.
    let group = [
        request(&x, "w-1", MessageId::new()),
        request(&x, "w-2", MessageId::new()),
        request(&y, "w-3", MessageId::new()),
        request(&z, "w-4", processed),
    ];
    let outcomes = runs::claim_all(&env.pool, &group).await;
    let won: Vec<&str> = group[..2]
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| matches!(o, Ok(runs::ClaimOutcome::Claimed(_))))
        .map(|(r, _)| r.owner.as_str())
        .collect();
    assert_eq!(won.len(), 1, "r-x claimed by {won:?}: {outcomes:?}");
    assert!(
        outcomes[..2]
            .iter()
            .any(|o| matches!(o, Ok(runs::ClaimOutcome::Refused(runs::Refusal::Busy)))),
        "{outcomes:?}"
    );
    assert!(
        matches!(&outcomes[2], Ok(runs::ClaimOutcome::Claimed(c)) if c.attempt == 1),
        "{:?}",
        outcomes[2]
    );
    assert!(
        matches!(outcomes[3], Ok(runs::ClaimOutcome::Duplicate)),
        "{:?}",
        outcomes[3]
    );
    let x_run = runs::get(&env.pool, "r-x").await.unwrap().unwrap();
    assert_eq!(x_run.lease_owner.as_deref(), Some(won[0]));
    assert_eq!(x_run.fence, 1, "r-x's fence was raised twice");
    assert_eq!(env.attempts("r-x", 0).await, 1, "one attempt counted twice");
    let z_run = runs::get(&env.pool, "r-z").await.unwrap().unwrap();
    assert_eq!(
        (z_run.fence, z_run.lease_owner),
        (0, None),
        "a processed message took a lease"
    );
}

fn intent(run_id: &RunId, key: &str, hash: &str, fence: Fence) -> EffectIntent {
    EffectIntent {
        key: IdempotencyKey::parse(key).unwrap(),
        tool: "ledger".into(),
        run_id: run_id.clone(),
        seq: 0,
        request_hash: hash.into(),
        fence,
        max_calls: 0,
        repeat_limit: 0,
    }
}

fn entry(call_no: i32, answer: &str) -> JournalEntry {
    JournalEntry {
        seq: 0,
        call_no,
        kind: "model".into(),
        request_hash: "h".into(),
        response: json!({ "content": answer }),
        tokens: 1,
        cost: 0.0,
        latency_ms: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_several_steps_go_in_together_and_a_call_journaled_twice_keeps_the_first() {
    let env = TestEnv::new().await;
    let (p, q) = (
        env.insert_chain_run("r-p").await,
        env.insert_chain_run("r-q").await,
    );
    let fence = claim(&env, &p, "w", 30.0).await;
    let key = IdempotencyKey::parse("r-p:link:0").unwrap();
    assert!(matches!(
        effects::begin(&env.pool, &intent(&p, "r-p:link:0", "h", fence)).await,
        Ok(IntentOutcome::Recorded(EffectState::New))
    ));
    let group = [
        Record::Journal(p.clone(), entry(0, "p0"), None),
        Record::Journal(q.clone(), entry(0, "q0"), None),
        Record::EffectResult(key.clone(), json!({ "posted": 1 })),
    ];
    let answers = records::write_all(&env.pool, &group).await;
    assert!(
        matches!(answers[..], [Ok(true), Ok(true), Ok(true)]),
        "{answers:?}"
    );
    // Two answers to the same call in one group (a stale worker next to the current one): the
    // first goes in, the second is told so, and the journal keeps one answer.
    let twice = [
        Record::Journal(p.clone(), entry(1, "first"), None),
        Record::Journal(p.clone(), entry(1, "second"), None),
    ];
    let answers = records::write_all(&env.pool, &twice).await;
    assert!(matches!(answers[..], [Ok(true), Ok(false)]), "{answers:?}");
    assert_eq!(
        texts(
            &env,
            "SELECT run_id || '/' || call_no || ':' || (response->>'content') FROM trailmark.journal"
        )
        .await,
        ["r-p/0:p0", "r-p/1:first", "r-q/0:q0"]
    );
    assert_eq!(
        texts(
            &env,
            "SELECT idempotency_key || '=' || result::text FROM trailmark.effects"
        )
        .await,
        [r#"r-p:link:0={"posted": 1}"#]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intents_in_one_group_each_get_their_own_verdict() {
    let env = TestEnv::new().await;
    let (s, t, u) = (
        env.insert_chain_run("r-s").await,
        env.insert_chain_run("r-t").await,
        env.insert_chain_run("r-u").await,
    );
    let fence_s = claim(&env, &s, "w-s", 30.0).await;
    let stale_t = claim(&env, &t, "w-t1", 0.0).await;
    let _current_t = claim(&env, &t, "w-t2", 30.0).await;
    let fence_u = claim(&env, &u, "w-u", 30.0).await;
    // r-u's key was used before with another request.
    assert!(matches!(
        effects::begin(&env.pool, &intent(&u, "r-u:link:0", "old", fence_u)).await,
        Ok(IntentOutcome::Recorded(EffectState::New))
    ));
    let group = [
        intent(&s, "r-s:link:0", "h", fence_s),
        intent(&t, "r-t:link:0", "h", stale_t),
        intent(&u, "r-u:link:0", "new", fence_u),
        intent(&s, "r-s:link:1", "h", fence_s),
    ];
    let verdicts = effects::begin_all(&env.pool, &group).await;
    assert!(
        matches!(
            &verdicts[..],
            [
                Ok(IntentOutcome::Recorded(EffectState::New)),
                Err(store::Error::FencedOut { .. }),
                Err(store::Error::Conflict { .. }),
                Ok(IntentOutcome::Recorded(EffectState::New)),
            ]
        ),
        "{verdicts:?}"
    );
    assert_eq!(
        texts(
            &env,
            "SELECT idempotency_key || '=' || request_hash FROM trailmark.effects"
        )
        .await,
        ["r-s:link:0=h", "r-s:link:1=h", "r-u:link:0=old"],
        "a stale worker's intent was recorded, or a conflicting one replaced the first"
    );
    // The same key twice in one group (a stale step next to the current one): one intent, and
    // the second learns that the call may have been made.
    let twice = [
        intent(&s, "r-s:link:2", "h", fence_s),
        intent(&s, "r-s:link:2", "h", fence_s),
    ];
    let verdicts = effects::begin_all(&env.pool, &twice).await;
    assert!(
        matches!(
            &verdicts[..],
            [
                Ok(IntentOutcome::Recorded(EffectState::New)),
                Ok(IntentOutcome::Recorded(EffectState::Unknown)),
            ]
        ),
        "{verdicts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intents_of_one_run_in_a_group_count_each_other_against_its_budget() {
    let env = TestEnv::new().await;
    let v = env.insert_chain_run("r-v").await;
    let fence = claim(&env, &v, "w-v", 30.0).await;
    let budget_of_one = |key| EffectIntent {
        max_calls: 1,
        ..intent(&v, key, "h", fence)
    };
    let group = [budget_of_one("r-v:link:0"), budget_of_one("r-v:link:1")];
    let verdicts = effects::begin_all(&env.pool, &group).await;
    assert!(
        matches!(
            &verdicts[..],
            [
                Ok(IntentOutcome::Recorded(EffectState::New)),
                Ok(IntentOutcome::OverLimit(_)),
            ]
        ),
        "a budget of one call let two through: {verdicts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_meeting_an_unreachable_database_fails_at_once_not_step_by_step() {
    // Nothing listens on port 1: every connection attempt fails until the acquire timeout.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(1))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let run_id = RunId::parse("r-down").unwrap();
    let group: Vec<runs::ClaimRequest> = (0..20)
        .map(|_| request(&run_id, "w", MessageId::new()))
        .collect();
    // One by one, the 20 claims would each wait out the timeout: 20 s and more, while every
    // other step of the process queues behind the batch.
    let outcomes = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runs::claim_all(&pool, &group),
    )
    .await
    .expect("the batch ran its claims one by one against a database that is down");
    assert_eq!(outcomes.len(), 20);
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Err(store::Error::Unavailable { .. }))),
        "{outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_claim_says_why_as_the_run_stood() {
    let env = TestEnv::new().await;
    let (w, e) = (
        env.insert_chain_run("r-w").await,
        env.insert_chain_run("r-e").await,
    );
    sqlx::query("UPDATE trailmark.runs SET step_seq = 3 WHERE run_id = 'r-w'")
        .execute(&env.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE trailmark.runs SET status = 'needs_review' WHERE run_id = 'r-e'")
        .execute(&env.pool)
        .await
        .unwrap();
    let missing = RunId::parse("r-missing").unwrap();
    let group = [
        request(&w, "w-1", MessageId::new()),
        request(&e, "w-2", MessageId::new()),
        request(&missing, "w-3", MessageId::new()),
    ];
    let outcomes = runs::claim_all(&env.pool, &group).await;
    assert!(
        matches!(
            &outcomes[..],
            [
                Ok(runs::ClaimOutcome::Refused(runs::Refusal::Position(3))),
                Ok(runs::ClaimOutcome::Refused(runs::Refusal::Status(s))),
                Ok(runs::ClaimOutcome::Refused(runs::Refusal::UnknownRun)),
            ] if *s == trailmark::domain::RunStatus::NeedsReview
        ),
        "{outcomes:?}"
    );
}

/// A step commit that pre-claims `run`'s next position for `owner`, whose presence backend is
/// `pid`.
fn preclaiming(
    env: &TestEnv,
    run: &RunId,
    fence: Fence,
    (owner, pid): (&str, i32),
) -> checkpoint::StepCommit {
    checkpoint::StepCommit {
        preclaim: Some(checkpoint::PreClaim {
            owner: owner.into(),
            pid: Some(pid),
        }),
        ..first_step_commit(env, run, fence, &[], 1)
    }
}

/// A claim at position 1, as the next step's delivery asks it.
fn next_request(run: &RunId, owner: &str, redelivered: bool) -> runs::ClaimRequest {
    runs::ClaimRequest {
        version: 1,
        seq: 1,
        redelivered,
        ..request(run, owner, MessageId::new())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_claims_the_next_position_idly_and_any_delivery_may_take_it() {
    let env = TestEnv::new().await;
    let (x, y) = (
        env.insert_chain_run("r-x").await,
        env.insert_chain_run("r-y").await,
    );
    let (fx, fy) = (
        claim(&env, &x, "w-a", 30.0).await,
        claim(&env, &y, "w-a", 30.0).await,
    );
    // The holder's presence: a backend of the test's pool, alive while the test runs.
    let alive = store::backend_pid(&env.pool).await.unwrap();
    // A fork's replay brings answers for positions not yet run: the pre-claim counts them.
    let replayed = Record::Journal(
        x.clone(),
        JournalEntry {
            seq: 1,
            ..entry(0, "x1")
        },
        None,
    );
    records::write_all(&env.pool, &[replayed]).await[0]
        .as_ref()
        .expect("journal entry at position 1");
    let step = preclaiming(&env, &x, fx, ("w-a/next", alive));
    let committed = checkpoint::commit(&env.pool, &step).await.unwrap();
    let checkpoint::Committed::Done {
        preclaimed: Some(next),
        rows,
    } = committed
    else {
        panic!("no pre-claim: {committed:?}");
    };
    // The commit hands back the outbox row of its message, for the worker to remove once the
    // broker confirms it.
    let stored: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM trailmark.outbox WHERE message_id = $1")
            .bind(step.outbox[0].message_id.0)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(rows, stored);
    assert_eq!(
        (next.attempt, next.journaled),
        (1, 1),
        "(attempt, journal entries) at position 1"
    );
    let run = runs::get(&env.pool, "r-x").await.unwrap().unwrap();
    assert_eq!(
        (run.step_seq, run.fence, run.lease_owner.as_deref()),
        (1, fx.0 + 1, Some("w-a/next")),
        "the run moved on with its next position leased to the committer"
    );
    assert_eq!(run.lease_expires_at, None, "a pre-claim's lease is idle");
    assert_eq!(env.attempts("r-x", 1).await, 1);
    assert!(
        runs::take_expired_leases(&env.pool, 10)
            .await
            .unwrap()
            .is_empty(),
        "the supervisor voided an idle lease"
    );

    // The delivery went to another worker: its claim takes the idle lease at once, as the same
    // attempt and no takeover (the holder never got the message).
    let taken = runs::claim(&env.pool, &next_request(&x, "w-b", false)).await;
    assert!(
        matches!(&taken, Ok(runs::ClaimOutcome::Claimed(c))
            if (c.fence.0, c.attempt, c.journaled, c.took_over) == (fx.0 + 2, 1, 1, false)),
        "{taken:?}"
    );
    assert_eq!(env.attempts("r-x", 1).await, 1, "the attempt counted twice");
    // The pre-claim's holder, one fence behind, writes nothing any more.
    let stale = EffectIntent {
        seq: 1,
        ..intent(&x, "r-x:link:1", "h", Fence(fx.0 + 1))
    };
    assert!(matches!(
        effects::begin(&env.pool, &stale).await,
        Err(store::Error::FencedOut { .. })
    ));

    // A redelivery may follow a holder that started the step and died: another attempt, and
    // a takeover.
    checkpoint::commit(&env.pool, &preclaiming(&env, &y, fy, ("w-a/next", alive)))
        .await
        .unwrap();
    let again = runs::claim(&env.pool, &next_request(&y, "w-b", true)).await;
    assert!(
        matches!(&again, Ok(runs::ClaimOutcome::Claimed(c))
            if (c.attempt, c.journaled, c.took_over) == (2, 0, true)),
        "{again:?}"
    );

    // A holder that died with the lease still idle (it never beat) most likely never started
    // the step: its messages sat in its prefetch. Their redeliveries, and the relay's copy of a
    // row it had not removed, count no second attempt; the lease the claim leaves is an
    // ordinary one, so a step that kills its worker is counted from its next takeover on.
    let z = env.insert_chain_run("r-z").await;
    let fz = claim(&env, &z, "w-a", 30.0).await;
    let gone = preclaiming(&env, &z, fz, ("w-a/next", i32::MAX));
    checkpoint::commit(&env.pool, &gone).await.unwrap();
    let redelivered = runs::claim(&env.pool, &next_request(&z, "w-b", true)).await;
    assert!(
        matches!(&redelivered, Ok(runs::ClaimOutcome::Claimed(c)) if (c.attempt, c.took_over) == (1, false)),
        "{redelivered:?}"
    );
    let w = env.insert_chain_run("r-w").await;
    let fw = claim(&env, &w, "w-a", 30.0).await;
    let gone = preclaiming(&env, &w, fw, ("w-a/next", i32::MAX));
    checkpoint::commit(&env.pool, &gone).await.unwrap();
    let copy = runs::claim(&env.pool, &next_request(&w, "w-b", false)).await;
    assert!(
        matches!(&copy, Ok(runs::ClaimOutcome::Claimed(c)) if (c.attempt, c.took_over) == (1, false)),
        "{copy:?}"
    );
    // The holder takes back a pre-claim it never started (too old to start on when its message
    // came back, or redelivered): the same attempt, no takeover. Without that word from it, a
    // redelivery to the holder may follow a start: another attempt.
    let u = env.insert_chain_run("r-u").await;
    let fu = claim(&env, &u, "w-a", 30.0).await;
    checkpoint::commit(&env.pool, &preclaiming(&env, &u, fu, ("w-a/next", alive)))
        .await
        .unwrap();
    let back = runs::ClaimRequest {
        version: 1,
        unstarted_preclaim: true,
        ..next_request(&u, "w-a/next", true)
    };
    let back = runs::claim(&env.pool, &back).await;
    assert!(
        matches!(&back, Ok(runs::ClaimOutcome::Claimed(c)) if (c.attempt, c.took_over) == (1, false)),
        "{back:?}"
    );
    let t = env.insert_chain_run("r-t").await;
    let ft = claim(&env, &t, "w-a", 30.0).await;
    checkpoint::commit(&env.pool, &preclaiming(&env, &t, ft, ("w-a/next", alive)))
        .await
        .unwrap();
    let unsure = runs::claim(&env.pool, &next_request(&t, "w-a/next", true)).await;
    assert!(
        matches!(&unsure, Ok(runs::ClaimOutcome::Claimed(c)) if c.attempt == 2),
        "{unsure:?}"
    );

    // A dead holder that left a trace of the step (an effect under its fence) had started it:
    // another attempt, and a takeover.
    let v = env.insert_chain_run("r-v").await;
    let fv = claim(&env, &v, "w-a", 30.0).await;
    let gone = preclaiming(&env, &v, fv, ("w-a/next", i32::MAX));
    checkpoint::commit(&env.pool, &gone).await.unwrap();
    let started = EffectIntent {
        seq: 1,
        ..intent(&v, "r-v:link:1", "h", Fence(fv.0 + 1))
    };
    effects::begin(&env.pool, &started).await.unwrap();
    let after_start = runs::claim(&env.pool, &next_request(&v, "w-b", true)).await;
    assert!(
        matches!(&after_start, Ok(runs::ClaimOutcome::Claimed(c)) if (c.attempt, c.took_over) == (2, true)),
        "{after_start:?}"
    );
    // w-b dies in turn, its lease no longer idle: the next claim is a counted takeover.
    sqlx::query("UPDATE trailmark.runs SET lease_pid = $2 WHERE run_id = $1")
        .bind(w.as_str())
        .bind(i32::MAX)
        .execute(&env.pool)
        .await
        .unwrap();
    let after = runs::claim(&env.pool, &next_request(&w, "w-c", true)).await;
    assert!(
        matches!(&after, Ok(runs::ClaimOutcome::Claimed(c)) if (c.attempt, c.took_over) == (2, true)),
        "{after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_writes_only_at_the_position_it_was_handed_out_for() {
    // A pre-claim a Postgres crash forgot held fence f + 1 at position 1; a later claim at
    // position 0 hands out f + 1 again. The forgotten holder must be refused.
    let env = TestEnv::new().await;
    let x = env.insert_chain_run("r-x").await;
    let f = claim(&env, &x, "w-a", 30.0).await;
    let elsewhere = EffectIntent {
        seq: 1,
        ..intent(&x, "r-x:link:1", "h", f)
    };
    assert!(matches!(
        effects::begin(&env.pool, &elsewhere).await,
        Err(store::Error::FencedOut { .. })
    ));
    assert!(
        !runs::heartbeat(&env.pool, (&x, 1), f, 30.0, None)
            .await
            .unwrap(),
        "a heartbeat at another position kept the lease"
    );
    runs::release(&env.pool, (&x, 1), f, (1.0, false), "gave up")
        .await
        .unwrap();
    let run = runs::get(&env.pool, "r-x").await.unwrap().unwrap();
    assert_eq!(
        run.lease_owner.as_deref(),
        Some("w-a"),
        "a release at another position gave the lease back"
    );
    assert!(
        runs::heartbeat(&env.pool, (&x, 0), f, 30.0, None)
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_renewal_keeps_every_lease_held_skips_a_locked_row_and_names_the_lost_ones() {
    // A process renews all its leases at once; a row another transaction holds must neither
    // stall the others nor count as lost.
    let env = TestEnv::new().await;
    let (x, y, z) = (
        env.insert_chain_run("r-x").await,
        env.insert_chain_run("r-y").await,
        env.insert_chain_run("r-z").await,
    );
    let (fx, fy, fz) = (
        claim(&env, &x, "w-a", 1.0).await,
        claim(&env, &y, "w-a", 1.0).await,
        claim(&env, &z, "w-a", 1.0).await,
    );
    // Another worker took z over: z's fence moved on.
    sqlx::query("UPDATE trailmark.runs SET fence = fence + 1 WHERE run_id = $1")
        .bind(z.as_str())
        .execute(&env.pool)
        .await
        .unwrap();
    let mut locker = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM trailmark.runs WHERE run_id = $1 FOR UPDATE")
        .bind(y.as_str())
        .execute(&mut *locker)
        .await
        .unwrap();
    let held = [(x.clone(), 0, fx), (y.clone(), 0, fy), (z.clone(), 0, fz)];
    let lost = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runs::heartbeat_all(&env.pool, &held, 600.0, None),
    )
    .await
    .expect("a locked row held the renewal up")
    .unwrap();
    assert_eq!(lost, vec![(z.clone(), 0, fz)]);
    locker.rollback().await.unwrap();
    let expires = |id: &RunId| {
        let id = id.as_str().to_owned();
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, f64>(
                "SELECT EXTRACT(EPOCH FROM lease_expires_at - now())::float8 FROM trailmark.runs WHERE run_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert!(expires(&x).await > 500.0, "x's lease was not renewed");
    assert!(
        expires(&y).await < 2.0,
        "the locked row was waited for and renewed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_claim_meeting_a_row_at_the_next_position_counts_its_attempt_on_that_row() {
    let env = TestEnv::new().await;
    let run = env.insert_chain_run("r-row").await;
    let fence = claim(&env, &run, "w-a", 30.0).await;
    // The next position already has a row (an earlier attempt's): the pre-claim's plain
    // insert meets its key, and the commit takes the merging form.
    sqlx::query(
        "INSERT INTO trailmark.steps (run_id, seq, step, attempts) VALUES ($1, 1, 'link', 1)",
    )
    .bind(run.as_str())
    .execute(&env.pool)
    .await
    .unwrap();
    let step = preclaiming(&env, &run, fence, ("w-a/next", 1));
    let committed = checkpoint::commit(&env.pool, &step).await.unwrap();
    let checkpoint::Committed::Done {
        preclaimed: Some(next),
        ..
    } = committed
    else {
        panic!("no pre-claim: {committed:?}");
    };
    assert_eq!(next.attempt, 2, "the earlier attempt and this pre-claim");
    assert_eq!(env.attempts("r-row", 1).await, 2);
    let run = runs::get(&env.pool, "r-row").await.unwrap().unwrap();
    assert_eq!(run.step_seq, 1);
}

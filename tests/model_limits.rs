//! Fleet-wide requests- and tokens-per-minute limits per model endpoint, against the real
//! servers and the stand-in model enforcing the same limit as a provider does: the fleet keeps
//! under it instead of being refused, a step with no room waits holding no lease and spending
//! no attempt and says so, and a call larger than the whole limit stops its run for review.

mod common;

use std::time::Duration;

use common::{Running, TestEnv};
use serde_json::json;
use trailmark::config::Settings;
use trailmark::domain::{Admission, JournalEntry, ModelAsk, RunStatus};
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::store::model_usage;
use trailmark::store::records::{self, Record};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};

const WAIT: Duration = Duration::from_secs(30);

/// A `chain` link's call: 19 prompt tokens (run ids of 9 characters) and 16 answer tokens, so
/// 35 real; reserved at 19 + its max_tokens of 64 = 83 until answered.
const LINK_TOKENS: i64 = 35;

async fn standin(requests_per_minute: u64, tokens_per_minute: u64) -> ModelServer {
    ModelServer::start(ModelServerOptions {
        requests_per_minute,
        tokens_per_minute,
        ..Default::default()
    })
    .await
    .expect("model server")
}

/// `chain` served in this process against `server`, with its limits set so.
fn serve(env: &TestEnv, server: &ModelServer, limits: (u64, u64)) -> Running {
    let mut s: Settings = env.settings.clone();
    s.model.base_url = server.base_url();
    s.model.model = "test-model".into();
    (s.model.requests_per_minute, s.model.tokens_per_minute) = limits;
    let engine = Engine::with_pool(
        s,
        trailmark_testkit::registry(),
        Failpoints::default(),
        env.pool.clone(),
    )
    .expect("engine");
    env.spawn_all(engine)
}

async fn progress_lines(env: &TestEnv, run_id: &str, like: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT line FROM trailmark.progress WHERE run_id = $1 AND line LIKE $2 ORDER BY id",
    )
    .bind(run_id)
    .bind(like)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

fn ask(estimate: u64) -> ModelAsk<'static> {
    ModelAsk {
        endpoint: "http://m/v1/chat/completions m",
        requests_per_minute: 0,
        tokens_per_minute: 100,
        estimate,
        hold: Duration::from_secs(1),
        run_id: "r-1",
        seq: 0,
    }
}

async fn reserve(env: &TestEnv, estimate: u64) -> Admission {
    model_usage::reserve(&env.pool, &ask(estimate))
        .await
        .unwrap()
}

/// How long a refusal says to wait, in whole seconds.
fn wait_secs(refused: &Admission) -> u64 {
    match refused {
        Admission::Full { wait, .. } => wait.as_secs_f64().round() as u64,
        other => panic!("not refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_counts_calls_in_flight_at_their_estimate_and_answered_ones_at_their_usage() {
    let env = TestEnv::new().await;
    // A row a minute old no longer counts, and the next reservation deletes it.
    sqlx::query("INSERT INTO trailmark.model_usage (endpoint, at, tokens, run_id, seq)
                 VALUES ('http://m/v1/chat/completions m', now() - interval '61 seconds', 100, 'r-0', 0)")
        .execute(&env.pool)
        .await
        .unwrap();
    let Admission::Reserved { id, used } = reserve(&env, 60).await else {
        panic!("an empty window refused a call");
    };
    assert_eq!(used, (0, 0));
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.model_usage")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "the old row was deleted");
    // In flight, the call counts at its estimate until a minute after it must have ended.
    let refused = reserve(&env, 50).await;
    assert!(
        matches!(refused, Admission::Full { used: (1, 60), .. }),
        "{refused:?}"
    );
    assert_eq!(wait_secs(&refused), 61, "the hold, then a minute");
    // Failed, it counts at its estimate for a minute from the failure.
    model_usage::failed(&env.pool, id).await.unwrap();
    assert_eq!(wait_secs(&reserve(&env, 50).await), 60);
    // Answered, its real usage counts from when it was journaled, in the journal's statement.
    let run = env.insert_chain_run("r-1").await;
    let entry = JournalEntry {
        seq: 0,
        call_no: 0,
        kind: "model".into(),
        request_hash: "h".into(),
        response: json!({ "content": "answer" }),
        tokens: 10,
        cost: 0.0,
        latency_ms: 1,
    };
    let written = records::write_all(&env.pool, &[Record::Journal(run, entry, Some(id))]).await;
    assert!(matches!(written[..], [Ok(true)]), "{written:?}");
    let (tokens, same_time): (i64, bool) = sqlx::query_as(
        "SELECT u.tokens, u.at = j.created_at FROM trailmark.model_usage u, trailmark.journal j WHERE u.id = $1",
    )
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((tokens, same_time), (10, true));
    assert!(matches!(
        reserve(&env, 90).await,
        Admission::Reserved { used: (1, 10), .. }
    ));
    // 10 + 90 used: a call of 5 fits once the first leaves; one of 95 only once both have.
    let refused = reserve(&env, 5).await;
    assert!(
        matches!(refused, Admission::Full { used: (2, 100), .. }),
        "{refused:?}"
    );
    assert_eq!(wait_secs(&refused), 60);
    assert_eq!(wait_secs(&reserve(&env, 95).await), 61);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_larger_than_the_whole_tokens_per_minute_limit_stops_the_run_for_review() {
    let env = TestEnv::new().await;
    let server = standin(0, 0).await;
    let running = serve(&env, &server, (0, 50));
    env.start_run("chain", "too-big-1", json!({"steps": 2}))
        .await;
    let run = env
        .wait_status("too-big-1", RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    for says in [
        "step link (position 0)",
        "needs up to 83 tokens",
        "more than model.tokens_per_minute (50)",
        "can never be made",
        "raise model.tokens_per_minute",
    ] {
        assert!(error.contains(says), "the review says {says:?}: {error}");
    }
    assert_eq!(run.handover.expect("handover note")["error_class"], "guard");
    assert_eq!(server.calls(), 0, "a call that can never fit is never made");
    assert_eq!(
        env.attempts("too-big-1", 0).await,
        1,
        "stopped at once, not retried"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_with_no_room_waits_without_a_lease_or_an_attempt_and_run_show_says_so() {
    let env = TestEnv::new().await;
    let server = standin(2, 0).await;
    let running = serve(&env, &server, (2, 0));
    // Two calls fit in the minute; the third link waits for the first to age out.
    env.start_run("chain", "throttled", json!({"steps": 3}))
        .await;
    env.wait_until("the third link to wait for the limit", WAIT, || async {
        !progress_lines(&env, "throttled", "%requests-per-minute limit%")
            .await
            .is_empty()
    })
    .await;
    let line = progress_lines(&env, "throttled", "%requests-per-minute limit%")
        .await
        .remove(0);
    assert!(
        line.starts_with("step link (position 2) waits for the model's requests-per-minute limit (2 of 2 used) at http://127.0.0.1:")
            && line.contains(" test-model: no call is made until enough of the last minute's use has aged out")
            && line.contains("(not counted as an attempt); back in ")
            && line.ends_with(" s, 0 of 5 attempts used"),
        "{line}"
    );
    // The progress line is written when the step finds no room, before the worker gives the
    // lease back in a statement of its own: wait for that, bounded.
    env.wait_until("the waiting step to give its lease back", WAIT, || async {
        let run = trailmark::store::runs::get(&env.pool, "throttled")
            .await
            .unwrap()
            .unwrap();
        run.lease_owner.is_none()
    })
    .await;
    let run = trailmark::store::runs::get(&env.pool, "throttled")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(run.status, RunStatus::Running);
    assert_eq!(run.step_seq, 2, "still waiting at the third link");
    assert_eq!(run.lease_owner, None, "the waiting step holds no lease");
    assert_eq!(
        env.attempts("throttled", 2).await,
        0,
        "the wait spends no attempt"
    );
    assert_eq!(
        server.calls(),
        2,
        "no call is made while the window is full"
    );
    let shown = env.command(&["run", "show", "throttled"]).output().unwrap();
    let (out, err) = common::text(&shown);
    assert!(
        out.contains("waits for the model's requests-per-minute limit (2 of 2 used)"),
        "run show says what the step waits for: {out}{err}"
    );
    // The reservations: two answered calls, counted at their real usage.
    let reserved: Vec<(i64, String)> =
        sqlx::query_as("SELECT tokens, run_id FROM trailmark.model_usage ORDER BY id")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(reserved, vec![(LINK_TOKENS, "throttled".into()); 2]);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_keep_every_minute_under_the_tokens_per_minute_limit_with_no_429() {
    // 12 runs of 4 links: 48 calls of 35 tokens, 1680 in all, against a limit of 1000 a
    // minute: about 28 calls fit in the first minute, the rest wait for it to age out.
    const LIMIT: u64 = 1000;
    let env = TestEnv::new().await;
    let server = standin(0, LIMIT).await;
    let model = [
        ("TRAILMARK__MODEL__BASE_URL", server.base_url()),
        ("TRAILMARK__MODEL__MODEL", "test-model".to_string()),
        ("TRAILMARK__MODEL__TOKENS_PER_MINUTE", LIMIT.to_string()),
    ];
    let _workers: Vec<_> = (0..4)
        .map(|_| env.spawn_process_with(None, &model))
        .collect();
    let runs: Vec<String> = (0..12).map(|i| format!("tokens-{i:02}")).collect();
    for run in &runs {
        env.start_run("chain", run, json!({"steps": 4})).await;
    }
    for run in &runs {
        env.wait_status(run, RunStatus::Succeeded, Duration::from_secs(150))
            .await;
    }
    let (calls, tokens): (i64, i64) = sqlx::query_as(
        "SELECT count(*), sum(tokens)::bigint FROM trailmark.journal WHERE kind = 'model'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (calls, tokens),
        (48, 48 * LINK_TOKENS),
        "one answer per link"
    );
    assert!(tokens as u64 > LIMIT, "the fleet had to wait");
    // Every window of 60 s (timestamps in microseconds), ending at each answer: the busiest ones.
    let busiest: i64 = sqlx::query_scalar(
        "SELECT max(used)::bigint FROM (
            SELECT sum(tokens) OVER (ORDER BY created_at
                     RANGE BETWEEN interval '59.999999 seconds' PRECEDING AND CURRENT ROW) AS used
              FROM trailmark.journal WHERE kind = 'model') w",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        busiest as u64 <= LIMIT,
        "a minute of the journal used {busiest} tokens"
    );
    assert_eq!(server.rate_limited(), 0, "the stand-in never had to refuse");
    assert_eq!(server.calls(), 48);
    assert!(
        server.busiest_minute().tokens <= LIMIT,
        "{:?}",
        server.busiest_minute()
    );
    let waits: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.progress WHERE line LIKE '%waits for the model''s tokens-per-minute limit (%'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(waits > 0, "steps said they waited for the limit");
    let attempts: i64 = sqlx::query_scalar("SELECT sum(attempts)::bigint FROM trailmark.steps")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    // A lease lost on a loaded machine (3 s leases here) may add an attempt; each wait would.
    assert!(
        attempts >= 48 && attempts < 48 + waits,
        "the waits spent no attempt: {attempts} attempts, {waits} waits"
    );
    println!(
        "busiest minute: {busiest} tokens in the journal, {:?} at the stand-in; {waits} waits, {attempts} attempts",
        server.busiest_minute()
    );
}

//! Failure semantics against the real servers: model failures, slow tools,
//! parking, retry caps with handover notes, budgets, loops, panics, timeouts.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Running, TestEnv};
use serde_json::{Value, json};
use trailmark::config::Settings;
use trailmark::domain::{IdempotencyKey, RunStatus};
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::guard::Budget;
use trailmark::workflow::{
    Lookup, Registry, StepContext, StepError, StepKind, StepOutcome, Tool, Workflow,
};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions, Scripted};

const WAIT: Duration = Duration::from_secs(60);

fn start(env: &TestEnv, settings: Settings, registry: Registry) -> (Arc<Engine>, Running) {
    let engine = Engine::with_pool(settings, registry, Failpoints::default(), env.pool.clone())
        .expect("engine");
    let running = env.spawn_all(engine.clone());
    (engine, running)
}

fn with_model(env: &TestEnv, server: &ModelServer) -> Settings {
    let mut s = env.settings.clone();
    s.model.base_url = server.base_url();
    s.model.model = "test-model".into();
    s.model.timeout_ms = 2_000;
    s
}

async fn model_server(script: Vec<Scripted>) -> ModelServer {
    ModelServer::start(ModelServerOptions {
        script,
        ..Default::default()
    })
    .await
    .expect("model server")
}

/// `chain` served by one engine whose model is a stand-in server playing `script` first.
async fn serve_chain_with_model(env: &TestEnv, script: Vec<Scripted>) -> (ModelServer, Running) {
    let server = model_server(script).await;
    let (_engine, running) = start(env, with_model(env, &server), trailmark_testkit::registry());
    (server, running)
}

/// A keyed table the test workflows write to, standing in for a ledger that enforces its key.
async fn ledger(env: &TestEnv) {
    sqlx::query("CREATE TABLE test_ledger (reference TEXT PRIMARY KEY, amount BIGINT NOT NULL)")
        .execute(&env.pool)
        .await
        .unwrap();
}

async fn post(pool: &sqlx::PgPool, reference: &str, amount: i64) -> Result<Value, StepError> {
    let done = sqlx::query("INSERT INTO test_ledger (reference, amount) VALUES ($1, $2) ON CONFLICT (reference) DO NOTHING")
        .bind(reference)
        .bind(amount)
        .execute(pool)
        .await
        .map_err(|e| StepError::temporary(e.to_string()))?;
    Ok(json!({ "reference": reference, "created": done.rows_affected() == 1 }))
}

async fn ledger_rows(env: &TestEnv) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM test_ledger")
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

fn key(ctx: &StepContext, item: &str) -> IdempotencyKey {
    IdempotencyKey::for_step(ctx.run_id(), ctx.step(), item)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_500_then_200_gives_one_journal_entry_and_two_calls() {
    let env = TestEnv::new().await;
    let (server, running) = serve_chain_with_model(&env, vec![Scripted::Status(500)]).await;
    env.start_run("chain", "r-500", json!({"steps": 1})).await;
    env.wait_status("r-500", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            "r-500"
        )
        .await,
        1
    );
    assert_eq!((server.calls(), server.answered()), (2, 1));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_retry_waits_at_least_the_servers_retry_after() {
    let env = TestEnv::new().await;
    let (server, running) = serve_chain_with_model(
        &env,
        vec![Scripted::RateLimited {
            retry_after_secs: 1,
        }],
    )
    .await;
    let started = Instant::now();
    env.start_run("chain", "r-429", json!({"steps": 1})).await;
    env.wait_status("r-429", RunStatus::Succeeded, WAIT).await;
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "retried after {:?}, before Retry-After",
        started.elapsed()
    );
    assert_eq!((server.calls(), server.answered()), (2, 1));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_model_credentials_stop_the_run_at_once_without_retries() {
    let env = TestEnv::new().await;
    let (server, running) = serve_chain_with_model(&env, vec![Scripted::Status(401)]).await;
    env.start_run("chain", "r-401", json!({"steps": 3})).await;
    let run = env.wait_status("r-401", RunStatus::NeedsReview, WAIT).await;
    assert_eq!(server.calls(), 1, "an auth failure is never retried");
    let note = run.handover.expect("handover note");
    assert_eq!(note["error_class"], "tool_auth");
    assert_eq!(note["failed_step"], "link");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_answering_after_the_client_timeout_is_retried_under_the_same_key_without_a_duplicate()
{
    let env = TestEnv::new().await;
    ledger(&env).await;
    let calls = Arc::new(AtomicU64::new(0));
    let counter = calls.clone();
    let wf = Workflow::new("slow-tool", 1).step("post", StepKind::Write, move |ctx| {
        let counter = counter.clone();
        async move {
            let pool = ctx.pool().clone();
            let call = |k: IdempotencyKey| {
                let (pool, counter) = (pool.clone(), counter.clone());
                async move {
                    let n = counter.fetch_add(1, Ordering::SeqCst);
                    // The write lands, but the first answer comes after the client gave up.
                    let slow = async {
                        let r = post(&pool, k.as_str(), 100).await;
                        if n == 0 {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                        }
                        r
                    };
                    tokio::time::timeout(Duration::from_millis(300), slow)
                        .await
                        .map_err(|_| StepError::temporary("ledger answered after 300 ms"))?
                }
            };
            let lookup = |_k| async { Ok(Lookup::CannotTell) };
            let result = ctx
                .tool_effect(
                    &Tool::idempotent("ledger"),
                    &key(&ctx, "inv-1"),
                    &json!({"amount": 100}),
                    call,
                    lookup,
                )
                .await?;
            Ok(StepOutcome::finish(result))
        }
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let (_engine, running) = start(&env, env.settings.clone(), registry);
    env.start_run("slow-tool", "r-slow", json!({})).await;
    let run = env.wait_status("r-slow", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one timed-out call, one retry"
    );
    assert_eq!(ledger_rows(&env).await, 1);
    assert_eq!(
        run.output.unwrap()["created"],
        json!(false),
        "the retry was recognised by the ledger's key"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_item_is_parked_and_the_others_are_processed() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let wf = Workflow::new("items", 1).step("post", StepKind::Write, |ctx| async move {
        let mut posted = 0;
        for i in 0..312 {
            let item = format!("inv-{i:03}");
            if i == 17 {
                ctx.park(&item, "scan unreadable: page 2 is blank");
                continue;
            }
            let pool = ctx.pool().clone();
            let reference = key(&ctx, &item).to_string();
            ctx.effect(&key(&ctx, &item), &json!({"amount": i}), |_| async move {
                post(&pool, &reference, i).await
            })
            .await?;
            posted += 1;
        }
        Ok(StepOutcome::finish(json!({ "posted": posted })))
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let (_engine, running) = start(&env, env.settings.clone(), registry);
    env.start_run("items", "r-park", json!({})).await;
    let run = env.wait_status("r-park", RunStatus::Succeeded, WAIT).await;
    assert_eq!(run.output.unwrap()["posted"], 311);
    assert_eq!(ledger_rows(&env).await, 311);
    let parked = trailmark::store::parked::list(&env.pool, "r-park")
        .await
        .unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].item.as_str(), parked[0].reason.as_str()),
        ("inv-017", "scan unreadable: page 2 is blank")
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_rejecting_every_write_stops_the_run_in_review_after_the_cap() {
    let env = TestEnv::new().await;
    let wf = Workflow::new("rejected", 1).step("post", StepKind::Write, |ctx| async move {
        let call = |_k| async {
            Err::<Value, _>(StepError::temporary(
                "ledger refused the entry: 503 service unavailable",
            ))
        };
        let lookup = |_k| async { Ok(Lookup::CannotTell) };
        ctx.tool_effect(
            &Tool::idempotent("ledger"),
            &key(&ctx, "inv-1"),
            &json!({"amount": 5}),
            call,
            lookup,
        )
        .await?;
        Ok(StepOutcome::finish(json!({})))
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let mut settings = env.settings.clone();
    settings.worker.max_attempts = 2;
    settings.worker.call_retries = 1;
    settings.worker.retry_base_ms = 100;
    let (_engine, running) = start(&env, settings, registry);
    env.start_run("rejected", "r-reject", json!({})).await;
    let run = env
        .wait_status("r-reject", RunStatus::NeedsReview, WAIT)
        .await;
    let note = run.handover.expect("handover note");
    assert_eq!(note["failed_step"], "post");
    assert_eq!(note["attempt"], 2);
    assert!(
        note["error"]
            .as_str()
            .unwrap()
            .contains("503 service unavailable"),
        "{note}"
    );
    assert_eq!(note["effects_committed"], json!([]), "no entry was posted");
    assert_eq!(
        env.scalar(
            "SELECT attempts::bigint FROM trailmark.steps WHERE run_id = $1",
            "r-reject"
        )
        .await,
        2
    );
    running.stop().await;
}

/// A loop of `n` steps, each one tool call with request `request(seq)`.
fn looping(name: &str, n: i32, tool: &'static str, request: fn(i32) -> Value) -> Workflow {
    Workflow::new(name, 1).step("act", StepKind::Write, move |ctx| async move {
        let pool = ctx.pool().clone();
        let reference = key(&ctx, &ctx.seq().to_string()).to_string();
        let call = move |_k| {
            let (pool, reference) = (pool.clone(), reference.clone());
            async move { post(&pool, &reference, 1).await }
        };
        let lookup = |_k| async { Ok(Lookup::CannotTell) };
        ctx.tool_effect(
            &Tool::idempotent(tool),
            &key(&ctx, &ctx.seq().to_string()),
            &request(ctx.seq()),
            call,
            lookup,
        )
        .await?;
        let out = json!({ "seq": ctx.seq() });
        if ctx.seq() + 1 >= n {
            Ok(StepOutcome::finish(out))
        } else {
            Ok(StepOutcome::goto(out, "act"))
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_of_5_tool_calls_stops_a_10_call_run_at_the_6th_without_truncating() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let wf = looping("ten", 10, "ledger", |seq| json!({ "entry": seq })).with_budget(Budget {
        max_tool_calls: 5,
        ..Default::default()
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let (_engine, running) = start(&env, env.settings.clone(), registry);
    env.start_run("ten", "r-budget", json!({})).await;
    let run = env
        .wait_status("r-budget", RunStatus::NeedsReview, WAIT)
        .await;
    assert_eq!(run.step_seq, 5, "stopped at the 6th call");
    assert_eq!(env.steps_done("r-budget").await, 5);
    assert_eq!(ledger_rows(&env).await, 5);
    let note = run.handover.unwrap();
    assert!(note["error"].as_str().unwrap().contains("budget"), "{note}");
    assert_eq!(note["effects_committed"].as_array().unwrap().len(), 5);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_action_repeated_beyond_the_limit_goes_to_review_naming_the_action() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let wf = looping(
        "stuck",
        50,
        "search",
        |_| json!({ "q": "overdue invoices for ACME" }),
    );
    let mut registry = Registry::new();
    registry.register(wf);
    let mut settings = env.settings.clone();
    settings.guards.repeat_limit = 3;
    let (_engine, running) = start(&env, settings, registry);
    env.start_run("stuck", "r-loop", json!({})).await;
    let run = env
        .wait_status("r-loop", RunStatus::NeedsReview, WAIT)
        .await;
    assert_eq!(run.step_seq, 3);
    let note = run.handover.unwrap();
    let error = note["error"].as_str().unwrap();
    assert!(
        error.contains("repeated action")
            && error.contains("search")
            && error.contains("overdue invoices for ACME"),
        "{error}"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_puts_the_run_in_review_and_the_worker_lives_on() {
    let env = TestEnv::new().await;
    let wf = Workflow::new("panics", 1).step("boom", StepKind::Read, |ctx| async move {
        if ctx.input()["panic"] == json!(true) {
            panic!("index out of bounds in invoice parser");
        }
        Ok(StepOutcome::finish(json!({})))
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let (_engine, running) = start(&env, env.settings.clone(), registry);
    env.start_run("panics", "r-panic", json!({"panic": true}))
        .await;
    let run = env
        .wait_status("r-panic", RunStatus::NeedsReview, WAIT)
        .await;
    assert!(
        run.error
            .unwrap()
            .contains("index out of bounds in invoice parser")
    );
    env.start_run("panics", "r-fine", json!({"panic": false}))
        .await;
    env.wait_status("r-fine", RunStatus::Succeeded, WAIT).await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_past_its_hard_timeout_goes_to_review() {
    let env = TestEnv::new().await;
    let mut settings = env.settings.clone();
    settings.guards.run_timeout_secs = 1;
    let (_engine, running) = start(&env, settings, trailmark_testkit::registry());
    env.start_run("chain", "r-late", json!({"steps": 5, "step_delay_ms": 600}))
        .await;
    let run = env
        .wait_status("r-late", RunStatus::NeedsReview, WAIT)
        .await;
    assert!(run.error.unwrap().contains("run timed out"));
    assert!(
        run.step_seq >= 1 && run.step_seq < 5,
        "stopped mid-run at {}",
        run.step_seq
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_past_its_soft_timeout_is_cancelled_and_retried() {
    let env = TestEnv::new().await;
    let wf = Workflow::new("sleepy", 1).step("nap", StepKind::Read, |ctx| async move {
        if ctx.attempt() == 1 {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        Ok(StepOutcome::finish(json!({ "attempt": ctx.attempt() })))
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let mut settings = env.settings.clone();
    settings.worker.step_timeout_secs = 1;
    settings.worker.retry_base_ms = 100;
    let (_engine, running) = start(&env, settings, registry);
    env.start_run("sleepy", "r-nap", json!({})).await;
    let run = env.wait_status("r-nap", RunStatus::Succeeded, WAIT).await;
    assert_eq!(run.output.unwrap()["attempt"], 2);
    running.stop().await;
}

/// A non-idempotent tool whose first call's outcome is lost (the process fails between the call
/// and recording its result); `lookup` decides what the retried step does.
async fn unknown_outcome_run(
    lookup_says: Lookup,
) -> (TestEnv, u64, trailmark::store::runs::RunRow) {
    let env = TestEnv::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let counter = calls.clone();
    let wf = Workflow::new("mailer", 1).step("send", StepKind::Message, move |ctx| {
        let (counter, answer) = (counter.clone(), lookup_says.clone());
        async move {
            let call = |_k| {
                counter.fetch_add(1, Ordering::SeqCst);
                async { Ok(json!({ "sent": true })) }
            };
            let lookup = |_k| async move { Ok(answer) };
            ctx.tool_effect(
                &Tool::not_idempotent("mail"),
                &key(&ctx, "note-1"),
                &json!({"to": "acme"}),
                call,
                lookup,
            )
            .await?;
            Ok(StepOutcome::finish(json!({})))
        }
    });
    let mut registry = Registry::new();
    registry.register(wf);
    let failpoints = Failpoints::default();
    failpoints.set(
        "effect.after_call",
        trailmark::failpoint::Action::Error,
        Some(1),
    );
    let engine =
        Engine::with_pool(env.settings.clone(), registry, failpoints, env.pool.clone()).unwrap();
    let running = env.spawn_all(engine);
    env.start_run("mailer", "r-unknown", json!({})).await;
    let settled = common::eventually("the run to settle", WAIT, || async {
        let run = trailmark::store::runs::get(&env.pool, "r-unknown")
            .await
            .unwrap();
        run.filter(|r| r.status.is_terminal() || r.status == RunStatus::NeedsReview)
    })
    .await;
    let run = settled.expect("run did not settle");
    running.stop().await;
    (env, calls.load(Ordering::SeqCst), run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_outcome_of_a_non_idempotent_tool_is_resolved_by_its_lookup() {
    let (_env, calls, run) = unknown_outcome_run(Lookup::Done(json!({ "sent": true }))).await;
    assert_eq!(run.status, RunStatus::Succeeded);
    assert_eq!(
        calls, 1,
        "the lookup found the first call; it was not repeated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_outcome_that_the_lookup_cannot_tell_goes_to_review_with_the_key() {
    let (_env, calls, run) = unknown_outcome_run(Lookup::CannotTell).await;
    assert_eq!(run.status, RunStatus::NeedsReview);
    assert_eq!(calls, 1, "never guess: no second call");
    let note = run.handover.unwrap();
    assert!(
        note["error"]
            .as_str()
            .unwrap()
            .contains("r-unknown:send:note-1"),
        "{note}"
    );
    assert_eq!(note["effects_unknown"][0]["key"], "r-unknown:send:note-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_model_answers_when_the_primary_keeps_failing() {
    let env = TestEnv::new().await;
    // The primary's first call and its 3 retries fail; the fallback's call is the fifth.
    let server = model_server(vec![Scripted::Status(503); 4]).await;
    let mut settings = with_model(&env, &server);
    settings.model.fallback_model = "test-fallback".into();
    let (_engine, running) = start(&env, settings, trailmark_testkit::registry());
    env.start_run("chain", "r-fallback", json!({"steps": 1}))
        .await;
    env.wait_status("r-fallback", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!((server.calls(), server.answered()), (5, 1));
    let model: String = sqlx::query_scalar(
        "SELECT response->>'model' FROM trailmark.journal WHERE run_id = 'r-fallback'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        model, "test-fallback",
        "the journal records which model answered"
    );
    running.stop().await;
}

/// A tool the test switches between down (every call fails with a 503) and healed, counting the
/// real calls each run made to it.
#[derive(Default)]
struct Flaky {
    healed: std::sync::atomic::AtomicBool,
    calls: std::sync::Mutex<std::collections::HashMap<String, i64>>,
}

impl Flaky {
    fn calls(&self, run_id: &str) -> i64 {
        self.calls.lock().unwrap().get(run_id).copied().unwrap_or(0)
    }
}

/// One step that posts one ledger row through `tool`, which the test switches as `flaky`. Its
/// lookup (asked only if `tool` is not idempotent, after an intent without a result) knows the
/// keys the tool answered with a 503, which it did not act on; of a key it never saw it cannot
/// tell.
fn through_flaky(flaky: Arc<Flaky>, tool: Tool) -> Registry {
    let wf = Workflow::new("flaky", 1).step("post", StepKind::Write, move |ctx| {
        let (flaky, tool) = (flaky.clone(), tool.clone());
        async move {
            let pool = ctx.pool().clone();
            let (run_id, reference) = (ctx.run_id().to_string(), key(&ctx, "row").to_string());
            let seen = flaky.calls(ctx.run_id().as_str()) > 0;
            let call = move |_k| {
                let (flaky, pool, run_id, reference) = (
                    flaky.clone(),
                    pool.clone(),
                    run_id.clone(),
                    reference.clone(),
                );
                async move {
                    *flaky.calls.lock().unwrap().entry(run_id).or_default() += 1;
                    if !flaky.healed.load(Ordering::SeqCst) {
                        return Err(StepError::temporary(
                            "flaky answered 503 service unavailable",
                        ));
                    }
                    post(&pool, &reference, 1).await
                }
            };
            let lookup = move |_k| async move {
                Ok(if seen {
                    Lookup::NotDone
                } else {
                    Lookup::CannotTell
                })
            };
            let request = json!({ "row": 1 });
            let posted = ctx
                .tool_effect(&tool, &key(&ctx, "row"), &request, call, lookup)
                .await?;
            Ok(StepOutcome::finish(posted))
        }
    });
    let mut registry = Registry::new();
    registry.register(wf);
    registry
}

/// Breakers that open after 2 failed calls for `open_secs`; `max_attempts` a step; no
/// in-process retry.
fn breaker_settings(env: &TestEnv, open_secs: u64, max_attempts: i32) -> Settings {
    let mut s = env.settings.clone();
    s.guards.breaker_failures = 2;
    s.guards.breaker_open_secs = open_secs;
    s.worker.max_attempts = max_attempts;
    s.worker.call_retries = 0;
    s.worker.retry_base_ms = 100;
    s
}

/// The times the engine told a run's progress that it waits for `tool`'s breaker.
async fn breaker_waits(env: &TestEnv, run_id: &str) -> i64 {
    env.scalar(
        "SELECT count(*) FROM trailmark.progress WHERE run_id = $1 AND line LIKE '%circuit breaker of flaky%'",
        run_id,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_wait_for_an_open_breaker_without_spending_attempts_and_finish_once_it_heals() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let flaky = Arc::new(Flaky::default());
    let settings = breaker_settings(&env, 4, 5);
    let max = settings.worker.max_attempts as i64;
    let (_engine, running) = start(
        &env,
        settings,
        through_flaky(flaky.clone(), Tool::idempotent("flaky")),
    );
    // The tool is down: the first two calls fail and open the breaker, the other runs are
    // refused. Each run is then refused more often than it has attempts while the tool stays
    // down; a probe at each half-open time fails and counts for the run that made it (one per
    // 4 s, too few to reach the cap of 5 of any run).
    let runs: Vec<String> = (0..5).map(|i| format!("r-wait-{i}")).collect();
    for run in &runs {
        env.start_run("flaky", run, json!({})).await;
    }
    env.wait_until(
        "every run to wait for the breaker more than max_attempts times",
        WAIT,
        || async {
            let mut all = true;
            for run in &runs {
                all &= breaker_waits(&env, run).await > max;
            }
            all
        },
    )
    .await;
    let reviewed = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE 'r-wait-%' AND status = 'needs_review'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(reviewed, 0, "no run went to review for an open breaker");
    // A run that just made the failing probe shows that failure instead, until it is refused.
    let shown = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM trailmark.steps WHERE run_id LIKE 'r-wait-%'
            AND last_error LIKE 'waiting for the circuit breaker of flaky%tries again at%(not counted as an attempt)'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        shown >= 3,
        "the steps' last errors say what they wait for, until when: {shown} of 5"
    );
    flaky.healed.store(true, Ordering::SeqCst);
    for run in &runs {
        env.wait_status(run, RunStatus::Succeeded, WAIT).await;
        assert_eq!(
            env.attempts(run, 0).await,
            flaky.calls(run),
            "run {run}: attempts are its real calls, the breaker's refusals not among them"
        );
    }
    assert_eq!(ledger_rows(&env).await, 5, "each run's row once");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_never_heals_still_sends_runs_to_review_after_the_cap_of_real_calls() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let flaky = Arc::new(Flaky::default());
    let settings = breaker_settings(&env, 1, 3);
    let max = settings.worker.max_attempts as i64;
    let (_engine, running) = start(
        &env,
        settings,
        through_flaky(flaky.clone(), Tool::idempotent("flaky")),
    );
    let runs = ["r-down-0", "r-down-1", "r-down-2"];
    for run in runs {
        env.start_run("flaky", run, json!({})).await;
    }
    let mut waited = 0;
    for run in runs {
        let stopped = env.wait_status(run, RunStatus::NeedsReview, WAIT).await;
        let note = stopped.handover.expect("handover note");
        let error = note["error"].as_str().unwrap();
        assert!(
            error.contains(&format!("failed temporarily {max} times"))
                && error.contains("503 service unavailable")
                && error.contains("circuit breaker for flaky is open"),
            "{note}"
        );
        assert_eq!(
            flaky.calls(run),
            max,
            "run {run}: the cap counts real calls"
        );
        assert_eq!(env.attempts(run, 0).await, max);
        waited += breaker_waits(&env, run).await;
    }
    assert!(
        waited > 0,
        "the probes' re-opened breaker made runs wait in between"
    );
    assert_eq!(ledger_rows(&env).await, 0);
    running.stop().await;
}

/// Effect rows (any, with or without a result) recorded for `run`.
async fn effect_rows(env: &TestEnv, run_id: &str) -> i64 {
    env.scalar(
        "SELECT count(*) FROM trailmark.effects WHERE run_id = $1",
        run_id,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_refuses_a_non_idempotent_call_before_recording_its_intent() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let flaky = Arc::new(Flaky::default());
    // Open for 8 s: the runs refused at its opening are back about 5 s later, still refused, so
    // nothing they record can come from a probe while the first check below looks.
    let settings = breaker_settings(&env, 8, 5);
    let tool = Tool::not_idempotent("flaky");
    let (_engine, running) = start(&env, settings, through_flaky(flaky.clone(), tool));
    let runs: Vec<String> = (0..5).map(|i| format!("r-fragile-{i}")).collect();
    for run in &runs {
        env.start_run("flaky", run, json!({})).await;
    }
    // The first calls fail and open the breaker; the runs it refused made no call.
    let refused = |flaky: &Flaky| -> Vec<String> {
        runs.iter()
            .filter(|r| flaky.calls(r) == 0)
            .cloned()
            .collect()
    };
    env.wait_until("the breaker to refuse runs", WAIT, || async {
        let waiting = refused(&flaky);
        let mut all = !waiting.is_empty();
        for run in &waiting {
            all &= breaker_waits(&env, run).await >= 1;
        }
        all
    })
    .await;
    for run in refused(&flaky) {
        assert_eq!(
            effect_rows(&env, &run).await,
            0,
            "run {run}: a call the breaker refused left no intent"
        );
    }
    // Several half-open moments pass, each with a failing probe, the other runs waiting.
    env.wait_until(
        "every run to wait for the breaker 3 times",
        WAIT,
        || async {
            let mut all = true;
            for run in &runs {
                all &= breaker_waits(&env, run).await >= 3;
            }
            all
        },
    )
    .await;
    let reviewed = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM trailmark.runs WHERE run_id LIKE 'r-fragile-%' AND status = 'needs_review'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        reviewed, 0,
        "no run went to review while the breaker was open"
    );
    flaky.healed.store(true, Ordering::SeqCst);
    for run in &runs {
        let done = common::eventually("the run to settle", WAIT, || async {
            let run = trailmark::store::runs::get(&env.pool, run).await.unwrap();
            run.filter(|r| r.status.is_terminal() || r.status == RunStatus::NeedsReview)
        })
        .await
        .expect("run did not settle");
        assert_eq!(
            done.status,
            RunStatus::Succeeded,
            "run {run}: no call was lost, none is unknown: {:?}",
            done.handover
        );
    }
    assert_eq!(ledger_rows(&env).await, 5, "each run's row once");
    running.stop().await;
}

/// One step that makes two calls to `flaky`, not idempotent, at once, under keys `a` and `b`;
/// its lookup knows the keys the tool answered (per key), and of others cannot tell.
fn two_at_once(flaky: Arc<Flaky>) -> Registry {
    let mut registry = through_flaky(flaky.clone(), Tool::idempotent("flaky"));
    let wf = Workflow::new("pair", 1).step("post", StepKind::Write, move |ctx| {
        let flaky = flaky.clone();
        async move {
            let pool = ctx.pool().clone();
            let effect = |item: &'static str| {
                let (flaky, pool, key) = (flaky.clone(), pool.clone(), key(&ctx, item));
                let seen = flaky.calls(key.as_str()) > 0;
                let call = move |k: IdempotencyKey| {
                    let (flaky, pool) = (flaky.clone(), pool.clone());
                    async move {
                        *flaky
                            .calls
                            .lock()
                            .unwrap()
                            .entry(k.to_string())
                            .or_default() += 1;
                        if !flaky.healed.load(Ordering::SeqCst) {
                            return Err(StepError::temporary("flaky answered 503"));
                        }
                        post(&pool, k.as_str(), 1).await
                    }
                };
                let lookup = move |_k| async move {
                    Ok(if seen {
                        Lookup::NotDone
                    } else {
                        Lookup::CannotTell
                    })
                };
                let ctx = &ctx;
                async move {
                    let tool = Tool::not_idempotent("flaky");
                    ctx.tool_effect(&tool, &key, &json!({ "row": item }), call, lookup)
                        .await
                }
            };
            let (a, b) = tokio::join!(effect("a"), effect("b"));
            Ok(StepOutcome::finish(json!([a?, b?])))
        }
    });
    registry.register(wf);
    registry
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_after_its_intent_was_recorded_withdraws_it() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let flaky = Arc::new(Flaky::default());
    let settings = breaker_settings(&env, 2, 2);
    let (_engine, running) = start(&env, settings, two_at_once(flaky.clone()));
    // Another run's two failed calls open the breaker; it stops there (2 attempts).
    env.start_run("flaky", "r-opener", json!({})).await;
    env.wait_status("r-opener", RunStatus::NeedsReview, WAIT)
        .await;
    env.start_run("pair", "r-pair", json!({})).await;
    env.wait_until("r-pair to wait for the breaker", WAIT, || async {
        breaker_waits(&env, "r-pair").await >= 1
    })
    .await;
    assert_eq!(
        effect_rows(&env, "r-pair").await,
        0,
        "refused before any intent"
    );
    // Back at the half-open breaker, both calls see the probe free and record their intents;
    // one takes the probe, the other is refused before its call and withdraws its intent.
    flaky.healed.store(true, Ordering::SeqCst);
    let done = common::eventually("r-pair to settle", WAIT, || async {
        let run = trailmark::store::runs::get(&env.pool, "r-pair")
            .await
            .unwrap();
        run.filter(|r| r.status.is_terminal() || r.status == RunStatus::NeedsReview)
    })
    .await
    .expect("r-pair did not settle");
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.handover);
    for item in ["a", "b"] {
        assert_eq!(
            flaky.calls(&format!("r-pair:post:{item}")),
            1,
            "call {item} made once"
        );
    }
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_calls_at_once_keep_failing_behind_their_breaker_still_reaches_its_cap() {
    // At each half-open moment one of the step's two calls is the probe (a real call, failing)
    // and the other is refused: the attempt made a call, so it counts, and the run ends.
    let env = TestEnv::new().await;
    ledger(&env).await;
    let flaky = Arc::new(Flaky::default());
    let settings = breaker_settings(&env, 1, 3);
    let max = settings.worker.max_attempts as i64;
    let (_engine, running) = start(&env, settings, two_at_once(flaky.clone()));
    env.start_run("pair", "r-pair-down", json!({})).await;
    let stopped = env
        .wait_status("r-pair-down", RunStatus::NeedsReview, WAIT)
        .await;
    let note = stopped.handover.expect("handover note");
    assert!(
        note["error"]
            .as_str()
            .unwrap()
            .contains(&format!("failed temporarily {max} times")),
        "{note}"
    );
    assert_eq!(env.attempts("r-pair-down", 0).await, max);
    assert_eq!(ledger_rows(&env).await, 0);
    running.stop().await;
}

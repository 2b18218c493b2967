//! Human handover and compensation against the real servers: resume, resume after
//! a fix on new code, undo (full, scoped, interrupted by kill -9), approve and reject.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Running, TestEnv};
use serde_json::{Value, json};
use trailmark::domain::{IdempotencyKey, RunStatus};
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::guard::Budget;
use trailmark::model::{ChatMessage, ChatRequest};
use trailmark::operator::{self, Decider, Resume, UndoOptions};
use trailmark::store::{decisions, runs};
use trailmark::workflow::{Registry, StepContext, StepError, StepKind, StepOutcome, Workflow};

const WAIT: Duration = Duration::from_secs(90);

fn who(reason: &str) -> Decider {
    Decider::cli("maria.ops", reason)
}

fn engine(env: &TestEnv, wf: Workflow) -> Arc<Engine> {
    let mut registry = Registry::new();
    registry.register(wf);
    Engine::with_pool(
        env.settings.clone(),
        registry,
        Failpoints::default(),
        env.pool.clone(),
    )
    .unwrap()
}

fn serve(env: &TestEnv, wf: Workflow) -> (Arc<Engine>, Running) {
    let e = engine(env, wf);
    let r = env.spawn_all(e.clone());
    (e, r)
}

async fn ledger(env: &TestEnv) {
    sqlx::query(
        "CREATE TABLE payables (reference TEXT PRIMARY KEY, supplier TEXT NOT NULL, amount BIGINT NOT NULL,
                                reverses TEXT REFERENCES payables (reference))",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query("CREATE TABLE outbox_mail (key TEXT PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&env.pool)
        .await
        .unwrap();
}

async fn insert(
    pool: &sqlx::PgPool,
    reference: &str,
    supplier: &str,
    amount: i64,
    reverses: Option<&str>,
) -> Result<Value, StepError> {
    sqlx::query("INSERT INTO payables VALUES ($1, $2, $3, $4) ON CONFLICT (reference) DO NOTHING")
        .bind(reference)
        .bind(supplier)
        .bind(amount)
        .bind(reverses)
        .execute(pool)
        .await
        .map_err(|e| StepError::temporary(e.to_string()))?;
    Ok(json!({ "reference": reference }))
}

async fn mail(pool: &sqlx::PgPool, key: &str, body: &str) -> Result<Value, StepError> {
    sqlx::query("INSERT INTO outbox_mail VALUES ($1, $2) ON CONFLICT (key) DO NOTHING")
        .bind(key)
        .bind(body)
        .execute(pool)
        .await
        .map_err(|e| StepError::temporary(e.to_string()))?;
    Ok(json!({ "key": key }))
}

const ITEMS: [(&str, &str, i64); 5] = [
    ("a1", "S-01", 10),
    ("a2", "S-07", 20),
    ("a3", "S-07", 30),
    ("a4", "S-02", 40),
    ("a5", "S-07", 50),
];

/// Posts five payables, then mails the suppliers; both are undoable.
fn payables() -> Workflow {
    Workflow::new("payables", 1)
        .step("post", StepKind::Write, |ctx| async move {
            for (item, supplier, amount) in ITEMS {
                let key = IdempotencyKey::for_step(ctx.run_id(), "post", item);
                let pool = ctx.pool().clone();
                let reference = key.to_string();
                ctx.effect(&key, &json!({"amount": amount}), |_| async move {
                    insert(&pool, &reference, supplier, amount, None).await
                })
                .await?;
            }
            Ok(StepOutcome::next(json!({ "posted": ITEMS.len() })))
        })
        .key_recipe("run_id:post:item")
        .compensate("posts a reversal per payable in scope", |ctx| async move {
            let scope = ctx.undo().unwrap().scope.clone();
            let mut reversed = 0;
            for (item, supplier, amount) in ITEMS {
                if scope.get("supplier").is_some_and(|s| s != supplier) {
                    continue;
                }
                let original = IdempotencyKey::for_step(ctx.run_id(), "post", item);
                let (pool, reference, orig) = (
                    ctx.pool().clone(),
                    original.undo_of().to_string(),
                    original.to_string(),
                );
                ctx.effect(&original.undo_of(), &json!({"amount": -amount}), |_| async move {
                    insert(&pool, &reference, supplier, -amount, Some(&orig)).await
                })
                .await?;
                reversed += 1;
            }
            Ok(StepOutcome::next(json!({ "reversed": reversed })))
        })
        .step("notify", StepKind::Message, |ctx| async move {
            let key = IdempotencyKey::for_step(ctx.run_id(), "notify", "all");
            let (pool, k) = (ctx.pool().clone(), key.to_string());
            ctx.effect(&key, &json!({}), |_| async move {
                mail(&pool, &k, "debit notes").await
            })
            .await?;
            Ok(StepOutcome::next(json!({})))
        })
        .key_recipe("run_id:notify:all")
        .compensate("sends one withdrawal note", |ctx| async move {
            let original = IdempotencyKey::for_step(ctx.run_id(), "notify", "all");
            let (pool, k) = (ctx.pool().clone(), original.undo_of().to_string());
            ctx.effect(&original.undo_of(), &json!({}), |_| async move {
                mail(&pool, &k, "withdrawal of the debit notes").await
            })
            .await?;
            Ok(StepOutcome::next(json!({})))
        })
}

async fn payables_sum(env: &TestEnv) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(reverses), COALESCE(sum(amount), 0)::bigint FROM payables",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// Serves `wf` (the `payables` ledger in place), runs `run_id` to success, undoes it with `opts`
/// and waits until the undo has finished.
async fn succeed_then_undo(wf: Workflow, run_id: &str, reason: &str, opts: UndoOptions) -> TestEnv {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let (engine, running) = serve(&env, wf);
    env.start_run("payables", run_id, json!({})).await;
    env.wait_status(run_id, RunStatus::Succeeded, WAIT).await;
    operator::undo(&engine, run_id, &who(reason), opts)
        .await
        .unwrap();
    let run = env.wait_status(run_id, RunStatus::Compensated, WAIT).await;
    assert_eq!(run.error, None);
    running.stop().await;
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_undo_reverses_every_write_newest_first_and_ends_compensated() {
    let env = succeed_then_undo(
        payables(),
        "r-undo",
        "supplier disputes everything",
        UndoOptions::everything(),
    )
    .await;
    assert_eq!(
        payables_sum(&env).await,
        (10, 5, 0),
        "5 originals + 5 reversals summing to 0"
    );
    let mails: Vec<String> = sqlx::query_scalar("SELECT key FROM outbox_mail ORDER BY key")
        .fetch_all(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        mails,
        vec!["r-undo:notify:all", "undo:r-undo:notify:all"],
        "one withdrawal"
    );
    let order: Vec<String> = sqlx::query_scalar("SELECT step FROM trailmark.steps WHERE run_id = 'r-undo' AND step LIKE 'undo:%' ORDER BY seq")
        .fetch_all(&env.pool)
        .await
        .unwrap();
    assert_eq!(order, vec!["undo:notify@1", "undo:post@0"], "newest first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_of_a_run_that_used_its_whole_tool_budget_still_reverses_everything() {
    // Five payables and one mail: exactly the budget, so the forward run succeeds with none left.
    let wf = payables().with_budget(Budget {
        max_tool_calls: 6,
        ..Default::default()
    });
    let env = succeed_then_undo(
        wf,
        "r-spent",
        "wrong supplier file",
        UndoOptions::everything(),
    )
    .await;
    assert_eq!(payables_sum(&env).await, (10, 5, 0));
}

/// One payable whose compensation posts its reversal and then, while `broken`, stops with an
/// error nobody can classify: an undo that stops halfway, in `needs_review`.
fn reversal_stops(broken: Arc<AtomicBool>) -> Workflow {
    Workflow::new("payables", 1)
        .step("post", StepKind::Write, |ctx| async move {
            let key = IdempotencyKey::for_step(ctx.run_id(), "post", "a1");
            let (pool, reference) = (ctx.pool().clone(), key.to_string());
            ctx.effect(&key, &json!({"amount": 10}), |_| async move {
                insert(&pool, &reference, "S-01", 10, None).await
            })
            .await?;
            Ok(StepOutcome::next(json!({})))
        })
        .key_recipe("run_id:post:item")
        .compensate("posts a reversal", move |ctx| {
            let broken = broken.clone();
            async move {
                let original = IdempotencyKey::for_step(ctx.run_id(), "post", "a1");
                let (pool, reference, orig) = (
                    ctx.pool().clone(),
                    original.undo_of().to_string(),
                    original.to_string(),
                );
                ctx.effect(
                    &original.undo_of(),
                    &json!({"amount": -10}),
                    |_| async move { insert(&pool, &reference, "S-01", -10, Some(&orig)).await },
                )
                .await?;
                if broken.load(Ordering::SeqCst) {
                    return Err(StepError::Unknown("the ledger's reply looked odd".into()));
                }
                Ok(StepOutcome::next(json!({})))
            }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undo_that_stopped_halfway_can_be_undone_again_without_leaving_its_reversals() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let broken = Arc::new(AtomicBool::new(true));
    let (engine, running) = serve(&env, reversal_stops(broken.clone()));
    env.start_run("payables", "r-again", json!({})).await;
    env.wait_status("r-again", RunStatus::Succeeded, WAIT).await;
    operator::undo(
        &engine,
        "r-again",
        &who("wrong file"),
        UndoOptions::everything(),
    )
    .await
    .unwrap();
    env.wait_status("r-again", RunStatus::NeedsReview, WAIT)
        .await;
    broken.store(false, Ordering::SeqCst);
    // The stopped compensation's own reversal is not a write left standing: undo goes ahead.
    operator::undo(
        &engine,
        "r-again",
        &who("ledger checked"),
        UndoOptions::everything(),
    )
    .await
    .unwrap();
    env.wait_status("r-again", RunStatus::Compensated, WAIT)
        .await;
    assert_eq!(payables_sum(&env).await, (2, 1, 0), "one reversal, once");
    running.stop().await;
}

/// Posts two payables, then stops with an error nobody can classify: the run waits for a person
/// with two writes of an unfinished step behind it.
fn stops_halfway() -> Workflow {
    Workflow::new("halfway", 1)
        .step("post", StepKind::Write, |ctx| async move {
            for (item, supplier, amount) in &ITEMS[..2] {
                let key = IdempotencyKey::for_step(ctx.run_id(), "post", item);
                let (pool, reference) = (ctx.pool().clone(), key.to_string());
                ctx.effect(&key, &json!({"amount": amount}), |_| async move {
                    insert(&pool, &reference, supplier, *amount, None).await
                })
                .await?;
            }
            Err(StepError::Unknown(
                "the third payable's scan is unreadable".into(),
            ))
        })
        .key_recipe("run_id:post:item")
        .compensate("posts a reversal per payable", |_ctx| async move {
            Ok(StepOutcome::next(json!({})))
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_refuses_to_leave_a_stopped_steps_writes_silently_and_lists_them_when_told_to() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let (engine, running) = serve(&env, stops_halfway());
    env.start_run("halfway", "r-half", json!({})).await;
    env.wait_status("r-half", RunStatus::NeedsReview, WAIT)
        .await;
    let refused = operator::undo(
        &engine,
        "r-half",
        &who("start over"),
        UndoOptions::everything(),
    )
    .await
    .unwrap_err()
    .to_string();
    for expected in [
        "r-half:post:a1",
        "r-half:post:a2",
        "trailmark run resume r-half",
        "--leave-partial",
    ] {
        assert!(
            refused.contains(expected),
            "{expected:?} missing from: {refused}"
        );
    }
    let run = runs::get(&env.pool, "r-half").await.unwrap().unwrap();
    assert_eq!(
        run.status,
        RunStatus::NeedsReview,
        "a refused undo changes nothing"
    );
    assert_eq!(payables_sum(&env).await, (2, 0, 30));

    let opts = UndoOptions {
        leave_partial: true,
        ..UndoOptions::everything()
    };
    let outcome = operator::undo(&engine, "r-half", &who("reversing by hand"), opts)
        .await
        .unwrap();
    assert!(
        outcome.next.contains("r-half:post:a1, r-half:post:a2"),
        "{}",
        outcome.next
    );
    env.wait_status("r-half", RunStatus::Compensated, WAIT)
        .await;
    assert_eq!(
        payables_sum(&env).await,
        (2, 0, 30),
        "left standing, as told"
    );
    let plan: Value = sqlx::query_scalar("SELECT undo FROM trailmark.runs WHERE run_id = 'r-half'")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        plan["left_standing"],
        json!(["r-half:post:a1", "r-half:post:a2"])
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_undo_reverses_only_the_selected_supplier() {
    let env = succeed_then_undo(
        payables(),
        "r-scope",
        "S-07 says its mismatches were wrong",
        UndoOptions::scoped(json!({"supplier": "S-07"})),
    )
    .await;
    let reversed: Vec<String> = sqlx::query_scalar(
        "SELECT reverses FROM payables WHERE reverses IS NOT NULL ORDER BY reverses",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        reversed,
        vec!["r-scope:post:a2", "r-scope:post:a3", "r-scope:post:a5"]
    );
    assert_eq!(payables_sum(&env).await.2, 10 + 40, "S-01 and S-02 stand");
    let decisions = decisions::list(&env.pool, "r-scope").await.unwrap();
    assert_eq!(decisions.len(), 1);
    assert_eq!(
        (decisions[0].action.as_str(), decisions[0].actor.as_str()),
        ("undo", "maria.ops")
    );
    assert_eq!(decisions[0].details["scope"], json!({"supplier": "S-07"}));
}

/// A model step, then a write step that fails while `broken` is set.
fn fragile(broken: Arc<AtomicBool>, version: i32) -> Workflow {
    Workflow::new("fragile", version)
        .step("ask", StepKind::Model, |ctx| async move {
            let a = ctx
                .model(&ChatRequest::new(vec![ChatMessage::user(
                    "classify invoice 7",
                )]))
                .await?;
            Ok(StepOutcome::next(json!({ "answer": a.content })))
        })
        .step("post", StepKind::Write, move |ctx: StepContext| {
            let broken = broken.clone();
            async move {
                if broken.load(Ordering::SeqCst) {
                    return Err(StepError::Unknown(
                        "ledger rejected the entry: account 4711 is closed".into(),
                    ));
                }
                Ok(StepOutcome::finish(
                    json!({ "posted": true, "workflow": ctx.workflow() }),
                ))
            }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_review_then_resume_finishes_without_repeating_completed_steps() {
    let env = TestEnv::new().await;
    let broken = Arc::new(AtomicBool::new(true));
    let (engine, running) = serve(&env, fragile(broken.clone(), 1));
    env.start_run("fragile", "r-resume", json!({})).await;
    let run = env
        .wait_status("r-resume", RunStatus::NeedsReview, WAIT)
        .await;
    assert!(
        run.handover.unwrap()["error"]
            .as_str()
            .unwrap()
            .contains("account 4711 is closed")
    );
    // The stopped step is held for review, not running.
    let out = env.command(&["run", "show", "r-resume"]).output().unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    let post = shown
        .lines()
        .find(|l| l.split_whitespace().take(2).eq(["1", "post"]))
        .unwrap_or_default();
    assert!(post.trim_end().ends_with("in review"), "{shown}");
    broken.store(false, Ordering::SeqCst);
    let out = operator::resume(
        &engine,
        "r-resume",
        &who("account reopened by finance"),
        Resume::Again,
    )
    .await
    .unwrap();
    assert_eq!(
        (out.status_before.as_str(), out.status_after.as_str()),
        ("needs_review", "running")
    );
    env.wait_status("r-resume", RunStatus::Succeeded, WAIT)
        .await;
    // The timeline says who resumed the step, not that an attempt was lost.
    let lines: Vec<String> = sqlx::query_scalar(
        "SELECT line FROM trailmark.progress WHERE run_id = 'r-resume' AND seq = 1 ORDER BY at",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("attempt 2: resumed by maria.ops (account reopened by finance)"))
            && !lines.iter().any(|l| l.contains("did not finish")),
        "{lines:?}"
    );
    let attempts: Vec<(String, i32)> = sqlx::query_as(
        "SELECT step, attempts FROM trailmark.steps WHERE run_id = 'r-resume' ORDER BY seq",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        attempts,
        vec![("ask".into(), 1), ("post".into(), 2)],
        "the model step did not run again"
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            "r-resume"
        )
        .await,
        1
    );
    let err = operator::resume(&engine, "r-resume", &who("again"), Resume::Again)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("it is succeeded"), "{err}");
    running.stop().await;
}

/// One model step whose prompt is fixed in version 2; version 1 cannot use its answer.
fn extractor(version: i32) -> Workflow {
    Workflow::new("extractor", version).step("extract", StepKind::Model, move |ctx| async move {
        let answer = ctx.model(&extract_request(version)).await?;
        if version == 1 {
            return Err(StepError::Unknown(
                "the answer is not line-item JSON".into(),
            ));
        }
        Ok(StepOutcome::finish(json!({ "items": answer.content })))
    })
}

fn extract_request(version: i32) -> ChatRequest {
    let prompt = match version {
        1 => "list the line items of invoice 7",
        _ => "list the line items of invoice 7 as a JSON array",
    };
    ChatRequest::new(vec![ChatMessage::user(prompt)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_prompt_fix_resume_asks_the_model_again_only_when_told_and_keeps_the_old_answer() {
    let env = TestEnv::new().await;
    let (_, running) = serve(&env, extractor(1));
    env.start_run("extractor", "r-prompt", json!({})).await;
    env.wait_status("r-prompt", RunStatus::NeedsReview, WAIT)
        .await;
    running.stop().await;

    let (v2, running) = serve(&env, extractor(2));
    // Replaying the journaled answer of the old prompt cannot work: the run says so, and how.
    operator::resume(
        &v2,
        "r-prompt",
        &who("prompt asks for JSON now"),
        Resume::AfterFix,
    )
    .await
    .unwrap();
    let run = env
        .wait_status("r-prompt", RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    assert!(error.contains("differs from the journaled one"), "{error}");
    assert!(error.contains("--after-fix --ask-again"), "{error}");

    let out = operator::resume(
        &v2,
        "r-prompt",
        &who("prompt asks for JSON now; ask again"),
        Resume::AfterFixAskAgain,
    )
    .await
    .unwrap();
    assert!(
        out.next.contains("1 journaled answer set aside"),
        "{}",
        out.next
    );
    env.wait_status("r-prompt", RunStatus::Succeeded, WAIT)
        .await;
    let hashes = |sql: &'static str| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sql)
                .fetch_all(&pool)
                .await
                .unwrap()
        }
    };
    let hash =
        |v| trailmark::domain::request_hash(&serde_json::to_value(extract_request(v)).unwrap());
    assert_eq!(
        hashes("SELECT request_hash FROM trailmark.journal WHERE run_id = 'r-prompt'").await,
        vec![hash(2)],
        "the journal holds the new answer"
    );
    assert_eq!(
        hashes("SELECT request_hash FROM trailmark.journal_set_aside WHERE run_id = 'r-prompt'")
            .await,
        vec![hash(1)],
        "the paid answer is kept"
    );
    let spent = trailmark::store::journal::totals(&env.pool, "r-prompt")
        .await
        .unwrap();
    assert_eq!(spent.entries, 2, "both answers were paid for");
    let d = decisions::list(&env.pool, "r-prompt").await.unwrap();
    assert_eq!(d.len(), 2);
    assert_eq!(d[1].details["answers_set_aside"], 1);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_fix_continues_on_the_new_version_and_records_it() {
    let env = TestEnv::new().await;
    let mut settings = env.settings.clone();
    settings.worker.max_attempts = 1;
    let broken_v1 = Arc::new(AtomicBool::new(true));
    let mut registry = Registry::new();
    registry.register(fragile(broken_v1, 1));
    let v1 = Engine::with_pool(
        settings.clone(),
        registry,
        Failpoints::default(),
        env.pool.clone(),
    )
    .unwrap();
    let running = env.spawn_all(v1.clone());
    env.start_run("fragile", "r-fix", json!({})).await;
    env.wait_status("r-fix", RunStatus::NeedsReview, WAIT).await;
    let refused = operator::resume(&v1, "r-fix", &who("try again"), Resume::Again)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("--after-fix"), "{refused}");
    running.stop().await;

    // Deploy v2 with the fix: a new engine with the fixed handler.
    let mut registry = Registry::new();
    registry.register(fragile(Arc::new(AtomicBool::new(false)), 2));
    let v2 =
        Engine::with_pool(settings, registry, Failpoints::default(), env.pool.clone()).unwrap();
    let running = env.spawn_all(v2.clone());
    operator::resume(
        &v2,
        "r-fix",
        &who("deployed fix for closed accounts"),
        Resume::AfterFix,
    )
    .await
    .unwrap();
    let run = env.wait_status("r-fix", RunStatus::Succeeded, WAIT).await;
    assert_eq!(run.workflow_version, 2);
    let d = decisions::list(&env.pool, "r-fix").await.unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(
        (
            d[0].action.as_str(),
            d[0].version_before,
            d[0].version_after
        ),
        ("resume_after_fix", 1, 2)
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            "r-fix"
        )
        .await,
        1
    );
    running.stop().await;
}

fn approval() -> Workflow {
    Workflow::new("approval", 1)
        .step("prepare", StepKind::Read, |_ctx| async move {
            Ok(StepOutcome::next(json!({ "total": 1234 })))
        })
        .step("sign_off", StepKind::Human, |ctx| async move {
            let total = ctx.output_of("prepare").await?.unwrap_or_default()["total"].clone();
            // Work a human step does before asking is kept: the step does not run again.
            ctx.park("inv-77", "amount above the approval limit");
            Ok(StepOutcome::wait(
                json!({ "question": "pay the supplier?", "total": total }),
            ))
        })
        .on_reject("fallback")
        .step("pay", StepKind::Write, |_ctx| async move {
            Ok(StepOutcome::finish(json!({ "paid": true })))
        })
        .step("fallback", StepKind::Read, |_ctx| async move {
            Ok(StepOutcome::finish(json!({ "paid": false })))
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_and_reject_of_a_human_step_continue_or_divert_and_show_in_the_timeline() {
    let env = TestEnv::new().await;
    let (engine, running) = serve(&env, approval());
    for run_id in ["r-yes", "r-no"] {
        env.start_run("approval", run_id, json!({})).await;
        let run = env.wait_status(run_id, RunStatus::Waiting, WAIT).await;
        assert_eq!(run.handover.unwrap()["question"]["total"], 1234);
        let parked = trailmark::store::parked::list(&env.pool, run_id)
            .await
            .unwrap();
        assert_eq!(parked.len(), 1, "the human step's parked item was dropped");
    }
    let wrong = operator::approve(&engine, "r-yes", "pay", &who("x"))
        .await
        .unwrap_err();
    assert!(
        wrong.to_string().contains("waits at step sign_off"),
        "{wrong}"
    );
    operator::approve(&engine, "r-yes", "sign_off", &who("amount matches the PO"))
        .await
        .unwrap();
    operator::reject(&engine, "r-no", "sign_off", &who("duplicate invoice"))
        .await
        .unwrap();
    assert_eq!(
        env.wait_status("r-yes", RunStatus::Succeeded, WAIT)
            .await
            .output
            .unwrap()["paid"],
        true
    );
    assert_eq!(
        env.wait_status("r-no", RunStatus::Succeeded, WAIT)
            .await
            .output
            .unwrap()["paid"],
        false
    );
    let out = env.command(&["run", "show", "r-no"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("reject step sign_off by maria.ops") && text.contains("duplicate invoice"),
        "{text}"
    );
    let d = decisions::list(&env.pool, "r-yes").await.unwrap();
    assert_eq!(
        (
            d[0].action.as_str(),
            d[0].reason.as_str(),
            d[0].status_after.as_str()
        ),
        ("approve", "amount matches the PO", "running")
    );
    running.stop().await;
}

fn frozen() -> Workflow {
    Workflow::new("frozen", 1)
        .step("read", StepKind::Read, |ctx| async move {
            ctx.park("inv-9", "scan unreadable");
            Ok(StepOutcome::next(json!({})))
        })
        .step("email", StepKind::Message, |_ctx| async move {
            Ok(StepOutcome::finish(json!({ "sent": true })))
        })
        .freeze_unless_clear()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_irreversible_step_waits_while_an_item_is_in_doubt_until_approved() {
    let env = TestEnv::new().await;
    let (engine, running) = serve(&env, frozen());
    env.start_run("frozen", "r-freeze", json!({})).await;
    let run = env.wait_status("r-freeze", RunStatus::Waiting, WAIT).await;
    let note = run.handover.unwrap();
    assert_eq!(note["parked"][0]["item"], "inv-9", "{note}");
    assert_eq!(run.step.as_ref().map(|s| s.as_str()), Some("email"));
    operator::approve(
        &engine,
        "r-freeze",
        "email",
        &who("inv-9 is handled by hand"),
    )
    .await
    .unwrap();
    let run = env
        .wait_status("r-freeze", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(run.output.unwrap()["sent"], true);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_killed_halfway_resumes_with_each_reversal_exactly_once() {
    let env = TestEnv::new().await;
    let _first = env.spawn_process(None);
    env.start_run("chain", "r-undo-kill", json!({"steps": 60}))
        .await;
    env.wait_status("r-undo-kill", RunStatus::Succeeded, WAIT)
        .await;
    drop(_first);
    // The undo's 30th reversal kills its worker after the reversal is written, before its commit.
    let mut undoer = env.spawn_process(Some("chain.after_reversal=kill@30"));
    let out = env
        .command(&[
            "run",
            "undo",
            "r-undo-kill",
            "--reason",
            "drill",
            "--actor",
            "ops",
            "--yes",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = tokio::task::spawn_blocking(move || undoer.wait())
        .await
        .unwrap();
    assert!(!status.success(), "the undo worker should have been killed");
    let _second = env.spawn_process(None);
    env.wait_status("r-undo-kill", RunStatus::Compensated, WAIT)
        .await;
    let (rows, distinct): (i64, i64) = sqlx::query_as("SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger WHERE run_id = 'r-undo-kill' AND reference LIKE 'undo:%'")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!((rows, distinct), (60, 60), "each reversal exactly once");
    let repeated = env.scalar("SELECT count(*) FROM trailmark.steps WHERE run_id = $1 AND step LIKE 'undo:%' AND attempts > 1", "r-undo-kill").await;
    assert_eq!(
        repeated, 1,
        "only the compensation in flight at the kill ran twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_that_do_not_fit_the_status_are_refused_by_the_cli() {
    let env = TestEnv::new().await;
    let (_engine, running) = serve(&env, trailmark_testkit::chain::workflow());
    env.start_run("chain", "r-cli", json!({"steps": 2})).await;
    env.wait_status("r-cli", RunStatus::Succeeded, WAIT).await;
    let out = env
        .command(&["run", "resume", "r-cli", "--reason", "why not"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("cannot resume run r-cli: it is succeeded"),
        "{err}"
    );
    let out = env
        .command(&["run", "undo", "r-cli", "--reason", "x"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("add --yes"), "{err}");
    // Before asking, it lists the reversals it would write, newest first.
    let (second, first) = (
        err.find("undo:r-cli:link:1")
            .expect("the reversal of position 1 listed"),
        err.find("undo:r-cli:link:0")
            .expect("the reversal of position 0 listed"),
    );
    assert!(second < first, "newest first: {err}");
    assert_eq!(
        runs::get(&env.pool, "r-cli").await.unwrap().unwrap().status,
        RunStatus::Succeeded,
        "nothing changed"
    );
    let out = env.command(&["contract", "chain"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("key run_id:link:position") && text.contains("reversal"),
        "{text}"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_waiting_past_the_human_timeout_is_escalated_to_review() {
    let env = TestEnv::new().await;
    let mut settings = env.settings.clone();
    settings.supervisor.human_timeout_secs = 1;
    let mut registry = Registry::new();
    registry.register(approval());
    registry.register(frozen());
    let engine =
        Engine::with_pool(settings, registry, Failpoints::default(), env.pool.clone()).unwrap();
    let running = env.spawn_all(engine.clone());
    env.start_run("approval", "r-late", json!({})).await;
    // A step frozen while an item is in doubt waits for a person too (an `approval` note).
    env.start_run("frozen", "r-doubt", json!({})).await;
    let run = env
        .wait_status("r-late", RunStatus::NeedsReview, WAIT)
        .await;
    let note = run.handover.unwrap();
    assert_eq!(note["error_class"], "human_timeout");
    assert_eq!(
        note["waiting_for"]["question"]["question"],
        "pay the supplier?"
    );
    let d = decisions::list(&env.pool, "r-late").await.unwrap();
    assert_eq!(
        (d[0].action.as_str(), d[0].actor.as_str()),
        ("timeout", "supervisor")
    );
    let doubt = env
        .wait_status("r-doubt", RunStatus::NeedsReview, WAIT)
        .await;
    assert_eq!(
        doubt.handover.unwrap()["waiting_for"]["waiting_for"],
        "approval"
    );
    // Resuming asks the person again, and the wait counts from then: a second escalation.
    operator::resume(&engine, "r-late", &who("back from holiday"), Resume::Again)
        .await
        .unwrap();
    env.wait_status("r-late", RunStatus::Waiting, WAIT).await;
    env.wait_status("r-late", RunStatus::NeedsReview, WAIT)
        .await;
    let d = decisions::list(&env.pool, "r-late").await.unwrap();
    let actions: Vec<&str> = d.iter().map(|d| d.action.as_str()).collect();
    assert_eq!(actions, ["timeout", "resume", "timeout"]);
    running.stop().await;
}

/// Two steps; each says which version ran it. Version 2 renamed the second step, so a run of
/// version 1 cannot simply go on there.
fn upgraded(version: i32) -> Workflow {
    let second = if version == 1 { "post" } else { "post_v2" };
    Workflow::new("upgraded", version)
        .step("read", StepKind::Read, move |_ctx| async move {
            Ok(StepOutcome::next(json!({ "read_by": version })))
        })
        .step(second, StepKind::Write, move |_ctx| async move {
            Ok(StepOutcome::finish(json!({ "posted_by": version })))
        })
}

/// A run of `version` created and queued at its first step, as a worker of that version left it.
async fn queue_run_of_version(env: &TestEnv, run: &str, version: i32) {
    let run_id = trailmark::domain::RunId::parse(run).unwrap();
    let first: trailmark::domain::StepAddress = "read".into();
    let new = runs::NewRun {
        run_id: &run_id,
        workflow: "upgraded",
        version,
        first_step: &first,
        input: &json!({}),
        parent: None,
        traceparent: None,
        flow_key: None,
        priority: 2,
    };
    assert!(runs::insert(&env.pool, &new).await.unwrap());
    let msg = env
        .topology()
        .step_message(&run_id, "upgraded", version, &first, 0);
    env.publish(&trailmark::relay::to_outgoing(&msg)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_stops_older_runs_for_review_and_holds_newer_steps_for_new_workers() {
    let env = TestEnv::new().await;
    // An old (v1) worker still running while the run already moved to v2: it holds the
    // message back (delay queue) instead of dead-lettering it.
    let (old, running) = serve(&env, upgraded(1));
    queue_run_of_version(&env, "r-newer", 2).await;
    env.wait_until("the v1 worker to hold the v2 step back", WAIT, || async {
        old.stats.delayed.load(Ordering::Relaxed) > 0
    })
    .await;
    running.stop().await;
    assert_eq!(old.stats.dead_lettered.load(Ordering::Relaxed), 0);
    // The new (v2) worker takes it, and a run still on v1 stops for a person, with advice.
    let (new, running) = serve(&env, upgraded(2));
    let done = env.wait_status("r-newer", RunStatus::Succeeded, WAIT).await;
    assert_eq!(done.output.unwrap()["posted_by"], 2);
    queue_run_of_version(&env, "r-older", 1).await;
    let stopped = env
        .wait_status("r-older", RunStatus::NeedsReview, WAIT)
        .await;
    let error = stopped.error.unwrap();
    assert!(error.contains("was started on upgraded v1"), "{error}");
    assert!(error.contains("run resume r-older --after-fix"), "{error}");
    assert_eq!(
        env.steps_done("r-older").await,
        0,
        "nothing ran on v2 by itself"
    );
    // The person checked the checkpoints and moves the run to v2.
    operator::resume(
        &new,
        "r-older",
        &who("checked: v2 reads the same input"),
        Resume::AfterFix,
    )
    .await
    .unwrap();
    let done = env.wait_status("r-older", RunStatus::Succeeded, WAIT).await;
    assert_eq!(done.output.unwrap()["posted_by"], 2);
    assert_eq!(new.stats.dead_lettered.load(Ordering::Relaxed), 0);
    running.stop().await;
}

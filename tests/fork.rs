//! Fork and replay: a live fork of a `chain` run from position 5 runs only positions 5 to 9,
//! under its own keys; a shadow fork of the reference night with a changed model answer shows
//! what would change and touches nothing outside; lineage in `run show --json`; clear refusals.

mod common;
mod reference_support;

use std::sync::Arc;
use std::time::Duration;

use common::{TestEnv, text};
use reference_support::{RefEnv, WAIT};
use serde_json::{Value, json};
use trailmark::diff;
use trailmark::domain::RunStatus;
use trailmark::failpoint::Failpoints;
use trailmark::operator::{self, Decider, ForkPoint, ForkRequest};
use trailmark::workflow::{Registry, StepError, StepKind, StepOutcome, Workflow};
use trailmark_reference::{extract, mail, workflow as reconcile};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};

const SHORT: Duration = Duration::from_secs(60);

fn who() -> Decider {
    Decider::cli("fern", "what would it do from here")
}

fn fork_at(from: ForkPoint, run_id: &str, shadow: bool) -> ForkRequest {
    ForkRequest {
        from,
        run_id: Some(run_id.into()),
        input: None,
        shadow,
        answers_from: None,
    }
}

/// (seq, call_no, request hash, answer) of a run's journal before position `before`.
async fn journal_before(
    env: &TestEnv,
    run_id: &str,
    before: i32,
) -> Vec<(i32, i32, String, Value)> {
    sqlx::query_as(
        "SELECT seq, call_no, request_hash, response FROM trailmark.journal
          WHERE run_id = $1 AND seq < $2 ORDER BY seq, call_no",
    )
    .bind(run_id)
    .bind(before)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_from_position_5_runs_only_the_rest_under_its_own_keys() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "c-parent", json!({ "steps": 10 }))
        .await;
    env.wait_status("c-parent", RunStatus::Succeeded, SHORT)
        .await;

    let plan = operator::fork(
        &engine,
        "c-parent",
        &fork_at(ForkPoint::Position(5), "c-fork", false),
        &who(),
    )
    .await
    .unwrap();
    assert_eq!(plan.writing_steps, vec!["link".to_string()], "{plan:?}");
    assert_eq!((plan.inherited_positions, plan.inherited_answers), (5, 5));
    env.wait_status("c-fork", RunStatus::Succeeded, SHORT).await;

    // Positions 0-4 were taken over, not run: the same answers, word for word, marked as
    // inherited, no claim, no effect; 5-9 ran under the fork's keys.
    let parent = journal_before(&env, "c-parent", 5).await;
    assert_eq!(journal_before(&env, "c-fork", 5).await, parent);
    let inherited = env
        .scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND inherited_from = 'c-parent'",
            "c-fork",
        )
        .await;
    assert_eq!(inherited, 5);
    for seq in 0..5 {
        assert_eq!(
            env.attempts("c-fork", seq).await,
            1,
            "position {seq} claimed again"
        );
    }
    let keys: Vec<(String, i32)> = sqlx::query_as(
        "SELECT idempotency_key, seq FROM trailmark.effects WHERE run_id = 'c-fork' ORDER BY seq",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let expected: Vec<(String, i32)> = (5..10).map(|i| (format!("c-fork:link:{i}"), i)).collect();
    assert_eq!(keys, expected);
    assert_eq!(env.chain_ledger("c-parent").await, (10, 10));
    assert_eq!(env.chain_ledger("c-fork").await, (5, 5));
    let refs: Vec<i32> = sqlx::query_scalar(
        "SELECT step FROM trailmark.chain_ledger WHERE run_id = 'c-fork' ORDER BY step",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(refs, (5..10).collect::<Vec<_>>());
    // The fork pays only for its own calls.
    let spent = env
        .scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND inherited_from IS NULL",
            "c-fork",
        )
        .await;
    assert_eq!(spent, 5);

    // Lineage, as `run show --json` prints it for either run.
    let show = |id: &str| {
        let out = env
            .command(&["run", "show", id, "--json"])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        serde_json::from_str::<Value>(&stdout).unwrap()
    };
    let fork = show("c-fork");
    assert_eq!(fork["lineage"]["parent"]["parent_run_id"], "c-parent");
    assert_eq!(fork["lineage"]["parent"]["from_seq"], 5);
    assert_eq!(fork["lineage"]["parent"]["actor"], "fern");
    let parent = show("c-parent");
    assert_eq!(parent["lineage"]["children"][0]["run_id"], "c-fork");

    let d = diff::compare(&env.pool, "c-parent", "c-fork")
        .await
        .unwrap();
    assert_eq!((d.inherited_before, d.compared), (5, 5));
    running.stop().await;
}

/// A workflow that stops for review at its second step.
fn stops_at_b() -> Workflow {
    Workflow::new("two", 1)
        .step("a", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::next(json!({ "a": 1 })))
        })
        .step("b", StepKind::Read, |_ctx| async {
            Err::<StepOutcome, _>(StepError::Unknown(
                "the supplier API answered nonsense".into(),
            ))
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_that_cannot_be_made_are_refused_with_what_to_do() {
    let env = TestEnv::new().await;
    let mut registry: Registry = trailmark_testkit::registry();
    registry.register(stops_at_b());
    let engine = env.engine_with(registry, Failpoints::default());
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "c-done", json!({ "steps": 3 }))
        .await;
    env.start_run("two", "t-review", json!({})).await;
    env.wait_status("c-done", RunStatus::Succeeded, SHORT).await;
    env.wait_status("t-review", RunStatus::NeedsReview, SHORT)
        .await;

    let refused = |r: Result<_, operator::Error>| match r {
        Err(e) => e.to_string(),
        Ok(plan) => panic!("a fork was made: {plan:?}"),
    };
    let cases = [
        ("nope", ForkPoint::Position(0), "run nope not found"),
        (
            "c-done",
            ForkPoint::Step("nope".into()),
            "has no step \"nope\"",
        ),
        (
            "c-done",
            ForkPoint::Position(7),
            "no forward step at position 7; its positions are 0 to 2",
        ),
        (
            "t-review",
            ForkPoint::Position(1),
            "stopped for review at position 1",
        ),
    ];
    for (run, from, expected) in cases {
        let why = refused(operator::fork(&engine, run, &fork_at(from, "f-x", false), &who()).await);
        assert!(why.contains(expected), "{why}");
    }
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id = $1",
            "f-x"
        )
        .await,
        0,
        "a refused fork made a run"
    );
    // Before the failed step a fork of a run in review is allowed.
    operator::fork_plan(
        &engine,
        "t-review",
        &fork_at(ForkPoint::Position(0), "f-ok", false),
    )
    .await
    .unwrap();

    // The CLI asks before a live fork writes outside; with no terminal it refuses.
    let out = env
        .command(&["run", "fork", "c-done", "--from", "1", "--reason", "again"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("steps link write outside again") && stderr.contains("add --yes"),
        "{stderr}"
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM trailmark.forks WHERE parent_run_id = $1",
            "c-done"
        )
        .await,
        0
    );
    // A live fork of a shadow run would build on writes that never happened; a fork of an undone
    // run on writes that were reversed.
    let shadow = fork_at(ForkPoint::Position(1), "c-shadow", true);
    operator::fork(&engine, "c-done", &shadow, &who())
        .await
        .unwrap();
    env.wait_status("c-shadow", RunStatus::Shadowed, SHORT)
        .await;
    let live = fork_at(ForkPoint::Position(2), "f-x", false);
    let why = refused(operator::fork(&engine, "c-shadow", &live, &who()).await);
    assert!(why.contains("is a shadow run"), "{why}");
    let undo = operator::UndoOptions::scoped(json!({}));
    operator::undo(&engine, "c-done", &who(), undo)
        .await
        .unwrap();
    env.wait_status("c-done", RunStatus::Compensated, SHORT)
        .await;
    let why = refused(
        operator::fork(
            &engine,
            "c-done",
            &fork_at(ForkPoint::Position(1), "f-x", true),
            &who(),
        )
        .await,
    );
    assert!(why.contains("its undo reversed"), "{why}");
    running.stop().await;
}

/// The reference stand-in's answers, except that invoice `invoice_no` is read with 7 more units
/// on its first line: the model changed its mind.
fn changed_model(invoice_no: String) -> ModelServerOptions {
    let base = extract::responder();
    let responder: trailmark_standin::model_server::Responder = Arc::new(move |req| {
        let answer = base(req)?;
        let mut read: extract::Extracted = serde_json::from_str(&answer).ok()?;
        if read.invoice_no == invoice_no {
            read.lines[0].qty += 7;
        }
        serde_json::to_string(&read).ok()
    });
    ModelServerOptions {
        responder: Some(responder),
        ..Default::default()
    }
}

/// Every row of every table of the outside world, as text, sorted: a byte-for-byte snapshot of
/// the ledger, the stock records and the mail sink.
async fn outside_world(r: &RefEnv) -> Vec<String> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
          WHERE table_schema = 'reference' ORDER BY table_name",
    )
    .fetch_all(&r.outside)
    .await
    .unwrap();
    let mut rows = Vec::new();
    for t in tables {
        let sql = format!("SELECT '{t}: ' || t::text FROM reference.{t} t ORDER BY 1");
        let mut these: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&r.outside)
            .await
            .unwrap();
        rows.append(&mut these);
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_fork_with_a_changed_answer_shows_what_would_change_and_touches_nothing() {
    let mut r = RefEnv::new().await;
    r.start_mail_sender();
    let night = RefEnv::night(40, 6);
    let run_id = night.run_id().to_string();
    let engine = r
        .env
        .engine_with(trailmark_reference::registry(), Failpoints::default());
    let running = r.env.spawn_all(engine);
    r.start(&night).await;
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    let notes = mail::counts(&r.outside, &run_id).await.unwrap().notes;
    r.wait_sink(&run_id, notes, 1).await;
    running.stop().await;
    let before = outside_world(&r).await;

    // Replay the night from step 2 against a model that reads one invoice differently.
    let fetched: Value = r.output(&run_id, reconcile::FETCH).await;
    let invoice = fetched["scans"][0]["invoice_no"]
        .as_str()
        .unwrap()
        .to_owned();
    let model = ModelServer::start(changed_model(invoice.clone()))
        .await
        .unwrap();
    r.env.settings.model.base_url = model.base_url();
    let engine = r
        .env
        .engine_with(trailmark_reference::registry(), Failpoints::default());
    let running = r.env.spawn_all(engine.clone());
    let shadow = format!("{run_id}-shadow");
    let from = ForkPoint::Step(reconcile::EXTRACT.into());
    let plan = operator::fork(&engine, &run_id, &fork_at(from, &shadow, true), &who())
        .await
        .unwrap();
    assert_eq!(plan.from_seq, 1);
    r.env.wait_status(&shadow, RunStatus::Shadowed, WAIT).await;
    // A second shadow fork replays the night's own answers instead of asking the model: the
    // model is not called, and it would do exactly what the night did.
    let replay = format!("{run_id}-replay");
    let from = ForkPoint::Step(reconcile::EXTRACT.into());
    let again = ForkRequest {
        answers_from: Some(run_id.clone()),
        ..fork_at(from, &replay, true)
    };
    operator::fork(&engine, &run_id, &again, &who())
        .await
        .unwrap();
    r.env.wait_status(&replay, RunStatus::Shadowed, WAIT).await;
    running.stop().await;
    let same = diff::compare(&r.env.pool, &run_id, &replay).await.unwrap();
    // Same answers, same writes; only the write steps' outputs say "recorded" instead of
    // "written", as a shadow run's do.
    // The replay paid nothing: every answer it used was the night's.
    let night_paid = r
        .env
        .scalar(
            "SELECT COALESCE(sum(tokens), 0)::bigint FROM trailmark.journal WHERE run_id = $1 AND seq >= 1",
            &run_id,
        )
        .await;
    assert_eq!((same.compared, same.tokens_delta), (9, -night_paid));
    let differ: Vec<&str> = same
        .differences
        .iter()
        .inspect(|p| assert!(p.answers.is_empty() && p.writes.is_empty(), "{p:?}"))
        .filter_map(|p| p.b_step.as_deref())
        .collect();
    assert_eq!(differ, [reconcile::POST, reconcile::UPDATE_STOCK]);

    // Nothing outside changed, byte for byte; the shadow asked the model for every invoice.
    assert_eq!(outside_world(&r).await, before);
    assert_eq!(model.answered(), 40);

    let d = diff::compare(&r.env.pool, &run_id, &shadow).await.unwrap();
    assert_eq!(d.inherited_before, 1);
    let extract_diff = d
        .differences
        .iter()
        .find(|p| p.seq == 1)
        .expect("step 2 differs");
    assert_eq!(extract_diff.answers.len(), 1, "{extract_diff:?}");
    let answer = &extract_diff.answers[0];
    assert!(
        !answer.request_changed,
        "the prompt is the same: {answer:?}"
    );
    assert!(
        answer.b.as_deref().unwrap().contains(&invoice),
        "{answer:?}"
    );
    let post = d
        .differences
        .iter()
        .find(|p| p.b_step.as_deref() == Some(reconcile::POST))
        .expect("the ledger adjustments differ");
    assert!(!post.writes.is_empty(), "{post:?}");
    assert!(
        post.writes.iter().all(|w| w.key.contains(&invoice)),
        "only the invoice read differently changes the ledger: {post:?}"
    );
    // The same comparison as an operator reads it.
    let out = r
        .env
        .command(&["run", "diff", &run_id, &shadow])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("position 1 extract_line_items: output differs")
            && stdout.contains(&format!("effect only_b {{run}}:{invoice}")),
        "{stdout}"
    );
    eprintln!("{stdout}");
    // The shadow's would-be writes are kept: its ledger entries and its mail.
    let recorded: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM trailmark.shadow_writes WHERE run_id = $1 GROUP BY kind ORDER BY kind",
    )
    .bind(&shadow)
    .fetch_all(&r.env.pool)
    .await
    .unwrap();
    assert_eq!(
        recorded.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["effect", "message"]
    );
    model.shutdown().await;
}

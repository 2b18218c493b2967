//! Debounce of run starts (`flow::debounce`): of a burst of starts with one key only the last
//! becomes a run, with its own id and input; a repeat of any start of the burst starts nothing
//! more; a superseded start is named as such by the API and `trailmark run show`; a start
//! pending when its process is killed (or killed while it is being started) still becomes a run
//! once; a start without its key is refused naming the field.

mod api_support;
mod common;
mod dlq_support;

use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use api_support::Api;
use common::{TestEnv, text};
use dlq_support::{dead_letters, wait_dlq_depth};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use trailmark::Debounce;
use trailmark::domain::RunStatus;
use trailmark::store::debounce::DebouncedStart;
use trailmark::workflow::{StepKind, StepOutcome, Workflow};
use trailmark_testkit::debounced::NAME;

const WAIT: Duration = Duration::from_secs(60);

/// The recorded debounced start of `run_id`, if any.
async fn held(env: &TestEnv, run_id: &str) -> Option<DebouncedStart> {
    trailmark::store::debounce::find(&env.pool, run_id, None)
        .await
        .unwrap()
}

/// Publishes a start of `debounced` and waits until a worker recorded it (a burst's order is
/// the order its starts are recorded in; published at once, a broker with concurrent consumers
/// may hand them over in another).
async fn start_held(env: &TestEnv, run_id: &str, input: Value) -> DebouncedStart {
    env.start_run(NAME, run_id, input).await;
    let what = format!("start {run_id} recorded");
    common::eventually(&what, WAIT, || held(env, run_id))
        .await
        .unwrap_or_else(|| panic!("start {run_id} was not recorded within {WAIT:?}"))
}

/// Runs of `debounced` (in the database, whatever their status).
async fn runs_of_debounced(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar("SELECT run_id FROM trailmark.runs WHERE workflow = $1 ORDER BY run_id")
        .bind(NAME)
        .fetch_all(&env.pool)
        .await
        .unwrap()
}

/// Debounced starts still pending.
async fn pending(env: &TestEnv) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM trailmark.debounced_starts WHERE state = 'pending'")
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_five_starts_with_one_key_is_one_run_of_the_last_and_repeats_start_nothing() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    // Two keys, their bursts interleaved: a's five starts and b's two.
    let mut first_due = None;
    for i in 1..=5 {
        let entry = start_held(&env, &format!("a-{i}"), json!({"key": "a", "note": i})).await;
        assert_eq!((entry.state.as_str(), entry.nth), ("pending", i));
        first_due.get_or_insert(entry.due_at);
        if i <= 2 {
            start_held(&env, &format!("b-{i}"), json!({"key": "b", "note": i})).await;
        }
    }
    let last = held(&env, "a-5").await.unwrap();
    assert!(
        last.due_at > first_due.unwrap(),
        "the due time moves with each start"
    );

    let winner = env.wait_status("a-5", RunStatus::Succeeded, WAIT).await;
    env.wait_status("b-2", RunStatus::Succeeded, WAIT).await;
    env.wait_until("no start pending", WAIT, || async {
        pending(&env).await == 0
    })
    .await;
    assert_eq!(
        runs_of_debounced(&env).await,
        ["a-5", "b-2"],
        "one run per key"
    );
    assert_eq!(
        winner.input,
        json!({"key": "a", "note": 5}),
        "the last start's input"
    );
    assert_eq!(winner.output, Some(json!({"key": "a", "note": 5})));
    let late = (winner.created_at - last.due_at).num_milliseconds();
    eprintln!("a-5 became a run {late} ms after its due time (waits.poll_ms 250)");
    assert!(
        (0..2_000).contains(&late),
        "started {late} ms after its due time"
    );
    for i in 1..=4 {
        let e = held(&env, &format!("a-{i}")).await.unwrap();
        assert_eq!(e.state, "superseded", "a-{i}");
        assert_eq!(e.superseded_by.as_deref(), Some("a-5"), "a-{i}");
    }
    assert_eq!(held(&env, "a-5").await.unwrap().state, "started");

    // Repeats of the winner and of a superseded start are duplicates; another input under a
    // superseded start's id is a conflict. None starts anything.
    let duplicates = engine.stats.duplicates.load(Ordering::Relaxed);
    env.start_run(NAME, "a-5", json!({"key": "a", "note": 5}))
        .await;
    env.start_run(NAME, "a-2", json!({"key": "a", "note": 2}))
        .await;
    env.start_run(NAME, "a-3", json!({"key": "a", "note": "other"}))
        .await;
    env.wait_until("both repeats dropped as duplicates", WAIT, || async {
        engine.stats.duplicates.load(Ordering::Relaxed) >= duplicates + 2
    })
    .await;
    wait_dlq_depth(&env, 1).await;
    let letters = dead_letters(&env).await;
    assert_eq!(letters[0].reason, "run_conflict", "{letters:?}");
    let detail = letters[0].detail.clone().unwrap_or_default();
    assert!(detail.contains("superseded by a-5 (debounced)"), "{detail}");
    assert_eq!(pending(&env).await, 0, "no repeat opened a burst");
    assert_eq!(runs_of_debounced(&env).await, ["a-5", "b-2"]);
    // Stopped before the environment goes: a worker still draining would declare its queues again.
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_without_its_key_is_refused_naming_the_field_and_one_with_it_is_held() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    env.start_run(NAME, "no-key", json!({"note": 1})).await;
    env.start_run(NAME, "long-key", json!({"key": "x".repeat(200)}))
        .await;
    wait_dlq_depth(&env, 2).await;
    let letters = dead_letters(&env).await;
    assert!(
        letters.iter().all(|l| l.reason == "bad_input"),
        "{letters:?}"
    );
    let details: Vec<String> = letters.iter().filter_map(|l| l.detail.clone()).collect();
    assert!(
        details
            .iter()
            .any(|d| d.contains("no-key") && d.contains("no field key")),
        "{details:?}"
    );
    assert!(
        details
            .iter()
            .any(|d| d.contains("long-key") && d.contains("field key is 200 bytes")),
        "{details:?}"
    );
    assert_eq!(pending(&env).await, 0, "nothing was held");
    assert!(runs_of_debounced(&env).await.is_empty());

    // `run start` refuses it before publishing.
    let out = env
        .command(&[
            "run",
            "start",
            NAME,
            "--run-id",
            "cli-no-key",
            "--input",
            "{}",
        ])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no field key"), "{stderr}");

    // A start with its key: held, and `--wait` says until when.
    let args = [
        "run",
        "start",
        NAME,
        "--run-id",
        "cli-1",
        "--input",
        r#"{"key": "c"}"#,
        "--wait",
    ];
    let out = env.command(&args).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains(
            "run cli-1 is a debounced start of workflow debounced (key c), pending until"
        ),
        "{stdout}"
    );
    env.wait_status("cli-1", RunStatus::Succeeded, WAIT).await;
    // Stopped before the environment goes: a worker still draining would declare its queues again.
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_a_held_start_as_pending_and_a_superseded_one_by_its_winner() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let start = |run_id: &str, input: Value| json!({"workflow": NAME, "run_id": run_id, "input": input, "reason": "burst"});
    let post = |body: Value| {
        api.call(
            Method::POST,
            "/api/v1/runs",
            Some(&api.operator),
            Some(body),
            None,
        )
    };

    let (status, first) = post(start("s-1", json!({"key": "k", "note": 1}))).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{first}");
    assert_eq!(
        (first["state"].as_str(), first["created"].as_bool()),
        (Some("pending"), Some(true))
    );
    assert!(
        first["message"].as_str().unwrap().contains("pending until"),
        "{first}"
    );
    let (status, second) = post(start("s-2", json!({"key": "k", "note": 2}))).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{second}");
    assert_eq!(second["replaced"], "s-1");

    // The superseded start again: nothing new, it says who won.
    let (status, again) = post(start("s-1", json!({"key": "k", "note": 1}))).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{again}");
    assert_eq!(
        (again["state"].as_str(), again["created"].as_bool()),
        (Some("superseded"), Some(false))
    );
    assert_eq!(again["superseded_by"], "s-2");
    let (status, other) = post(start("s-1", json!({"key": "k", "note": "other"}))).await;
    assert_eq!(
        (status, other["error"].as_str()),
        (StatusCode::CONFLICT, Some("run_conflict")),
        "{other}"
    );
    let (status, missing) = post(start("s-3", json!({"note": 3}))).await;
    assert_eq!(
        (status, missing["error"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("bad_input"))
    );
    assert!(
        missing["message"]
            .as_str()
            .unwrap()
            .contains("no field key"),
        "{missing}"
    );

    let (status, shown) = api
        .call(
            Method::GET,
            "/api/v1/runs/s-1",
            Some(&api.viewer),
            None,
            None,
        )
        .await;
    assert_eq!(
        (status, shown["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("debounced")),
        "{shown}"
    );
    assert!(
        shown["message"]
            .as_str()
            .unwrap()
            .contains("superseded by s-2 (debounced)"),
        "{shown}"
    );

    api.env.wait_status("s-2", RunStatus::Succeeded, WAIT).await;
    assert_eq!(runs_of_debounced(&api.env).await, ["s-2"]);
    // The winner again, once it runs: the run, as for any start.
    let (status, run) = post(start("s-2", json!({"key": "k", "note": 2}))).await;
    assert_eq!(
        (status, run["created"].as_bool()),
        (StatusCode::OK, Some(false)),
        "{run}"
    );
    let out = api.env.command(&["run", "show", "s-1"]).output().unwrap();
    let (_, stderr) = text(&out);
    assert!(stderr.contains("superseded by s-2 (debounced)"), "{stderr}");
    let starts: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trailmark.audit WHERE action = 'run.start'")
            .fetch_one(&api.env.pool)
            .await
            .unwrap();
    assert_eq!(starts, 2, "each recorded start is audited, repeats are not");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_pending_when_its_process_is_killed_becomes_a_run_once_after_a_restart() {
    let env = TestEnv::new().await;
    let mut first = env.spawn_process(None);
    start_held(&env, "k-1", json!({"key": "z"})).await;
    first.kill9();
    assert_eq!(held(&env, "k-1").await.unwrap().state, "pending");
    assert!(
        runs_of_debounced(&env).await.is_empty(),
        "killed before it was due"
    );

    // Killed inside the scan that makes it a run, before its commit.
    let mut second = env.spawn_process(Some("debounce.before_commit=kill@1"));
    let status = tokio::task::spawn_blocking(move || second.wait())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert_eq!(held(&env, "k-1").await.unwrap().state, "pending");
    assert!(
        runs_of_debounced(&env).await.is_empty(),
        "the scan's transaction died with it"
    );

    // Two processes race for it: one run.
    let _third = env.spawn_process(None);
    let _fourth = env.spawn_process(None);
    env.wait_status("k-1", RunStatus::Succeeded, WAIT).await;
    assert_eq!(runs_of_debounced(&env).await, ["k-1"]);
    assert_eq!(held(&env, "k-1").await.unwrap().state, "started");
    assert_eq!(env.attempts("k-1", 0).await, 1, "its one step ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_started_without_pause_still_runs_within_ten_windows() {
    let env = TestEnv::new().await;
    let window = Duration::from_secs(1);
    let stream = Workflow::new("stream", 1)
        .debounce(Debounce::new("key", window).unwrap())
        .step("record", StepKind::Read, |ctx| async move {
            Ok(StepOutcome::finish(ctx.input().clone()))
        });
    let mut registry = trailmark_testkit::registry();
    registry.register(stream);
    let running = env.spawn_all(env.engine_with(registry, Default::default()));
    let ran = || async {
        sqlx::query_as::<_, (String, chrono::DateTime<chrono::Utc>)>(
            "SELECT run_id, created_at FROM trailmark.runs WHERE workflow = 'stream'",
        )
        .fetch_optional(&env.pool)
        .await
        .unwrap()
    };
    // Each start recorded before the next is sent: far closer together than the window.
    let (mut sent, began) = (0, std::time::Instant::now());
    let (run_id, created_at) = loop {
        if let Some(run) = ran().await {
            break run;
        }
        assert!(
            began.elapsed() < WAIT,
            "no run within {WAIT:?} of a steady stream"
        );
        sent += 1;
        let id = format!("st-{sent}");
        env.start_run("stream", &id, json!({"key": "s", "n": sent}))
            .await;
        common::eventually("start recorded", WAIT, || held(&env, &id))
            .await
            .unwrap();
    };
    let first = held(&env, "st-1").await.unwrap();
    let held_for = (created_at - first.first_at).to_std().unwrap();
    eprintln!("{sent} starts sent; run {run_id} began {held_for:?} after the burst's first");
    assert!(
        sent > 10,
        "the stream was too slow to test the cap: {sent} starts"
    );
    assert!(
        held_for >= window * 10 && held_for < window * 10 + Duration::from_secs(2),
        "held {held_for:?}; the cap is 10 windows ({:?})",
        window * 10
    );
    // Stopped before the environment goes: a worker still draining would declare its queues again.
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_starts_of_one_key_published_at_once_are_one_run() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let starts: Vec<_> = (1..=20)
        .map(|i| {
            let id = trailmark::domain::RunId::parse(&format!("c-{i}")).unwrap();
            let event =
                trailmark::domain::RunStartEvent::new(id, NAME, json!({"key": "c", "n": i}));
            env.topology().run_start(&event)
        })
        .collect();
    // Taken by concurrent deliveries: they queue on the key's pending row.
    env.publish_all(&starts).await;
    env.wait_until("one run started, nothing pending", WAIT, || async {
        pending(&env).await == 0 && runs_of_debounced(&env).await.len() == 1
    })
    .await;
    let states: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT s.run_id, s.state, w.run_id FROM trailmark.debounced_starts s
           LEFT JOIN trailmark.debounced_starts w ON w.burst = s.burst AND w.state = 'started'
          ORDER BY s.nth",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(states.len(), 20, "every start recorded once: {states:?}");
    let winner = runs_of_debounced(&env).await.remove(0);
    assert_eq!(
        states.last().unwrap().0,
        winner,
        "the last recorded start won"
    );
    for (id, state, by) in &states[..19] {
        assert_eq!(
            (state.as_str(), by.as_deref()),
            ("superseded", Some(winner.as_str())),
            "{id}"
        );
    }
    // Stopped before the environment goes: a worker still draining would declare its queues again.
    running.stop().await;
}

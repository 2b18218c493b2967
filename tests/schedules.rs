//! Schedules against the real servers: three schedulers (one killed mid-scan) start one run per
//! tick; pause starts nothing; a backfill run twice starts each tick once; `skip` never lets
//! two runs of a schedule overlap; bad input is refused naming the field, creating nothing.

mod common;

use std::time::Duration;

use chrono::{DateTime, SubsecRound, Utc};
use common::{TestEnv, assert_each_refused, text};
use trailmark::domain::RunStatus;

const WAIT: Duration = Duration::from_secs(120);

/// Runs `trailmark schedule <args>` and returns stdout; it must succeed.
fn schedule(env: &TestEnv, args: &[&str]) -> String {
    let mut all = vec!["schedule"];
    all.extend_from_slice(args);
    let out = env.command(&all).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "schedule {args:?}: {stderr}");
    stdout
}

/// Creates schedule `name`: a one-link `chain` run every second.
fn every_second(env: &TestEnv, name: &str) {
    schedule(
        env,
        &[
            "create",
            name,
            "--workflow",
            "chain",
            "--every",
            "1s",
            "--input",
            r#"{"steps": 1}"#,
        ],
    );
}

/// A run of a schedule: (tick or id, status, created, finished).
type Ran<T> = (T, RunStatus, DateTime<Utc>, Option<DateTime<Utc>>);

/// The schedule's runs, oldest tick first.
async fn runs_of(env: &TestEnv, name: &str) -> Vec<Ran<DateTime<Utc>>> {
    let rows: Vec<Ran<String>> = sqlx::query_as(
        "SELECT run_id, status, created_at, finished_at FROM trailmark.runs
          WHERE run_id LIKE $1 ORDER BY run_id",
    )
    .bind(format!("{name}:%"))
    .fetch_all(&env.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(id, status, created, finished)| {
            let tick = id.split_once(':').unwrap().1;
            let tick = DateTime::parse_from_rfc3339(tick).unwrap().to_utc();
            (tick, status, created, finished)
        })
        .collect()
}

/// A migrated environment and one `serve` process on it.
async fn migrated_with_serve() -> (TestEnv, common::ChildGuard) {
    let env = TestEnv::new().await;
    assert!(env.command(&["migrate"]).output().unwrap().status.success());
    let serve = env.spawn_process(None);
    (env, serve)
}

async fn db_now(env: &TestEnv) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_schedulers_one_killed_mid_scan_start_exactly_one_run_per_tick() {
    let env = TestEnv::new().await;
    assert!(env.command(&["migrate"]).output().unwrap().status.success());
    // The first process dies (SIGKILL) inside its second scan that fires a tick, before the
    // commit: that tick must still start once, from another process.
    let mut doomed = env.spawn_process(Some("schedule.before_commit=kill@2"));
    let _others = [env.spawn_process(None), env.spawn_process(None)];
    schedule(
        &env,
        &[
            "create",
            "every-2s",
            "--workflow",
            "chain",
            "--every",
            "2s",
            "--input",
            r#"{"steps": 2}"#,
            "--overlap",
            "allow",
        ],
    );
    let doomed_exit = common::wait_exit(&mut doomed, WAIT).await;
    assert!(doomed_exit.is_some(), "the failpoint never fired");
    env.wait_until("8 ticks started", WAIT, || async {
        runs_of(&env, "every-2s").await.len() >= 8
    })
    .await;
    let runs = runs_of(&env, "every-2s").await;
    for pair in runs.windows(2) {
        assert_eq!(
            (pair[1].0 - pair[0].0).num_seconds(),
            2,
            "a tick was missed between {} and {}",
            pair[0].0,
            pair[1].0
        );
    }
    for (tick, ..) in &runs[..8] {
        let id = format!("every-2s:{}", tick.format("%Y-%m-%dT%H:%M:%SZ"));
        env.wait_status(&id, RunStatus::Succeeded, WAIT).await;
        assert_eq!(
            env.chain_ledger(&id).await,
            (2, 2),
            "{id}: ledger rows, distinct keys"
        );
    }
    let started: i64 =
        sqlx::query_scalar("SELECT started FROM trailmark.schedules WHERE name = 'every-2s'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert!(started as usize >= runs.len(), "{started} < {}", runs.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_schedule_starts_nothing_and_a_backfill_run_twice_starts_each_tick_once() {
    let (env, _serve) = migrated_with_serve().await;
    every_second(&env, "often");
    env.wait_until("a first tick", WAIT, || async {
        !runs_of(&env, "often").await.is_empty()
    })
    .await;
    schedule(&env, &["pause", "often", "--why", "supplier down"]);
    let paused_at = db_now(&env).await;
    let before = runs_of(&env, "often").await.len();
    // Three ticks' time on the database's clock, with schedulers scanning every second.
    env.wait_until("three ticks to pass", WAIT, || async {
        db_now(&env).await - paused_at > chrono::Duration::seconds(3)
    })
    .await;
    assert_eq!(
        runs_of(&env, "often").await.len(),
        before,
        "a paused schedule started a run"
    );
    let shown = schedule(&env, &["show", "often", "--json"]);
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["paused"], true);
    assert_eq!(shown["upcoming"], serde_json::json!([]));

    // Ten past seconds, most without a run (the schedule was paused), backfilled twice.
    let to = db_now(&env).await.trunc_subsecs(0) - chrono::Duration::seconds(1);
    let from = to - chrono::Duration::seconds(9);
    let had = runs_of(&env, "often").await;
    let had = had.iter().filter(|r| r.0 >= from && r.0 <= to).count();
    let (from, to) = (from.to_rfc3339(), to.to_rfc3339());
    let args = ["backfill", "often", "--from", &from, "--to", &to];
    let first = schedule(&env, &args);
    let said = format!("{} runs started, {had} existed already", 10 - had);
    assert!(first.contains(&said), "{first}");
    let again = schedule(&env, &args);
    assert!(
        again.contains("0 runs started, 10 existed already"),
        "{again}"
    );
    assert_eq!(runs_of(&env, "often").await.len(), before + 10 - had);

    schedule(&env, &["resume", "often"]);
    env.wait_until("ticks again after resume", WAIT, || async {
        runs_of(&env, "often").await.len() > before + 10
    })
    .await;
    let audit: Vec<String> = sqlx::query_scalar(
        "SELECT action FROM trailmark.audit WHERE target = 'schedule:often' ORDER BY id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        [
            "schedule.create",
            "schedule.pause",
            "schedule.backfill",
            "schedule.backfill",
            "schedule.resume"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_skip_a_run_that_lasts_three_ticks_never_overlaps_the_next() {
    let (env, _serve) = migrated_with_serve().await;
    schedule(
        &env,
        &[
            "create",
            "slow",
            "--workflow",
            "chain",
            "--every",
            "1s",
            "--overlap",
            "skip",
            "--input",
            r#"{"steps": 3, "step_delay_ms": 1000}"#,
        ],
    );
    env.wait_until("three runs of the slow schedule ended", WAIT, || async {
        let runs = runs_of(&env, "slow").await;
        runs.iter().filter(|r| r.1 == RunStatus::Succeeded).count() >= 3
    })
    .await;
    let runs = runs_of(&env, "slow").await;
    for pair in runs.windows(2) {
        let finished = pair[0]
            .3
            .expect("a later run started only after this one ended");
        assert!(
            pair[1].2 >= finished,
            "run of {} started while that of {} ran",
            pair[1].0,
            pair[0].0
        );
    }
    let skipped: i64 =
        sqlx::query_scalar("SELECT skipped FROM trailmark.schedules WHERE name = 'slow'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert!(
        skipped >= 2,
        "ticks during a run are skipped, counted: {skipped}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_naming_the_field_and_creates_nothing() {
    let env = TestEnv::new().await;
    assert!(env.command(&["migrate"]).output().unwrap().status.success());
    let c = |extra: &'static [&'static str]| -> Vec<&'static str> {
        let mut v = vec!["schedule", "create"];
        v.extend_from_slice(extra);
        v
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            c(&["n1", "--workflow", "chain", "--cron", "61 * * * *"]),
            "cron: ",
        ),
        (
            c(&[
                "n1",
                "--workflow",
                "chain",
                "--cron",
                "0 2 * * *",
                "--tz",
                "Mars/Olympus",
            ]),
            "tz: ",
        ),
        (
            c(&["n1", "--workflow", "chain", "--every", "0s"]),
            "every: ",
        ),
        (
            c(&["n1", "--workflow", "chain", "--every", "400d"]),
            "every: ",
        ),
        (
            c(&["bad:name", "--workflow", "chain", "--every", "1m"]),
            "name: ",
        ),
        (
            c(&["n1", "--workflow", "nope", "--every", "1m"]),
            "workflow: ",
        ),
        (
            c(&[
                "n1",
                "--workflow",
                "chain",
                "--every",
                "1m",
                "--input",
                "[1]",
            ]),
            "input: ",
        ),
        (
            c(&[
                "n1",
                "--workflow",
                "chain",
                "--every",
                "1m",
                "--input",
                r#"{"steps": 0}"#,
            ]),
            "input: ",
        ),
        (
            c(&[
                "n1",
                "--workflow",
                "chain",
                "--every",
                "1m",
                "--overlap",
                "sometimes",
            ]),
            "overlap: ",
        ),
        (
            c(&[
                "n1",
                "--workflow",
                "chain",
                "--every",
                "1m",
                "--catch-up",
                "soon",
            ]),
            "catch_up: ",
        ),
    ];
    let cases: Vec<(&[&str], &str)> = cases.iter().map(|(a, e)| (a.as_slice(), *e)).collect();
    assert_each_refused(&env, &cases);
    let none = schedule(&env, &["list"]);
    assert!(none.contains("no schedules"), "{none}");

    schedule(
        &env,
        &["create", "ok", "--workflow", "chain", "--every", "1m"],
    );
    let future = (Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let long_ago = (Utc::now() - chrono::Duration::days(400)).to_rfc3339();
    let now = Utc::now().to_rfc3339();
    assert_each_refused(
        &env,
        &[
            (
                &[
                    "schedule", "backfill", "ok", "--from", &now, "--to", &future,
                ],
                "to: ",
            ),
            (
                &[
                    "schedule", "backfill", "ok", "--from", &long_ago, "--to", &now,
                ],
                "from: ",
            ),
            (
                &[
                    "schedule",
                    "create",
                    "ok",
                    "--workflow",
                    "chain",
                    "--every",
                    "2m",
                ],
                "exists with another",
            ),
            (
                &["schedule", "pause", "missing"],
                "no schedule named missing",
            ),
        ],
    );
    assert_eq!(runs_of(&env, "ok").await.len(), 0, "nothing half-created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_whose_input_the_workflow_now_refuses_fires_nothing_and_stops_no_other() {
    let env = TestEnv::new().await;
    assert!(env.command(&["migrate"]).output().unwrap().status.success());
    for name in ["broken", "fine"] {
        every_second(&env, name);
    }
    // A deploy whose workflow is stricter than the one the schedule was created against: its
    // input is now refused. Before the scheduler runs, so no tick of it can start.
    sqlx::query("UPDATE trailmark.schedules SET input = '{\"steps\": 0}' WHERE name = 'broken'")
        .execute(&env.pool)
        .await
        .unwrap();
    let _serve = env.spawn_process(None);
    env.wait_until("three runs of the fine schedule", WAIT, || async {
        runs_of(&env, "fine").await.len() >= 3
    })
    .await;
    assert_eq!(
        runs_of(&env, "broken").await.len(),
        0,
        "a refused input started a run"
    );
    let (started, next_tick_passed): (i64, bool) = sqlx::query_as(
        "SELECT started, next_tick < now() FROM trailmark.schedules WHERE name = 'broken'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(started, 0);
    assert!(
        next_tick_passed,
        "the refused schedule is left due, not moved on"
    );
}

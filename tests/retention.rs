//! Retention against the real servers: `trailmark prune` removes only finished runs past their
//! keep time, with every row of theirs, after writing each to the archive in the `run export`
//! format; runs in review or waiting stay whatever their age; a removed run leaves a tombstone,
//! so its late duplicate start starts nothing and a conflicting one is dead-lettered; audit
//! rows stay; over HTTP the same start is `410` and another `409`. Two `serve` processes prune
//! in the background without removing or archiving a run twice.

mod api_support;
mod common;
mod dlq_support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::servers::TempDir;
use common::{TestEnv, text};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use trailmark::api::Role;
use trailmark::domain::{RunId, RunStartEvent, RunStatus};
use trailmark::retention::Policy;

const WAIT: Duration = Duration::from_secs(90);

/// Rows of `run_id` in each table a run's record spans.
async fn rows_of(env: &TestEnv, run_id: &str) -> [i64; 4] {
    let mut counts = [0; 4];
    for (i, table) in ["runs", "steps", "journal", "effects"].iter().enumerate() {
        let sql = format!("SELECT count(*) FROM trailmark.{table} WHERE run_id = $1");
        counts[i] = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    }
    counts
}

/// Runs the binary with `extra` environment; (exit code, stdout, stderr).
fn trailmark(
    env: &TestEnv,
    args: &[&str],
    extra: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    let out = env
        .command(args)
        .envs(extra.iter().copied())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    (out.status.code(), stdout, stderr)
}

/// Every archive file under `dir`, by file name.
fn archived(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for day in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(day.path()).unwrap().flatten() {
            files.push(f.path());
        }
    }
    files.sort();
    files
}

/// A document without the time it was exported.
fn timeless(mut doc: Value) -> Value {
    doc.as_object_mut().unwrap().remove("exported_at");
    doc
}

async fn count(env: &TestEnv, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&env.pool).await.unwrap()
}

async fn db_seconds_since_last_finish(env: &TestEnv) -> f64 {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - max(finished_at))::float8 FROM trailmark.runs
          WHERE finished_at IS NOT NULL",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_removes_only_finished_runs_past_their_keep_time_and_a_late_start_starts_nothing() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let chain = json!({"steps": 2});
    env.start_run("chain", "old-done", chain.clone()).await;
    let waiting = json!({"steps": 3, "wait": {"at": 1, "event": "go", "timeout_secs": 3600}});
    env.start_run("chain", "old-cancelled", waiting.clone())
        .await;
    env.start_run("chain", "old-waiting", waiting).await;
    let reviewed = json!({"steps": 3, "wait": {"at": 1, "event": "go", "timeout_secs": 1}});
    env.start_run("chain", "old-review", reviewed).await;
    env.wait_status("old-done", RunStatus::Succeeded, WAIT)
        .await;
    env.wait_status("old-cancelled", RunStatus::Waiting, WAIT)
        .await;
    env.wait_status("old-waiting", RunStatus::Waiting, WAIT)
        .await;
    env.wait_status("old-review", RunStatus::NeedsReview, WAIT)
        .await;
    let (code, _, stderr) = trailmark(
        &env,
        &["run", "cancel", "old-cancelled", "--reason", "not needed"],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let (code, exported, stderr) = trailmark(&env, &["run", "export", "old-done"], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let exported: Value = serde_json::from_str(&exported).unwrap();
    assert_eq!(exported["format"], "trailmark.run.v1");
    assert_eq!(exported["steps"].as_array().unwrap().len(), 2);
    let done_rows = rows_of(&env, "old-done").await;

    // The old runs are 10 s past their end, the new one not: pruning what is older than 6 s
    // must take the old finished ones only.
    env.wait_until("the old runs to be 10 s old", WAIT, || async {
        db_seconds_since_last_finish(&env).await >= 10.0
    })
    .await;
    env.start_run("chain", "new-done", chain.clone()).await;
    env.wait_status("new-done", RunStatus::Succeeded, WAIT)
        .await;
    let archive = TempDir::new(&format!("archive-{}", env.prefix));
    let dir = archive.0.to_str().unwrap();
    let with_archive = [("TRAILMARK__RETENTION__ARCHIVE_DIR", dir)];

    let (code, dry, stderr) = trailmark(&env, &["prune", "--older-than", "6s", "--dry-run"], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        dry.contains("would remove run old-done") && dry.contains("would remove run old-cancelled"),
        "{dry}"
    );
    assert_eq!(
        rows_of(&env, "old-done").await,
        done_rows,
        "a dry run removed rows"
    );

    let (code, said, stderr) = trailmark(&env, &["prune", "--older-than", "6s"], &with_archive);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(said.contains("2 runs removed (2 archived)"), "{said}");
    for gone in ["old-done", "old-cancelled"] {
        assert_eq!(rows_of(&env, gone).await, [0, 0, 0, 0], "{gone} left rows");
    }
    for kept in ["old-waiting", "old-review", "new-done"] {
        assert_eq!(rows_of(&env, kept).await[0], 1, "{kept} was removed");
    }
    assert!(done_rows[1] == 2 && done_rows[2] >= 2, "{done_rows:?}");
    let files = archived(&archive.0);
    assert_eq!(files.len(), 2, "{files:?}");
    let file = files.iter().find(|f| f.ends_with("old-done.json")).unwrap();
    let doc: Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    assert_eq!(
        timeless(doc),
        timeless(exported),
        "the archive is the export"
    );
    // The decision's audit row outlives its run.
    let audited = env
        .scalar(
            "SELECT count(*) FROM trailmark.audit WHERE target = $1 AND action = 'cancel'",
            "old-cancelled",
        )
        .await;
    assert_eq!(audited, 1);
    let (code, _, shown) = trailmark(&env, &["run", "show", "old-done"], &[]);
    assert_eq!(code, Some(1));
    assert!(
        shown.contains("succeeded and was removed by retention") && shown.contains("old-done.json"),
        "{shown}"
    );

    // A late duplicate start starts nothing; one with other input is refused as a conflict.
    let same = RunStartEvent::new(RunId::parse("old-done").unwrap(), "chain", chain);
    let other = RunStartEvent::new(
        RunId::parse("old-done").unwrap(),
        "chain",
        json!({"steps": 5}),
    );
    let topology = env.topology();
    env.publish_all(&[topology.run_start(&same), topology.run_start(&other)])
        .await;
    dlq_support::wait_dlq_depth(&env, 1).await;
    let letters = dlq_support::dead_letters(&env).await;
    assert_eq!(letters[0].reason, "run_conflict", "{letters:?}");
    let detail = letters[0].detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("run old-done ran workflow chain"),
        "{detail}"
    );
    env.wait_until("the start queue to drain", WAIT, || async {
        dlq_support::depth(&env, &topology.run_start_queue()).await == 0
    })
    .await;
    assert_eq!(
        rows_of(&env, "old-done").await,
        [0, 0, 0, 0],
        "a late start ran it again"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_serve_processes_prune_in_the_background_each_run_once() {
    let env = TestEnv::new().await;
    let archive = TempDir::new(&format!("archive-{}", env.prefix));
    let settings = [
        ("TRAILMARK__RETENTION__KEEP_SECS", "1".to_owned()),
        ("TRAILMARK__RETENTION__INTERVAL_SECS", "1".to_owned()),
        ("TRAILMARK__RETENTION__BATCH", "3".to_owned()),
        (
            "TRAILMARK__RETENTION__ARCHIVE_DIR",
            archive.0.display().to_string(),
        ),
    ];
    let _serve = [
        env.spawn_process_with(None, &settings),
        env.spawn_process_with(None, &settings),
    ];
    let runs: Vec<String> = (0..20).map(|i| format!("bg-{i}")).collect();
    for id in &runs {
        env.start_run("chain", id, json!({"steps": 2})).await;
    }
    env.wait_until("20 runs removed", WAIT, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM trailmark.pruned_runs")
            .fetch_one(&env.pool)
            .await
            .unwrap()
            == 20
    })
    .await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.runs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    let files = archived(&archive.0);
    assert_eq!(files.len(), 20, "one archive file per run: {files:?}");
    for id in &runs {
        // Each ran its two links once before it was removed (the ledger is outside trailmark).
        assert_eq!(env.chain_ledger(id).await, (2, 2), "{id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_run_started_again_over_http_is_gone_or_a_conflict_and_nothing_starts() {
    let api = api_support::Api::start_with(trailmark_testkit::registry(), |_| {}).await;
    let env = &api.env;
    let body = json!({"workflow": "chain", "run_id": "r-gone", "input": {"steps": 1}});
    let token = Some(api.token(Role::Operator));
    let (status, run) = api
        .call(
            Method::POST,
            "/api/v1/runs",
            token,
            Some(body.clone()),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{run}");
    env.wait_status("r-gone", RunStatus::Succeeded, WAIT).await;
    env.wait_until("the run to be 2 s old", WAIT, || async {
        db_seconds_since_last_finish(env).await >= 2.0
    })
    .await;
    let policy = Policy::from_settings(&env.settings.retention).older_than(Duration::from_secs(1));
    let pruned = trailmark::retention::prune(&env.engine(), &policy, false, |_| {})
        .await
        .unwrap();
    assert_eq!(pruned.run_ids, ["r-gone"]);

    let (status, why) = api
        .call(Method::POST, "/api/v1/runs", token, Some(body), None)
        .await;
    assert_eq!(
        (status, why["error"].as_str()),
        (StatusCode::GONE, Some("run_pruned")),
        "{why}"
    );
    let other = json!({"workflow": "chain", "run_id": "r-gone", "input": {"steps": 2}});
    let (status, why) = api
        .call(Method::POST, "/api/v1/runs", token, Some(other), None)
        .await;
    assert_eq!(
        (status, why["error"].as_str()),
        (StatusCode::CONFLICT, Some("run_conflict")),
        "{why}"
    );
    assert!(
        why["message"]
            .as_str()
            .unwrap()
            .contains("removed by retention"),
        "{why}"
    );
    assert_eq!(rows_of(env, "r-gone").await, [0, 0, 0, 0]);
    assert_eq!(
        env.chain_ledger("r-gone").await,
        (1, 1),
        "the one run's one write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_and_its_children_are_removed_together_children_after_their_parent() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    let input = json!({"steps": 2, "children": {"at": 0, "count": 3, "steps": 1}});
    env.start_run("chain", "fam", input).await;
    env.wait_status("fam", RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM trailmark.runs WHERE parent_run_id = 'fam'"
        )
        .await,
        3
    );
    env.wait_until("the family to be 2 s old", WAIT, || async {
        db_seconds_since_last_finish(&env).await >= 2.0
    })
    .await;
    let (code, said, stderr) = trailmark(&env, &["prune", "--older-than", "1s"], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(said.contains("4 runs removed"), "{said}");
    assert_eq!(count(&env, "SELECT count(*) FROM trailmark.runs").await, 0);
    assert_eq!(
        count(&env, "SELECT count(*) FROM trailmark.pruned_runs").await,
        4
    );
    let left = count(&env, "SELECT (SELECT count(*) FROM trailmark.fan_outs) + (SELECT count(*) FROM trailmark.children)").await;
    assert_eq!(left, 0, "fan-out rows left behind");
    running.stop().await;
}

/// A pruner working through a long backlog at a low duty (a batch of one run, then a rest 99
/// times as long) is in the middle of its pass when `serve` gets SIGTERM: the process stops
/// without waiting for the pass, the batch it was in is whole or absent, and the next process
/// removes the rest, each run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_pruner_mid_pass_and_the_next_process_removes_the_rest() {
    let env = TestEnv::new().await;
    let runs: Vec<String> = (0..30).map(|i| format!("slow-{i}")).collect();
    for id in &runs {
        env.start_run("chain", id, json!({"steps": 1})).await;
    }
    let mut serve = env.spawn_process_with(None, &[]);
    for id in &runs {
        env.wait_status(id, RunStatus::Succeeded, WAIT).await;
    }
    drop(serve);
    let pruning = [
        ("TRAILMARK__RETENTION__KEEP_SECS", "1".to_owned()),
        ("TRAILMARK__RETENTION__INTERVAL_SECS", "1".to_owned()),
        ("TRAILMARK__RETENTION__BATCH", "1".to_owned()),
        ("TRAILMARK__RETENTION__DUTY_PERCENT", "1".to_owned()),
    ];
    serve = env.spawn_process_with(None, &pruning);
    let removed = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM trailmark.pruned_runs")
            .fetch_one(&env.pool)
            .await
            .unwrap()
    };
    env.wait_until("the pass to begin", WAIT, || async { removed().await >= 1 })
        .await;
    serve.signal(libc::SIGTERM);
    let status = common::wait_exit(&mut serve, Duration::from_secs(30))
        .await
        .expect("serve stops on SIGTERM without finishing the pass");
    assert!(status.success(), "{status:?}");
    let at_stop = removed().await;
    assert!(at_stop < 30, "the pass was cut short: {at_stop} removed");
    // Every run is either removed with its tombstone or still whole.
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.runs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(kept + at_stop, 30);

    let faster = [
        ("TRAILMARK__RETENTION__KEEP_SECS", "1".to_owned()),
        ("TRAILMARK__RETENTION__INTERVAL_SECS", "1".to_owned()),
        ("TRAILMARK__RETENTION__DUTY_PERCENT", "100".to_owned()),
    ];
    let _next = env.spawn_process_with(None, &faster);
    env.wait_until("the rest removed", WAIT, || async { removed().await == 30 })
        .await;
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.runs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(kept, 0, "every run removed, none twice (30 tombstones)");
}

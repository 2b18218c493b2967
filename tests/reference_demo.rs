//! `trailmark demo` as a user runs it: the story's closing lines, a re-run that repeats nothing,
//! the naive version's damage, the race, and no process left behind when it is interrupted.

mod common;
mod reference_support;

use std::collections::BTreeSet;
use std::process::{Output, Stdio};
use std::time::Duration;

use reference_support::{RefEnv, WAIT, expected_mismatches};
use trailmark_reference::ledger;

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `trailmark <args>` against the test's servers, off the async runtime.
async fn trailmark(r: &RefEnv, args: &[&str]) -> Output {
    let mut cmd = r.env.command(args);
    tokio::task::spawn_blocking(move || cmd.output().expect("run trailmark"))
        .await
        .unwrap()
}

/// Processes whose environment points at `db` (the demo's children inherit DATABASE_URL).
fn processes_using(db: &str) -> Vec<u32> {
    let needle = format!("DATABASE_URL=postgres://postgres@127.0.0.1:5432/{db}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

async fn no_process_left(db: &str) {
    let gone = common::eventually(
        "the demo's processes to end",
        Duration::from_secs(10),
        || {
            let left = processes_using(db);
            async move { left.is_empty().then_some(()) }
        },
    )
    .await;
    assert!(
        gone.is_some(),
        "demo processes outlived it: {:?}",
        processes_using(db)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_tells_the_story_and_a_rerun_repeats_nothing() {
    let r = RefEnv::new().await;
    let night = RefEnv::night(312, 40);
    let notes = expected_mismatches(&night)
        .iter()
        .map(|m| m.matched.item.supplier.clone())
        .collect::<BTreeSet<_>>()
        .len();
    assert_eq!(notes, 11, "the README's figure for the story's night");
    // No --night: the default is the story's night, so the figures are the README's on any day.
    let out = trailmark(&r, &["demo"]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    let closing: Vec<&str> = stdout.trim_end().lines().rev().take(3).collect();
    assert_eq!(
        closing,
        vec![
            format!("debit notes sent: {notes}, duplicates: 0").as_str(),
            "ledger rows: 40, distinct keys: 40",
            "invoices read: 312, model calls: 312, restarts: 1",
        ],
        "{stdout}"
    );
    assert!(stderr.contains("worker 1 was killed by SIGKILL in step 7/10 post_ledger_adjustments with 23 ledger rows"), "{stderr}");
    assert!(
        stderr.contains("step  2/10 extract_line_items"),
        "no progress shown: {stderr}"
    );
    no_process_left(&r.env.db_name).await;

    let again = trailmark(&r, &["demo", "--night", "2026-10-13", "--json"]).await;
    let (stdout, stderr) = text(&again);
    assert!(again.status.success(), "re-run failed:\n{stdout}\n{stderr}");
    assert!(stderr.contains("already finished"), "{stderr}");
    let figures: serde_json::Value = serde_json::from_str(&stdout).expect("--json prints JSON");
    assert_eq!(figures["already_finished"], true);
    assert_eq!(figures["variant"], "trailmark", "{figures}");
    for (field, want) in [
        ("invoices_read", 312),
        ("model_calls", 312),
        ("restarts", 1),
        ("ledger_rows", 40),
        ("distinct_keys", 40),
        ("debit_notes_sent", notes as i64),
        ("duplicates", 0),
    ] {
        assert_eq!(
            figures[field], want,
            "{field} changed on the re-run: {figures}"
        );
    }
    assert_eq!(
        ledger::counts(&r.outside, night.run_id().as_str())
            .await
            .unwrap(),
        (40, 40)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_demo_measures_63_rows_and_624_reads() {
    let r = RefEnv::new().await;
    let out = trailmark(&r, &["demo", "--naive", "--night", "2026-10-13"]).await;
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "naive demo failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("invoices read: 624, model calls: 624, restarts: 1"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ledger rows: 63, distinct keys: 40"),
        "{stdout}"
    );
    no_process_left(&r.env.db_name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_demo_measures_both_variants() {
    let r = RefEnv::new().await;
    let out = trailmark(&r, &["demo", "race", "--tries", "5"]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "race failed:\n{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let x: u32 = lines[0]
        .strip_prefix("check-then-post: ")
        .and_then(|rest| rest.strip_suffix(" of 5 tries left duplicates"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected line {:?}", lines[0]));
    assert!(
        x >= 1,
        "check-then-post left no duplicate in 5 tries: {stdout}"
    );
    assert_eq!(lines[1], "unique key: 0 of 5 tries left duplicates");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM reference.entries WHERE run_id LIKE 'race-%'")
            .fetch_one(&r.outside)
            .await
            .unwrap();
    assert_eq!(rows, 0, "the race left rows in the ledger");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_demo_leaves_no_process_and_a_rerun_finishes_the_run() {
    let r = RefEnv::new().await;
    let args = [
        "demo",
        "--night",
        "2026-10-13",
        "--invoices",
        "60",
        "--mismatches",
        "8",
        "--no-crash",
    ];
    let mut demo = r
        .env
        .command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let night = RefEnv::night(60, 8);
    let run_id = night.run_id().to_string();
    r.env
        .wait_until("the run has started", WAIT, || async {
            r.env
                .scalar(
                    "SELECT count(*) FROM trailmark.runs WHERE run_id = $1",
                    &run_id,
                )
                .await
                == 1
        })
        .await;
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe {
        libc::kill(demo.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || demo.wait().unwrap())
        .await
        .unwrap();
    assert!(
        !status.success(),
        "an interrupted demo must not report success"
    );
    let finished = r
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.runs WHERE run_id = $1 AND status = 'succeeded'",
            &run_id,
        )
        .await;
    assert_eq!(
        finished, 0,
        "the run finished before the interruption; the test proves nothing"
    );
    no_process_left(&r.env.db_name).await;

    let out = trailmark(&r, &args).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "re-run failed:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("is unfinished"),
        "the re-run did not resume the run: {stderr}"
    );
    assert!(
        stdout.contains("ledger rows: 8, distinct keys: 8"),
        "{stdout}"
    );
    no_process_left(&r.env.db_name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_refuses_to_share_its_queues_with_a_worker_it_did_not_start() {
    let r = RefEnv::new().await;
    let left_running = r.serve(None);
    let queue = r.env.topology().steps_queue();
    r.env
        .wait_until("the other worker consumes", WAIT, || async {
            trailmark::broker::queue_state(&r.env.settings.broker, &queue)
                .await
                .ok()
                .flatten()
                .is_some_and(|q| q.consumers > 0)
        })
        .await;
    let out = trailmark(&r, &["demo"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("other consumer(s) take messages from")
            && stderr.contains("Stop them, or give the demo a database and prefix of its own"),
        "{stderr}"
    );
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.runs")
        .fetch_one(&r.env.pool)
        .await
        .unwrap();
    assert_eq!(runs, 0, "the demo started nothing");
    assert_eq!(
        processes_using(&r.env.db_name),
        [left_running.pid()],
        "the demo left no process of its own"
    );
}

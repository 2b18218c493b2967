//! Local writes (`ctx.local_write`): rows of a table in trailmark's own database written by the
//! step's commit statement itself. A row exists if and only if its step committed, once; a key
//! already holding other values stops the run for review and writes nothing; a repeat with the
//! same values is harmless; a shadow run records its rows and writes none; undo reverses them.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::TestEnv;
use serde_json::json;
use trailmark::domain::{LocalTable, MessageId, RunId, RunStatus};
use trailmark::operator::{self, Decider, ForkPoint, ForkRequest, UndoOptions};
use trailmark::store::{self, checkpoint, effects, runs};

const WAIT: Duration = Duration::from_secs(120);

fn local(steps: i32) -> serde_json::Value {
    json!({ "steps": steps, "ledger": "local" })
}

fn who() -> Decider {
    Decider::cli("kim", "checking local writes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_writing_its_ledger_with_the_commit_writes_each_row_once_and_no_effect_record() {
    let env = TestEnv::new().await;
    let running = env.spawn_all(env.engine());
    env.start_run("chain", "r-local", local(25)).await;
    env.wait_status("r-local", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger("r-local").await, (25, 25));
    let recorded = env
        .scalar(
            "SELECT count(*) FROM trailmark.effects WHERE run_id = $1",
            "r-local",
        )
        .await;
    assert_eq!(recorded, 0, "a local write needs no intent nor result");
    // Each row went in with its own step's commit: same transaction, same clock.
    let apart = env
        .scalar(
            "SELECT count(*) FROM trailmark.chain_ledger l JOIN trailmark.steps s
               ON s.run_id = l.run_id AND s.seq = l.step
             WHERE l.run_id = $1 AND l.created_at = s.finished_at",
            "r-local",
        )
        .await;
    assert_eq!(apart, 25, "every row is stamped with its step's commit");
    // Listings show them as writes of their steps.
    let listed = effects::list(&env.pool, "r-local").await.unwrap();
    let keys: Vec<(String, String, i32)> = listed
        .iter()
        .map(|e| (e.idempotency_key.clone(), e.tool.clone(), e.seq))
        .collect();
    let expected: Vec<(String, String, i32)> = (0..25)
        .map(|i| {
            let key = format!("trailmark.chain_ledger:r-local:{i}");
            (key, effects::LOCAL_WRITE.to_owned(), i)
        })
        .collect();
    assert_eq!(keys, expected);
    assert!(listed.iter().all(|e| e.completed));
    assert_eq!(
        effects::totals(&env.pool, "r-local").await.unwrap(),
        (25, 25)
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holding_other_values_stops_the_run_at_that_step_naming_the_key_and_writes_nothing() {
    let env = TestEnv::new().await;
    sqlx::query(
        "INSERT INTO trailmark.chain_ledger (reference, run_id, step, payload)
         VALUES ('r-clash:2', 'someone-else', 2, 'another payload')",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let running = env.spawn_all(env.engine());
    env.start_run("chain", "r-clash", local(5)).await;
    let run = env
        .wait_status("r-clash", RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    assert!(
        error.contains("position 2")
            && error.contains("trailmark.chain_ledger:r-clash:2")
            && error.contains("already holds other values")
            && error.contains("resume"),
        "{error}"
    );
    assert_eq!(run.step_seq, 2, "the run stays at the refused step");
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT reference, payload FROM trailmark.chain_ledger WHERE reference LIKE 'r-clash:%' ORDER BY reference",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let refs: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(refs, ["r-clash:0", "r-clash:1", "r-clash:2"]);
    assert_eq!(
        rows[2].1, "another payload",
        "the standing row is untouched"
    );
    let checkpointed = env
        .scalar(
            "SELECT count(*) FROM trailmark.steps WHERE run_id = $1 AND seq = 2 AND finished_at IS NOT NULL",
            "r-clash",
        )
        .await;
    assert_eq!(checkpointed, 0, "the refused step did not commit");
    running.stop().await;
}

/// A table of the application's own, in trailmark's database.
static NOTES: LocalTable = LocalTable::new("app_notes", "k", &["k", "v"]);

/// The commit of position 0 of a fresh `chain` run, writing `note` (`(k, v)`) with it.
async fn commit_with_note(env: &TestEnv, id: &str, note: (&str, i32)) -> checkpoint::StepCommit {
    let run = env.insert_chain_run(id).await;
    let fence = claim(env, &run).await;
    let row = NOTES.row(json!({ "k": note.0, "v": note.1 })).unwrap();
    checkpoint::StepCommit {
        local_writes: vec![row],
        ..common::first_step_commit(env, &run, fence, &[], 1)
    }
}

async fn claim(env: &TestEnv, run: &RunId) -> trailmark::domain::Fence {
    let request = runs::ClaimRequest {
        version: 1,
        run_id: run.clone(),
        seq: 0,
        step: "link".into(),
        owner: "w".into(),
        lease_secs: 30.0,
        presence_pid: None,
        message: ("steps", MessageId::new()),
        redelivered: false,
        unstarted_preclaim: false,
    };
    match runs::claim(&env.pool, &request).await.unwrap() {
        runs::ClaimOutcome::Claimed(c) => c.fence,
        other => panic!("could not claim {run}: {other:?}"),
    }
}

async fn notes(env: &TestEnv) -> Vec<(String, i32)> {
    sqlx::query_as("SELECT k, v FROM app_notes ORDER BY k")
        .fetch_all(&env.pool)
        .await
        .unwrap()
}

async fn position(env: &TestEnv, id: &str) -> i64 {
    env.scalar(
        "SELECT step_seq::int8 FROM trailmark.runs WHERE run_id = $1",
        id,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_values_under_a_key_are_a_repeat_other_values_a_refusal_even_inside_a_group() {
    let env = TestEnv::new().await;
    sqlx::raw_sql(
        "CREATE TABLE app_notes (k TEXT PRIMARY KEY, v INTEGER NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let first = commit_with_note(&env, "n-1", ("k1", 1)).await;
    assert!(checkpoint::commit(&env.pool, &first).await.is_ok());
    let repeat = commit_with_note(&env, "n-2", ("k1", 1)).await;
    assert!(
        checkpoint::commit(&env.pool, &repeat).await.is_ok(),
        "the same values under the key are a repeat"
    );
    let other = commit_with_note(&env, "n-3", ("k1", 2)).await;
    match checkpoint::commit(&env.pool, &other).await {
        Err(store::Error::LocalWrite { run_id, seq, what }) => {
            assert_eq!((run_id.as_str(), seq), ("n-3", 0));
            assert!(
                what.contains("app_notes:k1") && what.contains("already holds other values"),
                "{what}"
            );
        }
        other => panic!("another value under k1 was not refused: {other:?}"),
    }
    assert_eq!(notes(&env).await, [("k1".to_owned(), 1)]);
    assert_eq!(
        (position(&env, "n-2").await, position(&env, "n-3").await),
        (1, 0)
    );
    let inbox = env
        .scalar(
            "SELECT count(*) FROM trailmark.inbox WHERE message_id = $1::uuid",
            &other.inbox.1.to_string(),
        )
        .await;
    assert_eq!(inbox, 0, "the refused commit left no inbox row");

    // In one group commit, the refused step costs the others nothing.
    let group = vec![
        commit_with_note(&env, "n-4", ("k2", 4)).await,
        commit_with_note(&env, "n-5", ("k1", 5)).await,
        commit_with_note(&env, "n-6", ("k3", 6)).await,
    ];
    let outcomes = checkpoint::commit_all(&env.pool, &group).await;
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
    assert!(
        matches!(&outcomes[1], Err(store::Error::LocalWrite { run_id, .. }) if run_id == "n-5"),
        "{outcomes:?}"
    );
    let expected = [("k1", 1), ("k2", 4), ("k3", 6)].map(|(k, v)| (k.to_owned(), v));
    assert_eq!(notes(&env).await, expected);
    let positions = [
        position(&env, "n-4").await,
        position(&env, "n-5").await,
        position(&env, "n-6").await,
    ];
    assert_eq!(positions, [1, 0, 1]);
}

/// Kills the process at `failpoint` on its 10th hit (inside step 10), checks what the kill left,
/// restarts and waits for the run to end.
async fn kill_in_step_10(env: &TestEnv, run_id: &str, failpoint: &str) -> (i64, i64) {
    let mut first = env.spawn_process(Some(&format!("{failpoint}=kill@10")));
    env.start_run("chain", run_id, local(30)).await;
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9), "not killed: {status:?}");
    let at_kill = (
        env.steps_done(run_id).await,
        env.chain_ledger(run_id).await.0,
    );
    let _second = env.spawn_process(None);
    env.wait_status(run_id, RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger(run_id).await, (30, 30));
    at_kill
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_its_commit_a_step_has_written_no_row_and_writes_it_once_on_resume() {
    let env = TestEnv::new().await;
    let at_kill = kill_in_step_10(&env, "r-lkill", "step.before_commit").await;
    assert_eq!(
        at_kill,
        (9, 9),
        "(steps committed, ledger rows) at the kill"
    );
    assert_eq!(
        env.attempts("r-lkill", 9).await,
        2,
        "the killed step ran again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_its_commit_a_step_is_not_run_again_and_its_row_stays_single() {
    let env = TestEnv::new().await;
    let at_kill = kill_in_step_10(&env, "r-lkill2", "step.after_commit").await;
    assert_eq!(
        at_kill,
        (10, 10),
        "(steps committed, ledger rows) at the kill"
    );
    assert_eq!(
        env.attempts("r-lkill2", 9).await,
        1,
        "a committed step never runs again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_fork_records_its_local_writes_and_writes_none_then_undo_reverses_the_parent() {
    let env = TestEnv::new().await;
    let engine = env.engine();
    let running = env.spawn_all(engine.clone());
    env.start_run("chain", "r-lp", local(6)).await;
    env.wait_status("r-lp", RunStatus::Succeeded, WAIT).await;

    let shadow = ForkRequest {
        from: ForkPoint::Position(3),
        run_id: Some("r-ls".into()),
        input: None,
        shadow: true,
        answers_from: None,
    };
    operator::fork(&engine, "r-lp", &shadow, &who())
        .await
        .unwrap();
    env.wait_status("r-ls", RunStatus::Shadowed, WAIT).await;
    assert_eq!(env.chain_ledger("r-ls").await, (0, 0), "a shadow run wrote");
    let recorded: Vec<(i32, String, String)> = sqlx::query_as(
        "SELECT seq, kind, key FROM trailmark.shadow_writes WHERE run_id = 'r-ls' ORDER BY seq",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let expected: Vec<(i32, String, String)> = (3..6)
        .map(|i| {
            let key = format!("trailmark.chain_ledger:r-ls:{i}");
            (i, effects::LOCAL_WRITE.to_owned(), key)
        })
        .collect();
    assert_eq!(recorded, expected);
    // The diff pairs each recorded row with the parent's write under the same key (the payload
    // hashes an answer to a prompt that names the run, so the rows differ).
    let d = trailmark::diff::compare(&env.pool, "r-lp", "r-ls")
        .await
        .unwrap();
    assert_eq!(d.compared, 3);
    let writes: Vec<(String, &str, &str)> = d
        .differences
        .iter()
        .flat_map(|p| &p.writes)
        .map(|w| (w.key.clone(), w.kind.as_str(), w.change))
        .collect();
    let paired: Vec<(String, &str, &str)> = (3..6)
        .map(|i| {
            (
                format!("trailmark.chain_ledger:{{run}}:{i}"),
                "local_write",
                "changed",
            )
        })
        .collect();
    assert_eq!(writes, paired);

    // Undo of the parent: its preview names each step's local write, and each reversal row
    // goes in once, with its compensation's commit.
    let preview = operator::undo_preview(&engine, "r-lp", UndoOptions::everything())
        .await
        .unwrap();
    let named: Vec<Vec<String>> = preview
        .compensations
        .iter()
        .map(|c| c.writes.clone())
        .collect();
    let expected: Vec<Vec<String>> = (0..6)
        .rev()
        .map(|i| vec![format!("trailmark.chain_ledger:r-lp:{i}")])
        .collect();
    assert_eq!(named, expected);
    operator::undo(&engine, "r-lp", &who(), UndoOptions::everything())
        .await
        .unwrap();
    env.wait_status("r-lp", RunStatus::Compensated, WAIT).await;
    let reversals: Vec<String> = sqlx::query_scalar(
        "SELECT reference FROM trailmark.chain_ledger WHERE run_id = 'r-lp' AND reference LIKE 'undo:%' ORDER BY step",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let expected: Vec<String> = (0..6).map(|i| format!("undo:r-lp:{i}")).collect();
    assert_eq!(reversals, expected);
    running.stop().await;
}

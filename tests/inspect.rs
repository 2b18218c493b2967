//! The reads of `trailmark::inspect` that the bench and the drill rely on: a prefix matches only
//! the runs that start with it (a `_` in it is no wildcard), the counts and times are those of
//! the runs that ran, and the finish notification arrives for each run.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use serde_json::json;
use sqlx::postgres::PgListener;
use trailmark::domain::RunStatus;
use trailmark::inspect;
use trailmark_testkit::ledger as chain;

use common::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reads_over_runs_see_what_ran_and_only_the_runs_of_their_prefix() {
    let env = TestEnv::new().await;
    let pool = &env.pool;
    inspect::notify_run_finishes(pool).await.unwrap();
    // Installing twice replaces the first: still one notification per finish.
    inspect::notify_run_finishes(pool).await.unwrap();
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener
        .listen(inspect::RUN_FINISHED_CHANNEL)
        .await
        .unwrap();
    let running = env.spawn_all(env.engine());
    let before = Utc::now();
    // `pX1-0` would match the prefix `p_1-` if the `_` were a LIKE wildcard.
    env.start_run("chain", "p_1-0", json!({"steps": 3, "ledger": "local"}))
        .await;
    env.start_run("chain", "p_1-1", json!({"steps": 3, "ledger": "effect"}))
        .await;
    env.start_run("chain", "pX1-0", json!({"steps": 2, "ledger": "local"}))
        .await;
    let mut finished = Vec::new();
    while finished.len() < 3 {
        let note = tokio::time::timeout(Duration::from_secs(60), listener.recv())
            .await
            .expect("every run's finish notified within 60 s")
            .unwrap();
        finished.push(note.payload().to_owned());
    }
    finished.sort();
    assert_eq!(finished, ["pX1-0", "p_1-0", "p_1-1"]);
    for id in ["p_1-0", "p_1-1", "pX1-0"] {
        env.wait_status(id, RunStatus::Succeeded, Duration::from_secs(5))
            .await;
    }

    let p = inspect::progress(pool, "p_1-").await.unwrap();
    assert_eq!((p.succeeded, p.steps_committed, p.stopped), (2, 6, None));
    let p = inspect::progress(pool, "pX1-").await.unwrap();
    assert_eq!((p.succeeded, p.steps_committed), (1, 2));

    let gaps = inspect::step_gap_percentiles(pool, "p_1-").await.unwrap();
    let (p50, p99) = (gaps.p50_ms.unwrap(), gaps.p99_ms.unwrap());
    assert!(0.0 < p50 && p50 <= p99, "{gaps:?}");
    let none = inspect::step_gap_percentiles(pool, "nobody-")
        .await
        .unwrap();
    assert_eq!((none.p50_ms, none.p99_ms), (None, None));

    let times = inspect::step_times(pool, "p_1-").await.unwrap();
    let positions: Vec<(&str, i32)> = times.iter().map(|t| (t.run_id.as_str(), t.seq)).collect();
    assert_eq!(
        positions,
        [
            ("p_1-0", 0),
            ("p_1-0", 1),
            ("p_1-0", 2),
            ("p_1-1", 0),
            ("p_1-1", 1),
            ("p_1-1", 2)
        ]
    );
    for t in &times {
        let committed = t.committed.expect("every position committed");
        assert_eq!(t.previous_commit.is_none(), t.seq == 0, "{t:?}");
        assert!(t.previous_commit.is_none_or(|p| p <= t.claimed), "{t:?}");
        assert!(t.claimed <= committed, "{t:?}");
        // Only the effect run records intents before its ledger writes.
        assert_eq!(
            t.first_effect_intent.is_some(),
            t.run_id == "p_1-1",
            "{t:?}"
        );
    }

    let counts = chain::ledger_counts(pool, "p_1-").await.unwrap();
    assert_eq!((counts.rows, counts.distinct), (6, 6));
    let counts = chain::ledger_counts(pool, "pX1-").await.unwrap();
    assert_eq!((counts.rows, counts.distinct), (2, 2));
    let rows = chain::ledger_row_times(pool, "p_1-").await.unwrap();
    assert_eq!(rows.len(), 6);
    assert!(rows.iter().all(|r| r.run_id.starts_with("p_1-")));
    let forward = chain::forward_ledger_counts(pool, &["p_1-1".into()])
        .await
        .unwrap();
    assert_eq!((forward.rows, forward.distinct), (3, 3));

    let ids: Vec<String> = ["p_1-0", "p_1-1", "pX1-0", "never-0"]
        .map(String::from)
        .into();
    let states = inspect::run_states(pool, &ids).await.unwrap();
    assert_eq!(states.len(), 3, "a run never created is left out");
    assert!(
        states
            .iter()
            .all(|s| s.status == RunStatus::Succeeded && !s.has_note)
    );
    let mut committed: Vec<(String, i64)> = inspect::committed_steps(pool, &ids)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.run_id, r.steps))
        .collect();
    committed.sort();
    assert_eq!(
        committed,
        [
            ("pX1-0".into(), 2),
            ("p_1-0".into(), 3),
            ("p_1-1".into(), 3)
        ]
    );
    let reached = inspect::positions_reached(pool, &ids[2..3]).await.unwrap();
    assert_eq!(
        reached.into_iter().collect::<HashSet<_>>(),
        HashSet::from([("pX1-0".into(), 0), ("pX1-0".into(), 1)])
    );
    let work = inspect::work_of_run(pool, "p_1-1").await.unwrap();
    assert_eq!((work.steps, work.effects), (3, 3));
    assert_eq!(
        inspect::completed_effects(pool, &ids[..1]).await.unwrap(),
        0,
        "a local-write run makes no outside write"
    );
    assert_eq!(inspect::completed_effects(pool, &ids).await.unwrap(), 3);
    let mut succeeded = inspect::succeeded_runs(pool, &ids).await.unwrap();
    succeeded.sort();
    assert_eq!(succeeded, ["pX1-0", "p_1-0", "p_1-1"]);

    let first = inspect::first_commit_after(pool, Some("p_1-"), before)
        .await
        .unwrap()
        .expect("a commit after the start");
    let all = inspect::commit_times_between(pool, before, Utc::now())
        .await
        .unwrap();
    assert_eq!(all.len(), 8);
    assert!(all.windows(2).all(|w| w[0] <= w[1]));
    let last = *all.last().unwrap();
    assert!(first >= all[0]);
    assert_eq!(
        inspect::first_commit_after(pool, None, before)
            .await
            .unwrap(),
        Some(all[0])
    );
    assert_eq!(
        inspect::first_commit_after(pool, None, last).await.unwrap(),
        None
    );
    let each = inspect::first_commit_of_each_after(pool, &ids, before)
        .await
        .unwrap();
    assert_eq!(each.len(), 3);
    assert!(each.iter().all(|c| c.at > before && c.at <= last));

    env.wait_until(
        "the outbox to be published",
        Duration::from_secs(30),
        || async { inspect::unpublished_outbox_rows(pool).await.unwrap() == 0 },
    )
    .await;
    running.stop().await;

    // Leases, and runs in review, set by hand on runs that never ran.
    for id in ["q_1-0", "qX1-0", "r-0", "r-1"] {
        env.insert_chain_run(id).await;
    }
    sqlx::query("UPDATE trailmark.runs SET lease_owner = 'worker-a' WHERE run_id LIKE 'q%'")
        .execute(pool)
        .await
        .unwrap();
    let leases = inspect::lease_owners(pool, "q_1-").await.unwrap();
    assert_eq!(
        leases
            .iter()
            .map(|l| (l.run_id.as_str(), l.owner.as_str()))
            .collect::<Vec<_>>(),
        [("q_1-0", "worker-a")]
    );
    assert!(
        inspect::lease_owners(pool, "p_1-")
            .await
            .unwrap()
            .is_empty()
    );
    sqlx::query(
        "UPDATE trailmark.runs SET status = 'needs_review',
                error = CASE run_id WHEN 'r-0' THEN 'stopped by seam x_y' ELSE 'stopped by seam xzy' END
          WHERE run_id LIKE 'r-%'",
    )
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(
        inspect::runs_in_review_mentioning(pool, "seam x_y")
            .await
            .unwrap(),
        ["r-0"]
    );
    let p = inspect::progress(pool, "r-").await.unwrap();
    let stopped = p.stopped.expect("a run in review has stopped");
    assert_eq!(
        (stopped.run_id.as_str(), stopped.status),
        ("r-0", RunStatus::NeedsReview)
    );

    // Counted by name: the engine's own triggers on runs (tombstones, waiting_since) stay.
    let finish_triggers = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'trailmark.runs'::regclass
                AND tgname = 'inspect_run_finished'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        n
    };
    assert_eq!(finish_triggers().await, 1, "the finish notification is on");
    inspect::stop_notifying_run_finishes(pool).await.unwrap();
    assert_eq!(
        finish_triggers().await,
        0,
        "the finish notification left a trigger behind"
    );

    inspect::erase_runs(pool).await.unwrap();
    chain::erase_ledger(pool).await.unwrap();
    assert_eq!(
        inspect::progress(pool, "").await.unwrap(),
        inspect::Progress::default()
    );
    assert_eq!(
        chain::ledger_counts(pool, "").await.unwrap(),
        chain::LedgerCounts::default()
    );
    drop(listener);
}

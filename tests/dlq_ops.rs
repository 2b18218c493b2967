//! The DLQ commands against the real servers: requeue by reason, purge and its confirmation,
//! unknown ids, and passes that follow each other closely.

mod common;
mod dlq_support;

use std::collections::BTreeMap;

use common::TestEnv;
use dlq_support::{WAIT, cli, dead_letters, depth, message, step_body, wait_dlq_depth};
use serde_json::json;
use trailmark::broker::{self, Outgoing};
use trailmark::dlq::{Dlq, Selection, quiet};
use trailmark::domain::{RUN_START_ROUTING_KEY, STEP_ROUTING_KEY};

/// The audit trail, oldest first: "actor action target reason" and the details.
async fn audit_rows(env: &TestEnv) -> Vec<(String, serde_json::Value)> {
    sqlx::query_as(
        "SELECT actor || ' ' || action || ' ' || target || ' ' || reason, details
           FROM trailmark.audit ORDER BY id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_by_reason_sends_each_back_to_its_queue_and_a_still_broken_one_returns() {
    let env = TestEnv::new().await;
    let t = env.topology();
    let v2 = |run: &str| json!({"v": 2, "run_id": run, "workflow": "chain"}).to_string();
    let msgs = [
        message(
            t.runs_exchange(),
            RUN_START_ROUTING_KEY,
            "a-1",
            v2("r-a").into_bytes(),
        ),
        message(
            t.steps_exchange(),
            STEP_ROUTING_KEY,
            "a-2",
            step_body("r-b", "chain", 2),
        ),
        message(
            t.steps_exchange(),
            STEP_ROUTING_KEY,
            "a-3",
            b"\xff\xfe".to_vec(),
        ),
    ];
    env.publish_all(&msgs).await;
    let running = env.spawn_all(env.engine());
    wait_dlq_depth(&env, 3).await;

    let (code, out, err) = cli(
        &env,
        &[
            "dlq",
            "requeue",
            "--reason",
            "unsupported_version",
            "--why",
            "v2 parser deployed",
            "--actor",
            "dora",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("requeued 2 of 3"), "{out}");
    assert!(
        out.contains(&format!("1 to {}", t.run_start_queue())),
        "{out}"
    );
    assert!(out.contains(&format!("1 to {}", t.steps_queue())), "{out}");
    // Still version 2: the worker dead-letters both again, from the queue they were sent to.
    env.wait_until("both back in the DLQ as requeued once", WAIT, || async {
        dead_letters(&env)
            .await
            .iter()
            .filter(|l| l.requeued == 1)
            .count()
            == 2
    })
    .await;
    let letters = dead_letters(&env).await;
    let seen: BTreeMap<_, _> = letters
        .iter()
        .map(|l| {
            (
                l.id.as_str(),
                (l.reason.as_str(), l.queue.clone().unwrap(), l.requeued),
            )
        })
        .collect();
    let want = BTreeMap::from([
        ("a-1", ("unsupported_version", t.run_start_queue(), 1)),
        ("a-2", ("unsupported_version", t.steps_queue(), 1)),
        ("a-3", ("undecodable", t.steps_queue(), 0)),
    ]);
    assert_eq!(seen, want);
    let (code, out, _) = cli(&env, &["dlq", "requeue", "--reason", "nothing_like_this"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("requeued 0 of 3") && out.contains("no dead letter has reason"),
        "{out}"
    );
    // Both passes are in the audit trail, with who, why, what was selected and what it did.
    let rows = audit_rows(&env).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        rows[0].0.as_str(),
        "dora dlq.requeue reason:unsupported_version v2 parser deployed",
    );
    assert_eq!(rows[0].1["requeued"], 2);
    assert!(
        rows[1]
            .0
            .ends_with("dlq.requeue reason:nothing_like_this no reason given"),
        "{rows:?}"
    );
    assert_eq!(rows[1].1["requeued"], 0);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_refuses_without_a_terminal_purges_with_yes_and_errors_say_what_to_do() {
    let env = TestEnv::new().await;
    let t = env.topology();
    let garbage: Vec<_> = (0..3)
        .map(|i| {
            message(
                t.steps_exchange(),
                STEP_ROUTING_KEY,
                &format!("g-{i}"),
                vec![0x80, i],
            )
        })
        .collect();
    env.publish_all(&garbage).await;
    let running = env.spawn_all(env.engine());
    wait_dlq_depth(&env, 3).await;
    running.stop().await;

    let (code, out, err) = cli(&env, &["dlq", "show", "g-1"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("reason      undecodable") && out.contains("2 bytes, not UTF-8 JSON"),
        "{out}"
    );
    assert!(out.contains("hex: 8001"), "{out}");

    let (code, _, err) = cli(&env, &["dlq", "purge", "--all"]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("refusing to purge all 3 dead letters") && err.contains("--yes"),
        "{err}"
    );
    assert_eq!(depth(&env, &t.dlq()).await, 3, "refused, yet purged");
    assert!(
        audit_rows(&env).await.is_empty(),
        "a refused purge is audited"
    );

    let (code, out, err) = cli(&env, &["dlq", "purge", "g-1", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("purged 1 dead letters"), "{out}");
    let mut left: Vec<_> = dead_letters(&env).await.into_iter().map(|l| l.id).collect();
    left.sort();
    assert_eq!(left, ["g-0", "g-2"], "only g-1 was removed");

    let (code, out, err) = cli(&env, &["dlq", "purge", "--all", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("purged 2 dead letters"), "{out}");
    assert_eq!(depth(&env, &t.dlq()).await, 0);
    let rows: Vec<(String, i64)> = audit_rows(&env)
        .await
        .into_iter()
        .map(|(what, details)| (what, details["purged"].as_i64().unwrap_or(-1)))
        .collect();
    let has = |rest: &str| rows.iter().any(|(w, _)| w.ends_with(rest));
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(
        has("dlq.purge g-1 no reason given") && has("dlq.purge all no reason given"),
        "{rows:?}"
    );
    assert_eq!((rows[0].1, rows[1].1), (1, 2));

    let (code, _, err) = cli(&env, &["dlq", "show", "nope"]).await;
    assert_eq!(code, 1);
    let expected = format!(
        "no dead letter with id nope in {}; list them with `trailmark dlq list`",
        t.dlq()
    );
    assert!(err.contains(&expected), "{err}");
    let (code, out, _) = cli(&env, &["dlq", "list"]).await;
    assert_eq!(
        (code, out.trim()),
        (0, format!("{} is empty", t.dlq()).as_str())
    );

    let out = env
        .command(&["dlq", "list"])
        .env("AMQP_URL", "amqp://guest:hunter2@127.0.0.1:1/%2f")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "broker down is exit 2: {err}");
    assert!(
        err.contains("cannot connect to RabbitMQ") && !err.contains("hunter2"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_passes_each_see_every_message() {
    let env = TestEnv::new().await;
    let t = env.topology();
    let headers = broker::map_to_headers(&BTreeMap::from([
        ("x-trailmark-reason".to_owned(), "undecodable".to_owned()),
        ("x-trailmark-queue".to_owned(), t.steps_queue()),
    ]));
    let letters: Vec<_> = (0..300)
        .map(|i| Outgoing {
            headers: headers.clone(),
            ..message(t.dlx(), "", &format!("d-{i:03}"), b"{".to_vec())
        })
        .collect();
    env.publish_all(&letters).await;
    wait_dlq_depth(&env, 300).await;
    // A quorum queue takes a closed channel's messages back a moment after the close; every
    // pass must still see all of them, and a purge right after a show must find its message.
    let dlq = Dlq::connect(&env.settings.broker).await.unwrap();
    for pass in 0..4 {
        let listing = dlq
            .list(&trailmark::dlq::Page::all(), &quiet)
            .await
            .unwrap();
        assert_eq!(
            (listing.depth, listing.letters.len()),
            (300, 300),
            "pass {pass}"
        );
    }
    for (n, id) in ["d-299", "d-000"].into_iter().enumerate() {
        let shown = dlq.show(id, &quiet).await.unwrap();
        assert_eq!(shown.letter.reason, "undecodable");
        let purged = dlq.purge(&Selection::Id(id.into()), &quiet).await.unwrap();
        assert_eq!(
            (purged.purged, purged.left, purged.unseen),
            (1, 299 - n as u32, 0),
            "{id}"
        );
        let again = dlq.purge(&Selection::Id(id.into()), &quiet).await;
        assert!(
            matches!(again, Err(trailmark::dlq::Error::NotFound { .. })),
            "{id}: {again:?}"
        );
    }
    assert_eq!(dlq.depth().await.unwrap(), 298);
    dlq.close().await;
}

/// `dlq list --json` with these extra arguments: its letter ids and its `next` cursor.
async fn page_of(env: &TestEnv, extra: &[&str]) -> (Vec<String>, Option<String>) {
    let mut args = vec!["dlq", "list", "--json", "--limit", "5"];
    args.extend_from_slice(extra);
    let (code, out, err) = cli(env, &args).await;
    assert_eq!(code, 0, "{err}");
    let listing: serde_json::Value = serde_json::from_str(&out).expect("JSON listing");
    assert_eq!(listing["depth"], 12, "{out}");
    let ids = listing["letters"]
        .as_array()
        .expect("letters")
        .iter()
        .map(|l| l["id"].as_str().expect("id").to_owned())
        .collect();
    (ids, listing["next"].as_str().map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_is_stable_oldest_first_and_pages_through_each_letter_once_removing_none() {
    let env = TestEnv::new().await;
    let t = env.topology();
    // Published in one order, dead at times in another: the listing follows the time of death.
    let died = |i: usize| format!("2026-11-30T10:00:{:02}+00:00", (i * 7) % 12);
    let letters: Vec<_> = (0..12)
        .map(|i| Outgoing {
            headers: broker::map_to_headers(&BTreeMap::from([
                ("x-trailmark-reason".to_owned(), "undecodable".to_owned()),
                ("x-trailmark-queue".to_owned(), t.steps_queue()),
                ("x-trailmark-failed-at".to_owned(), died(i)),
            ])),
            ..message(t.dlx(), "", &format!("p-{i:02}"), b"{".to_vec())
        })
        .collect();
    env.publish_all(&letters).await;
    wait_dlq_depth(&env, 12).await;
    let mut oldest_first: Vec<usize> = (0..12).collect();
    oldest_first.sort_by_key(|i| died(*i));
    let expected: Vec<String> = oldest_first.iter().map(|i| format!("p-{i:02}")).collect();

    let first = page_of(&env, &[]).await;
    assert_eq!(first.0, expected[..5], "the oldest five");
    assert_eq!(page_of(&env, &[]).await, first, "the same page again");
    let mut seen = first.0.clone();
    let mut next = first.1;
    while let Some(cursor) = next {
        let page = page_of(&env, &["--after", &cursor]).await;
        seen.extend(page.0);
        next = page.1;
    }
    assert_eq!(seen, expected, "every letter once, oldest first");

    // Nothing left the DLQ (a quorum queue may hand the messages back in another order, which
    // is why the listing orders by the letters themselves).
    wait_dlq_depth(&env, 12).await;
    let mut kept: Vec<String> = dead_letters(&env).await.into_iter().map(|l| l.id).collect();
    kept.sort();
    let mut all = expected.clone();
    all.sort();
    assert_eq!(kept, all);
    let (code, _, err) = cli(&env, &["dlq", "list", "--after", "not-a-cursor"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a cursor `dlq list` printed"), "{err}");
}

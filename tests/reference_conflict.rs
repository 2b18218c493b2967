//! The outside stores enforce their keys: a reused key with another amount is a conflict that
//! names the key (and stops the run for a person), an older fencing token is refused, and a
//! repeated note is recorded once at the mail sink.

mod common;
mod reference_support;

use std::collections::BTreeMap;

use reference_support::{RefEnv, WAIT, expected_mismatches};
use trailmark::broker::{Outgoing, map_to_headers};
use trailmark::domain::RunStatus;
use trailmark::failpoint::Failpoints;
use trailmark_reference::ledger::{self, Entry, Posted};
use trailmark_reference::{Error, logic, mail};

fn entry(reference: &str, amount_cents: i64) -> Entry {
    Entry {
        reference: reference.into(),
        run_id: "run-x".into(),
        invoice_no: "INV-1".into(),
        line: 1,
        kind: "qty".into(),
        supplier: "SUP01".into(),
        amount_cents,
        reverses: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_refuses_a_reused_key_with_another_amount_and_names_the_key() {
    let r = RefEnv::new().await;
    let key = "run-x:INV-1:1:qty";
    assert_eq!(
        ledger::post(&r.outside, &entry(key, 1250), Some(3))
            .await
            .unwrap(),
        Posted::Created
    );
    assert_eq!(
        ledger::post(&r.outside, &entry(key, 1250), Some(3))
            .await
            .unwrap(),
        Posted::AlreadyThere
    );
    match ledger::post(&r.outside, &entry(key, 1300), Some(3)).await {
        Err(e @ Error::Conflict { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(key) && text.contains("12.50 EUR") && text.contains("13.00 EUR"),
                "{text}"
            );
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(
        ledger::entries(&r.outside, "run-x").await.unwrap(),
        vec![(key.to_owned(), 1250)],
        "the stored amount changed"
    );

    // A newer worker has shown token 5; the old one (3) may no longer post anything.
    assert_eq!(
        ledger::post(&r.outside, &entry("run-x:INV-2:1:qty", 10), Some(5))
            .await
            .unwrap(),
        Posted::Created
    );
    match ledger::post(&r.outside, &entry("run-x:INV-3:1:qty", 10), Some(3)).await {
        Err(e @ Error::FencedOut { .. }) => assert!(e.to_string().contains("run-x"), "{e}"),
        other => panic!("expected a fenced-out refusal, got {other:?}"),
    }
    assert_eq!(ledger::counts(&r.outside, "run-x").await.unwrap(), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_meeting_a_reused_key_stops_for_review_naming_the_key() {
    let r = RefEnv::new().await;
    let night = RefEnv::night(40, 5);
    let run_id = night.run_id().to_string();
    // An earlier, different adjustment already holds the key of the night's first mismatch.
    let first = expected_mismatches(&night).remove(0);
    let mut squatter = logic::entry(&run_id, &first);
    squatter.amount_cents += 100;
    ledger::post(&r.outside, &squatter, None).await.unwrap();

    let engine = r
        .env
        .engine_with(trailmark_reference::registry(), Failpoints::default());
    let running = r.env.spawn_all(engine);
    r.start(&night).await;
    let run = r
        .env
        .wait_status(&run_id, RunStatus::NeedsReview, WAIT)
        .await;
    let error = run.error.unwrap_or_default();
    assert!(
        error.contains(&first.key),
        "the review reason does not name the key: {error}"
    );
    assert!(
        error.contains("post_ledger_adjustments"),
        "the review reason does not name the step: {error}"
    );
    assert_eq!(
        ledger::entries(&r.outside, &run_id).await.unwrap(),
        vec![(first.key.clone(), squatter.amount_cents)],
        "the conflicting key was overwritten or later entries were posted"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_note_delivered_twice_is_recorded_once_at_the_sink() {
    let mut r = RefEnv::new().await;
    r.start_mail_sender();
    let note = mail::Mail {
        kind: "debit_note".into(),
        run_id: "run-mail".into(),
        claim: "DN-2026-10-13-SUP03".into(),
        recipient: "accounts@sup03.example".into(),
        subject: "Debit note DN-2026-10-13-SUP03".into(),
        body: "claim DN-2026-10-13-SUP03".into(),
    };
    let headers = BTreeMap::from([(
        trailmark::workflow::IDEMPOTENCY_KEY_HEADER.to_owned(),
        "run-mail:send_debit_notes:SUP03".to_owned(),
    )]);
    // Two deliveries of the same note (as a relay repeat would make), under two message ids.
    let copies: Vec<Outgoing> = (0..2)
        .map(|_| Outgoing {
            message_id: uuid::Uuid::new_v4().to_string(),
            exchange: mail::exchange(&r.env.prefix),
            routing_key: "debit_note".into(),
            headers: map_to_headers(&headers),
            body: serde_json::to_vec(&note).unwrap(),
        })
        .collect();
    r.env.publish_all(&copies).await;
    let reached = common::eventually("the second delivery to reach the sink", WAIT, || async {
        let counts = mail::counts(&r.outside, "run-mail").await.unwrap();
        (counts.repeats_ignored >= 1).then_some(counts)
    })
    .await;
    let counts = reached.expect("the second delivery never reached the sink");
    assert_eq!(
        counts,
        mail::SinkCounts {
            notes: 1,
            duplicate_notes: 0,
            repeats_ignored: 1,
            summaries: 0,
            withdrawals: 0
        }
    );
}

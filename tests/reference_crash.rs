//! The reference story with real process kills: a worker SIGKILLs itself at a
//! named spot of `reconcile`, a fresh `trailmark serve` resumes, and the outside systems show
//! that nothing was read, asked, posted or sent twice.

mod common;
mod reference_support;

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;

use reference_support::{RefEnv, WAIT, expected_mismatches};
use trailmark::domain::RunStatus;
use trailmark_reference::checkpoints::{Notes, WriteOutcome, Writes};
use trailmark_reference::workflow::{EXTRACT, POST, SEND_NOTES};
use trailmark_reference::{invoices, ledger, mail};

fn suppliers(night: &trailmark_reference::night::Night) -> i64 {
    let mismatches = expected_mismatches(night);
    mismatches
        .iter()
        .map(|m| m.matched.item.supplier.clone())
        .collect::<BTreeSet<_>>()
        .len() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_entry_24_the_resumed_run_posts_each_adjustment_once() {
    let mut r = RefEnv::new().await;
    r.start_mail_sender();
    let night = RefEnv::night(312, 40);
    let run_id = night.run_id().to_string();
    let mut first = r.serve(Some("reconcile.post_entry=kill@24"));
    r.start(&night).await;
    let status = r.died(&mut first).await;
    assert_eq!(
        status.signal(),
        Some(9),
        "the worker should have SIGKILLed itself: {status:?}"
    );
    assert_eq!(
        ledger::counts(&r.outside, &run_id).await.unwrap(),
        (23, 23),
        "23 entries committed before the kill"
    );
    let calls_before_resume = r.model.answered();
    assert_eq!(
        calls_before_resume, 312,
        "one model call per invoice before the crash"
    );

    let _second = r.serve(None);
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    assert_eq!(ledger::counts(&r.outside, &run_id).await.unwrap(), (40, 40));
    assert_eq!(
        r.model.answered(),
        calls_before_resume,
        "the resumed run asked the model again"
    );
    assert_eq!(
        invoices::reads(&r.outside, &night, &run_id).await.unwrap(),
        312,
        "invoices were read again"
    );
    let posted: Writes = r.output(&run_id, POST).await;
    let recorded = posted
        .writes
        .iter()
        .filter(|w| w.outcome == WriteOutcome::Recorded)
        .count();
    assert_eq!(
        (posted.written, recorded),
        (17, 23),
        "17 posted after the resume, 23 known from before"
    );
    let repeated: Vec<_> = r
        .attempts(&run_id)
        .await
        .into_iter()
        .filter(|(_, a)| *a > 1)
        .collect();
    assert_eq!(
        repeated,
        vec![(POST.to_owned(), 2)],
        "only the interrupted step ran twice"
    );
    let expected: Vec<(String, i64)> = {
        let mut v: Vec<_> = expected_mismatches(&night)
            .into_iter()
            .map(|m| (m.key, m.amount_cents))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        ledger::entries(&r.outside, &run_id).await.unwrap(),
        expected
    );
    let sink = r.wait_sink(&run_id, suppliers(&night), 1).await;
    assert_eq!(
        sink,
        mail::SinkCounts {
            notes: suppliers(&night),
            duplicate_notes: 0,
            repeats_ignored: 0,
            summaries: 1,
            withdrawals: 0
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_inside_step_2_the_journaled_answers_are_not_asked_again() {
    let r = RefEnv::new().await;
    let night = RefEnv::night(60, 8);
    let run_id = night.run_id().to_string();
    let mut first = r.serve(Some("reconcile.extract.answer=kill@25"));
    r.start(&night).await;
    assert_eq!(r.died(&mut first).await.signal(), Some(9));
    assert_eq!(
        r.model.answered(),
        25,
        "25 answers paid for before the kill"
    );
    let journaled = r
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            &run_id,
        )
        .await;
    assert_eq!(
        journaled, 25,
        "every paid answer was journaled before the kill"
    );

    let _second = r.serve(None);
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        r.model.answered(),
        60,
        "each invoice's answer was paid for exactly once"
    );
    assert_eq!(
        r.env
            .scalar(
                "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
                &run_id
            )
            .await,
        60
    );
    let extracted: trailmark_reference::checkpoints::Extracted = r.output(&run_id, EXTRACT).await;
    assert_eq!(
        extracted.answers.len(),
        60,
        "the checkpoint carries every model answer"
    );
    assert_eq!(ledger::counts(&r.outside, &run_id).await.unwrap(), (8, 8));
    assert_eq!(
        invoices::reads(&r.outside, &night, &run_id).await.unwrap(),
        60
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_last_ledger_commit_the_ledger_key_absorbs_the_repeat() {
    let r = RefEnv::new().await;
    let night = RefEnv::night(60, 8);
    let run_id = night.run_id().to_string();
    // The 8th ledger commit is the last: the ledger has the row, trailmark only the intent.
    let mut first = r.serve(Some("reconcile.ledger.after_commit=kill@8"));
    r.start(&night).await;
    assert_eq!(r.died(&mut first).await.signal(), Some(9));
    assert_eq!(ledger::counts(&r.outside, &run_id).await.unwrap(), (8, 8));
    let unknown = r
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.effects WHERE run_id = $1 AND result IS NULL",
            &run_id,
        )
        .await;
    assert_eq!(
        unknown, 1,
        "the last entry's outcome is unknown to trailmark"
    );

    let _second = r.serve(None);
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        ledger::counts(&r.outside, &run_id).await.unwrap(),
        (8, 8),
        "the repeat left a second row"
    );
    let posted: Writes = r.output(&run_id, POST).await;
    let outcomes: Vec<WriteOutcome> = posted.writes.iter().map(|w| w.outcome).collect();
    assert_eq!(outcomes[..7], [WriteOutcome::Recorded; 7]);
    assert_eq!(
        outcomes[7],
        WriteOutcome::AlreadyThere,
        "the unknown one was posted again and recognised"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_inside_step_9_no_supplier_gets_a_note_twice() {
    let mut r = RefEnv::new().await;
    r.start_mail_sender();
    let night = RefEnv::night(60, 8);
    let run_id = night.run_id().to_string();
    let mut first = r.serve(Some("reconcile.notes.queued=kill@1"));
    r.start(&night).await;
    assert_eq!(r.died(&mut first).await.signal(), Some(9));
    let exchange = mail::exchange(&r.env.prefix);
    let outbox = r
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.outbox WHERE exchange = $1",
            &exchange,
        )
        .await;
    assert_eq!(outbox, 0, "notes of an uncommitted step reached the outbox");

    let _second = r.serve(None);
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    let notes: Notes = r.output(&run_id, SEND_NOTES).await;
    let expected = suppliers(&night);
    assert_eq!(notes.notes.len() as i64, expected);
    let sink = r.wait_sink(&run_id, expected, 1).await;
    assert_eq!(
        sink,
        mail::SinkCounts {
            notes: expected,
            duplicate_notes: 0,
            repeats_ignored: 0,
            summaries: 1,
            withdrawals: 0
        }
    );
    let bodies: Vec<String> = sqlx::query_scalar(
        "SELECT body FROM reference.mail_messages WHERE run_id = $1 AND kind = 'debit_note'",
    )
    .bind(&run_id)
    .fetch_all(&r.outside)
    .await
    .unwrap();
    for (body, note) in bodies.iter().zip(&notes.notes) {
        assert!(
            bodies.iter().any(|b| b.contains(&note.claim)),
            "no note names claim {}",
            note.claim
        );
        assert!(
            body.contains("claim DN-"),
            "a note does not name its claim: {body}"
        );
    }
}

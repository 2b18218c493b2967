//! A supplier's later correction: its adjustments were wrong, so the run is undone
//! for that supplier only. Reversal entries and stock reversals point at the originals, one
//! withdrawal note names the claim, and nothing of the other suppliers changes.

mod common;
mod reference_support;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::Running;

use reference_support::{RefEnv, WAIT, expected_mismatches};
use serde_json::json;
use trailmark::domain::RunStatus;
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::operator::{self, Decider, UndoOptions};
use trailmark_reference::night::Night;
use trailmark_reference::{logic, mail, stock, undo};

/// The default night, run to success by an in-process engine with the mail sender running.
async fn finished_night() -> (RefEnv, Night, String, Arc<Engine>, Running) {
    let mut r = RefEnv::new().await;
    r.start_mail_sender();
    let night = RefEnv::night(312, 40);
    let run_id = night.run_id().to_string();
    let engine = r
        .env
        .engine_with(trailmark_reference::registry(), Failpoints::default());
    let running = r.env.spawn_all(engine.clone());
    r.start(&night).await;
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    (r, night, run_id, engine, running)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suppliers_correction_is_undone_with_reversals_and_one_withdrawal() {
    let (r, night, run_id, engine, running) = finished_night().await;

    let expected = expected_mismatches(&night);
    let mut per_supplier: BTreeMap<String, i64> = BTreeMap::new();
    for m in &expected {
        *per_supplier
            .entry(m.matched.item.supplier.clone())
            .or_default() += 1;
    }
    let (supplier, k) = per_supplier
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(s, n)| (s.clone(), *n))
        .unwrap();
    // The preview lists exactly the reversals the undo then writes: one ledger entry per
    // adjustment of that supplier, and nothing of the others.
    let scope = UndoOptions::scoped(json!({ "supplier": supplier }));
    let preview = operator::undo_preview(&engine, &run_id, scope)
        .await
        .unwrap();
    let listed = |step: &str| -> Vec<String> {
        let c = preview
            .compensations
            .iter()
            .find(|c| c.step == step)
            .unwrap();
        let mut keys: Vec<String> = c
            .reversals
            .as_ref()
            .unwrap()
            .iter()
            .map(|r| r.key.clone())
            .collect();
        keys.sort();
        keys
    };
    let ledger_listed = listed("post_ledger_adjustments");
    assert_eq!(ledger_listed.len() as i64, k, "{preview:?}");
    assert_eq!(
        listed("send_debit_notes").len(),
        1,
        "one withdrawal for one supplier"
    );
    let who = Decider::cli("maria.ops", format!("{supplier} corrected its invoices"));
    operator::undo(
        &engine,
        &run_id,
        &who,
        UndoOptions::scoped(json!({ "supplier": supplier })),
    )
    .await
    .unwrap();
    r.env
        .wait_status(&run_id, RunStatus::Compensated, WAIT)
        .await;

    let mut written: Vec<String> = sqlx::query_scalar(
        "SELECT reference FROM reference.entries WHERE run_id = $1 AND reverses IS NOT NULL",
    )
    .bind(&run_id)
    .fetch_all(&r.outside)
    .await
    .unwrap();
    written.sort();
    assert_eq!(
        written, ledger_listed,
        "the undo wrote what the preview listed"
    );

    let (rows, reversals, supplier_sum, others_sum): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(reverses),
                COALESCE(sum(amount_cents) FILTER (WHERE supplier = $2), 0)::bigint,
                COALESCE(sum(amount_cents) FILTER (WHERE supplier <> $2), 0)::bigint
           FROM reference.entries WHERE run_id = $1",
    )
    .bind(&run_id)
    .bind(&supplier)
    .fetch_one(&r.outside)
    .await
    .unwrap();
    let others: i64 = expected
        .iter()
        .filter(|m| m.matched.item.supplier != supplier)
        .map(|m| m.amount_cents)
        .sum();
    assert_eq!(
        (rows, reversals, supplier_sum, others_sum),
        (40 + k, k, 0, others),
        "reversals of {supplier} only"
    );
    let dangling: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM reference.entries r LEFT JOIN reference.entries o ON o.reference = r.reverses
          WHERE r.run_id = $1 AND r.reverses IS NOT NULL AND (o.reference IS NULL OR o.supplier <> $2)",
    )
    .bind(&run_id)
    .bind(&supplier)
    .fetch_one(&r.outside)
    .await
    .unwrap();
    assert_eq!(
        dangling, 0,
        "a reversal points at nothing, or at another supplier's entry"
    );

    assert_eq!(
        stock::counts(&r.outside, &run_id).await.unwrap(),
        (40 + k, 40 + k)
    );
    let held: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(s.disputed_qty), 0)::bigint FROM reference.stock_received s
          JOIN reference.entries e ON e.run_id = $1 AND e.reverses IS NULL AND e.supplier = $2
           AND s.po_no = 'PO-' || split_part(e.invoice_no, '-', 2) || '-' || split_part(e.invoice_no, '-', 3) AND s.line = e.line",
    )
    .bind(&run_id)
    .bind(&supplier)
    .fetch_one(&r.outside)
    .await
    .unwrap();
    assert_eq!(held, 0, "units of {supplier}'s lines are still on hold");

    let sink = r.wait_sink(&run_id, per_supplier.len() as i64, 1).await;
    r.env
        .wait_until("the withdrawal reached the sink", WAIT, || async {
            mail::counts(&r.outside, &run_id).await.unwrap().withdrawals == 1
        })
        .await;
    let claim: String = sqlx::query_scalar(
        "SELECT claim FROM reference.mail_messages WHERE run_id = $1 AND kind = 'withdrawal'",
    )
    .bind(&run_id)
    .fetch_one(&r.outside)
    .await
    .unwrap();
    assert_eq!(claim, logic::claim(&night.id(), &supplier));
    assert_eq!(sink.duplicate_notes, 0);
    running.stop().await;
}

#[test]
fn an_undo_scope_that_selects_nothing_or_is_not_understood_is_refused() {
    let night = RefEnv::night(312, 40);
    let all = expected_mismatches(&night);
    assert_eq!(undo::select(&all, &json!({})).unwrap().len(), 40);
    let err = undo::select(&all, &json!({"supplier": "S-07"})).unwrap_err();
    assert!(err.contains("selects none") && err.contains("SUP"), "{err}");
    let err = undo::select(&all, &json!({"vendor": "SUP03"})).unwrap_err();
    assert!(err.contains("vendor"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_undo_reverses_every_entry_releases_all_stock_and_withdraws_each_note_once() {
    let (r, night, run_id, engine, running) = finished_night().await;
    let disputed = || async {
        sqlx::query_scalar::<_, i64>("SELECT COALESCE(sum(disputed_qty), 0)::bigint FROM reference.stock_received WHERE night = $1")
            .bind(night.id())
            .fetch_one(&r.outside)
            .await
            .unwrap()
    };
    assert!(disputed().await > 0, "the run put units on hold");
    let suppliers = expected_mismatches(&night)
        .iter()
        .map(|m| m.matched.item.supplier.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .len() as i64;
    let notes = r.wait_sink(&run_id, suppliers, 1).await.notes;
    assert_eq!(notes, suppliers, "one debit note per over-billed supplier");

    let who = Decider::cli(
        "maria.ops",
        "the whole night was run against the wrong price list",
    );
    operator::undo(&engine, &run_id, &who, UndoOptions::everything())
        .await
        .unwrap();
    r.env
        .wait_status(&run_id, RunStatus::Compensated, WAIT)
        .await;

    let (rows, reversals, sum): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(reverses), COALESCE(sum(amount_cents), 0)::bigint FROM reference.entries WHERE run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&r.outside)
    .await
    .unwrap();
    assert_eq!(
        (rows, reversals, sum),
        (80, 40, 0),
        "40 entries, 40 reversals, nothing left standing"
    );
    assert_eq!(disputed().await, 0, "stock is back where it started");
    r.env
        .wait_until("every withdrawal reached the sink", WAIT, || async {
            mail::counts(&r.outside, &run_id).await.unwrap().withdrawals >= notes
        })
        .await;
    let sink = mail::counts(&r.outside, &run_id).await.unwrap();
    assert_eq!(
        (sink.withdrawals, sink.duplicate_notes),
        (notes, 0),
        "one withdrawal per debit note"
    );
    running.stop().await;
}

//! The first version from the story: all ten steps in one pass, nothing checkpointed, plain
//! inserts into a ledger table without a unique key. After a crash it can only start again from
//! step 1: it reads every invoice again, pays for every model answer again and posts again the
//! entries it had already posted. `trailmark demo --naive` runs it to measure the damage.

use sqlx::PgPool;

use super::night::Night;
use super::{extract, invoices, logic, mail, orders, stock};
use trailmark::failpoint::{Failpoints, Injected};
use trailmark::model::ModelClient;

/// Why a naive pass stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An outside store failed.
    #[error(transparent)]
    Outside(#[from] super::Error),
    /// The model call failed (the naive version has no retries either).
    #[error("model call for invoice {invoice}: {error}")]
    Model {
        /// The invoice being read.
        invoice: String,
        /// What went wrong.
        error: trailmark::model::Error,
    },
    /// The model's answer could not be used.
    #[error("model answer for invoice {invoice}: {why}")]
    Answer {
        /// The invoice being read.
        invoice: String,
        /// What is wrong with it.
        why: String,
    },
    /// A failpoint fired (drills).
    #[error(transparent)]
    Injected(#[from] Injected),
}

/// Failpoint hit before each plain ledger insert.
pub const POST_FAILPOINT: &str = "reconcile.naive.post_entry";

/// One pass of the naive version, from step 1 to step 10, under `night.naive_run_id()`.
pub async fn run_pass(
    outside: &PgPool,
    model: &ModelClient,
    night: &Night,
    failpoints: &Failpoints,
) -> Result<(), Error> {
    let run_id = night.naive_run_id();
    let run = run_id.as_str();
    orders::seed(outside, night).await?;
    let scans = invoices::fetch(outside, night, run).await?;
    let mut items = Vec::new();
    for scan in &scans {
        let answer = model
            .chat(&extract::request(&scan.text))
            .await
            .map_err(|error| Error::Model {
                invoice: scan.invoice_no.clone(),
                error,
            })?;
        let read = extract::parse_answer(&answer.content).map_err(|why| Error::Answer {
            invoice: scan.invoice_no.clone(),
            why,
        })?;
        items.extend(logic::items(scan, &read));
    }
    let po_nos: Vec<String> = scans.iter().map(|s| s.po_no.clone()).collect();
    let order_rows = orders::read(outside, night, &po_nos).await?;
    let matched = logic::match_orders(&items, &order_rows).map_err(super::Error::Invalid)?;
    let received = stock::read_received(outside, night, &po_nos).await?;
    let over = logic::compare(&matched, &received).map_err(super::Error::Invalid)?;
    let mismatches = logic::flag(run, &over);
    for m in &mismatches {
        failpoints.hit(POST_FAILPOINT)?;
        sqlx::query("INSERT INTO reference.naive_entries (reference, run_id, invoice_no, amount_cents) VALUES ($1, $2, $3, $4)")
            .bind(&m.key)
            .bind(run)
            .bind(&m.matched.item.invoice_no)
            .bind(m.amount_cents)
            .execute(outside)
            .await
            .map_err(super::Error::from)?;
    }
    for m in &mismatches {
        sqlx::query("INSERT INTO reference.naive_stock_adjustments (reference, run_id, qty) VALUES ($1, $2, $3)")
            .bind(format!("{}:stock", m.key))
            .bind(run)
            .bind(m.disputed_qty)
            .execute(outside)
            .await
            .map_err(super::Error::from)?;
    }
    let groups = logic::by_supplier(&mismatches);
    for (supplier, lines) in &groups {
        // Sent straight away under a fresh id: nothing would recognise a repeat.
        let note = logic::debit_note(run, &night.id(), supplier, lines);
        mail::deliver(outside, &format!("naive:{}", uuid::Uuid::new_v4()), &note).await?;
    }
    let summary = logic::summary(run, &night.id(), scans.len(), &mismatches, groups.len());
    mail::deliver(
        outside,
        &format!("naive:{}", uuid::Uuid::new_v4()),
        &summary,
    )
    .await?;
    Ok(())
}

/// Forgets an earlier naive run of the night, so each demo measures one story from scratch.
pub async fn reset(outside: &PgPool, night: &Night) -> Result<(), Error> {
    let run_id = night.naive_run_id();
    let mut tx = outside.begin().await.map_err(super::Error::from)?;
    for sql in [
        "DELETE FROM reference.naive_entries WHERE run_id = $1",
        "DELETE FROM reference.naive_stock_adjustments WHERE run_id = $1",
        "DELETE FROM reference.mail_messages WHERE run_id = $1",
    ] {
        sqlx::query(sql)
            .bind(run_id.as_str())
            .execute(&mut *tx)
            .await
            .map_err(super::Error::from)?;
    }
    tx.commit().await.map_err(super::Error::from)?;
    invoices::reset_reads(outside, night, run_id.as_str()).await?;
    Ok(())
}

/// (rows, distinct references) in the naive ledger for the night's naive run.
pub async fn ledger_counts(outside: &PgPool, night: &Night) -> Result<(i64, i64), Error> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM reference.naive_entries WHERE run_id = $1",
    )
    .bind(night.naive_run_id().as_str())
    .fetch_one(outside)
    .await
    .map_err(super::Error::from)?)
}

/// Stock adjustments the naive run made (repeats included).
pub async fn stock_count(outside: &PgPool, night: &Night) -> Result<i64, Error> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM reference.naive_stock_adjustments WHERE run_id = $1",
    )
    .bind(night.naive_run_id().as_str())
    .fetch_one(outside)
    .await
    .map_err(super::Error::from)?)
}

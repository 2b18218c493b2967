//! `reconcile`: the nightly invoice reconciliation in ten steps with declared kinds.
//!
//! Steps 1-6 change nothing outside and checkpoint everything they read or were told (invoices,
//! every model answer, the stock numbers). Step 7 is the first outside write (one keyed ledger
//! entry per mismatch), 8 puts the disputed units on hold (keyed), 9 and 10 send notes through the
//! outbox, so they leave if and only if their step commits. Email, the hardest to undo, comes last.
//!
//! Failpoints (for the crash tests and the demo): `reconcile.extract.answer` after each journaled
//! model answer, `reconcile.compare.start`, `reconcile.post_entry` before each ledger entry,
//! `reconcile.ledger.after_commit` after each ledger commit and before trailmark records it,
//! `reconcile.notes.queued` after step 9 queued its notes.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;

use super::checkpoints::{
    Answer, Compared, Difference, Extracted, Fetched, Flagged, MatchedLines, Note, Notes,
    StockRead, Write, WriteOutcome, Writes, prior,
};
use super::night::Night;
use super::{extract, invoices, ledger, logic, mail, orders, outside, stock, undo};
use trailmark::domain::IdempotencyKey;
use trailmark::workflow::{Lookup, StepContext, StepError, StepKind, StepOutcome, Tool, Workflow};

/// Workflow name in run-start events.
pub const NAME: &str = "reconcile";
/// Step 1.
pub const FETCH: &str = "fetch_invoices";
/// Step 2.
pub const EXTRACT: &str = "extract_line_items";
/// Step 3.
pub const MATCH: &str = "match_purchase_orders";
/// Step 4.
pub const READ_STOCK: &str = "read_stock_received";
/// Step 5.
pub const COMPARE: &str = "compare_quantities_and_prices";
/// Step 6.
pub const FLAG: &str = "flag_mismatches";
/// Step 7.
pub const POST: &str = "post_ledger_adjustments";
/// Step 8.
pub const UPDATE_STOCK: &str = "update_stock_records";
/// Step 9.
pub const SEND_NOTES: &str = "send_debit_notes";
/// Step 10.
pub const SEND_SUMMARY: &str = "send_summary";

/// The ten steps in order, with their kinds (the demo prints these).
pub const STEPS: [(&str, StepKind); 10] = [
    (FETCH, StepKind::Read),
    (EXTRACT, StepKind::Model),
    (MATCH, StepKind::Read),
    (READ_STOCK, StepKind::Read),
    (COMPARE, StepKind::Read),
    (FLAG, StepKind::Read),
    (POST, StepKind::Write),
    (UPDATE_STOCK, StepKind::Write),
    (SEND_NOTES, StepKind::Message),
    (SEND_SUMMARY, StepKind::Message),
];

/// The `reconcile` workflow definition.
pub fn workflow() -> Workflow {
    Workflow::new(NAME, 1)
        .input::<crate::night::ReconcileInput>()
        .step(FETCH, StepKind::Read, fetch)
        .step(EXTRACT, StepKind::Model, extract_items)
        .step(MATCH, StepKind::Read, match_orders)
        .step(READ_STOCK, StepKind::Read, read_stock)
        .step(COMPARE, StepKind::Read, compare)
        .step(FLAG, StepKind::Read, flag)
        .step(POST, StepKind::Write, post_adjustments)
        .key_recipe("run_id:invoice_no:line:kind (the ledger's reference, its primary key)")
        .compensate(
            "posts a reversal entry undo:<key> per adjustment in scope",
            undo::reverse_entries,
        )
        .reversals(undo::list_entry_reversals)
        .step(UPDATE_STOCK, StepKind::Write, update_stock)
        .key_recipe("run_id:invoice_no:line:kind:stock")
        .compensate(
            "posts a reversal adjustment per adjustment in scope, releasing the units",
            undo::reverse_stock,
        )
        .reversals(undo::list_stock_reversals)
        .step(SEND_NOTES, StepKind::Message, send_notes)
        .key_recipe("run_id:send_debit_notes:supplier")
        .compensate(
            "sends one withdrawal note per supplier in scope, naming the claim",
            undo::withdraw_notes,
        )
        .reversals(undo::list_withdrawals)
        .step(SEND_SUMMARY, StepKind::Message, send_summary)
        .key_recipe("run_id:send_summary:finance-head")
        .compensate(
            "sends the finance head a correction naming the scope",
            undo::correct_summary,
        )
        .reversals(undo::list_correction)
}

/// The night from the run's input and a pool on the outside database.
pub(super) async fn setup(ctx: &StepContext) -> Result<(Night, PgPool), StepError> {
    let night = Night::from_input(ctx.input())?;
    Ok((night, outside::pool_for(ctx.pool()).await?))
}

pub(super) fn next(output: impl Serialize) -> Result<StepOutcome, StepError> {
    Ok(StepOutcome::next(
        serde_json::to_value(output).expect("checkpoints serialise"),
    ))
}

fn unknown(ctx: &StepContext, what: impl std::fmt::Display) -> StepError {
    StepError::Unknown(format!("run {} step {}: {what}", ctx.run_id(), ctx.step()))
}

async fn fetch(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let (night, pool) = setup(&ctx).await?;
    orders::seed(&pool, &night).await?;
    let scans = invoices::fetch(&pool, &night, ctx.run_id().as_str()).await?;
    next(Fetched {
        night: night.id(),
        invoices: scans.len(),
        scans,
    })
}

async fn extract_items(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let fetched: Fetched = prior(&ctx, FETCH).await?;
    let (mut answers, mut items) = (Vec::new(), Vec::new());
    // One call at a time, in invoice order: call numbers must be the same on a replay, so the
    // journal hands back the answers already paid for.
    let total = fetched.scans.len();
    for (n, scan) in fetched.scans.iter().enumerate() {
        // For whoever watches the run: the longest step of the night says where it is.
        if n % 50 == 0 {
            ctx.progress(format!("reading line items: {n} of {total} invoices done"));
        }
        let answer = ctx.model(&extract::request(&scan.text)).await?;
        ctx.failpoint("reconcile.extract.answer")?;
        let read = extract::parse_answer(&answer.content).map_err(|e| {
            unknown(&ctx, format!("model answer for invoice {}: {e}. Point model.base_url at a model that extracts line items (`trailmark demo model-server` is one), then `trailmark run resume {} --after-fix --ask-again` (a plain resume replays the journaled answer)", scan.invoice_no, ctx.run_id()))
        })?;
        if read.invoice_no != scan.invoice_no {
            return Err(unknown(
                &ctx,
                format!(
                    "the model read invoice {} as {:?}",
                    scan.invoice_no, read.invoice_no
                ),
            ));
        }
        items.extend(logic::items(scan, &read));
        answers.push(Answer {
            invoice_no: scan.invoice_no.clone(),
            answer: answer.content,
        });
    }
    ctx.progress(format!(
        "line items read from all {total} invoices: {} lines",
        items.len()
    ));
    next(Extracted { answers, items })
}

async fn match_orders(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let (night, pool) = setup(&ctx).await?;
    let extracted: Extracted = prior(&ctx, EXTRACT).await?;
    let po_nos = po_numbers(extracted.items.iter().map(|i| &i.po_no));
    let rows = orders::read(&pool, &night, &po_nos).await?;
    let matched = logic::match_orders(&extracted.items, &rows).map_err(|e| unknown(&ctx, e))?;
    next(MatchedLines { matched })
}

async fn read_stock(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let (night, pool) = setup(&ctx).await?;
    let matched: MatchedLines = prior(&ctx, MATCH).await?;
    let po_nos = po_numbers(matched.matched.iter().map(|m| &m.item.po_no));
    let stock = stock::read_received(&pool, &night, &po_nos).await?;
    next(StockRead { stock })
}

async fn compare(ctx: StepContext) -> Result<StepOutcome, StepError> {
    ctx.failpoint("reconcile.compare.start")?;
    let matched: MatchedLines = prior(&ctx, MATCH).await?;
    // The stock numbers of step 4's checkpoint, never a fresh read: a resumed run must compare
    // against what it saw, or its keys would suddenly carry other amounts.
    let stock: StockRead = prior(&ctx, READ_STOCK).await?;
    let over = logic::compare(&matched.matched, &stock.stock).map_err(|e| unknown(&ctx, e))?;
    let differences = over
        .into_iter()
        .map(|(matched, received_qty)| Difference {
            matched,
            received_qty,
        })
        .collect();
    next(Compared {
        lines_compared: matched.matched.len(),
        differences,
    })
}

async fn flag(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let compared: Compared = prior(&ctx, COMPARE).await?;
    let pairs: Vec<_> = compared
        .differences
        .into_iter()
        .map(|d| (d.matched, d.received_qty))
        .collect();
    let mismatches = logic::flag(ctx.run_id().as_str(), &pairs);
    let total_cents = mismatches.iter().map(|m| m.amount_cents).sum();
    next(Flagged {
        mismatches,
        total_cents,
    })
}

async fn post_adjustments(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let flagged: Flagged = prior(&ctx, FLAG).await?;
    let fence = ctx.fence().0;
    let mut writes = Vec::with_capacity(flagged.mismatches.len());
    for m in &flagged.mismatches {
        ctx.failpoint("reconcile.post_entry")?;
        let entry = logic::entry(ctx.run_id().as_str(), m);
        let request = serde_json::to_value(&entry).expect("entries serialise");
        let outcome = keyed(&ctx, "ledger", &entry.reference, &request, || {
            let (entry, ctx) = (entry.clone(), ctx.clone());
            async move {
                // The outside database is reached inside the write only: a replay check, which
                // makes no write, then checks this step's writes without any database.
                let pool = outside::pool_for(ctx.pool()).await?;
                let posted = ledger::post(&pool, &entry, Some(fence)).await?;
                // A crash here: the ledger has the entry, trailmark has only the intent. The
                // resumed step posts again under the same key and the ledger recognises it.
                ctx.failpoint("reconcile.ledger.after_commit")?;
                Ok(posted == ledger::Posted::Created)
            }
        })
        .await?;
        writes.push(Write {
            key: m.key.clone(),
            value: m.amount_cents,
            received_qty: m.received_qty,
            outcome,
        });
    }
    next(Writes::new(writes))
}

async fn update_stock(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let night = Night::from_input(ctx.input())?;
    let flagged: Flagged = prior(&ctx, FLAG).await?;
    let fence = ctx.fence().0;
    let mut writes = Vec::with_capacity(flagged.mismatches.len());
    for m in &flagged.mismatches {
        let adj = stock::Adjustment {
            reference: format!("{}:stock", m.key),
            run_id: ctx.run_id().to_string(),
            night: night.id(),
            po_no: m.matched.item.po_no.clone(),
            line: m.matched.item.line,
            qty: m.disputed_qty,
            reverses: None,
        };
        let request = serde_json::to_value(&adj).expect("adjustments serialise");
        let key = adj.reference.clone();
        let outcome = keyed(&ctx, "stock", &key, &request, || {
            let (trailmark, adj) = (ctx.pool().clone(), adj.clone());
            // As for the ledger: the outside database inside the write only.
            async move {
                let pool = outside::pool_for(&trailmark).await?;
                Ok(stock::adjust(&pool, &adj, fence).await?)
            }
        })
        .await?;
        writes.push(Write {
            key,
            value: m.disputed_qty.into(),
            received_qty: m.received_qty,
            outcome,
        });
    }
    next(Writes::new(writes))
}

/// Runs `write` to `tool` under `key` as a keyed effect and says how it ended; `write` answers
/// whether it created something now. It may run more than once (retries under the same key):
/// both stores enforce the key, so they are declared idempotent and a call with an unknown
/// outcome after a crash is simply made again.
pub(super) async fn keyed<W, Fut>(
    ctx: &StepContext,
    tool: &str,
    key: &str,
    request: &Value,
    write: W,
) -> Result<WriteOutcome, StepError>
where
    W: Fn() -> Fut,
    Fut: Future<Output = Result<bool, StepError>>,
{
    let key = IdempotencyKey::parse(key).map_err(|e| unknown(ctx, e))?;
    let called = AtomicBool::new(false);
    let result = ctx
        .tool_effect(
            &Tool::idempotent(tool),
            &key,
            request,
            |_key| {
                called.store(true, Ordering::Relaxed);
                let write = write();
                async move { Ok(serde_json::json!({ "created": write.await? })) }
            },
            |_key| async { Ok(Lookup::CannotTell) },
        )
        .await?;
    Ok(
        match (called.load(Ordering::Relaxed), result["created"].as_bool()) {
            (false, _) => WriteOutcome::Recorded,
            (true, Some(true)) => WriteOutcome::Written,
            (true, _) => WriteOutcome::AlreadyThere,
        },
    )
}

async fn send_notes(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let night = Night::from_input(ctx.input())?;
    let flagged: Flagged = prior(&ctx, FLAG).await?;
    let exchange = mail_exchange(ctx.input());
    let mut notes = Vec::new();
    for (supplier, lines) in logic::by_supplier(&flagged.mismatches) {
        let note = logic::debit_note(ctx.run_id().as_str(), &night.id(), &supplier, &lines);
        let key = IdempotencyKey::for_step(ctx.run_id(), SEND_NOTES, &supplier);
        let total_cents = lines.iter().map(|m| m.amount_cents).sum();
        notes.push(Note {
            key: key.to_string(),
            claim: note.claim.clone(),
            recipient: note.recipient.clone(),
            lines: lines.len(),
            total_cents,
        });
        ctx.send(
            &exchange,
            "debit_note",
            &key,
            serde_json::to_vec(&note).expect("notes serialise"),
        );
    }
    // A crash here loses nothing and sends nothing: the notes leave only with the checkpoint.
    ctx.failpoint("reconcile.notes.queued")?;
    next(Notes { notes })
}

async fn send_summary(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let night = Night::from_input(ctx.input())?;
    let fetched: Fetched = prior(&ctx, FETCH).await?;
    let flagged: Flagged = prior(&ctx, FLAG).await?;
    let sent: Notes = prior(&ctx, SEND_NOTES).await?;
    let summary = logic::summary(
        ctx.run_id().as_str(),
        &night.id(),
        fetched.invoices,
        &flagged.mismatches,
        sent.notes.len(),
    );
    let key = IdempotencyKey::for_step(ctx.run_id(), SEND_SUMMARY, "finance-head");
    ctx.send(
        &mail_exchange(ctx.input()),
        "summary",
        &key,
        serde_json::to_vec(&summary).expect("notes serialise"),
    );
    let note = Note {
        key: key.to_string(),
        claim: summary.claim,
        recipient: summary.recipient,
        lines: flagged.mismatches.len(),
        total_cents: flagged.total_cents,
    };
    Ok(StepOutcome::finish(
        serde_json::to_value(Notes { notes: vec![note] }).expect("checkpoints serialise"),
    ))
}

/// Where notes go: the input's `mail_exchange`, or the default installation's.
pub fn mail_exchange(input: &Value) -> String {
    input
        .get("mail_exchange")
        .and_then(Value::as_str)
        .map_or_else(|| mail::exchange("trailmark"), str::to_owned)
}

fn po_numbers<'a>(all: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = all.cloned().collect();
    v.sort();
    v.dedup();
    v
}

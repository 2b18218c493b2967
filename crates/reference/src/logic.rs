//! The reconciliation's reasoning, as pure functions over checkpointed data: match extracted
//! lines to purchase orders, compare them with the stock received, flag what was over-billed,
//! and word the notes. Both the workflow and the naive version use these, so the only difference
//! between them is how they survive a crash.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::extract::Extracted;
use super::generate;
use super::invoices::Scan;
use super::ledger::{Entry, cents};
use super::mail::Mail;
use super::orders::OrderRow;
use super::stock::Received;

/// One invoice line as extracted, with the invoice it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// Invoice number.
    pub invoice_no: String,
    /// Supplier code.
    pub supplier: String,
    /// Purchase order billed.
    pub po_no: String,
    /// Line number.
    pub line: i32,
    /// Article.
    pub sku: String,
    /// Units billed.
    pub qty: i32,
    /// Price billed per unit, in cents.
    pub unit_price_cents: i64,
}

/// An item with the purchase-order line it bills.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Matched {
    /// The billed line.
    #[serde(flatten)]
    pub item: Item,
    /// Units ordered.
    pub ordered_qty: i32,
    /// Agreed price per unit, in cents.
    pub agreed_price_cents: i64,
}

/// One over-billed line: the ledger adjustment it calls for, with the numbers it was computed from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    /// Ledger reference and idempotency key: `run_id:invoice_no:line:kind`.
    pub key: String,
    /// The matched line.
    #[serde(flatten)]
    pub matched: Matched,
    /// Units received, as read in step 4: the stock number this claim rests on.
    pub received_qty: i32,
    /// `qty` or `price`.
    pub kind: String,
    /// Units disputed.
    pub disputed_qty: i32,
    /// Amount claimed back, in cents.
    pub amount_cents: i64,
}

/// The items of an invoice as the model read them.
pub fn items(scan: &Scan, extracted: &Extracted) -> Vec<Item> {
    extracted
        .lines
        .iter()
        .map(|l| Item {
            invoice_no: scan.invoice_no.clone(),
            supplier: scan.supplier.clone(),
            po_no: scan.po_no.clone(),
            line: l.line,
            sku: l.sku.clone(),
            qty: l.qty,
            unit_price_cents: l.unit_price_cents,
        })
        .collect()
}

/// Pairs every item with its purchase-order line; an item without one is an error naming it.
pub fn match_orders(items: &[Item], orders: &[OrderRow]) -> Result<Vec<Matched>, String> {
    let by_line: HashMap<(&str, i32), &OrderRow> = orders
        .iter()
        .map(|o| ((o.po_no.as_str(), o.line), o))
        .collect();
    items
        .iter()
        .map(|item| match by_line.get(&(item.po_no.as_str(), item.line)) {
            Some(o) if o.sku == item.sku => Ok(Matched {
                item: item.clone(),
                ordered_qty: o.ordered_qty,
                agreed_price_cents: o.agreed_price_cents,
            }),
            Some(o) => Err(format!(
                "invoice {} line {} bills {} but {} line {} ordered {}",
                item.invoice_no, item.line, item.sku, o.po_no, o.line, o.sku
            )),
            None => Err(format!(
                "invoice {} line {} bills purchase order {} line {}, which the order system does not have",
                item.invoice_no, item.line, item.po_no, item.line
            )),
        })
        .collect()
}

/// Compares billed lines with the stock received and the agreed prices; returns the lines that
/// bill too much, each with the received quantity used. A line without a stock record is an error.
pub fn compare(matched: &[Matched], received: &[Received]) -> Result<Vec<(Matched, i32)>, String> {
    let by_line: HashMap<(&str, i32), i32> = received
        .iter()
        .map(|r| ((r.po_no.as_str(), r.line), r.received_qty))
        .collect();
    let mut over = Vec::new();
    for m in matched {
        let Some(&got) = by_line.get(&(m.item.po_no.as_str(), m.item.line)) else {
            return Err(format!(
                "no stock record for {} line {}",
                m.item.po_no, m.item.line
            ));
        };
        if m.item.qty > got || m.item.unit_price_cents > m.agreed_price_cents {
            over.push((m.clone(), got));
        }
    }
    Ok(over)
}

/// One adjustment per over-billed quantity and per over-billed price.
pub fn flag(run_id: &str, differences: &[(Matched, i32)]) -> Vec<Mismatch> {
    let mut out = Vec::new();
    for (m, received) in differences {
        let i = &m.item;
        let mut push = |kind: &str, disputed_qty: i32, amount_cents: i64| {
            out.push(Mismatch {
                key: format!("{run_id}:{}:{}:{kind}", i.invoice_no, i.line),
                matched: m.clone(),
                received_qty: *received,
                kind: kind.to_owned(),
                disputed_qty,
                amount_cents,
            })
        };
        if i.qty > *received {
            let short = i.qty - received;
            push("qty", short, i64::from(short) * i.unit_price_cents);
        }
        if i.unit_price_cents > m.agreed_price_cents {
            let units = i.qty.min(*received);
            push(
                "price",
                units,
                i64::from(units) * (i.unit_price_cents - m.agreed_price_cents),
            );
        }
    }
    out
}

/// The ledger entry of a mismatch.
pub fn entry(run_id: &str, m: &Mismatch) -> Entry {
    Entry {
        reference: m.key.clone(),
        run_id: run_id.to_owned(),
        invoice_no: m.matched.item.invoice_no.clone(),
        line: m.matched.item.line,
        kind: m.kind.clone(),
        supplier: m.matched.item.supplier.clone(),
        amount_cents: m.amount_cents,
        reverses: None,
    }
}

/// Mismatches grouped by supplier, in supplier order: one debit note each.
pub fn by_supplier(mismatches: &[Mismatch]) -> BTreeMap<String, Vec<&Mismatch>> {
    let mut groups: BTreeMap<String, Vec<&Mismatch>> = BTreeMap::new();
    for m in mismatches {
        groups
            .entry(m.matched.item.supplier.clone())
            .or_default()
            .push(m);
    }
    groups
}

/// The claim a debit note makes; printed in the note so a person can spot a repeat.
pub fn claim(night_id: &str, supplier: &str) -> String {
    format!("DN-{night_id}-{supplier}")
}

/// The debit note to one supplier.
pub fn debit_note(run_id: &str, night_id: &str, supplier: &str, lines: &[&Mismatch]) -> Mail {
    let claim = claim(night_id, supplier);
    let name = generate::supplier(supplier).map_or(supplier, |s| s.name);
    let total: i64 = lines.iter().map(|m| m.amount_cents).sum();
    let mut body = format!(
        "To {name},\n\nDebit note, claim {claim}. Our reconciliation of the night {night_id} found {} invoice line(s) billed above what we received or agreed:\n",
        lines.len()
    );
    for m in lines {
        let i = &m.matched.item;
        body.push_str(&format!(
            "- {} line {} ({}): {} {} units, {}\n",
            i.invoice_no,
            i.line,
            i.sku,
            m.kind,
            m.disputed_qty,
            cents(m.amount_cents)
        ));
    }
    body.push_str(&format!(
        "Total claimed: {}.\nIf you receive claim {claim} more than once, it is the same claim; please book it once.\n",
        cents(total)
    ));
    Mail {
        kind: "debit_note".into(),
        run_id: run_id.to_owned(),
        claim: claim.clone(),
        recipient: format!("accounts@{}.example", supplier.to_lowercase()),
        subject: format!("Debit note {claim}: {}", cents(total)),
        body,
    }
}

/// The summary for the finance head.
pub fn summary(
    run_id: &str,
    night_id: &str,
    invoices: usize,
    mismatches: &[Mismatch],
    notes: usize,
) -> Mail {
    let total: i64 = mismatches.iter().map(|m| m.amount_cents).sum();
    let claim = format!("SUMMARY-{night_id}");
    let body = format!(
        "Reconciliation {run_id} of the night {night_id}: {invoices} invoices checked, {} ledger adjustments posted ({} in total), {notes} debit notes sent.\n",
        mismatches.len(),
        cents(total)
    );
    Mail {
        kind: "summary".into(),
        run_id: run_id.to_owned(),
        claim: claim.clone(),
        recipient: "finance-head@distributor.example".into(),
        subject: format!(
            "Reconciliation {night_id}: {} adjustments, {}",
            mismatches.len(),
            cents(total)
        ),
        body,
    }
}

/// The note that takes a debit note back after an undo; it names the claim it withdraws.
pub fn withdrawal(run_id: &str, night_id: &str, supplier: &str, lines: &[&Mismatch]) -> Mail {
    let claim = claim(night_id, supplier);
    let name = generate::supplier(supplier).map_or(supplier, |s| s.name);
    let total: i64 = lines.iter().map(|m| m.amount_cents).sum();
    let body = format!(
        "To {name},\n\nWe withdraw claim {claim} ({} line(s), {}). Our ledger entries for it have been reversed; please disregard the debit note.\n",
        lines.len(),
        cents(total)
    );
    Mail {
        kind: "withdrawal".into(),
        run_id: run_id.to_owned(),
        claim: claim.clone(),
        recipient: format!("accounts@{}.example", supplier.to_lowercase()),
        subject: format!("Withdrawal of debit note {claim}"),
        body,
    }
}

/// The correction the finance head gets when part of a reconciliation is undone.
pub fn correction(run_id: &str, night_id: &str, scope: &str, reversed: &[&Mismatch]) -> Mail {
    let total: i64 = reversed.iter().map(|m| m.amount_cents).sum();
    Mail {
        kind: "summary_correction".into(),
        run_id: run_id.to_owned(),
        claim: format!("SUMMARY-{night_id}"),
        recipient: "finance-head@distributor.example".into(),
        subject: format!(
            "Correction to reconciliation {night_id}: {} adjustments reversed",
            reversed.len()
        ),
        body: format!(
            "Reconciliation {run_id} of the night {night_id}: the adjustments of {scope} were reversed ({} entries, {}).\n",
            reversed.len(),
            cents(total)
        ),
    }
}

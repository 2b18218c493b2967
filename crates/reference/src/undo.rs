//! The compensations of `reconcile`: a supplier's later correction is handled by
//! an undo scoped to that supplier (`trailmark run undo RUN --scope '{"supplier":"SUP03"}'`).
//! Nothing is deleted: each ledger entry gets a reversal entry `undo:<key>` that points at it, each
//! stock adjustment a reversal that releases the units again, each debit note a withdrawal that
//! names its claim, and the finance head a correction. Every reversal is keyed, so an
//! interrupted undo resumes without reversing anything twice.

use serde_json::Value;

use super::checkpoints::{Flagged, Note, Notes, Write, Writes, prior};
use super::logic::{self, Mismatch};
use super::night::Night;
use super::workflow::{FLAG, SEND_NOTES, SEND_SUMMARY, keyed, mail_exchange, next, setup};
use super::{ledger, stock};
use trailmark::domain::{IdempotencyKey, RunId};
use trailmark::workflow::{PreviewContext, Reversal, StepContext, StepError, StepOutcome};

/// Scope fields an undo of `reconcile` understands.
const SCOPE_FIELDS: [&str; 2] = ["supplier", "invoice_no"];

/// The run's adjustments the undo's scope selects (`{}` selects all).
async fn selected(ctx: &StepContext) -> Result<Vec<Mismatch>, StepError> {
    let target = ctx.undo().ok_or_else(|| {
        StepError::Unknown(format!(
            "run {} step {}: this is a compensation and runs only during an undo",
            ctx.run_id(),
            ctx.step()
        ))
    })?;
    let flagged: Flagged = prior(ctx, FLAG).await?;
    select(&flagged.mismatches, &target.scope)
        .map_err(|e| StepError::Unknown(format!("run {} {}: {e}", ctx.run_id(), ctx.step())))
}

/// The adjustments an undo's scope selects, read as a preview reads them (the same checkpoint
/// and the same selection as [`selected`]).
async fn selected_for_preview(p: &PreviewContext) -> Result<Vec<Mismatch>, StepError> {
    let raw = p.output_of(FLAG).await?.ok_or_else(|| {
        StepError::Unknown(format!(
            "run {}: no checkpoint of step {FLAG}, so nothing it flagged can be listed",
            p.run_id()
        ))
    })?;
    let flagged: Flagged = serde_json::from_value(raw).map_err(|e| {
        StepError::Unknown(format!(
            "run {}: the checkpoint of step {FLAG} is unreadable: {e}",
            p.run_id()
        ))
    })?;
    select(&flagged.mismatches, &p.target().scope)
        .map_err(|e| StepError::Unknown(format!("run {}: {e}", p.run_id())))
}

/// The ledger entry that reverses adjustment `m`: the preview lists it, the compensation posts it.
fn entry_reversal(run_id: &str, m: &Mismatch) -> ledger::Entry {
    let mut entry = logic::entry(run_id, m);
    entry.reference = format!("undo:{}", m.key);
    entry.amount_cents = -m.amount_cents;
    entry.reverses = Some(m.key.clone());
    entry
}

/// The stock adjustment that releases the units adjustment `m` put on hold.
fn stock_reversal(run_id: &str, night: &str, m: &Mismatch) -> stock::Adjustment {
    let original = format!("{}:stock", m.key);
    stock::Adjustment {
        reference: format!("undo:{original}"),
        run_id: run_id.to_owned(),
        night: night.to_owned(),
        po_no: m.matched.item.po_no.clone(),
        line: m.matched.item.line,
        qty: -m.disputed_qty,
        reverses: Some(original),
    }
}

/// The key of the withdrawal of `supplier`'s debit note.
fn withdrawal_key(run_id: &RunId, supplier: &str) -> IdempotencyKey {
    IdempotencyKey::for_step(run_id, SEND_NOTES, supplier).undo_of()
}

/// The key of the finance head's correction for `scope`.
fn correction_key(run_id: &RunId, scope: &Value) -> Result<IdempotencyKey, StepError> {
    let original = IdempotencyKey::for_step(run_id, SEND_SUMMARY, "finance-head").undo_of();
    IdempotencyKey::parse(&format!("{original}:{}", scope_tag(scope)))
        .map_err(|e| StepError::Unknown(format!("run {run_id}: {e}")))
}

/// Preview of step 7's undo: one reversal entry per selected adjustment.
pub(super) async fn list_entry_reversals(p: PreviewContext) -> Result<Vec<Reversal>, StepError> {
    let chosen = selected_for_preview(&p).await?;
    Ok(chosen
        .iter()
        .map(|m| {
            let e = entry_reversal(p.run_id().as_str(), m);
            Reversal {
                what: format!(
                    "ledger entry {} for {} (invoice {} line {}, {}), reversing {}",
                    ledger::cents(e.amount_cents),
                    e.supplier,
                    e.invoice_no,
                    e.line,
                    e.kind,
                    m.key
                ),
                key: e.reference,
            }
        })
        .collect())
}

/// Preview of step 8's undo: one releasing adjustment per selected adjustment.
pub(super) async fn list_stock_reversals(p: PreviewContext) -> Result<Vec<Reversal>, StepError> {
    let chosen = selected_for_preview(&p).await?;
    let night = Night::from_input(p.input())?.id();
    Ok(chosen
        .iter()
        .map(|m| {
            let adj = stock_reversal(p.run_id().as_str(), &night, m);
            Reversal {
                what: format!(
                    "stock: release {} units of {} line {} ({})",
                    -adj.qty, adj.po_no, adj.line, m.matched.item.supplier
                ),
                key: adj.reference,
            }
        })
        .collect())
}

/// Preview of step 9's undo: one withdrawal per supplier in scope.
pub(super) async fn list_withdrawals(p: PreviewContext) -> Result<Vec<Reversal>, StepError> {
    let chosen = selected_for_preview(&p).await?;
    Ok(logic::by_supplier(&chosen)
        .into_iter()
        .map(|(supplier, lines)| Reversal {
            key: withdrawal_key(p.run_id(), &supplier).to_string(),
            what: format!(
                "mail: withdraw the debit note to {supplier} ({} lines, {})",
                lines.len(),
                ledger::cents(lines.iter().map(|m| m.amount_cents).sum())
            ),
        })
        .collect())
}

/// Preview of step 10's undo: the finance head's correction.
pub(super) async fn list_correction(p: PreviewContext) -> Result<Vec<Reversal>, StepError> {
    let chosen = selected_for_preview(&p).await?;
    let key = correction_key(p.run_id(), &p.target().scope)?;
    Ok(vec![Reversal {
        key: key.to_string(),
        what: format!(
            "mail: correction to the finance head for {} adjustments ({})",
            chosen.len(),
            ledger::cents(chosen.iter().map(|m| m.amount_cents).sum())
        ),
    }])
}

/// Applies a scope; an unknown field or a scope that selects nothing is refused, since both
/// usually mean a typo that would otherwise undo the wrong things or nothing at all.
pub fn select(all: &[Mismatch], scope: &Value) -> Result<Vec<Mismatch>, String> {
    let empty = serde_json::Map::new();
    let fields = match scope {
        Value::Null => &empty,
        Value::Object(map) => map,
        other => {
            return Err(format!(
                "undo scope {other} is not a JSON object like {{\"supplier\": \"SUP03\"}}"
            ));
        }
    };
    if let Some(unknown) = fields.keys().find(|k| !SCOPE_FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "undo scope field {unknown:?} is not understood; use {SCOPE_FIELDS:?}"
        ));
    }
    let wants =
        |field: &str, value: &str| fields.get(field).is_none_or(|v| v.as_str() == Some(value));
    let chosen: Vec<Mismatch> = all
        .iter()
        .filter(|m| {
            wants("supplier", &m.matched.item.supplier)
                && wants("invoice_no", &m.matched.item.invoice_no)
        })
        .cloned()
        .collect();
    if chosen.is_empty() {
        let suppliers: std::collections::BTreeSet<&str> = all
            .iter()
            .map(|m| m.matched.item.supplier.as_str())
            .collect();
        return Err(format!(
            "undo scope {scope} selects none of the run's {} adjustments (their suppliers: {suppliers:?})",
            all.len()
        ));
    }
    Ok(chosen)
}

/// Undo of step 7: one reversal entry per selected adjustment.
pub(super) async fn reverse_entries(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let chosen = selected(&ctx).await?;
    let (_, pool) = setup(&ctx).await?;
    let fence = ctx.fence().0;
    let mut writes = Vec::with_capacity(chosen.len());
    for m in &chosen {
        let entry = entry_reversal(ctx.run_id().as_str(), m);
        let request = serde_json::to_value(&entry).expect("entries serialise");
        let outcome =
            keyed(&ctx, "ledger", &entry.reference, &request, || {
                let (pool, entry) = (pool.clone(), entry.clone());
                async move {
                    Ok(ledger::post(&pool, &entry, Some(fence)).await? == ledger::Posted::Created)
                }
            })
            .await?;
        writes.push(Write {
            key: entry.reference.clone(),
            value: entry.amount_cents,
            received_qty: m.received_qty,
            outcome,
        });
    }
    next(Writes::new(writes))
}

/// Undo of step 8: one reversal adjustment per selected adjustment, releasing the units.
pub(super) async fn reverse_stock(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let chosen = selected(&ctx).await?;
    let (night, pool) = setup(&ctx).await?;
    let fence = ctx.fence().0;
    let mut writes = Vec::with_capacity(chosen.len());
    for m in &chosen {
        let adj = stock_reversal(ctx.run_id().as_str(), &night.id(), m);
        let request = serde_json::to_value(&adj).expect("adjustments serialise");
        let outcome = keyed(&ctx, "stock", &adj.reference, &request, || {
            let (pool, adj) = (pool.clone(), adj.clone());
            async move { Ok(stock::adjust(&pool, &adj, fence).await?) }
        })
        .await?;
        writes.push(Write {
            key: adj.reference.clone(),
            value: adj.qty.into(),
            received_qty: m.received_qty,
            outcome,
        });
    }
    next(Writes::new(writes))
}

/// Undo of step 9: one withdrawal per supplier whose adjustments are reversed.
pub(super) async fn withdraw_notes(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let chosen = selected(&ctx).await?;
    let night = Night::from_input(ctx.input())?;
    let exchange = mail_exchange(ctx.input());
    let mut notes = Vec::new();
    for (supplier, lines) in logic::by_supplier(&chosen) {
        let mail = logic::withdrawal(ctx.run_id().as_str(), &night.id(), &supplier, &lines);
        let key = withdrawal_key(ctx.run_id(), &supplier);
        let total_cents = lines.iter().map(|m| m.amount_cents).sum();
        notes.push(Note {
            key: key.to_string(),
            claim: mail.claim.clone(),
            recipient: mail.recipient.clone(),
            lines: lines.len(),
            total_cents,
        });
        ctx.send(
            &exchange,
            "withdrawal",
            &key,
            serde_json::to_vec(&mail).expect("notes serialise"),
        );
    }
    next(Notes { notes })
}

/// Undo of step 10: a correction to the finance head, keyed per scope (a later undo of another
/// supplier sends its own correction).
pub(super) async fn correct_summary(ctx: StepContext) -> Result<StepOutcome, StepError> {
    let chosen = selected(&ctx).await?;
    let night = Night::from_input(ctx.input())?;
    let scope = ctx.undo().map(|t| t.scope.clone()).unwrap_or_default();
    let refs: Vec<&Mismatch> = chosen.iter().collect();
    let mail = logic::correction(
        ctx.run_id().as_str(),
        &night.id(),
        &scope_tag(&scope),
        &refs,
    );
    let key = correction_key(ctx.run_id(), &scope)?;
    ctx.send(
        &mail_exchange(ctx.input()),
        "summary_correction",
        &key,
        serde_json::to_vec(&mail).expect("notes serialise"),
    );
    let total_cents = chosen.iter().map(|m| m.amount_cents).sum();
    let note = Note {
        key: key.to_string(),
        claim: mail.claim,
        recipient: mail.recipient,
        lines: chosen.len(),
        total_cents,
    };
    next(Notes { notes: vec![note] })
}

/// `supplier=SUP03` (fields sorted), or `all`: readable, and valid inside a key.
fn scope_tag(scope: &Value) -> String {
    let Some(fields) = scope.as_object().filter(|m| !m.is_empty()) else {
        return "all".into();
    };
    let mut parts: Vec<String> = fields
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}={}",
                v.as_str()
                    .unwrap_or_default()
                    .chars()
                    .filter(char::is_ascii_graphic)
                    .collect::<String>()
            )
        })
        .collect();
    parts.sort();
    parts.join(",")
}

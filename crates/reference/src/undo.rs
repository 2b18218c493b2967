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
use trailmark::domain::IdempotencyKey;
use trailmark::workflow::{StepContext, StepError, StepOutcome};

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
        let mut entry = logic::entry(ctx.run_id().as_str(), m);
        entry.reference = format!("undo:{}", m.key);
        entry.amount_cents = -m.amount_cents;
        entry.reverses = Some(m.key.clone());
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
        let original = format!("{}:stock", m.key);
        let adj = stock::Adjustment {
            reference: format!("undo:{original}"),
            run_id: ctx.run_id().to_string(),
            night: night.id(),
            po_no: m.matched.item.po_no.clone(),
            line: m.matched.item.line,
            qty: -m.disputed_qty,
            reverses: Some(original),
        };
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
        let key = IdempotencyKey::for_step(ctx.run_id(), SEND_NOTES, &supplier).undo_of();
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
    let scope = ctx
        .undo()
        .map(|t| scope_tag(&t.scope))
        .unwrap_or_else(|| "all".into());
    let refs: Vec<&Mismatch> = chosen.iter().collect();
    let mail = logic::correction(ctx.run_id().as_str(), &night.id(), &scope, &refs);
    let original = IdempotencyKey::for_step(ctx.run_id(), SEND_SUMMARY, "finance-head").undo_of();
    let key = IdempotencyKey::parse(&format!("{original}:{scope}"))
        .map_err(|e| StepError::Unknown(format!("run {}: {e}", ctx.run_id())))?;
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

//! Stock records: units received per purchase-order line, and keyed adjustments that put the
//! disputed units of a mismatch on hold. An adjustment row and its effect on the stock record are
//! one transaction, keyed by the adjustment's reference, so a repeat changes nothing.

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::ledger::check_fence;
use super::night::Night;
use super::{Error, Result};

/// Units received against one purchase-order line, as read at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Received {
    /// Purchase order.
    pub po_no: String,
    /// Line.
    pub line: i32,
    /// Article.
    pub sku: String,
    /// Units received.
    pub received_qty: i32,
}

/// The received-stock records of the given orders.
pub async fn read_received(
    pool: &PgPool,
    night: &Night,
    po_nos: &[String],
) -> Result<Vec<Received>> {
    Ok(sqlx::query_as(
        "SELECT po_no, line, sku, received_qty FROM reference.stock_received
          WHERE night = $1 AND po_no = ANY($2) ORDER BY po_no, line",
    )
    .bind(night.id())
    .bind(po_nos)
    .fetch_all(pool)
    .await?)
}

/// Changes a received quantity, as a late goods-receipt correction would (tests and drills).
pub async fn set_received(
    pool: &PgPool,
    night: &Night,
    po_no: &str,
    line: i32,
    qty: i32,
) -> Result<()> {
    let done = sqlx::query("UPDATE reference.stock_received SET received_qty = $4 WHERE night = $1 AND po_no = $2 AND line = $3")
        .bind(night.id())
        .bind(po_no)
        .bind(line)
        .bind(qty)
        .execute(pool)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::Invalid(format!(
            "night {} has no stock record for {po_no} line {line}",
            night.id()
        )));
    }
    Ok(())
}

/// One keyed adjustment: put `qty` units of a purchase-order line on hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adjustment {
    /// The idempotency key: `run_id:invoice_no:line:kind:stock`.
    pub reference: String,
    /// The run that makes it.
    pub run_id: String,
    /// The night's id.
    pub night: String,
    /// Purchase order.
    pub po_no: String,
    /// Line.
    pub line: i32,
    /// Units put on hold (negative: released again by a reversal).
    pub qty: i32,
    /// For a reversal: the reference of the adjustment it reverses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverses: Option<String>,
}

/// Applies an adjustment once: `true` when it was applied now, `false` when it was already there.
/// The same reference with another quantity is a conflict. `fence` works as in the ledger.
pub async fn adjust(pool: &PgPool, adj: &Adjustment, fence: i64) -> Result<bool> {
    let mut tx = pool.begin().await?;
    check_fence(&mut tx, "stock", &adj.run_id, fence).await?;
    let inserted = sqlx::query(
        "INSERT INTO reference.stock_adjustments (reference, run_id, night, po_no, line, qty, fence, reverses)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (reference) DO NOTHING",
    )
    .bind(&adj.reference)
    .bind(&adj.run_id)
    .bind(&adj.night)
    .bind(&adj.po_no)
    .bind(adj.line)
    .bind(adj.qty)
    .bind(fence)
    .bind(&adj.reverses)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if !inserted {
        let stored: i32 =
            sqlx::query_scalar("SELECT qty FROM reference.stock_adjustments WHERE reference = $1")
                .bind(&adj.reference)
                .fetch_one(&mut *tx)
                .await?;
        tx.rollback().await?;
        if stored != adj.qty {
            return Err(Error::Conflict {
                store: "stock",
                key: adj.reference.clone(),
                stored: format!("{stored} units on hold"),
                new: format!("{} units", adj.qty),
            });
        }
        return Ok(false);
    }
    let updated = sqlx::query(
        "UPDATE reference.stock_received SET disputed_qty = disputed_qty + $4
          WHERE night = $1 AND po_no = $2 AND line = $3",
    )
    .bind(&adj.night)
    .bind(&adj.po_no)
    .bind(adj.line)
    .bind(adj.qty)
    .execute(&mut *tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Err(Error::Invalid(format!(
            "stock adjustment {}: night {} has no stock record for {} line {}",
            adj.reference, adj.night, adj.po_no, adj.line
        )));
    }
    tx.commit().await?;
    Ok(true)
}

/// (adjustments, distinct references) of a run.
pub async fn counts(pool: &PgPool, run_id: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as("SELECT count(*), count(DISTINCT reference) FROM reference.stock_adjustments WHERE run_id = $1")
        .bind(run_id)
        .fetch_one(pool)
        .await?)
}

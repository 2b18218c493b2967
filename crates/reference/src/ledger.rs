//! The ledger, a stand-in for the finance system: one row per adjustment, its `reference` the
//! idempotency key (`run_id:invoice_no:line:kind`) and the primary key. A repeated post with the
//! same amount is recognised; the same reference with another amount is a conflict, never a skip.
//! It also remembers the highest fencing token each run has shown it and refuses older ones, so
//! a worker that was paused past its lease cannot post when it wakes.

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::{Error, Result};

/// One adjustment to post.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The idempotency key: `run_id:invoice_no:line:kind`.
    pub reference: String,
    /// The run that posts it.
    pub run_id: String,
    /// The invoice it corrects.
    pub invoice_no: String,
    /// The invoice line.
    pub line: i32,
    /// `qty` (billed more than received) or `price` (billed above the agreed price).
    pub kind: String,
    /// Supplier code.
    pub supplier: String,
    /// Amount claimed back, in cents (negative for a reversal).
    pub amount_cents: i64,
    /// For a reversal: the reference of the entry it reverses (nothing is ever deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverses: Option<String>,
}

/// What a post did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Posted {
    /// A new row.
    Created,
    /// The reference was there with the same amount: nothing changed.
    AlreadyThere,
}

/// Posts one entry in its own transaction. With `fence`, the post is refused when the run has
/// already shown a newer token; `None` is for callers without a lease (the race demo).
pub async fn post(pool: &PgPool, entry: &Entry, fence: Option<i64>) -> Result<Posted> {
    let mut tx = pool.begin().await?;
    if let Some(fence) = fence {
        check_fence(&mut tx, "ledger", &entry.run_id, fence).await?;
    }
    let inserted = sqlx::query(
        "INSERT INTO reference.entries (reference, run_id, invoice_no, line, kind, supplier, amount_cents, fence, reverses)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (reference) DO NOTHING",
    )
    .bind(&entry.reference)
    .bind(&entry.run_id)
    .bind(&entry.invoice_no)
    .bind(entry.line)
    .bind(&entry.kind)
    .bind(&entry.supplier)
    .bind(entry.amount_cents)
    .bind(fence)
    .bind(&entry.reverses)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if inserted {
        tx.commit().await?;
        return Ok(Posted::Created);
    }
    let stored: i64 =
        sqlx::query_scalar("SELECT amount_cents FROM reference.entries WHERE reference = $1")
            .bind(&entry.reference)
            .fetch_one(&mut *tx)
            .await?;
    tx.rollback().await?;
    if stored != entry.amount_cents {
        return Err(Error::Conflict {
            store: "ledger",
            key: entry.reference.clone(),
            stored: format!("amount {}", cents(stored)),
            new: format!("amount {}", cents(entry.amount_cents)),
        });
    }
    Ok(Posted::AlreadyThere)
}

/// Records `fence` as the run's highest token, or refuses it when a higher one was seen.
/// The row stays locked until the caller's transaction ends, so the check and the write that
/// follows cannot interleave with a newer worker's write.
pub(crate) async fn check_fence(
    tx: &mut PgConnection,
    store: &'static str,
    run_id: &str,
    fence: i64,
) -> Result<()> {
    let current: i64 = sqlx::query_scalar(
        "INSERT INTO reference.run_fences (run_id, fence) VALUES ($1, $2)
         ON CONFLICT (run_id) DO UPDATE SET fence = GREATEST(run_fences.fence, EXCLUDED.fence)
         RETURNING fence",
    )
    .bind(run_id)
    .bind(fence)
    .fetch_one(&mut *tx)
    .await?;
    if current > fence {
        return Err(Error::FencedOut {
            store,
            run_id: run_id.to_owned(),
            fence,
            current,
        });
    }
    Ok(())
}

/// (rows, distinct references) of a run: the two figures that show whether anything doubled.
pub async fn counts(pool: &PgPool, run_id: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM reference.entries WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await?)
}

/// Every entry of a run, ordered by reference.
pub async fn entries(pool: &PgPool, run_id: &str) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as("SELECT reference, amount_cents FROM reference.entries WHERE run_id = $1 ORDER BY reference")
        .bind(run_id)
        .fetch_all(pool)
        .await?)
}

/// Cents as `12.34 EUR`, for messages people read.
pub fn cents(amount: i64) -> String {
    let sign = if amount < 0 { "-" } else { "" };
    format!("{sign}{}.{:02} EUR", amount.abs() / 100, amount.abs() % 100)
}

//! The distributor's purchase orders and goods-received records for a night, written once into
//! the outside database, as the ERP would hold them before the reconciliation starts.

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::Result;
use super::generate;
use super::night::Night;

/// Writes the night's purchase orders and receipts unless they are there already. Receipts that
/// exist are never overwritten (a test may have changed them on purpose).
pub async fn seed(pool: &PgPool, night: &Night) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let created =
        sqlx::query("INSERT INTO reference.nights (night) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(night.id())
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
    if !created {
        tx.rollback().await?;
        return Ok(false);
    }
    let world = generate::world(night);
    let o = &world.orders;
    sqlx::query(
        "INSERT INTO reference.purchase_orders (night, po_no, line, sku, ordered_qty, agreed_price_cents)
         SELECT $1, * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::int[], $6::bigint[])",
    )
    .bind(night.id())
    .bind(o.iter().map(|x| x.po_no.clone()).collect::<Vec<_>>())
    .bind(o.iter().map(|x| x.line as i32).collect::<Vec<_>>())
    .bind(o.iter().map(|x| x.sku.clone()).collect::<Vec<_>>())
    .bind(o.iter().map(|x| x.ordered_qty as i32).collect::<Vec<_>>())
    .bind(o.iter().map(|x| x.agreed_price_cents).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    let r = &world.receipts;
    sqlx::query(
        "INSERT INTO reference.stock_received (night, po_no, line, sku, received_qty)
         SELECT $1, * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::int[])",
    )
    .bind(night.id())
    .bind(r.iter().map(|x| x.po_no.clone()).collect::<Vec<_>>())
    .bind(r.iter().map(|x| x.line as i32).collect::<Vec<_>>())
    .bind(r.iter().map(|x| x.sku.clone()).collect::<Vec<_>>())
    .bind(r.iter().map(|x| x.received_qty as i32).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// One purchase-order line as read for matching.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct OrderRow {
    /// Purchase order.
    pub po_no: String,
    /// Line.
    pub line: i32,
    /// Article.
    pub sku: String,
    /// Units ordered.
    pub ordered_qty: i32,
    /// Agreed unit price in cents.
    pub agreed_price_cents: i64,
}

/// The purchase-order lines of the given orders.
pub async fn read(pool: &PgPool, night: &Night, po_nos: &[String]) -> Result<Vec<OrderRow>> {
    Ok(sqlx::query_as(
        "SELECT po_no, line, sku, ordered_qty, agreed_price_cents FROM reference.purchase_orders
          WHERE night = $1 AND po_no = ANY($2) ORDER BY po_no, line",
    )
    .bind(night.id())
    .bind(po_nos)
    .fetch_all(pool)
    .await?)
}

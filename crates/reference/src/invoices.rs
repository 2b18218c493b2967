//! The invoice source: hands out a night's invoices (as scanned text, for the model to read) and
//! counts every read durably in the outside database, so "invoices read" survives any crash of
//! the reader and re-reading after a restart shows up in the figures.

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::Result;
use super::generate::{self, Invoice};
use super::night::Night;

/// One invoice as the source delivers it: its number, supplier and the scan's text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scan {
    /// Invoice number.
    pub invoice_no: String,
    /// Supplier code.
    pub supplier: String,
    /// Purchase order billed.
    pub po_no: String,
    /// The scanned text the model extracts line items from.
    pub text: String,
}

/// Reads every invoice of the night on behalf of `reader` (a run id) and counts the reads.
pub async fn fetch(pool: &PgPool, night: &Night, reader: &str) -> Result<Vec<Scan>> {
    let scans: Vec<Scan> = generate::world(night).invoices.iter().map(scan).collect();
    // Counted before handing them over: a reader that dies right after still read them.
    sqlx::query(
        "INSERT INTO reference.invoice_reads (night, reader, reads) VALUES ($1, $2, $3)
         ON CONFLICT (night, reader) DO UPDATE SET reads = invoice_reads.reads + EXCLUDED.reads",
    )
    .bind(night.id())
    .bind(reader)
    .bind(scans.len() as i64)
    .execute(pool)
    .await?;
    Ok(scans)
}

/// How many invoices `reader` has read for the night, across all its attempts.
pub async fn reads(pool: &PgPool, night: &Night, reader: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT reads FROM reference.invoice_reads WHERE night = $1 AND reader = $2",
    )
    .bind(night.id())
    .bind(reader)
    .fetch_optional(pool)
    .await?
    .unwrap_or(0))
}

/// Forgets `reader`'s reads (the naive demo starts from nothing each time).
pub async fn reset_reads(pool: &PgPool, night: &Night, reader: &str) -> Result<()> {
    sqlx::query("DELETE FROM reference.invoice_reads WHERE night = $1 AND reader = $2")
        .bind(night.id())
        .bind(reader)
        .execute(pool)
        .await?;
    Ok(())
}

/// The scanned text of an invoice: what a person (or the model) would read.
pub fn scan(inv: &Invoice) -> Scan {
    let name = generate::supplier(&inv.supplier).map_or("unknown supplier", |s| s.name);
    let mut text = format!(
        "INVOICE {}\nSupplier: {} {}\nPurchase order: {}\n",
        inv.invoice_no, inv.supplier, name, inv.po_no
    );
    for l in &inv.lines {
        let price = format!(
            "{}.{:02}",
            l.unit_price_cents / 100,
            l.unit_price_cents % 100
        );
        text.push_str(&format!(
            "Line {}: {} qty {} @ {} EUR\n",
            l.line, l.sku, l.qty, price
        ));
    }
    Scan {
        invoice_no: inv.invoice_no.clone(),
        supplier: inv.supplier.clone(),
        po_no: inv.po_no.clone(),
        text,
    }
}

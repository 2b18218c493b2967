//! The outside database: where the invoice source, the purchase orders, the stock records, the
//! ledger and the mail sink keep their state. It is a database of its own on the same server as
//! trailmark's (named `<trailmark database>_outside`), or wherever
//! `TRAILMARK_REFERENCE_DATABASE_URL` points, so nothing outside is ever in trailmark's tables.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use super::{Error, Result};

/// Suffix added to trailmark's database name.
pub const SUFFIX: &str = "_outside";
/// Overrides the derived location of the outside database.
pub const URL_VAR: &str = "TRAILMARK_REFERENCE_DATABASE_URL";

/// The schema, created idempotently; ledger and stock tables carry their keys as primary keys.
const SCHEMA: &str = r#"
CREATE SCHEMA IF NOT EXISTS reference;
-- Nights whose purchase orders and receipts have been written.
CREATE TABLE IF NOT EXISTS reference.nights (
    night TEXT PRIMARY KEY, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
-- How often each reader fetched each night's invoices: survives any crash of the reader.
CREATE TABLE IF NOT EXISTS reference.invoice_reads (
    night TEXT NOT NULL, reader TEXT NOT NULL, reads BIGINT NOT NULL,
    PRIMARY KEY (night, reader));
CREATE TABLE IF NOT EXISTS reference.purchase_orders (
    night TEXT NOT NULL, po_no TEXT NOT NULL, line INTEGER NOT NULL, sku TEXT NOT NULL,
    ordered_qty INTEGER NOT NULL, agreed_price_cents BIGINT NOT NULL,
    PRIMARY KEY (night, po_no, line));
-- Stock received per purchase-order line; disputed_qty is what adjustments have put on hold.
CREATE TABLE IF NOT EXISTS reference.stock_received (
    night TEXT NOT NULL, po_no TEXT NOT NULL, line INTEGER NOT NULL, sku TEXT NOT NULL,
    received_qty INTEGER NOT NULL, disputed_qty INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (night, po_no, line));
CREATE TABLE IF NOT EXISTS reference.stock_adjustments (
    reference TEXT PRIMARY KEY, run_id TEXT NOT NULL, night TEXT NOT NULL, po_no TEXT NOT NULL,
    line INTEGER NOT NULL, qty INTEGER NOT NULL, fence BIGINT,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now());
-- The ledger: the reference is the idempotency key, and the database enforces it.
CREATE TABLE IF NOT EXISTS reference.entries (
    reference TEXT PRIMARY KEY, run_id TEXT NOT NULL, invoice_no TEXT NOT NULL,
    line INTEGER NOT NULL, kind TEXT NOT NULL, supplier TEXT NOT NULL,
    amount_cents BIGINT NOT NULL, fence BIGINT, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS entries_run_idx ON reference.entries (run_id);
-- Reversals point at what they reverse (added after the first release; idempotent).
ALTER TABLE reference.entries ADD COLUMN IF NOT EXISTS reverses TEXT;
ALTER TABLE reference.stock_adjustments ADD COLUMN IF NOT EXISTS reverses TEXT;
-- The highest fencing token each run has shown the ledger and stock stores.
CREATE TABLE IF NOT EXISTS reference.run_fences (
    run_id TEXT PRIMARY KEY, fence BIGINT NOT NULL);
-- The mail sink: one row per key; a repeated key only counts a delivery.
CREATE TABLE IF NOT EXISTS reference.mail_messages (
    key TEXT PRIMARY KEY, run_id TEXT NOT NULL, kind TEXT NOT NULL, claim TEXT NOT NULL,
    recipient TEXT NOT NULL, subject TEXT NOT NULL, body TEXT NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1, first_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS mail_run_idx ON reference.mail_messages (run_id);
-- The naive version's ledger and stock log: plain inserts, no key enforced.
CREATE TABLE IF NOT EXISTS reference.naive_entries (
    id BIGSERIAL PRIMARY KEY, reference TEXT NOT NULL, run_id TEXT NOT NULL,
    invoice_no TEXT NOT NULL, amount_cents BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS reference.naive_stock_adjustments (
    id BIGSERIAL PRIMARY KEY, reference TEXT NOT NULL, run_id TEXT NOT NULL, qty INTEGER NOT NULL);
-- `demo race`: the check-then-post table has no key on purpose.
CREATE TABLE IF NOT EXISTS reference.race_unkeyed (
    id BIGSERIAL PRIMARY KEY, try_id TEXT NOT NULL, reference TEXT NOT NULL);
-- Calls the demo's model server answered, per demo invocation, so a re-run can report them.
CREATE TABLE IF NOT EXISTS reference.model_calls (
    run_id TEXT NOT NULL, invocation UUID NOT NULL, calls BIGINT NOT NULL,
    PRIMARY KEY (run_id, invocation));
"#;

/// Where the outside database is, given trailmark's own connection options.
pub fn options_for(trailmark: &PgConnectOptions) -> Result<PgConnectOptions> {
    if let Some(url) = std::env::var(URL_VAR).ok().filter(|u| !u.is_empty()) {
        return url.parse().map_err(|e| {
            Error::Invalid(format!(
                "{URL_VAR} {} is not a Postgres URL: {e}",
                trailmark::redact::url(&url)
            ))
        });
    }
    let name = format!(
        "{}{SUFFIX}",
        trailmark.get_database().unwrap_or("trailmark")
    );
    Ok(trailmark.clone().database(&name))
}

/// The outside database's name, for messages.
pub fn name(options: &PgConnectOptions) -> String {
    options.get_database().unwrap_or("postgres").to_owned()
}

/// Creates the database when missing, then the schema; safe from several processes at once.
pub async fn prepare(options: &PgConnectOptions) -> Result<PgPool> {
    trailmark::store::create_database(options).await?;
    let pool = connect(options).await?;
    let mut tx = pool.begin().await?;
    // Concurrent CREATE ... IF NOT EXISTS can still collide in the catalog: take a lock first.
    sqlx::query("SELECT pg_advisory_xact_lock(7207001)")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(SCHEMA).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(pool)
}

/// A pool on the outside database next to `trailmark`'s, prepared once per process and reused.
pub async fn pool_for(trailmark: &PgPool) -> Result<PgPool> {
    static POOLS: OnceLock<tokio::sync::Mutex<HashMap<String, PgPool>>> = OnceLock::new();
    let options = options_for(&trailmark.connect_options())?;
    let key = format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        name(&options)
    );
    let mut pools = POOLS.get_or_init(Default::default).lock().await;
    if let Some(pool) = pools.get(&key).filter(|p| !p.is_closed()) {
        return Ok(pool.clone());
    }
    let pool = prepare(&options).await?;
    pools.insert(key, pool.clone());
    Ok(pool)
}

async fn connect(options: &PgConnectOptions) -> Result<PgPool> {
    let options = options
        .clone()
        .log_statements(tracing::log::LevelFilter::Trace);
    Ok(PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await?)
}

/// Drops the outside database (tests clean up after themselves with this).
pub async fn drop_database(options: &PgConnectOptions) -> Result<()> {
    Ok(trailmark::store::drop_database(options).await?)
}

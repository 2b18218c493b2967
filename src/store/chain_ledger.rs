//! The ledger of the built-in `chain` workflow (`trailmark.chain_ledger`): the outside store its
//! steps write to, whose primary key on the reference is what makes a repeated write harmless.

use sqlx::PgExecutor;

use super::Result;
use crate::domain::LocalTable;

/// The ledger as a local table, for `chain` runs that write their rows with the step's commit
/// (`"ledger": "local"`) instead of through an effect.
pub static TABLE: LocalTable = LocalTable::new(
    "trailmark.chain_ledger",
    "reference",
    &["reference", "run_id", "step", "payload"],
);

/// One ledger row to post.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    /// The unique reference (`run_id:step`, or `undo:` + a reference for a reversal).
    pub reference: &'a str,
    /// The run that posts it.
    pub run_id: &'a str,
    /// The position that posts it.
    pub step: i32,
    /// What it records.
    pub payload: &'a str,
}

/// Posts `entry` unless its reference exists; returns whether it went in.
pub async fn post(db: impl PgExecutor<'_>, entry: Entry<'_>) -> Result<bool> {
    let done = sqlx::query(
        "INSERT INTO trailmark.chain_ledger (reference, run_id, step, payload) VALUES ($1, $2, $3, $4)
         ON CONFLICT (reference) DO NOTHING",
    )
    .bind(entry.reference)
    .bind(entry.run_id)
    .bind(entry.step)
    .bind(entry.payload)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The payload stored under `reference`.
pub async fn payload(db: impl PgExecutor<'_>, reference: &str) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT payload FROM trailmark.chain_ledger WHERE reference = $1")
            .bind(reference)
            .fetch_optional(db)
            .await?,
    )
}

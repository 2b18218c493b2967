//! The ledger of the built-in `chain` workflow (`trailmark.chain_ledger`): the outside store its
//! steps write to, whose primary key on the reference is what makes a repeated write harmless.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use trailmark::inspect::like_prefix;

use trailmark::domain::LocalTable;
use trailmark::store::Result;

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

// Reads for the project's own tools (bench, drill).

/// Empties the ledger, so a benchmark repetition starts alike.
async fn erase(db: impl PgExecutor<'_>) -> Result<()> {
    sqlx::raw_sql("TRUNCATE trailmark.chain_ledger")
        .execute(db)
        .await?;
    Ok(())
}

/// Rows and distinct references of the runs matching the `LIKE` pattern `pattern`.
async fn counts_matching(db: impl PgExecutor<'_>, pattern: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger WHERE run_id LIKE $1",
    )
    .bind(pattern)
    .fetch_one(db)
    .await?)
}

/// Rows and distinct references of `runs`, reversals (`undo:` references) left out.
async fn forward_counts(db: impl PgExecutor<'_>, runs: &[String]) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger
          WHERE run_id = ANY($1) AND reference NOT LIKE 'undo:%'",
    )
    .bind(runs)
    .fetch_one(db)
    .await?)
}

/// (run, position, insert time) of every row of the runs matching the `LIKE` pattern `pattern`.
async fn row_times(
    db: impl PgExecutor<'_>,
    pattern: &str,
) -> Result<Vec<(String, i32, chrono::DateTime<chrono::Utc>)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, step, created_at FROM trailmark.chain_ledger WHERE run_id LIKE $1
          ORDER BY run_id, step",
    )
    .bind(pattern)
    .fetch_all(db)
    .await?)
}

/// Ledger rows and distinct references: equal when every write happened once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerCounts {
    /// Rows.
    pub rows: i64,
    /// Distinct references among them.
    pub distinct: i64,
}

/// One ledger row's position and insert time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRowTime {
    /// The run that posted it.
    pub run_id: String,
    /// The position that posted it.
    pub step: i32,
    /// When it was inserted (start of the inserting transaction).
    pub at: DateTime<Utc>,
}

/// Empties the ledger, so that a benchmark repetition starts alike.
pub async fn erase_ledger(db: impl PgExecutor<'_>) -> Result<()> {
    erase(db).await
}

/// Ledger rows and distinct references of the runs whose id starts with `prefix`.
pub async fn ledger_counts(db: impl PgExecutor<'_>, prefix: &str) -> Result<LedgerCounts> {
    let (rows, distinct) = counts_matching(db, &like_prefix(prefix)).await?;
    Ok(LedgerCounts { rows, distinct })
}

/// Ledger rows and distinct references of `runs`, their reversals (`undo:` references)
/// left out: the forward writes the runs made.
pub async fn forward_ledger_counts(
    db: impl PgExecutor<'_>,
    runs: &[String],
) -> Result<LedgerCounts> {
    let (rows, distinct) = forward_counts(db, runs).await?;
    Ok(LedgerCounts { rows, distinct })
}

/// Insert times of the ledger rows of the runs whose id starts with `prefix`, by run and
/// position: where an outside write falls within its step.
pub async fn ledger_row_times(db: impl PgExecutor<'_>, prefix: &str) -> Result<Vec<LedgerRowTime>> {
    let rows = row_times(db, &like_prefix(prefix)).await?;
    Ok(rows
        .into_iter()
        .map(|(run_id, step, at)| LedgerRowTime { run_id, step, at })
        .collect())
}

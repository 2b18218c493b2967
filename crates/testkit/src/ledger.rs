//! The ledger of the built-in `chain` workflow (`trailmark.chain_ledger`): the outside store its
//! steps write to, whose primary key on the reference is what makes a repeated write harmless.

use sqlx::PgExecutor;

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

// Reads for the project's own tools (bench, drill), faced by `crate::inspect::chain`: they move
// with the ledger when `chain` leaves the engine.

/// Empties the ledger, so a benchmark repetition starts alike.
pub(crate) async fn erase(db: impl PgExecutor<'_>) -> Result<()> {
    sqlx::raw_sql("TRUNCATE trailmark.chain_ledger")
        .execute(db)
        .await?;
    Ok(())
}

/// Rows and distinct references of the runs matching the `LIKE` pattern `pattern`.
pub(crate) async fn counts_matching(db: impl PgExecutor<'_>, pattern: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger WHERE run_id LIKE $1",
    )
    .bind(pattern)
    .fetch_one(db)
    .await?)
}

/// Rows and distinct references of `runs`, reversals (`undo:` references) left out.
pub(crate) async fn forward_counts(db: impl PgExecutor<'_>, runs: &[String]) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger
          WHERE run_id = ANY($1) AND reference NOT LIKE 'undo:%'",
    )
    .bind(runs)
    .fetch_one(db)
    .await?)
}

/// (run, position, insert time) of every row of the runs matching the `LIKE` pattern `pattern`.
pub(crate) async fn row_times(
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

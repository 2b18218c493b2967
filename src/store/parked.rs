//! Items set aside with a reason; committed with the step that parked them.

use serde::Serialize;
use sqlx::PgConnection;

use super::Result;
use crate::domain::RunId;

/// A parked item as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ParkedRow {
    /// The item's id.
    pub item: String,
    /// Step that parked it.
    pub step: String,
    /// Its position.
    pub seq: i32,
    /// Why.
    pub reason: String,
}

/// Records parked items in the step's transaction; parking the same item again keeps the first.
pub async fn insert(
    tx: &mut PgConnection,
    run_id: &RunId,
    seq: i32,
    step: &str,
    items: &[crate::workflow::Parked],
) -> Result<()> {
    for p in items {
        sqlx::query(
            "INSERT INTO trailmark.parked (run_id, item, seq, step, reason) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (run_id, item) DO NOTHING",
        )
        .bind(run_id.as_str())
        .bind(&p.item)
        .bind(seq)
        .bind(step)
        .bind(&p.reason)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Parked items of a run, in order.
pub async fn list(db: impl sqlx::PgExecutor<'_>, run_id: &str) -> Result<Vec<ParkedRow>> {
    Ok(sqlx::query_as("SELECT item, step, seq, reason FROM trailmark.parked WHERE run_id = $1 ORDER BY seq, created_at, item")
        .bind(run_id)
        .fetch_all(db)
        .await?)
}

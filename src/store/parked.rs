//! Items set aside with a reason; committed with the step that parked them.

use serde::Serialize;

use super::Result;

/// A parked item as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
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

/// Parked items of a run, in order.
pub async fn list(db: impl sqlx::PgExecutor<'_>, run_id: &str) -> Result<Vec<ParkedRow>> {
    Ok(sqlx::query_as("SELECT item, step, seq, reason FROM trailmark.parked WHERE run_id = $1 ORDER BY seq, created_at, item")
        .bind(run_id)
        .fetch_all(db)
        .await?)
}

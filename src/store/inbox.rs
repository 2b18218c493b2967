//! Processed message ids per consumer (the dedup table).

use sqlx::PgExecutor;

use super::Result;
use crate::domain::MessageId;

/// Records `id` as processed; `false` means another delivery got there first (a duplicate).
pub async fn record(db: impl PgExecutor<'_>, consumer: &str, id: MessageId) -> Result<bool> {
    let done = sqlx::query(
        "INSERT INTO trailmark.inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(id.0)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Whether `id` was processed by `consumer` (a refused claim asks this first: a delivery whose
/// original committed while it waited is a duplicate, whatever state the run is in now).
pub async fn seen(db: impl PgExecutor<'_>, consumer: &str, id: MessageId) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.inbox WHERE consumer = $1 AND message_id = $2)",
    )
    .bind(consumer)
    .bind(id.0)
    .fetch_one(db)
    .await?)
}

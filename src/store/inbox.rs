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

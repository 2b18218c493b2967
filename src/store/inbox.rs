//! Processed message ids per consumer (the dedup table).

use super::Result;
use crate::domain::MessageId;

/// What recording a message as processed found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// First time: the message is processed now.
    New,
    /// Processed before with the same body (or a body that was not hashed): a repeat.
    Repeat,
    /// Processed before with another body: the id was reused, and this body was never
    /// processed. Carries the body hash stored with the first use.
    Reused(String),
}

/// Records `id` as processed with its body's hash, in the caller's transaction.
pub async fn record(
    db: &mut sqlx::PgConnection,
    consumer: &str,
    id: MessageId,
    body_hash: &str,
) -> Result<Recorded> {
    let inserted = sqlx::query(
        "INSERT INTO trailmark.inbox (consumer, message_id, body_hash) VALUES ($1, $2, $3)
         ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(id.0)
    .bind(body_hash)
    .execute(&mut *db)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(Recorded::New);
    }
    // A statement of its own: it sees the row of a concurrent first use once that committed.
    let first: Option<String> = sqlx::query_scalar(
        "SELECT body_hash FROM trailmark.inbox WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id.0)
    .fetch_one(&mut *db)
    .await?;
    Ok(match first {
        Some(first) if first != body_hash => Recorded::Reused(first),
        _ => Recorded::Repeat,
    })
}

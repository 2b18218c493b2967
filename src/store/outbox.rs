//! The outbox: messages committed with the checkpoint, published by the relay.

use std::sync::LazyLock;

use sqlx::{PgExecutor, Row};

use super::{PgQuery, Result};
use crate::domain::OutgoingMessage;

/// A claimed outbox row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    /// Row id (only for marking; never used as a high-water mark, ids commit out of order).
    pub id: i64,
    /// Message id.
    pub message_id: uuid::Uuid,
    /// Target exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Headers as a JSON object of strings.
    pub headers: serde_json::Value,
    /// Body.
    pub body: Vec<u8>,
}

/// The `INSERT` of outbox rows bound by [`bind_rows`] from parameter `$first` on, returning
/// each row's id and message id.
pub(crate) fn insert_sql(first: usize) -> String {
    let p: Vec<String> = (first..first + 7).map(|i| format!("${i}")).collect();
    format!(
        "INSERT INTO trailmark.outbox (message_id, exchange, routing_key, headers, body, available_at, holder_pid)
         SELECT m, x, k, h, b, now() + make_interval(secs => d), pid
           FROM UNNEST({}::uuid[], {}::text[], {}::text[], {}::jsonb[], {}::bytea[], {}::float8[], {}::int4[])
             AS u(m, x, k, h, b, d, pid)
         RETURNING id, message_id",
        p[0], p[1], p[2], p[3], p[4], p[5], p[6]
    )
}

/// Two parts of a statement (`queued_ids` and `queue`) that insert the outbox rows bound by
/// [`bind_rows`] from parameter `$first` on, each tagged with the number of the step commit it
/// belongs to (an eighth array), only for items satisfying `condition`. The row ids are drawn
/// first, so the statement can hand each item its rows' ids (`queued_ids`: `item`, `o` the
/// message's place in its item, `id`) without a unique index on message ids.
pub(crate) fn insert_items_sql(first: usize, condition: &str) -> String {
    let p: Vec<String> = (first..first + 8).map(|i| format!("${i}")).collect();
    format!(
        "queued_ids AS (
            SELECT nextval('trailmark.outbox_id_seq') AS id, u.*
              FROM UNNEST({}::uuid[], {}::text[], {}::text[], {}::jsonb[], {}::bytea[], {}::float8[], {}::int4[], {}::int8[])
                   WITH ORDINALITY AS u(m, x, k, h, b, d, pid, item, o)
             WHERE {condition}
        ), queue AS (
            INSERT INTO trailmark.outbox (id, message_id, exchange, routing_key, headers, body, available_at, holder_pid)
            SELECT id, m, x, k, h, b, now() + make_interval(secs => d), pid FROM queued_ids
        )",
        p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]
    )
}

/// Binds `messages` as the seven arrays [`insert_sql`] expects.
pub(crate) fn bind_rows<'q, 'm: 'q>(
    q: PgQuery<'q>,
    messages: impl IntoIterator<Item = &'m OutgoingMessage>,
) -> PgQuery<'q> {
    let messages: Vec<&OutgoingMessage> = messages.into_iter().collect();
    let headers: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::to_value(&m.headers).expect("string map"))
        .collect();
    q.bind(messages.iter().map(|m| m.message_id.0).collect::<Vec<_>>())
        .bind(
            messages
                .iter()
                .map(|m| m.exchange.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            messages
                .iter()
                .map(|m| m.routing_key.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(headers)
        .bind(
            messages
                .iter()
                .map(|m| m.body.as_slice())
                .collect::<Vec<_>>(),
        )
        .bind(
            messages
                .iter()
                .map(|m| m.relay_after_ms as f64 / 1000.0)
                .collect::<Vec<_>>(),
        )
        .bind(messages.iter().map(|m| m.holder_pid).collect::<Vec<_>>())
}

static INSERT: LazyLock<String> = LazyLock::new(|| insert_sql(1));

/// Queues messages in the caller's transaction; returns each message's row id, in order.
pub async fn insert(db: impl PgExecutor<'_>, messages: &[OutgoingMessage]) -> Result<Vec<i64>> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(i64, uuid::Uuid)> = bind_rows(sqlx::query(INSERT.as_str()), messages)
        .fetch_all(db)
        .await?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<std::result::Result<_, sqlx::Error>>()?;
    Ok(messages
        .iter()
        .map(|m| {
            rows.iter()
                .find(|(_, id)| *id == m.message_id.0)
                .map_or(0, |r| r.0)
        })
        .collect())
}

/// Locks up to `limit` unpublished rows that no other relay holds, oldest first: rows that are
/// available, and rows held for a committer that has died (its presence backend is gone).
pub async fn claim(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<OutboxRow>> {
    Ok(sqlx::query_as(
        "SELECT id, message_id, exchange, routing_key, headers, body FROM trailmark.outbox
          WHERE published_at IS NULL
            AND (available_at <= now() OR trailmark.process_gone(holder_pid))
          ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// Marks rows published after their positive confirms.
pub async fn mark_published(db: impl PgExecutor<'_>, ids: &[i64]) -> Result<()> {
    sqlx::query("UPDATE trailmark.outbox SET published_at = now(), attempts = attempts + 1 WHERE id = ANY($1)")
        .bind(ids)
        .execute(db)
        .await?;
    Ok(())
}

/// Deletes rows (by row id) the worker that committed them has published itself (eager
/// publish, confirm received): nothing is left for the relay to do, and only the pruner would
/// ever read them.
///
/// Meant for [`super::relaxed_pool`]: the delete need not wait for its fsync. If Postgres crashes
/// before it reaches disk, the only cost is that the relay publishes those rows once more, and
/// consumers drop the repeats by message id.
pub async fn forget_published(db: impl PgExecutor<'_>, ids: &[i64]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query("DELETE FROM trailmark.outbox WHERE id = ANY($1) AND published_at IS NULL")
        .bind(ids)
        .execute(db)
        .await?;
    Ok(())
}

/// Counts a failed publish attempt on rows that stay unpublished.
pub async fn mark_failed(db: impl PgExecutor<'_>, ids: &[i64]) -> Result<()> {
    sqlx::query("UPDATE trailmark.outbox SET attempts = attempts + 1 WHERE id = ANY($1)")
        .bind(ids)
        .execute(db)
        .await?;
    Ok(())
}

/// Holds back rows the broker refused on their own, each with its error: tried again after a
/// delay that doubles with every attempt (2 s, 4 s, ... at most 5 min).
pub async fn hold_back(db: impl PgExecutor<'_>, rows: &[(i64, String)]) -> Result<()> {
    let (ids, errors): (Vec<i64>, Vec<String>) = rows.iter().cloned().unzip();
    sqlx::query(
        "UPDATE trailmark.outbox o
            SET attempts = o.attempts + 1, last_error = f.error, holder_pid = NULL,
                available_at = now() + make_interval(secs => least(300, 2 ^ least(o.attempts + 1, 9)))
           FROM unnest($1::bigint[], $2::text[]) AS f(id, error)
          WHERE o.id = f.id",
    )
    .bind(&ids)
    .bind(&errors)
    .execute(db)
    .await?;
    Ok(())
}

/// Deletes up to `batch` rows published more than `retention_secs` ago; returns how many.
pub async fn prune(db: impl PgExecutor<'_>, retention_secs: f64, batch: i64) -> Result<u64> {
    let done = sqlx::query(
        "DELETE FROM trailmark.outbox WHERE id IN (
            SELECT id FROM trailmark.outbox
             WHERE published_at < now() - make_interval(secs => $1) LIMIT $2)",
    )
    .bind(retention_secs)
    .bind(batch)
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}

/// What waits in the outbox.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub struct Backlog {
    /// Rows not yet published.
    pub pending: i64,
    /// Seconds since the oldest of them was written (0 when none).
    pub oldest_age_secs: f64,
    /// Of those, rows held back because the broker refused them (see [`hold_back`]).
    pub held_back: i64,
}

/// The outbox's backlog.
pub async fn backlog(db: impl PgExecutor<'_>) -> Result<Backlog> {
    Ok(sqlx::query_as(
        "SELECT count(*) AS pending,
                COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 AS oldest_age_secs,
                count(*) FILTER (WHERE last_error IS NOT NULL) AS held_back
           FROM trailmark.outbox WHERE published_at IS NULL",
    )
    .fetch_one(db)
    .await?)
}

//! What shadow runs would have done outside: effects and messages recorded, never made or sent.

use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;
use crate::domain::ShadowWrite;

#[derive(sqlx::FromRow)]
struct Row {
    seq: i32,
    kind: String,
    key: String,
    target: String,
    request: Value,
}

/// Records writes of a shadow run; a replayed step records the same keys again and its request
/// replaces the earlier attempt's (the attempt that commits is the one that counts).
pub async fn record(db: impl PgExecutor<'_>, run_id: &str, writes: &[ShadowWrite]) -> Result<()> {
    if writes.is_empty() {
        return Ok(());
    }
    let col = |f: fn(&ShadowWrite) -> String| writes.iter().map(f).collect::<Vec<_>>();
    sqlx::query(
        "INSERT INTO trailmark.shadow_writes (run_id, seq, kind, key, target, request)
         SELECT $1, * FROM UNNEST($2::int4[], $3::text[], $4::text[], $5::text[], $6::jsonb[])
         ON CONFLICT (run_id, kind, key) DO UPDATE
            SET seq = EXCLUDED.seq, target = EXCLUDED.target, request = EXCLUDED.request",
    )
    .bind(run_id)
    .bind(writes.iter().map(|w| w.seq).collect::<Vec<_>>())
    .bind(col(|w| w.kind.clone()))
    .bind(col(|w| w.key.clone()))
    .bind(col(|w| w.target.clone()))
    .bind(writes.iter().map(|w| w.request.clone()).collect::<Vec<_>>())
    .execute(db)
    .await?;
    Ok(())
}

/// A shadow run's writes in order.
pub async fn list(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<ShadowWrite>> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT seq, kind, key, target, request FROM trailmark.shadow_writes
          WHERE run_id = $1 ORDER BY seq, created_at, kind, key",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ShadowWrite {
            seq: r.seq,
            kind: r.kind,
            key: r.key,
            target: r.target,
            request: r.request,
        })
        .collect())
}

//! Progress lines: what a run says about its work while it works (`ctx.progress`), and what the
//! engine says about its recovery. Written in batches off the step's path; the newest
//! [`KEEP`] lines of a run are kept.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgExecutor;

use super::Result;

/// Lines kept per run.
pub const KEEP: i64 = 50;

/// One line to record.
#[derive(Debug, Clone)]
pub struct NewLine {
    /// The run.
    pub run_id: String,
    /// The position it was said at.
    pub seq: i32,
    /// When it was said.
    pub at: DateTime<Utc>,
    /// What.
    pub line: String,
}

/// A recorded line.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Line {
    /// Order.
    pub id: i64,
    /// The position it was said at.
    pub seq: i32,
    /// When.
    pub at: DateTime<Utc>,
    /// What.
    pub line: String,
}

/// Records `lines` in one statement, then prunes the runs they belong to down to [`KEEP`].
pub async fn record(conn: &mut sqlx::PgConnection, lines: &[NewLine]) -> Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let runs: Vec<&str> = lines.iter().map(|l| l.run_id.as_str()).collect();
    sqlx::query(
        "INSERT INTO trailmark.progress (run_id, seq, at, line)
         SELECT * FROM UNNEST($1::text[], $2::int4[], $3::timestamptz[], $4::text[])",
    )
    .bind(&runs)
    .bind(lines.iter().map(|l| l.seq).collect::<Vec<_>>())
    .bind(lines.iter().map(|l| l.at).collect::<Vec<_>>())
    .bind(lines.iter().map(|l| l.line.as_str()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "DELETE FROM trailmark.progress p USING (
            SELECT id FROM (
                SELECT id, row_number() OVER (PARTITION BY run_id ORDER BY id DESC) AS n
                  FROM trailmark.progress WHERE run_id = ANY($1)) ranked
             WHERE n > $2) old
         WHERE p.id = old.id",
    )
    .bind(&runs)
    .bind(KEEP)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A run's lines after the id `after` (0: all kept), oldest first.
pub async fn list(db: impl PgExecutor<'_>, run_id: &str, after: i64) -> Result<Vec<Line>> {
    Ok(sqlx::query_as(
        "SELECT id, seq, at, line FROM trailmark.progress WHERE run_id = $1 AND id > $2 ORDER BY id",
    )
    .bind(run_id)
    .bind(after)
    .fetch_all(db)
    .await?)
}

//! The audit trail: one append-only row per mutation an operator or the API made, written in the
//! transaction of the change it records.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;

/// An audit row to write.
#[derive(Debug, Clone)]
pub struct NewEntry<'a> {
    /// Who (a token's name, or the operator at the terminal).
    pub actor: &'a str,
    /// Their role (`viewer`, `operator`, `admin`; `cli` for the terminal).
    pub role: &'a str,
    /// `api` or `cli`.
    pub via: &'a str,
    /// What (`resume`, `undo`, `dlq.requeue`, `dlq.reveal`, ...).
    pub action: &'a str,
    /// On what (a run id, a dead letter's id, a reason code).
    pub target: &'a str,
    /// Why, in their words.
    pub reason: &'a str,
    /// The HTTP request's id, for the API.
    pub request_id: Option<&'a str>,
    /// The run's status before, when the target is a run.
    pub status_before: Option<&'a str>,
    /// And after.
    pub status_after: Option<&'a str>,
    /// Anything else worth keeping (a scope, counts).
    pub details: &'a Value,
}

/// A recorded audit row.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Entry {
    /// Order.
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who.
    pub actor: String,
    /// Their role.
    pub role: String,
    /// Through which face.
    pub via: String,
    /// What.
    pub action: String,
    /// On what.
    pub target: String,
    /// Why.
    pub reason: String,
    /// The request's id.
    pub request_id: Option<String>,
    /// Run status before.
    pub status_before: Option<String>,
    /// Run status after.
    pub status_after: Option<String>,
    /// Details.
    pub details: Value,
}

/// Records one entry in the caller's transaction.
pub async fn insert(db: impl PgExecutor<'_>, e: &NewEntry<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO trailmark.audit (actor, role, via, action, target, reason, request_id,
                                      status_before, status_after, details)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(e.actor)
    .bind(e.role)
    .bind(e.via)
    .bind(e.action)
    .bind(e.target)
    .bind(e.reason)
    .bind(e.request_id)
    .bind(e.status_before)
    .bind(e.status_after)
    .bind(e.details)
    .execute(db)
    .await?;
    Ok(())
}

/// The newest entries first, before the id `before` (a cursor; `None` from the newest), at most
/// `limit`, optionally about one target.
pub async fn list(
    db: impl PgExecutor<'_>,
    target: Option<&str>,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<Entry>> {
    Ok(sqlx::query_as(
        "SELECT id, at, actor, role, via, action, target, reason, request_id, status_before,
                status_after, details
           FROM trailmark.audit
          WHERE ($1::text IS NULL OR target = $1) AND ($2::int8 IS NULL OR id < $2)
          ORDER BY id DESC LIMIT $3",
    )
    .bind(target)
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await?)
}

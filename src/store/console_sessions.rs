//! Console sessions: the hash of a browser's session id, the hash of the token it logged in
//! with, its CSRF secret and when it expires.

use sqlx::PgExecutor;

use super::Result;

/// A live session as read back.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Session {
    /// SHA-256 (hex) of the token it logged in with.
    pub token_hash: String,
    /// The secret its forms carry.
    pub csrf: String,
}

/// Opens a session for `ttl_secs`, and forgets expired ones.
pub async fn open(
    db: &mut sqlx::PgConnection,
    id_hash: &str,
    token_hash: &str,
    csrf: &str,
    ttl_secs: u64,
) -> Result<()> {
    sqlx::query("DELETE FROM trailmark.console_sessions WHERE expires_at < now()")
        .execute(&mut *db)
        .await?;
    sqlx::query(
        "INSERT INTO trailmark.console_sessions (id_hash, token_hash, csrf, expires_at)
         VALUES ($1, $2, $3, now() + make_interval(secs => $4))",
    )
    .bind(id_hash)
    .bind(token_hash)
    .bind(csrf)
    .bind(ttl_secs as f64)
    .execute(&mut *db)
    .await?;
    Ok(())
}

/// The session with this id hash, unless it expired.
pub async fn get(db: impl PgExecutor<'_>, id_hash: &str) -> Result<Option<Session>> {
    Ok(sqlx::query_as(
        "SELECT token_hash, csrf FROM trailmark.console_sessions
          WHERE id_hash = $1 AND expires_at > now()",
    )
    .bind(id_hash)
    .fetch_optional(db)
    .await?)
}

/// Ends a session.
pub async fn close(db: impl PgExecutor<'_>, id_hash: &str) -> Result<()> {
    sqlx::query("DELETE FROM trailmark.console_sessions WHERE id_hash = $1")
        .bind(id_hash)
        .execute(db)
        .await?;
    Ok(())
}

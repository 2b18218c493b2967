//! Idempotency keys of mutating API requests: the first request under a key runs, a repeat with
//! the same request gets the first response again, another request under the key is refused.

use sqlx::PgExecutor;

use super::Result;

/// What a key holds when a request arrives with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begun {
    /// New: the request runs now (the key is held as in progress).
    Run,
    /// A request under this key is still running.
    InProgress,
    /// The key was used with another request.
    Mismatch,
    /// The same request ran before: its response.
    Replay {
        /// HTTP status.
        status: u16,
        /// Body.
        body: Vec<u8>,
    },
}

/// Takes `key` for a request with `request_hash`, or says what it holds.
pub async fn begin(db: &mut sqlx::PgConnection, key: &str, request_hash: &str) -> Result<Begun> {
    let inserted = sqlx::query(
        "INSERT INTO trailmark.api_idempotency (key, request_hash) VALUES ($1, $2)
         ON CONFLICT (key) DO NOTHING",
    )
    .bind(key)
    .bind(request_hash)
    .execute(&mut *db)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(Begun::Run);
    }
    let (hash, done, status, body): (String, bool, Option<i32>, Option<Vec<u8>>) = sqlx::query_as(
        "SELECT request_hash, done, response_status, response_body
               FROM trailmark.api_idempotency WHERE key = $1",
    )
    .bind(key)
    .fetch_one(&mut *db)
    .await?;
    Ok(match (hash == request_hash, done) {
        (false, _) => Begun::Mismatch,
        (true, false) => Begun::InProgress,
        (true, true) => Begun::Replay {
            status: status.unwrap_or(200) as u16,
            body: body.unwrap_or_default(),
        },
    })
}

/// Keeps the response of the request that holds `key`.
pub async fn finish(db: impl PgExecutor<'_>, key: &str, status: u16, body: &[u8]) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.api_idempotency SET done = true, response_status = $2, response_body = $3
          WHERE key = $1",
    )
    .bind(key)
    .bind(i32::from(status))
    .bind(body)
    .execute(db)
    .await?;
    Ok(())
}

/// Lets `key` go (the request failed before it changed anything, so it may be tried again).
pub async fn release(db: impl PgExecutor<'_>, key: &str) -> Result<()> {
    sqlx::query("DELETE FROM trailmark.api_idempotency WHERE key = $1 AND NOT done")
        .bind(key)
        .execute(db)
        .await?;
    Ok(())
}

/// Forgets keys older than `secs` (a client retries within minutes, not days).
pub async fn prune(db: impl PgExecutor<'_>, secs: f64) -> Result<u64> {
    Ok(sqlx::query(
        "DELETE FROM trailmark.api_idempotency WHERE created_at < now() - make_interval(secs => $1)",
    )
    .bind(secs)
    .execute(db)
    .await?
    .rows_affected())
}

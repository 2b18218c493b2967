//! The fleet's use of each model endpoint over the last minute (`trailmark.model_usage`), so
//! that the fleet keeps under an endpoint's requests- and tokens-per-minute limits instead of
//! learning them from the provider's refusals. A call reserves its place before it is made
//! ([`reserve`]); its answer's real usage replaces the estimate in the statement that journals
//! it (`store::records`); a failed call keeps its estimate ([`failed`]).

use std::time::Duration;

use sqlx::PgExecutor;

use super::Result;
use crate::domain::{Admission, ModelAsk};

/// Reserves `ask`'s place in its endpoint's last minute when there is room, in one statement
/// under the endpoint's lock (`trailmark.reserve_model_call`, which also deletes a batch of rows
/// that left the window).
pub async fn reserve(db: impl PgExecutor<'_>, ask: &ModelAsk<'_>) -> Result<Admission> {
    let (reserved, requests, tokens, wait): (Option<i64>, i64, i64, Option<f64>) =
        sqlx::query_as(
            "SELECT reserved, requests, tokens, wait_secs
               FROM trailmark.reserve_model_call($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(ask.endpoint)
        .bind(whole(ask.requests_per_minute))
        .bind(whole(ask.tokens_per_minute))
        .bind(whole(ask.estimate))
        .bind(ask.hold.as_secs_f64())
        .bind(ask.run_id)
        .bind(ask.seq)
        .fetch_one(db)
        .await?;
    let used = (requests.max(0) as u64, tokens.max(0) as u64);
    Ok(match reserved {
        Some(id) => Admission::Reserved { id, used },
        None => Admission::Full {
            used,
            // Never absent for a call within the limit; a second is a safe guess if it were.
            wait: Duration::from_secs_f64(wait.unwrap_or(1.0).max(0.0)),
        },
    })
}

/// The call reserved as `id` failed: it counts from now for a minute, at its estimate (what the
/// provider counted of a failed call is unknown, and the request itself counted).
pub async fn failed(db: impl PgExecutor<'_>, id: i64) -> Result<()> {
    sqlx::query("UPDATE trailmark.model_usage SET at = clock_timestamp() WHERE id = $1")
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}

/// A setting or estimate as a bigint (they are checked far below its limit).
fn whole(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

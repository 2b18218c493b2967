//! Concurrency keys' rows: limits operators set, the per-key lock rows with their token buckets,
//! the slots runs hold and the runs waiting for one (see `flow::gate`).

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use super::runs::ExpiredLease;

/// When a slot row is live: reserved for a run whose step message is on its way, or held by an
/// executing run whose lease is (an idle pre-claim too). A slot outlives a dead worker only
/// until its lease expires; a dead presence connection alone does not free it, because a worker
/// whose connection dropped is still running its step and renews its lease through its pool
/// once it can: counted free, its key would run over its limit when it does (the drill's
/// Postgres fault showed 16 runs of a key limited to 10).
const LIVE: &str = "(s.reserved_until > now() OR (r.lease_owner IS NOT NULL
                     AND (r.lease_expires_at IS NULL OR r.lease_expires_at > now())
                     AND r.status IN ('running', 'compensating')))";

/// What a run's own row says before its step is gated.
#[derive(Debug, sqlx::FromRow)]
pub struct RunFlow {
    /// The run.
    pub run_id: String,
    /// Its key (`None`: not counted under one).
    pub flow_key: Option<String>,
    /// Its priority level.
    pub priority: i16,
}

/// The keys and priorities of the runs `run_ids` that exist.
pub async fn run_flows(db: impl PgExecutor<'_>, run_ids: &[&str]) -> Result<Vec<RunFlow>> {
    Ok(
        sqlx::query_as("SELECT run_id, flow_key, priority FROM trailmark.runs WHERE run_id = ANY($1)")
            .bind(run_ids)
            .fetch_all(db)
            .await?,
    )
}

/// The slot of a key a claim holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The key.
    pub key: String,
    /// A rate applies to the key: every step start takes a token, so the run's next step goes
    /// through the gate (no pre-claim).
    pub paced: bool,
    /// A total applies to the workflow: its keys take turns, so a run keeps its slot only while
    /// no run of the workflow waits.
    pub shared: bool,
}

/// Whether a run waits that should go before `run_id` (which holds a slot of the key): one that
/// ranks ahead of it in its key's line, or, under a workflow total (`shared`), any run of the
/// workflow (keys take turns). A step's end then gives its slot to the line instead of
/// pre-claiming the run's next step. With whether anyone waits in that line at all (a key's
/// line, or the workflow's when `shared`). Index probes, one round trip.
pub async fn line_ahead(
    db: impl PgExecutor<'_>,
    (workflow, key): (&str, &str),
    run_id: &str,
    (shared, aging_secs): (bool, f64),
) -> Result<(bool, bool)> {
    Ok(sqlx::query_as(
        "SELECT CASE WHEN $4 THEN EXISTS (SELECT 1 FROM trailmark.flow_waiters WHERE workflow = $1)
                ELSE EXISTS (SELECT 1 FROM trailmark.flow_waiters w, trailmark.runs r
                              WHERE r.run_id = $3 AND w.workflow = $1 AND w.key = $2
                                AND w.rank_at < r.created_at - make_interval(secs => $5 * r.priority)) END,
                EXISTS (SELECT 1 FROM trailmark.flow_waiters WHERE workflow = $1 AND ($4 OR key = $2))",
    )
    .bind(workflow)
    .bind(key)
    .bind(run_id)
    .bind(shared)
    .bind(aging_secs)
    .fetch_one(db)
    .await?)
}

/// Whether any run waits in `key`'s line (or, `shared`, in any line of the workflow): a step's
/// end that freed a slot hands it on only then, and leaves the locked hand-off out otherwise (a
/// run that starts waiting meanwhile is handed a slot by the supervisor's loop). One index probe.
pub async fn anyone_waits(db: impl PgExecutor<'_>, (workflow, key): (&str, &str), shared: bool) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.flow_waiters WHERE workflow = $1 AND ($3 OR key = $2))",
    )
    .bind(workflow)
    .bind(key)
    .bind(shared)
    .fetch_one(db)
    .await?)
}

/// Limits set at run time for a workflow: for one key, and for every key ('').
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct LimitRow {
    /// The workflow.
    pub workflow: String,
    /// The key ('' for every key).
    pub key: String,
    /// Runs of a key holding a step at once.
    pub concurrency: Option<i32>,
    /// Runs of the workflow holding a step at once ('' row only).
    pub total: Option<i32>,
    /// Step starts per second per key.
    pub rate: Option<f64>,
    /// Who set it.
    pub set_by: String,
    /// When.
    pub set_at: DateTime<Utc>,
}

/// The limits set for `workflow` that apply to `key`: its own row and the every-key row.
pub async fn limits_for(db: impl PgExecutor<'_>, workflow: &str, key: &str) -> Result<Vec<LimitRow>> {
    Ok(sqlx::query_as(
        "SELECT * FROM trailmark.flow_limits WHERE workflow = $1 AND key IN ($2, '') ORDER BY key DESC",
    )
    .bind(workflow)
    .bind(key)
    .fetch_all(db)
    .await?)
}

/// Every limit set at run time for the workflows `workflows`.
pub async fn limits_of(db: impl PgExecutor<'_>, workflows: &[&str]) -> Result<Vec<LimitRow>> {
    Ok(
        sqlx::query_as("SELECT * FROM trailmark.flow_limits WHERE workflow = ANY($1) ORDER BY workflow, key")
            .bind(workflows)
            .fetch_all(db)
            .await?,
    )
}

/// Every limit set at run time, by workflow and key.
pub async fn limits(db: impl PgExecutor<'_>) -> Result<Vec<LimitRow>> {
    Ok(sqlx::query_as("SELECT * FROM trailmark.flow_limits ORDER BY workflow, key")
        .fetch_all(db)
        .await?)
}

/// A change of limits: `None` keeps what is set.
#[derive(Debug, Clone, Default)]
pub struct LimitChange {
    /// Runs of a key holding a step at once.
    pub concurrency: Option<i32>,
    /// Runs of the workflow holding a step at once (every-key row only).
    pub total: Option<i32>,
    /// Step starts per second per key.
    pub rate: Option<f64>,
}

/// Sets limits for one key, or every key (''), keeping what the change leaves out; returns the
/// row as it stands.
pub async fn set_limit(
    db: impl PgExecutor<'_>,
    (workflow, key): (&str, &str),
    change: &LimitChange,
    by: &str,
) -> Result<LimitRow> {
    Ok(sqlx::query_as(
        "INSERT INTO trailmark.flow_limits (workflow, key, concurrency, total, rate, set_by)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (workflow, key) DO UPDATE
            SET concurrency = COALESCE(EXCLUDED.concurrency, flow_limits.concurrency),
                total = COALESCE(EXCLUDED.total, flow_limits.total),
                rate = COALESCE(EXCLUDED.rate, flow_limits.rate),
                set_by = EXCLUDED.set_by, set_at = now()
         RETURNING *",
    )
    .bind(workflow)
    .bind(key)
    .bind(change.concurrency)
    .bind(change.total)
    .bind(change.rate)
    .bind(by)
    .fetch_one(db)
    .await?)
}

/// Removes the limits set for one key or every key (''), so the declared ones apply again;
/// whether there were any.
pub async fn clear_limit(db: impl PgExecutor<'_>, (workflow, key): (&str, &str)) -> Result<bool> {
    let done = sqlx::query("DELETE FROM trailmark.flow_limits WHERE workflow = $1 AND key = $2")
        .bind(workflow)
        .bind(key)
        .execute(db)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// A key's lock row: its token bucket as it stands.
#[derive(Debug, sqlx::FromRow)]
pub struct KeyRow {
    /// Tokens left (`None`: never rate-limited).
    pub tokens: Option<f64>,
    /// Seconds since the bucket was last refilled.
    pub idle_secs: f64,
}

/// Locks the row of `key` ('' for the workflow's total) until the transaction ends, creating it
/// the first time: every claim and hand-off of the key goes through it, one at a time.
pub async fn lock_key(tx: &mut PgConnection, workflow: &str, key: &str) -> Result<KeyRow> {
    const LOCK: &str = "SELECT tokens, EXTRACT(EPOCH FROM now() - refilled_at)::float8 AS idle_secs
                          FROM trailmark.flow_keys WHERE workflow = $1 AND key = $2 FOR UPDATE";
    let found: Option<KeyRow> = sqlx::query_as(LOCK).bind(workflow).bind(key).fetch_optional(&mut *tx).await?;
    if let Some(row) = found {
        return Ok(row);
    }
    sqlx::query("INSERT INTO trailmark.flow_keys (workflow, key) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(workflow)
        .bind(key)
        .execute(&mut *tx)
        .await?;
    Ok(sqlx::query_as(LOCK).bind(workflow).bind(key).fetch_one(&mut *tx).await?)
}

/// Stores a key's token bucket after a claim or hand-off took from it.
pub async fn set_tokens(tx: &mut PgConnection, (workflow, key): (&str, &str), tokens: f64) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.flow_keys SET tokens = $3, refilled_at = now() WHERE workflow = $1 AND key = $2",
    )
    .bind(workflow)
    .bind(key)
    .bind(tokens)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Slots of a key as a claim finds them, with the key's row locked.
#[derive(Debug, Default, sqlx::FromRow)]
pub struct Slots {
    /// Live slots of the key, the asking runs' own included.
    pub live: i64,
    /// Live slots of the whole workflow (counted only when asked).
    pub total_live: Option<i64>,
    /// The asking runs that hold a live slot of the key already (one reserved for them, or held
    /// by the lease of another delivery of their step).
    pub own: Vec<String>,
    /// Runs of the key wait for a slot now (not for a later token).
    pub queued: bool,
}

/// Counts the live slots of `key` (and of the workflow when `total`), names those of `askers`
/// that hold one, and removes the slots that ended (their run gave its lease back, died, or
/// ended). Call with the key's row locked.
pub async fn slots(
    tx: &mut PgConnection,
    (workflow, key): (&str, &str),
    askers: &[&str],
    total: bool,
) -> Result<Slots> {
    let sql = format!(
        "WITH s AS (
             SELECT s.run_id, s.key, {LIVE} AS live
               FROM trailmark.flow_slots s LEFT JOIN trailmark.runs r ON r.run_id = s.run_id
              WHERE s.workflow = $1 AND ($4 OR s.key = $2)
         ), ended AS (
             DELETE FROM trailmark.flow_slots f USING s
              WHERE f.run_id = s.run_id AND NOT s.live AND s.key = $2
         )
         SELECT count(*) FILTER (WHERE live AND key = $2) AS live,
                CASE WHEN $4 THEN count(*) FILTER (WHERE live) END AS total_live,
                COALESCE(array_agg(run_id) FILTER (WHERE live AND key = $2 AND run_id = ANY($3)),
                         '{{}}') AS own,
                EXISTS (SELECT 1 FROM trailmark.flow_waiters w
                         WHERE w.workflow = $1 AND w.key = $2 AND w.not_before <= now()) AS queued
           FROM s"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(workflow)
        .bind(key)
        .bind(askers)
        .bind(total)
        .fetch_one(&mut *tx)
        .await?)
}

/// Gives the runs `run_ids` a slot of `key` held by their leases from now on (a reservation
/// becomes held).
pub async fn hold(tx: &mut PgConnection, run_ids: &[&str], (workflow, key): (&str, &str)) -> Result<()> {
    sqlx::query(
        "INSERT INTO trailmark.flow_slots (run_id, workflow, key) SELECT unnest($1::text[]), $2, $3
         ON CONFLICT (run_id) DO UPDATE SET workflow = $2, key = $3, reserved_until = NULL",
    )
    .bind(run_ids)
    .bind(workflow)
    .bind(key)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A run that waits for a slot or a token.
#[derive(Debug, Clone)]
pub struct NewWaiter<'a> {
    /// The run.
    pub run_id: &'a str,
    /// The position its step message was for.
    pub seq: i32,
    /// Its workflow and key.
    pub at: (&'a str, &'a str),
    /// Its priority level.
    pub priority: i16,
    /// `slot`, `total` or `rate`.
    pub reason: &'static str,
    /// Not handed a slot before this many seconds from now (a rate limit's next token).
    pub after_secs: f64,
    /// Seconds of waiting that lift a run one priority level (`flow.aging_secs`).
    pub aging_secs: f64,
}

/// Records runs of one key as waiting, in one statement (a repeat of the same position keeps
/// its place in the line; a position named twice is recorded once). A run's rank is its start,
/// so a run that began earlier goes on before runs that began later (runs finish in the order
/// they came instead of all of them late), moved earlier by `aging_secs` per priority level: a
/// higher level goes first, and a lower one is passed only by higher ones that started less than
/// the levels between them times `aging_secs` after it.
pub async fn wait_all(tx: &mut PgConnection, waiters: &[NewWaiter<'_>]) -> Result<()> {
    let mut unique: Vec<&NewWaiter<'_>> = Vec::with_capacity(waiters.len());
    for w in waiters {
        if !unique.iter().any(|u| (u.run_id, u.seq) == (w.run_id, w.seq)) {
            unique.push(w);
        }
    }
    let Some(first) = unique.first() else {
        return Ok(());
    };
    sqlx::query(
        "INSERT INTO trailmark.flow_waiters (run_id, seq, workflow, key, priority, reason, not_before, rank_at)
         SELECT w.run_id, w.seq, $3, $4, w.priority, w.reason, now() + make_interval(secs => w.after_secs),
                r.created_at - make_interval(secs => $5 * w.priority)
           FROM UNNEST($1::text[], $2::int4[], $6::int2[], $7::text[], $8::float8[])
                AS w(run_id, seq, priority, reason, after_secs)
           JOIN trailmark.runs r ON r.run_id = w.run_id
         ON CONFLICT (run_id, seq) DO UPDATE SET reason = EXCLUDED.reason,
                not_before = GREATEST(flow_waiters.not_before, EXCLUDED.not_before)",
    )
    .bind(unique.iter().map(|w| w.run_id).collect::<Vec<_>>())
    .bind(unique.iter().map(|w| w.seq).collect::<Vec<_>>())
    .bind(first.at.0)
    .bind(first.at.1)
    .bind(first.aging_secs)
    .bind(unique.iter().map(|w| w.priority).collect::<Vec<_>>())
    .bind(unique.iter().map(|w| w.reason).collect::<Vec<_>>())
    .bind(unique.iter().map(|w| w.after_secs).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Hands up to `n` waiting runs of `key` (due ones, in rank order) a slot reserved for
/// `reserve_secs`, removes their waits, and returns the runs still executing at the position
/// they waited at, for their step messages to be queued in the same transaction. Call with the
/// key's row locked.
pub async fn hand(
    tx: &mut PgConnection,
    (workflow, key): (&str, &str),
    n: i64,
    reserve_secs: f64,
) -> Result<Vec<ExpiredLease>> {
    if n <= 0 {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_as(
        "WITH picked AS (
             DELETE FROM trailmark.flow_waiters w
              WHERE (w.run_id, w.seq) IN (SELECT run_id, seq FROM trailmark.flow_waiters
                                           WHERE workflow = $1 AND key = $2 AND not_before <= now()
                                           ORDER BY rank_at LIMIT $3)
             RETURNING w.run_id, w.seq
         ), ready AS (
             SELECT r.run_id, r.workflow, r.workflow_version, r.step, r.step_seq, r.traceparent
               FROM picked p JOIN trailmark.runs r ON r.run_id = p.run_id AND r.step_seq = p.seq
              WHERE r.status = ANY($5::text[]) AND r.step IS NOT NULL
         ), reserved AS (
             INSERT INTO trailmark.flow_slots (run_id, workflow, key, reserved_until)
             SELECT run_id, $1, $2, now() + make_interval(secs => $4) FROM ready
             ON CONFLICT (run_id) DO UPDATE SET workflow = $1, key = $2,
                    reserved_until = EXCLUDED.reserved_until
         ), served AS (
             UPDATE trailmark.flow_keys SET served_at = now() WHERE workflow = $1 AND key = $2
                AND EXISTS (SELECT 1 FROM ready)
         )
         SELECT * FROM ready",
    )
    .bind(workflow)
    .bind(key)
    .bind(n)
    .bind(reserve_secs)
    .bind(&crate::domain::RunStatus::EXECUTING[..])
    .fetch_all(&mut *tx)
    .await?)
}

/// Keys of a workflow with runs waiting now, least recently served first (round-robin).
pub async fn waiting_keys(tx: &mut PgConnection, workflow: &str) -> Result<Vec<String>> {
    // A skip scan: one index probe per key, however many runs each has waiting.
    Ok(sqlx::query_scalar(
        "WITH RECURSIVE k(key) AS (
             (SELECT key FROM trailmark.flow_waiters WHERE workflow = $1 ORDER BY key LIMIT 1)
             UNION ALL
             SELECT (SELECT w.key FROM trailmark.flow_waiters w
                      WHERE w.workflow = $1 AND w.key > k.key ORDER BY w.key LIMIT 1)
               FROM k WHERE k.key IS NOT NULL
         )
         SELECT k.key FROM k LEFT JOIN trailmark.flow_keys f ON f.workflow = $1 AND f.key = k.key
          WHERE k.key IS NOT NULL
          ORDER BY f.served_at NULLS FIRST, k.key",
    )
    .bind(workflow)
    .fetch_all(&mut *tx)
    .await?)
}

/// Workflows with runs waiting (one index probe each).
pub async fn waiting_workflows(db: impl PgExecutor<'_>) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "WITH RECURSIVE k(workflow) AS (
             (SELECT workflow FROM trailmark.flow_waiters ORDER BY workflow LIMIT 1)
             UNION ALL
             SELECT (SELECT w.workflow FROM trailmark.flow_waiters w
                      WHERE w.workflow > k.workflow ORDER BY w.workflow LIMIT 1)
               FROM k WHERE k.workflow IS NOT NULL
         )
         SELECT workflow FROM k WHERE workflow IS NOT NULL",
    )
    .fetch_all(db)
    .await?)
}

/// Why and since when a run waits for a slot or a token, for `run show`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Waiting {
    /// The key it is counted under.
    pub key: String,
    /// `slot` (its key's limit), `total` (its workflow's) or `rate` (its key's rate).
    pub reason: String,
    /// Its priority level.
    pub priority: i16,
    /// Since when it waits.
    pub since: DateTime<Utc>,
    /// Not handed a slot before this (a rate limit's next token).
    pub not_before: DateTime<Utc>,
    /// Runs of its key ahead of it in the line.
    pub ahead: i64,
}

/// Whether and why a run waits for a slot (`None`: it does not).
pub async fn waiting(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<Waiting>> {
    Ok(sqlx::query_as(
        "SELECT w.key, w.reason, w.priority, w.since, w.not_before,
                (SELECT count(*) FROM trailmark.flow_waiters a
                  WHERE a.workflow = w.workflow AND a.key = w.key AND a.rank_at < w.rank_at) AS ahead
           FROM trailmark.flow_waiters w WHERE w.run_id = $1 ORDER BY w.seq DESC LIMIT 1",
    )
    .bind(run_id)
    .fetch_optional(db)
    .await?)
}

/// One key's figures, for metrics and the console.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct KeyLoad {
    /// The workflow.
    pub workflow: String,
    /// The key.
    pub key: String,
    /// Runs holding a slot.
    pub running: i64,
    /// Runs waiting for a slot.
    pub waiting: i64,
    /// Runs waiting for a token of the key's rate.
    pub throttled: i64,
}

/// The `limit` keys with the most runs waiting or running: what a busy fleet is busy with.
pub async fn busiest(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<KeyLoad>> {
    let sql = format!(
        "WITH w AS (
             SELECT workflow, key, count(*) FILTER (WHERE reason <> 'rate') AS waiting,
                    count(*) FILTER (WHERE reason = 'rate') AS throttled
               FROM trailmark.flow_waiters GROUP BY 1, 2
         ), s AS (
             SELECT s.workflow, s.key, count(*) AS running
               FROM trailmark.flow_slots s LEFT JOIN trailmark.runs r ON r.run_id = s.run_id
              WHERE {LIVE} GROUP BY 1, 2
         )
         SELECT workflow, key, COALESCE(s.running, 0) AS running, COALESCE(w.waiting, 0) AS waiting,
                COALESCE(w.throttled, 0) AS throttled
           FROM w FULL JOIN s USING (workflow, key)
          ORDER BY COALESCE(w.waiting, 0) + COALESCE(w.throttled, 0) DESC, COALESCE(s.running, 0) DESC,
                   workflow, key
          LIMIT $1"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(limit).fetch_all(db).await?)
}

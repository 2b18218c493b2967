//! The `schedules` table: what a schedule starts and when, and the scheduler's place in it.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;

/// A schedule as stored.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct ScheduleRow {
    /// Its name, the start of every run id it makes.
    pub name: String,
    /// The workflow each tick starts.
    pub workflow: String,
    /// The input of every run.
    #[cfg_attr(feature = "ops-http", schema(value_type = Object))]
    pub input: Value,
    /// A cron expression (with `tz`), or none for a fixed interval.
    pub cron: Option<String>,
    /// The cron expression's time zone (IANA name).
    pub tz: Option<String>,
    /// The fixed interval in seconds, or none for a cron expression.
    pub every_secs: Option<i64>,
    /// `skip`, `buffer-one` or `allow`: what a tick does while the previous run is unfinished.
    pub overlap: String,
    /// How far back ticks missed while no scheduler ran are still started.
    pub catch_up_secs: i64,
    /// A paused schedule starts nothing.
    pub paused: bool,
    /// The next tick to fire.
    pub next_tick: DateTime<Utc>,
    /// A tick held back by `buffer-one` until the previous run ends.
    pub buffered_tick: Option<DateTime<Utc>>,
    /// The newest tick that started a run (its run is `<name>:<tick>`).
    pub last_tick: Option<DateTime<Utc>>,
    /// Runs started by ticks.
    pub started: i64,
    /// Ticks that started nothing (overlap or missed beyond the catch-up window).
    pub skipped: i64,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// `SELECT <columns> FROM trailmark.schedules` and what follows, as one static statement.
macro_rules! select {
    ($rest:literal) => {
        concat!(
            "SELECT name, workflow, input, cron, tz, every_secs, overlap, catch_up_secs, paused,
                    next_tick, buffered_tick, last_tick, started, skipped, created_at,
                    updated_at
               FROM trailmark.schedules ",
            $rest
        )
    };
}

/// A schedule to create.
pub struct NewSchedule<'a> {
    /// Name.
    pub name: &'a str,
    /// Workflow.
    pub workflow: &'a str,
    /// Input.
    pub input: &'a Value,
    /// Cron expression and time zone, or none.
    pub cron: Option<(&'a str, &'a str)>,
    /// Interval in seconds, or none.
    pub every_secs: Option<i64>,
    /// Overlap policy.
    pub overlap: &'a str,
    /// Catch-up window in seconds.
    pub catch_up_secs: i64,
    /// The first tick.
    pub next_tick: DateTime<Utc>,
}

/// Inserts the schedule unless one has the name; `false` when one does.
pub async fn insert(db: impl PgExecutor<'_>, s: &NewSchedule<'_>) -> Result<bool> {
    let done = sqlx::query(
        "INSERT INTO trailmark.schedules
             (name, workflow, input, cron, tz, every_secs, overlap, catch_up_secs, next_tick)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(s.name)
    .bind(s.workflow)
    .bind(s.input)
    .bind(s.cron.map(|c| c.0))
    .bind(s.cron.map(|c| c.1))
    .bind(s.every_secs)
    .bind(s.overlap)
    .bind(s.catch_up_secs)
    .bind(s.next_tick)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// One schedule; `FOR UPDATE` when `lock`.
pub async fn get(db: impl PgExecutor<'_>, name: &str, lock: bool) -> Result<Option<ScheduleRow>> {
    let sql = match lock {
        true => select!("WHERE name = $1 FOR UPDATE"),
        false => select!("WHERE name = $1"),
    };
    Ok(sqlx::query_as(sql)
    .bind(name)
    .fetch_optional(db)
    .await?)
}

/// Every schedule, by name.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<ScheduleRow>> {
    Ok(sqlx::query_as(select!("ORDER BY name"))
    .fetch_all(db)
    .await?)
}

/// Up to `limit` schedules with a tick due (or a buffered tick waiting), locked for this
/// transaction; rows another scheduler holds are skipped, not waited for.
pub async fn due(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<ScheduleRow>> {
    Ok(sqlx::query_as(select!(
        "WHERE NOT paused AND (next_tick <= now() OR buffered_tick IS NOT NULL)
          ORDER BY next_tick LIMIT $1 FOR UPDATE SKIP LOCKED"
    ))
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// Where a scan left a schedule.
pub struct Advanced<'a> {
    /// The schedule.
    pub name: &'a str,
    /// Its next tick.
    pub next_tick: DateTime<Utc>,
    /// A tick held back, if any.
    pub buffered_tick: Option<DateTime<Utc>>,
    /// The newest tick that started a run, if this scan started one.
    pub last_tick: Option<DateTime<Utc>>,
    /// Runs started by this scan.
    pub started: i64,
    /// Ticks this scan skipped.
    pub skipped: i64,
}

/// Records a scan's work on a schedule.
pub async fn advance(db: impl PgExecutor<'_>, a: &Advanced<'_>) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.schedules
            SET next_tick = $2, buffered_tick = $3,
                last_tick = COALESCE($4, last_tick),
                started = started + $5, skipped = skipped + $6, updated_at = now()
          WHERE name = $1",
    )
    .bind(a.name)
    .bind(a.next_tick)
    .bind(a.buffered_tick)
    .bind(a.last_tick)
    .bind(a.started)
    .bind(a.skipped)
    .execute(db)
    .await?;
    Ok(())
}

/// Pauses or resumes; a resumed schedule's next tick is `next_tick` (ticks while paused are
/// not made up). `false` when no schedule has the name.
pub async fn set_paused(
    db: impl PgExecutor<'_>,
    name: &str,
    paused: bool,
    next_tick: Option<DateTime<Utc>>,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE trailmark.schedules
            SET paused = $2, next_tick = COALESCE($3, next_tick), buffered_tick = NULL,
                updated_at = now()
          WHERE name = $1",
    )
    .bind(name)
    .bind(paused)
    .bind(next_tick)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Deletes the schedule (its runs stay); `false` when none has the name.
pub async fn delete(db: impl PgExecutor<'_>, name: &str) -> Result<bool> {
    let done = sqlx::query("DELETE FROM trailmark.schedules WHERE name = $1")
        .bind(name)
        .execute(db)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// The database's clock: ticks are judged by it, as leases are.
pub async fn now(db: impl PgExecutor<'_>) -> Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT now()").fetch_one(db).await?)
}

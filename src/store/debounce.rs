//! The `debounced_starts` table: starts of debounced workflows held until their key's burst
//! ends (`crate::flow::debounce` says what they mean). One row per start. A start of a key
//! takes the key's advisory lock, then the key's one `pending` row, which the timer loop locks
//! (`SKIP LOCKED`) when it makes the start a run.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::Result;

/// The hash a start's input is compared by, as SQL over a `jsonb` parameter: the tombstones'
/// (`store::retention`), so that both tell a repeat from a conflict the same way.
macro_rules! input_hash {
    ($param:literal) => {
        concat!(
            "encode(sha256(convert_to((",
            $param,
            "::jsonb)::text, 'UTF8')), 'hex')"
        )
    };
}

/// The class of the advisory locks of debounce keys (the lock's first key), apart from any
/// other advisory lock in the database (`store::waits` uses 0x7477).
const KEY_LOCK_CLASS: i32 = 0x6462;

/// Takes the transaction-scoped lock of a workflow's debounce key: the starts of one key are
/// recorded one transaction after the other, each seeing the one before (a row lock alone
/// would not do: a start that waited on the pending row finds it superseded and cannot see the
/// row that replaced it, which its statement's snapshot predates).
pub async fn lock_key(conn: &mut PgConnection, workflow: &str, key_value: &str) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2 || chr(31) || $3))")
        .bind(KEY_LOCK_CLASS)
        .bind(workflow)
        .bind(key_value)
        .execute(conn)
        .await?;
    Ok(())
}

/// A key's pending start, locked by the transaction that read it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Pending {
    /// The start's run id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// Its key's value.
    pub key_value: String,
    /// Its burst.
    pub burst: i64,
    /// The run-start event, word for word.
    pub event: Value,
    /// The starter's trace context.
    pub traceparent: Option<String>,
    /// Its number in the burst.
    pub nth: i32,
    /// When the burst's first start came.
    pub first_at: DateTime<Utc>,
    /// When it becomes a run.
    pub due_at: DateTime<Utc>,
    /// Whether that time has come (database clock).
    pub overdue: bool,
}

const PENDING_COLUMNS: &str = "run_id, workflow, key_value, burst, event, traceparent, nth, first_at, due_at, due_at <= now() AS overdue";

/// The pending start of `key_value` of `workflow`, locked until the transaction ends (the timer
/// loop skips it meanwhile; when the loop has it, this waits for the loop's commit and then
/// finds no pending start). Take [`lock_key`] first.
pub async fn lock_pending(
    conn: &mut PgConnection,
    workflow: &str,
    key_value: &str,
) -> Result<Option<Pending>> {
    let sql = format!(
        "SELECT {PENDING_COLUMNS} FROM trailmark.debounced_starts
          WHERE workflow = $1 AND key_value = $2 AND state = 'pending' FOR UPDATE"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(workflow)
        .bind(key_value)
        .fetch_optional(conn)
        .await?)
}

/// Up to `limit` pending starts of `workflows` whose time has come, earliest first, locked
/// (`SKIP LOCKED`: another process's scan, or a start of the same key, has the others).
pub async fn due(
    conn: &mut PgConnection,
    workflows: &[String],
    limit: i64,
) -> Result<Vec<Pending>> {
    let sql = format!(
        "SELECT {PENDING_COLUMNS} FROM trailmark.debounced_starts
          WHERE state = 'pending' AND due_at <= now() AND workflow = ANY($1)
          ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(workflows)
        .bind(limit)
        .fetch_all(conn)
        .await?)
}

/// A recorded start, as a later start of its id, `trailmark run show` and the API see it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct DebouncedStart {
    /// The start's run id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// The value of the workflow's debounce key in its input.
    pub key_value: String,
    /// `pending` (it becomes a run at `due_at` unless a later start of its key replaces it),
    /// `superseded` (a later start replaced it: it never runs), `started` (it is a run now),
    /// `refused` (it came due and could not be made a run; `note` says why).
    pub state: String,
    /// Its number in its burst (1 for the first start).
    pub nth: i32,
    /// When its burst's first start came.
    pub first_at: DateTime<Utc>,
    /// When it came.
    pub arrived_at: DateTime<Utc>,
    /// When it is (or was) due to become a run.
    pub due_at: DateTime<Utc>,
    /// When it was superseded, started or refused.
    pub ended_at: Option<DateTime<Utc>>,
    /// Why it was refused.
    pub note: Option<String>,
    /// For a superseded start: the last start of its burst, which runs in its place.
    pub superseded_by: Option<String>,
    /// That start's state.
    pub winner_state: Option<String>,
    /// When that start is (or was) due.
    pub winner_due_at: Option<DateTime<Utc>>,
    /// Whether the start it is compared with asks for the same workflow and input (a repeat).
    #[serde(skip)]
    pub same: bool,
}

/// The recorded start of `run_id`, with its burst's winner when it was superseded, compared
/// with a start of `asked` (workflow and input), if any.
pub async fn find(
    db: impl PgExecutor<'_>,
    run_id: &str,
    asked: Option<(&str, &Value)>,
) -> Result<Option<DebouncedStart>> {
    let (workflow, input) = asked.unzip();
    Ok(sqlx::query_as(concat!(
        "SELECT s.run_id, s.workflow, s.key_value, s.state, s.nth, s.first_at, s.arrived_at,
                s.due_at, s.ended_at, s.note,
                w.run_id AS superseded_by, w.state AS winner_state, w.due_at AS winner_due_at,
                (s.workflow = $2 AND s.input_hash = ",
        input_hash!("$3"),
        ") IS TRUE AS same
           FROM trailmark.debounced_starts s
           LEFT JOIN LATERAL (
                SELECT o.run_id, o.state, o.due_at FROM trailmark.debounced_starts o
                 WHERE s.state = 'superseded' AND o.burst = s.burst AND o.state <> 'superseded'
                 LIMIT 1) w ON true
          WHERE s.run_id = $1"
    ))
    .bind(run_id)
    .bind(workflow)
    .bind(input)
    .fetch_optional(db)
    .await?)
}

/// A start to record as its key's pending one.
#[derive(Debug)]
pub struct NewStart<'a> {
    /// Its run id.
    pub run_id: &'a str,
    /// Its workflow.
    pub workflow: &'a str,
    /// Its key's value.
    pub key_value: &'a str,
    /// The run-start event, word for word.
    pub event: &'a Value,
    /// Its input (hashed).
    pub input: &'a Value,
    /// The starter's trace context.
    pub traceparent: Option<&'a str>,
    /// The debounce window (seconds).
    pub window_secs: f64,
    /// The longest a burst is held from its first start (seconds).
    pub cap_secs: f64,
}

/// Records `start` as its key's pending start: the first of a new burst, or the next of the
/// burst of `after` (the key's pending start, which the caller has superseded in this
/// transaction): due a window after now, but never earlier than `after` was due nor later than
/// the cap after the burst's first start. `None` when it was not recorded: a start of its run id
/// (with another key) was recorded meanwhile.
pub async fn insert(
    conn: &mut PgConnection,
    start: &NewStart<'_>,
    after: Option<&Pending>,
) -> Result<Option<DebouncedStart>> {
    Ok(sqlx::query_as(concat!(
        "INSERT INTO trailmark.debounced_starts
                (run_id, workflow, key_value, burst, state, event, input_hash, traceparent, nth,
                 first_at, due_at)
         VALUES ($1, $2, $3, COALESCE($8, nextval('trailmark.debounce_bursts')), 'pending', $4, ",
        input_hash!("$5"),
        ", $6, COALESCE($9, 0) + 1, COALESCE($10, now()),
                 GREATEST($11, LEAST(now() + make_interval(secs => $7),
                                     COALESCE($10, now()) + make_interval(secs => $12))))
         ON CONFLICT DO NOTHING
         RETURNING run_id, workflow, key_value, state, nth, first_at, arrived_at, due_at, ended_at,
                   note, NULL::text AS superseded_by, NULL::text AS winner_state,
                   NULL::timestamptz AS winner_due_at, true AS same"
    ))
    .bind(start.run_id)
    .bind(start.workflow)
    .bind(start.key_value)
    .bind(start.event)
    .bind(start.input)
    .bind(start.traceparent)
    .bind(start.window_secs)
    .bind(after.map(|p| p.burst))
    .bind(after.map(|p| p.nth))
    .bind(after.map(|p| p.first_at))
    .bind(after.map(|p| p.due_at))
    .bind(start.cap_secs)
    .fetch_optional(conn)
    .await?)
}

/// What became of a start that ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A later start of its key replaced it.
    Superseded,
    /// It is a run now.
    Started,
    /// It came due and could not be made a run.
    Refused,
}

impl Ended {
    fn as_str(self) -> &'static str {
        match self {
            Ended::Superseded => "superseded",
            Ended::Started => "started",
            Ended::Refused => "refused",
        }
    }
}

/// Ends the pending start `run_id` as `how` (with why, when refused), dropping its event.
pub async fn end(
    conn: &mut PgConnection,
    run_id: &str,
    how: Ended,
    note: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.debounced_starts SET state = $2, note = $3, event = NULL, ended_at = now()
          WHERE run_id = $1 AND state = 'pending'",
    )
    .bind(run_id)
    .bind(how.as_str())
    .bind(note)
    .execute(conn)
    .await?;
    Ok(())
}

/// Pending starts by workflow (those with none are left out).
pub async fn pending_counts(db: impl PgExecutor<'_>) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT workflow, count(*) FROM trailmark.debounced_starts
          WHERE state = 'pending' GROUP BY workflow",
    )
    .fetch_all(db)
    .await?)
}

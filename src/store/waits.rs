//! The `waits` table (what a waiting run waits for) and the `signals` table (events sent to
//! runs), and the statements that move a waiting run on.
//!
//! Every statement that finds a waiting run locks its `runs` row (`FOR UPDATE OF r`) and checks
//! that the run still waits at the wait's position: whoever closes a wait (an event, the timer
//! loop, an operator's decision) holds the run's row while it does, so two of them can never
//! both move one run on. The event's side and the wait's side of the same (name, key) pair are
//! serialised by [`lock_pair`] (see `docs/ARCHITECTURE.md`, "Waits").

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::domain::{Due, InboundEvent, NewWait, StepAddress, Transition, WaitFor};

/// The class of the advisory locks of (name, key) pairs (the lock's first key), apart from any
/// other advisory lock in the database.
const PAIR_LOCK_CLASS: i32 = 0x7477;

/// Takes the transaction-scoped lock of an event's (name, key) pair. The transaction that
/// registers a wait and the one that records an arriving event both take it before they look
/// for each other, so whichever comes second sees the first one's commit.
pub async fn lock_pair(conn: &mut PgConnection, name: &str, key: &str) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2 || chr(31) || $3))")
        .bind(PAIR_LOCK_CLASS)
        .bind(name)
        .bind(key)
        .execute(conn)
        .await?;
    Ok(())
}

/// Registers the wait of the step at `seq` (in the transaction of that step's commit); returns
/// when it is due (database clock).
pub async fn insert(
    conn: &mut PgConnection,
    (run_id, seq, step): (&str, i32, &StepAddress),
    wait: &NewWait,
) -> Result<DateTime<Utc>> {
    let (after, at) = match wait.due() {
        Due::In(secs) => (Some(secs), None),
        Due::At(time) => (None, Some(time)),
    };
    let (kind, name, key, on_timeout) = match &wait.what {
        WaitFor::Event {
            name,
            key,
            on_timeout,
            ..
        } => ("event", Some(name), Some(key), on_timeout.as_ref()),
        WaitFor::Sleep(_) => ("sleep", None, None, None),
        WaitFor::Children(_) | WaitFor::UndoneChildren(_) => ("children", None, None, None),
    };
    Ok(sqlx::query_scalar(
        "INSERT INTO trailmark.waits (run_id, seq, step, kind, event_name, match_key, next_step,
                                      on_timeout, due_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8,
                 COALESCE($10, now() + make_interval(secs => $9::float8)))
         RETURNING due_at",
    )
    .bind(run_id)
    .bind(seq)
    .bind(step)
    .bind(kind)
    .bind(name)
    .bind(key)
    .bind(&wait.next_step)
    .bind(on_timeout)
    .bind(after)
    .bind(at)
    .fetch_one(conn)
    .await?)
}

/// Opens again the closed wait of `run_id` at `seq` (a fan-out step that runs again after its
/// parent was resumed); `false` when there is none.
pub async fn reopen(conn: &mut PgConnection, run_id: &str, seq: i32) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE trailmark.waits SET resolved_at = NULL, resolution = NULL, signal_id = NULL,
                since = now()
          WHERE run_id = $1 AND seq = $2 AND kind = 'children'",
    )
    .bind(run_id)
    .bind(seq)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A waiting run, found by its wait and locked for the caller's transaction.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Waiting {
    /// The run.
    pub run_id: String,
    /// The position of the step that waits.
    pub seq: i32,
    /// That step.
    pub step: StepAddress,
    /// `event` or `sleep`.
    pub kind: String,
    /// An event wait's event name.
    pub event_name: Option<String>,
    /// And its match key.
    pub match_key: Option<String>,
    /// Where the run goes on.
    pub next_step: StepAddress,
    /// Where an event wait goes on timeout (`None`: needs_review).
    pub on_timeout: Option<StepAddress>,
    /// Waiting since.
    pub since: DateTime<Utc>,
    /// Due (wake-up or deadline).
    pub due_at: DateTime<Utc>,
    /// The run's workflow.
    pub workflow: String,
    /// And its version.
    pub workflow_version: i32,
    /// Whether the run is a shadow fork.
    pub shadow: bool,
    /// Seconds since it was due (negative before).
    pub late_secs: f64,
    /// The run whose step started it, for a child run (its stop for review is counted there).
    pub parent_run_id: Option<String>,
}

const WAITING: &str = "SELECT w.run_id, w.seq, w.step, w.kind, w.event_name, w.match_key, w.next_step,
        w.on_timeout, w.since, w.due_at, r.workflow, r.workflow_version, r.shadow,
        r.parent_run_id, EXTRACT(EPOCH FROM now() - w.due_at)::float8 AS late_secs
   FROM trailmark.waits w JOIN trailmark.runs r ON r.run_id = w.run_id
  WHERE w.resolved_at IS NULL AND r.status = 'waiting' AND r.step_seq = w.seq";

/// The runs that wait for the event `name` with `key`, oldest wait first, their rows locked.
pub async fn waiting_for(conn: &mut PgConnection, name: &str, key: &str) -> Result<Vec<Waiting>> {
    let sql = format!(
        "{WAITING} AND w.kind = 'event' AND w.event_name = $1 AND w.match_key = $2
          ORDER BY w.since, w.run_id FOR UPDATE OF r"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(name)
        .bind(key)
        .fetch_all(conn)
        .await?)
}

/// The wait of `run_id` at `seq`, if the run still waits there, its row locked.
pub async fn waiting_at(conn: &mut PgConnection, run_id: &str, seq: i32) -> Result<Option<Waiting>> {
    let sql = format!("{WAITING} AND w.run_id = $1 AND w.seq = $2 FOR UPDATE OF r");
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(seq)
        .fetch_optional(conn)
        .await?)
}

/// Up to `limit` waits that are due (a sleep's wake-up, an event wait's deadline), earliest
/// first, their runs locked; runs another scanner holds are skipped, so two timer loops never
/// move one run on twice. The earliest are picked through the due index first, then joined by
/// key: ordering the join instead sorted every due wait on each round (10,000 due at once: 34 ms
/// a round), and a join the planner may turn into a scan of `runs` costs as much on every poll.
pub async fn due(conn: &mut PgConnection, limit: i64) -> Result<Vec<Waiting>> {
    let earliest: Vec<(String, i32)> = sqlx::query_as(
        "SELECT run_id, seq FROM trailmark.waits
          WHERE resolved_at IS NULL AND due_at <= now() ORDER BY due_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    if earliest.is_empty() {
        return Ok(Vec::new());
    }
    let (runs, seqs): (Vec<String>, Vec<i32>) = earliest.into_iter().unzip();
    let sql = format!(
        "{WAITING} AND (w.run_id, w.seq) IN (SELECT * FROM UNNEST($1::text[], $2::int4[]))
          ORDER BY w.due_at FOR UPDATE OF r SKIP LOCKED"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(runs)
        .bind(seqs)
        .fetch_all(conn)
        .await?)
}

/// Closes due waits whose run no longer waits at their position, and returns them (run,
/// position). Every move of a waiting run closes its wait in the same transaction, so this
/// should find none; left open, one would stay among the earliest due waits that the timer loop
/// reads on every round. Cheap when there are none: it reads the due waits through their
/// partial index, and writes nothing.
pub async fn close_orphans(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<(String, i32)>> {
    Ok(sqlx::query_as(
        "UPDATE trailmark.waits w SET resolved_at = now(), resolution = 'decision'
           FROM (SELECT o.run_id, o.seq FROM trailmark.waits o
                  WHERE o.resolved_at IS NULL AND o.due_at <= now()
                    AND NOT EXISTS (SELECT 1 FROM trailmark.runs r WHERE r.run_id = o.run_id
                                       AND r.status = 'waiting' AND r.step_seq = o.seq)
                  LIMIT $1 FOR UPDATE SKIP LOCKED) x
          WHERE w.run_id = x.run_id AND w.seq = x.seq
      RETURNING w.run_id, w.seq",
    )
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// How a waiting run goes on, for [`move_on`].
#[derive(Debug, Clone)]
pub struct Move<'a> {
    /// The run.
    pub run_id: &'a str,
    /// The position of the step that waited.
    pub seq: i32,
    /// `event`, `timeout` or `woke`.
    pub resolution: &'static str,
    /// The event that resumed it.
    pub signal_id: Option<&'a str>,
    /// The status move (from waiting).
    pub status: Transition,
    /// The step it goes on with, at position `seq + 1`.
    pub step: &'a StepAddress,
    /// The run's error, when it stops for review.
    pub error: Option<String>,
    /// Its handover note, when it stops for review.
    pub handover: Option<Value>,
}

/// Closes the waits of `moves` and moves their runs on to position `seq + 1` (fence + 1, no
/// lease), only where the run still waits at `seq`; returns the runs moved. The caller queues
/// their step messages in the same transaction.
pub async fn move_on(conn: &mut PgConnection, moves: &[Move<'_>]) -> Result<Vec<String>> {
    if moves.is_empty() {
        return Ok(Vec::new());
    }
    let col = |f: for<'m> fn(&'m Move<'_>) -> Option<&'m str>| {
        moves.iter().map(f).collect::<Vec<_>>()
    };
    Ok(sqlx::query_scalar(
        "WITH m AS (
            SELECT * FROM UNNEST($1::text[], $2::int4[], $3::text[], $4::text[], $5::text[],
                                 $6::text[], $7::text[], $8::jsonb[])
              AS m(run_id, seq, resolution, signal_id, status, step, error, handover)
         ), closed AS (
            UPDATE trailmark.waits w SET resolved_at = now(), resolution = m.resolution,
                                         signal_id = m.signal_id
              FROM m WHERE w.run_id = m.run_id AND w.seq = m.seq AND w.resolved_at IS NULL
            RETURNING w.run_id, w.seq
         )
         UPDATE trailmark.runs r
            SET status = m.status, step = m.step, step_seq = m.seq + 1, fence = r.fence + 1,
                lease_owner = NULL, lease_expires_at = NULL, lease_pid = NULL,
                error = m.error, handover = m.handover, updated_at = now()
           FROM m JOIN closed c ON c.run_id = m.run_id AND c.seq = m.seq
          WHERE r.run_id = m.run_id AND r.status = 'waiting' AND r.step_seq = m.seq
         RETURNING r.run_id",
    )
    .bind(col(|m| Some(m.run_id)))
    .bind(moves.iter().map(|m| m.seq).collect::<Vec<_>>())
    .bind(col(|m| Some(m.resolution)))
    .bind(col(|m| m.signal_id))
    .bind(moves.iter().map(|m| m.status.to).collect::<Vec<_>>())
    .bind(col(|m| Some(m.step.as_str())))
    .bind(moves.iter().map(|m| m.error.as_deref()).collect::<Vec<_>>())
    .bind(moves.iter().map(|m| m.handover.as_ref()).collect::<Vec<_>>())
    .fetch_all(conn)
    .await?)
}

/// What the store knew of an event's id when the event arrived.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// A new event, recorded; kept for a wait until `expires_at` if none takes it now.
    New {
        /// When it stops waiting for a wait (database clock).
        expires_at: DateTime<Utc>,
    },
    /// The same event was received before (same name, key and payload).
    Repeat(SignalRow),
    /// The id was received before with another name, key or payload.
    Reused(SignalRow),
}

/// Records an arriving event, unless its id is known; `keep_secs`: how long it waits for a
/// wait to take it, `retention_secs`: how long after that it stays in sight if none does.
pub async fn receive(
    conn: &mut PgConnection,
    event: &InboundEvent,
    via: &str,
    (keep_secs, retention_secs): (u64, u64),
) -> Result<Received> {
    let new: Option<DateTime<Utc>> = sqlx::query_scalar(
        "INSERT INTO trailmark.signals (signal_id, name, match_key, payload, payload_hash, via,
                                        expires_at, forget_at)
         VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7::float8),
                 now() + make_interval(secs => $7::float8 + $8::float8))
         ON CONFLICT (signal_id) DO NOTHING
         RETURNING expires_at",
    )
    .bind(&event.id)
    .bind(&event.name)
    .bind(&event.key)
    .bind(&event.payload)
    .bind(event.payload_hash())
    .bind(via)
    .bind(keep_secs as f64)
    .bind(retention_secs as f64)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(expires_at) = new {
        return Ok(Received::New { expires_at });
    }
    let stored = signal(&mut *conn, &event.id).await?.ok_or_else(|| {
        super::Error::unavailable(
            format!("event {} was recorded and removed at the same moment", event.id),
            sqlx::Error::RowNotFound,
        )
    })?;
    let same = stored.name == event.name
        && stored.key == event.key
        && stored.payload_hash == event.payload_hash();
    Ok(if same {
        Received::Repeat(stored)
    } else {
        Received::Reused(stored)
    })
}

/// Marks an event consumed by the `resumed` runs it moved on.
pub async fn consumed(db: impl PgExecutor<'_>, signal_id: &str, resumed: i32) -> Result<()> {
    sqlx::query(
        "UPDATE trailmark.signals SET consumed_at = now(), resumed = resumed + $2 WHERE signal_id = $1",
    )
    .bind(signal_id)
    .bind(resumed)
    .execute(db)
    .await?;
    Ok(())
}

/// Takes the oldest pending event of `name` and `key` for a wait that has just come: marks it
/// consumed (by one run) and returns its id.
pub async fn take_pending(conn: &mut PgConnection, name: &str, key: &str) -> Result<Option<String>> {
    Ok(sqlx::query_scalar(
        "UPDATE trailmark.signals SET consumed_at = now(), resumed = resumed + 1
          WHERE signal_id = (SELECT signal_id FROM trailmark.signals
                              WHERE name = $1 AND match_key = $2 AND consumed_at IS NULL
                                AND expired_at IS NULL AND expires_at > now()
                              ORDER BY received_at, signal_id LIMIT 1 FOR UPDATE)
         RETURNING signal_id",
    )
    .bind(name)
    .bind(key)
    .fetch_optional(conn)
    .await?)
}

/// An event as stored.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct SignalRow {
    /// Its id.
    pub signal_id: String,
    /// Its name.
    pub name: String,
    /// Its match key.
    #[sqlx(rename = "match_key")]
    pub key: String,
    /// Its payload.
    #[cfg_attr(feature = "ops-http", schema(value_type = Object))]
    pub payload: Value,
    /// The payload's hash.
    pub payload_hash: String,
    /// Through which face it came (`api`, `cli`, `amqp`, `embedded`).
    pub via: String,
    /// When it came.
    pub received_at: DateTime<Utc>,
    /// Until when a wait may take it.
    pub expires_at: DateTime<Utc>,
    /// When a wait took it (or it resumed the runs waiting for it).
    pub consumed_at: Option<DateTime<Utc>>,
    /// How many runs it resumed.
    pub resumed: i32,
    /// When it expired without a wait taking it.
    pub expired_at: Option<DateTime<Utc>>,
}

impl SignalRow {
    /// `pending`, `consumed` or `expired`.
    pub fn state(&self) -> &'static str {
        match (self.consumed_at, self.expired_at) {
            (Some(_), _) => "consumed",
            (None, Some(_)) => "expired",
            (None, None) => "pending",
        }
    }
}

const SIGNAL: &str = "SELECT signal_id, name, match_key, payload, payload_hash, via, received_at,
        expires_at, consumed_at, resumed, expired_at FROM trailmark.signals";

/// One event by id.
pub async fn signal(db: impl PgExecutor<'_>, signal_id: &str) -> Result<Option<SignalRow>> {
    let sql = format!("{SIGNAL} WHERE signal_id = $1");
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(signal_id)
        .fetch_optional(db)
        .await?)
}

/// Which events a listing shows.
#[derive(Debug, Clone, Default)]
pub struct SignalFilter {
    /// Only `pending`, `consumed` or `expired` ones.
    pub state: Option<String>,
    /// Only events of this name.
    pub name: Option<String>,
    /// Only events with this key.
    pub key: Option<String>,
}

/// Events, newest first.
pub async fn signals(
    db: impl PgExecutor<'_>,
    f: &SignalFilter,
    limit: i64,
) -> Result<Vec<SignalRow>> {
    let sql = format!(
        "{SIGNAL} WHERE ($1::text IS NULL OR name = $1) AND ($2::text IS NULL OR match_key = $2)
            AND ($3::text IS NULL
                 OR ($3 = 'consumed' AND consumed_at IS NOT NULL)
                 OR ($3 = 'expired' AND consumed_at IS NULL AND expired_at IS NOT NULL)
                 OR ($3 = 'pending' AND consumed_at IS NULL AND expired_at IS NULL))
          ORDER BY received_at DESC, signal_id LIMIT $4"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(f.name.as_deref())
        .bind(f.key.as_deref())
        .bind(f.state.as_deref())
        .bind(limit)
        .fetch_all(db)
        .await?)
}

/// An event no wait took before it expired.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Expired {
    /// Its id.
    pub signal_id: String,
    /// Its name.
    pub name: String,
    /// Its match key.
    pub match_key: String,
    /// When it came.
    pub received_at: DateTime<Utc>,
}

/// Marks up to `limit` pending events past their time as expired, and returns them (to be
/// logged: an event for nobody is never dropped silently).
pub async fn expire(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<Expired>> {
    Ok(sqlx::query_as(
        "UPDATE trailmark.signals s SET expired_at = now()
           FROM (SELECT signal_id FROM trailmark.signals
                  WHERE consumed_at IS NULL AND expired_at IS NULL AND expires_at <= now()
                  ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) x
          WHERE s.signal_id = x.signal_id
      RETURNING s.signal_id, s.name, s.match_key, s.received_at",
    )
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// Removes up to `limit` expired events past their time in sight; consumed events stay with the
/// runs they resumed.
pub async fn prune(db: impl PgExecutor<'_>, limit: i64) -> Result<u64> {
    let done = sqlx::query(
        "DELETE FROM trailmark.signals WHERE signal_id IN (
            SELECT signal_id FROM trailmark.signals
             WHERE consumed_at IS NULL AND forget_at <= now() AND expired_at IS NOT NULL
             LIMIT $1 FOR UPDATE SKIP LOCKED)",
    )
    .bind(limit)
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}

/// The event that resumed `run_id` after its wait at `seq`: id, name, key, payload, received.
/// A fork took the positions before its fork point over from its parent, and with them the
/// parent's waits there: the step after such a wait reads the event the parent received.
pub async fn received_event(
    db: impl PgExecutor<'_>,
    run_id: &str,
    seq: i32,
) -> Result<Option<(String, String, String, Value, DateTime<Utc>)>> {
    Ok(sqlx::query_as(
        "WITH RECURSIVE owner(run_id, depth) AS (
            SELECT $1::text, 0
            UNION ALL
            SELECT f.parent_run_id, o.depth + 1 FROM owner o
              JOIN trailmark.forks f ON f.run_id = o.run_id
             WHERE $2 < f.from_seq AND o.depth < 64
         )
         SELECT s.signal_id, s.name, s.match_key, s.payload, s.received_at
           FROM owner o
           JOIN trailmark.waits w ON w.run_id = o.run_id AND w.seq = $2 AND w.resolution = 'event'
           JOIN trailmark.signals s ON s.signal_id = w.signal_id
          ORDER BY o.depth LIMIT 1",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_optional(db)
    .await?)
}

/// A wait as a run's views show it, with the event that ended it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct WaitRow {
    /// The position of the step that waited.
    pub seq: i32,
    /// That step.
    pub step: String,
    /// `event` or `sleep`.
    pub kind: String,
    /// The event waited for.
    pub event_name: Option<String>,
    /// Its match key.
    pub match_key: Option<String>,
    /// Where the run goes on.
    pub next_step: String,
    /// Where an event wait goes on timeout (`None`: needs_review).
    pub on_timeout: Option<String>,
    /// Since when.
    pub since: DateTime<Utc>,
    /// Until when (a sleep's wake-up, an event wait's deadline).
    pub until: DateTime<Utc>,
    /// When it ended (`None`: the run waits now).
    pub resolved_at: Option<DateTime<Utc>>,
    /// How: `event`, `timeout`, `woke` or `decision`.
    pub resolution: Option<String>,
    /// The event received, if one ended it.
    pub event_id: Option<String>,
    /// Its payload.
    #[cfg_attr(feature = "ops-http", schema(value_type = Option<Object>))]
    pub payload: Option<Value>,
    /// When it was received.
    pub received_at: Option<DateTime<Utc>>,
}

/// The waits of a run, oldest first (at most the last 100).
pub async fn for_run(db: impl PgExecutor<'_>, run_id: &str) -> Result<Vec<WaitRow>> {
    Ok(sqlx::query_as(
        "SELECT * FROM (
            SELECT w.seq, w.step, w.kind, w.event_name, w.match_key, w.next_step, w.on_timeout,
                   w.since, w.due_at AS until, w.resolved_at, w.resolution,
                   w.signal_id AS event_id, s.payload, s.received_at
              FROM trailmark.waits w LEFT JOIN trailmark.signals s ON s.signal_id = w.signal_id
             WHERE w.run_id = $1 ORDER BY w.seq DESC LIMIT 100) last
          ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(db)
    .await?)
}

/// Open waits by kind (`event`, `sleep`), for the gauges.
pub async fn open_counts(db: impl PgExecutor<'_>) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT kind, count(*) FROM trailmark.waits WHERE resolved_at IS NULL GROUP BY kind",
    )
    .fetch_all(db)
    .await?)
}

//! Worker processes that stopped showing life while their connections stay open (SIGSTOP, a
//! frozen VM, a stalled host, a network cut without a reset), and the runs such a process may
//! hold back: see `worker::sweep`.
//!
//! A dead process closes its sockets, so Postgres ends its presence backend at once
//! (`trailmark.process_gone`) and RabbitMQ hands its unacknowledged messages to others. A
//! frozen one keeps both: its presence connection stays open but stops running the query it
//! runs every `worker.heartbeat_secs`, which Postgres shows as an idle backend whose state has
//! not changed for that long.

use sqlx::PgExecutor;

use super::Result;
use super::runs::ExpiredLease;
use crate::domain::RunStatus;

/// The `application_name` of every presence connection starts with this; the worker id follows
/// (the SQL function `trailmark.presence_alive` spells it too).
pub const PRESENCE_APPLICATION: &str = "trailmark presence ";

/// A worker process whose presence connection has been silent too long.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Silent {
    /// Its presence backend's pid.
    pub pid: i32,
    /// Its presence connection's `application_name` (which names the worker).
    pub name: String,
    /// How long it has been silent, seconds (database clock).
    pub silent_secs: f64,
}

/// The presence beat: a query, so that Postgres records the moment (`state_change`).
pub async fn beat(db: impl PgExecutor<'_>) -> Result<()> {
    sqlx::query("SELECT 1").execute(db).await?;
    Ok(())
}

/// Worker processes of this database whose presence connection is open but has run nothing for
/// more than `secs` (the asker's own, `own_pid`, left out). Only sessions this role may see are
/// seen: those of the same role, or all with `pg_read_all_stats`.
pub async fn silent_workers(
    db: impl PgExecutor<'_>,
    secs: f64,
    own_pid: Option<i32>,
) -> Result<Vec<Silent>> {
    Ok(sqlx::query_as(
        "SELECT pid, application_name AS name,
                EXTRACT(EPOCH FROM now() - state_change)::float8 AS silent_secs
           FROM pg_stat_activity
          WHERE datname = current_database() AND starts_with(application_name, $1)
            AND state = 'idle' AND state_change < now() - make_interval(secs => $2)
            AND pid IS DISTINCT FROM $3
          ORDER BY pid",
    )
    .bind(PRESENCE_APPLICATION)
    .bind(secs)
    .bind(own_pid)
    .fetch_all(db)
    .await?)
}

/// Marks as re-queued (their `updated_at` set to now) and returns up to `limit` executing runs
/// that have not moved for `secs` while nothing is known to be working on them: their lease is
/// free or an idle pre-claim (an expired lease is the supervisor's), no retry of their step is
/// waiting for its time, and no message of theirs waits in the outbox for a relay (one left
/// there a lease after it became available is held: by a frozen relay's lock, or by the broker's
/// refusals), and it does not wait for a slot of its concurrency key (`flow::gate`). Their step message is then in a queue, in a delay queue, held unacknowledged by a
/// consumer that does not run, or in the outbox beyond reach;
/// the caller queues a copy of it in the same transaction. Only runs of a workflow in
/// `deployed` (names and versions, as [`crate::workflow::Registry::deployed`]) at that version
/// or older are taken: a copy the caller cannot run would only wait (a newer version) or be
/// dead-lettered (an unknown workflow) beside the original, and a run marked but not re-queued
/// would be skipped by every sweeper for `secs`. Rows other sweepers hold are skipped, and a run
/// marked here waits `secs` again before it can be marked again.
pub async fn take_stranded(
    db: impl PgExecutor<'_>,
    secs: f64,
    limit: i64,
    deployed: &(Vec<String>, Vec<i32>),
) -> Result<Vec<ExpiredLease>> {
    Ok(sqlx::query_as(
        "UPDATE trailmark.runs r SET updated_at = now()
           FROM (SELECT u.run_id FROM trailmark.runs u
                  WHERE u.status = ANY($1::text[]) AND u.step IS NOT NULL
                    AND u.updated_at < now() - make_interval(secs => $2)
                    AND (u.lease_owner IS NULL OR u.lease_expires_at IS NULL)
                    AND EXISTS (SELECT 1 FROM unnest($4::text[], $5::int[]) AS d(name, version)
                                 WHERE d.name = u.workflow AND d.version >= u.workflow_version)
                    AND NOT EXISTS (SELECT 1 FROM trailmark.steps s
                                     WHERE s.run_id = u.run_id AND s.seq = u.step_seq
                                       AND s.retry_at > now())
                    AND NOT EXISTS (SELECT 1 FROM trailmark.flow_waiters w
                                     WHERE w.run_id = u.run_id AND w.seq = u.step_seq)
                    AND NOT EXISTS (SELECT 1 FROM trailmark.outbox o
                                     WHERE o.published_at IS NULL
                                       AND o.headers->>'x-trailmark-run-id' = u.run_id
                                       AND o.available_at > now() - make_interval(secs => $2))
                  ORDER BY u.updated_at LIMIT $3 FOR UPDATE OF u SKIP LOCKED) s
          WHERE r.run_id = s.run_id
      RETURNING r.run_id, r.workflow, r.workflow_version, r.step, r.step_seq, r.traceparent",
    )
    .bind(&RunStatus::EXECUTING[..])
    .bind(secs)
    .bind(limit)
    .bind(&deployed.0)
    .bind(&deployed.1)
    .fetch_all(db)
    .await?)
}

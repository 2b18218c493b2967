//! Retention's SQL: which finished runs are due for removal, their export, their removal with
//! every row that belongs to them (leaving a tombstone), and the age-based pruning of
//! tombstones, inbox ids and audit rows. Each call is one statement; the pruner
//! (`crate::retention`) puts a batch's statements in one transaction.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::Result;

/// The statuses a run never leaves without a person: the only ones removed.
macro_rules! finished {
    () => {
        "('succeeded', 'failed', 'compensated', 'cancelled', 'shadowed')"
    };
}

/// The statement of [`due`] for one workflow condition (on `$1`; `$2` the keep time, `$3` the
/// batch).
macro_rules! due_sql {
    ($workflow:literal) => {
        concat!(
            "SELECT r.run_id, r.workflow, r.status, r.finished_at
               FROM trailmark.runs r
              WHERE r.status IN ",
            finished!(),
            " AND r.finished_at < now() - make_interval(secs => $2) AND ",
            $workflow,
            " AND NOT EXISTS (
                    SELECT 1 FROM trailmark.forks f JOIN trailmark.runs c ON c.run_id = f.run_id
                     WHERE f.parent_run_id = r.run_id AND c.status NOT IN ",
            finished!(),
            ")
                AND NOT EXISTS (
                    SELECT 1 FROM trailmark.runs c
                     WHERE c.parent_run_id = r.run_id AND c.status NOT IN ",
            finished!(),
            ")
                AND (r.parent_run_id IS NULL OR NOT EXISTS (
                    SELECT 1 FROM trailmark.runs p WHERE p.run_id = r.parent_run_id))
              ORDER BY r.finished_at
              LIMIT $3
              FOR UPDATE OF r SKIP LOCKED"
        )
    };
}

/// A run due for removal.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Due {
    /// Its id.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// How it ended.
    pub status: String,
    /// When.
    pub finished_at: DateTime<Utc>,
}

/// Which runs a keep time applies to.
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    /// The runs of one workflow.
    Workflow(&'a str),
    /// The runs of every workflow not in the list (the default keep time's).
    Others(&'a [String]),
}

/// Takes the pruner's turn for this transaction: `false` when another process prunes now, so
/// two pruners never archive or count the same runs.
pub async fn take_turn(tx: &mut PgConnection) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext('trailmark.retention'))")
            .fetch_one(tx)
            .await?,
    )
}

/// Up to `limit` runs in `scope` that finished more than `keep_secs` ago, oldest first, locked
/// (`SKIP LOCKED`: a run an operator is forking now waits for the next batch). A run with a
/// fork or a child run that has not finished stays (the fork reads its parent's positions, a
/// child's ending counts in its parent's join), and a child run stays as long as its parent
/// (an undo of the parent undoes its children, and its next step read them).
///
/// One statement per kind of scope, each with its workflow condition written out: with one
/// `CASE` on a bound parameter for both, the generic plan could use neither index as a range
/// and read every finished run's index entry on each pass (3,835 buffers, 20-30 ms at 1,000,000
/// finished runs with none due; docs/BENCHMARKS.md, "Periodic queries at 100 and 100,000 runs in
/// flight").
pub async fn due(
    tx: &mut PgConnection,
    scope: Scope<'_>,
    keep_secs: i64,
    limit: i64,
) -> Result<Vec<Due>> {
    let query = match scope {
        // `runs_finished_idx` (workflow, finished_at): the workflow's oldest.
        Scope::Workflow(w) => sqlx::query_as(due_sql!("r.workflow = $1")).bind(w),
        // `runs_finished_at_idx` (finished_at): the oldest of all, skipping the named workflows.
        Scope::Others(list) => sqlx::query_as(due_sql!("r.workflow <> ALL($1)")).bind(list),
    };
    Ok(query
        .bind(keep_secs as f64)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?)
}

/// Each run's whole record as one JSON document (`docs/OPERATIONS.md`, "Run export"): the run
/// row and, per table, its rows in order, with every column. Runs that do not exist are left
/// out.
pub async fn export(db: impl PgExecutor<'_>, run_ids: &[String]) -> Result<Vec<(String, Value)>> {
    Ok(sqlx::query_as(
        "SELECT r.run_id, jsonb_build_object(
            'format', 'trailmark.run.v1',
            'exported_at', now(),
            'run', to_jsonb(r),
            'steps', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.seq), '[]')
                        FROM trailmark.steps x WHERE x.run_id = r.run_id),
            'journal', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.seq, x.call_no), '[]')
                          FROM trailmark.journal x WHERE x.run_id = r.run_id),
            'journal_set_aside', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.set_aside_at, x.seq, x.call_no), '[]')
                                    FROM trailmark.journal_set_aside x WHERE x.run_id = r.run_id),
            'effects', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.seq, x.created_at), '[]')
                          FROM trailmark.effects x WHERE x.run_id = r.run_id),
            'decisions', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.id), '[]')
                            FROM trailmark.decisions x WHERE x.run_id = r.run_id),
            'parked', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.created_at), '[]')
                         FROM trailmark.parked x WHERE x.run_id = r.run_id),
            'progress', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.id), '[]')
                           FROM trailmark.progress x WHERE x.run_id = r.run_id),
            'waits', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.seq), '[]')
                        FROM trailmark.waits x WHERE x.run_id = r.run_id),
            'events', (SELECT coalesce(jsonb_agg(to_jsonb(s) ORDER BY s.received_at), '[]')
                         FROM trailmark.signals s
                        WHERE s.signal_id IN (SELECT w.signal_id FROM trailmark.waits w WHERE w.run_id = r.run_id)),
            'shadow_writes', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.seq, x.created_at), '[]')
                                FROM trailmark.shadow_writes x WHERE x.run_id = r.run_id),
            'forked_from', (SELECT to_jsonb(x) - 'run_id' FROM trailmark.forks x WHERE x.run_id = r.run_id),
            'fan_outs', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'run_id' ORDER BY x.seq), '[]')
                           FROM trailmark.fan_outs x WHERE x.run_id = r.run_id),
            'children', (SELECT coalesce(jsonb_agg(to_jsonb(x) - 'parent_run_id' ORDER BY x.seq, x.idx), '[]')
                           FROM trailmark.children x WHERE x.parent_run_id = r.run_id))
           FROM trailmark.runs r
          WHERE r.run_id = ANY($1)",
    )
    .bind(run_ids)
    .fetch_all(db)
    .await?)
}

/// Rows removed with a batch of runs, by table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Removed {
    /// Runs (each leaves a tombstone).
    pub runs: i64,
    /// Step rows.
    pub steps: i64,
    /// Journal entries (set-aside ones included).
    pub journal: i64,
    /// Outside-write records.
    pub effects: i64,
    /// Decisions, parked items, progress lines, waits, events, shadow writes, fork links,
    /// fan-outs and their children's rows.
    pub other: i64,
}

impl Removed {
    /// Adds another batch's counts.
    pub fn add(&mut self, o: Removed) {
        self.runs += o.runs;
        self.steps += o.steps;
        self.journal += o.journal;
        self.effects += o.effects;
        self.other += o.other;
    }
}

/// Removes the runs and every row that belongs to them, and leaves a tombstone of each (its
/// workflow, a hash of its input, its end, where it was archived), in one statement.
pub async fn remove(
    tx: &mut PgConnection,
    run_ids: &[String],
    archived_to: &[Option<String>],
) -> Result<Removed> {
    Ok(sqlx::query_as(
        "WITH gone AS (SELECT unnest($1::text[]) AS run_id, unnest($2::text[]) AS archived_to),
         s  AS (DELETE FROM trailmark.steps WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         j  AS (DELETE FROM trailmark.journal WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         ja AS (DELETE FROM trailmark.journal_set_aside WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         e  AS (DELETE FROM trailmark.effects WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         d  AS (DELETE FROM trailmark.decisions WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         p  AS (DELETE FROM trailmark.parked WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         pr AS (DELETE FROM trailmark.progress WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         sw AS (DELETE FROM trailmark.shadow_writes WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         f  AS (DELETE FROM trailmark.forks WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         fo AS (DELETE FROM trailmark.fan_outs WHERE run_id IN (SELECT run_id FROM gone) RETURNING 1),
         ch AS (DELETE FROM trailmark.children WHERE parent_run_id IN (SELECT run_id FROM gone) RETURNING 1),
         w  AS (DELETE FROM trailmark.waits WHERE run_id IN (SELECT run_id FROM gone) RETURNING signal_id),
         -- An event goes with the last run it resumed.
         ev AS (DELETE FROM trailmark.signals sg
                 WHERE sg.signal_id IN (SELECT signal_id FROM w WHERE signal_id IS NOT NULL)
                   AND NOT EXISTS (SELECT 1 FROM trailmark.waits o
                                    WHERE o.signal_id = sg.signal_id
                                      AND o.run_id NOT IN (SELECT run_id FROM gone))
                RETURNING 1),
         r  AS (DELETE FROM trailmark.runs WHERE run_id IN (SELECT run_id FROM gone)
                RETURNING run_id, workflow, input, status, finished_at),
         t  AS (INSERT INTO trailmark.pruned_runs (run_id, workflow, input_hash, status, finished_at, archived_to)
                SELECT r.run_id, r.workflow, encode(sha256(convert_to(r.input::text, 'UTF8')), 'hex'),
                       r.status, r.finished_at, g.archived_to
                  FROM r JOIN gone g USING (run_id)
                ON CONFLICT (run_id) DO NOTHING
                RETURNING 1)
         SELECT (SELECT count(*) FROM t) AS runs,
                (SELECT count(*) FROM s) AS steps,
                (SELECT count(*) FROM j) + (SELECT count(*) FROM ja) AS journal,
                (SELECT count(*) FROM e) AS effects,
                (SELECT count(*) FROM d) + (SELECT count(*) FROM p) + (SELECT count(*) FROM pr)
                  + (SELECT count(*) FROM sw) + (SELECT count(*) FROM f) + (SELECT count(*) FROM w)
                  + (SELECT count(*) FROM fo) + (SELECT count(*) FROM ch)
                  + (SELECT count(*) FROM ev) AS other",
    )
    .bind(run_ids)
    .bind(archived_to)
    .fetch_one(&mut *tx)
    .await?)
}

/// A removed run's tombstone, as a later start of its id sees it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Tombstone {
    /// The workflow it ran.
    pub workflow: String,
    /// How it ended.
    pub status: String,
    /// When it was removed.
    pub pruned_at: DateTime<Utc>,
    /// Whether the start asks for the same workflow and input (a repeat), not another (a
    /// conflict).
    pub same: bool,
}

/// The tombstone of `run_id`, compared with a start of `workflow` with `input`.
pub async fn tombstone(
    db: impl PgExecutor<'_>,
    run_id: &str,
    workflow: &str,
    input: &Value,
) -> Result<Option<Tombstone>> {
    Ok(sqlx::query_as(
        "SELECT workflow, status, pruned_at,
                workflow = $2
                  AND input_hash = encode(sha256(convert_to(($3::jsonb)::text, 'UTF8')), 'hex') AS same
           FROM trailmark.pruned_runs WHERE run_id = $1",
    )
    .bind(run_id)
    .bind(workflow)
    .bind(input)
    .fetch_optional(db)
    .await?)
}

/// What is left of a removed run: its tombstone.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Gone {
    /// How it ended.
    pub status: String,
    /// When it was removed.
    pub pruned_at: DateTime<Utc>,
    /// Its archive file, if one was written.
    pub archived_to: Option<String>,
}

/// The tombstone of `run_id`, if it is a removed run's.
pub async fn gone(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<Gone>> {
    Ok(sqlx::query_as(
        "SELECT status, pruned_at, archived_to FROM trailmark.pruned_runs WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(db)
    .await?)
}

/// What ages out by itself: tombstones, debounced starts that ended, processed message ids,
/// audit rows.
#[derive(Debug, Clone, Copy)]
pub enum Aged {
    /// Tombstones of removed runs (`pruned_at`).
    Tombstones,
    /// Debounced starts superseded, started or refused (`ended_at`), kept as long as
    /// tombstones: a late start of a superseded id must find its row.
    Debounced,
    /// The inbox's processed message ids (`processed_at`).
    Inbox,
    /// The audit trail (`at`).
    Audit,
}

impl Aged {
    /// The table and its time column.
    fn table(self) -> (&'static str, &'static str) {
        match self {
            Aged::Tombstones => ("trailmark.pruned_runs", "pruned_at"),
            Aged::Debounced => ("trailmark.debounced_starts", "ended_at"),
            Aged::Inbox => ("trailmark.inbox", "processed_at"),
            Aged::Audit => ("trailmark.audit", "at"),
        }
    }

    /// Its name in output and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Aged::Tombstones => "tombstones",
            Aged::Debounced => "debounced_starts",
            Aged::Inbox => "inbox",
            Aged::Audit => "audit",
        }
    }
}

/// Removes up to `limit` rows of `what` older than `secs` (oldest first, through its time
/// index); with `count_only`, counts what would go instead.
pub async fn forget(
    db: impl PgExecutor<'_>,
    what: Aged,
    secs: i64,
    limit: i64,
    count_only: bool,
) -> Result<i64> {
    let (table, at) = what.table();
    let pick = format!(
        "SELECT ctid FROM {table} WHERE {at} < now() - make_interval(secs => $1) ORDER BY {at} LIMIT $2"
    );
    let sql = if count_only {
        format!("SELECT count(*) FROM ({pick}) old")
    } else {
        format!(
            "WITH old AS ({pick}), gone AS (DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM old) RETURNING 1)
             SELECT count(*) FROM gone"
        )
    };
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(secs as f64)
        .bind(limit)
        .fetch_one(db)
        .await?)
}

//! The SQL behind [`crate::inspect`]: read-only questions the project's own tools (bench, drill)
//! and operators ask about many runs at once, plus the two set-up statements a benchmark needs
//! (emptying the run tables, and a NOTIFY when a run finishes). Kept here so that a schema change
//! is made, and checked, in one crate; the typed face is [`crate::inspect`].
//!
//! The waits' questions (which runs wait for an event, how their waits ended, what became of
//! the events, how late sleepers woke) are the drill's and the bench's, so they are here too
//! rather than beside the statements that move waiting runs on (`store::waits`).
//!
//! Runs are chosen either by id list (`= ANY($1)`) or by id prefix: a prefix is bound as a
//! `LIKE` pattern that [`like_prefix`] escaped, so a `_` or `%` in it matches only itself.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::Result;
use crate::domain::RunStatus;

/// The `LIKE` pattern matching every id that starts with `prefix` and nothing else (`\`, `%`
/// and `_` in it escaped with the default escape character `\`).
pub fn like_prefix(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '\\' | '%' | '_') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}

/// Empties every per-run table of the engine; they have no foreign key to `runs` for CASCADE
/// to follow, so each is named.
pub(crate) async fn erase_runs(db: impl PgExecutor<'_>) -> Result<()> {
    sqlx::raw_sql(
        "TRUNCATE trailmark.runs, trailmark.steps, trailmark.journal, trailmark.effects,
                  trailmark.parked, trailmark.decisions, trailmark.inbox, trailmark.outbox",
    )
    .execute(db)
    .await?;
    Ok(())
}

/// Runs succeeded, positions committed (`sum(step_seq)`), and the first run (by id) that stopped
/// without succeeding, with its status and error, of the runs matching `pattern`.
#[allow(clippy::type_complexity)]
pub(crate) async fn progress(
    db: impl PgExecutor<'_>,
    pattern: &str,
) -> Result<(i64, i64, Option<String>, Option<RunStatus>, Option<String>)> {
    Ok(
        sqlx::query_as(sqlx::AssertSqlSafe(format!("{PROGRESS} WHERE run_id LIKE $1")))
            .bind(pattern)
            .fetch_one(db)
            .await?,
    )
}

/// [`progress`] of the runs `ids` names, through the primary key: what it costs does not grow
/// with the other runs in the table (a pattern, bound as a parameter, reads them all).
#[allow(clippy::type_complexity)]
pub(crate) async fn progress_of(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<(i64, i64, Option<String>, Option<RunStatus>, Option<String>)> {
    Ok(
        sqlx::query_as(sqlx::AssertSqlSafe(format!("{PROGRESS} WHERE run_id = ANY($1)")))
            .bind(ids)
            .fetch_one(db)
            .await?,
    )
}

/// The figures of [`progress`] and [`progress_of`], before their `WHERE`.
const PROGRESS: &str = "SELECT count(*) FILTER (WHERE status = 'succeeded'), COALESCE(sum(step_seq), 0)::bigint,
        (array_agg(run_id ORDER BY run_id) FILTER (WHERE status NOT IN ('running', 'succeeded')))[1],
        (array_agg(status ORDER BY run_id) FILTER (WHERE status NOT IN ('running', 'succeeded')))[1],
        (array_agg(error ORDER BY run_id) FILTER (WHERE status NOT IN ('running', 'succeeded')))[1]
   FROM trailmark.runs";

/// p50 and p99 (ms) of the time between the commits of consecutive positions of one run, over
/// the runs matching `pattern`; `None` when no run has two committed positions.
pub(crate) async fn step_gaps(
    db: impl PgExecutor<'_>,
    pattern: &str,
) -> Result<(Option<f64>, Option<f64>)> {
    Ok(sqlx::query_as(
        "WITH g AS (SELECT finished_at - lag(finished_at) OVER (PARTITION BY run_id ORDER BY seq) AS gap
                      FROM trailmark.steps WHERE run_id LIKE $1)
         SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000,
                percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000
           FROM g WHERE gap IS NOT NULL",
    )
    .bind(pattern)
    .fetch_one(db)
    .await?)
}

/// One row of [`step_times`]: run, position, previous position's commit, claim, first journal
/// entry, first effect intent, commit.
pub(crate) type StepTimesRow = (
    String,
    i32,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

/// Every position of the runs matching `pattern` with the timestamps the engine wrote for it,
/// ordered by run and position.
pub(crate) async fn step_times(
    db: impl PgExecutor<'_>,
    pattern: &str,
) -> Result<Vec<StepTimesRow>> {
    Ok(sqlx::query_as(
        "WITH s AS (SELECT run_id, seq, started_at, finished_at,
                           lag(finished_at) OVER (PARTITION BY run_id ORDER BY seq) AS prev_commit
                      FROM trailmark.steps WHERE run_id LIKE $1),
              j AS (SELECT run_id, seq, min(created_at) AS answer FROM trailmark.journal
                     WHERE run_id LIKE $1 GROUP BY 1, 2),
              e AS (SELECT run_id, seq, min(created_at) AS intent FROM trailmark.effects
                     WHERE run_id LIKE $1 GROUP BY 1, 2)
         SELECT s.run_id, s.seq, s.prev_commit, s.started_at, j.answer, e.intent, s.finished_at
           FROM s LEFT JOIN j USING (run_id, seq) LEFT JOIN e USING (run_id, seq)
          ORDER BY s.run_id, s.seq",
    )
    .bind(pattern)
    .fetch_all(db)
    .await?)
}

/// The trigger function behind [`notify_run_finishes`]: NOTIFY `trailmark_run_finished` with
/// the run id.
const FINISH_FUNCTION: &str = "CREATE OR REPLACE FUNCTION trailmark.inspect_run_finished() RETURNS trigger
    LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('trailmark_run_finished', NEW.run_id); RETURN NULL; END $$";

/// Installs (replacing any earlier one) a trigger that NOTIFYs `trailmark_run_finished` with
/// the run id in the transaction that sets a run's `finished_at`, delivered at its commit.
pub(crate) async fn notify_run_finishes(db: impl PgExecutor<'_> + Copy) -> Result<()> {
    stop_notifying_run_finishes(db).await?;
    sqlx::raw_sql(FINISH_FUNCTION).execute(db).await?;
    sqlx::raw_sql(
        "CREATE TRIGGER inspect_run_finished AFTER UPDATE ON trailmark.runs FOR EACH ROW
         WHEN (NEW.finished_at IS NOT NULL AND OLD.finished_at IS NULL)
         EXECUTE FUNCTION trailmark.inspect_run_finished()",
    )
    .execute(db)
    .await?;
    Ok(())
}

/// Removes what [`notify_run_finishes`] installed (nothing when it is not there).
pub(crate) async fn stop_notifying_run_finishes(db: impl PgExecutor<'_> + Copy) -> Result<()> {
    sqlx::raw_sql(
        "DROP TRIGGER IF EXISTS inspect_run_finished ON trailmark.runs;
         DROP FUNCTION IF EXISTS trailmark.inspect_run_finished()",
    )
    .execute(db)
    .await?;
    Ok(())
}

/// (run, lease owner) of every run matching `pattern` whose lease is held.
pub(crate) async fn lease_owners(
    db: impl PgExecutor<'_>,
    pattern: &str,
) -> Result<Vec<(String, String)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, lease_owner FROM trailmark.runs WHERE run_id LIKE $1 AND lease_owner IS NOT NULL",
    )
    .bind(pattern)
    .fetch_all(db)
    .await?)
}

/// The earliest position commit after `at` of the runs matching `pattern` (every run when
/// `None`).
pub(crate) async fn first_commit_after(
    db: impl PgExecutor<'_>,
    pattern: Option<&str>,
    at: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>> {
    Ok(sqlx::query_scalar(
        "SELECT min(finished_at) FROM trailmark.steps
          WHERE ($1::text IS NULL OR run_id LIKE $1) AND finished_at > $2",
    )
    .bind(pattern)
    .bind(at)
    .fetch_one(db)
    .await?)
}

/// For each of `runs` that committed a position after `at`: its earliest such commit.
pub(crate) async fn first_commit_of_each_after(
    db: impl PgExecutor<'_>,
    runs: &[String],
    at: DateTime<Utc>,
) -> Result<Vec<(String, DateTime<Utc>)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, min(finished_at) FROM trailmark.steps
          WHERE run_id = ANY($1) AND finished_at > $2 GROUP BY run_id",
    )
    .bind(runs)
    .bind(at)
    .fetch_all(db)
    .await?)
}

/// Of `runs`, the one that waited longest within `[from, to]` for its next commit (the wait
/// from its previous commit, or its creation, clipped to the window), and that wait in ms.
pub(crate) async fn longest_run_wait(
    db: impl PgExecutor<'_>,
    runs: &[String],
    (from, to): (DateTime<Utc>, DateTime<Utc>),
) -> Result<Option<(String, f64)>> {
    Ok(sqlx::query_as(
        "WITH marks AS (
             SELECT run_id, finished_at AS at FROM trailmark.steps
              WHERE run_id = ANY($1) AND finished_at IS NOT NULL
             UNION ALL
             SELECT run_id, created_at FROM trailmark.runs WHERE run_id = ANY($1)
         ), gaps AS (
             SELECT run_id, lag(at) OVER (PARTITION BY run_id ORDER BY at) AS prev, at FROM marks
         )
         SELECT run_id,
                (EXTRACT(EPOCH FROM least(at, $3) - greatest(prev, $2)) * 1000)::float8 AS ms
           FROM gaps WHERE prev IS NOT NULL AND at > $2 AND prev < $3
          ORDER BY ms DESC LIMIT 1",
    )
    .bind(runs)
    .bind(from)
    .bind(to)
    .fetch_optional(db)
    .await?)
}

/// Every position commit (of any run) in `(after, until]`, in time order.
pub(crate) async fn commit_times_between(
    db: impl PgExecutor<'_>,
    after: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<Vec<DateTime<Utc>>> {
    Ok(sqlx::query_scalar(
        "SELECT finished_at FROM trailmark.steps WHERE finished_at > $1 AND finished_at <= $2
          ORDER BY finished_at",
    )
    .bind(after)
    .bind(until)
    .fetch_all(db)
    .await?)
}

/// (run, status, whether a handover note is written, error) of each of `ids` that exists.
pub(crate) async fn statuses(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<Vec<(String, RunStatus, bool, Option<String>)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, status, handover IS NOT NULL, error FROM trailmark.runs WHERE run_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(db)
    .await?)
}

/// (run, status, positions committed) of each of `ids` that exists.
pub(crate) async fn committed_positions(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<Vec<(String, RunStatus, i64)>> {
    Ok(sqlx::query_as(
        "SELECT r.run_id, r.status, coalesce(s.n, 0)::bigint
           FROM trailmark.runs r
           LEFT JOIN (SELECT run_id, count(*) AS n FROM trailmark.steps
                       WHERE run_id = ANY($1) AND finished_at IS NOT NULL GROUP BY run_id) s USING (run_id)
          WHERE r.run_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(db)
    .await?)
}

/// (run, position) of every checkpoint row (claimed or committed) of `ids`.
pub(crate) async fn positions(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<Vec<(String, i32)>> {
    Ok(
        sqlx::query_as("SELECT run_id, seq FROM trailmark.steps WHERE run_id = ANY($1)")
            .bind(ids)
            .fetch_all(db)
            .await?,
    )
}

/// Positions committed and effects completed by one run.
pub(crate) async fn work_of_run(db: impl PgExecutor<'_>, run: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM trailmark.steps WHERE run_id = $1 AND finished_at IS NOT NULL),
                (SELECT count(*) FROM trailmark.effects WHERE run_id = $1 AND completed_at IS NOT NULL)",
    )
    .bind(run)
    .fetch_one(db)
    .await?)
}

/// Those of `ids` that succeeded.
pub(crate) async fn succeeded(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT run_id FROM trailmark.runs WHERE run_id = ANY($1) AND status = 'succeeded'",
    )
    .bind(ids)
    .fetch_all(db)
    .await?)
}

/// The fan-outs of `ids`: how many, how many joined, the fan-outs (`run:position`) whose
/// started count differs from their started children rows or child runs (a child started
/// twice), and those moved on by more than one join.
pub(crate) async fn fan_outs(
    db: &sqlx::PgPool,
    ids: &[String],
) -> Result<(i64, i64, Vec<String>, Vec<String>)> {
    let (total, joined): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(joined_at) FROM trailmark.fan_outs WHERE run_id = ANY($1)",
    )
    .bind(ids)
    .fetch_one(db)
    .await?;
    let twice: Vec<String> = sqlx::query_scalar(
        "SELECT f.run_id || ':' || f.seq FROM trailmark.fan_outs f
          WHERE f.run_id = ANY($1)
            AND (f.started <> (SELECT count(*) FROM trailmark.children c
                                WHERE c.parent_run_id = f.run_id AND c.seq = f.seq
                                  AND c.state NOT IN ('pending', 'skipped'))
              OR f.started <> (SELECT count(*) FROM trailmark.children c
                                 JOIN trailmark.runs r ON r.run_id = c.run_id
                                WHERE c.parent_run_id = f.run_id AND c.seq = f.seq))",
    )
    .bind(ids)
    .fetch_all(db)
    .await?;
    let joined_twice: Vec<String> = sqlx::query_scalar(
        "SELECT run_id || ':' || seq FROM trailmark.progress
          WHERE run_id = ANY($1) AND line LIKE 'children joined:%'
          GROUP BY run_id, seq HAVING count(*) > 1",
    )
    .bind(ids)
    .fetch_all(db)
    .await?;
    Ok((total, joined, twice, joined_twice))
}

/// Seconds from the commit of the step at `seq` of `run_id` (which started children) to the
/// join that moved it on, database clock; `None` until it joined.
pub(crate) async fn fan_out_span(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<Option<f64>> {
    Ok(sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM f.joined_at - s.finished_at)::float8
           FROM trailmark.fan_outs f
           JOIN trailmark.steps s ON s.run_id = f.run_id AND s.seq = f.seq
          WHERE f.run_id = $1 AND f.seq = $2 AND f.joined_at IS NOT NULL",
    )
    .bind(run_id)
    .bind(seq)
    .fetch_optional(db)
    .await?
    .flatten())
}

/// Of the runs whose ids start with `prefix`: how many succeeded, and the seconds from the
/// first one's creation to the last one's end (database clock).
pub(crate) async fn runs_span(db: impl PgExecutor<'_>, prefix: &str) -> Result<(i64, Option<f64>)> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'succeeded'),
                EXTRACT(EPOCH FROM max(finished_at) - min(created_at))::float8
           FROM trailmark.runs WHERE run_id LIKE $1",
    )
    .bind(like_prefix(prefix))
    .fetch_one(db)
    .await?)
}

/// Effects (one per key and run) completed by `runs`.
pub(crate) async fn completed_effects(db: impl PgExecutor<'_>, runs: &[String]) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.effects WHERE run_id = ANY($1) AND completed_at IS NOT NULL",
    )
    .bind(runs)
    .fetch_one(db)
    .await?)
}

/// Outbox rows no relay or worker has published yet.
pub(crate) async fn unpublished_outbox_rows(db: impl PgExecutor<'_>) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM trailmark.outbox WHERE published_at IS NULL")
            .fetch_one(db)
            .await?,
    )
}

/// Why the unpublished outbox rows are still there, for a report on a stall: one row per
/// reason, with how many rows, their most attempts, and one of their broker errors.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct OutboxBacklog {
    /// `held back` (the broker refused them alone), `holder alive` (a worker that is still
    /// connected publishes them itself), or `due` (any relay may take them now).
    pub reason: String,
    /// Rows for this reason.
    pub rows: i64,
    /// The most publish attempts among them.
    pub max_attempts: i32,
    /// Seconds until the first of them may be taken (0 when due).
    pub next_in_secs: f64,
    /// One of their last broker errors, when any.
    pub last_error: Option<String>,
}

/// The unpublished outbox rows, by why they wait.
pub(crate) async fn outbox_backlog(db: impl PgExecutor<'_>) -> Result<Vec<OutboxBacklog>> {
    Ok(sqlx::query_as(
        "SELECT reason, count(*) AS rows, max(attempts) AS max_attempts,
                greatest(0, extract(epoch FROM min(available_at) - now()))::float8 AS next_in_secs,
                max(last_error) AS last_error
           FROM (SELECT attempts, available_at, last_error,
                        CASE WHEN available_at > now() AND last_error IS NOT NULL THEN 'held back'
                             WHEN available_at > now() AND NOT trailmark.process_gone(holder_pid)
                                  THEN 'holder alive'
                             ELSE 'due' END AS reason
                   FROM trailmark.outbox WHERE published_at IS NULL) o
          GROUP BY reason ORDER BY reason",
    )
    .fetch_all(db)
    .await?)
}

/// Runs of `workflow` holding a step now, by concurrency key: a live lease (set, not expired,
/// its process not gone), read from the runs alone so that it checks the gate's slot rows
/// rather than repeating them.
pub(crate) async fn running_by_key(
    db: impl PgExecutor<'_>,
    workflow: &str,
) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT flow_key, count(*) FROM trailmark.runs
          WHERE workflow = $1 AND flow_key IS NOT NULL AND lease_owner IS NOT NULL
            AND (lease_expires_at IS NULL OR lease_expires_at > now())
            AND NOT trailmark.process_gone(lease_pid)
          GROUP BY flow_key ORDER BY flow_key",
    )
    .bind(workflow)
    .fetch_all(db)
    .await?)
}

/// (run, position) of every run of `workflow` waiting for a slot or a token of its key.
pub(crate) async fn key_waiters(db: impl PgExecutor<'_>, workflow: &str) -> Result<Vec<(String, i32)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, seq FROM trailmark.flow_waiters WHERE workflow = $1 ORDER BY run_id, seq",
    )
    .bind(workflow)
    .fetch_all(db)
    .await?)
}

/// Runs with a slot still reserved for them that are no longer executing: a slot held out of
/// use for a run that will never claim it.
pub(crate) async fn reserved_for_ended(db: impl PgExecutor<'_>) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT s.run_id FROM trailmark.flow_slots s LEFT JOIN trailmark.runs r USING (run_id)
          WHERE s.reserved_until > now() AND (r.status IS NULL OR NOT r.status = ANY($1::text[]))
          ORDER BY s.run_id",
    )
    .bind(&RunStatus::EXECUTING[..])
    .fetch_all(db)
    .await?)
}

/// Runs in review whose error or handover note contains `text` (as is: no wildcard).
pub(crate) async fn in_review_mentioning(
    db: impl PgExecutor<'_>,
    text: &str,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT run_id FROM trailmark.runs WHERE status = 'needs_review'
            AND (strpos(error, $1) > 0 OR strpos(handover::text, $1) > 0) ORDER BY run_id",
    )
    .bind(text)
    .fetch_all(db)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::like_prefix;

    #[test]
    fn a_prefix_pattern_escapes_the_wildcards_it_contains() {
        assert_eq!(like_prefix("l0-"), "l0-%");
        assert_eq!(like_prefix("a_b%c\\"), "a\\_b\\%c\\\\%");
    }
}

/// Those of `ids` that wait for an event now (status `waiting`, an open event wait).
pub async fn waiting_for_events(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT w.run_id FROM trailmark.waits w JOIN trailmark.runs r ON r.run_id = w.run_id
          WHERE w.run_id = ANY($1) AND w.resolved_at IS NULL AND w.kind = 'event'
            AND r.status = 'waiting' AND r.step_seq = w.seq",
    )
    .bind(ids)
    .fetch_all(db)
    .await?)
}

/// How each event wait of `ids` ended: run, position, resolution (`None`: open), the event's
/// id, and the event's payload.
pub type WaitOutcome = (String, i32, Option<String>, Option<String>, Option<Value>);

/// Every event wait of `ids`, by run and position.
pub async fn outcomes(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<WaitOutcome>> {
    Ok(sqlx::query_as(
        "SELECT w.run_id, w.seq, w.resolution, w.signal_id, s.payload
           FROM trailmark.waits w LEFT JOIN trailmark.signals s ON s.signal_id = w.signal_id
          WHERE w.run_id = ANY($1) AND w.kind = 'event' ORDER BY w.run_id, w.seq",
    )
    .bind(ids)
    .fetch_all(db)
    .await?)
}

/// Each of `ids` (event ids) as stored: id, state (`pending`, `consumed`, `expired`) and the
/// runs it resumed.
pub async fn signal_states(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<Vec<(String, String, i32)>> {
    Ok(sqlx::query_as(
        "SELECT signal_id,
                CASE WHEN consumed_at IS NOT NULL THEN 'consumed'
                     WHEN expired_at IS NOT NULL THEN 'expired' ELSE 'pending' END,
                resumed
           FROM trailmark.signals WHERE signal_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(db)
    .await?)
}

/// How late the sleeps of runs whose id starts with `prefix` were ended, from their due time:
/// by the timer loop (`resolved_at`), and to the start of the step after them (the claim of
/// the woken step), in seconds, each as (p50, p99, max); with how many and over how many
/// seconds their due times were spread. For the bench.
pub async fn sleep_lags(db: impl PgExecutor<'_>, prefix: &str) -> Result<SleepLags> {
    Ok(sqlx::query_as(
        "SELECT count(*) AS sleeps,
                COALESCE(EXTRACT(EPOCH FROM max(w.due_at) - min(w.due_at)), 0)::float8 AS due_spread_secs,
                COALESCE(percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM w.resolved_at - w.due_at)), 0)::float8 AS woken_p50,
                COALESCE(percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM w.resolved_at - w.due_at)), 0)::float8 AS woken_p99,
                COALESCE(max(EXTRACT(EPOCH FROM w.resolved_at - w.due_at)), 0)::float8 AS woken_max,
                COALESCE(percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM s.started_at - w.due_at)), 0)::float8 AS started_p50,
                COALESCE(percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM s.started_at - w.due_at)), 0)::float8 AS started_p99,
                COALESCE(max(EXTRACT(EPOCH FROM s.started_at - w.due_at)), 0)::float8 AS started_max,
                count(*) FILTER (WHERE w.resolved_at < w.due_at OR s.started_at < w.due_at) AS early
           FROM trailmark.waits w
           JOIN trailmark.steps s ON s.run_id = w.run_id AND s.seq = w.seq + 1
          WHERE w.run_id LIKE $1 AND w.kind = 'sleep' AND w.resolution = 'woke'",
    )
    .bind(like_prefix(prefix))
    .fetch_one(db)
    .await?)
}

/// What [`sleep_lags`] measured.
#[derive(Debug, Clone, Copy, Default, Serialize, sqlx::FromRow)]
pub struct SleepLags {
    /// Sleeps ended.
    pub sleeps: i64,
    /// From the first due time to the last (s).
    pub due_spread_secs: f64,
    /// Due time to the timer loop's wake-up: p50 (s).
    pub woken_p50: f64,
    /// p99 (s).
    pub woken_p99: f64,
    /// Worst (s).
    pub woken_max: f64,
    /// Due time to the claim of the woken step: p50 (s).
    pub started_p50: f64,
    /// p99 (s).
    pub started_p99: f64,
    /// Worst (s).
    pub started_max: f64,
    /// Sleeps ended, or steps started, before their time (must be 0).
    pub early: i64,
}

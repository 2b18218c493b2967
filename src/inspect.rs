//! What the project's own tools (the bench, the drill) and operators read about many runs at
//! once: statuses, progress, commit times, leases, outbox and effect counts, waits and events.
//! They read the engine through these functions, never through its tables, so that a schema
//! change is made and compiled in one crate (the SQL is in `store::inspect`).
//!
//! Runs are chosen by an id list or by an id prefix; a prefix matches ids that start with it and
//! nothing else (a `_` or `%` in it is no wildcard). Every function takes an executor: a pool, a
//! connection or a transaction.
//!
//! Two functions change state, for the bench only: [`erase_runs`] and
//! [`notify_run_finishes`].

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::domain::RunStatus;
use crate::store::{Result, inspect as sql};

/// The NOTIFY channel on which [`notify_run_finishes`] announces finished runs (payload: the
/// run id).
pub const RUN_FINISHED_CHANNEL: &str = "trailmark_run_finished";

/// How far the runs with one id prefix are.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Runs succeeded.
    pub succeeded: i64,
    /// Positions committed, summed over the runs.
    pub steps_committed: i64,
    /// The first run (by id) that stopped without succeeding (any status but running and
    /// succeeded), if one did.
    pub stopped: Option<StoppedRun>,
}

/// A run that stopped without succeeding.
#[derive(Debug, Clone, PartialEq)]
pub struct StoppedRun {
    /// The run.
    pub run_id: String,
    /// Where it stands.
    pub status: RunStatus,
    /// Its error or handover reason.
    pub error: Option<String>,
}

/// Percentiles of the time between the commits of consecutive positions of one run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GapPercentiles {
    /// Median (ms); `None` when no run committed two positions.
    pub p50_ms: Option<f64>,
    /// 99th percentile (ms); `None` when no run committed two positions.
    pub p99_ms: Option<f64>,
}

/// The timestamps the engine wrote for one position of a run (each the start time of the
/// transaction that wrote it).
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimes {
    /// The run.
    pub run_id: String,
    /// The position.
    pub seq: i32,
    /// When the previous position committed (`None` for the first position).
    pub previous_commit: Option<DateTime<Utc>>,
    /// When the position was first claimed.
    pub claimed: DateTime<Utc>,
    /// The first model answer journaled at this position, if any.
    pub first_journal_entry: Option<DateTime<Utc>>,
    /// The first outside write's intent recorded at this position, if any.
    pub first_effect_intent: Option<DateTime<Utc>>,
    /// When the position committed (`None` while it has not).
    pub committed: Option<DateTime<Utc>>,
}

/// A run's lease and who holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolder {
    /// The run.
    pub run_id: String,
    /// The lease owner (see [`crate::engine::lease_owner_pid`]).
    pub owner: String,
}

/// A run and a commit time of one of its positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCommit {
    /// The run.
    pub run_id: String,
    /// The commit's time.
    pub at: DateTime<Utc>,
}

/// Where a run stands, as the drill's verdict reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunState {
    /// The run.
    pub run_id: String,
    /// Its status.
    pub status: RunStatus,
    /// Whether a handover note is written.
    pub has_note: bool,
    /// Its error or handover reason.
    pub error: Option<String>,
}

/// A run's status and how many positions it committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCommitted {
    /// The run.
    pub run_id: String,
    /// Its status.
    pub status: RunStatus,
    /// Positions committed.
    pub steps: i64,
}

/// What one run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunWork {
    /// Positions committed.
    pub steps: i64,
    /// Outside writes (effects) completed.
    pub effects: i64,
}

/// Empties every per-run table (runs, steps, journal, effects, parked, decisions, inbox,
/// outbox) so that a benchmark repetition starts alike; the `chain` ledger is
/// the test kit's (`trailmark_testkit::ledger::erase_ledger`). Never on a database whose runs matter.
pub async fn erase_runs(db: impl PgExecutor<'_>) -> Result<()> {
    sql::erase_runs(db).await
}

/// How far the runs whose id starts with `prefix` are: succeeded, positions committed, the
/// first that stopped.
pub async fn progress(db: impl PgExecutor<'_>, prefix: &str) -> Result<Progress> {
    progress_from(sql::progress(db, &sql::like_prefix(prefix)).await?)
}

/// [`progress`] of the runs `ids` names: its cost does not grow with the runs beside them (the
/// bench's growth phase polls it beside ten million finished steps).
pub async fn progress_of(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Progress> {
    progress_from(sql::progress_of(db, ids).await?)
}

fn progress_from(
    (succeeded, steps_committed, run_id, status, error): (
        i64,
        i64,
        Option<String>,
        Option<RunStatus>,
        Option<String>,
    ),
) -> Result<Progress> {
    let stopped = match (run_id, status) {
        (Some(run_id), Some(status)) => Some(StoppedRun {
            run_id,
            status,
            error,
        }),
        _ => None,
    };
    Ok(Progress {
        succeeded,
        steps_committed,
        stopped,
    })
}

/// p50 and p99 of the commit-to-commit gaps between consecutive positions of one run, over the
/// runs whose id starts with `prefix` (computed in the database: it serves 100,000 runs).
pub async fn step_gap_percentiles(db: impl PgExecutor<'_>, prefix: &str) -> Result<GapPercentiles> {
    let (p50_ms, p99_ms) = sql::step_gaps(db, &sql::like_prefix(prefix)).await?;
    Ok(GapPercentiles { p50_ms, p99_ms })
}

/// Every position of the runs whose id starts with `prefix`, with its claim, first journal
/// entry, first effect intent and commit times, by run and position: where a step's time goes.
pub async fn step_times(db: impl PgExecutor<'_>, prefix: &str) -> Result<Vec<StepTimes>> {
    let rows = sql::step_times(db, &sql::like_prefix(prefix)).await?;
    Ok(rows
        .into_iter()
        .map(
            |(run_id, seq, previous_commit, claimed, journal, intent, committed)| StepTimes {
                run_id,
                seq,
                previous_commit,
                claimed,
                first_journal_entry: journal,
                first_effect_intent: intent,
                committed,
            },
        )
        .collect())
}

/// Makes every run that finishes from now on NOTIFY [`RUN_FINISHED_CHANNEL`] with its id,
/// delivered when its final commit is: the bench times a run to the moment its end is visible
/// to a client, as it does the systems it compares with (a poll would add its period, and
/// `finished_at` is the start of the final transaction, before its commit). A trigger on the
/// runs table, so for a benchmark's database only; undone by [`stop_notifying_run_finishes`].
pub async fn notify_run_finishes(db: impl PgExecutor<'_> + Copy) -> Result<()> {
    sql::notify_run_finishes(db).await
}

/// Removes what [`notify_run_finishes`] installed; nothing when it is not installed.
pub async fn stop_notifying_run_finishes(db: impl PgExecutor<'_> + Copy) -> Result<()> {
    sql::stop_notifying_run_finishes(db).await
}

/// The current lease holders of the runs whose id starts with `prefix` (runs without a lease
/// left out).
pub async fn lease_owners(db: impl PgExecutor<'_>, prefix: &str) -> Result<Vec<LeaseHolder>> {
    let rows = sql::lease_owners(db, &sql::like_prefix(prefix)).await?;
    Ok(rows
        .into_iter()
        .map(|(run_id, owner)| LeaseHolder { run_id, owner })
        .collect())
}

/// The earliest position commit after `at` among the runs whose id starts with `prefix`, or
/// among all runs when `prefix` is `None`: how long progress stopped after a fault.
pub async fn first_commit_after(
    db: impl PgExecutor<'_>,
    prefix: Option<&str>,
    at: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>> {
    let pattern = prefix.map(sql::like_prefix);
    sql::first_commit_after(db, pattern.as_deref(), at).await
}

/// For each of `runs` that committed a position after `at`, its earliest such commit (runs
/// that did not are left out): when each run held up by a fault moved again.
pub async fn first_commit_of_each_after(
    db: impl PgExecutor<'_>,
    runs: &[String],
    at: DateTime<Utc>,
) -> Result<Vec<RunCommit>> {
    let rows = sql::first_commit_of_each_after(db, runs, at).await?;
    Ok(rows
        .into_iter()
        .map(|(run_id, at)| RunCommit { run_id, at })
        .collect())
}

/// Every position commit of any run in `(after, until]`, in time order: where progress stalled.
pub async fn commit_times_between(
    db: impl PgExecutor<'_>,
    after: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<Vec<DateTime<Utc>>> {
    sql::commit_times_between(db, after, until).await
}

/// Of `runs`, the one that waited longest within `[from, to]` for its next commit (from its
/// previous commit or its creation, clipped to the window), with that wait in ms: how long a
/// fault held a run back, which a gap in all commits hides while other runs move.
pub async fn longest_run_wait(
    db: impl PgExecutor<'_>,
    runs: &[String],
    window: (DateTime<Utc>, DateTime<Utc>),
) -> Result<Option<(String, f64)>> {
    sql::longest_run_wait(db, runs, window).await
}

/// Status, note and error of each of `ids` that exists (ids never created are left out).
pub async fn run_states(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<RunState>> {
    let rows = sql::statuses(db, ids).await?;
    Ok(rows
        .into_iter()
        .map(|(run_id, status, has_note, error)| RunState {
            run_id,
            status,
            has_note,
            error,
        })
        .collect())
}

/// Status and committed positions of each of `ids` that exists: how far a drive is.
pub async fn committed_steps(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<RunCommitted>> {
    let rows = sql::committed_positions(db, ids).await?;
    Ok(rows
        .into_iter()
        .map(|(run_id, status, steps)| RunCommitted {
            run_id,
            status,
            steps,
        })
        .collect())
}

/// (run, position) of every checkpoint row of `ids`, claimed or committed: which positions
/// the runs reached.
pub async fn positions_reached(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<Vec<(String, i32)>> {
    sql::positions(db, ids).await
}

/// Positions committed and outside writes completed by one run.
pub async fn work_of_run(db: impl PgExecutor<'_>, run: &str) -> Result<RunWork> {
    let (steps, effects) = sql::work_of_run(db, run).await?;
    Ok(RunWork { steps, effects })
}

/// Those of `ids` that succeeded.
pub async fn succeeded_runs(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<String>> {
    sql::succeeded(db, ids).await
}

/// What the fan-outs of `ids` did, for the drill's invariants (no child started twice, no
/// parent joined twice).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FanOuts {
    /// Fan-outs the runs' steps made.
    pub fan_outs: i64,
    /// Of them, joined (the parent went on).
    pub joined: i64,
    /// Fan-outs (`run:position`) that counted more children started than they have, or have
    /// child runs they did not count.
    pub started_twice: Vec<String>,
    /// Positions (`run:position`) a join moved a parent to more than once.
    pub joined_twice: Vec<String>,
}

/// The fan-outs of `ids` (see [`FanOuts`]).
pub async fn fan_outs(db: &sqlx::PgPool, ids: &[String]) -> Result<FanOuts> {
    let (fan_outs, joined, started_twice, joined_twice) = sql::fan_outs(db, ids).await?;
    Ok(FanOuts {
        fan_outs,
        joined,
        started_twice,
        joined_twice,
    })
}

/// Seconds from the commit of the step at `seq` of `run_id` that started children to the join
/// that moved the run on (database clock); `None` until it joined.
pub async fn fan_out_span(db: impl PgExecutor<'_>, run_id: &str, seq: i32) -> Result<Option<f64>> {
    sql::fan_out_span(db, run_id, seq).await
}

/// Of the runs whose ids start with `prefix`: how many succeeded, and the seconds from the
/// first one's creation to the last one's end (database clock).
pub async fn runs_span(db: impl PgExecutor<'_>, prefix: &str) -> Result<(i64, Option<f64>)> {
    sql::runs_span(db, prefix).await
}

/// Outside writes (effects) completed by `runs`, one per key and run.
pub async fn completed_effects(db: impl PgExecutor<'_>, runs: &[String]) -> Result<i64> {
    sql::completed_effects(db, runs).await
}

/// Outbox rows no worker or relay has published yet (every run's).
pub async fn unpublished_outbox_rows(db: impl PgExecutor<'_>) -> Result<i64> {
    sql::unpublished_outbox_rows(db).await
}

/// Why the unpublished outbox rows wait, by reason (what a stalled drill reports).
pub use crate::store::inspect::OutboxBacklog;

/// The unpublished outbox rows grouped by why they wait (held back, their worker still holds
/// them, or due for any relay).
pub async fn outbox_backlog(db: impl PgExecutor<'_>) -> Result<Vec<OutboxBacklog>> {
    sql::outbox_backlog(db).await
}

/// Runs of `workflow` holding a step now (a live lease), by concurrency key: what a key's
/// limit bounds, as the drill samples it.
pub async fn running_by_key(db: impl PgExecutor<'_>, workflow: &str) -> Result<Vec<(String, i64)>> {
    sql::running_by_key(db, workflow).await
}

/// (run, position) of every run of `workflow` waiting in a key's line (for a slot or a token).
pub async fn key_waiters(db: impl PgExecutor<'_>, workflow: &str) -> Result<Vec<(String, i32)>> {
    sql::key_waiters(db, workflow).await
}

/// Runs a slot is still reserved for although they no longer execute (a slot kept from use).
pub async fn reserved_for_ended(db: impl PgExecutor<'_>) -> Result<Vec<String>> {
    sql::reserved_for_ended(db).await
}

/// The runs in review whose error or handover note contains `text` (literally), by id.
pub async fn runs_in_review_mentioning(db: impl PgExecutor<'_>, text: &str) -> Result<Vec<String>> {
    sql::in_review_mentioning(db, text).await
}

/// The `LIKE` pattern for ids starting with a prefix, for other tools' tables of the same runs.
pub use crate::store::inspect::like_prefix;

/// How one event wait ended, and how late sleepers woke.
pub use crate::store::inspect::{SleepLags, WaitOutcome};

/// Those of `ids` that wait for an event now (status `waiting`, an open event wait).
pub async fn waiting_for_events(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<String>> {
    sql::waiting_for_events(db, ids).await
}

/// Every event wait of `ids`, by run and position: how each ended.
pub async fn wait_outcomes(db: impl PgExecutor<'_>, ids: &[String]) -> Result<Vec<WaitOutcome>> {
    sql::outcomes(db, ids).await
}

/// Each of `ids` (event ids) as stored: id, state (`pending`, `consumed`, `expired`) and the
/// runs it resumed.
pub async fn signal_states(
    db: impl PgExecutor<'_>,
    ids: &[String],
) -> Result<Vec<(String, String, i32)>> {
    sql::signal_states(db, ids).await
}

/// How late the sleeps of runs whose id starts with `prefix` were ended (see [`SleepLags`]).
pub async fn sleep_lags(db: impl PgExecutor<'_>, prefix: &str) -> Result<SleepLags> {
    sql::sleep_lags(db, prefix).await
}

//! The `runs` table: creation, lease claim and heartbeat, listing (the fenced advance is part
//! of the step commit, `checkpoint`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgExecutor, PgPool};

use super::Result;
use crate::domain::{Fence, MessageId, RunId, RunStatus, StepAddress, Transition, UndoPlan};

/// A run as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct RunRow {
    /// Run id.
    pub run_id: String,
    /// Workflow name.
    pub workflow: String,
    /// Workflow version.
    pub workflow_version: i32,
    /// Where the run stands; a name this build does not know fails the read instead of being
    /// guessed.
    pub status: RunStatus,
    /// The step to run next.
    pub step: Option<StepAddress>,
    /// Position of the next step.
    pub step_seq: i32,
    /// Input given at start.
    pub input: Value,
    /// Final output.
    pub output: Option<Value>,
    /// Last error or handover reason.
    pub error: Option<String>,
    /// The handover note while the run needs review (or what a person must decide while waiting).
    pub handover: Option<Value>,
    /// The undo plan, once an undo was decided.
    #[cfg_attr(feature = "ops-http", schema(value_type = Option<Object>))]
    pub undo: Option<sqlx::types::Json<UndoPlan>>,
    /// Worker holding the lease.
    pub lease_owner: Option<String>,
    /// Backend pid of the holder's presence connection.
    pub lease_pid: Option<i32>,
    /// Lease expiry (database clock).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Current fencing token.
    pub fence: i64,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// Finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// A shadow fork: outside writes recorded, never made.
    pub shadow: bool,
    /// The run whose step started it (a child run).
    #[sqlx(default)]
    pub parent_run_id: Option<String>,
    /// The concurrency key it is counted under (`None`: none).
    #[sqlx(default)]
    pub flow_key: Option<String>,
    /// Its priority among runs waiting for a slot (0 lowest to 4 highest).
    #[sqlx(default)]
    pub priority: i16,
}

impl RunRow {
    /// Whether the run was started with `workflow` and `input`: the rule that makes a second
    /// start of a run id a repeat (nothing new starts) or a conflict (refused, the run kept).
    pub fn started_with(&self, workflow: &str, input: &Value) -> bool {
        self.workflow == workflow && &self.input == input
    }
}

/// A new run; the first step is queued by the caller in the same transaction.
pub struct NewRun<'a> {
    /// Id.
    pub run_id: &'a RunId,
    /// Workflow name.
    pub workflow: &'a str,
    /// Workflow version.
    pub version: i32,
    /// First step.
    pub first_step: &'a StepAddress,
    /// Input.
    pub input: &'a Value,
    /// The run whose step started it, for a child run.
    pub parent: Option<&'a str>,
    /// The run's trace context (a W3C `traceparent`), for steps re-queued without a header.
    pub traceparent: Option<&'a str>,
    /// Its concurrency key, if its workflow declares one.
    pub flow_key: Option<&'a str>,
    /// Its priority level among runs waiting for a slot.
    pub priority: i16,
}

/// Inserts the run unless it exists; returns whether it was created.
pub async fn insert(db: impl PgExecutor<'_>, run: &NewRun<'_>) -> Result<bool> {
    let done = sqlx::query(
        "INSERT INTO trailmark.runs (run_id, workflow, workflow_version, status, step, input,
                                     parent_run_id, traceparent, flow_key, priority)
         VALUES ($1, $2, $3, $6, $4, $5, $7, $8, $9, $10) ON CONFLICT (run_id) DO NOTHING",
    )
    .bind(run.run_id.as_str())
    .bind(run.workflow)
    .bind(run.version)
    .bind(run.first_step)
    .bind(run.input)
    .bind(RunStatus::Running)
    .bind(run.parent)
    .bind(run.traceparent)
    .bind(run.flow_key)
    .bind(run.priority)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The trace context stored with a run when it started (`None`: none, or no such run).
pub async fn traceparent(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<String>> {
    let found: Option<Option<String>> =
        sqlx::query_scalar("SELECT traceparent FROM trailmark.runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(db)
            .await?;
    Ok(found.flatten())
}

/// Reads one run.
pub async fn get(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<RunRow>> {
    Ok(
        sqlx::query_as("SELECT * FROM trailmark.runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(db)
            .await?,
    )
}

/// Where a run stands: its status, the position of its next step and the workflow version it
/// is on (`None`: no such run).
pub async fn standing(
    db: impl PgExecutor<'_>,
    run_id: &RunId,
) -> Result<Option<(RunStatus, i32, i32)>> {
    Ok(
        sqlx::query_as(
            "SELECT status, step_seq, workflow_version FROM trailmark.runs WHERE run_id = $1",
        )
            .bind(run_id.as_str())
            .fetch_optional(db)
            .await?,
    )
}

/// Lists runs, newest first, optionally by status.
pub async fn list(
    db: impl PgExecutor<'_>,
    (status, parent): (Option<RunStatus>, Option<&str>),
    limit: i64,
) -> Result<Vec<RunRow>> {
    Ok(sqlx::query_as(
        "SELECT * FROM trailmark.runs WHERE ($1::text IS NULL OR status = $1)
            AND ($3::text IS NULL OR parent_run_id = $3)
         ORDER BY created_at DESC, run_id LIMIT $2",
    )
    .bind(status)
    .bind(limit)
    .bind(parent)
    .fetch_all(db)
    .await?)
}

/// What a successful lease claim hands the worker.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The new fencing token.
    pub fence: Fence,
    /// Status at claim time (one of [`RunStatus::EXECUTING`]).
    pub status: RunStatus,
    /// Run input.
    pub input: Value,
    /// Seconds since the run was created (database clock), for the run's hard timeout.
    pub age_secs: f64,
    /// The undo plan while compensating.
    pub undo: Option<UndoPlan>,
    /// Which attempt at this position this is (1-based, counted across crashes).
    pub attempt: i32,
    /// Journal entries already recorded at this position (a replay reads them back).
    pub journaled: i32,
    /// Whether another owner held the lease until this claim (a dead or frozen worker's, or
    /// one the supervisor voided).
    pub took_over: bool,
    /// A shadow run: outside writes are recorded, never made.
    pub shadow: bool,
    /// Made by the previous step's commit (a pre-claim), not by a claim statement: the step's
    /// commit is synchronous (`StepTx::commit`).
    pub preclaimed: bool,
    /// For a child run, its parent: the commit that ends it counts it in its fan-out.
    pub parent: Option<String>,
    /// The concurrency key whose slot the claim holds (set by `flow::gate`, carried by a
    /// pre-claim): a step's end that gives the lease up hands the slot on.
    pub flow: Option<super::flow::Held>,
}

/// A worker asking for a run's lease to execute one step delivery (owned, so a group-commit task
/// can carry it).
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The run.
    pub run_id: RunId,
    /// The position the delivery is for.
    pub seq: i32,
    /// The workflow version the delivery is for: a copy of a step message from before an
    /// operator moved the run to another version (`trailmark workflow move`) claims nothing.
    pub version: i32,
    /// The step (for the attempt row).
    pub step: StepAddress,
    /// Who asks (worker id and delivery).
    pub owner: String,
    /// Lease length.
    pub lease_secs: f64,
    /// Backend pid of the asker's presence connection.
    pub presence_pid: Option<i32>,
    /// The inbox consumer and the delivery's message id: a processed message is never claimed.
    pub message: (&'static str, MessageId),
    /// RabbitMQ delivered the message before: a pre-claim's holder may have started it.
    pub redelivered: bool,
    /// The asker holds the run's pre-claim for this message and never started the step on it
    /// (too old to start on, or redelivered): finding that lease still idle, it counts no
    /// second attempt.
    pub unstarted_preclaim: bool,
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimOutcome {
    /// The message was processed before: drop it.
    Duplicate,
    /// Not claimable, and why.
    Refused(Refusal),
    /// The lease is ours.
    Claimed(Claim),
}

/// Why a claim was refused, as the run stood when the claim statement began (the snapshot in
/// which the inbox showed the message as unprocessed). A delivery whose original commits while
/// the claim waits for the run's row lock reads `Busy`; the worker's next re-check then finds the
/// inbox row and drops it as a duplicate.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such run.
    UnknownRun,
    /// The run does not take steps in this status (it ended, waits for a person, ...).
    Status(RunStatus),
    /// The run is at another position.
    Position(i32),
    /// The run was moved to another workflow version.
    Version(i32),
    /// Another live worker holds the lease.
    Busy,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    seen: bool,
    took_over: bool,
    fence: Option<i64>,
    status: Option<RunStatus>,
    input: Option<Value>,
    age_secs: Option<f64>,
    undo: Option<sqlx::types::Json<UndoPlan>>,
    shadow: Option<bool>,
    parent_run_id: Option<String>,
    attempts: Option<i32>,
    journaled: i32,
    run_status: Option<RunStatus>,
    run_seq: Option<i32>,
    run_version: Option<i32>,
}

/// The claim statement for any number of requests ("items", numbered from 1 in binding order).
/// A lease is free when released, expired, the asker's own (a delivery retried in place after an
/// infrastructure failure), held by a process whose presence connection is gone (it died:
/// kill -9 closes its sockets, so Postgres ends its backend), or idle (a pre-claim, see
/// `checkpoint::PreClaim`). A pre-claim counted the attempt already: a first delivery that takes
/// it while its holder lives is that attempt (the holder never got the message) and no
/// takeover; a redelivery, or any delivery once the holder is gone, may follow a holder that
/// started the step and died, and counts as another. Two requests for the
/// same run in one batch (two deliveries of its step) update the row once; the other is refused.
const CLAIM: &str = "WITH req AS (
        SELECT * FROM UNNEST($1::text[], $2::int4[], $3::text[], $4::float8[], $5::int4[], $6::text[],
                             $7::text[], $8::uuid[], $10::bool[], $11::bool[], $12::int4[])
          WITH ORDINALITY AS r(run_id, seq, owner, lease_secs, pid, step, consumer, message_id,
                               redelivered, unstarted, version, n)
    ), seen AS (
        SELECT r.n FROM req r JOIN trailmark.inbox i ON i.consumer = r.consumer AND i.message_id = r.message_id
    ), lease AS (
        -- Who held the lease before this statement (its snapshot): a claim that takes a lease
        -- held by another owner is a takeover, unless it takes an idle pre-claim (whose attempt
        -- its commit counted) that the holder cannot have started: on a first delivery while
        -- the holder lives, or once the holder is gone without a trace of the step (no effect
        -- under its fence, no journal entry of its own at the position). A dead worker's
        -- prefetched messages come back redelivered, mostly never started; counting each of
        -- them would stop healthy runs for review after a few worker deaths. The holder itself
        -- taking back a pre-claim it never started (`unstarted`) is no takeover either.
        SELECT r.n, u.lease_expires_at IS NULL
                    AND (r.unstarted AND u.lease_owner = r.owner OR CASE WHEN trailmark.process_gone(u.lease_pid)
                             THEN NOT EXISTS (SELECT 1 FROM trailmark.effects e
                                               WHERE e.run_id = r.run_id AND e.seq = r.seq AND e.fence = u.fence)
                                  AND NOT EXISTS (SELECT 1 FROM trailmark.journal j
                                                   WHERE j.run_id = r.run_id AND j.seq = r.seq
                                                     AND j.inherited_from IS NULL)
                             ELSE NOT r.redelivered END) AS first_on_preclaim
          FROM req r JOIN trailmark.runs u ON u.run_id = r.run_id
         WHERE u.lease_owner IS NOT NULL
           AND (u.lease_owner <> r.owner OR r.unstarted AND u.lease_expires_at IS NULL)
    ), claimed AS (
        UPDATE trailmark.runs u
           SET lease_owner = r.owner, lease_expires_at = now() + make_interval(secs => r.lease_secs),
               lease_pid = r.pid, fence = u.fence + 1, updated_at = now()
          FROM req r
         WHERE u.run_id = r.run_id AND u.step_seq = r.seq AND u.workflow_version = r.version
           -- An expression the status index cannot serve: a plan cached while the table was
           -- young would otherwise read every running run through it on each claim.
           AND CASE WHEN u.status = ANY($9::text[]) THEN true ELSE false END
           AND r.n NOT IN (SELECT n FROM seen)
           AND (u.lease_owner IS NULL OR u.lease_expires_at IS NULL OR u.lease_expires_at < now()
                OR u.lease_owner = r.owner OR trailmark.process_gone(u.lease_pid))
        RETURNING r.n, r.run_id, r.seq, r.step, u.fence, u.status, u.input,
                  EXTRACT(EPOCH FROM now() - u.created_at)::float8 AS age_secs, u.undo, u.shadow,
                  u.parent_run_id
    ), attempt AS (
        INSERT INTO trailmark.steps (run_id, seq, step, attempts)
        SELECT c.run_id, c.seq, c.step,
               CASE WHEN c.n IN (SELECT n FROM lease WHERE first_on_preclaim) THEN 0 ELSE 1 END
          FROM claimed c
        ON CONFLICT (run_id, seq) DO UPDATE SET attempts = trailmark.steps.attempts + EXCLUDED.attempts, retry_at = NULL
        RETURNING run_id, seq, attempts
    )
    SELECT r.n IN (SELECT n FROM seen) AS seen,
           r.n IN (SELECT n FROM lease WHERE NOT first_on_preclaim) AS took_over,
           c.fence, c.status, c.input, c.age_secs, c.undo, c.shadow, c.parent_run_id, a.attempts,
           (SELECT count(*) FROM trailmark.journal j WHERE j.run_id = r.run_id AND j.seq = r.seq)::int4 AS journaled,
           o.status AS run_status, o.step_seq AS run_seq, o.workflow_version AS run_version
      FROM req r LEFT JOIN claimed c ON c.n = r.n LEFT JOIN attempt a ON a.run_id = c.run_id AND a.seq = c.seq
      -- Only for a refused claim: the run as it stood, to say why.
      LEFT JOIN LATERAL (SELECT u.status, u.step_seq, u.workflow_version FROM trailmark.runs u
                          WHERE u.run_id = r.run_id AND c.n IS NULL) o ON true
     ORDER BY r.n";

/// Checks the inbox, takes the lease of the run at the request's position if it is free, raises
/// the fence and counts the attempt: one statement, committed before any outside call is made.
pub async fn claim(db: impl PgExecutor<'_>, r: &ClaimRequest) -> Result<ClaimOutcome> {
    let mut outcomes = claim_batch(db, std::slice::from_ref(r)).await?;
    Ok(outcomes.remove(0))
}

/// Claims for several deliveries in one statement on `db` (a transaction of the caller's), each
/// with the outcome [`claim`] would give it; none asked, no statement.
pub async fn claim_in(db: impl PgExecutor<'_>, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    claim_batch(db, reqs).await
}

/// Claims for several deliveries, each with the outcome [`claim`] would give it: in one statement,
/// or one by one when that fails (two processes' batches that lock the same runs in opposite
/// orders deadlock, and one of them is aborted).
pub async fn claim_all<'a>(
    pool: &'a PgPool,
    reqs: &'a [ClaimRequest],
) -> Vec<Result<ClaimOutcome>> {
    let batch = |reqs: &'a [ClaimRequest]| async move {
        let outcomes = claim_batch(pool, reqs).await?;
        Ok(outcomes.into_iter().map(Ok).collect())
    };
    super::batch_or_each("claim", reqs, true, batch, |r| claim(pool, r)).await
}

async fn claim_batch(db: impl PgExecutor<'_>, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
    let text = |f: fn(&ClaimRequest) -> &str| reqs.iter().map(f).collect::<Vec<_>>();
    let rows: Vec<ClaimRow> = sqlx::query_as(CLAIM)
        .bind(text(|r| r.run_id.as_str()))
        .bind(reqs.iter().map(|r| r.seq).collect::<Vec<_>>())
        .bind(text(|r| r.owner.as_str()))
        .bind(reqs.iter().map(|r| r.lease_secs).collect::<Vec<_>>())
        .bind(reqs.iter().map(|r| r.presence_pid).collect::<Vec<_>>())
        .bind(reqs.iter().map(|r| &r.step).collect::<Vec<_>>())
        .bind(text(|r| r.message.0))
        .bind(reqs.iter().map(|r| r.message.1.0).collect::<Vec<_>>())
        .bind(&RunStatus::EXECUTING[..])
        .bind(reqs.iter().map(|r| r.redelivered).collect::<Vec<_>>())
        .bind(reqs.iter().map(|r| r.unstarted_preclaim).collect::<Vec<_>>())
        .bind(reqs.iter().map(|r| r.version).collect::<Vec<_>>())
        .fetch_all(db)
        .await?;
    Ok(rows
        .into_iter()
        .zip(reqs)
        .map(|(row, r)| outcome(row, (r.seq, r.version)))
        .collect())
}

fn outcome(row: ClaimRow, asked: (i32, i32)) -> ClaimOutcome {
    if row.seen {
        return ClaimOutcome::Duplicate;
    }
    let (Some(fence), Some(status), Some(input), Some(age_secs), Some(attempt)) =
        (row.fence, row.status, row.input, row.age_secs, row.attempts)
    else {
        let stood = (row.run_status, row.run_seq, row.run_version);
        return ClaimOutcome::Refused(refusal(stood, asked));
    };
    ClaimOutcome::Claimed(Claim {
        fence: Fence(fence),
        status,
        input,
        age_secs,
        undo: row.undo.map(|plan| plan.0),
        attempt,
        journaled: row.journaled,
        took_over: row.took_over,
        shadow: row.shadow.unwrap_or(false),
        preclaimed: false,
        parent: row.parent_run_id,
        flow: None,
    })
}

/// Why a claim of position and version `asked` was refused, given how the run stood.
fn refusal(
    (status, seq, version): (Option<RunStatus>, Option<i32>, Option<i32>),
    (asked_seq, asked_version): (i32, i32),
) -> Refusal {
    let (Some(status), Some(seq), Some(version)) = (status, seq, version) else {
        return Refusal::UnknownRun;
    };
    if !status.accepts_steps() {
        Refusal::Status(status)
    } else if seq != asked_seq {
        Refusal::Position(seq)
    } else if version != asked_version {
        Refusal::Version(version)
    } else {
        Refusal::Busy
    }
}

/// Extends a held lease and re-stamps the holder's presence pid (the presence connection may
/// have been re-opened since the claim, and a lease naming a gone backend is free to take);
/// `false` means the fence moved on (the caller must stop). The first beat on a pre-claim turns
/// its idle lease into an ordinary one. Position and fence together name the holder: a fence
/// alone could be one that a Postgres crash forgot and a later claim at an earlier position
/// handed out again (see `checkpoint::PreClaim`).
pub async fn heartbeat(
    db: impl PgExecutor<'_>,
    (run_id, seq): (&RunId, i32),
    fence: Fence,
    lease_secs: f64,
    presence_pid: Option<i32>,
) -> Result<bool> {
    let held = [(run_id.clone(), seq, fence)];
    Ok(heartbeat_all(db, &held, lease_secs, presence_pid).await?.is_empty())
}

/// [`heartbeat`] for many leases in one statement (a process renews all its leases at once);
/// returns the ones lost (the fence moved on). A run whose row another transaction holds
/// locked at that moment is neither renewed nor lost: the next beat renews it, where waiting
/// for the lock would hold back every other lease of the process.
pub async fn heartbeat_all(
    db: impl PgExecutor<'_>,
    held: &[(RunId, i32, Fence)],
    lease_secs: f64,
    presence_pid: Option<i32>,
) -> Result<Vec<(RunId, i32, Fence)>> {
    let rows: Vec<(String, i32, i64)> = sqlx::query_as(
        "WITH h AS (
             SELECT * FROM UNNEST($1::text[], $2::int4[], $3::int8[]) AS h(run_id, seq, fence)
         ), held AS (
             SELECT h.* FROM h JOIN trailmark.runs r
                 ON r.run_id = h.run_id AND r.fence = h.fence AND r.step_seq = h.seq
              WHERE r.lease_owner IS NOT NULL
         ), free AS (
             SELECT r.run_id FROM trailmark.runs r JOIN held USING (run_id)
                FOR UPDATE OF r SKIP LOCKED
         ), renewed AS (
             UPDATE trailmark.runs u
                SET lease_expires_at = now() + make_interval(secs => $4), lease_pid = $5
               FROM free, held
              WHERE u.run_id = free.run_id AND held.run_id = u.run_id AND u.fence = held.fence
                AND u.step_seq = held.seq AND u.lease_owner IS NOT NULL
         )
         SELECT h.run_id, h.seq, h.fence FROM h
          WHERE NOT EXISTS (SELECT 1 FROM held
                             WHERE held.run_id = h.run_id AND held.seq = h.seq AND held.fence = h.fence)",
    )
    .bind(held.iter().map(|h| h.0.as_str()).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.1).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.2.0).collect::<Vec<_>>())
    .bind(lease_secs)
    .bind(presence_pid)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(run_id, seq, fence)| Some((RunId::try_from(run_id).ok()?, seq, Fence(fence))))
        .collect())
}

/// Stores the undo plan its compensation steps read (targets, scope, writes left standing).
pub async fn set_undo_plan(db: impl PgExecutor<'_>, run_id: &str, plan: &UndoPlan) -> Result<()> {
    sqlx::query("UPDATE trailmark.runs SET undo = $2 WHERE run_id = $1")
        .bind(run_id)
        .bind(sqlx::types::Json(plan))
        .execute(db)
        .await?;
    Ok(())
}

/// Gives a lease back without advancing the run (its step is retried after `delay_secs` from a
/// delay queue), and notes on the step when it runs again and why it failed. Checked by position
/// and fence, as [`heartbeat`]. `give_back`: the attempt its claim counted is taken back with the
/// lease (a wait on an open circuit breaker or a model's rate limit made no call); a crash
/// before this statement leaves the attempt counted, as every crash does.
pub async fn release(
    db: impl PgExecutor<'_>,
    (run_id, seq): (&RunId, i32),
    fence: Fence,
    (delay_secs, give_back): (f64, bool),
    error: &str,
) -> Result<()> {
    sqlx::query(
        "WITH released AS (
            UPDATE trailmark.runs SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
             WHERE run_id = $1 AND fence = $2 AND step_seq = $5
            RETURNING run_id, step_seq
         )
         UPDATE trailmark.steps s SET retry_at = now() + make_interval(secs => $3), last_error = $4,
                attempts = CASE WHEN $6 THEN GREATEST(s.attempts - 1, 0) ELSE s.attempts END
           FROM released r WHERE s.run_id = r.run_id AND s.seq = r.step_seq",
    )
    .bind(run_id.as_str())
    .bind(fence.0)
    .bind(delay_secs)
    .bind(error)
    .bind(seq)
    .bind(give_back)
    .execute(db)
    .await?;
    Ok(())
}

/// Gives back pre-claims whose steps never started (`checkpoint::PreClaim`; a stopping worker's,
/// so that the next worker's claim counts the attempt as the first): each idle lease still held
/// under its fence at its position is freed, and the attempt the pre-claim counted is taken back.
pub async fn release_preclaims(
    db: impl PgExecutor<'_>,
    held: &[(RunId, Fence, i32)],
) -> Result<u64> {
    if held.is_empty() {
        return Ok(0);
    }
    let done = sqlx::query(
        "WITH freed AS (
            UPDATE trailmark.runs r SET lease_owner = NULL, lease_pid = NULL, updated_at = now()
              FROM UNNEST($1::text[], $2::int8[], $3::int4[]) AS h(run_id, fence, seq)
             WHERE r.run_id = h.run_id AND r.fence = h.fence AND r.step_seq = h.seq
               AND r.lease_owner IS NOT NULL AND r.lease_expires_at IS NULL
            RETURNING r.run_id, r.step_seq
         )
         UPDATE trailmark.steps s SET attempts = s.attempts - 1
           FROM freed f WHERE s.run_id = f.run_id AND s.seq = f.step_seq AND s.attempts > 0",
    )
    .bind(held.iter().map(|h| h.0.as_str()).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.1.0).collect::<Vec<_>>())
    .bind(held.iter().map(|h| h.2).collect::<Vec<_>>())
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}

/// A run whose lease expired without progress, taken back by [`take_expired_leases`].
#[derive(Debug, sqlx::FromRow)]
pub struct ExpiredLease {
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// The workflow version it follows.
    pub workflow_version: i32,
    /// The step its worker was executing.
    pub step: StepAddress,
    /// That step's position.
    pub step_seq: i32,
    /// The run's trace context, for the re-queued message's `traceparent` header.
    pub traceparent: Option<String>,
}

/// Voids up to `limit` expired leases of executing runs (fence + 1, so their holders can never
/// commit) and returns those runs, oldest expiry first, for their steps to be queued again in the
/// caller's transaction. Rows other scanners hold are skipped.
pub async fn take_expired_leases(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<ExpiredLease>> {
    Ok(sqlx::query_as(
        "UPDATE trailmark.runs r
            SET lease_owner = NULL, lease_expires_at = NULL, fence = r.fence + 1, updated_at = now()
           FROM (SELECT run_id FROM trailmark.runs
                  WHERE lease_owner IS NOT NULL AND lease_expires_at < now()
                    AND status = ANY($1::text[]) AND step IS NOT NULL
                  ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED) e
          WHERE r.run_id = e.run_id
      RETURNING r.run_id, r.workflow, r.workflow_version, r.step, r.step_seq, r.traceparent",
    )
    .bind(&RunStatus::EXECUTING[..])
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// A waiting run escalated by [`escalate_waiting`].
#[derive(Debug, sqlx::FromRow)]
pub struct Escalated {
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// What it waited for (the note it had), wrapped into the review note.
    pub handover: Option<Value>,
    /// The position it waits at.
    pub step_seq: i32,
    /// The step it waits at.
    pub step: Option<StepAddress>,
    /// Its workflow version.
    pub workflow_version: i32,
}

/// Moves up to `limit` runs that have waited for a person longer than `after_secs` to
/// needs_review, keeping what they waited for in the note; returns them for their decisions to be
/// recorded in the caller's transaction. Child runs are left to [`escalate_child`] (their parent's
/// row must be locked first).
///
/// Reads the runs waiting for a person since before the cut-off, through
/// `runs_person_waits_idx`, and nothing else: the status and the note kinds are written out (not
/// bound) so that the generic plan can use that partial index, and runs waiting for an event or
/// a time are not in it. Reading every waiting run through the status index cost 27 ms a scan at
/// 100,000 waiting (docs/BENCHMARKS.md, "Periodic queries at 100 and 100,000 runs in flight").
pub async fn escalate_waiting(
    db: impl PgExecutor<'_>,
    after_secs: u64,
    limit: i64,
) -> Result<Vec<Escalated>> {
    escalate(db, after_secs, (None, limit)).await
}

/// Escalates the child run `run_id` as [`escalate_waiting`] does, if it still qualifies, in the
/// caller's transaction (which locked its parent's row first, see `store::children`).
pub async fn escalate_child(
    db: impl PgExecutor<'_>,
    after_secs: u64,
    run_id: &str,
) -> Result<Option<Escalated>> {
    Ok(escalate(db, after_secs, (Some(run_id), 1)).await?.pop())
}

/// Up to `limit` child runs (with their parents) that [`escalate_child`] would escalate now;
/// nothing is locked.
pub async fn late_children(
    db: impl PgExecutor<'_>,
    after_secs: u64,
    limit: i64,
) -> Result<Vec<(String, String)>> {
    let sql = format!(
        "SELECT u.run_id, u.parent_run_id FROM trailmark.runs u {LATE}
            AND u.parent_run_id IS NOT NULL ORDER BY u.waiting_since LIMIT $2"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(after_secs as i64)
        .bind(limit)
        .fetch_all(db)
        .await?)
}

/// Runs (`u`) waiting for a person longer than `$1` seconds (see [`escalate_waiting`] for why
/// the status and note kinds are written out).
const LATE: &str = "WHERE u.status = 'waiting' AND (u.handover->>'waiting_for') IN ('decision', 'approval')
                  AND u.waiting_since < now() - make_interval(secs => $1::float8)
                  -- Not moved since it started waiting.
                  AND u.updated_at < now() - make_interval(secs => $1::float8)
                  -- A run waiting for an event or a time has a timeout of its own.
                  AND NOT EXISTS (SELECT 1 FROM trailmark.waits t
                                   WHERE t.run_id = u.run_id AND t.resolved_at IS NULL)";

/// Escalates late runs: only `run_id` when given, else up to `limit` runs that no fan-out
/// started. One statement for each (no `CASE` on a bound parameter, which would keep the generic
/// plan off the partial index).
async fn escalate(
    db: impl PgExecutor<'_>,
    after_secs: u64,
    (run_id, limit): (Option<&str>, i64),
) -> Result<Vec<Escalated>> {
    let to = RunStatus::Waiting
        .move_to(RunStatus::NeedsReview)
        .expect("the status table lets a waiting run be escalated");
    let which = match run_id {
        Some(_) => "u.run_id = $4",
        None => "u.parent_run_id IS NULL",
    };
    let sql = format!(
        "UPDATE trailmark.runs r SET status = $2, updated_at = now(),
                handover = jsonb_build_object('waiting_for', r.handover, 'error_class', 'human_timeout',
                    'error', format('no decision within %s s; approve or reject, or resume to ask again', $1::bigint))
           FROM (SELECT u.run_id FROM trailmark.runs u {LATE} AND {which}
                  ORDER BY u.waiting_since LIMIT $3 FOR UPDATE SKIP LOCKED) w
          WHERE r.run_id = w.run_id
      RETURNING r.run_id, r.workflow, r.handover, r.step_seq, r.step, r.workflow_version"
    );
    let query = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(after_secs as i64)
        .bind(to.to)
        .bind(limit);
    let query = match run_id {
        Some(id) => query.bind(id),
        None => query,
    };
    Ok(query.fetch_all(db).await?)
}

/// Reads a run and locks its row until the caller's transaction ends (operator decisions).
pub async fn lock(db: impl PgExecutor<'_>, run_id: &str) -> Result<Option<RunRow>> {
    Ok(
        sqlx::query_as("SELECT * FROM trailmark.runs WHERE run_id = $1 FOR UPDATE")
            .bind(run_id)
            .fetch_optional(db)
            .await?,
    )
}

/// Where an operator decision puts a run.
#[derive(Debug, Clone, Copy)]
pub struct Decided<'a> {
    /// The status move.
    pub status: Transition,
    /// The step it runs next (or stopped at).
    pub step: Option<&'a StepAddress>,
    /// That step's position.
    pub seq: i32,
    /// The workflow version it follows from now on.
    pub version: i32,
}

/// Applies an operator decision: moves the run, voids any lease (fence + 1, so a step in flight
/// commits nothing), clears the error and handover note (the decision row keeps them) and
/// closes the run's open wait for an event or a time, if any (the decision moved it on).
pub async fn set_by_decision(db: impl PgExecutor<'_>, run_id: &str, to: Decided<'_>) -> Result<()> {
    sqlx::query(
        "WITH closed AS (
            UPDATE trailmark.waits SET resolved_at = now(), resolution = 'decision'
             WHERE run_id = $1 AND resolved_at IS NULL
         )
         UPDATE trailmark.runs SET status = $2, step = $3, step_seq = $4, workflow_version = $5,
                fence = fence + 1, lease_owner = NULL, lease_expires_at = NULL, error = NULL,
                handover = NULL, updated_at = now(),
                finished_at = CASE WHEN $6 THEN now() END
          WHERE run_id = $1",
    )
    .bind(run_id)
    .bind(to.status.to)
    .bind(to.step)
    .bind(to.seq)
    .bind(to.version)
    .bind(to.status.to.is_terminal())
    .execute(db)
    .await?;
    Ok(())
}

/// How many runs of a workflow have a status.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Count {
    /// The workflow.
    pub workflow: String,
    /// The status.
    pub status: RunStatus,
    /// How many.
    pub runs: i64,
}

/// Runs by workflow and status.
pub async fn counts(db: impl PgExecutor<'_>) -> Result<Vec<Count>> {
    counts_of(db, &RunStatus::ALL).await
}

/// Runs by workflow and status, for `statuses` only: the unfinished ones read only their own
/// entries of the status index, where counting every status reads one entry per run ever kept.
/// The statuses are written into the statement: as a parameter of a generic plan the planner
/// cannot tell how few runs they hold, and starts parallel workers (about 15 ms) for 100.
pub async fn counts_of(db: impl PgExecutor<'_>, statuses: &[RunStatus]) -> Result<Vec<Count>> {
    let listed: Vec<String> = statuses.iter().map(|s| format!("'{}'", s.as_str())).collect();
    let sql = format!(
        "SELECT workflow, status, count(*) AS runs FROM trailmark.runs
          WHERE status IN ({})
          GROUP BY workflow, status ORDER BY workflow, status",
        listed.join(", ")
    );
    // The statuses' own names, fixed in the code: nothing from outside is spliced in.
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(db).await?)
}

/// Which runs a listing shows.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this status.
    pub status: Option<RunStatus>,
    /// Only this workflow.
    pub workflow: Option<String>,
    /// Created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Created before.
    pub until: Option<DateTime<Utc>>,
    /// Only runs retrying or stuck: their step is on a second attempt or more, waits in a delay
    /// queue, or its lease expired.
    pub stuck: bool,
    /// Continue after this run (the previous page's last), newest first.
    pub after: Option<(DateTime<Utc>, String)>,
    /// Only the child runs of this run.
    pub parent: Option<String>,
}

/// A run as a listing shows it, with the state of its current step.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Summary {
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// The workflow version it follows.
    pub workflow_version: i32,
    /// Where it stands.
    pub status: RunStatus,
    /// The step it runs next (or stopped at).
    pub step: Option<StepAddress>,
    /// That step's position.
    pub step_seq: i32,
    /// Claims of that step so far.
    pub attempts: i32,
    /// When that step runs again, while it waits in a delay queue.
    pub retry_at: Option<DateTime<Utc>>,
    /// Its last temporary failure.
    pub last_error: Option<String>,
    /// The run's error or handover reason.
    pub error: Option<String>,
    /// Who holds its lease.
    pub lease_owner: Option<String>,
    /// Until when.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// The run whose step started it (a child run).
    pub parent_run_id: Option<String>,
}

impl Summary {
    /// Where the next page starts: this run's creation time (microseconds) and id.
    pub fn cursor(&self) -> String {
        format!("{}.{}", self.created_at.timestamp_micros(), self.run_id)
    }
}

/// The newest `limit` runs whose id starts with `prefix` (a schedule's runs): id and status.
pub async fn with_prefix(
    db: impl PgExecutor<'_>,
    prefix: &str,
    limit: i64,
) -> Result<Vec<(String, String)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, status FROM trailmark.runs
          WHERE run_id LIKE $1 ORDER BY created_at DESC, run_id DESC LIMIT $2",
    )
    .bind(super::inspect::like_prefix(prefix))
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// A cursor handed out by [`Summary::cursor`], as [`Filter::after`] takes it; `None` when it is
/// not one.
pub fn parse_cursor(cursor: &str) -> Option<(DateTime<Utc>, String)> {
    let (micros, run_id) = cursor.split_once('.')?;
    let at = DateTime::from_timestamp_micros(micros.parse().ok()?)?;
    Some((at, run_id.to_owned()))
}

/// A page of runs, newest first.
pub async fn page(db: impl PgExecutor<'_>, f: &Filter, limit: i64) -> Result<Vec<Summary>> {
    let (after_at, after_id) = f.after.clone().unzip();
    Ok(sqlx::query_as(
        "SELECT r.run_id, r.workflow, r.workflow_version, r.status, r.step, r.step_seq,
                COALESCE(s.attempts, 0) AS attempts, s.retry_at, s.last_error, r.error,
                r.lease_owner, r.lease_expires_at, r.created_at, r.updated_at, r.parent_run_id
           FROM trailmark.runs r
           LEFT JOIN trailmark.steps s ON s.run_id = r.run_id AND s.seq = r.step_seq
          WHERE ($1::text IS NULL OR r.status = $1)
            AND ($2::text IS NULL OR r.workflow = $2)
            AND ($3::timestamptz IS NULL OR r.created_at >= $3)
            AND ($4::timestamptz IS NULL OR r.created_at < $4)
            AND ($5::timestamptz IS NULL OR (r.created_at, r.run_id) < ($5, $6))
            AND (NOT $7 OR (r.status = ANY($8::text[]) AND (
                    COALESCE(s.attempts, 0) > 1 OR r.lease_expires_at < now()
                 OR (r.lease_owner IS NULL AND s.finished_at IS NULL AND s.attempts >= 1))))
            AND ($10::text IS NULL OR r.parent_run_id = $10)
          ORDER BY r.created_at DESC, r.run_id DESC LIMIT $9",
    )
    .bind(f.status)
    .bind(f.workflow.as_deref())
    .bind(f.since)
    .bind(f.until)
    .bind(after_at)
    .bind(after_id)
    .bind(f.stuck)
    .bind(&RunStatus::EXECUTING[..])
    .bind(limit)
    .bind(f.parent.as_deref())
    .fetch_all(db)
    .await?)
}

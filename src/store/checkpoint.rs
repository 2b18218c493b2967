//! The step commit as one statement: inbox row, fenced run advance,
//! checkpoint, parked items, local writes and outbox rows, all or nothing, for one step or for
//! several steps that reached their commit at the same moment (group commit).
//!
//! One statement instead of a transaction of six: a step's cost is dominated by round trips and
//! per-statement set-up, and a single statement is atomic by itself. The one case that needs a
//! rollback (an inbox row went in but its fence check failed) is handled inside the statement by
//! `trailmark.refuse_commit`, which aborts it; a refused batch is then committed step by step, so
//! one stale worker's step never takes the others down with it. A local write whose key holds
//! other values aborts it the same way (`trailmark.refuse_local_write`).

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::Value;
use sqlx::{PgExecutor, PgPool};

use super::outbox;
use super::{Error, Result};
use crate::domain::{Fence, LocalTable, LocalWrite, MessageId, NewWait, OutgoingMessage, RunId};
use crate::domain::{StepAddress, Transition};

/// Where a committed step leaves the run.
#[derive(Debug, Clone)]
pub struct Advance {
    /// Position just executed.
    pub seq: i32,
    /// Next step, `None` when the run ends.
    pub next_step: Option<StepAddress>,
    /// The status move this commit makes.
    pub status: Transition,
    /// Final output, when the run ends.
    pub output: Option<Value>,
    /// Error text for review/failed states.
    pub error: Option<String>,
    /// Handover note, when the run goes to a person.
    pub handover: Option<Value>,
}

/// Everything one step commit writes (owned, so a group-commit task can carry it).
#[derive(Debug, Clone)]
pub struct StepCommit {
    /// The run.
    pub run_id: RunId,
    /// The committer's fence.
    pub fence: Fence,
    /// The step (for parked items).
    pub step: StepAddress,
    /// The run's new head.
    pub to: Advance,
    /// The step row's new output: the checkpoint, or a waiting step's question.
    pub step_output: Option<Value>,
    /// Whether the step is finished (a waiting step is not).
    pub finished: bool,
    /// The inbox consumer and the delivery's message id.
    pub inbox: (&'static str, MessageId),
    /// Items the step parked (id, reason).
    pub parked: Vec<(String, String)>,
    /// Messages to queue.
    pub outbox: Vec<OutgoingMessage>,
    /// Rows written into tables of trailmark's database (`ctx.local_write`).
    pub local_writes: Vec<LocalWrite>,
    /// Takes the run's lease for its next position in the same statement (see [`PreClaim`]).
    pub preclaim: Option<PreClaim>,
    /// What the run waits for after the step (an event or a time): registered in the commit's
    /// own transaction (`crate::wait`, through [`commit_first`]), never by [`commit_all`].
    pub wait: Option<NewWait>,
    /// For the commit that ends a child run, its parent: the child is counted in its fan-out
    /// in the commit's own transaction (`crate::wait::children`), never by [`commit_all`].
    pub ends_child_of: Option<String>,
}

/// The committer's claim on the run's next position, made by the commit itself so that the
/// next step's delivery, when it comes back to the same worker, needs no claim statement.
///
/// The lease it leaves is idle: it names the owner and its presence pid but no expiry, so the
/// supervisor never voids it and any worker's claim may take it (a delivery that went to
/// another worker is not kept waiting). Its holder starts the step on the fence it knows
/// (the commit's + 1) without a statement; the first heartbeat turns the lease into an ordinary
/// one. Fence + 1 and position + 1 move together, so a pre-claim that a Postgres crash forgot
/// can never match the run again: every way on from the surviving state raises the fence
/// without moving the position first (a claim, a voided lease, a decision).
#[derive(Debug, Clone)]
pub struct PreClaim {
    /// Lease owner to record.
    pub owner: String,
    /// The owner's presence pid.
    pub pid: Option<i32>,
}

/// What a pre-claim counted at the next position, as a claim reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NextClaim {
    /// Which attempt at the position the pre-claim is (1-based).
    pub attempt: i32,
    /// Journal entries already recorded at the position.
    pub journaled: i32,
    /// Seconds since the run was created, at the commit (database clock).
    pub age_secs: f64,
}

/// What a commit did with its step.
#[derive(Debug, Clone, PartialEq)]
pub enum Committed {
    /// The step is committed, and with `preclaimed` the next position is claimed for its
    /// committer.
    Done {
        /// The pre-claim's counts, when the commit made one.
        preclaimed: Option<NextClaim>,
        /// The outbox row ids of the step's messages, in their order.
        rows: Vec<i64>,
    },
    /// Another delivery of the same message committed first: nothing was written.
    Duplicate,
}

/// The commit statement for any number of steps ("items", numbered from 1 in binding order);
/// the parked-items part only when a step parked something, and one local-write part per table
/// written, because every data-changing part costs its executor set-up on each step even when
/// it writes nothing.
fn commit_sql(shape: Shape, tables: &[&LocalTable]) -> String {
    let Shape {
        parked: with_parked,
        merge_next,
    } = shape;
    // The next position has no row yet (positions are only ever claimed after the run reached
    // them), so its row is inserted; a speculative insert would cost one more WAL record per
    // step. Should it exist after all, the statement fails on the key and [`commit`] runs the
    // merging form.
    let merge = if merge_next {
        "ON CONFLICT (run_id, seq) DO UPDATE SET attempts = trailmark.steps.attempts + 1, retry_at = NULL"
    } else {
        ""
    };
    let committed = "item IN (SELECT n FROM adv)";
    let park = if with_parked {
        ", park AS (
            INSERT INTO trailmark.parked (run_id, item, seq, step, reason)
            SELECT i.run_id, p.item, i.seq, i.step, p.reason
              FROM UNNEST($16::int8[], $17::text[], $18::text[]) AS p(n, item, reason)
              JOIN item i ON i.n = p.n
             WHERE p.n IN (SELECT n FROM adv)
            ON CONFLICT (run_id, item) DO NOTHING
        )"
    } else {
        // Keeps the parameter numbering: $16 to $18 are bound either way.
        ", park AS (SELECT $16::int8[], $17::text[], $18::text[])"
    };
    // $29 and $30 (what the step rows keep of their local writes) are bound either way too.
    let (labels, set_labels, join_labels) = if tables.is_empty() {
        (", labels AS (SELECT $29::int8[], $30::jsonb[])", "", "")
    } else {
        (
            ", labels AS (
                SELECT n, jsonb_agg(label ORDER BY o) AS labels
                  FROM UNNEST($29::int8[], $30::jsonb[]) WITH ORDINALITY AS l(n, label, o) GROUP BY n
            )",
            ", local_writes = l.labels",
            " LEFT JOIN labels l ON l.n = i.n",
        )
    };
    let writes: String = tables
        .iter()
        .enumerate()
        .map(|(t, table)| local_write_sql(table, 31 + 2 * t))
        .collect();
    format!(
        "WITH item AS (
            SELECT * FROM UNNEST($1::text[], $2::int8[], $3::int4[], $4::text[], $5::text[], $6::jsonb[],
                                 $7::text[], $8::jsonb[], $9::jsonb[], $10::bool[], $11::text[], $12::uuid[], $13::text[],
                                 $14::bool[], $15::bool[], $27::text[], $28::int4[])
              WITH ORDINALITY AS i(run_id, fence, seq, next_step, status, output, error, handover,
                                   step_output, finished, consumer, message_id, step, advances, ends,
                                   preclaim, preclaim_pid, n)
        ), fresh AS (
            -- Not merged: a repeated message makes the statement fail on the key (see `commit`),
            -- which costs less than a speculative insert on every step.
            INSERT INTO trailmark.inbox (consumer, message_id) SELECT consumer, message_id FROM item
        ), adv AS (
            UPDATE trailmark.runs r
               SET step_seq = r.step_seq + CASE WHEN i.advances THEN 1 ELSE 0 END,
                   step = i.next_step, status = i.status, output = COALESCE(i.output, r.output),
                   error = i.error, handover = i.handover,
                   -- A pre-claim (see `PreClaim`): an idle lease on the next position, fence + 1.
                   lease_owner = i.preclaim, lease_expires_at = NULL, lease_pid = i.preclaim_pid,
                   fence = r.fence + CASE WHEN i.preclaim IS NULL THEN 0 ELSE 1 END,
                   updated_at = now(), finished_at = CASE WHEN i.ends THEN now() END
              FROM item i
             WHERE r.run_id = i.run_id AND r.fence = i.fence AND r.step_seq = i.seq
            RETURNING i.n, EXTRACT(EPOCH FROM now() - r.created_at)::float8 AS age_secs
        ), pre AS (
            -- The pre-claim's attempt, counted as a claim counts it.
            INSERT INTO trailmark.steps (run_id, seq, step, attempts)
            SELECT i.run_id, i.seq + 1, i.next_step, 1 FROM item i
             WHERE i.preclaim IS NOT NULL AND i.n IN (SELECT n FROM adv)
            {merge}
            RETURNING run_id, attempts,
                      -- As the claim counts them: a fork may carry answers for a replay.
                      (SELECT count(*) FROM trailmark.journal j
                        WHERE j.run_id = trailmark.steps.run_id AND j.seq = trailmark.steps.seq)::int4 AS journaled
        ){labels}, checkpoint AS (
            UPDATE trailmark.steps s SET output = i.step_output, finished_at = CASE WHEN i.finished THEN now() END{set_labels}
              FROM item i{join_labels}
             WHERE s.run_id = i.run_id AND s.seq = i.seq AND i.step_output IS NOT NULL
               AND i.n IN (SELECT n FROM adv)
        ){park}{writes}, {queue}
        SELECT CASE WHEN i.n IN (SELECT n FROM adv) THEN 'committed'
                    ELSE trailmark.refuse_commit(i.run_id, i.fence) END,
               p.attempts, p.journaled, a.age_secs,
               ARRAY(SELECT q.id FROM queued_ids q WHERE q.item = i.n ORDER BY q.o) AS outbox_ids
          FROM item i LEFT JOIN adv a ON a.n = i.n
               LEFT JOIN pre p ON p.run_id = i.run_id AND a.n IS NOT NULL
         ORDER BY i.n",
        queue = outbox::insert_items_sql(19, committed),
    )
}

/// The part of the commit statement that writes the committed steps' rows of one local table
/// (item numbers in `$first`, rows as JSON objects in the next parameter). A key already
/// holding a row is left alone when the compared columns agree, and aborts the statement when
/// they differ: `DO UPDATE` sees the newest committed row under the key, even one the
/// statement's snapshot cannot, so a concurrent writer's row is compared too.
fn local_write_sql(table: &LocalTable, first: usize) -> String {
    let (name, quoted, key) = (table.name(), table.quoted(), format!("\"{}\"", table.key()));
    let columns = |prefix: &str, of: &mut dyn Iterator<Item = &'static str>| {
        of.map(|c| format!("{prefix}\"{c}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let compared: Vec<&str> = table.compared().collect();
    let on_conflict = if compared.is_empty() {
        format!("ON CONFLICT ({key}) DO NOTHING")
    } else {
        format!(
            "ON CONFLICT ({key}) DO UPDATE SET {key} = EXCLUDED.{key}
             WHERE ({}) IS DISTINCT FROM ({})
               AND trailmark.refuse_local_write('{name}', EXCLUDED.{key}::text)",
            columns("t.", &mut compared.iter().copied()),
            columns("EXCLUDED.", &mut compared.iter().copied()),
        )
    };
    format!(
        ", write_{first} AS (
            INSERT INTO {quoted} AS t ({})
            SELECT {} FROM UNNEST(${first}::int8[], ${}::jsonb[]) AS w(n, row)
                 CROSS JOIN LATERAL jsonb_populate_record(NULL::{quoted}, w.row) AS r
             WHERE w.n IN (SELECT n FROM adv)
            {on_conflict}
        )",
        columns("", &mut table.columns()),
        columns("r.", &mut table.columns()),
        first + 1,
    )
}

/// Which form of the commit statement a batch needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    /// A step parked items.
    parked: bool,
    /// A pre-claim's next position may already have a row (the plain form failed on its key).
    merge_next: bool,
}

/// The statement for a batch of `shape` writing the local tables `tables` (by identity, in
/// the order their parameters are bound), built once per combination.
fn statement(shape: Shape, tables: &[&'static LocalTable]) -> Arc<str> {
    type Key = (Shape, Vec<usize>);
    static BUILT: LazyLock<Mutex<HashMap<Key, Arc<str>>>> = LazyLock::new(Default::default);
    let key = (
        shape,
        tables
            .iter()
            .map(|t| *t as *const LocalTable as usize)
            .collect(),
    );
    let mut built = BUILT.lock().expect("commit statements lock");
    built
        .entry(key)
        .or_insert_with(|| commit_sql(shape, tables).into())
        .clone()
}

/// The distinct local tables the batch writes to, in first-use order.
fn tables_of(steps: &[StepCommit]) -> Vec<&'static LocalTable> {
    let mut tables: Vec<&'static LocalTable> = Vec::new();
    for w in steps.iter().flat_map(|c| &c.local_writes) {
        if !tables.iter().any(|t| std::ptr::eq(*t, w.table)) {
            tables.push(w.table);
        }
    }
    tables
}

/// Commits one step; [`Committed::Duplicate`] means another delivery of the same message
/// committed first, [`Error::FencedOut`] that a newer worker holds the run (or it moved on).
/// Nothing is written in either case.
pub async fn commit(db: &PgPool, c: &StepCommit) -> Result<Committed> {
    let one = std::slice::from_ref(c);
    let mut done = commit_batch(db, one, false).await;
    if done.as_ref().is_err_and(next_row_exists) {
        done = commit_batch(db, one, true).await;
    }
    match done {
        Ok(verdicts) => verdict(&verdicts[0], c),
        Err(e) if not_advanced(&e) => repeat(db, c).await,
        Err(e) => Err(refused(e, c)),
    }
}

/// Commits one step as the first writes of a longer transaction (a wait's registration, a
/// child's count in its parent's fan-out), after whatever locks the caller took in `tx`.
/// `Continue`: the step went in; go on in the transaction. `Break`: it did not (a repeat, fenced
/// out, a failure); the transaction is rolled back and the answer is the caller's to return.
pub async fn commit_first<'c>(
    pool: &PgPool,
    mut tx: sqlx::Transaction<'c, sqlx::Postgres>,
    c: &StepCommit,
) -> ControlFlow<Result<Committed>, (sqlx::Transaction<'c, sqlx::Postgres>, Committed)> {
    let answer = match commit_batch(&mut *tx, std::slice::from_ref(c), false).await {
        Ok(verdicts) => match verdict(&verdicts[0], c) {
            Ok(committed @ Committed::Done { .. }) => return ControlFlow::Continue((tx, committed)),
            other => other,
        },
        // The refusal aborted the transaction: it is rolled back before the pool is asked
        // what the refusal was.
        Err(e) => match tx.rollback().await {
            Ok(()) if not_advanced(&e) => return ControlFlow::Break(repeat(pool, c).await),
            Ok(()) => return ControlFlow::Break(Err(refused(e, c))),
            Err(rollback) => return ControlFlow::Break(Err(rollback.into())),
        },
    };
    ControlFlow::Break(match tx.rollback().await {
        Ok(()) => answer,
        Err(rollback) => Err(rollback.into()),
    })
}

/// Whether the pre-claim's insert of the next position's row met a row already there.
fn next_row_exists(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.constraint() == Some("steps_pkey"))
}

/// Whether the commit was refused because the run did not move (a stale fence, or a position
/// already passed) or because its message's inbox row exists.
fn not_advanced(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| {
        d.code().as_deref() == Some("TMF01") || d.constraint() == Some("inbox_pkey")
    })
}

/// Why a commit was refused: a duplicate when another delivery of the same message committed
/// first while the committer's fence is still the run's, else fenced out (a stale fence is
/// reported as such even when the newer worker committed the message: that is what the
/// operator needs to read in the log).
async fn repeat(db: &PgPool, c: &StepCommit) -> Result<Committed> {
    let duplicate: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.runs WHERE run_id = $1 AND fence = $2)
            AND EXISTS (SELECT 1 FROM trailmark.inbox WHERE consumer = $3 AND message_id = $4)",
    )
    .bind(c.run_id.as_str())
    .bind(c.fence.0)
    .bind(c.inbox.0)
    .bind(c.inbox.1.0)
    .fetch_one(db)
    .await?;
    if duplicate {
        Ok(Committed::Duplicate)
    } else {
        Err(fenced_out(c))
    }
}

/// Commits several steps, each with the outcome [`commit`] would give it: in one statement when
/// none is refused, else one by one (a stale fence or a lock conflict between two processes'
/// batches aborts the whole statement, and must not cost the other steps their commit).
pub async fn commit_all<'a>(pool: &'a PgPool, steps: &'a [StepCommit]) -> Vec<Result<Committed>> {
    let batch = |steps: &'a [StepCommit]| async move {
        let verdicts = commit_batch(pool, steps, false).await?;
        Ok(steps
            .iter()
            .zip(&verdicts)
            .map(|(c, v)| verdict(v, c))
            .collect())
    };
    super::batch_or_each("commit", steps, true, batch, |c| commit(pool, c)).await
}

/// One step's answer in a commit statement: its verdict, the pre-claim's counts if it made one,
/// and its outbox row ids.
type Verdict = (String, Option<NextClaim>, Vec<i64>);

async fn commit_batch(
    db: impl PgExecutor<'_>,
    steps: &[StepCommit],
    merge_next: bool,
) -> std::result::Result<Vec<Verdict>, sqlx::Error> {
    let parked: Vec<(i64, &(String, String))> = numbered(steps, |c| c.parked.iter());
    let tables = tables_of(steps);
    let shape = Shape {
        parked: !parked.is_empty(),
        merge_next,
    };
    let sql = statement(shape, &tables);
    let writes: Vec<(i64, &LocalWrite)> = numbered(steps, |c| c.local_writes.iter());
    let queued: Vec<(i64, &OutgoingMessage)> = numbered(steps, |c| c.outbox.iter());
    let col = |f: fn(&StepCommit) -> Option<&str>| steps.iter().map(f).collect::<Vec<_>>();
    let json = |f: fn(&StepCommit) -> Option<&Value>| steps.iter().map(f).collect::<Vec<_>>();
    let flag =
        |f: fn(&Transition) -> bool| steps.iter().map(|c| f(&c.to.status)).collect::<Vec<_>>();
    let q = sqlx::query(sqlx::AssertSqlSafe(&*sql))
        .bind(col(|c| Some(c.run_id.as_str())))
        .bind(steps.iter().map(|c| c.fence.0).collect::<Vec<_>>())
        .bind(steps.iter().map(|c| c.to.seq).collect::<Vec<_>>())
        .bind(col(|c| c.to.next_step.as_ref().map(StepAddress::as_str)))
        .bind(steps.iter().map(|c| c.to.status.to).collect::<Vec<_>>())
        .bind(json(|c| c.to.output.as_ref()))
        .bind(col(|c| c.to.error.as_deref()))
        .bind(json(|c| c.to.handover.as_ref()))
        .bind(json(|c| c.step_output.as_ref()))
        .bind(steps.iter().map(|c| c.finished).collect::<Vec<_>>())
        .bind(col(|c| Some(c.inbox.0)))
        .bind(steps.iter().map(|c| c.inbox.1.0).collect::<Vec<_>>())
        .bind(col(|c| Some(c.step.as_str())))
        .bind(flag(|t| t.advances()))
        .bind(flag(|t| t.to.is_terminal()))
        .bind(parked.iter().map(|p| p.0).collect::<Vec<_>>())
        .bind(parked.iter().map(|p| p.1.0.as_str()).collect::<Vec<_>>())
        .bind(parked.iter().map(|p| p.1.1.as_str()).collect::<Vec<_>>());
    let messages: Vec<&OutgoingMessage> = queued.iter().map(|q| q.1).collect();
    let rows = outbox::bind_rows(q, messages.iter().copied())
        .bind(queued.iter().map(|q| q.0).collect::<Vec<_>>())
        .bind(col(|c| c.preclaim.as_ref().map(|p| p.owner.as_str())))
        .bind(
            steps
                .iter()
                .map(|c| c.preclaim.as_ref().and_then(|p| p.pid))
                .collect::<Vec<_>>(),
        )
        .bind(writes.iter().map(|w| w.0).collect::<Vec<_>>())
        .bind(writes.iter().map(|w| w.1.record()).collect::<Vec<_>>());
    let rows = tables
        .iter()
        .fold(rows, |q, table| {
            let mine = writes.iter().filter(|w| std::ptr::eq(w.1.table, *table));
            let (items, rows): (Vec<i64>, Vec<Value>) =
                mine.map(|w| (w.0, Value::Object(w.1.row.clone()))).unzip();
            q.bind(items).bind(rows)
        })
        .fetch_all(db)
        .await?;
    rows.iter().map(verdict_row).collect()
}

/// One row of the commit's answer.
fn verdict_row(row: &sqlx::postgres::PgRow) -> std::result::Result<Verdict, sqlx::Error> {
    use sqlx::Row;
    let (attempt, journaled, age): (Option<i32>, Option<i32>, Option<f64>) =
        (row.try_get(1)?, row.try_get(2)?, row.try_get(3)?);
    let next = match (attempt, journaled, age) {
        (Some(attempt), Some(journaled), Some(age_secs)) => Some(NextClaim {
            attempt,
            journaled,
            age_secs,
        }),
        _ => None,
    };
    Ok((row.try_get(0)?, next, row.try_get(4)?))
}

/// Flattens each step's `rows`, tagged with the step's item number (1-based, as `ORDINALITY`).
fn numbered<'a, T, I>(steps: &'a [StepCommit], rows: impl Fn(&'a StepCommit) -> I) -> Vec<(i64, T)>
where
    I: Iterator<Item = T>,
{
    steps
        .iter()
        .enumerate()
        .flat_map(|(n, c)| rows(c).map(move |r| (n as i64 + 1, r)))
        .collect()
}

/// One step's outcome. A delivery whose fence is stale is reported as fenced out even when the
/// same message was also committed by the newer worker: that is what the operator needs to read
/// in the log.
fn verdict((v, preclaimed, rows): &Verdict, c: &StepCommit) -> Result<Committed> {
    match v.as_str() {
        "committed" => Ok(Committed::Done {
            preclaimed: *preclaimed,
            rows: rows.clone(),
        }),
        _ => Err(fenced_out(c)),
    }
}

fn refused(e: sqlx::Error, c: &StepCommit) -> Error {
    let code = e.as_database_error().and_then(|d| d.code());
    match code.as_deref() {
        Some("TMF01") => fenced_out(c),
        Some(code) if !c.local_writes.is_empty() && refuses_the_row(code) => Error::LocalWrite {
            run_id: c.run_id.to_string(),
            seq: c.to.seq,
            what: local_write_refusal(&e, c),
        },
        _ => e.into(),
    }
}

/// SQLSTATEs a row can earn: the key holding other values (TMF02), data that does not fit its
/// column (class 22), a constraint (class 23), a table or column that is not there (42P01,
/// 42703) or a value of the wrong type (42804).
fn refuses_the_row(code: &str) -> bool {
    code == "TMF02"
        || code.starts_with("22")
        || code.starts_with("23")
        || ["42P01", "42703", "42804"].contains(&code)
}

/// Which local writes the refused commit carried, and what Postgres said.
fn local_write_refusal(e: &sqlx::Error, c: &StepCommit) -> String {
    let said = e
        .as_database_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_else(|| e.to_string());
    let labels: Vec<String> = c.local_writes.iter().map(LocalWrite::label).collect();
    format!(
        "its local write ({}) was refused: {said}",
        labels.join(", ")
    )
}

fn fenced_out(c: &StepCommit) -> Error {
    Error::FencedOut {
        run_id: c.run_id.to_string(),
        fence: c.fence.0,
    }
}

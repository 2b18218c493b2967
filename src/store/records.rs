//! A step's records of what happened, written the moment they are known: model answers
//! (journal entries) and outside calls' results (effects). Several steps' records go in one
//! statement (group commit, see `crate::batch`), on the relaxed pool (see [`super::relaxed_pool`]).

use serde_json::Value;
use sqlx::PgPool;

use super::Result;
use crate::domain::{IdempotencyKey, JournalEntry, RunId};

/// One record to write.
#[derive(Debug, Clone)]
pub enum Record {
    /// A model answer, with the id of the reservation its call made in `model_usage` if its
    /// endpoint is limited (the answer's real usage replaces the estimate in the same
    /// statement); a second writer of the same call keeps the first answer.
    Journal(RunId, JournalEntry, Option<i64>),
    /// The result of the outside call made under the key.
    EffectResult(IdempotencyKey, Value),
}

/// The journal entries of `$1` to `$9` (inserted, not merged: a second writer of the same call
/// makes the statement fail on the key, and [`write_all`] then writes one record at a time and
/// reports that entry as not inserted). A speculative `ON CONFLICT` insert would cost one more
/// WAL record per entry for a case that happens only when a stale worker overlaps a new one.
/// With them, the real usage of the reservations in `$10` (NULL: none), counted from the
/// journaling (the same `now()` as the entry's `created_at`). A statement that fails leaves
/// those reservations at their estimates: counted too long, never too short.
const JOURNAL: &str = "WITH used AS (
        UPDATE trailmark.model_usage m SET tokens = u.tokens, at = now()
          FROM UNNEST($10::int8[], $7::int8[]) AS u(id, tokens)
         WHERE m.id = u.id
    )
    INSERT INTO trailmark.journal (run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms)
    SELECT * FROM UNNEST($1::text[], $2::int4[], $3::int4[], $4::text[], $5::text[], $6::jsonb[],
                         $7::int8[], $8::float8[], $9::int8[])";

/// The effect results of `$1` (keys) and `$2` (results).
const RESULTS: &str = "UPDATE trailmark.effects f SET result = u.result, completed_at = now()
      FROM UNNEST($1::text[], $2::jsonb[]) AS u(key, result)
     WHERE f.idempotency_key = u.key";

/// Journal entries from `$1` to `$9` with their reservations' usage in `$10` (as [`JOURNAL`]),
/// and effect results in `$11` and `$12`, in one statement.
const BOTH: &str = "WITH ins AS (
        INSERT INTO trailmark.journal (run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms)
        SELECT * FROM UNNEST($1::text[], $2::int4[], $3::int4[], $4::text[], $5::text[], $6::jsonb[],
                             $7::int8[], $8::float8[], $9::int8[])
    ), used AS (
        UPDATE trailmark.model_usage m SET tokens = u.tokens, at = now()
          FROM UNNEST($10::int8[], $7::int8[]) AS u(id, tokens)
         WHERE m.id = u.id
    )
    UPDATE trailmark.effects f SET result = u.result, completed_at = now()
      FROM UNNEST($11::text[], $12::jsonb[]) AS u(key, result)
     WHERE f.idempotency_key = u.key";

/// Writes `records`, answering each: for a journal entry whether it went in (`false`: another
/// writer recorded that call first), for an effect result always `true`. One statement, unless
/// an entry's call was journaled already (the statement fails on the key, and the records are
/// then written one at a time) or two entries are for the same call.
pub async fn write_all<'a>(pool: &'a PgPool, records: &'a [Record]) -> Vec<Result<bool>> {
    let batch = |records: &'a [Record]| async move {
        let answers = write(pool, records).await?;
        Ok(answers.into_iter().map(Ok).collect())
    };
    let one = |r: &'a Record| async move {
        match write(pool, std::slice::from_ref(r)).await {
            Err(e) if another_writer_first(&e) => Ok(false),
            written => Ok(written?[0]),
        }
    };
    let batchable = !same_call_twice(records);
    super::batch_or_each("record write", records, batchable, batch, one).await
}

fn same_call_twice(records: &[Record]) -> bool {
    let mut calls: Vec<(&str, i32, i32)> = entries(records)
        .map(|(run, e, _)| (run.as_str(), e.seq, e.call_no))
        .collect();
    let all = calls.len();
    calls.sort_unstable();
    calls.dedup();
    calls.len() != all
}

fn entries(records: &[Record]) -> impl Iterator<Item = (&RunId, &JournalEntry, Option<i64>)> {
    records.iter().filter_map(|r| match r {
        Record::Journal(run, e, reserved) => Some((run, e, *reserved)),
        Record::EffectResult(..) => None,
    })
}

/// Whether a journal insert failed because another writer recorded the same call first.
fn another_writer_first(e: &super::Error) -> bool {
    let Some(sqlx::Error::Database(db)) = e.sqlx_cause() else {
        return false;
    };
    db.constraint() == Some("journal_pkey")
}

/// One statement for all `records` (journal entries, effect results or both); every record
/// went in when it succeeds.
async fn write(pool: &PgPool, records: &[Record]) -> Result<Vec<bool>> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let journal: Vec<(&RunId, &JournalEntry, Option<i64>)> = entries(records).collect();
    let results: Vec<(&str, &Value)> = records
        .iter()
        .filter_map(|r| match r {
            Record::EffectResult(key, v) => Some((key.as_str(), v)),
            Record::Journal(..) => None,
        })
        .collect();
    let sql = match (journal.is_empty(), results.is_empty()) {
        (false, true) => JOURNAL,
        (true, _) => RESULTS,
        (false, false) => BOTH,
    };
    let mut q = sqlx::query(sql);
    if !journal.is_empty() {
        let col = |f: fn(&JournalEntry) -> &str| journal.iter().map(|j| f(j.1)).collect::<Vec<_>>();
        q = q
            .bind(journal.iter().map(|j| j.0.as_str()).collect::<Vec<_>>())
            .bind(journal.iter().map(|j| j.1.seq).collect::<Vec<_>>())
            .bind(journal.iter().map(|j| j.1.call_no).collect::<Vec<_>>())
            .bind(col(|e| e.kind.as_str()))
            .bind(col(|e| e.request_hash.as_str()))
            .bind(journal.iter().map(|j| &j.1.response).collect::<Vec<_>>())
            .bind(journal.iter().map(|j| j.1.tokens).collect::<Vec<_>>())
            .bind(journal.iter().map(|j| j.1.cost).collect::<Vec<_>>())
            .bind(journal.iter().map(|j| j.1.latency_ms).collect::<Vec<_>>())
            .bind(journal.iter().map(|j| j.2).collect::<Vec<_>>());
    }
    if !results.is_empty() {
        q = q
            .bind(results.iter().map(|r| r.0).collect::<Vec<_>>())
            .bind(results.iter().map(|r| r.1).collect::<Vec<_>>());
    }
    q.execute(pool).await?;
    Ok(vec![true; records.len()])
}

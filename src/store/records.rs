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
    /// A model answer; a second writer of the same call keeps the first answer.
    Journal(RunId, JournalEntry),
    /// The result of the outside call made under the key.
    EffectResult(IdempotencyKey, Value),
}

/// Journal entries from `$1` to `$9`, effect results in `$10` and `$11`; returns, per journal
/// entry in binding order, whether it went in.
const WRITE: &str = "WITH entry AS (
        SELECT * FROM UNNEST($1::text[], $2::int4[], $3::int4[], $4::text[], $5::text[], $6::jsonb[],
                             $7::int8[], $8::float8[], $9::int8[])
          WITH ORDINALITY AS e(run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms, n)
    ), ins AS (
        INSERT INTO trailmark.journal (run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms)
        SELECT run_id, seq, call_no, kind, request_hash, response, tokens, cost, latency_ms FROM entry
        ON CONFLICT DO NOTHING
        RETURNING run_id, seq, call_no
    ), result AS (
        UPDATE trailmark.effects f SET result = u.result, completed_at = now()
          FROM UNNEST($10::text[], $11::jsonb[]) AS u(key, result)
         WHERE f.idempotency_key = u.key
    )
    SELECT (e.run_id, e.seq, e.call_no) IN (SELECT run_id, seq, call_no FROM ins)
      FROM entry e ORDER BY e.n";

/// Writes `records`, answering each: for a journal entry whether it went in (`false`: another
/// writer recorded that call first), for an effect result always `true`. One statement, unless
/// two entries are for the same call: the statement could not tell which one went in, so then
/// the batch's records are written one at a time.
pub async fn write_all<'a>(pool: &'a PgPool, records: &'a [Record]) -> Vec<Result<bool>> {
    let batch = |records: &'a [Record]| async move {
        let answers = write(pool, records).await?;
        Ok(answers.into_iter().map(Ok).collect())
    };
    let one = |r: &'a Record| async move { Ok(write(pool, std::slice::from_ref(r)).await?[0]) };
    let batchable = !same_call_twice(records);
    super::batch_or_each("record write", records, batchable, batch, one).await
}

fn same_call_twice(records: &[Record]) -> bool {
    let mut calls: Vec<(&str, i32, i32)> = entries(records)
        .map(|(run, e)| (run.as_str(), e.seq, e.call_no))
        .collect();
    let all = calls.len();
    calls.sort_unstable();
    calls.dedup();
    calls.len() != all
}

fn entries(records: &[Record]) -> impl Iterator<Item = (&RunId, &JournalEntry)> {
    records.iter().filter_map(|r| match r {
        Record::Journal(run, e) => Some((run, e)),
        Record::EffectResult(..) => None,
    })
}

/// One statement for all `records`; the answers follow their order.
async fn write(pool: &PgPool, records: &[Record]) -> Result<Vec<bool>> {
    let journal: Vec<(&RunId, &JournalEntry)> = entries(records).collect();
    let results: Vec<(&str, &Value)> = records
        .iter()
        .filter_map(|r| match r {
            Record::EffectResult(key, v) => Some((key.as_str(), v)),
            Record::Journal(..) => None,
        })
        .collect();
    let col = |f: fn(&JournalEntry) -> &str| journal.iter().map(|j| f(j.1)).collect::<Vec<_>>();
    let inserted: Vec<bool> = sqlx::query_scalar(WRITE)
        .bind(journal.iter().map(|j| j.0.as_str()).collect::<Vec<_>>())
        .bind(journal.iter().map(|j| j.1.seq).collect::<Vec<_>>())
        .bind(journal.iter().map(|j| j.1.call_no).collect::<Vec<_>>())
        .bind(col(|e| e.kind.as_str()))
        .bind(col(|e| e.request_hash.as_str()))
        .bind(journal.iter().map(|j| &j.1.response).collect::<Vec<_>>())
        .bind(journal.iter().map(|j| j.1.tokens).collect::<Vec<_>>())
        .bind(journal.iter().map(|j| j.1.cost).collect::<Vec<_>>())
        .bind(journal.iter().map(|j| j.1.latency_ms).collect::<Vec<_>>())
        .bind(results.iter().map(|r| r.0).collect::<Vec<_>>())
        .bind(results.iter().map(|r| r.1).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
    let mut inserted = inserted.into_iter();
    Ok(records
        .iter()
        .map(|r| match r {
            Record::Journal(..) => inserted.next().unwrap_or(false),
            Record::EffectResult(..) => true,
        })
        .collect())
}

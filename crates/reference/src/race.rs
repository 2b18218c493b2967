//! `trailmark demo race`: two workers post the same entries at the same time (as two workers do
//! after a lease is wrongly taken over, or a message is delivered twice). Both run the same
//! check-then-post code, with a small pause between the check and the insert. Into a table
//! without a key, that leaves duplicates whenever the two interleave; into the ledger, whose
//! reference is the primary key, it cannot. The store's unique key is what is safe.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::Barrier;

use super::Result;
use super::ledger::{self, Entry};

/// What the race measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RaceReport {
    /// Tries per variant.
    pub tries: u32,
    /// Entries both workers post in each try.
    pub entries: u32,
    /// Pause between check and insert, in milliseconds.
    pub pause_ms: u64,
    /// Tries that left a duplicate with check-then-post into an unkeyed table.
    pub check_then_post: u32,
    /// Tries that left a duplicate with the ledger's unique key.
    pub unique_key: u32,
}

impl RaceReport {
    /// The two lines the demo prints.
    pub fn lines(&self) -> [String; 2] {
        [
            format!(
                "check-then-post: {} of {} tries left duplicates",
                self.check_then_post, self.tries
            ),
            format!(
                "unique key: {} of {} tries left duplicates",
                self.unique_key, self.tries
            ),
        ]
    }
}

#[derive(Clone, Copy)]
enum Variant {
    CheckThenPost,
    UniqueKey,
}

/// Runs both variants `tries` times and removes the rows it wrote.
pub async fn run(
    outside: &PgPool,
    tries: u32,
    entries: u32,
    pause: Duration,
) -> Result<RaceReport> {
    let nonce = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut report = RaceReport {
        tries,
        entries,
        pause_ms: pause.as_millis() as u64,
        check_then_post: 0,
        unique_key: 0,
    };
    let outcome = async {
        for t in 1..=tries {
            let try_id = format!("race-{nonce}-{t}");
            if try_once(
                outside,
                Variant::CheckThenPost,
                &format!("{try_id}-a"),
                entries,
                pause,
            )
            .await?
            {
                report.check_then_post += 1;
            }
            if try_once(
                outside,
                Variant::UniqueKey,
                &format!("{try_id}-b"),
                entries,
                pause,
            )
            .await?
            {
                report.unique_key += 1;
            }
        }
        Ok::<_, super::Error>(())
    }
    .await;
    clean(outside, &nonce).await?;
    outcome.map(|()| report)
}

/// One try: both workers post every entry; `true` when duplicates were left behind.
async fn try_once(
    outside: &PgPool,
    variant: Variant,
    try_id: &str,
    entries: u32,
    pause: Duration,
) -> Result<bool> {
    let start = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (pool, start, try_id) = (outside.clone(), start.clone(), try_id.to_owned());
            tokio::spawn(async move {
                start.wait().await;
                for i in 1..=entries {
                    let entry = entry(&try_id, i);
                    check_then_post(&pool, variant, &entry, pause).await?;
                }
                Ok::<_, super::Error>(())
            })
        })
        .collect();
    for w in workers {
        w.await.expect("race worker panicked")?;
    }
    let (rows, distinct): (i64, i64) = match variant {
        Variant::CheckThenPost => sqlx::query_as(
            "SELECT count(*), count(DISTINCT reference) FROM reference.race_unkeyed WHERE try_id = $1",
        )
        .bind(try_id)
        .fetch_one(outside)
        .await?,
        Variant::UniqueKey => ledger::counts(outside, try_id).await?,
    };
    Ok(rows != distinct || distinct != i64::from(entries))
}

/// Check, pause, insert: the same code for both variants; only the table differs.
async fn check_then_post(
    pool: &PgPool,
    variant: Variant,
    entry: &Entry,
    pause: Duration,
) -> Result<()> {
    let exists: bool = match variant {
        Variant::CheckThenPost => {
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM reference.race_unkeyed WHERE try_id = $1 AND reference = $2)")
                .bind(&entry.run_id)
                .bind(&entry.reference)
                .fetch_one(pool)
                .await?
        }
        Variant::UniqueKey => sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM reference.entries WHERE reference = $1)")
            .bind(&entry.reference)
            .fetch_one(pool)
            .await?,
    };
    if exists {
        return Ok(());
    }
    tokio::time::sleep(pause).await;
    match variant {
        Variant::CheckThenPost => {
            sqlx::query("INSERT INTO reference.race_unkeyed (try_id, reference) VALUES ($1, $2)")
                .bind(&entry.run_id)
                .bind(&entry.reference)
                .execute(pool)
                .await?;
        }
        // The other worker may have posted since the check: the ledger recognises the key.
        Variant::UniqueKey => {
            ledger::post(pool, entry, None).await?;
        }
    }
    Ok(())
}

fn entry(try_id: &str, i: u32) -> Entry {
    Entry {
        reference: format!("{try_id}:INV-RACE-{i:04}:1:qty"),
        run_id: try_id.to_owned(),
        invoice_no: format!("INV-RACE-{i:04}"),
        line: 1,
        kind: "qty".into(),
        supplier: "SUP01".into(),
        amount_cents: 100 * i64::from(i),
        reverses: None,
    }
}

async fn clean(outside: &PgPool, nonce: &str) -> Result<()> {
    let pattern = format!("race-{nonce}-%");
    sqlx::query("DELETE FROM reference.race_unkeyed WHERE try_id LIKE $1")
        .bind(&pattern)
        .execute(outside)
        .await?;
    sqlx::query("DELETE FROM reference.entries WHERE run_id LIKE $1")
        .bind(&pattern)
        .execute(outside)
        .await?;
    Ok(())
}

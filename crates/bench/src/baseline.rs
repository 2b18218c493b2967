//! B3, the baseline: the same step semantics as `chain` with none of trailmark's features,
//! written as the fastest bare loop we know how to write, so the report says what the features
//! cost against a strong opponent. Per message: the answer, then ONE statement (dedup row,
//! checkpoint row, ledger row, outbox row; an implicit transaction, one round trip and one WAL
//! flush), then the next message is published at once with a confirm (eager publish; the
//! outbox row is deleted once confirmed, in batches that do not wait for their WAL flush) while
//! the delivery is acknowledged (acks of consecutive deliveries coalesced with `multiple`). A
//! relay publishes, with pipelined confirms, only the rows whose eager publish did not confirm
//! within `relay.eager_grace_ms` (a crash between commit and publish). Same queue type (quorum),
//! same Postgres, same prefetch, one process per trailmark `serve` process. It has no leases,
//! no journal, no effect records, no DLQ, no retries: a failed delivery is simply requeued.
//!
//! Tuning, and what was not done: the step statement and the relay's statements are prepared
//! once per connection (sqlx caches them) and the pool is the bench's `--pool`; one connection
//! per in-flight delivery (128) would not fit Postgres's 100 connections, and a step holds its
//! connection for one round trip only. Eager publish takes the relay's NOTIFY, poll and second
//! commit off the step's path, as trailmark's eager publish does.
//!
//! The price list runs B3 twice more, each time keeping more of the records trailmark's promises
//! rest on ([`Promises`]): every answer journaled when it arrives, then attempts and fencing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Error, Result};
use trailmark::broker::{self, Outgoing, Publisher};
use trailmark::config::Settings;
use trailmark::model::ModelClient;

const SCHEMA: &str = "
CREATE SCHEMA b3;
CREATE TABLE b3.inbox (message_id UUID PRIMARY KEY, processed_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE b3.checkpoints (run_id TEXT NOT NULL, seq INTEGER NOT NULL, output JSONB NOT NULL,
    done BOOLEAN NOT NULL, committed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (run_id, seq));
CREATE INDEX b3_checkpoints_done ON b3.checkpoints (run_id) WHERE done;
CREATE TABLE b3.ledger (reference TEXT PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL, payload TEXT NOT NULL);
CREATE TABLE b3.outbox (id BIGSERIAL PRIMARY KEY, message_id UUID NOT NULL, body BYTEA NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE b3.journal (run_id TEXT NOT NULL, seq INTEGER NOT NULL, answer TEXT NOT NULL,
    PRIMARY KEY (run_id, seq));
CREATE TABLE b3.runs (run_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, fence BIGINT NOT NULL,
    owner UUID, lease_until TIMESTAMPTZ);
CREATE TABLE b3.steps (run_id TEXT NOT NULL, seq INTEGER NOT NULL, attempts INTEGER NOT NULL,
    PRIMARY KEY (run_id, seq));
";

/// Which of the records trailmark's promises rest on B3 keeps beside its one statement: each
/// step up this list is a line of the bench's price list, and trailmark against the last is the
/// engine's own overhead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promises {
    /// The one statement alone; the checkpoint holds the answer.
    Bare,
    /// Every answer journaled the moment it arrives (a statement of its own on the pool that
    /// does not wait for the WAL flush, as trailmark's journal entries; the step's synchronous
    /// statement flushes it), the checkpoint naming it by hash; a redelivered message reads the
    /// journal first and pays for no answer twice.
    Journal,
    /// The journal, and a run row with a fencing token and a step row counting attempts: the
    /// step statement is fenced (a stale attempt writes nothing) and pre-claims the next position
    /// for this process (the fence raised, its step row with one attempt), so a message this
    /// process published itself starts without a statement; any other delivery claims with one
    /// (fence raised, attempt counted, lease taken, the journal read), as trailmark's do.
    Fenced,
}

impl Promises {
    /// The value of `--b3-promises` that selects this variant.
    pub fn arg(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Journal => "journal",
            Self::Fenced => "fenced",
        }
    }

    /// The variant `--b3-promises` names; the error lists the choices.
    pub fn parse(s: &str) -> std::result::Result<Self, UnknownPromises> {
        [Self::Bare, Self::Journal, Self::Fenced]
            .into_iter()
            .find(|p| p.arg() == s)
            .ok_or_else(|| UnknownPromises(s.to_owned()))
    }
}

/// A `--b3-promises` value that names no variant.
#[derive(Debug, thiserror::Error)]
#[error("--b3-promises {0:?}: expected bare, journal or fenced")]
pub struct UnknownPromises(pub String);

/// The whole step in one statement. The inbox row is a plain insert: a repeated message fails
/// the statement on its key (and is then acknowledged as a duplicate), which costs less than a
/// speculative insert on every step; the ledger row, written only with a fresh inbox row, can
/// meet its key only through a repeat, so it is a plain insert too.
const STEP: &str = "WITH fresh AS (
        INSERT INTO b3.inbox (message_id) VALUES ($1)
    ), checkpoint AS (
        INSERT INTO b3.checkpoints (run_id, seq, output, done) VALUES ($2, $3, $4, $5)
    ), ledger AS (
        INSERT INTO b3.ledger (reference, run_id, step, payload)
        SELECT $2::text || ':' || $3::int4, $2, $3, $6 WHERE $6::text IS NOT NULL
    ), outbox AS (
        INSERT INTO b3.outbox (message_id, body) SELECT $7, $8 WHERE $8::bytea IS NOT NULL
        RETURNING id
    )
    SELECT 1::int8, (SELECT id FROM outbox)";

/// [`Promises::Fenced`]'s run start: the run row (position 0, fence 1, pre-claimed by this
/// process) and its first step row beside B3's own rows; a repeated start fails on the inbox
/// key, as B3's does.
const START_FENCED: &str = "WITH fresh AS (
        INSERT INTO b3.inbox (message_id) VALUES ($1)
    ), run AS (
        INSERT INTO b3.runs (run_id, seq, fence, owner) VALUES ($2, 0, 1, $5)
    ), step AS (
        INSERT INTO b3.steps (run_id, seq, attempts) VALUES ($2, 0, 1)
    ), checkpoint AS (
        INSERT INTO b3.checkpoints (run_id, seq, output, done) VALUES ($2, -1, '{}', false)
    ), outbox AS (
        INSERT INTO b3.outbox (message_id, body) VALUES ($3, $4) RETURNING id
    )
    SELECT 1::int8, (SELECT id FROM outbox)";

/// [`Promises::Fenced`]'s step: B3's statement behind the fence check of the run row, which
/// also pre-claims the next position for this process (fence raised with the position, the
/// next step row with its first attempt). A stale fence writes nothing and returns no fence.
const STEP_FENCED: &str = "WITH run AS (
        UPDATE b3.runs SET seq = $3 + 1, fence = fence + 1, owner = $10, lease_until = NULL
         WHERE run_id = $2 AND seq = $3 AND fence = $9 RETURNING fence
    ), fresh AS (
        INSERT INTO b3.inbox (message_id) SELECT $1 FROM run
    ), checkpoint AS (
        INSERT INTO b3.checkpoints (run_id, seq, output, done) SELECT $2, $3, $4, $5 FROM run
    ), next_step AS (
        INSERT INTO b3.steps (run_id, seq, attempts) SELECT $2, $3 + 1, 1 FROM run WHERE NOT $5
    ), ledger AS (
        INSERT INTO b3.ledger (reference, run_id, step, payload)
        SELECT $2::text || ':' || $3::int4, $2, $3, $6 FROM run WHERE $6::text IS NOT NULL
    ), outbox AS (
        INSERT INTO b3.outbox (message_id, body) SELECT $7, $8 FROM run WHERE $8::bytea IS NOT NULL
        RETURNING id
    )
    SELECT (SELECT fence FROM run), (SELECT id FROM outbox)";

/// [`Promises::Fenced`]'s claim, for a delivery that is not this process's own pre-claimed
/// message: raises the fence, takes the lease, counts the attempt and reads the journal. B3 has
/// no presence, so it takes the lease whoever holds it; the fence still keeps the holder it
/// displaced from writing. No fence back: the run is at another position (a repeat).
const CLAIM_FENCED: &str = "WITH run AS (
        UPDATE b3.runs SET fence = fence + 1, owner = $3, lease_until = now() + interval '30 s'
         WHERE run_id = $1 AND seq = $2 RETURNING fence
    ), step AS (
        UPDATE b3.steps SET attempts = attempts + 1
         WHERE run_id = $1 AND seq = $2 AND EXISTS (SELECT 1 FROM run)
    )
    SELECT (SELECT fence FROM run), (SELECT answer FROM b3.journal WHERE run_id = $1 AND seq = $2)";

/// Creates B3's tables in their own schema of the bench database.
pub async fn create_schema(pool: &PgPool) -> Result<()> {
    sqlx::raw_sql(SCHEMA).execute(pool).await?;
    Ok(())
}

/// B3's work queue under `prefix` (a quorum queue, published to through the default exchange).
pub fn queue(prefix: &str) -> String {
    format!("{prefix}.b3")
}

/// One B3 message; `seq = -1` starts the run (like trailmark's run-start event).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Message {
    /// Dedup key.
    pub id: uuid::Uuid,
    /// Run id.
    pub run: String,
    /// Position, -1 for the run start.
    pub seq: i32,
    /// Steps in the run.
    pub steps: i32,
    /// [`Promises::Fenced`]: the fence the position was pre-claimed with (0 otherwise).
    #[serde(default)]
    pub fence: i64,
    /// [`Promises::Fenced`]: the process that pre-claimed the position.
    #[serde(default)]
    pub owner: Option<uuid::Uuid>,
}

impl Message {
    /// The run-start message, ready to publish.
    pub fn start(prefix: &str, run: &str, steps: i32) -> Outgoing {
        Self {
            id: uuid::Uuid::new_v4(),
            run: run.to_owned(),
            seq: -1,
            steps,
            fence: 0,
            owner: None,
        }
        .outgoing(prefix)
    }

    fn outgoing(&self, prefix: &str) -> Outgoing {
        Outgoing {
            message_id: self.id.to_string(),
            exchange: String::new(),
            routing_key: queue(prefix),
            headers: FieldTable::default(),
            body: serde_json::to_vec(self).expect("B3 message serialises"),
        }
    }
}

/// Where B3 (and the DBOS peer) get the ~2 KB answer: the same stand-in model server as
/// trailmark, or the same in-process stand-in answer.
pub enum Answers {
    /// Over HTTP, with trailmark's own model client.
    Http(ModelClient),
    /// In-process, padded to this many bytes.
    Local(usize),
}

impl Answers {
    /// The answer to link `seq` of `run`: the request `chain` makes, answered the same way; the
    /// error says which link's call failed.
    pub async fn answer(
        &self,
        run: &str,
        seq: i32,
        steps: i32,
    ) -> std::result::Result<String, String> {
        let request = super::peer::request(run, seq, steps);
        match self {
            Self::Local(bytes) => Ok(trailmark_standin::model_server::standin_answer(
                &request, *bytes,
            )),
            Self::Http(client) => client
                .chat(&request)
                .await
                .map(|a| a.content)
                .map_err(|e| format!("model call for {run}:{seq}: {e}")),
        }
    }
}

struct B3 {
    pool: PgPool,
    /// Connections that do not wait for the WAL flush: journal entries, outbox removals.
    relaxed: PgPool,
    settings: Settings,
    answers: Answers,
    promises: Promises,
    /// This process, as the owner of the positions it pre-claims ([`Promises::Fenced`]).
    me: uuid::Uuid,
    publisher: Publisher,
    /// Outbox ids whose eager publish was confirmed, for the batched delete.
    confirmed: mpsc::UnboundedSender<i64>,
}

/// Runs one B3 process (consumer + eager publisher + relay) until `shutdown`, keeping the
/// records `promises` names beside its one statement.
pub async fn serve(
    settings: Settings,
    answers: Answers,
    promises: Promises,
    shutdown: CancellationToken,
) -> Result<()> {
    let pool = trailmark::store::connect(&settings.database).await?;
    let relaxed = trailmark::store::relaxed_pool(&pool, &settings.database);
    let conn = broker::connect(&settings.broker, "b3-publisher").await?;
    let confirm = Duration::from_millis(settings.broker.confirm_timeout_ms);
    let publisher = Publisher::open(&conn, confirm).await?;
    let (confirmed, forget_rx) = mpsc::unbounded_channel();
    let b3 = Arc::new(B3 {
        pool,
        relaxed: relaxed.clone(),
        settings,
        answers,
        promises,
        me: uuid::Uuid::new_v4(),
        publisher,
        confirmed,
    });
    let relay = tokio::spawn(relay(b3.clone(), shutdown.clone()));
    let forget = tokio::spawn(forget(relaxed, forget_rx, shutdown.clone()));
    let consumed = consume(&b3, &shutdown).await;
    shutdown.cancel();
    let relayed = relay
        .await
        .map_err(|e| Error::Failed(format!("B3 relay task: {e}")))?;
    let forgot = forget
        .await
        .map_err(|e| Error::Failed(format!("B3 outbox clean-up task: {e}")))?;
    let _ = conn.close(200, "b3 done".into()).await;
    consumed.and(relayed).and(forgot)
}

async fn consume(b3: &Arc<B3>, shutdown: &CancellationToken) -> Result<()> {
    let conn = broker::connect(&b3.settings.broker, "b3-worker").await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(b3.settings.worker.concurrency, BasicQosOptions::default())
        .await?;
    let q = queue(&b3.settings.broker.prefix);
    let mut deliveries = channel
        .basic_consume(
            q.as_str().into(),
            "b3".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let (settled, settled_rx) = mpsc::unbounded_channel();
    let acks = tokio::spawn(coalesce_acks(settled_rx));
    let tasks = TaskTracker::new();
    loop {
        let next = tokio::select! {
            next = deliveries.next() => next,
            _ = shutdown.cancelled() => break,
        };
        let Some(delivery) = next else {
            return Err(Error::Failed(
                "B3 consumer stream ended (broker connection closed)".into(),
            ));
        };
        let (b3, delivery, settled) = (b3.clone(), delivery?, settled.clone());
        // The prefetch bounds how many of these run at once.
        tasks.spawn(async move { handle(&b3, delivery, &settled).await });
    }
    tasks.close();
    tasks.wait().await;
    drop(settled);
    let _ = acks.await;
    let _ = conn.close(200, "b3 done".into()).await;
    Ok(())
}

/// A delivery whose step is done: to be acknowledged, or already nacked (requeued).
enum Settled {
    Ack(u64, Acker),
    Nacked(u64),
}

/// Acknowledges finished deliveries: the consecutive ones from the oldest unsettled tag with one
/// `multiple` ack, the ones beyond a gap (a slower delivery still running) one by one at once,
/// so a slow step never holds the prefetch window shut.
async fn coalesce_acks(mut rx: mpsc::UnboundedReceiver<Settled>) {
    // Delivery tags of a channel start at 1.
    let mut next: u64 = 1;
    let mut settled_alone: BTreeSet<u64> = BTreeSet::new();
    let mut waiting: BTreeMap<u64, Option<Acker>> = BTreeMap::new();
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        for s in batch {
            match s {
                Settled::Ack(tag, acker) => waiting.insert(tag, Some(acker)),
                Settled::Nacked(tag) => waiting.insert(tag, None),
            };
        }
        let mut last = None;
        loop {
            if let Some(acker) = waiting.remove(&next) {
                last = acker.or(last);
            } else if !settled_alone.remove(&next) {
                break;
            }
            next += 1;
        }
        if let Some(acker) = last {
            let _ = acker.ack(BasicAckOptions { multiple: true }).await;
        }
        for (tag, acker) in std::mem::take(&mut waiting) {
            if let Some(acker) = acker {
                let _ = acker.ack(BasicAckOptions::default()).await;
            }
            settled_alone.insert(tag);
        }
    }
}

async fn handle(b3: &B3, delivery: Delivery, settled: &mpsc::UnboundedSender<Settled>) {
    let tag = delivery.delivery_tag;
    match step(b3, &delivery.data, delivery.redelivered).await {
        Ok(next) => {
            let _ = settled.send(Settled::Ack(tag, delivery.acker));
            if let Some((outbox_id, next)) = next {
                b3.publish_now(outbox_id, &next).await;
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "B3 step failed; requeueing");
            let _ = delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await;
            let _ = settled.send(Settled::Nacked(tag));
        }
    }
}

impl B3 {
    /// Eager publish of a committed next message; the relay covers a failure after the grace.
    async fn publish_now(&self, outbox_id: i64, next: &Message) {
        let out = next.outgoing(&self.settings.broker.prefix);
        match self.publisher.publish(&out).await {
            Ok(()) => {
                let _ = self.confirmed.send(outbox_id);
            }
            Err(e) => tracing::warn!(
                error = %e,
                run = %next.run,
                "B3 eager publish failed; the relay publishes the row after the grace"
            ),
        }
    }
}

/// The whole of B3's step: the answer, then one statement. Returns the next message to publish
/// with its outbox id, when there is one and the delivery was not a repeat.
async fn step(b3: &B3, body: &[u8], redelivered: bool) -> Result<Option<(i64, Message)>> {
    let msg: Message =
        serde_json::from_slice(body).map_err(|e| Error::Failed(format!("B3 message: {e}")))?;
    let (fence, answer) = if msg.seq >= 0 {
        let Some((fence, journaled)) = b3.begin(&msg, redelivered).await? else {
            return Ok(None);
        };
        (fence, Some(b3.answer(&msg, journaled).await?))
    } else {
        (0, None)
    };
    let last = msg.seq + 1 >= msg.steps;
    let payload = answer
        .as_ref()
        .map(|a| trailmark::domain::request_hash(&json!(a)));
    // With a journal the checkpoint names the answer by its hash, as `chain`'s does.
    let output = match b3.promises {
        Promises::Bare => json!({ "link": msg.seq, "answer": answer }),
        Promises::Journal | Promises::Fenced => {
            json!({ "link": msg.seq, "answer_sha256": payload })
        }
    };
    let fenced = b3.promises == Promises::Fenced;
    let next = (!last).then(|| Message {
        id: uuid::Uuid::new_v4(),
        run: msg.run.clone(),
        seq: msg.seq + 1,
        steps: msg.steps,
        // The step statement pre-claims the next position with the fence raised by one (the
        // run start with fence 1).
        fence: if fenced { fence + 1 } else { 0 },
        owner: fenced.then_some(b3.me),
    });
    let body = next
        .as_ref()
        .map(|n| serde_json::to_vec(n).expect("B3 message serialises"));
    let stepped = if fenced && msg.seq < 0 {
        sqlx::query_as(START_FENCED)
            .bind(msg.id)
            .bind(&msg.run)
            .bind(next.as_ref().map(|n| n.id))
            .bind(body)
            .bind(b3.me)
            .fetch_one(&b3.pool)
            .await
    } else {
        let statement = sqlx::query_as(if fenced { STEP_FENCED } else { STEP })
            .bind(msg.id)
            .bind(&msg.run)
            .bind(msg.seq)
            .bind(&output)
            .bind(last)
            .bind(payload)
            .bind(next.as_ref().map(|n| n.id))
            .bind(body);
        let statement = if fenced {
            statement.bind(fence).bind(b3.me)
        } else {
            statement
        };
        statement.fetch_one(&b3.pool).await
    };
    let (fenced_in, outbox_id): (Option<i64>, Option<i64>) = match stepped {
        Ok(row) => row,
        // The message's rows exist: a repeat, which changes nothing.
        Err(e) if is_repeat(&e) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if fenced_in.is_none() {
        // Another attempt holds the run now: this one writes nothing.
        return Ok(None);
    }
    Ok(match (outbox_id, next) {
        (Some(id), Some(next)) => Some((id, next)),
        _ => None,
    })
}

/// Whether a step statement failed on a key a repeated message meets first (its inbox row, or a
/// run start's run row).
fn is_repeat(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| {
        matches!(
            d.constraint(),
            Some("inbox_pkey" | "runs_pkey" | "steps_pkey" | "checkpoints_pkey")
        )
    })
}

impl B3 {
    /// Where a step starts: the fence it writes under and the answer an earlier attempt
    /// journaled; `None` when the run is at another position (a repeat).
    async fn begin(
        &self,
        msg: &Message,
        redelivered: bool,
    ) -> Result<Option<(i64, Option<String>)>> {
        match self.promises {
            Promises::Bare => Ok(Some((0, None))),
            // A first delivery has no earlier attempt whose answer could be journaled, but for a
            // relay's copy of a message also published eagerly: its call is paid again, and the
            // journal's key hands back the answer on record.
            Promises::Journal if !redelivered => Ok(Some((0, None))),
            Promises::Journal => Ok(Some((0, self.journaled(msg).await?))),
            // This process's own message, on the position its last statement pre-claimed.
            Promises::Fenced if !redelivered && msg.owner == Some(self.me) => {
                Ok(Some((msg.fence, None)))
            }
            Promises::Fenced => {
                let (fence, answer): (Option<i64>, Option<String>) = sqlx::query_as(CLAIM_FENCED)
                    .bind(&msg.run)
                    .bind(msg.seq)
                    .bind(self.me)
                    .fetch_one(&self.pool)
                    .await?;
                Ok(fence.map(|f| (f, answer)))
            }
        }
    }

    /// The step's answer: the journaled one, or a new one journaled the moment it arrives (with
    /// a journal). An entry another attempt wrote first wins, so every attempt goes on with the
    /// one answer on record.
    async fn answer(&self, msg: &Message, journaled: Option<String>) -> Result<String> {
        if let Some(answer) = journaled {
            return Ok(answer);
        }
        let answer = self
            .answers
            .answer(&msg.run, msg.seq, msg.steps)
            .await
            .map_err(|e| Error::Failed(format!("B3 {e}")))?;
        if self.promises == Promises::Bare {
            return Ok(answer);
        }
        let wrote = sqlx::query("INSERT INTO b3.journal (run_id, seq, answer) VALUES ($1, $2, $3)")
            .bind(&msg.run)
            .bind(msg.seq)
            .bind(&answer)
            .execute(&self.relaxed)
            .await;
        match wrote {
            Ok(_) => Ok(answer),
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.constraint() == Some("journal_pkey")) =>
            {
                let theirs = self.journaled(msg).await?;
                theirs.ok_or_else(|| {
                    Error::Failed(format!("B3 journal of {}:{} vanished", msg.run, msg.seq))
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn journaled(&self, msg: &Message) -> Result<Option<String>> {
        Ok(
            sqlx::query_scalar("SELECT answer FROM b3.journal WHERE run_id = $1 AND seq = $2")
                .bind(&msg.run)
                .bind(msg.seq)
                .fetch_optional(&self.pool)
                .await?,
        )
    }
}

/// Deletes the rows whose eager publish was confirmed, gathered for 50 ms per statement, on a
/// pool that does not wait for the WAL flush: a delete lost in a Postgres crash only makes the
/// relay publish the row once more, and the inbox drops the repeat.
async fn forget(
    relaxed: PgPool,
    mut rx: mpsc::UnboundedReceiver<i64>,
    shutdown: CancellationToken,
) -> Result<()> {
    loop {
        let first = tokio::select! {
            id = rx.recv() => id,
            _ = shutdown.cancelled() => None,
        };
        let Some(first) = first else {
            return Ok(());
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
        let mut ids = vec![first];
        while let Ok(id) = rx.try_recv() {
            ids.push(id);
        }
        sqlx::query("DELETE FROM b3.outbox WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&relaxed)
            .await?;
    }
}

/// The safety net: publishes the rows left unpublished past `relay.eager_grace_ms`.
async fn relay(b3: Arc<B3>, shutdown: CancellationToken) -> Result<()> {
    let poll = Duration::from_millis(b3.settings.relay.poll_interval_ms);
    loop {
        while drain(&b3).await? > 0 {}
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// Publishes one batch of overdue rows with pipelined confirms, then deletes them, in one
/// transaction.
async fn drain(b3: &B3) -> Result<usize> {
    let grace = b3.settings.relay.eager_grace_ms as f64 / 1000.0;
    let mut tx = b3.pool.begin().await?;
    let rows: Vec<(i64, uuid::Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT id, message_id, body FROM b3.outbox WHERE created_at < now() - make_interval(secs => $2)
          ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(b3.settings.relay.batch_size)
    .bind(grace)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let q = queue(&b3.settings.broker.prefix);
    let msgs: Vec<Outgoing> = rows
        .iter()
        .map(|(_, id, body)| Outgoing {
            message_id: id.to_string(),
            exchange: String::new(),
            routing_key: q.clone(),
            headers: FieldTable::default(),
            body: body.clone(),
        })
        .collect();
    for confirmed in b3.publisher.publish_all(&msgs).await {
        confirmed?;
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    sqlx::query("DELETE FROM b3.outbox WHERE id = ANY($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(ids.len())
}

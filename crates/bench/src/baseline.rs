//! B3, the baseline: the same step semantics as `chain` with none of trailmark's features, so
//! the report can say what the features cost. Per message: consume -> one transaction (dedup
//! row + checkpoint row + ledger row + outbox row) -> ack; a relay task publishes the outbox with
//! confirms, woken by NOTIFY with polling as the safety net. Same queue type (quorum), same
//! Postgres, same prefetch, one process per trailmark `serve` process. It has no leases, no
//! journal, no effect records, no DLQ, no retries: a failed delivery is simply requeued.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Error, Result};
use trailmark::broker::{self, Outgoing, Publisher};
use trailmark::config::Settings;
use trailmark::model::{ChatMessage, ChatRequest, ModelClient};

const SCHEMA: &str = "
CREATE SCHEMA b3;
CREATE TABLE b3.inbox (message_id UUID PRIMARY KEY, processed_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE b3.checkpoints (run_id TEXT NOT NULL, seq INTEGER NOT NULL, output JSONB NOT NULL,
    done BOOLEAN NOT NULL, committed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (run_id, seq));
CREATE INDEX b3_checkpoints_done ON b3.checkpoints (run_id) WHERE done;
CREATE TABLE b3.ledger (reference TEXT PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL, payload TEXT NOT NULL);
CREATE TABLE b3.outbox (id BIGSERIAL PRIMARY KEY, message_id UUID NOT NULL, body BYTEA NOT NULL, published_at TIMESTAMPTZ);
CREATE INDEX b3_outbox_unpublished ON b3.outbox (id) WHERE published_at IS NULL;
CREATE FUNCTION b3.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('b3_outbox', ''); RETURN NULL; END $$;
CREATE TRIGGER outbox_notify AFTER INSERT ON b3.outbox FOR EACH STATEMENT EXECUTE FUNCTION b3.outbox_notify();
";

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
}

impl Message {
    /// The run-start message, ready to publish.
    pub fn start(prefix: &str, run: &str, steps: i32) -> Outgoing {
        Self {
            id: uuid::Uuid::new_v4(),
            run: run.to_owned(),
            seq: -1,
            steps,
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

/// Where B3 gets its ~2 KB answer: the same stand-in model server as trailmark, or the same
/// in-process stand-in answer.
pub enum Answers {
    /// Over HTTP, with trailmark's own model client.
    Http(ModelClient),
    /// In-process, padded to this many bytes.
    Local(usize),
}

struct B3 {
    pool: PgPool,
    settings: Settings,
    answers: Answers,
}

/// Runs one B3 process (consumer + relay) until `shutdown`.
pub async fn serve(
    settings: Settings,
    answers: Answers,
    shutdown: CancellationToken,
) -> Result<()> {
    let pool = trailmark::store::connect(&settings.database).await?;
    let b3 = Arc::new(B3 {
        pool,
        settings,
        answers,
    });
    let relay = tokio::spawn(relay(b3.clone(), shutdown.clone()));
    let consumed = consume(&b3, &shutdown).await;
    shutdown.cancel();
    let relayed = relay
        .await
        .map_err(|e| Error::Failed(format!("B3 relay task: {e}")))?;
    consumed.and(relayed)
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
        let (b3, delivery) = (b3.clone(), delivery?);
        // The prefetch bounds how many of these run at once.
        tasks.spawn(async move { handle(&b3, delivery).await });
    }
    tasks.close();
    tasks.wait().await;
    let _ = conn.close(200, "b3 done".into()).await;
    Ok(())
}

async fn handle(b3: &B3, delivery: Delivery) {
    match step(b3, &delivery.data).await {
        Ok(()) => {
            let _ = delivery.acker.ack(BasicAckOptions::default()).await;
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
        }
    }
}

/// The whole of B3's step: the answer, then one transaction.
async fn step(b3: &B3, body: &[u8]) -> Result<()> {
    let msg: Message =
        serde_json::from_slice(body).map_err(|e| Error::Failed(format!("B3 message: {e}")))?;
    let answer = if msg.seq >= 0 {
        Some(answer(b3, &msg).await?)
    } else {
        None
    };
    let mut tx = b3.pool.begin().await?;
    let fresh = sqlx::query("INSERT INTO b3.inbox (message_id) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(msg.id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    if !fresh {
        tx.rollback().await?;
        return Ok(());
    }
    let last = msg.seq + 1 >= msg.steps;
    let output = json!({ "link": msg.seq, "answer": answer });
    sqlx::query("INSERT INTO b3.checkpoints (run_id, seq, output, done) VALUES ($1, $2, $3, $4)")
        .bind(&msg.run)
        .bind(msg.seq)
        .bind(&output)
        .bind(last)
        .execute(&mut *tx)
        .await?;
    if let Some(answer) = &answer {
        let payload = trailmark::domain::request_hash(&json!(answer));
        sqlx::query("INSERT INTO b3.ledger (reference, run_id, step, payload) VALUES ($1, $2, $3, $4) ON CONFLICT (reference) DO NOTHING")
            .bind(format!("{}:{}", msg.run, msg.seq)).bind(&msg.run).bind(msg.seq).bind(payload)
            .execute(&mut *tx).await?;
    }
    if !last {
        let next = Message {
            id: uuid::Uuid::new_v4(),
            run: msg.run.clone(),
            seq: msg.seq + 1,
            steps: msg.steps,
        };
        let body = serde_json::to_vec(&next).expect("B3 message serialises");
        sqlx::query("INSERT INTO b3.outbox (message_id, body) VALUES ($1, $2)")
            .bind(next.id)
            .bind(body)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The same request `chain` makes, answered the same way.
async fn answer(b3: &B3, msg: &Message) -> Result<String> {
    let request = ChatRequest {
        messages: vec![
            ChatMessage::system("You are one link of a chain. Answer briefly."),
            ChatMessage::user(format!(
                "Link {} of {} in run {}.",
                msg.seq, msg.steps, msg.run
            )),
        ],
        max_tokens: Some(64),
        temperature: Some(0.0),
    };
    match &b3.answers {
        Answers::Local(bytes) => Ok(trailmark_standin::model_server::standin_answer(
            &request, *bytes,
        )),
        Answers::Http(client) => client
            .chat(&request)
            .await
            .map(|a| a.content)
            .map_err(|e| Error::Failed(format!("B3 model call: {e}"))),
    }
}

async fn relay(b3: Arc<B3>, shutdown: CancellationToken) -> Result<()> {
    let settings = &b3.settings;
    let conn = broker::connect(&settings.broker, "b3-relay").await?;
    let publisher = Publisher::open(
        &conn,
        Duration::from_millis(settings.broker.confirm_timeout_ms),
    )
    .await?;
    let mut listener = PgListener::connect_with(&b3.pool).await?;
    listener.listen("b3_outbox").await?;
    let poll = Duration::from_millis(settings.relay.poll_interval_ms);
    loop {
        while drain(&b3, &publisher).await? > 0 {}
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = listener.recv() => {}
            _ = tokio::time::sleep(poll) => {}
        }
    }
    let _ = conn.close(200, "b3 relay done".into()).await;
    Ok(())
}

/// Publishes one batch of unpublished rows with confirms, then marks them, in one transaction.
async fn drain(b3: &B3, publisher: &Publisher) -> Result<usize> {
    let mut tx = b3.pool.begin().await?;
    let rows: Vec<(i64, uuid::Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT id, message_id, body FROM b3.outbox WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(b3.settings.relay.batch_size).fetch_all(&mut *tx).await?;
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
    for confirmed in publisher.publish_all(&msgs).await {
        confirmed?;
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    sqlx::query("UPDATE b3.outbox SET published_at = now() WHERE id = ANY($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(ids.len())
}

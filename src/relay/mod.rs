//! The relay: outbox rows -> RabbitMQ, with publisher confirms (at-least-once).
//!
//! Rows are claimed with `FOR UPDATE SKIP LOCKED`, so any number of relays can run; a row is
//! marked published only after its positive confirm, inside the transaction that holds its lock.
//! A crash between confirm and mark publishes the row again: consumers dedup by message id.
//! NOTIFY wakes the relay early; polling is the safety net. No "last id" is ever tracked,
//! because ids do not commit in order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, Outgoing, Publisher};
use crate::engine::Engine;
use crate::health::Loop;
use crate::store::{self, outbox};

/// Relay errors: either side went away; [`run`] reconnects by itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// RabbitMQ failed.
    #[error("the relay lost the broker")]
    Broker(#[from] broker::Error),
    /// Postgres failed.
    #[error("the relay lost the database")]
    Store(#[from] store::Error),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

const NOTIFY_CHANNEL: &str = "trailmark_outbox";
const PRUNE_BATCH: i64 = 5_000;

/// Publishes outbox rows until `shutdown` fires, reconnecting after failures of either server.
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), Error> {
    let mut backoff = Duration::from_millis(200);
    engine.health.runs(Loop::Relay);
    while !shutdown.is_cancelled() {
        engine.health.beat(Loop::Relay);
        match session(&engine, &shutdown).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(error = %crate::error::Report(&e), retry_in_ms = backoff.as_millis() as u64, "relay failed; reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    Ok(())
}

async fn session(engine: &Arc<Engine>, shutdown: &CancellationToken) -> Result<(), Error> {
    let settings = &engine.settings;
    let conn = broker::connect(&settings.broker, &format!("relay-{}", engine.worker_id)).await?;
    let publisher = Publisher::open(
        &conn,
        Duration::from_millis(settings.broker.confirm_timeout_ms),
    )
    .await?;
    let mut listener = PgListener::connect_with(&engine.pool).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    let poll = Duration::from_millis(settings.relay.poll_interval_ms);
    tracing::info!("relay publishing");
    loop {
        engine.health.beat(Loop::Relay);
        while drain_batch(engine, &publisher).await? > 0 {
            if shutdown.is_cancelled() {
                return Ok(());
            }
        }
        outbox::prune(
            &engine.pool,
            settings.relay.retention_secs as f64,
            PRUNE_BATCH,
        )
        .await?;
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            // A listener error (database restart) just falls back to polling; the next drain
            // reports the database if it is really gone.
            _ = listener.recv() => {}
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// Publishes one batch of unpublished rows; returns how many were confirmed.
/// Public so tests can step the relay explicitly.
pub async fn drain_batch(engine: &Engine, publisher: &Publisher) -> Result<usize, Error> {
    let mut tx = engine.pool.begin().await?;
    let rows = outbox::claim(&mut *tx, engine.settings.relay.batch_size).await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let messages: Vec<Outgoing> = rows.iter().map(row_to_outgoing).collect();
    let started = std::time::Instant::now();
    let results = publisher.publish_all(&messages).await;
    crate::metrics::relay_published(started.elapsed());
    let (mut ok, mut failed, mut first_error) = (Vec::new(), Vec::new(), None);
    for (row, result) in rows.iter().zip(results) {
        match result {
            Ok(()) => ok.push(row.id),
            Err(e) => {
                failed.push(row.id);
                first_error.get_or_insert(e);
            }
        }
    }
    engine
        .failpoints
        .hit("relay.after_confirm")
        .map_err(|e| store::Error::unavailable("relay interrupted", e))?;
    outbox::mark_published(&mut *tx, &ok).await?;
    outbox::mark_failed(&mut *tx, &failed).await?;
    tx.commit().await?;
    engine
        .stats
        .relayed
        .fetch_add(ok.len() as u64, std::sync::atomic::Ordering::Relaxed);
    // With eager publishing on, rows reach the relay only from operators, the supervisor, or a
    // worker that died between commit and publish: worth a line each time. Without it, every
    // message passes here.
    if engine.settings.relay.eager_grace_ms > 0 {
        tracing::info!(rows = ok.len(), "relay published outbox rows");
    } else {
        tracing::debug!(rows = ok.len(), "relay published outbox rows");
    }
    if let Some(e) = first_error {
        // A refused message stays in the outbox and is tried again; a dead channel reconnects.
        tracing::error!(error = %crate::error::Report(&e), failed = failed.len(), "relay could not publish some outbox rows");
        return Err(e.into());
    }
    Ok(ok.len())
}

fn row_to_outgoing(row: &outbox::OutboxRow) -> Outgoing {
    let headers: BTreeMap<String, String> =
        serde_json::from_value(row.headers.clone()).unwrap_or_default();
    Outgoing {
        message_id: row.message_id.to_string(),
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        headers: broker::map_to_headers(&headers),
        body: row.body.clone(),
    }
}

/// The AMQP form of an outbox message (used by workers that publish their own commits).
pub fn to_outgoing(m: &crate::domain::OutgoingMessage) -> Outgoing {
    Outgoing {
        message_id: m.message_id.to_string(),
        exchange: m.exchange.clone(),
        routing_key: m.routing_key.clone(),
        headers: broker::map_to_headers(&m.headers),
        body: m.body.clone(),
    }
}

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
    let mut ok = Vec::new();
    let mut failed = Vec::new();
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok(()) => ok.push(rows[i].id),
            Err(e) => failed.push((i, e)),
        }
    }
    let (held, down) = isolate(publisher, &rows, &messages, failed, &mut ok).await;
    engine
        .failpoints
        .hit("relay.after_confirm")
        .map_err(|e| store::Error::unavailable("relay interrupted", e))?;
    outbox::mark_published(&mut *tx, &ok).await?;
    outbox::hold_back(&mut *tx, &held).await?;
    let unsent: Vec<i64> = down.iter().map(|(i, _)| rows[*i].id).collect();
    outbox::mark_failed(&mut *tx, &unsent).await?;
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
    if let Some((_, e)) = down.into_iter().next() {
        // The broker is gone or too slow: the rows stay and the session reconnects.
        tracing::error!(error = %crate::error::Report(&e), failed = unsent.len(), "relay could not publish some outbox rows");
        return Err(e.into());
    }
    Ok(ok.len())
}

/// Sorts the rows a batch failed to publish. One bad row (its exchange missing) makes the
/// broker close the channel and takes the rest of its batch down with it, so each failed row
/// is tried once more alone: those that pass join `ok`; those the broker refuses alone are
/// returned to be held back (with the broker's words), so they cannot stop the rows behind
/// them; the rest failed because the broker is unreachable or slow, and are returned as such.
async fn isolate(
    publisher: &Publisher,
    rows: &[outbox::OutboxRow],
    messages: &[Outgoing],
    failed: Vec<(usize, broker::Error)>,
    ok: &mut Vec<i64>,
) -> (Vec<(i64, String)>, Vec<(usize, broker::Error)>) {
    let (mut held, mut down) = (Vec::new(), Vec::new());
    for (i, first) in failed {
        let alone = match first {
            // Refused on its own merits (unroutable): no need to ask again. A nack is not: it
            // says the broker cannot take messages now, so the row counts with those the broker
            // was too slow or gone for (the session reconnects and tries again within seconds),
            // never held back for the minutes a refused row may wait.
            refused @ broker::Error::Refused { .. } => Err(refused),
            broker::Error::Connection(_) if publisher.connected() => {
                publisher.publish(&messages[i]).await
            }
            other => Err(other),
        };
        match alone {
            Ok(()) => ok.push(rows[i].id),
            Err(e) if refused_alone(&e) && publisher.connected() => {
                let why = match &e {
                    broker::Error::Connection(closed) => {
                        format!("the broker refused it and closed the channel: {closed}")
                    }
                    other => crate::error::Report(other).to_string(),
                };
                held_back_log(&rows[i], &why);
                held.push((rows[i].id, why));
            }
            Err(e) => down.push((i, e)),
        }
    }
    (held, down)
}

/// Whether the broker refused this message itself (rather than being unreachable or slow): it
/// returned it unroutable, or closed the channel over it with a channel-level (soft) error such
/// as a missing exchange. A connection that went away mid-publish is not a refusal, whatever
/// the connection's status reads at that moment.
fn refused_alone(e: &broker::Error) -> bool {
    match e {
        broker::Error::Refused { .. } => true,
        broker::Error::Connection(e) => e.is_amqp_soft_error(),
        _ => false,
    }
}

fn held_back_log(row: &outbox::OutboxRow, why: &str) {
    let header = |name: &str| {
        row.headers
            .get(name)
            .and_then(serde_json::Value::as_str)
            .unwrap_or("-")
            .to_owned()
    };
    tracing::error!(
        message.id = %row.message_id,
        exchange = %row.exchange,
        routing_key = %row.routing_key,
        run.id = %header("x-trailmark-run-id"),
        step = %header("x-trailmark-step"),
        error = %why,
        "the broker refused an outbox row on its own; it is held back and tried again later (the rows behind it go on). Declare the exchange and bind a queue to it, or fix the workflow's target; `trailmark_outbox_held_back` counts such rows"
    );
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

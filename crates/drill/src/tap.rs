//! The `dup` fault: a queue of the drill's own bound beside the step queue sees every step
//! message published; a share of them is published again with the same message id, shuffled and
//! late, as a redelivery after a lost ack or a publisher's retry would be.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::schedule::Rng;
use trailmark::broker::{self, Outgoing, Publisher, Topology};
use trailmark::config::BrokerSettings;
use trailmark::domain::STEP_ROUTING_KEY;

/// The header that marks the drill's own copies, so the tap does not copy them again.
const COPY_HEADER: &str = "x-drill-copy";

/// A running tap.
pub struct Tap {
    copied: Arc<AtomicU64>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Tap {
    /// Starts copying `share` (0..1) of the step messages under `topology`.
    pub fn start(settings: BrokerSettings, topology: Topology, share: f64, seed: u64) -> Self {
        let copied = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let task = tokio::spawn(run(
            settings,
            topology,
            share,
            Rng::new(seed ^ 0x7a9),
            copied.clone(),
            stop.clone(),
        ));
        Self { copied, stop, task }
    }

    /// Stops the tap; returns how many copies were published (and confirmed).
    pub async fn stop(self) -> u64 {
        self.stop.cancel();
        let _ = self.task.await;
        self.copied.load(Ordering::Relaxed)
    }
}

async fn run(
    settings: BrokerSettings,
    topology: Topology,
    share: f64,
    mut rng: Rng,
    copied: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    // The broker faults close this connection too: the tap comes back like any client.
    while !stop.is_cancelled() {
        if let Err(e) = session(&settings, &topology, share, &mut rng, &copied, &stop).await {
            tracing::debug!(error = %e, "drill tap lost the broker; reconnecting");
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.cancelled() => {}
            }
        }
    }
}

async fn session(
    settings: &BrokerSettings,
    topology: &Topology,
    share: f64,
    rng: &mut Rng,
    copied: &AtomicU64,
    stop: &CancellationToken,
) -> Result<(), broker::Error> {
    let conn = broker::connect(settings, "drill-tap").await?;
    let channel = conn.create_channel().await?;
    // Exclusive: it disappears with the connection, so a drill never leaves it behind.
    let queue = format!("{}.drill-tap", topology.steps_queue());
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), exclusive, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            queue.as_str().into(),
            topology.steps_exchange().into(),
            STEP_ROUTING_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let no_ack = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut seen = channel
        .basic_consume(
            queue.as_str().into(),
            "drill-tap".into(),
            no_ack,
            FieldTable::default(),
        )
        .await?;
    let publisher = Publisher::open(&conn, Duration::from_secs(30)).await?;
    let mut held: Vec<Outgoing> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            d = seen.next() => {
                let Some(d) = d else { return Ok(()) };
                let d = d?;
                let headers = d.properties.headers().clone().unwrap_or_default();
                if headers.inner().contains_key(COPY_HEADER) || rng.unit() >= share {
                    continue;
                }
                let mut headers = headers;
                headers.insert(COPY_HEADER.into(), AMQPValue::Boolean(true));
                held.push(Outgoing {
                    message_id: d.properties.message_id().as_ref().map(|m| m.to_string()).unwrap_or_default(),
                    exchange: topology.steps_exchange(),
                    routing_key: STEP_ROUTING_KEY.into(),
                    headers,
                    body: d.data,
                });
            }
            _ = tick.tick() => {
                rng.shuffle(&mut held);
                let out = std::mem::take(&mut held);
                let ok = publisher.publish_all(&out).await.iter().filter(|r| r.is_ok()).count();
                copied.fetch_add(ok as u64, Ordering::Relaxed);
            }
            _ = stop.cancelled() => {
                let _ = conn.close(200, "drill done".into()).await;
                return Ok(());
            }
        }
    }
}

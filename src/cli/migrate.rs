//! `trailmark migrate`: database, schema and broker topology, idempotently.

use anyhow::Context;

use crate::broker::{self, Topology};
use crate::config::{Settings, redact_url};
use crate::store;

/// Creates the database if missing, applies migrations and declares the topology.
pub async fn migrate(settings: &Settings) -> anyhow::Result<()> {
    store::ensure_database(&settings.database).await?;
    let pool = store::connect(&settings.database).await?;
    store::migrate(&pool).await?;
    let applied = store::migrations_applied(&pool)
        .await
        .context("reading the migration history")?;
    println!(
        "database ready: {} ({applied} migrations applied)",
        redact_url(&settings.database.url)
    );
    declare_topology(settings).await?;
    println!(
        "broker topology declared at {} under prefix {:?}",
        redact_url(&settings.broker.url),
        settings.broker.prefix
    );
    Ok(())
}

/// Declares exchanges and queues (also done by every worker at start).
pub async fn declare_topology(settings: &Settings) -> anyhow::Result<()> {
    let conn = broker::connect(&settings.broker, "migrate").await?;
    let channel = conn.create_channel().await.map_err(broker::Error::from)?;
    Topology::new(&settings.broker.prefix, settings.broker.delivery_limit)
        .declare(&channel)
        .await
        .map_err(broker::Error::from)
        .context("declaring exchanges and queues (an existing queue with other arguments must be deleted first)")?;
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

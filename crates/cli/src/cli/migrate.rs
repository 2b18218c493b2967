//! `trailmark migrate`: database, schema and broker topology, idempotently.

use anyhow::Context;

use trailmark::broker;
use trailmark::config::Settings;
use trailmark::redact;
use trailmark::store;

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
        redact::url(&settings.database.url)
    );
    broker::declare_topology(&settings.broker)
        .await
        .context("declaring exchanges and queues (an existing queue with other arguments must be deleted first)")?;
    println!(
        "broker topology declared at {} under prefix {:?}",
        redact::url(&settings.broker.url),
        settings.broker.prefix
    );
    Ok(())
}

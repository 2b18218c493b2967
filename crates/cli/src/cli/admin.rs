//! `trailmark token new` and `trailmark audit`.

use clap::Subcommand;
use trailmark::api::{Role, new_token};
use trailmark::config::Settings;
use trailmark::store::{self, audit};

/// The `token` subcommands.
#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a token for the API: prints it once, and the line to put in `api.tokens`.
    New {
        /// Who holds it (recorded as the actor of what they do).
        #[arg(long)]
        name: String,
        /// viewer, operator or admin.
        #[arg(long)]
        role: String,
    },
}

/// Runs a `token` subcommand (no server is needed: only the hash goes into the configuration).
pub fn token(command: TokenCommand) -> anyhow::Result<()> {
    let TokenCommand::New { name, role } = command;
    if name.is_empty() || name.contains([':', ',']) {
        anyhow::bail!("--name must be non-empty and contain no ':' or ','");
    }
    let role: Role = role.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let (secret, entry) = new_token(&name, role);
    println!("token for {name} ({}), shown once: {secret}", role.as_str());
    println!("add to the configuration's [api] tokens list:");
    println!("  tokens = [\"{entry}\"]");
    println!("or to the environment (comma-separated with the others):");
    println!("  TRAILMARK__API__TOKENS={entry}");
    Ok(())
}

/// `trailmark audit [--target T] [--limit N] [--json]`: who did what, when and why, newest first.
pub async fn audit(
    settings: &Settings,
    target: Option<&str>,
    limit: i64,
    as_json: bool,
) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let entries = audit::list(&pool, target, None, limit).await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    if entries.is_empty() {
        println!(
            "no audit entries{}",
            target.map(|t| format!(" about {t}")).unwrap_or_default()
        );
    }
    for e in entries {
        let change = match (&e.status_before, &e.status_after) {
            (Some(b), Some(a)) => format!(" ({b} -> {a})"),
            _ => String::new(),
        };
        println!(
            "{}  {} ({}, {})  {} {}{change}: {}",
            e.at.format("%Y-%m-%d %H:%M:%S"),
            e.actor,
            e.role,
            e.via,
            e.action,
            e.target,
            e.reason
        );
    }
    Ok(())
}

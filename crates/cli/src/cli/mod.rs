//! Operator commands behind the `trailmark` binary; one file per command group.
//! This is binary glue, so it reports with `anyhow`; library errors stay typed underneath.

pub mod admin;
pub mod bench;
pub mod decide;
pub mod demo;
pub mod dlq;
pub mod drill;
pub mod event;
pub mod fork;
pub mod limit;
pub mod migrate;
pub mod prune;
pub mod replay;
pub mod run;
pub mod runs;
pub mod schedule;
pub mod serve;
mod table;
pub mod watch;
pub mod workflow;

/// The exit code for an error: 2 when a server is down or the configuration is wrong (what an
/// operator or a supervisor like systemd must look at), 1 when the request itself was refused.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use trailmark::error::Reaction;
    use trailmark::reaction::reaction;
    match reaction(e.as_ref()) {
        Reaction::Retry | Reaction::Fix => 2,
        _ => 1,
    }
}

/// Asks on the terminal before a change that cannot be taken back, unless `yes`; refuses when
/// there is no terminal to ask on. `hint` tells how to look first ("Check ... with `...`, ").
pub(crate) async fn confirm(what: &str, hint: &str, yes: bool) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        anyhow::bail!(
            "refusing to {what} without confirmation: stdin is not a terminal. {hint}then add --yes"
        );
    }
    eprint!("About to {what}. Go on? [y/N] ");
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await?
    .map_err(|e| anyhow::anyhow!("reading the answer from stdin: {e}"))?;
    match answer.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(()),
        _ => anyhow::bail!("not confirmed; nothing was changed"),
    }
}

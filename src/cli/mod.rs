//! Operator commands behind the `trailmark` binary; one file per command group.
//! This is binary glue, so it reports with `anyhow`; library errors stay typed underneath.

pub mod bench;
pub mod decide;
pub mod demo;
pub mod dlq;
pub mod migrate;
pub mod run;
pub mod runs;
pub mod serve;

/// Whether an error means a server is down or misaddressed (exit code 2) rather than a bad
/// request or a failure (exit code 1).
pub fn is_unavailable(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<crate::store::Error>(),
            Some(crate::store::Error::Unavailable(_))
        ) || matches!(
            cause.downcast_ref::<crate::broker::Error>(),
            Some(crate::broker::Error::Unavailable(_))
        ) || matches!(
            cause.downcast_ref::<crate::engine::Error>(),
            Some(crate::engine::Error::Store(
                crate::store::Error::Unavailable(_)
            ))
        )
    })
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

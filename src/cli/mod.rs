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
    use crate::{bench, broker, dlq, engine, store};
    // The library errors that wrap store or broker errors are transparent (their text is the
    // inner one's), so the inner error is not in the chain: look inside them here.
    let store_down = |e: &store::Error| matches!(e, store::Error::Unavailable(_));
    let broker_down = |e: &broker::Error| matches!(e, broker::Error::Unavailable(_));
    e.chain().any(|cause| {
        cause.downcast_ref::<store::Error>().is_some_and(store_down)
            || cause
                .downcast_ref::<broker::Error>()
                .is_some_and(broker_down)
            || match cause.downcast_ref::<engine::Error>() {
                Some(engine::Error::Store(e)) => store_down(e),
                _ => false,
            }
            || match cause.downcast_ref::<bench::Error>() {
                Some(bench::Error::Store(e)) => store_down(e),
                Some(bench::Error::Broker(e)) => broker_down(e),
                _ => false,
            }
            || match cause.downcast_ref::<dlq::Error>() {
                Some(dlq::Error::Broker(e)) => broker_down(e),
                _ => false,
            }
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

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

//! Workflows that ship with the engine: `chain`, for smoke tests, drills and benchmarks.

pub mod chain;

use crate::workflow::Registry;

/// A registry holding every built-in workflow.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(chain::workflow());
    r
}

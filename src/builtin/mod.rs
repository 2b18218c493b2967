//! Workflows that ship with trailmark: `chain`, for smoke tests, drills and benchmarks, and
//! `reconcile`, the reference scenario (see [`crate::reference`]).

pub mod chain;

use crate::workflow::Registry;

/// A registry holding every built-in workflow.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(chain::workflow());
    r.register(crate::reference::workflow::workflow());
    r
}

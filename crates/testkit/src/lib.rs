//! The project's own test kit: the `chain` workflow, which the CLI (`trailmark run start
//! --workflow chain`), the drill, the bench and the tests drive without writing code, and its
//! ledger; and `debounced`, a one-step workflow that debounces its starts by key. It lives beside the engine, not in it, so an embedder's engine carries no test
//! scaffolding; it builds on the engine's `testkit` feature.

pub mod chain;
pub mod debounced;
pub mod ledger;

use trailmark::workflow::Registry;

/// A registry holding the kit's workflows (`chain`, `debounced`).
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(chain::workflow());
    r.register(debounced::workflow());
    r
}

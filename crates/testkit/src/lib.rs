//! The project's own test kit: the `chain` workflow, which the CLI (`trailmark run start
//! --workflow chain`), the drill, the bench and the tests drive without writing code, and its
//! ledger. It lives beside the engine, not in it, so an embedder's engine carries no test
//! scaffolding; it builds on the engine's `testkit` feature.

pub mod chain;
pub mod ledger;

use trailmark::workflow::Registry;

/// A registry holding the kit's workflows (`chain`).
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(chain::workflow());
    r
}

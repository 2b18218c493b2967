//! The project's own test kit: the `chain` workflow, which the CLI (`trailmark run start
//! --workflow chain`), the drill, the bench and the tests drive without writing code, and its
//! ledger; and `debounced`, a one-step workflow that debounces its starts by key. It lives beside the engine, not in it, so an embedder's engine carries no test
//! scaffolding; it builds on the engine's `testkit` feature.

pub mod chain;
pub mod debounced;
pub mod ledger;
pub mod pychain;

use trailmark::workflow::Registry;

/// The environment variable that names the `chain` versions a process carries (`1,2`), so a
/// test or a drill can stand an old build and a new one side by side.
pub const CHAIN_VERSIONS: &str = "TRAILMARK_CHAIN_VERSIONS";

/// A registry holding the kit's workflows (`chain` v1, `debounced`).
pub fn registry() -> Registry {
    registry_with(&[1])
}

/// A registry holding `debounced` and `chain` at each of `chain_versions`.
pub fn registry_with(chain_versions: &[i32]) -> Registry {
    let mut r = Registry::new();
    for v in chain_versions {
        r.register(chain::workflow_v(*v));
    }
    r.register(debounced::workflow());
    r
}

/// The `chain` versions [`CHAIN_VERSIONS`] names (`[1]` when it is not set), or why the value
/// is not a list of versions.
pub fn chain_versions_from_env() -> Result<Vec<i32>, String> {
    let Ok(text) = std::env::var(CHAIN_VERSIONS) else {
        return Ok(vec![1]);
    };
    let versions: Vec<i32> = text
        .split(',')
        .map(|v| v.trim().parse::<i32>().ok().filter(|v| *v >= 1))
        .collect::<Option<_>>()
        .ok_or_else(|| {
            format!("{CHAIN_VERSIONS}={text:?} is not a list of versions from 1 up, like `1,2`")
        })?;
    Ok(versions)
}

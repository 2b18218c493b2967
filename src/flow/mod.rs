//! Sharing capacity between runs: what a workflow declares (a key read from each run's input,
//! concurrency limits per key and for the whole workflow, debounce of run starts) and the
//! machinery that holds the fleet to it.

pub mod debounce;
mod key;
mod rules;

pub use key::{KeyError, KeyField, MAX_KEY_LEN};
pub use rules::{Concurrency, Debounce, MAX_DEBOUNCE, RuleError, Rules};

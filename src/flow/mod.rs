//! Sharing capacity between runs: what a workflow declares (a key read from each run's input,
//! concurrency limits per key and for the whole workflow, debounce of run starts) and the
//! machinery that holds the fleet to it.

pub mod debounce;
pub mod dispatch;
pub mod gate;
mod key;
pub mod limits;
pub mod lines;
mod priority;
mod rules;

pub use key::{KeyError, KeyField, MAX_KEY_LEN};
pub use priority::{BadPriority, Priority};
pub use rules::{Concurrency, Debounce, MAX_DEBOUNCE, RuleError, Rules};

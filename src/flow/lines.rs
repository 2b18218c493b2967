//! What this process last saw of its keys' lines: when a key's line (or, under a workflow total,
//! the workflow's) was last found empty.
//!
//! A keyed step's end asks whether a run waits that should go first (keep the slot or give it
//! up) and whether anyone waits for a slot it frees (hand it on or not): one index probe each,
//! on every step of every keyed run. A line found empty a moment ago is taken as still empty
//! for [`FRESH`]: a run that starts waiting meanwhile is seen that much later by the runs
//! holding slots, and a slot freed meanwhile reaches it through the supervisor's loop
//! (`flow.poll_ms`) as any missed hand-off does. Limits do not rest on it: a slot is only ever
//! taken under the key's lock.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a line found empty counts as empty without a new look.
pub const FRESH: Duration = Duration::from_millis(50);

/// Past this many lines remembered, a look that finds one empty drops the stale ones: a fleet
/// with many keys does not keep one entry per key it ever saw.
const PRUNE_ABOVE: usize = 1024;

/// The lines this process found empty, and when.
#[derive(Debug, Default)]
pub struct Lines {
    empty_at: Mutex<HashMap<(String, String), Instant>>,
}

impl Lines {
    /// The line a step of `key` looks at: the key's own, or the workflow's (`shared`: a total
    /// applies, and any waiting run of the workflow counts).
    fn line(workflow: &str, key: &str, shared: bool) -> (String, String) {
        (workflow.to_owned(), if shared { String::new() } else { key.to_owned() })
    }

    /// Whether the line was found empty less than [`FRESH`] ago.
    pub fn empty(&self, workflow: &str, key: &str, shared: bool) -> bool {
        let seen = self.empty_at.lock().expect("lines lock");
        seen.get(&Self::line(workflow, key, shared))
            .is_some_and(|at| at.elapsed() < FRESH)
    }

    /// Notes what a look at the line found.
    pub fn saw(&self, workflow: &str, key: &str, shared: bool, empty: bool) {
        let line = Self::line(workflow, key, shared);
        match empty {
            true => self.saw_empty_at(line, Instant::now()),
            false => {
                self.empty_at.lock().expect("lines lock").remove(&line);
            }
        }
    }

    fn saw_empty_at(&self, line: (String, String), at: Instant) {
        let mut seen = self.empty_at.lock().expect("lines lock");
        if seen.len() >= PRUNE_ABOVE {
            seen.retain(|_, at| at.elapsed() < FRESH);
        }
        seen.insert(line, at);
    }

    /// Forgets what was seen of `key`'s line and its workflow's: a run of it started waiting here.
    pub fn forget(&self, workflow: &str, key: &str) {
        let mut seen = self.empty_at.lock().expect("lines lock");
        seen.remove(&Self::line(workflow, key, false));
        seen.remove(&Self::line(workflow, key, true));
    }
}

#[cfg(test)]
mod tests {
    use super::{FRESH, Lines, PRUNE_ABOVE};
    use std::time::Instant;

    #[test]
    fn a_line_seen_empty_is_empty_until_a_run_of_it_waits_here_or_a_look_finds_one() {
        let lines = Lines::default();
        assert!(!lines.empty("chain", "a", false), "never looked at");
        lines.saw("chain", "a", false, true);
        assert!(lines.empty("chain", "a", false));
        assert!(!lines.empty("chain", "b", false), "another key's line");
        assert!(!lines.empty("chain", "a", true), "the workflow's line is another");
        lines.forget("chain", "a");
        assert!(!lines.empty("chain", "a", false));
        lines.saw("chain", "b", true, true);
        assert!(lines.empty("chain", "c", true), "under a total every key looks at one line");
        lines.saw("chain", "c", true, false);
        assert!(!lines.empty("chain", "b", true));
    }

    #[test]
    fn lines_seen_long_ago_are_dropped_once_many_are_remembered() {
        let lines = Lines::default();
        let long_ago = Instant::now().checked_sub(FRESH * 2).expect("a clock past FRESH");
        for i in 0..PRUNE_ABOVE {
            lines.saw_empty_at(("chain".into(), format!("k{i}")), long_ago);
        }
        lines.saw("chain", "now", false, true);
        let seen = lines.empty_at.lock().unwrap();
        assert_eq!(seen.len(), 1, "only the line seen just now is kept");
        assert!(seen.contains_key(&("chain".to_owned(), "now".to_owned())));
    }
}

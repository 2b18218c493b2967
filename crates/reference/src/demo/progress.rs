//! Progress on stderr while the demo runs: which step, and the counts that matter, as the
//! stores report them. stdout stays for the table and the closing lines.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn started() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// One line on stderr, stamped with the seconds since the demo began.
pub fn say(line: &str) {
    eprintln!("[{:>6.1}s] {line}", started().elapsed().as_secs_f64());
}

/// Prints a status line when it changes: at once when the step changes, otherwise at most once
/// a second, so a step making 312 model calls does not print 312 lines.
pub struct Ticker {
    last_head: String,
    last_line: String,
    last_at: Instant,
}

impl Ticker {
    /// A ticker that has printed nothing yet.
    pub fn new() -> Self {
        started();
        Self {
            last_head: String::new(),
            last_line: String::new(),
            last_at: Instant::now(),
        }
    }

    /// Offers a status: `head` names the step, `counts` the figures.
    pub fn offer(&mut self, head: &str, counts: &str) {
        let line = format!("{head}  {counts}");
        let step_changed = head != self.last_head;
        let due = self.last_at.elapsed() >= Duration::from_secs(1);
        if line != self.last_line && (step_changed || due) {
            say(&line);
            self.last_head = head.to_owned();
            self.last_line = line;
            self.last_at = Instant::now();
        }
    }
}

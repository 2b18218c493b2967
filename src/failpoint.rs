//! Named failpoints for crash tests and drills: `TRAILMARK_FAILPOINTS="name=kill@24;other=error@1"`.
//!
//! `kill` sends SIGKILL to this very process (a real crash: no destructors, no flush, no ack);
//! `error` makes the spot fail like a lost database connection. `@N` fires on the N-th hit only;
//! without it the action fires on every hit.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

/// What a failpoint does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL this process.
    Kill,
    /// Return an injected error.
    Error,
}

#[derive(Debug)]
struct Point {
    action: Action,
    nth: Option<u64>,
    hits: u64,
}

/// An injected failure.
#[derive(Debug, thiserror::Error)]
#[error("failpoint {0} fired (injected failure)")]
pub struct Injected(pub String);

/// The configured failpoints of a process, and its drill seams; empty (and free) unless
/// configured.
#[derive(Debug, Clone, Default)]
pub struct Failpoints {
    points: Arc<Mutex<HashMap<String, Point>>>,
    seams: Option<Arc<crate::seams::Seams>>,
}

impl Failpoints {
    /// Reads `TRAILMARK_FAILPOINTS` and the drill seams (`TRAILMARK_DRILL`); only the project's
    /// own tools read them, so an embedder's environment cannot arm a crash.
    #[cfg(feature = "testkit")]
    pub fn from_env() -> Result<Self, String> {
        let mut fp = match std::env::var("TRAILMARK_FAILPOINTS") {
            Ok(spec) => Self::parse(&spec)?,
            Err(_) => Self::default(),
        };
        fp.seams = crate::seams::Seams::from_env()?.map(Arc::new);
        Ok(fp)
    }

    /// The drill seams, when a drill switched them on.
    pub fn seams(&self) -> Option<&crate::seams::Seams> {
        self.seams.as_deref()
    }

    /// Parses `name=action[@nth];...`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let fp = Self::default();
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, rest) = part
                .split_once('=')
                .ok_or_else(|| format!("failpoint {part:?}: expected name=action[@n]"))?;
            let (action, nth) = match rest.split_once('@') {
                Some((a, n)) => (
                    a,
                    Some(
                        n.parse::<u64>()
                            .map_err(|_| format!("failpoint {part:?}: @{n} is not a number"))?,
                    ),
                ),
                None => (rest, None),
            };
            let action = match action {
                "kill" => Action::Kill,
                "error" => Action::Error,
                other => {
                    return Err(format!(
                        "failpoint {part:?}: unknown action {other:?} (kill or error)"
                    ));
                }
            };
            fp.set(name.trim(), action, nth);
        }
        Ok(fp)
    }

    /// Arms `name` (tests in the same process use this for `Error`).
    pub fn set(&self, name: &str, action: Action, nth: Option<u64>) {
        let mut points = self.points.lock().expect("failpoint lock");
        points.insert(
            name.to_owned(),
            Point {
                action,
                nth,
                hits: 0,
            },
        );
    }

    /// Passes the named spot.
    pub fn hit(&self, name: &str) -> Result<(), Injected> {
        let mut points = self.points.lock().expect("failpoint lock");
        let Some(point) = points.get_mut(name) else {
            return Ok(());
        };
        point.hits += 1;
        if point.nth.is_some_and(|n| n != point.hits) {
            return Ok(());
        }
        match point.action {
            Action::Error => Err(Injected(name.to_owned())),
            Action::Kill => {
                tracing::error!(
                    failpoint = name,
                    "failpoint fired: killing this process with SIGKILL"
                );
                kill_self()
            }
        }
    }
}

fn kill_self() -> ! {
    // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    // SIGKILL cannot be caught; this line is never reached.
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_fires_on_the_nth_hit_only() {
        let fp = Failpoints::parse("a=error@2").unwrap();
        assert!(fp.hit("a").is_ok());
        assert!(fp.hit("a").is_err());
        assert!(fp.hit("a").is_ok());
        assert!(fp.hit("unset").is_ok());
    }

    #[test]
    fn bad_specs_are_refused_with_the_part() {
        assert!(
            Failpoints::parse("a=explode")
                .unwrap_err()
                .contains("explode")
        );
        assert!(Failpoints::parse("nothing").is_err());
    }
}

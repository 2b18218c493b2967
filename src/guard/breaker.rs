//! A circuit breaker per tool, per process: after N consecutive failures the tool is not called
//! for a while, then one probe decides whether it closes. A refused call was never made, so the
//! step that wanted it waits for the probe without spending an attempt (`StepError::BreakerOpen`);
//! a probe that never reports (its step was cancelled) is given up after the open period, so a
//! lost probe cannot keep the breaker refusing for ever.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the breaker says about a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Call the tool.
    Allow,
    /// Do not call; try again after this long.
    Refuse(Duration),
}

#[derive(Debug, Default)]
struct State {
    failures: u32,
    open_until: Option<Instant>,
    /// When the probe now in flight was let through.
    probing: Option<Instant>,
}

/// Breakers for every tool this process calls.
#[derive(Debug)]
pub struct Breakers {
    threshold: u32,
    open_for: Duration,
    tools: Mutex<HashMap<String, State>>,
}

impl Breakers {
    /// Opens after `threshold` consecutive failures (0 disables), for `open_for`.
    pub fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            threshold,
            open_for,
            tools: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `tool` may be called at `now`; after the open period one caller gets the probe.
    pub fn check(&self, tool: &str, now: Instant) -> Decision {
        if self.threshold == 0 {
            return Decision::Allow;
        }
        let mut tools = self.tools.lock().expect("breaker lock");
        let state = tools.entry(tool.to_owned()).or_default();
        if let Some(wait) = self.refusal(state, now) {
            return Decision::Refuse(wait);
        }
        if state.open_until.is_some() {
            state.probing = Some(now);
        }
        Decision::Allow
    }

    /// What [`Self::check`] would answer at `now`, without taking the probe: a step asks it
    /// before it records an intent, so that a call the breaker would refuse leaves no record.
    pub fn peek(&self, tool: &str, now: Instant) -> Decision {
        if self.threshold == 0 {
            return Decision::Allow;
        }
        let tools = self.tools.lock().expect("breaker lock");
        match tools.get(tool).and_then(|state| self.refusal(state, now)) {
            Some(wait) => Decision::Refuse(wait),
            None => Decision::Allow,
        }
    }

    /// How long a breaker in `state` refuses from `now`: `None` when it is closed or its probe
    /// is free to take.
    fn refusal(&self, state: &State, now: Instant) -> Option<Duration> {
        match state.open_until {
            None => None,
            Some(until) if now < until => Some(until - now),
            // Asked again soon: the probe's outcome decides for everyone.
            Some(_) if state.probing.is_some_and(|since| now < since + self.open_for) => {
                Some(self.open_for.min(Duration::from_secs(1)))
            }
            Some(_) => None,
        }
    }

    /// How long `tool` is still refused from `now`, if its breaker is open; takes no probe.
    pub fn refusing(&self, tool: &str, now: Instant) -> Option<Duration> {
        let tools = self.tools.lock().expect("breaker lock");
        let until = tools.get(tool)?.open_until?;
        (now < until).then(|| until - now)
    }

    /// Records the outcome of a call that was allowed; returns the breaker's change, if any:
    /// `Some(true)` it opened, `Some(false)` it closed.
    pub fn record(&self, tool: &str, ok: bool, now: Instant) -> Option<bool> {
        if self.threshold == 0 {
            return None;
        }
        let mut tools = self.tools.lock().expect("breaker lock");
        let state = tools.entry(tool.to_owned()).or_default();
        if ok {
            let was_open = state.open_until.is_some();
            *state = State::default();
            if was_open {
                tracing::info!(tool, "circuit breaker closed");
            }
            return was_open.then_some(false);
        }
        state.failures += 1;
        if state.probing.is_some() || state.failures >= self.threshold {
            let opens = state.open_until.is_none();
            if opens || state.probing.is_some() {
                tracing::warn!(tool, failures = state.failures, "circuit breaker open");
            }
            state.open_until = Some(now + self.open_for);
            state.probing = None;
            return opens.then_some(true);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_probes_once_then_closes_on_success() {
        let b = Breakers::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(b.check("ledger", t0), Decision::Allow);
            b.record("ledger", false, t0);
        }
        assert_eq!(
            b.check("ledger", t0 + Duration::from_secs(4)),
            Decision::Refuse(Duration::from_secs(6))
        );
        assert_eq!(
            b.check("stock", t0),
            Decision::Allow,
            "breakers are per tool"
        );
        let later = t0 + Duration::from_secs(11);
        assert_eq!(
            b.check("ledger", later),
            Decision::Allow,
            "one probe after the open period"
        );
        assert!(
            matches!(b.check("ledger", later), Decision::Refuse(_)),
            "only one probe at a time"
        );
        b.record("ledger", true, later);
        assert_eq!(b.check("ledger", later), Decision::Allow);
    }

    #[test]
    fn a_failed_probe_reopens_at_once() {
        let b = Breakers::new(2, Duration::from_secs(5));
        let t0 = Instant::now();
        b.record("mail", false, t0);
        b.record("mail", false, t0);
        let later = t0 + Duration::from_secs(6);
        assert_eq!(b.check("mail", later), Decision::Allow);
        b.record("mail", false, later);
        assert_eq!(
            b.refusing("mail", later),
            Some(Duration::from_secs(5)),
            "open again, for the whole period"
        );
        assert_eq!(
            b.check("mail", later),
            Decision::Refuse(Duration::from_secs(5))
        );
    }

    #[test]
    fn a_probe_that_never_reports_is_given_up_after_the_open_period() {
        let b = Breakers::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        b.record("mail", false, t0);
        let half_open = t0 + Duration::from_secs(5);
        assert_eq!(b.check("mail", half_open), Decision::Allow, "the probe");
        // Its step is cancelled: no record comes.
        let soon = half_open + Duration::from_secs(4);
        assert_eq!(
            b.check("mail", soon),
            Decision::Refuse(Duration::from_secs(1))
        );
        let later = half_open + Duration::from_secs(5);
        assert_eq!(b.check("mail", later), Decision::Allow, "another probe");
    }

    #[test]
    fn a_peek_answers_like_a_check_but_leaves_the_probe() {
        let b = Breakers::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(b.peek("mail", t0), Decision::Allow, "never failed");
        b.record("mail", false, t0);
        let open = t0 + Duration::from_secs(2);
        assert_eq!(b.peek("mail", open), Decision::Refuse(Duration::from_secs(3)));
        let half_open = t0 + Duration::from_secs(5);
        for _ in 0..2 {
            assert_eq!(b.peek("mail", half_open), Decision::Allow, "the probe is free");
        }
        assert_eq!(b.check("mail", half_open), Decision::Allow, "still free after peeks");
        assert_eq!(
            b.peek("mail", half_open),
            Decision::Refuse(Duration::from_secs(1)),
            "the probe is in flight"
        );
    }
}

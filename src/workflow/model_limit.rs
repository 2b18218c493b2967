//! Fleet-wide request and token limits per model endpoint (`model.requests_per_minute`,
//! `model.tokens_per_minute`): before a request that the journal does not answer, the step
//! reserves its place in the endpoint's last minute (`store::model_usage`). With no room the
//! step waits, holding no lease and spending no attempt ([`StepError::Throttled`]), until enough
//! usage has left the window; so the fleet stays under the provider's limit instead of learning
//! it from refusals.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{StepContext, StepError};
use crate::domain::{Admission, ModelAsk};
use crate::model::{ChatRequest, Limits, ModelClient};

/// How long after a request's own timeout its reservation may wait for the answer to be
/// journaled before it stops counting as in flight (then it counts for another minute).
const JOURNAL_MARGIN: Duration = Duration::from_secs(60);

/// How long a process takes an endpoint's refusal as the answer for its other calls, before it
/// asks again: soon enough to see room that answered calls freed early (their real usage below
/// their estimates), seldom enough that a backlog of waiting steps does not queue on the
/// endpoint's lock with refusals.
const ASK_AGAIN: Duration = Duration::from_secs(1);

/// The endpoints this process last found full, so that its waiting steps are refused without a
/// statement while nothing can have changed (one refusal an [`ASK_AGAIN`] per endpoint and
/// process, not one per waiting step).
#[derive(Default)]
pub(crate) struct FullEndpoints(Mutex<HashMap<String, Full>>);

/// An endpoint's last refusal.
struct Full {
    /// The window's usage then: requests, tokens.
    used: (u64, u64),
    /// The refused call's estimate: a smaller call may fit, and asks.
    estimate: u64,
    /// When room was to come for it.
    room_at: Instant,
    /// Until when the refusal stands for this process's calls.
    until: Instant,
}

impl FullEndpoints {
    /// The standing refusal of a call of `estimate` at `endpoint`: the window's usage and the
    /// time left until room comes.
    fn refusal(&self, endpoint: &str, estimate: u64, now: Instant) -> Option<((u64, u64), Duration)> {
        let known = self.0.lock().expect("full endpoints lock");
        let full = known.get(endpoint)?;
        (now < full.until && estimate >= full.estimate)
            .then(|| (full.used, full.room_at.saturating_duration_since(now)))
    }

    fn remember(&self, endpoint: &str, full: Full) {
        let mut known = self.0.lock().expect("full endpoints lock");
        known.insert(endpoint.to_owned(), full);
    }

    fn forget(&self, endpoint: &str) {
        let mut known = self.0.lock().expect("full endpoints lock");
        known.remove(endpoint);
    }
}

impl StepContext {
    /// Reserves the request's place at `client`'s endpoint: `None` for an endpoint without
    /// limits (no statement), the reservation otherwise. Refused, the step waits
    /// ([`StepError::Throttled`]); a request larger than the whole tokens-per-minute limit could
    /// never be made and stops the run for review.
    pub(super) async fn reserve_call(
        &self,
        client: &ModelClient,
        request: &ChatRequest,
    ) -> Result<Option<i64>, StepError> {
        let limits = client.limits();
        if !limits.any() {
            return Ok(None);
        }
        let endpoint = client.endpoint();
        let estimate = request.estimated_tokens();
        if limits.tokens_per_minute > 0 && estimate > limits.tokens_per_minute {
            return Err(self.larger_than_limit(&endpoint, estimate, limits.tokens_per_minute));
        }
        let full_endpoints = &self.tools().full_endpoints;
        if let Some((used, wait)) = full_endpoints.refusal(&endpoint, estimate, Instant::now()) {
            return Err(self.throttled(limits, &endpoint, (used, estimate), wait));
        }
        let ask = ModelAsk {
            endpoint: &endpoint,
            requests_per_minute: limits.requests_per_minute,
            tokens_per_minute: limits.tokens_per_minute,
            estimate,
            hold: client.timeout() + JOURNAL_MARGIN,
            run_id: self.run_id().as_str(),
            seq: self.seq(),
        };
        match self.tools().records.reserve_model(ask).await? {
            Admission::Reserved { id, used } => {
                full_endpoints.forget(&endpoint);
                crate::metrics::model_reserved(&endpoint, estimate, used.1 + estimate);
                Ok(Some(id))
            }
            Admission::Full { used, wait } => {
                let now = Instant::now();
                let until = now + wait.min(ASK_AGAIN);
                let room_at = now + wait;
                full_endpoints.remember(&endpoint, Full { used, estimate, room_at, until });
                Err(self.throttled(limits, &endpoint, (used, estimate), wait))
            }
        }
    }

    /// The step's wait for `endpoint`'s room, counted and logged.
    fn throttled(
        &self,
        limits: Limits,
        endpoint: &str,
        (used, estimate): ((u64, u64), u64),
        wait: Duration,
    ) -> StepError {
        crate::metrics::model_throttled(endpoint, used.1);
        tracing::debug!(endpoint, wait_ms = wait.as_millis() as u64, "model call waits for the endpoint's limit");
        StepError::throttled(full(limits, used, estimate), endpoint, wait)
    }

    /// The reserved request failed: it counts at its estimate from now (the provider counted
    /// the request). Not recorded (logged), it counts a little longer: safe.
    pub(super) async fn reserved_call_failed(&self, reserved: Option<i64>) {
        let Some(id) = reserved else { return };
        if let Err(e) = self.tools().records.model_call_failed(id).await {
            tracing::warn!(error = %e, reservation = id, "a failed model call's reservation was not closed; it counts until it ages out");
        }
    }

    fn larger_than_limit(&self, endpoint: &str, estimate: u64, limit: u64) -> StepError {
        StepError::Guard(format!(
            "run {run} step {} (position {}): its model call needs up to {estimate} tokens (the prompt's estimate plus max_tokens), more than model.tokens_per_minute ({limit}) allows {endpoint} in a whole minute, so it can never be made; raise model.tokens_per_minute and restart the workers, then `trailmark run resume {run}`, or shorten the prompt or max_tokens and resume after the fix",
            self.step(),
            self.seq(),
            run = self.run_id(),
        ))
    }
}

/// Which of the limits has no room, with the window's usage (`used`: requests, tokens), as the
/// step's wait names it.
fn full(limits: Limits, (requests, tokens): (u64, u64), estimate: u64) -> String {
    let mut full = Vec::new();
    let rpm = limits.requests_per_minute;
    if rpm > 0 && requests + 1 > rpm {
        full.push(format!("requests-per-minute limit ({requests} of {rpm} used)"));
    }
    let tpm = limits.tokens_per_minute;
    if tpm > 0 && tokens + estimate > tpm {
        full.push(format!(
            "tokens-per-minute limit ({tokens} of {tpm} used, this call needs up to {estimate})"
        ));
    }
    full.join(" and ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_stands_a_second_for_calls_at_least_as_large() {
        let known = FullEndpoints::default();
        let now = Instant::now();
        let full = Full {
            used: (3, 950),
            estimate: 84,
            room_at: now + Duration::from_secs(20),
            until: now + ASK_AGAIN,
        };
        known.remember("e", full);
        let (used, wait) = known.refusal("e", 84, now).expect("refused without asking");
        assert_eq!((used, wait), ((3, 950), Duration::from_secs(20)));
        assert!(known.refusal("e", 40, now).is_none(), "a smaller call may fit: it asks");
        assert!(known.refusal("other", 84, now).is_none());
        assert!(known.refusal("e", 84, now + ASK_AGAIN).is_none(), "then asks again");
        known.forget("e");
        assert!(known.refusal("e", 84, now).is_none(), "room found: forgotten");
    }

    #[test]
    fn the_wait_names_each_full_limit_with_its_usage() {
        let limits = Limits {
            requests_per_minute: 10,
            tokens_per_minute: 1000,
        };
        assert_eq!(
            full(limits, (3, 950), 84),
            "tokens-per-minute limit (950 of 1000 used, this call needs up to 84)"
        );
        assert_eq!(
            full(limits, (10, 100), 84),
            "requests-per-minute limit (10 of 10 used)"
        );
        assert_eq!(
            full(limits, (10, 999), 84),
            "requests-per-minute limit (10 of 10 used) and tokens-per-minute limit (999 of 1000 used, this call needs up to 84)"
        );
    }
}

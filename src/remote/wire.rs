//! The step protocol's JSON, as the worker sends and reads it (`docs/STEP_PROTOCOL.md`), and
//! how an endpoint's answer becomes a step outcome or a classified step error.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Threshold;
use crate::workflow::{Children, EventWait, StepError, StepOutcome};

/// The protocol's name and version, in every call and manifest.
pub const PROTOCOL: &str = "trailmark-step/1";

/// One attempt's call to the endpoint (not `Debug`: it holds the attempt's token).
#[derive(Serialize)]
pub struct StepCall<'a> {
    /// [`PROTOCOL`].
    pub protocol: &'static str,
    /// The run.
    pub run_id: &'a str,
    /// The run's workflow and version.
    pub workflow: &'a str,
    /// The run's version.
    pub version: i32,
    /// The step's declared name.
    pub step: &'a str,
    /// The run's position (from 0).
    pub position: i32,
    /// The attempt (from 1).
    pub attempt: i32,
    /// The lease's fencing token, carried back by every callback.
    pub fence: i64,
    /// The run's input.
    pub input: &'a Value,
    /// What the journal holds for this position, in call order.
    pub journal: Vec<Value>,
    /// The step undone, when this attempt is a compensation.
    pub undo: Option<Value>,
    /// Where and with which token to call back.
    pub callback: Callback<'a>,
    /// How long the worker waits for the answer.
    pub deadline_ms: u64,
}

/// Where an attempt's callbacks go.
#[derive(Serialize)]
pub struct Callback<'a> {
    /// The base URL; each op is a path under it.
    pub url: &'a str,
    /// The attempt's token.
    pub token: &'a str,
}

/// An error as the protocol carries it, both ways.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireError {
    /// `temporary`, `unknown`, `conflict` or `auth`.
    pub class: String,
    /// What happened.
    pub message: String,
    /// A delay the endpoint asks for before a temporary failure's retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl WireError {
    /// How a step error is told to the endpoint (the classes an SDK raises).
    pub fn of(e: &StepError) -> Self {
        let (class, retry_after_ms) = match e {
            StepError::Temporary { retry_after, .. } => {
                ("temporary", retry_after.map(|d| d.as_millis() as u64))
            }
            StepError::BreakerOpen { wait, .. } | StepError::Throttled { wait, .. } => {
                ("temporary", Some(wait.as_millis() as u64))
            }
            StepError::Infrastructure(_) => ("temporary", None),
            StepError::Conflict(_) => ("conflict", None),
            StepError::Auth(_) => ("auth", None),
            _ => ("unknown", None),
        };
        Self {
            class: class.into(),
            message: e.to_string(),
            retry_after_ms,
        }
    }

    /// The step error the endpoint reported; `who` names the endpoint, run and step.
    pub fn into_step_error(self, who: &str) -> StepError {
        let message = format!("{who}: {}", self.message);
        match self.class.as_str() {
            "temporary" => StepError::Temporary {
                reason: message,
                retry_after: self.retry_after_ms.map(Duration::from_millis),
            },
            "conflict" => StepError::Conflict(message),
            "auth" => StepError::Auth(message),
            "unknown" => StepError::Unknown(message),
            other => StepError::Unknown(format!(
                "{message} (the endpoint answered the error class {other:?}, which is none of temporary, unknown, conflict, auth: fix the endpoint)"
            )),
        }
    }
}

/// A step's outcome as the endpoint answers it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Outcome {
    output: Value,
    next: Value,
    #[serde(default)]
    pause: Option<Pause>,
}

/// What the run waits for before its next step.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pause {
    #[serde(default)]
    sleep_secs: Option<f64>,
    #[serde(default)]
    sleep_until: Option<chrono::DateTime<chrono::Utc>>,
    #[serde(default)]
    event: Option<EventPause>,
    #[serde(default)]
    children: Option<ChildrenPause>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventPause {
    name: String,
    #[serde(default)]
    key: Option<String>,
    timeout_secs: f64,
    #[serde(default)]
    on_timeout_goto: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChildrenPause {
    items: Vec<ChildItem>,
    #[serde(default)]
    max_in_flight: Option<usize>,
    #[serde(default)]
    first: Option<usize>,
    #[serde(default)]
    fail_threshold: Option<serde_json::Number>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChildItem {
    workflow: String,
    input: Value,
}

/// The endpoint's answer to a step call: an outcome, or the error it reports. The error of
/// `Err` says what is wrong with the body (the caller adds who sent it).
pub fn answer(body: &[u8]) -> Result<Result<StepOutcome, WireError>, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    if let Some(error) = value.get("error") {
        let e: WireError = serde_json::from_value(error.clone())
            .map_err(|e| format!("an error without its class and message ({e})"))?;
        return Ok(Err(e));
    }
    let outcome: Outcome =
        serde_json::from_value(value).map_err(|e| format!("not a step outcome ({e})"))?;
    outcome.into_step().map(Ok)
}

impl Outcome {
    fn into_step(self) -> Result<StepOutcome, String> {
        let base = match &self.next {
            Value::String(s) if s == "continue" => StepOutcome::next(self.output),
            Value::String(s) if s == "finish" => StepOutcome::finish(self.output),
            Value::String(s) if s == "wait" => StepOutcome::wait(self.output),
            Value::Object(o) if o.len() == 1 && o.get("goto").is_some_and(Value::is_string) => {
                StepOutcome::goto(self.output, o["goto"].as_str().unwrap_or_default())
            }
            other => {
                return Err(format!(
                    "`next` is {other}, not one of \"continue\", \"finish\", \"wait\", {{\"goto\": STEP}}"
                ));
            }
        };
        match self.pause {
            None => Ok(base),
            Some(p) => p.apply(base),
        }
    }
}

impl Pause {
    fn apply(self, base: StepOutcome) -> Result<StepOutcome, String> {
        let set = [
            self.sleep_secs.is_some(),
            self.sleep_until.is_some(),
            self.event.is_some(),
            self.children.is_some(),
        ];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err(
                "`pause` must hold exactly one of sleep_secs, sleep_until, event, children".into(),
            );
        }
        if let Some(secs) = self.sleep_secs {
            return Ok(base.sleeping_for(seconds("pause.sleep_secs", secs)?));
        }
        if let Some(at) = self.sleep_until {
            return Ok(base.sleeping_until(at));
        }
        if let Some(e) = self.event {
            let mut wait =
                EventWait::new(e.name, seconds("pause.event.timeout_secs", e.timeout_secs)?);
            if let Some(key) = e.key {
                wait = wait.key(key);
            }
            if let Some(step) = e.on_timeout_goto {
                wait = wait.on_timeout_goto(step);
            }
            return Ok(base.waiting_for(wait));
        }
        let c = self.children.expect("one pause is set");
        Ok(base.with_children(c.children()?))
    }
}

impl ChildrenPause {
    fn children(self) -> Result<Children, String> {
        let mut children = Children::new();
        for item in self.items {
            children = children.child(&item.workflow, item.input);
        }
        if let Some(m) = self.max_in_flight {
            children = children.max_in_flight(m);
        }
        if let Some(n) = self.first {
            children = children.first(n);
        }
        Ok(match self.fail_threshold {
            Some(f) if f.is_u64() => {
                children.fail_threshold(Threshold::Count(f.as_u64().unwrap_or(0) as usize))
            }
            Some(f) => children.fail_threshold(Threshold::Share(f.as_f64().unwrap_or(-1.0))),
            None => children,
        })
    }
}

/// A duration given in seconds: finite and more than zero (the engine checks the upper bound).
fn seconds(field: &str, secs: f64) -> Result<Duration, String> {
    if secs.is_finite() && secs > 0.0 {
        return Ok(Duration::from_secs_f64(secs));
    }
    Err(format!(
        "`{field}` must be a number of seconds above 0, got {secs}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::Next;

    #[test]
    fn each_next_and_pause_becomes_the_engine_outcome() {
        let o = answer(br#"{"output": {"a": 1}, "next": {"goto": "b"}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(o.next, Next::Goto("b".into()));
        assert_eq!(o.output, serde_json::json!({"a": 1}));
        let o = answer(br#"{"output": null, "next": "finish"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(o.next, Next::Finish);
        let o = answer(br#"{"output": 1, "next": "continue", "pause": {"sleep_secs": 2}}"#)
            .unwrap()
            .unwrap();
        assert!(o.pause().is_some());
        let o = answer(
            br#"{"output": 1, "next": "continue", "pause": {"event": {"name": "ok", "timeout_secs": 60}}}"#,
        )
        .unwrap()
        .unwrap();
        assert!(o.pause().is_some());
    }

    #[test]
    fn garbage_is_refused_with_what_is_wrong() {
        assert!(answer(b"<html>").unwrap_err().contains("not JSON"));
        assert!(
            answer(br#"{"output": 1}"#)
                .unwrap_err()
                .contains("not a step outcome")
        );
        assert!(
            answer(br#"{"output": 1, "next": "jump"}"#)
                .unwrap_err()
                .contains("`next`")
        );
        assert!(
            answer(br#"{"output": 1, "next": "continue", "pause": {}}"#)
                .unwrap_err()
                .contains("exactly one")
        );
        assert!(
            answer(br#"{"output": 1, "next": "continue", "pause": {"sleep_secs": -1}}"#)
                .unwrap_err()
                .contains("above 0")
        );
    }

    #[test]
    fn a_reported_error_keeps_its_class() {
        let e = answer(
            br#"{"error": {"class": "temporary", "message": "503", "retry_after_ms": 1500}}"#,
        )
        .unwrap()
        .unwrap_err()
        .into_step_error("endpoint py, run r step s");
        assert!(
            matches!(e, StepError::Temporary { retry_after: Some(d), .. } if d.as_millis() == 1500)
        );
        let e = WireError {
            class: "weird".into(),
            message: "x".into(),
            retry_after_ms: None,
        }
        .into_step_error("py");
        assert_eq!(e.class(), "unknown");
        assert_eq!(
            WireError::of(&StepError::Conflict("k".into())).class,
            "conflict"
        );
    }
}

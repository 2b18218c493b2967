//! Step addresses and undo plans: where a step message points, and which compensations an undo
//! runs in which order.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where a step message, a checkpoint or a run's head points: a declared step by name, or the
/// compensation of the step that ran at a position, written `undo:<step>@<seq>`. One type, so
/// that no caller builds or parses that form by hand.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
#[serde(from = "String", into = "String")]
pub struct StepAddress(String);

const UNDO_PREFIX: &str = "undo:";

impl StepAddress {
    /// A SQL `LIKE` pattern that matches every compensation's address.
    pub const UNDO_LIKE: &'static str = "undo:%";

    /// The declared step called `name`.
    pub fn step(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    /// The compensation of `step`, which ran at position `seq`.
    pub fn undo(step: &str, seq: i32) -> Self {
        Self(format!("{UNDO_PREFIX}{step}@{seq}"))
    }

    /// The address as stored and sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// For a compensation: the step it undoes and that step's position.
    pub fn undo_of(&self) -> Option<(&str, i32)> {
        let rest = self.0.strip_prefix(UNDO_PREFIX)?;
        let (step, seq) = rest.rsplit_once('@')?;
        Some((step, seq.parse().ok()?))
    }

    /// Whether this is a compensation.
    pub fn is_undo(&self) -> bool {
        self.undo_of().is_some()
    }

    /// The declared step whose handler (or, for a compensation, whose compensation) runs.
    pub fn declared(&self) -> &str {
        self.undo_of().map_or(self.as_str(), |(step, _)| step)
    }
}

impl From<String> for StepAddress {
    fn from(raw: String) -> Self {
        Self(raw)
    }
}

impl From<&str> for StepAddress {
    fn from(raw: &str) -> Self {
        Self(raw.to_owned())
    }
}

impl From<StepAddress> for String {
    fn from(a: StepAddress) -> String {
        a.0
    }
}

impl fmt::Display for StepAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<str> for StepAddress {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for StepAddress {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// One finished step an undo compensates, or a fan-out whose children it undoes there.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedUndo {
    /// Its position.
    pub seq: i32,
    /// Its declared name.
    pub step: String,
    /// The step started child runs: they are undone (and waited for) before its own
    /// compensation runs, their effects being newer than its own writes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub children: bool,
    /// The step declares no compensation: it is in the plan only for its children.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub children_only: bool,
}

/// What an operator's undo decided, stored with the run while it compensates: the scope every
/// compensation is handed, the steps to compensate newest first, and the writes of a step that
/// stopped halfway that no compensation reverses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UndoPlan {
    /// Handed to every compensation (`{}`: everything).
    pub scope: Value,
    /// The steps to compensate, newest first.
    pub targets: Vec<PlannedUndo>,
    /// Keys of writes left standing (undo with `--leave-partial`).
    #[serde(default)]
    pub left_standing: Vec<String>,
}

impl UndoPlan {
    /// The first compensation to run, if any step is to be compensated.
    pub fn first(&self) -> Option<StepAddress> {
        self.targets
            .first()
            .map(|t| StepAddress::undo(&t.step, t.seq))
    }

    /// The target at position `seq`.
    pub fn target(&self, seq: i32) -> Option<&PlannedUndo> {
        self.targets.iter().find(|t| t.seq == seq)
    }

    /// The compensation after `current` (newest first), or `None` when the undo is complete.
    pub fn after(&self, current: &StepAddress) -> Option<StepAddress> {
        let (_, seq) = current.undo_of()?;
        let pos = self.targets.iter().position(|t| t.seq == seq)?;
        self.targets
            .get(pos + 1)
            .map(|t| StepAddress::undo(&t.step, t.seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undo_address_round_trips_and_names_its_step() {
        let a = StepAddress::undo("post", 7);
        assert_eq!(a.as_str(), "undo:post@7");
        assert_eq!(a.undo_of(), Some(("post", 7)));
        assert_eq!(a.declared(), "post");
        let parsed: StepAddress = serde_json::from_str("\"undo:a@b@3\"").unwrap();
        assert_eq!(parsed.undo_of(), Some(("a@b", 3)));
        let plain = StepAddress::step("link");
        assert!(!plain.is_undo());
        assert_eq!(plain.declared(), "link");
        assert!(!StepAddress::step("undo:no-position").is_undo());
    }

    #[test]
    fn a_plan_runs_its_compensations_newest_first_then_ends() {
        let plan: UndoPlan = serde_json::from_value(serde_json::json!({
            "scope": {}, "targets": [{"seq": 5, "step": "b"}, {"seq": 2, "step": "a", "children": true}]
        }))
        .unwrap();
        let first = plan.first().unwrap();
        assert_eq!(first, StepAddress::undo("b", 5));
        assert_eq!(plan.after(&first), Some(StepAddress::undo("a", 2)));
        assert_eq!(plan.after(&StepAddress::undo("a", 2)), None);
        assert!(plan.left_standing.is_empty());
        assert!(plan.target(2).is_some_and(|t| t.children && !t.children_only));
        assert!(!plan.target(5).unwrap().children, "absent means no children");
    }
}

//! Run status and the transitions the engine allows.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a run stands (DESIGN.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// A step message is queued or being executed.
    Running,
    /// Waiting for a person or for a retry delay.
    Waiting,
    /// Stopped; a person must decide (handover note written).
    NeedsReview,
    /// Undo in progress.
    Compensating,
    /// Finished every step.
    Succeeded,
    /// Undo finished.
    Compensated,
    /// Ended with an error that was not handed over.
    Failed,
    /// Stopped by an operator.
    Cancelled,
}

impl RunStatus {
    /// Every status, for listings and metrics.
    pub const ALL: [RunStatus; 8] = [
        Self::Running,
        Self::Waiting,
        Self::NeedsReview,
        Self::Compensating,
        Self::Succeeded,
        Self::Compensated,
        Self::Failed,
        Self::Cancelled,
    ];

    /// The name stored in the database and shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Waiting => "waiting",
            Self::NeedsReview => "needs_review",
            Self::Compensating => "compensating",
            Self::Succeeded => "succeeded",
            Self::Compensated => "compensated",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// True when no step will run again without an operator decision.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Compensated | Self::Failed | Self::Cancelled
        )
    }

    /// Whether a worker may execute steps of a run in this status.
    pub fn accepts_steps(self) -> bool {
        matches!(self, Self::Running | Self::Compensating)
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown status name.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown run status {0:?}: expected one of running, waiting, needs_review, compensating, succeeded, compensated, failed, cancelled"
)]
pub struct UnknownStatus(String);

impl FromStr for RunStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for st in RunStatus::ALL {
            assert_eq!(st.as_str().parse::<RunStatus>().unwrap(), st);
        }
        assert!("done".parse::<RunStatus>().is_err());
    }
}

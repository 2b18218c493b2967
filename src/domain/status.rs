//! Run status and the one table of moves between statuses that every writer checks.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a run stands (see `docs/ARCHITECTURE.md`, "Vocabulary").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
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
    /// A shadow fork finished every step; its outside writes were recorded, never made.
    Shadowed,
}

use RunStatus::*;

/// Every move a run's status may make, by status of departure. Writers ask
/// [`RunStatus::move_to`] before they bind a new status into SQL, so no statement can put a run
/// where this table does not allow (a move to the same status is a step that advanced the run).
const MOVES: [(RunStatus, &[RunStatus]); 9] = [
    // Steps commit (advance, end, wait for a person, stop for review); an operator cancels.
    (
        Running,
        &[
            Running,
            Succeeded,
            Shadowed,
            Waiting,
            NeedsReview,
            Cancelled,
        ],
    ),
    // The same for compensations.
    (
        Compensating,
        &[Compensating, Compensated, Waiting, NeedsReview, Cancelled],
    ),
    // A person approves, rejects or cancels, the human timeout escalates, or an undo starts.
    (
        Waiting,
        &[
            Running,
            Succeeded,
            Shadowed,
            Cancelled,
            NeedsReview,
            Compensating,
            Compensated,
        ],
    ),
    // A person resumes (forward or undo; a run stopped past its children's failure threshold
    // waits for them again), cancels, or undoes.
    (
        NeedsReview,
        &[Running, Waiting, Compensating, Cancelled, Compensated],
    ),
    // Ended runs can only be undone.
    (Succeeded, &[Compensating, Compensated]),
    (Compensated, &[Compensating, Compensated]),
    (Failed, &[Compensating, Compensated]),
    (Cancelled, &[Compensating, Compensated]),
    // A shadow run changed nothing outside: there is nothing to undo.
    (Shadowed, &[]),
];

/// A status move the table of moves allows; the only way a writer gets a status to store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// The status the writer saw.
    pub from: RunStatus,
    /// The status it writes.
    pub to: RunStatus,
}

impl Transition {
    /// Whether the run's step position moves past the step that made this transition: a
    /// committed step advances the run (also when it ends it); a run that stops for a person
    /// stays at the step that stopped it.
    pub fn advances(self) -> bool {
        matches!(
            self.to,
            Running | Compensating | Succeeded | Compensated | Shadowed
        )
    }
}

/// A status move the table does not allow: a bug in the writer, never a run to write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a run cannot move from {from} to {to}; this is a bug in trailmark, please report it")]
pub struct IllegalMove {
    /// Status of departure.
    pub from: RunStatus,
    /// The refused destination.
    pub to: RunStatus,
}

impl RunStatus {
    /// Every status, for listings and metrics.
    pub const ALL: [RunStatus; 9] = [
        Running,
        Waiting,
        NeedsReview,
        Compensating,
        Succeeded,
        Compensated,
        Failed,
        Cancelled,
        Shadowed,
    ];

    /// The statuses of runs that have not finished: few at any time, however long the history.
    pub const UNFINISHED: [RunStatus; 4] = [Running, Waiting, NeedsReview, Compensating];

    /// The statuses in which workers execute steps.
    pub const EXECUTING: [RunStatus; 2] = [Running, Compensating];

    /// The name stored in the database and shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            Running => "running",
            Waiting => "waiting",
            NeedsReview => "needs_review",
            Compensating => "compensating",
            Succeeded => "succeeded",
            Compensated => "compensated",
            Failed => "failed",
            Cancelled => "cancelled",
            Shadowed => "shadowed",
        }
    }

    /// The status of a run that finished its last step: `shadowed` for a shadow fork, which
    /// changed nothing outside, else `succeeded`.
    pub fn finished(shadow: bool) -> RunStatus {
        if shadow { Shadowed } else { Succeeded }
    }

    /// True when no step will run again without an operator decision.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Succeeded | Compensated | Failed | Cancelled | Shadowed
        )
    }

    /// Whether a worker may execute steps of a run in this status.
    pub fn accepts_steps(self) -> bool {
        Self::EXECUTING.contains(&self)
    }

    /// The move from `self` to `to`, if the table allows it.
    pub fn move_to(self, to: RunStatus) -> Result<Transition, IllegalMove> {
        let allowed = MOVES
            .iter()
            .find(|(from, _)| *from == self)
            .is_some_and(|(_, to_list)| to_list.contains(&to));
        if allowed {
            Ok(Transition { from: self, to })
        } else {
            Err(IllegalMove { from: self, to })
        }
    }

    /// The names of `statuses`, for binding a set of statuses into a statement.
    pub fn names(statuses: &[RunStatus]) -> Vec<&'static str> {
        statuses.iter().map(|s| s.as_str()).collect()
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown status name (typed by an operator, or read from a database written by a newer
/// trailmark).
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown run status {0:?}: expected one of running, waiting, needs_review, compensating, succeeded, compensated, failed, cancelled, shadowed"
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

impl TryFrom<String> for RunStatus {
    type Error = UnknownStatus;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
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

    #[test]
    fn every_status_has_one_row_of_moves() {
        for st in RunStatus::ALL {
            assert_eq!(
                MOVES.iter().filter(|(from, _)| *from == st).count(),
                1,
                "{st}"
            );
        }
    }

    #[test]
    fn ended_runs_can_only_be_undone() {
        for st in RunStatus::ALL
            .into_iter()
            .filter(|s| s.is_terminal() && *s != Shadowed)
        {
            for to in RunStatus::ALL {
                let undo = matches!(to, Compensating | Compensated);
                assert_eq!(st.move_to(to).is_ok(), undo, "{st} -> {to}");
            }
        }
    }

    #[test]
    fn a_shadow_run_ends_shadowed_and_has_nothing_to_undo() {
        assert!(Running.move_to(Shadowed).unwrap().advances());
        assert!(Shadowed.is_terminal());
        for to in RunStatus::ALL {
            assert!(Shadowed.move_to(to).is_err(), "shadowed -> {to}");
        }
    }

    #[test]
    fn a_step_commit_advances_unless_the_run_stops_for_a_person() {
        assert!(Running.move_to(Running).unwrap().advances());
        assert!(Running.move_to(Succeeded).unwrap().advances());
        assert!(Compensating.move_to(Compensated).unwrap().advances());
        assert!(!Running.move_to(Waiting).unwrap().advances());
        assert!(!Running.move_to(NeedsReview).unwrap().advances());
        assert_eq!(
            Running.move_to(Compensated),
            Err(IllegalMove {
                from: Running,
                to: Compensated
            })
        );
    }
}

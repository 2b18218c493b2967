//! How a step ends by starting child runs and waiting for them ([`Children`]), and what the
//! next step reads of them ([`ChildResult`], [`ChildrenSummary`], `StepContext::children`).
//!
//! The children are started by the step's own commit, each with a deterministic run id
//! (`<parent>:<position>:<index>`); the parent waits holding no lease and no message, and goes
//! on when the join's condition holds (`docs/WORKFLOWS.md`, "Child runs").

use serde::Serialize;
use serde_json::Value;

use crate::domain::Threshold;
pub use crate::domain::{ChildResult, ChildrenSummary};

/// The child runs a step starts, and when its run goes on: every child (or the first N) has
/// succeeded, with at most the failure threshold failed (none unless set). Beyond it the run
/// stops in `needs_review` naming the failed children.
#[derive(Debug, Clone, PartialEq)]
pub struct Children {
    /// Each child's workflow and input, by index.
    pub(crate) children: Vec<(String, Value)>,
    pub(crate) first: Option<usize>,
    pub(crate) threshold: Threshold,
    pub(crate) max_in_flight: Option<usize>,
    /// Why an input could not be made JSON: the step then stops for review.
    pub(crate) unserializable: Option<String>,
}

impl Default for Children {
    fn default() -> Self {
        Self::new()
    }
}

impl Children {
    /// No children yet; add them with [`Children::child`].
    pub fn new() -> Self {
        Self {
            children: Vec::new(),
            first: None,
            threshold: Threshold::Count(0),
            max_in_flight: None,
            unserializable: None,
        }
    }

    /// A map over `items`: one child of `workflow` per item, the item its input.
    pub fn map<T: Serialize>(workflow: &str, items: impl IntoIterator<Item = T>) -> Self {
        items
            .into_iter()
            .fold(Self::new(), |all, item| all.child(workflow, item))
    }

    /// Adds a child run of `workflow` (a workflow registered in this process) with `input`.
    pub fn child(mut self, workflow: &str, input: impl Serialize) -> Self {
        let input = serde_json::to_value(input).unwrap_or_else(|e| {
            let index = self.children.len();
            self.unserializable
                .get_or_insert_with(|| format!("the input of child {index} cannot be stored as JSON: {e}"));
            Value::Null
        });
        self.children.push((workflow.to_owned(), input));
        self
    }

    /// At most `n` children run at once; the next starts as one ends (default: all at once).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = Some(n);
        self
    }

    /// The run goes on once `n` children have succeeded; children not started by then never
    /// are (those running go on to their end).
    pub fn first(mut self, n: usize) -> Self {
        self.first = Some(n);
        self
    }

    /// How many children may fail (stop in `needs_review`, fail or be cancelled) before the run
    /// stops for review: a count, or a share of the children (0 to 1, rounded down).
    pub fn fail_threshold(mut self, threshold: Threshold) -> Self {
        self.threshold = threshold;
        self
    }
}

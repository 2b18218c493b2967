//! What a workflow declares about sharing capacity, checked where it is declared.

use std::time::Duration;

use super::{KeyError, KeyField};

/// The longest debounce window: a start held longer than this is a schedule, not a burst.
pub const MAX_DEBOUNCE: Duration = Duration::from_secs(3600);

/// Why a declared rule was refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// The key field is not a path.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// A limit of zero.
    #[error("{field} is 0: a limit must be at least 1 (to stop a workflow, pause its starts instead)")]
    ZeroLimit {
        /// `per_key` or `total`.
        field: &'static str,
    },
    /// A debounce window of zero or over [`MAX_DEBOUNCE`].
    #[error("debounce window is {0:?}; it must be more than 0 and at most an hour")]
    Window(Duration),
}

/// Concurrency limits of a workflow: at most `per_key` runs of one key (and at most `total` runs
/// of the workflow, when set) hold a step at once across the fleet. Operators change both at run
/// time (`trailmark limit set`); these are the defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Concurrency {
    /// The input field a run's key is read from.
    pub key: KeyField,
    /// Runs of one key holding a step at once, at most.
    pub per_key: u32,
    /// Runs of the whole workflow holding a step at once, at most (`None`: no such limit).
    pub total: Option<u32>,
    /// A run without the field is not limited (else it is refused at start).
    pub optional: bool,
}

impl Concurrency {
    /// Runs keyed by the input field `key` (a dotted path), at most `per_key` of a key at once.
    pub fn per_key(key: &str, per_key: u32) -> Result<Self, RuleError> {
        if per_key == 0 {
            return Err(RuleError::ZeroLimit { field: "per_key" });
        }
        Ok(Self {
            key: KeyField::parse(key)?,
            per_key,
            total: None,
            optional: false,
        })
    }

    /// Also at most `total` runs of the workflow at once, whatever their keys.
    pub fn total(mut self, total: u32) -> Result<Self, RuleError> {
        if total == 0 {
            return Err(RuleError::ZeroLimit { field: "total" });
        }
        self.total = Some(total);
        Ok(self)
    }
}

impl Concurrency {
    /// Runs whose input lacks the field run unlimited instead of being refused at start (a
    /// workflow that only some callers key).
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

/// Debounce of run starts: of the starts with one key that arrive within `window` of each other,
/// only the last one runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Debounce {
    /// The input field a start's key is read from.
    pub key: KeyField,
    /// How long a start waits for a later one with the same key.
    pub window: Duration,
}

impl Debounce {
    /// Starts keyed by the input field `key`; the last of a burst runs `window` after it came.
    pub fn new(key: &str, window: Duration) -> Result<Self, RuleError> {
        if window.is_zero() || window > MAX_DEBOUNCE {
            return Err(RuleError::Window(window));
        }
        Ok(Self {
            key: KeyField::parse(key)?,
            window,
        })
    }
}

/// Everything a workflow declares about sharing capacity.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rules {
    /// Concurrency limits, if any.
    pub concurrency: Option<Concurrency>,
    /// Debounce of run starts, if any.
    pub debounce: Option<Debounce>,
}

impl Rules {
    /// The concurrency key of a run started with `input`: `None` when the workflow declares no
    /// key, or an optional one the input lacks; refused when a required one is missing or unfit.
    pub fn key_of(&self, input: &serde_json::Value) -> Result<Option<String>, KeyError> {
        let Some(c) = &self.concurrency else {
            return Ok(None);
        };
        match c.key.value_in(input) {
            Ok(key) => Ok(Some(key)),
            Err(KeyError::Missing { .. }) if c.optional => Ok(None),
            Err(e) => Err(e),
        }
    }
}

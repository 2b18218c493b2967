//! Identifiers parsed once at the edge, so the rest of the code cannot mix them up.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Why a raw id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// Empty, too long, or with characters outside `[A-Za-z0-9._:-]`.
    #[error(
        "invalid {what} {value:?}: use 1-200 characters from A-Z a-z 0-9 . _ : - (e.g. run-2026-10-13-ldh)"
    )]
    Invalid {
        /// Which kind of id.
        what: &'static str,
        /// The refused input, truncated.
        value: String,
    },
}

fn check(what: &'static str, raw: &str) -> Result<(), IdError> {
    let ok = !raw.is_empty()
        && raw.len() <= 200
        && raw
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'));
    if ok {
        Ok(())
    } else {
        Err(IdError::Invalid {
            what,
            value: raw.chars().take(60).collect(),
        })
    }
}

/// A caller-chosen run id; starting the same id twice starts one run.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

impl RunId {
    /// Validates a raw run id.
    pub fn parse(raw: &str) -> Result<Self, IdError> {
        check("run id", raw).map(|()| Self(raw.to_owned()))
    }
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for RunId {
    type Error = IdError;
    fn try_from(raw: String) -> Result<Self, IdError> {
        check("run id", &raw).map(|()| Self(raw))
    }
}

impl From<RunId> for String {
    fn from(id: RunId) -> String {
        id.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The id of one message; the dedup (inbox) key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageId(pub Uuid);

impl MessageId {
    /// A fresh id, for a message that is being created (never for a retried one). Time-ordered
    /// (UUIDv7: a millisecond timestamp, then 74 random bits), so that the inbox row every
    /// processed message leaves goes to the end of the inbox's primary key: a random id lands on
    /// a random page of an index that holds every id of the dedup window, and after each
    /// checkpoint the first change to a page writes the whole page to the WAL again (measured in
    /// `docs/BENCHMARKS.md`, "Growth").
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl Default for MessageId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The fencing token of a run's lease; a commit carrying an older one is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fence(pub i64);

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The key an outside store enforces so that a write happens once; built from stable ids.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Builds `run_id:step:logical_input`, never from time or randomness.
    pub fn for_step(run: &RunId, step: &str, logical_input: &str) -> Self {
        Self(format!("{run}:{step}:{logical_input}"))
    }
    /// The key of the compensation of the write made under `self`: `undo:<key>`.
    pub fn undo_of(&self) -> Self {
        Self(format!("undo:{}", self.0))
    }
    /// Validates a raw key (printable ASCII, up to 400 characters).
    pub fn parse(raw: &str) -> Result<Self, IdError> {
        let ok = !raw.is_empty() && raw.len() <= 400 && raw.chars().all(|c| c.is_ascii_graphic());
        if ok {
            Ok(Self(raw.to_owned()))
        } else {
            Err(IdError::Invalid {
                what: "idempotency key",
                value: raw.chars().take(60).collect(),
            })
        }
    }
    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for IdempotencyKey {
    type Error = IdError;
    fn try_from(raw: String) -> Result<Self, IdError> {
        Self::parse(&raw)
    }
}

impl From<IdempotencyKey> for String {
    fn from(k: IdempotencyKey) -> String {
        k.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_made_one_after_another_sort_in_the_order_they_were_made() {
        // What keeps the inbox's primary key growing at its end (see `MessageId::new`).
        let ids: Vec<MessageId> = (0..10_000).map(|_| MessageId::new()).collect();
        assert!(ids.windows(2).all(|w| w[0].0 < w[1].0), "not time-ordered");
        assert!(ids.iter().all(|id| id.0.get_version_num() == 7));
    }

    #[test]
    fn run_ids_accept_the_documented_alphabet_only() {
        assert!(RunId::parse("run-2026-10-13-ldh").is_ok());
        assert!(RunId::parse("").is_err());
        assert!(RunId::parse("a b").is_err());
        assert!(RunId::parse(&"x".repeat(201)).is_err());
    }

    #[test]
    fn keys_are_built_from_stable_ids() {
        let run = RunId::parse("r1").unwrap();
        assert_eq!(
            IdempotencyKey::for_step(&run, "post", "inv-7:1").as_str(),
            "r1:post:inv-7:1"
        );
    }
}

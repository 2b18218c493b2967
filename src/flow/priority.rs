//! A run's priority among the runs waiting for a slot of its key.

use serde::{Deserialize, Serialize};

/// A run's priority, 0 (lowest) to 4 (highest); a start that names none gets [`Priority::NORMAL`].
/// Higher levels are handed slots first; a waiting run rises one level per
/// `flow.aging_secs` waited, so the lowest is served in the end however busy the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Priority(u8);

/// Why a priority was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("priority {0} is outside its levels: 0 (lowest) to 4 (highest), 2 when none is given")]
pub struct BadPriority(pub i64);

impl Priority {
    /// The highest level.
    pub const HIGHEST: Priority = Priority(4);
    /// What a start that names none gets.
    pub const NORMAL: Priority = Priority(2);

    /// A level, checked.
    pub fn new(level: i64) -> Result<Self, BadPriority> {
        match u8::try_from(level) {
            Ok(l) if l <= Self::HIGHEST.0 => Ok(Self(l)),
            _ => Err(BadPriority(level)),
        }
    }

    /// The level as stored.
    pub fn level(self) -> i16 {
        i16::from(self.0)
    }
}

impl Default for Priority {
    fn default() -> Self {
        Self::NORMAL
    }
}

impl<'de> Deserialize<'de> for Priority {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let level = i64::deserialize(d)?;
        Priority::new(level).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_priority_outside_its_levels_is_refused_naming_them() {
        assert_eq!(Priority::new(4).unwrap(), Priority::HIGHEST);
        assert!(Priority::new(5).unwrap_err().to_string().contains("0 (lowest) to 4"));
        let e = serde_json::from_str::<Priority>("-1").unwrap_err();
        assert!(e.to_string().contains("priority -1"), "{e}");
    }
}

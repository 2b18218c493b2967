//! Schedules: runs started on a cadence, a cron expression in a time zone or a fixed interval.
//!
//! A schedule is a row (`store::schedules`). The scheduler ([`fire::fire_due`], run by every
//! process's supervisor loop) takes due rows with `FOR UPDATE SKIP LOCKED` and, in the same
//! transaction, creates each tick's run with the deterministic id `<name>:<tick>` and its first
//! step in the outbox, then moves the schedule's next tick on. Whichever process fires a tick and
//! whatever dies, a tick starts one run: the transaction commits all of it or none, the lock keeps
//! two schedulers off one row, and the run id makes any second start of the same tick a no-op.
//! Ticks are judged on the database's clock. What the operator commands do is in [`ops`].

pub mod fire;
pub mod ops;

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};

use crate::domain::RunId;
use crate::store;

/// The longest interval, catch-up window and backfill range: a year and a day.
pub const LONGEST: Duration = Duration::from_secs(366 * 24 * 3600);
/// The most ticks one backfill starts.
pub const MAX_BACKFILL_TICKS: usize = 1_000;
/// The catch-up window when none is given.
pub const DEFAULT_CATCH_UP: Duration = Duration::from_secs(60);

/// Schedule errors, by what the caller does about them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value given does not fit; `field` names it.
    #[error("{field}: {message}")]
    Invalid {
        /// The option or field.
        field: &'static str,
        /// What is wrong and what would do.
        message: String,
    },
    /// No schedule has the name.
    #[error("no schedule named {0}; list them with `trailmark schedule list`")]
    NotFound(String),
    /// A schedule with the name exists and says something else.
    #[error(
        "schedule {0} exists with another workflow, input or cadence; delete it first (`trailmark schedule delete {0}`) or pick another name"
    )]
    Conflict(String),
    /// Postgres failed; nothing was changed.
    #[error("the schedules could not be read or changed")]
    Store(#[from] store::Error),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> Error {
    Error::Invalid {
        field,
        message: message.into(),
    }
}

/// When a schedule's ticks fall.
#[derive(Debug, Clone)]
pub enum Cadence {
    /// A cron expression (five fields, or six with seconds) in a time zone.
    Cron {
        /// The parsed expression.
        cron: Box<croner::Cron>,
        /// Its zone: ticks fall on its wall clock, across daylight-saving changes.
        tz: chrono_tz::Tz,
    },
    /// Every so often, on multiples of the interval since the Unix epoch (so every process and
    /// every re-creation of the schedule agrees on the ticks).
    Every(Duration),
}

impl Cadence {
    /// Parses `--cron EXPR [--tz ZONE]` (UTC when no zone is given).
    pub fn cron(expr: &str, tz: Option<&str>) -> Result<Self, Error> {
        let tz = match tz {
            None => chrono_tz::UTC,
            Some(name) => chrono_tz::Tz::from_str(name).map_err(|_| {
                invalid(
                    "tz",
                    format!(
                        "{:?} is not an IANA time zone (such as Europe/Berlin or UTC)",
                        shown(name)
                    ),
                )
            })?,
        };
        let cron = croner::Cron::from_str(expr).map_err(|e| {
            invalid(
                "cron",
                format!(
                    "{:?} does not parse ({e}); write five fields (minute hour day month weekday), e.g. \"0 2 * * *\"",
                    shown(expr)
                ),
            )
        })?;
        Ok(Self::Cron {
            cron: Box::new(cron),
            tz,
        })
    }

    /// Parses `--every DURATION` (`30s`, `5m`, `1h`, `1d`), from a second to a year and a day.
    pub fn every(text: &str) -> Result<Self, Error> {
        let every = duration("every", text)?;
        if every < Duration::from_secs(1) || every.subsec_nanos() != 0 {
            return Err(invalid("every", "must be whole seconds, at least 1s"));
        }
        Ok(Self::Every(every))
    }

    /// The first tick strictly after `t`; `None` when the expression has no further tick.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Self::Every(every) => {
                let secs = every.as_secs() as i64;
                let next = (t.timestamp().div_euclid(secs) + 1) * secs;
                DateTime::from_timestamp(next, 0)
            }
            Self::Cron { cron, tz } => {
                let local = tz.from_utc_datetime(&t.naive_utc());
                let next = cron.find_next_occurrence(&local, false).ok()?;
                Some(next.with_timezone(&Utc))
            }
        }
    }

    /// The ticks in `[from, to]`, at most `max` (the caller refuses a range with more).
    pub fn ticks_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        max: usize,
    ) -> Vec<DateTime<Utc>> {
        let mut ticks = Vec::new();
        let mut next = self.next_after(from - chrono::Duration::seconds(1));
        while let Some(t) = next.filter(|t| *t <= to && ticks.len() <= max) {
            ticks.push(t);
            next = self.next_after(t);
        }
        ticks
    }
}

/// A schedule, checked: what it starts, when, and what a tick does when the last run is busy.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Its name.
    pub name: String,
    /// The workflow each tick starts.
    pub workflow: String,
    /// The input of every run.
    pub input: serde_json::Value,
    /// When ticks fall.
    pub cadence: Cadence,
    /// What a tick does while the previous run has not ended.
    pub overlap: Overlap,
    /// How far back missed ticks are still started after a time without a scheduler.
    pub catch_up: Duration,
}

impl Spec {
    /// Reads a stored schedule (written by [`ops::create`], so it parses unless edited by hand).
    pub fn from_row(row: &store::schedules::ScheduleRow) -> Result<Self, Error> {
        let cadence = match (&row.cron, row.every_secs) {
            (Some(expr), _) => Cadence::cron(expr, row.tz.as_deref())?,
            (None, Some(secs)) => Cadence::Every(Duration::from_secs(secs.max(1) as u64)),
            (None, None) => return Err(invalid("every", "the stored schedule has no cadence")),
        };
        Ok(Self {
            name: row.name.clone(),
            workflow: row.workflow.clone(),
            input: row.input.clone(),
            cadence,
            overlap: row.overlap.parse()?,
            catch_up: Duration::from_secs(row.catch_up_secs.max(0) as u64),
        })
    }

    /// The run id of `tick`.
    pub fn run_of(&self, tick: DateTime<Utc>) -> RunId {
        run_id(&self.name, tick)
    }
}

/// What a tick does while the schedule's previous run has not ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Starts nothing (the tick is counted as skipped).
    Skip,
    /// Holds one tick back and starts it when the previous run ends; further ticks meanwhile are
    /// skipped.
    BufferOne,
    /// Starts the run anyway.
    Allow,
}

impl Overlap {
    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Skip => "skip",
            Self::BufferOne => "buffer-one",
            Self::Allow => "allow",
        }
    }
}

impl FromStr for Overlap {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "skip" => Ok(Self::Skip),
            "buffer-one" => Ok(Self::BufferOne),
            "allow" => Ok(Self::Allow),
            other => Err(invalid(
                "overlap",
                format!("{:?} is not one of skip, buffer-one, allow", shown(other)),
            )),
        }
    }
}

/// Checks a schedule name: it starts every run id the schedule makes, so it is made of the
/// characters a run id may hold, without the `:` that separates it from the tick.
pub fn check_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "name",
            format!(
                "{:?} is not a schedule name: 1 to 64 letters, digits, '.', '_' or '-'",
                shown(name)
            ),
        ))
    }
}

/// The run a tick starts: `<name>:<tick in UTC>`, the same whichever process fires it.
pub fn run_id(name: &str, tick: DateTime<Utc>) -> RunId {
    let id = format!("{name}:{}", tick.format("%Y-%m-%dT%H:%M:%SZ"));
    RunId::parse(&id).expect("a checked name and a UTC time make a run id")
}

/// Parses a duration such as `90s`, `15m`, `2h` or `1d`, up to [`LONGEST`].
pub fn duration(field: &'static str, text: &str) -> Result<Duration, Error> {
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(
            field,
            format!(
                "{:?} is not a duration ({e}); write e.g. 30s, 15m, 2h or 1d",
                shown(text)
            ),
        )
    })?;
    if d > LONGEST {
        return Err(invalid(field, "must be at most 366d"));
    }
    Ok(d)
}

/// At most 60 characters of a value from outside, for an error message.
fn shown(text: &str) -> String {
    text.chars().take(60).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().to_utc()
    }

    #[test]
    fn intervals_fall_on_multiples_of_themselves() {
        let every = Cadence::every("2s").unwrap();
        assert_eq!(
            every.next_after(at("2026-12-03T10:00:01Z")),
            Some(at("2026-12-03T10:00:02Z"))
        );
        assert_eq!(
            every.next_after(at("2026-12-03T10:00:02Z")),
            Some(at("2026-12-03T10:00:04Z"))
        );
    }

    #[test]
    fn a_cron_tick_follows_its_zone_across_daylight_saving() {
        let nightly = Cadence::cron("0 2 * * *", Some("Europe/Berlin")).unwrap();
        // Winter: 02:00 in Berlin is 01:00 UTC; summer: 00:00 UTC.
        assert_eq!(
            nightly.next_after(at("2026-12-03T10:00:00Z")),
            Some(at("2026-12-04T01:00:00Z"))
        );
        assert_eq!(
            nightly.next_after(at("2026-07-01T10:00:00Z")),
            Some(at("2026-07-02T00:00:00Z"))
        );
    }

    #[test]
    fn ticks_between_include_both_ends() {
        let every = Cadence::every("1m").unwrap();
        let ticks =
            every.ticks_between(at("2026-12-03T10:00:00Z"), at("2026-12-03T10:03:00Z"), 10);
        assert_eq!(ticks.len(), 4);
        assert_eq!(ticks[0], at("2026-12-03T10:00:00Z"));
    }

    #[test]
    fn bad_values_are_refused_naming_the_field() {
        let field = |r: Result<Cadence, Error>| match r {
            Err(Error::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(Cadence::cron("61 * * * *", None)), "cron");
        assert_eq!(field(Cadence::cron("0 2 * * *", Some("Mars/Olympus"))), "tz");
        assert_eq!(field(Cadence::every("0s")), "every");
        assert_eq!(field(Cadence::every("1.5s")), "every");
        assert_eq!(field(Cadence::every("400d")), "every");
        assert_eq!(field(Cadence::every("soon")), "every");
        assert!("sometimes".parse::<Overlap>().is_err());
        for bad in ["", "a:b", "x y", &"n".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            run_id("nightly", at("2026-12-03T02:00:00+01:00")).as_str(),
            "nightly:2026-12-03T01:00:00Z"
        );
    }
}

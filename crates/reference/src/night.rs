//! Which night a reconciliation covers and how big it is; from it follow the run id, the run's
//! input and the names under which the outside systems keep that night's data.

use chrono::NaiveDate;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Error, Result};
use trailmark::domain::RunId;

/// The night the reference story tells: the demo's default, whose figures the README shows.
pub const STORY_NIGHT: &str = "2026-10-13";

/// Invoices on a default night (the reference story's figures).
pub const DEFAULT_INVOICES: u32 = 312;
/// Mismatches on a default night: one ledger adjustment each.
pub const DEFAULT_MISMATCHES: u32 = 40;
/// Seed of the default night, so everyone reproduces the same figures.
pub const DEFAULT_SEED: u64 = 7;
/// The site code in run ids, as in `run-2026-10-13-ldh`.
pub const SITE: &str = "ldh";
/// Largest night the generator accepts, so a typo cannot fill the disk.
const MAX_INVOICES: u32 = 100_000;

/// One night of supplier invoices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Night {
    /// The business date.
    pub date: NaiveDate,
    /// How many invoices arrive.
    pub invoices: u32,
    /// How many invoice lines disagree with the stock received or the agreed price.
    pub mismatches: u32,
    /// Generator seed.
    pub seed: u64,
}

impl Night {
    /// The default night for `date`: 312 invoices, 40 mismatches.
    pub fn new(date: NaiveDate) -> Self {
        Self {
            date,
            invoices: DEFAULT_INVOICES,
            mismatches: DEFAULT_MISMATCHES,
            seed: DEFAULT_SEED,
        }
    }

    /// Checks the sizes, so a bad option fails before any process starts.
    pub fn validated(self) -> Result<Self> {
        if self.invoices == 0 || self.invoices > MAX_INVOICES {
            return Err(Error::Invalid(format!(
                "a night has 1 to {MAX_INVOICES} invoices, not {}",
                self.invoices
            )));
        }
        if self.mismatches == 0 || self.mismatches > self.invoices {
            return Err(Error::Invalid(format!(
                "a night of {} invoices has 1 to {} mismatches, not {}",
                self.invoices, self.invoices, self.mismatches
            )));
        }
        Ok(self)
    }

    /// The name the outside systems file this night under: the date, plus the sizes when they
    /// are not the defaults (so a smaller night never mixes with the default one).
    pub fn id(&self) -> String {
        let default = self.invoices == DEFAULT_INVOICES
            && self.mismatches == DEFAULT_MISMATCHES
            && self.seed == DEFAULT_SEED;
        if default {
            self.date.to_string()
        } else {
            format!(
                "{}-n{}-m{}-s{}",
                self.date, self.invoices, self.mismatches, self.seed
            )
        }
    }

    /// The run id of this night's reconciliation: `run-<night>-ldh`.
    pub fn run_id(&self) -> RunId {
        RunId::parse(&format!("run-{}-{SITE}", self.id()))
            .expect("night ids use the run-id alphabet")
    }

    /// The run id of the naive version's run, kept apart from the real one.
    pub fn naive_run_id(&self) -> RunId {
        RunId::parse(&format!("run-{}-{SITE}-naive", self.id()))
            .expect("night ids use the run-id alphabet")
    }

    /// The input of a `reconcile` run; `mail_exchange` is where notes are sent.
    pub fn input(&self, mail_exchange: &str) -> Value {
        json!({
            "date": self.date.to_string(),
            "invoices": self.invoices,
            "mismatches": self.mismatches,
            "seed": self.seed,
            "mail_exchange": mail_exchange,
        })
    }

    /// Reads a run's input; missing sizes take the defaults, a missing date is an error.
    pub fn from_input(input: &Value) -> Result<Self> {
        let date = input.get("date").and_then(Value::as_str).ok_or_else(|| {
            Error::Invalid(format!(
                "reconcile input needs \"date\": \"YYYY-MM-DD\"; got {input}"
            ))
        })?;
        let date = parse_date(date)?;
        let number =
            |name: &str, default: u64| input.get(name).and_then(Value::as_u64).unwrap_or(default);
        let night = Self {
            date,
            invoices: number("invoices", DEFAULT_INVOICES.into())
                .try_into()
                .unwrap_or(u32::MAX),
            mismatches: number("mismatches", DEFAULT_MISMATCHES.into())
                .try_into()
                .unwrap_or(u32::MAX),
            seed: number("seed", DEFAULT_SEED),
        };
        night.validated()
    }
}

/// The input of a `reconcile` run as the workflow declares it: a date, optional sizes and seed,
/// and where notes are sent. Unknown fields are refused.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileInput {
    /// The night, `YYYY-MM-DD`.
    pub date: String,
    /// Invoices that night.
    pub invoices: Option<u32>,
    /// Invoice lines that bill too much.
    pub mismatches: Option<u32>,
    /// Seed of the generated paperwork.
    pub seed: Option<u64>,
    /// The exchange debit notes and the summary are published to.
    pub mail_exchange: Option<String>,
}

impl trailmark::workflow::Input for ReconcileInput {
    fn check(&self) -> std::result::Result<(), String> {
        let mut night = Night::new(parse_date(&self.date).map_err(|e| e.to_string())?);
        night.invoices = self.invoices.unwrap_or(night.invoices);
        night.mismatches = self.mismatches.unwrap_or(night.mismatches);
        night.validated().map(|_| ()).map_err(|e| e.to_string())
    }
}

/// Parses `YYYY-MM-DD`, saying what was expected when it is not.
pub fn parse_date(raw: &str) -> Result<NaiveDate> {
    NaiveDate::parse_from_str(raw, "%Y-%m-%d")
        .map_err(|e| Error::Invalid(format!("night {raw:?} is not a date like 2026-10-13: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_night_has_the_story_run_id_and_round_trips_through_the_input() {
        let night = Night::new(parse_date("2026-10-13").unwrap());
        assert_eq!(night.run_id().as_str(), "run-2026-10-13-ldh");
        let back = Night::from_input(&night.input("x.reference.mail")).unwrap();
        assert_eq!(back, night);
    }

    #[test]
    fn other_sizes_get_their_own_run_id_and_bad_sizes_are_refused() {
        let mut night = Night::new(parse_date("2026-10-13").unwrap());
        night.invoices = 80;
        assert_eq!(night.run_id().as_str(), "run-2026-10-13-n80-m40-s7-ldh");
        night.mismatches = 81;
        assert!(night.validated().unwrap_err().to_string().contains("81"));
        assert!(parse_date("13/10/2026").is_err());
    }
}

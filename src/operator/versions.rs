//! `trailmark workflow versions`: every workflow version known anywhere (runs in flight, this
//! binary, the live workers), with its runs in flight and whether it can leave the code.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Result;
use crate::domain::RunStatus;
use crate::engine::Engine;
use crate::store::deployments::{self, Carried};
use crate::store::versions::{self as rows, InFlight};
use crate::workflow::Registry;

/// One workflow version as operators retire it: who carries it and which runs still need it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct VersionState {
    /// The workflow.
    pub workflow: String,
    /// The version.
    pub version: i32,
    /// Whether the binary that answers carries it.
    pub carried_here: bool,
    /// The live worker processes that carry it (`trailmark.deployments`).
    pub live_workers: i64,
    /// Whether it is the newest version carried here or by a live worker: new runs start on it.
    pub newest: bool,
    /// Its runs that have not ended, by status (`running`, `waiting`, `needs_review`,
    /// `compensating`; each present, 0 when none).
    pub in_flight: BTreeMap<String, i64>,
    /// Their sum.
    pub in_flight_total: i64,
    /// When the oldest of them started.
    pub oldest_started_at: Option<DateTime<Utc>>,
    /// Its age in whole seconds.
    pub oldest_age_secs: Option<i64>,
    /// Whether it can be removed from the code: no run in flight needs it, and it is not the
    /// version new runs start on.
    pub removable: bool,
    /// What to do with it, in words.
    pub verdict: String,
}

/// Every workflow version known to this binary, to the live workers or to a run in flight,
/// by workflow then version.
pub async fn versions(engine: &Engine) -> Result<Vec<VersionState>> {
    let in_flight = rows::in_flight(&engine.pool).await?;
    let live = deployments::live(&engine.pool).await?;
    Ok(merge(&in_flight, &engine.registry, &live, Utc::now()))
}

/// The three sources side by side, as of `now`.
fn merge(
    in_flight: &[InFlight],
    here: &Registry,
    live: &[Carried],
    now: DateTime<Utc>,
) -> Vec<VersionState> {
    let mut known: BTreeMap<(String, i32), VersionState> = BTreeMap::new();
    for name in here.names() {
        for v in here.versions(&name) {
            slot(&mut known, &name, v).carried_here = true;
        }
    }
    for c in live {
        slot(&mut known, &c.workflow, c.version).live_workers = c.workers;
    }
    for f in in_flight {
        let s = slot(&mut known, &f.workflow, f.version);
        s.in_flight.insert(f.status.as_str().to_owned(), f.runs);
        s.in_flight_total += f.runs;
        s.oldest_started_at = Some(s.oldest_started_at.map_or(f.oldest, |o| o.min(f.oldest)));
    }
    let newest = newest_carried(&known);
    let mut all: Vec<VersionState> = known.into_values().collect();
    for s in &mut all {
        let newest = newest.get(&s.workflow).copied();
        s.newest = newest == Some(s.version);
        s.oldest_age_secs = s.oldest_started_at.map(|t| (now - t).num_seconds().max(0));
        (s.removable, s.verdict) = verdict(s, newest);
    }
    all
}

/// The entry of `workflow` at `version`, made blank when first seen.
fn slot<'a>(
    known: &'a mut BTreeMap<(String, i32), VersionState>,
    workflow: &str,
    version: i32,
) -> &'a mut VersionState {
    known
        .entry((workflow.to_owned(), version))
        .or_insert_with(|| blank(workflow, version))
}

fn blank(workflow: &str, version: i32) -> VersionState {
    let in_flight = RunStatus::UNFINISHED
        .iter()
        .map(|s| (s.as_str().to_owned(), 0))
        .collect();
    VersionState {
        workflow: workflow.to_owned(),
        version,
        carried_here: false,
        live_workers: 0,
        newest: false,
        in_flight,
        in_flight_total: 0,
        oldest_started_at: None,
        oldest_age_secs: None,
        removable: false,
        verdict: String::new(),
    }
}

/// Per workflow, the newest version carried here or by a live worker: the one new runs start
/// on (a version only runs in flight name is carried by nobody).
fn newest_carried(known: &BTreeMap<(String, i32), VersionState>) -> BTreeMap<String, i32> {
    let mut newest = BTreeMap::new();
    for s in known
        .values()
        .filter(|s| s.carried_here || s.live_workers > 0)
    {
        // Keys are ordered by version within a workflow: the last one seen is the newest.
        newest.insert(s.workflow.clone(), s.version);
    }
    newest
}

/// Whether the version can leave the code, and what to do with it, in words; `newest` is the
/// workflow's newest version carried here or by a live worker.
fn verdict(s: &VersionState, newest: Option<i32>) -> (bool, String) {
    let n = s.in_flight_total;
    let runs = if n == 1 {
        "1 run".to_owned()
    } else {
        format!("{n} runs")
    };
    let move_them = format!(
        "`trailmark workflow move {} --from {} --to {} --reason ... --preview`",
        s.workflow,
        s.version,
        newest.map_or("NEWER".to_owned(), |v| v.to_string())
    );
    let newer_than_any = newest.is_none_or(|v| s.version > v);
    match (n, s.newest, s.live_workers) {
        (0, true, _) => (false, "newest: new runs start on it".into()),
        (0, false, _) => (
            true,
            "no runs in flight: can be removed from the code".into(),
        ),
        (_, true, _) => (
            false,
            format!("newest: new runs start on it; {runs} in flight"),
        ),
        (_, false, 0) if newer_than_any => (
            false,
            format!(
                "{runs} in flight on a version newer than any carried here or by a live worker: their next steps wait for a worker that carries it, then go to the DLQ; deploy it"
            ),
        ),
        (_, false, 0) => (
            false,
            format!(
                "{runs} in flight and no live worker carries it: their next steps stop for review; deploy it again, or move them ({move_them})"
            ),
        ),
        _ => (
            false,
            format!("{runs} in flight: keep it, or move them ({move_them})"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::Workflow;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(secs, 0).unwrap()
    }

    fn flight(version: i32, status: RunStatus, runs: i64, oldest: i64) -> InFlight {
        InFlight {
            workflow: "chain".into(),
            version,
            status,
            runs,
            oldest: at(oldest),
        }
    }

    #[test]
    fn each_version_says_what_holds_it_and_whether_it_can_go() {
        let mut here = Registry::new();
        here.register(Workflow::new("chain", 2))
            .register(Workflow::new("chain", 3));
        let live = [Carried {
            workflow: "chain".into(),
            version: 2,
            workers: 4,
        }];
        let in_flight = [
            flight(1, RunStatus::NeedsReview, 2, 100),
            flight(1, RunStatus::Waiting, 1, 50),
            flight(2, RunStatus::Running, 5, 900),
        ];
        let all = merge(&in_flight, &here, &live, at(1_000));
        let by_version: Vec<(i32, bool, i64, i64, bool)> = all
            .iter()
            .map(|s| {
                (
                    s.version,
                    s.carried_here,
                    s.live_workers,
                    s.in_flight_total,
                    s.removable,
                )
            })
            .collect();
        assert_eq!(
            by_version,
            vec![
                (1, false, 0, 3, false),
                (2, true, 4, 5, false),
                (3, true, 0, 0, false)
            ]
        );
        let v1 = &all[0];
        assert_eq!(v1.in_flight["needs_review"], 2);
        assert_eq!(v1.in_flight["compensating"], 0);
        assert_eq!(v1.oldest_age_secs, Some(950));
        assert!(
            v1.verdict
                .starts_with("3 runs in flight and no live worker carries it"),
            "{}",
            v1.verdict
        );
        assert!(
            v1.verdict.contains("workflow move chain --from 1 --to 3"),
            "{}",
            v1.verdict
        );
        assert_eq!(
            all[1].verdict,
            "5 runs in flight: keep it, or move them (`trailmark workflow move chain --from 2 --to 3 --reason ... --preview`)"
        );
        assert!(all[2].newest);
        assert_eq!(all[2].verdict, "newest: new runs start on it");
    }

    #[test]
    fn a_version_without_runs_in_flight_that_new_runs_do_not_start_on_can_be_removed() {
        let mut here = Registry::new();
        here.register(Workflow::new("chain", 1))
            .register(Workflow::new("chain", 2));
        let all = merge(&[], &here, &[], at(0));
        assert!(all[0].removable);
        assert_eq!(
            all[0].verdict,
            "no runs in flight: can be removed from the code"
        );
        assert!(!all[1].removable, "the newest is where new runs start");
        let newer = [flight(4, RunStatus::Running, 1, 0)];
        let all = merge(&newer, &here, &[], at(0));
        assert!(
            all[2]
                .verdict
                .starts_with("1 run in flight on a version newer than any carried here"),
            "{}",
            all[2].verdict
        );
    }
}

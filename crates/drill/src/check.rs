//! Reading what the drill left: run statuses, keys, receiver rows, the processes' call logs and
//! the DLQ, and the verdict on each invariant.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use sqlx::PgPool;

use super::report::{DeadLetters, Effects, Fencing, Invariant, ModelCalls, Report, Runs};
use super::{Error, Result};
use trailmark::config::BrokerSettings;
use trailmark::dlq::{self, Dlq};
use trailmark::domain::RunStatus;
use trailmark::inspect::{self, RunState};

/// Terminal statuses other than success.
const OTHER_TERMINAL: [RunStatus; 4] = [
    RunStatus::Failed,
    RunStatus::Cancelled,
    RunStatus::Compensated,
    RunStatus::Shadowed,
];

/// Where the drill's runs ended (the control run excluded).
pub async fn runs(pool: &PgPool, ids: &[String], steps_per_run: i64) -> Result<Runs> {
    let rows = inspect::run_states(pool, ids).await?;
    let mut r = Runs {
        started: ids.len() as i64,
        steps_per_run,
        ..Runs::default()
    };
    let mut seen = HashSet::new();
    for RunState {
        run_id: id,
        status,
        has_note: note,
        error,
    } in rows
    {
        seen.insert(id.clone());
        match status {
            RunStatus::Succeeded => r.succeeded += 1,
            RunStatus::NeedsReview if note => {
                r.in_review += 1;
                if r.review_examples.len() < 5 {
                    r.review_examples.push(error.unwrap_or_default());
                }
            }
            RunStatus::NeedsReview => r.in_review_without_note += 1,
            s if OTHER_TERMINAL.contains(&s) => r.other_terminal += 1,
            s => {
                r.lost += 1;
                if r.lost_examples.len() < 10 {
                    r.lost_examples.push(format!("{id} is {s}"));
                }
            }
        }
    }
    for id in ids.iter().filter(|id| !seen.contains(*id)) {
        r.lost += 1;
        if r.lost_examples.len() < 10 {
            r.lost_examples.push(format!("{id} was never created"));
        }
    }
    Ok(r)
}

/// Where the drive stands, in one read per round: the work done by `ids` in steps, and how many
/// of them are neither terminal nor in review (still moving). A settled run counts as `per_run`
/// steps however many it committed: one stopped in review early has done its share of the
/// drive, so the faults planned at shares of the expected steps still come while the others
/// move.
pub async fn standing(pool: &PgPool, ids: &[String], per_run: i64) -> Result<(i64, i64)> {
    let (mut done, mut settled) = (0, 0);
    for run in inspect::committed_steps(pool, ids).await? {
        if settles(run.status) {
            done += per_run;
            settled += 1;
        } else {
            done += run.steps;
        }
    }
    Ok((done, ids.len() as i64 - settled))
}

/// Whether a run in `status` has stopped moving for the drive: terminal, or in review.
fn settles(status: RunStatus) -> bool {
    status == RunStatus::Succeeded
        || status == RunStatus::NeedsReview
        || OTHER_TERMINAL.contains(&status)
}

/// Every position the runs `ids` reached (claimed or committed).
pub async fn positions(pool: &PgPool, ids: &[String]) -> Result<Vec<(String, i32)>> {
    Ok(inspect::positions_reached(pool, ids).await?)
}

/// What one run did: steps, distinct effect keys done.
pub async fn one_run(pool: &PgPool, run: &str) -> Result<(i64, i64)> {
    let work = inspect::work_of_run(pool, run).await?;
    Ok((work.steps, work.effects))
}

/// The drill's runs that succeeded.
pub async fn succeeded(pool: &PgPool, ids: &[String]) -> Result<Vec<String>> {
    Ok(inspect::succeeded_runs(pool, ids).await?)
}

/// Distinct effect keys done for `runs`.
pub async fn keys(pool: &PgPool, runs: &[String]) -> Result<i64> {
    Ok(inspect::completed_effects(pool, runs).await?)
}

/// Rows left in the outbox that no relay published.
pub async fn unpublished(pool: &PgPool) -> Result<i64> {
    Ok(inspect::unpublished_outbox_rows(pool).await?)
}

/// What a stalled drill shows, so that a stall seen once (in CI, say) can be explained from
/// its output alone: why the unpublished outbox rows wait, what the drill's queues hold and
/// who consumes them, and the last lines each process logged.
pub async fn stall_report(pool: &PgPool, log_dir: &Path, vhost: &str, prefix: &str) -> Vec<String> {
    let mut lines = Vec::new();
    match inspect::outbox_backlog(pool).await {
        Ok(backlog) => lines.extend(backlog.iter().map(|b| {
            format!(
                "outbox: {} {} (attempts up to {}, next in {:.0} s){}",
                b.rows,
                b.reason,
                b.max_attempts,
                b.next_in_secs,
                b.last_error
                    .as_deref()
                    .map_or(String::new(), |e| format!("; last error: {e}"))
            )
        })),
        Err(e) => lines.push(format!("outbox: could not be read: {e}")),
    }
    let args = [
        "-q",
        "list_queues",
        "-p",
        vhost,
        "name",
        "messages_ready",
        "messages_unacknowledged",
        "consumers",
    ];
    match super::faults::tool("rabbitmqctl", &args) {
        Ok(out) => lines.extend(
            out.lines()
                .filter(|l| l.starts_with(prefix))
                .map(|l| format!("queue (ready, unacked, consumers): {l}")),
        ),
        Err(e) => lines.push(format!("queues: could not be listed: {e}")),
    }
    lines.extend(last_log_lines(log_dir, 3));
    lines
}

/// The last `n` lines of each process log in `dir`, each cut to 300 characters.
fn last_log_lines(dir: &Path, n: usize) -> Vec<String> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|f| f.extension().is_some_and(|e| e == "log") && !is_call_log(f));
    files.sort();
    let mut lines = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        for line in &all[all.len().saturating_sub(n)..] {
            let cut: String = line.chars().take(300).collect();
            lines.push(format!("{name}: {cut}"));
        }
    }
    lines
}

fn is_call_log(file: &Path) -> bool {
    file.file_name()
        .is_some_and(|f| f.to_string_lossy().starts_with("calls-"))
}

/// Steps committed by each process the drill started (its call log is named by its pid).
pub fn commits_by_process(
    dir: &Path,
    names: &HashMap<u32, String>,
) -> Result<BTreeMap<String, i64>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::Failed(format!("reading the call logs in {}: {e}", dir.display())))?;
    let mut by = BTreeMap::new();
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = file
            .strip_prefix("calls-")
            .and_then(|f| f.strip_suffix(".log"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let commits = text.lines().filter(|l| l.starts_with("commit ")).count() as i64;
        if commits > 0 {
            let name = names
                .get(&pid)
                .cloned()
                .unwrap_or_else(|| format!("pid {pid}"));
            by.insert(name, commits);
        }
    }
    Ok(by)
}

/// The processes' call logs, read back.
#[derive(Debug, Default)]
pub struct CallLogs {
    /// Model answers paid for.
    pub models: ModelCalls,
    /// Outside calls made, and made again under the same key.
    pub calls: i64,
    /// Calls beyond the first per key.
    pub calls_repeated: i64,
    /// Commits and fence findings.
    pub fencing: Fencing,
}

/// Reads every `calls-*.log` under `dir`.
pub fn call_logs(dir: &Path) -> Result<CallLogs> {
    let mut text = String::new();
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::Failed(format!("reading the call logs in {}: {e}", dir.display())))?;
    for entry in entries.flatten() {
        text.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
    }
    Ok(parse_logs(&text))
}

/// The counts and fence findings of the call logs' lines.
pub fn parse_logs(text: &str) -> CallLogs {
    let mut out = CallLogs::default();
    let mut models = HashSet::new();
    let mut keys = HashSet::new();
    let mut commits: HashMap<(String, String), u32> = HashMap::new();
    // Per run: (position, fence) of every commit; fences never go down along a run.
    let mut fences: BTreeMap<String, Vec<(i32, i64)>> = BTreeMap::new();
    // Per run: (time, fence, key) of every call, to find a call under an older fence.
    let mut calls: BTreeMap<String, Vec<(u128, i64, String)>> = BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["model", run, seq, call] => {
                out.models.paid += 1;
                models.insert(format!("{run} {seq} {call}"));
            }
            ["call", run, _seq, key, fence, at] => {
                out.calls += 1;
                keys.insert(key.to_string());
                if let (Ok(fence), Ok(at)) = (fence.parse(), at.parse()) {
                    calls
                        .entry(run.to_string())
                        .or_default()
                        .push((at, fence, key.to_string()));
                }
            }
            ["commit", run, seq, fence] => {
                out.fencing.commits += 1;
                *commits
                    .entry((run.to_string(), seq.to_string()))
                    .or_default() += 1;
                if let (Ok(seq), Ok(fence)) = (seq.parse::<i32>(), fence.parse::<i64>()) {
                    fences
                        .entry(run.to_string())
                        .or_default()
                        .push((seq, fence));
                }
            }
            // A line cut short by a kill -9 mid-write cannot happen (one write per line), but
            // a log from another build may carry lines this one does not know.
            _ => {}
        }
    }
    out.models.distinct = models.len() as i64;
    out.models.repeated = out.models.paid - out.models.distinct;
    out.calls_repeated = out.calls - keys.len() as i64;
    out.fencing.double_commits = commits
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|((run, seq), n)| format!("{run} position {seq} committed {n} times"))
        .collect();
    for (run, mut list) in fences {
        list.sort();
        for pair in list.windows(2) {
            let ((s0, f0), (s1, f1)) = (pair[0], pair[1]);
            if f1 < f0 {
                out.fencing.stale_commits.push(format!(
                    "{run}: position {s1} committed under fence {f1} after position {s0} under fence {f0}"
                ));
            }
        }
    }
    for (run, mut list) in calls {
        list.sort();
        let mut newest = i64::MIN;
        for (_, fence, key) in list {
            if fence < newest {
                out.fencing.stale_calls.push(format!(
                    "{run}: {key} called under fence {fence} after fence {newest}"
                ));
            }
            newest = newest.max(fence);
        }
    }
    out
}

/// Whether `letter` is one of the `conflicts` (events sent again with another payload), refused
/// as `event_conflict`.
fn is_refused_conflict(letter: &dlq::DeadLetter, conflicts: &[String]) -> bool {
    letter.reason == "event_conflict" && conflicts.contains(&letter.id)
}

/// How many of the `conflicts` are in `letters` as `event_conflict`. A conflicting copy may be
/// dead-lettered twice (at least once: redelivered after a broker fault cut the ack of its first
/// refusal); each counts once.
pub fn refused_conflicts(letters: &[dlq::DeadLetter], conflicts: &[String]) -> usize {
    let refused: HashSet<&str> = letters
        .iter()
        .filter(|l| is_refused_conflict(l, conflicts))
        .map(|l| l.id.as_str())
        .collect();
    refused.len()
}

/// The DLQ's letters: poison found with a reason, poison missing, letters that are not poison.
/// `conflicts`: ids of events sent again with another payload, expected as `event_conflict`.
pub async fn dead_letters(
    settings: &BrokerSettings,
    poison: &[String],
    conflicts: &[String],
) -> Result<DeadLetters> {
    let dlq = Dlq::connect(settings).await?;
    let listing = dlq.list(&dlq::Page::all(), &dlq::quiet).await;
    dlq.close().await;
    let listing = listing?;
    let mut d = DeadLetters {
        poison_sent: poison.len() as u32,
        ..DeadLetters::default()
    };
    let poison_ids: HashSet<&str> = poison.iter().map(String::as_str).collect();
    let mut found = HashSet::new();
    for letter in &listing.letters {
        *d.by_reason.entry(letter.reason.clone()).or_default() += 1;
        if is_refused_conflict(letter, conflicts) {
            continue;
        }
        if poison_ids.contains(letter.id.as_str()) {
            if !letter.reason.is_empty() && letter.reason != "unknown" {
                found.insert(letter.id.clone());
            }
        } else {
            d.unexpected
                .push(format!("{} ({})", letter.id, letter.reason));
        }
    }
    d.event_conflicts = refused_conflicts(&listing.letters, conflicts) as u32;
    d.poison_found = found.len() as u32;
    d.poison_missing = poison
        .iter()
        .filter(|id| !found.contains(*id))
        .cloned()
        .collect();
    Ok(d)
}

/// The first ten of a list of ids, for a verdict's detail line.
fn first_ten(ids: &[String]) -> String {
    ids.iter().take(10).cloned().collect::<Vec<_>>().join(", ")
}

/// Every invariant's verdict, from the report's figures.
pub fn verdicts(r: &Report, unpublished: i64) -> Vec<Invariant> {
    let e: &Effects = &r.effects;
    let runs = &r.runs;
    let d = &r.dead_letters;
    let f = &r.fencing;
    vec![
        Invariant {
            name: "every run ends terminal, or in review with a note".into(),
            ok: runs.lost == 0 && runs.in_review_without_note == 0,
            detail: format!(
                "{} lost, {} in review without a note{}",
                runs.lost,
                runs.in_review_without_note,
                if runs.lost_examples.is_empty() {
                    String::new()
                } else {
                    format!(" (e.g. {})", runs.lost_examples.join("; "))
                }
            ),
        },
        Invariant {
            name: "applied effects = distinct keys = expected".into(),
            ok: e.keys == e.expected
                && e.applied.is_none_or(|a| a == e.keys)
                && e.duplicated.unwrap_or(0) == 0,
            detail: format!(
                "expected {}, keys {}, applied {}, duplicated {}",
                e.expected,
                e.keys,
                e.applied.map_or("not counted".into(), |a| a.to_string()),
                e.duplicated.map_or("not counted".into(), |a| a.to_string())
            ),
        },
        Invariant {
            name: "no healthy message in the DLQ".into(),
            ok: d.unexpected.is_empty(),
            detail: if d.unexpected.is_empty() {
                "none".into()
            } else {
                first_ten(&d.unexpected)
            },
        },
        Invariant {
            name: "every poison message in the DLQ with a reason".into(),
            ok: d.poison_missing.is_empty(),
            detail: format!(
                "{} of {} found{}",
                d.poison_found,
                d.poison_sent,
                if d.poison_missing.is_empty() {
                    String::new()
                } else {
                    format!("; missing {}", first_ten(&d.poison_missing))
                }
            ),
        },
        Invariant {
            name: "no write from a fenced-out worker accepted".into(),
            ok: f.double_commits.is_empty() && f.stale_commits.is_empty(),
            detail: format!(
                "{} positions committed twice, {} commits under a fence older than an earlier position's{}",
                f.double_commits.len(),
                f.stale_commits.len(),
                f.double_commits
                    .iter()
                    .chain(&f.stale_commits)
                    .next()
                    .map_or(String::new(), |x| format!(" (e.g. {x})"))
            ),
        },
        paused(r),
        Invariant {
            name: "no checkpoint without its next-step message".into(),
            ok: unpublished == 0 && runs.lost == 0,
            detail: format!(
                "{unpublished} outbox rows never published; every committed step's successor ran or the run settled"
            ),
        },
    ]
}

/// The drill's runs per workflow version, and the links that ran on another version's code.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Versions {
    /// Runs started on v1.
    pub v1_runs: i64,
    /// Runs started on v2.
    pub v2_runs: i64,
    /// Committed links whose output names another version's code than their run's.
    pub mismatched: i64,
    /// Up to ten of them, `run:position`.
    pub examples: Vec<String>,
}

/// The drill's runs per version, and the links whose code (`"code"` in a `chain` link's
/// output, absent at v1) is not their run's version.
pub async fn versions(pool: &PgPool, ids: &[String]) -> Result<Versions> {
    let (v1_runs, v2_runs): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE workflow_version = 1),
                count(*) FILTER (WHERE workflow_version = 2)
           FROM trailmark.runs WHERE run_id = ANY($1)",
    )
    .bind(ids)
    .fetch_one(pool)
    .await
    .map_err(trailmark::store::Error::from)?;
    let mismatched: Vec<String> = sqlx::query_scalar(
        "SELECT s.run_id || ':' || s.seq FROM trailmark.steps s
           JOIN trailmark.runs r USING (run_id)
          WHERE r.run_id = ANY($1) AND s.finished_at IS NOT NULL AND s.step = 'link'
            AND COALESCE((s.output->>'code')::int, 1) <> r.workflow_version
          ORDER BY 1",
    )
    .bind(ids)
    .fetch_all(pool)
    .await
    .map_err(trailmark::store::Error::from)?;
    Ok(Versions {
        v1_runs,
        v2_runs,
        mismatched: mismatched.len() as i64,
        examples: mismatched.into_iter().take(10).collect(),
    })
}

/// The versions invariant: every link ran on its run's version, and (with two workers or
/// more, one of each build) runs of both versions were drilled.
pub fn versions_verdict(v: &Versions, workers: usize) -> Invariant {
    let both = workers < 2 || (v.v1_runs > 0 && v.v2_runs > 0);
    Invariant {
        name: "every link ran on its run's workflow version".into(),
        ok: v.mismatched == 0 && both,
        detail: format!(
            "{} runs on v1, {} on v2, {} links on another version's code{}",
            v.v1_runs,
            v.v2_runs,
            v.mismatched,
            v.examples
                .first()
                .map_or(String::new(), |x| format!(" (e.g. {x})"))
        ),
    }
}

/// The fan-out invariants: no child started twice (each fan-out counted as many children
/// started as it has started rows and child runs), no parent joined twice (one join line per
/// position a join moved a parent to).
pub fn fan_out_verdicts(f: &inspect::FanOuts) -> Vec<Invariant> {
    vec![
        Invariant {
            name: "no child run started twice".into(),
            ok: f.started_twice.is_empty(),
            detail: format!(
                "{} fan-outs; {} counted children they do not have{}",
                f.fan_outs,
                f.started_twice.len(),
                f.started_twice
                    .first()
                    .map_or(String::new(), |x| format!(" (e.g. {x})"))
            ),
        },
        Invariant {
            name: "no parent joined twice".into(),
            ok: f.joined_twice.is_empty(),
            detail: format!(
                "{} joined; {} positions reached by more than one join{}",
                f.joined,
                f.joined_twice.len(),
                f.joined_twice
                    .first()
                    .map_or(String::new(), |x| format!(" (e.g. {x})"))
            ),
        },
    ]
}

/// What a stopped worker may hold a run back for: noticing it takes a lease (its presence
/// falls silent, its leases expire), re-queueing a second or two more; the rest is slack for a
/// loaded machine.
pub fn pause_bound_ms(lease_secs: u64) -> f64 {
    (2 * lease_secs + 2) as f64 * 1000.0
}

/// The pause invariant: no run waited much past a lease while a worker was stopped (a pause
/// shorter than the bound cannot break it; `--pause-secs` makes longer ones).
fn paused(r: &Report) -> Invariant {
    let bound = pause_bound_ms(r.lease_secs);
    let pause = r.faults.iter().find(|f| f.fault == "pause");
    let wait = pause.and_then(|p| {
        p.run_wait_max_ms
            .map(|ms| (ms, p.run_waited_longest.clone()))
    });
    Invariant {
        name: "no run held back by a stopped worker much past a lease".into(),
        ok: wait.as_ref().is_none_or(|(ms, _)| *ms <= bound),
        detail: match (pause, wait) {
            (None, _) => "no pause injected".into(),
            (Some(_), None) => "no run waited while a worker was stopped".into(),
            (Some(_), Some((ms, run))) => format!(
                "the longest a run waited while a worker was stopped: {ms:.0} ms ({}); bound {bound:.0} ms (2 x lease + 2 s)",
                run.unwrap_or_default()
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fan_out_that_counted_a_child_twice_or_a_parent_joined_twice_fails_its_invariant() {
        let clean = inspect::FanOuts {
            fan_outs: 3,
            joined: 3,
            ..Default::default()
        };
        assert!(fan_out_verdicts(&clean).iter().all(|v| v.ok));
        let broken = inspect::FanOuts {
            started_twice: vec!["p:0".into()],
            joined_twice: vec!["q:1".into()],
            ..clean
        };
        let verdicts = fan_out_verdicts(&broken);
        assert!(verdicts.iter().all(|v| !v.ok));
        assert!(verdicts[0].detail.contains("e.g. p:0") && verdicts[1].detail.contains("e.g. q:1"));
    }

    #[test]
    fn a_run_held_back_by_a_stopped_worker_past_twice_the_lease_breaks_the_pause_invariant() {
        let with = |ms: Option<f64>| Report {
            lease_secs: 4,
            faults: vec![crate::report::FaultFigures {
                fault: "pause".into(),
                injected: 2,
                run_wait_max_ms: ms,
                run_waited_longest: ms.map(|_| "drill-7".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        let held = paused(&with(Some(20_004.0)));
        assert!(!held.ok, "{}", held.detail);
        assert!(
            held.detail.contains("20004 ms (drill-7); bound 10000 ms"),
            "{}",
            held.detail
        );
        assert!(paused(&with(Some(5_216.0))).ok);
        assert!(paused(&with(None)).ok);
        assert!(paused(&Report::default()).ok);
    }

    #[test]
    fn the_call_logs_give_repeats_double_commits_and_stale_calls() {
        let logs = "model r1 0 0\nmodel r1 0 0\nmodel r1 1 0\n\
                    call r1 0 k0 3 100\ncall r1 0 k0 4 200\ncall r1 1 k1 2 300\n\
                    commit r1 0 4\ncommit r1 1 5\ncommit r1 1 6\n";
        let c = parse_logs(logs);
        assert_eq!(
            (c.models.paid, c.models.distinct, c.models.repeated),
            (3, 2, 1)
        );
        assert_eq!((c.calls, c.calls_repeated), (3, 1));
        assert_eq!(c.fencing.commits, 3);
        assert_eq!(
            c.fencing.double_commits,
            vec!["r1 position 1 committed 2 times"]
        );
        assert_eq!(
            c.fencing.stale_calls,
            vec!["r1: k1 called under fence 2 after fence 4"]
        );
        let c = parse_logs("commit r2 0 5\ncommit r2 1 7\ncommit r2 2 6\n");
        assert_eq!(
            c.fencing.stale_commits,
            vec!["r2: position 2 committed under fence 6 after position 1 under fence 7"]
        );
    }
}

//! Where an unloaded trailmark step spends its time, read from the timestamps the engine already
//! writes (each is the start of the statement that wrote it; read through
//! [`trailmark::inspect::step_times`] and the ledger's [`trailmark_testkit::ledger::ledger_row_times`]): commit of the previous step, claim,
//! journal entry or effect intent, ledger row, commit. Each segment therefore also holds the
//! commit (fsync) of the write that opens it. A step the previous commit pre-claimed has its
//! claim time in that commit (`worker.preclaim`): its first segment is 0 and the second holds
//! the publish and the delivery.

use std::collections::HashMap;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;
use trailmark::inspect;
use trailmark_testkit::ledger;

use super::Result;
use super::env::BenchEnv;

/// Segment labels of a step whose ledger row goes in with its commit (`ctx.local_write`), in
/// step order; the values come back in the same order.
pub const SEGMENTS: [&str; 3] = [
    "commit -> next claim (commit; eager publish + confirm, delivery; claim = inbox check + lease + attempt; 0 when pre-claimed)",
    "claim -> journal entry (claim commit, model call over HTTP; pre-claimed: also the publish and the delivery)",
    "journal entry -> step commit (journal round trip; ledger row, checkpoint and next message in one commit)",
];

/// Segment labels of a step whose ledger row is an outside write (`ctx.effect`).
pub const SEGMENTS_EFFECT: [&str; 4] = [
    "commit -> next claim (commit; eager publish + confirm, delivery; claim = inbox check + lease + attempt; 0 when pre-claimed)",
    "claim -> effect intent (claim commit, model call over HTTP, journal commit; pre-claimed: also the publish and the delivery)",
    "effect intent -> ledger row (intent commit)",
    "ledger row -> step commit (ledger commit, effect result commit)",
];

/// Segment labels of a `pychain` step (its ledger row an outside write made by the Python
/// endpoint): the same timestamps as [`SEGMENTS_EFFECT`], with the step protocol's calls in them.
pub const SEGMENTS_REMOTE: [&str; 4] = [
    "commit -> next claim (as for a compiled step)",
    "claim -> effect intent (claim commit; the step call to the endpoint; the model callback, its journal commit; the effect/begin callback, the intent commit)",
    "effect intent -> ledger row (effect/begin's answer back to the endpoint; its own insert)",
    "ledger row -> step commit (the effect/end callback, the result commit; the endpoint's answer; the step commit)",
];

/// p50 of each segment over the steps of the runs starting with a prefix (ms).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Breakdown {
    /// One p50 per segment label.
    pub p50_ms: Vec<f64>,
}

/// The breakdown of the local-write steps of runs whose ids start with `prefix`: per step with
/// a previous commit and a journal entry, previous commit -> claim -> first journal entry ->
/// commit.
pub async fn local(env: &BenchEnv, prefix: &str) -> Result<Breakdown> {
    let steps = inspect::step_times(&env.pool, prefix).await?;
    let rows = steps
        .iter()
        .filter_map(|s| {
            let prev = s.previous_commit?;
            let answer = s.first_journal_entry?;
            Some(vec![
                Some(s.claimed - prev),
                Some(answer - s.claimed),
                s.committed.map(|c| c - answer),
            ])
        })
        .collect::<Vec<_>>();
    Ok(medians(&rows))
}

/// The breakdown of the effect steps of runs whose ids start with `prefix`: per step with a
/// previous commit, an effect intent and a ledger row, previous commit -> claim -> first intent
/// -> ledger row -> commit (a position with several ledger rows counts once per row).
pub async fn effect(env: &BenchEnv, prefix: &str) -> Result<Breakdown> {
    let steps = inspect::step_times(&env.pool, prefix).await?;
    let mut ledger: HashMap<(String, i32), Vec<DateTime<Utc>>> = HashMap::new();
    for row in ledger::ledger_row_times(&env.pool, prefix).await? {
        ledger
            .entry((row.run_id, row.step))
            .or_default()
            .push(row.at);
    }
    let mut rows = Vec::new();
    for s in &steps {
        let (Some(prev), Some(intent)) = (s.previous_commit, s.first_effect_intent) else {
            continue;
        };
        for &at in ledger
            .get(&(s.run_id.clone(), s.seq))
            .map_or(&[][..], Vec::as_slice)
        {
            rows.push(vec![
                Some(s.claimed - prev),
                Some(intent - s.claimed),
                Some(at - intent),
                s.committed.map(|c| c - at),
            ]);
        }
    }
    Ok(medians(&rows))
}

/// The p50 of each segment over `rows` (all of one length), as Postgres's `percentile_cont(0.5)`
/// computed it when this was SQL: missing values left out, linear interpolation between the
/// two middle values. No rows, no segments.
fn medians(rows: &[Vec<Option<TimeDelta>>]) -> Breakdown {
    let width = rows.first().map_or(0, Vec::len);
    let p50_ms = (0..width)
        .map(|i| {
            let mut ms: Vec<f64> = rows
                .iter()
                .filter_map(|r| r[i])
                .map(|d| d.num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0)
                .collect();
            ms.sort_by(f64::total_cmp);
            percentile_cont(&ms, 0.5)
        })
        .collect();
    Breakdown { p50_ms }
}

/// Postgres's `percentile_cont(q)` over sorted values: the value at rank `q * (n - 1)`,
/// interpolated linearly between its neighbours; 0 for no values.
fn percentile_cont(sorted: &[f64], q: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return 0.0;
    };
    let rank = q * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_interpolate_as_postgres_does_and_skip_missing_values() {
        assert_eq!(percentile_cont(&[1.0, 2.0, 4.0, 8.0], 0.5), 3.0);
        assert_eq!(percentile_cont(&[1.0, 2.0, 4.0], 0.5), 2.0);
        assert_eq!(percentile_cont(&[], 0.5), 0.0);
        let ms = TimeDelta::milliseconds;
        let rows = vec![
            vec![Some(ms(1)), Some(ms(10))],
            vec![Some(ms(3)), None],
            vec![Some(ms(2)), Some(ms(20))],
        ];
        assert_eq!(medians(&rows).p50_ms, vec![2.0, 15.0]);
        assert!(medians(&[]).p50_ms.is_empty());
    }
}

//! Comparing two runs position by position: step outputs, model answers (with token and cost
//! deltas) and the outside writes each made or, in shadow, would have made. This is the eval
//! loop's other half: fork last night's run in shadow with the new prompt, then see what changed.
//!
//! Keys are compared with each run's id replaced by `{run}`, since keys are built from the run id
//! and a fork's keys differ from its parent's by that alone.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::PgPool;

use crate::store::{self, effects, forks, journal, runs, shadow, steps};

/// Why two runs cannot be compared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A run does not exist.
    #[error("run {0} not found: list runs with `trailmark run list`")]
    NotFound(String),
    /// The database failed.
    #[error("the runs could not be read")]
    Store(#[from] store::Error),
}

/// One run as the comparison names it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Side {
    /// The run.
    pub run_id: String,
    /// Its workflow and version.
    pub workflow: String,
    /// Its version.
    pub version: i32,
    /// Its status.
    pub status: String,
    /// Positions it has.
    pub positions: usize,
    /// A shadow fork (its outside messages are recorded; a live run's are not kept, so
    /// messages are compared only between two shadow runs).
    pub shadow: bool,
}

/// A model call that differs.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct AnswerDiff {
    /// Call number within the position.
    pub call_no: i32,
    /// A's answer (`None`: A made no such call).
    pub a: Option<String>,
    /// B's answer.
    pub b: Option<String>,
    /// Whether the requests differ too (a changed prompt), not only the answers.
    pub request_changed: bool,
    /// B's tokens minus A's.
    pub tokens_delta: i64,
    /// B's cost minus A's.
    pub cost_delta: f64,
}

/// An outside write that differs: made (or recorded in shadow) by one run only, or made by both
/// under the same key with different requests.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct WriteDiff {
    /// The key, with the run id as `{run}`.
    pub key: String,
    /// `effect` or `message`.
    pub kind: String,
    /// `only_a`, `only_b` or `changed`.
    pub change: &'static str,
    /// The request B makes or would make, where it was recorded (shadow runs).
    pub b_request: Option<serde_json::Value>,
    /// The request A makes or would make, where it was recorded.
    pub a_request: Option<serde_json::Value>,
}

/// One position that differs.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct PositionDiff {
    /// Position.
    pub seq: i32,
    /// A's step there.
    pub a_step: Option<String>,
    /// B's step there.
    pub b_step: Option<String>,
    /// Whether the checkpointed outputs differ.
    pub output_changed: bool,
    /// Model calls that differ.
    pub answers: Vec<AnswerDiff>,
    /// Outside writes that differ.
    pub writes: Vec<WriteDiff>,
}

/// Two runs compared.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct RunDiff {
    /// The first run.
    pub a: Side,
    /// The second run.
    pub b: Side,
    /// Positions before this one were taken over by a fork from the other run, so they are
    /// the same by construction and not compared.
    pub inherited_before: i32,
    /// Positions compared.
    pub compared: usize,
    /// Positions that differ, in order.
    pub differences: Vec<PositionDiff>,
    /// B's tokens minus A's, over the compared positions.
    pub tokens_delta: i64,
    /// B's cost minus A's, over the compared positions.
    pub cost_delta: f64,
}

/// Everything about one run the comparison reads.
struct Loaded {
    side: Side,
    steps: BTreeMap<i32, steps::StepRow>,
    answers: BTreeMap<(i32, i32), journal::Answer>,
    writes: BTreeMap<i32, BTreeMap<(String, String), Write>>,
}

/// A write as compared: its request hash, and the request where a shadow run recorded it.
struct Write {
    hash: Option<String>,
    request: Option<serde_json::Value>,
}

/// Compares run `a` with run `b`.
pub async fn compare(pool: &PgPool, a: &str, b: &str) -> Result<RunDiff, Error> {
    let (a_run, b_run) = (load(pool, a).await?, load(pool, b).await?);
    let inherited_before = inherited(pool, a, b).await?;
    let seqs: std::collections::BTreeSet<i32> = a_run
        .steps
        .keys()
        .chain(b_run.steps.keys())
        .copied()
        .filter(|s| *s >= inherited_before)
        .collect();
    let mut differences = Vec::new();
    let (mut tokens_delta, mut cost_delta) = (0, 0.0);
    for seq in &seqs {
        let answers = answer_diffs(&a_run, &b_run, *seq);
        let ((ta, ca), (tb, cb)) = (answers_sum(&a_run, *seq), answers_sum(&b_run, *seq));
        tokens_delta += tb - ta;
        cost_delta += cb - ca;
        let (sa, sb) = (a_run.steps.get(seq), b_run.steps.get(seq));
        // Outputs name their run (keys, claims): B's is read under A's id.
        let b_output = sb.map(|s| s.output.as_ref().map(|o| rename(o, b, a)));
        let output_changed = sa.map(|s| s.output.clone()) != b_output;
        let writes = write_diffs(&a_run, &b_run, *seq);
        if output_changed || !answers.is_empty() || !writes.is_empty() {
            differences.push(PositionDiff {
                seq: *seq,
                a_step: sa.map(|s| s.step.to_string()),
                b_step: sb.map(|s| s.step.to_string()),
                output_changed,
                answers,
                writes,
            });
        }
    }
    Ok(RunDiff {
        a: a_run.side,
        b: b_run.side,
        inherited_before,
        compared: seqs.len(),
        differences,
        tokens_delta,
        cost_delta,
    })
}

/// Where one run was forked from the other: the positions before it are shared.
async fn inherited(pool: &PgPool, a: &str, b: &str) -> Result<i32, Error> {
    for (child, parent) in [(b, a), (a, b)] {
        if let Some(f) = forks::parent(pool, child).await?
            && f.parent_run_id == parent
        {
            return Ok(f.from_seq);
        }
    }
    Ok(0)
}

async fn load(pool: &PgPool, run_id: &str) -> Result<Loaded, Error> {
    let run = runs::get(pool, run_id)
        .await?
        .ok_or_else(|| Error::NotFound(run_id.to_owned()))?;
    let steps: BTreeMap<i32, steps::StepRow> = steps::list(pool, run_id)
        .await?
        .into_iter()
        .filter(|s| !s.step.is_undo())
        .map(|s| (s.seq, s))
        .collect();
    let answers = journal::answers(pool, run_id)
        .await?
        .into_iter()
        .map(|a| ((a.seq, a.call_no), a))
        .collect();
    let recorded = shadow::list(pool, run_id).await?;
    let mut writes: BTreeMap<i32, BTreeMap<(String, String), Write>> = BTreeMap::new();
    // A live run's writes are its effects and local writes (request hashes); a shadow run's
    // are in `shadow_writes`.
    for e in effects::page(pool, run_id, -1, i64::MAX).await? {
        let key = replace_id(&e.idempotency_key, run_id, "{run}");
        let kind = match e.tool.as_str() {
            effects::LOCAL_WRITE => effects::LOCAL_WRITE,
            _ => "effect",
        };
        let w = Write {
            hash: Some(e.request_hash),
            request: None,
        };
        writes
            .entry(e.seq)
            .or_default()
            .insert((kind.into(), key), w);
    }
    for w in &recorded {
        let key = replace_id(&w.key, run_id, "{run}");
        let write = Write {
            hash: Some(crate::domain::request_hash(&w.request)),
            request: Some(w.request.clone()),
        };
        writes
            .entry(w.seq)
            .or_default()
            .insert((w.kind.clone(), key), write);
    }
    let side = Side {
        run_id: run.run_id.clone(),
        workflow: run.workflow.clone(),
        version: run.workflow_version,
        status: run.status.as_str().into(),
        positions: steps.len(),
        shadow: run.shadow,
    };
    Ok(Loaded {
        side,
        steps,
        answers,
        writes,
    })
}

/// Whether two writes carry the same request once each run's id is read as the other's: keys
/// and requests name their run, and a live run keeps only its requests' hashes, so a recorded
/// request is rewritten under the other run's id and hashed.
fn same_request(x: &Write, a_id: &str, y: &Write, b_id: &str) -> bool {
    let as_other = |w: &Write, from: &str, to: &str| {
        w.request
            .as_ref()
            .map(|r| crate::domain::request_hash(&rename(r, from, to)))
    };
    x.hash == y.hash
        || as_other(y, b_id, a_id).is_some_and(|h| x.hash.as_deref() == Some(h.as_str()))
        || as_other(x, a_id, b_id).is_some_and(|h| y.hash.as_deref() == Some(h.as_str()))
}

/// `value` with every occurrence of run id `from` in its strings replaced by `to`.
fn rename(value: &serde_json::Value, from: &str, to: &str) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) => Value::String(replace_id(s, from, to)),
        Value::Array(items) => Value::Array(items.iter().map(|v| rename(v, from, to)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (replace_id(k, from, to), rename(v, from, to)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// `text` with run id `id` replaced by `to` where it stands as a whole id: not inside a longer
/// one (`r1` in `r10`, a parent's id inside its fork's `<id>-fork-...`).
fn replace_id(text: &str, id: &str, to: &str) -> String {
    let part = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(id) {
        let before = rest[..at].chars().next_back().or(out.chars().next_back());
        let after = rest[at + id.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(part) || after.is_some_and(part) {
            out.push_str(id);
        } else {
            out.push_str(to);
        }
        rest = &rest[at + id.len()..];
    }
    out.push_str(rest);
    out
}

/// Tokens and cost a run paid at `seq` (answers a fork took over were paid by another run).
fn answers_sum(run: &Loaded, seq: i32) -> (i64, f64) {
    run.answers
        .range((seq, i32::MIN)..=(seq, i32::MAX))
        .filter(|(_, a)| !a.inherited)
        .fold((0, 0.0), |(t, c), (_, a)| (t + a.tokens, c + a.cost))
}

fn answer_diffs(a: &Loaded, b: &Loaded, seq: i32) -> Vec<AnswerDiff> {
    let calls: std::collections::BTreeSet<i32> = a
        .answers
        .range((seq, i32::MIN)..=(seq, i32::MAX))
        .chain(b.answers.range((seq, i32::MIN)..=(seq, i32::MAX)))
        .map(|((_, n), _)| *n)
        .collect();
    calls
        .into_iter()
        .filter_map(|n| {
            let (x, y) = (a.answers.get(&(seq, n)), b.answers.get(&(seq, n)));
            let same = x.map(|e| (&e.request_hash, &e.content))
                == y.map(|e| (&e.request_hash, &e.content));
            (!same).then(|| AnswerDiff {
                call_no: n,
                a: x.and_then(|e| e.content.clone()),
                b: y.and_then(|e| e.content.clone()),
                request_changed: x.map(|e| &e.request_hash) != y.map(|e| &e.request_hash),
                tokens_delta: y.map_or(0, |e| e.tokens) - x.map_or(0, |e| e.tokens),
                cost_delta: y.map_or(0.0, |e| e.cost) - x.map_or(0.0, |e| e.cost),
            })
        })
        .collect()
}

fn write_diffs(a: &Loaded, b: &Loaded, seq: i32) -> Vec<WriteDiff> {
    let empty = BTreeMap::new();
    let (wa, wb) = (
        a.writes.get(&seq).unwrap_or(&empty),
        b.writes.get(&seq).unwrap_or(&empty),
    );
    let keys: std::collections::BTreeSet<&(String, String)> = wa.keys().chain(wb.keys()).collect();
    let messages_kept = a.side.shadow && b.side.shadow;
    keys.into_iter()
        .filter(|k| k.0 != "message" || messages_kept)
        .filter_map(|k| {
            let change = match (wa.get(k), wb.get(k)) {
                (Some(_), None) => "only_a",
                (None, Some(_)) => "only_b",
                (Some(x), Some(y)) if !same_request(x, &a.side.run_id, y, &b.side.run_id) => {
                    "changed"
                }
                _ => return None,
            };
            Some(WriteDiff {
                kind: k.0.clone(),
                key: k.1.clone(),
                change,
                a_request: wa.get(k).and_then(|w| w.request.clone()),
                b_request: wb.get(k).and_then(|w| w.request.clone()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::replace_id;

    #[test]
    fn a_run_id_is_replaced_only_where_it_stands_whole() {
        assert_eq!(
            replace_id("r1:link:3 r10:link:3", "r1", "{run}"),
            "{run}:link:3 r10:link:3"
        );
        assert_eq!(replace_id("a-fork-1:x", "a", "{run}"), "a-fork-1:x");
        assert_eq!(replace_id("a-fork-1:x", "a-fork-1", "a"), "a:x");
        assert_eq!(replace_id("r1r1", "r1", "x"), "r1r1");
    }
}

//! Concurrency keys under the drill (`--tenants N --tenant-limit L`): the runs are spread over N
//! values of the workflow's declared key (`t0`..), every key limited to L at run time before the
//! first start. A sampler reads every 100 ms, through every fault, how many runs of each key
//! hold a step (a live lease, read from the runs, not from the gate's slot rows) and who waits
//! in a key's line; at the end no run may be left in a line and no slot reserved for a run that
//! ended.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::report::Invariant;
use super::{Error, Result};
use trailmark::flow::KeyField;
use trailmark::inspect;
use trailmark::store::flow::{self, LimitChange};
use trailmark::workflow::Workflow;

/// How often the sampler reads the keys.
const EVERY: Duration = Duration::from_millis(100);

/// How the runs are spread over keys, and the limit each key gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenants {
    /// Distinct key values (`t0`..`t<N-1>`); run `i` gets `t<i mod N>`.
    pub count: usize,
    /// Runs of one key holding a step at once, set for every key before the runs start.
    pub limit: u32,
}

/// The spread of one drill: the workflow's key field and the tenants.
#[derive(Debug, Clone)]
pub struct Keyed {
    workflow: String,
    field: KeyField,
    tenants: Tenants,
}

impl Keyed {
    /// The spread for `wf` of runs started with `input`; refused when it declares no
    /// concurrency key, the input is no JSON object, or N or L is 0.
    pub fn new(wf: &Workflow, tenants: Tenants, input: &Value) -> Result<Self> {
        let Some(declared) = &wf.flow.concurrency else {
            return Err(Error::Failed(format!(
                "--tenants spreads runs over a concurrency key, and workflow {:?} declares none; drill it without --tenants",
                wf.name
            )));
        };
        if !input.is_object() {
            return Err(Error::Failed(format!(
                "--tenants sets the key field {} in the input, and the input {input} is no JSON object",
                declared.key.name()
            )));
        }
        if tenants.count == 0 || tenants.limit == 0 {
            return Err(Error::Failed(
                "--tenants and --tenant-limit must be at least 1".into(),
            ));
        }
        Ok(Self {
            workflow: wf.name.clone(),
            field: declared.key.clone(),
            tenants,
        })
    }

    /// The input of the `i`th run: `input` with the key field set to `t<i mod N>`.
    pub fn input(&self, input: &Value, i: usize) -> Value {
        let mut out = input.clone();
        let name = self.field.name();
        let path: Vec<&str> = name.split('.').collect();
        let mut at = &mut out;
        for segment in &path[..path.len() - 1] {
            if !at.get(*segment).is_some_and(Value::is_object) {
                at[*segment] = Value::Object(Default::default());
            }
            at = &mut at[*segment];
        }
        at[path[path.len() - 1]] = Value::String(format!("t{}", i % self.tenants.count));
        out
    }

    /// Sets the limit for every key of the workflow, as `trailmark limit set` would.
    pub async fn set_limit(&self, pool: &PgPool) -> Result<()> {
        let change = LimitChange {
            concurrency: Some(self.tenants.limit as i32),
            ..LimitChange::default()
        };
        flow::set_limit(pool, (&self.workflow, ""), &change, "drill").await?;
        Ok(())
    }

    /// Starts sampling the keys until [`Watch::stop`].
    pub fn watch(&self, pool: PgPool) -> Watch {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(sample(
            pool,
            self.workflow.clone(),
            i64::from(self.tenants.limit),
            seen.clone(),
            stop.clone(),
        ));
        Watch {
            keyed: self.clone(),
            seen,
            stop,
            task,
        }
    }
}

/// What the samples saw so far.
#[derive(Debug, Default)]
struct Seen {
    samples: u64,
    unread: u64,
    running_max: BTreeMap<String, i64>,
    over: Vec<String>,
    waiting_max: i64,
    waits: HashSet<(String, i32)>,
}

/// A running sampler.
pub struct Watch {
    keyed: Keyed,
    seen: Arc<Mutex<Seen>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Watch {
    /// Stops sampling, reads what the runs left in the lines and slots, and gives the figures.
    pub async fn stop(self, pool: &PgPool) -> Result<KeyFigures> {
        self.stop.cancel();
        let _ = self.task.await;
        let left = inspect::key_waiters(pool, &self.keyed.workflow).await?;
        let reserved = inspect::reserved_for_ended(pool).await?;
        let seen = self
            .seen
            .lock()
            .map_err(|_| Error::Failed("the key sampler panicked".into()))?;
        Ok(KeyFigures {
            field: self.keyed.field.name(),
            tenants: self.keyed.tenants.count,
            limit: i64::from(self.keyed.tenants.limit),
            samples: seen.samples,
            samples_unread: seen.unread,
            running_max: seen.running_max.values().copied().max().unwrap_or(0),
            running_max_by_key: seen.running_max.clone(),
            over_limit: seen.over.clone(),
            waiting_max: seen.waiting_max,
            waits_seen: seen.waits.len() as u64,
            waiters_left: left
                .iter()
                .map(|(run, seq)| format!("{run}:{seq}"))
                .collect(),
            reserved_for_ended: reserved,
        })
    }
}

/// Reads the keys every [`EVERY`] until stopped; a read that fails (a Postgres fault of the
/// drill's) is counted and skipped.
async fn sample(
    pool: PgPool,
    workflow: String,
    limit: i64,
    seen: Arc<Mutex<Seen>>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let read = async {
            let running = inspect::running_by_key(&pool, &workflow).await?;
            let waiting = inspect::key_waiters(&pool, &workflow).await?;
            Ok::<_, trailmark::store::Error>((running, waiting))
        };
        let read = read.await;
        if let Ok(mut s) = seen.lock() {
            match read {
                Ok((running, waiting)) => s.add(running, waiting, limit),
                Err(_) => s.unread += 1,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = stop.cancelled() => {}
        }
    }
}

impl Seen {
    fn add(&mut self, running: Vec<(String, i64)>, waiting: Vec<(String, i32)>, limit: i64) {
        self.samples += 1;
        for (key, n) in running {
            if n > limit && self.over.len() < 10 {
                let at = chrono::Utc::now().format("%H:%M:%S%.3f");
                self.over.push(format!("{key}: {n} of {limit} at {at}"));
            }
            let most = self.running_max.entry(key).or_default();
            *most = (*most).max(n);
        }
        self.waiting_max = self.waiting_max.max(waiting.len() as i64);
        self.waits.extend(waiting);
    }
}

/// The keys as the drill saw them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KeyFigures {
    /// The input field the runs were spread over.
    pub field: String,
    /// Key values used.
    pub tenants: usize,
    /// Runs of one key holding a step at once, at most.
    pub limit: i64,
    /// Samples read (every 100 ms).
    pub samples: u64,
    /// Samples that could not be read (Postgres faults).
    pub samples_unread: u64,
    /// The most runs of one key seen holding a step at once.
    pub running_max: i64,
    /// The same, per key.
    pub running_max_by_key: BTreeMap<String, i64>,
    /// Samples where a key had more runs holding a step than its limit (the first ten).
    pub over_limit: Vec<String>,
    /// The most runs seen waiting in the lines at once.
    pub waiting_max: i64,
    /// Distinct (run, position) seen waiting: a lower bound of the waits (a short one falls
    /// between samples).
    pub waits_seen: u64,
    /// (run:position) still in a line at the end.
    pub waiters_left: Vec<String>,
    /// Runs that ended with a slot still reserved for them.
    pub reserved_for_ended: Vec<String>,
}

/// The first few of a list, for a verdict's detail.
fn some(list: &[String]) -> String {
    match list.first() {
        None => String::new(),
        Some(_) => format!(
            " (e.g. {})",
            list.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The keys' invariants.
pub fn verdicts(k: &KeyFigures) -> Vec<Invariant> {
    vec![
        Invariant {
            name: "no key had more runs holding a step than its limit".into(),
            ok: k.over_limit.is_empty() && k.samples > 0,
            detail: format!(
                "at most {} of {} runs of one key held a step, in {} samples every 100 ms ({} unread); {} waits seen, up to {} at once{}",
                k.running_max,
                k.limit,
                k.samples,
                k.samples_unread,
                k.waits_seen,
                k.waiting_max,
                some(&k.over_limit)
            ),
        },
        Invariant {
            name: "no run left waiting for a slot".into(),
            ok: k.waiters_left.is_empty(),
            detail: format!(
                "{} left in a line{}",
                k.waiters_left.len(),
                some(&k.waiters_left)
            ),
        },
        Invariant {
            name: "no slot reserved for a run that ended".into(),
            ok: k.reserved_for_ended.is_empty(),
            detail: format!(
                "{} reserved{}",
                k.reserved_for_ended.len(),
                some(&k.reserved_for_ended)
            ),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_over_its_limit_in_one_sample_fails_and_the_waits_are_counted_once() {
        let mut s = Seen::default();
        s.add(vec![("t0".into(), 2)], vec![("r1".into(), 0)], 2);
        s.add(
            vec![("t0".into(), 3), ("t1".into(), 1)],
            vec![("r1".into(), 0), ("r2".into(), 3)],
            2,
        );
        assert_eq!((s.samples, s.waits.len(), s.waiting_max), (2, 2, 2));
        assert_eq!(s.running_max["t0"], 3);
        assert!(s.over[0].starts_with("t0: 3 of 2 at "), "{:?}", s.over);
        let k = KeyFigures {
            limit: 2,
            samples: 2,
            running_max: 3,
            over_limit: s.over.clone(),
            ..KeyFigures::default()
        };
        let v = verdicts(&k);
        assert!(!v[0].ok && v[1].ok && v[2].ok, "{v:?}");
        assert!(
            verdicts(&KeyFigures {
                samples: 1,
                ..KeyFigures::default()
            })
            .iter()
            .all(|i| i.ok)
        );
    }
}

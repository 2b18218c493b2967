//! What `/livez` and `/readyz` answer. Live: every loop the process runs (worker, relay,
//! supervisor) has come round recently, whether or not its servers answer (a process waiting for
//! a broker to come back is alive; killing it would not help). Ready: Postgres answers with the
//! schema this build expects, the worker (if the process runs one) is connected and consuming,
//! and the process is not draining after SIGTERM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::config::DatabaseSettings;
use crate::store;

/// A loop of the process that reports itself alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Loop {
    /// The step consumer.
    Worker,
    /// The outbox relay.
    Relay,
    /// The lease supervisor.
    Supervisor,
    /// The supervisor's timer loop (wake-ups and event timeouts of waiting runs).
    Timers,
    /// The pruner (retention), beside the supervisor.
    Pruner,
    /// The hand-off of free slots to runs waiting for one (concurrency keys), beside the
    /// supervisor.
    Flow,
}

const LOOPS: [Loop; 6] = [
    Loop::Worker,
    Loop::Relay,
    Loop::Supervisor,
    Loop::Timers,
    Loop::Pruner,
    Loop::Flow,
];

/// A loop that has not come round for this long is stuck.
const STUCK_AFTER: Duration = Duration::from_secs(60);

/// How long one schema check answers for: probes arriving together share one connection.
const SCHEMA_CHECK_FRESH: Duration = Duration::from_secs(1);

/// The process's health, updated by its loops and read by the health endpoints.
#[derive(Debug, Default)]
pub struct Health {
    running: [AtomicBool; 6],
    beats: [AtomicU64; 6],
    consuming: AtomicBool,
    /// Why the worker's last broker session ended, until it consumes again.
    broker_problem: std::sync::Mutex<Option<String>>,
    draining: AtomicBool,
    // One check at a time, its answer reused briefly: however many probes and scrapers call
    // `/readyz`, the process opens at most one connection for them (`connections_per_process`
    // counts it).
    schema: tokio::sync::Mutex<Option<(Instant, Option<String>)>>,
}

/// Why a process is not live or not ready.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// Whether it is.
    pub ok: bool,
    /// What is wrong, one line each (empty when ok).
    pub reasons: Vec<String>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn index(l: Loop) -> usize {
    LOOPS
        .iter()
        .position(|x| *x == l)
        .expect("every loop is listed")
}

impl Health {
    /// Marks a loop as one this process runs (and beats it once).
    pub fn runs(&self, l: Loop) {
        self.running[index(l)].store(true, Ordering::SeqCst);
        self.beat(l);
    }

    /// A loop came round.
    pub fn beat(&self, l: Loop) {
        self.beats[index(l)].store(now_ms(), Ordering::Relaxed);
    }

    /// Whether the worker is connected and consuming.
    pub fn set_consuming(&self, consuming: bool) {
        self.consuming.store(consuming, Ordering::SeqCst);
        if consuming {
            self.set_broker_problem(None);
        }
    }

    /// Why the worker cannot consume (a missing vhost, a refused login, a broker that does not
    /// answer), for `/readyz` to say instead of a guess.
    pub fn set_broker_problem(&self, problem: Option<String>) {
        if let Ok(mut held) = self.broker_problem.lock() {
            *held = problem;
        }
    }

    /// The process received SIGTERM: not ready any more.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the process is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// `/livez`: every running loop came round within a minute.
    pub fn live(&self) -> Verdict {
        let now = now_ms();
        let reasons: Vec<String> = LOOPS
            .iter()
            .enumerate()
            .filter(|(i, _)| self.running[*i].load(Ordering::SeqCst))
            .filter_map(|(i, l)| {
                let age = now.saturating_sub(self.beats[i].load(Ordering::Relaxed));
                (age > STUCK_AFTER.as_millis() as u64).then(|| {
                    format!(
                        "the {} loop has not come round for {} s",
                        name(*l),
                        age / 1000
                    )
                })
            })
            .collect();
        Verdict {
            ok: reasons.is_empty(),
            reasons,
        }
    }

    /// `/readyz`: not draining, the worker consuming (if there is one), Postgres answering with
    /// this build's schema.
    pub async fn ready(&self, database: &DatabaseSettings) -> Verdict {
        let mut reasons = Vec::new();
        if self.draining() {
            reasons.push("draining: the process is stopping".to_owned());
        }
        if self.running[index(Loop::Worker)].load(Ordering::SeqCst)
            && !self.consuming.load(Ordering::SeqCst)
        {
            let why = self
                .broker_problem
                .lock()
                .ok()
                .and_then(|p| p.clone())
                .unwrap_or_else(|| "it is connecting to the broker".to_owned());
            reasons.push(format!("the worker is not consuming: {why}"));
        }
        if let Some(problem) = self.schema_problem(database).await {
            reasons.push(problem);
        }
        Verdict {
            ok: reasons.is_empty(),
            reasons,
        }
    }
}

impl Health {
    /// What is wrong with Postgres or its schema, if anything, from a check at most a second old.
    async fn schema_problem(&self, database: &DatabaseSettings) -> Option<String> {
        let mut last = self.schema.lock().await;
        if let Some((at, answer)) = last.as_ref()
            && at.elapsed() < SCHEMA_CHECK_FRESH
        {
            return answer.clone();
        }
        let answer = schema_answers(database)
            .await
            .err()
            .map(|e| crate::error::Report(&e).to_string());
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}

fn name(l: Loop) -> &'static str {
    match l {
        Loop::Worker => "worker",
        Loop::Relay => "relay",
        Loop::Supervisor => "supervisor",
            Loop::Timers => "timers",
        Loop::Pruner => "pruner",
        Loop::Flow => "flow",
    }
}

/// Postgres answers within two seconds, with a schema this build can run on.
async fn schema_answers(database: &DatabaseSettings) -> store::Result<()> {
    let check = async {
        let mut conn = store::connect_one(database).await?;
        let checked = store::check_schema(&mut conn, database).await.map(drop);
        let _ = sqlx::Connection::close(conn).await;
        checked
    };
    match tokio::time::timeout(Duration::from_secs(2), check).await {
        Ok(answer) => answer,
        Err(_) => Err(store::Error::Unavailable {
            what: "Postgres did not answer within 2 s".into(),
            source: None,
        }),
    }
}

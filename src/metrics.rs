//! Prometheus metrics, served at `/metrics` by the API. Counters and histograms are recorded
//! where things happen; the gauges that describe the database (runs by status, outbox backlog,
//! runs waiting for review) are refreshed from it in the background. No run id is ever a label:
//! every label has a bounded set of values.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::domain::RunStatus;
use crate::store;

/// Runs by workflow and status (gauge, from the database).
pub const RUNS: &str = "trailmark_runs";
/// Runs in `needs_review` (gauge, from the database).
pub const REVIEW_RUNS: &str = "trailmark_review_runs";
/// A step from claim to disposition, by workflow, step and outcome (histogram, seconds).
pub const STEP_DURATION: &str = "trailmark_step_duration_seconds";
/// Steps retried, by class: `temporary` (from a delay queue), `infrastructure` (in place),
/// `breaker_open` and `throttled` (waits that spend no attempt).
pub const STEP_RETRIES: &str = "trailmark_step_retries_total";
/// Steps run again, by cause: `redelivery` (a claim's attempt > 1), `lease_expired`
/// (re-queued by the supervisor), `operator` (a resume decision).
pub const RESUMES: &str = "trailmark_resumes_total";
/// Leases taken from another holder (dead, expired, or a re-queued step).
pub const LEASE_TAKEOVERS: &str = "trailmark_lease_takeovers_total";
/// Deliveries dropped as duplicates, by reason.
pub const DUPLICATES: &str = "trailmark_duplicates_dropped_total";
/// Deliveries dropped as stale (the run moved on, or a newer worker owns it).
pub const STALE: &str = "trailmark_stale_dropped_total";
/// Messages this process dead-lettered, by reason.
pub const DEAD_LETTERED: &str = "trailmark_dead_lettered_total";
/// Outbox rows not yet published (gauge, from the database).
pub const OUTBOX_PENDING: &str = "trailmark_outbox_pending";
/// Age of the oldest unpublished outbox row (gauge, seconds, from the database).
pub const OUTBOX_OLDEST_AGE: &str = "trailmark_outbox_oldest_age_seconds";
/// Outbox rows held back because the broker refused them alone (gauge, from the database):
/// above 0, a workflow sends to an exchange that is missing or that no queue is bound to.
pub const OUTBOX_HELD_BACK: &str = "trailmark_outbox_held_back";
/// One relay batch from publish to its last confirm (histogram, seconds).
pub const RELAY_PUBLISH: &str = "trailmark_relay_publish_duration_seconds";
/// Model tokens, by model and kind (`prompt`, `completion`).
pub const MODEL_TOKENS: &str = "trailmark_model_tokens_total";
/// Model cost, by model.
pub const MODEL_COST: &str = "trailmark_model_cost_total";
/// Model calls a fleet-wide limit per minute held back (the step waits), by endpoint.
pub const MODEL_THROTTLED: &str = "trailmark_model_throttled_total";
/// Tokens reserved for model calls at limited endpoints (the calls' estimates, replaced by
/// their real usage in the window once answered), by endpoint.
pub const MODEL_RESERVED_TOKENS: &str = "trailmark_model_reserved_tokens_total";
/// Tokens the fleet used (or holds reserved) at a limited endpoint in the last minute, as this
/// process last saw it when it asked for room (gauge), by endpoint.
pub const MODEL_WINDOW_TOKENS: &str = "trailmark_model_window_tokens";
/// Whether a tool's circuit breaker is open in this process (gauge, 1 or 0).
pub const BREAKER_OPEN: &str = "trailmark_breaker_open";
/// Log lines dropped because the log sink was too slow or failing.
pub const LOG_LINES_LOST: &str = "trailmark_log_lines_lost";
/// Runs waiting for an event or sleeping, by kind (`event`, `sleep`) (gauge, from the database).
pub const WAITS_OPEN: &str = "trailmark_waits_open";
/// Events sent to runs, by outcome: `resumed` (runs waited for it), `kept` (none did yet),
/// `duplicate`, `conflict` (its id was used with another payload), `refused` (a bad field).
pub const EVENTS_RECEIVED: &str = "trailmark_events_received_total";
/// Events that expired without a wait taking them.
pub const EVENTS_EXPIRED: &str = "trailmark_events_expired_total";
/// Rows removed by retention, by what: `runs`, `steps`, `journal`, `effects`, `other` (the
/// rest of a run's rows), `tombstones`, `inbox`, `audit`.
pub const PRUNED: &str = "trailmark_pruned_rows_total";
/// Runs written to the archive directory before their removal.
pub const ARCHIVED: &str = "trailmark_runs_archived_total";
/// When the last prune pass of this process ended without an error (gauge, Unix seconds).
pub const PRUNE_LAST: &str = "trailmark_prune_last_success_timestamp_seconds";
/// Waiting runs moved on, by what moved them: `event`, `woke` (a sleep ended), `timeout`.
pub const WAITS_ENDED: &str = "trailmark_waits_ended_total";
/// How late a due wait (a wake-up or an event timeout) was moved on after its time (histogram,
/// seconds, database clock).
pub const WAKE_LAG: &str = "trailmark_wake_lag_seconds";
/// Step deliveries whose run had to wait for a slot or a token of its key, by workflow.
pub const FLOW_WAITED: &str = "trailmark_flow_waited_total";
/// Runs of the busiest concurrency keys, by workflow, key and state (`running`: holding a slot,
/// `waiting`: for a slot, `throttled`: for a rate's token) (gauge, from the database). Only the
/// [`FLOW_KEYS_SHOWN`] busiest keys are labelled by name, the rest summed under `(other)`, so
/// the labels stay bounded however many tenants there are.
pub const FLOW_KEYS: &str = "trailmark_flow_key_runs";
/// How many keys [`FLOW_KEYS`] names.
pub const FLOW_KEYS_SHOWN: i64 = 20;
/// Debounced run starts waiting for their key's burst to end, by workflow (gauge, from the
/// database).
pub const DEBOUNCED_PENDING: &str = "trailmark_debounced_starts_pending";
/// Debounced run starts, by outcome: `held` (the first of a burst), `superseded` (a later one,
/// which replaced the pending start), `started` (due, made a run), `refused` (due, its run id
/// taken meanwhile).
pub const DEBOUNCED: &str = "trailmark_debounced_starts_total";

/// Explicit buckets, from a fast statement to a slow model call.
const STEP_BUCKETS: [f64; 14] = [
    0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];
const LAG_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 30.0, 300.0];
const PUBLISH_BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process's recorder (once; later calls return the same handle).
pub fn install() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(STEP_DURATION.into()), &STEP_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(RELAY_PUBLISH.into()), &PUBLISH_BUCKETS)
            })
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(WAKE_LAG.into()), &LAG_BUCKETS))
            .expect("the buckets are not empty");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // Another recorder (an embedder's) keeps its place; this handle then renders nothing.
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// The metrics in the Prometheus text format.
pub fn render() -> String {
    gauge!(LOG_LINES_LOST).set(crate::telemetry::lines_lost() as f64);
    install().render()
}

/// Counts a step delivery whose run waits for a slot or a token of its key.
pub fn flow_waited(workflow: &str) {
    counter!(FLOW_WAITED, "workflow" => workflow.to_owned()).increment(1);
}

/// Records how a step ended and how long it took.
pub fn step_finished(workflow: &str, step: &str, outcome: &'static str, took: Duration) {
    histogram!(STEP_DURATION, "workflow" => workflow.to_owned(), "step" => step.to_owned(), "outcome" => outcome)
        .record(took.as_secs_f64());
}

/// Counts a step retry of `class`.
pub fn step_retried(class: &'static str) {
    counter!(STEP_RETRIES, "class" => class).increment(1);
}

/// Counts steps run again for `cause`.
pub fn resumed(cause: &'static str, n: u64) {
    counter!(RESUMES, "cause" => cause).increment(n);
}

/// Counts leases taken from another holder.
pub fn lease_taken_over(n: u64) {
    counter!(LEASE_TAKEOVERS).increment(n);
}

/// Counts a delivery dropped as a duplicate.
pub fn duplicate_dropped(reason: &'static str) {
    counter!(DUPLICATES, "reason" => reason).increment(1);
}

/// Counts a delivery dropped as stale.
pub fn stale_dropped() {
    counter!(STALE).increment(1);
}

/// Counts a message dead-lettered by this process.
pub fn dead_lettered(reason: &'static str) {
    counter!(DEAD_LETTERED, "reason" => reason).increment(1);
}

/// Records one relay batch's publish time.
pub fn relay_published(took: Duration) {
    histogram!(RELAY_PUBLISH).record(took.as_secs_f64());
}

/// Counts a model answer's tokens and cost.
pub fn model_answered(model: &str, prompt: u64, completion: u64, cost: f64) {
    counter!(MODEL_TOKENS, "model" => model.to_owned(), "kind" => "prompt").increment(prompt);
    counter!(MODEL_TOKENS, "model" => model.to_owned(), "kind" => "completion")
        .increment(completion);
    // A counter of cost: the exporter keeps floats for gauges only, so cost is kept as a gauge
    // that only ever goes up.
    gauge!(MODEL_COST, "model" => model.to_owned()).increment(cost);
}

/// Counts a model call admitted at a limited `endpoint` with `estimate` tokens reserved,
/// `window` the endpoint's tokens in the last minute with it.
pub fn model_reserved(endpoint: &str, estimate: u64, window: u64) {
    counter!(MODEL_RESERVED_TOKENS, "endpoint" => endpoint.to_owned()).increment(estimate);
    gauge!(MODEL_WINDOW_TOKENS, "endpoint" => endpoint.to_owned()).set(window as f64);
}

/// Counts a model call held back by `endpoint`'s limits, `window` its tokens in the last minute.
pub fn model_throttled(endpoint: &str, window: u64) {
    counter!(MODEL_THROTTLED, "endpoint" => endpoint.to_owned()).increment(1);
    gauge!(MODEL_WINDOW_TOKENS, "endpoint" => endpoint.to_owned()).set(window as f64);
}

/// Counts an event sent to runs, by `outcome`.
pub fn event_received(outcome: &'static str) {
    counter!(EVENTS_RECEIVED, "outcome" => outcome).increment(1);
}

/// Counts events that expired without a wait taking them.
pub fn events_expired(n: u64) {
    counter!(EVENTS_EXPIRED).increment(n);
}

/// Counts a waiting run moved on `by` an event, a wake-up or a timeout, `late_secs` after its
/// due time for the last two.
pub fn wait_ended(by: &'static str, late_secs: Option<f64>) {
    counter!(WAITS_ENDED, "by" => by).increment(1);
    if let Some(late) = late_secs {
        histogram!(WAKE_LAG).record(late.max(0.0));
    }
}

/// Counts debounced run starts by `outcome`.
pub fn debounced(outcome: &'static str, n: u64) {
    counter!(DEBOUNCED, "outcome" => outcome).increment(n);
}

/// Sets the pending debounced starts of `workflow`.
pub fn debounced_pending(workflow: &str, n: i64) {
    gauge!(DEBOUNCED_PENDING, "workflow" => workflow.to_owned()).set(n as f64);
}

/// A batch of runs removed (and how many of them archived).
pub fn pruned(r: &store::retention::Removed, archived: u64) {
    for (what, n) in [
        ("runs", r.runs),
        ("steps", r.steps),
        ("journal", r.journal),
        ("effects", r.effects),
        ("other", r.other),
    ] {
        counter!(PRUNED, "what" => what).increment(n.max(0) as u64);
    }
    counter!(ARCHIVED).increment(archived);
}

/// Rows of `what` aged out.
pub fn aged_out(what: &'static str, n: i64) {
    counter!(PRUNED, "what" => what).increment(n.max(0) as u64);
}

/// A prune pass ended without an error.
pub fn prune_finished() {
    gauge!(PRUNE_LAST).set(chrono::Utc::now().timestamp() as f64);
}

/// Sets whether `tool`'s breaker is open.
pub fn breaker(tool: &str, open: bool) {
    gauge!(BREAKER_OPEN, "tool" => tool.to_owned()).set(if open { 1.0 } else { 0.0 });
}

/// How often the database gauges are refreshed.
const REFRESH: Duration = Duration::from_secs(5);

/// Every how many refreshes the finished runs are counted too: their count grows with the
/// history kept (117-123 ms per count at 1,000,000 finished runs, in every process), while
/// on-call acts on the unfinished ones, which stay fresh.
const FINISHED_EVERY: u32 = 12;

/// Refreshes the database gauges every few seconds until `shutdown`.
pub async fn refresh_gauges(pool: PgPool, shutdown: CancellationToken) {
    let mut known = BTreeSet::new();
    for round in 0u32.. {
        let statuses: &[RunStatus] = match round % FINISHED_EVERY {
            0 => &RunStatus::ALL,
            _ => &RunStatus::UNFINISHED,
        };
        if let Err(e) = refresh(&pool, statuses, &mut known).await {
            tracing::debug!(error = %crate::error::Report(&e), "metrics: the database gauges were not refreshed");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(REFRESH) => {}
        }
    }
}

/// One refresh of every database gauge.
pub async fn refresh_once(pool: &PgPool) -> store::Result<()> {
    refresh(pool, &RunStatus::ALL, &mut BTreeSet::new()).await
}

/// One refresh of the database gauges, counting runs in `statuses` only, for every workflow
/// seen so far (`known`), so that a status no run has any more reads 0.
async fn refresh(
    pool: &PgPool,
    statuses: &[RunStatus],
    known: &mut BTreeSet<String>,
) -> store::Result<()> {
    let counts = store::runs::counts_of(pool, statuses).await?;
    known.extend(counts.iter().map(|c| c.workflow.clone()));
    for workflow in known.iter() {
        for &status in statuses {
            let runs = counts
                .iter()
                .find(|c| c.workflow == *workflow && c.status == status)
                .map_or(0, |c| c.runs);
            gauge!(RUNS, "workflow" => workflow.clone(), "status" => status.as_str())
                .set(runs as f64);
        }
    }
    let review: i64 = counts
        .iter()
        .filter(|c| c.status == RunStatus::NeedsReview)
        .map(|c| c.runs)
        .sum();
    gauge!(REVIEW_RUNS).set(review as f64);
    let backlog = store::outbox::backlog(pool).await?;
    gauge!(OUTBOX_PENDING).set(backlog.pending as f64);
    gauge!(OUTBOX_OLDEST_AGE).set(backlog.oldest_age_secs);
    gauge!(OUTBOX_HELD_BACK).set(backlog.held_back as f64);
    let open = store::waits::open_counts(pool).await?;
    for kind in ["event", "sleep"] {
        let n = open.iter().find(|(k, _)| k == kind).map_or(0, |(_, n)| *n);
        gauge!(WAITS_OPEN, "kind" => kind).set(n as f64);
    }
    crate::flow::debounce::refresh_gauge(pool).await?;
    refresh_keys(pool).await
}

/// The busiest keys' gauges; a key no longer among them (or idle) reads 0 once, then is left.
async fn refresh_keys(pool: &PgPool) -> store::Result<()> {
    static SHOWN: std::sync::Mutex<BTreeSet<(String, String)>> = std::sync::Mutex::new(BTreeSet::new());
    let busiest = store::flow::busiest(pool, i64::MAX).await?;
    let mut now = BTreeSet::new();
    let mut other: std::collections::BTreeMap<String, [i64; 3]> = Default::default();
    for (i, k) in busiest.iter().enumerate() {
        let figures = [k.running, k.waiting, k.throttled];
        if (i as i64) < FLOW_KEYS_SHOWN {
            set_key(&k.workflow, &k.key, figures);
            now.insert((k.workflow.clone(), k.key.clone()));
        } else {
            let sum = other.entry(k.workflow.clone()).or_default();
            sum.iter_mut().zip(figures).for_each(|(s, f)| *s += f);
        }
    }
    for (workflow, figures) in other {
        set_key(&workflow, "(other)", figures);
        now.insert((workflow, "(other)".to_owned()));
    }
    let mut shown = SHOWN.lock().unwrap_or_else(|e| e.into_inner());
    for (workflow, key) in shown.difference(&now) {
        set_key(workflow, key, [0, 0, 0]);
    }
    *shown = now;
    Ok(())
}

fn set_key(workflow: &str, key: &str, [running, waiting, throttled]: [i64; 3]) {
    for (state, n) in [("running", running), ("waiting", waiting), ("throttled", throttled)] {
        gauge!(FLOW_KEYS, "workflow" => workflow.to_owned(), "key" => key.to_owned(), "state" => state)
            .set(n as f64);
    }
}

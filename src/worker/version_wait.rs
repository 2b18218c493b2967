//! A step of a workflow version this worker does not carry: a newer one (a rolling upgrade under
//! way, or a version never deployed), or an older one that another live worker still carries
//! (the other side of a rolling upgrade: `trailmark.deployments` says who carries what). The
//! message waits in the delay queues for a worker that carries its version, but only while its
//! run still waits at that position, and only for `worker.newer_version_wait_secs`: then it is
//! dead-lettered where an operator sees it, instead of circling through the delay queues for
//! ever. An older version no live worker carries does not wait: its run is claimed and stopped
//! for review (`ending::refuse_older_version`), for a person to move it on.
//!
//! How long it has waited travels with the message, in two headers the first wait sets (when it
//! was first seen, how many waits since), so every worker it meets counts the same wait.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::types::FieldTable;

use super::outcome::{Disposition, dead};
use crate::broker::header_str;
use crate::domain::{RunStartEvent, StepMessage};
use crate::engine::Engine;
use crate::store::{self, runs};

/// When a worker first sent the message to wait for its version (RFC 3339).
pub const SINCE: &str = "x-trailmark-newer-version-since";
/// How many times it has waited since.
pub const WAITS: &str = "x-trailmark-newer-version-waits";

/// The dead-letter reason of a step whose version no worker took in time.
pub const REASON: &str = "version_not_deployed";

/// A wait is said at WARN once per message per this long (at DEBUG in between).
const WARN_EVERY: Duration = Duration::from_secs(60);

/// How long a message has waited for its version, as its headers say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waited {
    /// When it was first sent to wait.
    pub since: DateTime<Utc>,
    /// How many waits so far.
    pub times: u32,
}

impl Waited {
    /// The wait recorded in `headers`, if the message waited before (a header that does not
    /// parse counts as none: the wait starts again, it is not cut short).
    pub fn read(headers: Option<&FieldTable>) -> Option<Self> {
        let since = header_str(headers, SINCE)?;
        let since = DateTime::parse_from_rfc3339(&since).ok()?.with_timezone(&Utc);
        let times = header_str(headers, WAITS)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        Some(Self { since, times })
    }
}

/// A step that must go to another worker: the newest version this worker carries, and whether
/// another live worker is known to carry the step's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Elsewhere {
    /// The newest version of the workflow carried here.
    pub deployed: i32,
    /// Another live worker carries the step's version.
    pub carried: bool,
}

/// Hops straight back through the steps queue a step takes while another live worker carries
/// its version, before it waits in the delay queues: in a mixed fleet it meets a carrier within
/// a few hops at a few milliseconds each (a delay-queue trip would cost a second per hop, which
/// made a rolling deploy ten times slower), and a carrier that is alive but stuck (frozen)
/// still cannot make the step circle fast for long.
const QUICK_HOPS: u32 = 10;

/// Where `msg` must go instead of running here, when it must wait for another
/// worker: its version is not carried here, and it is newer than every version carried here,
/// or another live worker carries it, or it has waited less than a lease (`waited`): a carrier
/// that is starting, or whose presence connection is reconnecting, is not seen for a moment, and
/// a run must not stop for review for that. `None`: run it here (or refuse it here).
pub(super) async fn elsewhere(
    engine: &Engine,
    msg: &StepMessage,
    waited: Option<Waited>,
) -> store::Result<Option<Elsewhere>> {
    let Some(newest) = engine.registry.get(&msg.workflow) else {
        return Ok(None);
    };
    if engine.registry.version(&msg.workflow, msg.version).is_some() {
        return Ok(None);
    }
    let deployed = newest.version;
    let newer = msg.version > deployed;
    let carried = store::deployments::carried_elsewhere(
        &engine.pool,
        &msg.workflow,
        msg.version,
        &engine.worker_id,
    )
    .await?;
    let grace = engine.settings.worker.lease();
    let so_far = waited.map_or(Duration::ZERO, |w| {
        (Utc::now() - w.since).to_std().unwrap_or_default()
    });
    let waits = newer || carried || so_far < grace;
    Ok(waits.then_some(Elsewhere { deployed, carried }))
}

/// A start naming `version` of its workflow, which this worker does not carry: sent straight
/// back to the start queue when another live worker carries it, up to [`QUICK_HOPS`] times, to
/// meet one (`None`: no live worker carries it, or the hops are spent; the start is refused).
pub(super) async fn start_elsewhere(
    engine: &Engine,
    event: &RunStartEvent,
    version: i32,
    delivery: &lapin::message::Delivery,
) -> store::Result<Option<Disposition>> {
    let waited = Waited::read(delivery.properties.headers().as_ref());
    let times = waited.map_or(0, |w| w.times);
    if times >= QUICK_HOPS {
        return Ok(None);
    }
    let (workflow, me) = (&event.workflow, &engine.worker_id);
    if !store::deployments::carried_elsewhere(&engine.pool, workflow, version, me).await? {
        return Ok(None);
    }
    tracing::debug!(run.id = %event.run_id, version, hops = times + 1, "start of a workflow version another worker carries; sent on to meet it");
    Ok(Some(Disposition::WaitForVersion {
        delay: Duration::ZERO,
        waited: Waited {
            since: waited.map_or_else(Utc::now, |w| w.since),
            times: times + 1,
        },
    }))
}

/// What becomes of a step of version `msg.version` met by a worker whose newest is `deployed`:
/// stale when its run ended or moved past it (whatever its version), dead-lettered once it has
/// waited `worker.newer_version_wait_secs`, else one more wait in a delay queue.
pub(super) async fn process(
    engine: &Engine,
    msg: &StepMessage,
    Elsewhere { deployed, carried }: Elsewhere,
    waited: Option<Waited>,
) -> store::Result<Disposition> {
    match runs::standing(&engine.pool, &msg.run_id).await? {
        None => return super::step::no_run(engine, &msg.run_id).await,
        Some((status, _, _)) if !status.accepts_steps() => {
            return Ok(Disposition::Stale(format!("run is {status}")));
        }
        Some((_, seq, _)) if seq != msg.seq => {
            return Ok(Disposition::Stale(format!(
                "run is at position {seq}, message is for {}",
                msg.seq
            )));
        }
        // A copy from before an operator moved the run to another version.
        Some((_, _, version)) if version != msg.version => {
            return Ok(Disposition::Stale(format!(
                "run was moved to {} v{version}, message is for v{}",
                msg.workflow, msg.version
            )));
        }
        Some(_) => {}
    }
    let now = Utc::now();
    let since = waited.map_or(now, |w| w.since);
    let times = waited.map_or(0, |w| w.times);
    let so_far = (now - since).to_std().unwrap_or_default();
    let limit = engine.settings.worker.newer_version_wait_secs;
    if so_far >= Duration::from_secs(limit) {
        return Ok(dead(REASON, detail(msg, deployed, so_far, times, limit)));
    }
    // Zero: straight back through the steps queue, to meet a carrier (`QUICK_HOPS`).
    let delay = if carried && times < QUICK_HOPS {
        Duration::ZERO
    } else {
        delay(engine, so_far)
    };
    // A hop toward a known carrier is routing at work in a rolling deploy, not news.
    if !carried && warns(waited.is_none(), so_far, delay) {
        tracing::warn!(run.id = %msg.run_id, version = msg.version, deployed, waited_secs = so_far.as_secs(),
            limit_secs = limit, "step of a workflow version this worker does not carry; it waits for a worker that carries it (a rolling upgrade under way?), then goes to the DLQ");
    } else {
        tracing::debug!(version = msg.version, deployed, waited_secs = so_far.as_secs(), "step of a workflow version not carried here waits again");
    }
    Ok(Disposition::WaitForVersion {
        delay,
        waited: Waited {
            since,
            times: times + 1,
        },
    })
}

/// Whether this wait is said at WARN: the first one, and then the first after each
/// [`WARN_EVERY`] of waiting (the previous wait, `delay` ago, was in an earlier period).
fn warns(first: bool, so_far: Duration, delay: Duration) -> bool {
    let period = |d: Duration| d.as_secs() / WARN_EVERY.as_secs();
    first || period(so_far) > period(so_far.saturating_sub(delay))
}

/// The wait before the message is looked at again: short at first (an upgrade usually finishes
/// within seconds), longer the longer it waits, so a forgotten version costs little meanwhile.
fn delay(engine: &Engine, so_far: Duration) -> Duration {
    let first = Duration::from_millis(engine.settings.worker.busy_retry_ms.max(1_000));
    match so_far.as_secs() {
        0..30 => first,
        30..300 => first.max(Duration::from_secs(5)),
        _ => first.max(Duration::from_secs(30)),
    }
}

/// The dead letter's detail: which run, step and versions, how long it waited, what to do.
fn detail(msg: &StepMessage, deployed: i32, so_far: Duration, times: u32, limit: u64) -> String {
    format!(
        "run {} step {} (position {}) is of {} v{}, but the workers that met it carry up to v{deployed} without it; no worker carrying v{} took it within {} s ({times} waits; worker.newer_version_wait_secs = {limit}); see which live workers carry it with `trailmark workflow versions`, deploy v{} of {} (or move the run: `trailmark workflow move`), then `trailmark dlq requeue {}`",
        msg.run_id,
        msg.step,
        msg.seq,
        msg.workflow,
        msg.version,
        msg.version,
        so_far.as_secs(),
        msg.version,
        msg.workflow,
        msg.message_id,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_waiting_a_second_at_a_time_is_said_at_warn_once_a_minute() {
        let second = Duration::from_secs(1);
        let said = (0..600u64)
            .filter(|s| warns(*s == 0, Duration::from_secs(*s), second))
            .count();
        // The first wait, then at 60, 120, ... 540 s.
        assert_eq!(said, 10);
    }

    #[test]
    fn the_wait_is_read_back_from_the_headers_it_was_written_to() {
        let since = DateTime::parse_from_rfc3339("2026-12-01T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let mut headers = FieldTable::default();
        let text = |s: String| lapin::types::AMQPValue::LongString(s.into());
        headers.insert(SINCE.into(), text(since.to_rfc3339()));
        headers.insert(WAITS.into(), text("7".into()));
        assert_eq!(
            Waited::read(Some(&headers)),
            Some(Waited { since, times: 7 })
        );
        assert_eq!(Waited::read(None), None);
    }
}

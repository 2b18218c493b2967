//! An event arriving, through whichever face: recorded once by its id, and the runs that wait
//! for it moved on, in one transaction. The same id again is the same event (nothing more
//! happens); the same id with another name, key or payload is refused as a conflict.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{How, go_on};
use crate::domain::{BadEvent, InboundEvent};
use crate::engine::Engine;
use crate::operator::Decider;
use crate::store::{self, audit, waits};

/// What became of an event sent to runs.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct EventSent {
    /// The event's id (given, or made when none was).
    pub id: String,
    /// Its name.
    pub name: String,
    /// Its match key.
    pub key: String,
    /// `resumed` (it moved waiting runs on), `kept` (no run waits for it yet: the first wait
    /// for its name and key takes it), or `duplicate` (this id was received before).
    pub outcome: String,
    /// The runs it moved on.
    pub resumed: Vec<String>,
    /// Until when it is kept for a wait, when it was kept.
    pub kept_until: Option<DateTime<Utc>>,
    /// For a duplicate: what became of the first (`pending`, `consumed`, `expired`).
    pub first: Option<String>,
}

/// Why an event was not taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// A field is wrong, or the event is too large; nothing was recorded.
    #[error(transparent)]
    Bad(#[from] BadEvent),
    /// The id was received before with another name, key or payload; nothing was recorded.
    #[error(
        "event id {id} was received at {at} with {what}; this event (payload sha256 {new_hash}) was not recorded: send it under another id"
    )]
    Conflict {
        /// The id.
        id: String,
        /// When the first came.
        at: DateTime<Utc>,
        /// What the first had: its name, key and payload hash.
        what: String,
        /// The first's payload hash.
        stored_hash: String,
        /// This one's payload hash.
        new_hash: String,
    },
    /// The database failed; nothing was recorded.
    #[error("the event was not recorded")]
    Store(#[from] store::Error),
}

/// Who sends an event: a person or program through a face that audits (the API, the CLI, the
/// embedded handle), or an upstream service over AMQP (not audited, as its run starts are not).
#[derive(Debug, Clone, Copy)]
pub enum Sender<'a> {
    /// Audited as this decider (its `via` names the face).
    Audited(&'a Decider),
    /// Published to `<prefix>.runs` with routing key `run.event`.
    Amqp,
}

impl Sender<'_> {
    fn via(&self) -> &str {
        match self {
            Self::Audited(who) => who.via,
            Self::Amqp => "amqp",
        }
    }
}

/// Records `event` and moves on every run that waits for its name and key, in one transaction
/// (with its audit row when `from` is audited); an event no run waits for is kept for
/// `waits.event_keep_secs`, for the first wait that comes.
pub async fn send(
    engine: &Engine,
    event: InboundEvent,
    from: Sender<'_>,
) -> Result<EventSent, SendError> {
    let via = from.via().to_owned();
    let w = &engine.settings.waits;
    let mut tx = engine.pool.begin().await.map_err(store::Error::from)?;
    waits::lock_pair(&mut tx, &event.name, &event.key).await?;
    let keep = (w.event_keep_secs, w.event_retention_secs);
    let sent = |outcome: &str, resumed, kept_until, first: Option<&str>| EventSent {
        id: event.id.clone(),
        name: event.name.clone(),
        key: event.key.clone(),
        outcome: outcome.to_owned(),
        resumed,
        kept_until,
        first: first.map(str::to_owned),
    };
    let expires_at = match waits::receive(&mut tx, &event, &via, keep).await? {
        waits::Received::New { expires_at } => expires_at,
        waits::Received::Repeat(first) => {
            tx.rollback().await.map_err(store::Error::from)?;
            crate::metrics::event_received("duplicate");
            tracing::info!(event.id = %event.id, first = first.state(), "the event was received before; nothing more to do");
            return Ok(sent("duplicate", Vec::new(), None, Some(first.state())));
        }
        waits::Received::Reused(first) => {
            tx.rollback().await.map_err(store::Error::from)?;
            crate::metrics::event_received("conflict");
            let new_hash = event.payload_hash();
            tracing::warn!(event.id = %event.id, stored = %first.payload_hash, new = %new_hash, "an event id reused with another payload; refused");
            return Err(SendError::Conflict {
                what: format!(
                    "name {}, key {} and payload sha256 {}",
                    first.name, first.key, first.payload_hash
                ),
                id: event.id.clone(),
                at: first.received_at,
                stored_hash: first.payload_hash,
                new_hash,
            });
        }
    };
    let waiting = waits::waiting_for(&mut tx, &event.name, &event.key).await?;
    let runs = waiting
        .into_iter()
        .map(|w| (w, How::Event(event.id.clone())))
        .collect();
    let resumed = go_on(&mut tx, &engine.topology, runs).await?;
    if !resumed.is_empty() {
        waits::consumed(&mut *tx, &event.id, resumed.len() as i32).await?;
    }
    if let Sender::Audited(who) = from {
        audited(&mut tx, who, &event, &resumed).await?;
    }
    let fp = &engine.failpoints;
    fp.hit("event.before_commit").map_err(interrupted)?;
    tx.commit().await.map_err(store::Error::from)?;
    fp.hit("event.after_commit").map_err(interrupted)?;
    if resumed.is_empty() {
        crate::metrics::event_received("kept");
        tracing::info!(event.id = %event.id, event = %event.name, key = %event.key, "no run waits for the event yet; kept for the first wait that comes");
        return Ok(sent("kept", Vec::new(), Some(expires_at), None));
    }
    crate::metrics::event_received("resumed");
    tracing::info!(event.id = %event.id, event = %event.name, key = %event.key, runs = resumed.len(), "the event moved waiting runs on");
    Ok(sent("resumed", resumed, None, None))
}

/// The event's audit row, in its transaction: who sent what to whom.
async fn audited(
    tx: &mut sqlx::PgConnection,
    who: &Decider,
    event: &InboundEvent,
    resumed: &[String],
) -> store::Result<()> {
    let details = serde_json::json!({
        "name": event.name, "key": event.key, "payload_hash": event.payload_hash(),
        "resumed": resumed,
    });
    audit::insert(tx, &who.audit_entry("event.send", &event.id, &details)).await
}

fn interrupted(e: crate::failpoint::Injected) -> SendError {
    SendError::Store(store::Error::unavailable("the event was interrupted", e))
}

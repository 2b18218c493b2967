//! Events sent to waiting runs over AMQP (`<prefix>.runs` with routing key `run.event`), so
//! that upstream services in any language can send them as they start runs. Each is recorded
//! and delivered by `wait::send`, exactly as the API's and the CLI's; a bad field is
//! dead-lettered as `bad_event` and an id reused with another payload as `event_conflict`,
//! nothing half-created; a repeat is dropped as a duplicate.

use std::collections::BTreeMap;

use super::outcome::{Disposition, dead, dead_letter_headers as h};
use crate::domain::{BadEvent, InboundEvent};
use crate::engine::Engine;
use crate::store;
use crate::wait::{self, SendError};

/// The dead-letter reason of an event with a bad field.
pub const BAD_EVENT: &str = "bad_event";
/// The dead-letter reason of an event whose id was used before with another payload.
pub const EVENT_CONFLICT: &str = "event_conflict";

/// Takes one event; `Err` means infrastructure failed and the delivery is retried in place.
pub(super) async fn process(
    engine: &Engine,
    event: &Result<InboundEvent, BadEvent>,
) -> store::Result<Disposition> {
    let event = match event {
        Ok(event) => event.clone(),
        Err(bad) => {
            crate::metrics::event_received("refused");
            return Ok(dead(
                BAD_EVENT,
                format!("{bad}; fix the sender and send the event again"),
            ));
        }
    };
    let refused = match wait::send(engine, event, wait::Sender::Amqp).await {
        Ok(sent) if sent.outcome == "duplicate" => {
            return Ok(Disposition::Duplicate(
                "the event was received before under its id",
            ));
        }
        Ok(_) => return Ok(Disposition::Committed(Vec::new())),
        Err(refused) => refused,
    };
    let detail = refused.to_string();
    let (stored, new) = match refused {
        SendError::Conflict {
            stored_hash,
            new_hash,
            ..
        } => (stored_hash, new_hash),
        SendError::Store(e) => return Err(e),
        other => return Ok(dead(BAD_EVENT, other.to_string())),
    };
    Ok(Disposition::DeadLetter {
        reason: EVENT_CONFLICT,
        detail,
        evidence: BTreeMap::from([
            (h::STORED_PAYLOAD_HASH.to_owned(), stored),
            (h::PAYLOAD_HASH.to_owned(), new),
        ]),
    })
}

//! The vocabulary of the engine as types, with no I/O: ids, run status and its allowed moves,
//! step addresses and undo plans, journal entries, effect records and local writes, and the
//! messages that travel through RabbitMQ, events sent to runs and what a run waits for (an event,
//! a time, or child runs).

mod children;
mod envelope;
mod event;
mod ids;
mod local_write;
mod record;
mod signal;
mod status;
mod step;
mod wait;

pub use children::{
    ChildResult, ChildStart, ChildrenSummary, FanOut, MAX_CHILDREN, Threshold, allowed_failures, child_run_id, never,
};
pub use envelope::{
    EagerHold,
    DecodeError, OutgoingMessage, RUN_START_ROUTING_KEY, RunStartEvent, STEP_ROUTING_KEY,
    StepMessage,
};
pub use event::{EVENT_HEADER, EVENT_STATUSES, Event};
pub use ids::{Fence, IdError, IdempotencyKey, MessageId, RunId};
pub use local_write::{BadLocalWrite, LocalTable, LocalWrite};
pub use record::{
    Admission, ModelAsk, EffectIntent, EffectState, IntentOutcome, JournalEntry, ShadowWrite, Spent, ToolUsage,
    request_hash,
};
pub use signal::{
    BadEvent, EVENT_SEND_ROUTING_KEY, InboundEvent, MAX_EVENT_FIELD_CHARS, check_key, check_name,
};
pub use status::{IllegalMove, RunStatus, Transition, UnknownStatus};
pub use step::{PlannedUndo, StepAddress, UndoPlan};
pub use wait::{Due, NewWait, WaitFor};

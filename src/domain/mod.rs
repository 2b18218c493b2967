//! The vocabulary of DESIGN.md as types, with no I/O: ids, run status and its transitions, and
//! the messages that travel through RabbitMQ.

mod envelope;
mod ids;
mod status;

pub use envelope::{
    DecodeError, RUN_START_ROUTING_KEY, RunStartEvent, STEP_ROUTING_KEY, StepMessage,
};
pub use ids::{Fence, IdError, IdempotencyKey, MessageId, RunId};
pub use status::RunStatus;

//! Trailmark runs long, multi-step agent workflows so that a crash, a timeout or a half-finished
//! step becomes recoverable progress instead of lost or duplicated work.
//!
//! # The map
//!
//! | module | what it does |
//! |---|---|
//! | [`domain`] | ids, run status, the run-start event and the step message; no I/O |
//! | [`config`] | typed settings: compiled-in defaults, optional file, environment |
//! | [`store`] | all SQL: runs, step checkpoints, journal, effects, inbox, outbox |
//! | [`broker`] | RabbitMQ connection, topology, publisher with confirms |
//! | [`workflow`] | the API for writing workflows: steps, kinds, context, next-step choice |
//! | [`worker`] | delivery -> dedup -> lease -> handler -> one commit -> ack |
//! | [`relay`] | outbox -> RabbitMQ with publisher confirms |
//! | [`dlq`] | the dead-letter queue for operators: list, show, requeue, purge |
//! | [`supervisor`] | expired leases -> the step re-queued through the outbox |
//! | [`guard`] | budgets, repeated-action detection, circuit breakers |
//! | [`operator`] | operator decisions: resume, resume after fix, undo, cancel, approve, reject |
//! | [`engine`] | the shared state a process's components run on |
//! | [`model`] | OpenAI-compatible chat-completions client |
//! | [`standin`] | stand-in outside systems for tests, drills and the demo |
//! | [`builtin`] | the `chain` workflow and the reference `reconcile` workflow |
//! | [`reference`] | the nightly invoice reconciliation (DESIGN.md §12), its stand-in outside systems and `trailmark demo` |
//! | [`bench`] | `trailmark bench`: throughput, latency, CPU, recovery against the bare-loop baseline B3 |
//! | [`cli`] | operator commands behind the `trailmark` binary |
//!
//! # The promises (DESIGN.md §1)
//!
//! A finished step never runs again (its output is committed with the next step's outbox row);
//! a model answer is paid for once (journaled the moment it arrives); an outside write happens
//! once where the receiving store enforces the idempotency key; no step message is lost (outbox
//! plus publisher confirms); a repeated message changes nothing (inbox); a stale worker cannot
//! write (fenced lease); bad input goes to a dead-letter queue with its reason.

#![warn(missing_docs)]

pub mod bench;
pub mod broker;
pub mod builtin;
pub mod cli;
pub mod config;
pub mod dlq;
pub mod domain;
pub mod engine;
pub mod error;
pub mod failpoint;
pub mod guard;
pub mod model;
pub mod operator;
pub mod process;
pub mod reference;
pub mod relay;
pub mod standin;
pub mod store;
pub mod supervisor;
pub mod telemetry;
pub mod timeline;
pub mod worker;
pub mod workflow;

pub use process::serve;

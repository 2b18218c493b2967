//! Trailmark runs long, multi-step agent workflows so that a crash, a timeout or a half-finished
//! step becomes recoverable progress instead of lost or duplicated work. This crate is the
//! engine; the `trailmark` binary, the reference scenario, the benchmark and the stand-in model
//! server are the workspace members under `crates/`.
//!
//! # The map
//!
//! | module | what it does |
//! |---|---|
//! | [`api`] | the HTTP surface: `/livez`, `/readyz`, `/metrics`, and the ops API under `/api/v1` with roles and an audit trail |
//! | [`console`] | the ops console in the browser at `/`: review queue, run pages, decisions, dead letters |
//! | [`diff`] | two runs compared position by position: outputs, model answers, outside writes |
//! | [`domain`] | ids, run status and its allowed moves, step addresses, undo plans, journal and effect records, the messages; no I/O |
//! | [`config`] | typed settings: compiled-in defaults, optional file, environment |
//! | [`store`] | all SQL: runs, step checkpoints, journal, effects, inbox, outbox, decisions |
//! | [`broker`] | RabbitMQ connection, topology, publisher with confirms |
//! | [`workflow`] | the API for writing workflows: steps, kinds, context, next-step choice |
//! | [`worker`] | delivery -> dedup -> lease -> handler -> one commit -> ack; owns the step transaction |
//! | [`relay`] | outbox -> RabbitMQ with publisher confirms |
//! | [`supervisor`] | expired leases -> the step re-queued through the outbox; late decisions escalated |
//! | [`process`] | the components one process runs ([`serve`]) and how they stop |
//! | [`startup`] | what a process checks before it says it started: servers reachable, logins accepted, schema current |
//! | [`operator`] | operator decisions: resume, resume after fix, undo, cancel, approve, reject, fork |
//! | [`timeline`] | a run as an operator reads it (what `trailmark run show` prints) |
//! | [`inspect`] | reads over many runs for the project's tools and operators: statuses, progress, commit times, leases |
//! | [`dlq`] | the dead-letter queue for operators: list, show, requeue, purge |
//! | [`guard`] | budgets, repeated-action detection, circuit breakers |
//! | [`health`] | what `/livez` and `/readyz` answer: loops coming round, servers answering, not draining |
//! | [`metrics`] | Prometheus metrics: recorded where things happen, database gauges refreshed in the background |
//! | [`model`] | OpenAI-compatible chat-completions client, and the offline answer |
//! | [`engine`] | the shared state a process's components run on |
//! | [`error`] | how a caller reacts to an error: retry, fix the configuration, or accept a refusal |
//! | [`builtin`] | the `chain` workflow, for smoke tests, drills and benchmarks |
//! | [`failpoint`] | named failpoints for crash tests and drills |
//! | [`seams`] | faults a drill switches on around `ctx.model` and `ctx.effect`, and its call log |
//! | [`redact`] | the one place that hides secrets in what trailmark prints |
//! | [`telemetry`] | logging setup |
//!
//! # The promises
//!
//! A finished step never runs again (its output is committed with the next step's outbox row);
//! a model answer is paid for once (journaled the moment it arrives); an outside write happens
//! once where the receiving store enforces the idempotency key; no step message is lost (outbox
//! plus publisher confirms); a repeated message changes nothing (inbox); a stale worker cannot
//! write (fenced lease); bad input goes to a dead-letter queue with its reason. The architecture
//! document (`docs/ARCHITECTURE.md`) names the file that keeps each promise and the test that
//! proves it.

#![warn(missing_docs)]

pub mod api;
pub mod broker;
pub mod builtin;
pub mod config;
pub mod console;
pub mod diff;
pub mod dlq;
pub mod domain;
pub mod engine;
pub mod error;
pub mod failpoint;
pub mod guard;
pub mod health;
pub mod inspect;
pub mod metrics;
pub mod model;
pub mod operator;
pub mod process;
pub mod redact;
pub mod relay;
pub mod seams;
pub mod startup;
pub mod store;
pub mod supervisor;
pub mod telemetry;
pub mod timeline;
pub mod worker;
pub mod workflow;

pub use process::serve;

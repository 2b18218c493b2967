//! Trailmark runs long, multi-step agent workflows so that a crash, a timeout or a half-finished
//! step becomes recoverable progress instead of lost or duplicated work. This crate is the
//! engine; the `trailmark` binary, the reference scenario, the benchmark, the drill and the
//! stand-in model server are the workspace members under `crates/`.
//!
//! # For workflow authors
//!
//! `use trailmark::prelude::*;` brings everything a workflow needs: [`Workflow`], the step
//! context [`StepContext`], outcomes, error classes, keys, input checks, and [`Trailmark`], the
//! one call that starts an engine inside a program. [`config`] holds the settings. That is the
//! whole public face; what follows is the engine's inside, public only to the project's own tools
//! through the `testkit` feature (no stability promise is made for it).
//!
//! # The map
//!
//! | module | what it does |
//! |---|---|
//! | `api` | (feature `ops-http`) the HTTP surface: `/livez`, `/readyz`, `/metrics`, and the ops API under `/api/v1` with roles and an audit trail |
//! | `console` | (feature `ops-http`) the ops console in the browser at `/`: review queue, run pages, decisions, dead letters |
//! | `diff` | two runs compared position by position: outputs, model answers, outside writes |
//! | `domain` | ids, run status and its allowed moves, step addresses, undo plans, journal and effect records, the messages; no I/O |
//! | `config` | typed settings: compiled-in defaults, optional file, environment |
//! | `store` | all SQL: runs, step checkpoints, journal, effects, inbox, outbox, decisions |
//! | `broker` | RabbitMQ connection, topology, publisher with confirms |
//! | `workflow` | the API for writing workflows: steps, kinds, context, next-step choice |
//! | `worker` | delivery -> dedup -> lease -> handler -> one commit -> ack; owns the step transaction |
//! | `relay` | outbox -> RabbitMQ with publisher confirms |
//! | `replay` | the replay check: a run's recorded history exported, and replayed against the workflows of this build to find where a change would take it down another path |
//! | `remote` | (feature `ops-http`) steps written in other languages: workflows whose steps an HTTP endpoint serves over the step protocol, their callbacks served through the step context |
//! | `retention` | finished runs removed after their keep time (archived first), tombstones, aged inbox ids and audit rows; `trailmark prune` |
//! | `supervisor` | expired leases -> the step re-queued through the outbox; late decisions escalated |
//! | `wait` | runs that wait for an event, a time or child runs: events sent to them, the wait's registration, the timer loop, fan-outs and their joins |
//! | `process` | the components one process runs (`serve`) and how they stop |
//! | `startup` | what a process checks before it says it started: servers reachable, logins accepted, schema current |
//! | `operator` | operator decisions: resume, resume after fix, undo, cancel, approve, reject, fork |
//! | `timeline` | a run as an operator reads it (what `trailmark run show` prints) |
//! | `inspect` | reads over many runs for the project's tools and operators: statuses, progress, commit times, leases |
//! | `dlq` | the dead-letter queue for operators: list, show, requeue, purge |
//! | `guard` | budgets, repeated-action detection, circuit breakers |
//! | `health` | what `/livez` and `/readyz` answer: loops coming round, servers answering, not draining |
//! | `metrics` | Prometheus metrics: recorded where things happen, database gauges refreshed in the background |
//! | `model` | OpenAI-compatible chat-completions client, and the offline answer |
//! | `engine` | the shared state a process's components run on |
//! | `embedded` | [`Trailmark`]: the one call that starts an engine in a program, and the handle to its runs |
//! | `prelude` | the names a workflow author needs |
//! | `error` | the words for how a caller reacts to an error, and an error shown with its causes |
//! | `reaction` | which reaction an error calls for: retry, fix the configuration, or accept a refusal |
//! | `failpoint` | named failpoints for crash tests and drills (armed only with `testkit`) |
//! | `seams` | faults a drill switches on around `ctx.model` and `ctx.effect`, and its call log |
//! | `redact` | the one place that hides secrets in what trailmark prints |
//! | `telemetry` | logging setup |
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

#![deny(missing_docs)]
// Without `testkit` the engine's inside is crate-private, and what only the project's tools call
// (the CLI's admin commands, the drill's read functions) is unused in this build: that is the
// point of the feature, not dead code to delete. The `testkit` build (every workspace build, with
// clippy -D warnings) still reports dead code inside the engine.
#![cfg_attr(not(feature = "testkit"), allow(dead_code, unused_imports))]

/// Declares the engine's inner modules: public to the project's own tools with the `testkit`
/// feature, crate-private for embedders.
macro_rules! inner {
    ($($(#[$attr:meta])* $name:ident;)*) => {$(
        $(#[$attr])*
        #[cfg(feature = "testkit")]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "testkit"))]
        pub(crate) mod $name;
    )*};
}

inner! {
    #[cfg(feature = "ops-http")]
    api;
    broker;
    #[cfg(feature = "ops-http")]
    console;
    diff;
    dlq;
    domain;
    engine;
    error;
    failpoint;
    flow;
    guard;
    health;
    inspect;
    metrics;
    model;
    operator;
    process;
    reaction;
    redact;
    relay;
    replay;
    retention;
    schedule;
    seams;
    startup;
    store;
    supervisor;
    telemetry;
    timeline;
    wait;
    worker;
    workflow;
}

pub mod config;
pub mod embedded;
pub mod prelude;
#[cfg(feature = "ops-http")]
pub mod remote;
pub mod trace;

pub use domain::{BadLocalWrite, UnknownStatus};
pub use embedded::{Builder, Error, RunView, Trailmark};
pub use prelude::*;
/// What `trailmark serve` runs: worker, relay, supervisor and the HTTP surface on one engine.
#[cfg(feature = "testkit")]
pub use process::serve;
pub use workflow::{StartRefused, StepDef};

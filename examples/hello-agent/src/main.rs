//! hello-agent: a three-step agent on an engine embedded in this program. It drafts a greeting
//! with the model (the answer is journaled: a crash never pays for it twice), waits for a
//! person's approval (given here by the program itself), then posts the greeting to an outside
//! ledger under an idempotency key (a crash never posts it twice). Run it with
//! `cargo run -p hello-agent` against the local Postgres and RabbitMQ (`DATABASE_URL`, `AMQP_URL`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use trailmark::prelude::*;

/// What a run is started with: checked before the run exists.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    customer: String,
}

impl Input for Request {
    fn check(&self) -> Result<(), String> {
        match self.customer.trim().is_empty() {
            true => Err("customer must not be empty".into()),
            false => Ok(()),
        }
    }
}

/// What the first step hands to the others.
#[derive(Serialize, Deserialize)]
struct Draft {
    greeting: String,
}

/// The outside system: a ledger that keeps one entry per key, as a store with a unique reference
/// does. (The engine refuses a key reused with another request before the call is made.)
type Ledger = Arc<Mutex<HashMap<String, Value>>>;

fn hello_agent(ledger: Ledger) -> Workflow {
    Workflow::new("hello-agent", 1)
        .input::<Request>()
        .step("draft", StepKind::Model, |ctx| async move {
            let request: Request = ctx.input_as()?;
            let prompt = format!("Write a one-line greeting for {}.", request.customer);
            let answer = ctx
                .model(&ChatRequest::new(vec![ChatMessage::user(prompt)]))
                .await?;
            Ok(StepOutcome::next(Draft {
                greeting: answer.content,
            }))
        })
        .step("approve", StepKind::Human, |ctx| async move {
            let draft: Option<Draft> = ctx.output_as("draft").await?;
            Ok(StepOutcome::wait(
                json!({ "send this greeting?": draft.map(|d| d.greeting) }),
            ))
        })
        .step("post", StepKind::Write, move |ctx| {
            let ledger = ledger.clone();
            async move {
                let draft: Option<Draft> = ctx.output_as("draft").await?;
                let entry = json!({ "greeting": draft.map(|d| d.greeting) });
                let key = IdempotencyKey::for_step(ctx.run_id(), "post", "greeting");
                let request = entry.clone();
                let posted = ctx.effect(&key, &request, |key| async move {
                    let mut ledger = ledger.lock().expect("ledger lock");
                    ledger.entry(key.to_string()).or_insert(entry);
                    Ok(json!({ "posted": key.as_str() }))
                });
                Ok(StepOutcome::finish(posted.await?))
            }
        })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // config/default.toml's values, then a file and the environment (DATABASE_URL, AMQP_URL,
    // TRAILMARK__SECTION__KEY). No model is configured by default: the engine answers offline.
    let mut settings = Settings::load()?;
    // Queues of its own, and no HTTP surface: a `trailmark serve` nearby keeps its own work.
    settings.broker.prefix = "hello-agent".into();
    settings.api.listen = String::new();

    let ledger = Ledger::default();
    let mut registry = Registry::new();
    registry.register(hello_agent(ledger.clone()));
    let engine = Trailmark::builder(settings, registry)
        .migrate(true)
        .start()
        .await?;

    let run = format!("hello-{}", std::process::id());
    let ada = Request {
        customer: "Ada".into(),
    };
    engine.start_run(&run, "hello-agent", &ada).await?;
    let waiting = engine.wait_for(&run, Duration::from_secs(60)).await?;
    println!("{run} is {}: {}", waiting.status, json!(waiting.question));

    engine
        .approve(&run, "approve", "hello-agent", "reads well")
        .await?;
    let done = engine.wait_for(&run, Duration::from_secs(60)).await?;
    println!("ledger: {}", json!(*ledger.lock().expect("ledger lock")));
    println!("{}", done.status);
    engine.shutdown().await?;
    match done.status {
        RunStatus::Succeeded => Ok(()),
        other => Err(format!("run {run} ended {other}: {:?}", done.error).into()),
    }
}

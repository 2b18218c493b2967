//! Harness for the reference scenario: a [`TestEnv`] (own trailmark database and broker prefix)
//! plus the outside database next to it, the mail exchange, and a stand-in model server in this
//! process that answers extraction requests and counts every call. Everything is removed when
//! the test ends, failed or not.

#![allow(dead_code)]

use std::process::ExitStatus;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio_util::sync::CancellationToken;
use trailmark::broker;
use trailmark_reference::logic::{self, Item, Mismatch};
use trailmark_reference::night::{Night, parse_date};
use trailmark_reference::orders::OrderRow;
use trailmark_reference::stock::Received;
use trailmark_reference::{extract, generate, mail, outside, workflow};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};

use crate::common::{self, ChildGuard, TestEnv};

/// Bound on every wait.
pub const WAIT: Duration = Duration::from_secs(90);

/// One isolated reference world.
pub struct RefEnv {
    /// Trailmark's side (dropped after the outside side, see `Drop`).
    pub env: TestEnv,
    /// The outside database.
    pub outside: PgPool,
    /// The stand-in model, counting calls.
    pub model: ModelServer,
    outside_options: PgConnectOptions,
    sender: Option<CancellationToken>,
}

impl RefEnv {
    pub async fn new() -> Self {
        let mut env = TestEnv::new().await;
        let trailmark: PgConnectOptions = env
            .settings
            .database
            .url
            .parse()
            .expect("test database URL");
        let outside_options = outside::options_for(&trailmark).expect("outside options");
        let outside = outside::prepare(&outside_options)
            .await
            .expect("prepare the outside database");
        let conn = broker::connect(&env.settings.broker, "test-mail-setup")
            .await
            .expect("connect RabbitMQ");
        let ch = conn.create_channel().await.expect("channel");
        mail::declare(&ch, &env.prefix)
            .await
            .expect("declare the mail exchange");
        let _ = conn.close(200, "done".into()).await;
        let opts = ModelServerOptions {
            responder: Some(extract::responder()),
            ..Default::default()
        };
        let model = ModelServer::start(opts)
            .await
            .expect("start the model server");
        // In-process engines of this test ask the same model as its child processes.
        env.settings.model.base_url = model.base_url();
        Self {
            env,
            outside,
            model,
            outside_options,
            sender: None,
        }
    }

    /// A night of the given size on the story's date.
    pub fn night(invoices: u32, mismatches: u32) -> Night {
        let mut night = Night::new(parse_date("2026-10-13").unwrap());
        night.invoices = invoices;
        night.mismatches = mismatches;
        night.validated().unwrap()
    }

    /// `trailmark serve` as a real child process, asking this test's model server.
    pub fn serve(&self, failpoints: Option<&str>) -> ChildGuard {
        let model = [("TRAILMARK__MODEL__BASE_URL", self.model.base_url())];
        self.env.spawn_process_with(failpoints, &model)
    }

    /// Publishes the night's run-start, as the upstream scheduler would.
    pub async fn start(&self, night: &Night) {
        let input = night.input(&mail::exchange(&self.env.prefix));
        self.env
            .start_run(workflow::NAME, night.run_id().as_str(), input)
            .await;
    }

    /// Runs the mail sender in this process until the environment is dropped.
    pub fn start_mail_sender(&mut self) {
        let stop = CancellationToken::new();
        let (settings, sink) = (self.env.settings.broker.clone(), self.outside.clone());
        tokio::spawn(mail::run_sender(settings, sink, stop.clone()));
        self.sender = Some(stop);
    }

    /// Waits (bounded, polling) for a child that is expected to kill itself.
    pub async fn died(&self, child: &mut ChildGuard) -> ExitStatus {
        common::wait_exit(child, WAIT).await.unwrap_or_else(|| {
            panic!("the worker did not die within {WAIT:?}: its failpoint never fired")
        })
    }

    /// Waits until the sink holds `notes` debit notes and `summaries` summaries of the run.
    pub async fn wait_sink(&self, run_id: &str, notes: i64, summaries: i64) -> mail::SinkCounts {
        let what = format!("{notes} notes and {summaries} summaries in the sink");
        let held = common::eventually(&what, WAIT, || async {
            let counts = mail::counts(&self.outside, run_id).await.unwrap();
            (counts.notes >= notes && counts.summaries >= summaries).then_some(counts)
        })
        .await;
        match held {
            Some(counts) => counts,
            None => panic!(
                "sink holds {:?}, expected {notes} notes and {summaries} summaries",
                mail::counts(&self.outside, run_id).await.unwrap()
            ),
        }
    }

    /// The checkpoint of `step`, typed.
    pub async fn output<T: serde::de::DeserializeOwned>(&self, run_id: &str, step: &str) -> T {
        let raw: serde_json::Value = sqlx::query_scalar(
            "SELECT output FROM trailmark.steps WHERE run_id = $1 AND step = $2 AND output IS NOT NULL ORDER BY seq DESC LIMIT 1",
        )
        .bind(run_id)
        .bind(step)
        .fetch_one(&self.env.pool)
        .await
        .unwrap_or_else(|e| panic!("no checkpoint of {step}: {e}"));
        serde_json::from_value(raw).expect("checkpoint shape")
    }

    /// Attempts per step name.
    pub async fn attempts(&self, run_id: &str) -> Vec<(String, i32)> {
        sqlx::query_as("SELECT step, attempts FROM trailmark.steps WHERE run_id = $1 ORDER BY seq")
            .bind(run_id)
            .fetch_all(&self.env.pool)
            .await
            .unwrap()
    }
}

/// The adjustments the night calls for, computed from the generated paperwork itself.
pub fn expected_mismatches(night: &Night) -> Vec<Mismatch> {
    let world = generate::world(night);
    let items: Vec<Item> = world
        .invoices
        .iter()
        .flat_map(|inv| {
            inv.lines.iter().map(|l| Item {
                invoice_no: inv.invoice_no.clone(),
                supplier: inv.supplier.clone(),
                po_no: inv.po_no.clone(),
                line: l.line as i32,
                sku: l.sku.clone(),
                qty: l.qty as i32,
                unit_price_cents: l.unit_price_cents,
            })
        })
        .collect();
    let orders: Vec<OrderRow> = world
        .orders
        .iter()
        .map(|o| OrderRow {
            po_no: o.po_no.clone(),
            line: o.line as i32,
            sku: o.sku.clone(),
            ordered_qty: o.ordered_qty as i32,
            agreed_price_cents: o.agreed_price_cents,
        })
        .collect();
    let received: Vec<Received> = world
        .receipts
        .iter()
        .map(|r| Received {
            po_no: r.po_no.clone(),
            line: r.line as i32,
            sku: r.sku.clone(),
            received_qty: r.received_qty as i32,
        })
        .collect();
    let matched = logic::match_orders(&items, &orders).unwrap();
    let over = logic::compare(&matched, &received).unwrap();
    logic::flag(night.run_id().as_str(), &over)
}

impl Drop for RefEnv {
    /// Stops the mail sender, drops the outside database and the mail exchange; the
    /// [`TestEnv`] field then removes trailmark's database and topology.
    fn drop(&mut self) {
        if let Some(stop) = self.sender.take() {
            stop.cancel();
        }
        let (options, settings, prefix) = (
            self.outside_options.clone(),
            self.env.settings.clone(),
            self.env.prefix.clone(),
        );
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(conn) = broker::connect(&settings.broker, "test-mail-teardown").await
                    && let Ok(ch) = conn.create_channel().await
                {
                    let _ = mail::delete(&ch, &prefix).await;
                    let _ = conn.close(200, "teardown".into()).await;
                }
                let _ = outside::drop_database(&options).await;
            });
        })
        .join();
    }
}

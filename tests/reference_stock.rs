//! A resumed run works from the stock numbers it checkpointed, not from a fresh read: the goods
//! receipts change while the worker is dead, and the run still posts exactly what it saw.

mod common;
mod reference_support;

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;

use reference_support::{RefEnv, WAIT, expected_mismatches};
use trailmark::domain::RunStatus;
use trailmark_reference::checkpoints::{Compared, StockRead};
use trailmark_reference::workflow::{COMPARE, READ_STOCK};
use trailmark_reference::{generate, ledger, stock};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_run_uses_the_checkpointed_stock_numbers_after_stock_changed() {
    let r = RefEnv::new().await;
    let night = RefEnv::night(60, 8);
    let run_id = night.run_id().to_string();
    let mut first = r.serve(Some("reconcile.compare.start=kill@1"));
    r.start(&night).await;
    assert_eq!(r.died(&mut first).await.signal(), Some(9));
    let read: StockRead = r.output(&run_id, READ_STOCK).await;

    // While no worker runs, the receipts change: a short delivery turns out complete, and a
    // complete one turns out empty. A fresh read would flag other lines with other amounts.
    let expected = expected_mismatches(&night);
    let short = expected
        .iter()
        .find(|m| m.kind == "qty")
        .expect("the night has a quantity mismatch");
    let item = &short.matched.item;
    stock::set_received(&r.outside, &night, &item.po_no, item.line, item.qty)
        .await
        .unwrap();
    let flagged: HashSet<(String, i32)> = expected
        .iter()
        .map(|m| (m.matched.item.po_no.clone(), m.matched.item.line))
        .collect();
    let world = generate::world(&night);
    let clean = world
        .receipts
        .iter()
        .find(|x| !flagged.contains(&(x.po_no.clone(), x.line as i32)))
        .unwrap();
    stock::set_received(&r.outside, &night, &clean.po_no, clean.line as i32, 0)
        .await
        .unwrap();

    let _second = r.serve(None);
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    let mut want: Vec<(String, i64)> = expected
        .iter()
        .map(|m| (m.key.clone(), m.amount_cents))
        .collect();
    want.sort();
    assert_eq!(
        ledger::entries(&r.outside, &run_id).await.unwrap(),
        want,
        "the ledger follows the changed stock"
    );
    let compared: Compared = r.output(&run_id, COMPARE).await;
    let used = compared
        .differences
        .iter()
        .find(|d| d.matched.item.po_no == item.po_no && d.matched.item.line == item.line)
        .expect("the short delivery is still a difference");
    assert_eq!(
        used.received_qty, short.received_qty,
        "compare used a fresh stock number"
    );
    let checkpointed = read
        .stock
        .iter()
        .find(|x| x.po_no == item.po_no && x.line == item.line)
        .unwrap();
    assert_eq!(checkpointed.received_qty, short.received_qty);
    let now = stock::read_received(&r.outside, &night, std::slice::from_ref(&item.po_no))
        .await
        .unwrap();
    let fresh = now.iter().find(|x| x.line == item.line).unwrap();
    assert_eq!(
        fresh.received_qty, item.qty,
        "the stock record really changed in between"
    );
    assert_eq!(stock::counts(&r.outside, &run_id).await.unwrap(), (8, 8));
}

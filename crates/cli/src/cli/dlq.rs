//! `trailmark dlq list | show | requeue | purge`: the dead-letter queue for operators.

use clap::{ArgGroup, Subcommand};

use trailmark::config::Settings;
use trailmark::dlq::{
    BodyView, Cursor, DeadLetter, DeadLetteredBy, Dlq, Listing, Page, Requeued, Selection, Shown,
};
use trailmark::operator::{self, Decider};
use trailmark::store;

/// The `dlq` subcommands.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first (by time of death, then id): id, reason, source queue,
    /// deliveries, size, time. The same DLQ lists the same way every time; nothing is removed.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// At most this many messages per page.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// The page after this cursor (printed at the end of the previous page, `next` in JSON).
        #[arg(long)]
        after: Option<Cursor>,
    },
    /// Show one dead letter: every header, and the body when it is JSON.
    Show {
        /// Message id (first column of `dlq list`).
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Send dead letters back to the queue they died in, through the normal pipeline
    /// (the inbox still drops a message that was already processed).
    #[command(group(ArgGroup::new("which").required(true).args(["id", "all", "reason"])))]
    Requeue {
        /// Message id (first column of `dlq list`).
        id: Option<String>,
        /// Every dead letter.
        #[arg(long)]
        all: bool,
        /// Every dead letter with this reason code (e.g. unknown_workflow).
        #[arg(long)]
        reason: Option<String>,
        /// Who does it, and why: recorded in the audit trail.
        #[command(flatten)]
        who: Audited,
    },
    /// Delete dead letters for good. Asks first, unless --yes.
    #[command(group(ArgGroup::new("which").required(true).args(["id", "all"])))]
    Purge {
        /// Message id (first column of `dlq list`).
        id: Option<String>,
        /// Every dead letter.
        #[arg(long)]
        all: bool,
        /// Do not ask; required when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
        /// Who does it, and why: recorded in the audit trail.
        #[command(flatten)]
        who: Audited,
    },
}

/// Who makes an audited change (a requeue or purge, a schedule's change), and why: `--why`,
/// since `--reason` already selects dead letters by their reason code.
#[derive(Debug, clap::Args)]
pub struct Audited {
    /// Why, in your words (recorded in the audit trail).
    #[arg(long, default_value = "no reason given")]
    why: String,
    /// Who does it (default: $USER).
    #[arg(long, env = "TRAILMARK_ACTOR")]
    actor: Option<String>,
}

impl Audited {
    fn decider(&self) -> Decider {
        Decider::cli(
            self.actor
                .clone()
                .unwrap_or_else(super::decide::default_actor),
            self.why.clone(),
        )
    }

    /// The decider, its `--why` checked first as text from outside (before the change is made).
    pub(super) fn checked(&self) -> anyhow::Result<Decider> {
        trailmark::api::input::check("--why", &self.why, trailmark::api::input::Kind::Reason)?;
        Ok(self.decider())
    }
}

/// Runs one `dlq` subcommand.
pub async fn run(settings: &Settings, command: DlqCommand) -> anyhow::Result<()> {
    // What changes the DLQ is audited: the database is checked before anything is touched.
    let audit = match &command {
        DlqCommand::Requeue { .. } | DlqCommand::Purge { .. } => {
            Some(store::connect(&settings.database).await?)
        }
        _ => None,
    };
    let dlq = Dlq::connect(&settings.broker).await?;
    let result = match command {
        DlqCommand::List { json, limit, after } => list(&dlq, json, &Page { after, limit }).await,
        DlqCommand::Show { id, json } => show(&dlq, &id, json).await,
        DlqCommand::Requeue {
            id,
            all,
            reason,
            who,
        } => {
            let which = selection(id, all, reason);
            let done = requeue(&dlq, &which).await;
            record(audit, who, "dlq.requeue", &which, done).await
        }
        DlqCommand::Purge { id, all, yes, who } => {
            let which = selection(id, all, None);
            let done = purge(&dlq, &which, yes).await;
            record(audit, who, "dlq.purge", &which, done).await
        }
    };
    dlq.close().await;
    result
}

/// Writes the audit row of a requeue or purge that did something, then reports how it went.
async fn record(
    pool: Option<sqlx::PgPool>,
    who: Audited,
    action: &str,
    which: &Selection,
    done: anyhow::Result<Option<Done>>,
) -> anyhow::Result<()> {
    let (Some(pool), Some(done)) = (pool, done?) else {
        return Ok(());
    };
    let target = which.target();
    operator::record_action(&pool, &who.decider(), action, &target, &done.details)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "{action} of {target} was done but not recorded in the audit trail: {e}"
            )
        })?;
    done.outcome
}

fn selection(id: Option<String>, all: bool, reason: Option<String>) -> Selection {
    match (id, all, reason) {
        (Some(id), _, _) => Selection::Id(id),
        (_, _, Some(reason)) => Selection::Reason(reason),
        _ => Selection::All,
    }
}

/// Progress of long passes, on stderr so that stdout stays parseable.
fn progress(taken: u32, depth: u32) {
    eprintln!("dlq: {taken} of {depth} messages looked at");
}

async fn list(dlq: &Dlq, json: bool, page: &Page) -> anyhow::Result<()> {
    let listing = dlq.list(page, &progress).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&listing)?);
        return Ok(());
    }
    print_listing(&listing, page);
    Ok(())
}

fn print_listing(l: &Listing, page: &Page) {
    if l.depth == 0 {
        println!("{} is empty", l.queue);
        return;
    }
    let shown = l.letters.len();
    let from = match page.after {
        Some(_) => "a later page",
        None => "the oldest",
    };
    println!(
        "{}: {} dead letters, oldest first; {from}: {shown}",
        l.queue, l.depth
    );
    let mut table = super::table::new(
        &[
            "id",
            "reason",
            "queue",
            "tries",
            "bytes",
            "failed at",
            "detail",
        ],
        &["tries", "bytes"],
    );
    for d in &l.letters {
        table.add_row(vec![
            d.id.clone(),
            d.reason.clone(),
            d.queue.clone().unwrap_or("-".into()),
            d.deliveries.map(|n| n.to_string()).unwrap_or("-".into()),
            d.body_bytes.to_string(),
            d.failed_at.clone().unwrap_or("-".into()),
            short(d.detail.as_deref().unwrap_or(""), 80),
        ]);
    }
    super::table::print(&table);
    if let Some(next) = &l.next {
        println!(
            "more follow: `trailmark dlq list --limit {} --after {next}`",
            page.limit
        );
    }
    if l.unseen > 0 {
        println!(
            "{} letters were held by another client (a concurrent `dlq` command?) and are not listed: list again when it is done",
            l.unseen
        );
    }
    println!(
        "inspect one with `trailmark dlq show ID`; send back with `trailmark dlq requeue ID | --reason R | --all`"
    );
}

fn short(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_owned(),
    }
}

async fn show(dlq: &Dlq, id: &str, json: bool) -> anyhow::Result<()> {
    let shown = dlq.show(id, &progress).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&shown)?);
        return Ok(());
    }
    print_shown(&shown);
    Ok(())
}

fn print_shown(s: &Shown) {
    let d = &s.letter;
    let opt = |v: &Option<String>| v.clone().unwrap_or("-".into());
    println!("id          {}", d.id);
    let by = match d.by {
        DeadLetteredBy::Worker => "a worker",
        DeadLetteredBy::Broker => "RabbitMQ",
        DeadLetteredBy::Unknown => "unknown",
    };
    println!("reason      {} (dead-lettered by {by})", d.reason);
    println!("detail      {}", opt(&d.detail));
    println!("queue       {}", opt(&d.queue));
    println!(
        "original    exchange {}  routing key {}",
        opt(&d.exchange),
        opt(&d.routing_key)
    );
    println!("failed at   {}", opt(&d.failed_at));
    println!(
        "deliveries  {}  requeued before {}",
        d.deliveries.map(|n| n.to_string()).unwrap_or("-".into()),
        d.requeued
    );
    println!("headers");
    for (k, v) in &s.headers {
        println!("  {k}: {v}");
    }
    match &s.body {
        BodyView::Json { text } => println!("body ({} bytes, JSON)\n{text}", d.body_bytes),
        BodyView::Binary {
            bytes,
            head_hex,
            truncated,
        } => println!(
            "body ({bytes} bytes, not UTF-8 JSON), {}hex: {head_hex}{}",
            if *truncated { "first 64 bytes in " } else { "" },
            if *truncated { " ..." } else { "" }
        ),
    }
}

/// What a requeue or purge did (for the audit trail), and whether all of it went.
struct Done {
    details: serde_json::Value,
    outcome: anyhow::Result<()>,
}

async fn requeue(dlq: &Dlq, which: &Selection) -> anyhow::Result<Option<Done>> {
    let r = dlq.requeue(which, &progress).await?;
    print_requeued(dlq, which, &r);
    let stuck = r.failed.len() + r.no_source_queue.len();
    let outcome = if stuck > 0 {
        Err(anyhow::anyhow!(
            "{stuck} selected dead letters were not requeued (listed above) and are still in {}; fix the cause and run the command again",
            dlq.queue()
        ))
    } else {
        Ok(())
    };
    let details = serde_json::to_value(&r)?;
    Ok(Some(Done { details, outcome }))
}

fn print_requeued(dlq: &Dlq, which: &Selection, r: &Requeued) {
    let targets: Vec<String> = r
        .by_queue
        .iter()
        .map(|(q, n)| format!("{n} to {q}"))
        .collect();
    println!(
        "requeued {} of {} dead letters from {}{}{}",
        r.requeued,
        r.depth,
        dlq.queue(),
        if targets.is_empty() { "" } else { ": " },
        targets.join(", ")
    );
    if r.left > 0 {
        println!("{} not selected, left in the DLQ", r.left);
    }
    if r.unseen > 0 {
        println!(
            "{} held by another client meanwhile and not looked at; run the command again when it is done",
            r.unseen
        );
    }
    if let Selection::Reason(reason) = which
        && r.requeued == 0
        && r.failed.is_empty()
    {
        println!("no dead letter has reason {reason:?}; see the reasons with `trailmark dlq list`");
    }
    for id in &r.no_source_queue {
        eprintln!(
            "not requeued: {id} names no source queue; inspect it with `trailmark dlq show {id}`"
        );
    }
    for f in &r.failed {
        eprintln!("not requeued: {}: {}", f.id, f.why);
    }
}

async fn purge(dlq: &Dlq, which: &Selection, yes: bool) -> anyhow::Result<Option<Done>> {
    let plan = match which {
        Selection::Id(id) => {
            let s = dlq.show(id, &progress).await?;
            describe_one(&s.letter, &dlq.queue())
        }
        _ => match dlq.depth().await? {
            0 => {
                println!("{} is empty; nothing to purge", dlq.queue());
                return Ok(None);
            }
            n => format!("all {n} dead letters in {}", dlq.queue()),
        },
    };
    super::confirm(
        &format!("purge {plan} (they are deleted for good)"),
        "Check what would go with `trailmark dlq list`, ",
        yes,
    )
    .await?;
    let purged = dlq.purge(which, &progress).await?;
    println!("purged {} dead letters from {}", purged.purged, dlq.queue());
    if purged.unseen > 0 {
        println!(
            "{} held by another client meanwhile and not looked at; they are still there",
            purged.unseen
        );
    }
    Ok(Some(Done {
        details: serde_json::to_value(purged)?,
        outcome: Ok(()),
    }))
}

fn describe_one(d: &DeadLetter, queue: &str) -> String {
    format!(
        "dead letter {} in {queue} (reason {}, from {}, {} bytes)",
        d.id,
        d.reason,
        d.queue.as_deref().unwrap_or("an unknown queue"),
        d.body_bytes
    )
}

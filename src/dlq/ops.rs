//! The four operations on the DLQ. Each is one pass (see [`super::scan`]).

use std::collections::BTreeMap;

use lapin::message::Delivery;
use serde::Serialize;
use serde_json::Value;

use super::letter::{BodyView, DeadLetter, headers_json, requeue_headers};
use super::page::{self, Page};
use super::scan::Scan;
use super::{Dlq, Error, Progress, Result, Selection};
use crate::broker::{Outgoing, Publisher};

/// Messages published per round of confirms during a requeue.
const BATCH: usize = 100;

/// What `list` found.
#[derive(Debug, Clone, Serialize)]
pub struct Listing {
    /// The DLQ.
    pub queue: String,
    /// Messages in it when the listing began.
    pub depth: u32,
    /// Every letter read, counted by reason code (not just the page's).
    pub by_reason: BTreeMap<String, u32>,
    /// The page asked for, oldest first (by time of death, then id).
    pub letters: Vec<DeadLetter>,
    /// Pass as the next page's `after` to go on; absent on the last page.
    pub next: Option<String>,
    /// Messages another client was holding during the pass (not listed, still in the DLQ).
    pub unseen: u32,
}

/// What a requeue or purge would touch (see [`Dlq::count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Count {
    /// Letters selected.
    pub selected: u32,
    /// Messages in the DLQ.
    pub depth: u32,
}

/// One dead letter in full.
#[derive(Debug, Clone, Serialize)]
pub struct Shown {
    /// The summary `list` shows.
    #[serde(flatten)]
    pub letter: DeadLetter,
    /// Every header, `x-death` included.
    pub headers: BTreeMap<String, Value>,
    /// The body as text when it is UTF-8 JSON, otherwise its size and first bytes.
    pub body: BodyView,
}

/// One message a requeue could not send back.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    /// The message.
    pub id: String,
    /// What went wrong; the message is still in the DLQ.
    pub why: String,
}

/// What `requeue` did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Requeued {
    /// Messages in the DLQ when the pass began.
    pub depth: u32,
    /// Messages sent back and removed from the DLQ.
    pub requeued: u32,
    /// Of those, how many went to each queue.
    pub by_queue: BTreeMap<String, u32>,
    /// Selected messages that name no source queue (still in the DLQ).
    pub no_source_queue: Vec<String>,
    /// Selected messages whose publish or ack failed (still in the DLQ).
    pub failed: Vec<Failure>,
    /// Messages not selected, left in the DLQ.
    pub left: u32,
    /// Messages another client was holding during the pass (not looked at, still in the DLQ).
    pub unseen: u32,
}

/// What `purge` did.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Purged {
    /// Messages deleted.
    pub purged: u32,
    /// Messages not selected, left in the DLQ.
    pub left: u32,
    /// Messages another client was holding during the pass (not looked at, still in the DLQ).
    pub unseen: u32,
}

impl Dlq {
    fn letter(&self, d: &Delivery) -> DeadLetter {
        DeadLetter::read(
            d.properties.message_id().as_ref().map(|m| m.as_str()),
            d.properties.headers().as_ref(),
            d.routing_key.as_str(),
            &d.data,
            self.delivery_limit,
        )
    }

    /// One page of the dead letters in a stable oldest-first order (see [`super::page`]).
    /// Nothing is removed: the pass reads the whole DLQ and hands every message back together.
    pub async fn list(&self, page: &Page, progress: Progress<'_>) -> Result<Listing> {
        let scan = Scan::open(&self.conn, &self.queue(), progress).await?;
        self.read(scan, page).await
    }

    /// The letters counted by reason (none listed), or only the depth when more than `up_to`
    /// letters are in the DLQ: a summary cheap enough for every visit of a page. The depth is
    /// read once, by the pass itself.
    pub async fn grouped(&self, up_to: u32) -> Result<Listing> {
        let scan = Scan::open(&self.conn, &self.queue(), &super::quiet).await?;
        let depth = scan.depth();
        if depth <= up_to {
            return self.read(scan, &Page::first(0)).await;
        }
        scan.finish().await;
        Ok(Listing {
            queue: self.queue(),
            depth,
            by_reason: BTreeMap::new(),
            letters: Vec::new(),
            next: None,
            unseen: 0,
        })
    }

    /// How many letters `which` selects, and the DLQ's depth: what a requeue or purge would
    /// touch. `All` is the depth, read without taking a letter; otherwise one pass counts.
    pub async fn count(&self, which: &Selection) -> Result<Count> {
        if *which == Selection::All {
            let depth = self.depth().await?;
            return Ok(Count {
                selected: depth,
                depth,
            });
        }
        let mut scan = Scan::open(&self.conn, &self.queue(), &super::quiet).await?;
        let mut selected = 0;
        let taken = async {
            while let Some(d) = scan.next().await? {
                selected += u32::from(which.matches(&self.letter(&d)));
            }
            Ok::<_, Error>(())
        }
        .await;
        let depth = scan.depth();
        scan.finish().await;
        taken?;
        Ok(Count { selected, depth })
    }

    /// Reads every letter of an open pass, hands them all back, and cuts `page` from them.
    async fn read(&self, mut scan: Scan<'_>, page: &Page) -> Result<Listing> {
        let mut letters = Vec::new();
        let taken = async {
            while let Some(d) = scan.next().await? {
                letters.push(self.letter(&d));
            }
            Ok::<_, Error>(())
        }
        .await;
        let (depth, unseen) = (scan.depth(), scan.unseen());
        scan.finish().await;
        taken?;
        let mut by_reason = BTreeMap::new();
        for letter in &letters {
            *by_reason.entry(letter.reason.clone()).or_default() += 1;
        }
        let (letters, next) = page::cut(letters, page);
        Ok(Listing {
            queue: self.queue(),
            depth,
            by_reason,
            letters,
            next: next.map(|c| c.to_string()),
            unseen,
        })
    }

    /// The first dead letter with this id, headers and body included; nothing is removed.
    pub async fn show(&self, id: &str, progress: Progress<'_>) -> Result<Shown> {
        let mut scan = Scan::open(&self.conn, &self.queue(), progress).await?;
        let found = async {
            while let Some(d) = scan.next().await? {
                let letter = self.letter(&d);
                if letter.id == id {
                    return Ok(Some(Shown {
                        letter,
                        headers: headers_json(d.properties.headers().as_ref()),
                        body: BodyView::of(&d.data),
                    }));
                }
            }
            Ok::<_, Error>(None)
        }
        .await;
        let unseen = scan.unseen();
        scan.finish().await;
        found?.ok_or_else(|| self.not_found(id, unseen))
    }

    /// Sends the selected dead letters back to the queues they died in, through the normal
    /// pipeline. Each DLQ copy is acked only after its publish is confirmed.
    pub async fn requeue(&self, which: &Selection, progress: Progress<'_>) -> Result<Requeued> {
        let publisher = Publisher::open(&self.conn, self.confirm_timeout).await?;
        let mut scan = Scan::open(&self.conn, &self.queue(), progress).await?;
        let mut report = Requeued {
            depth: scan.depth(),
            ..Default::default()
        };
        let done = async {
            let mut batch = Vec::new();
            while let Some(d) = scan.next().await? {
                let letter = self.letter(&d);
                if !which.matches(&letter) {
                    report.left += 1;
                    continue;
                }
                batch.push((letter, d));
                if batch.len() >= BATCH {
                    self.send_back(&publisher, &mut scan, &mut batch, &mut report)
                        .await;
                }
            }
            self.send_back(&publisher, &mut scan, &mut batch, &mut report)
                .await;
            Ok::<_, Error>(())
        }
        .await;
        let unseen = scan.unseen();
        report.unseen = unseen;
        scan.finish().await;
        let _ = publisher.channel().close(200, "requeue done".into()).await;
        done?;
        if let Selection::Id(id) = which
            && report.requeued == 0
            && report.failed.is_empty()
        {
            return Err(match report.no_source_queue.is_empty() {
                true => self.not_found(id, unseen),
                false => Error::NoSourceQueue { id: id.clone() },
            });
        }
        Ok(report)
    }

    /// Publishes a batch with pipelined confirms, then acks the DLQ copy of each confirmed one.
    /// Everything not acked here returns to the DLQ when the pass ends.
    async fn send_back(
        &self,
        publisher: &Publisher,
        scan: &mut Scan<'_>,
        batch: &mut Vec<(DeadLetter, Delivery)>,
        report: &mut Requeued,
    ) {
        let mut sending = Vec::with_capacity(batch.len());
        let mut outgoing = Vec::with_capacity(batch.len());
        for (letter, mut d) in batch.drain(..) {
            let Some(queue) = letter.queue.clone().filter(|q| *q != self.queue()) else {
                report.no_source_queue.push(letter.id);
                continue;
            };
            outgoing.push(Outgoing {
                message_id: letter.id.clone(),
                exchange: String::new(),
                routing_key: queue.clone(),
                headers: requeue_headers(d.properties.headers().as_ref(), letter.requeued),
                body: std::mem::take(&mut d.data),
            });
            sending.push((letter.id, queue, d));
        }
        let confirms = publisher.publish_all(&outgoing).await;
        for ((id, queue, d), confirm) in sending.into_iter().zip(confirms) {
            if let Err(e) = confirm {
                let why = format!("not requeued to {queue}: {e}; it stays in the DLQ");
                report.failed.push(Failure { id, why });
                continue;
            }
            match scan.ack(&d).await {
                Ok(_) => {
                    report.requeued += 1;
                    *report.by_queue.entry(queue).or_default() += 1;
                }
                Err(e) => report.failed.push(Failure {
                    id,
                    why: format!(
                        "requeued to {queue}, but its DLQ copy could not be removed ({e}); \
                         it stays in the DLQ too, and requeuing it again is harmless (the inbox drops repeats)"
                    ),
                }),
            }
        }
    }

    /// Deletes the selected dead letters for good: at most the messages that were in the DLQ
    /// when the pass began, whatever arrives meanwhile.
    pub async fn purge(&self, which: &Selection, progress: Progress<'_>) -> Result<Purged> {
        let mut scan = Scan::open(&self.conn, &self.queue(), progress).await?;
        let mut report = Purged::default();
        let done = async {
            while let Some(d) = scan.next().await? {
                if which.matches(&self.letter(&d)) {
                    scan.ack(&d).await?;
                    report.purged += 1;
                } else {
                    report.left += 1;
                }
            }
            Ok::<_, Error>(())
        }
        .await;
        let unseen = scan.unseen();
        report.unseen = unseen;
        scan.finish().await;
        done?;
        match which {
            Selection::Id(id) if report.purged == 0 => Err(self.not_found(id, unseen)),
            _ => Ok(report),
        }
    }

    fn not_found(&self, id: &str, unseen: u32) -> Error {
        Error::NotFound {
            id: id.to_owned(),
            queue: self.queue(),
            unseen,
        }
    }
}

//! Line-item extraction by the model: the prompt the workflow sends, the answer format it
//! expects, and the stand-in model's deterministic answer (it reads the scan the way a model
//! would, so replays can be checked word for word and calls can be counted).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use trailmark::model::{ChatMessage, ChatRequest};
use trailmark_standin::model_server::Responder;

/// The instruction that opens every extraction request; the stand-in recognises it.
pub const INSTRUCTION: &str = "Extract the line items of this supplier invoice. Answer with JSON only: \
{\"invoice_no\": string, \"lines\": [{\"line\": n, \"sku\": string, \"qty\": n, \"unit_price_cents\": n}]}";

/// What the model answers for one invoice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extracted {
    /// The invoice number read from the scan.
    pub invoice_no: String,
    /// The lines read from the scan.
    pub lines: Vec<ExtractedLine>,
}

/// One line as the model read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtractedLine {
    /// Line number.
    pub line: i32,
    /// Article.
    pub sku: String,
    /// Units billed.
    pub qty: i32,
    /// Price billed per unit, in cents.
    pub unit_price_cents: i64,
}

/// The request for one scanned invoice; the same scan always gives the same request.
pub fn request(scan_text: &str) -> ChatRequest {
    ChatRequest {
        messages: vec![
            ChatMessage::system(INSTRUCTION),
            ChatMessage::user(scan_text),
        ],
        max_tokens: Some(400),
        temperature: Some(0.0),
    }
}

/// Reads a model answer, saying what is wrong with it when it is not the expected JSON.
pub fn parse_answer(content: &str) -> Result<Extracted, String> {
    serde_json::from_str(content.trim()).map_err(|e| {
        let start: String = content.chars().take(40).collect();
        format!("the answer is not line-item JSON ({e}); it starts with {start:?}")
    })
}

/// The stand-in model's answer source: extraction requests get the scan's line items as JSON,
/// anything else falls through to the server's default answer.
pub fn responder() -> Responder {
    Arc::new(|req: &ChatRequest| {
        let is_extraction = req
            .messages
            .first()
            .is_some_and(|m| m.content == INSTRUCTION);
        let scan = req.messages.get(1).filter(|_| is_extraction)?;
        Some(
            serde_json::to_string(&read_scan(&scan.content)).expect("extraction answers serialise"),
        )
    })
}

/// Reads a scan as the stand-in model does: the `INVOICE` header and every `Line` row.
fn read_scan(text: &str) -> Extracted {
    let mut out = Extracted {
        invoice_no: String::new(),
        lines: Vec::new(),
    };
    for row in text.lines().map(str::trim) {
        if let Some(no) = row.strip_prefix("INVOICE ") {
            out.invoice_no = no.trim().to_owned();
        } else if let Some(line) = row.strip_prefix("Line ").and_then(read_line) {
            out.lines.push(line);
        }
    }
    out
}

/// `3: SKU-0042 qty 12 @ 4.50 EUR`
fn read_line(rest: &str) -> Option<ExtractedLine> {
    let (no, rest) = rest.split_once(':')?;
    let words: Vec<&str> = rest.split_whitespace().collect();
    let [sku, "qty", qty, "@", price, ..] = words.as_slice() else {
        return None;
    };
    let (whole, frac) = price.split_once('.').unwrap_or((price, "0"));
    let cents = whole.parse::<i64>().ok()? * 100 + frac.parse::<i64>().ok()?;
    Some(ExtractedLine {
        line: no.trim().parse().ok()?,
        sku: (*sku).to_owned(),
        qty: qty.parse().ok()?,
        unit_price_cents: cents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::world;
    use crate::invoices::scan;
    use crate::night::{Night, parse_date};

    #[test]
    fn the_stand_in_reads_every_scan_back_to_its_billed_lines() {
        let night = Night::new(parse_date("2026-10-13").unwrap());
        let respond = responder();
        for inv in world(&night).invoices.iter().take(50) {
            let answer = respond(&request(&scan(inv).text)).expect("an extraction answer");
            let got = parse_answer(&answer).unwrap();
            assert_eq!(got.invoice_no, inv.invoice_no);
            let billed: Vec<(i32, i32, i64)> = inv
                .lines
                .iter()
                .map(|l| (l.line as i32, l.qty as i32, l.unit_price_cents))
                .collect();
            let read: Vec<(i32, i32, i64)> = got
                .lines
                .iter()
                .map(|l| (l.line, l.qty, l.unit_price_cents))
                .collect();
            assert_eq!(read, billed);
        }
    }

    #[test]
    fn other_requests_fall_through_and_bad_answers_are_described() {
        let other = ChatRequest::new(vec![ChatMessage::user("hello")]);
        assert!(responder()(&other).is_none());
        assert!(
            parse_answer("stand-in answer 0123")
                .unwrap_err()
                .contains("stand-in answer")
        );
    }
}

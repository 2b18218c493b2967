//! The offline model: when no model is configured (`model.base_url` empty), steps record a
//! deterministic answer computed here instead of calling out. It keeps the quickstart, smoke
//! tests and drills free of any model server and bill, and the answer depends only on the
//! request, so a replayed step can be checked word for word against its journal entry.

use std::time::Instant;

use sha2::{Digest, Sha256};

use super::{ChatAnswer, ChatRequest, estimate_tokens};

/// Text that pads answers to the requested size; fixed, so answers stay deterministic.
const FILLER: &str =
    " lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor";

/// Size of the offline answer the engine records.
pub const ANSWER_BYTES: usize = 64;

/// The deterministic answer: `stand-in answer <16 hex of sha256(messages JSON)>`, padded to
/// `answer_bytes` (servers that stand in for a model answer the same way).
pub fn answer(req: &ChatRequest, answer_bytes: usize) -> String {
    // Serializing plain strings cannot fail; an empty digest input would still be deterministic.
    let json = serde_json::to_vec(&req.messages).unwrap_or_default();
    let digest = hex::encode(Sha256::digest(&json));
    let mut text = format!("stand-in answer {}", &digest[..16]);
    while text.len() < answer_bytes {
        let room = answer_bytes - text.len();
        // FILLER is ASCII, so any byte index is a char boundary.
        text.push_str(&FILLER[..room.min(FILLER.len())]);
    }
    text
}

/// The offline answer as a chat answer, with estimated tokens and no cost.
pub fn chat(req: &ChatRequest, answer_bytes: usize) -> ChatAnswer {
    let started = Instant::now();
    let content = answer(req, answer_bytes);
    ChatAnswer {
        completion_tokens: estimate_tokens(&content),
        prompt_tokens: req.estimated_prompt_tokens(),
        content,
        model: "stand-in".into(),
        cost: 0.0,
        latency_ms: started.elapsed().as_millis() as u64,
    }
}

//! The attempts whose endpoint may call back now: one token each, made when the call goes out
//! and forgotten when the attempt ends (answered, timed out, dropped with its step), so a
//! callback of an ended or forged attempt finds nothing to act on.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, OnceLock};

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

/// The process's open attempts, and the URL their endpoints call back on. One per process: a
/// callback is routed by its token alone, whichever engine made the call.
pub static HUB: LazyLock<Hub> = LazyLock::new(Hub::default);

/// Open attempts by token.
#[derive(Default)]
pub struct Hub {
    open: Mutex<HashMap<String, Slot>>,
    base: OnceLock<String>,
}

struct Slot {
    fence: i64,
    next_call: u64,
    secret: Arc<[u8]>,
    to_step: mpsc::Sender<Callback>,
    /// Why a callback of this attempt was refused, if one was: the attempt is then void.
    refused: Option<String>,
}

/// One callback handed to the attempt's step, which answers it through `reply`.
pub struct Callback {
    /// The op (`model`, `effect/begin`, ...).
    pub op: String,
    /// Its body, without `fence` and `call`.
    pub body: Value,
    /// Where the step's answer goes.
    pub reply: oneshot::Sender<Reply>,
}

/// What a callback is answered.
#[derive(Debug)]
pub enum Reply {
    /// 200 with this body.
    Done(Value),
    /// Refused: HTTP status, code, message.
    Refused(u16, &'static str, String),
}

/// Why a callback is not handed to its step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No open attempt has this token.
    UnknownAttempt,
    /// The fence is not the attempt's.
    FencedOut { sent: i64, attempt: i64 },
    /// The call number is not the next one.
    OutOfOrder { sent: u64, expected: u64 },
}

/// An open attempt's token, forgotten when this is dropped.
pub struct Open {
    /// The token the endpoint calls back with.
    pub token: String,
}

impl Drop for Open {
    fn drop(&mut self) {
        HUB.open.lock().expect("hub lock").remove(&self.token);
    }
}

impl Hub {
    /// Sets the URL endpoints call back on (once per process).
    pub fn set_base(&self, url: String) {
        let _ = self.base.set(url);
    }

    /// The URL endpoints call back on, if the listener runs.
    pub fn base(&self) -> Option<&str> {
        self.base.get().map(String::as_str)
    }

    /// Opens an attempt fenced by `fence`; its callbacks arrive on the receiver.
    pub fn open(&self, fence: i64, secret: Arc<[u8]>) -> (Open, mpsc::Receiver<Callback>) {
        // 244 random bits (two v4 uuids), as the API's own tokens are made.
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        // Callbacks of one attempt are served one at a time: one waiting is enough.
        let (to_step, from_endpoint) = mpsc::channel(1);
        let slot = Slot {
            fence,
            next_call: 1,
            secret,
            to_step,
            refused: None,
        };
        self.open
            .lock()
            .expect("hub lock")
            .insert(token.clone(), slot);
        (Open { token }, from_endpoint)
    }

    /// The secret that signs the attempt's callbacks.
    pub fn secret(&self, token: &str) -> Result<Arc<[u8]>, Refusal> {
        let open = self.open.lock().expect("hub lock");
        let slot = open.get(token).ok_or(Refusal::UnknownAttempt)?;
        Ok(slot.secret.clone())
    }

    /// Records that a callback of the attempt was refused (`why`): whatever the endpoint then
    /// answers, the attempt is void, since the refused callback's work is missing from it.
    pub fn refuse(&self, token: &str, why: String) {
        if let Some(slot) = self.open.lock().expect("hub lock").get_mut(token) {
            slot.refused.get_or_insert(why);
        }
    }

    /// Why a callback of the attempt was refused, if one was.
    pub fn refusal(&self, token: &str) -> Option<String> {
        let open = self.open.lock().expect("hub lock");
        open.get(token).and_then(|slot| slot.refused.clone())
    }

    /// Admits callback number `call` with `fence` to the attempt: the next number, the
    /// attempt's fence. A refused one does not advance the count.
    pub fn admit(
        &self,
        token: &str,
        fence: i64,
        call: u64,
    ) -> Result<mpsc::Sender<Callback>, Refusal> {
        let mut open = self.open.lock().expect("hub lock");
        let slot = open.get_mut(token).ok_or(Refusal::UnknownAttempt)?;
        let refused = |slot: &mut Slot, why: &str| {
            slot.refused.get_or_insert_with(|| why.to_owned());
        };
        if fence != slot.fence {
            refused(slot, "fenced_out");
            return Err(Refusal::FencedOut {
                sent: fence,
                attempt: slot.fence,
            });
        }
        if call != slot.next_call {
            refused(slot, "out_of_order");
            return Err(Refusal::OutOfOrder {
                sent: call,
                expected: slot.next_call,
            });
        }
        slot.next_call += 1;
        Ok(slot.to_step.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_next_call_of_an_open_attempt_with_its_fence_is_admitted() {
        let (open, _rx) = HUB.open(7, Arc::from(&b"s"[..]));
        assert!(HUB.admit(&open.token, 7, 1).is_ok());
        assert_eq!(
            HUB.admit(&open.token, 7, 1).err(),
            Some(Refusal::OutOfOrder {
                sent: 1,
                expected: 2
            })
        );
        assert_eq!(
            HUB.admit(&open.token, 6, 2).err(),
            Some(Refusal::FencedOut {
                sent: 6,
                attempt: 7
            })
        );
        assert!(HUB.admit(&open.token, 7, 2).is_ok());
        let token = open.token.clone();
        drop(open);
        assert_eq!(HUB.admit(&token, 7, 3).err(), Some(Refusal::UnknownAttempt));
        assert_eq!(
            HUB.admit("forged", 7, 1).err(),
            Some(Refusal::UnknownAttempt)
        );
    }
}

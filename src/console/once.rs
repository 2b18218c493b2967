//! A form that acts on many things (an undo, a requeue, a purge) acts once, however often it is
//! sent (a double-click, a reload): each such form carries a fresh key, kept with the API's
//! `Idempotency-Key`s. A repeat of a finished form goes where the first went; a repeat while the
//! first still runs is refused; a form that failed may be sent again.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use sha2::{Digest, Sha256};

use super::{ConsoleState, Shown};
use crate::store::idempotency::{self, Begun};

/// A taken form key.
pub(super) struct Once {
    key: String,
    replay: Option<String>,
}

impl Once {
    /// Takes `form_key` for a form whose content is `fingerprint`.
    pub async fn take(
        state: &ConsoleState,
        form_key: &str,
        fingerprint: &str,
    ) -> Result<Self, Shown> {
        if form_key.is_empty() || form_key.len() > 100 {
            return Err(Shown::bad_request(
                "this form carries no form key; reload the page and send it again",
            ));
        }
        let key = format!("console:{form_key}");
        let hash = hex::encode(Sha256::digest(fingerprint.as_bytes()));
        let mut conn = state.engine.pool.acquire().await.map_err(Shown::store)?;
        match idempotency::begin(&mut conn, &key, &hash).await? {
            Begun::Run => Ok(Self { key, replay: None }),
            Begun::Replay { body, .. } => Ok(Self {
                key,
                replay: Some(String::from_utf8_lossy(&body).into_owned()),
            }),
            Begun::InProgress => Err(Shown::new(
                StatusCode::CONFLICT,
                "Already being done",
                "this form was already sent and is still being carried out; wait a moment, then reload",
            )),
            Begun::Mismatch => Err(Shown::bad_request(
                "this form's key was used for another form; reload the page and send it again",
            )),
        }
    }

    /// Where the first sending of this form went, if it finished.
    pub fn replay(&self) -> Option<Response> {
        self.replay
            .as_deref()
            .map(|to| Redirect::to(to).into_response())
    }

    /// Keeps where the form went (a redirect), or lets the key go when it did not succeed.
    pub fn keep<'a>(
        self,
        state: &'a ConsoleState,
        response: &Response,
    ) -> impl Future<Output = Result<(), Shown>> + Send + 'a {
        // Read now, not in the future: a response body is not `Sync`, so a borrow of it must not
        // live across an await.
        let went = response
            .headers()
            .get(header::LOCATION)
            .and_then(|l| l.to_str().ok())
            .filter(|_| response.status().is_redirection())
            .map(|to| (response.status().as_u16(), to.to_owned()));
        self.settle(state, went)
    }

    async fn settle(self, state: &ConsoleState, went: Option<(u16, String)>) -> Result<(), Shown> {
        let pool = &state.engine.pool;
        match went {
            Some((status, to)) => {
                idempotency::finish(pool, &self.key, status, to.as_bytes()).await?
            }
            None => idempotency::release(pool, &self.key).await?,
        }
        Ok(())
    }
}
